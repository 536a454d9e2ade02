"""nanopara's Triton kernels as `torch.library` custom ops, so torch.compile can compile a model that uses them.

Why: dynamo cannot trace our Python launchers (autotuners, raw `kernel[grid](...)` calls that branch on Python
values). A custom op is one opaque node: dynamo and AOTAutograd see its schema, shape function (`register_fake`)
and backward (`register_autograd`); Inductor compiles everything around it (bias + GELU, residual adds, casts).

Ops (namespace `nanopara`; forward and backward apart, so the compiled backward calls the backward kernel):
    attn_fwd(q, k, v, causal, sm_scale) -> (out, lse)    attn_bwd(do, q, k, v, out, lse, causal, sm_scale) -> dq, dk, dv
    attn_qkv_fwd(qkv, n_head, causal, sm_scale) -> (out, lse)  qkv (B, T, 3*H*D) packed [q | k | v] heads
    attn_qkv_bwd(do, qkv, out, lse, n_head, causal, sm_scale) -> dqkv (B, T, 3*H*D): one buffer, no stack copy
        (out/dq/dk/dv: (B, H, T, D) views of (B, T, H, D) memory, as the fake functions say: free head merge)
    layernorm_fwd(x, weight, bias?, eps, out_dtype?) -> (y, mean, rstd)     x (..., C); mean, rstd (M,) fp32
    add_layernorm_fwd(x, residual, weight, bias?, eps, out_dtype?) -> (y, h, mean, rstd)     h = x + residual
    layernorm_bwd(dy, dh?, x, weight, mean, rstd, has_bias) -> (dx, dw, db)     db is (0,) without bias
    ce_fwd(logits, targets, n_vocab, ignore_index, loss_scale) -> (loss, lse)   logits (N, Vp); mean over valid rows
    ce_bwd(logits, targets, lse, grad, n_vocab, ignore_index, loss_scale) -> dlogits (N, Vp), a NEW buffer

Cross-entropy: a custom op may not mutate its input, so `ce_fwd` only reads the logits (saved for the backward
instead of dlogits: same memory) and `ce_bwd` reads them again into a new buffer: one more pass over the logits
than the eager in-place kernel (~0.8 ms a step at GPT-2 124M, B=32, H200). `cross_entropy_inplace` keeps that
eager path under torch.compile (a graph break at the loss); bench/bench_gpt.py times both.

Public functions (`attention`, ..., `cross_entropy_inplace`) call the ops with autograd, Triton on any device (CPU:
TRITON_INTERPRET=1). Callers: nanopara/model.py's TritonOps. Tests: tests/test_ops.py (opcheck, torch.compile).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kernels import attention as _attn
from kernels import cross_entropy as _ce
from kernels import layernorm as _ln


def _bthd_like(t: Tensor, dtype=None) -> Tensor:
    """Empty (B, H, T, D) view of (B, T, H, D) memory: the layout the attention launchers allocate."""
    B, H, T, D = t.shape
    return t.new_empty(B, T, H, D, dtype=dtype or t.dtype).transpose(1, 2)


# ---------------------------------------------------------------------------------------------------------------
# Attention (kernels/attention.py): flash attention forward, FlashAttention-2 backward from the saved lse


@torch.library.custom_op("nanopara::attn_fwd", mutates_args=())
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: Optional[float]) -> tuple[Tensor, Tensor]:
    return _attn.attention_block_fwd(q, k, v, causal, sm_scale)


@attn_fwd.register_fake
def _(q, k, v, causal, sm_scale):
    return _bthd_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)  # (B, H, T, D), (B, H, T)


@torch.library.custom_op("nanopara::attn_bwd", mutates_args=())
def attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
             sm_scale: Optional[float]) -> tuple[Tensor, Tensor, Tensor]:
    return _attn.attention_block_bwd(do, q, k, v, out, lse, causal, sm_scale)


@attn_bwd.register_fake
def _(do, q, k, v, out, lse, causal, sm_scale):
    return _bthd_like(q), _bthd_like(k), _bthd_like(v)


def _attn_setup(ctx, inputs, output):
    q, k, v, causal, sm_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.sm_scale = causal, sm_scale
    ctx.mark_non_differentiable(lse)  # lse is for ring attention's merge; nothing differentiates through it


def _attn_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.nanopara.attn_bwd(dout, q, k, v, out, lse, ctx.causal, ctx.sm_scale)
    return dq, dk, dv, None, None


attn_fwd.register_autograd(_attn_backward, setup_context=_attn_setup)


def attention(q, k, v, causal=True, sm_scale=None):
    """Scaled dot-product attention over (B, H, T, D) through the Triton kernels, as one graph node."""
    return torch.ops.nanopara.attn_fwd(q, k, v, causal, sm_scale)[0]


# the same over a packed (B, T, 3*H*D) projection: the backward returns d(qkv) as one buffer (no stack afterwards)

@torch.library.custom_op("nanopara::attn_qkv_fwd", mutates_args=())
def attn_qkv_fwd(qkv: Tensor, n_head: int, causal: bool, sm_scale: Optional[float]) -> tuple[Tensor, Tensor]:
    return _attn.attention_block_fwd(*_attn.split_qkv(qkv, n_head), causal, sm_scale)


@attn_qkv_fwd.register_fake
def _(qkv, n_head, causal, sm_scale):
    q = _attn.split_qkv(qkv, n_head)[0]
    return _bthd_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)  # (B, H, T, D), (B, H, T)


@torch.library.custom_op("nanopara::attn_qkv_bwd", mutates_args=())
def attn_qkv_bwd(do: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, n_head: int, causal: bool,
                 sm_scale: Optional[float]) -> Tensor:
    return _attn.attention_qkv_bwd(do, qkv, out, lse, n_head, causal, sm_scale)


@attn_qkv_bwd.register_fake
def _(do, qkv, out, lse, n_head, causal, sm_scale):
    return qkv.new_empty(qkv.shape)  # contiguous (B, T, 3*H*D)


def _attn_qkv_setup(ctx, inputs, output):
    qkv, n_head, causal, sm_scale = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse)
    ctx.n_head, ctx.causal, ctx.sm_scale = n_head, causal, sm_scale
    ctx.mark_non_differentiable(lse)


def _attn_qkv_backward(ctx, dout, dlse):
    qkv, out, lse = ctx.saved_tensors
    return torch.ops.nanopara.attn_qkv_bwd(dout, qkv, out, lse, ctx.n_head, ctx.causal, ctx.sm_scale), None, None, None


attn_qkv_fwd.register_autograd(_attn_qkv_backward, setup_context=_attn_qkv_setup)


def attention_qkv(qkv, n_head, causal=True, sm_scale=None):
    """attention() over a packed (B, T, 3*H*D) projection, as one graph node; out (B, H, T, D)."""
    return torch.ops.nanopara.attn_qkv_fwd(qkv, n_head, causal, sm_scale)[0]


# ---------------------------------------------------------------------------------------------------------------
# LayerNorm and residual-add + LayerNorm (kernels/layernorm.py)


def _stats_like(x: Tensor) -> Tensor:
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return x.new_empty(M, dtype=torch.float32)  # (M,)


@torch.library.custom_op("nanopara::layernorm_fwd", mutates_args=())
def layernorm_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float,
                  out_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor, Tensor]:
    y, _, mean, rstd = _ln.layernorm_fwd(x, weight, bias, eps, out_dtype=out_dtype)
    return y, mean, rstd


@layernorm_fwd.register_fake
def _(x, weight, bias, eps, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype), _stats_like(x), _stats_like(x)


@torch.library.custom_op("nanopara::add_layernorm_fwd", mutates_args=())
def add_layernorm_fwd(x: Tensor, residual: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float,
                      out_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    y, h, mean, rstd = _ln.layernorm_fwd(x, weight, bias, eps, residual=residual, out_dtype=out_dtype)
    return y, h, mean, rstd


@add_layernorm_fwd.register_fake
def _(x, residual, weight, bias, eps, out_dtype):
    dtype = torch.promote_types(x.dtype, residual.dtype)  # h = x + residual, PyTorch's promotion
    return (x.new_empty(x.shape, dtype=out_dtype or dtype), x.new_empty(x.shape, dtype=dtype), _stats_like(x),
            _stats_like(x))


@torch.library.custom_op("nanopara::layernorm_bwd", mutates_args=())
def layernorm_bwd(dy: Tensor, dh: Optional[Tensor], x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor,
                  has_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = _ln.layernorm_bwd(dy, x, weight, has_bias, mean, rstd, dh=dh)
    return dx, dw, (db if has_bias else weight.new_empty(0))


@layernorm_bwd.register_fake
def _(dy, dh, x, weight, mean, rstd, has_bias):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape if has_bias else 0)


def _ln_setup(ctx, inputs, output):
    x, weight, bias, eps, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(mean, rstd)


def _ln_backward(ctx, dy, dmean, drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = torch.ops.nanopara.layernorm_bwd(dy, None, x, weight, mean, rstd, ctx.has_bias)
    return dx, dw, (db if ctx.has_bias else None), None, None


layernorm_fwd.register_autograd(_ln_backward, setup_context=_ln_setup)


def _add_ln_setup(ctx, inputs, output):
    x, residual, weight, bias, eps, _ = inputs
    _, h, mean, rstd = output
    ctx.save_for_backward(h, weight, mean, rstd)  # the backward normalises the stored h again
    ctx.has_bias = bias is not None
    ctx.dtypes = x.dtype, residual.dtype
    ctx.mark_non_differentiable(mean, rstd)


def _add_ln_backward(ctx, dy, dh, dmean, drstd):
    h, weight, mean, rstd = ctx.saved_tensors
    if dy is None:  # only h was used downstream
        dy = torch.zeros_like(h)
    dx, dw, db = torch.ops.nanopara.layernorm_bwd(dy, dh, h, weight, mean, rstd, ctx.has_bias)
    # h = x + residual: both get the same gradient, each in its own dtype (as autograd's add does)
    return dx.to(ctx.dtypes[0]), dx.to(ctx.dtypes[1]), dw, (db if ctx.has_bias else None), None, None


add_layernorm_fwd.register_autograd(_add_ln_backward, setup_context=_add_ln_setup)


def layernorm(x, weight, bias, eps=1e-5, out_dtype=None):
    """LayerNorm over the last dim through the Triton kernels, as one graph node; y in out_dtype if given."""
    return torch.ops.nanopara.layernorm_fwd(x, weight, bias, eps, out_dtype)[0]


def add_layernorm(x, residual, weight, bias, eps=1e-5, out_dtype=None):
    """(LayerNorm(x + residual), x + residual) through one Triton kernel, as one graph node."""
    y, h, _, _ = torch.ops.nanopara.add_layernorm_fwd(x, residual, weight, bias, eps, out_dtype)
    return y, h


# ---------------------------------------------------------------------------------------------------------------
# Cross-entropy over a padded vocabulary (kernels/cross_entropy.py), mean over rows whose target != ignore_index


def _ce_scale(targets: Tensor, ignore_index: int, loss_scale, grad=None) -> Tensor:
    """loss_scale (* grad) / n_valid as a (1,) device tensor: no host sync."""
    n_valid = (targets != ignore_index).sum().clamp(min=1).float()
    s = loss_scale / n_valid
    return (s if grad is None else s * grad.float()).reshape(1)


@torch.library.custom_op("nanopara::ce_fwd", mutates_args=())
def ce_fwd(logits: Tensor, targets: Tensor, n_vocab: int, ignore_index: int,
           loss_scale: float) -> tuple[Tensor, Tensor]:
    z = logits if logits.stride(1) == 1 else logits.contiguous()
    loss, lse = _ce.cross_entropy_fwd(z, targets, n_vocab, ignore_index, "mean", loss_scale)
    return loss, lse


@ce_fwd.register_fake
def _(logits, targets, n_vocab, ignore_index, loss_scale):
    return logits.new_empty((), dtype=torch.float32), logits.new_empty(logits.shape[0], dtype=torch.float32)


@torch.library.custom_op("nanopara::ce_bwd", mutates_args=())
def ce_bwd(logits: Tensor, targets: Tensor, lse: Tensor, grad: Tensor, n_vocab: int, ignore_index: int,
           loss_scale: float) -> Tensor:
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # (N, Vp), contiguous
    return _ce.ce_shard_grad_triton(logits, targets, 0, n_vocab, lse, _ce_scale(targets, ignore_index, loss_scale,
                                                                                 grad), ignore_index, out=out)


@ce_bwd.register_fake
def _(logits, targets, lse, grad, n_vocab, ignore_index, loss_scale):
    return logits.new_empty(logits.shape)


def _ce_setup(ctx, inputs, output):
    logits, targets, n_vocab, ignore_index, loss_scale = inputs
    _, lse = output
    ctx.save_for_backward(logits, targets, lse)
    ctx.args = n_vocab, ignore_index, loss_scale
    ctx.mark_non_differentiable(lse)


def _ce_backward(ctx, dloss, dlse):
    logits, targets, lse = ctx.saved_tensors
    dz = torch.ops.nanopara.ce_bwd(logits, targets, lse, dloss, *ctx.args)
    return dz, None, None, None, None


ce_fwd.register_autograd(_ce_backward, setup_context=_ce_setup)


def cross_entropy(logits, targets, n_vocab=None, ignore_index=-1, loss_scale=1.0):
    """Mean cross-entropy (times loss_scale) over rows with target != ignore_index, padding columns >= n_vocab
    excluded, as one graph node per direction. logits (N, Vp), targets (N,)."""
    n_vocab = logits.shape[-1] if n_vocab is None else n_vocab
    _ce._check(logits, targets, n_vocab)
    return torch.ops.nanopara.ce_fwd(logits, targets, n_vocab, ignore_index, float(loss_scale))[0]


@torch.compiler.disable
def cross_entropy_inplace(logits, targets, n_vocab=None, ignore_index=-1, loss_scale=1.0):
    """The eager fused path (dlogits written into the logits buffer during the forward). Under torch.compile the
    graph breaks here and this runs eagerly on the compiled graph's logits output."""
    return _ce.cross_entropy_triton(logits, targets, n_vocab, ignore_index, "mean", loss_scale)
