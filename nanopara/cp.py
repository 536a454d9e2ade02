"""Context parallel: applied to the single-device GPT from outside; ring or Ulysses attention over the cp group.

    apply_cp(model, mesh)           # parallel.parallelize, step 2 (after TP, before the PP split)
    logits, loss = model(x, y)      # x, y: the whole (B, T) batch of this dp rank, on every cp rank of it

Each cp rank holds 2 of the 2*cp chunks of every sequence (zigzag: ring_attention.py). `apply_cp` installs a
forward pre-hook on the GPT that takes this rank's chunks of idx and targets and passes their positions
(GPT.forward's `pos`), so every caller keeps the single-device contract (the loader, train.py and the checkpoints
do not change with cp); logits come back for this rank's tokens only. Pipelines take the chunks in their first
and last stage instead (shard_stage_inputs). A forward with KV caches (generation) is left whole: cp ranks hold
the same weights, so each runs it alone.

Attention (parallel.cp_impl): ring (ring_attention.py: K/V passed around the ring, zigzag-balanced) or Ulysses
(Jacobs et al. 2023, below): an all-to-all turns this rank's tokens of every head into every token of nh/cp heads;
plain causal attention over the whole sequence (zigzag rows put back in order); an all-to-all back. Balanced by
construction, needs nh/tp divisible by cp; 4 all-to-alls per layer each way.

Loss: each rank's loss is the mean over its own valid targets (-1 ignored) times cp * n_local / n_group (n_group:
valid targets of the whole sequences, one scalar all-reduce over cp); the engines average gradients over dp x cp,
so the result is the single-process mean. Tests: tests/test_cp.py (gloo, CPU); GPU: bench/bench_cp.py; notes/cp.md.
"""
from __future__ import annotations

import dataclasses
import inspect
import types

import torch
import torch.distributed as dist

from kernels.attention import attention, attention_triton
from nanopara.model import GPT, CausalSelfAttention, split_qkv
from nanopara.ring_attention import Ring, ring_attention_qkv, zigzag_positions


def ring_of(mesh, **kw) -> Ring:
    """This rank's Ring: mesh's cp group and the neighbours it receives from and sends to."""
    prev, nxt = mesh.neighbours("cp")
    return Ring(mesh.groups.get("cp"), mesh.cp_rank, mesh.cp, prev, nxt, **kw)


# ----------------------------------------------------------------------------------------------------------------
# Ulysses (Jacobs et al. 2023, DeepSpeed-Ulysses): all-to-all from sequence shards to head shards and back

def _seq_to_heads(x, group, n: int):
    """(B, nh, T/n, hs) this rank's tokens of every head -> (B, nh/n, T, hs) every rank's tokens (in cp-rank order)
    of head group `rank`: one all-to-all."""
    B, nh, Tl, hs = x.shape
    send = x.reshape(B, n, nh // n, Tl, hs).transpose(0, 1).contiguous()  # (n, B, nh/n, Tl, hs): piece j -> rank j
    recv = torch.empty_like(send)  # piece s: rank s's tokens of this rank's heads
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, nh // n, n * Tl, hs)


def _heads_to_seq(y, group, n: int):
    """The inverse of _seq_to_heads: (B, nh/n, T, hs) -> (B, nh, T/n, hs)."""
    B, h, T, hs = y.shape
    send = y.reshape(B, h, n, T // n, hs).permute(2, 0, 1, 3, 4).contiguous()  # piece s: rank s's tokens -> rank s
    recv = torch.empty_like(send)  # piece j: this rank's tokens of head group j
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(B, n * h, T // n, hs)


class _SeqToHeads(torch.autograd.Function):
    """fwd: _seq_to_heads; bwd: _heads_to_seq (an all-to-all's adjoint is the reverse all-to-all)."""

    @staticmethod
    def forward(ctx, x, group, n):
        ctx.group, ctx.n = group, n
        return _seq_to_heads(x, group, n)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, ctx.n), None, None


class _HeadsToSeq(torch.autograd.Function):
    """fwd: _heads_to_seq; bwd: _seq_to_heads."""

    @staticmethod
    def forward(ctx, y, group, n):
        ctx.group, ctx.n = group, n
        return _heads_to_seq(y, group, n)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group, ctx.n), None, None


def ulysses_attention(q, k, v, ring: Ring):
    """Attention of this rank's tokens q, k, v (B, nh, T/cp, hs) (zigzag chunks) by all-to-all: each rank attends
    over the whole sequence for nh/cp heads (the kernels' plain causal attention), then the heads go home.
    4 all-to-alls per layer forward (q, k, v, out) and 4 backward, each moving (cp-1)/cp of its tensor."""
    n = ring.size
    if q.shape[1] % n:
        raise ValueError(f"Ulysses attention: {q.shape[1]} heads per rank do not split over cp={n} ranks")
    T = q.shape[2] * n
    order = torch.cat([zigzag_positions(T, n, s, q.device) for s in range(n)])  # gathered row i = position order[i]
    to_global = torch.argsort(order)
    q, k, v = (_SeqToHeads.apply(t, ring.group, n)[:, :, to_global] for t in (q, k, v))  # (B, nh/cp, T, hs)
    attend = attention_triton if ring.triton else attention
    y = attend(q, k, v, causal=ring.causal)[:, :, order]  # back to the gathered (cp-rank) order
    return _HeadsToSeq.apply(y, ring.group, n)


# ----------------------------------------------------------------------------------------------------------------
# applying CP to a model: attention op, positions and inputs, loss

class _CPOps:
    """A block's op table with attention_qkv replaced by ring (or Ulysses) attention; everything else is `ops`."""

    def __init__(self, ops, ring: Ring, impl: str):
        self._ops, self._ring, self._impl = ops, ring, impl

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def attention_qkv(self, qkv, n_head):  # packed (B, T, 3*nh*hs) -> (B, nh, T, hs)
        ring = self._ring  # Triton blocks on CUDA (whatever model.kernels: SDPA returns no lse), or in the interpreter
        if not ring.triton and (qkv.is_cuda or getattr(self._ops, "_interpret", False)):
            ring = dataclasses.replace(ring, triton=True)
        if self._impl == "ring":
            return ring_attention_qkv(qkv, n_head, ring)
        return ulysses_attention(*split_qkv(qkv, n_head), ring)


def _attention_forward(self, x, ops, kv_cache=None):
    """CausalSelfAttention.forward with CP attention; a KV-cache forward (generation) stays local."""
    cp_ops = ops if kv_cache is not None else _CPOps(ops, self.cp_ring, self.cp_impl)
    return CausalSelfAttention.forward(self, x, cp_ops, kv_cache)


def _cp_loss(inner, ring: Ring):
    """loss_fn (GPT's, or tp.py's vocab-parallel one) rescaled so that the mean over cp ranks is the mean over all
    valid targets of the whole sequences (count-weighted: -1 targets may be spread unevenly over the chunks)."""

    def loss_fn(self, logits, targets):
        valid = targets != -1
        n_local = valid.sum().float()
        n_group = n_local.clone()
        dist.all_reduce(n_group, group=ring.group)
        # a rank without a valid target: score one token with weight 0, so neither the loss nor its gradient is NaN
        first = targets.reshape(-1)[:1]
        targets = torch.cat([torch.where(n_local > 0, first, 0), targets.reshape(-1)[1:]]).view_as(targets)
        return inner(self, logits, targets) * (n_local * ring.size / n_group)

    return loss_fn


class _ShardInputs:
    """Forward pre-hook of the GPT: idx and targets (B, T) -> this rank's zigzag chunks (B, T/cp), with their
    global positions as `pos`. Generation (kv_caches given) runs whole on every rank."""

    def __init__(self, ring: Ring, block_size: int):
        self.ring, self.block_size = ring, block_size
        self.sig = inspect.signature(GPT.forward)

    def __call__(self, module, args, kwargs):
        a = self.sig.bind(module, *args, **kwargs).arguments
        if a.get("kv_caches") is not None:
            return None
        idx = a["idx"]
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds the model's context of {self.block_size}")
        pos = zigzag_positions(T, self.ring.size, self.ring.rank, idx.device)
        a["idx"], a["pos"] = idx[:, pos], pos
        if a.get("targets") is not None:
            a["targets"] = a["targets"][:, pos]
        a.pop("self")
        return (), a


def shard_stage_inputs(ring: Ring):
    """Pre-hook for pipeline chunks: the first chunk takes this rank's chunks of the token ids (and gets their
    positions), the last its targets; the residual stream between stages is already local."""

    def hook(chunk, args, kwargs):
        x, targets = args[0], (args[1] if len(args) > 1 else kwargs.get("targets"))
        if chunk.first:
            pos = zigzag_positions(x.shape[1], ring.size, ring.rank, x.device)
            x, kwargs = x[:, pos], {**kwargs, "pos": pos}
        if chunk.last and targets is not None:
            targets = targets[:, zigzag_positions(targets.shape[1], ring.size, ring.rank, targets.device)]
        return (x, targets), {k: v for k, v in kwargs.items() if k != "targets"}

    return hook


def keep_kv(p) -> bool:
    """parallel.cp_keep_kv resolved (ParallelConfig p): auto = on for the ring at cp = 2 (its one remote block's
    dK/dV part would otherwise go home after the last block, exposed), off elsewhere; true: on for the ring."""
    return p.cp_impl == "ring" and p.cp > 1 and (p.cp_keep_kv == "true" or p.cp_keep_kv == "auto" and p.cp == 2)


def apply_cp(model: GPT, mesh, pipeline: bool = False, impl: str = "ring", keep_kv: bool = False) -> GPT:
    """Context parallel over mesh's cp group, in place: every block's attention becomes ring (or Ulysses)
    attention, the loss count-weighted over cp; without `pipeline` the GPT's forward takes its zigzag chunks itself
    (pipelines: shard_stage_inputs on the chunks, after the split). keep_kv: Ring.keep_kv (ring_attention.py)."""
    if impl not in ("ring", "ulysses"):
        raise ValueError(f"parallel.cp_impl must be ring or ulysses, got {impl!r}")
    ring = ring_of(mesh, keep_kv=keep_kv and impl == "ring")
    for block in model.transformer.h:
        block.attn.cp_ring, block.attn.cp_impl = ring, impl
        block.attn.forward = types.MethodType(_attention_forward, block.attn)
    model.loss_fn = types.MethodType(_cp_loss(model.loss_fn.__func__, ring), model)
    if not pipeline:
        model.register_forward_pre_hook(_ShardInputs(ring, model.cfg.block_size), with_kwargs=True)
    if ring.group is not None:  # create the communicator now, with every cp rank present
        dist.all_reduce(torch.zeros(1, device=mesh.device), group=ring.group)
    return model
