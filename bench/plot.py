"""Loss curve of a run: `python bench/plot.py RUN_DIR [--out FILE.png]` reads RUN_DIR/metrics.jsonl.

Training loss (raw and smoothed) and validation loss against tokens seen (if tokens are known) or steps.
Needs matplotlib (the optional `plot` extra: `pip install matplotlib`; `make plot` installs it when missing).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanopara.report import read_metrics  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run", help="run directory holding metrics.jsonl (or the .jsonl file itself)")
    ap.add_argument("--out", default=None, help="PNG path (default RUN/loss.png)")
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    path = args.run if args.run.endswith(".jsonl") else os.path.join(args.run, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"error: no metrics file at {path}")
    steps, vals = read_metrics(path)  # a resumed run's records replace the abandoned ones
    train = [(r["step"], r["loss"]) for r in steps if r["loss"] == r["loss"]]
    val = [(r["step"], r["val_loss"]) for r in vals]
    if not train:
        raise SystemExit(f"error: {path} has no training loss lines")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps, losses = zip(*train)
    smooth, ema = [], None
    for v in losses:
        ema = v if ema is None else 0.95 * ema + 0.05 * v
        smooth.append(ema)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(steps, losses, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
    ax.plot(steps, smooth, color="tab:blue", lw=1.6, label="train (EMA 0.95)")
    if val:
        ax.plot(*zip(*val), "o-", color="tab:orange", ms=3, label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_ylim(min(losses) - 0.3, min(max(losses), 11.0) + 0.2)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(args.title or os.path.basename(os.path.dirname(os.path.abspath(path))))
    out = args.out or os.path.join(os.path.dirname(path), "loss.png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
