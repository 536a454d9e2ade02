"""FP8 GEMM with per-tensor, per-row and 1x128 / 128x128 block scaling: out = (A * sa) @ (B * sb)^T (+ bias).

Shapes: A (M, K) and B (N, K), both K-major (unit stride along K: what Hopper's fp8 wgmma reads), in
float8_e4m3fn or float8_e5m2 (any mix: e5m2 gradients x e4m3 weights in the backward); out (M, N) in bf16, fp16
or fp32; bias (N,) optional, added in fp32 before the cast. The scales are fp32 grids (kernels/fp8_quant.py's
conventions) whose shapes say the scaling:
    per tensor   sa (1, 1), sb (1, 1)                      applied once, in the epilogue
    per row      sa (M, 1), sb (N, 1)    (a row of B is a column of B^T; tensor and row scales mix freely)
    block        sa (M, ceil(K/128)) 1x128 blocks of A; sb (ceil(N/128), ceil(K/128)) 128x128 blocks or
                 (N, ceil(K/128)) 1x128 blocks of B (the weight-gradient GEMM: both operands are activations)
Block scales are applied inside the K loop (DeepSeek-V3, arXiv 2412.19437 3.3): each 128-wide K step is one
tl.dot into a fresh fp32 tile, scaled by sa[m] * sb[n] and added to the accumulator (full fp32 every 128). K need
not be a multiple of 128: the last block is partial and loads past K read zeros. Per-tensor and per-row GEMMs
accumulate with tl.dot(a, b, acc); `fast_accum=False` promotes every BLOCK_K (cuBLAS's use_fast_accum=False).

Kernel: persistent tiles (a few programs per SM walking a GROUP_M-swizzled order, or one program per tile),
autotuned per (M bucket, N, K, scaling, dtypes). On Hopper A, B and out move through device-side TMA descriptors
when strides allow (K and N 16-byte multiples), pipelined into async wgmma; elsewhere the kernel loads through
pointers. A promoted K step's dot (block scales, precise accumulation) must finish before its fp32 add, a wgmma
wait a step: their cost against fast accumulation (notes/fp8.md; a two-step lag to hide it lost every tuning).

Callers: nanopara/fp8.py (forward X W^T, dgrad dY W, wgrad dY^T X). `fp8_matmul`: Triton on GPUs with fp8 tensor
cores (sm_89+), the reference elsewhere; `fp8_matmul_triton` forces the kernel (tests/test_fp8.py, interpreter).
Run: `python bench/bench_fp8.py` (TFLOP/s against torch._scaled_mm and bf16 cuBLAS on the same GPU).
"""
import functools
import os

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import BLOCK, _cdiv, _next_pow2, block_of, fp8_dequantize_ref
from kernels.launch import fast, tma_scratch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
FORCE_TMA = None  # tests: True / False overrides fp8_matmul_triton's tma=None choice (the interpreter runs TMA too)
# promoted GEMMs (precise accumulation, block scales) on Hopper through kernels/fp8_matmul_ws.py (Gluon,
# warp-specialised): fp8_matmul_triton's `ws` (nanopara/fp8.py's recipe.ws: on in a graphed step), unless
# NANOPARA_FP8_WS=1 / 0 forces it on / off everywhere
WS = {"1": True, "0": False}.get(os.environ.get("NANOPARA_FP8_WS", ""))
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_matmul_ref(a, b, a_scale, b_scale, bias=None, out_dtype=torch.bfloat16):
    """The spec: dequantize A and B to fp32 with their scale grids, matmul in fp32, add bias, cast."""
    M, K = a.shape
    N = b.shape[0]
    out = fp8_dequantize_ref(a, a_scale, block_of(a_scale, M, K)) @ fp8_dequantize_ref(
        b, b_scale, block_of(b_scale, N, K)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# ---------------------------------------------------------------------------------------------------------------
# Tiles. Candidates (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps), each persistent (grid = SMs) or not (one
# program per tile). Kept: the shapes of Triton's persistent-matmul tutorial for fp8 (128 x 128/256 x 64/128,
# 2-4 stages), plus 64-row tiles for skinny M; pruned per call (_prune) by what the scaling can hold in registers
# (block-scaled and precise-accumulation tiles keep a second fp32 tile: <= 64 accumulator registers a thread each,
# else <= 128), by shared memory (stages x (BLOCK_M + BLOCK_N) x BLOCK_K bytes + the output tile's staging
# <= 220 KB), by BLOCK_K = 128 for block scaling, and by the problem (no 256-wide tile for N <= 128, no 128-row
# tile for M <= 64). `python bench/bench_fp8.py --ptxas` compiles every candidate for sm_90a (no GPU) and prints
# registers, spills and shared memory.

_TILES = [
    (128, 256, 128, 3, 8), (128, 256, 64, 4, 8), (128, 128, 128, 4, 8), (128, 128, 128, 3, 4),
    (128, 128, 64, 5, 4), (64, 256, 128, 4, 8), (64, 128, 128, 5, 4), (128, 64, 128, 5, 4),
]
_CPU_TILE = (32, 32, BLOCK, 1, 4)  # the interpreter: small tiles, several per test shape, 128-wide K steps
SMEM_BUDGET = 220 * 1024
_KEY = ["M_BUCKET", "N", "K", "BLOCK_SCALED", "B_SCALE_ROWS", "FAST_ACCUM", "TMA"]


def _configs():
    if _INTERPRET:
        m, n, k, s, w = _CPU_TILE
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 2, "PERSISTENT": True},
                              num_stages=s, num_warps=w)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, "PERSISTENT": p},
                          num_stages=s, num_warps=w)
            for m, n, k, s, w in _TILES for p in (True, False)]


def tile_fits(m, n, k, stages, warps, two_accumulators, b_row_scales=False, out_bytes=2):
    """Whether a tile fits the register and shared-memory budgets above (also used by the --ptxas report).
    b_row_scales (block scaling with 1x128 B, the weight-gradient GEMM): the K loop also holds a BLOCK_N vector
    of B scales per pipeline stage in registers; 128x128 tiles of 8 warps spilled (ptxas, sm_90a), 4-warp tiles
    of 64 x 128 / 128 x 64 did not."""
    acc_regs = m * n // (32 * warps)
    smem = stages * (m + n) * k + m * n * out_bytes
    if b_row_scales and (warps != 4 or n > 128):
        return False
    return acc_regs <= (64 if two_accumulators else 128) and smem <= SMEM_BUDGET


def _prune(configs, named_args, **kwargs):
    if _INTERPRET:
        return configs
    block_scaled, fast_accum = kwargs["BLOCK_SCALED"], kwargs["FAST_ACCUM"]
    out_bytes = named_args["C"].element_size()
    M, N = named_args["M_BUCKET"], named_args["N"]

    def keep(c):
        m, n, k = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        if block_scaled and k != BLOCK:
            return False
        if (n == 256 and N <= 128) or (m == 128 and M <= 64):
            return False
        return tile_fits(m, n, k, c.num_stages, c.num_warps, block_scaled or not fast_accum,
                         block_scaled and kwargs["B_SCALE_ROWS"] == 1, out_bytes)
    return [c for c in configs if keep(c)] or configs[:1]


def _tune_bench(fn, quantiles=None):
    """The autotuner's timing, shorter than Triton's default (25 + 100 ms a candidate): a GEMM worth tuning runs
    0.1-2 ms, so 25 ms is 12-250 samples, and a model's first step tunes ~12 keys per mode."""
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernel


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile index -> (pid_m, pid_n), GROUP_M row tiles at a time down each column (B tiles stay in L2 for them)."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % in_group) % size_m, (tile % in_group) // size_m


@triton.autotune(configs=_configs(), key=_KEY, prune_configs_by={"early_config_prune": _prune}, do_bench=_tune_bench)
@triton.jit
def _fp8_matmul_kernel(A, B, C, BIAS, SA, SB, M, N, K, M_BUCKET,
                       stride_am, stride_bn, stride_cm, stride_sam, stride_sak, stride_sbn, stride_sbk,
                       BLOCK_SCALED: tl.constexpr, B_SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       TMA: tl.constexpr, FAST_ACCUM: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       PERSISTENT: tl.constexpr):  # PERSISTENT only sizes the grid (launcher); M_BUCKET: tuning key
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    start, step = tl.program_id(0), tl.num_programs(0)
    if TMA:  # out-of-bounds rows and K columns load as zeros; stores past M, N are dropped
        a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(B, shape=[N, K], strides=[stride_bn, 1], block_shape=[BLOCK_N, BLOCK_K])
        c_desc = tl.make_tensor_descriptor(C, shape=[M, N], strides=[stride_cm, 1],
                                           block_shape=[BLOCK_M, BLOCK_N // 2])
    offs_k = tl.arange(0, BLOCK_K)
    # the epilogue recomputes its tile's coordinates from its own counter, so that the flattened loop nest
    # (prologue of the next tile's loads overlapping this tile's epilogue) carries no value across the boundary
    tile_c = start - step
    for tile in tl.range(start, num_tiles, step, flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        # rows past M / N are clamped to row 0 (loaded, never stored): no row masks in the K loop
        rows_a = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows_a = tl.where(rows_a < M, rows_a, 0)
        rows_b = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_b = tl.where(rows_b < N, rows_b, 0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            k0 = ki * BLOCK_K
            if TMA:
                a = a_desc.load([pid_m * BLOCK_M, k0])
                b = b_desc.load([pid_n * BLOCK_N, k0])
            else:
                k_ok = (k0 + offs_k) < K
                a = tl.load(A + rows_a[:, None].to(tl.int64) * stride_am + (k0 + offs_k)[None, :],
                            mask=k_ok[None, :], other=0.0)
                b = tl.load(B + rows_b[:, None].to(tl.int64) * stride_bn + (k0 + offs_k)[None, :],
                            mask=k_ok[None, :], other=0.0)
            if BLOCK_SCALED:  # BLOCK_K == 128: one scale per row of A and per row (block) of B for this K step
                tl.static_assert(BLOCK_K == 128, "block scales index K steps by ki: BLOCK_K must be the 128 block")
                sa = tl.load(SA + rows_a * stride_sam + ki * stride_sak)
                if B_SCALE_ROWS % BLOCK_N == 0:  # one 128x128 block of B spans the tile: one scalar, one FMA
                    sb = tl.load(SB + (pid_n * BLOCK_N // B_SCALE_ROWS) * stride_sbn + ki * stride_sbk)
                    acc += tl.dot(a, b.T) * (sa * sb)[:, None]
                else:  # never a (BLOCK_M, BLOCK_N) tile of scales: two broadcast multiplies
                    sb = tl.load(SB + (rows_b // B_SCALE_ROWS) * stride_sbn + ki * stride_sbk)
                    acc += (tl.dot(a, b.T) * sa[:, None]) * sb[None, :]
            elif FAST_ACCUM:
                acc = tl.dot(a, b.T, acc)
            else:
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)

        tile_c += step
        pid_m, pid_n = _tile_coords(tile_c, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if not BLOCK_SCALED:  # per-tensor scales have stride 0: the same element for every row
            sa = tl.load(SA + tl.where(offs_m < M, offs_m, 0) * stride_sam)
            sb = tl.load(SB + tl.where(offs_n < N, offs_n, 0) * stride_sbn)
            acc = acc * sa[:, None] * sb[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if TMA:  # two half-width stores: half the shared memory of the staging tile
            acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc0.to(C.dtype.element_ty))
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], acc1.to(C.dtype.element_ty))
        else:
            mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
            tl.store(C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty),
                     mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Launcher

_mm = fast(_fp8_matmul_kernel)


@functools.lru_cache(maxsize=None)
def _sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


@functools.lru_cache(maxsize=None)
def _capability(device):
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def _scaling(a, b, sa, sb):
    """Validate the operands; returns (block_scaled, B rows per scale row, scale strides sam, sak, sbn, sbk).
    A grid with one row or one column is read with stride 0 there, so tensor, row and block scales combine."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_matmul: A (M, K) and B (N, K) expected, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_matmul: A and B must be float8_e4m3fn / float8_e5m2, got {a.dtype} and {b.dtype}")
    if sa.dim() != 2 or sb.dim() != 2 or sa.dtype != torch.float32 or sb.dtype != torch.float32:
        raise ValueError(f"fp8_matmul: scales must be 2-D fp32 grids, got {tuple(sa.shape)} {sa.dtype} and "
                         f"{tuple(sb.shape)} {sb.dtype}")
    M, K = a.shape
    N = b.shape[0]
    block_of(sa, M, K), block_of(sb, N, K)  # raise on a grid that fits no block
    if sa.shape[0] not in (1, M):
        raise ValueError(f"fp8_matmul: A's scales must be per tensor, per row or 1x128 blocks (rows 1 or {M}); "
                         f"128-row blocks of A ({tuple(sa.shape)}) are not supported")
    b_rows = BLOCK if (sb.shape[0] not in (1, N)) else 1
    block_scaled = sa.shape[1] > 1 or sb.shape[1] > 1 or b_rows > 1
    strides = (0 if sa.shape[0] == 1 else sa.stride(0), 0 if sa.shape[1] == 1 else sa.stride(1),
               0 if sb.shape[0] == 1 else sb.stride(0), 0 if sb.shape[1] == 1 else sb.stride(1))
    return block_scaled, b_rows, strides


def _tma_ok(*ts):
    """TMA descriptors need 16-byte aligned bases and row strides, and unit stride along the row."""
    return all(t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in ts)


def fp8_matmul_triton(a, b, a_scale, b_scale, bias=None, out_dtype=torch.bfloat16, fast_accum=True, out=None,
                      tma=None, ws=False):
    """The Triton kernel on any device (CPU tensors need TRITON_INTERPRET=1). out: an (M, N) tensor to write into
    (unit column stride), else a new one of out_dtype. tma: None = where the GPU and the strides allow (or
    FORCE_TMA where a test set it). ws: a promoted GEMM (fast_accum off, or block scales) on Hopper goes to
    kernels/fp8_matmul_ws.py where its strides allow (WS, when set, overrides)."""
    block_scaled, b_rows, (sam, sak, sbn, sbk) = _scaling(a, b, a_scale, b_scale)
    M, K = a.shape
    N = b.shape[0]
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("fp8_matmul: A and B must be K-major (unit stride along K): pass the transposed copy "
                         "the quantization kernels write (kernels/fp8_quant.py transpose=True)")
    if out is None:
        if out_dtype not in OUT_DTYPES:
            raise ValueError(f"fp8_matmul: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
        out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    elif out.shape != (M, N) or out.stride(1) != 1 or out.dtype not in OUT_DTYPES:
        raise ValueError(f"fp8_matmul: out must be ({M}, {N}) with unit column stride in one of {OUT_DTYPES}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"fp8_matmul: bias must have shape ({N},), got {tuple(bias.shape)}")
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(torch.zeros(M, N, device=a.device) + (0 if bias is None else bias.float()))
    if tma is None:
        tma = FORCE_TMA if FORCE_TMA is not None else (
            not _INTERPRET and _capability(a.device)[0] >= 9 and _tma_ok(a, b, out))
    if (ws if WS is None else WS) and tma and a.is_cuda and (block_scaled or not fast_accum):
        from kernels import fp8_matmul_ws
        if fp8_matmul_ws.supported(a, b, out):
            return fp8_matmul_ws.launch(a, b, out, bias, a_scale, b_scale, block_scaled, b_rows, (sam, sak, sbn, sbk))
    if tma and a.is_cuda:
        triton.set_allocator(tma_scratch)
    tiles = lambda meta: _cdiv(M, meta["BLOCK_M"]) * _cdiv(N, meta["BLOCK_N"])  # noqa: E731  (host ints: fp8_quant)
    programs = _sm_count(a.device)
    grid = lambda meta: (min(tiles(meta), programs) if meta["PERSISTENT"] else tiles(meta),)  # noqa: E731
    _mm[grid](a, b, out, bias, a_scale, b_scale, M, N, K, _next_pow2(M),
              a.stride(0), b.stride(0), out.stride(0), sam, sak, sbn, sbk,
              BLOCK_SCALED=block_scaled, B_SCALE_ROWS=b_rows, HAS_BIAS=bias is not None, TMA=bool(tma),
              FAST_ACCUM=bool(fast_accum))
    return out


def triton_supported(device) -> bool:
    """fp8 tensor-core dots: sm_89 (Ada) and later."""
    return device.type == "cuda" and _capability(device) >= (8, 9)


def fp8_matmul(a, b, a_scale, b_scale, bias=None, out_dtype=torch.bfloat16, fast_accum=True, out=None):
    """(A * sa) @ (B * sb)^T + bias: the Triton kernel on fp8-capable CUDA GPUs, the reference elsewhere."""
    if triton_supported(a.device):
        return fp8_matmul_triton(a, b, a_scale, b_scale, bias, out_dtype, fast_accum, out)
    _scaling(a, b, a_scale, b_scale)
    y = fp8_matmul_ref(a, b, a_scale, b_scale, bias, out.dtype if out is not None else out_dtype)
    return y if out is None else out.copy_(y)


# ---------------------------------------------------------------------------------------------------------------
# Parity + benchmark: python -m kernels.fp8_matmul [--quick] [--out FILE]: bench/bench_fp8.py --only parity,gemm

if __name__ == "__main__":
    import runpy
    import sys
    sys.argv = [sys.argv[0], "--only", "parity,gemm", *sys.argv[1:]]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runpy.run_path(os.path.join(root, "bench", "bench_fp8.py"), run_name="__main__")
