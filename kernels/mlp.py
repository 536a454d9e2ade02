"""GPT-2's MLP block as one fused op: the tanh-GELU lives in the epilogues of two Triton GEMMs.

Math (x (..., C) flattened to x2 (M, C); w_fc (H, C), w_proj (C, H) in nn.Linear layout, H = 4C in GPT-2):
    pre = x2 @ w_fc^T + b_fc                       (M, H)   fp32 accumulation, stored in the input dtype
    h   = gelu(pre) = 0.5 pre (1 + tanh(u)),  u = sqrt(2/pi) (pre + 0.044715 pre^3)      (F.gelu(approximate="tanh"))
    y   = h @ w_proj^T + b_proj                    (M, C)
Backward, given dy (M, C):
    dh   = dy @ w_proj                             (M, H)
    dpre = dh * gelu'(pre),  gelu'(z) = 0.5 (1 + t) + 0.5 z (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 z^2),  t = tanh(u)
    db_fc = sum_rows(dpre);  dW_fc = dpre^T @ x2;  dx = dpre @ w_fc
    dW_proj = dy^T @ h;  db_proj = sum_rows(dy)

What is fused (the rest is cuBLAS through torch):
  _fc_gelu_fwd     pre = x2 @ w_fc^T + b_fc; its epilogue stores pre (saved for the backward) and h = gelu(pre)
                   (h computed from pre as rounded to the input dtype, so h == F.gelu(pre) up to h's own rounding).
                   Eager PyTorch runs the GEMM, then reads pre back for a separate GELU pass.
  _proj_dgelu_bwd  dh = dy @ w_proj; its epilogue loads the matching pre tile, stores dpre = dh * gelu'(pre), and
                   writes this tile's fp32 column sums of dpre into a (M / PART_M, H) partial buffer that torch sums
                   afterwards (= db_fc; deterministic, no atomics). Eager PyTorch materialises dh, runs the GELU
                   backward over dh and pre, then a separate reduction for db_fc.
  y = F.linear(h, w_proj, b_proj) and the backward's four other products run in cuBLAS.
tanh is 1 - 2 / (exp2(2u log2 e) + 1), in fp32 (Triton 3.6 has no tl.math.tanh; exp2 is the native instruction and
runs in the interpreter), with u capped at 20, where tanh is 1 in fp32: no inf, no NaN; exp2 -> 0 gives exactly -1.

GEMM design (Hopper, sm_90; triton 3.6):
  * TMA everywhere through device-side descriptors (`tl.make_tensor_descriptor`, built once per program): tile loads
    and stores go through the bulk tensor copy engine, out-of-range rows/columns are zero-filled on load and
    clipped on store, so any M (1, 17, 129, ...) needs no masks in the main loop. Device-side descriptors need a
    little global scratch per program, which Triton asks of `triton.set_allocator`; that allocator is a ContextVar
    (per thread: the autograd engine runs the backward on its own thread), so the launchers set it on every call.
    Host-side `TensorDescriptor`s were the alternative; they bake the block shape into the argument, which the
    autotuner picks after the descriptor is built and which kernels/launch.py's cached-binary path could not fix up.
  * Persistent grid: min(#SMs, #tiles) programs walk the tiles with a grid stride, in grouped order (GROUP_M tile
    rows sweep the columns together, so the w tiles and x rows they share stay in L2). The tile loop is flattened
    into the K loop (`tl.range(..., flatten=True)`) so the TMA loads of the next tile are issued while this tile's
    epilogue runs, num_stages deep; tl.dot on bf16/fp16 tiles in shared memory lowers to wgmma.
  * The backward's epilogue reads a pre tile, and that TMA load waits at once (Triton pipelines the K loop's
    loads, not the epilogue's). So on the GPU each tile first asks L2 for its pre tile (`prefetch.global.L2`
    through inline PTX, one per 128-byte line), and the DRAM round trip overlaps the K loop; the interpreter skips
    the hint (PREFETCH=False), which changes no result.
  * Constraints that follow from TMA: rows of x, w_fc, w_proj, pre, dy 16-byte aligned, i.e. C and H multiples of
    8 for 16-bit dtypes (the launchers check; base pointers are realigned by a copy if needed).
  * The interpreter (TRITON_INTERPRET=1, CPU tests) runs this same code path: triton 3.6's interpreter implements
    tensor descriptors (loads zero-padded, stores clipped, as TMA does) and ignores the pipelining hints; it gets one
    small tile config with 3 "SMs" so the grid stride, partial tiles and the K tail are exercised.
  * fp32 inputs: tl.dot in tf32 only where torch.backends.cuda.matmul.allow_tf32 allows it, else exact fp32.
  Known costs, from the compiled IR (sm_90a, triton 3.6): the epilogue does not overlap
  the next tile's wgmma (no warp specialisation for Hopper in triton 3.6; only the next tile's TMA loads run ahead),
  so the forward pays its GELU math (one ex2 + one approximate divide per element) on top of the GEMM; Triton
  gives the forward's four half-tile TMA stores (pre, h per half) one staging buffer, so each waits for the
  previous one's shared-memory read.

Shapes: x (..., C) any leading dims; biases may be None. Autocast: like F.linear, when autocast is on for x's device
x, weights and biases are cast (`.to`, outside the autograd Function, so fp32 master weights get fp32 grads) to the
autocast dtype and y comes out in it; without autocast every tensor must share x's dtype.

Measured (H200, GPU time, M = 32768, C = 768; results/mlp_s5.txt, results/mlp_sweep_s5.txt): fc+gelu 0.365-0.372 ms
(416-424 TFLOP/s, 0.70x the bare cuBLAS GEMM), proj+dgelu 0.448-0.467 ms (0.55-0.58x): the fusion saves the GELU
passes but the GEMMs lose it again, MLP fwd+bwd 1.78-1.80 ms vs eager 1.80 ms. Tiles that fit 2-3 programs per SM
(so one program's epilogue overlaps another's wgmma) were no faster (commit c0747e2, reverted).

Callers: nanopara/model.py, opt-in (`TritonOps(fused_mlp=True)`; bench/bench_gpt.py mode option `mlp=fused`).
`mlp()` takes the Triton path on CUDA tensors and `mlp_ref` on CPU ones; `mlp_triton()` always the Triton path
(CPU tests under TRITON_INTERPRET=1).

Run: `python -m kernels.mlp [--quick] [--out FILE]` (GPU): parity line, then TFLOP/s of each fused GEMM against the
same-shape cuBLAS matmul, and MLP forward / forward+backward against eager PyTorch and torch.compile, at
M = 32768 (B=32 x T=1024), C = 768, bf16. Tests: `python -m pytest tests/test_mlp.py -q` (CPU).
"""
import argparse
import functools
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.launch import fast, tma_scratch


def mlp_ref(x, w_fc, b_fc, w_proj, b_proj):
    """Pure PyTorch: the spec, the CPU path and the test oracle (autocast applies as to any F.linear)."""
    return F.linear(F.gelu(F.linear(x, w_fc, b_fc), approximate="tanh"), w_proj, b_proj)


# ---------------------------------------------------------------------------------------------------------------
# Configs. Hopper bf16 GEMM tiles in the shape of Triton's persistent TMA matmul: 128 x 256 (or 256 x 128) tiles
# over two consumer warpgroups (8 warps), 128 x 128, and 64-row tiles for small M; BLOCK_K = 64 (128-byte rows,
# the widest TMA swizzle) or 128; 3-5 stages. All split the epilogue into two column halves (EPI_SPLIT = 2): with
# the whole 128 x 256 tile at once the forward spilled 44 bytes (255 registers) and its TMA staging tiles pushed
# shared memory past 227 KB for 4 stages; split, it takes 177 registers and 180 KB (ptxas, sm_90a, triton 3.6).

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, EPI_SPLIT); GROUP_M 8 throughout
_TILES = [(128, 256, 64, 8, 3, 2), (128, 256, 64, 8, 4, 2), (256, 128, 64, 8, 3, 2), (128, 128, 64, 8, 4, 2),
          (128, 128, 64, 8, 5, 2), (128, 128, 128, 8, 3, 2), (64, 256, 64, 4, 4, 2), (64, 128, 64, 4, 4, 2)]
_CPU_TILE = (32, 32, 16, 4, 1, 2)  # the interpreter: one small tile, so every test has several M, N and K tiles
GROUP_M = 8
# granularity of the backward's db_fc partials: one (H,) fp32 row per PART_M rows of x, whatever BLOCK_M the
# autotuner picks (a tile of BLOCK_M rows writes its column sums into the first of its BLOCK_M / PART_M rows and
# zeros into the others), so the buffer can be allocated before the config is known. The smallest BLOCK_M on the
# GPU; half the tile in the interpreter, so the tests run the several-rows-per-tile path.
PART_M = 16 if _INTERPRET else min(t[0] for t in _TILES)
SMEM_BYTES = 227 * 1024 - 1024  # shared memory a block may use on H100/H200, less a margin for barriers
# (BLOCK_M, BLOCK_E) staging tiles each kernel's epilogue keeps in shared memory, fitted to what triton 3.6
# allocates (within 64 bytes over every tile above): forward one (pre and h reuse it), backward two (pre, dpre)
_EPI_TILES = {"fwd": 1, "bwd": 2}


def _configs():
    tiles = [_CPU_TILE] if _INTERPRET else _TILES
    g = 2 if _INTERPRET else GROUP_M
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": g, "EPI_SPLIT": e}, num_warps=w,
                          num_stages=s) for m, n, k, w, s, e in tiles]


def _pruner(kind):
    def prune(configs, named_args, **kwargs):
        if _INTERPRET:
            return configs
        es = named_args["W"].element_size()
        small_m = named_args["M_BUCKET"] <= 64  # 128-row tiles would be half padding

        def fits(c):
            bm, bn, bk = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
            smem = (c.num_stages * (bm + bn) * bk + _EPI_TILES[kind] * bm * bn // c.kwargs["EPI_SPLIT"]) * es
            return smem <= SMEM_BYTES and (bm == 64 or not small_m)
        return [c for c in configs if fits(c)] or configs[-1:]
    return {"early_config_prune": prune}


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels

_LOG2E = tl.constexpr(1.4426950408889634)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_KAPPA = tl.constexpr(0.044715)


@triton.jit
def _tanh(u):
    """tanh(u) = 1 - 2 / (e^(2u) + 1) in fp32; u capped at 20 (tanh(20) is 1 in fp32) so e^(2u) stays finite,
    and e^(2u) -> 0 gives -1."""
    return 1.0 - 2.0 / (tl.exp2(tl.minimum(u, 20.0) * (2.0 * _LOG2E)) + 1.0)


@triton.jit
def _gelu_tanh(z):
    return 0.5 * z * (1.0 + _tanh(_SQRT_2_OVER_PI * z * (1.0 + _KAPPA * z * z)))


@triton.jit
def _gelu_tanh_grad(z):
    """d gelu_tanh(z) / dz, the same expression as PyTorch's GeluBackward (approximate='tanh')."""
    z2 = z * z
    t = _tanh(_SQRT_2_OVER_PI * z * (1.0 + _KAPPA * z2))
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _KAPPA * z2)


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped tile order: tiles walk down GROUP_M tile rows, then to the next column, so programs running at
    the same time share w's column tiles and x's row tiles in L2."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % rows
    pid_n = (tile % per_group) // rows
    return pid_m, pid_n


@triton.jit
def _split_n(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_M, BLOCK_N) -> its left and right (BLOCK_M, BLOCK_N / 2) halves (in registers: no data moves)."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _fwd_epilogue(acc, B, pre_desc, h_desc, off_m, off_n, N, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc (BLOCK_M, BLOCK_N) fp32 = x @ w^T for columns [off_n, off_n + BLOCK_N): store pre and gelu(pre)."""
    if HAS_BIAS:
        cols = off_n + tl.arange(0, BLOCK_N)
        acc += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    pre = acc.to(pre_desc.dtype)
    pre_desc.store([off_m, off_n], pre)  # rows >= M, cols >= N are clipped
    # GELU of pre as stored, so that h and the backward's gelu'(pre) see the same value
    h_desc.store([off_m, off_n], _gelu_tanh(pre.to(tl.float32)).to(h_desc.dtype))


@triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K"], prune_configs_by=_pruner("fwd"))
@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _fc_gelu_fwd(X, W, B, PRE, H, M, N, K, M_BUCKET,
                 HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_SMS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 EPI_SPLIT: tl.constexpr):
    """PRE = X @ W^T + B (M, N) and H = gelu_tanh(PRE); X (M, K), W (N, K), all rows contiguous. M_BUCKET: the
    autotuner's key only. EPI_SPLIT = 2: the epilogue runs on two column halves of the tile, one after the other
    (fewer live registers, half-width TMA store buffers)."""
    BLOCK_E: tl.constexpr = BLOCK_N // EPI_SPLIT  # epilogue tile width
    x_desc = tl.make_tensor_descriptor(X, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(W, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    pre_desc = tl.make_tensor_descriptor(PRE, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_E])
    h_desc = tl.make_tensor_descriptor(H, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_E])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([off_m, ki * BLOCK_K])  # (BLOCK_M, BLOCK_K), zero past M and K
            b = w_desc.load([off_n, ki * BLOCK_K])  # (BLOCK_N, BLOCK_K): w is K-major, as wgmma wants B
            acc = tl.dot(a, b.T, acc, input_precision=DOT_PRECISION)
        if EPI_SPLIT == 2:
            acc0, acc1 = _split_n(acc, BLOCK_M, BLOCK_N)
            _fwd_epilogue(acc0, B, pre_desc, h_desc, off_m, off_n, N, HAS_BIAS, BLOCK_E)
            _fwd_epilogue(acc1, B, pre_desc, h_desc, off_m, off_n + BLOCK_E, N, HAS_BIAS, BLOCK_E)
        else:
            _fwd_epilogue(acc, B, pre_desc, h_desc, off_m, off_n, N, HAS_BIAS, BLOCK_E)


@triton.jit
def _prefetch_l2(BASE, off_m, off_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Ask L2 for the (BLOCK_M, BLOCK_N) tile at (off_m, off_n) of the row-major (M, N) tensor at BASE: one
    `prefetch.global.L2` per 128-byte line (2 per thread for a 128 x 256 bf16 tile). A hint only (no result)."""
    LINE: tl.constexpr = 1024 // BASE.dtype.element_ty.primitive_bitwidth  # elements per 128-byte line
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N // LINE) * LINE
    ptrs = BASE + rows.to(tl.int64)[:, None] * N + cols[None, :]
    ptrs = tl.where((rows < M)[:, None] & (cols < N)[None, :], ptrs, BASE)  # out of range: the (valid) base
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _bwd_epilogue(acc, pre_desc, dpre_desc, PART, pid_m, off_m, off_n, N, PART_ROWS, R: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """acc (BLOCK_M, BLOCK_N) fp32 = dy @ w for columns [off_n, off_n + BLOCK_N): store dpre = acc * gelu'(pre)
    and its fp32 column sums into PART row pid_m * R (zeros into the R - 1 rows after it)."""
    # rows >= M: dy was zero-filled, so dh = 0 there and (pre zero-filled too) dpre = 0: the sums need no mask
    dpre = acc * _gelu_tanh_grad(pre_desc.load([off_m, off_n]).to(tl.float32))
    dpre_desc.store([off_m, off_n], dpre.to(dpre_desc.dtype))
    colsum = tl.sum(dpre, axis=0)  # (BLOCK_N,) fp32
    cols = off_n + tl.arange(0, BLOCK_N)
    if R == 1:
        tl.store(PART + pid_m * N + cols, colsum, mask=cols < N)
    else:
        r = tl.arange(0, R)
        rows = pid_m * R + r
        vals = tl.where(r[:, None] == 0, colsum[None, :], 0.0)  # (R, BLOCK_N)
        tl.store(PART + rows[:, None] * N + cols[None, :], vals, mask=(rows < PART_ROWS)[:, None] &
                 (cols < N)[None, :])


@triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K"], prune_configs_by=_pruner("bwd"))
@triton.jit(do_not_specialize=["M", "M_BUCKET", "PART_ROWS"])
def _proj_dgelu_bwd(DY, W, PRE, DPRE, PART, M, N, K, PART_ROWS, M_BUCKET,
                    DOT_PRECISION: tl.constexpr, NUM_SMS: tl.constexpr, PART_M: tl.constexpr, PREFETCH: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    EPI_SPLIT: tl.constexpr):
    """DPRE = (DY @ W) * gelu_tanh'(PRE) (M, N), DY (M, K), W (K, N); PART (PART_ROWS, N) fp32 gets, per tile, the
    column sums of its fp32 DPRE in row pid_m * BLOCK_M / PART_M and zeros in the tile's other rows.
    PREFETCH (GPU only: inline PTX): before its K loop, a tile asks L2 for its PRE tile, so that the epilogue's TMA
    load of PRE, which waits at once (Triton does not pipeline the epilogue's load in the flattened loop), hits L2
    instead of waiting a DRAM round trip. Holding PRE in registers across the K loop instead spilled 768 bytes at
    128 x 256."""
    BLOCK_E: tl.constexpr = BLOCK_N // EPI_SPLIT
    R: tl.constexpr = BLOCK_M // PART_M  # partial rows per tile
    dy_desc = tl.make_tensor_descriptor(DY, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(W, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    pre_desc = tl.make_tensor_descriptor(PRE, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_E])
    dpre_desc = tl.make_tensor_descriptor(DPRE, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_E])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if PREFETCH:
            _prefetch_l2(PRE, off_m, off_n, M, N, BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = dy_desc.load([off_m, ki * BLOCK_K])  # (BLOCK_M, BLOCK_K)
            b = w_desc.load([ki * BLOCK_K, off_n])  # (BLOCK_K, BLOCK_N): w_proj is N-major
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if EPI_SPLIT == 2:
            acc0, acc1 = _split_n(acc, BLOCK_M, BLOCK_N)
            _bwd_epilogue(acc0, pre_desc, dpre_desc, PART, pid_m, off_m, off_n, N, PART_ROWS, R, BLOCK_E)
            _bwd_epilogue(acc1, pre_desc, dpre_desc, PART, pid_m, off_m, off_n + BLOCK_E, N, PART_ROWS, R, BLOCK_E)
        else:
            _bwd_epilogue(acc, pre_desc, dpre_desc, PART, pid_m, off_m, off_n, N, PART_ROWS, R, BLOCK_E)


# ---------------------------------------------------------------------------------------------------------------
# Launchers (kernels/launch.py: after the first call per specialization, the compiled binaries launch directly)

_fwd, _bwd = fast(_fc_gelu_fwd), fast(_proj_dgelu_bwd)


@functools.lru_cache(maxsize=None)
def _sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 3


def _tma_ready(t):
    """t with contiguous rows and a 16-byte aligned base (copies only if it has neither)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _dot_precision(dtype):
    return "ieee" if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"


def _m_bucket(M):
    return min(triton.next_power_of_2(max(M, 1)), 8192)  # retune per power of 2 up to 8192 rows


def _grid(M, N, sms, meta):
    return (min(sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)


def _check(x2, w_fc, b_fc, w_proj, b_proj):
    C, Hd = x2.shape[1], w_fc.shape[0]
    if w_fc.shape != (Hd, C) or w_proj.shape != (C, Hd) or (b_fc is not None and b_fc.shape != (Hd,)) \
            or (b_proj is not None and b_proj.shape != (C,)):
        raise ValueError(f"mlp: for x (..., {C}) want w_fc ({Hd}, {C}), b_fc ({Hd},), w_proj ({C}, {Hd}), "
                         f"b_proj ({C},); got {tuple(w_fc.shape)}, {None if b_fc is None else tuple(b_fc.shape)}, "
                         f"{tuple(w_proj.shape)}, {None if b_proj is None else tuple(b_proj.shape)}")
    ts = [t for t in (x2, w_fc, b_fc, w_proj, b_proj) if t is not None]
    if any(t.dtype != x2.dtype for t in ts):
        raise ValueError(f"mlp: dtypes differ ({[t.dtype for t in ts]}); outside autocast all must match x")
    if any(t.device != x2.device for t in ts):
        raise ValueError(f"mlp: tensors on several devices ({[str(t.device) for t in ts]})")
    es = x2.element_size()
    if (C * es) % 16 or (Hd * es) % 16:
        raise ValueError(f"mlp: TMA needs 16-byte rows: C={C} and hidden={Hd} must be multiples of {16 // es} "
                         f"for {x2.dtype}")


def mlp_fc_fwd(x2, w_fc, b_fc):
    """x2 (M, C), w_fc (H, C), b_fc (H,) or None -> (pre, h), both (M, H) in x2's dtype."""
    x2, w_fc = _tma_ready(x2), _tma_ready(w_fc)
    M, K = x2.shape
    N = w_fc.shape[0]
    pre = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    h = torch.empty_like(pre)
    if M > 0:
        if x2.is_cuda:
            triton.set_allocator(tma_scratch)
        _fwd[functools.partial(_grid, M, N, _sm_count(x2.device))](
            x2, w_fc, b_fc, pre, h, M, N, K, _m_bucket(M), HAS_BIAS=b_fc is not None,
            DOT_PRECISION=_dot_precision(x2.dtype), NUM_SMS=_sm_count(x2.device))
    return pre, h


def proj_dgelu_bwd(dy2, w_proj, pre, need_bias_grad=True):
    """dy2 (M, C), w_proj (C, H), pre (M, H) -> (dpre (M, H) in pre's dtype, db_fc (H,) in pre's dtype or None).
    db_fc sums the (cdiv(M, PART_M), H) fp32 partials in a fixed order (deterministic)."""
    dy2, w_proj, pre = _tma_ready(dy2), _tma_ready(w_proj), _tma_ready(pre)
    M, K = dy2.shape
    N = w_proj.shape[1]
    dpre = torch.empty((M, N), dtype=pre.dtype, device=pre.device)
    part_rows = triton.cdiv(M, PART_M)
    part = torch.empty((part_rows, N), dtype=torch.float32, device=pre.device)  # every row written by a tile
    if M > 0:
        if dy2.is_cuda:
            triton.set_allocator(tma_scratch)
        _bwd[functools.partial(_grid, M, N, _sm_count(dy2.device))](
            dy2, w_proj, pre, dpre, part, M, N, K, part_rows, _m_bucket(M),
            DOT_PRECISION=_dot_precision(dy2.dtype), NUM_SMS=_sm_count(dy2.device), PART_M=PART_M,
            PREFETCH=dy2.is_cuda)
    db = part.sum(0).to(pre.dtype) if need_bias_grad else None
    return dpre, db


# ---------------------------------------------------------------------------------------------------------------
# Autograd


class MLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_fc, b_fc, w_proj, b_proj):
        x2 = x.reshape(-1, x.shape[-1])  # (M, C)
        _check(x2, w_fc, b_fc, w_proj, b_proj)
        pre, h = mlp_fc_fwd(x2, w_fc, b_fc)  # (M, H) each
        y = F.linear(h, w_proj, b_proj)  # (M, C), cuBLAS
        ctx.save_for_backward(x2, w_fc, w_proj, pre, h)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w_fc, w_proj, pre, h = ctx.saved_tensors
        need_x, need_wfc, need_bfc, need_wproj, need_bproj = ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])  # (M, C)
        dx = dw_fc = db_fc = dw_proj = db_proj = None
        if need_x or need_wfc or need_bfc:
            dpre, db_fc = proj_dgelu_bwd(dy2, w_proj, pre, need_bfc)  # (M, H), (H,)
            if need_x:
                dx = (dpre @ w_fc).view(ctx.x_shape)
            if need_wfc:
                dw_fc = dpre.t() @ x2  # (H, C)
        if need_wproj:
            dw_proj = dy2.t() @ h  # (C, H)
        if need_bproj:
            db_proj = dy2.sum(0)
        return dx, dw_fc, db_fc, dw_proj, db_proj


def _autocast(x, *params):
    """F.linear's autocast rule: under autocast for x's device, every floating tensor in the autocast dtype."""
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return (x,) + params
    dt = torch.get_autocast_dtype(dev)
    return tuple(None if t is None else t.to(dt) for t in (x,) + params)


def mlp_triton(x, w_fc, b_fc, w_proj, b_proj):
    """The fused Triton path on any device (CPU tensors need TRITON_INTERPRET=1), autocast like F.linear. Under
    autocast the weights are cast on every call (eager autocast caches weight casts within a region; here that is
    two ~5 MB copies per layer at GPT-2 124M, a few us)."""
    args = _autocast(x, w_fc, b_fc, w_proj, b_proj)
    with torch.autocast(x.device.type, enabled=False):  # everything is in one dtype now: no recasts inside
        return MLPFunction.apply(*args)


def mlp(x, w_fc, b_fc, w_proj, b_proj):
    """gelu_tanh(x @ w_fc^T + b_fc) @ w_proj^T + b_proj: fused Triton on CUDA tensors, the reference elsewhere."""
    return mlp_triton(x, w_fc, b_fc, w_proj, b_proj) if x.is_cuda else mlp_ref(x, w_fc, b_fc, w_proj, b_proj)


# ---------------------------------------------------------------------------------------------------------------
# Parity + benchmark: python -m kernels.mlp [--quick] [--out FILE]


def _eager(x, w_fc, b_fc, w_proj, b_proj):
    """What PyTorch runs without us: cuBLAS GEMM, GELU pass, cuBLAS GEMM (and, backward, GELU backward + db)."""
    return F.linear(F.gelu(F.linear(x, w_fc, b_fc), approximate="tanh"), w_proj, b_proj)


def _inputs(M, C, dtype, requires_grad=True):
    g = torch.Generator(device="cuda").manual_seed(0)
    ts = [torch.randn(M, C, device="cuda", generator=g), torch.randn(4 * C, C, device="cuda", generator=g) * C ** -0.5,
          0.1 * torch.randn(4 * C, device="cuda", generator=g),
          torch.randn(C, 4 * C, device="cuda", generator=g) * (4 * C) ** -0.5,
          0.1 * torch.randn(C, device="cuda", generator=g)]
    dy = torch.randn(M, C, device="cuda", generator=g).to(dtype)
    return [t.to(dtype).requires_grad_(requires_grad) for t in ts], dy


def _max_errors(fn, ts, dy):
    """Max abs error of y and the five grads of fn against mlp_ref in fp32 on the same (rounded) inputs."""
    def run(fn, ts, dy):
        ts = [t.detach().requires_grad_() for t in ts]
        y = fn(*ts)
        return [y] + list(torch.autograd.grad(y, ts, dy))
    ref = run(mlp_ref, [t.float() for t in ts], dy.float())
    return [(a.float() - r).abs().max().item() for a, r in zip(run(fn, ts, dy), ref)]


def _parity(M, C, dtype):
    ts, dy = _inputs(M, C, dtype)
    fmt = lambda es: ", ".join(f"{e:.2e}" for e in es)  # noqa: E731
    print(f"parity {M}x{C} {str(dtype).split('.')[-1]}: max err vs fp32 ref (y, dx, dw_fc, db_fc, dw_proj, db_proj):"
          f" triton {fmt(_max_errors(mlp, ts, dy))}; eager {fmt(_max_errors(_eager, ts, dy))}")


def _bench_ms(fn):
    for _ in range(3):  # tune / compile outside the graph capture
        fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, return_mode="median")


def _bench(M, C, dtype, compile_ok):
    ts, dy = _inputs(M, C, dtype)
    x, w_fc, b_fc, w_proj, b_proj = ts
    H = 4 * C
    gemm = 2 * M * C * H  # flops of one of the six GEMMs
    rows = []
    with torch.no_grad():  # (a) the fused GEMMs alone vs the same-shape cuBLAS product
        pre, _ = mlp_fc_fwd(x, w_fc, b_fc)
        pairs = {"fc+gelu fwd": (lambda: mlp_fc_fwd(x, w_fc, b_fc), lambda: F.linear(x, w_fc, b_fc)),
                 "proj dgelu bwd": (lambda: proj_dgelu_bwd(dy, w_proj, pre), lambda: torch.mm(dy, w_proj))}
        for name, (ours, cublas) in pairs.items():
            t_o, t_c = _bench_ms(ours), _bench_ms(cublas)
            rows.append(dict(part="gemm", what=name, M=M, C=C, ours_ms=t_o, cublas_ms=t_c,
                             ours_tflops=gemm / t_o / 1e9, cublas_tflops=gemm / t_c / 1e9, ratio=t_c / t_o))
    impls = {"triton": mlp, "eager": _eager}
    if compile_ok:
        impls["compile"] = torch.compile(_eager)
    for name, fn in impls.items():  # (b) the whole block, GPU time (CUDA-graph replay)
        with torch.no_grad():
            t_f = _bench_ms(lambda: fn(*ts))
        t_fb = _bench_ms(lambda: torch.autograd.grad(fn(*ts), ts, dy))
        rows.append(dict(part="mlp", what=name, M=M, C=C, fwd_ms=t_f, fwd_bwd_ms=t_fb,
                         fwd_tflops=2 * gemm / t_f / 1e9, fwd_bwd_tflops=6 * gemm / t_fb / 1e9))
    eager = next(r for r in rows if r["what"] == "eager")
    for r in rows:
        if r["part"] == "mlp":
            r["fwd_vs_eager"] = eager["fwd_ms"] / r["fwd_ms"]
            r["fwd_bwd_vs_eager"] = eager["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="no torch.compile column")
    p.add_argument("--out", help="append JSON lines here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA GPU (tests run the kernels on CPU: pytest tests/test_mlp.py)")
    dtype = torch.bfloat16
    _parity(4096, 768, dtype)
    M, C = 32768, 768  # B=32 x T=1024, GPT-2 124M
    rows = _bench(M, C, dtype, compile_ok=not args.quick)
    dev = torch.cuda.get_device_name()
    print(f"{dev}, M={M}, C={C}, H={4 * C}, bf16; GPU time by CUDA-graph replay (median)")
    print(f"{'GEMM':>16} {'ours ms':>8} {'TFLOP/s':>7} {'cuBLAS ms':>9} {'TFLOP/s':>7} {'ours/cuBLAS':>11}")
    for r in rows:
        if r["part"] == "gemm":
            print(f"{r['what']:>16} {r['ours_ms']:8.4f} {r['ours_tflops']:7.0f} {r['cublas_ms']:9.4f} "
                  f"{r['cublas_tflops']:7.0f} {r['ratio']:10.2f}x")
    print(f"{'MLP':>16} {'fwd ms':>8} {'TFLOP/s':>7} {'vs eager':>8} {'f+b ms':>8} {'TFLOP/s':>7} {'vs eager':>8}")
    for r in rows:
        if r["part"] == "mlp":
            print(f"{r['what']:>16} {r['fwd_ms']:8.4f} {r['fwd_tflops']:7.0f} {r['fwd_vs_eager']:7.2f}x "
                  f"{r['fwd_bwd_ms']:8.4f} {r['fwd_bwd_tflops']:7.0f} {r['fwd_bwd_vs_eager']:7.2f}x")
    print("GEMM rows: the fused kernel (GEMM + its epilogue: bias, GELU / GELU', db_fc partials) against the bare "
          "cuBLAS product of the same shape ('ours/cuBLAS' > 1: ours faster). MLP rows: forward, and forward + the "
          "five input grads (torch.autograd.grad, no .grad accumulation); TFLOP/s counts 2 / 6 GEMMs")
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(dict(r, device=dev, dtype="bfloat16")) + "\n")


if __name__ == "__main__":
    main()
