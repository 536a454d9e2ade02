"""Ring attention with zigzag load balance (Liu et al. 2023): context parallel's attention op.

Sequence split (zigzag). Each sequence of T tokens is cut into 2*cp chunks of c = T/(2*cp); cp rank r holds chunks
r and 2*cp-1-r, in that order. Under the causal mask a contiguous split would give rank 0 one block of work and
rank cp-1 cp of them; the zigzag pair gives every rank the same work.

Ring. Per layer, with q, k, v (B, nh, 2c, hs) of this rank's tokens: for i = 0..cp-1 rank r holds the K/V of rank
s = r - i (mod cp), posts the send of it to rank r+1 and the receive of the next one from rank r-1 (one
(2, B, nh, 2c, hs) message), and computes its queries against the K/V in hand meanwhile. Zigzag blocks (q chunks
r, 2cp-1-r; kv chunks s, 2cp-1-s), all without a masked-out tile:
    s == r   causal attention on the local 2c x 2c (the local order is the global order)
    s <  r   all 2c queries against chunk s only (both q chunks come after it; chunk 2cp-1-s after both)
    s >  r   query chunk 2cp-1-r only against both kv chunks (chunk r comes before both)
Partial results merge in natural-log LSE (online softmax), in fp32: kernels/attention.py attention_merge_.
Backward (FlashAttention-2's, per block, from the merged out and lse): the same ring; dq accumulates here, and the
dk/dv a rank computes for the block in hand (rank s's, in the activation dtype) is sent straight home to s, which
adds the parts in fp32 in ring order. Comm per layer: (cp-1) K/V messages forward; (cp-1) K/V messages and (cp-1)
dK/dV parts backward; NCCL runs them on its own stream, so they overlap the blocks' kernels. Kept K/V
(Ring.keep_kv, parallel.cp_keep_kv): the forward keeps the cp-1 remote blocks it received for backward, which then
sends no K/V, runs the remote blocks first (their parts go home) and the diagonal while the parts travel.

Blocks run kernels/attention.py's attention_block_fwd / attention_block_bwd (Triton: out + lse, backward from a
given lse) on CUDA tensors or in the interpreter, else a PyTorch reference in fp32 (attention_ref, _block_bwd_ref).
Used by cp.py; tested by tests/test_cp.py (gloo, CPU); measured by bench/bench_cp.py (notes/cp.md).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from kernels.attention import attention_block_bwd, attention_block_fwd, attention_merge_, attention_ref
from nanopara.model import split_qkv


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
    keep_kv: bool = False  # forward keeps the remote K/V blocks for backward (no K/V messages there)


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


def ring_fwd(q, k, v, ring: Ring, kept: list | None = None):
    """Forward of this rank's queries against every rank's keys. q, k, v (B, nh, T, hs) of the local tokens ->
    (out (B, nh, T, hs) in q's dtype, a view of (B, T, nh, hs) memory; lse fp32 (B, nh, T)). `kept`: a list that
    gets, for steps 1..cp-1, the (2, B, nh, T, hs) K/V block received for that step (None where no query sees it)."""
    B, nh, T, hs = q.shape
    n, r = ring.size, ring.rank
    kv = torch.stack([k, v])  # (2, B, nh, T, hs): the message passed around the ring
    out = lse = None
    for i in range(n):
        if i < n - 1:  # the next block travels while this one computes
            nxt, pending = _send_recv(kv, ring)
        plan = _plan(r, (r - i) % n, n, ring.causal, ring.layout, T)
        if kept is not None and i > 0:  # the buffer the ring received, held instead of dropped at the next step
            kept.append(None if plan is None else kv)
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


def ring_bwd(do, q, k, v, out, lse, ring: Ring, kept: list | None = None):
    """Gradients (dq, dk, dv), fp32 (B, nh, T, hs), of this rank's q, k, v, given the merged out and lse.
    The K/V blocks travel the ring as in the forward; the dk/dv a rank computes for the block in hand (rank s's)
    goes straight back to s in q's dtype, where it is added in fp32 (in ring order: the sum is the same as carrying
    an fp32 accumulator around the ring, at half its bytes). `kept` (ring_fwd's): _ring_bwd_kept, no K/V messages."""
    if kept is not None:
        return _ring_bwd_kept(do, q, k, v, out, lse, ring, kept)
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


def _ring_bwd_kept(do, q, k, v, out, lse, ring: Ring, kept: list):
    """ring_bwd from the remote K/V blocks the forward kept (kept[i-1]: step i's): no K/V message. The remote
    blocks run first, in ring order i = 1..cp-1 (every rank walks the same steps, so a step's send of a part pairs
    with its peer's receive of the same step, as in ring_bwd); each step posts its part home together with the
    receive of this rank's own part of that step. The diagonal then computes while the parts travel."""
    n, r, T = ring.size, ring.rank, q.shape[2]
    B, nh, _, hs = q.shape
    held, homes, sent = [], [], []  # (query slice, dq contribution) per remote block; parts coming home; sends
    for i in range(1, n):
        s, src = (r - i) % n, (r + i) % n  # this step's K/V owner; the rank holding this rank's block at this step
        plan, home = _plan(r, s, n, ring.causal, ring.layout, T), _plan(src, r, n, ring.causal, ring.layout, T)
        ops, part = [], None
        if plan is not None:
            qs, ks, causal = plan
            kv = kept[i - 1]
            part = torch.empty(2, B, len(range(*ks.indices(T))), nh, hs, dtype=q.dtype, device=q.device)
            g = _block_bwd(do[:, :, qs], q[:, :, qs], kv[0, :, :, ks], kv[1, :, :, ks], out[:, :, qs],
                           lse[:, :, qs], causal, ring, part.transpose(2, 3))
            held.append((qs, g[0]))
            ops.append(dist.P2POp(dist.isend, part, _global(ring, s), ring.group))
        if home is not None:
            buf = torch.empty(2, B, len(range(*home[1].indices(T))), nh, hs, dtype=q.dtype, device=q.device)
            ops.append(dist.P2POp(dist.irecv, buf, _global(ring, src), ring.group))
        if ops:
            work = _post(ops)
            if home is not None:  # waited for (once) by its add below
                homes.append((buf, home[1], (work, part)))
            else:
                sent.append((work, part))
    # the diagonal, from the same stacked copy of k, v as ring_bwd's step 0 (same inputs, same kernel path)
    kv = torch.stack([k, v])
    qs, ks, causal = _plan(r, r, n, ring.causal, ring.layout, T)
    g = _block_bwd(do[:, :, qs], q[:, :, qs], kv[0, :, :, ks], kv[1, :, :, ks], out[:, :, qs], lse[:, :, qs],
                   causal, ring)
    # The adds in ring_bwd's order (dq: the diagonal's, then the remote blocks' in ring order; dk/dv: the own
    # diagonal part, then the parts from the other ranks in step order) onto the same zeros: the fp32 sums are
    # identical to ring_bwd's, bit for bit. Only when the remote blocks ran and the parts travelled differs.
    dq = _bthd_zeros(1, B, nh, T, hs, q.device)[0]
    dkv = _bthd_zeros(2, B, nh, T, hs, q.device)
    dq[:, :, qs] += g[0]
    dkv[0][:, :, ks] += g[1]
    dkv[1][:, :, ks] += g[2]
    for qs, dq_block in held:
        dq[:, :, qs] += dq_block
    for back in homes:
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
    """fwd: ring_fwd; bwd: ring_bwd (gradients in q's dtype); with ring.keep_kv the K/V the forward received too."""

    @staticmethod
    def forward(ctx, q, k, v, ring):
        kept = [] if ring.keep_kv else None
        out, lse = ring_fwd(q, k, v, ring, kept)
        ctx.save_for_backward(q, k, v, out, lse, *(kept or ()))  # kept K/V: held to backward (recompute: transient)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, *kept = ctx.saved_tensors
        dq, dk, dv = ring_bwd(do, q, k, v, out, lse, ctx.ring, kept if ctx.ring.keep_kv else None)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


class RingAttentionQKV(torch.autograd.Function):
    """The same from the packed (B, T, 3*nh*hs) projection: backward writes dq, dk, dv, cast, into one packed
    gradient (the three views' gradients would otherwise be cast one by one, then stacked by autograd)."""

    @staticmethod
    def forward(ctx, qkv, n_head, ring):
        kept = [] if ring.keep_kv else None
        out, lse = ring_fwd(*split_qkv(qkv, n_head), ring, kept)
        ctx.save_for_backward(qkv, out, lse, *(kept or ()))
        ctx.n_head, ctx.ring = n_head, ring
        return out

    @staticmethod
    def backward(ctx, do):
        qkv, out, lse, *kept = ctx.saved_tensors
        grads = ring_bwd(do, *split_qkv(qkv, ctx.n_head), out, lse, ctx.ring, kept if ctx.ring.keep_kv else None)
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
