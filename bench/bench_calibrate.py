"""Microbenchmarks that fill the planner's GPU table (nanopara/gpus.py reads the JSON this writes).

    python bench/bench_calibrate.py --out results/plan_gpus_h200.json                    # one GPU
    torchrun --standalone --nproc_per_node=2 bench/bench_calibrate.py --out F.json        # + collectives, TP/PP host

Sections, in order; one that would pass the time budget (--budget, 200 s) is skipped with a line:
  gemm       bf16 (torch.matmul: cuBLAS) and fp8 (torch._scaled_mm, one scale per tensor) TFLOP/s by shape class
             (the smallest of M, N, K: nanopara/gpus.py gemm_class)
  attention  kernels/attention.py forward + backward at the presets' shapes (D 64: gpt2_124m, B*H 192; D 128: gpt_1b,
             B*H 128; both T 1024; and T 16k), tuned outside the timing, GPU time by CUDA-graph replay (an eager
             timing at D 64 measures the ~360 us of launches, not the kernel), TFLOP/s with causal FLOPs
  membw      D2D copy and an elementwise op (GELU), GB/s
  host       host us per launch, and the host's own time to issue a tiny GPT's step while the GPU is held busy
             (torch.cuda._sleep queued first: nothing the host does waits for a kernel) at two depths: us per block
             (the difference) and per step (the shallow step less its blocks), both issue times, so neither goes
             negative as wall-time differences can; a step that waits anyway (a sync, a full launch queue) is timed
             by wall clock and listed under "waited". Ours, kernels=torch, AC full / selective, FP8 by mode, MoE;
             dense and MoE again at 8 x 1024 tokens (does the host cost grow with the shape?)
  comm       (world >= 2) NCCL all-reduce, reduce-scatter, all-gather, all-to-all, send/recv pairs by size; whether
             an eager collective makes the host wait for the GPU work queued before it; host per block at tp2,
             tp2 + sp (also at 8 x 1024 tokens), dp (DDP), per block-micro-batch at pp2 (1F1B), the rest as dp
Every number is one kernel, collective or launch on this machine, never an end-to-end training row: the planner is
checked against those (nanopara/plan_check.py), so they must not be what sets its table. Rank 0 merges its rows into
--out (a later run with more GPUs adds its comm sizes). Run by `make bench-all SET=calibrate` (bench/run_set.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import harness as H
from nanopara.mesh import Mesh

# (M, N, K) per shape class of the planner (gpus.gemm_class: by the smallest dimension)
GEMMS = {"xs": [(8192, 256, 768), (16384, 384, 2048)],
         "s": [(16384, 768, 768), (16384, 768, 3072), (8192, 1024, 4096)],
         "m": [(8192, 2048, 2048), (8192, 8192, 2048), (8192, 2048, 8192)],
         "l": [(8192, 4096, 4096), (8192, 4096, 14336)],
         "xl": [(8192, 8192, 8192), (16384, 8192, 8192)]}
# (B, H, T, D): gpt2_124m at micro-batch 16, gpt_1b at micro-batch 8 (the manifest's rows), one 16k sequence
ATTN = {"64": (16, 12, 1024, 64), "128": (8, 16, 1024, 128), "128_long": (1, 16, 16384, 128)}
SIZES = [2 ** 20, 2 ** 23, 2 ** 26, 2 ** 28]  # bytes: 1, 8, 64, 256 MiB
T0 = time.perf_counter()


def left(budget: float) -> float:
    return budget - (time.perf_counter() - T0)


def agree(ok: bool, mesh) -> bool:
    """Every rank takes the same branch (a rank's budget check is its own clock)."""
    if mesh is None or mesh.world == 1:
        return ok
    t = torch.tensor([1.0 if ok else 0.0], device=mesh.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


# ----------------------------------------------------------------------------------------------------------------
# one GPU: GEMMs, attention, memory bandwidth

def gemm_section(dev) -> dict:
    out = {"bf16": {}, "fp8": {}}
    for cls, shapes in GEMMS.items():
        bf, f8 = [], []
        for M, N, K in shapes:
            a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
            ms = H.bench_ms(lambda: a @ w.t(), dev)
            bf.append(2 * M * N * K / ms / 1e9)
            try:
                a8, w8 = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
                one = torch.ones((), device=dev)
                ms = H.bench_ms(lambda: torch._scaled_mm(a8, w8.t(), one, one, out_dtype=torch.bfloat16), dev)
                f8.append(2 * M * N * K / ms / 1e9)
            except (RuntimeError, TypeError) as e:  # no FP8 tensor cores: the class stays unmeasured
                print(f"  fp8 {M}x{N}x{K}: {str(e).splitlines()[0][:100]}")
            del a, w
        out["bf16"][cls] = sum(bf) / len(bf)
        if f8:
            out["fp8"][cls] = sum(f8) / len(f8)
        print(f"  gemm {cls:3s} bf16 {out['bf16'][cls]:7.1f} TFLOP/s" + (f"  fp8 {out['fp8'][cls]:7.1f}" if f8 else ""),
              flush=True)
    return out


def attention_section(dev, budget: float) -> dict:
    """Fwd + bwd TFLOP/s of our attention at each ATTN shape: GPU time alone, what a step sees while the host runs
    ahead (kernels/attention.py's own benchmark times its "graph" rows the same way; results/attention.txt)."""
    import triton

    from kernels.attention import attention
    out = {}
    for name, (B, Hh, T, D) in ATTN.items():
        if left(budget) < 40:
            print(f"  attention {name}: skipped (budget)")
            continue
        q, k, v = (torch.randn(B, Hh, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)

        def step():
            torch.autograd.grad(attention(q, k, v, causal=True), (q, k, v), do)
        step()  # autotune this shape's (T, B*H) bucket outside the timing and the capture
        H.sync(dev)
        ms = triton.testing.do_bench_cudagraph(step, rep=50, return_mode="median") if dev.type == "cuda" else \
            H.bench_ms(step, dev)
        out[name] = 3.5 * 2 * B * Hh * T * T * D / ms / 1e9  # causal: half of 4*B*H*T^2*D, fwd + bwd = 3.5 x fwd
        print(f"  attention D={D} B*H={B * Hh} T={T}: {out[name]:.1f} TFLOP/s fwd+bwd (graph replay)", flush=True)
    return out


def membw_section(dev) -> dict:
    x = torch.empty(2 ** 29, device=dev, dtype=torch.uint8)
    y = torch.empty_like(x)
    copy = 2 * x.numel() / H.bench_ms(lambda: y.copy_(x), dev) / 1e6
    h = torch.randn(2 ** 27, device=dev, dtype=torch.bfloat16)
    gelu = 4 * h.numel() / H.bench_ms(lambda: F.gelu(h, approximate="tanh"), dev) / 1e6
    print(f"  copy {copy:.0f} GB/s, gelu {gelu:.0f} GB/s", flush=True)
    return {"copy": copy, "elementwise": gelu}


# ----------------------------------------------------------------------------------------------------------------
# host cost: a tiny GPT's forward + backward + step, two depths; the GPU finishes each kernel in microseconds

TINY = {"model.n_embd": 256, "model.n_head": 4, "model.block_size": 128, "train.seq_len": 128,
        "train.micro_batch": 1, "train.val_every": 0, "train.cuda_graph": "false"}  # eager: the host is the point


def count_syncs(fn) -> int:
    """Host-device synchronisations one call of fn makes (torch's sync debug mode warns on each)."""
    import warnings
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def _hold_gpu(dev, seconds: float) -> None:
    """Queue a kernel that spins `seconds` on this device's stream: what the host issues next waits behind it."""
    if dev.type == "cuda":
        torch.cuda._sleep(int(seconds * _clock_hz(dev)))


_HZ = {}


def _clock_hz(dev) -> float:
    """Cycles a second of torch.cuda._sleep on this GPU (timed once with CUDA events)."""
    if dev.index not in _HZ:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        b.synchronize()
        _HZ[dev.index] = 20_000_000 / (a.elapsed_time(b) * 1e-3)
    return _HZ[dev.index]


def issue_s(step, mesh, reps: int = 6) -> tuple[float, bool]:
    """(seconds the host takes to issue one call of step(), whether it waited): the median over reps of the host
    clock around step() while the GPU is held busy for 4x a synced step's wall time, the slowest rank's. A host that
    waited (a sync, a full launch queue: the call took half the hold or more) gets the synced wall time instead."""
    dev = mesh.device
    H.sync(dev)
    t0 = time.perf_counter()
    step()
    H.sync(dev)
    hold = min(2.0, max(0.05, 4 * H.max_over_ranks([time.perf_counter() - t0], mesh)[0]))  # one hold: ranks agree
    times = []
    for _ in range(reps):
        if mesh.world > 1:
            dist.barrier()
        H.sync(dev)
        _hold_gpu(dev, hold)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    H.sync(dev)
    med = H.max_over_ranks([statistics.median(times)], mesh)[0]
    waited = dev.type == "cuda" and med > 0.5 * hold
    if waited:
        med = H.timed(step, steps=reps, warmup=1, mesh=mesh)["step_s"]
    return med, waited


def host_us(mesh, flags: dict, layers: tuple = (1, 4), n_micro: int = 1, per_rank: int = 1) -> dict:
    """Host cost of train.py's step at two depths: {"layer_us": us a block and micro-batch (per_rank: blocks a rank
    holds = layers / per_rank), "step_us": us a step beside them (>= 0), "syncs": host syncs a block, "waited"}."""
    t, syncs, waited = [], [], False
    for L in layers:
        f = {**TINY, **flags}
        cfg = H.make_cfg("gpt2_124m", {**f, "model.n_layer": L, "train.tokens_per_step":
                                       int(f["train.seq_len"]) * int(f["train.micro_batch"]) * n_micro * mesh.dp})
        trainer, _ = H.build_trainer(cfg, mesh)
        batches = H.synthetic_batches(cfg, trainer.accum, mesh.device)
        step = lambda: H.train_step(trainer, batches)  # noqa: E731
        H.timed(step, steps=1, warmup=5, mesh=mesh)  # tuning, allocator, NCCL set-up
        s, w = issue_s(step, mesh)
        t.append(s)
        waited |= w
        syncs.append(count_syncs(step))
        trainer.close()
        del trainer
        H.free()
    blocks = [L / per_rank * n_micro for L in layers]  # block-micro-batches a rank issues
    per = max(0.0, (t[1] - t[0]) / (blocks[1] - blocks[0]))
    return {"layer_us": per * 1e6, "step_us": max(0.0, t[0] - blocks[0] * per) * 1e6,
            "syncs": max(0.0, (syncs[1] - syncs[0]) / (blocks[1] - blocks[0])), "waited": waited}


def launch_us(dev) -> float:
    x = torch.zeros(16, device=dev)
    n = 2000
    return H.timed(lambda: x.add_(1.0), steps=n, warmup=50, device=dev)["step_s"] * 1e6


HOST_1GPU = {"dense": {}, "torch_kernels": {"model.kernels": "torch"},
             "ac_full": {"train.activation_checkpointing": "full"},
             "ac_selective": {"train.activation_checkpointing": "selective"},
             "fp8_tensor": {"train.fp8": "tensor", "train.fp8_filter": "all"},
             "fp8_row": {"train.fp8": "row", "train.fp8_filter": "all"},  # row / block: more quantization kernels
             "fp8_block": {"train.fp8": "block", "train.fp8_filter": "all"},
             "moe": {"model.moe_experts": 8, "model.moe_top_k": 2, "model.moe_every": 1}}
# the same at 8 x 1024 tokens a micro-batch (the manifest's MoE rows): does a block's host cost grow with the shape?
# (issue times: the held GPU makes the kernels' own time irrelevant; the planner reads only the names above)
BIG = {"model.block_size": 1024, "train.seq_len": 1024, "train.micro_batch": 8}
HOST_1GPU.update({"dense_8k": BIG, "moe_8k": {**HOST_1GPU["moe"], **BIG}})
HOST_2GPU = {"tp2": ({"parallel.tp": 2}, 1), "tp2_sp": ({"parallel.tp": 2, "parallel.sp": "true"}, 1),
             "dp2": ({}, 1), "pp2": ({"parallel.pp": 2, "parallel.pp_layers": "even"}, 4),  # even: L / 2 a rank
             "cp2": ({"parallel.cp": 2}, 1), "ep2": ({"parallel.ep": 2, **HOST_1GPU["moe"]}, 1),
             # eager TP at the manifest's 8 x 1024 tokens: does TP's host cost grow with the shape (notes/planner.md)?
             "tp2_8k": ({"parallel.tp": 2, **BIG}, 1), "tp2_sp_8k": ({"parallel.tp": 2, "parallel.sp": "true", **BIG}, 1)}


def _put(out: dict, name: str, r: dict) -> None:
    out["layer_us"][name], out["step_us"][name], out["syncs_per_layer"][name] = r["layer_us"], r["step_us"], r["syncs"]
    if r["waited"]:
        out.setdefault("waited", []).append(name)


def host_section(mesh, budget: float) -> dict:
    out = {"launch_us": launch_us(mesh.device), "layer_us": {}, "step_us": {}, "syncs_per_layer": {}}
    print(f"  host per torch launch {out['launch_us']:.1f} us", flush=True)
    for name, flags in HOST_1GPU.items():
        if left(budget) < 45:
            print(f"  host {name}: skipped (budget)")
            continue
        r = host_us(mesh, flags)
        _put(out, name, r)
        print(f"  host {name}: {r['layer_us']:.0f} us a block (fwd+bwd), {r['step_us']:.0f} us a step beside, "
              f"{r['syncs']:.1f} host syncs a block" + (" (waited: wall time)" if r["waited"] else ""), flush=True)
    return out


# ----------------------------------------------------------------------------------------------------------------
# two GPUs and more: collectives by size, the host wait at an eager collective, TP / PP host cost

def comm_section(mesh, budget: float) -> dict:
    n, dev, out = mesh.world, mesh.device, {}
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv"):
        rows = []
        for size in SIZES:
            full = torch.ones(size // 2, device=dev, dtype=torch.bfloat16)
            part = torch.empty(size // 2 // n, device=dev, dtype=torch.bfloat16)
            peer = mesh.rank ^ 1 if mesh.rank ^ 1 < n else mesh.rank
            fn = {"all_reduce": lambda: dist.all_reduce(full),
                  "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
                  "all_gather": lambda: dist.all_gather_into_tensor(full, part),
                  "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(full), full),
                  "send_recv": lambda: [w.wait() for w in dist.batch_isend_irecv(
                      [dist.P2POp(dist.isend, full, peer),
                       dist.P2POp(dist.irecv, torch.empty_like(full), peer)])]}[kind]
            steps = 20 if size <= 2 ** 26 else 8
            s = H.timed(fn, steps=steps, warmup=3, mesh=mesh)["step_s"]
            rows.append([size, s])
        out[kind] = rows
        if mesh.is_main:
            print(f"  {kind:14s} " + "  ".join(f"{b / 2 ** 20:5.0f} MiB {s * 1e3:7.3f} ms" for b, s in rows),
                  flush=True)
    # does an eager collective make the host wait for the GPU work queued before it?
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    small = torch.ones(2 ** 20, device=dev)
    H.sync(dev)
    q0 = time.perf_counter()
    for _ in range(8):
        a @ a
    q1 = time.perf_counter()
    dist.all_reduce(small)
    q2 = time.perf_counter()
    H.sync(dev)
    q3 = time.perf_counter()
    out["host_wait_share"] = max(0.0, (q2 - q1) / max(q3 - q0, 1e-9))
    peer = mesh.rank ^ 1 if mesh.rank ^ 1 < n else mesh.rank
    H.sync(dev)
    q0 = time.perf_counter()
    for _ in range(8):
        a @ a
    q1 = time.perf_counter()
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, small, peer), dist.P2POp(dist.irecv, small.clone(), peer)]):
        w.wait()
    q2 = time.perf_counter()
    H.sync(dev)
    out["p2p_host_wait_share"] = max(0.0, (q2 - q1) / max(time.perf_counter() - q0, 1e-9))
    if mesh.is_main:
        print(f"  eager all-reduce / send-recv behind ~{1e3 * (q3 - q0):.1f} ms of GEMMs: the host waited "
              f"{out['host_wait_share']:.2f} / {out['p2p_host_wait_share']:.2f} of it", flush=True)
    return out


def host2_section(world, budget: float) -> dict:
    out = {"layer_us": {}, "step_us": {}, "syncs_per_layer": {}}
    for name, (flags, m) in HOST_2GPU.items():
        if not agree(left(budget) > 40, world):
            if world.is_main:
                print(f"  host {name}: skipped (budget)")
            continue
        deg = {a: int(flags.get(f"parallel.{a}", 1)) for a in ("pp", "tp", "cp", "ep")}
        mesh = Mesh.build(dp=-1, pp=deg["pp"], tp=deg["tp"], cp=deg["cp"], ep=deg["ep"])
        # pp: a rank holds layers / pp blocks and issues each once a micro-batch (its own issue time, so the other
        # stage's progress is not in it)
        r = host_us(mesh, flags, (2, 4) if deg["pp"] > 1 else (1, 4), m, per_rank=deg["pp"])
        _put(out, name, r)
        if mesh.is_main:
            print(f"  host {name}: {r['layer_us']:.0f} us a block{' and micro-batch' if m > 1 else ''}, "
                  f"{r['step_us']:.0f} us a step beside, {r['syncs']:.1f} host syncs a block"
                  + (" (waited: wall time)" if r["waited"] else ""), flush=True)
    return out


# ----------------------------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="", help="merge the table into this JSON file (rank 0)")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds; sections past it are skipped")
    ap.add_argument("--sections", default="gemm,attention,membw,host,comm")
    args = ap.parse_args()
    secs = args.sections.split(",")
    mesh = Mesh.build()  # dp = world: the comm section's group
    dev, say = mesh.device, H.printer(mesh)
    say(H.banner("bench_calibrate: the planner's GPU table", mesh))
    table = {"gpu": H.gpu_name(dev), **{k: v for k, v in H.stamp().items() if k != "gpu"},
             "source": "bench/bench_calibrate.py"}
    if "gemm" in secs:
        table["gemm_tflops"] = gemm_section(dev)
    if "attention" in secs and agree(left(args.budget) > 60, mesh):
        table["attention_tflops"] = attention_section(dev, args.budget)
    if "membw" in secs:
        table["membw_gbs"] = membw_section(dev)
    if "host" in secs and agree(left(args.budget) > 50, mesh):
        table["host"] = host_section(H.solo_mesh(dev), args.budget)
    if "comm" in secs and mesh.world >= 2 and agree(left(args.budget) > 30, mesh):
        table["comm"] = {str(mesh.world): comm_section(mesh, args.budget)}
        if mesh.world % 2 == 0:
            h2 = host2_section(mesh, args.budget)
            table.setdefault("host", {"layer_us": {}, "step_us": {}})
            for k in ("layer_us", "step_us", "syncs_per_layer"):
                table["host"].setdefault(k, {}).update(h2[k])
            table["host"]["waited"] = table["host"].get("waited", []) + h2.get("waited", [])
    table["seconds"] = time.perf_counter() - T0
    if mesh.is_main and args.out:
        old = {}
        if os.path.exists(args.out):
            with open(args.out) as f:
                old = json.load(f)
        if old.get("gpu") == table["gpu"]:  # same GPU: keep what this run did not measure (e.g. 4-GPU comm)
            table["comm"] = {**old.get("comm", {}), **table.get("comm", {})}
            old.update(table)
            table = old
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)
        print(f"wrote {args.out} ({table['seconds']:.0f} s)")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
