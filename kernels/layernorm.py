"""LayerNorm (and residual-add + LayerNorm) as fused Triton kernels.

Math, per row x of width C (statistics always in fp32):
    mean = sum(x) / C,   rstd = 1 / sqrt(sum((x - mean)^2) / C + eps),   xhat = (x - mean) * rstd
    y = xhat * w + b
Backward, with g = dy * w:
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))       (means over the row)
    dw = sum_rows(dy * xhat),   db = sum_rows(dy)
`add_layernorm(x, residual, w, b)` returns (y, h) with h = x + residual (the new residual stream, in the dtype
`x + residual` has in PyTorch: bf16 + bf16 -> bf16, bf16 + fp32 -> fp32, so an fp32 stream is never truncated)
and y = LN(h) in h's dtype; its backward adds the grad flowing into h to dx, and x and residual get that same
gradient, each in its own dtype.

Shapes: x (..., C) with any leading dims (flattened to M rows), weight (C,), bias (C,) or None. Output in x's dtype;
weight/bias may have another dtype (fp32 params under bf16 autocast) and get their grads in that dtype.

Kernels:
  forward  one program per tile of BLOCK_M rows x BLOCK_C columns (whole row in registers, C <= 16384); stores
           y (and h) plus fp32 mean/rstd (M,) for the backward.
  backward one program per group of rows: dx in one pass over its rows, while dw/db accumulate in registers;
           each group writes one row of a (n_groups, C) fp32 partial buffer, and a tiny torch sum reduces it.
           No second pass over all M rows for dw/db (eager PyTorch runs a separate dgamma/dbeta kernel).

Callers: nanopara/model.py (ln_1, ln_2 via add_layernorm, ln_f). Public ops take the Triton path when x is on
CUDA and the reference on CPU; `layernorm_triton` / `add_layernorm_triton` force the Triton path (tests run it
on CPU under TRITON_INTERPRET=1).

Run: `python -m kernels.layernorm [--quick] [--sweep] [--out FILE]` prints parity, then a benchmark table
(ms, GB/s, % of measured D2D copy bandwidth, speed-up vs eager F.layer_norm and torch.compile).
"""
import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_C = 16384  # whole row lives in registers (16384: the backward spills a little, see _tile)


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


@triton.jit
def _layernorm_fwd_kernel(X, R, H, Y, W, B, MEAN, RSTD, M, C, stride_x, stride_r, stride_h, stride_y, eps,
                          ADD_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = rows.to(tl.int64)  # M * C may exceed 2**31
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < M
    cmask = cols < C
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
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=rmask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _layernorm_bwd_kernel(X, DY, DH, DX, W, MEAN, RSTD, DW_PART, DB_PART, M, C, ROWS_PER_GROUP,
                          stride_x, stride_dy, stride_dh, stride_dx,
                          HAS_DH: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    group = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    # running column sums of this group's rows (a tile's rows sit in the same threads, so the per-tile sum over
    # axis 0 below costs no communication)
    dw_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    row_start = group * ROWS_PER_GROUP
    row_end = tl.minimum(row_start + ROWS_PER_GROUP, M)
    for r0 in range(row_start, row_end, BLOCK_M):
        rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)  # M * C may exceed 2**31
        rmask = rows < row_end
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)  # re-read (L1 hit) to free registers
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


# ---------------------------------------------------------------------------------------------------------------
# Launchers


# Tile choice. Both kernels are memory bound, so what matters is bytes in flight per SM: enough resident warps,
# each with wide (8 x bf16 = 16-byte) loads, and no register spills. ptxas (sm_90) puts the forward at ~4 and
# the backward at ~7 registers per element a thread holds, so the forward holds ~8 elements of a row per thread
# (<= 64 registers, 32 resident warps per SM) and the backward ~4 (~40-64 registers, 32-48 warps per SM).
# Narrow rows are stacked BLOCK_M to a tile so a program still moves a useful amount.
FWD_TILE, FWD_ELEMS_PER_THREAD = 4096, 8
BWD_TILE, BWD_ELEMS_PER_THREAD = 2048, 4
BWD_GROUPS_PER_SM = 2  # more groups: better latency hiding, but a bigger (n_groups, C) partial buffer to reduce
_TILE_OVERRIDE = {}  # ("fwd"|"bwd", C) -> (BLOCK_M, num_warps); set only by the benchmark's --sweep


def _tile(C, kind):
    """(BLOCK_M, BLOCK_C, num_warps) for kind "fwd" or "bwd"."""
    block_c = triton.next_power_of_2(C)
    if (kind, C) in _TILE_OVERRIDE:
        return _TILE_OVERRIDE[kind, C][0], block_c, _TILE_OVERRIDE[kind, C][1]
    tile, per_thread = (FWD_TILE, FWD_ELEMS_PER_THREAD) if kind == "fwd" else (BWD_TILE, BWD_ELEMS_PER_THREAD)
    block_m = max(1, tile // block_c)
    num_warps = min(32, max(1, block_m * block_c // (32 * per_thread)))
    return block_m, block_c, num_warps


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


def layernorm_fwd(x, weight, bias, eps, residual=None):
    """Returns (y, h, mean, rstd) with y, h of x's shape (h is None without residual), mean/rstd fp32 (M,).
    y is in x's dtype, or in h's (x + residual's promoted dtype) with a residual."""
    _check(x, weight, bias)
    C = x.shape[-1]
    x2 = _rows(x, C)  # (M, C)
    M = x2.shape[0]
    out_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    y = torch.empty((M, C), dtype=out_dtype, device=x.device)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    h = r2 = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"add_layernorm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        r2 = _rows(residual, C)
        h = torch.empty((M, C), dtype=out_dtype, device=x.device)
    if M > 0:
        block_m, block_c, num_warps = _tile(C, "fwd")
        _layernorm_fwd_kernel[(triton.cdiv(M, block_m),)](
            x2, r2, h, y, weight, bias, mean, rstd, M, C, x2.stride(0),
            0 if r2 is None else r2.stride(0), 0 if h is None else h.stride(0), y.stride(0), eps,
            ADD_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_C=block_c, num_warps=num_warps)
    return y.view(x.shape), (None if h is None else h.view(x.shape)), mean, rstd


def _n_groups(device, M, block_m):
    """Row groups for the backward: about one resident wave of programs; the partial buffer stays small."""
    if device.type == "cuda":
        target = BWD_GROUPS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 3  # interpreter: still exercises several groups and uneven group sizes
    return max(1, min(target, triton.cdiv(M, block_m)))


def layernorm_bwd(dy, x, weight, has_bias, mean, rstd, dh=None, n_groups=None):
    """Returns (dx, dw, db): dx in x's dtype (+dh when given), dw/db in weight's dtype (db None without bias)."""
    C = x.shape[-1]
    x2, dy2 = _rows(x, C), _rows(dy, C)  # (M, C)
    dh2 = None if dh is None else _rows(dh, C)
    M = x2.shape[0]
    dx = torch.empty((M, C), dtype=x.dtype, device=x.device)
    block_m, block_c, num_warps = _tile(C, "bwd")
    n_groups = n_groups or _n_groups(x.device, M, block_m)
    # whole tiles per group, so only the very last tile of the last group is partial
    rows_per_group = triton.cdiv(triton.cdiv(M, n_groups), block_m) * block_m if M > 0 else block_m
    n_groups = max(1, triton.cdiv(M, rows_per_group))
    # every group writes its whole row of partials (zeros if it has no rows), so no memset is needed
    part = torch.empty((2 if has_bias else 1, n_groups, C), dtype=torch.float32, device=x.device)
    if M > 0:
        _layernorm_bwd_kernel[(n_groups,)](
            x2, dy2, dh2, dx, weight, mean, rstd, part[0], part[-1], M, C, rows_per_group,
            x2.stride(0), dy2.stride(0), 0 if dh2 is None else dh2.stride(0), dx.stride(0),
            HAS_DH=dh is not None, HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_C=block_c, num_warps=num_warps)
    else:
        part.zero_()
    sums = part.sum(1).to(weight.dtype)  # (2 or 1, C): the tiny second-stage reduction, one launch for dw and db
    return dx.view(x.shape), sums[0], (sums[1] if has_bias else None)


# ---------------------------------------------------------------------------------------------------------------
# Autograd


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, _, mean, rstd = layernorm_fwd(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = layernorm_bwd(dy, x, weight, ctx.has_bias, mean, rstd)
        return dx, dw, db, None


class AddLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps):
        y, h, mean, rstd = layernorm_fwd(x, weight, bias, eps, residual=residual)
        ctx.save_for_backward(h, weight, mean, rstd)
        ctx.has_bias = bias is not None
        ctx.dtypes = x.dtype, residual.dtype
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = layernorm_bwd(dy, h, weight, ctx.has_bias, mean, rstd, dh=dh)
        # h = x + residual: both inputs get the same gradient (as autograd's own add does), in their dtypes
        return dx.to(ctx.dtypes[0]), dx.to(ctx.dtypes[1]), dw, db, None


def layernorm_triton(x, weight, bias, eps=1e-5):
    """Triton path on any device (CPU tensors need TRITON_INTERPRET=1)."""
    return LayerNormFunction.apply(x, weight, bias, eps)


def add_layernorm_triton(x, residual, weight, bias, eps=1e-5):
    """Triton path of add_layernorm on any device (CPU tensors need TRITON_INTERPRET=1)."""
    return AddLayerNormFunction.apply(x, residual, weight, bias, eps)


def layernorm(x, weight, bias, eps=1e-5):
    """LayerNorm over the last dim: Triton on CUDA, the PyTorch reference elsewhere."""
    return layernorm_triton(x, weight, bias, eps) if x.is_cuda else layernorm_ref(x, weight, bias, eps)


def add_layernorm(x, residual, weight, bias, eps=1e-5):
    """(y, h) = (LayerNorm(x + residual), x + residual) in one pass on CUDA; the reference elsewhere."""
    if x.is_cuda:
        return add_layernorm_triton(x, residual, weight, bias, eps)
    return add_layernorm_ref(x, residual, weight, bias, eps)


# ---------------------------------------------------------------------------------------------------------------
# Parity + benchmark: python -m kernels.layernorm [--quick] [--sweep] [--out FILE]


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
        rows.append(dict(op="layernorm", impl=name, M=M, C=C, dtype=str(dtype).split(".")[-1], fwd_ms=t_f,
                         bwd_ms=t_b, fwd_bwd_ms=t_fb, fwd_gbs=fwd_bytes / t_f / 1e6, bwd_gbs=bwd_bytes / t_b / 1e6,
                         fwd_bwd_gbs=(fwd_bytes + bwd_bytes) / t_fb / 1e6))
    eager_ms = next(q["fwd_bwd_ms"] for q in rows if q["impl"] == "eager")
    for r in rows:
        for k in ("fwd", "bwd", "fwd_bwd"):
            r[f"{k}_pct_copy"] = 100 * r[f"{k}_gbs"] / copy_gbs
        r["speedup_fwd_bwd"] = eager_ms / r["fwd_bwd_ms"]
    return rows


def _sweep(M, C, dtype):
    """Time the forward, then fwd+bwd, over (BLOCK_M, num_warps) around the heuristic, and the backward's number
    of row groups: the numbers to retune FWD_*/BWD_* constants with."""
    global BWD_GROUPS_PER_SM
    x = torch.randn(M, C, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.ones(C, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.zeros(C, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(M, C, device="cuda", dtype=dtype)
    fwd = lambda: layernorm(x, w, b)  # noqa: E731
    fwd_bwd = lambda: layernorm(x, w, b).backward(dy)  # noqa: E731
    block_c = triton.next_power_of_2(C)
    print(f"sweep {M}x{C}: heuristic (BLOCK_M, BLOCK_C, num_warps) fwd {_tile(C, 'fwd')} bwd {_tile(C, 'bwd')}")
    for kind, fn in (("fwd", fwd), ("bwd", fwd_bwd)):
        for block_m in (1, 2, 4, 8, 16):
            for num_warps in (2, 4, 8, 16, 32):
                per_thread = block_m * block_c // (32 * num_warps)
                if not 2 <= per_thread <= 32 or block_m * block_c > 16384:
                    continue
                _TILE_OVERRIDE[kind, C] = (block_m, num_warps)
                ms = triton.testing.do_bench(fn, grad_to_none=[x, w, b], return_mode="median")
                print(f"  {kind} BLOCK_M={block_m:2d} num_warps={num_warps:2d} ({per_thread:2d}/thread): "
                      f"{'fwd' if kind == 'fwd' else 'fwd+bwd'} {ms * 1e3:7.1f} us")
        _TILE_OVERRIDE.clear()
    default = BWD_GROUPS_PER_SM
    for groups in (1, 2, 3, 4, 8):
        BWD_GROUPS_PER_SM = groups
        ms = triton.testing.do_bench(fwd_bwd, grad_to_none=[x, w, b], return_mode="median")
        print(f"  BWD_GROUPS_PER_SM={groups}: fwd+bwd {ms * 1e3:7.1f} us")
    BWD_GROUPS_PER_SM = default


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two shapes, no torch.compile")
    p.add_argument("--sweep", action="store_true", help="also sweep tile sizes at 16384x768 and 4096x8192")
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
          f"{'f+b ms':>8} {'GB/s':>5} {'%copy':>5} {'f+b vs eager':>12}")
    out = open(args.out, "a") if args.out else None
    for M, C in shapes:
        for r in _bench(M, C, dtype, copy_gbs, compile_ok=not args.quick):
            cells = " ".join(f"{r[k + '_ms']:8.4f} {r[k + '_gbs']:5.0f} {r[k + '_pct_copy']:4.0f}%"
                             for k in ("fwd", "bwd", "fwd_bwd"))
            print(f"{f'{M}x{C}':>12} {r['impl']:>8} {cells} {r['speedup_fwd_bwd']:11.2f}x")
            if out:
                out.write(json.dumps(dict(r, device=torch.cuda.get_device_name(), copy_gbs=copy_gbs)) + "\n")
    print("GB/s counts the bytes that must move: fwd x, w, b in and y out; bwd x, dy, w, mean, rstd in and dx, dw, "
          "db out")
    if out:
        out.close()
    if args.sweep:
        _sweep(16384, 768, dtype)
        _sweep(4096, 8192, dtype)


if __name__ == "__main__":
    main()
