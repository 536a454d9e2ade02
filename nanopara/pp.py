"""Pipeline parallelism: split a GPT into stages, and run one step's schedule over send/recv on this rank.

    chunks = split_model(model, mesh.pp, mesh.pp_rank, virtual=v)  # this rank's chunks; drop `model` after
    stage = Stage(chunks)                            # one module under single-device names: for the DP engine
    tied = embedding_group(mesh)                     # collective, once: first + last stage of each replica
    pipe = Pipeline(chunks, mesh, "1f1b", m, act_shape=(B, T, C))  # collective over the pp group
    loss = pipe.step(inputs, targets)                # m micro-batches; grads accumulate; mean loss on every rank
    sync_tied_grads(chunks, tied)                    # then the data-parallel reduction and the optimizer

Split: the n_layer blocks go into pp*v chunks; chunk c lives on pp rank c % pp (Megatron-LM's interleaved
placement; v = 1: one chunk per rank). Chunk 0 adds wte + wpe, the last chunk ln_f + lm_head + loss; parameter
names stay the single-device model's ("transformer.h.5.attn.c_attn.weight"). The tied wte/lm_head weight is held
twice, by the first stage (wte) and the last (lm_head, a copy marked `pp_tied_copy`; both marked `pp_tied`); their
gradients are summed over a 2-rank embedding group every step (Megatron-LM), so both copies take identical updates.

Schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1), their send/recv program and the simulator that checks them are
in schedules.py; `Pipeline` here runs this rank's program: posts batches of isend/irecv, waits right before a
received tensor is used, runs each F/B/W on its chunk. The schedule API is re-exported (pp.build_schedule,
pp.simulate, pp.bubble), so callers see one pipeline module.

Called by parallel.py (split_model, build_pipeline) and trainer.py (the pipeline step, sync_tied_grads); tested by
tests/test_pp.py.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import types
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from nanopara.model import GPT
from nanopara.moe import moe_layers
from nanopara.schedules import Action, build_schedule, forward_only, message_label, program
from nanopara.schedules import bubble, simulate  # noqa: F401  (re-exported: pp.simulate, pp.bubble)
from nanopara.zb import DeferredWeightGrads

# ----------------------------------------------------------------------------------------------------------------
# stage split


def split_layers(n_layer: int, pp: int, virtual: int = 1, layers=None) -> list[range]:
    """The global block indices of each of the pp*virtual chunks, in model order; `layers`: blocks per chunk."""
    n = pp * virtual
    if virtual > 1 and pp == 1:
        raise ValueError(f"parallel.pp_virtual={virtual} needs parallel.pp > 1")
    if layers is None:
        if n_layer % n:
            raise ValueError(f"model.n_layer={n_layer} is not divisible by parallel.pp*parallel.pp_virtual = "
                             f"{pp}*{virtual} = {n}; set parallel.pp_layers to split it unevenly")
        layers = [n_layer // n] * n
    layers = list(layers)
    if len(layers) != n:
        raise ValueError(f"parallel.pp_layers={layers} has {len(layers)} entries; it needs one per chunk, "
                         f"parallel.pp*parallel.pp_virtual = {n}")
    if min(layers) < 1:
        raise ValueError(f"parallel.pp_layers={layers}: every chunk needs at least one block")
    if sum(layers) != n_layer:
        raise ValueError(f"parallel.pp_layers={layers} sums to {sum(layers)}, but model.n_layer={n_layer}")
    starts = list(itertools.accumulate([0] + layers))
    return [range(a, b) for a, b in zip(starts, starts[1:])]


class Chunk(nn.Module):
    """Blocks `layers` of a GPT (global indices), with wte + wpe if it is the first chunk and ln_f + lm_head +
    loss if the last. Submodules keep the GPT's names, so named_parameters() match the single-device model's."""

    ops_for = GPT.ops_for

    def __init__(self, model: GPT, index: int, layers: range, last: bool):
        super().__init__()
        self.cfg, self.index, self.layers, self.first, self.last = model.cfg, index, layers, index == 0, last
        t = model.transformer
        self.transformer = nn.ModuleDict()
        if self.first:
            self.transformer["wte"], self.transformer["wpe"] = t.wte, t.wpe
        self.transformer["h"] = nn.ModuleDict({str(i): t.h[i] for i in layers})
        if last:
            self.transformer["ln_f"], self.lm_head = t.ln_f, model.lm_head
        self._ops, self.is_tied = {}, False
        self.loss_fn = types.MethodType(model.loss_fn.__func__, self)  # GPT's, or tp.py's vocab-parallel one
        if hasattr(model, "tp_state"):
            self.tp_state = model.tp_state
        # tp.py's per-rank dropout stream (SP) wraps the model's forward; each chunk's forward takes its place
        for hook in model._forward_pre_hooks.values():
            self.register_forward_pre_hook(hook)
        for hook in model._forward_hooks.values():
            self.register_forward_hook(hook)

    @property
    def tied(self) -> nn.Parameter | None:
        """This chunk's copy of the tied wte/lm_head weight (first or last chunk), else None."""
        if not self.is_tied:
            return None
        return self.transformer["wte"].weight if self.first else self.lm_head.weight

    def forward(self, x, targets=None, pos=None):
        """x: token ids (B, T) on the first chunk, else the residual stream (B, T, C) from the previous chunk.
        Returns the residual stream for the next chunk, or the loss on the last. pos: as GPT.forward's (cp.py)."""
        t = self.transformer
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device) if pos is None else pos
            x = F.dropout(t.wte(x) + t.wpe(pos), self.cfg.dropout, self.training)  # (B, T, C), as GPT.forward
        ops = self.ops_for(x.device)
        m = None
        for block in t.h.values():
            x, m = block(x, ops, None, m)
        if not self.last:
            return m + x  # the residual add the next block's fused LayerNorm would do, in its order (m + x)
        x = ops.add_layernorm(m, x, t.ln_f)[0]
        return self.loss_fn(self.lm_head(x), targets)


def split_model(model: GPT, pp: int, pp_rank: int, virtual: int = 1, layers=None) -> list[Chunk]:
    """This rank's chunks (global index pp_rank, pp_rank + pp, ...) of a GPT (single-device or after apply_tp).
    The caller drops `model` afterwards, so only these chunks' modules stay alive."""
    ranges = split_layers(model.cfg.n_layer, pp, virtual, layers)
    chunks = [Chunk(model, c, ranges[c], c == len(ranges) - 1) for c in range(pp_rank, len(ranges), pp)]
    if model.lm_head.weight is model.transformer.wte.weight:
        for ch in chunks:
            ch.is_tied = ch.first or ch.last
            if ch.first and pp > 1:
                ch.tied.pp_tied = True  # engines reduce it last, after sync_tied_grads (buckets.grad_buckets)
        last = chunks[-1]
        if last.last and not last.first:  # the last stage's own copy of the tied weight
            old = model.lm_head.weight
            w = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
            w.__dict__.update(old.__dict__)  # tp.py's shard attributes (tp_dim, tp_parts, ...)
            w.pp_tied, w.pp_tied_copy = True, True  # grad norms count the tied weight once: skip this copy
            last.lm_head = copy.copy(model.lm_head)
            last.lm_head._parameters = dict(last.lm_head._parameters)
            last.lm_head.weight = w
    return chunks


class Stage(nn.Module):
    """This rank's chunks as one module, for the data-parallel engine and checkpoints: the parameters under their
    single-device names (transformer.wte/wpe on the first stage, transformer.h.N, transformer.ln_f and lm_head.weight,
    the tied copy, on the last). It runs only through its Pipeline."""

    def __init__(self, chunks: list[Chunk]):
        super().__init__()
        self.chunks = list(chunks)  # a plain list, not submodules: each parameter is registered once, by name
        self.layers = {ch.index: list(ch.layers) for ch in self.chunks}  # global block indices, for checkpoints
        self.transformer = nn.ModuleDict()
        for ch in self.chunks:
            for name in ("wte", "wpe"):
                if name in ch.transformer:
                    self.transformer[name] = ch.transformer[name]
        self.transformer["h"] = nn.ModuleDict({i: b for ch in self.chunks for i, b in ch.transformer["h"].items()})
        for ch in self.chunks:
            if ch.last:
                self.transformer["ln_f"], self.lm_head = ch.transformer["ln_f"], ch.lm_head

    def train(self, mode: bool = True):
        for ch in self.chunks:  # the first chunk's embedding dropout reads the chunk's own flag
            ch.train(mode)
        return super().train(mode)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline stage runs through its Pipeline (trainer.Trainer: step and evaluate)")


def embedding_group(mesh):
    """This rank's {first stage, last stage} group of the tied weight at its (dp, cp, tp) coordinate, or None
    (pp = 1, or a middle stage). Collective: every rank creates every group, in the same order."""
    if mesh.pp == 1:
        return None
    mine = None
    for d, c, t in itertools.product(range(mesh.dp), range(mesh.cp), range(mesh.tp)):
        ranks = [mesh.rank_of(pp=0, dp=d, cp=c, tp=t), mesh.rank_of(pp=mesh.pp - 1, dp=d, cp=c, tp=t)]
        group = mesh.new_group(ranks)
        if mesh.rank in ranks:
            mine = group
    return mine


def sync_tied_grads(chunks: list[Chunk], group) -> None:
    """Sum the tied weight's two gradient halves (wte use on the first stage, lm_head use on the last), once per
    step after the last backward and before any data-parallel reduce-scatter touches them (Megatron-LM#844)."""
    for w in (ch.tied for ch in chunks if ch.tied is not None and group is not None):
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        dist.all_reduce(w.grad, group=group)


def sync_tied_weights(chunks: list[Chunk], group, mesh) -> None:
    """Copy the first stage's tied weight onto the last stage's copy (after loading weights)."""
    for w in (ch.tied for ch in chunks if ch.tied is not None and group is not None):
        dist.broadcast(w.detach(), src=mesh.rank_of(pp=0), group=group)


# ----------------------------------------------------------------------------------------------------------------
# executor


class Pipeline:
    """Runs one step's m micro-batches on this rank's chunks, from its action list of `schedule`. Built by every
    rank of the pp group together (one all-reduce: NCCL wants the first call on a group to involve all of it).

    act_shape / act_dtype: every message between chunks, e.g. (micro_batch, seq_len, n_embd) fp32 (the residual
    stream's dtype; (B, T/tp, C) under sequence parallel). on_last_backward(chunk, params) is called right before
    the action that adds the step's last gradient to `params` of the chunk (its last B for every parameter; under
    ZB-H1 the last B for all but the Linears' weights, whose gradients zb.py defers to W, and the last W for
    those): the point where a data-parallel engine turns its gradient reduction on for them, so the reduction
    overlaps the backwards still to run on this rank and downstream. amp: the autocast context of the
    forwards. It is entered once per step, so its cast of each weight to bf16 is made once and shared by all the
    micro-batches in flight (GPipe holds m of them), and left for every backward, as in a plain training loop.
    clock: None, or a function returning a timestamp (a recorded CUDA event, bench/bench_pp.py); then `trace`
    collects (action, start, end) per action."""

    def __init__(self, chunks: list[Chunk], mesh, schedule: str, n_micro: int, act_shape: tuple,
                 act_dtype: torch.dtype = torch.float32, on_last_backward: Callable[[Chunk, list], None] | None = None,
                 amp: Callable = contextlib.nullcontext):
        self.p, self.rank, self.v = mesh.pp, mesh.pp_rank, len(chunks)
        self.actions = build_schedule(schedule, mesh.pp, n_micro, len(chunks))[mesh.pp_rank]
        self.program = program(self.actions)
        self.chunks = {ch.index: ch for ch in chunks}
        if {a.chunk for a in self.actions} != set(self.chunks):
            raise ValueError(f"pp rank {mesh.pp_rank} holds chunks {sorted(self.chunks)}, but the schedule runs "
                             f"{sorted({a.chunk for a in self.actions})}: split with the same pp and pp_virtual")
        self.first, self.last = 0 in self.chunks, any(ch.last for ch in chunks)
        self.m, self.split = n_micro, any(a.op == "W" for a in self.actions)
        self.act_shape, self.act_dtype, self.device = torch.Size(act_shape), act_dtype, mesh.device
        self.on_last_backward, self.amp = on_last_backward, amp
        self.clock, self.trace = None, []
        self.last_b = {a.chunk: a for a in self.actions if a.op == "B"}
        self.last_w = {a.chunk: a for a in self.actions if a.op == "W"}
        # ZB-H1: B computes input gradients (and the small parameters'), W the Linears' weight gradients (zb.py)
        self.deferred = {c: DeferredWeightGrads(ch) for c, ch in self.chunks.items()} if self.split else {}
        # MoE layers take their aux loss's gradient factor at forward time: each micro-batch's, as its LM loss gets
        self.moe = {c: moe_layers(ch) for c, ch in self.chunks.items()}
        self.group = mesh.groups.get("pp") if mesh.pp > 1 else None
        self.ranks = [mesh.rank_of(pp=i) for i in range(mesh.pp)]  # pp index (as in Action) -> global rank
        self._eval_programs = {}  # n -> program of forward_only
        if self.group is not None:
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)

    def step(self, inputs=None, targets=None, loss_scale: float = 1.0, weights=None) -> torch.Tensor:
        """Forward and backward m micro-batches: inputs[i] token ids (B, T) of micro-batch i (read on the first
        stage), targets[i] (B, T) (read on the last). Each micro-batch backpropagates loss * loss_scale * w_i / m
        (weights w: None = all 1; SFT's token weights, train.token_weights); the chunks' .grad accumulate over the
        step. Returns the mean of w_i * loss_i (0-dim, unscaled) on every pp rank."""
        self._check(inputs, targets, self.m)
        for d in self.deferred.values():
            d.new_step()
        w = [1.0] * self.m if weights is None else list(weights)
        return self._execute(self.program, dict(inputs=inputs, targets=targets, scale=loss_scale, w=w, train=True))

    @torch.no_grad()
    def evaluate(self, inputs=None, targets=None, n: int = 1) -> torch.Tensor:
        """The mean loss of n micro-batches, forwards only (`forward_only`; any n), on every pp rank."""
        self._check(inputs, targets, n)
        for d in self.deferred.values():  # the weights changed since the last step's casts
            d.new_step()
        if n not in self._eval_programs:
            self._eval_programs[n] = program(forward_only(self.p, n, self.rank, self.v))
        return self._execute(self._eval_programs[n], dict(inputs=inputs, targets=targets, train=False))

    def _check(self, inputs, targets, n: int) -> None:
        for name, given, needed in (("inputs", inputs, self.first), ("targets", targets, self.last)):
            if needed and (given is None or len(given) != n):
                raise ValueError(f"this pipeline stage needs {name} for all {n} micro-batches of the step")

    def _execute(self, prog: list, data: dict) -> torch.Tensor:
        saved, losses, received, outgoing, inflight = {}, {}, {}, {}, []  # messages keyed by label
        with self.amp():
            self._loop(prog, data, saved, losses, received, outgoing, inflight)
        w = data.get("w")
        loss = torch.stack([losses[i] * (1.0 if w is None else w[i]) for i in sorted(losses)]).mean() if losses \
            else torch.zeros((), device=self.device)
        if self.group is not None:  # the last stage's loss, for every rank's log line
            dist.broadcast(loss, self.ranks[-1], group=self.group)
        return loss

    def _loop(self, prog, data, saved, losses, received, outgoing, inflight) -> None:
        for step in prog:
            if step[0] == "post":
                ops = [dist.P2POp(dist.isend, outgoing.pop(label), self.ranks[peer], self.group)
                       for peer, label in step[1]]
                for peer, label in step[2]:
                    received[label] = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
                    ops.append(dist.P2POp(dist.irecv, received[label], self.ranks[peer], self.group))
                inflight.append((dist.batch_isend_irecv(ops), ops))  # ops keep the sent tensors alive
            elif step[0] == "wait":  # a rank's batches complete in order: wait for all posted so far
                inflight = _wait(inflight)
            else:
                a = step[1]
                if self.on_last_backward is not None:
                    ch = self.chunks[a.chunk]
                    if self.last_b.get(a.chunk) == a:
                        d = self.deferred.get(a.chunk)
                        self.on_last_backward(ch, list(ch.parameters()) if d is None else d.eager_params)
                    elif self.last_w.get(a.chunk) == a:
                        self.on_last_backward(ch, self.deferred[a.chunk].weights)
                t0 = self.clock() if self.clock else None
                sent = self._run(a, received.pop(message_label(a, "recv"), None), saved, losses, data)
                if self.clock:
                    self.trace.append((a, t0, self.clock()))
                if a.send is not None:
                    outgoing[message_label(a, "send")] = sent
        _wait(inflight)

    def _run(self, a: Action, got, saved: dict, losses: dict, data: dict):
        """One action; returns the tensor to send (F: the activation; B: the input's gradient) or None."""
        ch, key = self.chunks[a.chunk], (a.chunk, a.mb)
        if a.op == "F":
            x = data["inputs"][a.mb] if ch.first else got.requires_grad_(data["train"])
            for layer in self.moe[a.chunk] if data["train"] else ():
                layer.aux_grad_scale = data["scale"] * data["w"][a.mb] / self.m
            y = ch(x, data["targets"][a.mb] if ch.last else None)
            if ch.last:
                losses[a.mb] = y.detach().float()
                if not data["train"]:
                    return None
                y = y * (data["scale"] * data["w"][a.mb] / self.m)  # the loss is scaled once, here
            elif y.shape != self.act_shape or y.dtype != self.act_dtype:
                raise ValueError(f"chunk {a.chunk} returns {tuple(y.shape)} {y.dtype}, but the pipeline was "
                                 f"built for messages of {tuple(self.act_shape)} {self.act_dtype}")
            if data["train"]:
                saved[key] = (x, y)
            return None if ch.last else y.detach()
        with torch.autocast(self.device.type, enabled=False):  # backwards outside autocast; its weight casts kept
            if a.op == "W":  # the Linears' weight gradients of a micro-batch whose input gradient B already sent
                self.deferred[a.chunk].run(a.mb)
                return None
            x, y = saved.pop(key)
            if not self.split:  # stage-boundary backward: input and weight gradients in one pass
                torch.autograd.backward(y, got)
                return None if ch.first else x.grad
            d = self.deferred[a.chunk]  # ZB: one walk of the graph; the Linears store their dW inputs for W
            with d.recording(a.mb):
                torch.autograd.backward(y, got, inputs=([] if ch.first else [x]) + d.eager_params)
            return None if ch.first else x.grad


def _wait(inflight: list) -> list:
    for works, _ in inflight:
        for w in works:
            w.wait()
    return []
