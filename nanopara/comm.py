"""Collectives with autograd rules (Megatron f/g, sequence-parallel gather/reduce-scatter) and hand-written ones.

Every function takes its process group explicitly; a group of None means a size-1 axis: no communication.

Sections (each with its own math and owner): tensor parallel (tp.py); ring collectives (`ring_all_reduce`,
`ring_reduce_scatter`, `ring_all_gather`: N-1 + N-1 send/recv steps, 2(N-1)/N of the data per rank; tested in
tests/test_comm.py, measured against NCCL by `torchrun --nproc_per_node=N bench/bench_comm.py`); data parallel
(ZeRO-3's all-gather forward / reduce-scatter backward, used by zero3.py).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


# ----------------------------------------------------------------------------------------------------------------
# --- tensor parallel (owner: tp.py)
#
# Megatron-LM (Shoeybi et al. 2019, Fig. 3): a column-parallel linear is entered through `f` and a row-parallel one
# left through `g`; f and g are conjugate (each one's backward is the other's forward). Sequence parallelism
# (Korthikanti et al. 2022, Fig. 5) replaces them with an all-gather along the sequence (entering) and a
# reduce-scatter along the sequence (leaving), conjugate in the same way. Activations are (B, T, C) here, so the
# sequence is dim 1; NCCL/gloo gather along dim 0, hence the movedim copies (Megatron keeps (T, B, C) to avoid them).
# Collectives are looked up as `dist.<op>` at call time so a benchmark can wrap them with timers.

def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _gather_fn():  # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (same arguments)
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_fn():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """In-place SUM all-reduce of a contiguous tensor over `group` (no autograd)."""
    if group is not None:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's x along `dim` in rank order (no autograd). x (.., n, ..) -> (.., n*size, ..)."""
    n = _size(group)
    if n == 1:
        return x
    xt = x.movedim(dim, 0).contiguous()  # (n_local, ...) so each rank's piece is one contiguous block
    out = torch.empty((n * xt.shape[0], *xt.shape[1:]), dtype=x.dtype, device=x.device)
    _gather_fn()(out, xt, group=group)
    return out.movedim(0, dim).contiguous()


def reduce_scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum x over ranks and keep this rank's 1/size chunk of `dim` (no autograd). x (.., n, ..) -> (.., n/size, ..)."""
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"reduce-scatter: dim {dim} of size {x.shape[dim]} is not divisible by the group size {n}")
    xt = x.movedim(dim, 0).contiguous()  # (n_total, ...): rank r receives rows r*n_total/size ..
    out = torch.empty((xt.shape[0] // n, *xt.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_fn()(out, xt, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim).contiguous()


class _F(torch.autograd.Function):
    """fwd: identity, bwd: all-reduce (enter a column-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):  # in place, like Megatron: the grad reaching f is a fresh matmul output
        return all_reduce_sum(grad.contiguous(), ctx.group), None


class _G(torch.autograd.Function):
    """fwd: all-reduce, bwd: identity (leave a row-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            return all_reduce_sum(x.contiguous(), group)
        ctx.mark_dirty(x)  # reduce in place (no copy); autograd errors if anything saved x for backward
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllGatherSeq(torch.autograd.Function):
    """fwd: all-gather along dim, bwd: reduce-scatter along dim (enter a TP region from a sequence shard)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    """fwd: reduce-scatter along dim, bwd: all-gather along dim (leave a TP region into a sequence shard)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


def f(x: torch.Tensor, group) -> torch.Tensor:
    """fwd: identity, bwd: all-reduce over `group` (Megatron's f, before a column-parallel linear)."""
    return x if group is None else _F.apply(x, group)


def g(x: torch.Tensor, group) -> torch.Tensor:
    """fwd: all-reduce over `group`, bwd: identity (Megatron's g, after a row-parallel linear)."""
    return x if group is None else _G.apply(x, group)


def all_gather_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """fwd: all-gather along `dim` (the sequence), bwd: reduce-scatter along `dim` (SP paper's g, entering TP)."""
    return x if group is None else _AllGatherSeq.apply(x, group, dim)


def reduce_scatter_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """fwd: reduce-scatter along `dim` (the sequence), bwd: all-gather along `dim` (SP paper's g-bar, leaving TP)."""
    return x if group is None else _ReduceScatterSeq.apply(x, group, dim)


# ----------------------------------------------------------------------------------------------------------------
# --- ring collectives (for reading and benchmarking: the engines use NCCL's)
#
# The bandwidth-optimal ring (Patarasuk & Yuan 2009; the algorithm NCCL's ring implements), written from
# point-to-point messages so the 2(N-1)/N can be read off the loops. A flat tensor is cut into N chunks (sizes
# differ by at most one element, like torch.tensor_split); rank r only ever sends to r+1 and receives from r-1.
#
#   reduce-scatter, N-1 steps: at step s rank r sends chunk (r-s-1) % N and receives chunk (r-s-2) % N, which it
#     adds to its own copy. The chunk sent at step s+1 is the one reduced at step s, so each message carries one
#     more rank's contribution; after N-1 steps chunk r holds all N.       bytes sent per rank: (N-1)/N * size
#   all-gather, N-1 steps: at step s rank r forwards chunk (r-s) % N (which it holds) and receives (r-s-1) % N
#     into place.                                                          bytes sent per rank: (N-1)/N * size
#   all-reduce = reduce-scatter + all-gather                               bytes sent per rank: 2(N-1)/N * size
#
# Every step posts its send and its receive together (batch_isend_irecv: one NCCL group call), so no rank sits in
# a blocking send while its neighbour sits in one too. Bus bandwidth, 2(N-1)/N * size / time, is therefore the
# right figure for both this ring and NCCL's all-reduce: bench/bench_comm.py compares them. The chunk-level steps
# are not pipelined (NCCL splits each chunk into slices so the add overlaps the next transfer), which is the gap
# the benchmark shows. Tested against torch.distributed in tests/test_comm.py.

def _ring(group) -> tuple[int, int, int, int]:
    """(size, rank in group, global rank of the next, global rank of the previous)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return n, r, dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)


def _send_recv(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int, group) -> None:
    """Send to the next rank and receive from the previous one, posted together; empty chunks are skipped."""
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, nxt, group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, prv, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _combine(op):
    if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        return lambda acc, x: acc.add_(x)
    if op == dist.ReduceOp.MAX:
        return lambda acc, x: torch.maximum(acc, x, out=acc)
    if op == dist.ReduceOp.MIN:
        return lambda acc, x: torch.minimum(acc, x, out=acc)
    raise ValueError(f"ring collectives support SUM, AVG, MAX and MIN, not {op}")


def _chunks(flat: torch.Tensor, n: int) -> list[torch.Tensor]:
    """n contiguous views of a 1-D tensor, the first numel % n of them one element longer."""
    q, rem = divmod(flat.numel(), n)
    return list(flat.split([q + (i < rem) for i in range(n)]))


def _ring_reduce_scatter_(chunks: list[torch.Tensor], op, group) -> None:
    """In place: afterwards chunks[rank] holds op over all ranks of that chunk (the others hold partial results)."""
    n, r, nxt, prv = _ring(group)
    combine = _combine(op)
    tmp = torch.empty(max(c.numel() for c in chunks), dtype=chunks[0].dtype, device=chunks[0].device)
    for s in range(n - 1):
        send, acc = chunks[(r - s - 1) % n], chunks[(r - s - 2) % n]
        got = tmp[:acc.numel()]  # previous rank sends its chunk (r-s-2) % N: the same index, the same size
        _send_recv(send, got, nxt, prv, group)
        combine(acc, got)


def _ring_all_gather_(chunks: list[torch.Tensor], group) -> None:
    """In place: chunks[rank] is this rank's; afterwards every chunk holds its owner's data."""
    n, r, nxt, prv = _ring(group)
    for s in range(n - 1):
        _send_recv(chunks[(r - s) % n], chunks[(r - s - 1) % n], nxt, prv, group)


def _flat(x: torch.Tensor, what: str) -> torch.Tensor:
    if not x.is_contiguous():
        raise ValueError(f"ring collectives need contiguous tensors ({what} is not)")
    return x.view(-1)


def ring_all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of x (any shape and size) over `group` as ring reduce-scatter + all-gather; returns x."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    n, r = dist.get_world_size(group), dist.get_rank(group)
    chunks = _chunks(_flat(x, "x"), n)
    _ring_reduce_scatter_(chunks, op, group)
    if op == dist.ReduceOp.AVG:
        chunks[r].div_(n)  # each rank divides the chunk it owns once, before the gather copies it everywhere
    _ring_all_gather_(chunks, group)
    return x


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Like dist.reduce_scatter_tensor: rank r gets op over ranks of input's r-th 1/N; input is left unchanged."""
    n = 1 if group is None else dist.get_world_size(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"ring_reduce_scatter: input has {input.numel()} elements, expected {n} x {output.numel()}")
    if n == 1:
        return output.copy_(input.view_as(output))
    work = _flat(input, "input").clone()  # the ring reduces in place; (N*k,) -> N chunks of k
    chunks = list(work.split(output.numel()))
    _ring_reduce_scatter_(chunks, op, group)
    mine = chunks[dist.get_rank(group)]
    if op == dist.ReduceOp.AVG:
        mine.div_(n)
    _flat(output, "output").copy_(mine)
    return output


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group) -> torch.Tensor:
    """Like dist.all_gather_into_tensor: output = concatenation of every rank's input, in rank order."""
    n = 1 if group is None else dist.get_world_size(group)
    if output.numel() != n * input.numel():
        raise ValueError(f"ring_all_gather: output has {output.numel()} elements, expected {n} x {input.numel()}")
    if n == 1:
        return output.copy_(input.view_as(output))
    chunks = list(_flat(output, "output").split(input.numel()))  # (N*k,) -> N chunks of k
    chunks[dist.get_rank(group)].copy_(_flat(input, "input"))
    _ring_all_gather_(chunks, group)
    return output


# ----------------------------------------------------------------------------------------------------------------
# --- data parallel (owner: zero3.py): ZeRO-3's parameter gather with its autograd rule
#
# ZeRO-3 (Rajbhandari et al. 2020, Sec. 5.3) keeps 1/N of a unit's flat parameter buffer on each rank. The full
# buffer is all-gathered before the unit runs (launched one unit early: prefetch) and the gradient of the full
# buffer is reduce-scattered back to the shards. The engine owns the buffer (frees it after forward, gathers it
# again before backward), so the autograd function only marks the boundary and says what backward does.

def all_gather_flat(shard: torch.Tensor, group, dtype: torch.dtype, out: torch.Tensor | None = None):
    """Start gathering every rank's flat `shard` (k,) into `out` (N*k,) in `dtype`; returns (out, work, sent).

    Asynchronous: wait on `work` before reading `out`; keep `sent` (the cast shard) alive until then.
    """
    if group is None:  # a group of one (ZeRO-3's experts when each is held by one rank): a copy is the gather
        out = shard.detach().to(dtype, copy=True) if out is None else out.copy_(shard)
        return out, NoWork(), out
    sent = shard.detach().to(dtype)
    if out is None:
        out = torch.empty(dist.get_world_size(group) * shard.numel(), dtype=dtype, device=shard.device)
    work = dist.all_gather_into_tensor(out, sent, group=group, async_op=True)
    return out, work, sent


class NoWork:
    """The handle of a collective over a group of one rank: nothing to wait for."""

    def wait(self):
        pass


def flat_views(full: torch.Tensor, shapes) -> list:
    """Views of a flat buffer holding tensors of the given shapes end to end (padding, if any, after them)."""
    views, off = [], 0
    for shape in shapes:
        n = math.prod(shape)
        views.append(full[off:off + n].view(shape))
        off += n
    return views


class _ZeroGather(torch.autograd.Function):
    """fwd: the unit's parameters as views of its gathered flat buffer, bwd: async reduce-scatter (SUM, fp32)."""

    @staticmethod
    def forward(ctx, anchor, full, group, on_reduce, shapes):
        ctx.group, ctx.on_reduce, ctx.numel = group, on_reduce, full.numel()
        # one node for the whole unit (not a split plus a view per parameter): the hooks run once per block per
        # pass on the host's critical path. The views keep `full`'s storage, which the engine frees and refills.
        return tuple(flat_views(full, shapes))

    @staticmethod
    def backward(ctx, *grads):  # one gradient per view, in the gather dtype (zeros where a view got none)
        g = grads[0].new_empty(ctx.numel, dtype=torch.float32)  # reduce in fp32 whatever the compute dtype:
        n = sum(x.numel() for x in grads)                       # the same sums as DDP's
        torch.cat([x.reshape(-1) for x in grads], out=g[:n])  # one copy kernel, casting on the way
        g[n:].zero_()  # the flat buffer's padding
        if ctx.group is None:  # a group of one: the whole gradient is this rank's shard
            ctx.on_reduce(NoWork(), g, g)
            return None, None, None, None, None
        k = g.numel() // dist.get_world_size(ctx.group)
        out = g[dist.get_rank(ctx.group) * k:][:k]  # (k,): this rank's shard, in place (recv = send + r*k)
        work = dist.reduce_scatter_tensor(out, g, group=ctx.group, async_op=True)
        ctx.on_reduce(work, out, g)  # the engine waits before the optimizer step; comm overlaps the rest of bwd
        return None, None, None, None, None


def zero_gathered(anchor: torch.Tensor, full: torch.Tensor, group, on_reduce, shapes) -> tuple:
    """fwd: views of `full` (a unit's all-gathered flat parameters, laid end to end, padding after) with the
    given shapes; bwd: reduce-scatter the unit's whole gradient over `group` and pass (work, shard_grad, sent) to
    `on_reduce`. `anchor` is any leaf that requires grad, so backward reaches here.
    `on_reduce` lives in the autograd graph (C++, invisible to gc): it should not hold its engine strongly."""
    return _ZeroGather.apply(anchor, full, group, on_reduce, shapes)
