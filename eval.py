"""Evaluate a nanopara checkpoint (any layout) or GPT-2's Hugging Face weights: HellaSwag, loss, GSM8K.

    python eval.py --init_from=pytorch_model.bin --tasks=hellaswag               # GPT-2's published weights
    python eval.py --out_dir=runs/gpt2 --tasks=hellaswag,loss --out=runs/gpt2/evals.jsonl
    torchrun --nproc_per_node=8 eval.py --out_dir=runs/gpt2 --tasks=hellaswag,loss,gsm8k

Keys (`--key=value`; a repeated key: the last one wins):
  --out_dir=RUN | --ckpt=STEP_DIR | --init_from=FILE   weights, read as sample.py reads them (--n_head=H: odd HF sizes)
  --tasks=LIST       comma-separated, of hellaswag, loss, gsm8k (hellaswag)
  --limit=N          the first N items of each task (loss: windows); 0 = all (0)
  --batch=B          HellaSwag items (x 4 endings), loss windows or GSM8K prompts per forward (16)
  --device=auto|cpu|cuda    --dtype=auto|bf16|fp32 (auto: bf16 autocast on CUDA, fp32 on CPU)
  --hellaswag=PATH   llama.cpp's 6-line HellaSwag file (.txt or .txt.bz2) or its folder (default: the mirror's)
  --data=PATH        loss on: a .bin shard path or glob (every match), a folder or dataset name (its val shards),
                     or a text file; default for a run: the val shards of the data it trained on
  --seq_len=T        loss window (default: the model's context)
  --gsm8k=PATH       test.jsonl or its folder (default: the mirror's); --shots=K worked examples from train.jsonl
                     beside it (5; 0 = none); --max_new=N tokens per answer (256)
  --out=FILE         append the results as one JSON line
Under torchrun each data-parallel rank scores a slice and the results are all-reduced (NCCL; gloo with
--device=cpu): the numbers equal one process's with the same --batch (the loss, which the Trainer's evaluate scores
as train.py's val_loss, to fp32 rounding). Mirror: env NANOPARA_MIRROR, else
../shared/data beside the repository. Scoring rules: nanopara/evals.py. Every user error is one line on stderr and
exit code 2; --help prints this text.
"""
from __future__ import annotations

import dataclasses
import difflib
import glob
import json
import math
import os
import sys
import time

import numpy as np
import torch

from nanopara import evals
from nanopara.checkpoint import CheckpointError
from nanopara.cli import parse_flags
from nanopara.config import Config, ParallelConfig, TrainConfig
from nanopara.consolidate import full_model_state, resolve
from nanopara.data import EOT, default_mirror, find_shards, get_tokenizer, read_shard
from nanopara.evals import EvalError
from nanopara.mesh import Mesh, MeshError
from nanopara.model import GPT
from nanopara.parallel import parallelize
from nanopara.trainer import autocast

TASKS = ("hellaswag", "loss", "gsm8k")


@dataclasses.dataclass
class Args:
    out_dir: str = ""
    ckpt: str = ""
    init_from: str = ""
    n_head: int = 0
    tasks: str = "hellaswag"
    limit: int = 0
    batch: int = 16
    device: str = "auto"
    dtype: str = "auto"
    hellaswag: str = ""
    data: str = ""
    seq_len: int = 0
    gsm8k: str = ""
    shots: int = 5
    max_new: int = 256
    out: str = ""


def parse_args(argv: list[str]) -> Args:
    args = parse_flags(Args(), argv, EvalError)  # a repeated key: the last one wins
    for key, low in (("limit", 0), ("batch", 1), ("n_head", 0), ("seq_len", 0), ("shots", 0), ("max_new", 1)):
        if getattr(args, key) < low:
            raise EvalError(f"--{key} must be >= {low}, got {getattr(args, key)}")
    bad = [t for t in args.tasks.split(",") if t not in TASKS]
    if bad or not args.tasks:
        close = difflib.get_close_matches(bad[0], TASKS, n=1) if bad else []
        raise EvalError(f"--tasks: unknown task {bad[0] if bad else ''!r}, choose from {', '.join(TASKS)}"
                        + (f" (did you mean {close[0]}?)" if close else ""))
    if args.device not in ("auto", "cpu", "cuda"):
        raise EvalError(f"--device must be auto, cpu or cuda, got {args.device!r}")
    if args.dtype not in ("auto", "bf16", "fp32"):
        raise EvalError(f"--dtype must be auto, bf16 or fp32, got {args.dtype!r}")
    if args.init_from and (args.out_dir or args.ckpt):
        raise EvalError("give --init_from=FILE or --out_dir/--ckpt, not both")
    if not (args.init_from or args.out_dir or args.ckpt):
        raise EvalError("nothing to evaluate: give --out_dir=RUN, --ckpt=STEP_DIR or --init_from=FILE")
    if args.n_head and not args.init_from:
        raise EvalError("--n_head applies to --init_from only (a checkpoint records its own)")
    return args


# ----------------------------------------------------------------------------------------------------------------
# weights and task data

def load_model(args: Args) -> tuple[GPT, dict]:
    """(the model on CPU, what it is: {"source", "step", "data"} where data is the run's data config or None)."""
    if args.init_from:
        import sample  # beside this file: Hugging Face GPT-2 weights are read one way for both scripts
        try:
            return sample.hf_model(args.init_from, args.n_head), {"source": args.init_from, "step": None,
                                                                    "data": None}
        except sample.SampleError as e:
            raise EvalError(str(e)) from None
    path = args.ckpt or args.out_dir
    if args.ckpt and args.out_dir and not os.path.isdir(args.ckpt):
        path = os.path.join(args.out_dir, "ckpt", args.ckpt)  # a step name under the run
    path, note = resolve(path)
    if note:
        print(f"warning: {note}", file=sys.stderr, flush=True)
    sd, cfg = full_model_state(path)
    model = GPT(cfg)
    model.load_state_dict(sd)
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        meta = {}
    config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    return model, {"source": path, "step": meta.get("step"), "data": config.get("data")}


def loss_streams(args: Args, run_data: dict | None, enc) -> tuple[list, str]:
    """(token arrays, what they are) for the loss task; rule in --data's help."""
    p = args.data
    if not p:
        if not run_data or not run_data.get("dataset"):
            raise EvalError("--tasks=loss needs --data=PATH (shards, a dataset name or a text file)")
        try:
            files = find_shards(run_data["dataset"], "val", run_data.get("data_dir", "data/shards"))
        except (FileNotFoundError, ValueError) as e:
            raise EvalError(f"the run's own validation data: {e}; pass --data=PATH") from None
    elif os.path.isfile(p) and not p.endswith(".bin"):  # a text file, tokenized here
        try:
            with open(p, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise EvalError(f"--data: cannot read {p} as UTF-8 text: {type(e).__name__}") from None
        return [np.array([EOT] + enc.encode_ordinary(text), dtype=np.int64)], p
    elif p.endswith(".bin") or any(c in p for c in "*?["):
        files = sorted(glob.glob(p))
        if not files:
            raise EvalError(f"--data: no files match {p}")
    else:
        try:
            files = find_shards(p, "val")
        except (FileNotFoundError, ValueError) as e:
            raise EvalError(f"--data: {e}") from None
    try:
        return [read_shard(f) for f in files], f"{len(files)} shard(s) {files[0]}" + (" ..." if len(files) > 1 else "")
    except (FileNotFoundError, ValueError) as e:
        raise EvalError(f"--data: {e}") from None


def load_tasks(args: Args, tasks: list, info: dict, enc, mirror) -> dict:
    """Every task's data, read before the model runs: a missing or malformed file fails first."""
    data = {}
    if "hellaswag" in tasks:
        path = evals.find_eval_file(args.hellaswag, mirror, "hellaswag",
                                    ("hellaswag_val_full.txt.bz2", "hellaswag_val_full.txt"), "HellaSwag",
                                    f"download {evals.HELLASWAG_URL} and pass --hellaswag=FILE")
        data["hellaswag"] = evals.read_hellaswag(path, args.limit)
    if "loss" in tasks:
        data["loss"] = loss_streams(args, info["data"], enc)[0]
    if "gsm8k" in tasks:
        path = evals.find_eval_file(args.gsm8k, mirror, "gsm8k", ("test.jsonl",), "GSM8K",
                                    f"download test.jsonl from {evals.GSM8K_URL} and pass --gsm8k=FILE")
        rows, shots = evals.read_gsm8k(path, args.limit), []
        if args.shots:
            train = os.path.join(os.path.dirname(path), "train.jsonl")
            if not os.path.isfile(train):
                raise EvalError(f"--shots={args.shots} takes worked examples from {train}, which does not exist "
                                f"(download it from {evals.GSM8K_URL}, or --shots=0)")
            shots = evals.read_gsm8k(train, args.shots)
        data["gsm8k"] = (rows, shots)
    return data


# ----------------------------------------------------------------------------------------------------------------
# output

class Progress:
    """callback(done, total) drawing a bar on stderr: redrawn in place on a terminal, every 10% otherwise."""

    def __init__(self, name: str, enabled: bool):
        self.name, self.enabled, self.t0, self.last = name, enabled, time.perf_counter(), -1
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int):
        if not self.enabled or not total:
            return
        frac = done / total
        if not self.tty and int(frac * 10) == self.last:
            return
        self.last = int(frac * 10)
        dt = time.perf_counter() - self.t0
        eta = dt / frac - dt if frac else 0.0
        bar = "#" * int(frac * 30)
        line = f"{self.name:<10} [{bar:<30}] {done}/{total} {dt:6.1f}s eta {eta:6.1f}s"
        print("\r" + line if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)
        if self.tty and done == total:
            print(file=sys.stderr, flush=True)


def table(results: dict) -> str:
    rows = [("task", "metric", "value", "n")]
    for key, v in results.items():
        if key in ("loss", "ppl"):
            rows.append(("loss", key, f"{v:.4f}" if key == "loss" else f"{v:.2f}", f"{results['loss_tokens']:,} tok"))
        elif key.startswith(("hellaswag_acc", "gsm8k_exact")):
            task, metric = key.split("_", 1)
            rows.append((task, metric, f"{100 * v:.2f}%", f"{results[task + '_n']:,}"))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:>{w[2]}}  {r[3]:>{w[3]}}" for r in rows)


# ----------------------------------------------------------------------------------------------------------------
# the loss task: the Trainer's evaluate

def loss_task(model: GPT, streams: list, args: Args, mesh: Mesh, progress=None) -> dict:
    """{"loss", "ppl", "loss_tokens"}: the mean next-token loss over evals.loss_batches' windows, scored by the
    Trainer's evaluate (parallel.parallelize over the dp ranks: train.py's val_loss). evaluate averages batch means
    over the ranks, so a call must give every rank a batch of the same size: round r hands rank k batch
    r * world + k while whole rounds of full batches last; each batch left over (fewer than world, or the short
    last one) is scored by one rank while the others pass none (a mean of 0), so its mean comes back / world."""
    T = args.seq_len or model.cfg.block_size
    batches = evals.loss_batches(streams, T, args.batch, args.limit, model.cfg.vocab_size, model.cfg.block_size)
    cfg = Config(preset="eval", device=mesh.device.type, model=model.cfg, parallel=ParallelConfig(dp=mesh.dp),
                 train=TrainConfig(micro_batch=args.batch, seq_len=T, dtype=args.dtype, val_every=0, sample_tokens=0))
    trainer = parallelize(model, mesh, cfg)
    W, rank, full = mesh.dp, mesh.dp_rank, len(batches[-1]) == args.batch
    rounds = (len(batches) if full else len(batches) - 1) // W
    nll, done, mine = 0.0, 0, rounds + sum(j % W == rank for j in range(rounds * W, len(batches)))
    for r in range(rounds):
        nll += trainer.evaluate([evals.window_batch(streams, batches[r * W + rank], T)]) * W * args.batch * T
        done += 1
        if progress:
            progress(done, mine)
    for j in range(rounds * W, len(batches)):
        own = j % W == rank
        nll += trainer.evaluate([evals.window_batch(streams, batches[j], T)] if own else []) * W * len(batches[j]) * T
        done += own
        if progress and own:
            progress(done, mine)
    trainer.close()
    n = sum(map(len, batches)) * T
    return {"loss": nll / n, "ppl": math.exp(min(nll / n, 700.0)), "loss_tokens": n}


# ----------------------------------------------------------------------------------------------------------------

def run(args: Args, mesh: Mesh) -> dict:
    tasks = list(dict.fromkeys(args.tasks.split(",")))
    main_rank = mesh.is_main
    try:
        enc = get_tokenizer()
    except RuntimeError as e:  # offline, no cached encoding
        raise EvalError(str(e)) from None
    model, info = load_model(args)
    data = load_tasks(args, tasks, info, enc, default_mirror())
    cfg = model.cfg
    if {"hellaswag", "gsm8k"} & set(tasks) and cfg.vocab_size < enc.n_vocab:
        raise EvalError(f"hellaswag and gsm8k are tokenized with GPT-2's {enc.n_vocab} tokens; this model has "
                        f"vocab_size {cfg.vocab_size}")
    if args.seq_len > cfg.block_size:
        raise EvalError(f"--seq_len={args.seq_len} exceeds the model's context of {cfg.block_size}")
    if "gsm8k" in tasks and args.max_new >= cfg.block_size:
        raise EvalError(f"--max_new={args.max_new} leaves no room for a question in the model's context of "
                        f"{cfg.block_size} (use --max_new<={cfg.block_size - 1})")
    dev = mesh.device
    model.to(dev)
    amp, half = autocast(args.dtype, dev)  # nanopara/trainer.py: the one autocast rule
    kw = dict(rank=mesh.dp_rank, world=mesh.dp, group=mesh.dp_group, amp=amp)
    results = {}
    for task in tasks:
        t0 = time.perf_counter()
        bar = Progress(task, main_rank)
        if task == "hellaswag":
            results.update(evals.hellaswag(model, enc, data[task], args.batch, progress=bar, **kw))
        elif task == "loss":
            results.update(loss_task(model, data[task], args, mesh, progress=bar))
        else:
            rows, shots = data[task]
            results.update(evals.gsm8k(model, enc, rows, shots, args.batch, args.max_new, progress=bar, **kw))
            results["gsm8k_shots"] = len(shots)
        results[f"{task}_time_s"] = round(time.perf_counter() - t0, 2)
    record = {"source": info["source"], "step": info["step"], "tasks": tasks, "limit": args.limit,
              "world": mesh.world, "device": str(dev), "dtype": "bf16" if half else "fp32", **results}
    if main_rank:
        print(table(results), flush=True)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return 0
    rank = int(os.environ.get("RANK", "0"))
    mesh = None
    try:
        args = parse_args(argv)
        mesh = Mesh.build(device=args.device)
        run(args, mesh)
        return 0
    except torch.OutOfMemoryError as e:
        print(f"error (rank {rank}): out of GPU memory ({str(e).splitlines()[0][:100]}): lower --batch",
              file=sys.stderr, flush=True)
        return 2
    except (EvalError, CheckpointError, MeshError) as e:
        if rank == 0:  # the same on every rank: one line, not one per process
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if mesh is not None:
            mesh.destroy()


if __name__ == "__main__":
    sys.exit(main())
