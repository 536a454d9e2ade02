"""Microbenchmarks that fill the planner's GPU table (nanopara/gpus.py reads the JSON this writes).

    python bench/bench_calibrate.py --out results/plan_gpus_h200.json                    # one GPU
    torchrun --standalone --nproc_per_node=2 bench/bench_calibrate.py --out F.json        # + collectives, TP/PP host

Sections, in order; one that would pass the time budget (--budget, 200 s) is skipped with a line:
  gemm       bf16 (torch.matmul: cuBLAS) and fp8 (torch._scaled_mm, one scale per tensor) TFLOP/s by shape class
             (the smallest of M, N, K: nanopara/gpus.py gemm_class)
  attention  kernels/attention.py forward + backward, TFLOP/s with causal FLOPs (3.5 x the forward's 2*B*H*T^2*D)
  membw      D2D copy and an elementwise op (GELU), GB/s
  host       host us per launch (a torch op), and the host time to issue a tiny GPT's forward + backward + step
             per block and per step (two depths, GPU work negligible): our kernels, model.kernels=torch, activation
             checkpointing full / selective, FP8 tensor, MoE
  comm       (world >= 2) NCCL all-reduce, reduce-scatter, all-gather, all-to-all, send/recv pairs by size; whether
             an eager collective makes the host wait for the GPU work queued before it; host per block at tp2,
             tp2 + sp, dp (DDP) and per block-micro-batch at pp2 (1F1B), the rest of an even world as dp
Every number is one kernel, collective or launch on this machine, never an end-to-end training row: the planner is
checked against those (nanopara/plan_check.py), so they must not be what sets its table. Rank 0 merges its rows into
--out (a later run with more GPUs adds its comm sizes). Run by `make bench-all SET=calibrate` (bench/run_set.py).
"""
from __future__ import annotations

import argparse
import json
import os
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
ATTN = {"64": (16, 12, 1024, 64), "128": (4, 16, 4096, 128), "128_long": (1, 16, 16384, 128)}
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
    from kernels.attention import attention
    out = {}
    for name, (B, Hh, T, D) in ATTN.items():
        if left(budget) < 40:
            print(f"  attention {name}: skipped (budget)")
            continue
        q, k, v = (torch.randn(B, Hh, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        ms = H.bench_ms(lambda: attention(q, k, v, causal=True).backward(do), dev, grad_to_none=[q, k, v])
        out[name] = 3.5 * 2 * B * Hh * T * T * D / ms / 1e9  # causal: half of 4*B*H*T^2*D, fwd + bwd = 3.5 x fwd
        print(f"  attention D={D} T={T}: {out[name]:.1f} TFLOP/s fwd+bwd", flush=True)
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
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def host_us(mesh, flags: dict, layers: tuple = (2, 6), n_micro: int = 1) -> tuple[float, float, float]:
    """(us per block and micro-batch, us per step beside the blocks, host syncs per block and micro-batch) from
    two depths of train.py's step."""
    t, syncs = [], []
    for L in layers:
        cfg = H.make_cfg("gpt2_124m", {**TINY, **flags, "model.n_layer": L,
                                       "train.tokens_per_step": 128 * n_micro * mesh.dp})
        trainer, _ = H.build_trainer(cfg, mesh)
        batches = H.synthetic_batches(cfg, trainer.accum, mesh.device)
        t.append(H.timed(lambda: H.train_step(trainer, batches), steps=20, warmup=5, mesh=mesh)["step_s"])
        syncs.append(count_syncs(lambda: H.train_step(trainer, batches)))
        trainer.close()
        del trainer
        H.free()
    per_layer = (t[1] - t[0]) / (layers[1] - layers[0]) / n_micro
    return (per_layer * 1e6, (t[0] - layers[0] * n_micro * per_layer) * 1e6,
            max(0.0, (syncs[1] - syncs[0]) / (layers[1] - layers[0]) / n_micro))


def launch_us(dev) -> float:
    x = torch.zeros(16, device=dev)
    n = 2000
    return H.timed(lambda: x.add_(1.0), steps=n, warmup=50, device=dev)["step_s"] * 1e6


HOST_1GPU = {"dense": {}, "torch_kernels": {"model.kernels": "torch"},
             "ac_full": {"train.activation_checkpointing": "full"},
             "ac_selective": {"train.activation_checkpointing": "selective"},
             "fp8_tensor": {"train.fp8": "tensor"},
             "moe": {"model.moe_experts": 8, "model.moe_top_k": 2, "model.moe_every": 1}}
HOST_2GPU = {"tp2": ({"parallel.tp": 2}, 1), "tp2_sp": ({"parallel.tp": 2, "parallel.sp": "true"}, 1),
             "dp2": ({}, 1), "pp2": ({"parallel.pp": 2}, 4), "cp2": ({"parallel.cp": 2}, 1),
             "ep2": ({"parallel.ep": 2, **HOST_1GPU["moe"]}, 1)}


def host_section(mesh, budget: float) -> dict:
    out = {"launch_us": launch_us(mesh.device), "layer_us": {}, "step_us": {}, "syncs_per_layer": {}}
    print(f"  host per torch launch {out['launch_us']:.1f} us", flush=True)
    for name, flags in HOST_1GPU.items():
        if left(budget) < 45:
            print(f"  host {name}: skipped (budget)")
            continue
        out["layer_us"][name], out["step_us"][name], out["syncs_per_layer"][name] = host_us(mesh, flags)
        print(f"  host {name}: {out['layer_us'][name]:.0f} us a block (fwd+bwd), {out['step_us'][name]:.0f} us "
              f"a step beside, {out['syncs_per_layer'][name]:.1f} host syncs a block", flush=True)
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
        layers = (4, 8) if deg["pp"] > 1 else (2, 6)
        per, step, syncs = host_us(mesh, flags, layers, m)
        if deg["pp"] > 1:
            per, syncs = 2 * per, 2 * syncs  # a rank holds half the blocks: per block it holds
        out["layer_us"][name], out["step_us"][name], out["syncs_per_layer"][name] = per, step, syncs
        if mesh.is_main:
            print(f"  host {name}: {per:.0f} us a block{' and micro-batch' if m > 1 else ''}, {step:.0f} us a step "
                  f"beside, {syncs:.1f} host syncs a block", flush=True)
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
