"""Training throughput with checkpoints: none, blocking saves, asynchronous saves (nanopara/async_save.py).

    python bench/bench_ckpt.py [--preset gpt_1b] [--every 50] [--periods 3] [--modes none,blocking,async,none]
                               [--each] [--profile] [--ckpt_dir D] [--out F] [-- FLAGS]

train.py's step (config -> GPT -> parallelize -> Trainer: bf16 autocast, fused AdamW) on synthetic tokens, 32 x
1,024 tokens a step by default, one trainer for every mode (the same model and memory). After --warmup steps, the
--modes in order: `none` runs --base_periods x --every steps (first and last: drift shows as their difference);
`blocking` and `async` run --periods x --every steps with a checkpoint every --every steps
(checkpoint.save_training, keep=1: at most two on disk), the first one --every/2 steps in, so the window holds
whole periods. Each mode checks that every checkpoint was published, in order. Two rates per row, both against
the mean of the `none` rows: over the steps (what a long run sees: each save's held time and any wait for the
previous write are inside the steps), and with the final wait for the last background write added (paid once per
run, at its end; in this short window it weighs ~periods times more than in a run of 1,000s of steps). Also:
seconds each save held the training thread (the whole write when blocking; the snapshot when async), checkpoint
GB; the writer's own lines say how long each background write took. --each syncs and times every step and gives
the median step with a background write in flight and without; async pins its host buffers first (train.py: after
step 1; `reserve_s`). --profile: the kernels of one step of each mode
(async: with a write in flight), GPU-busy share and kinds. On CPU: a smoke run (tests/test_async_ckpt.py).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import torch

import harness as H
from nanopara import async_save, checkpoint
from nanopara.mesh import Mesh


class _Position:
    """The loader's part of a checkpoint (synthetic tokens: only a counter)."""

    def __init__(self):
        self.sample = 0

    def state_dict(self) -> dict:
        return {"sample": self.sample}


def run_mode(mode: str, args, cfg, mesh, trainer, batches, steps: int) -> dict:
    out_dir = os.path.join(args.ckpt_dir, mode)
    shutil.rmtree(out_dir, ignore_errors=True)
    pos, held, saved, each = _Position(), [], [], {"writing": [], "idle": []}
    writer = async_save.writer_for(out_dir)
    # as train.py does after its first step: the host buffers pinned before the clock starts (once a run)
    reserve_s = async_save.reserve(trainer.state_dict(), writer) if mode == "async" else 0.0
    H.sync(mesh.device)
    t0 = t_mark = time.perf_counter()
    profiles = {}
    for i in range(1, steps + 1):
        if args.profile and i == args.every // 2 + 3:  # a few steps after the first save: its write in flight
            label = "writing" if writer.busy() else "idle"
            profiles[label] = H.kernel_summary(H.profile(lambda: H.train_step(trainer, batches), mesh.device))
            print(H.summary_lines(profiles[label], f"{mode} step {i}, {label}"), flush=True)
        else:
            H.train_step(trainer, batches)
        pos.sample += trainer.accum * cfg.train.micro_batch
        if args.each:  # each step synced and timed, filed by whether a background write was in flight at its end
            H.sync(mesh.device)
            now = time.perf_counter()
            each["writing" if writer.busy() else "idle"].append(1e3 * (now - t_mark))
        if mode != "none" and (i - args.every // 2) % args.every == 0:
            t1 = time.perf_counter()
            checkpoint.save_training(out_dir, i, mesh, trainer, pos, {"config": cfg.to_dict()}, keep=1,
                                     background=mode == "async")
            held.append(time.perf_counter() - t1)
            t_mark = time.perf_counter()  # the next step's time starts after the save's held time
            published = checkpoint.latest(out_dir, checksums=False)  # async: the previous save's, now published
            if mode == "blocking" or saved:
                want = i if mode == "blocking" else saved[-1]
                assert (published or "").endswith(f"step_{want:06d}"), f"{mode}: step {want} unpublished ({published})"
            saved.append(i)
        elif args.each:
            t_mark = time.perf_counter()
    H.sync(mesh.device)
    t_steps = time.perf_counter() - t0
    failure = async_save.drain(out_dir, release=True)
    t_all = time.perf_counter() - t0
    assert failure is None, failure
    if saved:
        assert checkpoint.latest(out_dir).endswith(f"step_{saved[-1]:06d}"), "the last checkpoint was not published"
    gb = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out_dir) for f in fs) / 1e9 if saved else 0
    shutil.rmtree(out_dir, ignore_errors=True)
    tokens = steps * trainer.accum * cfg.train.micro_batch * cfg.train.seq_len
    return {"mode": mode, "preset": cfg.preset, "steps": steps, "every": args.every, "saves": len(saved),
            "tokens_per_s": tokens / t_all, "tokens_per_s_steps": tokens / t_steps, "step_ms": 1e3 * t_steps / steps,
            "drain_s": t_all - t_steps, "held_s": held, "held_mean_s": sum(held) / len(held) if held else 0.0,
            "reserve_s": reserve_s, "ckpt_gb": gb,
            "tokens_per_step": trainer.accum * cfg.train.micro_batch * cfg.train.seq_len,
            **({f"profile_{k}": v for k, v in profiles.items()}),
            **({f"step_ms_{k}": v for k, v in each.items()} if args.each else {}),
            **({f"median_step_ms_{k}": statistics.median(v) for k, v in each.items() if v} if args.each else {})}


COLS = [("mode", "mode", ""), ("steps", "steps", "d"), ("saves", "saves", "d"), ("step_ms", "ms/step", ".1f"),
        ("tokens_per_s_steps", "tok/s", ",.0f"), ("vs_none_steps", "vs none", ".3f"),
        ("held_mean_s", "held s/save", ".2f"), ("drain_s", "final wait s", ".2f"),
        ("tokens_per_s", "tok/s with it", ",.0f"), ("vs_none", "vs none with it", ".3f"), ("ckpt_gb", "ckpt GB", ".2f"),
        ("median_step_ms_idle", "idle ms", ".1f"), ("median_step_ms_writing", "writing ms", ".1f")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt_1b", choices=sorted(H.PRESETS))
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu (a smoke run)")
    ap.add_argument("--every", type=int, default=50, help="steps between checkpoints")
    ap.add_argument("--periods", type=int, default=3, help="checkpoints per checkpointing mode")
    ap.add_argument("--base_periods", type=int, default=1, help="--every-step periods of the mode without them")
    ap.add_argument("--modes", default="none,blocking,async,none", help="in this order; `none` rows are the baseline")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--each", action="store_true", help="sync and time every step: median step ms with a background "
                                                        "write in flight and without (columns `writing`, `idle`)")
    ap.add_argument("--profile", action="store_true", help="profile one step of each mode a few steps after its "
                                                           "first save (async: a write in flight): GPU busy share")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro_batch", type=int, default=8)
    ap.add_argument("--tokens_per_step", type=int, default=32768)
    ap.add_argument("--ckpt_dir", default="runs/bench_ckpt", help="checkpoints go here (on the disk to measure)")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    ap.add_argument("flags", nargs="*", help="more of train.py's --key=value flags (e.g. a smaller model)")
    args = ap.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = H.make_cfg(args.preset, {"device": device, "train.seq_len": args.seq, "train.micro_batch": args.micro_batch,
                                   "train.tokens_per_step": args.tokens_per_step, "train.steps": 10 ** 9,
                                   **dict(f.lstrip("-").split("=", 1) for f in args.flags)})
    mesh = Mesh.build(device=device)
    print(H.banner(f"bench_ckpt {args.preset} {args.tokens_per_step:,} tokens/step, a checkpoint every "
                   f"{args.every} steps", mesh), flush=True)
    trainer, _ = H.build_trainer(cfg, mesh)
    batches = H.synthetic_batches(cfg, trainer.accum, mesh.device)
    for _ in range(args.warmup):
        H.train_step(trainer, batches)
    rows = []
    for mode in args.modes.split(","):
        periods = args.base_periods if mode == "none" else args.periods
        rows.append(run_mode(mode, args, cfg, mesh, trainer, batches, periods * args.every))
        print(H.table(rows[-1:], COLS[:5] + COLS[6:8]), flush=True)
    none = [r for r in rows if r["mode"] == "none"]
    for key in ("tokens_per_s", "tokens_per_s_steps"):  # against the mean of the `none` rows (before and after)
        base = sum(r[key] for r in none) / len(none) if none else float("nan")
        for r in rows:
            r[key.replace("tokens_per_s", "vs_none")] = r[key] / base
    print("\n" + H.table(rows, COLS), flush=True)
    H.append_jsonl(args.out, rows)
    trainer.close()
    mesh.destroy()
    return rows


if __name__ == "__main__":
    main()
