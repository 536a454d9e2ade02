"""FP8 GEMM for Hopper in Gluon with fp32 promotion every 128 K: warp-specialised, persistent.

Same contract as kernels/fp8_matmul.py (its docstring has the shapes and scale grids): out = (A * sa) @ (B * sb)^T
(+ bias), A (M, K) and B (N, K) K-major fp8, for the GEMMs that cannot accumulate in the tensor core's own
precision: per-tensor / per-row scaling with `fast_accum=False` (the dgrad and wgrad GEMMs of nanopara/fp8.py) and
block scaling (1x128 A; 128x128 or 1x128 B). Each 128-wide K step is one wgmma into a fresh fp32 tile, which is
then scaled (block) and added into the accumulator: the add must wait for its wgmma, and in the Triton kernel that
wait stalls the whole CTA once per step (0.68-0.77x cuBLAS precise, notes/fp8.md). Here the wait is a warpgroup's
own, so it costs only that warpgroup:
  * `gl.warp_specialize`: a 1-warp TMA loader (24 registers) fills a ring of NUM_BUF stages (A's two 64-row halves
    and B's BLOCK_N rows, 128 K wide) for two 4-warp consumer warpgroups, each owning 64 rows of a 128-row tile;
    a stage has a ready mbarrier (TMA bytes) and an empty one (both consumers arrive);
  * a consumer's step: issue step k's wgmma, wait for step k-1's (one stays in flight: LAG), scale it, add it, free
    its stage. While one warpgroup adds, the other's wgmma holds the tensor cores (the two drift apart freely);
  * persistent: one CTA per SM walks the tiles in GROUP_M-swizzled order; the epilogue (row / tensor scales, bias,
    cast) goes out through a per-warpgroup staging tile and a TMA store that the next tile's K loop overlaps.
The same design as kernels/attention_hopper.py (loader + two consumers, setmaxnreg 240 / 24), and the one cuBLAS
and CUTLASS use for FP8 promotion (consumer warpgroups whose promotion adds overlap each other's wgmma).
Measured (one H200, results/fp8_ws_h200.txt): 0.96-1.08x cuBLAS's precise `_scaled_mm` at gpt_1b's large shapes,
1.3-1.5x the Triton kernel; its host cost (host TMA descriptors) is higher, so it runs in graphed steps
(nanopara/parallel.py sets recipe.ws) unless NANOPARA_FP8_WS=1 / 0 (fp8_matmul.WS) forces it on / off.
Tests: tests/test_fp8_ws.py (sm_90a compile budgets on CPU; GPU parity). Bench: `bench/bench_fp8.py --ws`.
"""
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.fp8_quant import BLOCK
from kernels.launch import cdiv, fast

ROWS = 64  # rows of a tile per consumer warpgroup (one wgmma M); a tile is 2 * ROWS rows
SUB_M = gl.constexpr(ROWS)
BLOCK_K = gl.constexpr(BLOCK)  # one promotion (and one block scale) per 128-wide K step
CONSUMER_REGS = gl.constexpr(240)
# (BLOCK_N, NUM_BUF stages, LAG): a consumer holds its accumulator and LAG + 1 partial tiles of 64 x BLOCK_N fp32
# (64 registers each at BLOCK_N = 128); a stage is 2 x 64 x 128 + BLOCK_N x 128 bytes. The first of a scaling's
# candidates is its default. Block scaling has no LAG: the step's scales beside two partials spilled (628-2,212
# bytes) and ptxas serialised the wgmmas (C7515); tests/test_fp8_ws.py holds the defaults to no spill, no C751x.
CONFIGS = {"precise": [(128, 5, 1), (128, 4, 1), (128, 5, 0)], "block": [(128, 5, 0), (128, 4, 0)]}
GROUP_M = gl.constexpr(8)
_GL_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5, torch.bfloat16: gl.bfloat16,
              torch.float16: gl.float16, torch.float32: gl.float32}


@gluon.jit
def _tile(t, num_pid_m, num_pid_n, GROUP: gl.constexpr):
    """Tile index -> (pid_m, pid_n), GROUP row tiles at a time down each column (B tiles stay in L2 for them).
    fp8_matmul._tile_coords's order, restated: a Gluon kernel can call only @gluon.jit functions."""
    in_group = GROUP * num_pid_n
    first_m = (t // in_group) * GROUP
    size_m = gl.minimum(num_pid_m - first_m, GROUP)
    return first_m + (t % in_group) % size_m, (t % in_group) // size_m


@gluon.jit
def _loader(args, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, LAG: gl.constexpr, BLOCK_SCALED: gl.constexpr,
            B_SCALE_ROWS: gl.constexpr, HAS_BIAS: gl.constexpr):
    (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, SA, SB, BIAS, M, N, K,
     stride_sam, stride_sak, stride_sbn, stride_sbk) = args
    num_pid_m = gl.cdiv(M, 2 * SUB_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    j = 0  # K steps issued by this CTA so far: ring slot and phase
    for t in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile(t, num_pid_m, num_pid_n, GROUP_M)
        for ki in range(k_steps):
            s = j % NUM_BUF
            mbarrier.wait(empty.index(s), ((j // NUM_BUF) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
            mbarrier.expect(ready.index(s), 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            for c in gl.static_range(2):  # the two consumers' 64-row halves (rows past M load as zeros)
                tma.async_copy_global_to_shared(a_desc, [pid_m * 2 * SUB_M + c * SUB_M, ki * BLOCK_K],
                                                ready.index(s), a_bufs.index(2 * s + c))
            tma.async_copy_global_to_shared(b_desc, [pid_n * BLOCK_N, ki * BLOCK_K], ready.index(s), b_bufs.index(s))
            j += 1


@gluon.jit
def _rows_cols(r0, pid_n, M, N, BLOCK_N: gl.constexpr, acc_layout: gl.constexpr):
    """A consumer's 64 rows and the tile's BLOCK_N columns, those past M / N clamped to 0 (their scales are read,
    never stored). Made where they are used, not held across the K loop: registers."""
    rows = r0 + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, acc_layout))
    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    return gl.where(rows < M, rows, 0), gl.where(cols < N, cols, 0)


@gluon.jit
def _scales(ki, sc, BLOCK_N: gl.constexpr, BLOCK_SCALED: gl.constexpr, B_SCALE_ROWS: gl.constexpr,
            acc_layout: gl.constexpr):
    """Step ki's block scales (loaded before the wait on its wgmma, so their latency hides under it): A's per row
    and B's per column, or one scalar where a 128x128 block of B spans the tile. Unused without block scaling."""
    SA, SB, stride_sam, stride_sak, stride_sbn, stride_sbk, r0, pid_n, M, N = sc
    rows, cols = _rows_cols(r0, pid_n, M, N, BLOCK_N, acc_layout)
    if BLOCK_SCALED:
        sa = gl.load(SA + rows * stride_sam + ki * stride_sak)
        if B_SCALE_ROWS % BLOCK_N == 0:
            sa = sa * gl.load(SB + (pid_n * BLOCK_N // B_SCALE_ROWS) * stride_sbn + ki * stride_sbk)
            sb = gl.full(cols.shape, 1.0, gl.float32, cols.type.layout)
        else:
            sb = gl.load(SB + (cols // B_SCALE_ROWS) * stride_sbn + ki * stride_sbk)
    else:
        sa = gl.full(rows.shape, 1.0, gl.float32, rows.type.layout)
        sb = gl.full(cols.shape, 1.0, gl.float32, cols.type.layout)
    return sa, sb


@gluon.jit
def _promote(acc, part, sa, sb, BLOCK_N: gl.constexpr, BLOCK_SCALED: gl.constexpr, B_SCALE_ROWS: gl.constexpr):
    """acc + part: part scaled by its step's block scales (block scaling), as it is otherwise."""
    if BLOCK_SCALED:
        if B_SCALE_ROWS % BLOCK_N == 0:
            acc = acc + part * gl.expand_dims(sa, 1)
        else:
            acc = acc + (part * gl.expand_dims(sa, 1)) * gl.expand_dims(sb, 0)
    else:
        acc = acc + part
    return acc


@gluon.jit
def _issue(a_bufs, b_bufs, ready, j, part, WG: gl.constexpr, NUM_BUF: gl.constexpr):
    """Wait for ring step j's operands and issue its wgmma into part's registers (a fresh product: use_acc off)."""
    s = j % NUM_BUF
    mbarrier.wait(ready.index(s), (j // NUM_BUF) & 1)
    return warpgroup_mma(a_bufs.index(2 * s + WG), b_bufs.index(s).permute((1, 0)), part, use_acc=False,
                         is_async=True)


@gluon.jit
def _land(acc, part, IN_FLIGHT: gl.constexpr, empty_bar, ki, sc, BLOCK_N: gl.constexpr, BLOCK_SCALED: gl.constexpr,
          B_SCALE_ROWS: gl.constexpr, acc_layout: gl.constexpr):
    """K step ki's partial: its scales loaded, its wgmma waited for (IN_FLIGHT newer ones may still run), its ring
    stage freed, then promoted into acc. Returns (acc, the landed partial: its registers for a later step)."""
    sa, sb = _scales(ki, sc, BLOCK_N, BLOCK_SCALED, B_SCALE_ROWS, acc_layout)
    part = warpgroup_mma_wait(num_outstanding=IN_FLIGHT, deps=(part, ))
    mbarrier.arrive(empty_bar, count=1)
    return _promote(acc, part, sa, sb, BLOCK_N, BLOCK_SCALED, B_SCALE_ROWS), part


@gluon.jit
def _consume(WG: gl.constexpr, args, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, LAG: gl.constexpr,
             BLOCK_SCALED: gl.constexpr, B_SCALE_ROWS: gl.constexpr, HAS_BIAS: gl.constexpr):
    """Consumer warpgroup WG (0 or 1): rows [64 WG, 64 WG + 64) of every tile of this CTA."""
    (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, SA, SB, BIAS, M, N, K,
     stride_sam, stride_sak, stride_sbn, stride_sbk) = args
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    num_pid_m = gl.cdiv(M, 2 * SUB_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    c_smem = c_bufs.index(WG)
    j = 0
    for t in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile(t, num_pid_m, num_pid_n, GROUP_M)
        r0 = pid_m * 2 * SUB_M + WG * SUB_M
        sc = (SA, SB, stride_sam, stride_sak, stride_sbn, stride_sbk, r0, pid_n, M, N)
        acc = gl.zeros([SUB_M, BLOCK_N], gl.float32, acc_layout)
        pa = gl.zeros([SUB_M, BLOCK_N], gl.float32, acc_layout)  # partial tiles (use_acc=False: never read)
        pb = gl.zeros([SUB_M, BLOCK_N], gl.float32, acc_layout)
        if LAG:
            # step 0 goes out; then each step issues step ki and promotes step ki - 1 (one wgmma in flight). Two
            # steps a trip with fixed roles (pa even steps, pb odd): swapping them would move registers that an
            # in-flight wgmma owns, and ptxas then serialises every wgmma (C7515)
            pa = _issue(a_bufs, b_bufs, ready, j, pa, WG, NUM_BUF)
            for kk in range(1, k_steps - 1, 2):
                pb = _issue(a_bufs, b_bufs, ready, j + 1, pb, WG, NUM_BUF)
                acc, pa = _land(acc, pa, 1, empty.index(j % NUM_BUF), kk - 1, sc, BLOCK_N, BLOCK_SCALED, B_SCALE_ROWS,
                            acc_layout)
                pa = _issue(a_bufs, b_bufs, ready, j + 2, pa, WG, NUM_BUF)
                acc, pb = _land(acc, pb, 1, empty.index((j + 1) % NUM_BUF), kk, sc, BLOCK_N, BLOCK_SCALED,
                            B_SCALE_ROWS, acc_layout)
                j += 2
            # the tail, in names of its own (an if may not turn a variable from in flight to landed)
            if k_steps % 2 == 0:  # the last step (odd) still to issue, into pb's registers
                pc = _issue(a_bufs, b_bufs, ready, j + 1, pb, WG, NUM_BUF)
                acc, qa = _land(acc, pa, 1, empty.index(j % NUM_BUF), k_steps - 2, sc, BLOCK_N, BLOCK_SCALED,
                            B_SCALE_ROWS, acc_layout)
                acc, qc = _land(acc, pc, 0, empty.index((j + 1) % NUM_BUF), k_steps - 1, sc, BLOCK_N, BLOCK_SCALED,
                            B_SCALE_ROWS, acc_layout)
                j += 2
            else:  # the last step (even) is in flight in pa
                acc, qa = _land(acc, pa, 0, empty.index(j % NUM_BUF), k_steps - 1, sc, BLOCK_N, BLOCK_SCALED,
                            B_SCALE_ROWS, acc_layout)
                j += 1
        else:
            for ki in range(k_steps):
                pa = _issue(a_bufs, b_bufs, ready, j, pa, WG, NUM_BUF)
                acc, pa = _land(acc, pa, 0, empty.index(j % NUM_BUF), ki, sc, BLOCK_N, BLOCK_SCALED, B_SCALE_ROWS,
                            acc_layout)
                j += 1

        rows, cols = _rows_cols(r0, pid_n, M, N, BLOCK_N, acc_layout)
        if not BLOCK_SCALED:  # per-tensor grids have stride 0: one element for every row / column
            acc = acc * gl.expand_dims(gl.load(SA + rows * stride_sam), 1) * gl.expand_dims(
                gl.load(SB + cols * stride_sbn), 0)
        if HAS_BIAS:
            acc = acc + gl.expand_dims(gl.load(BIAS + cols).to(gl.float32), 0)
        tma.store_wait(0)  # the previous tile's store has left the staging tile
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [r0, pid_n * BLOCK_N], c_smem)  # rows / columns past M, N dropped
    tma.store_wait(0)


@gluon.jit
def _consumer1(args, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, LAG: gl.constexpr, BLOCK_SCALED: gl.constexpr,
               B_SCALE_ROWS: gl.constexpr, HAS_BIAS: gl.constexpr):
    _consume(1, args, BLOCK_N, NUM_BUF, LAG, BLOCK_SCALED, B_SCALE_ROWS, HAS_BIAS)


@gluon.jit
def _fp8_matmul_ws_kernel(a_desc, b_desc, c_desc, SA, SB, BIAS, M, N, K, stride_sam, stride_sak, stride_sbn,
                          stride_sbk, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, LAG: gl.constexpr,
                          BLOCK_SCALED: gl.constexpr, B_SCALE_ROWS: gl.constexpr, HAS_BIAS: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * NUM_BUF] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_BUF] + b_desc.block_type.shape, b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumers
    args = (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, SA, SB, BIAS, M, N, K,
            stride_sam, stride_sak, stride_sbn, stride_sbk)
    gl.warp_specialize([(_consume, (0, args, BLOCK_N, NUM_BUF, LAG, BLOCK_SCALED, B_SCALE_ROWS, HAS_BIAS)),
                        (_consumer1, (args, BLOCK_N, NUM_BUF, LAG, BLOCK_SCALED, B_SCALE_ROWS, HAS_BIAS)),
                        (_loader, (args, BLOCK_N, NUM_BUF, LAG, BLOCK_SCALED, B_SCALE_ROWS, HAS_BIAS))],
                       [4, 1], [CONSUMER_REGS, 24])


# ---------------------------------------------------------------------------------------------------------------
# Launcher

_mm = fast(_fp8_matmul_ws_kernel)
_SMS = {}


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple, dtype: torch.dtype):
    """The shared-memory layout of a TMA block (6 us a call to make on a 2-core CPU: made once per block and dtype)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def descriptors(a, b, out, block_n):
    """Host TMA descriptors: A in 64-row halves of 128-wide K steps, B in block_n rows, out in 64 x block_n."""
    def desc(x, block):
        return TensorDescriptor(x, list(x.shape), [x.stride(0), 1], list(block), _smem_layout(block, x.dtype))
    return desc(a, (ROWS, BLOCK)), desc(b, (block_n, BLOCK)), desc(out, (ROWS, block_n))


@functools.lru_cache(maxsize=None)
def _hopper(device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def supported(a, b, out) -> bool:
    """Hopper (sm_90) tensors whose rows TMA can read: 16-byte aligned bases and row strides, unit inner stride."""
    if not (a.is_cuda and _hopper(a.device)):
        return False
    return all(t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in (a, b, out))


def launch(a, b, out, bias, a_scale, b_scale, block_scaled, b_rows, strides, config=None):
    """out = (A * sa) @ (B * sb)^T (+ bias) with promotion every 128 K; the caller (fp8_matmul.fp8_matmul_triton)
    has validated the operands and worked out the scaling (kernels/fp8_matmul._scaling)."""
    M, K = a.shape
    N = b.shape[0]
    if block_scaled and b_rows == 1 and strides[2] != 1:
        # B's 1x128 scales (the wgrad): a K step reads one per column of the tile. Stored (N, K/128) those are 128
        # strided loads; column-contiguous (a small copy, N x K/128 fp32) they are 512 bytes in a row
        b_scale = b_scale.t().contiguous().t()
        strides = (*strides[:2], 1, b_scale.stride(1))
    block_n, num_buf, lag = config or CONFIGS["block" if block_scaled else "precise"][0]
    a_desc, b_desc, c_desc = descriptors(a, b, out, block_n)
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    grid = (min(cdiv(M, 2 * ROWS) * cdiv(N, block_n), _SMS[dev]), )
    _mm[grid](a_desc, b_desc, c_desc, a_scale, b_scale, bias if bias is not None else a_scale, M, N, K, *strides,
              BLOCK_N=block_n, NUM_BUF=num_buf, LAG=lag, BLOCK_SCALED=bool(block_scaled), B_SCALE_ROWS=b_rows,
              HAS_BIAS=bias is not None, num_warps=4)
    return out
