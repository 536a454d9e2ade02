"""The replicated engines: SingleDevice (one replica) and DDP (bucketed all-reduce overlapped with backward).

Both are engine.py's Engine (the interface, the step, clipping, checkpoints); parallel.build_engine picks
SingleDevice for dp*cp == 1 (any tp) and DDP for parallel.zero=0 (ZeRO: zero.py, zero3.py).

DDP protocol. Gradients live in flat fp32 buckets of ~parallel.bucket_mb, filled in reverse registration order
(≈ backward order). A step starts with p.grad = None, so autograd keeps the gradient it made (no add into a
zeroed buffer); the post-accumulate-grad hook copies it into the parameter's slice of its bucket, makes p.grad
that view (later micro-steps accumulate into it in place) and counts the bucket's parameters. Once all of a
bucket's parameters are in, its all-reduce starts (async_op=True) while backward goes on; buckets start in index
order, so every rank issues the same collectives in the same order, and step() waits on the handles.
no_sync micro-steps reduce nothing; a parameter without a gradient in a step reduces as zeros.
parallel.grad_dests=on: the Linear weights skip the copy (their bf16 -> fp32 gradient casts write into their
slots: Engine._set_grad_dests). Off by default for DDP: it saves one copy per optimizer step but adds a Python
autograd node per Linear per micro-step, host time that slows steps whose forward is host-bound.
parallel.reduce_dtype=bf16 sends a bf16 copy of each bucket (half the bytes; the sum is rounded to bf16 and copied
back into the fp32 bucket, so the optimizer still sees fp32 gradients): torch's bf16_compress_hook trade.
Memory: 16Ψ bytes of model states (Engine.memory_bytes) plus autocast's bf16 weight copies and activations.

Tested by tests/test_dp.py (against the single-process run, resume, memory); benchmarked against torch's
DistributedDataParallel by bench/bench_dp.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from nanopara.config import Config
from nanopara.buckets import BucketHooks, grad_buckets, reduce_group, views
from nanopara.engine import Engine, NoWork, check_fp32, param_kind
from nanopara.mesh import Mesh
from nanopara.optim import build_adamw


# ----------------------------------------------------------------------------------------------------------------
# one replica

class SingleDevice(Engine):
    """One replica (dp = cp = 1), no dp communication: AdamW with global-norm clipping; tp rules still apply."""

    label = "SingleDevice"

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: Config):
        super().__init__(model, mesh, cfg)
        self.optimizer = build_adamw(model.named_parameters(), cfg.train, mesh.device)

    def _grad_pieces(self):
        return [(p.grad, param_kind(p)) for p in self.params if p.grad is not None]

    def _zero_grads(self):
        if not self.grads_overwritten:
            self.optimizer.zero_grad(set_to_none=not self.keep_grad_buffers)

    def zero_grad_buffers(self):
        """Zero every gradient in place (nanopara/graph.py: a captured backward accumulates into these buffers)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:  # none yet before the first backward
            torch._foreach_zero_(grads)


# ----------------------------------------------------------------------------------------------------------------
# DDP

class _Widen:
    """A reduction of a low-precision copy of a bucket: wait() also copies the sum back into the fp32 bucket."""

    def __init__(self, work, low: torch.Tensor, buf: torch.Tensor):
        self.work, self.low, self.buf = work, low, buf

    def wait(self):
        self.work.wait()
        self.buf.copy_(self.low)
        self.low = None


class DDP(BucketHooks, Engine):
    """Replicated AdamW; bucketed gradient all-reduce overlapped with backward."""

    label = "DDP"

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: Config):
        super().__init__(model, mesh, cfg)
        check_fp32(self.params)
        for p in self.params:  # replicas start identical even if a caller forgot to seed alike
            group = reduce_group(self, [p])[0]  # experts (ep.py): over their replicas only
            if group is not None:
                dist.broadcast(p.data, src=dist.get_global_rank(group, 0), group=group)
        self.optimizer = build_adamw(model.named_parameters(), cfg.train, mesh.device)
        self.reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.parallel.reduce_dtype]
        self.buckets = grad_buckets(self.params, int(cfg.parallel.bucket_mb * 2 ** 20) // 4)
        self._groups = [reduce_group(self, b)[0] for b in self.buckets]  # dp x cp, or edp for experts
        self.bufs = [torch.zeros(sum(p.numel() for p in b), device=self.device) for b in self.buckets]
        self._slot = {id(p): g.view_as(p) for b, buf in zip(self.buckets, self.bufs)  # p's slice of its bucket
                      for p, g in zip(b, views(buf, [p.numel() for p in b]))}
        self._zero_grads()
        self._install_hooks(self.buckets)
        if cfg.parallel.grad_dests == "on":  # off by default for DDP: see the docstring
            self._set_grad_dests(self.params)

    def _on_grad(self, p):
        self._into_slot(p)  # the first gradient since the step, not made in its slot: handed over to the bucket
        super()._on_grad(p)

    def _launch(self, i):
        for p in self.buckets[i]:
            if p.grad is None:  # no gradient this step (an unused parameter): it reduces as zeros
                p.grad = self._slot[id(p)].zero_()
        group = self._groups[i]
        if group is None:  # experts with one replica (ep = dp x cp): nothing to reduce
            return NoWork()
        if self.reduce_dtype == torch.float32:
            return dist.all_reduce(self.bufs[i], group=group, async_op=True)
        low = self.bufs[i].to(self.reduce_dtype)  # (bucket,) bf16: half the bytes on the wire, alive until wait()
        return _Widen(dist.all_reduce(low, group=group, async_op=True), low, self.bufs[i])

    def _before_backward(self):
        self._check_single_sync()

    def _after_backward(self):
        if self._sync:
            self._launch_ready(force=True)

    def _finish_grads(self):
        self._launch_ready(force=True)  # a step after no_sync-only micro-steps still reduces
        for work in self._works:
            work.wait()
        self._works = []
        self._reset_buckets()

    def _wait_inflight(self):
        for work in self._works:
            work.wait()
        self._works = []
        self._reset_buckets()

    def _grad_pieces(self):
        return [(p.grad, param_kind(p)) for p in self.params]

    def _zero_grads(self):
        if self.keep_grad_buffers:  # a CUDA graph (graph.py) accumulates into the bucket slots: keep them as .grad
            for buf in self.bufs:
                buf.zero_()
            for p in self.params:
                p.grad = self._slot[id(p)]
        else:
            for p in self.params:  # the buckets keep their memory; the next backward hands new gradients over
                p.grad = None
        self._given.clear()

    def _extra_grads(self):
        return self.bufs
