"""Any train.py layout's training step: tokens/s, MFU, peak memory and the communication it exposes.

    torchrun --nproc_per_node=N bench/bench_layout.py [--tree DIR] [--label NAME] [--out DIR] -- TRAIN.PY FLAGS
    e.g. -- --preset=gpt_1b --train.micro_batch=8 --parallel.tp=2 --parallel.pp=2 --train.tokens_per_step=65536

Builds the run as train.py does (Config from the same flags, Mesh, GPT, parallel.parallelize, the micro-steps of
train.tokens_per_step with no_sync, pipeline_step under pp, graph.py's replay under --train.cuda_graph=true) on
synthetic tokens, warms up 5 steps, times --steps steps (the slowest rank's wall time: tokens/s, MFU over all
GPUs with report.flops_per_token, which counts a MoE's active parameters; peak memory of the fullest GPU) and
profiles one step on rank 0. From the GPU kernels of that step:
  comm     the union of the NCCL kernels' intervals;
  exposed  the part of it during which no compute kernel runs: the time the step waits on communication;
  kinds    GPU time per kind of kernel (GEMM, attention, NCCL, AdamW, LayerNorm, FP8 casts, other) and the
           costliest kernels: where a layout's step goes beside the one-GPU step.
Both are printed per step and per layer (divided by n_layer). --tree imports nanopara from another checkout
(`git archive REV | tar -x -C DIR`), so the same script measures an older tree; flags that tree does not know
are dropped with a note.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time


def _union(iv):
    """Total length of a union of (start, end) intervals, and the merged list."""
    merged = []
    for a, b in sorted(iv):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return sum(b - a for a, b in merged), merged


def _overlap(xs, ys):
    """Length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def exposed_comm(kernels):
    """(comm ms, exposed ms, compute-busy ms, span ms) from (name, start_us, end_us) GPU kernels."""
    comm = [(s, e) for n, s, e in kernels if "nccl" in n.lower()]
    comp = [(s, e) for n, s, e in kernels if "nccl" not in n.lower()]
    c, cm = _union(comm)
    b, bm = _union(comp)
    span = max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)
    return c / 1e3, (c - _overlap(cm, bm)) / 1e3, b / 1e3, span / 1e3


KINDS = (("nccl", ("nccl",)), ("attention", ("attn", "flash", "fmha", "sdpa")), ("fp8 cast", ("_amax", "_cast", "_rows_k",
         "_blocks_k")), ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "_matmul", "_mm_", "wgmma")),
         ("adamw", ("adamw", "multi_tensor")), ("layernorm", ("layernorm", "_ln_")), ("cross entropy", ("_ce_",)))


def kernel_mix(kernels):
    """GPU ms per kind of kernel (summed durations, overlaps counted twice) and the costliest kernel names."""
    kinds, names = {}, {}
    for n, s, e in kernels:
        low = n.lower()
        kind = next((k for k, keys in KINDS if any(key in low for key in keys)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + (e - s) / 1e3
        names[n[:90]] = names.get(n[:90], 0.0) + (e - s) / 1e3
    return kinds, sorted(names.items(), key=lambda kv: -kv[1])[:20]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", default="", help="import nanopara from this directory (another commit's tree)")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("flags", nargs="*")
    args = ap.parse_args()
    if os.environ.get("NP_STACKS_AFTER"):  # a hang shows where every rank waits: stacks to stderr, then exit
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["NP_STACKS_AFTER"]), exit=True)
    root = os.path.abspath(args.tree or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, root)
    import torch
    import torch.distributed as dist
    from nanopara import cli as C
    from nanopara.mesh import Mesh
    from nanopara.model import GPT
    from nanopara import parallel as P
    parallelize = P.parallelize
    check_layout = getattr(P, "check_layout", None)  # (older trees: no micro-steps, no pipeline)
    pipeline_step = getattr(P, "pipeline_step", None)

    known = set(C._valid_keys(C.parse_args([]))) | {"preset"}
    flags = [f for f in args.flags if f.split("=")[0][2:] in known]
    dropped = sorted(set(args.flags) - set(flags))
    cfg = C.parse_args(flags)
    p, t = cfg.parallel, cfg.train
    ep = {"ep": p.ep} if hasattr(p, "ep") else {}  # (older trees have no expert parallel)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a gloo smoke run of the script (tests/test_bench.py)
    mesh = Mesh.build(p.dp, p.pp, p.cp, p.tp, dev, p.timeout_s, **ep)
    accum = check_layout(cfg, mesh.world, dev) if check_layout else 1  # micro-steps per step, as train.py's
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    n_params = model.num_params()
    engine = parallelize(model, mesh, cfg)
    pipe = getattr(engine, "pipeline", None)
    gen = torch.Generator().manual_seed(mesh.dp_rank)
    batches = []
    for _ in range(accum):
        x = torch.randint(0, cfg.model.vocab_size, (t.micro_batch, t.seq_len), generator=gen)
        batches.append((x, torch.roll(x, -1, 1)))
    on_gpu = [(x.to(mesh.device), y.to(mesh.device)) for x, y in batches] if pipe is None else []

    cuda = dev == "cuda"
    amp = lambda: torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda)  # noqa: E731
    graphed = None
    if getattr(t, "cuda_graph", False):  # train.cuda_graph: forward + backward replayed (graph.py)
        from nanopara.graph import GraphedMicroStep
        graphed = GraphedMicroStep(engine.model, amp, 1.0 / accum, engine)

    def step():
        if pipe is not None:  # the pipeline enters autocast itself (pp.py), once per step
            pipeline_step(engine, batches)
        for micro, (x, y) in enumerate(on_gpu):
            if graphed is not None:
                graphed(x, y)
            else:
                with engine.no_sync(micro < accum - 1):
                    with amp():
                        _, loss = engine.model(x, y)
                    engine.backward(loss.float() / accum)
        engine.step(1e-4)

    one = not dist.is_initialized()  # a one-GPU baseline: no process group

    def reduce_max(v):
        v = torch.tensor([v], device=mesh.device)
        if not one:
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return v.item()

    def barrier():
        if not one:
            dist.barrier()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if cuda:  # before the warm-up: a CUDA graph's private pool is allocated at capture, then never again
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        step()
    sync()
    barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    step_s = reduce_max((time.perf_counter() - t0) / args.steps)
    tok_s = accum * t.micro_batch * t.seq_len * mesh.dp / step_s
    flops = 6 * n_params + 12 * cfg.model.n_layer * cfg.model.n_embd * t.seq_len  # report.flops_per_token
    mfu = flops * tok_s / (mesh.world * 989e12)  # H100 / H200 dense bf16
    peak = reduce_max(torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0)

    from torch.profiler import ProfilerActivity, profile
    barrier()
    kernels = []
    if mesh.is_main and cuda:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            sync()
        kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        step()
        sync()
    barrier()
    if mesh.is_main:
        comm, exposed, busy, span = exposed_comm(kernels) if kernels else (0.0, 0.0, 0.0, 0.0)
        L = cfg.model.n_layer
        kinds, top = kernel_mix(kernels) if kernels else ({}, [])
        res = dict(label=args.label or ("old" if args.tree else "new"), tree=args.tree or ".", flags=flags,
                   dropped_flags=dropped, gpu=torch.cuda.get_device_name() if cuda else "cpu",
                   n_gpu=mesh.world, date=datetime.date.today().isoformat(), micro_steps=accum, step_ms=step_s * 1e3,
                   tokens_per_s=tok_s, mfu=mfu,
                   peak_mem_gb=peak, profiled_step_span_ms=span, compute_busy_ms=busy, comm_ms=comm,
                   exposed_comm_ms=exposed, comm_per_layer_ms=comm / L, exposed_per_layer_ms=exposed / L,
                   kernel_ms_by_kind=kinds, top_kernels_ms=top)
        print(f"{res['label']:>14}: {tok_s:10,.0f} tok/s  MFU {mfu * 100:4.1f}%  peak {peak:5.1f} GB | "
              f"profiled step {span:6.1f} ms, comm {comm:6.1f} ms, exposed {exposed:6.1f} ms "
              f"({exposed / L:5.2f} ms/layer)" + (f"  [dropped {dropped}]" if dropped else ""), flush=True)
        print(f"{'':>14}  kernel ms: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])),
              flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "layout.jsonl"), "a") as fh:
                fh.write(json.dumps(res) + "\n")
    barrier()
    if graphed is not None:
        graphed.close()  # (destroying the process group under a live graph with NCCL kernels hangs)
    if not one:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
