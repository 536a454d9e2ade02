"""MoE against dense on the book corpus at equal tokens, several seeds, runs sharing one GPU (issue #44 item 5).

    python3 bench/moe_books.py --out=DIR [--arms=dense,fine] [--seeds=1337,2,3] [--jobs=6] [--steps=1500]
                               [--data=books] [--limit=N] [--extra='more train.py flags']   (the CPU test's)

Each (arm, seed) is `train.py --data.dataset=books` with the same flags (micro-batch 8, 16,384 tokens a step, lr
1.2e-3, warm-up 200, a CUDA graph) and its seed, then `eval.py --tasks=loss` on the whole validation split;
--jobs of them at once, one process each, on the visible GPUs in turn (a loss comparison: runs beside each other
change its speed, never its numbers). Arms: dense = gpt2_124m, fine = gpt2_moe_fine (the same active FLOPs a
token), moe = gpt2_moe. Output: DIR/<arm>_<seed>/ (the run), DIR/moe_books.jsonl (one row per run: held-out loss,
median tok/s and MFU of the run's steps, peak memory; then one summary row), DIR/moe_books.png (validation loss by
step, when matplotlib is there) and the table on stdout. The goal's test: the MoE arm's mean below dense's by more
than their pooled standard deviation, sqrt((s_moe^2 + s_dense^2) / 2), sample std over the seeds.
Offline data: NANOPARA_MIRROR (data/prepare.py books prepares it first).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import subprocess
import sys

import harness as H
from nanopara.report import read_metrics

ROOT = H.ROOT
ARMS = {"dense": ["--preset=gpt2_124m"], "fine": ["--preset=gpt2_moe_fine"], "moe": ["--preset=gpt2_moe"]}
COMMON = ["--train.micro_batch=8", "--train.tokens_per_step=16384", "--train.lr=1.2e-3",
          "--train.warmup_steps=200", "--train.val_every=250", "--train.log_every=50", "--train.cuda_graph=true",
          "--overwrite=true"]


def run_one(a, arm: str, seed: int, gpu: int) -> dict:
    """Train then score one (arm, seed); a failure costs its own row only."""
    run = os.path.join(a.out, f"{arm}_{seed}")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)} if a.ngpu else dict(os.environ)
    scores = os.path.join(run, "evals.jsonl")
    steps = [sys.executable, "train.py", *ARMS[arm], f"--data.dataset={a.data}", *COMMON, f"--train.steps={a.steps}",
             f"--seed={seed}", f"--out_dir={run}", *a.extra.split()], \
        [sys.executable, "eval.py", f"--out_dir={run}", "--tasks=loss", f"--limit={a.limit}", f"--out={scores}"]
    row = {"arm": arm, "seed": seed, "steps": a.steps}
    with open(os.path.join(a.out, f"{arm}_{seed}.log"), "w") as log:
        for argv in steps:
            try:
                code = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=a.timeout).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            if code != 0:
                return {**row, "error": f"{os.path.basename(argv[1])} exited {code} (log: {arm}_{seed}.log)"}
    recs, vals = read_metrics(os.path.join(run, "metrics.jsonl"))
    late = recs[len(recs) // 4:] or recs  # past compilation and autotuning
    with open(scores) as f:
        score = json.loads(f.readlines()[-1])
    return {**row, "val_loss": score["loss"], "loss_tokens": score["loss_tokens"],
            "tok_s": statistics.median(r["tokens_per_s"] for r in late),
            "mfu": statistics.median(r.get("mfu", 0.0) for r in late),
            "peak_mem_gb": max(r.get("peak_mem_gb", 0.0) for r in recs),
            "curve": [[v["step"], v["val_loss"]] for v in vals]}


def summary(rows: list[dict], moe: str) -> dict:
    by = {arm: [r["val_loss"] for r in rows if r["arm"] == arm and "val_loss" in r] for arm in ("dense", moe)}
    out = {"summary": True, "arm": moe}
    for arm, xs in by.items():
        out[f"{arm}_mean"] = statistics.mean(xs) if xs else None
        out[f"{arm}_std"] = statistics.stdev(xs) if len(xs) > 1 else None
        out[f"{arm}_n"] = len(xs)
    if out["dense_std"] is not None and out[f"{moe}_std"] is not None:
        out["diff"] = out[f"{moe}_mean"] - out["dense_mean"]
        out["pooled_std"] = ((out["dense_std"] ** 2 + out[f"{moe}_std"] ** 2) / 2) ** 0.5
        out["met"] = out["diff"] < -out["pooled_std"]
    return out


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no plot)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        if r.get("curve"):
            s, v = zip(*r["curve"])
            ax.plot(s, v, label=f"{r['arm']} seed {r['seed']}", color="C0" if r["arm"] == "dense" else "C1")
    ax.set(xlabel="step (16,384 tokens)", ylabel="validation loss", title="MoE against dense on books")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--arms", default="dense,fine")
    ap.add_argument("--seeds", default="1337,2,3")
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--timeout", type=int, default=3000, help="seconds for each train.py / eval.py")
    ap.add_argument("--data", default="books", help="train.py's --data.dataset (eval.py scores its val shards)")
    ap.add_argument("--limit", type=int, default=0, help="eval.py's --limit (windows scored; 0 = the whole split)")
    ap.add_argument("--extra", default="", help="more train.py flags, after the common ones (a CPU smoke test)")
    a = ap.parse_args(argv)
    arms, seeds = a.arms.split(","), [int(s) for s in a.seeds.split(",")]
    bad = [x for x in arms if x not in ARMS]
    if bad or "dense" not in arms or len(arms) < 2:
        raise SystemExit(f"error: --arms takes dense and one or more of {sorted(set(ARMS) - {'dense'})}; got {a.arms}")
    os.makedirs(a.out, exist_ok=True)
    a.ngpu = H.torch.cuda.device_count()
    todo = [(arm, s) for s in seeds for arm in arms]
    with cf.ThreadPoolExecutor(max_workers=a.jobs) as pool:
        rows = list(pool.map(lambda i: run_one(a, *todo[i], i % max(a.ngpu, 1)), range(len(todo))))
    rows += [summary(rows, arm) for arm in arms if arm != "dense"]
    H.append_jsonl(os.path.join(a.out, "moe_books.jsonl"), rows)
    print(H.table([r for r in rows if "summary" not in r],
                  [("arm", "arm", ""), ("seed", "seed", "d"), ("val_loss", "val_loss", ".4f"), ("tok_s", "tok/s", ",.0f"),
                   ("mfu", "MFU", ".1%"), ("peak_mem_gb", "GB", ".1f"), ("error", "error", "")], f"{H.stamp()['gpu']}, {a.steps} steps x 16,384"))
    for s in rows[-(len(arms) - 1):]:
        print(json.dumps(s))
    plot(rows, os.path.join(a.out, "moe_books.png"))
    return rows


if __name__ == "__main__":
    main()
