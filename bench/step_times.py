"""Summarise train.py runs: median and mean step time (and tokens/s) from each run's metrics.jsonl.

    python bench/step_times.py [--skip 5] RUN_DIR...

The first --skip steps (compilation, allocator warm-up) are left out. The median is robust to the host stalls of
tens of ms that hit a few steps of any process on the GPU machines; the mean is what a run's wall time sees.
"""
from __future__ import annotations

import argparse
import json
import os


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args()
    for run in args.runs:
        with open(os.path.join(run, "metrics.jsonl")) as f:
            recs = [r for r in map(json.loads, f) if "step_time_s" in r][args.skip:]
        if not recs:
            print(f"{run}: no timed steps")
            continue
        last = recs[-1]["step_time_s"] * 1e3  # a step read before it finished would show here as ~0
        t = sorted(r["step_time_s"] * 1e3 for r in recs)
        tok = recs[0]["tokens_per_s"] * recs[0]["step_time_s"]  # tokens per step
        med, mean = t[len(t) // 2], sum(t) / len(t)
        print(f"{run}: {len(t)} steps, step ms median {med:.2f} mean {mean:.2f} min {t[0]:.2f} last {last:.2f} | "
              f"tok/s at the median {tok / med * 1e3:,.0f}, at the mean {tok / mean * 1e3:,.0f}")


if __name__ == "__main__":
    main()
