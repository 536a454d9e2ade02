"""SFT then RL on one GPU: held-out exact match after SFT and after GRPO, plus batched-generation tokens/s.

    python3 bench/post_train_demo.py --out=DIR                        # ~8.5 min on one H100
    python3 bench/post_train_demo.py --out=/tmp/x --device=cpu --smoke=1   # the logic, in ~3 min on CPU

The setting RL with verifiable rewards is for: labelled answers are scarce, prompts and a checker are not. SFT gets
--examples labelled examples (20,000 by default) and trains on them to its plateau; RL then draws its prompts from
rl.py's own 20,000 training prompts (another seed: nearly all unseen by SFT) and learns only from the checker.
1. Data: `python -m nanopara.tasks digits` ("What is 3 4 8 + 5 7?" -> " 4 0 5"; --task=arith writes GPT-2 BPE
   numbers, which a model from scratch learns far later: 18.4 % after 3,000 steps with 200,000 examples) -> JSONL
   -> `data/prepare.py sft`. Held-out prompts are disjoint from training ones by hash.
2. SFT from scratch with train.py (--preset, default gpt2_124m; --sft_steps), a checkpoint every --sft_every
   steps, each scored by greedy exact match on --test_n held-out prompts: the "SFT alone" curve.
3. RL with rl.py from the SFT checkpoint of step --rl_from (default last: then "SFT alone" is RL's start; auto: the
   first whose greedy exact match on training prompts reaches --auto_em, which helps when SFT ends near 100 %) for
   --rl_steps of --prompts x --group completions, one run per learning rate in --rl_lr, reported: the one of higher
   training reward (never chosen on test prompts). rl.py scores the held-out prompts at step 0, every --eval_every.
4. Generation: rl.sample (batched, KV cache, rows leave at EOT) on the SFT model's shape with EOT never hit, prompt
   32 tokens, 128 new, batch 1..256, bf16: tokens/s; model.generate (one batch, no stop) beside it.
Results: one JSON line in DIR/post_train.jsonl (the SFT curve, exact match at RL's start and end, the gain in
points over the start and over SFT's last step, RL curves, generation tokens/s), the runs under DIR/runs; `python
bench/plot.py DIR/post_train.jsonl` draws both curves. Goal (issue 31): RL adds >= 15 points over SFT's last step.
Measured with these defaults: 10.2 % -> 33.3 % (results/post_train_rl_scarce_h100.txt, which also holds the other
SFT data sizes: RL's gain depends strongly on where SFT leaves the model).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

import harness as H
from bench_generate import timed
from nanopara import rl, tasks
from nanopara.consolidate import full_model_state
from nanopara.data import get_tokenizer
from nanopara.model import GPT

ROOT = H.ROOT


def sh(argv: list[str], log: str) -> float:
    """Run a command from the repo root, its output into `log`; seconds taken. Fails loudly with the log's tail."""
    t0 = time.time()
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, *argv], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True)
    if r.returncode:
        with open(log) as f:
            raise SystemExit(f"{' '.join(argv[:2])} failed ({r.returncode}); end of {log}:\n{f.read()[-3000:]}")
    return time.time() - t0


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


def sft_curve(run_dir: str, every: int, steps: int, task: str, test_n: int, device) -> list[dict]:
    """Greedy exact match of each SFT checkpoint (rl.exact_match) on the held-out prompts rl.py scores and on as many
    training-split prompts (what --rl_from=auto chooses by: the held-out prompts never pick anything)."""
    enc, out, t, amp = get_tokenizer(), [], tasks.get_task(task), H.amp(device)
    held_out = tasks.make_examples(task, test_n, "test", 1337)  # rl.py's default --seed: the same prompts
    train = tasks.make_examples(task, test_n, "train", 7)
    for step in range(every, steps + 1, every):
        sd, cfg = full_model_state(os.path.join(run_dir, "ckpt", f"step_{step:06d}"))
        model = GPT(cfg)
        model.load_state_dict(sd)
        model.to(device).eval()
        out.append({"step": step, "test_exact_match": rl.exact_match(model, enc, t, held_out, 8, amp=amp),
                    "train_exact_match": rl.exact_match(model, enc, t, train, 8, amp=amp)})
        print(f"SFT step {step}: exact match held-out {out[-1]['test_exact_match']:.1%}, train prompts "
              f"{out[-1]['train_exact_match']:.1%}", flush=True)
    return out


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", type=int, default=0, help="1: tiny sizes, to check the pipeline on CPU")
    p.add_argument("--task", default="digits")
    p.add_argument("--preset", default="gpt2_124m")
    p.add_argument("--model", default="", help="train.py model keys, e.g. '--model.n_layer=6 --model.n_embd=384'")
    p.add_argument("--examples", type=int, default=20_000, help="labelled SFT examples (20,000: SFT plateaus near "
                   "10 %%; 30,000 and more: near 86-96 %%, little left for RL)")
    p.add_argument("--sft_steps", type=int, default=3000)
    p.add_argument("--sft_every", type=int, default=1000, help="SFT checkpoints (each scored) every N steps")
    p.add_argument("--rl_from", default="last", help="the SFT step RL starts from; last: the final one; auto: the "
                   "first checkpoint with >= --auto_em exact match on training prompts (else the last)")
    p.add_argument("--auto_em", type=float, default=0.25)
    p.add_argument("--sft_lr", type=float, default=6e-4)
    p.add_argument("--rl_steps", type=int, default=600)
    p.add_argument("--rl_lr", default="2e-5", help="comma-separated: one RL run each from the same start")
    p.add_argument("--rl_args", default="", help="more rl.py keys for every RL run, e.g. '--kl_coef=0.02 "
                   "--temperature=0.7'")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=16)
    p.add_argument("--test_n", type=int, default=1000)
    p.add_argument("--eval_every", type=int, default=100)
    a = p.parse_args()
    if a.smoke:
        a.preset, a.model, a.examples = "tiny", "--model.n_layer=2", 3000
        a.sft_steps, a.sft_every = 20, 10
        a.rl_steps, a.rl_lr, a.prompts, a.group, a.test_n, a.eval_every = 2, "1e-5,4e-5", 4, 4, 20, 0
    if a.rl_from == "last":
        a.rl_from = str(a.sft_steps)
    if a.sft_steps % a.sft_every or (a.rl_from != "auto" and (int(a.rl_from) % a.sft_every
                                                                or not 0 < int(a.rl_from) <= a.sft_steps)):
        raise SystemExit("--sft_steps and --rl_from must be multiples of --sft_every, rl_from <= sft_steps")
    return a


def prepare(a, runs: str) -> float:
    """The task's train and validation JSONL, made into SFT shards; seconds taken."""
    data = os.path.join(a.out, "data")
    os.makedirs(data, exist_ok=True)
    train_jsonl, val_jsonl = os.path.join(data, "train.jsonl"), os.path.join(data, "val.jsonl")
    sh(["-m", "nanopara.tasks", a.task, f"--n={a.examples}", "--split=train", f"--out={train_jsonl}"],
       os.path.join(runs, "tasks.log"))
    sh(["-m", "nanopara.tasks", a.task, "--n=2000", "--split=test", "--seed=1", f"--out={val_jsonl}"],
       os.path.join(runs, "tasks_val.log"))
    return sh(["data/prepare.py", "sft", train_jsonl, "--val_jsonl", val_jsonl, "--name", "post_train", "--seq_len",
               "256", "--out", os.path.join(a.out, "shards"), "--force"], os.path.join(runs, "prepare.log"))


def sft(a, res: dict, sft_dir: str, runs: str, device) -> None:
    """SFT from scratch, a checkpoint every sft_every steps, each scored on the held-out prompts."""
    res["sft_s"] = sh(["train.py", f"--preset={a.preset}", *a.model.split(), f"--device={a.device}",
                       "--data.dataset=post_train", f"--data.data_dir={os.path.join(a.out, 'shards')}",
                       "--model.block_size=256", "--train.seq_len=256",
                       f"--train.micro_batch={4 if a.smoke else 64}", f"--train.steps={a.sft_steps}",
                       f"--train.lr={a.sft_lr}", f"--train.warmup_steps={max(1, a.sft_steps // 10)}",
                       "--train.val_every=0", "--train.sample_tokens=0",
                       f"--train.log_every={max(1, a.sft_steps // 20)}", f"--ckpt.every={a.sft_every}",
                       f"--ckpt.keep={a.sft_steps // a.sft_every + 1}", f"--out_dir={sft_dir}", "--overwrite=true"],
                      os.path.join(runs, "sft.log"))
    recs = [r for r in H.read_jsonl(os.path.join(sft_dir, "metrics.jsonl")) if "loss" in r]
    res.update(sft_steps=a.sft_steps, sft_lr=a.sft_lr, sft_loss_last=recs[-1]["loss"],
               sft_tokens_per_s_median=sorted(r["tokens_per_s"] for r in recs)[len(recs) // 2],
               sft_curve=sft_curve(sft_dir, a.sft_every, a.sft_steps, a.task, a.test_n, device))
    res["sft_final_exact_match"] = res["sft_curve"][-1]["test_exact_match"]


def rl_runs(a, res: dict, sft_dir: str, runs: str) -> None:
    """RL from the SFT checkpoint of step rl_from, one run per learning rate; the one reported is chosen by its
    training reward (never by the held-out prompts)."""
    if a.rl_from == "auto":  # the first checkpoint that gets some training prompts right: RL needs rewards to differ
        rl_from = next((c["step"] for c in res["sft_curve"] if c["train_exact_match"] >= a.auto_em),
                       res["sft_curve"][-1]["step"])
    else:
        rl_from = int(a.rl_from)
    start = os.path.join(sft_dir, "ckpt", f"step_{rl_from:06d}")
    res["rl_from_step"], res["rl_runs"] = rl_from, []
    for lr in [float(x) for x in a.rl_lr.split(",")]:
        res["rl_runs"].append(rl_run(a, lr, start, runs))
    best = max(res["rl_runs"], key=lambda r: r["train_reward_last10pct"])  # chosen by training reward, not test
    res["rl_lr_chosen"] = best["lr"]
    res["exact_match_after_sft"], res["exact_match_after_rl"] = best["exact_match_start"], best["exact_match_end"]
    res["gain_points_over_start"] = 100 * (best["exact_match_end"] - best["exact_match_start"])
    res["gain_points_over_sft_final"] = 100 * (best["exact_match_end"] - res["sft_final_exact_match"])
    res["goal_met"] = min(res["gain_points_over_start"], res["gain_points_over_sft_final"]) >= 15  # over SFT alone


def rl_run(a, lr: float, start: str, runs: str) -> dict:
    rl_dir = os.path.join(runs, f"rl_lr{lr:g}")
    secs = sh(["rl.py", f"--init={start}", f"--task={a.task}", f"--out_dir={rl_dir}", "--overwrite=1",
               f"--device={a.device}", f"--steps={a.rl_steps}", f"--prompts={a.prompts}", f"--group={a.group}",
               f"--lr={lr}", "--max_new=8", f"--test_n={a.test_n}", f"--eval_every={a.eval_every}",
               f"--micro={0 if a.smoke else 256}", *a.rl_args.split()], os.path.join(runs, f"rl_lr{lr:g}.log"))
    recs = H.read_jsonl(os.path.join(rl_dir, "metrics.jsonl"))
    evals, steps = [r for r in recs if "test_exact_match" in r], [r for r in recs if "reward" in r]
    head, tail = steps[:max(1, len(steps) // 10)], steps[-max(1, len(steps) // 10):]
    run = {"lr": lr, "rl_args": a.rl_args, "seconds": secs, "exact_match_start": evals[0]["test_exact_match"],
           "exact_match_end": evals[-1]["test_exact_match"],
           "train_reward_first10pct": sum(r["reward"] for r in head) / len(head),
           "train_reward_last10pct": sum(r["reward"] for r in tail) / len(tail),
           "curve": [{"step": r["step"], "test_exact_match": r["test_exact_match"]} for r in evals],
           "reward": [{k: round(r[k], 4) for k in ("step", "reward", "pass_at_group", "response_len", "clip_frac")}
                      for r in steps],
           "step_s_median": sorted(r["step_s"] for r in steps)[len(steps) // 2],
           "gen_tokens_per_s_median": sorted(r["gen_tokens_per_s"] for r in steps)[len(steps) // 2]}
    print(f"RL lr {lr:g}: held-out exact match {run['exact_match_start']:.1%} -> {run['exact_match_end']:.1%}, "
          f"train reward (first / last 10%) {run['train_reward_first10pct']:.3f} / "
          f"{run['train_reward_last10pct']:.3f}, {secs:.0f} s", flush=True)
    return run


def main():
    a = parse()
    runs, device, t_start = os.path.join(a.out, "runs"), torch.device(a.device), time.time()
    os.makedirs(runs, exist_ok=True)
    print(H.banner(f"post_train_demo {a.task} {a.preset}"), flush=True)
    res = {"task": a.task, "preset": a.preset, "model_keys": a.model, "train_examples": a.examples,
           "test_n": a.test_n, "prepare_s": prepare(a, runs)}
    sft_dir = os.path.join(runs, "sft")
    sft(a, res, sft_dir, runs, device)
    rl_runs(a, res, sft_dir, runs)
    sd, cfg = full_model_state(sft_dir)  # batched generation speed on the SFT model's shape
    model = GPT(cfg)
    model.load_state_dict(sd)
    res["generation"] = generation_speed(model, device, batches=(1, 4) if a.smoke else (1, 16, 64, 256),
                                         new=8 if a.smoke else 128)
    res["total_s"] = time.time() - t_start
    H.append_jsonl(os.path.join(a.out, "post_train.jsonl"), res)
    print(f"held-out {a.task} exact match: SFT step {res['rl_from_step']} {res['exact_match_after_sft']:.1%} -> RL "
          f"{res['exact_match_after_rl']:.1%} ({res['gain_points_over_start']:+.1f} points; goal >= +15; SFT alone "
          f"at step {a.sft_steps}: {res['sft_final_exact_match']:.1%}); total {res['total_s']:.0f} s -> "
          f"{os.path.join(a.out, 'post_train.jsonl')}")


if __name__ == "__main__":
    main()
