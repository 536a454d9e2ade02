"""Context parallel: ring attention with zigzag load balance, applied to the single-device GPT from outside.

    apply_cp(model, mesh)           # parallel.parallelize, step 2 (after TP, before the PP split)
    logits, loss = model(x, y)      # x, y: the whole (B, T) batch of this dp rank, on every cp rank of it

Sequence split (zigzag). Each sequence of T tokens is cut into 2*cp chunks of c = T/(2*cp); cp rank r holds chunks
r and 2*cp-1-r, in that order: (B, 2c) tokens and their global positions. Under the causal mask a contiguous split
would give rank 0 one block of work and rank cp-1 cp of them; the zigzag pair gives every rank the same work.
`apply_cp` installs a forward pre-hook on the GPT that takes this rank's chunks of idx and targets and passes their
positions (GPT.forward's `pos`), so every caller keeps the single-device contract (the loader, train.py and the
checkpoints do not change with cp); logits come back for this rank's tokens only. A forward with KV caches
(generation) is left whole: cp ranks hold the same weights, so each runs it alone.

Ring attention (Liu et al. 2023). Per layer, with q, k, v (B, nh, 2c, hs) of this rank's tokens: for i = 0..cp-1
rank r holds the K/V of rank s = r - i (mod cp), posts the send of it to rank r+1 and the receive of the next one
from rank r-1 (one (2, B, nh, 2c, hs) message), and computes its queries against the K/V in hand meanwhile.
Zigzag blocks (q chunks r, 2cp-1-r; kv chunks s, 2cp-1-s), all without a masked-out tile:
    s == r   causal attention on the local 2c x 2c (the local order is the global order)
    s <  r   all 2c queries against chunk s only (both q chunks come after it; chunk 2cp-1-s after both)
    s >  r   query chunk 2cp-1-r only against both kv chunks (chunk r comes before both)
each block but the first is c x 2c, the same on every rank. The partial results merge in natural-log LSE
(online softmax): lse = logaddexp(lse, lse_i), out = exp(lse_old - lse) out + exp(lse_i - lse) out_i, in fp32
(one pass: kernels/attention.py attention_merge_).
Backward (FlashAttention-2's, per block, from the merged out and lse): the same ring; dq accumulates here, and the
dk/dv a rank computes for the block in hand (rank s's, in the activation dtype, only the keys the block saw) is
sent straight home to s, which adds the parts in fp32 in ring order while its next block computes.
Comm per layer: (cp-1) K/V messages forward; (cp-1) K/V messages and (cp-1) dK/dV parts backward.

Blocks run kernels/attention.py's attention_block_fwd / attention_block_bwd (Triton, out + lse, backward from a
given lse) on CUDA tensors, or under TRITON_INTERPRET=1 with `model.kernels=triton`; elsewhere a PyTorch
reference in fp32 (attention_ref and `_block_bwd_ref` below). NCCL runs the send/recv on its own stream, so the
transfer overlaps the block's kernels; only `wait()` orders the two.

Ulysses (parallel.cp_impl=ulysses; Jacobs et al. 2023): an all-to-all turns this rank's tokens of every head into
every token of nh/cp heads; plain causal attention over the whole sequence (zigzag rows put back in order); an
all-to-all back. Balanced by construction, needs nh/tp divisible by cp; 4 all-to-alls per layer each way.

Loss: each rank's loss is the mean over its own valid targets (-1 ignored) times cp * n_local / n_group (n_group:
valid targets of the whole sequences, one scalar all-reduce over cp); the engines average gradients over dp x cp,
so the result is the single-process mean. Tests: tests/test_cp.py (gloo, CPU); GPU: bench/bench_cp.py.
"""
from __future__ import annotations

import dataclasses
import inspect
import types

import torch
import torch.distributed as dist

from kernels.attention import (attention, attention_block_bwd, attention_block_fwd, attention_merge_, attention_ref,
                               attention_triton)
from nanopara.model import GPT, CausalSelfAttention, split_qkv


@dataclasses.dataclass
class Ring:
    """One cp group as ring attention sees it. `layout`: zigzag (balanced) or contiguous (rank r holds chunk r:
    the naive split, for the benchmark); `triton`: the Triton block kernels, else the PyTorch reference."""
    group: object        # ProcessGroup of the cp ranks (None: cp = 1)
    rank: int            # this rank's index in the cp group
    size: int            # cp
    prev: int            # global rank this rank receives from
    next: int            # global rank this rank sends to
    causal: bool = True
    layout: str = "zigzag"
    triton: bool = False


def ring_of(mesh, **kw) -> Ring:
    prev, nxt = mesh.neighbours("cp")
    return Ring(mesh.groups.get("cp"), mesh.cp_rank, mesh.cp, prev, nxt, **kw)


# ----------------------------------------------------------------------------------------------------------------
# the sequence split

def zigzag_positions(T: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions (2c,) of cp rank `rank`'s tokens of a T-token sequence: chunks rank and 2*cp-1-rank."""
    check_seq_len(T, cp)
    c = T // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])


def check_seq_len(T: int, cp: int) -> None:
    if T % (2 * cp):
        raise ValueError(f"context parallel: a sequence of {T} tokens does not split into 2*cp = {2 * cp} equal "
                         f"chunks (zigzag); use a sequence length divisible by {2 * cp}")


def _plan(r: int, s: int, n: int, causal: bool, layout: str, T: int):
    """(query slice, key slice, causal) of this rank's queries against rank s's keys, or None: nothing visible."""
    everything = slice(0, T)
    if not causal:
        return everything, everything, False
    if s == r:
        return everything, everything, True
    if layout == "contiguous":  # rank r holds chunk r: earlier ranks fully visible, later ones not at all
        return (everything, everything, False) if s < r else None
    c = T // 2
    return (everything, slice(0, c), False) if s < r else (slice(c, T), everything, False)


# ----------------------------------------------------------------------------------------------------------------
# blocks: Triton kernels (out + lse; backward from a given lse) or the fp32 PyTorch reference

def _block_fwd(q, k, v, causal, ring: Ring):
    """(out (B, nh, Tq, hs) in q's dtype, lse fp32 (B, nh, Tq)) of q against one K/V block."""
    return (attention_block_fwd if ring.triton else attention_ref)(q, k, v, causal)


def _block_bwd_ref(do, q, k, v, out, lse, causal):
    """FlashAttention-2's backward of one block from the merged out and lse, in fp32 (Dao 2023, Alg. 2)."""
    q, k, v, do, out = (t.float() for t in (q, k, v, do, out))
    scale = q.shape[-1] ** -0.5
    s = q @ k.transpose(-2, -1) * scale  # (B, nh, Tq, Tk)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    p = torch.exp(s - lse[..., None])
    dv = p.transpose(-2, -1) @ do
    dp = do @ v.transpose(-2, -1)
    ds = p * (dp - (do * out).sum(-1, keepdim=True))  # delta = rowsum(dO * O)
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


def _block_bwd(do, q, k, v, out, lse, causal, ring: Ring, dkdv=None):
    """(dq, dk, dv) of one block; dk, dv written into `dkdv` (two views) when given."""
    if ring.triton:
        grads = None if dkdv is None else (torch.empty_like(q.transpose(1, 2)).transpose(1, 2), *dkdv)
        return attention_block_bwd(do, q, k, v, out, lse, causal, grads=grads)
    g = _block_bwd_ref(do, q, k, v, out, lse, causal)
    if dkdv is None:
        return g
    return g[0], dkdv[0].copy_(g[1]), dkdv[1].copy_(g[2])


# ----------------------------------------------------------------------------------------------------------------
# ring communication: send to the next rank, receive from the previous one

def _post(ops: list) -> list:
    """Post point-to-point ops as one group (NCCL's own stream); returns the works to wait for."""
    return dist.batch_isend_irecv(ops)


def _send_recv(t: torch.Tensor, ring: Ring):
    """Post isend(t) to ring.next and irecv of a tensor like t from ring.prev; returns (buffer, pending)."""
    buf = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, ring.next, ring.group), dist.P2POp(dist.irecv, buf, ring.prev, ring.group)]
    return buf, (_post(ops), t)  # t stays referenced until the send is waited for


def _wait(pending) -> None:
    for work in pending[0]:
        work.wait()


def ring_fwd(q, k, v, ring: Ring):
    """Forward of this rank's queries against every rank's keys. q, k, v (B, nh, T, hs) of the local tokens ->
    (out (B, nh, T, hs) in q's dtype, a view of (B, T, nh, hs) memory; lse fp32 (B, nh, T))."""
    B, nh, T, hs = q.shape
    n, r = ring.size, ring.rank
    kv = torch.stack([k, v])  # (2, B, nh, T, hs): the message passed around the ring
    out = lse = None
    for i in range(n):
        if i < n - 1:  # the next block travels while this one computes
            nxt, pending = _send_recv(kv, ring)
        plan = _plan(r, (r - i) % n, n, ring.causal, ring.layout, T)
        if plan is not None:
            qs, ks, causal = plan
            o, l = _block_fwd(q[:, :, qs], kv[0, :, :, ks], kv[1, :, :, ks], causal, ring)
            if out is None:  # step 0 covers every query row (its own diagonal)
                out, lse = o.float(), l
            elif ring.triton:  # merge in natural-log LSE, in place on the rows this block saw: one pass
                attention_merge_(out[:, :, qs], lse[:, :, qs], o, l)
            else:
                o_acc, l_acc = out[:, :, qs], lse[:, :, qs]
                new = torch.logaddexp(l_acc, l)
                o_acc.mul_(torch.exp(l_acc - new)[..., None]).add_(torch.exp(l - new)[..., None] * o.float())
                l_acc.copy_(new)
        if i < n - 1:
            _wait(pending)
            kv = nxt
    y = torch.empty(B, T, nh, hs, dtype=q.dtype, device=q.device).transpose(1, 2)  # (B, nh, T, hs) view
    y.copy_(out)
    return y, lse


def _bthd_zeros(n, B, nh, T, hs, device):
    """n fp32 zero (B, nh, T, hs) views of (n, B, T, nh, hs) memory: the block kernels' gradient layout, so the
    accumulating adds read and write both operands in the same order (vectorised, no strided gather)."""
    return torch.zeros(n, B, T, nh, hs, dtype=torch.float32, device=device).transpose(2, 3)


def ring_bwd(do, q, k, v, out, lse, ring: Ring):
    """Gradients (dq, dk, dv), fp32 (B, nh, T, hs), of this rank's q, k, v, given the merged out and lse.
    The K/V blocks travel the ring as in the forward; the dk/dv a rank computes for the block in hand (rank s's)
    goes straight back to s in q's dtype, where it is added in fp32 (in ring order: the sum is the same as carrying
    an fp32 accumulator around the ring, at half its bytes)."""
    n, r, T = ring.size, ring.rank, q.shape[2]
    B, nh, _, hs = q.shape
    kv = torch.stack([k, v])
    dq = _bthd_zeros(1, B, nh, T, hs, q.device)[0]
    dkv = _bthd_zeros(2, B, nh, T, hs, q.device)  # this rank's dk, dv: its own part, then the others' as they come
    back, sent = None, []  # (buffer, key slice, pending) of the part of dk/dv on its way home; parts sent
    for i in range(n):
        if i < n - 1:
            nxt, pending = _send_recv(kv, ring)
        s = (r - i) % n
        plan = _plan(r, s, n, ring.causal, ring.layout, T)
        ops, part = [], None
        if plan is not None:  # this block's part, computed while the previous parts are still arriving
            qs, ks, causal = plan
            if i > 0:  # (2, B, keys, nh, hs) in q's dtype, written by the kernel: the message home to rank s
                part = torch.empty(2, B, len(range(*ks.indices(T))), nh, hs, dtype=q.dtype, device=q.device)
            g = _block_bwd(do[:, :, qs], q[:, :, qs], kv[0, :, :, ks], kv[1, :, :, ks], out[:, :, qs],
                           lse[:, :, qs], causal, ring, None if part is None else part.transpose(2, 3))
            dq[:, :, qs] += g[0]
            if part is None:
                dkv[0][:, :, ks] += g[1]
                dkv[1][:, :, ks] += g[2]
            else:
                ops.append(dist.P2POp(dist.isend, part, _global(ring, s), ring.group))
        if back is not None:
            _add_home(dkv, back)
            back = None
        src = (r + i) % n  # the rank holding this rank's block now: its part comes home
        home = _plan(src, r, n, ring.causal, ring.layout, T) if i > 0 else None
        if home is not None:
            ks_home = home[1]
            rows = len(range(*ks_home.indices(T)))
            buf = torch.empty(2, B, rows, nh, hs, dtype=q.dtype, device=q.device)
            ops.append(dist.P2POp(dist.irecv, buf, _global(ring, src), ring.group))
        if ops:
            work = _post(ops)
            if home is not None:  # waited for (once) by the next step's add
                back = (buf, ks_home, (work, part))
            else:  # a send alone: waited for at the end, its buffer referenced until then
                sent.append((work, part))
        if i < n - 1:
            _wait(pending)
            kv = nxt
    if back is not None:
        _add_home(dkv, back)
    for pending in sent:
        _wait(pending)
    return dq, dkv[0], dkv[1]


def _global(ring: Ring, cp_rank: int) -> int:
    """Global rank of a cp rank of this ring's group."""
    return dist.get_global_rank(ring.group, cp_rank)


def _add_home(dkv, back) -> None:
    buf, ks, pending = back
    _wait(pending)
    dkv[:, :, :, ks] += buf.transpose(2, 3)


class RingAttention(torch.autograd.Function):
    """fwd: ring_fwd; bwd: ring_bwd (gradients in q's dtype)."""

    @staticmethod
    def forward(ctx, q, k, v, ring):
        out, lse = ring_fwd(q, k, v, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_bwd(do, q, k, v, out, lse, ctx.ring)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


class RingAttentionQKV(torch.autograd.Function):
    """The same from the packed (B, T, 3*nh*hs) projection: backward writes dq, dk, dv, cast, into one packed
    gradient (the three views' gradients would otherwise be cast one by one, then stacked by autograd)."""

    @staticmethod
    def forward(ctx, qkv, n_head, ring):
        out, lse = ring_fwd(*split_qkv(qkv, n_head), ring)
        ctx.save_for_backward(qkv, out, lse)
        ctx.n_head, ctx.ring = n_head, ring
        return out

    @staticmethod
    def backward(ctx, do):
        qkv, out, lse = ctx.saved_tensors
        grads = ring_bwd(do, *split_qkv(qkv, ctx.n_head), out, lse, ctx.ring)
        dqkv = torch.empty_like(qkv)
        for view, g in zip(split_qkv(dqkv, ctx.n_head), grads):
            view.copy_(g)
        return dqkv, None, None


def _check_local_len(T: int, ring: Ring) -> None:
    if ring.causal and ring.layout == "zigzag" and T % 2:
        raise ValueError(f"ring attention (zigzag): the local sequence of {T} tokens is not two chunks")


def ring_attention(q, k, v, ring: Ring):
    """Attention of this rank's q (B, nh, T, hs) over the keys of the whole cp group (see the module docstring)."""
    _check_local_len(q.shape[2], ring)
    return RingAttention.apply(q, k, v, ring)


def ring_attention_qkv(qkv, n_head: int, ring: Ring):
    """ring_attention of the packed projection (B, T, 3*nh*hs): the model's path (one packed gradient)."""
    _check_local_len(qkv.shape[1], ring)
    return RingAttentionQKV.apply(qkv, n_head, ring)


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


def apply_cp(model: GPT, mesh, pipeline: bool = False, impl: str = "ring") -> GPT:
    """Context parallel over mesh's cp group, in place: every block's attention becomes ring (or Ulysses)
    attention, the loss count-weighted over cp; without `pipeline` the GPT's forward takes its zigzag chunks itself
    (pipelines: shard_stage_inputs on the chunks, after the split)."""
    if impl not in ("ring", "ulysses"):
        raise ValueError(f"parallel.cp_impl must be ring or ulysses, got {impl!r}")
    ring = ring_of(mesh)
    for block in model.transformer.h:
        block.attn.cp_ring, block.attn.cp_impl = ring, impl
        block.attn.forward = types.MethodType(_attention_forward, block.attn)
    model.loss_fn = types.MethodType(_cp_loss(model.loss_fn.__func__, ring), model)
    if not pipeline:
        model.register_forward_pre_hook(_ShardInputs(ring, model.cfg.block_size), with_kwargs=True)
    if ring.group is not None:  # create the communicator now, with every cp rank present
        dist.all_reduce(torch.zeros(1, device=mesh.device), group=ring.group)
    return model
