"""Loss curve of a run: `python bench/plot.py RUN_DIR [--out FILE.png]` reads RUN_DIR/metrics.jsonl.

Training loss (raw and smoothed) and validation loss against tokens seen (if tokens are known) or steps.
`python bench/plot.py DIR/post_train.jsonl` (bench/post_train_demo.py's results, one a line; `--index` picks the
line, default the last) draws SFT's held-out exact match by SFT step, then RL's held-out exact match and training
reward by RL step.
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
    ap.add_argument("--index", type=int, default=-1, help="post_train .jsonl: the record to draw")
    args = ap.parse_args()
    if args.run.endswith((".json", ".jsonl")) and not args.run.endswith("metrics.jsonl"):
        return plot_post_train(args)
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


def plot_post_train(args):
    """Two panels: the SFT-alone curve, then every RL run of the record (held-out exact match and train reward)."""
    import json
    with open(args.run) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    rec = recs[args.index] if args.run.endswith(".jsonl") else recs[0]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    sft = rec["sft_curve"]
    a1.plot([c["step"] for c in sft], [100 * c["test_exact_match"] for c in sft], "o-", color="tab:gray",
            label="SFT alone: held-out exact match")
    a1.axvline(rec["rl_from_step"], color="tab:green", ls=":", label=f"RL starts (step {rec['rl_from_step']})")
    a1.set_xlabel("SFT step")
    a1.set_ylabel("% of prompts")
    for r in rec["rl_runs"]:
        c = r["curve"]
        a2.plot([x["step"] for x in c], [100 * x["test_exact_match"] for x in c], "o-",
                label=f"RL lr {r['lr']:g}: held-out exact match")
        rw, ema, sm = r["reward"], None, []
        for x in rw:
            ema = x["reward"] if ema is None else 0.95 * ema + 0.05 * x["reward"]
            sm.append(100 * ema)
        a2.plot([x["step"] for x in rw], sm, lw=1.2, alpha=0.8, label=f"RL lr {r['lr']:g}: train reward (EMA 0.95)")
    a2.axhline(100 * rec["sft_final_exact_match"], color="tab:gray", ls="--", label="SFT alone, last step")
    a2.set_xlabel("RL step")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(args.title or f"{rec['task']}: SFT on {rec['train_examples']:,} examples, then GRPO "
                 f"({rec['gpu']}, {rec['date'][:10]})", fontsize=10)
    out = args.out or os.path.splitext(args.run)[0] + ".png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
