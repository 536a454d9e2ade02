"""Train GPT-2 with nanopara: config -> mesh -> data -> model -> parallelize -> loop -> save.

    python train.py --preset=tiny --device=cpu                  # CPU, a few minutes
    python train.py --preset=gpt2_124m --data.dataset=books     # one GPU
    torchrun --nproc_per_node=8 train.py --parallel.zero=1      # eight GPUs, ZeRO-1
    torchrun --nproc_per_node=8 train.py --parallel.pp=2 --parallel.tp=2 --train.tokens_per_step=524288  # 3D, m=8
    make train NGPU=8 ARGS="--train.steps=100"                  # the same through make

Every key is listed by nanopara/config.py (`python train.py --help`); unknown keys and bad values stop the run
before any work. `--plan` prints the planner's memory and step-time prediction for the run and exits (plan.py). Parallelism is applied from outside the model by nanopara/parallel.py, in the order its docstring
gives (TP -> CP -> EP -> PP -> activation checkpointing -> FP8 -> DP/ZeRO), and returns the Trainer
(nanopara/trainer.py): the one step object this loop calls. Checkpoints: nanopara/checkpoint.py; the log:
nanopara/report.py.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from nanopara import checkpoint, evals, plan_run, reshard, runguard, sft
from nanopara.cli import describe, help_text, parse_args
from nanopara.config import Config, ConfigError
from nanopara.data import TokenLoader, default_mirror, find_shards, get_tokenizer
from nanopara.mesh import Mesh, MeshError
from nanopara.model import GPT
from nanopara.optim import lr_at
from nanopara.parallel import check_layout, parallelize
from nanopara.report import Metrics, StepReporter, TrainingError, flops_per_token


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def write_run_info(cfg: Config, mesh: Mesh) -> None:
    """config.json and run_info.txt into the run directory (rank 0), and for a run under a `runs/` folder
    `runs/latest` pointing at it (runs/latest -> tiny for --out_dir=runs/tiny): `make sample` and `make plot` read
    runs/latest by default. A relative symlink, replaced atomically (a new link under a temporary name, renamed
    over the old one); a `latest` that is not a symlink is left alone; other parents get no link."""
    out = os.path.normpath(os.path.abspath(cfg.out_dir))
    link = os.path.join(os.path.dirname(out), "latest")
    if os.path.basename(os.path.dirname(out)) == "runs" and os.path.basename(out) != "latest" and \
            (os.path.islink(link) or not os.path.exists(link)):
        tmp = f"{link}.tmp{os.getpid()}"
        try:
            os.symlink(os.path.basename(out), tmp)
            os.replace(tmp, link)
        except OSError:  # a file system without symlinks: the run goes on without the link
            if os.path.islink(tmp):
                os.remove(tmp)
    with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
        f.write(describe(cfg))
    info = [f"git {git_rev()}", f"torch {torch.__version__}", f"mesh world={mesh.world} {mesh.sizes}",
            f"argv {' '.join(sys.argv)}"]
    try:
        info.append(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout)
    except Exception:
        info.append("nvidia-smi: not available")
    with open(os.path.join(cfg.out_dir, "run_info.txt"), "w") as f:
        f.write("\n".join(info) + "\n")


def build_loaders(cfg: Config, mesh: Mesh, log) -> tuple[TokenLoader, TokenLoader | None]:
    """Each dp rank's slice of the training shards (and of the validation shards). Missing or broken shards, and
    token ids >= vocab_size, fail here, before any model work."""
    t, d = cfg.train, cfg.data
    common = dict(rank=mesh.dp_rank, world=mesh.dp, seed=cfg.seed, vocab_size=cfg.model.vocab_size,
                  loss_mask=d.loss_mask)  # SFT shards: targets outside the responses come as -1 (data.py)
    loader = TokenLoader(find_shards(d.dataset, "train", d.data_dir), t.micro_batch, t.seq_len, **common)
    if loader.masks is not None:
        log("loss mask on: training on response tokens only (SFT shards)")
        if t.cuda_graph == "auto":  # token_weights: a replay has one fixed scale
            t.cuda_graph = "false"
        if t.cuda_graph == "true":
            raise ConfigError("train.cuda_graph=true with loss-masked (SFT) shards: each micro-batch's loss is "
                              "weighted by its trained-token count, which a graph replay's fixed scale cannot do; "
                              "drop one")
        if cfg.parallel.tp_streams > 1:  # tp_streams.py: the halves' mean losses are averaged with equal weights
            raise ConfigError("parallel.tp_streams=2 with loss-masked (SFT) shards: the two halves of a micro-batch "
                              "would need their trained-token counts as weights; use parallel.tp_streams=1")
    first = loader.state_dict()
    next(loader)  # opens the first shard now
    loader.load_state_dict(first)
    if t.val_every == 0:
        return loader, None
    try:
        return loader, TokenLoader(find_shards(d.dataset, "val", d.data_dir), t.micro_batch, t.seq_len,
                                   shuffle=False, **common)
    except (ValueError, FileNotFoundError) as e:  # a missing or tiny validation split must not stop training
        log(f"warning: validation off: {e}")
        return loader, None


def build_model(cfg: Config, resuming: bool, log) -> GPT:
    """The single-device model, initialised identically on every rank (same seed), or from Hugging Face weights."""
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    try:
        model = GPT(cfg.model)
    except (RuntimeError, MemoryError) as e:  # the host cannot hold it: say which sizes, not the allocator's trace
        m = cfg.model
        raise ConfigError(f"the model does not fit in host memory (model.n_layer={m.n_layer}, n_embd={m.n_embd}, "
                          f"block_size={m.block_size}, vocab_size={m.vocab_size}): {str(e).splitlines()[0][:120]}")
    if cfg.ckpt.init_from and not resuming:  # a trainer checkpoint or HF GPT-2 weights; shapes checked (sft.py)
        log(f"initialised from {sft.init_from(model, cfg.ckpt.init_from)}")
    return model


def find_resume(cfg: Config, mesh: Mesh, log) -> str | None:
    """--resume: the checkpoint to continue from, ckpt/latest or else the newest that verifies (checkpoint.find_resume:
    each rank hashes its share of the shards), checked against this run's model shape and step count before any
    model work. None for a fresh run, and for --resume in a directory that holds no checkpoint yet (said)."""
    if not cfg.resume:
        return None
    try:
        path, note = checkpoint.find_resume(cfg.out_dir, mesh)
    except checkpoint.NoCheckpoint:
        log(f"--resume: {cfg.out_dir} holds no checkpoint yet: starting from step 0")
        return None
    if note:
        log(f"warning: {note}")
    saved_step = checkpoint.check_model_matches(path, vars(cfg.model))["step"]
    if saved_step >= cfg.train.steps:
        raise ConfigError(f"--resume: {path} is at step {saved_step} and --train.steps={cfg.train.steps}: "
                          f"nothing left to train; raise --train.steps")
    return path


def start_log(cfg: Config, mesh: Mesh, trainer, metrics: Metrics, n_params: int, resume_path, start: int) -> None:
    """config.json and run_info.txt into the run directory, and a one-line summary of the run on screen."""
    if mesh.is_main:
        os.makedirs(cfg.out_dir, exist_ok=True)
        write_run_info(cfg, mesh)
    if resume_path:
        metrics.log({"step": start, "resumed_from": resume_path}, f"resumed from {resume_path} at step {start}")
    t, axes = cfg.train, " ".join(f"{k}{v}" for k, v in mesh.sizes.items() if v > 1) or "one process"
    tokens = trainer.accum * t.micro_batch * t.seq_len * mesh.dp
    if mesh.is_main:
        print(f"{cfg.preset or 'custom'} | {n_params / 1e6:.1f}M params | {axes} on {mesh.device} | "
              f"{trainer.dtype or torch.float32} | {tokens:,} tokens/step = {trainer.accum} micro-steps x "
              f"{t.micro_batch} x {t.seq_len}{' x dp' + str(mesh.dp) if mesh.dp > 1 else ''} | {t.steps} steps | "
              f"config: {os.path.join(cfg.out_dir, 'config.json')}", flush=True)


def load_evals(cfg: Config) -> dict:
    """train.eval_every's items, read once before any model work: {task: items}; a missing file is one line."""
    t = cfg.train
    if t.eval_every == 0:
        return {}
    data = {}
    if "hellaswag" in t.eval_tasks.split(","):
        mirror = default_mirror()
        where = t.eval_hellaswag or os.path.join(mirror or "$NANOPARA_MIRROR (unset)", "eval", "hellaswag", "")
        try:
            path = evals.find_eval_file(t.eval_hellaswag, mirror, "hellaswag", ("hellaswag_val_full.txt.bz2",
                                        "hellaswag_val_full.txt"), "HellaSwag", "pass --train.eval_hellaswag=FILE")
            data["hellaswag"] = evals.read_hellaswag(path, t.eval_limit)
            get_tokenizer()  # offline without a cached encoding: fail now, not at the first eval
        except (evals.EvalError, RuntimeError) as e:
            raise ConfigError(f"train.eval_every={t.eval_every}: {e} (looked in {where}; the file: "
                              f"{evals.HELLASWAG_URL}; or set train.eval_every=0)") from None
    return data


def run_evals(model: GPT, data: dict, cfg: Config, mesh: Mesh, amp, metrics: Metrics, step: int) -> dict:
    """Every task of `data` on the whole model; each dp rank scores its slice of the batches, results summed over
    the dp group (evals.py): the numbers of one process. Logged to metrics.jsonl and as one line."""
    t0, rec = time.perf_counter(), {"step": step}
    kw = dict(rank=mesh.dp_rank, world=mesh.dp, group=mesh.groups.get("dp"), amp=amp)
    if "hellaswag" in data:  # micro_batch rows per forward (4 per item)
        rec.update(evals.hellaswag(model, get_tokenizer(), data["hellaswag"], max(1, cfg.train.micro_batch // 4), **kw))
    rec["eval_time_s"] = time.perf_counter() - t0
    metrics.log(rec, f"step {step:5d} | " + " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else
                                                    f"{k} {v}" for k, v in rec.items() if k != "step"))
    return rec


@torch.no_grad()
def sample(model: GPT, device, tokens: int, seed: int, amp) -> str:
    enc = get_tokenizer()
    g = torch.Generator(device=device).manual_seed(seed)
    start = enc.eot_token if enc.eot_token < model.cfg.vocab_size else 0  # tiny test vocabularies lack EOT
    model.eval()
    with amp():
        out = model.generate(torch.tensor([[start]], device=device), tokens, temperature=1.0, top_k=200, generator=g)
    model.train()
    return enc.decode([t for t in out[0, 1:].tolist() if t < enc.n_vocab])


def token_weights(batches: list, loader, mesh: Mesh) -> list[float] | None:
    """Per micro-batch loss factors that make the step's loss the mean over every trained target of the step,
    across micro-batches and dp ranks, rather than the mean of per-micro-batch means (which over-weights a
    micro-batch with few trained targets). Only loss-masked (SFT) data has unequal counts; otherwise None (all 1).
    Micro-batch i's mean loss times n_i * dp * m / N, N = trained targets of the whole step: the engines' average
    over dp and train.py's 1/m then give sum(losses) / N. One scalar all-reduce over dp per step."""
    if getattr(loader, "masks", None) is None:
        return None
    n = torch.tensor([float((y != -1).sum()) for _, y in batches], dtype=torch.float64)
    total = n.sum().reshape(1).to(mesh.device)
    if mesh.dp > 1:
        dist.all_reduce(total, group=mesh.dp_group)
    return (n * mesh.dp * len(batches) / max(total.item(), 1.0)).tolist()


# ----------------------------------------------------------------------------------------------------------------
def train(cfg: Config) -> dict:
    t = cfg.train
    mesh = Mesh.build(cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.tp, cfg.device,
                      cfg.parallel.timeout_s, ep=cfg.parallel.ep)
    log = print if mesh.is_main else (lambda *a, **k: None)
    accum = check_layout(cfg, mesh.world, mesh.device.type)  # micro-steps per optimizer step
    with runguard.RunGuard(cfg.out_dir, mesh) as guard:  # rank 0 holds out_dir's lock; SIGTERM/SIGINT: save, stop
        checkpoint.prepare_run_dir(cfg.out_dir, cfg.resume, cfg.overwrite, mesh.is_main)
        loader, val_loader = build_loaders(cfg, mesh, log)
        eval_data = load_evals(cfg)  # train.eval_every: HellaSwag items (nanopara/evals.py)
        resume_path = find_resume(cfg, mesh, log)
        model = build_model(cfg, resume_path is not None, log)
        n_params = model.num_params()
        trainer = parallelize(model, mesh, cfg)  # nanopara/parallel.py: the one step object, whatever the layout
        if trainer.pipeline is not None:
            model = None  # each rank keeps its stage (trainer.model): the rest of the GPT goes
        start = reshard.restore_training(resume_path, mesh, trainer, loader) if resume_path else 0
        metrics = Metrics(cfg.out_dir, mesh.is_main)
        start_log(cfg, mesh, trainer, metrics, n_params, resume_path, start)
        reporter = StepReporter(metrics, mesh, trainer.scaler,
                                tokens_per_step=accum * t.micro_batch * t.seq_len * mesh.dp, log_every=t.log_every,
                                flops_per_token=flops_per_token(cfg.model, n_params, t.seq_len),
                                last_step=t.steps - 1, max_bad_steps=t.max_bad_steps, defer=not trainer.scaler.enabled)
        reporter.plan_s = plan_run.expected_step_s(cfg, mesh, log)  # metrics.jsonl: measured / predicted step time

        for step in range(start, t.steps):
            reporter.begin_step()
            lr = lr_at(step, t)
            batches = [next(loader) for _ in range(accum)]
            loss = trainer.forward_backward(batches, token_weights(batches, loader, mesh))  # SFT masks: else None
            norm = trainer.step(lr, sync=not reporter.defer)  # a NaN loss gives a NaN norm: the update is skipped
            if step == start:  # the optimizer state now exists: pin the async saves' host buffers (seconds, once)
                checkpoint.reserve_async(cfg.out_dir, mesh, trainer)
            reporter.end_step(step, lr, loss, norm, must_report=step == t.steps - 1, extra=trainer.moe_stats)
            between_steps(step, cfg, mesh, trainer, model, loader, val_loader, eval_data, metrics, reporter, log,
                          guard)

        text = ""
        if t.sample_tokens > 0 and model is None:  # pp > 1: no rank holds the whole model
            log(f"sample: skipped under pipeline parallel; python sample.py --out_dir={cfg.out_dir} reads the "
                f"checkpoint")
        elif t.sample_tokens > 0:
            text = sample(model, mesh.device, t.sample_tokens, cfg.seed, trainer.amp)
            log(f"sample:\n{text}")
        trainer.close()  # before the process group goes: a captured NCCL kernel blocks its destruction
        mesh.destroy()
        return {"losses": reporter.losses, "steps": t.steps, "start": start, "sample": text}


def between_steps(step, cfg, mesh, trainer, model, loader, val_loader, eval_data, metrics, reporter, log,
                  guard) -> None:
    """What runs after optimizer step `step`: first whether every rank stops here (SIGTERM/SIGINT on any rank:
    runguard.py), then at their intervals validation, HellaSwag, a sample, a checkpoint. A stop saves a checkpoint
    and leaves with 128 + the signal number. A failed save is a warning, but at the last step an error."""
    t, last = cfg.train, step == cfg.train.steps - 1
    signum = guard.agree_stop(last)  # (a collective every step; 0 at the last step: the run ends anyway)
    do_val = not signum and val_loader is not None and ((step + 1) % t.val_every == 0 or last)
    do_sample = (not signum and t.sample_every > 0 and (step + 1) % t.sample_every == 0 and not last
                 and model is not None)
    do_save = ((cfg.ckpt.every > 0 and ((step + 1) % cfg.ckpt.every == 0 or signum))
               or ((last or signum) and cfg.ckpt.final))
    do_eval = not signum and bool(eval_data) and ((step + 1) % t.eval_every == 0 or last)
    if not (do_val or do_sample or do_save or do_eval or signum):
        return
    reporter.pause()  # the deferred step is reported (a non-finite streak may stop the run here)
    trainer.engine.wait_params()  # ZeRO's prefetched parameter gathers (zero.py): what follows reads parameters
    if do_eval:
        run_evals(model, eval_data, cfg, mesh, trainer.amp, metrics, step)
    if do_val:
        val_loader.reset()
        vl = trainer.evaluate([next(val_loader) for _ in range(min(t.val_steps, len(val_loader)))])  # no wrap-around
        metrics.log({"step": step, "val_loss": vl}, f"step {step:5d} | val_loss {vl:.4f}")
    if do_sample:
        log(f"sample at step {step}:\n{sample(model, mesh.device, t.sample_tokens, cfg.seed, trainer.amp)}")
    saved = "nothing saved (ckpt.every=0 and ckpt.final=false)"
    if do_save:
        try:
            path = checkpoint.save_training(cfg.out_dir, step + 1, mesh, trainer, loader,
                                            {"config": cfg.to_dict(), "git": git_rev()}, cfg.ckpt.keep)
            saved = f"saved checkpoint {path}; continue with --resume"
            if not signum:
                log(f"saved checkpoint {path}")
        except checkpoint.CheckpointError as e:  # nothing was published: `latest` names the last good checkpoint
            if last:
                raise
            saved = str(e)
            if not signum:
                log(f"warning: {e}; training goes on and the next save tries again")
    if signum:
        trainer.close()  # as at the end of train(): before the process group goes
        mesh.destroy()
        guard.stop(step, signum, saved, log)


def main(argv: list[str] | None = None) -> dict:
    """User-caused errors (config, layout, data, checkpoint, repeated non-finite loss) print one line, from one
    rank only, and exit with code 2; a caller passing argv (tests, notebooks) gets the exception itself."""
    try:
        args = sys.argv[1:] if argv is None else argv
        if "--help" in args or "-h" in args:
            print(help_text())
            return {}
        world = next((a.split("=", 1)[1] for a in args if a.startswith("--check_world=")), None)
        if world is not None:  # `make train NGPU=N` checks the configuration once before launching N processes
            cfg = parse_args([a for a in args if not a.startswith("--check_world=")])
            check_layout(cfg, int(world), "cpu" if cfg.device == "cpu" else "cuda")
            checkpoint.prepare_run_dir(cfg.out_dir, cfg.resume, cfg.overwrite, is_main=False)
            return {}
        cfg = parse_args(args)
        if cfg.plan:  # the planner's prediction for this run, printed before any work; then exit (plan_run.py)
            return plan_run.print_plan(cfg)
        return train(cfg)
    except torch.OutOfMemoryError as e:  # a user's batch or model too large for the GPU: one line with the way out
        e = TrainingError(f"out of GPU memory ({str(e).splitlines()[0][:100]}): lower --train.micro_batch (keep "
                          f"--train.tokens_per_step: the difference becomes gradient accumulation), use "
                          f"--parallel.zero=1..3 or --parallel.tp over several GPUs, or a smaller model")
        print(f"error (rank {os.environ.get('RANK', '0')}): {e}", file=sys.stderr, flush=True)
        if argv is not None:
            raise e from None
        leave(2)
    except (ConfigError, MeshError, checkpoint.CheckpointError, TrainingError, FileNotFoundError, ValueError) as e:
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0 or not isinstance(e, (ConfigError, MeshError)):  # those two are the same on every rank
            print(f"error: {e}" if rank == 0 else f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        if argv is not None:
            raise
        leave(2)


def leave(code: int) -> None:
    """sys.exit(code) after an error, without a live gloo group: its threads at interpreter exit can abort the
    process (std::terminate, exit -6) after the one clear line. NCCL groups are left to the runtime."""
    if dist.is_initialized() and dist.get_backend() == "gloo":
        try:
            dist.destroy_process_group()
        except Exception:  # (exiting anyway)
            pass
    sys.exit(code)


if __name__ == "__main__":
    main()
