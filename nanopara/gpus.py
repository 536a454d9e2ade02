"""The planner's GPU table: what one GPU, its node and the fabric between nodes do, each number with its source.

A GPU entry holds microbenchmark numbers only: GEMM TFLOP/s by shape class (bf16, fp8), the attention kernel's
fwd+bwd TFLOP/s, memory-bound GB/s, host microseconds per launch and per transformer block (a tiny model whose GPU
work is negligible, so the time is the host's), NCCL collectives and p2p by size, plus spec figures (memory, peak
FLOP/s). The entries below are seeded from the kernel and comm benchmarks already in results/ and from published
specs, each marked by `SOURCES`; H200 takes the first bench_calibrate table (results/calibrate_gpus_h200.json) but
for what `ADOPTED` leaves out, H100 what of it is NCCL's or the code's (`SHARED`: collectives, host syncs); where
results/plan_gpus_<gpu>.json exists (bench_calibrate.py's output) its numbers replace the seeds. Also the MoE
expert MLP's rate by rows an expert and FP8's modes (results/moe_h100.txt, fp8_h100.txt). Nothing here is fitted
to the end-to-end rows the planner is checked against (plan_check.py).

Collectives: the time of a measured (kind, group size) is interpolated in log(bytes) between measured sizes
(linear in bytes to the latency floor below the smallest); other group sizes convert through the ring's bus
factor (all-reduce 2(n-1)/n, reduce-scatter / all-gather / all-to-all (n-1)/n); the other collectives are the
all-reduce at the nearest measured group size (comm_4.json's at 4) x their measured share of an all-reduce of the
same bytes where both were measured (2 GPUs: all-gather 0.64-0.67 at 48-64 MiB, not the 0.5 of equal bus bandwidth;
results/tp.txt's 4-GPU SP steps: 0.95 / 0.82 for all-gather / reduce-scatter). A group that spans nodes is
hierarchical: its k members in a node run the intra-node part, the m = n/k nodes exchange S/k bytes a GPU over
each GPU's own NIC (`FABRIC`). Callers: nanopara/planner.py, plan_search.py, plan.py.
"""
from __future__ import annotations

import copy
import glob
import json
import math
import os
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEMM_CLASSES = (("xs", 512), ("s", 1536), ("m", 3072), ("l", 6144), ("xl", 1 << 62))  # by min(M, N, K) <
MiB = 2 ** 20

# Inter-node fabric, fixed from published figures before any comparison (notes/planner.md): an HGX/DGX H100 node
# has 8 GPUs on NVSwitch and one 400 Gb/s NIC a GPU (ConnectX-7 NDR or RoCE: 50 GB/s a direction; Meta's Llama 3
# clusters: RoCE 400 Gb/s a GPU); NCCL reaches ~90 % of the link on large messages (nccl-tests), ~10 us latency.
FABRIC = {"gpus_per_node": 8, "nic_gbs": 50.0 * 0.9, "latency_us": 10.0}


def gemm_class(m: int, n: int, k: int) -> str:
    d = min(m, n, k)
    return next(c for c, edge in GEMM_CLASSES if d < edge)


def grouped_tflops(gpu, rows_per_expert: float) -> float:
    """The MoE expert MLP's fwd + bwd TFLOP/s at this many rows an expert: log-log between the measured points,
    their slope beyond them (fewer rows an expert: fewer, emptier tiles)."""
    (r0, t0), (r1, t1) = sorted(gpu.grouped_mlp)[:1] + sorted(gpu.grouped_mlp)[-1:]
    if r1 == r0:
        return t0
    return t0 * (max(rows_per_expert, 1.0) / r0) ** (math.log(t1 / t0) / math.log(r1 / r0))


def fp8_linear_speedup(gpu, mode: str, K: float, N: float) -> tuple | None:
    """(x, x with the weight cast each call) of an FP8 `mode` Linear K -> N over bf16, fwd + bwd, graphed: linear
    in log(K N / (K + N)) between the measured shapes; below the smallest, the first two's slope (smaller shapes
    gain less, then lose: floored at 0.25); above the largest, flat. None where the table has no such mode."""
    pts = sorted(gpu.fp8_linear.get(mode) or [])
    if not pts:
        return None
    kn = K * N / (K + N)
    if kn < pts[0][0] and len(pts) > 1:
        lo, hi = pts[0], pts[1]
    else:
        lo = max([p for p in pts if p[0] <= kn] or pts[:1], key=lambda p: p[0])
        hi = min([p for p in pts if p[0] >= kn] or pts[-1:], key=lambda p: p[0])
    w = 0.0 if hi[0] == lo[0] else math.log(kn / lo[0]) / math.log(hi[0] / lo[0])
    return tuple(max(a + w * (b - a), 0.25) for a, b in zip(lo[1:], hi[1:]))


def attention_tflops(gpu, head_dim: int, T: int) -> float:
    """Our attention's fwd + bwd TFLOP/s for head dim `head_dim` at sequence length T: log-log in T between the
    in-step points (the model's call, from step profiles; the table's "128_long" at 16,384 where they stop below
    it), clamped at the ends; the table's key where no in-step point exists for that head dim."""
    key = "64" if head_dim < 128 else "128"
    pts = sorted(gpu.attention_in_step.get(key, []))
    if not pts:
        return gpu.attention_tflops["128_long" if key == "128" and T >= 16384 else key]
    if key == "128" and pts[-1][0] < 16384 and gpu.attention_tflops.get("128_long"):
        pts.append([16384, gpu.attention_tflops["128_long"]])
    if T <= pts[0][0]:
        return pts[0][1]
    for (t0, r0), (t1, r1) in zip(pts, pts[1:]):
        if T <= t1:
            return r0 * (r1 / r0) ** (math.log(T / t0) / math.log(t1 / t0))
    return pts[-1][1]


@dataclass
class GPU:
    name: str
    mem_gb: float                 # torch's total_memory, 1e9 bytes
    peak_bf16: float              # dense tensor-core FLOP/s (MFU's denominator, report.PEAK_FLOPS)
    peak_fp8: float
    gemm_tflops: dict             # {"bf16": {class: TFLOP/s}, "fp8": {...}}
    attention_tflops: dict        # {"64": .., "128": .., "128_long": ..} ours, fwd+bwd, causal FLOPs
    membw_gbs: dict               # {"copy": .., "elementwise": ..}
    host: dict                    # {"launch_us", "layer_us": {variant: us}, "step_us": {variant: us}}
    comm: dict                    # {"n": {kind: [[bytes, seconds], ...]}}, measured within one node
    host_wait_share: float = 0.0  # share of queued GPU work an eager collective makes the host wait for
    p2p_host_wait_share: float = 0.0  # the same for a send/recv pair (pipeline, ring attention)
    latency_us: float = 15.0      # a collective's floor within a node
    grouped_mlp: list = field(default_factory=list)  # [[rows per expert, TFLOP/s]]: MoE expert MLP fwd + bwd
    fp8_modes: dict = field(default_factory=dict)    # {mode: (GEMM rate / tensorwise, ps a quantized element)}
    attention_in_step: dict = field(default_factory=dict)  # {head dim: [[T, TFLOP/s]]}: our attention as the model
    #                                                        calls it (packed-qkv views), from step profiles
    fp8_linear: dict = field(default_factory=dict)   # {mode: [[K N / (K + N), x, x cast each call]]}: FP8Linear
    #                                                   fwd + bwd over bf16's, graphed, M = 8192 (fp8_linear_speedup)
    adamw_share: float = 0.83     # torch's fused AdamW (the engines' optimizer) against copy bandwidth
    adamw_flat_share: float = 0.98  # kernels/adamw.py's one launch (train.optimizer=flat) against copy bandwidth
    sources: dict = field(default_factory=dict)


_AR2 = [[32 * MiB, 0.1385e-3], [256 * MiB, 0.9036e-3], [1024 * MiB, 3.278e-3]]   # results/comm_2.json (H200)
_AR4 = [[32 * MiB, 0.1820e-3], [256 * MiB, 1.2040e-3], [1024 * MiB, 4.530e-3]]   # results/comm_4.json (H200)


def _derived(ar: list, n: int) -> dict:
    """Seed rows for the other collectives from the measured all-reduce: the same bus bandwidth at each size,
    so reduce-scatter / all-gather / all-to-all take (n-1)/n where all-reduce takes 2(n-1)/n; a send/recv pair
    moves S each way at that bus bandwidth. Replaced by bench_calibrate's own rows."""
    half = [[s, t / 2] for s, t in ar]
    pair = [[s, t * n / (2 * (n - 1))] for s, t in ar]
    return {"all_reduce": ar, "reduce_scatter": half, "all_gather": half, "all_to_all": half, "send_recv": pair}


# Host variants known as a ratio to the dense block (a CPU proxy's, where the real host's us are not measured): ZB-H1's
# split backward, F + B + W against 1F1B's F + backward for the same 12 blocks, 7.7 against 6.2 ms (bench/host_zb.py,
# notes/pp.md; one W node per 4 Linears, the code since 9fd2303)
HOST_RATIOS = {"zb": 7.7 / 6.2}
_HOST = {  # us; the seeds' derivation is in SOURCES["host"]
    "launch_us": 9.0,
    "layer_us": {"torch_kernels": 1470.0, "dense": 1950.0, "ac_full": 2325.0, "ac_selective": 2100.0,
                 "fp8_tensor": 2350.0, "moe": 2550.0, "tp2": 2050.0, "tp2_sp": 2200.0, "dp2": 2030.0,
                 "zero3": 2500.0, "zb": 1950.0 * HOST_RATIOS["zb"], "cp2": 2100.0},  # pp: none measured (= dense)
    "step_us": {"dense": 1500.0}}

_H100 = GPU(
    name="H100", mem_gb=85.03, peak_bf16=989e12, peak_fp8=1979e12,
    gemm_tflops={"bf16": {"xs": 450.0, "s": 650.0, "m": 724.0, "l": 735.0, "xl": 741.0},
                 "fp8": {"xs": 540.0, "s": 900.0, "m": 1088.0, "l": 1200.0, "xl": 1299.0}},
    attention_tflops={"64": 256.0, "128": 397.0, "128_long": 397.0, "cudnn_128": 464.0, "sdpa_64": 154.0,
                      "sdpa_128": 265.0},
    membw_gbs={"copy": 3001.0, "elementwise": 0.8 * 3001.0},
    host=copy.deepcopy(_HOST), comm={"2": _derived(_AR2, 2), "4": {"all_reduce": _AR4}},
    # results/moe_h100.txt section 4, "GEMMs only": grouped_mlp_triton fwd + bwd (both expert GEMMs, bias + GELU
    # epilogues, bias gradients) on dropless routing's sorted rows, E = 8, C = 768: 32,768 rows 3.276 ms, 65,536 6.149
    grouped_mlp=[[4096.0, 283.2], [8192.0, 301.8]],
    # results/fp8_h100.txt, gpt_1b's four Linear shapes (class m), our kernels: GEMM TFLOP/s tensor 1088 (mean of
    # 1254 / 447 / 1257 / 1393), row 1202, block 780; quantization of an activation and its transpose for one fwd +
    # bwd, per element (8192 x 2048): tensor X (+X^T) 50.2 us, row X rows 23.7 + X cols 71.3, block X 1x128 (+X^T) 65.7
    fp8_modes={"tensor": (1.0, 50.2e6 / 16777216), "row": (1202 / 1088, 95.0e6 / 16777216),
               "block": (780 / 1088, 65.7e6 / 16777216)},
    # the attention kernels' CUPTI time in one-GPU step profiles (fwd + bwd, causal FLOPs): gpt_1b (D128, 8 x 16
    # heads, T 1024) 9.21 / 9.20 ms a micro-step (results/tp2_graph_gpt_1b_h100.jsonl), 8.76 (fp8_e2e_h100.txt's
    # profile), 38.55 / 4 (ckpt_async_profile_h100.txt): 235 TFLOP/s, where attention.txt's contiguous (B, H, T, D)
    # rows at T 4096 give 397; at T 16384 629.4 / 640.3 ms for 4 micro-steps (cp2_16k_h100_2.jsonl's 1-GPU rows):
    # 436. gpt2_moe (D64, 8 x 12 heads, T 1024): 2.29 / 2.33 ms a step (moe_step_profile_h100.jsonl): 236
    attention_in_step={"128": [[1024, 235.0], [16384, 436.0]], "64": [[1024, 236.0]]},
    # FP8Linear fwd + bwd over bf16, each side one CUDA graph, M = 8192, at gpt_1b's and gpt_3b's shapes (the two at
    # one K N / (K + N) averaged): the Gluon GEMMs, current scaling (fp8_linear_graph_h100.jsonl)
    fp8_linear={"tensor": [[1024, 1.186, 1.131], [1536, 1.368, 1.281], [1638, 1.402, 1.317], [2304, 1.514, 1.413],
                           [2458, 1.516, 1.38]],
                "row": [[1024, 1.106, 1.045], [1536, 1.282, 1.179], [1638, 1.317, 1.217], [2304, 1.402, 1.292],
                        [2458, 1.416, 1.302]],
                "block": [[1024, 0.776, 0.761], [1536, 0.851, 0.827], [1638, 0.884, 0.866], [2304, 0.951, 0.916],
                          [2458, 0.946, 0.924]]},
    sources={
        "mem_gb": "spec: H100 SXM 80 GB HBM3, 79.2 GiB as torch reports it",
        "peak": "spec: NVIDIA H100 SXM dense bf16 989 TFLOP/s, fp8 1979 (report.PEAK_FLOPS)",
        "gemm_tflops": "results/fp8_h100.txt (cuBLAS bf16 at gpt_1b's shapes, class m, and 8192^3, class xl; "
                       "fp8: our Triton tensorwise kernel, what train.fp8 runs, at the same shapes), "
                       "results/moe_h100.txt (dense cuBLAS at K or N = 768, class s); xs and l interpolated, fp8 "
                       "xs / s assumed 1.2x / 1.4x bf16 (K <= 768 sits at the FP8 ridge): until bench_calibrate",
        "attention_tflops": "results/attention.txt (H100 rows, GPU time by graph replay: D64 B16 T1024, D128 "
                            "B4 T4096; SDPA's flash backend for model.kernels=torch; cuDNN D128 for other "
                            "trainers' runs)",
        "membw_gbs": "results/fp8_h100.txt copy 3001 GB/s; elementwise 0.8 x copy (results/sweep_layernorm.txt: "
                     "LayerNorm kernels 66-95 % of copy)",
        "host": "launch 9 us: compiled Triton launch (bench_launch.py, notes/e2e.md). torch_kernels 1470 us a "
                "block: bench_dp.py's host ms (host time to issue gpt2_124m's fwd+bwd with the GPU held busy, "
                "model.kernels=torch) 18.6 ms / 12 blocks less ~1 ms of head (results/archive/"
                "dp_one_b32_1_h100.json, H100 host). dense = torch_kernels + our ops' extra host per block "
                "(bench_launch: attention fwd+bwd 362 vs SDPA 148 us, LayerNorm 335 vs ~200 x 2). ac_full +375, "
                "ac_selective +150 (CPU proxy, notes/pp.md); fp8 +100 a Linear (CPU proxy, notes/fp8.md); "
                "zero3 +550 (bench_dp.py host ms of units of 3 blocks, results/archive/dp2_zero3_units_b16.json); "
                "zb x 1.24 (CPU proxy: F + B + W over 1F1B's F + backward, notes/pp.md); tp2 +25 us a "
                "collective, dp2 +80, cp2 +150, moe +600: assumed. All until bench_calibrate measures them",
        "comm": "all-reduce: results/comm_2.json, comm_4.json (NCCL 2.28.9 on H200 NVLink 4, the same NVSwitch "
                "fabric as H100 SXM); the other collectives and p2p derived from it at equal bus bandwidth",
        "latency_us": "assumed: NCCL small-message floor on NVLink, ~10-20 us (nccl-tests)",
        "grouped_mlp": "results/moe_h100.txt section 4 (grouped_mlp_triton fwd + bwd, GEMMs only, 4,096 and 8,192 "
                       "rows an expert)",
        "fp8_modes": "results/fp8_h100.txt (GEMM table at gpt_1b's shapes; quantization kernels at 8192 x 2048)",
        "attention_in_step": "attention kernels' time in one-GPU step profiles: tp2_graph_gpt_1b_h100.jsonl, "
                             "fp8_e2e_h100.txt, ckpt_async_profile_h100.txt (D128 T1024), cp2_16k_h100_2.jsonl "
                             "(D128 T16384), moe_step_profile_h100.jsonl (D64 T1024)",
        "fp8_linear": "results/fp8_linear_graph_h100.jsonl (FP8Linear fwd + bwd against bf16 under CUDA graphs, "
                      "M = 8192, gpt_1b and gpt_3b shapes; H200 takes H100's)",
        "adamw_share": "results/bench_adamw.txt: torch's fused AdamW at 83 % of copy bandwidth (29 bytes a "
                       "parameter; kernels/adamw.py's flat kernel 98 %, what train.optimizer=flat runs)",
        "adamw_flat_share": "results/bench_adamw.txt: kernels/adamw.py's one launch at 98 % of copy (H200; the "
                            "flat engine's own step not yet measured)"})

_H200 = copy.deepcopy(_H100)
_H200.name, _H200.mem_gb = "H200", 150.75
_H200.attention_tflops = {"64": 261.0, "128": 389.0, "128_long": 389.0, "cudnn_128": 462.0, "sdpa_64": 159.0,
                          "sdpa_128": 268.0}
_H200.membw_gbs = {"copy": 4250.0, "elementwise": 0.8 * 4250.0}
# gpt_1b's attention in H200 step profiles: 34.87 / 34.31 / 34.69 / 34.68 ms for 4 micro-steps (scaleout_2,
# scaleout_pp_graph, scaleout_tp _h200.jsonl, 1-GPU rows): 250 TFLOP/s; T 16384 from the calibration (436); D64 none
_H200.attention_in_step = {"128": [[1024, 250.0]]}
_H200.sources.update({
    "mem_gb": "spec: H200 141 GB HBM3e, 143,771 MiB as nvidia-smi reports it",
    "gemm_tflops": "the H100 figures (same GH100 compute and clocks) until bench_calibrate",
    "attention_tflops": "results/attention.txt (H200 rows, GPU time by graph replay)",
    "attention_in_step": "D128 T1024: attention kernels' time in the 1-GPU rows' profiles of scaleout_2_h200.jsonl, "
                         "scaleout_pp_graph_h200.jsonl, scaleout_tp_h200.jsonl",
    "membw_gbs": "results/bench_adamw.txt: D2D copy 4250 GB/s; elementwise 0.8 x copy",
    "comm": "results/comm_2.json, comm_4.json (measured on H200)"})

SEEDS = {"H100": _H100, "H200": _H200}


# The host CPU's speed on the manifest's machines, measured by the one block every host ran: GPT-2's block with
# model.kernels=torch. bench_dp.py's host ms (gpt2_124m's fwd + bwd issued with the GPU held busy, B 32, one GPU) on
# two H100 hosts: 18.64 ms (results/archive/dp_one_b32_1_h100.json) and 19.7 (results/dp2_h100.txt); their mean less
# the 0.9 ms of embedding, head and loss a micro-step that step_us charges (MICRO_SHARE x 1,500), over 12 blocks.
HOST_ANCHOR_US = 1520.0


def anchored(layer_us: dict) -> dict:
    """A calibration's us a block by variant at the manifest hosts' speed: each variant's cost relative to the
    file's own torch-kernel block is the software's, the torch block's absolute the host CPU's (HOST_ANCHOR_US)."""
    own = layer_us.get("torch_kernels")
    return {k: v / own * HOST_ANCHOR_US for k, v in layer_us.items()} if own else dict(layer_us)


def _merge_layer(seed: dict, new: dict) -> dict:
    """The seed's us a block by variant with `new`'s in place; a seed variant `new` lacks keeps its difference to
    the dense block (what it adds is the software's), on `new`'s dense block."""
    shift = new.get("dense", seed["dense"]) - seed["dense"]
    out = {**{k: v + shift if k not in ("dense", "torch_kernels") else v for k, v in seed.items()}, **new}
    out.update({k: r * out["dense"] for k, r in HOST_RATIOS.items() if k not in new})
    return out


def _load(seed: GPU, path: str, drop: tuple = (), host_relative: bool = False) -> GPU:
    """The seed with bench_calibrate.py's measured numbers in place (its sections only; the rest stay seeds).
    drop: "section.key" entries not taken; host_relative: the host variants at the manifest hosts' speed
    (`anchored`), else the file's own host's us."""
    with open(path) as f:
        cal = json.load(f)
    for d in drop:
        sec, key = d.split(".")
        cal.get(sec, {}).pop(key, None)
        for sub in cal.get(sec, {}).values():
            if isinstance(sub, dict):
                sub.pop(key, None)
    g = copy.deepcopy(seed)
    where = f"{os.path.relpath(path, ROOT)} ({cal.get('gpu')}, {cal.get('date')}, git {cal.get('git')})"
    for key in ("gemm_tflops", "attention_tflops", "membw_gbs", "comm"):
        for sub, val in cal.get(key, {}).items():
            if val:
                getattr(g, key)[sub] = val if not isinstance(val, dict) else {**getattr(g, key).get(sub, {}),
                                                                               **val}
        if cal.get(key):
            g.sources[key] = f"measured: {where}" + (f", less {', '.join(drop)}" if drop else "")
    for key in ("host_wait_share", "p2p_host_wait_share"):  # measured with the collectives
        setattr(g, key, next((v[key] for v in cal.get("comm", {}).values() if key in v), getattr(g, key)))
    if cal.get("host"):
        h = dict(cal["host"])
        if host_relative:
            h["layer_us"] = anchored(h.get("layer_us", {}))
        g.host["launch_us"] = h.get("launch_us", g.host["launch_us"])
        g.host["layer_us"] = _merge_layer(g.host["layer_us"], h.get("layer_us", {}))
        for k in ("step_us", "syncs_per_layer"):
            g.host.setdefault(k, {}).update(h.get(k, {}))
        g.sources["host"] = f"measured: {where} (unmeasured variants keep their seeds" + \
            ("; at the manifest hosts' speed: x HOST_ANCHOR_US / the file's torch-kernel block)" if host_relative
             else ")")
    if "membw_gbs" in cal and "elementwise" not in cal["membw_gbs"]:
        g.membw_gbs["elementwise"] = 0.8 * g.membw_gbs["copy"]
    return g


# Calibrations taken into a seed, and what of them is not (notes/planner.md). The first 2 x H200 table: its head-dim-64
# attention was timed eagerly at 87 TFLOP/s (the launches, not the kernel: attention.txt's graph replay says 261);
# its host rows are wall time of a tiny model's step at 2 and 6 blocks (the probe of 557d434): at pp2 that slope
# carries the pipeline's (m + p - 1) / m fill and its intercept went negative (-19 ms), so neither pp2's block nor
# any per-step figure is taken; the other variants at the manifest hosts' speed (`anchored`: its torch block 1,930
# us -> 1,520; dense 3,670 -> 2,890, tp2 1.20x dense, tp2 + sp 1.86, MoE 1.78, ep2 2.85, FP8 1.76, AC full 1.60).
ADOPTED = {"H200": ("calibrate_gpus_h200.json", ("attention_tflops.64", "host.step_us", "host.pp2"), True)}
# What a calibration measures that is not the chip's, taken by the other GPUs: NCCL's collectives and send/recv by
# size on 2 GPUs with the host's wait on them (H100 SXM and H200 share NVLink 4 and NVSwitch; the seeds' all-reduce
# rows are H200's already), the host syncs a block makes (the code's: ep2's split sizes) and the host cost of each
# variant at the manifest hosts' speed (the software's; what H100's seeds held was assumed or, for our kernels'
# +480 us a block, from a bench_launch before the Gluon attention kernels: results/bench_smoke_h200.txt's gives
# our LayerNorm + attention 1,083 us a block over torch's on its host).
SHARED = {"H100": ("calibrate_gpus_h200.json", ("comm", "syncs_per_layer", "layer_us"), ("pp2",))}


def _share(seed: GPU, path: str, parts: tuple, drop: tuple = ()) -> GPU:
    """The seed with `parts` of another GPU's calibration: "comm" (rows and wait shares), "syncs_per_layer",
    "layer_us" (`anchored`, less the variants in `drop`)."""
    with open(path) as f:
        cal = json.load(f)
    g = copy.deepcopy(seed)
    where = f"{os.path.relpath(path, ROOT)} ({cal.get('gpu')}, {cal.get('date')})"
    if "comm" in parts:
        for n, rows in cal.get("comm", {}).items():
            g.comm[n] = {**g.comm.get(n, {}), **{k: v for k, v in rows.items() if isinstance(v, list)}}
            g.host_wait_share = rows.get("host_wait_share", g.host_wait_share)
            g.p2p_host_wait_share = rows.get("p2p_host_wait_share", g.p2p_host_wait_share)
        g.sources["comm"] = f"measured on the same NVLink 4 / NVSwitch fabric: {where}; the rest " + g.sources["comm"]
    if "syncs_per_layer" in parts:
        g.host["syncs_per_layer"] = dict(cal.get("host", {}).get("syncs_per_layer", {}))
        g.sources["host"] += f"; host syncs a block: {where}"
    if "layer_us" in parts:
        layer = anchored(cal.get("host", {}).get("layer_us", {}))
        g.host["layer_us"] = _merge_layer(g.host["layer_us"], {k: v for k, v in layer.items() if k not in drop})
        g.sources["host"] = f"us a block by variant: {where} at the manifest hosts' speed (x {HOST_ANCHOR_US:.0f} " \
            f"/ its torch-kernel block), less {', '.join(drop) or 'nothing'}; the rest: " + g.sources["host"]
    return g


def table(results_dir: str | None = None) -> dict:
    """{name: GPU}: the seeds with ADOPTED's calibrations in, each replaced by results/plan_gpus_<name>.json's
    numbers where that file exists (a newer bench_calibrate run)."""
    res = results_dir or os.path.join(ROOT, "results")
    gpus = dict(SEEDS)
    for key, (name, drop, rel) in ADOPTED.items():
        if os.path.exists(os.path.join(res, name)):
            gpus[key] = _load(gpus[key], os.path.join(res, name), drop, rel)
    for key, (name, parts, drop) in SHARED.items():
        if os.path.exists(os.path.join(res, name)):
            gpus[key] = _share(gpus[key], os.path.join(res, name), parts, drop)
    for path in sorted(glob.glob(os.path.join(res, "plan_gpus_*.json"))):
        with open(path) as f:
            name = json.load(f).get("gpu", "")
        key = next((k for k in SEEDS if k in name.upper()), None)
        if key:
            gpus[key] = _load(gpus[key], path)
    return gpus


def lookup(name: str, gpus: dict | None = None) -> GPU:
    """A table entry by a name like 'H100' or torch's 'NVIDIA H100 80GB HBM3'; ValueError with the list."""
    gpus = gpus if gpus is not None else table()
    key = next((k for k in gpus if k.lower() in name.lower()), None)
    if key is None:
        raise ValueError(f"unknown GPU {name!r}: the table has {', '.join(gpus)} "
                         f"(bench/bench_calibrate.py on another GPU adds it as results/plan_gpus_<gpu>.json)")
    return gpus[key]


# ----------------------------------------------------------------------------------------------------------------
# collectives

BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
       "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "send_recv": lambda n: 1.0}


def _interp(rows: list, size: float, floor: float) -> float:
    """Seconds at `size` bytes from measured [[bytes, seconds]] rows: log-log between rows, linear in bytes from
    the latency floor below the smallest, at the largest row's bandwidth above it."""
    rows = sorted(rows)
    if size <= rows[0][0]:
        return floor + (rows[0][1] - floor) * size / rows[0][0]
    if size >= rows[-1][0]:
        return rows[-1][1] * size / rows[-1][0]
    for (s0, t0), (s1, t1) in zip(rows, rows[1:]):
        if size <= s1:
            f = math.log(size / s0) / math.log(s1 / s0)
            return math.exp(math.log(t0) + f * math.log(t1 / t0))
    return rows[-1][1]


def intra_time(gpu: GPU, kind: str, size: float, n: int) -> float:
    """One collective of `size` bytes (the full tensor; send_recv: bytes each way) among n GPUs of one node."""
    if n <= 1 or size <= 0:
        return 0.0
    measured = sorted(int(k) for k in gpu.comm if gpu.comm[k].get(kind))
    near = min(measured, key=lambda k: (abs(k - n), -k))
    floor = gpu.latency_us * 1e-6
    t = _interp(gpu.comm[str(near)][kind], size, floor)
    if kind == "send_recv":
        return t
    with_ar = [k for k in measured if gpu.comm[str(k)].get("all_reduce")]
    if kind != "all_reduce" and with_ar:  # the all-reduce at the nearest measured size of group (n's own where
        near = min(with_ar, key=lambda k: (abs(k - n), -k))  # there is one) x this kind's measured share of an
        ar = sorted(int(k) for k in gpu.comm if gpu.comm[k].get("all_reduce"))  # all-reduce of the same bytes
        base = min(ar, key=lambda k: (abs(k - n), -k))
        share = _interp(gpu.comm[str(near)][kind], size, floor) / _interp(gpu.comm[str(near)]["all_reduce"], size,
                                                                           floor)
        return share * _interp(gpu.comm[str(base)]["all_reduce"], size, floor) * BUS["all_reduce"](n) / \
            BUS["all_reduce"](base)
    return t * BUS[kind](n) / BUS[kind](near)


def coll_time(gpu: GPU, kind: str, size: float, n: int, stride: int = 1, fabric: dict | None = None) -> float:
    """A collective over a group of n ranks whose members sit `stride` ranks apart (the mesh puts tp innermost):
    within a node if they fit in one, else hierarchical (intra-node part, then S/k a GPU over the NICs)."""
    if n <= 1 or size <= 0:
        return 0.0
    fab = fabric or FABRIC
    k = max(1, min(n, fab["gpus_per_node"] // max(stride, 1)))  # members of the group in one node
    m = n // k
    if m <= 1:
        return intra_time(gpu, kind, size, n)
    nic, lat = fab["nic_gbs"] * 1e9, fab["latency_us"] * 1e-6
    if kind == "send_recv":
        return lat + size / nic
    if kind == "all_to_all":  # (m-1)/m of a rank's rows go to other nodes, over its own NIC
        return intra_time(gpu, kind, size / m, k) + lat * math.log2(m) + size * (m - 1) / m / nic
    return intra_time(gpu, kind, size, k) + lat * math.log2(m) + BUS[kind](m) * size / k / nic
