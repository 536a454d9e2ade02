"""LayerNorm (and residual-add + LayerNorm) as fused Triton kernels.
Long file: forward, backward and the dw/db reduction with their per-width tuning (CUDA-graph timing) and benchmark.

Math, per row x of width C (statistics always in fp32):
    mean = sum(x) / C,   rstd = 1 / sqrt(sum((x - mean)^2) / C + eps),   xhat = (x - mean) * rstd,   y = xhat * w + b
Backward, with g = dy * w:   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),   dw = sum(dy * xhat),  db = sum(dy)
`add_layernorm(x, residual, w, b)` returns (y, h), h = x + residual in the dtype PyTorch's add gives (bf16 + fp32 ->
fp32: an fp32 stream is never truncated) and y = LN(h); its backward adds the grad flowing into h to dx, and x and
residual get that gradient, each in its own dtype.

Shapes: x (..., C), any leading dims (M rows), weight (C,), bias (C,) or None; y in x's dtype (or `out_dtype`);
weight/bias may have another dtype (fp32 params under bf16 autocast) and get their grads in it.

Kernels (memory bound: what counts is bytes in flight per SM):
  forward  walks tiles of BLOCK_M rows (whole rows in registers, C <= 16384) in a `tl.range(num_stages=)` loop, so
           the next tiles load by cp.async while this one reduces; one program per tile, or persistent (a few per
           SM, weight/bias loaded once); stores y (and h) and fp32 mean/rstd (M,).
  backward one program per group of rows, pipelined the same way: dx in one pass, dw/db summed in registers into a
           (n_groups, C) fp32 partial row per group, reduced by a second small kernel. Tiles: kernels/tuning.py.

Callers: nanopara/model.py (ln_1, ln_2 through add_layernorm, ln_f): Triton on CUDA, the reference on CPU;
`*_triton` force Triton (tests/test_layernorm.py, TRITON_INTERPRET=1 on CPU).
Run: `python -m kernels.layernorm [--quick] [--out FILE]`: parity, then ms, GB/s and % of the measured copy
bandwidth against eager F.layer_norm and torch.compile. Tile sweeps: bench/sweep_layernorm.py.
"""
import argparse
import functools
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.launch import cdiv, fast, next_pow2

MAX_C = 16384  # whole row lives in registers (16384: the backward spills a little)


def layernorm_ref(x, weight, bias, eps=1e-5):
    """Pure-PyTorch LayerNorm over the last dim with fp32 statistics; output in x's dtype."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps) * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def add_layernorm_ref(x, residual, weight, bias, eps=1e-5):
    """h = x + residual (PyTorch's type promotion), y = LayerNorm(h) in h's dtype. Returns (y, h)."""
    h = x + residual
    return layernorm_ref(h, weight, bias, eps), h


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels


# ---------------------------------------------------------------------------------------------------------------
# Tiles. Both kernels are memory bound: what matters is bytes in flight per SM, all the time. A program that loads
# a row, reduces it, then stores it has nothing in flight while it reduces; at 4096 x 8192 (2 resident programs per
# SM) that held the forward to 57% of copy bandwidth. So both kernels loop over row tiles with `tl.range(...,
# num_stages=STAGES)`: Triton's pipeliner turns the tile loads into cp.async copies into shared memory, STAGES - 1
# tiles ahead, which overlap the reductions of the tile in registers. The forward is persistent (a few programs per
# SM walk the tiles with a grid stride; weight and bias are loaded once per program, not once per tile); the
# backward already walks a group of rows per program. The best (BLOCK_M rows per tile, num_warps, STAGES, programs
# per SM) depends on the width, the dtypes (fp32 residual stream vs bf16) and the chip, so it is autotuned on first
# use per (C, flags) among tiles of 16..32 (forward) / 16..64 (backward) row elements per thread that fit in
# shared memory. PROGRAMS_PER_SM = 0 is the non-persistent forward: one program per tile (best for narrow rows, where a
# tile is small and many programs per SM already keep enough bytes in flight). The interpreter runs one tile size.

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# row elements a thread holds, min and max: every tile that won a shape in bench/sweep_layernorm.py (H200, 768 to
# 16384 wide, bf16 and fp32 streams) held 16..32 (forward) / 16..64 (backward); the backward's reductions amortise
# over more rows per thread (e.g. 8 rows x 4 warps at 16384x768)
_PER_THREAD = {"fwd": (16, 32), "bwd": (16, 64)}
# forward (STAGES, PROGRAMS_PER_SM): the combinations that won at least one shape of that sweep
_FWD_WALKS = ((1, 0), (3, 2), (4, 1), (2, 2), (3, 1))
SMEM_BYTES = 200 * 1024  # shared memory per SM the pipelined tiles may take (H100/H200: 227 KB per block)
BWD_GROUPS_PER_SM = 2  # backward row groups per SM: 2 measured best with the wide tiles (30.3 vs 33.0 us at 16384x768)


def _bwd_groups_per_sm(C):
    """Backward row groups per SM. Rows >= 8192 wide: one. Each group writes and the second kernel reads a (C,)
    fp32 row of dw (and db) partials, n_groups x C x 8 bytes against the M x C x 6 bytes of the backward itself; at
    4096 x 8192 two groups per SM made that 9% more traffic: 67.6 us vs 60.1 us at one (H200, bench/sweep_layernorm.py
    --groups)."""
    return 1 if C >= 8192 else BWD_GROUPS_PER_SM
# rows per group rounded up to a multiple of the largest BLOCK_M (groups split into whole tiles) once a group has
# 4 such tiles or more; fewer rows are not rounded, so a small M still spreads over every SM
BWD_GROUP_ALIGN = 8


def _configs(kind):
    if _INTERPRET:  # several programs per "SM" (one here), so the grid stride and partial tiles are exercised
        return [triton.Config({"BLOCK_M": 4, "STAGES": 2, **({"PROGRAMS_PER_SM": 2} if kind == "fwd" else {})},
                              num_warps=4)]
    tiles = [(m, w) for m in (1, 2, 4, 8) for w in (2, 4, 8, 16, 32)]
    if kind == "fwd":
        return [triton.Config({"BLOCK_M": m, "STAGES": s, "PROGRAMS_PER_SM": p}, num_warps=w)
                for m, w in tiles for s, p in _FWD_WALKS]
    return [triton.Config({"BLOCK_M": m, "STAGES": s}, num_warps=w) for m, w in tiles for s in (1, 2, 3)]


def _tune_bench(fn, quantiles=None):
    """The autotuner's timing: CUDA-graph replay. These kernels run 10-100 us, about a Python launch or less, so
    timing launches back to back (triton's default) measures the host too: at 16384x768 the forward's candidates
    took 21-23 us that way, 18.4-18.8 us replayed."""
    return triton.testing.do_bench_cudagraph(fn, rep=10, quantiles=quantiles)


# No `cache_results` (Triton's disk cache of autotune picks): kernels/tuning.py's store keeps the picks per GPU name
# (Triton's is per arch, so an H100's picks served an H200) and keeps them when the Triton cache is cleared.


def _stream_bytes(kind, named_args):
    """Bytes of one row element that the pipelined loop loads: x (+ residual) forward; x, dy (+ dh) backward."""
    names = ("X", "R") if kind == "fwd" else ("X", "DY", "DH")
    return sum(named_args[n].element_size() for n in names if named_args.get(n) is not None)


def _pruner(kind):
    lo, hi = _PER_THREAD[kind]

    def prune(configs, named_args, **kwargs):
        if _INTERPRET:
            return configs
        block_c = kwargs["BLOCK_C"]
        row_bytes = block_c * _stream_bytes(kind, named_args)

        def fits(c):
            m, w, s = c.kwargs["BLOCK_M"], c.num_warps, c.kwargs["STAGES"]
            per_sm = c.kwargs.get("PROGRAMS_PER_SM", _bwd_groups_per_sm(named_args["C"])) or 1
            return (lo <= m * block_c // (32 * w) <= hi and m * block_c <= MAX_C and per_sm * w <= 64
                    and per_sm * (s - 1) * m * row_bytes <= SMEM_BYTES)
        # rows narrower than 128 fit no tile in range: one row a program, not pipelined, the fewest warps
        return [c for c in configs if fits(c)] or [min((c for c in configs if c.kwargs["BLOCK_M"] == 1 and
                                                        c.kwargs["STAGES"] == 1), key=lambda c: c.num_warps)]
    return {"early_config_prune": prune}


@triton.jit
def _layernorm_fwd_tile(tile, X, R, H, Y, W, B, w, b, MEAN, RSTD, M, C, stride_x, stride_r, stride_h, stride_y, eps,
                        ADD_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, LOAD_WB: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Normalise rows [tile * BLOCK_M, +BLOCK_M). LOAD_WB: load weight/bias here, after the row statistics (so they
    hold no registers during the reductions), instead of using the w, b the caller loaded."""
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # M * C may exceed 2**31
    rmask = rows < M
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        # round the sum to h's dtype first: h is what the residual stream holds, and the backward
        # recomputes xhat from that stored h, so the forward must normalise exactly it
        x = (x.to(tl.float32) + r.to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + rows[:, None] * stride_h + cols[None, :], x, mask=mask)
    x = x.to(tl.float32)
    mean = tl.sum(x, axis=1) / C  # (BLOCK_M,)
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / C + eps)
    if LOAD_WB:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += b[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=rmask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.autotune(configs=_configs("fwd"), key=["C", "ADD_RESIDUAL", "HAS_BIAS"], prune_configs_by=_pruner("fwd"),
                 do_bench=_tune_bench)
@triton.jit
def _layernorm_fwd_kernel(X, R, H, Y, W, B, MEAN, RSTD, M, C, stride_x, stride_r, stride_h, stride_y, eps,
                          ADD_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr,
                          PROGRAMS_PER_SM: tl.constexpr):  # PROGRAMS_PER_SM sizes the grid; 0: one tile a program
    if PROGRAMS_PER_SM == 0:  # no loop: a loop around the same tile costs registers (ptxas: 96 vs 80 per thread
        _layernorm_fwd_tile(tl.program_id(0), X, R, H, Y, W, B, 0.0, 0.0, MEAN, RSTD, M, C,  # at 2 x 1024, 2 warps)
                            stride_x, stride_r, stride_h, stride_y, eps, ADD_RESIDUAL, HAS_BIAS, True, BLOCK_M, BLOCK_C)
    else:  # persistent: weight and bias once per program; the next tiles' loads in flight while one reduces
        cols = tl.arange(0, BLOCK_C)
        w = tl.load(W + cols, mask=cols < C, other=0.0).to(tl.float32)
        b = w
        if HAS_BIAS:
            b = tl.load(B + cols, mask=cols < C, other=0.0).to(tl.float32)
        for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0), num_stages=STAGES):
            _layernorm_fwd_tile(tile, X, R, H, Y, W, B, w, b, MEAN, RSTD, M, C, stride_x, stride_r, stride_h,
                                stride_y, eps, ADD_RESIDUAL, HAS_BIAS, False, BLOCK_M, BLOCK_C)


@triton.autotune(configs=_configs("bwd"), key=["C", "HAS_DH", "HAS_BIAS"], prune_configs_by=_pruner("bwd"),
                 do_bench=_tune_bench)
@triton.jit
def _layernorm_bwd_kernel(X, DY, DH, DX, W, MEAN, RSTD, DW_PART, DB_PART, M, C, ROWS_PER_GROUP,
                          stride_x, stride_dy, stride_dh, stride_dx,
                          HAS_DH: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr):
    group = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    # running column sums of this group's rows (a tile's rows sit in the same threads, so the per-tile sum over
    # axis 0 below costs no communication)
    dw_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    row_start = group * ROWS_PER_GROUP
    row_end = tl.minimum(row_start + ROWS_PER_GROUP, M)
    # once per program: inside the pipelined loop it would be copied to shared memory on every tile
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    for r0 in tl.range(row_start, row_end, BLOCK_M, num_stages=STAGES):
        rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)  # M * C may exceed 2**31
        rmask = rows < row_end
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        c1 = tl.sum(g * xhat, axis=1) / C  # mean(g * xhat), (BLOCK_M,)
        c2 = tl.sum(g, axis=1) / C  # mean(g)
        dx = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
        if HAS_DH:  # add_layernorm: h also flows onward as the residual stream
            dx += tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db_acc += tl.sum(dy, axis=0)
    tl.store(DW_PART + group * C + cols, dw_acc, mask=cmask)
    if HAS_BIAS:
        tl.store(DB_PART + group * C + cols, db_acc, mask=cmask)


@triton.jit
def _layernorm_dwdb_kernel(DW_PART, DB_PART, DW, DB, n_groups, C, HAS_BIAS: tl.constexpr,
                           BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr):
    """Second stage: column sums of the (n_groups, C) partials, written in the weight's dtype (one launch for dw
    and db instead of a torch sum plus a cast per tensor)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    dw = tl.zeros([BLOCK_C], dtype=tl.float32)
    db = tl.zeros([BLOCK_C], dtype=tl.float32)
    for g0 in range(0, n_groups, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        mask = (g < n_groups)[:, None] & cmask[None, :]
        offs = g[:, None] * C + cols[None, :]
        dw += tl.sum(tl.load(DW_PART + offs, mask=mask, other=0.0), axis=0)
        if HAS_BIAS:
            db += tl.sum(tl.load(DB_PART + offs, mask=mask, other=0.0), axis=0)
    tl.store(DW + cols, dw.to(DW.dtype.element_ty), mask=cmask)
    if HAS_BIAS:
        tl.store(DB + cols, db.to(DB.dtype.element_ty), mask=cmask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers (kernels/launch.py: after the first call per specialization, the compiled binaries launch directly)

_fwd, _bwd, _dwdb = fast(_layernorm_fwd_kernel), fast(_layernorm_bwd_kernel), fast(_layernorm_dwdb_kernel)


def _rows(t, C):
    """View t as (M, C) rows with unit column stride (copies only if the last dim is strided)."""
    t2 = t.reshape(-1, C)  # (M, C)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _check(x, weight, bias):
    C = x.shape[-1]
    if weight.shape != (C,) or (bias is not None and bias.shape != (C,)):
        raise ValueError(f"layernorm: weight/bias must have shape ({C},), got {tuple(weight.shape)}"
                         f"{'' if bias is None else ' / ' + str(tuple(bias.shape))}")
    if C > MAX_C:
        raise ValueError(f"layernorm: rows of width {C} > {MAX_C} are not supported by the Triton kernel")
    if weight.device != x.device:
        raise ValueError(f"layernorm: x on {x.device} but weight on {weight.device}")


@functools.lru_cache(maxsize=None)
def _sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _fwd_grid(M, sms, meta):
    """One program per tile, or (persistent) PROGRAMS_PER_SM programs per SM walking the tiles."""
    tiles = cdiv(M, meta["BLOCK_M"])
    return (tiles if meta["PROGRAMS_PER_SM"] == 0 else min(tiles, meta["PROGRAMS_PER_SM"] * sms),)


def layernorm_fwd(x, weight, bias, eps, residual=None, out_dtype=None):
    """Returns (y, h, mean, rstd) with y, h of x's shape (h is None without residual), mean/rstd fp32 (M,).
    h is in x + residual's promoted dtype; y in out_dtype if given (e.g. bf16 for a matmul under autocast: the
    same rounding autocast would do, without a separate cast pass), else in x's (or h's) dtype."""
    _check(x, weight, bias)
    C = x.shape[-1]
    x2 = _rows(x, C)  # (M, C)
    M = x2.shape[0]
    h_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    y = torch.empty((M, C), dtype=out_dtype or h_dtype, device=x.device)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    h = r2 = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"add_layernorm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        r2 = _rows(residual, C)
        h = torch.empty((M, C), dtype=h_dtype, device=x.device)
    if M > 0:
        _fwd[functools.partial(_fwd_grid, M, _sm_count(x.device))](
            x2, r2, h, y, weight, bias, mean, rstd, M, C, x2.stride(0),
            0 if r2 is None else r2.stride(0), 0 if h is None else h.stride(0), y.stride(0), eps,
            ADD_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK_C=next_pow2(C))
    return y.view(x.shape), (None if h is None else h.view(x.shape)), mean, rstd




def _bwd_groups(M, C, device, n_groups=None):
    """(n_groups, rows_per_group) of the backward: a few resident programs per SM (3 in the interpreter: several
    groups, uneven sizes), or n_groups if given; whole tiles per group, so only the very last tile of the last group
    is partial."""
    n_groups = n_groups or (_bwd_groups_per_sm(C) * _sm_count(device) if device.type == "cuda" else 3)
    rows_per_group = cdiv(max(M, 1), n_groups)
    if rows_per_group >= 4 * BWD_GROUP_ALIGN:
        rows_per_group = cdiv(rows_per_group, BWD_GROUP_ALIGN) * BWD_GROUP_ALIGN
    return cdiv(max(M, 1), rows_per_group), rows_per_group


def layernorm_bwd(dy, x, weight, has_bias, mean, rstd, dh=None, n_groups=None):
    """Returns (dx, dw, db): dx in x's dtype (+dh when given), dw/db in weight's dtype (db None without bias)."""
    C = x.shape[-1]
    x2, dy2 = _rows(x, C), _rows(dy, C)  # (M, C)
    dh2 = None if dh is None else _rows(dh, C)
    M = x2.shape[0]
    dx = torch.empty((M, C), dtype=x.dtype, device=x.device)
    n_groups, rows_per_group = _bwd_groups(M, C, x.device, n_groups)
    # every group writes its whole row of partials (zeros if it has no rows), so no memset is needed
    part = torch.empty((2 if has_bias else 1, n_groups, C), dtype=torch.float32, device=x.device)
    dw = torch.empty(C, dtype=weight.dtype, device=x.device)
    db = torch.empty(C, dtype=weight.dtype, device=x.device) if has_bias else None
    if M > 0:
        _bwd[(n_groups,)](
            x2, dy2, dh2, dx, weight, mean, rstd, part[0], part[-1], M, C, rows_per_group,
            x2.stride(0), dy2.stride(0), 0 if dh2 is None else dh2.stride(0), dx.stride(0),
            HAS_DH=dh is not None, HAS_BIAS=has_bias, BLOCK_C=next_pow2(C))
    else:
        part.zero_()
    # second stage over the (n_groups, C) partials (~1.6 MB for C = 768, 17 MB at 16384): latency bound, so many
    # narrow column strips with few dependent loop steps each; the fastest (columns, group rows a step, warps) of
    # bench/sweep_layernorm.py --dwdb (H200): 8 x 256 w4 up to 1024 wide (2.5 us at 256 x 768), 16-column strips
    # above; with one group per SM (<= 192 groups) 64 rows a step on one warp (2.8 vs 4.2 us at 128 x 8192)
    block_c = 8 if C <= 1024 else 16
    block_g, warps = (64, 1) if n_groups <= 192 else (256, 4)
    _dwdb[(cdiv(C, block_c),)](part[0], part[-1], dw, db, n_groups, C, HAS_BIAS=has_bias,
                                      BLOCK_G=block_g, BLOCK_C=block_c, num_warps=warps)
    return dx.view(x.shape), dw, db


# ---------------------------------------------------------------------------------------------------------------
# Autograd


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, out_dtype):
        y, _, mean, rstd = layernorm_fwd(x, weight, bias, eps, out_dtype=out_dtype)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = layernorm_bwd(dy, x, weight, ctx.has_bias, mean, rstd)
        return dx, dw, db, None, None


class AddLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, out_dtype):
        y, h, mean, rstd = layernorm_fwd(x, weight, bias, eps, residual=residual, out_dtype=out_dtype)
        ctx.save_for_backward(h, weight, mean, rstd)
        ctx.has_bias = bias is not None
        ctx.dtypes = x.dtype, residual.dtype
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = layernorm_bwd(dy, h, weight, ctx.has_bias, mean, rstd, dh=dh)
        # h = x + residual: both inputs get the same gradient (as autograd's own add does), in their dtypes
        return dx.to(ctx.dtypes[0]), dx.to(ctx.dtypes[1]), dw, db, None, None


def layernorm_triton(x, weight, bias, eps=1e-5, out_dtype=None):
    """Triton path on any device (CPU tensors need TRITON_INTERPRET=1); y in out_dtype if given."""
    return LayerNormFunction.apply(x, weight, bias, eps, out_dtype)


def add_layernorm_triton(x, residual, weight, bias, eps=1e-5, out_dtype=None):
    """Triton path of add_layernorm on any device (CPU tensors need TRITON_INTERPRET=1); y in out_dtype if given."""
    return AddLayerNormFunction.apply(x, residual, weight, bias, eps, out_dtype)


def layernorm(x, weight, bias, eps=1e-5):
    """LayerNorm over the last dim: Triton on CUDA, the PyTorch reference elsewhere."""
    return layernorm_triton(x, weight, bias, eps) if x.is_cuda else layernorm_ref(x, weight, bias, eps)


def add_layernorm(x, residual, weight, bias, eps=1e-5):
    """(y, h) = (LayerNorm(x + residual), x + residual) in one pass on CUDA; the reference elsewhere."""
    if x.is_cuda:
        return add_layernorm_triton(x, residual, weight, bias, eps)
    return add_layernorm_ref(x, residual, weight, bias, eps)


# ---------------------------------------------------------------------------------------------------------------
# Parity + benchmark: python -m kernels.layernorm [--quick] [--out FILE] (tile sweeps: bench/sweep_layernorm.py)


def _copy_bandwidth():
    """Measured device-to-device copy bandwidth in GB/s (read + write), the roofline for a memory-bound op."""
    src = torch.empty(256 * 2**20, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * 4 / ms / 1e6


def _parity(M, C, dtype):
    """Max error vs an fp32 reference for the kernel (fp32 params) and for eager F.layer_norm (bf16 params)."""
    torch.manual_seed(0)
    x = torch.randn(M, C, device="cuda", dtype=dtype)
    w = 1 + 0.1 * torch.randn(C, device="cuda")  # fp32 params, as under autocast
    b = 0.1 * torch.randn(C, device="cuda")
    dy = torch.randn(M, C, device="cuda", dtype=dtype)

    def run(fn, x, w, b):
        x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
        y = fn(x, w, b)
        return [y.float()] + [g.float() for g in torch.autograd.grad(y, (x, w, b), dy.to(y.dtype))]

    ref = run(layernorm_ref, x.float(), w, b)
    ours = run(layernorm, x, w, b)
    eager = run(lambda x, w, b: F.layer_norm(x, (C,), w.to(dtype), b.to(dtype)), x, w, b)
    fmt = lambda outs: ", ".join(f"{(a - r).abs().max().item():.2e}" for a, r in zip(outs, ref))  # noqa: E731
    print(f"parity {M}x{C} {str(dtype).split('.')[-1]}: max err vs fp32 ref (y, dx, dw, db): triton {fmt(ours)}; "
          f"eager {fmt(eager)}")


def _bench(M, C, dtype, copy_gbs, compile_ok):
    x = torch.randn(M, C, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.ones(C, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.zeros(C, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(M, C, device="cuda", dtype=dtype)
    es = x.element_size()
    fwd_bytes = 2 * M * C * es + 2 * C * es  # x, w, b in; y out
    bwd_bytes = 3 * M * C * es + 8 * M + 3 * C * es  # x, dy, w (+ mean/rstd) in; dx, dw, db out
    eager = lambda x, w, b: F.layer_norm(x, (C,), w, b)  # noqa: E731
    impls = {"triton": layernorm, "eager": eager}
    if compile_ok:
        impls["compile"] = torch.compile(eager)
    rows = []
    for name, fn in impls.items():
        t_f = triton.testing.do_bench(lambda: fn(x, w, b), return_mode="median")
        y = fn(x, w, b)  # backward alone: replay one graph
        t_b = triton.testing.do_bench(lambda: y.backward(dy, retain_graph=True), grad_to_none=[x, w, b],
                                      return_mode="median")
        del y
        t_fb = triton.testing.do_bench(lambda: fn(x, w, b).backward(dy), grad_to_none=[x, w, b],
                                       return_mode="median")
        # GPU time alone: fwd + the three input grads replayed from a CUDA graph (no Python/launch cost). `.grad`
        # accumulation is left out (torch.autograd.grad): an extra add over x's grad that is not LayerNorm's work
        # (in the model dx flows into the residual stream) and costs both impls the same ~25 us at 16384x768.
        try:
            t_g = triton.testing.do_bench_cudagraph(lambda: torch.autograd.grad(fn(x, w, b), (x, w, b), dy),
                                                    return_mode="median")
        except Exception:  # noqa: BLE001  (capture unsupported: report no number rather than fail the table)
            t_g = float("nan")
        rows.append(dict(op="layernorm", impl=name, M=M, C=C, dtype=str(dtype).split(".")[-1], fwd_bwd_graph_ms=t_g,
                         fwd_ms=t_f,
                         bwd_ms=t_b, fwd_bwd_ms=t_fb, fwd_gbs=fwd_bytes / t_f / 1e6, bwd_gbs=bwd_bytes / t_b / 1e6,
                         fwd_bwd_gbs=(fwd_bytes + bwd_bytes) / t_fb / 1e6))
    eager_ms = next(q["fwd_bwd_ms"] for q in rows if q["impl"] == "eager")
    eager_graph_ms = next(q["fwd_bwd_graph_ms"] for q in rows if q["impl"] == "eager")
    for r in rows:
        r["speedup_graph"] = eager_graph_ms / r["fwd_bwd_graph_ms"]
        for k in ("fwd", "bwd", "fwd_bwd"):
            r[f"{k}_pct_copy"] = 100 * r[f"{k}_gbs"] / copy_gbs
        r["speedup_fwd_bwd"] = eager_ms / r["fwd_bwd_ms"]
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two shapes, no torch.compile")
    p.add_argument("--out", help="append JSON lines here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA GPU "
                         "(tests run the kernels on CPU: pytest tests/test_layernorm.py)")
    dtype = torch.bfloat16
    for M, C in ((4099, 768), (1037, 1000), (512, 8192)):
        _parity(M, C, dtype)
    copy_gbs = _copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: measured D2D copy bandwidth {copy_gbs:.0f} GB/s")
    shapes = [(16384, 768), (4096, 8192)] if args.quick else \
        [(16384, 768), (16384, 1024), (16384, 1600), (8192, 4096), (4096, 8192), (2048, 16384)]
    print(f"{'shape':>12} {'impl':>8} {'fwd ms':>8} {'GB/s':>5} {'%copy':>5} {'bwd ms':>8} {'GB/s':>5} {'%copy':>5} "
          f"{'f+b ms':>8} {'GB/s':>5} {'%copy':>5} {'f+b vs eager':>12} {'graph f+b':>9} {'vs eager':>8}")
    out = open(args.out, "a") if args.out else None
    for M, C in shapes:
        for r in _bench(M, C, dtype, copy_gbs, compile_ok=not args.quick):
            cells = " ".join(f"{r[k + '_ms']:8.4f} {r[k + '_gbs']:5.0f} {r[k + '_pct_copy']:4.0f}%"
                             for k in ("fwd", "bwd", "fwd_bwd"))
            print(f"{f'{M}x{C}':>12} {r['impl']:>8} {cells} {r['speedup_fwd_bwd']:11.2f}x "
                  f"{r['fwd_bwd_graph_ms']:8.4f} {r['speedup_graph']:7.2f}x")
            if out:
                out.write(json.dumps(dict(r, device=torch.cuda.get_device_name(), copy_gbs=copy_gbs)) + "\n")
    print("GB/s counts the bytes that must move: fwd x, w, b in and y out; bwd x, dy, w, mean, rstd in and dx, dw, "
          "db out; 'graph f+b' = ms of fwd + input grads replayed from a CUDA graph (GPU time without launch overhead; "
          "no .grad accumulation); the do_bench columns include Python + launch time, which bounds small shapes")
    if out:
        out.close()


if __name__ == "__main__":
    main()
