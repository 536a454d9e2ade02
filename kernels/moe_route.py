"""Mixture-of-Experts token routing: top-k selection + the permutation that groups tokens by expert, and the two
row movements around the expert GEMMs (permute, unpermute-combine), forward and backward.
Long file: routing's three launches and the two row movements share one assignment layout and one benchmark.

Math. N tokens, E experts, k choices per token, router logits z (N, E): s = softmax(z) (or sigmoid(z)); key =
s + bias (the aux-loss-free balancing bias, DeepSeek-V3: selects, never a gate); idx[t] = the k largest keys of
row t, best first (ties: lowest expert id; softmax without bias selects on z itself). Assignments a = (t, j) are
numbered slot-major, a = j * N + t, and stably sorted by expert: expert e's group holds its first choices in token
order, then its second choices, ... With a capacity c an expert keeps the first c of its group (Switch/GShard).
    idx     (N, k) int64   chosen experts
    dest    (N, k) int32   row of assignment (t, j) in the expert-sorted buffer, -1 where dropped
    counts  (E,)   int32   assignments routed to each expert before dropping (load statistics, aux loss)
    offsets (E+1,) int32   expert e's kept rows are [offsets[e], offsets[e+1]); offsets[E] = rows in use
    permute:    xs[dest[t, j]] = x[t]                           backward  dx[t] = sum_j dxs[dest[t, j]]
    unpermute:  y[t] = sum_j w[t, j] * ys[dest[t, j]]           backward  dys[dest[t, j]] = w[t, j] * dy[t],
                                                                          dw[t, j] = <dy[t], ys[dest[t, j]]>
  Dropped assignments add nothing. Both walk tokens (x, dy read once, a token's k rows summed in a fixed order).
  No host sync anywhere: the rows to allocate, N*k or min(N*k, E*c), are known on the host.

Kernels. Routing is three launches: (1) per block of tokens, top-k by k rounds of max + lowest argmax, each
assignment's rank among the block's to the same expert and the block's per-expert counts; (2) one program scans
those counts into base ranks, totals and offsets; (3) dest = offsets[e] + base + rank if rank < capacity.
Callers: nanopara/moe.py (it makes the gates w, differentiable in z): `route`, `permute`, `unpermute` take Triton on
CUDA, the reference on CPU; `*_triton` force Triton (tests/test_moe.py). `python -m kernels.moe_route`: GB/s.
"""
import argparse
import json
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.launch import cdiv, fast, next_pow2

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
NO_CAPACITY = 2 ** 31 - 1  # dropless: every rank is below it


class Routing(NamedTuple):
    idx: torch.Tensor      # (N, k) int64 chosen experts, best first
    dest: torch.Tensor     # (N, k) int32 row in the expert-sorted buffer, -1 = dropped
    counts: torch.Tensor   # (E,) int32 assignments routed to each expert (before dropping)
    offsets: torch.Tensor  # (E+1,) int32 group boundaries of the kept rows
    rows: int              # rows of the sorted buffers


def sorted_rows(N, k, E, capacity=None):
    """Rows of the expert-sorted buffers: N*k dropless, at most E*capacity with a capacity."""
    return N * k if capacity is None else min(N * k, E * capacity)


def padded_dest(r, capacity):
    """r.dest for an (E x capacity)-row buffer, expert e's kept rows at [e * capacity, e * capacity + kept_e) and
    the rest of its capacity unused (expert parallel's fixed-size exchange, nanopara/ep.py); -1 stays -1. Device
    ops on (N, k): no host sync."""
    e = r.idx.to(torch.int32)
    return torch.where(r.dest >= 0, e * capacity + r.dest - r.offsets[r.idx], -1).to(torch.int32)


def _check_route(logits, k, score, bias, capacity):
    if logits.dim() != 2:
        raise ValueError(f"route: logits must be (N, E), got {tuple(logits.shape)}")
    E = logits.shape[1]
    if not 1 <= k <= E:
        raise ValueError(f"route: need 1 <= k <= E, got k={k}, E={E}")
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"route: score must be 'softmax' or 'sigmoid', got {score!r}")
    if bias is not None and bias.shape != (E,):
        raise ValueError(f"route: bias must have shape ({E},), got {tuple(bias.shape)}")
    if capacity is not None and capacity < 0:
        raise ValueError(f"route: capacity must be >= 0, got {capacity}")


def select_key(logits, score="softmax", bias=None):
    """The key top-k ranks (fp32): the logits themselves for softmax without bias (same order), else score + bias."""
    z = logits.float()
    if score == "softmax" and bias is None:
        return z
    s = z.softmax(-1) if score == "softmax" else z.sigmoid()
    return s if bias is None else s + bias.float()


def topk_ref(key, k):
    """k rounds of argmax (first index of the max, as the kernel breaks ties) with the winner masked out."""
    key = key.clone()
    picks = []
    for _ in range(k):
        e = key.argmax(-1)  # (N,)
        picks.append(e)
        key.scatter_(1, e[:, None], float("-inf"))
    return torch.stack(picks, 1) if picks else key.new_zeros(key.shape[0], 0, dtype=torch.long)  # (N, k)


def route_ref(logits, k, score="softmax", bias=None, capacity=None):
    """Pure-PyTorch routing (the spec): top-k, then a stable sort of the slot-major assignments by expert."""
    _check_route(logits, k, score, bias, capacity)
    N, E = logits.shape
    idx = topk_ref(select_key(logits, score, bias), k)  # (N, k)
    e_flat = idx.t().reshape(-1)  # (k*N,) slot-major: a = j * N + t
    order = torch.argsort(e_flat, stable=True)  # sorted position -> assignment
    counts = torch.bincount(e_flat, minlength=E)  # (E,)
    start = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(e_flat)
    rank[order] = torch.arange(k * N, device=logits.device) - start[e_flat[order]]  # rank within its expert
    cap = NO_CAPACITY if capacity is None else capacity
    kept = counts.clamp(max=cap)
    offsets = torch.zeros(E + 1, dtype=torch.long, device=logits.device)
    offsets[1:] = torch.cumsum(kept, 0)
    dest = torch.where(rank < cap, offsets[e_flat] + rank, -1)
    return Routing(idx, dest.view(k, N).t().to(torch.int32).contiguous(), counts.to(torch.int32),
                   offsets.to(torch.int32), sorted_rows(N, k, E, capacity))


def permute_ref(x, dest, rows):
    """xs (rows, C): xs[dest[t, j]] = x[t]; rows no assignment lands on are zero."""
    N, k = dest.shape
    xs = x.new_zeros(rows, x.shape[1])
    keep = dest >= 0
    tok = torch.arange(N, device=x.device)[:, None].expand(N, k)
    xs[dest[keep].long()] = x[tok[keep]]
    return xs


def unpermute_ref(ys, dest, weights=None):
    """y (N, C) = sum_j weights[t, j] * ys[dest[t, j]] over kept assignments, summed in fp32, in ys's dtype."""
    N, k = dest.shape
    keep = dest >= 0
    # zeroed, not weighted by 0: a row no assignment owns may hold anything (NaN * 0 is NaN, in the grads too)
    rows = torch.where(keep[:, :, None], ys[dest.clamp(min=0).long()].float(), 0.0)  # (N, k, C)
    w = keep.float() if weights is None else torch.where(keep, weights.float(), 0.0)
    return (rows * w[:, :, None]).sum(1).to(ys.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels: routing


@triton.jit
def _route_topk_kernel(LOGITS, BIAS, IDX, RANK, UNIT_COUNTS, N, E, stride_l, n_blocks,
                       K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pass 1 over a block of tokens: top-k, per-slot rank within the block's same-expert assignments, counts."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < N
    cmask = cols < E
    z = tl.load(LOGITS + rows[:, None].to(tl.int64) * stride_l + cols[None, :],
                mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    if SIGMOID:
        key = tl.sigmoid(z)
    elif HAS_BIAS:  # the bias shifts probabilities, so softmax them first
        z = tl.where(cmask[None, :], z, float("-inf"))
        p = tl.exp(z - tl.max(z, 1)[:, None])
        key = p / tl.sum(p, 1)[:, None]
    else:  # softmax is monotone: rank the logits
        key = z
    if HAS_BIAS:
        key += tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    key = tl.where(cmask[None, :], key, float("-inf"))
    for j in tl.static_range(K):
        best = tl.max(key, 1)
        e = tl.min(tl.where(key == best[:, None], cols[None, :], BLOCK_E), 1)  # lowest id among equal keys
        e = tl.minimum(e, E - 1)  # NaN logits: no key equals the max; stay in bounds
        hit = cols[None, :] == e[:, None]
        key = tl.where(hit, float("-inf"), key)
        onehot = (hit & rmask[:, None]).to(tl.int32)  # (BLOCK_N, BLOCK_E)
        rank = tl.sum(tl.cumsum(onehot, 0) * onehot, 1) - 1  # earlier same-expert tokens of this block and slot
        tl.store(IDX + rows * K + j, e.to(tl.int64), mask=rmask)
        tl.store(RANK + rows * K + j, rank, mask=rmask)
        tl.store(UNIT_COUNTS + (j * n_blocks + pid) * E + cols, tl.sum(onehot, 0), mask=cmask)


@triton.jit
def _route_offsets_kernel(UNIT_COUNTS, UNIT_BASE, COUNTS, OFFSETS, U, E, capacity,
                          BLOCK_U: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pass 2 (one program): exclusive scan of the (U, E) unit counts down the units (slot-major order), then the
    totals, the kept counts min(total, capacity) and their exclusive scan over experts (the group offsets)."""
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    running = tl.zeros([BLOCK_E], dtype=tl.int32)
    for u0 in range(0, U, BLOCK_U):
        units = u0 + tl.arange(0, BLOCK_U)
        mask = (units < U)[:, None] & cmask[None, :]
        offs = units[:, None] * E + cols[None, :]
        c = tl.load(UNIT_COUNTS + offs, mask=mask, other=0)
        tl.store(UNIT_BASE + offs, running[None, :] + tl.cumsum(c, 0) - c, mask=mask)
        running += tl.sum(c, 0)
    tl.store(COUNTS + cols, running, mask=cmask)
    kept = tl.minimum(running, capacity)
    tl.store(OFFSETS + cols, tl.cumsum(kept, 0) - kept, mask=cmask)
    tl.store(OFFSETS + E, tl.sum(kept, 0))


@triton.jit
def _route_dest_kernel(IDX, RANK, UNIT_BASE, OFFSETS, DEST, N, E, n_blocks, capacity,
                       K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pass 3 over the same token blocks: rank within the expert = the unit's base + the rank within the unit."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    for j in tl.static_range(K):
        e = tl.load(IDX + rows * K + j, mask=rmask, other=0).to(tl.int32)
        rank = tl.load(RANK + rows * K + j, mask=rmask, other=0)
        rank += tl.load(UNIT_BASE + (j * n_blocks + pid) * E + e, mask=rmask, other=0)
        start = tl.load(OFFSETS + e, mask=rmask, other=0)
        tl.store(DEST + rows * K + j, tl.where(rank < capacity, start + rank, -1), mask=rmask)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels: permute / unpermute (memory bound; tiles of BLOCK_T tokens x BLOCK_C columns)


def _move_configs():
    if _INTERPRET:  # several tokens and column chunks per program, partial tiles at the odd test shapes
        return [triton.Config({"BLOCK_T": 8, "BLOCK_C": 16}, num_warps=4)]
    return [triton.Config({"BLOCK_T": t, "BLOCK_C": c}, num_warps=w)
            for t, c, w in ((4, 1024, 4), (8, 1024, 8), (16, 512, 8), (16, 1024, 8), (32, 256, 4), (32, 512, 8))]


def _move_prune(configs, named_args, **kwargs):
    """Column chunks no wider than the row (rounded up to a power of 2), at least the narrowest one."""
    C = named_args["C"]
    keep = [c for c in configs if c.kwargs["BLOCK_C"] <= max(next_pow2(C), 256)]
    return keep or configs


_MOVE_TUNE = dict(configs=_move_configs(), key=["C", "K"], prune_configs_by={"early_config_prune": _move_prune})


@triton.autotune(**_MOVE_TUNE)
@triton.jit
def _permute_fwd_kernel(X, DEST, XS, N, C, stride_x, stride_xs,
                        K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """xs[dest[t, j]] = x[t]: each x tile is read once and written to its k rows."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < N
    ks = tl.arange(0, BLOCK_K)
    dest = tl.load(DEST + toks[:, None] * K + ks[None, :], mask=tmask[:, None] & (ks < K)[None, :], other=-1)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < C
        x = tl.load(X + toks[:, None].to(tl.int64) * stride_x + cols[None, :], mask=tmask[:, None] & cmask[None, :])
        for j in tl.static_range(K):
            d = tl.sum(tl.where(ks[None, :] == j, dest, 0), 1)  # (BLOCK_T,) column j of the dest tile
            tl.store(XS + d[:, None].to(tl.int64) * stride_xs + cols[None, :], x,
                     mask=(d >= 0)[:, None] & cmask[None, :])


@triton.autotune(**_MOVE_TUNE)
@triton.jit
def _unpermute_fwd_kernel(YS, DEST, W, Y, N, C, stride_ys, stride_y,
                          WEIGHTED: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """y[t] = sum_j w[t, j] * ys[dest[t, j]] in fp32, slots in order (WEIGHTED=False: w = 1, the permute bwd)."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < N
    ks = tl.arange(0, BLOCK_K)
    kmask = tmask[:, None] & (ks < K)[None, :]
    dest = tl.load(DEST + toks[:, None] * K + ks[None, :], mask=kmask, other=-1)
    if WEIGHTED:
        w = tl.load(W + toks[:, None] * K + ks[None, :], mask=kmask, other=0.0).to(tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < C
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):
            d = tl.sum(tl.where(ks[None, :] == j, dest, 0), 1)
            row = tl.load(YS + d[:, None].to(tl.int64) * stride_ys + cols[None, :],
                          mask=(d >= 0)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            if WEIGHTED:
                row *= tl.sum(tl.where(ks[None, :] == j, w, 0.0), 1)[:, None]
            acc += row
        tl.store(Y + toks[:, None].to(tl.int64) * stride_y + cols[None, :], acc.to(Y.dtype.element_ty),
                 mask=tmask[:, None] & cmask[None, :])


@triton.autotune(**_MOVE_TUNE)
@triton.jit
def _unpermute_bwd_kernel(DY, YS, DEST, W, DYS, DW, N, C, stride_dy, stride_ys, stride_dys,
                          K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """dys[dest[t, j]] = w[t, j] * dy[t]; dw[t, j] = <dy[t], ys[dest[t, j]]> (0 where dropped)."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < N
    ks = tl.arange(0, BLOCK_K)
    kmask = tmask[:, None] & (ks < K)[None, :]
    dest = tl.load(DEST + toks[:, None] * K + ks[None, :], mask=kmask, other=-1)
    w = tl.load(W + toks[:, None] * K + ks[None, :], mask=kmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < C
        dy = tl.load(DY + toks[:, None].to(tl.int64) * stride_dy + cols[None, :],
                     mask=tmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            sel = ks[None, :] == j
            d = tl.sum(tl.where(sel, dest, 0), 1)
            mask = (d >= 0)[:, None] & cmask[None, :]
            row = tl.load(YS + d[:, None].to(tl.int64) * stride_ys + cols[None, :], mask=mask, other=0.0)
            dw += tl.where(sel, tl.sum(dy * row.to(tl.float32), 1)[:, None], 0.0)
            wj = tl.sum(tl.where(sel, w, 0.0), 1)
            tl.store(DYS + d[:, None].to(tl.int64) * stride_dys + cols[None, :],
                     (dy * wj[:, None]).to(DYS.dtype.element_ty), mask=mask)
    tl.store(DW + toks[:, None] * K + ks[None, :], dw.to(DW.dtype.element_ty), mask=kmask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers (kernels/launch.py: after the first call per specialization, the compiled binaries launch directly)

_topk, _offsets, _dest = fast(_route_topk_kernel), fast(_route_offsets_kernel), fast(_route_dest_kernel)
_permute, _unpermute = fast(_permute_fwd_kernel), fast(_unpermute_fwd_kernel)
_unpermute_bwd = fast(_unpermute_bwd_kernel)


def _route_block(E):
    """Tokens per routing block: a (BLOCK_N, E) tile of ~8k elements (fewer units for the scan), 8 in the
    interpreter (several blocks and units at the test sizes)."""
    return 8 if _INTERPRET else max(16, min(1024, 8192 // next_pow2(E)))


def route_triton(logits, k, score="softmax", bias=None, capacity=None):
    """The Triton path of `route` on any device (CPU tensors need TRITON_INTERPRET=1)."""
    _check_route(logits, k, score, bias, capacity)
    N, E = logits.shape
    dev = logits.device
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_n, block_e = _route_block(E), next_pow2(E)
    n_blocks = cdiv(N, block_n)
    cap = NO_CAPACITY if capacity is None else capacity
    idx = torch.empty(N, k, dtype=torch.int64, device=dev)
    rank = torch.empty(N, k, dtype=torch.int32, device=dev)
    dest = torch.empty(N, k, dtype=torch.int32, device=dev)
    unit_counts = torch.empty(k * n_blocks, E, dtype=torch.int32, device=dev)
    unit_base = torch.empty_like(unit_counts)
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=dev)
    if N > 0:
        _topk[(n_blocks,)](logits, bias, idx, rank, unit_counts, N, E, logits.stride(0), n_blocks,
                           K=k, SIGMOID=score == "sigmoid", HAS_BIAS=bias is not None,
                           BLOCK_N=block_n, BLOCK_E=block_e, num_warps=4)
    _offsets[(1,)](unit_counts, unit_base, counts, offsets, k * n_blocks, E, cap,
                   BLOCK_U=8 if _INTERPRET else max(1, 4096 // block_e), BLOCK_E=block_e, num_warps=4)
    if N > 0:
        _dest[(n_blocks,)](idx, rank, unit_base, offsets, dest, N, E, n_blocks, cap, K=k, BLOCK_N=block_n,
                           num_warps=4)
    return Routing(idx, dest, counts, offsets, sorted_rows(N, k, E, capacity))


def _rows2d(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_dest(dest, N):
    if dest.dim() != 2 or dest.shape[0] != N or dest.dtype != torch.int32:
        raise ValueError(f"dest must be int32 (N={N}, k), got {dest.dtype} {tuple(dest.shape)}")


def _grid(N):
    return lambda meta: (cdiv(N, meta["BLOCK_T"]),)


def permute_fwd(x, dest, rows):
    """xs (rows, C) with xs[dest[t, j]] = x[t]; rows no kept assignment lands on are left unwritten."""
    x = _rows2d(x)
    N, C = x.shape
    _check_dest(dest, N)
    xs = x.new_empty(rows, C)
    k = dest.shape[1]
    if N > 0 and C > 0:
        _permute[_grid(N)](x, dest.contiguous(), xs, N, C, x.stride(0), xs.stride(0),
                           K=k, BLOCK_K=next_pow2(k))
    return xs


def unpermute_fwd(ys, dest, weights=None):
    """y (N, C) = sum_j weights[t, j] * ys[dest[t, j]] (weights None: 1), summed in fp32, in ys's dtype."""
    ys = _rows2d(ys)
    N, k = dest.shape
    _check_dest(dest, N)
    C = ys.shape[1]
    y = ys.new_empty(N, C)
    if N > 0 and C > 0:
        _unpermute[_grid(N)](ys, dest.contiguous(), None if weights is None else weights.contiguous(), y, N, C,
                             ys.stride(0), y.stride(0), WEIGHTED=weights is not None,
                             K=k, BLOCK_K=next_pow2(k))
    return y


def unpermute_bwd(dy, ys, dest, weights):
    """(dys, dweights): dys[dest[t, j]] = weights[t, j] * dy[t] (other rows unwritten), dweights[t, j] =
    <dy[t], ys[dest[t, j]]> (0 where dropped) in weights' dtype."""
    dy, ys = _rows2d(dy), _rows2d(ys)
    N, k = dest.shape
    C = ys.shape[1]
    dys = torch.empty_like(ys)
    dw = torch.empty(N, k, dtype=weights.dtype, device=ys.device)
    if N > 0:
        if C == 0:
            dw.zero_()
        else:
            _unpermute_bwd[_grid(N)](dy, ys, dest.contiguous(), weights.contiguous(), dys, dw, N, C,
                                     dy.stride(0), ys.stride(0), dys.stride(0),
                                     K=k, BLOCK_K=next_pow2(k))
    return dys, dw


# ---------------------------------------------------------------------------------------------------------------
# Autograd


class PermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dest, rows):
        ctx.save_for_backward(dest)
        return permute_fwd(x, dest, rows)

    @staticmethod
    def backward(ctx, dxs):
        (dest,) = ctx.saved_tensors
        return unpermute_fwd(dxs, dest), None, None


class UnpermuteFunction(torch.autograd.Function):
    """weights None: an unweighted gather (y[t] = ys[dest[t, 0]] for k = 1, 0 where dropped), whose backward is the
    permute's forward (nanopara/ep.py moves received rows with it)."""

    @staticmethod
    def forward(ctx, ys, dest, weights):
        if weights is None:
            ctx.save_for_backward(dest)
            ctx.rows = ys.shape[0]
        else:
            ctx.save_for_backward(ys, dest, weights)
        return unpermute_fwd(ys, dest, weights)

    @staticmethod
    def backward(ctx, dy):
        if len(ctx.saved_tensors) == 1:
            (dest,) = ctx.saved_tensors
            return permute_fwd(dy, dest, ctx.rows), None, None
        ys, dest, weights = ctx.saved_tensors
        dys, dw = unpermute_bwd(dy, ys, dest, weights)
        return dys, None, dw


def route(logits, k, score="softmax", bias=None, capacity=None):
    """Top-k routing and the expert-sorted permutation (see the module docstring); no autograd (indices only).
    Triton on CUDA, the reference elsewhere."""
    return (route_triton if logits.is_cuda else route_ref)(logits, k, score, bias, capacity)


def permute_triton(x, dest, rows):
    return PermuteFunction.apply(x, dest, rows)


def unpermute_triton(ys, dest, weights):
    return UnpermuteFunction.apply(ys, dest, weights)


def permute(x, dest, rows):
    """x (N, C) -> xs (rows, C) in expert-sorted order, with autograd. Triton on CUDA, the reference elsewhere."""
    return permute_triton(x, dest, rows) if x.is_cuda else permute_ref(x, dest, rows)


def unpermute(ys, dest, weights):
    """Weighted sum of each token's k expert rows -> (N, C), with autograd (ys and weights). Triton on CUDA, the
    reference elsewhere."""
    return unpermute_triton(ys, dest, weights) if ys.is_cuda else unpermute_ref(ys, dest, weights)


# ---------------------------------------------------------------------------------------------------------------
# Parity + benchmark: python -m kernels.moe_route [--out FILE]


def _copy_bandwidth():
    src = torch.empty(256 * 2**20, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * 4 / ms / 1e6


def _median_ms(fn):
    return triton.testing.do_bench(fn, return_mode="median")


def bench_moves(N, C, E, k, dtype=torch.bfloat16, copy_gbs=None, device="cuda", timer=_median_ms):
    """Rows (op, impl, ms, GB/s, % of copy) of route, permute and unpermute fwd / bwd at N tokens of width C, ours
    against PyTorch's index ops on the same sorted order. GB/s counts the bytes that must move: x once and its k
    copies (permute, unpermute fwd and the permute bwd), plus one more k rows read for the unpermute bwd."""
    torch.manual_seed(0)
    logits = torch.randn(N, E, device=device)
    r = route_triton(logits, k)
    x = torch.randn(N, C, device=device, dtype=dtype)
    ys = torch.randn(r.rows, C, device=device, dtype=dtype)
    w = torch.rand(N, k, device=device)
    dy = torch.randn(N, C, device=device, dtype=dtype)
    es = x.element_size()
    moved = N * C * es * (1 + k)
    order = torch.argsort(r.idx.t().reshape(-1), stable=True)  # sorted row -> slot-major assignment
    tok = torch.arange(N, device=device).repeat(k)[order]  # sorted row -> token
    w_sorted = w.t().reshape(-1)[order].to(dtype)[:, None]
    cases = {
        ("route", "triton"): (lambda: route_triton(logits, k), N * E * 4),
        ("route", "torch"): (lambda: route_ref(logits, k), N * E * 4),
        ("permute", "triton"): (lambda: permute_fwd(x, r.dest, r.rows), moved),
        ("permute", "torch"): (lambda: x.index_select(0, tok), moved),
        ("unpermute", "triton"): (lambda: unpermute_fwd(ys, r.dest, w), moved),
        ("unpermute", "torch"): (lambda: torch.zeros_like(x).index_add_(0, tok, ys * w_sorted), moved),
        ("permute_bwd", "triton"): (lambda: unpermute_fwd(ys, r.dest), moved),
        ("permute_bwd", "torch"): (lambda: torch.zeros_like(x).index_add_(0, tok, ys), moved),
        ("unpermute_bwd", "triton"): (lambda: unpermute_bwd(dy, ys, r.dest, w), N * C * es * (1 + 2 * k)),
        ("unpermute_bwd", "torch"): (lambda: (dy.index_select(0, tok) * w_sorted,
                                              (dy.index_select(0, tok) * ys).float().sum(-1)),
                                     N * C * es * (1 + 2 * k)),
    }
    rows = []
    for (op, impl), (fn, nbytes) in cases.items():
        ms = timer(fn)
        gbs = nbytes / ms / 1e6
        rows.append(dict(op=op, impl=impl, N=N, C=C, E=E, k=k, ms=ms, gbs=gbs,
                         pct_copy=100 * gbs / copy_gbs if copy_gbs else float("nan")))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="append JSON lines here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA GPU (tests run the kernels on CPU: pytest tests/test_moe.py)")
    torch.manual_seed(0)
    for N, E, k, cap in ((4099, 8, 2, None), (4099, 64, 8, None), (4099, 8, 2, 700)):
        logits = torch.randn(N, E, device="cuda")
        a, b = route_triton(logits, k, capacity=cap), route_ref(logits, k, capacity=cap)
        same = all(torch.equal(u, v) for u, v in zip(a[:4], b[:4]))
        print(f"parity route N={N} E={E} k={k} capacity={cap}: {'identical' if same else 'MISMATCH'}")
    copy_gbs = _copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: measured D2D copy bandwidth {copy_gbs:.0f} GB/s")
    out = open(args.out, "a") if args.out else None
    print(f"{'op':>14} {'impl':>7} {'N':>6} {'C':>5} {'ms':>8} {'GB/s':>6} {'%copy':>6}")
    for N, C, E, k in ((16384, 768, 8, 2), (32768, 768, 8, 2), (32768, 2048, 64, 8)):
        for r in bench_moves(N, C, E, k, copy_gbs=copy_gbs):
            print(f"{r['op']:>14} {r['impl']:>7} {N:>6} {C:>5} {r['ms']:8.4f} {r['gbs']:6.0f} {r['pct_copy']:5.0f}%")
            if out:
                out.write(json.dumps(dict(r, device=torch.cuda.get_device_name(), copy_gbs=copy_gbs)) + "\n")
    if out:
        out.close()


if __name__ == "__main__":
    main()
