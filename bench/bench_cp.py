"""Context parallel on N GPUs: CP efficiency of a training step, zigzag load balance, exposed communication.

    torchrun --nproc_per_node=2 bench/bench_cp.py --out=F.jsonl                 # gpt_1b, T = 16384: ~2-3 minutes
    torchrun --nproc_per_node=2 bench/bench_cp.py --out=F.jsonl --memory        # + peak memory at T/2 and T
    torchrun --nproc_per_node=4 bench/bench_cp.py --seq_len=32768               # cp = N, the processes
    torchrun --nproc_per_node=2 bench/bench_cp.py --device=cpu --n_layer=2 --n_embd=64 --n_head=2 --seq_len=64

Every step is train.py's (parallel.parallelize -> Trainer) on synthetic tokens: gpt_1b (18 blocks of 2048, 16
heads of 128) with block_size = seq_len, micro-batch 1, bf16 autocast, the Triton kernels. Sections:
1. step     one GPU: each rank trains the single-device model alone (a world-of-one mesh); cp=N: the N GPUs share
            one sequence (ring attention; gradients reduced over dp x cp). CP efficiency = t_1gpu / (N t_cpN);
            tok/s, MFU, peak memory per GPU. If one GPU runs out of memory, both repeat with ac=full (said so).
2. exposed  the cp=N step with ring attention's send/recv replaced by a no-op (same kernels and shapes, wrong
            values): (t_cpN - t_nocomm) / n_layer = communication not hidden behind compute, per layer; beside it
            the messages' own time (one K/V ping x the messages a layer sends, fwd + bwd).
   ulysses  the cp=N step with parallel.cp_impl=ulysses (all-to-all heads <-> sequence): time, CP efficiency.
3. balance  one layer's ring attention fwd + bwd at (1, 16, T/N, 128) per rank, zigzag vs contiguous split:
            compute per rank (no communication), max/min over ranks, and the ring's wall time.
4. memory   (--memory) peak memory at T/2 and T, 1 GPU and cp=N, ac none and full, and the longest T each would
            fit on a straight line through the two points (flash attention: activations linear in T): an
            extrapolation, labelled so.
One JSON line per section to --out. --profile: a chrome trace of one cp=N step per rank beside --out
(trace_cpN_rankR.json; ui.perfetto.dev).
"""
from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist

import harness as H
from nanopara import ring_attention as ra
from nanopara.mesh import Mesh


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="", help="append JSON lines here")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seq_len", type=int, default=16384)
    ap.add_argument("--n_layer", type=int, default=18)
    ap.add_argument("--n_embd", type=int, default=2048)
    ap.add_argument("--n_head", type=int, default=16)
    ap.add_argument("--ac", default="none", choices=["none", "full", "selective"], help="activation checkpointing")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    ap.add_argument("--memory", action="store_true", help="section 4: peak memory at T/2 and T, AC none and full")
    ap.add_argument("--profile", action="store_true", help="a torch.profiler trace of one cp=N step per rank")
    return ap.parse_args()


def make_cfg(args, cp_degree: int, T: int, ac: str, impl: str = "ring"):
    return H.make_cfg("gpt_1b", {
        "model.n_layer": args.n_layer, "model.n_embd": args.n_embd, "model.n_head": args.n_head,
        "model.block_size": args.seq_len, "model.kernels": "auto", "train.seq_len": T, "train.micro_batch": 1,
        "train.tokens_per_step": 0, "train.activation_checkpointing": ac, "parallel.dp": 1, "parallel.cp": cp_degree,
        "parallel.cp_impl": impl})


def time_config(args, mesh, run_mesh, cp_degree, T, ac, warmup=2, trace="", impl="ring") -> dict:
    """Seconds per step (slowest rank) and peak GB (max over ranks); step_s None and oom after an OOM."""
    cfg, dev = make_cfg(args, cp_degree, T, ac, impl), mesh.device
    result, trainer = {"cp": cp_degree, "impl": impl, "seq_len": T, "ac": ac}, None
    try:
        trainer, n_params = H.build_trainer(cfg, run_mesh)
        batches = H.synthetic_batches(cfg, 1, dev)  # the same sequence on every rank
        step = lambda: H.train_step(trainer, batches)  # noqa: E731
        t = H.timed(step, args.steps, warmup, mesh=run_mesh)
        if trace:  # one more step under the profiler: kernels and NCCL send/recv on their streams, per rank
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                H.sync(dev)
            prof.export_chrome_trace(trace)
        result.update(step_s=t["step_s"], peak_mem_gb=t["peak_gb"], mfu=H.mfu(cfg, n_params, T / t["step_s"],
                                                                              cp_degree, dev))
    except torch.OutOfMemoryError:
        result.update(step_s=None, oom=True)
    finally:
        if trainer is not None:
            trainer.close()
            trainer.engine.close()
        del trainer
        H.free()
    got = [None] * mesh.world
    dist.all_gather_object(got, result)
    if any(r.get("oom") for r in got):
        return dict(result, step_s=None, oom=True)
    step_s = max(r["step_s"] for r in got)
    return dict(result, step_s=step_s, tok_s=T / step_s, peak_mem_gb=max(r["peak_mem_gb"] for r in got),
                mfu=min(r["mfu"] for r in got))  # one sequence a step, whatever the GPUs sharing it


class NoComm:
    """Context: ring attention's send/recv replaced by 'the block in hand stays here' (same work, no messages)."""

    def __enter__(self):  # K/V blocks stay put; the dK/dV parts going home are not sent (their buffers not written)
        self.saved = ra._send_recv, ra._post
        ra._send_recv, ra._post = (lambda t, ring: (t, ([], t))), (lambda ops: [])

    def __exit__(self, *exc):
        ra._send_recv, ra._post = self.saved


def attention_times(mesh, T, n_head, head_dim, layout, comm: bool, reps=10):
    """Seconds of one fwd + bwd of ring attention on this rank (events on its stream), gathered over ranks."""
    dev = mesh.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(mesh.rank)
    q, k, v, do = (torch.randn(1, n_head, T // mesh.cp, head_dim, generator=g).to(dev, dtype) for _ in range(4))
    prev, nxt = mesh.neighbours("cp")
    ring = ra.Ring(mesh.groups["cp"], mesh.cp_rank, mesh.cp, prev, nxt, layout=layout, triton=dev.type == "cuda")

    def fwd_bwd():
        out, lse = ra.ring_fwd(q, k, v, ring)
        ra.ring_bwd(do, q, k, v, out, lse, ring)
    with NoComm() if not comm else contextlib.nullcontext():
        fwd_bwd()  # warm-up (autotuning at this shape)
        H.sync(dev)
        dist.barrier(group=mesh.groups["cp"])
        clock = H.Clock(dev)
        a = clock()
        for _ in range(reps):
            fwd_bwd()
        b = clock()
        H.sync(dev)
    got = [None] * mesh.world
    dist.all_gather_object(got, clock.ms(a, b) / 1e3 / reps)
    return got


def ping_s(mesh, shape, dtype, reps=10):
    """Seconds of one send/recv exchange of a tensor of `shape` with the ring neighbours."""
    t = torch.zeros(shape, dtype=dtype, device=mesh.device)
    prev, nxt = mesh.neighbours("cp")
    ring = ra.Ring(mesh.groups["cp"], mesh.cp_rank, mesh.cp, prev, nxt)
    return H.timed(lambda: ra._wait(ra._send_recv(t, ring)[1]), reps, 1, device=mesh.device)["step_s"]


# ----------------------------------------------------------------------------------------------------------------
# sections, each one JSON line

def steps_section(args, mesh, n, T, emit):
    """1 GPU against cp=N (and ac=full for both where one GPU runs out of memory); then no-comm and Ulysses."""
    ac, trace = args.ac, (os.path.join(os.path.dirname(os.path.abspath(args.out or "x")), f"trace_cp{n}_rank"
                                       f"{mesh.rank}.json") if args.profile else "")
    one = time_config(args, mesh, H.solo_mesh(mesh.device), 1, T, ac)
    if one.get("oom") and ac == "none":
        emit({"note": f"one GPU: out of memory at T={T} without activation checkpointing; both runs use ac=full"})
        ac = "full"
        one = time_config(args, mesh, H.solo_mesh(mesh.device), 1, T, ac)
    cpn = time_config(args, mesh, mesh, n, T, ac, trace=trace)
    eff = lambda r: one["step_s"] / (n * r["step_s"]) if one.get("step_s") and r.get("step_s") else None  # noqa
    emit({"section": "step", "one_gpu": one, f"cp{n}": cpn, "ac": ac, "cp_efficiency": eff(cpn)})
    if cpn.get("step_s"):
        with NoComm():
            quiet = time_config(args, mesh, mesh, n, T, ac)
        kv = ping_s(mesh, (2, 1, args.n_head, T // n, args.n_embd // args.n_head),
                    torch.bfloat16 if mesh.device.type == "cuda" else torch.float32)
        emit({"section": "exposed", "step_s_nocomm": quiet.get("step_s"), "kv_message_s": kv,
              "exposed_per_layer_s": (cpn["step_s"] - quiet["step_s"]) / args.n_layer if quiet.get("step_s") else None,
              "messages_per_layer_s": 3 * (n - 1) * kv})  # fwd + bwd of a layer, were none overlapped
    uly = time_config(args, mesh, mesh, n, T, ac, impl="ulysses")
    emit({"section": "ulysses", **uly, "cp_efficiency": eff(uly)})


def balance_section(args, mesh, T, emit):
    for layout in ("zigzag", "contiguous"):
        compute = attention_times(mesh, T, args.n_head, args.n_embd // args.n_head, layout, comm=False)
        wall = attention_times(mesh, T, args.n_head, args.n_embd // args.n_head, layout, comm=True)
        emit({"section": "balance", "layout": layout, "compute_s": compute, "max_over_min": max(compute) / min(compute),
              "ring_s": max(wall)})


def memory_section(args, mesh, n, T, emit):
    cap = torch.cuda.get_device_properties(mesh.device).total_memory / H.GB if mesh.device.type == "cuda" else 0.0
    for mode in ("none", "full"):
        for cpd, run_mesh in ((1, H.solo_mesh(mesh.device)), (n, mesh)):
            pts = [time_config(args, mesh, run_mesh, cpd, L, mode, warmup=1) for L in (T // 2, T)]
            row = {"section": "memory", "cp": cpd, "ac": mode, "gpu_gb": cap,
                   "points": [(p["seq_len"], p.get("peak_mem_gb")) for p in pts]}
            if all(p.get("peak_mem_gb") for p in pts):
                (t0, m0), (t1, m1) = row["points"]
                slope = (m1 - m0) / (t1 - t0)
                row["max_seq_len_extrapolated"] = int(t1 + (0.95 * cap - m1) / slope) if slope > 0 else None
            emit(row)


def main():
    args = parse()
    mesh = Mesh.build(dp=1, cp=int(os.environ.get("WORLD_SIZE", "1")), device=args.device)
    n, log = mesh.cp, H.printer(mesh)
    if n < 2:
        raise SystemExit("bench_cp.py runs on N >= 2 processes (cp = N): torchrun --nproc_per_node=2 bench/bench_cp.py")
    log(H.banner(f"bench_cp T={args.seq_len}, {args.n_layer} x {args.n_embd} ({args.n_head} heads)", mesh), flush=True)
    model = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "seq_len": args.seq_len}

    def emit(row):  # printed and appended as each section ends: a crash later keeps them
        log(row, flush=True)
        if mesh.is_main:
            H.append_jsonl(args.out, {"bench": "cp", "model": model, **row})
    steps_section(args, mesh, n, args.seq_len, emit)
    balance_section(args, mesh, args.seq_len, emit)
    if args.memory:
        memory_section(args, mesh, n, args.seq_len, emit)
    mesh.destroy()


if __name__ == "__main__":
    main()
