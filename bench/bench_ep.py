"""Expert parallel: gpt2_moe training throughput on 1 GPU, dpN (experts replicated) and epK (experts split) on N GPUs.

    torchrun --nproc_per_node=2 bench/bench_ep.py --out=F.jsonl                     (~2 minutes on 2 x H100)
    torchrun --nproc_per_node=4 bench/bench_ep.py --layouts=single,dp4,ep4,ep2 --out=F.jsonl
    torchrun --nproc_per_node=2 bench/bench_ep.py --capacity=1.0 --layouts=single,dp2,ep2,ep2c2,ep2f8 [--graph]
    torchrun --nproc_per_node=2 bench/bench_ep.py --device=cpu --preset=tiny_moe \\
        --micro_batch=2 --seq_len=64 --steps=2 --warmup=1                             (CPU smoke: the script runs)

Every layout runs train.py's step (parallel.parallelize -> Trainer: bf16 autocast, the MoE aux-loss factor and
expert-bias update) on synthetic tokens, the Triton kernels (model.kernels=auto: routing, permute and the grouped
GEMM), one micro-step per step of micro_batch x seq_len tokens per GPU:
  single  rank 0 alone (a one-process mesh; the other ranks wait at a barrier): the 1-GPU baseline
  dpN     DDP over the N GPUs, every expert on each (the baseline EP must beat on memory, and match on speed)
  epK     dp = N, ep = K: each GPU holds E/K of the experts of every MoE layer, K consecutive ranks form an ep
          group (ep2 on 4 GPUs is ep2 x dp2: two copies of each expert, reduced over "edp"); two all-to-alls
          per layer forward, two backward (ep.py); epKcJ: parallel.ep_chunks=J (capacity only; a2a not timed);
          epKf8: parallel.ep_fp8 (rows out in e4m3)
Per layout: tokens/s (global; the slowest rank's median step, each step timed alone; mean and max beside it: a
rank that autotunes a new row bucket of the grouped GEMM inside the timed steps shows as one slow step and stalls
its peer in the all-to-all), tokens/s per GPU, MFU on the active parameters (GPT.num_params: k/E of the experts),
peak memory, and the share of the step in the MoE layers' all-to-alls (CUDA events around them, ep layouts only;
it includes waiting for the slowest peer). Ratios: each epK's tokens/s per GPU over single's and dpN's. JSON lines
(one per layout, then the ratios) to --out. --profile: one step per layout profiled on rank 0 (GPU ms per kernel
kind, the costliest kernels).
"""
from __future__ import annotations

import argparse
import re

import torch
import torch.distributed as dist

import harness as H
from nanopara import ep as ep_mod
from nanopara.mesh import Mesh


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt2_moe", choices=sorted(H.PRESETS))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--kernels", default="auto", help="model.kernels: auto (Triton) | torch")
    ap.add_argument("--micro_batch", type=int, default=8)
    ap.add_argument("--capacity", type=float, default=None, help="model.moe_capacity (default: the preset's; > 0: "
                    "ep's fixed-size exchange, no host sync; 0: dropless, one split read per layer)")
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps (Triton autotuning happens here: the "
                    "received rows vary, and each new power-of-2 row bucket tunes the grouped GEMM once)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layouts", default="single,dp2,ep2")
    ap.add_argument("--out", default="", help="append JSON lines here")
    ap.add_argument("--profile", action="store_true", help="one profiled step per layout: GPU ms per kernel kind")
    ap.add_argument("--graph", action="store_true", help="single and dpN under a CUDA graph (train.cuda_graph=true: "
                    "needs --capacity > 0; ep layouts stay eager, expert parallel refuses graphs)")
    ap.add_argument("--reduce_dtype", default="fp32", help="parallel.reduce_dtype of dpN: fp32 | bf16")
    return ap.parse_args()


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
    """Warm-up, then timed steps (each alone); the slowest rank's numbers."""
    trainer, n_params = H.build_trainer(cfg, mesh)  # on the host: parallelize keeps this rank's experts
    batches = H.synthetic_batches(cfg, 1, mesh.device, seed=mesh.rank)

    def step():
        return H.train_step(trainer, batches)
    H.timed(step, 0, args.warmup, device=mesh.device)
    with A2ATimer(mesh.device.type == "cuda" and mesh.sizes.get("ep", 1) > 1) as a2a:
        t = H.timed(step, args.steps, mesh=mesh, each=True)
        a2a_ms = a2a.ms() / args.steps if a2a.pairs else 0.0
    rank_params, a2a_ms = H.max_over_ranks([sum(p.numel() for p in trainer.engine.params), a2a_ms], mesh)
    prof = H.kernel_summary(H.profile(step, mesh.device, on=mesh.rank == 0)) if args.profile else None
    trainer.close()
    trainer.engine.close()
    del trainer
    H.free()
    tr, world = cfg.train, mesh.world
    tps = tr.micro_batch * tr.seq_len * world / t["median_s"]
    if prof and mesh.rank == 0:
        print(H.summary_lines(prof, layout), flush=True)
    return {"layout": layout, "gpus": world, "micro_batch": tr.micro_batch, "seq_len": tr.seq_len,
            "step_ms": t["median_s"] * 1e3, "mean_step_ms": t["step_s"] * 1e3, "max_step_ms": t["max_s"] * 1e3,
            "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / world, "mfu": H.mfu(cfg, n_params, tps, world,
                                                                                  mesh.device),
            "active_params": n_params, "params_per_gpu": int(rank_params), "peak_gb": t["peak_gb"] or None,
            "a2a_share": a2a_ms / (t["step_s"] * 1e3) if a2a_ms else None, "profile": prof}


COLS = [("layout", "layout", ""), ("gpus", "gpus", "d"), ("step_ms", "step ms", ".1f"),
        ("mean_step_ms", "mean ms", ".1f"), ("max_step_ms", "max ms", ".1f"), ("tokens_per_s", "tok/s", ",.0f"),
        ("tokens_per_s_per_gpu", "tok/s/gpu", ",.0f"), ("mfu", "MFU", ".1%"), ("peak_gb", "peak GB", ".1f"),
        ("params_per_gpu", "params/gpu", ",d"), ("a2a_share", "a2a", ".1%")]


def main():
    args = parse()
    base = Mesh.build(dp=-1, device=args.device)  # the default process group, this rank's device
    N = base.world
    layouts = [f"dp{N}" if name == "dp2" and N != 2 else name for name in args.layouts.split(",")]
    for layout in layouts:
        m = re.fullmatch(r"ep(\d+)(c\d+)?(f8)?", layout)
        if not (layout in ("single", f"dp{N}") or (m and N % int(m[1]) == 0 and (m[2] is None or args.capacity))):
            raise SystemExit(f"bench_ep.py: layout {layout!r} on {N} GPUs: use single, dp{N}, epK with K dividing "
                             f"{N}, epKcJ (J pieces) with --capacity > 0, or epKf8 (FP8 dispatch)")
    H.printer(base)(H.banner(f"bench_ep {args.preset} B={args.micro_batch} T={args.seq_len} kernels={args.kernels}"
                             f" capacity={args.capacity}", base), flush=True)
    rows = []
    for layout in layouts:
        m = re.fullmatch(r"ep(\d+)(?:c(\d+))?(f8)?", layout)
        ep, chunks, fp8 = (int(m[1]), int(m[2] or 1), bool(m[3])) if m else (1, 1, False)
        over = {"model.kernels": args.kernels, "train.micro_batch": args.micro_batch, "train.seq_len": args.seq_len,
                "parallel.ep": ep, "parallel.ep_chunks": chunks, "parallel.ep_fp8": fp8,
                "parallel.reduce_dtype": args.reduce_dtype,
                "train.cuda_graph": "true" if args.graph and ep == 1 else "false"}
        if args.capacity is not None:
            over["model.moe_capacity"] = args.capacity
        cfg = H.make_cfg(args.preset, over)
        if layout == "single":
            if base.rank == 0:
                rows.append(run(cfg, H.solo_mesh(base.device), args, layout))
            dist.barrier()
            continue
        rows.append(run(cfg, Mesh.build(dp=N, device=args.device, ep=ep), args, layout))  # groups on the world
    if base.rank == 0:
        by = {r["layout"]: r for r in rows}
        ratios = {f"{name}_over_{ref}_per_gpu": by[name]["tokens_per_s_per_gpu"] / by[ref]["tokens_per_s_per_gpu"]
                  for name in by if name != "single" for ref in ("single", f"dp{N}") if ref in by and ref != name}
        print(H.table(rows, COLS))
        print("\n".join(f"{k}: {v:.3f}" for k, v in ratios.items()))
        H.append_jsonl(args.out, [dict(r, preset=args.preset, kernels=args.kernels, capacity=args.capacity,
                                       graph=args.graph and r["layout"] in ("single", f"dp{N}"),
                                       reduce_dtype=args.reduce_dtype)
                                  for r in rows] + [{"section": "ratios", "preset": args.preset, **ratios}])
    base.destroy()


if __name__ == "__main__":
    main()
