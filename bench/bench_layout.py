"""Any train.py layout's training step: tokens/s, MFU, peak memory, GPU-busy share and exposed communication.

    torchrun --nproc_per_node=N bench/bench_layout.py [--label NAME] [--out F.jsonl] [--baseline LABEL] -- FLAGS
    e.g. -- --preset=gpt_1b --train.micro_batch=8 --parallel.tp=2 --parallel.pp=2 --train.tokens_per_step=65536

The run is train.py's: the same flags make the Config, then Mesh, GPT, parallel.parallelize and the Trainer's
forward_backward + step (micro-steps, pipeline schedule, CUDA graph, FP8 and MoE hooks as training runs them), on
synthetic tokens. --warmup steps, then --steps timed ones: tokens/s of the slowest rank, MFU over all GPUs
(report.flops_per_token: a MoE counts its active parameters), peak memory of the fullest GPU. Then one step
profiled on rank 0 (bench/harness.py): its GPU-busy share, comm (the NCCL kernels' time), exposed comm (the part
of it that no compute kernel overlaps: what the step waits on communication; per step and per layer), GPU ms per
kernel kind and the costliest kernels. --baseline LABEL: this run's tokens/s per GPU over that of the row with
that label in --out (e.g. the one-GPU run of the same preset), the layout's scaling. One JSON line per run,
appended to --out (bench/run_set.py's `layouts` set runs one per layout). On CPU (gloo, fp32): a smoke run.
An older commit is measured with that commit's own copy of this script.
"""
from __future__ import annotations

import argparse
import os

import harness as H
from nanopara.mesh import Mesh


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="", help="append the row (JSON line) to this file")
    ap.add_argument("--baseline", default="", help="label of a row in --out: tokens/s per GPU against it")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("flags", nargs="*", help="train.py's --key=value flags")
    return ap.parse_args()


def row_of(args, cfg, mesh, trainer, n_params, t, prof) -> dict:
    tr, L = cfg.train, cfg.model.n_layer
    tok_s = trainer.accum * tr.micro_batch * tr.seq_len * mesh.dp / t["step_s"]
    row = dict(label=args.label or "layout", preset=cfg.preset, flags=args.flags, n_gpu=mesh.world,
               layout={k: mesh.sizes.get(k, 1) for k in ("dp", "tp", "pp", "cp", "ep")}, micro_steps=trainer.accum,
               step_ms=t["step_s"] * 1e3, tokens_per_s=tok_s, mfu=H.mfu(cfg, n_params, tok_s, mesh.world, mesh.device),
               peak_mem_gb=t["peak_gb"], profiled_step_span_ms=prof["span_ms"], **{k: prof[k] for k in (
                   "busy_ms", "gpu_busy_share", "comm_ms", "exposed_comm_ms", "kernel_ms_by_kind", "top_kernels_ms")},
               comm_per_layer_ms=prof["comm_ms"] / L, exposed_per_layer_ms=prof["exposed_comm_ms"] / L)
    base = [r for r in (H.read_jsonl(args.out) if args.baseline and os.path.exists(args.out) else [])
            if r.get("label") == args.baseline]
    if base:  # the last row of that label: tokens/s per GPU against it (none yet: no ratio)
        row.update(baseline=args.baseline, per_gpu_vs_baseline=(tok_s / mesh.world)
                   / (base[-1]["tokens_per_s"] / base[-1]["n_gpu"]))
    return row


COLS = [("label", "layout", ""), ("n_gpu", "GPUs", "d"), ("micro_steps", "micro", "d"), ("step_ms", "step ms", ".1f"),
        ("tokens_per_s", "tok/s", ",.0f"), ("per_gpu_vs_baseline", "per GPU vs base", ".3f"), ("mfu", "MFU", ".1%"),
        ("peak_mem_gb", "peak GB", ".1f"), ("gpu_busy_share", "GPU busy", ".1%"), ("comm_ms", "comm ms", ".1f"),
        ("exposed_comm_ms", "exposed ms", ".1f"), ("exposed_per_layer_ms", "exposed/layer", ".2f")]


def main():
    args = parse()
    cfg = H.parse_args(args.flags)
    p = cfg.parallel
    mesh = Mesh.build(p.dp, p.pp, p.cp, p.tp, cfg.device, p.timeout_s, ep=p.ep)
    trainer, n_params = H.build_trainer(cfg, mesh)
    batches = H.synthetic_batches(cfg, trainer.accum, mesh.device, seed=mesh.dp_rank)

    def step():
        return H.train_step(trainer, batches)
    t = H.timed(step, args.steps, args.warmup, mesh=mesh, peak_from_start=True)  # (a CUDA graph's pool: at capture)
    prof = H.kernel_summary(H.profile(step, mesh.device, on=mesh.is_main))
    if mesh.is_main:
        row = row_of(args, cfg, mesh, trainer, n_params, t, prof)
        print(H.banner(f"bench_layout {cfg.preset} {' '.join(args.flags)}", mesh))
        print(H.table([row], COLS))
        print("  kernel ms: " + ", ".join(f"{k} {v:.1f}" for k, v in row["kernel_ms_by_kind"].items()), flush=True)
        H.append_jsonl(args.out, row)
    trainer.close()  # before the process group goes: a captured NCCL kernel blocks its destruction
    mesh.destroy()


if __name__ == "__main__":
    main()
