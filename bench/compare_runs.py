"""Two train.py runs of the same flags side by side: per-step loss difference, median tokens/s and peak memory.

    python bench/compare_runs.py DIR NAME [NAME ...]   # DIR/old_NAME and DIR/new_NAME hold each run's metrics.jsonl

One JSON line per NAME (GPU, date, both loss curves, tokens/s as the median of steps >= 3, the ratio new/old). Made
for before/after checks of a refactor on one machine in one run (bench/ab_train.sh); results/step_object_ab_h200.*.
"""
import json
import statistics
import sys

import harness as H


def rows(path: str) -> list[dict]:
    with open(f"{path}/metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "loss" in r and "tokens_per_s" in r]


def compare(a: list[dict], b: list[dict]) -> dict:
    tok = [statistics.median(r["tokens_per_s"] for r in x[3:] or x) for x in (a, b)]
    la, lb = [r["loss"] for r in a], [r["loss"] for r in b]
    return dict(steps=len(la), max_abs_loss_diff=max(abs(x - y) for x, y in zip(la, lb)), tok_s_old=round(tok[0]),
                tok_s_new=round(tok[1]), ratio=round(tok[1] / tok[0], 4),
                peak_mem_gb_old=max(r["peak_mem_gb"] for r in a), peak_mem_gb_new=max(r["peak_mem_gb"] for r in b),
                losses_old=la, losses_new=lb)


def main():
    root, names = sys.argv[1], sys.argv[2:]
    for name in names:
        print(json.dumps({**H.stamp(), "run": name, **compare(rows(f"{root}/old_{name}"), rows(f"{root}/new_{name}"))}))


if __name__ == "__main__":
    main()
