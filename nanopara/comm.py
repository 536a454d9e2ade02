"""Collectives with autograd rules (Megatron f/g, sequence-parallel gather/reduce-scatter) and hand-written ones.

Every function takes its process group explicitly; a group of None means a size-1 axis: no communication.

Sections (each with its own math and owner): tensor parallel (tp.py); ring collectives (`ring_all_reduce`,
`ring_reduce_scatter`, `ring_all_gather`: N-1 + N-1 send/recv steps, 2(N-1)/N of the data per rank; tested in
tests/test_comm.py, measured against NCCL by `torchrun --nproc_per_node=N bench/bench_comm.py`); data parallel
(ZeRO-3's all-gather forward / reduce-scatter backward, used by dp.py).
"""
from __future__ import annotations

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
