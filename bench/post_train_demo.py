"""SFT then RL (GRPO) over several seeds, from scratch or from a pre-trained base, against a continued-SFT control.

    python3 bench/post_train_demo.py --out=DIR [--recipe=gpt2|small] [--seeds=1,2,3 --jobs=3]   # from scratch
    python3 bench/post_train_demo.py --out=DIR --recipe=small_base --base=runs/base --pretrain_steps=2000  # books base
    python3 bench/post_train_demo.py --out=DIR --report A.jsonl B.jsonl      # mean / spread and curves of rows
    python3 bench/post_train_demo.py --out=/tmp/x --device=cpu --smoke=1     # the pipeline on CPU, tiny sizes

The setting RL with verifiable rewards is for: labelled answers are scarce, prompts and a checker are not. Once:
--examples labelled examples of --task (nanopara.tasks seed 0) -> data/prepare.py sft. Per seed s of --seeds:
1. SFT: train.py --seed=s from scratch or from --base (--ckpt.init_from) on those examples, a checkpoint every
   --sft_every, each scored: SFT alone's curve.
2. RL: rl.py --seed=s from SFT's last checkpoint, --prompts x --group completions a step from --train_n unlabelled
   prompts (--prompt_seed: the same for every seed); it learns from the checker alone.
3. Control: train.py continues SFT from that checkpoint at SFT's final lr for RL's compute: ceil(RL's flop_tokens /
   (3 x SFT's tokens a step)) steps (rl.py's forward-token equivalents: sampled, no-grad and 3 x trained tokens).
Every score is greedy exact match on one held-out set (tasks.TEST_SEED, --test_n prompts), whatever the seeds.
--base: a train.py run; with --pretrain_steps=N and no checkpoint there yet, first pre-trained on `books` (the
mirror's text/) with the SFT model's shape, and kept. --jobs=N: N seeds at once, one process each, on the GPUs in turn.
DIR/post_train.jsonl (harness-stamped: GPU, date, git) gets a row per seed as it finishes (curves, finals, gains in
points, seconds), then per recipe (tag, start, task, GPU) a report row: mean, std, min, max of SFT's, RL's and the
control's final exact match and RL's gains, from those seed rows; DIR/post_train.png draws every seed's curves.
Goal (issue 46): RL above SFT and the control by a mean >= 10 points, every seed >= 5. Knowledge and the measured
runs: notes/post_training.md.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import math
import os
import runpy
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import harness as H
from bench_generate import timed
from nanopara import rl, tasks
from nanopara.config import TrainConfig
from nanopara.consolidate import full_model_state, resolve
from nanopara.data import get_tokenizer
from nanopara.model import GPT

ROOT = H.ROOT
# --recipe: the model and the step settings that differ between the two recipes. gpt2: the one measured on H100
# (notes/post_training.md: 10.2 % -> 33.3 %, one seed); small: a 6-layer, 384-wide GPT-2 (30M parameters, 19M of
# them the embedding) at a small model's lr, with RL's updates and sampling in one batch (a GPU has room for it),
# and dynamic sampling (--oversample=4: +3.0 points over plain RL on the same SFT runs, notes/post_training.md), on
# 15,000 labelled examples (3 seeds each on one H100: +7.8 points over SFT and the control at 20,000, +17.4 at 15,000,
# results/post_train_small_os4_600_h100.txt, post_train_small_os4_ex15k_h100.txt). small_base: the same from a books
# base (--base, --pretrain_steps=2000) on 5,000 labels: at 15,000 the base's SFT reaches 84-90 % and RL adds +5.7, at
# 5,000 +32.3 (3 seeds each on one H100, results/post_train_base_h100.txt).
RECIPES = {"gpt2": dict(preset="gpt2_124m", model="", sft_lr=6e-4, pretrain_lr=6e-4, micro=256, sample_batch=256,
                        rl_args="", examples=20_000),
           "small": dict(preset="gpt2_124m", model="--model.n_layer=6 --model.n_head=6 --model.n_embd=384",
                         sft_lr=1e-3, pretrain_lr=1e-3, micro=0, sample_batch=4096, rl_args="--oversample=4",
                         examples=15_000)}
RECIPES["small_base"] = {**RECIPES["small"], "examples": 5_000}
METRICS = ("sft_final_exact_match", "rl_final_exact_match", "control_final_exact_match", "gain_over_sft",
           "gain_over_control", "gain_over_best")


# ----------------------------------------------------------------------------------------------------------------
# running the scripts

def sh(a, argv: list[str], log: str) -> float:
    """Run train.py / rl.py (argv after the Python executable) from the repo root, output into `log`: a process of
    its own, or with --inproc=1 its main() in this one; seconds taken. Fails loudly with the log's tail."""
    t0 = time.time()
    with open(log, "w") as f:
        if a.inproc:  # the script as __main__ (runpy), as a process would run it: its exit code from SystemExit
            code, old = 0, sys.argv
            with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                try:
                    sys.argv = argv
                    runpy.run_path(os.path.join(ROOT, argv[0]), run_name="__main__")
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else int(e.code is not None)
                except Exception as e:  # noqa: BLE001  (reported with the log below)
                    print(f"{type(e).__name__}: {e}")
                    code = 1
                finally:
                    sys.argv = old
        else:
            code = subprocess.run([sys.executable, *argv], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if code:
        with open(log) as f:
            raise RuntimeError(f"{argv[0]} failed ({code}); end of {log}:\n{f.read()[-3000:]}")
    return time.time() - t0


def load(path: str, device) -> GPT:
    """The model of a checkpoint (a step directory, or a run's latest) on `device`, in eval mode."""
    sd, cfg = full_model_state(resolve(path)[0])
    model = GPT(cfg)
    model.load_state_dict(sd)
    return model.to(device).eval()


def score(model: GPT, a, examples: list) -> float:
    """Greedy exact match (rl.exact_match: tokens after sft.prompt_ids, the task's checker)."""
    return rl.exact_match(model, get_tokenizer(), tasks.get_task(a.task), examples, 8, amp=H.amp(a.device))


def ckpt_curve(run_dir: str, a, held_out: list, flop_per_step: float = 0.0) -> list[dict]:
    """Held-out exact match of every checkpoint of a train.py run (ckpt/step_*), with its compute."""
    out = []
    for name in sorted(d for d in os.listdir(os.path.join(run_dir, "ckpt")) if d.startswith("step_")):
        step = int(name[5:])
        em = score(load(os.path.join(run_dir, "ckpt", name), a.device), a, held_out)
        out.append({"step": step, "flop_tokens": step * flop_per_step, "test_exact_match": em})
    return out


def sft_argv(a, seed: int, out_dir: str, steps: int, lr: float, every: int, init: str = "",
             const: bool = False) -> list[str]:
    """train.py on the task's SFT shards: the model of --preset/--model at --seq_len, one micro-step of --sft_batch
    rows a step; lr warms up over a tenth of the steps and decays (cosine) to a tenth, or with const stays."""
    return ["train.py", f"--preset={a.preset}", *a.model.split(), f"--device={a.device}", f"--seed={seed}",
            f"--data.dataset={sft_dataset(a)}", f"--data.data_dir={os.path.join(a.work, 'shards')}",
            f"--model.block_size={a.seq_len}", f"--train.seq_len={a.seq_len}", f"--train.micro_batch={a.sft_batch}",
            "--train.tokens_per_step=0", f"--train.steps={steps}", f"--train.lr={lr}", "--train.val_every=0",
            "--train.sample_tokens=0", f"--train.log_every={max(1, steps // 20)}", f"--ckpt.every={every}",
            f"--ckpt.keep={steps // every + 2}", f"--out_dir={out_dir}", "--overwrite=true",
            *([f"--ckpt.init_from={init}"] if init else []),
            *(["--train.warmup_steps=0", "--train.min_lr_frac=1"] if const else
              [f"--train.warmup_steps={max(1, steps // 10)}"])]


# ----------------------------------------------------------------------------------------------------------------
# data and the pre-trained base

def prepare(a) -> None:
    """The task's labelled examples (nanopara.tasks seed 0: the same for every seed) as SFT shards under --work."""
    data = os.path.join(a.work, "data")
    train_jsonl, val_jsonl = (os.path.join(data, f"{a.task}_{s}.jsonl") for s in (a.examples, "val"))
    for path, n, split, seed in ((train_jsonl, a.examples, "train", 0), (val_jsonl, 200, "test", 1)):
        if not os.path.exists(path):  # an existing file keeps its mtime: prepare.py sees the shards are done
            os.makedirs(data, exist_ok=True)
            if tasks.main([a.task, f"--n={n}", f"--split={split}", f"--seed={seed}", f"--out={path}"]):
                raise SystemExit(f"nanopara.tasks {a.task} failed")
    spec = importlib.util.spec_from_file_location("prepare", os.path.join(ROOT, "data", "prepare.py"))
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    name = sft_dataset(a)
    try:
        prep.prepare_sft(name, [train_jsonl], os.path.join(a.work, "shards", name), seq_len=a.seq_len,
                         val_jsonl=val_jsonl)
    except prep.PrepareError as e:
        raise SystemExit(f"post_train_demo: {e}") from None


def sft_dataset(a) -> str:
    """The SFT shards' name under --work: one per task, example count and row length, so runs that differ in them
    can share a --work directory."""
    return f"post_train_{a.task}_{a.examples}_T{a.seq_len}"


def pretrain(a) -> dict:
    """--base: train.py on `books` with the SFT model's shape, unless a checkpoint is there; its last val_loss."""
    t0 = time.time()
    try:
        resolve(a.base)
    except Exception:  # noqa: BLE001  (no checkpoint yet: train it)
        if not a.pretrain_steps:
            raise SystemExit(f"--base={a.base} holds no checkpoint: pass --pretrain_steps=N to train one") from None
        shards = os.path.join(ROOT, "data", "shards", a.pretrain_data)  # a dataset name (else a path or glob)
        if "/" not in a.pretrain_data and not (os.path.isdir(shards) and any("train" in f for f in os.listdir(shards))):
            subprocess.run([sys.executable, "data/prepare.py", a.pretrain_data], cwd=ROOT, check=True)
        os.makedirs(a.base, exist_ok=True)
        n = a.pretrain_steps
        sh(a, ["train.py", f"--preset={a.preset}", *a.model.split(), f"--device={a.device}", "--seed=0",
               f"--data.dataset={a.pretrain_data}", f"--model.block_size={a.seq_len}", f"--train.seq_len={a.seq_len}",
               f"--train.micro_batch={a.sft_batch}", "--train.tokens_per_step=0", f"--train.steps={n}",
               f"--train.lr={a.pretrain_lr}", f"--train.warmup_steps={max(1, n // 10)}",
               f"--train.val_every={max(1, n // 4)}", "--train.sample_tokens=0", f"--train.log_every={max(1, n // 20)}",
               f"--out_dir={a.base}", "--overwrite=true"], os.path.join(a.work, "pretrain.log"))
    vals = [r["val_loss"] for r in H.read_jsonl(os.path.join(a.base, "metrics.jsonl")) if "val_loss" in r]
    return {"kind": "base", "base": a.base, "data": a.pretrain_data, "pretrain_steps": a.pretrain_steps,
            "val_loss": vals[-1] if vals else None, "seconds": time.time() - t0}


# ----------------------------------------------------------------------------------------------------------------
# one seed: SFT, RL, the control

def run_seed(a, seed: int) -> list[dict]:
    """SFT of `seed`, scored; then from its last checkpoint each RL arm (the recipe's, and --arm's) with its control,
    at once: a row per arm."""
    runs = os.path.join(a.work, "runs", f"{a.tag}_{'base' if a.base else 'scratch'}_s{seed}")
    os.makedirs(runs, exist_ok=True)
    held_out = tasks.make_examples(a.task, a.test_n, "test", tasks.TEST_SEED)
    tok_step = a.sft_batch * a.seq_len
    row = {"kind": "seed", **recipe(a), "seed": seed,
           "held_out": {"seed": tasks.TEST_SEED, "n": a.test_n, "sha1": tasks.digest(held_out)}, "seconds": {}}
    sec = row["seconds"]
    sft_dir = os.path.join(runs, "sft")
    sec["sft"] = sh(a, sft_argv(a, seed, sft_dir, a.sft_steps, a.sft_lr, a.sft_every, a.base),
                    os.path.join(runs, "sft.log"))
    t1 = time.time()
    row["sft_curve"] = ckpt_curve(sft_dir, a, held_out, 3 * tok_step)
    start = os.path.join(sft_dir, "ckpt", f"step_{a.sft_steps:06d}")
    row["sft_final_exact_match"] = row["sft_curve"][-1]["test_exact_match"]
    with open(os.path.join(a.work, "data", f"{a.task}_{a.examples}.jsonl")) as f:
        sft_examples = [tasks.Example(d["prompt"], d["response"], d["answer"])
                        for d, _ in zip(map(json.loads, f), range(a.test_n))]
    row["sft_train_exact_match"] = score(load(start, a.device), a, sft_examples)  # its own labelled examples
    sec["score"] = time.time() - t1
    print(f"seed {seed}: SFT {sec['sft']:.0f} s, held-out exact match {row['sft_final_exact_match']:.1%}", flush=True)
    arms = [(a.tag, a.rl_lr, a.rl_args)] + [(f"{a.tag}+{n}", lr, f"{a.rl_args} {x}".strip()) for n, lr, x in a.arm]
    with ThreadPoolExecutor(1 if a.inproc else len(arms)) as pool:  # each arm: rl.py (and train.py) processes
        jobs = [pool.submit(run_arm, a, seed, runs, start, held_out, copy.deepcopy(row), *arm) for arm in arms]
    rows = []
    for (tag, *_), job in zip(arms, jobs):  # an arm that failed loses its row only, not the others'
        try:
            rows.append(job.result())
        except RuntimeError as e:
            print(f"{tag} seed {seed} failed: {e}", flush=True)
    if not rows:
        raise RuntimeError(f"seed {seed}: every RL arm failed (above)")
    return rows


def run_arm(a, seed: int, runs: str, start: str, held_out: list, row: dict, tag: str, lr: float, args: str) -> dict:
    """RL from SFT's last checkpoint `start` at `lr` with rl.py keys `args`, then its control: one row."""
    sec, t0, sub = row["seconds"], time.time(), "" if tag == a.tag else "_" + tag[len(a.tag) + 1:]
    row.update(tag=tag, rl_lr=lr, rl_args=args)
    rl_dir, tok_step = os.path.join(runs, "rl" + sub), a.sft_batch * a.seq_len
    sec["rl"] = sh(a, ["rl.py", f"--init={start}", f"--task={a.task}", f"--out_dir={rl_dir}", "--overwrite=1",
                       f"--device={a.device}", f"--seed={seed}", f"--prompt_seed={a.prompt_seed}",
                       f"--test_seed={tasks.TEST_SEED}", f"--steps={a.rl_steps}", f"--prompts={a.prompts}",
                       f"--group={a.group}", f"--lr={lr}", "--max_new=8", f"--train_n={a.train_n}",
                       f"--test_n={a.test_n}", f"--eval_every={a.eval_every}", f"--micro={a.micro}", "--save=0",
                       f"--sample_batch={a.sample_batch}", *args.split()], rl_dir + ".log")
    rl_results(row, H.read_jsonl(os.path.join(rl_dir, "metrics.jsonl")))
    print(f"{tag} seed {seed}: RL {sec['rl']:.0f} s ({row['rl_step_s']:.2f} s a step), held-out exact match "
          f"{row['rl_final_exact_match']:.1%}", flush=True)
    if a.control:  # continued SFT with RL's compute, from the same checkpoint, at SFT's final lr
        steps = max(1, math.ceil(row["rl_flop_tokens"] / (3 * tok_step)))
        ctl_lr = a.sft_lr * TrainConfig().min_lr_frac  # where the cosine of sft_argv ends
        ctl_dir = os.path.join(runs, "control" + sub)
        sec["control"] = sh(a, sft_argv(a, seed, ctl_dir, steps, ctl_lr, max(1, steps // 4), start, const=True),
                            ctl_dir + ".log")
        row.update(control_steps=steps, control_lr=ctl_lr, control_flop_tokens=3 * tok_step * steps,
                   control_curve=ckpt_curve(ctl_dir, a, held_out, 3 * tok_step))
        row["control_final_exact_match"] = row["control_curve"][-1]["test_exact_match"]
    row.update(sft_tokens_per_step=tok_step, **gains(row))
    sec["total"] = sec["sft"] + sec["score"] + time.time() - t0
    print(f"{tag} seed {seed}: held-out exact match SFT {row['sft_final_exact_match']:.1%} (its own examples "
          f"{row['sft_train_exact_match']:.1%}) -> RL {row['rl_final_exact_match']:.1%}, control "
          f"{row.get('control_final_exact_match', float('nan')):.1%}; RL over the best of them "
          f"{row['gain_over_best']:+.1f} points; {sec['total']:.0f} s", flush=True)
    return row


def rl_results(row: dict, recs: list[dict]) -> None:
    """RL's curve (held-out exact match by step, with compute), reward curve, finals and its compute."""
    steps = [r for r in recs if "reward" in r]
    flop = {0: 0.0, **{r["step"]: r["flop_tokens"] for r in steps}}
    evals = [r for r in recs if "test_exact_match" in r]
    every = max(1, len(steps) // 200)
    head = steps[:max(1, len(steps) // 10)]
    row.update(rl_curve=[{"step": r["step"], "flop_tokens": flop[r["step"]], "test_exact_match": r["test_exact_match"]}
                         for r in evals], rl_test_set=sorted({r["test_set"] for r in evals}),
               rl_reward=[{k: round(r[k], 4) for k in ("step", "reward", "pass_at_group")} for r in steps[::every]],
               rl_start_reward=sum(r["reward"] for r in head) / len(head),
               rl_start_pass_at_group=sum(r["pass_at_group"] for r in head) / len(head),
               rl_start_exact_match=evals[0]["test_exact_match"], rl_final_exact_match=evals[-1]["test_exact_match"],
               rl_flop_tokens=steps[-1]["flop_tokens"], rl_step_s=statistics.median(r["step_s"] for r in steps))


def gains(row: dict) -> dict:
    """RL's final exact match over SFT's, the control's, and the better of the two, in points."""
    rl_em, sft = row["rl_final_exact_match"], row["sft_final_exact_match"]
    ctl = row.get("control_final_exact_match")
    best = sft if ctl is None else max(sft, ctl)
    return {"gain_over_sft": 100 * (rl_em - sft), "gain_over_control": None if ctl is None else 100 * (rl_em - ctl),
            "gain_over_best": 100 * (rl_em - best)}


def recipe(a) -> dict:
    """What defines a recipe: rows with the same values (and GPU) are seeds of one report."""
    return {"tag": a.tag, "init": "base" if a.base else "scratch", "base": a.base or None, "task": a.task,
            "preset": a.preset, "model_keys": a.model, "seq_len": a.seq_len, "examples": a.examples,
            "sft_steps": a.sft_steps, "sft_lr": a.sft_lr, "sft_batch": a.sft_batch, "rl_steps": a.rl_steps,
            "rl_lr": a.rl_lr, "prompts": a.prompts, "group": a.group, "train_n": a.train_n, "rl_args": a.rl_args,
            "prompt_seed": a.prompt_seed, "micro": a.micro, "sample_batch": a.sample_batch}


# ----------------------------------------------------------------------------------------------------------------
# the report over seeds

def report(rows: list[dict]) -> list[dict]:
    """One row per recipe (tag, start, task, GPU) of the seed rows: each metric's mean, std (n - 1), min, max and
    values, in seed order, and whether the goal is met (gain over the better baseline: mean >= 10, min >= 5)."""
    groups = {}
    for r in rows:
        if r.get("kind") == "seed":
            groups.setdefault((r["tag"], r["init"], r["task"], r.get("gpu")), []).append(r)
    out = []
    for (tag, init, task, gpu), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        rep = {"kind": "report", "tag": tag, "init": init, "task": task, "gpu": gpu, "seeds": [r["seed"] for r in rs],
               "held_out": sorted({r["held_out"]["sha1"] for r in rs}),
               "seconds_per_seed": statistics.mean(r["seconds"]["total"] for r in rs)}
        for m in METRICS:
            v = [r[m] for r in rs if r.get(m) is not None]
            if v:
                rep[m] = {"mean": statistics.mean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0,
                          "min": min(v), "max": max(v), "values": v}
        g = rep["gain_over_best"]
        rep["goal_met"] = g["mean"] >= 10 and g["min"] >= 5
        out.append(rep)
        print(f"{tag} from {init}, {task}, {len(rs)} seeds on {gpu}: held-out exact match (%, mean ± std, min..max) "
              f"SFT {spread(rep, 'sft_final_exact_match', 100)}, RL {spread(rep, 'rl_final_exact_match', 100)}, "
              f"control {spread(rep, 'control_final_exact_match', 100)}; RL over the better baseline "
              f"{spread(rep, 'gain_over_best')} points (goal: mean >= 10, every seed >= 5: "
              f"{'met' if rep['goal_met'] else 'not met'})", flush=True)
    return out


def spread(rep: dict, m: str, scale: float = 1.0) -> str:
    if m not in rep:
        return "-"
    s = {k: scale * rep[m][k] for k in ("mean", "std", "min", "max")}
    return f"{s['mean']:.1f} ± {s['std']:.1f} ({s['min']:.1f}..{s['max']:.1f})"


def plot(rows: list[dict], path: str) -> None:
    """Per seed: SFT's curve; RL's and the control's held-out exact match by compute; RL's training reward."""
    try:
        import matplotlib
    except ImportError:
        print("plot: matplotlib missing (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    seeds = sorted((r for r in rows if r.get("kind") == "seed"), key=lambda r: (r["tag"], r["init"], r["seed"]))
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, r in enumerate(seeds):
        c, lab = f"C{i % 10}", f"{r['tag']}/{r['init']} seed {r['seed']}"
        sc, rc, cc, rw = (r.get(k) or [] for k in ("sft_curve", "rl_curve", "control_curve", "rl_reward"))
        ax[0].plot([p["step"] for p in sc], [100 * p["test_exact_match"] for p in sc], "o-", color=c, label=lab)
        ax[1].plot([p["flop_tokens"] / 1e6 for p in rc], [100 * p["test_exact_match"] for p in rc], "o-", color=c,
                   label=f"{lab}: RL")
        if cc:
            xs = [0.0] + [p["flop_tokens"] / 1e6 for p in cc]
            ys = [100 * r["sft_final_exact_match"]] + [100 * p["test_exact_match"] for p in cc]
            ax[1].plot(xs, ys, "s--", color=c, alpha=0.6, label=f"{lab}: continued SFT")
        ax[2].plot([p["step"] for p in rw], [100 * p["reward"] for p in rw], color=c, lw=1, label=lab)
    for a_, (x, y) in zip(ax, (("SFT step", "held-out exact match (%)"),
                              ("compute after SFT (M forward-token equivalents)", "held-out exact match (%)"),
                              ("RL step", "sampled training reward (%)"))):
        a_.set_xlabel(x)
        a_.set_ylabel(y)
        a_.grid(alpha=0.3)
        a_.legend(fontsize=6)
    reps = [r for r in rows if r.get("kind") == "report"]
    fig.suptitle("; ".join(f"{r['tag']}/{r['init']} ({r['gpu']}): RL over best baseline "
                           f"{r['gain_over_best']['mean']:+.1f} ± {r['gain_over_best']['std']:.1f} points, "
                           f"{len(r['seeds'])} seeds" for r in reps) or "post-training demo", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ----------------------------------------------------------------------------------------------------------------
# generation speed (--gen_speed=1)

@torch.no_grad()
def generation_speed(model: GPT, device, batches=(1, 16, 64, 256), prompt=32, new=128) -> list[dict]:
    """tokens/s of rl.sample (and model.generate) on random prompts, EOT = -1 so no row stops early."""
    model, amp = model.to(device).eval(), H.amp(device)
    new = min(new, model.cfg.block_size - prompt)
    rows = []
    for B in batches:
        x = torch.randint(0, model.cfg.vocab_size - 1, (B, prompt), generator=torch.Generator().manual_seed(B)).tolist()
        g = torch.Generator(device=device).manual_seed(0)
        res = {"batch": B, "prompt_tokens": prompt, "new_tokens": new}
        for name, fn in (("rl_sample", lambda: rl.sample(model, x, new, 1.0, -1, g, amp)),
                         ("model_generate", lambda: model.generate(torch.tensor(x, device=device), new, 1.0,
                                                                   generator=g))):
            try:
                with amp():
                    res[f"{name}_tokens_per_s"] = B * new / timed(fn, device)  # after a warm-up call
            except RuntimeError as e:  # one sampler failing must not lose the other's number
                res[f"{name}_error"] = str(e).splitlines()[0][:200]
        rows.append(res)
        print(f"generation batch {B:4d}: " + " | ".join(f"{k} {v:,.0f}" for k, v in res.items()
                                                         if k.endswith("tokens_per_s")), flush=True)
    return rows


# ----------------------------------------------------------------------------------------------------------------

def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    arg = p.add_argument
    arg("--out", required=True, help="post_train.jsonl and post_train.png go here")
    arg("--work", default="", help="data, shards and runs (default OUT/work)")
    arg("--report", nargs="*", default=None, help="only aggregate these jsonl files' seed rows into OUT")
    arg("--device", default="cuda")
    arg("--smoke", type=int, default=0, help="1: tiny sizes and a few steps, to check the pipeline on CPU")
    arg("--inproc", type=int, default=0, help="1: train.py and rl.py inside this process (tests)")
    arg("--seeds", default="1,2,3", help="comma-separated; each is SFT's, RL's and the control's seed")
    arg("--jobs", type=int, default=1, help="seeds run at once, one process each")
    arg("--child_rows", default="", help=argparse.SUPPRESS)  # --jobs: where a child process writes its rows
    arg("--recipe", default="gpt2", choices=sorted(RECIPES), help="defaults of the keys below (RECIPES)")
    arg("--tag", default=None, help="the recipe's name in the rows and the report (default: --recipe)")
    arg("--task", default="digits")
    arg("--preset", default=None)
    arg("--model", default=None, help="train.py model keys, e.g. '--model.n_layer=6 --model.n_embd=384'")
    arg("--seq_len", type=int, default=256, help="SFT rows (packed examples) and the model's context")
    arg("--examples", type=int, default=None, help="labelled SFT examples (the same for every seed; default: the "
                                                   "recipe's)")
    arg("--sft_steps", type=int, default=3000)
    arg("--sft_every", type=int, default=1000, help="SFT checkpoints (each scored) every N steps")
    arg("--sft_lr", type=float, default=None)
    arg("--sft_batch", type=int, default=64, help="rows of --seq_len tokens per SFT step")
    arg("--base", default="", help="a train.py run to start SFT from (pre-trained on books if --pretrain_steps)")
    arg("--pretrain_steps", type=int, default=0)
    arg("--pretrain_lr", type=float, default=None)
    arg("--pretrain_data", default="books", help="the base's pre-training data (train.py --data.dataset)")
    arg("--rl_steps", type=int, default=600)
    arg("--rl_lr", type=float, default=2e-5)
    arg("--prompts", type=int, default=64)
    arg("--group", type=int, default=16)
    arg("--micro", type=int, default=None, help="rl.py --micro: rows per forward in its updates (0: all)")
    arg("--sample_batch", type=int, default=None, help="rl.py --sample_batch: rows per sampling batch")
    arg("--train_n", type=int, default=20_000, help="RL's unlabelled training prompts")
    arg("--prompt_seed", type=int, default=1337, help="which --train_n prompts (the same for every seed)")
    arg("--rl_args", default=None, help="more rl.py keys, e.g. '--kl_coef=0.02' (default: the recipe's)")
    arg("--arm", action="append", default=[], metavar="NAME:LR:ARGS",
        help="an RL arm beside the recipe's, from the same SFT checkpoints: rl.py at LR with ARGS (rl.py keys) added "
             "to --rl_args, and its own control; rows tagged TAG+NAME. Arms run at once. Repeatable")
    arg("--control", type=int, default=1, help="0: no continued-SFT control")
    arg("--test_n", type=int, default=1000, help="held-out prompts (tasks.TEST_SEED) every score uses")
    arg("--eval_every", type=int, default=100, help="RL's held-out scores every N steps")
    arg("--gen_speed", type=int, default=0, help="1: batched generation tokens/s on the first seed's SFT model")
    a = p.parse_args(argv)
    for k, v in {**RECIPES[a.recipe], "tag": "smoke" if a.smoke else a.recipe}.items():  # given keys win
        setattr(a, k, v if getattr(a, k) is None else getattr(a, k))
    if a.smoke:
        a.preset, a.model, a.seq_len, a.examples, a.sft_batch = "tiny", \
            "--model.n_layer=1 --model.n_embd=32 --model.n_head=2", 64, 300, 4
        a.sft_steps, a.sft_every, a.rl_steps, a.prompts, a.group, a.micro = 4, 2, 2, 2, 4, 0
        a.train_n, a.test_n, a.eval_every, a.rl_lr = 50, 16, 1, 1e-3
        a.pretrain_steps = a.pretrain_steps and 2
    a.work = a.work or os.path.join(a.out, "work")
    a.base = os.path.abspath(a.base) if a.base else ""  # the scripts run from the repo root
    a.seeds = [int(s) for s in str(a.seeds).split(",") if s]  # none: only the data (and --base's pre-training)
    try:
        a.arm = [(n, float(lr), x) for n, lr, x in (arm.split(":", 2) for arm in a.arm)]
    except ValueError:
        raise SystemExit(f"--arm takes NAME:LR:ARGS (ARGS may be empty), e.g. os4:2e-5:--oversample=4; got {a.arm}")
    if len({n for n, _, _ in a.arm}) < len(a.arm) or any(not n.isidentifier() for n, _, _ in a.arm):
        raise SystemExit(f"--arm names must be distinct words: {[n for n, _, _ in a.arm]}")
    if a.sft_steps % a.sft_every:
        raise SystemExit("--sft_steps must be a multiple of --sft_every")
    return a


def run_jobs(a, rows_path: str) -> list[dict]:
    """The seeds as child processes of this script, --jobs at a time, each on the next visible GPU. A child writes
    its row to OUT/rows_<tag>_s<seed>.jsonl, which this process moves into rows_path once it has finished (if this
    process is stopped first, those files hold the finished seeds: --report reads them)."""
    todo, running, rows = list(a.seeds), [], []
    n_gpu = torch.cuda.device_count() if a.device == "cuda" else 0
    while todo or running:
        while todo and len(running) < a.jobs:
            s = todo.pop(0)
            child = os.path.join(a.out, f"rows_{a.tag}_s{s}.jsonl")
            if os.path.exists(child):
                os.remove(child)
            env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": str(s % n_gpu)} if n_gpu > 1 else {})}
            running.append((s, child, subprocess.Popen([sys.executable, os.path.abspath(__file__), *sys.argv[1:],
                                                        f"--seeds={s}", "--jobs=1", f"--child_rows={child}"],
                                                       cwd=ROOT, env=env)))
        time.sleep(1)
        for job in [j for j in running if j[2].poll() is not None]:
            running.remove(job)
            if job[2].returncode == 0:
                new = H.read_jsonl(job[1])
                H.append_jsonl(rows_path, new)
                os.remove(job[1])
                rows += new
            else:
                print(f"seed {job[0]} failed ({job[2].returncode}): its log above", flush=True)
    return rows


def main(argv=None):
    a = parse(argv)
    os.makedirs(a.out, exist_ok=True)
    rows_path = a.child_rows or os.path.join(a.out, "post_train.jsonl")
    if a.report is not None:  # aggregate rows that came back from earlier runs
        rows = [r for f in a.report for r in H.read_jsonl(f) if r.get("kind") == "seed"]
    else:
        print(H.banner(f"post_train_demo {a.tag} {a.task} {a.preset} {a.model} seeds {a.seeds}"), flush=True)
        try:  # before any work: a machine offline without tiktoken's cache stops here in one line
            get_tokenizer()
        except RuntimeError as e:
            raise SystemExit(f"post_train_demo: {e}") from None
        os.makedirs(a.work, exist_ok=True)
        prepare(a)
        rows = []
        if a.base:
            base = pretrain(a)
            if not a.child_rows:
                H.append_jsonl(rows_path, base)
        if a.jobs > 1 and len(a.seeds) > 1:
            rows = run_jobs(a, rows_path)
        else:
            for s in a.seeds:
                rows += run_seed(a, s)
                H.append_jsonl(rows_path, [r for r in rows if r["seed"] == s])
        if a.gen_speed and rows:
            model = load(os.path.join(a.work, "runs", f"{a.tag}_{rows[0]['init']}_s{rows[0]['seed']}", "sft"),
                         a.device)  # its last checkpoint
            H.append_jsonl(rows_path, {"kind": "generation", "rows": generation_speed(model, a.device)})
        if a.child_rows:
            return
        rows = [{**H.stamp(), **r} for r in rows]
    if not rows:
        return
    reps = report(rows)
    H.append_jsonl(os.path.join(a.out, "post_train.jsonl"), reps)
    plot(rows + reps, os.path.join(a.out, "post_train.png"))


if __name__ == "__main__":
    main()
