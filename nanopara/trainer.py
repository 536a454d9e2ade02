"""Trainer: the one object a training loop talks to, whatever the layout (parallel.parallelize returns it).

    trainer = parallelize(GPT(cfg.model), mesh, cfg)
    loss = trainer.forward_backward(batches)      # one optimizer step's micro-batches [(x, y)]; mean loss over dp x cp
    norm = trainer.step(lr)                       # clip, update, zero grads; FP8 weight casts and MoE biases follow
    val = trainer.evaluate(batches)               # mean loss, forwards only (a float, the same on every rank)
    sd = trainer.state_dict(); trainer.load_state_dict(sd)   # what a checkpoint holds of the model and optimizer

It owns what a step needs beyond the engine (engine.py: the optimizer and gradient reduction over dp x cp):
micro-steps under no_sync, autocast (bf16 on GPU, fp32 on CPU: `autocast`), fp16 loss scaling, the CUDA graph of
a micro-step (graph.py, train.cuda_graph), the pipeline schedule (pp.py: the step's micro-batches run through
this rank's stage), MoE's aux-loss gradient factor and bias update (moe.py) and FP8's weight casts (fp8.py).
state_dict() names every tensor by its single-device (global) name; `tp_shards` / `ep_shards` say which global
slice of a sharded tensor this rank holds, `pp_chunks` which blocks, and ZeRO's flat shards carry their offsets
(zero.py), so a checkpoint can be read under another layout (consolidate.py).
Callers: train.py, rl.py (forward_backward's loss_fn), eval.py (evaluate), bench/, tests/test_trainer.py.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from nanopara.config import Config
from nanopara.mesh import Mesh
from nanopara.moe import loads_counted_once, set_aux_grad_scale, step_stats, update_expert_bias
from nanopara.optim import LossScaler
from nanopara.tp_streams import make_streams, split_fwd_bwd


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CKPT_FORMAT = 2  # the checkpoint format state_dict() writes (reshard.py reads it, and every older one)


def autocast(dtype: str | Config, device: torch.device):
    """(a callable returning the autocast context, the compute dtype or None for fp32) for train.dtype (or a
    script's --dtype): auto = bf16 on GPU, fp32 elsewhere. The one place that choice is made: the pipeline,
    ZeRO-3's bf16 copies (engine.compute_dtype), eval.py, rl.py and bench/ take it from here."""
    name = dtype.train.dtype if isinstance(dtype, Config) else dtype
    d = DTYPES[("bf16" if device.type == "cuda" else "fp32") if name == "auto" else name]
    if d == torch.float32:
        return contextlib.nullcontext, None
    return (lambda: torch.autocast(device.type, dtype=d)), d


def mean_over(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Mean over the ranks that hold different data (dp x cp); in place, no host sync."""
    if mesh.groups.get("dp_cp") is not None:
        dist.all_reduce(x, group=mesh.groups["dp_cp"])
        x /= dist.get_world_size(mesh.groups["dp_cp"])
    return x


def model_buffers(model) -> dict:
    """The persistent buffers of the model (state_dict entries that are not parameters: MoE's expert_bias)."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k not in params}


class Trainer:
    def __init__(self, engine, mesh: Mesh, cfg: Config, accum: int, *, pipeline=None, pp_layers=None,
                 tp_shards=None, ep_shards=None, fp8=None, graph: bool = False):
        self.engine, self.mesh, self.cfg, self.accum = engine, mesh, cfg, accum
        self.pipeline, self.pp_layers, self.fp8 = pipeline, pp_layers, fp8
        self.tp_shards, self.ep_shards = tp_shards or {}, ep_shards or {}
        self.amp, self.dtype = autocast(cfg, mesh.device)
        self.scaler = LossScaler(enabled=self.dtype == torch.float16)
        self.device = mesh.device
        self.graphed = None
        self.moe_stats = {}  # the last step's MoE numbers (0-dim tensors, unread): for the step's log record
        self._moe_groups = [g for g in (mesh.groups.get("dp_cp"), mesh.groups.get("tp") if cfg.parallel.sp else None)
                            if g is not None]  # expert loads summed over the ranks that saw other tokens
        if cfg.train.compile:
            engine.model = torch.compile(engine.model)
        n_streams = cfg.parallel.tp_streams  # 2: each micro-batch as two halves on two streams (tp_streams.py)
        self.split = n_streams > 1
        self.streams = make_streams(mesh.device) if self.split and not graph else None  # (a graph makes its own)
        if graph:  # parallel.use_cuda_graph / check_layout: cp = 1, ZeRO <= 1 (graph.py)
            from nanopara.graph import GraphedAccumStep, GraphedMicroStep, GraphedPipelineStep
            if pipeline is not None:  # the whole pipeline step, dp's reduction included
                self.graphed = GraphedPipelineStep(pipeline, engine, fp8)
            elif engine.n > 1:  # every micro-step and dp's reduction
                self.graphed = GraphedAccumStep(engine.model, self.amp, engine, fp8, tp_streams=n_streams)
            else:  # one micro-step, replayed m times
                self.graphed = GraphedMicroStep(engine.model, self.amp, self.scaler.scale / accum, engine,
                                                tp_streams=n_streams, overwrite=accum == 1)

    @property
    def model(self):
        """This rank's module: the (tp/cp/ep-sharded) GPT, or under pp > 1 its pipeline stage."""
        return self.engine.model

    def forward_backward(self, batches: list, weights: list | None = None, loss_fn=None) -> torch.Tensor:
        """Forwards and backwards of one optimizer step's micro-batches [(x, y)] (host or device tensors); the
        gradients are left for step(). weights: per micro-batch loss factors (train.token_weights; None = 1).
        loss_fn(model, batch) -> 0-dim loss: a micro-batch's own loss in place of the LM loss of (x, y) (rl.py's
        policy loss), run under the same autocast, no_sync and 1/accum, 1/(dp*cp) scaling; not under pp or graphs.
        Returns the mean loss over the micro-batches and the dp x cp ranks (0-dim, on the device, unread)."""
        if len(batches) != self.accum:
            raise ValueError(f"forward_backward got {len(batches)} micro-batches; this layout runs {self.accum} "
                             f"a step (train.tokens_per_step / (micro_batch * seq_len * dp))")
        if loss_fn is not None and (self.pipeline is not None or self.graphed is not None):
            raise ValueError("forward_backward(loss_fn=...) needs a layout without pipeline stages or CUDA graphs")
        if self.split and (weights is not None or loss_fn is not None):
            raise ValueError("parallel.tp_streams=2 averages the mean losses of two equal halves of each micro-batch: "
                             "per micro-batch loss weights (train.token_weights: loss-masked shards) and a loss_fn "
                             "do not fit; use parallel.tp_streams=1")
        scale = self.scaler.scale
        if self.cfg.model.moe_experts:  # the aux loss's gradient gets the factor the LM loss gets below
            set_aux_grad_scale(self.engine.model, scale / self.accum / self.engine.n)
        if self.pipeline is not None:
            loss = self._pipeline_step(batches, scale, weights)
        elif self.graphed is not None and self.engine.n > 1:  # GraphedAccumStep: the step, one replay
            if weights is not None:
                raise ValueError("cuda_graph: per micro-batch loss weights change between steps; a replay has one")
            xs = [x.to(self.device, non_blocking=True) for x, _ in batches]
            ys = [y.to(self.device, non_blocking=True) for _, y in batches]
            with self._moe_capture():
                loss = self.graphed(xs, ys, scale / self.accum)
        else:
            loss = torch.zeros((), device=self.device)
            for micro, batch in enumerate(batches):
                if loss_fn is None:
                    x, y = (b.to(self.device, non_blocking=True) for b in batch)
                w = 1.0 if weights is None else weights[micro]
                if self.graphed is not None:  # one GPU or tp alone: no gradient communication to skip
                    with self._moe_capture():
                        step_loss = self.graphed(x, y)
                elif self.split:  # under no_sync: engine.step reduces after both streams joined (tp_streams.py)
                    with self.engine.no_sync():
                        step_loss = split_fwd_bwd(self.engine.model, self.amp, x, y, scale / self.accum,
                                                  self.streams, self.engine.backward)
                else:
                    with self.engine.no_sync(micro < self.accum - 1):
                        with self.amp():
                            step_loss = self.engine.model(x, y)[1] if loss_fn is None else \
                                loss_fn(self.engine.model, batch)
                        self.engine.backward(step_loss.float() * (scale * w / self.accum))
                loss += step_loss.detach().float() * w
            loss = loss / self.accum
        return mean_over(loss, self.mesh)

    def _pipeline_step(self, batches: list, scale: float, weights) -> torch.Tensor:
        from nanopara.pp import sync_tied_grads
        pipe = self.pipeline
        xs, ys = self._stage_data(batches)
        if self.graphed is not None:  # the whole step of this rank's schedule, one replay (graph.py)
            if weights is not None:
                raise ValueError("cuda_graph: per micro-batch loss weights change between steps; a replay has one")
            with self._moe_capture():
                return self.graphed(xs, ys, scale / self.engine.n)
        with self.engine.no_sync():  # the reduction starts per chunk at its last backward (on_last_backward)
            loss = pipe.step(xs, ys, scale / self.engine.n, weights)  # engine.backward's 1/(dp*cp), here
        sync_tied_grads(pipe.chunks.values(), pipe.tied_group)  # before step() reduces the tied weight's bucket
        return loss

    def _moe_capture(self):
        """A graph's first call also runs its eager warm-up forwards: MoE's expert loads count them once (moe.py)."""
        if self.cfg.model.moe_experts and self.graphed.graph is None:
            return loads_counted_once(self.engine.model, self.graphed.warmup + 1)
        return contextlib.nullcontext()

    def _stage_data(self, batches: list):
        """The first stage reads the token ids, the last the targets; every pp rank of a dp index reads the same
        batches (the loader is per dp rank), so the loader states in its checkpoints agree."""
        pipe = self.pipeline
        xs = [x.to(self.device, non_blocking=True) for x, _ in batches] if pipe.first else None
        ys = [y.to(self.device, non_blocking=True) for _, y in batches] if pipe.last else None
        return xs, ys

    def step(self, lr: float, sync: bool = True):
        """Clip by the global norm, update, zero the grads (engine.step; a non-finite norm skips the update); then
        the FP8 weight casts go stale and MoE's expert biases move. Returns the norm: a float, or with sync=False
        on GPU a 0-dim device tensor nobody waited for."""
        norm = self.engine.step(lr, grad_scale=self.scaler.scale, sync=sync)
        # ZeRO prefetch (zero.py): the parameter all-gathers may still run; neither of these reads a parameter (the
        # FP8 casts happen in each layer's forward, after its block's wait; the MoE update reads buffers)
        if self.fp8 is not None:  # the fused AdamW bumps no version counter: re-cast the FP8 weights
            self.fp8.step()
        if self.cfg.model.moe_experts:
            groups = self._moe_groups

            def all_reduce(t):
                for g in groups:
                    dist.all_reduce(t, group=g)
            update_expert_bias(self.engine.model, all_reduce if groups else None)
            self.moe_stats = step_stats(self.engine.model)
        return norm

    @torch.no_grad()
    def evaluate(self, batches: list) -> float:
        """The mean loss of batches [(x, y)], forwards only, over every micro-batch and the dp x cp ranks."""
        model = self.engine.model
        self.engine.wait_params()  # (the hooked forwards would wait too; not every stage's reader is hooked)
        model.eval()
        try:
            if self.pipeline is not None:
                xs, ys = self._stage_data(batches)
                mean = self.pipeline.evaluate(xs, ys, len(batches))
            else:
                mean = torch.zeros((), device=self.device)
                for x, y in batches:
                    with self.amp():
                        mean += model(x.to(self.device), y.to(self.device))[1].float()
                mean = mean / max(len(batches), 1)
        finally:
            model.train()
        return mean_over(mean, self.mesh).item()

    def state_dict(self) -> dict:
        """This rank's part of the model and optimizer under global names, with the slice metadata that places it
        (tp_shards, ep_shards, pp_chunks), the loss scale and the model's buffers (MoE's expert_bias)."""
        sd = {"model": self.engine.model_state_dict(), "engine": self.engine.state_dict(),
              "scaler": self.scaler.state_dict(), "tp_shards": self.tp_shards, "ep_shards": self.ep_shards,
              "buffers": model_buffers(self.engine.model), "ckpt_format": CKPT_FORMAT}
        if self.pp_layers is not None:  # pp > 1: this rank's chunks and their global blocks
            sd["pp_chunks"] = {c: self.pp_layers[c] for c in sorted(self.pipeline.chunks)}
        if self.fp8 is not None and self.fp8.recipe.delayed:  # this rank's amax histories (fp8.amax_state)
            from nanopara.fp8 import amax_state
            sd["fp8"] = {"amax": amax_state(self.engine.model)}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Inverse of state_dict() on the same layout (ValueError / KeyError / RuntimeError when it does not fit);
        another layout's checkpoint goes through reshard.restore, which builds this rank's state first. FP8 amax
        histories load where this run keeps them (train.fp8_delayed) and the state has them; else they start afresh."""
        self.engine.load_model_state_dict(sd["model"])
        self.engine.load_state_dict(sd["engine"])
        with torch.no_grad():
            for name, buf in sd.get("buffers", {}).items():
                self.engine.model.get_buffer(name).copy_(buf)
        self.scaler.load_state_dict(sd["scaler"])
        if self.fp8 is not None and self.fp8.recipe.delayed and "fp8" in sd:
            from nanopara.fp8 import load_amax_state
            load_amax_state(self.engine.model, sd["fp8"]["amax"], self.device)

    def close(self) -> None:
        """Free the CUDA graph: before the process group goes (a captured NCCL kernel blocks its destruction)."""
        if self.graphed is not None:
            self.graphed.close()
