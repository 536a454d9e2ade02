"""Grouped GEMM over variable-size row groups (MoE experts): one launch for all experts, forward, input gradient
and weight gradient, with GELU fused into the epilogues of an expert MLP.
Long file: one op in two kernel families (pointer, TMA) that share the group search, epilogues and launchers.

Math. Rows of x (R, K) are grouped by expert: group e is rows [offsets[e], offsets[e+1]) (offsets (E+1,) int32 on
the device, as kernels/moe_route.py makes them; rows from offsets[E] on are not read or written). Weights in
nn.Linear's layout, one per expert: w (E, N, K), bias (E, N).
    forward   y[r] = x[r] @ w[e]^T + bias[e]                     (R, N)    optionally g = gelu_tanh(y), keeping y
    dgrad     dx[r] = dy[r] @ w[e]                               (R, K)    optionally times gelu'(pre[r])
    wgrad     dw[e] = dy[group e]^T @ x[group e],  db[e] = column sums of dy[group e]   (E, N, K), (E, N)
  grouped_mlp(...) = the E GPT-2 MLPs c_proj(gelu(c_fc(x))): the c_fc forward writes gelu(h) and keeps h, and the
  c_proj dgrad multiplies by gelu'(h) in its epilogue, so dh never takes a separate elementwise pass.

Kernels. Forward and dgrad are one kernel (only the strides of w differ); its tiles are the (m, n) tiles of every
group, m tiles never straddling two groups; each program finds its tile's group from the offsets alone (a cumsum
in registers), so the launch needs no host sync. The weight gradient is K-grouped: one program per (expert, n tile,
k tile) of dw, db summed from the same dy tiles. All accumulate in fp32; dw, db are written in the parameters' dtype.
TMA variants (_grouped_mm_tma_kernel, _grouped_wgrad_tma_kernel: the default on sm_90+ CUDA tensors; TMA /
NANOPARA_GROUPED_TMA, or tma=False, for the pointer kernels): operands moved by per-group device-side descriptors,
persistent over tiles numbered group by group. Autotuned per (N, K, rows bucket); bf16 on the GPU; in the
interpreter tl.dot on bf16 is wrong (notes/triton_cpu.md), so CPU tests use fp32/fp16. Measured: notes/moe.md.
Callers: nanopara/moe.py (the Triton expert path), kernels/grouped_gemm_fp8.py (SCALED). Public ops take the Triton
path on CUDA tensors and a loop over groups on CPU; `*_triton` force Triton. Tests: tests/test_moe.py.
Benchmark: bench/bench_moe.py --sections=gemm (TFLOP/s against dense cuBLAS and torch._grouped_mm).
"""
import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.launch import cdiv, fast, next_pow2, tma_scratch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The flattened TMA forward candidates (FLATTEN, _grouped_mm_tma_kernel): opt-in (NANOPARA_GROUPED_FLATTEN=1). On one
# H100 they pass the GPU parity tests and measured no faster (results/moe_gemm_flatten_h100.txt, notes/moe.md), while
# doubling the TMA forward's tuning candidates
FLATTEN_CANDIDATES = os.environ.get("NANOPARA_GROUPED_FLATTEN", "0") == "1"
MAX_E = 1024  # experts held in registers by every program (the tile -> group search)
# The TMA kernels (_grouped_mm_tma_kernel for forward / dgrad, _grouped_wgrad_tma_kernel for wgrad) for calls that
# pass tma=None (the autograd Functions, so the MoE layer). Set it with NANOPARA_GROUPED_TMA=0/1 or by assigning this
# flag; grouped_fwd / grouped_dgrad / grouped_wgrad(tma=True / False) override it.
# None: the TMA kernel on CUDA tensors (where it can run), the pointer kernel in the interpreter (CPU tests pick);
# NANOPARA_GROUPED_TMA=0: the pointer kernel everywhere (A/B comparisons); =1: TMA everywhere, the interpreter too
TMA = {"0": False, "1": True}.get(os.environ.get("NANOPARA_GROUPED_TMA", ""))
# The TMA wgrad's bias gradient (16-bit operands): summed on the tensor cores (a narrow second MMA per dy tile,
# _wgrad_tma_reduce's DB_MODE 2; the default) or on the CUDA cores (DB_MODE 1, NANOPARA_WGRAD_DB_MMA=0). On one H100
# at gpt2_moe's step shape the wgrad with db ran 209 -> 437 TFLOP/s (565 without db) and the graphed step 30.11 ->
# 28.58 ms (results/moe_wgrad_db_h100.txt)
WGRAD_DB_MMA = os.environ.get("NANOPARA_WGRAD_DB_MMA", "1") == "1"


def grouped_linear_ref(x, w, bias, offsets):
    """y[r] = x[r] @ w[e]^T + bias[e] for the rows of each group; rows past offsets[E] are zero. A loop over groups
    (one host sync for the offsets)."""
    y = x.new_zeros(x.shape[0], w.shape[1])
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y[lo:hi] = F.linear(x[lo:hi], w[e], None if bias is None else bias[e])
    return y


def grouped_mlp_ref(x, w_fc, b_fc, w_proj, b_proj, offsets):
    """Each group's GPT-2 MLP: c_proj(gelu_tanh(c_fc(x)))."""
    h = F.gelu(grouped_linear_ref(x, w_fc, b_fc, offsets), approximate="tanh")
    return grouped_linear_ref(h, w_proj, b_proj, offsets)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels

@triton.jit
def _gelu_tanh(x):
    """0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), sqrt(2/pi) = 0.7978845608...; tanh(u) = 2 sigmoid(2u)
    - 1, so gelu = x sigmoid(2u) (no libdevice: the interpreter runs it too)."""
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x * tl.sigmoid(2.0 * u)  # = 0.5 x (1 + tanh(u))


@triton.jit
def _gelu_tanh_grad(x):
    """d gelu_tanh / dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2), t = tanh(u)."""
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)


def _configs(kind):
    if _INTERPRET and kind == "wgrad_tma":  # 2 programs on one "SM": the persistent loop crosses groups
        return [triton.Config({"BLOCK_R": 16, "BLOCK_N": 16, "BLOCK_K": 16, "PROGRAMS_PER_SM": 2}, num_warps=4)]
    if _INTERPRET:  # 16 is tl.dot's smallest tile; 2 programs on one "SM": the persistent loop runs
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2,
                               **({"PROGRAMS_PER_SM": 2} if kind in ("mm", "mm_tma") else {}),
                               **({"FLATTEN": True} if kind == "mm_tma" else {})}, num_warps=4)]
    if kind == "mm":  # (BM, BN, BK, warps, stages): the usual Hopper bf16 tiles, persistent or not
        tiles = ((128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (256, 128, 64, 8, 3),
                 (64, 128, 64, 4, 4))
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, "PROGRAMS_PER_SM": p},
                              num_warps=w, num_stages=s) for m, n, k, w, s in tiles for p in (0, 1)]
    if kind == "mm_tma":  # (BM, BN, BK, warps, stages), always persistent: one program per SM; each tile with the
        # tile and K loops flattened into one pipelined loop or not (_flatten_prune drops the flattened ones where
        # they spill: the GELU' epilogue)
        tiles = ((128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 3), (128, 128, 64, 4, 4),
                 (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (256, 128, 64, 8, 3), (128, 64, 64, 4, 4))
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, "PROGRAMS_PER_SM": 1,
                               **({"FLATTEN": f} if f else {})}, num_warps=w, num_stages=s) for m, n, k, w, s in tiles
                for f in ((False, True) if FLATTEN_CANDIDATES else (False,))]
    if kind == "wgrad_tma":  # (BR, BN, BK, warps, stages): BLOCK_R the reduction over a group's rows, (BN, BK) dw's
        # tile; always persistent, one program per SM. 128 x 256 / 256 x 128 need 8 warps (128 fp32 accumulator
        # registers a thread) and 3 stages (48 KB of operands a stage beside the dw staging tile)
        tiles = ((64, 128, 128, 4, 3), (64, 128, 128, 4, 4), (64, 128, 128, 8, 3), (64, 128, 128, 8, 4),
                 (64, 128, 256, 8, 3), (64, 256, 128, 8, 3))
        return [triton.Config({"BLOCK_R": r, "BLOCK_N": n, "BLOCK_K": k, "PROGRAMS_PER_SM": 1},
                              num_warps=w, num_stages=s) for r, n, k, w, s in tiles]
    # wgrad: BLOCK_M is the reduction over a group's rows; (BN, BK) the dw tile
    tiles = ((64, 128, 128, 4, 4), (64, 128, 256, 8, 3), (64, 256, 128, 8, 3), (32, 128, 128, 4, 4),
             (128, 128, 128, 8, 3))
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 1}, num_warps=w, num_stages=s)
            for m, n, k, w, s in tiles]


@triton.jit
def _mm_tile(A, B, BIAS, C, PRE, SA, SB, e, row0, row_end, nt, N, K,
             stride_am, stride_be, stride_bk, stride_bn, stride_biase, stride_cm, stride_pm, stride_sbe,
             HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, INPUT_PRECISION: tl.constexpr, SCALED: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[rows] = epilogue(A[rows] @ B[e] + bias[e]) for rows [row0, row0 + BLOCK_M) < row_end, columns of tile nt.
    SCALED (FP8, kernels/grouped_gemm_fp8.py): A and B in fp8, the product times SA[row] * SB[e, column] (row
    scales of A, per-expert output-column scales of B) before the bias and the epilogue."""
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    rmask = rows < row_end
    cols = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * stride_am + ks[None, :]
    b_ptrs = B + e.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = ks < K - k0
        a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if SCALED:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if SCALED:
        sa = tl.load(SA + rows, mask=rmask, other=0.0)
        sb = tl.load(SB + e.to(tl.int64) * stride_sbe + cols, mask=nmask, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + e.to(tl.int64) * stride_biase + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
    mask = rmask[:, None] & nmask[None, :]
    if EPILOGUE == 1:  # GELU: keep the pre-activation (rounded as stored: the backward reads that value)
        pre = acc.to(C.dtype.element_ty)
        tl.store(PRE + rows[:, None] * stride_pm + cols[None, :], pre, mask=mask)
        acc = _gelu_tanh(pre.to(tl.float32))
    elif EPILOGUE == 2:  # GELU backward: the gradient at gelu's input
        pre = tl.load(PRE + rows[:, None] * stride_pm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = acc * _gelu_tanh_grad(pre)
    tl.store(C + rows[:, None] * stride_cm + cols[None, :], acc.to(C.dtype.element_ty), mask=mask)


@triton.autotune(configs=_configs("mm"), key=["N", "K", "R_BUCKET", "EPILOGUE", "SCALED"])
@triton.jit
def _grouped_mm_kernel(A, B, BIAS, C, PRE, SA, SB, OFFSETS, N, K, E, R_BUCKET,
                       stride_am, stride_be, stride_bk, stride_bn, stride_biase, stride_cm, stride_pm, stride_sbe,
                       HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                       SCALED: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr):  # PROGRAMS_PER_SM sizes the grid only
    """Forward (B = w^T) and dgrad (B = w) over all groups. EPILOGUE: 0 none, 1 GELU (stores PRE), 2 times
    gelu'(PRE)."""
    # the tile schedule, from the offsets alone: group e owns m tiles [tile_end[e] - m_tiles[e], tile_end[e])
    experts = tl.arange(0, BLOCK_E)
    emask = experts < E
    g_start = tl.load(OFFSETS + experts, mask=emask, other=0)
    g_end = tl.load(OFFSETS + experts + 1, mask=emask, other=0)
    m_tiles = (g_end - g_start + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(m_tiles, 0)
    num_m = tl.sum(m_tiles, 0)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        first_m = (tile // width) * GROUP_M  # GROUP_M m tiles share a sweep over the n tiles (L2 reuse)
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        mt = first_m + (tile % width) % size_m
        nt = (tile % width) // size_m
        e = tl.sum((tile_end <= mt).to(tl.int32), 0)  # the group whose tiles contain mt (empty groups skipped)
        here = experts == e
        row0 = tl.sum(tl.where(here, g_start + (mt - tile_end + m_tiles) * BLOCK_M, 0), 0)
        row_end = tl.sum(tl.where(here, g_end, 0), 0)
        _mm_tile(A, B, BIAS, C, PRE, SA, SB, e, row0, row_end, nt, N, K,
                 stride_am, stride_be, stride_bk, stride_bn, stride_biase, stride_cm, stride_pm, stride_sbe,
                 HAS_BIAS, EPILOGUE, INPUT_PRECISION, SCALED, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _group_tile(local, m_tiles, width, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A group's tile number -> (first row within the group, first column): GROUP_M m tiles share a sweep over the
    n tiles (the weight tile stays in L2 for them); width = GROUP_M * n tiles."""
    first_m = (local // width) * GROUP_M
    size_m = tl.minimum(m_tiles - first_m, GROUP_M)
    return (first_m + (local % width) % size_m) * BLOCK_M, ((local % width) // size_m) * BLOCK_N


@triton.jit
def _store_halves(desc, row, col, x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A (BLOCK_M, BLOCK_N) tile through a TMA descriptor of block (BLOCK_M, BLOCK_N // 2): two half-width stores,
    so the shared-memory staging tile is half as large (room for 3-4 stages of 128 x 256 x 64 operand tiles)."""
    x0, x1 = tl.split(tl.permute(tl.reshape(x, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
    desc.store([row, col], x0)
    desc.store([row, col + BLOCK_N // 2], x1)


def _flatten_prune(configs, named_args, **kwargs):
    """The flattened loop nest keeps the next tile's operands and this tile's epilogue live together: compiled for
    sm_90 (triton 3.6), the forward tiles fit (126-255 registers, at most 12 bytes spilled), the GELU' epilogue of
    the dgrad spills 396-648 bytes in five of eight tiles, so it keeps the unflattened loops."""
    if _INTERPRET or kwargs.get("EPILOGUE") != 2:
        return configs
    return [c for c in configs if not c.kwargs.get("FLATTEN")] or configs[:1]


@triton.autotune(configs=_configs("mm_tma"), key=["N", "K", "R_BUCKET", "EPILOGUE"],
                 prune_configs_by={"early_config_prune": _flatten_prune})
@triton.jit
def _grouped_mm_tma_kernel(A, B, BIAS, C, PRE, OFFSETS, N, K, E, R_BUCKET,
                           stride_am, stride_be, stride_bd1, stride_biase, stride_cm, stride_pm,
                           HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                           TRANS_B: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr,  # PROGRAMS_PER_SM: grid only
                           FLATTEN: tl.constexpr = False):
    """_grouped_mm_kernel's forward / dgrad (no SCALED) with A, B, C (and the GELU pre-activation's store) moved by
    TMA descriptors made on the device. B: the weights w as one 3-D descriptor, read in (1, BN, BK) blocks of
    w[e] (TRANS_B, forward: w (E, N, K), transposed in the dot) or (1, BK, BN) blocks (dgrad: w (E, K, N) here).
    Per group e, the A and C descriptors start at the group's first row and are (rows of e, K) and (rows of e, N):
    the TMA unit zero-fills the rows (and K columns) past their ends and drops stores past them, so a group's last,
    partial m tile neither reads nor writes another group's rows, with no masks in the K loop.
    Schedule: persistent, grid = PROGRAMS_PER_SM x SMs programs. The tiles are numbered group by group (group e's
    m_tiles x num_n tiles in GROUP_M-swizzled order, after those of the groups before it) and program p takes tiles
    p, p + P, p + 2P, ...: every wave of P tiles keeps all SMs busy up to the single partial wave at the very end,
    whatever the group sizes, and a wave's tiles are mostly one group's (its weight tile stays in L2). A program
    makes a group's descriptors once, and only if it has a tile in that group (empty groups make none)."""
    if TRANS_B:
        b_desc = tl.make_tensor_descriptor(B, shape=[E, N, K], strides=[stride_be, stride_bd1, 1],
                                           block_shape=[1, BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(B, shape=[E, K, N], strides=[stride_be, stride_bd1, 1],
                                           block_shape=[1, BLOCK_K, BLOCK_N])
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    tile_start = pid * 0  # first tile (global number) of group e
    for e in range(E):
        g_start = tl.load(OFFSETS + e)
        rows = tl.load(OFFSETS + e + 1) - g_start
        m_tiles = tl.cdiv(rows, BLOCK_M)
        tile_end = tile_start + m_tiles * num_n
        first = tile_start + (pid - tile_start % P + P) % P  # this program's first tile number >= tile_start
        if first < tile_end:
            a_desc = tl.make_tensor_descriptor(A + g_start.to(tl.int64) * stride_am, shape=[rows, K],
                                               strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
            c_desc = tl.make_tensor_descriptor(C + g_start.to(tl.int64) * stride_cm, shape=[rows, N],
                                               strides=[stride_cm, 1], block_shape=[BLOCK_M, BLOCK_N // 2])
            if EPILOGUE == 1:
                p_desc = tl.make_tensor_descriptor(PRE + g_start.to(tl.int64) * stride_pm, shape=[rows, N],
                                                   strides=[stride_pm, 1], block_shape=[BLOCK_M, BLOCK_N // 2])
            tile_c = first - P  # FLATTEN: the epilogue's own tile counter (see below)
            for tile in tl.range(first, tile_end, P, flatten=FLATTEN):
                m0, n0 = _group_tile(tile - tile_start, m_tiles, width, GROUP_M, BLOCK_M, BLOCK_N)
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    a = a_desc.load([m0, k0])
                    if TRANS_B:
                        b = tl.trans(tl.reshape(b_desc.load([e, n0, k0]), [BLOCK_N, BLOCK_K]))
                    else:
                        b = tl.reshape(b_desc.load([e, k0, n0]), [BLOCK_K, BLOCK_N])
                    acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
                # FLATTEN: the tile and K loops become one software-pipelined loop, so the next tile's first loads
                # are in flight during this tile's epilogue (c_fc's K = 768 is only 12 steps of 64: the pipeline's
                # fill and drain per tile weigh). The epilogue then recomputes its coordinates from its own counter
                # rather than carrying m0 / n0 across the tile boundary (as kernels/fp8_matmul.py does).
                tile_c += P
                m0, n0 = _group_tile(tile_c - tile_start, m_tiles, width, GROUP_M, BLOCK_M, BLOCK_N)
                cols = n0 + tl.arange(0, BLOCK_N)
                if HAS_BIAS:
                    acc += tl.load(BIAS + e * stride_biase + cols, mask=cols < N,
                                   other=0.0).to(tl.float32)[None, :]
                if EPILOGUE == 1:  # GELU: keep the pre-activation (rounded as stored: the backward reads it)
                    pre = acc.to(C.dtype.element_ty)
                    _store_halves(p_desc, m0, n0, pre, BLOCK_M, BLOCK_N)
                    acc = _gelu_tanh(pre.to(tl.float32))
                elif EPILOGUE == 2:  # GELU backward: the gradient at gelu's input (PRE read through pointers)
                    r = m0 + tl.arange(0, BLOCK_M)
                    pre = tl.load(PRE + (g_start + r).to(tl.int64)[:, None] * stride_pm + cols[None, :],
                                  mask=(r < rows)[:, None] & (cols < N)[None, :], other=0.0).to(tl.float32)
                    acc = acc * _gelu_tanh_grad(pre)
                _store_halves(c_desc, m0, n0, acc.to(C.dtype.element_ty), BLOCK_M, BLOCK_N)
        tile_start = tile_end


@triton.autotune(configs=_configs("wgrad"), key=["N", "K", "R_BUCKET"])
@triton.jit
def _grouped_wgrad_kernel(DY, X, OFFSETS, DW, DB, N, K, R_BUCKET,
                          stride_dym, stride_xm, stride_dwe, stride_dwn, stride_dwk, stride_dbe,
                          HAS_BIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """dw[e] tile (n, k) = sum over the group's rows of dy^T x; db[e] from the k-tile-0 programs."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    e = pid // (num_n * num_k)
    nt = (pid % (num_n * num_k)) // num_k
    kt = pid % num_k
    start = tl.load(OFFSETS + e)
    end = tl.load(OFFSETS + e + 1)
    cols_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
    nmask = cols_n < N
    kmask = cols_k < K
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        rmask = rows < end
        dy = tl.load(DY + rows[:, None] * stride_dym + cols_n[None, :], mask=rmask[:, None] & nmask[None, :],
                     other=0.0)
        x = tl.load(X + rows[:, None] * stride_xm + cols_k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(tl.trans(dy), x, acc, input_precision=INPUT_PRECISION)
        if HAS_BIAS:  # every program sums (no branch in the loop); the kt == 0 one stores
            db += tl.sum(dy.to(tl.float32), 0)
    e64 = e.to(tl.int64)
    tl.store(DW + e64 * stride_dwe + cols_n[:, None] * stride_dwn + cols_k[None, :] * stride_dwk,
             acc.to(DW.dtype.element_ty), mask=nmask[:, None] & kmask[None, :])
    if HAS_BIAS:
        tl.store(DB + e64 * stride_dbe + cols_n, db.to(DB.dtype.element_ty), mask=nmask & (kt == 0))


@triton.jit
def _wgrad_tma_reduce(dy_desc, x_desc, rows, n0, k0, DB_MODE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(dy[:rows, n0:n0+BN]^T @ x[:rows, k0:k0+BK], column sums of that dy block), fp32, through the group's
    descriptors: the rows past `rows` (the group's last, partial BLOCK_R tile) load as zeros. DB_MODE: 0 no sums;
    1 summed on the CUDA cores (each dy tile read out of shared memory into registers); 2 on the tensor cores as
    one more, narrow product dy^T @ E0, E0 (BR, 16) ones in its first column and zeros elsewhere (16-bit operands
    only: products by 1 and 0 are exact, the sums fp32 as in mode 1, in the MMA's order)."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    first_col = (tl.zeros([BLOCK_R, 16], dtype=tl.int32) + tl.arange(0, 16)[None, :]) == 0
    for r0 in range(0, rows, BLOCK_R):
        dy = dy_desc.load([r0, n0])  # (BR, BN): dy^T is a transposed view of this tile
        x = x_desc.load([r0, k0])  # (BR, BK)
        acc = tl.dot(tl.trans(dy), x, acc, input_precision=INPUT_PRECISION)
        if DB_MODE == 1:
            db += tl.sum(dy.to(tl.float32), 0)
        elif DB_MODE == 2:
            db_acc = tl.dot(tl.trans(dy), first_col.to(dy.dtype), db_acc)
    if DB_MODE == 2:
        db = tl.sum(db_acc, 1)  # one nonzero column: exact
    return acc, db


@triton.jit
def _store_halves_3d(desc, e, row, col, x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """_store_halves into block [e, row:row+BM, col:col+BN] of a 3-D descriptor of block (1, BM, BN // 2)."""
    x0, x1 = tl.split(tl.permute(tl.reshape(x, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
    desc.store([e, row, col], tl.reshape(x0, [1, BLOCK_M, BLOCK_N // 2]))
    desc.store([e, row, col + BLOCK_N // 2], tl.reshape(x1, [1, BLOCK_M, BLOCK_N // 2]))


@triton.autotune(configs=_configs("wgrad_tma"), key=["N", "K", "R_BUCKET"])
@triton.jit
def _grouped_wgrad_tma_kernel(DY, X, OFFSETS, DW, DB, N, K, E, R_BUCKET,
                              stride_dym, stride_xm, stride_dwe, stride_dwn, stride_dbe,
                              HAS_BIAS: tl.constexpr, DB_MODE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              PROGRAMS_PER_SM: tl.constexpr):  # PROGRAMS_PER_SM sizes the grid only
    """_grouped_wgrad_kernel through TMA descriptors made on the device: dw[e] (N, K) = dy[group e]^T @ x[group e],
    db[e] = column sums of dy[group e]. Per group e, the dy and x descriptors start at the group's first row and are
    (rows of e, N) and (rows of e, K): the reduction's last, partial BLOCK_R tile loads zeros past the group's end
    (never another group's rows nor the unused rows past offsets[E]), with no masks in the loop. dw is one 3-D
    descriptor (E, N, K), written in two half-width stores per (BN, BK) tile (clipped at N and K).
    Schedule: persistent, grid = PROGRAMS_PER_SM x SMs programs over the E x num_n x num_k tiles of dw numbered group
    by group (n tile major, k tile minor); program p takes tiles p, p + P, ... An empty group's tiles store zeros
    (no descriptors of dy / x are made for it); a program makes a group's descriptors only if it has a tile there.
    db: the k-tile-0 tiles sum their dy tiles (a second copy of the loop, so the other tiles' loop stays a plain
    TMA -> wgmma pipeline; DB_MODE as in _wgrad_tma_reduce) and store db[e, n tile] through pointers."""
    dw_desc = tl.make_tensor_descriptor(DW, shape=[E, N, K], strides=[stride_dwe, stride_dwn, 1],
                                        block_shape=[1, BLOCK_N, BLOCK_K // 2])
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    num_k = tl.cdiv(K, BLOCK_K)
    per_group = tl.cdiv(N, BLOCK_N) * num_k
    for e in range(E):
        tile_start = e * per_group
        tile_end = tile_start + per_group
        first = tile_start + (pid - tile_start % P + P) % P  # this program's first tile number >= tile_start
        if first < tile_end:
            g_start = tl.load(OFFSETS + e)
            rows = tl.load(OFFSETS + e + 1) - g_start
            if rows > 0:
                dy_desc = tl.make_tensor_descriptor(DY + g_start.to(tl.int64) * stride_dym, shape=[rows, N],
                                                    strides=[stride_dym, 1], block_shape=[BLOCK_R, BLOCK_N])
                x_desc = tl.make_tensor_descriptor(X + g_start.to(tl.int64) * stride_xm, shape=[rows, K],
                                                   strides=[stride_xm, 1], block_shape=[BLOCK_R, BLOCK_K])
                for tile in range(first, tile_end, P):
                    local = tile - tile_start
                    n0 = (local // num_k) * BLOCK_N
                    k0 = (local % num_k) * BLOCK_K
                    if HAS_BIAS:
                        if k0 == 0:
                            acc, db = _wgrad_tma_reduce(dy_desc, x_desc, rows, n0, k0, DB_MODE, INPUT_PRECISION,
                                                        BLOCK_R, BLOCK_N, BLOCK_K)
                            cols = n0 + tl.arange(0, BLOCK_N)
                            tl.store(DB + e * stride_dbe + cols, db.to(DB.dtype.element_ty), mask=cols < N)
                        else:
                            acc, _ = _wgrad_tma_reduce(dy_desc, x_desc, rows, n0, k0, 0, INPUT_PRECISION,
                                                       BLOCK_R, BLOCK_N, BLOCK_K)
                    else:
                        acc, _ = _wgrad_tma_reduce(dy_desc, x_desc, rows, n0, k0, 0, INPUT_PRECISION,
                                                   BLOCK_R, BLOCK_N, BLOCK_K)
                    _store_halves_3d(dw_desc, e, n0, k0, acc.to(DW.dtype.element_ty), BLOCK_N, BLOCK_K)
            else:  # an empty group: zeros
                for tile in range(first, tile_end, P):
                    local = tile - tile_start
                    n0 = (local // num_k) * BLOCK_N
                    k0 = (local % num_k) * BLOCK_K
                    if HAS_BIAS:
                        if k0 == 0:
                            cols = n0 + tl.arange(0, BLOCK_N)
                            tl.store(DB + e * stride_dbe + cols, tl.zeros([BLOCK_N], DB.dtype.element_ty),
                                     mask=cols < N)
                    _store_halves_3d(dw_desc, e, n0, k0, tl.zeros([BLOCK_N, BLOCK_K], DW.dtype.element_ty),
                                     BLOCK_N, BLOCK_K)


# ---------------------------------------------------------------------------------------------------------------
# Launchers (kernels/launch.py: after the first call per specialization, the compiled binaries launch directly)

_mm, _wgrad, _mm_tma = fast(_grouped_mm_kernel), fast(_grouped_wgrad_kernel), fast(_grouped_mm_tma_kernel)
_wgrad_tma = fast(_grouped_wgrad_tma_kernel)
_EPILOGUE = {None: 0, "gelu": 1, "gelu_grad": 2}


@functools.lru_cache(maxsize=None)
def _sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@functools.lru_cache(maxsize=None)
def _capability(device):
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def tma_supported(device):
    """(ok, reason): whether the TMA variant can run on `device`. Tensor descriptors made on the device need TMA
    hardware (sm_90 Hopper or newer); the interpreter (TRITON_INTERPRET=1, CPU tests) emulates them."""
    device = torch.device(device)
    if _INTERPRET:
        return True, "Triton interpreter (emulated TMA)"
    if device.type != "cuda":
        return False, f"{device.type}: the Triton kernels need CUDA (or TRITON_INTERPRET=1)"
    major, minor = _capability(device)
    if major < 9:
        return False, f"sm_{major}{minor}: TMA descriptors need sm_90 (Hopper) or newer"
    return True, f"sm_{major}{minor}"


def _tma_why_not(a, w, N):
    """None if a (R, K), w (E, ., .) and the (R, N) outputs fit TMA descriptors, else why not: unit stride along
    the last dimension, 16-byte aligned bases and other strides (each group's descriptors start at a row of a and
    c, so the row strides' alignment keeps every group's base aligned too)."""
    for name, t in (("x", a), ("w", w)):
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1]):
            return f"{name} {tuple(t.shape)} strides {t.stride()}: TMA needs unit stride along the last dimension " \
                   "and 16-byte aligned base and strides"
    if N * a.element_size() % 16:
        return f"output rows of {N} x {a.element_size()} bytes are not 16-byte multiples"
    return None


def _wgrad_tma_why_not(dy, x, dtype):
    """_tma_why_not for the weight gradient: dy (R, N) and x (R, K) read through per-group descriptors, dw (E, N, K)
    in `dtype` (made contiguous here) written through one."""
    for name, t in (("dy", dy), ("x", x)):
        if t.stride(-1) != 1 or t.data_ptr() % 16 or t.stride(0) * t.element_size() % 16:
            return f"{name} {tuple(t.shape)} strides {t.stride()}: TMA needs unit stride along the last dimension " \
                   "and 16-byte aligned base and strides"
    size = torch.empty(0, dtype=dtype).element_size()
    if x.shape[1] * size % 16:
        return f"dw rows of {x.shape[1]} x {size} bytes are not 16-byte multiples"
    return None


def _use_tma(tma, a, w, N, check=None):
    """tma: True (the TMA kernel, ValueError where it cannot run), False (the pointer kernel), None (the module
    flag TMA, falling back to the pointer kernel where TMA cannot run). check: () -> why not (None: fits), in
    place of _tma_why_not(a, w, N) (the weight gradient's operands)."""
    flag = TMA if tma is None else tma
    if not (a.device.type == "cuda" if flag is None else flag):
        return False
    ok, why = tma_supported(a.device)
    if ok:
        why = _tma_why_not(a, w, N) if check is None else check()
        ok = why is None
    if not ok and tma:
        raise ValueError(f"grouped GEMM with tma=True: {why}")
    return ok


def _bucket(R):
    """Rows, rounded up to a power of 2 (>= 4096), for the autotune key: the tile that wins depends on the rows
    (waves of tiles over the SMs), not only on (N, K). Unused inside the kernels."""
    return max(4096, next_pow2(R))


def _precision(dtype):
    """fp32 operands: exact fp32 products (as torch's default matmul), not tf32; 16-bit: ignored."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(x, w, offsets, name):
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"{name}: x must be (R, K) and w (E, N, K), got {tuple(x.shape)} and {tuple(w.shape)}")
    if offsets.shape != (w.shape[0] + 1,) or offsets.dtype != torch.int32:
        raise ValueError(f"{name}: offsets must be int32 ({w.shape[0] + 1},), got {offsets.dtype} "
                         f"{tuple(offsets.shape)}")
    if w.shape[0] > MAX_E:
        raise ValueError(f"{name}: at most {MAX_E} groups, got {w.shape[0]}")
    if x.dtype != w.dtype:
        raise ValueError(f"{name}: x and w must share a dtype, got {x.dtype} and {w.dtype}")


def _mm_grid(R, E, N, device):
    def grid(meta):
        tiles = (cdiv(R, meta["BLOCK_M"]) + E) * cdiv(N, meta["BLOCK_N"])  # bound on the real count
        p = meta["PROGRAMS_PER_SM"]
        return (tiles if p == 0 else max(1, min(tiles, p * _sm_count(device))),)
    return grid


def _launch_mm(a, b, stride_be, stride_bk, stride_bn, bias, offsets, N, K, epilogue, pre=None, scales=None,
               out_dtype=None):
    """scales: (sa (R,), sb (E, N)) fp32 for fp8 a and b (grouped_gemm_fp8.py); out_dtype: c's (default a's)."""
    a = a.contiguous()
    R, E = a.shape[0], offsets.shape[0] - 1
    c = torch.empty(R, N, dtype=out_dtype or a.dtype, device=a.device)
    if epilogue == "gelu":
        pre = torch.empty_like(c)
    sa, sb = scales if scales is not None else (None, None)
    if R > 0 and N > 0:
        _mm[_mm_grid(R, E, N, a.device)](
            a, b, bias, c, pre, sa, sb, offsets, N, K, E, _bucket(R), a.stride(0), stride_be, stride_bk, stride_bn,
            0 if bias is None else bias.stride(0), c.stride(0), 0 if pre is None else pre.stride(0),
            0 if sb is None else sb.stride(0),
            HAS_BIAS=bias is not None, EPILOGUE=_EPILOGUE[epilogue], INPUT_PRECISION=_precision(a.dtype),
            SCALED=scales is not None, BLOCK_E=next_pow2(E))
    return c, pre


def _launch_mm_tma(a, w, trans_b, bias, offsets, N, K, epilogue, pre=None):
    """_launch_mm through _grouped_mm_tma_kernel (16-bit or fp32 operands, no FP8 scales). w (E, N, K) with
    trans_b (forward), (E, K, N) without (dgrad); a contiguous, _tma_why_not(a, w, N) None.
    Device-side descriptors (tl.make_tensor_descriptor) are written by each program into a global scratch buffer
    (128 bytes a descriptor) that Triton's launcher asks `triton.set_allocator`'s allocator for; that allocator is a
    ContextVar, per thread (the autograd engine runs the backward on a thread of its own), so it is set here, on
    every call, and only for this kernel's launches (the pointer kernels need no scratch). The interpreter makes
    its descriptors on the host and needs none."""
    R, E = a.shape[0], offsets.shape[0] - 1
    c = torch.empty(R, N, dtype=a.dtype, device=a.device)
    if epilogue == "gelu":
        pre = torch.empty_like(c)
    if R > 0 and N > 0 and E > 0:
        if a.is_cuda:
            triton.set_allocator(tma_scratch)

        def grid(meta):  # persistent: at most PROGRAMS_PER_SM per SM, never more than a bound on the tiles
            tiles = (cdiv(R, meta["BLOCK_M"]) + E) * cdiv(N, meta["BLOCK_N"])
            return (max(1, min(tiles, meta["PROGRAMS_PER_SM"] * _sm_count(a.device))),)
        _mm_tma[grid](a, w, bias, c, pre, offsets, N, K, E, _bucket(R), a.stride(0), w.stride(0), w.stride(1),
                      0 if bias is None else bias.stride(0), c.stride(0), 0 if pre is None else pre.stride(0),
                      HAS_BIAS=bias is not None, EPILOGUE=_EPILOGUE[epilogue], INPUT_PRECISION=_precision(a.dtype),
                      TRANS_B=trans_b)
    return c, pre


def grouped_fwd(x, w, bias, offsets, gelu=False, tma=None):
    """y = x @ w[e]^T + bias[e] per group, (R, N) in x's dtype (rows past offsets[E] unwritten). gelu: returns
    (gelu_tanh(y), y), else (y, None). tma: _use_tma (None: the module flag TMA)."""
    _check(x, w, offsets, "grouped_fwd")
    E, N, K = w.shape
    if x.shape[1] != K or (bias is not None and bias.shape != (E, N)):
        raise ValueError(f"grouped_fwd: x {tuple(x.shape)}, w {tuple(w.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit")
    epilogue = "gelu" if gelu else None
    x = x.contiguous()
    if _use_tma(tma, x, w, N):
        return _launch_mm_tma(x, w, True, bias, offsets, N, K, epilogue)
    return _launch_mm(x, w, w.stride(0), w.stride(2), w.stride(1), bias, offsets, N, K, epilogue)


def grouped_dgrad(dy, w, offsets, pre=None, tma=None):
    """dx = dy @ w[e] per group, (R, K); with pre (the forward's GELU input): dx * gelu'(pre) instead.
    tma: _use_tma (None: the module flag TMA)."""
    _check(dy, w, offsets, "grouped_dgrad")
    E, N, K = w.shape
    if dy.shape[1] != N:
        raise ValueError(f"grouped_dgrad: dy {tuple(dy.shape)} does not fit w {tuple(w.shape)}")
    if pre is not None:
        pre = pre.contiguous()
    epilogue = None if pre is None else "gelu_grad"
    dy = dy.contiguous()
    if _use_tma(tma, dy, w, K):
        return _launch_mm_tma(dy, w, False, None, offsets, K, N, epilogue, pre)[0]
    return _launch_mm(dy, w, w.stride(0), w.stride(1), w.stride(2), None, offsets, K, N, epilogue, pre)[0]


def _launch_wgrad_tma(dy, x, offsets, dw, db):
    """grouped_wgrad through _grouped_wgrad_tma_kernel (dy, x contiguous; _wgrad_tma_why_not None). The scratch
    allocator for the device-side descriptors as in _launch_mm_tma (per thread: set on every call)."""
    R, N = dy.shape
    E, K = dw.shape[0], dw.shape[2]
    if dy.is_cuda:
        triton.set_allocator(tma_scratch)

    def grid(meta):  # persistent: at most PROGRAMS_PER_SM per SM, never more than the tiles of dw
        tiles = E * cdiv(N, meta["BLOCK_N"]) * cdiv(K, meta["BLOCK_K"])
        return (max(1, min(tiles, meta["PROGRAMS_PER_SM"] * _sm_count(dy.device))),)
    db_mode = 2 if WGRAD_DB_MMA and dy.element_size() == 2 else 1
    _wgrad_tma[grid](dy, x, offsets, dw, db, N, K, E, _bucket(R), dy.stride(0), x.stride(0), dw.stride(0),
                     dw.stride(1), 0 if db is None else db.stride(0),
                     HAS_BIAS=db is not None, DB_MODE=db_mode, INPUT_PRECISION=_precision(dy.dtype))


def grouped_wgrad(dy, x, offsets, dtype=None, bias=True, tma=None, out=None):
    """(dw (E, N, K), db (E, N) or None) in `dtype` (default dy's): dw[e] = dy[group e]^T @ x[group e]; an empty
    group's are zeros, rows past offsets[E] do not count. tma: _use_tma (None: the module flag TMA). out: a
    contiguous (E, N, K) tensor of `dtype` that dw is written into (an engine's gradient slot)."""
    dy, x = dy.contiguous(), x.contiguous()
    R, N = dy.shape
    K = x.shape[1]
    E = offsets.shape[0] - 1
    if x.shape[0] != R or dy.dtype != x.dtype:
        raise ValueError(f"grouped_wgrad: dy {dy.dtype} {tuple(dy.shape)} and x {x.dtype} {tuple(x.shape)} differ")
    dtype = dtype or dy.dtype
    dw = out if out is not None else torch.empty(E, N, K, dtype=dtype, device=dy.device)
    if dw.shape != (E, N, K) or dw.dtype != dtype or not dw.is_contiguous():
        raise ValueError(f"grouped_wgrad: out must be a contiguous ({E}, {N}, {K}) {dtype} tensor, got {dw.dtype} "
                         f"{tuple(dw.shape)}")
    db = torch.empty(E, N, dtype=dtype, device=dy.device) if bias else None
    if E > 0 and N > 0 and K > 0 and _use_tma(tma, dy, None, None, check=lambda: _wgrad_tma_why_not(dy, x, dtype)):
        _launch_wgrad_tma(dy, x, offsets, dw, db)
    elif E > 0 and N > 0 and K > 0:
        grid = lambda meta: (E * cdiv(N, meta["BLOCK_N"]) * cdiv(K, meta["BLOCK_K"]),)  # noqa: E731
        _wgrad[grid](dy, x, offsets, dw, db, N, K, _bucket(R), dy.stride(0), x.stride(0), dw.stride(0), dw.stride(1),
                     dw.stride(2), 0 if db is None else db.stride(0),
                     HAS_BIAS=bias, INPUT_PRECISION=_precision(dy.dtype))
    elif db is not None:
        db.zero_()
    return dw, db


# ---------------------------------------------------------------------------------------------------------------
# Autograd. Parameters may be fp32 masters while activations are bf16 (autocast): the forward casts the weights to
# x's dtype once (kept for the backward; a current shadow instead, as_dtype), and dw / db come back in each
# parameter's own dtype, dw written straight into an engine's gradient slot where it gave one (_dest).


def _dest(w):
    """Where w's gradient goes: `w.grad_into(w)` where an engine set one (engine.Engine._set_grad_dests: a view of
    its flat gradient buffer, for w's first gradient of a step), else None (a new tensor)."""
    into = getattr(w, "grad_into", None)
    return into(w) if into is not None else None


def _wgrad_into(dy, x, offsets, dtype, bias, dest):
    """grouped_wgrad written into `dest` where it fits (else computed apart and copied there)."""
    shape = (offsets.shape[0] - 1, dy.shape[1], x.shape[1])
    fits = dest is not None and dest.dtype == dtype and dest.is_contiguous() and tuple(dest.shape) == shape
    dw, db = grouped_wgrad(dy, x, offsets, dtype=dtype, bias=bias, out=dest if fits else None)
    return (dw if dest is None or fits else dest.copy_(dw)), db


def as_dtype(w, dt):
    """w in dt: its `shadow` where nanopara/flat.py keeps a current one (written by the optimizer with the weights,
    w._version unmoved since: no cast pass), else a cast."""
    s = getattr(w, "shadow", None)
    if s is not None and s.dtype == dt and getattr(w, "shadow_version", None) == w._version:
        return s
    return w.to(dt)


class GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, offsets):
        wc = as_dtype(w, x.dtype)
        y, _ = grouped_fwd(x, wc, bias, offsets)
        ctx.save_for_backward(x, wc, offsets)
        ctx.w = w
        ctx.dtypes = w.dtype, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, wc, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped_dgrad(dy, wc, offsets) if ctx.needs_input_grad[0] else None
        dw, db = _wgrad_into(dy, x, offsets, ctx.dtypes[0], ctx.dtypes[1] is not None, _dest(ctx.w))
        return dx, dw, None if db is None else db.to(ctx.dtypes[1]), None


class GroupedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_fc, b_fc, w_proj, b_proj, offsets):
        wf, wp = as_dtype(w_fc, x.dtype), as_dtype(w_proj, x.dtype)
        g, h = grouped_fwd(x, wf, b_fc, offsets, gelu=True)  # (R, H): gelu(h), h
        y, _ = grouped_fwd(g, wp, b_proj, offsets)  # (R, C)
        ctx.save_for_backward(x, wf, wp, h, g, offsets)
        ctx.ws = w_fc, w_proj
        ctx.dtypes = (w_fc.dtype, None if b_fc is None else b_fc.dtype, w_proj.dtype,
                      None if b_proj is None else b_proj.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, wf, wp, h, g, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dt_wf, dt_bf, dt_wp, dt_bp = ctx.dtypes
        dh = grouped_dgrad(dy, wp, offsets, pre=h)  # (R, H): gradient at gelu's input, fused
        dwp, dbp = _wgrad_into(dy, g, offsets, dt_wp, dt_bp is not None, _dest(ctx.ws[1]))
        dx = grouped_dgrad(dh, wf, offsets)
        dwf, dbf = _wgrad_into(dh, x, offsets, dt_wf, dt_bf is not None, _dest(ctx.ws[0]))
        cast = lambda t, dt: None if t is None else t.to(dt)  # noqa: E731  (bias dtype may differ from weight's)
        return dx, dwf, cast(dbf, dt_bf), dwp, cast(dbp, dt_bp), None


def grouped_linear_triton(x, w, bias, offsets):
    return GroupedLinearFunction.apply(x, w, bias, offsets)


def grouped_mlp_triton(x, w_fc, b_fc, w_proj, b_proj, offsets):
    return GroupedMLPFunction.apply(x, w_fc, b_fc, w_proj, b_proj, offsets)


def grouped_linear(x, w, bias, offsets):
    """x (R, K) grouped by offsets -> x @ w[e]^T + bias[e] (R, N). Triton on CUDA, the reference elsewhere."""
    return grouped_linear_triton(x, w, bias, offsets) if x.is_cuda else grouped_linear_ref(x, w, bias, offsets)


def grouped_mlp(x, w_fc, b_fc, w_proj, b_proj, offsets):
    """Each group's GPT-2 MLP, c_proj(gelu_tanh(c_fc(x))). Triton on CUDA, the reference elsewhere."""
    fn = grouped_mlp_triton if x.is_cuda else grouped_mlp_ref
    return fn(x, w_fc, b_fc, w_proj, b_proj, offsets)


# ---------------------------------------------------------------------------------------------------------------
# Group sizes and offsets (the tests' and bench/bench_moe.py's)


def group_sizes(R, E, skew, generator=None):
    """Group sizes summing to R: "balanced" (equal, remainder spread), "skewed" (expert e gets a share ~ 1/(e+1)^1.5,
    Zipf-like: ~48% to expert 0 of 8), "one" (one group holds everything), "random" (multinomial)."""
    if skew == "balanced":
        sizes = [R // E + (e < R % E) for e in range(E)]
    elif skew == "one":
        sizes = [R] + [0] * (E - 1)
    elif skew == "skewed":
        share = torch.tensor([1 / (e + 1) ** 1.5 for e in range(E)])
        sizes = (share / share.sum() * R).floor().long().tolist()
        sizes[0] += R - sum(sizes)
    else:
        sizes = torch.bincount(torch.randint(0, E, (R,), generator=generator), minlength=E).tolist()
    return sizes


def offsets_of(sizes, device):
    return torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
