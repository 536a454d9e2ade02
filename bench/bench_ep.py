"""Expert parallel: gpt2_moe training throughput on 1 GPU, dpN (experts replicated) and epK (experts split) on N GPUs.

    torchrun --nproc_per_node=2 bench/bench_ep.py --out=$OUT/ep                       (~2 minutes on 2 x H100)
    torchrun --nproc_per_node=4 bench/bench_ep.py --layouts=single,dp4,ep4,ep2 --out=$OUT/ep4
    torchrun --nproc_per_node=2 bench/bench_ep.py --device=cpu --preset=tiny_moe \\
        --micro_batch=2 --seq_len=64 --steps=2 --warmup=1 --out=/tmp/ep                 (CPU smoke: the script runs)

Every layout runs the trainer's own path (parallel.parallelize, engine.backward, engine.step) on synthetic tokens,
bf16 autocast, the Triton kernels (model.kernels=auto: routing, permute and the grouped GEMM), one micro-step per
step of micro_batch x seq_len tokens per GPU:
  single  rank 0 alone (a one-process mesh; the other ranks wait at a barrier): the 1-GPU baseline
  dpN     DDP over the N GPUs, every expert on each (the baseline EP must beat on memory, and match on speed)
  epK     dp = N, ep = K: each GPU holds E/K of the experts of every MoE layer, K consecutive ranks form an ep
          group (ep4 on 4 GPUs; ep2 on 4 GPUs is ep2 x dp2: two copies of each expert, reduced over "edp");
          two all-to-alls per layer forward, two backward (ep.py)
Per layout: tokens/s (global; the slowest rank's median step, each step timed alone; mean and max step beside it:
a rank that autotunes a new row bucket of the grouped GEMM inside the timed steps shows as one slow step and
stalls its peer in the all-to-all), tokens/s per GPU, MFU on the active parameters
(GPT.num_params: k/E of the experts; 6N + attention FLOPs per token over 989 TFLOP/s per H100), peak memory,
and the share of the step spent in the MoE layers' all-to-alls (CUDA events around them, ep layouts only: it includes
waiting for the slowest peer). Ratios: each epK's per-GPU tokens/s over single's and over dpN's. One JSON file
`ep.json` (GPU, date, rows) under --out. --profile: one profiled step per layout on rank 0, its top GPU kernels and
host ops in DIR/profile_<layout>.txt (where an ep step's time goes).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanopara import ep as ep_mod  # noqa: E402
from nanopara.presets import PRESETS  # noqa: E402
from nanopara.mesh import Mesh, grid_coords  # noqa: E402
from nanopara.model import GPT  # noqa: E402
from nanopara.parallel import parallelize  # noqa: E402
from nanopara.report import flops_per_token, peak_flops  # noqa: E402

GB = 1e9


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt2_moe", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--kernels", default="auto", help="model.kernels: auto (Triton) | torch")
    ap.add_argument("--micro_batch", type=int, default=8)
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps (Triton autotuning happens here: the "
                    "received rows vary, and each new power-of-2 row bucket tunes the grouped GEMM once)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layouts", default="single,dp2,ep2")
    ap.add_argument("--out", required=True, help="directory for ep.json")
    ap.add_argument("--profile", action="store_true", help="top kernels / host ops of one step per layout")
    return ap.parse_args()


def make_cfg(args, layout: str, world: int):
    cfg = PRESETS[args.preset]()
    cfg.device, cfg.model.kernels = args.device, args.kernels
    cfg.train.dtype = "bf16" if args.device == "cuda" else "fp32"
    cfg.train.micro_batch, cfg.train.seq_len, cfg.train.tokens_per_step = args.micro_batch, args.seq_len, 0
    cfg.parallel.dp = 1 if layout == "single" else world
    cfg.parallel.ep = int(layout[2:]) if layout.startswith("ep") else 1
    cfg.check()
    return cfg


def one_process_mesh(device) -> Mesh:
    """A world-1 mesh inside the torchrun job (no groups): the single-GPU baseline on rank 0."""
    sizes = {"pp": 1, "dp": 1, "cp": 1, "tp": 1}
    mesh = Mesh(0, 1, 0, device, sizes, grid_coords(0, sizes))
    mesh._make_groups()
    return mesh


class A2ATimer:
    """CUDA events around every all-to-all of the ep path (ep.all_to_all patched for the run)."""

    def __init__(self, on: bool):
        self.on, self.pairs, self.orig = on, [], ep_mod.all_to_all

    def __enter__(self):
        if self.on:
            def timed(*a, **k):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = self.orig(*a, **k)
                e.record()
                self.pairs.append((s, e))
                return out
            ep_mod.all_to_all = timed
        return self

    def __exit__(self, *exc):
        ep_mod.all_to_all = self.orig

    def ms(self) -> float:
        return sum(s.elapsed_time(e) for s, e in self.pairs)


def run(cfg, mesh, args, layout: str) -> dict:
    """Warm-up, then timed steps; this rank's numbers."""
    dev = mesh.device
    torch.manual_seed(1337)
    model = GPT(cfg.model)  # on the host: parallelize keeps this rank's experts before moving to the GPU
    n_params = model.num_params()
    engine = parallelize(model, mesh, cfg)
    g = torch.Generator().manual_seed(mesh.rank)
    tok = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.train.seq_len + 1), generator=g)
    x, y = tok[:, :-1].to(dev), tok[:, 1:].to(dev)
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if dev.type == "cuda" else contextlib.nullcontext

    def step():
        with amp():
            _, loss = engine.model(x, y)
        engine.backward(loss.float())
        return engine.step(1e-4, sync=False)

    for _ in range(args.warmup):
        step()
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    with A2ATimer(dev.type == "cuda" and mesh.sizes.get("ep", 1) > 1) as a2a:
        times = []  # per step: a one-time cost (an autotune of a new row bucket) shows as one slow step
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            sync(dev)
            times.append(time.perf_counter() - t0)
        step_s = sorted(times)[len(times) // 2]  # the median step
        a2a_ms = a2a.ms() / args.steps if a2a.pairs else None
    if args.profile:
        profile_step(step, dev, mesh, os.path.join(args.out, f"profile_{layout}.txt"))
    rec = {"step_s": step_s, "mean_step_s": sum(times) / len(times), "max_step_s": max(times), "a2a_ms": a2a_ms,
           "n_params": n_params,
           "rank_params": sum(p.numel() for p in engine.params),
           "peak_gb": torch.cuda.max_memory_allocated(dev) / GB if dev.type == "cuda" else None}
    engine.close()
    del engine, model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def profile_step(step, dev, mesh, path):
    """One step under torch.profiler on every rank; rank 0 writes its top GPU kernels and host ops."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        sync(dev)
    if mesh.rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        by = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
        with open(path, "w") as f:
            f.write(prof.key_averages().table(sort_by=by, row_limit=30) + "\n")
            f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30) + "\n")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def summarize(cfg, layout: str, ranks: list, world: int, device) -> dict:
    t = cfg.train
    step_s = max(r["step_s"] for r in ranks)
    tokens = t.micro_batch * t.seq_len * world
    tps = tokens / step_s
    peak = peak_flops(device)
    mfu = tps * flops_per_token(cfg.model, ranks[0]["n_params"], t.seq_len) / (peak * world) if peak else None
    a2a = [r["a2a_ms"] for r in ranks if r["a2a_ms"] is not None]
    return {"layout": layout, "gpus": world, "micro_batch": t.micro_batch, "seq_len": t.seq_len,
            "step_ms": step_s * 1e3, "mean_step_ms": max(r["mean_step_s"] for r in ranks) * 1e3,
            "max_step_ms": max(r["max_step_s"] for r in ranks) * 1e3, "tokens_per_s": tps,
            "tokens_per_s_per_gpu": tps / world, "mfu": mfu,
            "active_params": ranks[0]["n_params"], "params_per_gpu": max(r["rank_params"] for r in ranks),
            "peak_gb": max(r["peak_gb"] or 0 for r in ranks) or None,
            "a2a_share": (max(a2a) / (max(r["mean_step_s"] for r in ranks) * 1e3)) if a2a else None}


def main():
    args = parse()
    base = Mesh.build(dp=-1, device=args.device)  # the default process group, this rank's device
    N = base.world
    layouts = [f"dp{N}" if name == "dp2" and N != 2 else name for name in args.layouts.split(",")]
    for layout in layouts:
        if not (layout == "single" or layout == f"dp{N}" or (layout[:2] == "ep" and layout[2:].isdigit()
                                                              and N % int(layout[2:]) == 0)):
            raise SystemExit(f"bench_ep.py: layout {layout!r} on {N} GPUs: use single, dp{N}, or epK with K "
                             f"dividing {N}")
    rows = []
    for layout in layouts:
        cfg = make_cfg(args, layout, N)
        if layout == "single":
            if base.rank == 0:
                rows.append(summarize(cfg, layout, [run(cfg, one_process_mesh(base.device), args, layout)], 1,
                                      base.device))
            dist.barrier()
            continue
        mesh = Mesh.build(dp=N, device=args.device, ep=cfg.parallel.ep)  # new groups on the same default group
        ranks = [None] * mesh.world
        dist.all_gather_object(ranks, run(cfg, mesh, args, layout))
        if mesh.rank == 0:
            rows.append(summarize(cfg, layout, ranks, mesh.world, mesh.device))
    mesh = base
    if mesh.rank == 0:
        by = {r["layout"]: r for r in rows}
        ratios = {}
        for name in (n for n in by if n.startswith("ep")):
            for ref in ("single", f"dp{N}"):
                if ref in by:
                    ratios[f"{name}_over_{ref}_per_gpu"] = (by[name]["tokens_per_s_per_gpu"]
                                                            / by[ref]["tokens_per_s_per_gpu"])
        out = {"bench": "ep", "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "torch": torch.__version__, "preset": args.preset, "kernels": args.kernels, "rows": rows,
               "ratios": ratios}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ep.json"), "w") as f:
            json.dump(out, f, indent=1)
        print(f"{'layout':8s} {'gpus':>4s} {'step ms':>8s} {'mean/max':>13s} {'tok/s':>10s} {'tok/s/gpu':>10s} "
              f"{'MFU':>6s} "
              f"{'peak GB':>8s} {'params/gpu':>11s} {'a2a':>6s}")
        for r in rows:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] else "-"
            peak = f"{r['peak_gb']:.1f}" if r["peak_gb"] else "-"
            a2a = f"{r['a2a_share']:.1%}" if r["a2a_share"] is not None else "-"
            print(f"{r['layout']:8s} {r['gpus']:4d} {r['step_ms']:8.1f} "
                  f"{r['mean_step_ms']:6.1f}/{r['max_step_ms']:6.1f} {r['tokens_per_s']:10.0f} "
                  f"{r['tokens_per_s_per_gpu']:10.0f} {mfu:>6s} {peak:>8s} {r['params_per_gpu'] / 1e6:10.1f}M "
                  f"{a2a:>6s}")
        for k, v in ratios.items():
            print(f"{k}: {v:.3f}")
    mesh.destroy()


if __name__ == "__main__":
    main()
