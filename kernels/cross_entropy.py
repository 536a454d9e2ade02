"""Cross-entropy over a padded vocabulary, forward and backward fused in one Triton pass.
Long file: the fused loss and the vocab-parallel shard kernels (tp.py) share the row walk and the benchmark.

Math, per row of logits z (N, Vp), target t, real vocab V = n_vocab <= Vp (GPT-2: 50257 padded to 50304):
    lse = log(sum_{j < V} exp(z_j)),  loss = lse - z_t,  dz_j = (softmax(z)_j - [j == t]) * scale (j < V), 0 for j >= V.
Rows with t == ignore_index have loss 0 and grad 0; "mean" divides by the other rows (0, not NaN, if all are
ignored). Other targets outside [0, V) are not checked (a host sync): no out-of-bounds read, a meaningless loss.

How (online softmax, Milakov & Gimelshein 2018): one program per row walks the vocab in chunks keeping a running max
and sum of exp(z - m); if grad is needed, a second walk over the row (mostly from L2) writes dz. So the forward
already holds d(loss)/d(logits) up to the incoming grad scalar; the backward multiplies by it, and skips that pass
(no host sync) when it is 1: a trainer that accumulates passes `loss_scale=1/accum_steps` instead of dividing.
Memory: dz is written IN PLACE into the logits when they are a non-leaf activation (the lm_head output, which no
other op saves): peak extra memory O(N); the version bump makes autograd raise if an op did save them. After
backward the logits hold their gradient (or pass `inplace=False`); a leaf logits tensor is never overwritten.

Vocab-parallel pieces (Triton on CUDA, reference elsewhere), used by nanopara/tp.py without gathering logits:
    ce_shard_stats(z_shard, t, vocab_start, n_valid) -> (row_max, sumexp at row_max, target logit)
    ce_shard_grad(z_shard, t, vocab_start, n_valid, lse, grad_scale) -> dz_shard
  M = all_reduce_max(row_max); S = all_reduce_sum(sumexp * exp(row_max - M)); zt = all_reduce_sum(target logit);
  lse = M + log(S); loss = lse - zt; then ce_shard_grad with the global lse and grad_scale = 1/n_valid (mean).
Callers: nanopara/model.py (loss), nanopara/tp.py (vocab-parallel loss). Tests: tests/test_cross_entropy.py.
Run: `python -m kernels.cross_entropy [--quick] [--sweep] [--out FILE]`: parity, then fwd+bwd time, GB/s and peak
extra memory against eager F.cross_entropy (bf16 and fp32) and torch.compile.
"""
import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.launch import cdiv, fast


def cross_entropy_ref(logits, targets, n_vocab=None, ignore_index=-1, reduction="mean", loss_scale=1.0):
    """Pure-PyTorch spec: fp32 cross-entropy over the first n_vocab columns, padding excluded, times loss_scale."""
    n_vocab = logits.shape[-1] if n_vocab is None else n_vocab
    z = logits[:, :n_vocab].float()
    valid = targets != ignore_index
    lse = torch.logsumexp(z, dim=-1)
    zt = z.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, lse - zt, 0.0).sum() * loss_scale
    return loss / valid.sum().clamp(min=1) if reduction == "mean" else loss


def ce_shard_stats_ref(logits_shard, targets, vocab_start, n_valid_in_shard, ignore_index=-1):
    """(row max, sum exp(z - row max), target logit or 0) over the shard's first n_valid_in_shard columns."""
    z = logits_shard[:, :n_valid_in_shard].float()
    row_max = z.max(-1).values
    sumexp = torch.exp(z - row_max[:, None]).sum(-1)
    local = targets - vocab_start
    here = (targets != ignore_index) & (local >= 0) & (local < n_valid_in_shard)
    zt = torch.where(here, z.gather(1, torch.where(here, local, 0).unsqueeze(1)).squeeze(1), 0.0)
    return row_max, sumexp, zt


def ce_shard_grad_ref(logits_shard, targets, vocab_start, n_valid_in_shard, lse, grad_scale, ignore_index=-1):
    """(softmax - onehot) * grad_scale from the global lse; 0 on padding columns and ignored rows."""
    z = logits_shard.float()
    cols = torch.arange(z.shape[1], device=z.device)
    g = torch.exp(z - lse[:, None]) - (cols[None, :] == (targets - vocab_start)[:, None]).float()
    keep = (cols[None, :] < n_valid_in_shard) & (targets != ignore_index)[:, None]
    return (torch.where(keep, g, 0.0) * grad_scale).to(logits_shard.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels: two row helpers (stats walk, grad walk), composed by three small kernels

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E): exp2 is the native instruction


@triton.jit
def _row_stats(Z, row, stride_z, t, vocab_start, n_cols, n_cols_padded, BLOCK_V: tl.constexpr,
               STAGES: tl.constexpr):
    """Online max / sum-exp over the first n_cols columns of one row; also picks out z[t - vocab_start].
    STAGES > 1: the next chunks' loads are in flight (cp.async) while a chunk reduces."""
    cols = tl.arange(0, BLOCK_V)
    z_row = Z + row.to(tl.int64) * stride_z  # N * Vp can exceed 2**31
    m = -float("inf")
    s = 0.0
    for start in tl.range(0, n_cols, BLOCK_V, num_stages=STAGES):
        c = start + cols
        # the load is masked by the padded width (a multiple of 16 for GPT-2's 50304, so loads vectorise);
        # padding columns are then dropped in registers
        z = tl.load(z_row + c, mask=c < n_cols_padded, other=0.0).to(tl.float32)
        z = tl.where(c < n_cols, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # the first chunk always holds a real column, so m_new is finite from here on (no inf - inf)
        s = s * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.exp2((z - m_new) * LOG2E), axis=0)
        m = m_new
    local = t - vocab_start
    here = (local >= 0) & (local < n_cols)
    zt = tl.load(z_row + local, mask=here, other=0.0).to(tl.float32)
    return m, s, zt


@triton.jit
def _row_grad(Z, DZ, row, stride_z, stride_dz, t, vocab_start, n_cols, n_cols_padded, lse, scale,
              BLOCK_V: tl.constexpr, STAGES: tl.constexpr):
    """dz = (exp(z - lse) - onehot(t)) * scale on real columns, exactly 0 on padding columns."""
    cols = tl.arange(0, BLOCK_V)
    z_row = Z + row.to(tl.int64) * stride_z
    dz_row = DZ + row.to(tl.int64) * stride_dz
    local = t - vocab_start
    for start in tl.range(0, n_cols_padded, BLOCK_V, num_stages=STAGES):
        c = start + cols
        z = tl.load(z_row + c, mask=c < n_cols_padded, other=0.0).to(tl.float32)
        z = tl.where(c < n_cols, z, -float("inf"))  # as in _row_stats: vector loads, padding dropped here
        p = tl.exp2((z - lse) * LOG2E)  # 0 on padding
        g = (p - tl.where(c == local, 1.0, 0.0)) * scale
        tl.store(dz_row + c, g.to(DZ.dtype.element_ty), mask=c < n_cols_padded)


@triton.jit
def _ce_fwd_kernel(Z, DZ, T, LOSS, LSE, SCALE, stride_z, stride_dz, n_vocab, n_cols_padded, ignore_index,
                   WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr, STAGES: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(T + row).to(tl.int32)
    valid = t != ignore_index
    m, s, zt = _row_stats(Z, row, stride_z, t, 0, n_vocab, n_cols_padded, BLOCK_V, STAGES)
    lse = m + tl.log2(s) / LOG2E
    tl.store(LOSS + row, tl.where(valid, lse - zt, 0.0))
    tl.store(LSE + row, lse)
    if WRITE_GRAD:
        # loss_scale (/ n_valid for "mean"), read on device; ignored rows get an all-zero gradient, no one-hot
        scale = tl.where(valid, tl.load(SCALE), 0.0)
        _row_grad(Z, DZ, row, stride_z, stride_dz, tl.where(valid, t, -1), 0, n_vocab, n_cols_padded, lse, scale,
                  BLOCK_V, STAGES)


@triton.jit
def _scale_kernel(DZ, G, n, BLOCK: tl.constexpr):
    """dz *= g for the incoming scalar grad g, read on device; does nothing when g == 1 (the common case)."""
    g = tl.load(G).to(tl.float32)
    if g != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        dz = tl.load(DZ + offs, mask=offs < n).to(tl.float32)
        tl.store(DZ + offs, (dz * g).to(DZ.dtype.element_ty), mask=offs < n)


@triton.jit
def _ce_shard_stats_kernel(Z, T, MAX, SUMEXP, ZT, stride_z, vocab_start, n_valid, n_cols_padded, ignore_index,
                           BLOCK_V: tl.constexpr, STAGES: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(T + row).to(tl.int32)
    t = tl.where(t == ignore_index, -1 - vocab_start, t)  # maps to local -1: never in this shard
    m, s, zt = _row_stats(Z, row, stride_z, t, vocab_start, n_valid, n_cols_padded, BLOCK_V, STAGES)
    tl.store(MAX + row, m)
    tl.store(SUMEXP + row, s)
    tl.store(ZT + row, zt)


@triton.jit
def _ce_shard_grad_kernel(Z, DZ, T, LSE, SCALE, stride_z, stride_dz, vocab_start, n_valid, n_cols_padded,
                          ignore_index, BLOCK_V: tl.constexpr, STAGES: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(T + row).to(tl.int32)
    valid = t != ignore_index
    scale = tl.where(valid, tl.load(SCALE).to(tl.float32), 0.0)
    _row_grad(Z, DZ, row, stride_z, stride_dz, tl.where(valid, t, -1 - vocab_start), vocab_start, n_valid,
              n_cols_padded, tl.load(LSE + row), scale, BLOCK_V, STAGES)


# ---------------------------------------------------------------------------------------------------------------
# Launchers

# Vocab chunk per loop step, warps per row (16 elements, two 16-byte bf16 loads, per thread) and chunks in flight
# per walk (STAGES: `tl.range` pipelining, cp.async into shared memory while a chunk reduces; needs the padded
# width 16-divisible, as GPT-2's 50304 is). 2048 x 4 warps, STAGES=3: the fastest of `--sweep` (H200: 1.19 ms at
# 16384 x 50304, 65% of copy bandwidth for one read + one write; 1.40 unpipelined; 4096 x 8 the same, 8192 x 16 slower).
BLOCK_V, NUM_WARPS, STAGES = 2048, 4, 3


# launched through kernels/launch.py: after the first call per specialization, the compiled binaries directly
_ce_fwd, _scale, _shard_stats, _shard_grad = (fast(k) for k in (_ce_fwd_kernel, _scale_kernel, _ce_shard_stats_kernel,
                                                                  _ce_shard_grad_kernel))


def _check(logits, targets, n_vocab):
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy: want logits (N, Vp) and targets (N,), got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    if not 0 < n_vocab <= logits.shape[1]:
        raise ValueError(f"cross_entropy: n_vocab={n_vocab} must be in [1, {logits.shape[1]}]")
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):  # uint16 token shards: widen
        raise ValueError(f"cross_entropy: targets must be an integer tensor, got {targets.dtype}")


def _as_scalar_tensor(x, device):
    return (x.float() if torch.is_tensor(x) else torch.tensor(float(x))).reshape(1).to(device)


def cross_entropy_fwd(logits, targets, n_vocab, ignore_index, reduction, loss_scale=1.0, dlogits=None,
                      block_v=None):
    """Returns (loss, lse). Writes d(loss)/d(logits) into `dlogits` (may be `logits` itself) when given."""
    block_v = block_v or BLOCK_V
    N, Vp = logits.shape
    loss_rows = torch.empty(N, dtype=torch.float32, device=logits.device)
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    n_valid = (targets != ignore_index).sum().clamp(min=1).float()  # device scalar: no host sync
    scale = (loss_scale / n_valid if reduction == "mean" else torch.full_like(n_valid, loss_scale)).reshape(1)
    if N > 0:
        _ce_fwd[(N,)](
            logits, dlogits, targets, loss_rows, lse, scale, logits.stride(0),
            0 if dlogits is None else dlogits.stride(0), n_vocab, Vp, ignore_index,
            WRITE_GRAD=dlogits is not None, BLOCK_V=block_v, STAGES=STAGES, num_warps=NUM_WARPS)
    return loss_rows.sum() * scale[0], lse


def cross_entropy_bwd(dlogits, grad_loss):
    """Scale the gradient stored by the forward by the incoming grad (in place, no host sync)."""
    n = dlogits.numel()
    block = 8192
    if n > 0:
        _scale[(cdiv(n, block),)](dlogits, _as_scalar_tensor(grad_loss, dlogits.device), n,
                                         BLOCK=block, num_warps=8)
    return dlogits


def ce_shard_stats_triton(logits_shard, targets, vocab_start, n_valid_in_shard, ignore_index=-1,
                          block_v=None):
    """Per-row (max, sum exp(z - max), target logit or 0) over this shard's first n_valid_in_shard columns."""
    block_v = block_v or BLOCK_V
    _check(logits_shard, targets, n_valid_in_shard)
    z = logits_shard if logits_shard.stride(1) == 1 else logits_shard.contiguous()
    N = z.shape[0]
    row_max, sumexp, zt = (torch.empty(N, dtype=torch.float32, device=z.device) for _ in range(3))
    if N > 0:
        _shard_stats[(N,)](z, targets, row_max, sumexp, zt, z.stride(0), vocab_start, n_valid_in_shard,
                           z.shape[1], ignore_index, BLOCK_V=block_v, STAGES=STAGES, num_warps=NUM_WARPS)
    return row_max, sumexp, zt


def ce_shard_grad_triton(logits_shard, targets, vocab_start, n_valid_in_shard, lse, grad_scale, ignore_index=-1,
                         out=None, block_v=None):
    """dz for this shard given the global lse; grad_scale is a float or 1-element tensor (e.g. 1/n_valid).
    `out=logits_shard` writes it in place."""
    block_v = block_v or BLOCK_V
    _check(logits_shard, targets, n_valid_in_shard)
    z = logits_shard if logits_shard.stride(1) == 1 else logits_shard.contiguous()
    out = torch.empty_like(z) if out is None else out
    N = z.shape[0]
    if N > 0:
        _shard_grad[(N,)](z, out, targets, lse.float().contiguous(),
                          _as_scalar_tensor(grad_scale, z.device), z.stride(0), out.stride(0),
                          vocab_start, n_valid_in_shard, z.shape[1], ignore_index, BLOCK_V=block_v,
                          STAGES=STAGES, num_warps=NUM_WARPS)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Autograd


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, n_vocab, ignore_index, reduction, loss_scale, inplace, block_v):
        z = logits if logits.stride(1) == 1 else logits.contiguous()
        dz = None
        if ctx.needs_input_grad[0]:
            # in place only into an activation we own: a leaf is the caller's data, a copy is ours anyway
            mine = z is not logits or not logits.is_leaf
            dz = z if (inplace and mine) else torch.empty_like(z)
        loss, _ = cross_entropy_fwd(z, targets, n_vocab, ignore_index, reduction, loss_scale, dlogits=dz,
                                    block_v=block_v)
        if dz is not None:
            if dz is logits:
                torch.autograd.graph.increment_version(logits)  # anyone who saved the logits now fails loudly
            ctx.save_for_backward(dz)
        ctx.spent = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.spent:  # the first backward scaled the stored gradient in place and handed it on
            raise RuntimeError("cross_entropy: backward through the Triton loss can run only once "
                               "(retain_graph=True is not supported)")
        ctx.spent = True
        (dz,) = ctx.saved_tensors
        return cross_entropy_bwd(dz, grad_loss), None, None, None, None, None, None, None


def cross_entropy_triton(logits, targets, n_vocab=None, ignore_index=-1, reduction="mean", loss_scale=1.0,
                         inplace=True, block_v=None):
    """Triton path on any device (CPU tensors need TRITON_INTERPRET=1)."""
    n_vocab = logits.shape[-1] if n_vocab is None else n_vocab
    _check(logits, targets, n_vocab)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    return CrossEntropyFunction.apply(logits, targets, n_vocab, ignore_index, reduction, loss_scale, inplace,
                                      block_v)


def cross_entropy(logits, targets, n_vocab=None, ignore_index=-1, reduction="mean", loss_scale=1.0, inplace=True):
    """Mean (or sum) cross-entropy over rows whose target != ignore_index, padding columns >= n_vocab excluded,
    times loss_scale. On CUDA the gradient is computed in the forward and, with inplace=True, stored in the logits
    buffer. Pass loss_scale=1/grad_accum_steps instead of dividing the returned loss: the backward then receives
    a grad of 1 and skips its rescaling pass over the logits."""
    if logits.is_cuda:
        return cross_entropy_triton(logits, targets, n_vocab, ignore_index, reduction, loss_scale, inplace)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    n_vocab = logits.shape[-1] if n_vocab is None else n_vocab
    _check(logits, targets, n_vocab)
    return cross_entropy_ref(logits, targets, n_vocab, ignore_index, reduction, loss_scale)


def ce_shard_stats(logits_shard, targets, vocab_start, n_valid_in_shard, ignore_index=-1):
    """Vocab-parallel forward statistics of one shard (see the module docstring for the all-reduce recipe)."""
    if logits_shard.is_cuda:
        return ce_shard_stats_triton(logits_shard, targets, vocab_start, n_valid_in_shard, ignore_index)
    return ce_shard_stats_ref(logits_shard, targets, vocab_start, n_valid_in_shard, ignore_index)


def ce_shard_grad(logits_shard, targets, vocab_start, n_valid_in_shard, lse, grad_scale, ignore_index=-1,
                  out=None):
    """Vocab-parallel gradient of one shard from the global lse; padding and ignored rows get exactly 0."""
    if logits_shard.is_cuda:
        return ce_shard_grad_triton(logits_shard, targets, vocab_start, n_valid_in_shard, lse, grad_scale,
                                    ignore_index, out)
    g = ce_shard_grad_ref(logits_shard, targets, vocab_start, n_valid_in_shard, lse, grad_scale, ignore_index)
    return g if out is None else out.copy_(g)


# ---------------------------------------------------------------------------------------------------------------
# Parity + benchmark: python -m kernels.cross_entropy [--quick] [--sweep] [--out FILE]


def _parity(N, V, Vp):
    torch.manual_seed(0)
    logits = torch.randn(N, Vp, device="cuda", dtype=torch.bfloat16) * 3
    targets = torch.randint(0, V, (N,), device="cuda")
    targets[::7] = -1
    ref_in = logits.float().requires_grad_()
    ref = cross_entropy_ref(ref_in, targets, V)
    ref.backward()
    z = logits.clone().requires_grad_()
    h = z * 1  # non-leaf: the in-place path
    loss = cross_entropy(h, targets, V)
    loss.backward()
    print(f"parity {N}x{Vp} (V={V}) bf16: loss {loss.item():.6f} vs fp32 ref {ref.item():.6f}, "
          f"max |dlogits - ref| {(z.grad.float() - ref_in.grad).abs().max().item():.3e}, "
          f"padding grad max {z.grad[:, V:].abs().max().item():.1e}")


def _copy_bandwidth():
    """Measured device-to-device copy bandwidth in GB/s (read + write): the roofline of a memory-bound op."""
    src = torch.empty(256 * 2**20, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e6


def _bench(N, V, Vp, compile_ok, copy_gbs):
    targets = torch.randint(0, V, (N,), device="cuda")
    leaf = torch.randn(N, Vp, device="cuda", dtype=torch.bfloat16).requires_grad_()

    def eager_bf16(z):
        return F.cross_entropy(z[:, :V], targets, ignore_index=-1)

    def eager_fp32(z):  # what autocast does: F.cross_entropy runs in fp32
        return F.cross_entropy(z[:, :V].float(), targets, ignore_index=-1)

    impls = {"triton": lambda z: cross_entropy(z, targets, V), "eager-bf16": eager_bf16,
             "eager-fp32": eager_fp32}
    if compile_ok:
        impls["compile-fp32"] = torch.compile(eager_fp32)
    rows = []
    for name, fn in impls.items():
        # a view of the leaf is a non-leaf activation, like lm_head's output in the model: the Triton path
        # writes its gradient into that buffer (the leaf's values then hold gradients: harmless for timing)
        def step():
            fn(leaf.view(N, Vp)).backward()

        step()
        ms = triton.testing.do_bench(step, grad_to_none=[leaf], return_mode="median")
        leaf.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()  # eager's extra includes its logits-sized gradient; ours lives in the logits buffer
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
        leaf.grad = None
        gbs = 2 * N * Vp * 2 / ms / 1e6  # must move: read the bf16 logits once, write dlogits once
        rows.append(dict(op="cross_entropy", impl=name, N=N, V=V, Vp=Vp, fwd_bwd_ms=ms, gbs=gbs,
                         pct_copy=100 * gbs / copy_gbs, peak_extra_gb=extra / 1e9))
    for r in rows:
        for b in ("eager-bf16", "eager-fp32", "compile-fp32"):
            base_row = next((q for q in rows if q["impl"] == b), None)
            if base_row:
                r[f"speedup_vs_{b}"] = base_row["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    return rows


def _sweep(N, V, Vp, copy_gbs):
    """GPU time (CUDA-graph replay) of the fused loss writing dlogits in place, as in training, over (BLOCK_V,
    NUM_WARPS, STAGES): the numbers the constants above are set from."""
    global BLOCK_V, NUM_WARPS, STAGES
    default = BLOCK_V, NUM_WARPS, STAGES
    targets = torch.randint(0, V, (N,), device="cuda")
    z = torch.randn(N, Vp, device="cuda", dtype=torch.bfloat16)  # overwritten by its gradient: timing only
    gb = 2 * z.numel() * z.element_size() / 1e9  # logits read once, dlogits written once
    rows = []
    for bv, w in ((2048, 4), (4096, 8), (8192, 16)):
        for st in (1, 2, 3, 4):
            BLOCK_V, NUM_WARPS, STAGES = bv, w, st
            ms = triton.testing.do_bench_cudagraph(lambda: cross_entropy_fwd(z, targets, V, -1, "mean", dlogits=z),
                                                   rep=20)
            rows.append((ms, bv, w, st))
    BLOCK_V, NUM_WARPS, STAGES = default
    print(f"sweep {N}x{Vp} in place, GPU time; constants BLOCK_V, NUM_WARPS, STAGES = {default}")
    for ms, bv, w, st in sorted(rows):
        print(f"  {ms * 1e3:8.1f} us  {gb / ms * 1e3:6.0f} GB/s {100 * gb / ms * 1e3 / copy_gbs:5.1f}% of copy  "
              f"BLOCK_V={bv:5d} NUM_WARPS={w:2d} STAGES={st}" + ("  <- constants" if (bv, w, st) == default else ""))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one shape, no torch.compile")
    p.add_argument("--sweep", action="store_true", help="also sweep the launch constants at 16384 and 32768 x 50304")
    p.add_argument("--out", help="append JSON lines here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA GPU (tests run the kernels on CPU: "
                         "pytest tests/test_cross_entropy.py)")
    _parity(4096, 50257, 50304)
    copy_gbs = _copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: measured D2D copy bandwidth {copy_gbs:.0f} GB/s; "
          f"fwd+bwd of the loss on bf16 logits")
    shapes = [(16384, 50257, 50304)] if args.quick else [(8192, 50257, 50304), (16384, 50257, 50304)]
    print(f"{'shape':>14} {'impl':>13} {'f+b ms':>8} {'GB/s':>6} {'%copy':>6} {'peak extra GB':>14} "
          f"{'vs eager-bf16':>14} {'vs eager-fp32':>14} {'vs compile':>11}")
    out = open(args.out, "a") if args.out else None
    for N, V, Vp in shapes:
        for r in _bench(N, V, Vp, not args.quick, copy_gbs):
            sp = lambda k: f"{r[k]:.2f}x" if k in r else "-"  # noqa: E731
            print(f"{f'{N}x{Vp}':>14} {r['impl']:>13} {r['fwd_bwd_ms']:8.3f} {r['gbs']:6.0f} {r['pct_copy']:5.0f}% "
                  f"{r['peak_extra_gb']:14.3f} {sp('speedup_vs_eager-bf16'):>14} {sp('speedup_vs_eager-fp32'):>14} "
                  f"{sp('speedup_vs_compile-fp32'):>11}")
            if out:
                out.write(json.dumps(dict(r, device=torch.cuda.get_device_name(), copy_gbs=copy_gbs)) + "\n")
    print("GB/s counts the bytes that must move (bf16 logits read once, dlogits written once) for every impl")
    if out:
        out.close()
    if args.sweep:
        for n in (16384, 32768):
            _sweep(n, 50257, 50304, copy_gbs)


if __name__ == "__main__":
    main()
