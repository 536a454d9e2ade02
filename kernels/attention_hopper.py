"""Flash attention for Hopper (sm_90) in Gluon: a forward and a dK/dV kernel, warp-specialized and persistent.
Long file: two warp-specialized kernels, each a loader and two consumer partitions, with their configs and launchers.

Same math and contracts as kernels/attention.py (its docstring has the formulas), which calls this file on Hopper
GPUs where `supported()` says yes (bf16/fp16, head dim 64 or 128, layouts TMA reads as row blocks):
  * `attention_fwd(q, k, v, causal, sm_scale, fallback=)`: out (B, H, Tq, D) and lse (B, H, Tq) fp32, any lengths;
    `fallback` (attention.py's Triton forward) is one more candidate the first call of a shape times;
  * `attention_bwd_dkdv`: dK, dV given lse and delta = rowsum(dO * O), which attention.py's Triton dq kernel
    computes first (Tq % 4 == 0: the lse / delta rows are read through TMA).
Why Gluon: Triton 3.6 does not warp-specialize on Hopper, and at head dim 64 a block's online softmax (exp2, max,
sum) takes as long as its two matmuls. Both kernels use FlashAttention-3's pieces (Shah et al., 2024):
  * persistent: one CTA per SM walks work items (128 query rows, or 128 keys, of one (b, h)), longest first under
    the causal mask, dealt in a zigzag (round k: CTAs 0..G-1, then G-1..0) so every CTA's sum of work is even;
  * `gl.warp_specialize`: a 1-warp TMA loader (24 registers, setmaxnreg) fills rings of shared-memory stages for two
    4-warp consumer warpgroups (240 registers) of 64 rows each; each stage has a ready and an empty mbarrier;
  * forward: S = Q K^T and O += P V by wgmma, P from registers. S_next is issued with P V and its softmax runs
    while P V is on the tensor cores (intra-warpgroup overlap), so the V ring is one stage deeper than the K ring
    and a step frees (K_j, V_{j-1}); an item's last P V goes out with the next item's first S (the epilogue runs
    under a wgmma). PINGPONG (a config): the two consumers take turns issuing;
  * dK/dV (transposed: rows are keys): K and V stay in shared memory; per query block S^T = K Q^T and dP^T = V dO^T
    go out together, then dV += P^T dO and dK += dS^T Q; lse and delta come through the ring with Q and dO.
Masking: only diagonal blocks and tails compare indices. Host cost: 50-150 us a forward call (~40 for Triton).
Run: `python -m kernels.attention_hopper [--sweep]` (Hopper GPU). Tests: tests/test_attention_hopper.py (GPU);
tests/test_registers.py compiles every config for sm_90a on CPU (no spills, shared memory within 227 KB).
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels import tuning
from kernels.launch import cdiv, fast, next_pow2

LOG2E = 1.4426950408889634
ROWS = 64  # query rows per consumer warpgroup (one wgmma M tile); a work item is 2 * ROWS rows
SUB_M = gl.constexpr(ROWS)  # the same, for the kernels
CONSUMER_REGS = gl.constexpr(240)  # registers per thread of the consumer warpgroups (setmaxnreg); the loader: 24
# head dim -> candidate (BLOCK_N keys per block, NUM_BUF K stages (V: NUM_BUF + 1), PINGPONG), the first the default;
# with more than one, the first call of a shape times them (_config). Ping-pong or not, and at D128 Gluon or Triton
# (the same Gluon forward took 0.535-0.626 ms at B4 H16 T4096 on six H200s, the Triton one 0.583-0.605), vary by
# machine and shape, so all are timed. 128-key blocks at D128 fit because V's ring is the deeper one: 2 K + 3 V stages.
TRITON = "triton"  # the candidate that stands for the caller's fallback (kernels/attention.py's Triton forward)
CONFIGS = {64: [(128, 4, True), (128, 4, False), TRITON], 128: [(128, 2, True), (128, 2, False), (64, 4, True), TRITON]}
# head dims where kernels/attention.py's forward dispatches here (D64: 1.05-1.11x its Triton forward, H200)
PREFERRED_HEAD_DIMS = (64, 128)
# head dims where its backward takes this dK/dV kernel: backward (dq + dK/dV) 1.11-1.13x the Triton one at D64,
# 1.08-1.09x at D128 (H200); 1.00-1.10x and 1.09-1.12x (H100)
PREFERRED_BWD_HEAD_DIMS = (64, 128)


# ---------------------------------------------------------------------------------------------------------------
# Forward: loader partition, consumer partitions, the persistent kernel
# ---------------------------------------------------------------------------------------------------------------

@gluon.jit
def _zigzag(t, n_items):
    """The CTA's loop index t (pid, pid + G, ...; G CTAs) -> the work item it takes: round k deals items k*G ..
    k*G + G - 1 to CTAs 0..G-1 when k is even and to G-1..0 when odd (the last round may be short)."""
    G = gl.num_programs(0)
    k = t // G
    pid = t % G
    r = gl.minimum(G, n_items - k * G)  # items in this round
    if k % 2 == 1:
        t = k * G + r - 1 - pid
    return t


@gluon.jit
def _key_blocks(m0, Tk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(blocks to visit, leading blocks that need no mask) for the query tile starting at row m0."""
    if CAUSAL:
        hi = gl.minimum(m0 + BLOCK_M, Tk)
        n_free = gl.minimum(m0, Tk) // BLOCK_N
    else:
        hi = Tk
        n_free = Tk // BLOCK_N
    return gl.cdiv(hi, BLOCK_N), n_free


@gluon.jit
def _work_item(t, n_items, n_bh, n_m, H, Tk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """The CTA's loop index t (pid, pid + G, ...; G CTAs) -> (b, h, b*h, first query row, key blocks to visit, of
    which unmasked). Each work item is a 128-row query tile of one (b, h). Items are ordered longest first
    under a causal mask and dealt in a zigzag (round k: CTAs 0..G-1, then G-1..0), so each CTA's sum of work is even:
    at B16 H12 T1024 the busiest CTA gets 53 key blocks against a mean of 52.4 (56 when dealt in one direction)."""
    t = _zigzag(t, n_items)
    pid_m = t // n_bh
    if CAUSAL:
        pid_m = n_m - 1 - pid_m
    bh = t % n_bh
    m0 = pid_m * BLOCK_M
    n_blocks, n_free = _key_blocks(m0, Tk, BLOCK_M, BLOCK_N, CAUSAL)
    return bh // H, bh % H, bh, m0, n_blocks, n_free


@gluon.jit
def _loader(args, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr):
    (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, kv_ready, kv_empty, turn,
     O, LSE, so_b, so_h, so_t, qk_scale, H, Tq, Tk, n_bh, n_m, n_items,
     q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch) = args
    BLOCK_M: gl.constexpr = 2 * SUB_M
    j = 0  # K/V blocks issued by this CTA so far: ring slot and phase
    i = 0  # work items of this CTA so far: Q slot and phase
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, bh, m0, n_blocks, n_free = _work_item(t, n_items, n_bh, n_m, H, Tk, BLOCK_M, BLOCK_N, CAUSAL)
        qs = i % 2
        mbarrier.wait(q_empty.index(qs), ((i // 2) & 1) ^ 1)
        mbarrier.expect(q_ready.index(qs), 2 * q_desc.block_type.nbytes)
        q_row = b * q_rb + h * q_rh + m0
        for c in gl.static_range(2):  # the two consumers' 64-row halves
            tma.async_copy_global_to_shared(q_desc, [q_row + c * SUB_M, h * q_ch], q_ready.index(qs),
                                            q_smem.index(2 * qs + c))
        k_row = b * k_rb + h * k_rh
        v_row = b * v_rb + h * v_rh
        for n in range(n_blocks):
            # block j: K to K stage j % NUM_BUF, V to V stage j % (NUM_BUF + 1), one barrier pair per step. The
            # consumers release step m once S_m and P_{m-1} V_{m-1} are done (K_m and V_{m-1} free), so block j
            # waits for step j - NUM_BUF: K stage j % NUM_BUF and V stage (j - NUM_BUF - 1) % (NUM_BUF + 1)
            s = j % NUM_BUF
            mbarrier.wait(kv_empty.index(s), ((j // NUM_BUF) & 1) ^ 1)
            mbarrier.expect(kv_ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [k_row + n * BLOCK_N, h * k_ch], kv_ready.index(s),
                                            k_bufs.index(s))
            tma.async_copy_global_to_shared(v_desc, [v_row + n * BLOCK_N, h * v_ch], kv_ready.index(s),
                                            v_bufs.index(j % (NUM_BUF + 1)))
            j += 1
        i += 1


@gluon.jit
def _take_turn(turn, WG: gl.constexpr, tp, PINGPONG: gl.constexpr):
    """PINGPONG: wait until the other consumer has issued its wgmmas (they alternate), so one warpgroup's softmax
    runs while the other's matmuls hold the tensor cores. Returns the next phase."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), tp)
    return tp ^ 1


@gluon.jit
def _pass_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _mask(qk, n, n_free, rows, Tk, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, s_cols: gl.constexpr):
    """Scores of key block n with keys past Tk (and, causal, right of the diagonal) set to -inf."""
    if n >= n_free:  # the diagonal blocks and the key tail; blocks left of them need no mask
        cols = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=s_cols)
        keep = gl.expand_dims(cols < Tk, 0) & gl.expand_dims(rows >= 0, 1)
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
        qk = gl.where(keep, qk, float("-inf"))
    return qk


@gluon.jit
def _consume(WG: gl.constexpr, args, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr,
             PINGPONG: gl.constexpr):
    """Consumer warpgroup WG (0 or 1): rows [m0 + 64*WG, m0 + 64*WG + 64) of every work item of this CTA."""
    (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, kv_ready, kv_empty, turn,
     O, LSE, so_b, so_h, so_t, qk_scale, H, Tq, Tk, n_bh, n_m, n_items,
     q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch) = args
    BLOCK_M: gl.constexpr = 2 * SUB_M
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)

    j = 0
    i = 0
    tp = 0  # phase of this warpgroup's turn barrier
    qk = gl.zeros([SUB_M, BLOCK_N], gl.float32, s_layout)  # S registers, reused as the (ignored) accumulator input
    # The first S = Q K_0^T of the CTA's first item is issued here; every later item's is issued by the item
    # before it, together with that item's last P V, so its epilogue (normalise, store) runs under the wgmma.
    mbarrier.wait(q_ready.index(0), 0)  # (the grid is never larger than n_items: every CTA has a first item)
    mbarrier.wait(kv_ready.index(0), 0)
    tp = _take_turn(turn, WG, tp, PINGPONG)
    qk = warpgroup_mma(q_smem.index(WG), k_bufs.index(0).permute((1, 0)), qk, use_acc=False, is_async=True)
    _pass_turn(turn, WG, PINGPONG)
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, bh, m0, n_blocks, n_free = _work_item(t, n_items, n_bh, n_m, H, Tk, BLOCK_M, BLOCK_N, CAUSAL)
        rows = m0 + WG * SUB_M + gl.arange(0, SUB_M, layout=s_rows)
        qs = i % 2
        q = q_smem.index(2 * qs + WG)

        # block 0: its S is in flight; its softmax. Then each step issues S_next = Q K_next^T and O += P V_prev,
        # and runs the softmax of S_next while the P V wgmma is still on the tensor cores (FlashAttention-3's
        # intra-warpgroup overlap); O is rescaled once that wgmma has landed
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
        mbarrier.arrive(kv_empty.index(j % NUM_BUF), count=1)  # step j: S_j done, P V of the block before too
        qk = _mask(qk, 0, n_free, rows, Tk, BLOCK_N, CAUSAL, s_cols)
        m_i = gl.max(qk, axis=1) * qk_scale  # running max, log2 units
        p = gl.exp2(qk * qk_scale - gl.expand_dims(m_i, 1))  # one FMA per score into exp2
        l_i = gl.sum(p, axis=1)
        p = gl.convert_layout(p.to(dtype), p_layout)  # P as the next wgmma's A operand (bf16: half the registers)
        acc = gl.zeros([SUB_M, HEAD_DIM], gl.float32, layout=o_layout)
        prev = j % (NUM_BUF + 1)  # the V stage of the block whose P is held
        j += 1
        for n in range(1, n_blocks):
            s = j % NUM_BUF
            mbarrier.wait(kv_ready.index(s), (j // NUM_BUF) & 1)
            tp = _take_turn(turn, WG, tp, PINGPONG)
            qk = warpgroup_mma(q, k_bufs.index(s).permute((1, 0)), qk, use_acc=False, is_async=True)  # qk: dead
            acc = warpgroup_mma(p, v_bufs.index(prev), acc, is_async=True)
            _pass_turn(turn, WG, PINGPONG)
            qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk, ))  # S_next is in; P V may still run
            qk = _mask(qk, n, n_free, rows, Tk, BLOCK_N, CAUSAL, s_cols)
            m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
            p32 = gl.exp2(qk * qk_scale - gl.expand_dims(m_new, 1))
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p32, axis=1)
            p = gl.convert_layout(p32.to(dtype), p_layout)
            m_i = m_new
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(kv_empty.index(s), count=1)  # step j: K_j and V_{j-1} free
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
            prev = j % (NUM_BUF + 1)
            j += 1

        # the last P V, and the next item's first S (without a next item: a discarded product of stale buffers)
        has_next = t + gl.num_programs(0) < n_items
        mbarrier.wait(q_ready.index((i + 1) % 2), ((i + 1) // 2) & 1, pred=has_next)
        mbarrier.wait(kv_ready.index(j % NUM_BUF), (j // NUM_BUF) & 1, pred=has_next)
        tp = _take_turn(turn, WG, tp, PINGPONG)
        acc = warpgroup_mma(p, v_bufs.index(prev), acc, is_async=True)
        qk = warpgroup_mma(q_smem.index(2 * ((i + 1) % 2) + WG), k_bufs.index(j % NUM_BUF).permute((1, 0)), qk,
                           use_acc=False, is_async=True)
        _pass_turn(turn, WG, PINGPONG)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # (V_prev is released with the next S: step j)
        mbarrier.arrive(q_empty.index(qs), count=1)  # Q's wgmma reads are complete (waited above)
        i += 1

        out = acc * gl.expand_dims(gl.convert_layout(1.0 / l_i, o_rows), 1)
        r0 = m0 + WG * SUB_M  # a 64-bit scalar base and 32-bit offsets: 32 registers fewer than 64-bit pointers
        o_base = O + b.to(gl.int64) * so_b + h.to(gl.int64) * so_h + r0.to(gl.int64) * so_t
        o_r = gl.arange(0, SUB_M, layout=o_rows)
        o_c = gl.arange(0, HEAD_DIM, layout=o_cols)
        o_mask = gl.expand_dims(o_r < Tq - r0, 1) & gl.expand_dims(o_c < HEAD_DIM, 0)
        gl.store(o_base + gl.expand_dims(o_r * so_t, 1) + gl.expand_dims(o_c, 0), out.to(dtype), mask=o_mask)
        gl.store(LSE + bh.to(gl.int64) * Tq + rows, (m_i + gl.log2(l_i)) * 0.6931471805599453, mask=rows < Tq)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))  # the discarded one


@gluon.jit
def _consumer1(args, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr,
               PINGPONG: gl.constexpr):
    _consume(1, args, BLOCK_N, NUM_BUF, CAUSAL, PINGPONG)


@gluon.jit(do_not_specialize=["H", "Tq", "Tk", "n_bh", "q_rb", "q_rh", "q_ch", "k_rb", "k_rh", "k_ch", "v_rb",
                              "v_rh", "v_ch"])
def _attn_fwd_ws_kernel(q_desc, k_desc, v_desc, O, LSE, so_b, so_h, so_t, qk_scale, H, Tq, Tk, n_bh,
                        q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch,
                        BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr,
                        PINGPONG: gl.constexpr):
    BLOCK_M: gl.constexpr = 2 * SUB_M
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [4] + q_desc.block_type.shape, q_desc.layout)  # 2 slots x 2
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NUM_BUF] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUF + 1] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(q_empty.index(s), count=2)  # both consumers
    for s in gl.static_range(NUM_BUF):
        mbarrier.init(kv_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=2)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # PINGPONG: whose turn to issue
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    mbarrier.arrive(turn.index(0), count=1)  # consumer 0 issues first

    n_m = gl.cdiv(Tq, BLOCK_M)
    args = (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, kv_ready, kv_empty, turn,
            O, LSE, so_b, so_h, so_t, qk_scale, H, Tq, Tk, n_bh, n_m, n_m * n_bh,
            q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch)
    # (a tuple of constexprs loses its constexpr-ness in Triton 3.6: each partition gets them spelled out)
    gl.warp_specialize([(_consume, (0, args, BLOCK_N, NUM_BUF, CAUSAL, PINGPONG)),
                        (_consumer1, (args, BLOCK_N, NUM_BUF, CAUSAL, PINGPONG)),
                        (_loader, (args, BLOCK_N, NUM_BUF, CAUSAL, PINGPONG))],
                       [4, 1], [CONSUMER_REGS, 24])


# ---------------------------------------------------------------------------------------------------------------
# Backward: dK, dV per 128-key tile (dQ and delta stay with kernels/attention.py's Triton dq kernel, which runs first)
# ---------------------------------------------------------------------------------------------------------------

@gluon.jit
def _bwd_item(t, n_items, n_bh, H, Tq, BLOCK_Q: gl.constexpr, CAUSAL: gl.constexpr):
    """Work item t -> (b, h, b*h, first key n0, first and end query block). Key tiles of 2 * SUB_M keys; under a
    causal mask the first key tiles see the most queries, so they come first, dealt in the zigzag of _work_item."""
    t = _zigzag(t, n_items)
    bh = t % n_bh
    n0 = (t // n_bh) * (2 * SUB_M)
    lo = 0
    if CAUSAL:
        lo = n0 // BLOCK_Q  # queries before the tile's first key see none of its keys
    return bh // H, bh % H, bh, n0, lo, gl.cdiv(Tq, BLOCK_Q)


@gluon.jit
def _bwd_loader(args, BLOCK_Q: gl.constexpr, NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr):
    (q_desc, k_desc, v_desc, do_desc, l_desc, d_desc, k_smem, v_smem, q_bufs, do_bufs, l_bufs, d_bufs, kv_ready,
     kv_empty, qd_ready, qd_empty, DK, DV, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, qk_scale, sm_scale, H, Tq, Tk, n_bh,
     n_items, q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, do_rb, do_rh, do_ch) = args
    j = 0  # query blocks issued: ring slot and phase
    i = 0  # items: K/V slot and phase
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, bh, n0, lo, hi = _bwd_item(t, n_items, n_bh, H, Tq, BLOCK_Q, CAUSAL)
        ks = i % 2
        mbarrier.wait(kv_empty.index(ks), ((i // 2) & 1) ^ 1)
        mbarrier.expect(kv_ready.index(ks), 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        for c in gl.static_range(2):  # each consumer's 64 keys
            tma.async_copy_global_to_shared(k_desc, [b * k_rb + h * k_rh + n0 + c * SUB_M, h * k_ch],
                                            kv_ready.index(ks), k_smem.index(2 * ks + c))
            tma.async_copy_global_to_shared(v_desc, [b * v_rb + h * v_rh + n0 + c * SUB_M, h * v_ch],
                                            kv_ready.index(ks), v_smem.index(2 * ks + c))
        for n in range(lo, hi):
            s = j % NUM_BUF
            mbarrier.wait(qd_empty.index(s), ((j // NUM_BUF) & 1) ^ 1)
            mbarrier.expect(qd_ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                            + l_desc.block_type.nbytes + d_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b * q_rb + h * q_rh + n * BLOCK_Q, h * q_ch],
                                            qd_ready.index(s), q_bufs.index(s))
            tma.async_copy_global_to_shared(do_desc, [b * do_rb + h * do_rh + n * BLOCK_Q, h * do_ch],
                                            qd_ready.index(s), do_bufs.index(s))
            tma.async_copy_global_to_shared(l_desc, [bh, n * BLOCK_Q], qd_ready.index(s), l_bufs.index(s))
            tma.async_copy_global_to_shared(d_desc, [bh, n * BLOCK_Q], qd_ready.index(s), d_bufs.index(s))
            j += 1
        i += 1


@gluon.jit
def _lse_delta(l_bufs, d_bufs, s, BLOCK_Q: gl.constexpr, layout: gl.constexpr):
    """Base-2 lse and delta of the query block in stage s (the loader's TMA zero-fills columns past Tq)."""
    return (l_bufs.index(s).reshape([BLOCK_Q]).load(layout) * 1.4426950408889634,
            d_bufs.index(s).reshape([BLOCK_Q]).load(layout))


@gluon.jit
def _bwd_block(st, dpt, dk, dv, q, do, lse2, delta, n, keys, n0, Tq, qk_scale,
               BLOCK_Q: gl.constexpr, CAUSAL: gl.constexpr, op_layout: gl.constexpr, qcol_l: gl.constexpr):
    """One query block of a consumer, its S^T and dP^T wgmmas already issued: P^T = exp2(S^T * scale - lse) while
    dP^T runs, dV += P^T dO, dS^T = P^T (dP^T - delta), dK += dS^T Q (dK, dV returned in flight)."""
    st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
    cols = n * BLOCK_Q + gl.arange(0, BLOCK_Q, layout=qcol_l)
    masked = (n + 1) * BLOCK_Q > Tq
    if CAUSAL:
        masked = masked | (n * BLOCK_Q < n0 + 2 * SUB_M)
    if masked:  # the diagonal blocks and the query tail
        keep = gl.expand_dims(cols < Tq, 0) & gl.expand_dims(keys >= 0, 1)
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) >= gl.expand_dims(keys, 1))
        pt = gl.where(keep, pt, 0.0)
    dv = warpgroup_mma(gl.convert_layout(pt.to(do.dtype), op_layout), do, dv, is_async=True)
    dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
    dst = pt * (dpt - gl.expand_dims(delta, 0))
    dk = warpgroup_mma(gl.convert_layout(dst.to(q.dtype), op_layout), q, dk, is_async=True)
    return dk, dv, st, dpt


@gluon.jit
def _bwd_consume(WG: gl.constexpr, args, BLOCK_Q: gl.constexpr, NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr):
    """Consumer WG: keys [n0 + 64*WG, +64) of each item. Per query block (all transposed, rows are keys):
    S^T = K Q^T and dP^T = V dO^T issued together; P^T = exp2(S^T * scale - lse) while dP^T runs; dV += P^T dO;
    dS^T = P^T (dP^T - delta); dK += dS^T Q. P^T and dS^T go to wgmma from registers."""
    (q_desc, k_desc, v_desc, do_desc, l_desc, d_desc, k_smem, v_smem, q_bufs, do_bufs, l_bufs, d_bufs, kv_ready,
     kv_empty, qd_ready, qd_empty, DK, DV, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, qk_scale, sm_scale, H, Tq, Tk, n_bh,
     n_items, q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, do_rb, do_rh, do_ch) = args
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = k_desc.dtype
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_Q, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    keys_l: gl.constexpr = gl.SliceLayout(1, st_layout)
    qcol_l: gl.constexpr = gl.SliceLayout(0, st_layout)
    st = gl.zeros([SUB_M, BLOCK_Q], gl.float32, st_layout)  # registers reused as the ignored accumulator inputs
    dpt = gl.zeros([SUB_M, BLOCK_Q], gl.float32, st_layout)
    j = 0
    i = 0
    for t in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, bh, n0, lo, hi = _bwd_item(t, n_items, n_bh, H, Tq, BLOCK_Q, CAUSAL)
        keys = n0 + WG * SUB_M + gl.arange(0, SUB_M, layout=keys_l)
        ks = i % 2
        mbarrier.wait(kv_ready.index(ks), (i // 2) & 1)
        k = k_smem.index(2 * ks + WG)
        v = v_smem.index(2 * ks + WG)
        dk = gl.zeros([SUB_M, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([SUB_M, HEAD_DIM], gl.float32, acc_layout)
        for n in range(lo, hi):
            s = j % NUM_BUF
            mbarrier.wait(qd_ready.index(s), (j // NUM_BUF) & 1)
            st = warpgroup_mma(k, q_bufs.index(s).permute((1, 0)), st, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v, do_bufs.index(s).permute((1, 0)), dpt, use_acc=False, is_async=True)
            lse2, delta = _lse_delta(l_bufs, d_bufs, s, BLOCK_Q, qcol_l)
            dk, dv, st, dpt = _bwd_block(st, dpt, dk, dv, q_bufs.index(s), do_bufs.index(s), lse2, delta, n, keys,
                                         n0, Tq, qk_scale, BLOCK_Q, CAUSAL, op_layout, qcol_l)
            dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
            mbarrier.arrive(qd_empty.index(s), count=1)
            j += 1
        mbarrier.arrive(kv_empty.index(ks), count=1)  # K, V reads done (every wgmma waited)
        i += 1
        rows = n0 + WG * SUB_M + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, acc_layout))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        ok = gl.expand_dims(rows < Tk, 1) & gl.expand_dims(d < HEAD_DIM, 0)
        r64 = gl.expand_dims(rows.to(gl.int64), 1)
        gl.store(DK + b.to(gl.int64) * sk_b + h.to(gl.int64) * sk_h + r64 * sk_t + gl.expand_dims(d, 0),
                 (dk * sm_scale).to(dtype), mask=ok)
        gl.store(DV + b.to(gl.int64) * sv_b + h.to(gl.int64) * sv_h + r64 * sv_t + gl.expand_dims(d, 0),
                 dv.to(dtype), mask=ok)


@gluon.jit
def _bwd_consumer1(args, BLOCK_Q: gl.constexpr, NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr):
    _bwd_consume(1, args, BLOCK_Q, NUM_BUF, CAUSAL)


@gluon.jit(do_not_specialize=["H", "Tq", "Tk", "n_bh", "q_rb", "q_rh", "q_ch", "k_rb", "k_rh", "k_ch", "v_rb",
                              "v_rh", "v_ch", "do_rb", "do_rh", "do_ch"])
def _attn_bwd_dkdv_ws_kernel(q_desc, k_desc, v_desc, do_desc, l_desc, d_desc, DK, DV,
                             sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, qk_scale, sm_scale, H, Tq, Tk, n_bh,
                             q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, do_rb, do_rh, do_ch,
                             BLOCK_Q: gl.constexpr, NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr):
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [4] + k_desc.block_type.shape, k_desc.layout)  # 2 slots x 2
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [4] + v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [NUM_BUF] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [NUM_BUF] + do_desc.block_type.shape, do_desc.layout)
    l_bufs = gl.allocate_shared_memory(l_desc.dtype, [NUM_BUF] + l_desc.block_type.shape, l_desc.layout)  # lse
    d_bufs = gl.allocate_shared_memory(d_desc.dtype, [NUM_BUF] + d_desc.block_type.shape, d_desc.layout)  # delta
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    qd_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    qd_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(kv_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=2)
    for s in gl.static_range(NUM_BUF):
        mbarrier.init(qd_ready.index(s), count=1)
        mbarrier.init(qd_empty.index(s), count=2)
    n_items = gl.cdiv(Tk, 2 * SUB_M) * n_bh
    args = (q_desc, k_desc, v_desc, do_desc, l_desc, d_desc, k_smem, v_smem, q_bufs, do_bufs, l_bufs, d_bufs, kv_ready,
            kv_empty, qd_ready, qd_empty, DK, DV, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, qk_scale, sm_scale, H, Tq, Tk,
            n_bh, n_items, q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, do_rb, do_rh, do_ch)
    gl.warp_specialize([(_bwd_consume, (0, args, BLOCK_Q, NUM_BUF, CAUSAL)),
                        (_bwd_consumer1, (args, BLOCK_Q, NUM_BUF, CAUSAL)),
                        (_bwd_loader, (args, BLOCK_Q, NUM_BUF, CAUSAL))],
                       [4, 1], [CONSUMER_REGS, 24])


# ---------------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------------

def _rows(x):
    """How TMA reads x (B, H, T, D) as 2-D row blocks: (shape, strides, rows per batch, rows per head, column per
    head), or None for a layout it cannot read that way."""
    B, H, T, D = x.shape
    sb, sh, st, sd = x.stride()
    es = x.element_size()
    if sd != 1 or x.data_ptr() % 16 or (st * es) % 16:
        return None
    if (H == 1 or sh == T * st) and (B == 1 or sb == H * T * st):  # (B, H, T, D) memory, rows of stride st
        return [B * H * T, D], [st, 1], H * T, T, 0
    if (B == 1 or sb == T * st) and (H == 1 or (D <= sh and (H - 1) * sh + D <= st)):  # (B, T, H, D)-like
        return [B * T, (H - 1) * sh + D], [st, 1], T, 0, sh
    return None


def supported(q, k, v, causal, sm_scale=None) -> bool:
    """True where this forward runs: a Hopper GPU, bf16/fp16, head dim 64 or 128, TMA-readable layouts."""
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or not (q.dtype == k.dtype == v.dtype):
        return False
    if q.shape[-1] not in CONFIGS or (sm_scale is not None and sm_scale <= 0):
        return False
    return all(_rows(t) is not None for t in (q, k, v))


def _desc(x, block_rows):
    """A host TMA descriptor of x's rows in blocks of (block_rows, D), and x's (rows per batch, rows per head,
    column per head) for the kernel's coordinates."""
    shape, strides, rb, rh, ch = _rows(x)
    block = [block_rows, x.shape[-1]]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16)
    return TensorDescriptor(x, shape, strides, block, layout), (rb, rh, ch)


_NUM_SMS = {}


def _num_sms(device) -> int:
    """SMs of q's GPU: the persistent grids launch at most one CTA per SM."""
    dev = device.index if device.index is not None else torch.cuda.current_device()
    if dev not in _NUM_SMS:
        _NUM_SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _NUM_SMS[dev]


_fwd_ws = fast(_attn_fwd_ws_kernel)  # the compiled binary launched directly after the first call
_TUNED = {}  # (head dim, causal, Tk bucket, B*H bucket) -> the fastest CONFIGS candidate, timed on first use
_FWD_TUNER = tuning.Tuner(f"{__name__}:_FWD_TUNER", _attn_fwd_ws_kernel, CONFIGS)  # _TUNED's entries on disk


def _launch_args(q, k, v, out, lse, causal, scale, cfg):
    """(grid, args, constexprs) of the forward kernel for one CONFIGS candidate."""
    B, H, Tq, D = q.shape
    BLOCK_N, NUM_BUF, PINGPONG = cfg
    q_desc, qr = _desc(q, ROWS)
    k_desc, kr = _desc(k, BLOCK_N)
    v_desc, vr = _desc(v, BLOCK_N)
    grid = (min(cdiv(Tq, 2 * ROWS) * B * H, _num_sms(q.device)), )
    return grid, (q_desc, k_desc, v_desc, out, lse, *out.stride()[:3], scale * LOG2E, H, Tq, k.shape[2], B * H,
                  *qr, *kr, *vr), dict(BLOCK_N=BLOCK_N, NUM_BUF=NUM_BUF, CAUSAL=bool(causal), PINGPONG=PINGPONG,
                                       num_warps=4)


def _launch(q, k, v, out, lse, causal, scale, cfg):
    grid, args, meta = _launch_args(q, k, v, out, lse, causal, scale, cfg)
    _fwd_ws[grid](*args, **meta)


def _config(q, k, v, out, lse, causal, scale, fallback):
    """The CONFIGS candidate for this shape (TRITON only where a fallback is given): the first while a CUDA graph is
    being captured or where there is one, else the fastest, timed once per (head dim, causal, Tk and B*H power-of-2
    buckets) as triton.autotune would (its key), with a graph-capture guard. The choice is stored on disk
    (kernels/tuning.py): a later process on the same GPU skips the timing and compiles only the chosen kernel."""
    B, H, _, D = q.shape
    cands = [c for c in CONFIGS[D] if c != TRITON or fallback is not None]
    key = (D, bool(causal), next_pow2(k.shape[2]), min(next_pow2(B * H), 1024))
    if key not in _TUNED and len(cands) > 1:
        stored = _FWD_TUNER.get(key)  # a JSON list, or TRITON
        stored = tuple(stored) if isinstance(stored, list) else stored
        if stored in CONFIGS[D]:  # (a TRITON choice without a fallback: attention_fwd runs CONFIGS[D][0])
            _TUNED[key] = stored
    if key not in _TUNED:
        if len(cands) == 1 or torch.cuda.is_current_stream_capturing():
            return cands[0]
        # GPU time by CUDA-graph replay, as a training step sees it when the host runs ahead: do_bench would count
        # each call's launch cost, larger for the Gluon kernels (host descriptors), and so picks Triton at D64 on
        # an H100 where the Gluon forward is 7% faster on the GPU
        def run(c):
            if c == TRITON:
                return lambda: fallback(q, k, v, causal, scale)
            return lambda: _launch(q, k, v, out, lse, causal, scale, c)
        # interleaved rounds, the best of each candidate: D128 forward times drift 6-10% within seconds on an H100,
        # so one timing per candidate would pick whichever ran in a fast moment
        ms = [float("inf")] * len(cands)
        with _FWD_TUNER.tuning(f"attention forward for D={D}, causal={bool(causal)}, T<={key[2]}, B*H<={key[3]} "
                               f"({len(cands)} candidates)"):
            tuning.compile_parallel(_attn_fwd_ws_kernel, [_launch_args(q, k, v, out, lse, causal, scale, c)
                                                          for c in cands if c != TRITON])
            for _ in range(3):
                for i, c in enumerate(cands):
                    ms[i] = min(ms[i], triton.testing.do_bench_cudagraph(run(c), rep=10))
            _TUNED[key] = cands[ms.index(min(ms))]
            _FWD_TUNER.put(key, _TUNED[key])
    return _TUNED[key]


def attention_fwd(q, k, v, causal, sm_scale=None, config=None, fallback=None):
    """Forward of q (B, H, Tq, D) against k, v (B, H, Tk, D), where supported(). Returns (out, lse) exactly as
    kernels.attention.attention_block_fwd: out a (B, H, Tq, D) view of (B, Tq, H, D) memory, lse fp32 (B, H, Tq).
    config: a CONFIGS entry to use instead of the tuned one (the benchmark's sweep). fallback: another forward with
    this signature (kernels/attention.py's Triton one), timed as the TRITON candidate and called where it won;
    without it only the Gluon candidates run."""
    B, H, Tq, D = q.shape
    scale = sm_scale if sm_scale is not None else D ** -0.5
    out = torch.empty(B, Tq, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
    if out.numel() == 0 or k.shape[2] == 0:
        return out, lse
    cfg = config or _config(q, k, v, out, lse, causal, scale, fallback)
    if cfg == TRITON:
        if fallback is not None:
            return fallback(q, k, v, causal, scale)
        cfg = CONFIGS[D][0]  # tuned by a call that had a fallback; this one has none
    _launch(q, k, v, out, lse, causal, scale, cfg)
    return out, lse


# head dim -> (BLOCK_Q queries per step, NUM_BUF Q/dO stages) of the dK/dV kernel
BWD_CONFIGS = {64: [(64, 4)], 128: [(32, 4)]}
_bwd_ws = fast(_attn_bwd_dkdv_ws_kernel)


def attention_bwd_dkdv(q, k, v, do, lse, delta, dk, dv, causal, sm_scale=None, config=None):
    """dK, dV of attention into dk, dv ((B, H, Tk, D), unit stride along D, any other strides), given lse (the
    forward's) and delta = rowsum(dO * O) as kernels/attention.py's dq kernel stores them ((B*H, Tq) contiguous
    fp32, read through TMA: Tq % 4 == 0). q, k, v and do must pass supported()."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    scale = sm_scale if sm_scale is not None else D ** -0.5
    BLOCK_Q, NUM_BUF = config or BWD_CONFIGS[D][0]
    q_desc, qr = _desc(q, BLOCK_Q)
    do_desc, dor = _desc(do, BLOCK_Q)
    k_desc, kr = _desc(k, ROWS)
    v_desc, vr = _desc(v, ROWS)
    vec = gl.NVMMASharedLayout.get_default_for([1, BLOCK_Q], gl.float32)  # lse, delta: (B*H, Tq) rows, Tq % 4 == 0
    l_desc = TensorDescriptor(lse, [B * H, Tq], [Tq, 1], [1, BLOCK_Q], vec)
    d_desc = TensorDescriptor(delta, [B * H, Tq], [Tq, 1], [1, BLOCK_Q], vec)
    grid = (min(cdiv(Tk, 2 * ROWS) * B * H, _num_sms(q.device)), )
    _bwd_ws[grid](q_desc, k_desc, v_desc, do_desc, l_desc, d_desc, dk, dv, *dk.stride()[:3], *dv.stride()[:3],
                  scale * LOG2E, scale, H, Tq, Tk, B * H, *qr, *kr, *vr, *dor,
                  BLOCK_Q=BLOCK_Q, NUM_BUF=NUM_BUF, CAUSAL=bool(causal), num_warps=4)


# ---------------------------------------------------------------------------------------------------------------
# Parity check and benchmark: python -m kernels.attention_hopper [--sweep]
# ---------------------------------------------------------------------------------------------------------------

def _graph_ms(fn, reps=20):
    """GPU time of fn() replayed from a CUDA graph (no host cost), median of 5 timings of `reps` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return sorted(times)[2]


def _ref(q, k, v, causal):
    """fp32 attention in plain PyTorch (kernels/attention.py's attention_ref, which this file does not import)."""
    s = q.float() @ k.float().transpose(-2, -1) * q.shape[-1] ** -0.5  # (B, H, Tq, Tk)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Tq)
    return torch.exp(s - lse[..., None]) @ v.float(), lse


def _packed(B, H, T, D):
    """q, k, v as (B, H, T, D) views of the model's packed (B, T, 3*H*D) projection."""
    qkv = torch.randn(B, T, 3, H, D, device="cuda", dtype=torch.bfloat16)
    return tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))


def _bench(sweep=False):
    """Parity lines, host time per call, then GPU time of the forward (the tuned Gluon candidate, or each one with
    sweep) against cuDNN SDPA, and of the dK/dV kernel. Gluon against the Triton kernels, forward and backward:
    `python -m kernels.attention` on a Hopper GPU."""
    import time

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for B, H, T, D, causal in [(2, 3, 777, 64, True), (1, 2, 129, 128, False), (2, 2, 1000, 128, True)]:
        q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
        out, lse = attention_fwd(q, k, v, causal)
        ref, ref_lse = _ref(q, k, v, causal)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cud = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        print(f"parity B{B} H{H} T{T} D{D} causal={causal}: out err {(out.float() - ref).abs().max().item():.2e} "
              f"(cudnn {(cud.float() - ref).abs().max().item():.2e}), lse err "
              f"{(lse - ref_lse).abs().max().item():.2e}")
    q, k, v = _packed(1, 2, 128, 64)
    for _ in range(20):
        attention_fwd(q, k, v, True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(300):
        attention_fwd(q, k, v, True)
    host = (time.perf_counter() - t0) / 300 * 1e6
    torch.cuda.synchronize()
    print(f"host time per forward call (B1 H2 T128, launch + Python): {host:.1f} us")
    print(f"{'shape':>22} {'config':>10} {'ours ms':>8} {'cudnn ms':>8} {'TFLOP/s':>8} {'vs cudnn':>8}")
    shapes = [(16, 12, 1024, 64), (4, 16, 4096, 128), (8, 16, 2048, 64), (8, 16, 2048, 128)]
    for B, H, T, D in shapes:
        q, k, v = _packed(B, H, T, D)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cud = _graph_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        flops = 4 * B * H * T * T * D / 2
        attention_fwd(q, k, v, True)  # tunes this shape outside the graph capture
        key = _TUNED[(D, True, next_pow2(T), min(next_pow2(B * H), 1024))]
        for cfg in ([c for c in CONFIGS[D] if c != TRITON] if sweep else [None]):
            ours = _graph_ms(lambda: attention_fwd(q, k, v, True, config=cfg))
            c = cfg or key
            name = ("tuned " if cfg is None else "") + f"{c[0]}x{c[1]}" + ("pp" if c[2] else "")
            print(f"{f'B{B} H{H} T{T} D{D}':>22} {name:>10} {ours:8.3f} {cud:8.3f} {flops / ours / 1e9:8.1f} "
                  f"{cud / ours:7.2f}x")
    print(f"dK/dV kernel alone (GPU time): {'shape':>18} {'config':>7} {'ms':>7} {'TFLOP/s':>8}")
    for B, H, T, D in shapes:
        q, k, v = _packed(B, H, T, D)
        out, lse = attention_fwd(q, k, v, True)
        do = torch.randn_like(out)
        delta = (do.float() * out.float()).sum(-1).contiguous()  # (B, H, T): what the Triton dq kernel stores
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        for cfg in (BWD_CONFIGS[D] if sweep else BWD_CONFIGS[D][:1]):
            ms = _graph_ms(lambda: attention_bwd_dkdv(q, k, v, do, lse, delta, dk, dv, True, config=cfg))
            flops = 8 * B * H * T * T * D / 2  # 4 matmuls (S^T, dP^T, dV, dK): twice the forward's
            print(f"{'':>31}{f'B{B} H{H} T{T} D{D}':>18} {f'{cfg[0]}x{cfg[1]}':>7} {ms:7.3f} "
                  f"{flops / ms / 1e9:8.1f}")


if __name__ == "__main__":
    import sys
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        raise SystemExit("kernels.attention_hopper: needs a Hopper (sm_90) GPU; nothing to measure here")
    _bench("--sweep" in sys.argv)
