"""Flash attention (causal and non-causal), forward and backward, in Triton; the op the model calls.
Long file: forward, the two backward kernels and the ring-attention block entry points share tiles and launchers.

Math (per batch b and head h; q: (Tq, D), k, v: (Tk, D), scale = sm_scale, default 1/sqrt(D)):
    S   = scale * q @ k^T                      (Tq, Tk)   causal: S[i, j] = -inf for j > i  (needs Tq == Tk)
    lse = logsumexp(S, dim=-1)                 (Tq,)      natural log, fp32
    P   = exp(S - lse[:, None]);  out = P @ v  (Tq, D)
Backward (FlashAttention-2, Dao 2023, Alg. 2): delta = rowsum(dout * out); dP = dout @ v^T;
    dS = P * (dP - delta[:, None]);  dq = scale * dS @ k;  dk = scale * dS^T @ q;  dv = P^T @ dout
Forward: the online softmax in base 2 (log2(e) folded into the scale); a causal query block visits the key blocks
left of its diagonal unmasked, masks only the diagonal ones, never loads those right of it. Backward without
atomics: a dq kernel per query block (it also stores delta), then a dk/dv kernel per key block; P is recomputed
from the given lse, so merged (ring attention) out and lse work. Tiles load through pointers up to head dim 64 and
through TMA descriptors from 128 (`TMA_MIN_BLOCK_D`: faster there, slower at 64).
Shapes: q (B, H, Tq, D), k, v (B, H, Tk, D), any strides (views of a packed qkv are read in place); bf16/fp16
(fp32: tf32 dots), fp32 accumulation; out and grads are (B, H, T, D) views of (B, T, H, D) memory, so merging heads
is a free view; lse (B, H, Tq) fp32. Any length (masked tails); head dims not a power of 2 are padded in-kernel.
Backend choice: on Hopper the forward and the dK/dV kernel are kernels/attention_hopper.py's Gluon kernels where
it supports the call (the forward's first call per shape also times this file's forward, passed in as `fallback`,
and keeps the faster); the dq kernel is always this file's. NANOPARA_ATTN_HOPPER=0 keeps Triton everywhere.
Callers: nanopara/model.py's `attention_qkv()` over the packed (B, T, 3*H*D) projection (SDPA on CPU);
`attention_block_fwd` / `_bwd` serve one key block (nanopara/ring_attention.py). Tests: tests/test_attention.py.
Run: `python -m kernels.attention [--quick] [--out FILE]`: parity, GPU time and TFLOP/s against cuDNN / flash SDPA.
"""
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.launch import cdiv, fast, next_pow2, tma_scratch

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): converts the kernel's base-2 lse back to natural log


# ---------------------------------------------------------------------------------------------------------------
# Reference: the spec, the test oracle
# ---------------------------------------------------------------------------------------------------------------

def attention_ref(q, k, v, causal=True, sm_scale=None):
    """Plain PyTorch attention in fp32. Returns (out in q's dtype, lse fp32 (B, H, Tq))."""
    _check_inputs(q, k, v, causal)
    scale = sm_scale if sm_scale is not None else q.shape[-1] ** -0.5
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Tq)
    out = torch.matmul(torch.exp(s - lse[..., None]), v.float())  # (B, H, Tq, D)
    return out.to(q.dtype), lse


def _check_inputs(q, k, v, causal):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention wants (B, H, T, D) tensors, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention dtypes disagree: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention devices disagree: {q.device}, {k.device}, {v.device}")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs Tq == Tk (diagonal-aligned mask), got {q.shape[-2]} and "
                         f"{k.shape[-2]}")
    if k.shape[-2] == 0 and q.shape[-2] > 0:
        raise ValueError("attention over zero keys is undefined")


# ---------------------------------------------------------------------------------------------------------------
# Autotune configs: a handful of FA2-style tiles on the GPU, one small tile in the CPU interpreter
# ---------------------------------------------------------------------------------------------------------------

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head-dim class (padded D <= 64, D >= 128). Forward and dq:
# a query block of BLOCK_M rows walks key blocks of BLOCK_N, and the causal split into unmasked and diagonal blocks
# needs BLOCK_M % BLOCK_N == 0; dk/dv: a key block of BLOCK_N walks query blocks of BLOCK_M, BLOCK_N % BLOCK_M == 0.
# Kept: tiles that `ptxas -v` (sm_90a, bf16) compiles with no register spills, or a few dozen bytes; the tiles
# left out spill hundreds to thousands of bytes. A handful per class keeps first-call autotuning to seconds.
_TILES = {
    "fwd": {64: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 4)],
            128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)]},
    "dq": {64: [(128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3)],
           128: [(128, 32, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4)]},
    "dkdv": {64: [(32, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 4)],
             128: [(32, 128, 8, 3), (32, 128, 8, 2), (64, 64, 8, 3), (32, 64, 4, 4)]},
}
_CPU_TILE = {"fwd": (64, 32), "dq": (64, 32), "dkdv": (32, 64)}  # the interpreter: one small tile, no tuning


def _configs(kind):
    tiles = [_CPU_TILE[kind] + (4, 1)] if _INTERPRET else sorted(set(_TILES[kind][64] + _TILES[kind][128]))
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in tiles]


def _pruner(kind):
    def prune(configs, named_args, **kwargs):
        if _INTERPRET:
            return configs
        keep = _TILES[kind][64 if kwargs["BLOCK_D"] <= 64 else 128]
        return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in keep]
    return {"early_config_prune": prune}


# retune per power-of-2 length and per power-of-2 count of (batch, head) pairs: the best tile depends on how many
# programs fill the GPU (tiles tuned on a B=2 H=4 call were 8% slower at the B=16 H=12 training shape, H200)
_KEY = ["CAUSAL", "HEAD_DIM", "TMA", "T_BUCKET", "BH_BUCKET"]
_NO_SPEC = ["Tq", "Tk", "T_BUCKET", "BH_BUCKET"]  # one binary for every length (no recompiles for T % 16, T == 1)


# ---------------------------------------------------------------------------------------------------------------
# Forward kernel
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _tile_descs(A, B, T, stride_at, stride_bt, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """TMA descriptors of two (T, HEAD_DIM) row-major views (one (b, h) of k and v, or of q and dO) read in
    (BLOCK_T, BLOCK_D) tiles: rows past T and columns past HEAD_DIM load as zeros."""
    return (tl.make_tensor_descriptor(A, shape=[T, HEAD_DIM], strides=[stride_at, 1], block_shape=[BLOCK_T, BLOCK_D]),
            tl.make_tensor_descriptor(B, shape=[T, HEAD_DIM], strides=[stride_bt, 1], block_shape=[BLOCK_T, BLOCK_D]))


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, K_base, V_base, k_desc, v_desc, stride_kt, stride_kd, stride_vt, stride_vd,
                    offs_m, offs_d, lo, hi, Tk, qk_scale,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    MASK: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr):
    """Online softmax over key blocks [lo, hi). MASK: mask keys >= Tk (and, if CAUSAL, keys right of the row).
    TMA: k/v tiles through the tensor descriptors (rows past Tk and columns past HEAD_DIM arrive as zeros)."""
    offs_n = lo + tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    kt_ptrs = K_base + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kt  # (BLOCK_D, BLOCK_N)
    v_ptrs = V_base + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd  # (BLOCK_N, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        if TMA:
            kt = tl.trans(k_desc.load([start_n, 0]))
            v = v_desc.load([start_n, 0])
        elif MASK:
            n_ok = (start_n + tl.arange(0, BLOCK_N)) < Tk
            kt = tl.load(kt_ptrs, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif BLOCK_D != HEAD_DIM:
            kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        qk = tl.dot(q, kt)  # (BLOCK_M, BLOCK_N) unscaled scores
        if MASK:
            cols = start_n + tl.arange(0, BLOCK_N)
            keep = cols[None, :] < Tk
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            qk = tl.where(keep, qk, float("-inf"))
        # max of the unscaled scores times the (positive) scale: exp2's argument is then one FMA per score.
        # Every row sees >= 1 key before any all-masked block, so m_new is finite and exp2 never sees inf - inf
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        kt_ptrs += BLOCK_N * stride_kt
        v_ptrs += BLOCK_N * stride_vt
    return acc, l_i, m_i


@triton.autotune(configs=_configs("fwd"), key=_KEY, prune_configs_by=_pruner("fwd"))
@triton.jit(do_not_specialize=_NO_SPEC)
def _attn_fwd_kernel(Q, K, V, O, LSE, qk_scale,
                     stride_qb, stride_qh, stride_qt, stride_qd,
                     stride_kb, stride_kh, stride_kt, stride_kd,
                     stride_vb, stride_vh, stride_vt, stride_vd,
                     stride_ob, stride_oh, stride_ot, stride_od,
                     H, Tq, Tk, T_BUCKET, BH_BUCKET,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:  # the last query blocks have the most keys: launch them first so the tail of the grid is short
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    K_base = K + b * stride_kb + h * stride_kh
    V_base = V + b * stride_vb + h * stride_vh
    k_desc, v_desc = None, None  # pointer loads
    if TMA:
        k_desc, v_desc = _tile_descs(K_base, V_base, Tk, stride_kt, stride_vt, HEAD_DIM, BLOCK_N, BLOCK_D)

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Tq
    d_ok = offs_d < HEAD_DIM
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        # keys [0, m0) lie left of the diagonal for every row of the block: no mask; then the diagonal blocks
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K_base, V_base, k_desc, v_desc, stride_kt, stride_kd,
                                        stride_vt, stride_vd, offs_m, offs_d, 0, m0, Tk, qk_scale,
                                        BLOCK_N, HEAD_DIM, BLOCK_D, False, False, TMA)
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K_base, V_base, k_desc, v_desc, stride_kt, stride_kd,
                                        stride_vt, stride_vd, offs_m, offs_d, m0, tl.minimum(m0 + BLOCK_M, Tk), Tk,
                                        qk_scale, BLOCK_N, HEAD_DIM, BLOCK_D, True, True, TMA)
    else:
        tk_full = (Tk // BLOCK_N) * BLOCK_N  # whole key blocks, then the masked tail
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K_base, V_base, k_desc, v_desc, stride_kt, stride_kd,
                                        stride_vt, stride_vd, offs_m, offs_d, 0, tk_full, Tk, qk_scale,
                                        BLOCK_N, HEAD_DIM, BLOCK_D, False, False, TMA)
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K_base, V_base, k_desc, v_desc, stride_kt, stride_kd,
                                        stride_vt, stride_vd, offs_m, offs_d, tk_full, Tk, Tk, qk_scale,
                                        BLOCK_N, HEAD_DIM, BLOCK_D, True, False, TMA)

    out = acc / l_i[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + pid_bh.to(tl.int64) * Tq + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=m_ok)


# ---------------------------------------------------------------------------------------------------------------
# Backward kernels: dq (+ delta) per query block, then dk/dv per key block
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _grouped_order(pid, n_m, n_programs, CAUSAL: tl.constexpr, GROUP: tl.constexpr):
    """A 1-D grid of n_m query blocks x n_bh (batch, head) pairs -> (query block, pair), in groups of GROUP heads:
    a group's programs run its heads side by side, heaviest query blocks first under the causal mask, so the GPU's
    dispatch order is longest-first across the group's heads (a shorter tail) while the programs in flight share a
    few heads' K and V in L2. GROUP = 1: one head after another."""
    n_bh = n_programs // n_m
    g = pid // (GROUP * n_m)
    g_heads = tl.minimum(GROUP, n_bh - g * GROUP)  # the last group may be short
    r = pid - g * GROUP * n_m
    pid_m = r // g_heads
    if CAUSAL:
        pid_m = n_m - 1 - pid_m
    return pid_m, g * GROUP + r % g_heads


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse2, delta, K_base, V_base, k_desc, v_desc, stride_kt, stride_kd, stride_vt,
                       stride_vd, offs_m, offs_d, lo, hi, Tk, qk_scale,
                       BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       MASK: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr):
    """dq += dS @ k over key blocks [lo, hi) (dq is unscaled here)."""
    offs_n = lo + tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    kt_ptrs = K_base + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kt  # (BLOCK_D, BLOCK_N)
    vt_ptrs = V_base + offs_d[:, None] * stride_vd + offs_n[None, :] * stride_vt  # (BLOCK_D, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        if TMA:
            kt = tl.trans(k_desc.load([start_n, 0]))
            vt = tl.trans(v_desc.load([start_n, 0]))
        elif MASK:
            n_ok = (start_n + tl.arange(0, BLOCK_N)) < Tk
            kt = tl.load(kt_ptrs, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            vt = tl.load(vt_ptrs, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        elif BLOCK_D != HEAD_DIM:
            kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
            vt = tl.load(vt_ptrs, mask=d_ok[:, None], other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            vt = tl.load(vt_ptrs)
        p = tl.exp2(tl.dot(q, kt) * qk_scale - lse2[:, None])  # (BLOCK_M, BLOCK_N) = P, from the given lse
        if MASK:
            cols = start_n + tl.arange(0, BLOCK_N)
            keep = cols[None, :] < Tk
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, vt)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt))  # (BLOCK_M, BLOCK_D)
        kt_ptrs += BLOCK_N * stride_kt
        vt_ptrs += BLOCK_N * stride_vt
    return dq


@triton.autotune(configs=_configs("dq"), key=_KEY, prune_configs_by=_pruner("dq"))
@triton.jit(do_not_specialize=_NO_SPEC)
def _attn_bwd_dq_kernel(Q, K, V, O, DO, LSE, DELTA, DQ, qk_scale, sm_scale,
                        stride_qb, stride_qh, stride_qt, stride_qd,
                        stride_kb, stride_kh, stride_kt, stride_kd,
                        stride_vb, stride_vh, stride_vt, stride_vd,
                        stride_ob, stride_oh, stride_ot, stride_od,
                        stride_dob, stride_doh, stride_dot, stride_dod,
                        stride_dqb, stride_dqh, stride_dqt, stride_dqd,
                        H, Tq, Tk, T_BUCKET, BH_BUCKET,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_bh = _grouped_order(tl.program_id(0), tl.cdiv(Tq, BLOCK_M), tl.num_programs(0), CAUSAL, GROUP)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    K_base = K + b * stride_kb + h * stride_kh
    V_base = V + b * stride_vb + h * stride_vh
    k_desc, v_desc = None, None  # pointer loads
    if TMA:
        k_desc, v_desc = _tile_descs(K_base, V_base, Tk, stride_kt, stride_vt, HEAD_DIM, BLOCK_N, BLOCK_D)

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Tq
    md_ok = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                mask=md_ok, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :] * stride_dod,
                 mask=md_ok, other=0.0)
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od,
                mask=md_ok, other=0.0)
    # delta = rowsum(dO * O) from the given out; stored for the dk/dv kernel, which runs after this one
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    row = pid_bh.to(tl.int64) * Tq + offs_m
    tl.store(DELTA + row, delta, mask=m_ok)
    lse2 = tl.load(LSE + row, mask=m_ok, other=0.0) * 1.4426950408889634  # base-2 lse

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, K_base, V_base, k_desc, v_desc, stride_kt, stride_kd,
                                stride_vt, stride_vd, offs_m, offs_d, 0, m0, Tk, qk_scale,
                                BLOCK_N, HEAD_DIM, BLOCK_D, False, False, TMA)
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, K_base, V_base, k_desc, v_desc, stride_kt, stride_kd,
                                stride_vt, stride_vd, offs_m, offs_d, m0, tl.minimum(m0 + BLOCK_M, Tk), Tk, qk_scale,
                                BLOCK_N, HEAD_DIM, BLOCK_D, True, True, TMA)
    else:
        tk_full = (Tk // BLOCK_N) * BLOCK_N
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, K_base, V_base, k_desc, v_desc, stride_kt, stride_kd,
                                stride_vt, stride_vd, offs_m, offs_d, 0, tk_full, Tk, qk_scale,
                                BLOCK_N, HEAD_DIM, BLOCK_D, False, False, TMA)
        dq = _attn_bwd_dq_inner(dq, q, do, lse2, delta, K_base, V_base, k_desc, v_desc, stride_kt, stride_kd,
                                stride_vt, stride_vd, offs_m, offs_d, tk_full, Tk, Tk, qk_scale,
                                BLOCK_N, HEAD_DIM, BLOCK_D, True, False, TMA)
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :] * stride_dqd
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=md_ok)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, q_desc, do_desc,
                         stride_qt, stride_qd, stride_dot, stride_dod,
                         offs_n, offs_d, lo, hi, Tq, qk_scale,
                         BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         MASK: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr):
    """dv += P^T @ dO, dk += dS^T @ q over query blocks [lo, hi), all transposed: rows are keys (dk unscaled)."""
    offs_m = lo + tl.arange(0, BLOCK_M)
    d_ok = offs_d < HEAD_DIM
    qt_ptrs = Q_base + offs_d[:, None] * stride_qd + offs_m[None, :] * stride_qt  # (BLOCK_D, BLOCK_M)
    do_ptrs = DO_base + offs_m[:, None] * stride_dot + offs_d[None, :] * stride_dod  # (BLOCK_M, BLOCK_D)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        m_ok = rows < Tq
        if TMA:
            qt = tl.trans(q_desc.load([start_m, 0]))
            do = do_desc.load([start_m, 0])
        elif MASK:
            qt = tl.load(qt_ptrs, mask=d_ok[:, None] & m_ok[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        elif BLOCK_D != HEAD_DIM:
            qt = tl.load(qt_ptrs, mask=d_ok[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            qt = tl.load(qt_ptrs)
            do = tl.load(do_ptrs)
        if MASK:
            lse2 = tl.load(LSE_base + rows, mask=m_ok, other=0.0) * 1.4426950408889634
            delta = tl.load(DELTA_base + rows, mask=m_ok, other=0.0)
        else:
            lse2 = tl.load(LSE_base + rows) * 1.4426950408889634
            delta = tl.load(DELTA_base + rows)
        pt = tl.exp2(tl.dot(k, qt) * qk_scale - lse2[None, :])  # (BLOCK_N, BLOCK_M) = P^T
        if MASK:
            keep = rows[None, :] < Tq
            if CAUSAL:
                keep = keep & (rows[None, :] >= offs_n[:, None])
            pt = tl.where(keep, pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do)  # (BLOCK_N, BLOCK_D)
        dpt = tl.dot(v, tl.trans(do))  # (BLOCK_N, BLOCK_M) = dP^T
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt))  # (BLOCK_N, BLOCK_D)
        qt_ptrs += BLOCK_M * stride_qt
        do_ptrs += BLOCK_M * stride_dot
    return dk, dv


@triton.autotune(configs=_configs("dkdv"), key=_KEY, prune_configs_by=_pruner("dkdv"))
@triton.jit(do_not_specialize=_NO_SPEC)
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, qk_scale, sm_scale,
                          stride_qb, stride_qh, stride_qt, stride_qd,
                          stride_kb, stride_kh, stride_kt, stride_kd,
                          stride_vb, stride_vh, stride_vt, stride_vd,
                          stride_dob, stride_doh, stride_dot, stride_dod,
                          stride_dkb, stride_dkh, stride_dkt, stride_dkd,
                          stride_dvb, stride_dvh, stride_dvt, stride_dvd,
                          H, Tq, Tk, T_BUCKET, BH_BUCKET,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)  # causal: the first key blocks see the most queries and already launch first
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    Q_base = Q + b * stride_qb + h * stride_qh
    DO_base = DO + b * stride_dob + h * stride_doh
    LSE_base = LSE + pid_bh.to(tl.int64) * Tq
    DELTA_base = DELTA + pid_bh.to(tl.int64) * Tq
    q_desc, do_desc = None, None  # pointer loads
    if TMA:
        q_desc, do_desc = _tile_descs(Q_base, DO_base, Tq, stride_qt, stride_dot, HEAD_DIM, BLOCK_M, BLOCK_D)

    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    nd_ok = (offs_n < Tk)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                mask=nd_ok, other=0.0)  # (BLOCK_N, BLOCK_D)
    v = tl.load(V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                mask=nd_ok, other=0.0)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    tq_full = (Tq // BLOCK_M) * BLOCK_M
    if CAUSAL:
        # queries [n0, n0 + BLOCK_N) straddle the diagonal (masked); later ones see every key of the block
        lo = n0 + BLOCK_N
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, q_desc, do_desc,
                                      stride_qt, stride_qd, stride_dot, stride_dod, offs_n, offs_d, n0,
                                      tl.minimum(lo, Tq), Tq, qk_scale, BLOCK_M, HEAD_DIM, BLOCK_D, True, True, TMA)
    else:
        lo = n0 * 0
    # the masked query tail, then the whole query blocks in between. This order matters for speed only: with the
    # unmasked loop first on fresh zero accumulators (non-causal), ptxas serializes its wgmmas (warning C7515)
    dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, q_desc, do_desc,
                                  stride_qt, stride_qd, stride_dot, stride_dod, offs_n, offs_d,
                                  tl.maximum(lo, tq_full), Tq, Tq, qk_scale,
                                  BLOCK_M, HEAD_DIM, BLOCK_D, True, False, TMA)
    dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, q_desc, do_desc,
                                  stride_qt, stride_qd, stride_dot, stride_dod, offs_n, offs_d, lo, tq_full,
                                  Tq, qk_scale, BLOCK_M, HEAD_DIM, BLOCK_D, False, False, TMA)

    dk_ptrs = DK + b * stride_dkb + h * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :] * stride_dkd
    dv_ptrs = DV + b * stride_dvb + h * stride_dvh + offs_n[:, None] * stride_dvt + offs_d[None, :] * stride_dvd
    tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=nd_ok)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=nd_ok)


# ---------------------------------------------------------------------------------------------------------------
# Launchers (kernels/launch.py: after the first call per specialization, the compiled binaries launch directly)
# ---------------------------------------------------------------------------------------------------------------

_fwd, _bwd_dq, _bwd_dkdv = fast(_attn_fwd_kernel), fast(_attn_bwd_dq_kernel), fast(_attn_bwd_dkdv_kernel)


def _launch_args(q, k, causal, sm_scale):
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    if D > 256:
        raise ValueError(f"attention head dim {D} > 256 is not supported")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"attention wants fp16/bf16/fp32 inputs, got {q.dtype}")
    scale = sm_scale if sm_scale is not None else D ** -0.5
    meta = dict(HEAD_DIM=D, BLOCK_D=max(16, next_pow2(D)), CAUSAL=bool(causal))
    buckets = (next_pow2(max(Tq, Tk)), min(next_pow2(B * H), 1024))  # autotune key
    return B, H, Tq, Tk, D, scale, meta, buckets


# Tile loads through TMA (device-side descriptors, one per tensor per program) from this padded head dim up, where
# the layout allows (_use_tma): at D128 the forward 1.10x and fwd+bwd 1.04x faster (the dk/dv tile stops spilling),
# at D64 0.95x / 0.92x (a program lives ~17 us, too short to amortise building its descriptors). H200, GPU time.
TMA_MIN_BLOCK_D = 128


def _use_tma(meta, *ts):
    """TMA tile loads for these (B, H, T, D) tensors: a wide enough head dim, and each a per-(b, h) descriptor can
    read (unit stride along D, 16-byte aligned base and strides; views of the packed qkv projection qualify)."""
    def ok(t):
        return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((st * t.element_size()) % 16 == 0
                                                                    for st in t.stride()[:-1])
    return meta["BLOCK_D"] >= TMA_MIN_BLOCK_D and all(ok(t) for t in ts)


def _bthd_empty(B, H, T, D, like):
    """(B, H, T, D) view of (B, T, H, D) memory: head merging after attention becomes a free view."""
    return torch.empty(B, T, H, D, dtype=like.dtype, device=like.device).transpose(1, 2)


# On Hopper GPUs the forward runs kernels/attention_hopper.py (Gluon, warp-specialized) at the head dims where it
# measured faster (its PREFERRED_HEAD_DIMS) and supported() says so; NANOPARA_ATTN_HOPPER=0 (or HOPPER_FWD = False)
# keeps this file's Triton forward everywhere, for comparisons.
HOPPER_FWD = os.environ.get("NANOPARA_ATTN_HOPPER", "1") != "0"
HOPPER_BWD = HOPPER_FWD  # the same for the dK/dV kernel of the backward


def attention_block_fwd(q, k, v, causal, sm_scale=None):
    """Forward of a query block against a key/value block. Returns (out, lse fp32 (B, H, Tq))."""
    _check_inputs(q, k, v, causal)
    if HOPPER_FWD and q.is_cuda and not _INTERPRET:
        from kernels import attention_hopper
        if q.shape[-1] in attention_hopper.PREFERRED_HEAD_DIMS and attention_hopper.supported(q, k, v, causal,
                                                                                             sm_scale):
            return attention_hopper.attention_fwd(q, k, v, causal, sm_scale, fallback=attention_block_fwd_triton)
    return attention_block_fwd_triton(q, k, v, causal, sm_scale)


def attention_block_fwd_triton(q, k, v, causal, sm_scale=None):
    """The Triton forward (any CUDA GPU, or the CPU interpreter). Returns (out, lse fp32 (B, H, Tq))."""
    _check_inputs(q, k, v, causal)
    B, H, Tq, Tk, D, scale, meta, buckets = _launch_args(q, k, causal, sm_scale)
    out = _bthd_empty(B, H, Tq, D, q)
    lse = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse

    def grid(cfg):
        return (cdiv(Tq, cfg["BLOCK_M"]), B * H)

    tma = _use_tma(meta, k, v)
    if tma and q.is_cuda:
        triton.set_allocator(tma_scratch)
    _fwd[grid](q, k, v, out, lse, scale * LOG2E, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
               H, Tq, Tk, *buckets, TMA=tma, **meta)
    return out, lse


# heads the dq kernel's programs are grouped by (_grouped_order), for head dims <= 64 / above: groups of 8 made the
# backward 1.02-1.05x faster at D128 B4 H16 T4096 (H200, H100); at D64 they are within noise, so one head at a time
DQ_HEAD_GROUP = {False: 1, True: 8}


def attention_block_bwd(do, q, k, v, out, lse, causal, sm_scale=None, grads=None):
    """Backward of one block given the (possibly merged, global) out and lse. Returns (dq, dk, dv): new (B, H, T, D)
    views of (B, T, H, D) memory, or `grads` = (dq, dk, dv) given to write into (any strides; every element is
    written, e.g. views of one packed (B, T, 3, H, D) buffer: see attention_qkv)."""
    _check_inputs(q, k, v, causal)
    if do.shape != q.shape or out.shape != q.shape or lse.shape != q.shape[:3]:
        raise ValueError(f"attention_block_bwd shapes: do {tuple(do.shape)}, out {tuple(out.shape)} should be "
                         f"{tuple(q.shape)}; lse {tuple(lse.shape)} should be {tuple(q.shape[:3])}")
    B, H, Tq, Tk, D, scale, meta, buckets = _launch_args(q, k, causal, sm_scale)
    do = do.to(q.dtype)  # dO enters the dots beside v and q
    lse = lse.to(torch.float32).contiguous()  # (B, H, Tq), indexed as (B*H, Tq) rows
    delta = torch.empty_like(lse)
    if grads is None:
        dq, dk, dv = _bthd_empty(B, H, Tq, D, q), _bthd_empty(B, H, Tk, D, k), _bthd_empty(B, H, Tk, D, v)
    else:
        dq, dk, dv = grads
        if dq.shape != q.shape or dk.shape != k.shape or dv.shape != v.shape:
            raise ValueError(f"attention_block_bwd: grads shapes {[tuple(g.shape) for g in grads]} do not match "
                             f"q, k, v {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if dq.numel() == 0:
        return dq, dk.zero_(), dv.zero_()

    def grid_q(cfg):  # one axis: _grouped_order maps it to (query block, (b, h))
        return (cdiv(Tq, cfg["BLOCK_M"]) * B * H, )

    def grid_kv(cfg):
        return (cdiv(Tk, cfg["BLOCK_N"]), B * H)

    tma_dq, tma_dkdv = _use_tma(meta, k, v), _use_tma(meta, q, do)
    if (tma_dq or tma_dkdv) and q.is_cuda:
        triton.set_allocator(tma_scratch)
    # dq first: it also writes delta, which the dk/dv kernel reads (same stream, so ordered)
    _bwd_dq[grid_q](q, k, v, out, do, lse, delta, dq, scale * LOG2E, scale,
                    *q.stride(), *k.stride(), *v.stride(), *out.stride(), *do.stride(), *dq.stride(),
                    H, Tq, Tk, *buckets, TMA=tma_dq, GROUP=DQ_HEAD_GROUP[meta["BLOCK_D"] > 64], **meta)
    if _hopper_bwd(q, k, v, do, dk, dv, causal, sm_scale):
        from kernels import attention_hopper
        attention_hopper.attention_bwd_dkdv(q, k, v, do, lse, delta, dk, dv, causal, sm_scale)
        return dq, dk, dv
    _bwd_dkdv[grid_kv](q, k, v, do, lse, delta, dk, dv, scale * LOG2E, scale,
                       *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
                       H, Tq, Tk, *buckets, TMA=tma_dkdv, **meta)
    return dq, dk, dv


def _hopper_bwd(q, k, v, do, dk, dv, causal, sm_scale) -> bool:
    """dK/dV through kernels/attention_hopper.py's Gluon kernel (Hopper, its PREFERRED_BWD_HEAD_DIMS)."""
    if not (HOPPER_BWD and q.is_cuda and not _INTERPRET):
        return False
    from kernels import attention_hopper
    return (q.shape[-1] in attention_hopper.PREFERRED_BWD_HEAD_DIMS and dk.stride(-1) == 1 and dv.stride(-1) == 1
            and attention_hopper.supported(q, k, v, causal, sm_scale) and attention_hopper._rows(do) is not None
            and do.dtype == q.dtype and q.shape[2] % 4 == 0)  # lse / delta rows are read through TMA


# ---------------------------------------------------------------------------------------------------------------
# Autograd and the public op
# ---------------------------------------------------------------------------------------------------------------

class AttentionFunction(torch.autograd.Function):
    """fwd: flash attention (Triton); bwd: dq, dk, dv recomputing P from the saved lse."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        out, lse = attention_block_fwd(q, k, v, causal, sm_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_block_bwd(do, q, k, v, out, lse, ctx.causal, ctx.sm_scale)
        return dq, dk, dv, None, None


@triton.jit
def _merge_kernel(OA, LA, O, L, H, T, s_oab, s_oah, s_oat, s_lab, s_lah, s_lat, s_ob, s_oh, s_ot, s_lb, s_lh, s_lt,
                  D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """(oa, la) <- merge of (oa, la) and (o, l), one (BLOCK_T, D) tile of one (b, h): the online-softmax step."""
    b, h = tl.program_id(1) // H, tl.program_id(1) % H
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, D_PAD)
    rows, tile = t < T, (t < T)[:, None] & (d < D)[None, :]
    la_ptr = LA + b * s_lab + h * s_lah + t * s_lat
    la = tl.load(la_ptr, mask=rows, other=0.0)
    lb = tl.load(L + b * s_lb + h * s_lh + t * s_lt, mask=rows, other=0.0).to(tl.float32)
    mx = tl.maximum(la, lb)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # both blocks empty for a row: weights 0, lse stays -inf
    ea, eb = tl.exp(la - mx), tl.exp(lb - mx)
    tot = ea + eb
    new = mx + tl.log(tot)
    wa, wb = tl.where(tot > 0, ea / tot, 0.0), tl.where(tot > 0, eb / tot, 0.0)
    oa_ptr = OA + b * s_oab + h * s_oah + t[:, None] * s_oat + d[None, :]
    oa = tl.load(oa_ptr, mask=tile, other=0.0)
    o = tl.load(O + b * s_ob + h * s_oh + t[:, None] * s_ot + d[None, :], mask=tile, other=0.0).to(tl.float32)
    tl.store(oa_ptr, oa * wa[:, None] + o * wb[:, None], mask=tile)
    tl.store(la_ptr, new, mask=rows)


_merge = fast(_merge_kernel)


def attention_merge_(out, lse, o, l):
    """In place: (out, lse) <- the attention over both key sets of (out, lse) and (o, l), partial results of the
    same queries over two disjoint key blocks (natural-log LSE): lse = logaddexp(lse, l),
    out = exp(lse_old - lse) out + exp(l - lse) o. out (B, H, T, D) fp32 and o (any float dtype) with unit stride
    along D; lse, l (B, H, T) fp32; any other strides (views of a larger sequence). One pass over out and o."""
    B, H, T, D = out.shape
    if o.shape != out.shape or lse.shape != out.shape[:3] or l.shape != lse.shape:
        raise ValueError(f"attention_merge_: shapes out {tuple(out.shape)}, o {tuple(o.shape)}, lse {tuple(lse.shape)}, "
                         f"l {tuple(l.shape)}")
    if out.dtype != torch.float32 or out.stride(3) != 1 or o.stride(3) != 1:
        raise ValueError("attention_merge_: out must be fp32 and out, o unit-stride along the head dim")
    if out.numel():
        block_t = max(1, min(64, 4096 // next_pow2(D)))
        _merge[(cdiv(T, block_t), B * H)](out, lse, o, l, H, T, *out.stride()[:3], *lse.stride(), *o.stride()[:3],
                                         *l.stride(), D=D, D_PAD=next_pow2(D), BLOCK_T=block_t, num_warps=4)
    return out, lse


def split_qkv(qkv, n_head):
    """(B, T, 3*H*D) packed projection, columns [q heads | k heads | v heads] -> q, k, v (B, H, T, D) views."""
    B, T, C3 = qkv.shape
    if C3 % (3 * n_head):
        raise ValueError(f"packed qkv width {C3} is not 3 * n_head ({n_head}) * head_dim")
    return qkv.view(B, T, 3, n_head, C3 // (3 * n_head)).permute(2, 0, 3, 1, 4).unbind(0)


def attention_qkv_bwd(do, qkv, out, lse, n_head, causal, sm_scale=None):
    """Backward of attention over a packed qkv: the gradient of qkv, (B, T, 3*H*D), written in one buffer (no
    stack of dq, dk, dv afterwards: the kernels store straight into its q, k and v columns)."""
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    attention_block_bwd(do, *split_qkv(qkv, n_head), out, lse, causal, sm_scale, grads=split_qkv(dqkv, n_head))
    return dqkv


class QKVAttentionFunction(torch.autograd.Function):
    """Attention over a packed (B, T, 3*H*D) projection: fwd as AttentionFunction, bwd returns d(qkv) directly."""

    @staticmethod
    def forward(ctx, qkv, n_head, causal, sm_scale):
        out, lse = attention_block_fwd(*split_qkv(qkv, n_head), causal, sm_scale)
        ctx.save_for_backward(qkv, out, lse)
        ctx.n_head, ctx.causal, ctx.sm_scale = n_head, causal, sm_scale
        return out

    @staticmethod
    def backward(ctx, do):
        qkv, out, lse = ctx.saved_tensors
        return attention_qkv_bwd(do, qkv, out, lse, ctx.n_head, ctx.causal, ctx.sm_scale), None, None, None


def attention_qkv_triton(qkv, n_head, causal=True, sm_scale=None):
    """attention_triton over the heads of a packed qkv; returns out (B, H, T, D), a view of (B, T, H, D) memory."""
    return QKVAttentionFunction.apply(qkv, n_head, causal, sm_scale)


def attention_triton(q, k, v, causal=True, sm_scale=None):
    """The Triton path with autograd, on any device Triton runs on (CUDA, or CPU under TRITON_INTERPRET=1)."""
    return AttentionFunction.apply(q, k, v, causal, sm_scale)


def attention(q, k, v, causal=True, sm_scale=None):
    """Scaled dot-product attention over (B, H, T, D): Triton on CUDA tensors, PyTorch SDPA on CPU tensors."""
    if q.is_cuda:
        return attention_triton(q, k, v, causal, sm_scale)
    _check_inputs(q, k, v, causal)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)


def attention_qkv(qkv, n_head, causal=True, sm_scale=None):
    """attention() over a packed (B, T, 3*H*D) projection: Triton on CUDA (d(qkv) in one buffer), SDPA on CPU."""
    if qkv.is_cuda:
        return attention_qkv_triton(qkv, n_head, causal, sm_scale)
    return attention(*split_qkv(qkv, n_head), causal, sm_scale)


# ---------------------------------------------------------------------------------------------------------------
# Parity check and benchmark: python -m kernels.attention [--quick] [--out FILE]
# ---------------------------------------------------------------------------------------------------------------

def _max_errors(fn, q, k, v, do, causal):
    """Max abs error of fn's out, dq, dk, dv against attention_ref run in fp32 on the same inputs."""
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, _ = attention_ref(qf, kf, vf, causal)
    ref.backward(do.float())
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(do)
    return [(a.float() - b).abs().max().item() for a, b in zip((out, q.grad, k.grad, v.grad),
                                                                   (ref, qf.grad, kf.grad, vf.grad))]


def _bench(argv=None):
    import argparse
    import json

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels import attention_hopper
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two shapes, fewer repetitions")
    ap.add_argument("--out", default=None, help="also write the table as JSON lines to this file")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timings per impl and row (each keeps its best)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA GPU "
                         "(tests run the kernels on CPU: pytest tests/test_attention.py)")
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")

    # correctness: our bf16 error against an fp32 reference next to SDPA's bf16 error on the same inputs
    B, H, T, D = 2, 4, 777, 64
    q, k, v, do = (torch.randn(B, H, T, D, device=dev, dtype=dt) for _ in range(4))
    ours = _max_errors(lambda a, b, c: attention(a, b, c, True), q, k, v, do, True)
    sdpa = _max_errors(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, k, v, do, True)
    ok = all(o <= 2 * s + 1e-3 for o, s in zip(ours, sdpa))
    print(f"correctness (B={B} H={H} T={T} D={D} causal, max abs err vs fp32 ref; out dq dk dv): "
          f"ours {['%.2e' % e for e in ours]}  sdpa {['%.2e' % e for e in sdpa]}  {'ok' if ok else 'FAIL'}")

    shapes = [(16, 12, 1024, 64, True), (4, 16, 4096, 128, True), (4, 12, 1024, 64, True),
              (4, 16, 4096, 128, False), (8, 16, 2048, 128, True), (1, 4, 4096, 128, True)]
    if args.quick:
        shapes = shapes[:2]
    rep = 30 if args.quick else 100

    def sdpa_with(backend):
        def fn(a, b, c, causal):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(a, b, c, is_causal=causal)
        return fn

    impls = {"ours": lambda a, b, c, causal: attention(a, b, c, causal),
             "cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION), "flash": sdpa_with(SDPBackend.FLASH_ATTENTION)}
    rows = []
    hdr = f"{'B':>3} {'H':>3} {'T':>5} {'D':>4} {'causal':>6} {'mode':>7} | " + " | ".join(
        f"{n:>6} ms {'TF/s':>5}" for n in impls) + " | ours/cudnn ours/flash"
    print(hdr)
    print("-" * len(hdr))
    for B, H, T, D, causal in shapes:
        q, k, v, do = (torch.randn(B, H, T, D, device=dev, dtype=dt) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        flops_fwd = 4 * B * H * T * T * D / (2 if causal else 1)
        # "graph": fwd + bwd replayed from a CUDA graph = GPU time alone (what a training step sees when the CPU
        # runs ahead; "fwd-graph" the forward alone); the do_bench modes include each call's Python and launch cost
        for mode, flops in (("fwd", flops_fwd), ("fwd+bwd", 3.5 * flops_fwd), ("fwd-graph", flops_fwd),
                            ("graph", 3.5 * flops_fwd)):
            # each impl's best of `rounds` interleaved timings: the same kernel drifts 6-10% within seconds on an
            # H100, so one timing each would compare moments, not kernels
            times = dict.fromkeys(impls, float("inf"))
            for _ in range(args.rounds):
                for name, fn in impls.items():
                    def step(fn=fn):
                        out = fn(q, k, v, causal)
                        if mode == "fwd+bwd":
                            out.backward(do)
                        elif mode == "graph":
                            torch.autograd.grad(out, (q, k, v), do)
                    try:
                        step()  # autotune / warm-up outside the timing
                        ms = (triton.testing.do_bench_cudagraph(step, rep=rep, return_mode="median")
                              if mode.endswith("graph") else
                              triton.testing.do_bench(step, rep=rep, grad_to_none=[q, k, v], return_mode="median"))
                    except RuntimeError as e:  # a backend that does not take this shape on this GPU
                        ms = float("nan")
                        print(f"# {name} unavailable for this shape: {str(e).splitlines()[0][:100]}")
                    times[name] = min(times[name], ms) if ms == ms else ms
            row = dict(B=B, H=H, T=T, D=D, causal=causal, mode=mode, gpu=torch.cuda.get_device_name(),
                       **{f"{n}_ms": ms for n, ms in times.items()},
                       **{f"{n}_tflops": flops / ms * 1e-9 for n, ms in times.items()},
                       ours_vs_cudnn=times["cudnn"] / times["ours"], ours_vs_flash=times["flash"] / times["ours"])
            rows.append(row)
            print(f"{B:>3} {H:>3} {T:>5} {D:>4} {str(causal):>6} {mode:>7} | " + " | ".join(
                f"{times[n]:>9.3f} {row[n + '_tflops']:>5.0f}" for n in impls)
                  + f" | {row['ours_vs_cudnn']:>10.2f} {row['ours_vs_flash']:>10.2f}")
        buckets = _launch_args(q, k, causal, None)[-1]
        tiles = {n: [c for key, c in kern.cache.items() if key[:2] == (causal, D) and key[3:5] == buckets]
                 for n, kern in (("fwd", _attn_fwd_kernel), ("dq", _attn_bwd_dq_kernel),
                                 ("dkdv", _attn_bwd_dkdv_kernel))}  # the autotuner's pick for this shape's key
        hop = [f"gluon fwd {c}" for key, c in attention_hopper._TUNED.items() if key[:2] == (D, causal)
               and key[2:] == (next_pow2(T), min(next_pow2(B * H), 1024))]
        print("#   tuned tiles: " + "; ".join(hop + [
            f"{n} {c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']} w{c.num_warps} s{c.num_stages}"
            for n, cs in tiles.items() for c in cs]))
    if torch.cuda.get_device_capability()[0] == 9:
        rows += _hopper_rows(shapes=[(16, 12, 1024, 64), (4, 16, 4096, 128), (8, 16, 2048, 64),
                                     (8, 16, 2048, 128)][:2 if args.quick else 4], rounds=args.rounds, rep=rep)
    print("ratios are speed-ups (baseline time / our time): > 1 means ours is faster")
    if args.out:
        with open(args.out, "w") as f:
            for row in rows:
                f.write(json.dumps({k: None if x != x else x for k, x in row.items()}) + "\n")  # NaN -> null


def _hopper_rows(shapes, rounds, rep):
    """On Hopper: the dispatched forward and backward (kernels/attention_hopper.py's Gluon kernels where they are
    used) against this file's Triton kernels alone, causal, packed qkv views, GPU time, each side's best of rounds."""
    global HOPPER_BWD
    from kernels import attention_hopper
    saved, rows = HOPPER_BWD, []
    print("# Hopper, GPU time (ms): dispatched (Gluon where used) vs the Triton kernels alone, packed qkv, causal")
    for B, H, T, D in shapes:
        q, k, v = split_qkv(torch.randn(B, T, 3 * H * D, device="cuda", dtype=torch.bfloat16), H)
        out, lse = attention_block_fwd(q, k, v, True)  # tunes this shape outside the graph capture
        do = torch.randn_like(out)

        def bwd():
            attention_block_bwd(do, q, k, v, out, lse, True)
        cases = {("fwd", "ours"): (saved, lambda: attention_block_fwd(q, k, v, True)),
                 ("fwd", "triton"): (saved, lambda: attention_block_fwd_triton(q, k, v, True)),
                 ("bwd", "ours"): (saved, bwd), ("bwd", "triton"): (False, bwd)}
        ms = dict.fromkeys(cases, float("inf"))
        try:
            for _ in range(rounds):
                for case, (gluon_bwd, fn) in cases.items():
                    HOPPER_BWD = gluon_bwd  # read while the graph is captured
                    ms[case] = min(ms[case], triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
        finally:
            HOPPER_BWD = saved
        key = (D, True, next_pow2(T), min(next_pow2(B * H), 1024))
        cfg = attention_hopper._TUNED.get(key, "triton")
        for op in ("fwd", "bwd"):
            row = dict(B=B, H=H, T=T, D=D, causal=True, mode=f"hopper-{op}", gpu=torch.cuda.get_device_name(),
                       ours_ms=ms[op, "ours"], triton_ms=ms[op, "triton"],
                       ours_vs_triton=ms[op, "triton"] / ms[op, "ours"], fwd_config=str(cfg))
            rows.append(row)
            print(f"# B{B} H{H} T{T} D{D} {op}: ours {row['ours_ms']:.3f} triton {row['triton_ms']:.3f} = "
                  f"{row['ours_vs_triton']:.2f}x" + (f" (forward tuned: {cfg})" if op == "fwd" else ""))
    return rows


if __name__ == "__main__":
    _bench()
