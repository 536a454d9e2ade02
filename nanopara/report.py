"""Step reporting: each step's loss, norm and time read one step late, the log line, metrics.jsonl, MFU.

The host reads step i's numbers while the GPU already runs step i+1, so the GPU never idles between steps waiting
for the host: `end_step` copies (loss, norm) to pinned memory behind the step and records a CUDA event; the numbers
are read once that event has passed. A step is reported at once where something needs its numbers first (fp16: the
next step's loss scale; before validation, samples, checkpoints; the last step).

A step's time runs from the end of the previous step (or, after a pause for validation or a checkpoint, from this
step's start) to its own end: CUDA events on GPU, so host stalls count and the host's lead does not; the host clock
on CPU, where a step's work is done when `end_step` is called. Step times add up to the training time. The slowest
and fastest rank's times go over a gloo group, a collective between hosts that never waits for a GPU.

MFU = achieved FLOP/s / the GPU's dense bf16 peak (never the sparse figure); FLOPs per token = 6N + 12*L*T*C.
"""
from __future__ import annotations

import json
import math
import os
import resource
import time

import torch
import torch.distributed as dist

# dense bf16 tensor-core peak per GPU, for MFU
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12, "A800": 312e12,
              "L40S": 362e12, "L4": 121e12, "A10G": 70e12, "RTX 4090": 165e12, "RTX 3090": 71e12}


PLAN_WARMUP = 3  # steps before plan_ratio is recorded: autotuning, allocator growth and NCCL setup come first


class TrainingError(RuntimeError):
    """A run that cannot go on (repeated non-finite loss): one clear line, then exit."""


def peak_flops(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), 0.0)


def flops_per_token(model_cfg, n_params: int, seq_len: int) -> float:
    """6N for the matmuls of forward+backward plus attention's 12*L*T*C (causal masking not discounted)."""
    return 6 * n_params + 12 * model_cfg.n_layer * model_cfg.n_embd * seq_len


class Metrics:
    """Rank 0 prints lines and appends JSON records to <out_dir>/metrics.jsonl (never truncated: a resumed run
    appends a `resumed_from` record, then its steps)."""

    def __init__(self, out_dir: str, enabled: bool):
        self.enabled = enabled
        self.path = os.path.join(out_dir, "metrics.jsonl")

    def log(self, rec: dict | None, line: str | None = None):
        if not self.enabled:
            return
        if line:
            print(line, flush=True)
        if rec is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")


class StepReporter:
    """`begin_step()` before a step's work, `end_step(...)` after its optimizer step is issued, `pause()` before
    anything that is not training (validation, samples, checkpoints), `flush()` to report the pending step now."""

    def __init__(self, metrics: Metrics, mesh, scaler, *, tokens_per_step: int, flops_per_token: float,
                 log_every: int, last_step: int, max_bad_steps: int, defer: bool):
        self.metrics, self.mesh, self.scaler = metrics, mesh, scaler
        self.tokens_per_step, self.fpt, self.peak = tokens_per_step, flops_per_token, peak_flops(mesh.device)
        self.log_every, self.last_step, self.max_bad_steps, self.defer = log_every, last_step, max_bad_steps, defer
        self.cuda = mesh.device.type == "cuda"
        self.host_group = mesh.new_group(backend="gloo") if mesh.world > 1 and self.cuda else None
        self.pending, self.losses, self.bad_streak = None, [], 0
        self.prev_end = None  # the previous step's end (CUDA event or host time); None after a pause
        self.plan_s, self.first_step = None, None  # the planner's step time (train.py sets it; plan_run.py)
        if mesh.world > 1:  # said once, so the step lines stay short
            metrics.log(None, f"step times: the slowest of {mesh.world} ranks (tok/s follows it); in brackets the "
                              f"fastest rank's, so a gap shows a straggler")

    def begin_step(self):
        if self.prev_end is None:  # at the start or after a pause: time this step from now
            self.prev_end = time.perf_counter()
            if self.cuda:
                self.prev_end = torch.cuda.Event(enable_timing=True)
                self.prev_end.record()

    def end_step(self, step: int, lr: float, loss: torch.Tensor, norm, must_report: bool, extra: dict | None = None):
        """extra: more 0-dim tensors for the record (MoE stats), read with the loss, one step late."""
        extra = extra or {}
        numbers = torch.stack([loss.float(), torch.as_tensor(norm, dtype=torch.float32, device=loss.device),
                               *[v.float().to(loss.device) for v in extra.values()]])
        if self.cuda:  # to pinned host memory behind the step's work, read once `end` has passed
            numbers = torch.empty(len(numbers), pin_memory=True).copy_(numbers, non_blocking=True)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        if self.pending is not None:
            self._report(self.pending)  # the previous step, while this one runs on the GPU
        self.pending = {"step": step, "lr": lr, "numbers": numbers, "start": self.prev_end, "end": end,
                        "extra": list(extra)}
        self.prev_end = end
        if must_report or not self.defer:
            self.flush()

    def flush(self):
        if self.pending is not None:
            self._report(self.pending)
            self.pending = None

    def pause(self):
        self.flush()
        self.prev_end = None

    def _report(self, p: dict) -> None:
        if self.cuda:
            p["end"].synchronize()  # this step only (a tensor's .item() would wait for everything queued since)
            dt = p["start"].elapsed_time(p["end"]) / 1e3
        else:
            dt = p["end"] - p["start"]
        loss, grad_norm, *extra = p["numbers"].tolist()
        overflow = self.scaler.enabled and self.scaler.scale > 1.0  # fp16: an inf norm is the scaler's to halve
        self.scaler.update(math.isfinite(grad_norm))
        if math.isfinite(loss) and (math.isfinite(grad_norm) or overflow):
            self.bad_streak = 0 if math.isfinite(grad_norm) else self.bad_streak
        else:  # a non-finite loss, or gradient norm: the update was skipped
            self.bad_streak += 1
            what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm}"
            self.metrics.log(None, f"warning: step {p['step']}: {what}; update skipped ({self.bad_streak} in a row)")
            if self.bad_streak >= self.max_bad_steps:
                raise TrainingError(f"loss or gradient norm was non-finite for {self.bad_streak} steps in a row (step "
                                    f"{p['step']}); stopping. Lower train.lr, check the data, or use "
                                    f"train.dtype=bf16/fp32")
        slow = fast = dt
        if self.mesh.world > 1:  # slowest / fastest rank: stragglers show up here
            buf = torch.tensor([dt, -dt])
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.host_group)
            slow, fast = buf[0].item(), -buf[1].item()
        tok_s = self.tokens_per_step / max(slow, 1e-9)
        tflops = self.fpt * tok_s / self.mesh.world / 1e12
        mem = (torch.cuda.max_memory_allocated(self.mesh.device) if self.cuda
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 1e9
        self.losses.append(loss)
        rec = {"step": p["step"], "loss": loss, "lr": p["lr"], "grad_norm": grad_norm, "tokens_per_s": tok_s,
               "tflops": tflops, "mfu": tflops * 1e12 / self.peak if self.peak else 0.0, "peak_mem_gb": mem,
               "step_time_s": slow, "fastest_step_time_s": fast, "skipped": not (math.isfinite(loss) and
                                                                               math.isfinite(grad_norm))}
        rec.update(zip(p["extra"], extra))
        self.first_step = p["step"] if self.first_step is None else self.first_step
        if self.plan_s and p["step"] - self.first_step >= PLAN_WARMUP:  # every run checks the planner
            rec.update(plan_step_s=self.plan_s, plan_ratio=slow / self.plan_s)
        line = None
        if p["step"] % self.log_every == 0 or p["step"] == self.last_step:
            line = self.line(p["step"], loss, p["lr"], grad_norm, tok_s, tflops, rec["mfu"], mem, slow, fast)
        self.metrics.log(rec, line)

    def line(self, step, loss, lr, grad_norm, tok_s, tflops, mfu, mem, slow, fast) -> str:
        """The step's log line: GPU-only fields (TFLOP/s, MFU) only on a GPU; on CPU, memory is the host's peak
        RSS; the fastest rank's time only where there are several (the header line says what it means)."""
        parts = [f"step {step:5d}", f"loss {loss:.4f}", f"lr {lr:.2e}", f"norm {grad_norm:.3f}", f"{tok_s:,.0f} tok/s"]
        if self.cuda:
            parts += [f"{tflops:.1f} TFLOP/s"] + ([f"MFU {mfu * 100:.1f}%"] if self.peak else [])
            parts.append(f"mem {mem:.2f} GB")
        else:
            parts.append(f"rss {mem:.2f} GB")
        parts.append(f"{slow * 1e3:.0f} ms" + (f" (fastest {fast * 1e3:.0f})" if self.mesh.world > 1 else ""))
        return " | ".join(parts)


def read_metrics(path) -> tuple[list[dict], list[dict]]:
    """(step records, validation records) of a metrics.jsonl, in step order; where a resumed run logged a step
    again, its record replaces the earlier one."""
    steps, vals = {}, {}
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if "loss" in rec:
                    steps[rec["step"]] = rec
                elif "val_loss" in rec:
                    vals[rec["step"]] = rec
                elif "resumed_from" in rec:  # what the abandoned run logged past the checkpoint is superseded
                    steps = {s: r for s, r in steps.items() if s < rec["step"]}
                    vals = {s: r for s, r in vals.items() if s < rec["step"]}
    return [steps[s] for s in sorted(steps)], [vals[s] for s in sorted(vals)]
