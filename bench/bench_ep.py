"""Expert parallel: gpt2_moe training throughput on 1 GPU, dp2 (experts replicated) and ep2 (experts split) on 2 GPUs.

    torchrun --nproc_per_node=2 bench/bench_ep.py --out=$OUT/ep                       (~2 minutes on 2 x H100)
    torchrun --nproc_per_node=2 bench/bench_ep.py --device=cpu --preset=tiny_moe \\
        --micro_batch=2 --seq_len=64 --steps=2 --warmup=1 --out=/tmp/ep                 (CPU smoke: the script runs)

Every layout runs the trainer's own path (parallel.parallelize, engine.backward, engine.step) on synthetic tokens,
bf16 autocast, the Triton kernels (model.kernels=auto: routing, permute and the grouped GEMM), one micro-step per
step of micro_batch x seq_len tokens per GPU:
  single  rank 0 alone (a one-process mesh; rank 1 waits at a barrier): the 1-GPU baseline
  dp2     DDP over both GPUs, every expert on each (the baseline EP must beat on memory, and match on speed)
  ep2     dp = ep = 2: each GPU holds 4 of the 8 experts of every MoE layer; two all-to-alls per layer forward,
          two backward (ep.py)
Per layout: tokens/s (global; the slowest rank's median step, each step timed alone; mean and max step beside it:
a rank that autotunes a new row bucket of the grouped GEMM inside the timed steps shows as one slow step and
stalls its peer in the all-to-all), tokens/s per GPU, MFU on the active parameters
(GPT.num_params: k/E of the experts; 6N + attention FLOPs per token over 989 TFLOP/s per H100), peak memory,
and the share of the step spent in the MoE layers' all-to-alls (CUDA events around them, ep2 only).
Ratios: ep2 per-GPU tokens/s over single's and over dp2's. One JSON file `ep.json` (GPU, date, rows) under --out.
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
from nanopara.config import PRESETS  # noqa: E402
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
    return ap.parse_args()


def make_cfg(args, layout: str):
    cfg = PRESETS[args.preset]()
    cfg.device, cfg.model.kernels = args.device, args.kernels
    cfg.train.dtype = "bf16" if args.device == "cuda" else "fp32"
    cfg.train.micro_batch, cfg.train.seq_len, cfg.train.tokens_per_step = args.micro_batch, args.seq_len, 0
    cfg.parallel.dp = 1 if layout == "single" else 2
    cfg.parallel.ep = 2 if layout == "ep2" else 1
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


def run(cfg, mesh, args) -> dict:
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
    if base.world != 2:
        raise SystemExit(f"bench_ep.py compares 1 and 2 GPUs: run it under torchrun --nproc_per_node=2 "
                         f"(world is {base.world})")
    rows = []
    for layout in args.layouts.split(","):
        cfg = make_cfg(args, layout)
        if layout == "single":
            if base.rank == 0:
                rows.append(summarize(cfg, layout, [run(cfg, one_process_mesh(base.device), args)], 1, base.device))
            dist.barrier()
            continue
        mesh = Mesh.build(dp=2, device=args.device, ep=cfg.parallel.ep)  # new groups on the same default group
        ranks = [None] * mesh.world
        dist.all_gather_object(ranks, run(cfg, mesh, args))
        if mesh.rank == 0:
            rows.append(summarize(cfg, layout, ranks, mesh.world, mesh.device))
    mesh = base
    if mesh.rank == 0:
        by = {r["layout"]: r for r in rows}
        ratios = {}
        if "ep2" in by:
            for base in ("single", "dp2"):
                if base in by:
                    ratios[f"ep2_over_{base}_per_gpu"] = (by["ep2"]["tokens_per_s_per_gpu"]
                                                          / by[base]["tokens_per_s_per_gpu"])
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
