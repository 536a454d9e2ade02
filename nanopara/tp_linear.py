"""Tensor-parallel GEMMs with their collectives overlapped, and the sequence-parallel row layout.

The four TP linears (tp.py), on rows of tokens (N = B*T rows; W_r this rank's weight shard; AR all-reduce,
AG all-gather, RS reduce-scatter over the tp group):
                 forward                       backward
  column         y = x W_r^T                   dx = AR(dy W_r)                          dW = dy^T x
  row            y = AR(x_r W_r^T)             dx_r = dy W_r                            dW = dy^T x_r
  column + SP    y = AG(x_s) W_r^T             dx_s = RS(dy W_r)                        dW = dy^T AG(x_s)
  row + SP       y_s = RS(x_r W_r^T)           dx_r = AG(dy_s) W_r                      dW = AG(dy_s)^T x_r

Overlap ("collective matmul", Wang et al. 2023; Megatron's async TP): the rows are cut into k blocks and each
collective runs asynchronously (NCCL's own stream) while a GEMM runs on the compute stream:
  AG -> GEMM     every block's gather is queued at once; block j's GEMM waits for block j's gather only;
  GEMM -> RS/AR  block j's collective is launched as soon as block j's GEMM is done and runs under block j+1's;
  backward       the collective on dx runs under the dW GEMM (column + SP: the regather of x runs under dx's GEMMs).
`chunks` = 0 turns it all off: one collective per op, waited for at once (the comparison baseline).

Sequence-parallel layout. Rank r holds the N/tp rows {j*tp*n + r*n + i : j < k, i < n} (n = N/(tp*k)), stored
contiguously in that order and viewed as (B, T/tp, C), a label only: everything between the TP regions (LayerNorm,
dropout, residual adds) is per token. So piece j of every rank, gathered into one contiguous buffer, is exactly
rows j*tp*n .. (j+1)*tp*n of the full (B*T, C) activations, and a reduce-scatter of those rows hands each rank its
piece j back: every collective reads and writes contiguous memory, with no transposing copies (Megatron keeps
(T, B, C) for the same reason). k is a function of the shape alone (`blocks`), so every layer agrees on it.
Used by tp.py; tested by tests/test_tp.py; measured in notes/tp.md.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanopara.comm import _gather_fn, _reduce_scatter_fn


def blocks(rows: int, chunks: int) -> int:
    """Row blocks per rank for a shard of `rows` rows: the largest k <= max(chunks, 1) that divides rows."""
    k = max(chunks, 1)
    while rows % k:
        k -= 1
    return k


def shard_rows(rows: int, rank: int, tp: int, k: int) -> torch.Tensor:
    """Indices (into the full N = rows rows) of rank's SP shard, in its storage order."""
    n = rows // (tp * k)
    return (torch.arange(k)[:, None] * tp * n + rank * n + torch.arange(n)[None, :]).reshape(-1)


def _run(work, sync: bool):
    """An async collective's handle; waited for at once when overlap is off."""
    if sync:
        work.wait()
        return None
    return work


def _gather(out: torch.Tensor, x: torch.Tensor, group, sync: bool):
    """out (tp*n, C) <- every rank's x (n, C) in rank order."""
    return _run(_gather_fn()(out, x, group=group, async_op=True), sync)


def _scatter(out: torch.Tensor, x: torch.Tensor, group, sync: bool):
    """out (n, C) <- this rank's n rows of the sum over ranks of x (tp*n, C)."""
    return _run(_reduce_scatter_fn()(out, x, op=dist.ReduceOp.SUM, group=group, async_op=True), sync)


def _reduce(x: torch.Tensor, group, sync: bool):
    return _run(dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group, async_op=True), sync)


def _wait(works):
    for w in works:
        if w is not None:
            w.wait()


def _cast(t, dtype):
    """t in dtype; t itself (as t.to would return) when it is None or in dtype already: a no-op .to costs ~0.7 us
    of dispatch per call, and these run several times per TP layer per pass on the host's critical path."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _linear(x, w, b=None, out=None):
    """x w^T (+ b), all in one dtype (autocast never applies to out= calls, and the inputs are cast already)."""
    if out is None:
        return torch.nn.functional.linear(x, w, b)
    return torch.matmul(x, w.t(), out=out) if b is None else torch.addmm(b, x, w.t(), out=out)


class _Fn(torch.autograd.Function):
    """Shared bookkeeping: inputs cast to the compute dtype (autocast's, else x's); grads returned in theirs."""

    @staticmethod
    def _enter(ctx, x, weight, bias, group, chunks):
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.group, ctx.chunks, ctx.sync = group, chunks, chunks == 0
        ctx.tp, ctx.shape = dist.get_world_size(group), x.shape
        return _cast(x, dtype).reshape(-1, x.shape[-1]), _cast(weight, dtype), _cast(bias, dtype)

    @staticmethod
    def _grads(ctx, dx, dw, db):
        xd, wd, bd = ctx.dtypes
        return _cast(dx, xd), _cast(dw, wd), _cast(db, bd), None, None


class ColumnSP(_Fn):
    """y (B, T, out/tp) = AG(x_s) W_r^T + b_r from the SP shard x_s (B, T/tp, in). Saves x_s only and gathers it
    again in backward for dW (Korthikanti et al. 2022, 4.2.2), or with keep=True the gathered (B, T, in) input:
    one all-gather fewer per layer for B*T*in more bytes held (parallel.sp_keep_gathered)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, chunks, keep=False):
        xs, w, b = _Fn._enter(ctx, x, weight, bias, group, chunks)
        k = blocks(xs.shape[0], chunks)
        if k == 1:  # one gather, one GEMM
            full = xs.new_empty(ctx.tp * xs.shape[0], xs.shape[1])
            _wait([_gather(full, xs, group, ctx.sync)])
            y = _linear(full, w, b)
        else:
            full = xs.new_empty(k, ctx.tp * (xs.shape[0] // k), xs.shape[1])  # block j: rows j*tp*n ..
            works = [_gather(full[j], xs.view(k, -1, xs.shape[1])[j], group, ctx.sync) for j in range(k)]
            y = xs.new_empty(k, full.shape[1], w.shape[0])
            for j in range(k):
                if works[j] is not None:
                    works[j].wait()
                _linear(full[j], w, b, out=y[j])
        ctx.save_for_backward(full if keep else xs, w)
        ctx.has_bias, ctx.kept, ctx.rows = b is not None, keep, xs.shape[0]
        B, Ts = x.shape[0], x.shape[1]
        return y.view(B, Ts * ctx.tp, w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xs, w = ctx.saved_tensors  # the shard, or (keep) the gathered input
        dy = _cast(dy, w.dtype).reshape(-1, w.shape[0])  # (N, out/tp)
        k = blocks(ctx.rows, ctx.chunks)
        if k == 1:  # one gather, one GEMM, one reduce-scatter: the order below without the block views and lists
            full, gather = xs, None
            if not ctx.kept:
                full = xs.new_empty(ctx.tp * xs.shape[0], xs.shape[1])
                gather = _gather(full, xs, ctx.group, ctx.sync)
            dxs = xs.new_empty(ctx.rows, xs.shape[-1])
            part = dy @ w  # held (like `parts` below) until its reduce-scatter is waited for
            scatter = _scatter(dxs, part, ctx.group, ctx.sync)
            if gather is not None:
                gather.wait()
            dw = dy.t() @ full.view(-1, xs.shape[-1])  # runs under the reduce-scatter
            db = dy.sum(0) if ctx.has_bias else None
            if scatter is not None:
                scatter.wait()
            return (*_Fn._grads(ctx, dxs.view(ctx.shape), dw, db), None)
        if ctx.kept:
            full, gathers = xs, []
        else:
            full = xs.new_empty(k, ctx.tp * (xs.shape[0] // k), xs.shape[1])
            gathers = [_gather(full[j], xs.view(k, -1, xs.shape[1])[j], ctx.group, ctx.sync) for j in range(k)]
        dxs = xs.new_empty(k, ctx.rows // k, xs.shape[-1])
        parts, scatters = [], []
        for j, dyj in enumerate(dy.view(k, -1, dy.shape[1])):  # dx rows of block j, reduced while j+1 computes
            parts.append(dyj @ w)
            scatters.append(_scatter(dxs[j], parts[-1], ctx.group, ctx.sync))
        _wait(gathers)
        dw = dy.t() @ full.view(-1, xs.shape[-1])  # runs under the reduce-scatters
        db = dy.sum(0) if ctx.has_bias else None
        _wait(scatters)
        return (*_Fn._grads(ctx, dxs.view(ctx.shape), dw, db), None)


class RowSP(_Fn):
    """y_s (B, T/tp, out) = RS(x_r W_r^T) from this rank's input columns x_r (B, T, in/tp); no bias (tp.py adds it)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, chunks):
        xr, w, _ = _Fn._enter(ctx, x, weight, None, group, chunks)
        k = blocks(xr.shape[0] // ctx.tp, chunks)
        if k == 1:  # one GEMM, one reduce-scatter
            ys = xr.new_empty(xr.shape[0] // ctx.tp, w.shape[0])
            part = _linear(xr, w)  # held until the reduce-scatter is waited for
            work = _scatter(ys, part, group, ctx.sync)
            if work is not None:
                work.wait()
            ctx.save_for_backward(xr, w)
            return ys.view(x.shape[0], x.shape[1] // ctx.tp, w.shape[0])
        ys = xr.new_empty(k, xr.shape[0] // (k * ctx.tp), w.shape[0])
        parts, works = [], []
        for j, xj in enumerate(xr.view(k, -1, xr.shape[1])):
            parts.append(_linear(xj, w))
            works.append(_scatter(ys[j], parts[-1], group, ctx.sync))
        _wait(works)
        ctx.save_for_backward(xr, w)
        return ys.view(x.shape[0], x.shape[1] // ctx.tp, w.shape[0])

    @staticmethod
    def backward(ctx, dys):
        xr, w = ctx.saved_tensors
        dys = _cast(dys, w.dtype).reshape(-1, w.shape[0])  # (N/tp, out)
        k = blocks(dys.shape[0], ctx.chunks)
        if k == 1:  # one gather, one GEMM
            full = dys.new_empty(ctx.tp * dys.shape[0], dys.shape[1])
            work = _gather(full, dys, ctx.group, ctx.sync)
            dx = xr.new_empty(full.shape[0], w.shape[1])
            if work is not None:
                work.wait()
            torch.matmul(full, w, out=dx)
            return _Fn._grads(ctx, dx.view(ctx.shape), full.t() @ xr, None)
        full = dys.new_empty(k, ctx.tp * (dys.shape[0] // k), dys.shape[1])
        works = [_gather(full[j], dys.view(k, -1, dys.shape[1])[j], ctx.group, ctx.sync) for j in range(k)]
        dx = xr.new_empty(k, full.shape[1], w.shape[1])
        for j in range(k):  # block j's dx while block j+1 is still arriving
            if works[j] is not None:
                works[j].wait()
            torch.matmul(full[j], w, out=dx[j])
        dw = full.view(-1, w.shape[0]).t() @ xr
        return _Fn._grads(ctx, dx.view(ctx.shape), dw, None)


class ColumnTP(_Fn):
    """y (B, T, out/tp) = x W_r^T + b_r, x replicated; backward all-reduces dx in blocks under the dW GEMM (f)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, chunks):
        x2, w, b = _Fn._enter(ctx, x, weight, bias, group, chunks)
        y = _linear(x2, w, b)
        ctx.save_for_backward(x2, w)
        ctx.has_bias = b is not None
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        dy = _cast(dy, w.dtype).reshape(-1, w.shape[0])
        dx = x2.new_empty(x2.shape)
        if ctx.chunks <= 1:  # one GEMM, one all-reduce (tensor_split into 1 block is the whole tensor)
            torch.matmul(dy, w, out=dx)
            work = _reduce(dx, ctx.group, ctx.sync)
            dw = dy.t() @ x2  # under the all-reduce
            db = dy.sum(0) if ctx.has_bias else None
            if work is not None:
                work.wait()
            return _Fn._grads(ctx, dx.view(ctx.shape), dw, db)
        works = []
        for dyj, dxj in zip(dy.tensor_split(max(ctx.chunks, 1)), dx.tensor_split(max(ctx.chunks, 1))):
            torch.matmul(dyj, w, out=dxj)
            works.append(_reduce(dxj, ctx.group, ctx.sync))
        dw = dy.t() @ x2  # under the all-reduces
        db = dy.sum(0) if ctx.has_bias else None
        _wait(works)
        return _Fn._grads(ctx, dx.view(ctx.shape), dw, db)


class RowTP(_Fn):
    """y (B, T, out) = AR(x_r W_r^T): block j's all-reduce runs under block j+1's GEMM (g); no bias."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, chunks):
        x2, w, _ = _Fn._enter(ctx, x, weight, None, group, chunks)
        if chunks <= 1:
            y = _linear(x2, w)
            work = _reduce(y, group, ctx.sync)
            if work is not None:
                work.wait()
        else:
            y = x2.new_empty(x2.shape[0], w.shape[0])
            works = []
            for xj, yj in zip(x2.tensor_split(chunks), y.tensor_split(chunks)):
                _linear(xj, w, out=yj)
                works.append(_reduce(yj, group, ctx.sync))
            _wait(works)
        ctx.save_for_backward(x2, w)
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        dy = _cast(dy, w.dtype).reshape(-1, w.shape[0])
        return _Fn._grads(ctx, (dy @ w).view(ctx.shape), dy.t() @ x2, None)


# ----------------------------------------------------------------------------------------------------------------
# the SP layout's entry and exit without a GEMM (the embedding's reduce-scatter; FP8's GEMMs; tests)

def _reduce_scatter_rows(x: torch.Tensor, group, chunks: int) -> torch.Tensor:
    """(B, T, C) partial sums -> this rank's SP shard (B, T/tp, C) of their sum (no autograd)."""
    tp = dist.get_world_size(group)
    x2 = x.contiguous().view(-1, x.shape[-1])
    k = blocks(x2.shape[0] // tp, chunks)
    out = x2.new_empty(k, x2.shape[0] // (k * tp), x2.shape[1])
    _wait([_scatter(out[j], xj, group, False) for j, xj in enumerate(x2.view(k, -1, x2.shape[1]))])
    return out.view(x.shape[0], x.shape[1] // tp, x.shape[2])


class _Scatter(torch.autograd.Function):
    """fwd: (B, T, C) partial sums -> this rank's SP shard (B, T/tp, C) of their sum; bwd: the all-gather."""

    @staticmethod
    def forward(ctx, x, group, chunks):
        ctx.group, ctx.chunks = group, chunks
        return _reduce_scatter_rows(x, group, chunks)

    @staticmethod
    def backward(ctx, grad):
        return sp_gather(grad, ctx.group, ctx.chunks), None, None


class _Gather(torch.autograd.Function):
    """fwd: SP shards (B, T/tp, C) -> the full (B, T, C); bwd: the reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, xs, group, chunks):
        ctx.group, ctx.chunks = group, chunks
        return sp_gather(xs, group, chunks)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.group, ctx.chunks), None, None


def sp_scatter(x: torch.Tensor, group, chunks: int) -> torch.Tensor:
    """Reduce-scatter (B, T, C) into this rank's SP shard (B, T/tp, C); backward all-gathers."""
    return _Scatter.apply(x, group, chunks)


def sp_all_gather(xs: torch.Tensor, group, chunks: int) -> torch.Tensor:
    """All-gather SP shards (B, T/tp, C) into the full (B, T, C); backward reduce-scatters. For a GEMM that is not
    one of the four Functions above (FP8: tp.py runs FP8LinearFunction between these collectives)."""
    return _Gather.apply(xs, group, chunks)


def sp_gather(xs: torch.Tensor, group, chunks: int) -> torch.Tensor:
    """All-gather SP shards (B, T/tp, C) into the full (B, T, C) (no autograd: tests and _Scatter's backward)."""
    tp = dist.get_world_size(group)
    x2 = xs.contiguous().view(-1, xs.shape[-1])
    k = blocks(x2.shape[0], chunks)
    full = x2.new_empty(k, tp * (x2.shape[0] // k), x2.shape[1])
    _wait([_gather(full[j], x2.view(k, -1, x2.shape[1])[j], group, False) for j in range(k)])
    return full.view(xs.shape[0], xs.shape[1] * tp, xs.shape[2])
