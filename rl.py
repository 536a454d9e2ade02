"""RL with verifiable rewards (GRPO) on a task with a checker, from a checkpoint of this trainer.

    python rl.py --init=runs/sft --task=arith --out_dir=runs/rl --steps=100
    torchrun --nproc_per_node=4 rl.py --init=runs/sft --task=arith --out_dir=runs/rl --prompts=64 --group=16

Per step: --prompts prompts split over the dp ranks, --group completions each after sft.prompt_ids, rewards from the
task's checker (nanopara/tasks.py), --updates steps of GRPO's loss (nanopara/rl.py) through parallel.parallelize's
Trainer; greedy exact match on --test_n held-out prompts every --eval_every steps. Writes --out_dir's metrics.jsonl
(reward, pass_at_group, zero_adv_groups: of all sampled groups; informative_groups: of the trained; kl, ...;
flop_tokens: compute so far in forward-token equivalents; eval lines: test_exact_match, test_set), config.json, ckpt/.
Keys (`--key=value`, the last one wins; --help prints this). A user error: one line on stderr, exit code 2:
  --init=PATH        the starting policy: a run, ckpt/ or step directory (any layout), or HF GPT-2 weights (.bin/.pt)
  --task=NAME        arith | digits | sort | count | gsm8k (arith); --gsm8k=PATH: GSM8K's folder (default: the mirror's)
  --train_n=N        training prompts to draw from (20000); --test_n=N held-out prompts scored (500)
  --seed=S           sampling and prompt order (1337); --prompt_seed=S: which --train_n prompts (1337); --test_seed=S:
                     which held-out prompts (tasks.TEST_SEED = 1337: one fixed set for every run)
  --steps=N (100)  --prompts=P per step, global (32)  --group=G completions per prompt (8)  --temperature=T (1.0)
  --oversample=F     draw F x the prompts (1 to 16; 1.0), train on --prompts groups: rewards not all equal first (DAPO)
  --max_new=N        tokens per completion, EOT included (32); --sample_batch=N rows per sampling batch (256)
  --lr=LR (1e-5)  --warmup=N steps of linear warm-up (10)  --weight_decay=W (0)  --grad_clip=C (1.0)  AdamW's
  --adam_eps=E (1e-8; betas 0.9 / 0.95)  --clip_eps=E PPO ratio clip (0.2)  --kl_coef=B k3 KL to the start (0)
  --updates=K        optimizer steps per batch of rollouts (1); --micro=R rows per forward in updates, 0 = all (0)
  --eval_every=N     held-out exact match every N steps, 0 = at the start and the end only (25); --save=0: no checkpoint
  --out_dir=DIR (runs/rl)  --overwrite=1 replaces it  --device=auto|cpu|cuda  --dtype=auto|bf16|fp32 (auto: CUDA bf16)
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import sys
import time

import torch
import torch.distributed as dist

from nanopara import rl, tasks
from nanopara.checkpoint import CheckpointError, prepare_run_dir, save
from nanopara.cli import parse_flags
from nanopara.config import ConfigError
from nanopara.consolidate import full_model_state, resolve
from nanopara.data import get_tokenizer
from nanopara.evals import EvalError
from nanopara.mesh import Mesh, MeshError
from nanopara.model import GPT
from nanopara.parallel import parallelize
from nanopara.report import Metrics
from nanopara.sft import EOT, prompt_ids


class RLError(ValueError):
    """A user mistake: one line on stderr, exit code 2."""


@dataclasses.dataclass
class Args:
    init: str = ""
    task: str = "arith"
    gsm8k: str = ""
    train_n: int = 20000
    test_n: int = 500
    steps: int = 100
    prompts: int = 32
    group: int = 8
    oversample: float = 1.0
    max_new: int = 32
    sample_batch: int = 256
    temperature: float = 1.0
    lr: float = 1e-5
    warmup: int = 10
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    updates: int = 1
    micro: int = 0
    eval_every: int = 25
    out_dir: str = "runs/rl"
    overwrite: int = 0
    save: int = 1
    seed: int = 1337
    prompt_seed: int = 1337
    test_seed: int = tasks.TEST_SEED
    device: str = "auto"
    dtype: str = "auto"


def parse_args(argv: list[str]) -> Args:
    a = parse_flags(Args(), argv, RLError)
    for key, low in (("train_n", 1), ("test_n", 1), ("steps", 1), ("prompts", 1), ("group", 2), ("max_new", 1),
                     ("sample_batch", 1), ("warmup", 0), ("updates", 1), ("micro", 0), ("eval_every", 0)):
        if getattr(a, key) < low:
            raise RLError(f"--{key} must be >= {low}, got {getattr(a, key)}")
    for key, lo, hi in (("lr", 0, 1), ("clip_eps", 0, 1)):
        if not lo < getattr(a, key) <= hi:
            raise RLError(f"--{key} must be in ({lo}, {hi}], got {getattr(a, key)}")
    if not 1 <= a.oversample <= 16:
        raise RLError(f"--oversample must be in [1, 16] (prompts sampled per prompt trained), got {a.oversample}")
    if not 0 < a.adam_eps < 1:
        raise RLError(f"--adam_eps must be in (0, 1), got {a.adam_eps}")
    for key in ("weight_decay", "grad_clip", "kl_coef"):
        if not 0 <= getattr(a, key) < float("inf"):
            raise RLError(f"--{key} must be a finite number >= 0, got {getattr(a, key)}")
    if not 1e-4 <= a.temperature < float("inf"):
        raise RLError(f"--temperature must be >= 1e-4 (RL samples; greedy gives every completion one reward), "
                      f"got {a.temperature}")
    for key in ("seed", "prompt_seed", "test_seed"):
        if not 0 <= getattr(a, key) < 2 ** 32:
            raise RLError(f"--{key} must be in [0, 2**32), got {getattr(a, key)}")
    if a.task not in tasks.TASKS:
        raise RLError(f"--task: unknown task {a.task!r}, choose from {', '.join(tasks.TASKS)}")
    if a.device not in ("auto", "cpu", "cuda"):
        raise RLError(f"--device must be auto, cpu or cuda, got {a.device!r}")
    if a.dtype not in ("auto", "bf16", "fp32"):
        raise RLError(f"--dtype must be auto, bf16 or fp32, got {a.dtype!r}")
    if a.overwrite not in (0, 1) or a.save not in (0, 1):
        raise RLError("--overwrite and --save take 0 or 1")
    if not a.init:
        raise RLError("no starting policy: give --init=RUN_DIR (a checkpoint of train.py) or a GPT-2 state dict file")
    if not os.path.exists(a.init):
        raise RLError(f"--init: no such run, checkpoint or file {a.init}")
    return a


def load_policy(path: str) -> GPT:
    if os.path.isfile(path):  # Hugging Face GPT-2 weights, read as sample.py reads them
        import sample
        try:
            return sample.hf_model(path)
        except sample.SampleError as e:
            raise RLError(str(e)) from None
    sd, cfg = full_model_state(resolve(path)[0])
    model = GPT(cfg)
    model.load_state_dict(sd)
    return model


def logprobs(model, ro: rl.Rollout, a: Args, amp) -> torch.Tensor:
    """(B, T-1) response-token log-probs without grad, in micro-batches."""
    step = a.micro or ro.tokens.shape[0]
    with torch.no_grad():
        return torch.cat([rl.token_logprobs(model, ro.tokens[s:s + step], ro.mask[s:s + step], a.temperature, amp)
                          for s in range(0, ro.tokens.shape[0], step)])


# ----------------------------------------------------------------------------------------------------------------
def run(a: Args) -> dict:
    mesh = Mesh.build(dp=-1, device=a.device)
    dev, rank, world, group = mesh.device, mesh.rank, mesh.world, mesh.dp_group
    if a.prompts % world:
        raise RLError(f"--prompts={a.prompts} must be a multiple of the {world} data-parallel ranks")
    n_keep = a.prompts // world  # groups trained per rank
    n_draw = math.ceil(n_keep * a.oversample - 1e-9)  # groups sampled per rank (the -1e-9: 10 * 1.1 is 11.000...02)
    if n_draw * world > a.train_n:
        raise RLError(f"--prompts={a.prompts} x --oversample={a.oversample} draws {n_draw * world} distinct prompts a "
                      f"step, more than --train_n={a.train_n}")
    if a.dtype == "bf16" and dev.type != "cuda":
        raise RLError("--dtype=bf16 needs --device=cuda here (CPU runs fp32)")
    prepare_run_dir(a.out_dir, resume=False, overwrite=bool(a.overwrite), is_main=mesh.is_main)
    enc = get_tokenizer()
    task = tasks.get_task(a.task)
    train_ex = tasks.make_examples(a.task, a.train_n, "train", a.prompt_seed, a.gsm8k)
    test_ex = tasks.make_examples(a.task, a.test_n, "test", a.test_seed, a.gsm8k)
    policy = load_policy(a.init)
    T, V = policy.cfg.block_size, policy.cfg.vocab_size
    if V < enc.n_vocab:
        raise RLError(f"the policy's vocabulary ({V}) is smaller than GPT-2's ({enc.n_vocab})")
    train_ids = [prompt_ids(enc, ex.prompt) for ex in train_ex]
    longest = max(len(p) for p in train_ids + [prompt_ids(enc, ex.prompt) for ex in test_ex])
    if longest + a.max_new > T:
        raise RLError(f"a prompt of {longest} tokens + --max_new={a.max_new} exceeds the policy's context of {T}")
    ref = copy.deepcopy(policy).to(dev).eval() if a.kl_coef > 0 else None
    trainer = parallelize(policy, mesh, rl.trainer_config(
        policy.cfg, rows=a.prompts // world * a.group, micro=a.micro, world=world, device=dev.type, dtype=a.dtype,
        weight_decay=a.weight_decay, eps=a.adam_eps, grad_clip=a.grad_clip))
    policy, amp = trainer.model.eval(), trainer.amp  # no dropout anywhere: the first update's ratio must be exactly 1
    metrics = Metrics(a.out_dir, mesh.is_main)
    if mesh.is_main:
        os.makedirs(a.out_dir, exist_ok=True)
        with open(os.path.join(a.out_dir, "config.json"), "w") as f:
            json.dump({"rl": dataclasses.asdict(a), "model": dataclasses.asdict(policy.cfg), "world": world}, f,
                      indent=1)
    gen = torch.Generator(device=dev).manual_seed(a.seed + (rank << 32))  # each rank samples its own completions

    def held_out(step: int) -> float:
        em = rl.exact_match(policy, enc, task, test_ex, a.max_new, eot=EOT, rank=rank, world=world,
                            group=group, amp=amp)
        metrics.log({"step": step, "test_exact_match": em, "test_n": len(test_ex), "test_set": tasks.digest(test_ex)},
                    f"step {step:5d} | held-out exact match {em:.4f} ({len(test_ex)} {a.task} prompts)")
        return em

    first = held_out(0)
    last, flop_tokens = first, 0.0
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        batch = random.Random(f"{a.seed}/{step}").sample(range(len(train_ex)), n_draw * world)  # same on every rank
        mine = batch[rank::world]
        rows = [train_ids[i] for i in mine for _ in range(a.group)]  # (n_draw * G) prompts, a group together
        new = rl.sample(policy, rows, a.max_new, a.temperature, EOT, gen, amp, max_batch=a.sample_batch)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t_gen = time.perf_counter() - t0
        rewards = torch.tensor([task.check(enc.decode([t for t in c if t != EOT]), train_ex[i].answer)
                                for i, c in zip([i for i in mine for _ in range(a.group)], new)]).view(-1, a.group)
        # DAPO's dynamic sampling: train on n_keep groups, those whose rewards differ first (an all-equal group has
        # A = 0: no gradient), then all-equal ones; sampled order kept, so n_draw = n_keep trains every group as drawn
        spread = (rewards.std(1, correction=0) > 0).tolist()
        keep = sorted(([g for g in range(n_draw) if spread[g]] + [g for g in range(n_draw) if not spread[g]])[:n_keep])
        kept = [g * a.group + j for g in keep for j in range(a.group)]
        ro = rl.make_rollout([rows[k] for k in kept], [new[k] for k in kept],
                             rl.group_advantages(rewards[keep]).flatten(), dev)  # (n_keep * G) rows
        ro.old_logp = logprobs(policy, ro, a, amp)
        ro.ref_logp = logprobs(ref, ro, a, amp) if ref is not None else None
        lr = a.lr * min(1.0, step / a.warmup) if a.warmup else a.lr
        ups = [rl.update(trainer, ro, lr, clip_eps=a.clip_eps, kl_coef=a.kl_coef, temperature=a.temperature)
               for _ in range(a.updates)]
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        n_gen = sum(len(c) for c in new)
        s = rl.all_sum(torch.tensor([rewards.sum().item(), rewards.numel(), (rewards.max(1).values > 0).sum().item(),
                                     (rewards.std(1, correction=0) == 0).sum().item(), rewards.shape[0],
                                     float(n_gen), sum(c[-1] == EOT for c in new), float(sum(map(len, rows)) + n_gen),
                                     float(ro.tokens.numel()), sum(spread[g] for g in keep), len(keep)],
                                    dtype=torch.float64, device=dev), group, world).tolist()
        t_gen_max = torch.tensor([t_gen], dtype=torch.float64, device=dev)
        if world > 1:  # the slowest rank's sampling time
            dist.all_reduce(t_gen_max, op=dist.ReduceOp.MAX, group=group)
        t_gen_max = t_gen_max.item()
        # compute in forward-token equivalents (a backward ~ 2 forwards): every sampled row (prompt + completion;
        # with --oversample the groups left out too), the no-grad forwards of old (and ref) log-probs of the trained
        # rows and 3 x the trained tokens of every update (padding counted)
        flop_tokens += s[7] + s[8] * (2 if ref is not None else 1) + 3 * sum(u["trained_tokens"] for u in ups)
        # reward, pass_at_group, zero_adv_groups, response_len, stopped_frac: of every sampled group
        rec = {"step": step, "reward": s[0] / s[1], "pass_at_group": s[2] / s[4], "zero_adv_groups": s[3] / s[4],
               "informative_groups": s[9] / s[10],
               "response_len": s[5] / s[1], "stopped_frac": s[6] / s[1],
               "loss": ups[0]["loss"], "kl": ups[0]["kl"] if ref is not None else None,
               "clip_frac": sum(u["clip_frac"] for u in ups) / len(ups), "grad_norm": ups[-1]["grad_norm"],
               "lr": lr, "gen_tokens_per_s": s[5] / t_gen_max, "tokens_per_s": s[5] / dt, "step_s": dt,
               "flop_tokens": flop_tokens}
        kept_part = f"informative {rec['informative_groups']:.3f} | " if a.oversample > 1 else ""
        metrics.log(rec, f"step {step:5d} | reward {rec['reward']:.3f} | pass@{a.group} {rec['pass_at_group']:.3f} | "
                         f"len {rec['response_len']:.1f} | kl {rec['kl'] or 0:.4f} | clip {rec['clip_frac']:.3f} | "
                         f"{kept_part}gen {rec['gen_tokens_per_s']:.0f} tok/s | {dt * 1000:.0f} ms")
        if (a.eval_every and step % a.eval_every == 0) or step == a.steps:
            last = held_out(step)
    if a.save:
        save(a.out_dir, a.steps, mesh, {"model": policy.state_dict(), "mesh": dict(mesh.coords)},
             {"config": {"model": dataclasses.asdict(policy.cfg)}, "rl": dataclasses.asdict(a)}, keep=1)
    summary = {"task": a.task, "test_exact_match_start": first, "test_exact_match_end": last, "steps": a.steps,
               "flop_tokens": flop_tokens}
    metrics.log(summary, f"held-out exact match {first:.4f} -> {last:.4f}")
    trainer.close()
    mesh.destroy()
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return 0
    try:
        run(parse_args(argv))
        return 0
    except (RLError, ConfigError, CheckpointError, MeshError, EvalError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
