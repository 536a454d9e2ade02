"""The MoE experts' MLP with its forward and input-gradient GEMMs in FP8 (row scaling), on the grouped GEMM kernel.

Math (kernels/grouped_gemm.py's layout: rows of x (R, C) grouped by expert, offsets (E+1,); w_fc (E, H, C),
w_proj (E, C, H)). Every FP8 operand is e4m3 with one fp32 scale per row, and every GEMM contracts along the rows'
unit-stride dimension, as fp8 tensor cores want:
    forward   h = q(x) s_x @ (q(w_fc) s_fc)^T + b_fc,  g = gelu(h)      x: a scale per token row; w_fc[e]: per output
              y = q(g) s_g @ (q(w_proj) s_proj)^T + b_proj               row (e, j), from w_fc viewed (E*H, C)
    dgrad     dh = (q(dy) s_dy @ q(w_proj^T)[e]^T ...) * gelu'(h)        w_proj^T (E, H, C) quantized by its rows
              dx = q(dh) s_dh @ q(w_fc^T)[e]^T                           w_fc^T (E, C, H), likewise
    wgrad     dw_proj = dy^T g, dw_fc = dh^T x per expert, in bf16 (grouped_wgrad): their contraction runs over each
              expert's variable token count, which row scales cannot cover; per-expert column scales of dy and x
              over a group's rows and fp8 copies transposed per group are what an FP8 wgrad would need.
The scales are applied in the GEMM's epilogue (acc * s_a[row] * s_b[e, column]) before the bias and the GELU (its
gradient), so nothing else changes. Gradients are e4m3 too: a per-row scale gives each token row its own range, the
reason e5m2 is used for per-tensor scaling elsewhere (fp8.py). The weights are quantized on every call (x3: w, and
w^T for dgrad); the activations' copies are saved in FP8 for dgrad, x, g and h in 16 bits for the bf16 wgrad.
Fast accumulation (the tensor core's own, no promotion every 128 K) in every GEMM.

`triton=False` runs the same Function with PyTorch GEMMs on the dequantized operands (CPU, and the reference the
tests compare the Triton path with). Callers: nanopara/moe.py (experts with `fp8_state`, set by fp8.apply_fp8).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8_quant import E4M3, fp8_quantize
from kernels.grouped_gemm import _launch_mm, grouped_linear_ref, grouped_wgrad


def quantize_rows(t: torch.Tensor, triton: bool):
    """(q e4m3 of t's shape, fp32 scales of shape t.shape[:-1]): one scale per last-dimension row."""
    q = fp8_quantize(t.reshape(-1, t.shape[-1]), E4M3, "row", triton_path=triton)
    return q.q.view(t.shape), q.s.view(t.shape[:-1])


def gemm_fp8(a, sa, b, sb, bias, offsets, out_dtype, triton: bool, epilogue=None, pre=None):
    """Per group e: (a * sa[:, None]) @ (b[e] * sb[e][:, None])^T (+ bias[e]); a (R, K) fp8, b (E, N, K) fp8 with
    unit K stride, sa (R,), sb (E, N). epilogue "gelu" returns (gelu(y), y); "gelu_grad" returns y * gelu'(pre)."""
    E, N, K = b.shape
    if triton:
        return _launch_mm(a, b, b.stride(0), b.stride(2), b.stride(1), bias, offsets, N, K, epilogue, pre=pre,
                          scales=(sa.contiguous(), sb), out_dtype=out_dtype)
    y = grouped_linear_ref(a.float() * sa[:, None], b.float() * sb[:, :, None], None if bias is None else
                           bias.float(), offsets)
    if epilogue == "gelu":
        y = y.to(out_dtype)
        return F.gelu(y.float(), approximate="tanh").to(out_dtype), y
    if epilogue == "gelu_grad":
        with torch.enable_grad():
            p = pre.float().requires_grad_()
            slope, = torch.autograd.grad(F.gelu(p, approximate="tanh").sum(), p)
        return (y * slope).to(out_dtype), None
    return y.to(out_dtype), None


class GroupedMLPFP8Function(torch.autograd.Function):
    """grouped_gemm.GroupedMLPFunction with its four activation GEMMs in FP8 (module docstring)."""

    @staticmethod
    def forward(ctx, x, w_fc, b_fc, w_proj, b_proj, offsets, triton):
        dt = x.dtype
        xq, sx = quantize_rows(x, triton)
        wf, swf = quantize_rows(w_fc.detach(), triton)  # (E, H, C), per (e, j)
        wp, swp = quantize_rows(w_proj.detach(), triton)  # (E, C, H), per (e, c)
        bf = None if b_fc is None else b_fc.to(dt)
        bp = None if b_proj is None else b_proj.to(dt)
        g, h = gemm_fp8(xq, sx, wf, swf, bf, offsets, dt, triton, epilogue="gelu")
        gq, sg = quantize_rows(g, triton)
        y, _ = gemm_fp8(gq, sg, wp, swp, bp, offsets, dt, triton)
        wpt, swpt = quantize_rows(w_proj.detach().transpose(1, 2), triton)  # (E, H, C) for dh = dy @ w_proj[e]
        wft, swft = quantize_rows(w_fc.detach().transpose(1, 2), triton)  # (E, C, H) for dx = dh @ w_fc[e]
        ctx.save_for_backward(x, g, h, wpt, swpt, wft, swft, offsets)
        ctx.triton = triton
        ctx.dtypes = (w_fc.dtype, None if b_fc is None else b_fc.dtype, w_proj.dtype,
                      None if b_proj is None else b_proj.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, g, h, wpt, swpt, wft, swft, offsets = ctx.saved_tensors
        triton, dt = ctx.triton, x.dtype
        dt_wf, dt_bf, dt_wp, dt_bp = ctx.dtypes
        dy = dy.to(dt).contiguous()
        dyq, sdy = quantize_rows(dy, triton)
        dh, _ = gemm_fp8(dyq, sdy, wpt, swpt, None, offsets, dt, triton, epilogue="gelu_grad", pre=h)
        dhq, sdh = quantize_rows(dh, triton)
        dx, _ = gemm_fp8(dhq, sdh, wft, swft, None, offsets, dt, triton)
        wgrad = grouped_wgrad if triton else _wgrad_ref
        dwp, dbp = wgrad(dy, g, offsets, dtype=dt_wp, bias=dt_bp is not None)
        dwf, dbf = wgrad(dh, x, offsets, dtype=dt_wf, bias=dt_bf is not None)
        cast = lambda t, d: None if t is None else t.to(d)  # noqa: E731
        return dx, dwf, cast(dbf, dt_bf), dwp, cast(dbp, dt_bp), None, None


def _wgrad_ref(dy, x, offsets, dtype=None, bias=True):
    """grouped_wgrad's math in PyTorch (fp32 sums): dw[e] = dy[group e]^T x[group e], db[e] = its column sums."""
    E, bounds = offsets.shape[0] - 1, offsets.tolist()
    dw = dy.new_zeros(E, dy.shape[1], x.shape[1], dtype=torch.float32)
    db = dy.new_zeros(E, dy.shape[1], dtype=torch.float32) if bias else None
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        dw[e] = dy[lo:hi].float().t() @ x[lo:hi].float()
        if bias:
            db[e] = dy[lo:hi].float().sum(0)
    return dw.to(dtype or dy.dtype), None if db is None else db.to(dtype or dy.dtype)


def grouped_mlp_fp8(x, w_fc, b_fc, w_proj, b_proj, offsets, triton: bool | None = None):
    """Each expert's GPT-2 MLP with FP8 forward and input-gradient GEMMs; triton None: the kernels on CUDA."""
    triton = x.is_cuda if triton is None else triton
    return GroupedMLPFP8Function.apply(x, w_fc, b_fc, w_proj, b_proj, offsets, triton)
