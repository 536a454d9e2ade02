"""Train GPT-2 with nanopara: config -> mesh -> data -> model -> parallelize -> loop -> log / checkpoint.

    python train.py --preset=tiny --device=cpu                  # CPU, a few minutes
    python train.py --preset=gpt2_124m --data.dataset=books     # one GPU
    torchrun --nproc_per_node=8 train.py --parallel.zero=1      # eight GPUs, ZeRO-1
    make train NGPU=8 ARGS="--train.steps=100"                  # the same through make

Every key is listed by `nanopara/config.py`; unknown keys and bad values stop the run before any work.
Composition order (DESIGN.md section 4): TP (+SP) -> CP -> PP split -> activation checkpointing -> DP/ZeRO wrap.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import resource
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from nanopara import checkpoint
from nanopara.config import Config, ConfigError, describe, parse_args
from nanopara.data import TokenLoader, find_shards, get_tokenizer
from nanopara.dp import build_engine
from nanopara.graph import GraphedMicroStep, check_graphable
from nanopara.mesh import Mesh, MeshError
from nanopara.model import GPT, from_hf_state_dict
from nanopara.optim import LossScaler, lr_at

# dense bf16 tensor-core peak per GPU (never the sparse figure), for MFU
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12, "A800": 312e12,
              "L40S": 362e12, "L4": 121e12, "A10G": 70e12, "RTX 4090": 165e12, "RTX 3090": 71e12}


class TrainingError(RuntimeError):
    """A run that cannot go on (bad data, repeated non-finite loss): one clear line, then exit."""


def peak_flops(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), 0.0)


def flops_per_token(cfg: Config, n_params: int) -> float:
    """6N for the matmuls of forward+backward plus attention's 12*L*T*C (causal masking not discounted)."""
    m = cfg.model
    return 6 * n_params + 12 * m.n_layer * m.n_embd * cfg.train.seq_len


def autocast_dtype(cfg: Config, device: torch.device):
    d = cfg.train.dtype
    if d == "auto":
        d = "bf16" if device.type == "cuda" else "fp32"
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[d]


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def rng_state(device: torch.device) -> dict:
    s = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
         "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64))}  # tensors load with weights_only
    if device.type == "cuda":
        s["cuda"] = torch.cuda.get_rng_state(device)
    return s


def set_rng_state(s: dict, device: torch.device) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate((3, tuple(int(x) for x in s["python"]), None))
    st = np.random.get_state()
    np.random.set_state((st[0], s["numpy"].numpy().astype(np.uint32), 624, 0, 0.0))
    if device.type == "cuda" and "cuda" in s:
        torch.cuda.set_rng_state(s["cuda"], device)


def all_reduce_mean(x: torch.Tensor, mesh: Mesh, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, group=group)
        x /= dist.get_world_size(group)
    return x


# ----------------------------------------------------------------------------------------------------------------
class Logger:
    """Rank 0 prints one line per step and appends JSON lines to <out_dir>/metrics.jsonl."""

    def __init__(self, out_dir: str, enabled: bool, start_step: int):
        self.enabled = enabled
        self.path = os.path.join(out_dir, "metrics.jsonl")
        if enabled and start_step > 0 and os.path.exists(self.path):  # resumed: drop lines past the checkpoint
            with open(self.path) as f:
                keep = [ln for ln in f if ln.strip() and json.loads(ln).get("step", 0) < start_step]
            with open(self.path, "w") as f:
                f.writelines(keep)
        elif enabled and start_step == 0 and os.path.exists(self.path):
            os.remove(self.path)

    def log(self, rec: dict, line: str | None = None):
        if not self.enabled:
            return
        if line:
            print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def write_run_info(cfg: Config, out_dir: str, mesh: Mesh) -> None:
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        f.write(describe(cfg))
    info = [f"git {git_rev()}", f"torch {torch.__version__}", f"mesh world={mesh.world} {mesh.sizes}",
            f"argv {' '.join(sys.argv)}"]
    try:
        info.append(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout)
    except Exception:
        info.append("nvidia-smi: not available")
    with open(os.path.join(out_dir, "run_info.txt"), "w") as f:
        f.write("\n".join(info) + "\n")


@torch.no_grad()
def evaluate(engine, loader: TokenLoader, steps: int, mesh: Mesh, device, amp) -> float:
    engine.model.eval()
    loader.reset()
    total = torch.zeros((), device=device)
    steps = min(steps, len(loader))  # never wrap around and count the same tokens twice
    for _ in range(steps):
        x, y = next(loader)
        with amp():
            _, loss = engine.model(x.to(device), y.to(device))
        total += loss.float()
    engine.model.train()
    return all_reduce_mean(total / steps, mesh, mesh.groups.get("dp_cp")).item()


@torch.no_grad()
def sample(model: GPT, device, tokens: int, seed: int, amp) -> str:
    enc = get_tokenizer()
    g = torch.Generator(device=device).manual_seed(seed)
    start = enc.eot_token if enc.eot_token < model.cfg.vocab_size else 0  # tiny test vocabularies lack EOT
    idx = torch.tensor([[start]], device=device)
    model.eval()
    with amp():
        out = model.generate(idx, tokens, temperature=1.0, top_k=200, generator=g)
    model.train()
    return enc.decode([t for t in out[0, 1:].tolist() if t < enc.n_vocab])


# ----------------------------------------------------------------------------------------------------------------
def train(cfg: Config) -> dict:
    t = cfg.train
    mesh = Mesh.build(cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.tp, cfg.device,
                      cfg.parallel.timeout_s)
    device = mesh.device
    log = print if mesh.is_main else (lambda *a, **k: None)

    # the batch arithmetic, checked before any data or model work
    per_micro = t.micro_batch * t.seq_len * mesh.dp  # global tokens of one micro-step
    tokens_per_step = t.tokens_per_step or per_micro
    if tokens_per_step % per_micro:
        raise ConfigError(f"train.tokens_per_step={tokens_per_step} is not a multiple of micro_batch*seq_len*dp = "
                          f"{t.micro_batch}*{t.seq_len}*{mesh.dp} = {per_micro}")
    accum = tokens_per_step // per_micro
    if t.cuda_graph:
        check_graphable(cfg, device, mesh.world)

    # data: missing or broken shards fail here, before the model is built
    train_files = find_shards(cfg.data.dataset, "train", cfg.data.data_dir)
    val_files = find_shards(cfg.data.dataset, "val", cfg.data.data_dir) if t.val_every > 0 else []
    loader = TokenLoader(train_files, t.micro_batch, t.seq_len, rank=mesh.dp_rank, world=mesh.dp, seed=cfg.seed,
                         vocab_size=cfg.model.vocab_size)
    first = loader.state_dict()
    next(loader)  # opens the first shard now: bad headers or token ids >= vocab fail before any model work
    loader.load_state_dict(first)
    val_loader = None
    if val_files:
        try:
            val_loader = TokenLoader(val_files, t.micro_batch, t.seq_len, rank=mesh.dp_rank, world=mesh.dp,
                                     seed=cfg.seed, vocab_size=cfg.model.vocab_size, shuffle=False)
        except ValueError as e:  # a tiny validation split must not stop a training run
            log(f"warning: validation off: {e}")

    resume_path = None
    if cfg.resume:
        resume_path = checkpoint.latest(cfg.out_dir)
        if resume_path is None:
            raise checkpoint.CheckpointError(f"--resume: no complete checkpoint under {cfg.out_dir}/ckpt")
        saved = checkpoint.read_meta(resume_path).get("config", {}).get("model", {})  # corrupt meta fails here
        diff = [f"model.{k}={saved[k]} (this run: {v})" for k, v in dataclasses.asdict(cfg.model).items()
                if k in saved and k != "kernels" and saved[k] != v]
        if diff:
            raise checkpoint.CheckpointError(f"checkpoint {resume_path} was trained with a different model: "
                                             + ", ".join(diff))

    # model: identical init on every rank (same seed), then parallelism from outside
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    model = GPT(cfg.model)
    if cfg.ckpt.init_from and not resume_path:
        if not os.path.isfile(cfg.ckpt.init_from):
            raise checkpoint.CheckpointError(f"--ckpt.init_from: no file {cfg.ckpt.init_from}")
        from_hf_state_dict(model, torch.load(cfg.ckpt.init_from, map_location="cpu", weights_only=True))
        log(f"initialised from Hugging Face GPT-2 weights {cfg.ckpt.init_from}")
    n_params = model.num_params()
    tp_shards = {}
    if mesh.tp > 1:
        from nanopara.tp import apply_tp, shard_metadata
        model = apply_tp(model, mesh, sp=cfg.parallel.sp)
        tp_shards = shard_metadata(model, mesh)
    model.to(device)
    engine = build_engine(model, mesh, cfg)
    dtype = autocast_dtype(cfg, device)
    amp = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext
    scaler = LossScaler(enabled=dtype == torch.float16)

    start = 0
    if resume_path:
        state, meta = checkpoint.load(resume_path, mesh)
        try:
            engine.load_model_state_dict(state["model"])
            engine.load_state_dict(state["engine"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise checkpoint.CheckpointError(f"checkpoint {resume_path} does not fit this run: {e}") from None
        loader.load_state_dict(state["loader"])
        scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"], device)
        start = meta["step"]
        log(f"resumed from {resume_path} at step {start}")
    if t.compile:
        engine.model = torch.compile(engine.model)
    graphed = GraphedMicroStep(engine.model, amp, scaler.scale / accum, engine) if t.cuda_graph else None

    os.makedirs(cfg.out_dir, exist_ok=True)
    if mesh.is_main:
        write_run_info(cfg, cfg.out_dir, mesh)
    logger = Logger(cfg.out_dir, mesh.is_main, start)
    log(describe(cfg))
    log(f"mesh {mesh} | world {mesh.world} | device {device} | dtype {dtype or torch.float32} | "
        f"params {n_params / 1e6:.1f}M | tokens/step {tokens_per_step} = {accum} micro-steps x {per_micro}")

    def save(step):
        state = {"model": engine.model_state_dict(), "engine": engine.state_dict(), "loader": loader.state_dict(),
                 "scaler": scaler.state_dict(), "rng": rng_state(device), "mesh": dict(mesh.coords),
                 "tp_shards": tp_shards}  # which global slice of each tp-sharded tensor this rank holds
        meta = {"config": cfg.to_dict(), "git": git_rev()}
        path = checkpoint.save(cfg.out_dir, step, mesh, state, meta, keep=cfg.ckpt.keep)
        log(f"saved checkpoint {path}")

    fpt, peak = flops_per_token(cfg, n_params), peak_flops(device)
    # A step's numbers (loss, norm, time) are read one step late unless something needs them sooner (fp16: the loss
    # scale of the next step; validation, samples, checkpoints and the last step): the host reads step i while the
    # GPU already runs step i+1, so the GPU never idles between steps waiting for the host, and a host stall
    # shorter than a step costs nothing. A step's time on GPU is CUDA-event time from the previous step's end (from
    # its own start after a pause: validation, a checkpoint), so host stalls count and the host's lead does not;
    # the slowest / fastest rank's go over a gloo group, a collective between the hosts that never waits for a GPU.
    defer = not scaler.enabled
    host_group = dist.new_group(backend="gloo") if mesh.world > 1 and device.type == "cuda" else None
    losses, bad_streak, step, last_end = [], 0, start, 0.0

    def report(p: dict) -> None:
        nonlocal bad_streak, last_end
        if p["done"] is not None:
            p["done"].synchronize()  # this step only (a tensor's .item() would wait for everything queued since)
        loss_val, grad_norm = p["numbers"].tolist()
        finite = math.isfinite(loss_val) and math.isfinite(grad_norm)
        scaler.update(math.isfinite(grad_norm))
        if not math.isfinite(loss_val):
            bad_streak += 1
            log(f"warning: step {p['step']}: loss is {loss_val}; update skipped ({bad_streak} in a row)")
            if bad_streak >= t.max_bad_steps:
                raise TrainingError(f"loss was non-finite for {bad_streak} steps in a row (step {p['step']}); "
                                    f"stopping. Lower train.lr, check the data, or use train.dtype=bf16/fp32")
        else:
            bad_streak = 0
        if p["done"] is not None:
            dt = p["since"].elapsed_time(p["done"]) / 1e3
        else:  # CPU: from the previous step's end, or this one's start
            end = time.perf_counter()
            dt, last_end = end - max(p["t0"], last_end), end
        dts = [dt]
        if mesh.world > 1:  # slowest / fastest rank: stragglers show up here
            buf = torch.tensor([dt, -dt])
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=host_group)
            dts = [buf[0].item(), -buf[1].item()]
        tok_s = tokens_per_step / max(dts[0], 1e-9)
        tflops = fpt * tok_s / mesh.world / 1e12
        mem = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 1e9
        losses.append(loss_val)
        rec = {"step": p["step"], "loss": loss_val, "lr": p["lr"], "grad_norm": grad_norm, "tokens_per_s": tok_s,
               "tflops": tflops, "mfu": tflops * 1e12 / peak if peak else 0.0, "peak_mem_gb": mem,
               "step_time_s": dts[0], "fastest_step_time_s": dts[-1], "skipped": not finite}
        if p["step"] % t.log_every == 0 or p["step"] == t.steps - 1:
            logger.log(rec, f"step {p['step']:5d} | loss {loss_val:.4f} | lr {p['lr']:.2e} | norm {grad_norm:.3f} | "
                            f"{tok_s:,.0f} tok/s | {tflops:.1f} TFLOP/s | MFU {rec['mfu'] * 100:.1f}% | "
                            f"mem {mem:.2f} GB | {dts[0] * 1e3:.0f} ms (fastest {dts[-1] * 1e3:.0f})")
        else:
            logger.log(rec)

    pending = None
    for step in range(start, t.steps):
        t0 = time.perf_counter()
        since = pending["done"] if pending is not None else None  # GPU: the previous step's end, else (after a
        if device.type == "cuda" and since is None:                # pause or at the start) now
            since = torch.cuda.Event(enable_timing=True)
            since.record()
        lr = lr_at(step, t)
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            x, y = next(loader)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if graphed is not None:  # one GPU: no communication to skip or launch
                loss = graphed(x, y)
            else:
                with engine.no_sync(micro < accum - 1):
                    with amp():
                        _, loss = engine.model(x, y)
                    engine.backward(loss.float() * (scaler.scale / accum))
            loss_sum += loss.detach().float()
        loss_mean = all_reduce_mean(loss_sum / accum, mesh, mesh.groups.get("dp_cp"))
        norm = engine.step(lr, grad_scale=scaler.scale, sync=not defer)  # a NaN loss gives a NaN norm: skipped
        numbers = torch.stack([loss_mean.float(), torch.as_tensor(norm, dtype=torch.float32, device=device)])
        done = None
        if device.type == "cuda":  # to pinned host memory behind the step's work, read once `done` has passed
            numbers = torch.empty(2, pin_memory=True).copy_(numbers, non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        if pending is not None:
            report(pending)  # the previous step, while this one runs on the GPU
        pending = {"step": step, "lr": lr, "numbers": numbers, "done": done, "since": since, "t0": t0}
        last = step == t.steps - 1
        do_val = val_loader is not None and t.val_every > 0 and ((step + 1) % t.val_every == 0 or last)
        do_sample = t.sample_every > 0 and (step + 1) % t.sample_every == 0 and not last
        do_save = (cfg.ckpt.every > 0 and (step + 1) % cfg.ckpt.every == 0) or (last and cfg.ckpt.final)
        if not defer or last or do_val or do_sample or do_save:
            report(pending)
            pending = None
        if do_val:
            vl = evaluate(engine, val_loader, t.val_steps, mesh, device, amp)
            logger.log({"step": step, "val_loss": vl}, f"step {step:5d} | val_loss {vl:.4f}")
        if do_sample:
            log(f"sample: {sample(model, device, t.sample_tokens, cfg.seed, amp)!r}")
        if do_save:
            save(step + 1)

    text = sample(model, device, t.sample_tokens, cfg.seed, amp) if t.sample_tokens > 0 and start < t.steps else ""
    log(f"sample: {text!r}")
    summary = {"losses": losses, "steps": t.steps, "start": start, "sample": text}
    mesh.destroy()
    return summary


def main(argv: list[str] | None = None) -> dict:
    try:
        cfg = parse_args(sys.argv[1:] if argv is None else argv)
        return train(cfg)
    # user-caused: bad config or layout, missing/corrupt data or checkpoint (data errors are FileNotFoundError and
    # ValueError from nanopara/data.py), repeated non-finite loss. One line, no traceback, exit code 2; a caller
    # passing argv (tests, notebooks) gets the exception itself.
    except (ConfigError, MeshError, checkpoint.CheckpointError, TrainingError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        if argv is not None:
            raise
        sys.exit(2)


if __name__ == "__main__":
    main()
