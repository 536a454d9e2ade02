"""FP8 quantization: amax -> scale -> saturating cast, per tensor, per row, per column (written transposed), per
1x128 and per 128x128 block, in one pass over memory each (per tensor and per column: an amax pass first).
Long file: four kernels for five granularities, their autotuned tiles, the interpreter's fp8 rounding, one reference.

Math, for a group G of elements of x (the whole tensor, a row, a column, 1x128 or 128x128 elements):
    amax  = max_{i in G} |x_i|                 NaNs ignored: they stay NaN in q (and in any GEMM they reach)
    qs    = FP8_MAX / max(amax, AMAX_EPS)      fp32, correctly rounded; all-zero groups get a finite scale
    qs    = 2^floor(log2(qs)) if pow2          (mantissa bits cleared: exact, and s * q is exact in fp32)
    s     = 1 / qs                             the dequantization scale the GEMMs multiply by (x ~= q * s)
    q     = fp8(clamp(x * qs, -FP8_MAX, FP8_MAX))   round to nearest even, saturating at the format's maximum
FP8_MAX: 448 (e4m3), 57344 (e5m2). Scales: fp32 grids (ceil(R/br), ceil(C/bc)) for br x bc blocks; every kernel is
bit-exact to `fp8_quantize_ref`. Delayed: `quantize_tensor(x, amax=a)` scales by a given amax, records x's own.
Prologue (per tensor, kernels/fp8_prologue.py): both passes quantize gelu(x) or x * gelu'(h), made in registers.

Kernels (memory bound; the first two take their tile, warps and walk from the autotuner, per shape and flags):
  _amax_kernel    tile amax, folded with atomic_max into one fp32 (per tensor) or one per column, as int32 bits
  _cast_kernel    per-tensor / per-column scales from those amaxes (or a given amax), cast, store q and/or q^T
                  (the copy the weight-gradient GEMM reads); on request the column sums of x (dY's bias gradient)
  _rows_kernel    per-row amax and cast in one program per BLOCK_M rows (whole rows in registers up to MAX_ROW)
  _blocks_kernel  1x128 or 128x128 blocks, q and q^T from one 128x128 tile (a block of the transpose too)
Callers: nanopara/fp8.py, kernels/fp8_matmul.py (its reference). `fp8_quantize`: Triton on CUDA, the reference
elsewhere; the `quantize_*` launchers force Triton. Casts: cvt.rn.satfinite on the GPU; the interpreter rounds fp8
casts wrongly (notes/triton_cpu.md), so under TRITON_INTERPRET the kernels round to nearest even in integers.
Run: `python -m kernels.fp8_quant` (= `bench/bench_fp8.py --only parity,quant`).
"""
import functools
import itertools
import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from kernels.fp8_prologue import PROLOGUES, apply_prologue, prologue_ref
from kernels.launch import cdiv as _cdiv, fast, next_pow2 as _next_pow2

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
_FORMAT = {E4M3: (3, 7), E5M2: (2, 15)}  # (mantissa bits, exponent bias): the interpreter's exact cast
AMAX_EPS = 1e-12  # all-zero groups: scale from this amax (finite, no NaN; pytorch/ao#3356 was a NaN from amax = 0)
_AMAX_EPS = tl.constexpr(AMAX_EPS)
BLOCK = 128  # DeepSeek-V3's block: 1x128 for activations and gradients, 128x128 for weights
MAX_ROW = 8192  # rows up to this width are quantized from registers; wider ones are read twice (L2)


class FP8Tensors(NamedTuple):
    """A quantized operand: q (R, C) with its scale grid s, and/or its transpose qt (C, R) with st (the scale grid
    of qt, as the GEMM reads it); amax: the group amaxes of the input (per-tensor: (1, 1)), or None."""
    q: Optional[torch.Tensor]
    s: Optional[torch.Tensor]
    qt: Optional[torch.Tensor] = None
    st: Optional[torch.Tensor] = None
    amax: Optional[torch.Tensor] = None
    colsum: Optional[torch.Tensor] = None  # (C,) fp32 column sums of x, where asked (a bias gradient, fp8.py)


def scales_from_amax_ref(amax, dtype, pow2=False):
    """(qs, s): the quantization multiplier and the dequantization scale for these amaxes (fp32, same shape)."""
    a = amax.float().clamp_min(AMAX_EPS)  # NaN stays NaN
    qs = torch.full_like(a, FP8_MAX[dtype]) / a  # not `448.0 / a`: torch computes that as a.reciprocal() * 448
    if pow2:
        qs = (qs.view(torch.int32) & 0x7F800000).view(torch.float32)
    return qs, torch.ones_like(qs) / qs


def fp8_quantize_ref(x, dtype=E4M3, block=None, pow2=False, amax=None):
    """Quantize a 2-D x in blocks of block = (br, bc) elements (None: the whole tensor) -> (q, s, group amax).
    amax (delayed scaling): a scale grid's worth of amaxes to take the scales from instead of x's own."""
    R, C = x.shape
    if block is None:  # one group, also for an empty x (the kernels' (1, 1) scale)
        (br, bc), (gr, gc) = (max(R, 1), max(C, 1)), (1, 1)
    else:
        br, bc = min(block[0], max(R, 1)), min(block[1], max(C, 1))
        gr, gc = _cdiv(R, br), _cdiv(C, bc)
    xf = x.float()
    pad = torch.zeros(gr * br, gc * bc, dtype=torch.float32, device=x.device)
    pad[:R, :C] = xf
    tiles = pad.view(gr, br, gc, bc)  # (row block, row, column block, column)
    group_amax = tiles.abs().nan_to_num(nan=0.0).amax(dim=(1, 3)) if R * C else torch.zeros(gr, gc, device=x.device)
    qs, s = scales_from_amax_ref(group_amax if amax is None else amax.view(gr, gc), dtype, pow2)
    m = FP8_MAX[dtype]
    q = (tiles * qs[:, None, :, None]).clamp(-m, m).view(gr * br, gc * bc)[:R, :C].to(dtype)
    return q, s, group_amax


def fp8_dequantize_ref(q, s, block):
    """q (R, C) fp8 times its scale grid s expanded over blocks of block = (br, bc) -> fp32 (R, C)."""
    R, C = q.shape
    br, bc = block
    full = s.float().repeat_interleave(br, 0)[:R].repeat_interleave(bc, 1)[:, :C]
    return q.float() * full


def block_of(s, R, C):
    """The block (br, bc) a scale grid s (gr, gc) stands for over an (R, C) operand, in this file's conventions:
    rows 1 (gr == R), all (gr == 1) or 128 (gr == ceil(R/128)); columns all (gc == 1) or 128 (gc == ceil(C/128))."""
    gr, gc = s.shape
    rb, cb = _cdiv(R, BLOCK), _cdiv(C, BLOCK)
    if gr not in (R, 1, rb) or gc not in (1, cb):
        raise ValueError(f"fp8: a scale grid of shape {tuple(s.shape)} fits no block of an ({R}, {C}) operand: "
                         f"rows ({R}, 1 or {rb}) x columns (1 or {cb})")
    br = 1 if gr == R else (max(R, 1) if gr == 1 else BLOCK)
    return br, (max(C, 1) if gc == 1 else BLOCK)


# ---------------------------------------------------------------------------------------------------------------
# Triton helpers: NaN-propagating max, scales, the saturating cast


# NaN-propagating max / min as compares and selects, not tl.maximum / tl.minimum(propagate_nan=ALL): those lower
# to PTX max.NaN / min.NaN, and with them in a kernel Triton can mis-lower the transposed 1-byte store of the same
# fp8 tile (garbage bytes, NaN / inf in e4m3 / e5m2: triton-lang/triton#11111; notes/fp8.md). NaN in a: a; NaN in
# b: the compare is false, b. The same values as the max.NaN / min.NaN forms.
@triton.jit
def _max_nan(a, b):
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def _min_nan(a, b):
    return tl.where((a < b) | (a != a), a, b)


@triton.jit
def _amax(x, axis):
    """max |x| along axis (None: all), NaN elements ignored (as they are by fp8_quantize_ref): explicit, so the
    result does not depend on how a max instruction treats NaN."""
    return tl.max(tl.where(x == x, tl.abs(x), 0.0), axis)


@triton.jit
def _scales(amax, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """(qs, s) from amax, exactly as scales_from_amax_ref (correctly rounded divisions, not div.full)."""
    qs = tl.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), _max_nan(amax, _AMAX_EPS))
    if POW2:
        qs = (qs.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return qs, tl.div_rn(tl.full(qs.shape, 1.0, tl.float32), qs)


@triton.jit
def _to_fp8(x, DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
            SOFT: tl.constexpr):
    """Saturate at +-FP8_MAX (NaN stays NaN) and round to nearest even into DTYPE. SOFT: integer arithmetic instead
    of the hardware cast (the interpreter's own cast is wrong)."""
    x = _max_nan(_min_nan(x, FP8_MAX), -FP8_MAX)
    if SOFT:
        a = tl.abs(x)
        bits = a.to(tl.int32, bitcast=True)
        SHIFT: tl.constexpr = 23 - MANT
        # normal: round the fp32 mantissa to MANT bits (RNE; a carry moves into the exponent), rebias the exponent
        normal = ((bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MANT)
        # subnormal: a / 2^(1 - BIAS - MANT) rounded to an integer by the fp32 adder (RNE); 2^MANT = min normal
        small = a < 2.0 ** (1 - BIAS)
        sub = ((tl.where(small, a, 0.0) * 2.0 ** (BIAS + MANT - 1) + 8388608.0) - 8388608.0).to(tl.int32)
        out = tl.where(small, sub, normal)
        out = tl.where(x != x, 0x7F, out) | ((x.to(tl.int32, bitcast=True) >> 24) & 0x80)
        return out.to(tl.uint8).to(DTYPE, bitcast=True)
    return x.to(DTYPE)


# ---------------------------------------------------------------------------------------------------------------
# Tiles of the per-tensor and per-column kernels (_amax_kernel, _cast_kernel), autotuned per shape. They move 2
# (bf16) or 4 (fp32) bytes in and 1 or 2 out per element and are memory bound: what counts is bytes in flight per
# SM. With one fixed 32 x 128 tile on 8 warps an H100 reached 67 % of copy bandwidth for X tensor (+X^T), 47 % for
# the delayed cast and 39 % for the per-column transpose (results/fp8_h100.txt). Two suspects the candidates go
# after: q^T gets BLOCK_M contiguous bytes per row a tile (32 B; 64- and 128-row tiles write 64-128 B runs), and
# every tile's atomic_max (amax pass, RECORD) hits the same word, 4096 of them at 8192 x 2048: bigger tiles and the
# persistent walk (one atomic per program) cut that. Candidates: (BLOCK_M, BLOCK_K) in {32, 64, 128} x {64, 128,
# 256} on 4, 8 or 16 warps, one tile a program or persistent, within the register bounds below (every candidate
# compiles for sm_90a without spills: `bench/bench_fp8.py --ptxas`). Keyed on K, a power-of-2 bucket of M, the
# flags (which stores, RECORD, COLSUM) and the dtypes (the autotuner adds those); timed by CUDA-graph replay.

_PER_THREAD = (8, 64)  # tile elements a thread holds, min and max
# persistent: 16 warps of programs a SM (PROGRAMS_PER_SM = 16 / warps), resident at up to 128 registers a thread,
# so the walk is one wave; its loop keeps more live than one tile (ptxas, q^T and RECORD at 32 elements a thread:
# 145-206 registers or spills), so at most 16 elements a thread
_PERSISTENT_WARPS, _PERSISTENT_PER_THREAD = 16, 16


def _configs(interpret=_INTERPRET):
    """The candidates (interpret: the interpreter's one small tile, several per test shape; tests/test_fp8.py
    also runs every GPU candidate in the interpreter)."""
    if interpret:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_K": 32, "PROGRAMS_PER_SM": 0}, num_warps=4, num_stages=1)]
    configs = []
    for m, k, w in itertools.product((32, 64, 128), (64, 128, 256), (4, 8, 16)):
        n = m * k // (32 * w)  # elements a thread
        # 16 warps: half the bounds. 512 threads get at most 128 registers each, and ptxas spilled there at the
        # full bounds (64 elements with fp32 in; a 16-element walk with bf16 in, q^T and RECORD)
        half = 2 if w == 16 else 1
        if not _PER_THREAD[0] <= n <= _PER_THREAD[1] // half:
            continue
        configs.append(triton.Config({"BLOCK_M": m, "BLOCK_K": k, "PROGRAMS_PER_SM": 0}, num_warps=w, num_stages=1))
        if n <= _PERSISTENT_PER_THREAD // half:
            configs.append(triton.Config({"BLOCK_M": m, "BLOCK_K": k, "PROGRAMS_PER_SM": _PERSISTENT_WARPS // w},
                                         num_warps=w, num_stages=1))
    return configs


def tile_name(cfg):
    """'64x128 w8' (BLOCK_M x BLOCK_K, warps), with ' persistent 2/SM' for a persistent candidate."""
    p = cfg.kwargs["PROGRAMS_PER_SM"]
    return f"{cfg.kwargs['BLOCK_M']}x{cfg.kwargs['BLOCK_K']} w{cfg.num_warps}" + (f" persistent {p}/SM" if p else "")


@functools.lru_cache(maxsize=None)
def _sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _prune(configs, named_args, **kwargs):
    """Per shape: no tile taller than the M bucket or wider than K (above the smallest), no persistent candidate
    with no more tiles than its programs (it would be the one-tile-a-program candidate again); with the GELU
    backward prologue no 16-warp persistent walk (ptxas: 4 B of spills with h, RECORD and COLSUM)."""
    if _INTERPRET:
        return configs
    M, K = named_args["M_BUCKET"], named_args["K"]
    sms = _sm_count(named_args["X"].device)
    two_inputs = kwargs.get("PROLOGUE") == PROLOGUES["gelu_tanh_bwd"]

    def keep(c):
        m, k, p = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_K"], c.kwargs["PROGRAMS_PER_SM"]
        if m > max(32, M) or k > max(64, _next_pow2(K)) or two_inputs and p and c.num_warps == 16:
            return False
        return p == 0 or p * sms // _cdiv(K, k) < _cdiv(M, m)  # as _grid sizes it
    return [c for c in configs if keep(c)] or configs[:1]


def _tune_bench(fn, quantiles=None):
    """The autotuner's timing: CUDA-graph replay, as kernels/layernorm.py's. These kernels run 20-300 us, so
    timing Python launches back to back would time the host too."""
    return triton.testing.do_bench_cudagraph(fn, rep=10, quantiles=quantiles)


def _zero_stale_parts(nargs, reset_only=False):
    """The autotuner's pre-hook of _cast_kernel: before each timed run, and before the launch of its pick, zero the
    COLSUM partial rows this config does not write (rows >= cdiv(M, BLOCK_M)), which a candidate with a smaller
    BLOCK_M wrote while being timed. Everything else a run writes it overwrites, or folds in with atomic_max
    (idempotent: AMAX_OUT, the amax pass's bits), so the timing runs change no result."""
    parts = nargs["CSUM"]
    if parts is not None:
        parts[_cdiv(nargs["M"], nargs["BLOCK_M"]):].zero_()


_TUNE = dict(configs=_configs(), prune_configs_by={"early_config_prune": _prune}, do_bench=_tune_bench)


# ---------------------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _amax_tile(X, H, M, K, stride_xm, pid_m, cols, PER_COL: tl.constexpr, PROLOGUE: tl.constexpr,
               SOFT: tl.constexpr, BLOCK_M: tl.constexpr):
    """The amax of row tile pid_m of one column strip (after the prologue): per column (BLOCK_K,), or one scalar."""
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    offs = rows[:, None] * stride_xm + cols[None, :]
    x = apply_prologue(tl.load(X + offs, mask=mask, other=0.0).to(tl.float32), H, offs, mask, PROLOGUE, SOFT)
    return _amax(x, 0) if PER_COL else _amax(x, None)


@triton.autotune(key=["K", "M_BUCKET", "PER_COL", "PROLOGUE"], **_TUNE)  # + the dtypes (the autotuner adds them)
@triton.jit
def _amax_kernel(X, H, AMAX, M, K, M_BUCKET, stride_xm, PER_COL: tl.constexpr, PROLOGUE: tl.constexpr,
                 SOFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr):
    """Fold the amax of x into AMAX (int32 bits of fp32, zeroed): one value, or one per column (PER_COL). Program
    (i, j) takes row tile i of column strip j; persistent (PROGRAMS_PER_SM > 0, fewer programs along axis 0): also
    the strip's tiles i + n, i + 2n, ... (n = programs along axis 0), keeping a running max, so one atomic per
    program instead of one per tile. M_BUCKET: tuning key only. PROLOGUE (kernels/fp8_prologue.py): the amax of
    gelu(x), or of x * gelu'(h) with h read from H (X's strides), never written."""
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    amax = _amax_tile(X, H, M, K, stride_xm, tl.program_id(0), cols, PER_COL, PROLOGUE, SOFT, BLOCK_M)
    if PROGRAMS_PER_SM > 0:  # a constexpr branch: the loop would cost the one-tile kernel registers
        for pid_m in range(tl.program_id(0) + tl.num_programs(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
            amax = tl.maximum(amax, _amax_tile(X, H, M, K, stride_xm, pid_m, cols, PER_COL, PROLOGUE, SOFT,
                                               BLOCK_M))  # no NaN here
    if PER_COL:
        tl.atomic_max(AMAX + cols, amax.to(tl.int32, bitcast=True), mask=cols < K, sem="relaxed")
    else:
        tl.atomic_max(AMAX, amax.to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _cast_tile(X, H, Q, QT, CSUM, M, K, stride_xm, stride_qm, stride_qtk, pid_m, cols, qs,
               PER_COL: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr, COLSUM: tl.constexpr,
               PROLOGUE: tl.constexpr, FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
               SOFT: tl.constexpr, BLOCK_M: tl.constexpr):
    """Cast row tile pid_m of one column strip (after the prologue) with qs (per column, or a scalar), store q and/or
    q^T and the tile's column sums (row pid_m of CSUM); returns the tile's amax (for RECORD; unused values are
    dropped)."""
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cmask = cols < K
    mask = (rows < M)[:, None] & cmask[None, :]
    offs = rows[:, None] * stride_xm + cols[None, :]
    x = apply_prologue(tl.load(X + offs, mask=mask, other=0.0).to(tl.float32), H, offs, mask, PROLOGUE, SOFT)
    amax = _amax(x, None)  # here, not after the stores, which it would keep x live across (ptxas: ~2x registers)
    if PER_COL:
        y = _to_fp8(x * qs[None, :], Q.dtype.element_ty, FP8_MAX, MANT, BIAS, SOFT)
    else:
        y = _to_fp8(x * qs, Q.dtype.element_ty, FP8_MAX, MANT, BIAS, SOFT)
    if COLSUM:
        tl.store(CSUM + pid_m * K + cols, tl.sum(x, 0), mask=cmask)
    if WRITE_Q:
        tl.store(Q + rows[:, None] * stride_qm + cols[None, :], y, mask=mask)
    if WRITE_QT:
        tl.store(QT + cols[None, :].to(tl.int64) * stride_qtk + rows[:, None], y, mask=mask)
    return amax


@triton.autotune(key=["K", "M_BUCKET", "PER_COL", "WRITE_Q", "WRITE_QT", "RECORD", "COLSUM", "PROLOGUE"],
                 pre_hook=_zero_stale_parts, **_TUNE)
@triton.jit
def _cast_kernel(X, H, Q, QT, S, AMAX, AMAX_OUT, CSUM, M, K, M_BUCKET, stride_xm, stride_qm, stride_qtk,
                 PER_COL: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr, RECORD: tl.constexpr,
                 COLSUM: tl.constexpr, PROLOGUE: tl.constexpr, FP8_MAX: tl.constexpr, MANT: tl.constexpr,
                 BIAS: tl.constexpr, POW2: tl.constexpr, SOFT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr):
    """Cast x with the scale(s) of AMAX (fp32: one, or one per column), store it as q (M, K) and/or as q^T (K, M);
    tiles as _amax_kernel's (persistent or not). Programs with program_id(0) == 0 (their first tile is row tile 0,
    for every tile and grid) write the scales S. RECORD: fold x's amax into AMAX_OUT (delayed scaling: the scale
    came from history, the amax of this x goes into it), one atomic per program. COLSUM: each tile's column sums
    into row pid_m of CSUM (>= cdiv(M, BLOCK_M) rows, the rest zero), summed by the launcher: deterministic.
    PROLOGUE: what is cast, recorded and summed is gelu(x) or x * gelu'(h) (as in _amax_kernel), in fp32."""
    pid_k = tl.program_id(1)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cmask = cols < K
    if PER_COL:
        qs, s = _scales(tl.load(AMAX + cols, mask=cmask, other=0.0), FP8_MAX, POW2)
        if tl.program_id(0) == 0:
            tl.store(S + cols, s, mask=cmask)
    else:
        qs, s = _scales(tl.load(AMAX), FP8_MAX, POW2)
        if (tl.program_id(0) == 0) & (pid_k == 0):
            tl.store(S, s)
    amax = _cast_tile(X, H, Q, QT, CSUM, M, K, stride_xm, stride_qm, stride_qtk, tl.program_id(0), cols, qs,
                      PER_COL, WRITE_Q, WRITE_QT, COLSUM, PROLOGUE, FP8_MAX, MANT, BIAS, SOFT, BLOCK_M)
    if PROGRAMS_PER_SM > 0:  # as in _amax_kernel: the strip's further row tiles, the scales computed once
        for pid_m in range(tl.program_id(0) + tl.num_programs(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
            amax = tl.maximum(amax, _cast_tile(X, H, Q, QT, CSUM, M, K, stride_xm, stride_qm, stride_qtk, pid_m,
                                               cols, qs, PER_COL, WRITE_Q, WRITE_QT, COLSUM, PROLOGUE, FP8_MAX, MANT,
                                               BIAS, SOFT, BLOCK_M))
    if RECORD:
        tl.atomic_max(AMAX_OUT, amax.to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _rows_kernel(X, Q, S, M, K, stride_xm, stride_qm,
                 FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, POW2: tl.constexpr,
                 SOFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per-row scales: rows [pid * BLOCK_M, +BLOCK_M), amax walk then cast walk (one walk if K <= BLOCK_K)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rmask = rows < M
    cols = tl.arange(0, BLOCK_K)
    x_rows = X + rows[:, None] * stride_xm
    if K <= BLOCK_K:  # whole rows in registers: one read
        mask = rmask[:, None] & (cols < K)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        qs, s = _scales(_amax(x, 1), FP8_MAX, POW2)
        tl.store(Q + rows[:, None] * stride_qm + cols[None, :],
                 _to_fp8(x * qs[:, None], Q.dtype.element_ty, FP8_MAX, MANT, BIAS, SOFT), mask=mask)
    else:  # the second walk reads the rows again, mostly from L2
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = rmask[:, None] & ((k0 + cols) < K)[None, :]
            x = tl.load(x_rows + k0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, _amax(x, 1))
        qs, s = _scales(amax, FP8_MAX, POW2)
        for k0 in range(0, K, BLOCK_K):
            mask = rmask[:, None] & ((k0 + cols) < K)[None, :]
            x = tl.load(x_rows + k0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(Q + rows[:, None] * stride_qm + k0 + cols[None, :],
                     _to_fp8(x * qs[:, None], Q.dtype.element_ty, FP8_MAX, MANT, BIAS, SOFT), mask=mask)
    tl.store(S + rows, s, mask=rmask)


@triton.jit
def _blocks_kernel(X, Q, S, QT, ST, CSUM, M, K, stride_xm, stride_qm, stride_qtk, stride_sm, stride_sk, stride_stk,
                   stride_stm, TILE_SCALE: tl.constexpr, WRITE_QT: tl.constexpr, COLSUM: tl.constexpr,
                   FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, POW2: tl.constexpr,
                   SOFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (BLOCK_M, BLOCK_K = 128) tile. TILE_SCALE (128x128, BLOCK_M = 128): one scale, S[pid_m, pid_k]; q and
    (WRITE_QT) q^T share it. Else 1x128: a scale per row, S[m, pid_k]; with WRITE_QT (BLOCK_M = 128) also a scale
    per column for q^T's 1x128 blocks along the rows, ST[k, pid_m]. q^T is stored from the (BLOCK_M, BLOCK_K) tile
    through transposed addresses (Triton moves it through shared memory for coalesced stores), never tl.trans of an
    fp8 tile: with min.NaN / max.NaN in the kernel that store is a known Hopper miscompile (garbage bytes; triton-
    lang/triton#11111; mlc-ai/pith-train#74 saw tl.trans corrupt fp8 tiles by itself), the likely cause of the
    wrong W^T behind block mode's dgrad NaN at gpt_1b's shapes (notes/fp8.md)."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask, cmask = rows < M, cols < K
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if COLSUM:  # as _cast_kernel's
        tl.store(CSUM + pid_m * K + cols, tl.sum(x, 0), mask=cmask)
    if TILE_SCALE:
        qs, s = _scales(_amax(x, None), FP8_MAX, POW2)
        y = _to_fp8(x * qs, Q.dtype.element_ty, FP8_MAX, MANT, BIAS, SOFT)
        tl.store(S + pid_m * stride_sm + pid_k * stride_sk, s)
        tl.store(Q + rows[:, None] * stride_qm + cols[None, :], y, mask=mask)
        if WRITE_QT:
            tl.store(QT + cols[None, :].to(tl.int64) * stride_qtk + rows[:, None], y, mask=mask)
    else:
        qs, s = _scales(_amax(x, 1), FP8_MAX, POW2)
        tl.store(Q + rows[:, None] * stride_qm + cols[None, :],
                 _to_fp8(x * qs[:, None], Q.dtype.element_ty, FP8_MAX, MANT, BIAS, SOFT), mask=mask)
        tl.store(S + rows * stride_sm + pid_k * stride_sk, s, mask=rmask)
        if WRITE_QT:
            qs_t, s_t = _scales(_amax(x, 0), FP8_MAX, POW2)
            yt = _to_fp8(x * qs_t[None, :], QT.dtype.element_ty, FP8_MAX, MANT, BIAS, SOFT)
            tl.store(QT + cols[None, :].to(tl.int64) * stride_qtk + rows[:, None], yt, mask=mask)
            tl.store(ST + cols * stride_stk + pid_m * stride_stm, s_t, mask=cmask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers. The per-tensor and per-column kernels take their tile from the autotuner (above); the rows and blocks
# kernels have fixed tiles. ptxas, sm_90a (`bench/bench_fp8.py --ptxas`): a 128 x 128 block tile with its transpose
# takes 98 (1x128) / 55 (128x128) registers on 16 warps, ~200 on 8. The interpreter runs small tiles.

_amax_k, _cast_k, _rows_k, _blocks_k = fast(_amax_kernel), fast(_cast_kernel), fast(_rows_kernel), fast(_blocks_kernel)
# COLSUM's partials have a row per row tile of the smallest candidate: a larger tile leaves rows at zero (see
# _zero_stale_parts), and the sum stays deterministic (no atomics)
PARTS_BLOCK_M = min(c.kwargs["BLOCK_M"] for c in _cast_kernel.configs)
WARPS = 8  # warps of a 64 x 128 1x128 tile (no transpose)
BLOCK_WARPS = 16  # warps of a 128 x 128 block tile (1x128 with its transpose, 128x128)


def _as_rows(x):
    """x as (R, C) with unit column stride (copies only a strided last dim)."""
    if x.dim() != 2:
        raise ValueError(f"fp8 quantize: expected a 2-D tensor, got shape {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_dtype(x, dtype):
    if dtype not in FP8_MAX:
        raise ValueError(f"fp8 quantize: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"fp8 quantize: input must be fp32, bf16 or fp16, got {x.dtype}")


_FMT = {}


def _fmt(dtype, pow2):
    """The format constexprs, built once per (dtype, pow2); callers unpack the dict (**), never change it."""
    key = (dtype, bool(pow2))
    fmt = _FMT.get(key)
    if fmt is None:
        mant, bias = _FORMAT[dtype]
        fmt = _FMT[key] = dict(FP8_MAX=FP8_MAX[dtype], MANT=mant, BIAS=bias, POW2=bool(pow2), SOFT=_INTERPRET)
    return fmt


def _prologue_input(x, prologue, h):
    """(x, the kernels' H): for "gelu_tanh_bwd" h, checked (x's shape and device, a float dtype) and read with x's
    strides (both made contiguous where they differ); else x itself, a placeholder the kernels never read."""
    if prologue not in PROLOGUES:
        raise ValueError(f"fp8 quantize: prologue must be one of {list(PROLOGUES)}, got {prologue!r}")
    if prologue != "gelu_tanh_bwd":
        return x, x
    if h is None or h.shape != x.shape or h.device != x.device or not h.dtype.is_floating_point:
        raise ValueError(f"fp8 quantize: the gelu_tanh_bwd prologue needs h of x's shape {tuple(x.shape)} and device"
                         f", got {None if h is None else (tuple(h.shape), h.device, h.dtype)}")
    return (x, h) if h.stride() == x.stride() else (x.contiguous(), h.contiguous())


def _amax_bits(n, device):
    """Zeroed int32 buffer (1, n) for the atomic amax (bits of non-negative fp32: 0 is +0.0); the kernels see only
    its address, the (1, n) shape is the amax the launchers return (one view, no reshape)."""
    return torch.zeros(1, n, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=None)
def _rows_tile(K):
    """quantize_rows' (BLOCK_M, BLOCK_K, num_warps) for rows of K elements."""
    block_k = min(_next_pow2(max(K, 1)), 64 if _INTERPRET else MAX_ROW)
    block_m = max(1, min(16 if _INTERPRET else 8, (4096 if not _INTERPRET else 512) // block_k))
    return block_m, block_k, 4 if block_k <= 1024 else 8


def _parts(colsum, tiles_m, K, device):
    """The (tiles_m, K) fp32 column-sum partials a cast kernel writes with COLSUM (None: not asked), zeroed."""
    return torch.zeros(max(tiles_m, 1), K, dtype=torch.float32, device=device) if colsum else None


def _m_bucket(M):
    """The tuning key's M: rounded up to a power of 2 (>= 32). Unused inside the kernels."""
    return max(32, _next_pow2(M))


def _grid(M, K, sms, meta):
    """(row programs, column strips) for the tuner's tile: one program per tile, or (persistent) about
    PROGRAMS_PER_SM x SMs programs, each walking its column strip; never more row programs than row tiles, always
    every column strip (so the programs with program_id(0) == 0 cover row tile 0: they write the scales)."""
    tiles_m, tiles_k = _cdiv(M, meta["BLOCK_M"]), _cdiv(K, meta["BLOCK_K"])
    per_sm = meta["PROGRAMS_PER_SM"]
    return (tiles_m if per_sm == 0 else max(1, min(tiles_m, per_sm * sms // tiles_k)), tiles_k)


def quantize_tensor(x, dtype=E4M3, pow2=False, amax=None, write_q=True, transpose=False, colsum=False,
                    prologue=None, h=None):
    """Per-tensor scale. amax=None: x's own (an amax pass, then the cast); else the given fp32 amax (delayed
    scaling), and x's amax is recorded for the history in one pass. Returns FP8Tensors(q or None, s (1, 1),
    qt (K, M) or None, st = s, amax (1, 1) of x, colsum: x's column sums (K,) fp32 if asked, from the cast pass).
    prologue (kernels/fp8_prologue.py): "gelu_tanh" quantizes gelu(x), "gelu_tanh_bwd" x * gelu'(h) (h: x's
    shape), computed in fp32 in both passes and never written; amax and colsum are then those of that tensor."""
    _check_dtype(x, dtype)
    x = _as_rows(x)
    M, K = x.shape
    x, h = _prologue_input(x, prologue, h)
    q = torch.empty(M, K, dtype=dtype, device=x.device) if write_q else None
    qt = torch.empty(K, M, dtype=dtype, device=x.device) if transpose else None
    s = torch.empty(1, 1, dtype=torch.float32, device=x.device)
    bits = _amax_bits(1, x.device)
    grid, mb = functools.partial(_grid, M, K, _sm_count(x.device)), _m_bucket(M)
    pro = PROLOGUES[prologue]
    if M * K and amax is None:
        _amax_k[grid](x, h, bits, M, K, mb, x.stride(0), PER_COL=False, PROLOGUE=pro, SOFT=_INTERPRET)
    own = bits.view(torch.float32)  # (1, 1)
    given = own if amax is None else amax.float().reshape(1).contiguous()
    parts = _parts(colsum, _cdiv(M, PARTS_BLOCK_M), K, x.device)
    if M * K:
        _cast_k[grid](x, h, q if write_q else qt, qt, s, given, bits, parts, M, K, mb, x.stride(0), K, M,
                      PER_COL=False, WRITE_Q=write_q, WRITE_QT=transpose, RECORD=amax is not None, COLSUM=colsum,
                      PROLOGUE=pro, **_fmt(dtype, pow2))
    else:
        s.copy_(scales_from_amax_ref(given.view(1, 1), dtype, pow2)[1])
    return FP8Tensors(q, s, qt, s if transpose else None, own, parts.sum(0) if colsum else None)


def quantize_cols_t(x, dtype=E4M3, pow2=False, colsum=False):
    """Per-column scales, written transposed: FP8Tensors(None, None, qt (K, M), st (K, 1)) (rows of qt = columns of
    x). Two passes: the column amaxes need every row first. colsum: x's column sums from the cast pass."""
    _check_dtype(x, dtype)
    x = _as_rows(x)
    M, K = x.shape
    qt = torch.empty(K, M, dtype=dtype, device=x.device)
    st = torch.empty(K, 1, dtype=torch.float32, device=x.device)
    bits = _amax_bits(K, x.device)
    own = bits.view(torch.float32)  # (1, K)
    grid, mb = functools.partial(_grid, M, K, _sm_count(x.device)), _m_bucket(M)
    parts = _parts(colsum, _cdiv(M, PARTS_BLOCK_M), K, x.device)
    if M * K:
        _amax_k[grid](x, x, bits, M, K, mb, x.stride(0), PER_COL=True, PROLOGUE=0, SOFT=_INTERPRET)
        _cast_k[grid](x, x, qt, qt, st, own, bits, parts, M, K, mb, x.stride(0), K, M, PER_COL=True,
                      WRITE_Q=False, WRITE_QT=True, RECORD=False, COLSUM=colsum, PROLOGUE=0, **_fmt(dtype, pow2))
    else:
        st.copy_(scales_from_amax_ref(torch.zeros(K, 1, device=x.device), dtype, pow2)[1])
    return FP8Tensors(None, None, qt, st, own, parts.sum(0) if colsum else None)


def quantize_rows(x, dtype=E4M3, pow2=False):
    """Per-row scales: FP8Tensors(q (M, K), s (M, 1))."""
    _check_dtype(x, dtype)
    x = _as_rows(x)
    M, K = x.shape
    q = torch.empty(M, K, dtype=dtype, device=x.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M == 0:
        return FP8Tensors(q, s)
    block_m, block_k, warps = _rows_tile(K)
    _rows_k[(_cdiv(M, block_m),)](x, q, s, M, K, x.stride(0), q.stride(0), **_fmt(dtype, pow2),
                                  BLOCK_M=block_m, BLOCK_K=block_k, num_warps=warps)
    return FP8Tensors(q, s)


def _scale_grid_kmajor(R, nb, device):
    """An (R, nb) fp32 scale grid stored block-column-major (stride (1, R)): the GEMM's K loop reads the R scales
    of one K block as one contiguous vector (DeepGEMM's layout for activation scales)."""
    return torch.empty(nb, R, dtype=torch.float32, device=device).t()


def quantize_1x128(x, dtype=E4M3, pow2=False, transpose=False, colsum=False):
    """1x128 blocks along the rows: FP8Tensors(q (M, K), s (M, ceil(K/128))); with transpose also q^T (K, M) in
    1x128 blocks along ITS rows (128 consecutive rows of x), st (K, ceil(M/128)). One pass over 128x128 tiles.
    colsum: x's column sums from the same pass."""
    _check_dtype(x, dtype)
    x = _as_rows(x)
    M, K = x.shape
    kb, mb = _cdiv(K, BLOCK), _cdiv(M, BLOCK)
    q = torch.empty(M, K, dtype=dtype, device=x.device)
    s = _scale_grid_kmajor(M, kb, x.device)
    qt = torch.empty(K, M, dtype=dtype, device=x.device) if transpose else None
    st = _scale_grid_kmajor(K, mb, x.device) if transpose else None
    block_m = BLOCK if transpose else (32 if _INTERPRET else 64)
    parts = _parts(colsum, _cdiv(M, block_m), K, x.device)
    if M * K:
        _blocks_k[(_cdiv(M, block_m), kb)](
            x, q, s, qt, st, parts, M, K, x.stride(0), q.stride(0), M, s.stride(0), s.stride(1),
            0 if st is None else st.stride(0), 0 if st is None else st.stride(1), TILE_SCALE=False,
            WRITE_QT=transpose, COLSUM=colsum, **_fmt(dtype, pow2), BLOCK_M=block_m, BLOCK_K=BLOCK,
            num_warps=BLOCK_WARPS if transpose else WARPS)
    return FP8Tensors(q, s, qt, st, None, parts.sum(0) if colsum else None)


def quantize_128x128(x, dtype=E4M3, pow2=False, transpose=False):
    """128x128 blocks: FP8Tensors(q (N, K), s (ceil(N/128), ceil(K/128))); with transpose also q^T (K, N) and
    st = s^T (the same blocks, seen from the transpose). One pass."""
    _check_dtype(x, dtype)
    x = _as_rows(x)
    M, K = x.shape
    mb, kb = _cdiv(M, BLOCK), _cdiv(K, BLOCK)
    q = torch.empty(M, K, dtype=dtype, device=x.device)
    s = torch.empty(mb, kb, dtype=torch.float32, device=x.device)
    qt = torch.empty(K, M, dtype=dtype, device=x.device) if transpose else None
    if M * K:
        _blocks_k[(mb, kb)](x, q, s, qt, None, None, M, K, x.stride(0), q.stride(0), M, s.stride(0), s.stride(1),
                            0, 0, TILE_SCALE=True, WRITE_QT=transpose, COLSUM=False, **_fmt(dtype, pow2),
                            BLOCK_M=BLOCK, BLOCK_K=BLOCK, num_warps=BLOCK_WARPS)
    return FP8Tensors(q, s, qt, s.t() if transpose else None)


# ---------------------------------------------------------------------------------------------------------------
# Public op: one name per granularity, Triton on CUDA, the reference elsewhere

GRANULARITIES = ("tensor", "row", "col", "1x128", "128x128")


def _ref(x, dtype, granularity, pow2, transpose, amax, colsum=False, prologue=None, h=None):
    """The reference behind fp8_quantize, returning what the matching launcher returns."""
    x = prologue_ref(x, prologue, h)
    M, K = x.shape
    if granularity == "tensor":
        q, s, own = fp8_quantize_ref(x, dtype, None, pow2, amax)
        return FP8Tensors(q, s, q.t().contiguous() if transpose else None, s if transpose else None, own,
                          x.sum(0, dtype=torch.float32) if colsum else None)
    if granularity == "row":
        q, s, _ = fp8_quantize_ref(x, dtype, (1, K), pow2)
        return FP8Tensors(q, s)
    cs = x.sum(0, dtype=torch.float32) if colsum else None
    if granularity == "col":
        qt, st, own = fp8_quantize_ref(x.t(), dtype, (1, M), pow2)
        return FP8Tensors(None, None, qt, st, own.t(), cs)
    if granularity == "1x128":
        q, s, _ = fp8_quantize_ref(x, dtype, (1, BLOCK), pow2)
        if not transpose:
            return FP8Tensors(q, s, None, None, None, cs)
        qt, st, _ = fp8_quantize_ref(x.t(), dtype, (1, BLOCK), pow2)
        return FP8Tensors(q, s, qt, st, None, cs)
    q, s, _ = fp8_quantize_ref(x, dtype, (BLOCK, BLOCK), pow2)
    return FP8Tensors(q, s, q.t().contiguous() if transpose else None, s.t() if transpose else None)


def fp8_quantize(x, dtype=E4M3, granularity="tensor", pow2=False, transpose=False, amax=None, triton_path=None,
                 colsum=False, prologue=None, h=None):
    """Quantize a 2-D x. granularity: tensor | row | col (per column, returned transposed as qt) | 1x128 | 128x128;
    transpose: also q^T (tensor, 1x128, 128x128); amax: delayed scaling (tensor only); colsum: x's column sums
    (fp32) from the same pass (tensor, col, 1x128: dY's bias gradient). prologue (tensor only): quantize gelu(x)
    ("gelu_tanh") or x * gelu'(h) ("gelu_tanh_bwd") instead of x (quantize_tensor). triton_path: None = Triton on
    CUDA, the reference elsewhere; True forces the kernels (CPU: TRITON_INTERPRET=1)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"fp8_quantize: granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if amax is not None and granularity != "tensor":
        raise ValueError("fp8_quantize: delayed scaling (amax=) is per tensor only")
    if colsum and granularity not in ("tensor", "col", "1x128"):
        raise ValueError("fp8_quantize: colsum is for the granularities dY takes: tensor, col, 1x128")
    if transpose and granularity in ("row", "col"):
        raise ValueError("fp8_quantize: per-row scales of x are per-column scales of x^T: use granularity='col'")
    if prologue is not None and granularity != "tensor":
        raise ValueError("fp8_quantize: a prologue is per tensor only (the FP8 MLP's tensor mode)")
    if not (x.is_cuda if triton_path is None else triton_path):
        _check_dtype(x, dtype)
        _prologue_input(x, prologue, h)
        return _ref(x, dtype, granularity, pow2, transpose, amax, colsum, prologue, h)
    if granularity == "tensor":
        return quantize_tensor(x, dtype, pow2, amax, transpose=transpose, colsum=colsum, prologue=prologue, h=h)
    if granularity == "row":
        return quantize_rows(x, dtype, pow2)
    if granularity == "col":
        return quantize_cols_t(x, dtype, pow2, colsum)
    if granularity == "1x128":
        return quantize_1x128(x, dtype, pow2, transpose, colsum)
    return quantize_128x128(x, dtype, pow2, transpose)


# ---------------------------------------------------------------------------------------------------------------
# Parity + benchmark: python -m kernels.fp8_quant [--quick] [--out FILE]: bench/bench_fp8.py --only parity,quant

if __name__ == "__main__":
    import runpy
    import sys
    sys.argv = [sys.argv[0], "--only", "parity,quant", *sys.argv[1:]]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runpy.run_path(os.path.join(root, "bench", "bench_fp8.py"), run_name="__main__")
