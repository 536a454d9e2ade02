"""Fused AdamW over flat fp32 buffers: one kernel launch updates every parameter.

Math (Loshchilov & Hutter 2019, decoupled weight decay; the same order of operations as
torch.optim.AdamW(foreach=False), so the two agree to fp32 rounding), at step t >= 1 for each element:
    p = p * (1 - lr * wd * mask)            mask = 0 for params that take no decay (biases, LayerNorm, ...)
    m = m + (1 - beta1) * (g - m)           (torch's lerp)
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Shapes: p, m, v fp32 flat buffers of n elements (the optimizer lays every parameter of a rank, or its ZeRO shard,
end to end); g the flat gradient (fp32, or bf16: read and widened in the kernel); wd_mask an optional flat
bool/uint8 buffer (1 = decay). The mask costs 1 byte per element on top of the 28 that must move (p, g, m, v in,
p, m, v out), and lets any parameter order and any shard boundary work without a segment table.

Per element the kernel reads 16-17 bytes and writes 12; it is purely memory bound, so its figure of merit is
GB/s against the D2D copy bandwidth. Division and sqrt use round-to-nearest (tl.div_rn / tl.sqrt_rn) like
PyTorch's kernels, not the approximate fast-math versions, so GPU results also track torch to fp32 rounding.

Options: decay on a leading range instead of the mask (no mask byte), the unscale-and-clip divisor and a skip flag
as device scalars, the step count on the device, and a bf16 copy of the updated weights written in the same pass.
Caller: nanopara/flat.py (`train.optimizer=flat`). `adamw_step_` takes the Triton path on CUDA and `adamw_ref`
elsewhere; `adamw_step_triton_` forces the kernel (CPU tests under TRITON_INTERPRET=1).
Run: `python -m kernels.adamw [--quick] [--out FILE]`: parity vs torch.optim.AdamW, then ms/step and GB/s for
GPT-2 124M against torch.optim.AdamW(fused=True) and (foreach=True), and flat.py's launch (+bf16 copy).
"""
import argparse
import json
import math

import torch
import triton
import triton.language as tl

from kernels.launch import cdiv


def adamw_ref(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, wd_mask=None, n_decay=None, p16=None,
              grad_scale=None, found_inf=None):
    """In-place AdamW step in PyTorch, op for op as torch.optim.AdamW's single-tensor path; the optional
    arguments as adamw_step_triton_'s (step may be a 0-dim tensor; found_inf != 0: nothing changes)."""
    if found_inf is not None and found_inf.item() != 0:
        return
    step = step.item() if torch.is_tensor(step) else step
    g = g.float() if grad_scale is None else g.float() / grad_scale
    if wd_mask is not None:
        p.mul_(torch.where(wd_mask.bool(), 1 - lr * weight_decay, 1.0))
    elif n_decay is None:
        p.mul_(1 - lr * weight_decay)
    else:
        p[:n_decay].mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denom = (v.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)
    if p16 is not None:
        p16.copy_(p[:p16.numel()])


# ---------------------------------------------------------------------------------------------------------------
# Triton kernel


@triton.jit
def _adamw_kernel(P, G, M, V, MASK, P16, GS, SKIP, STEP, n, n_decay, n16, decay, one_minus_beta1, beta2,
                  one_minus_beta2, step_size, bc2_sqrt, eps, lr, log2_beta1, log2_beta2,
                  HAS_MASK: tl.constexpr, HAS_P16: tl.constexpr, HAS_GS: tl.constexpr, HAS_SKIP: tl.constexpr,
                  DEVICE_STEP: tl.constexpr, BLOCK: tl.constexpr):
    if HAS_SKIP:  # a non-finite gradient norm (the engines' found_inf): no element changes
        if tl.load(SKIP) != 0:
            return
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # n can exceed 2**31 (big ZeRO shards)
    inb = offs < n
    p = tl.load(P + offs, mask=inb)
    g = tl.load(G + offs, mask=inb).to(tl.float32)
    m = tl.load(M + offs, mask=inb)
    v = tl.load(V + offs, mask=inb)
    if HAS_GS:  # the unscale-and-clip divisor, a device scalar (as torch's fused AdamW's grad_scale)
        g = tl.div_rn(g, tl.load(GS))
    if DEVICE_STEP:  # the step count on the device (a skipped step does not count): bias corrections from it
        t = tl.load(STEP)
        step_size = lr / (1.0 - tl.exp2(t * log2_beta1))
        bc2_sqrt = tl.sqrt_rn(1.0 - tl.exp2(t * log2_beta2))
    if HAS_MASK:
        p = p * tl.where(tl.load(MASK + offs, mask=inb) != 0, decay, 1.0)
    else:  # the decayed parameters first: [0, n_decay)
        p = p * tl.where(offs < n_decay, decay, 1.0)
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(P + offs, p, mask=inb)
    tl.store(M + offs, m, mask=inb)
    tl.store(V + offs, v, mask=inb)
    if HAS_P16:  # the bf16 copy the matmuls read, rounded to nearest even as torch's .to (on the bits: the
        bits = p.to(tl.uint32, bitcast=True)  # interpreter's own cast truncates; finite values only, as weights are)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(P16 + offs, bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=offs < n16)


# ---------------------------------------------------------------------------------------------------------------
# Launcher and public op (no autograd: an optimizer step is not differentiated)

BLOCK = 2048


def _check(p, g, m, v, wd_mask, step):
    n = p.numel()
    for name, t in (("p", p), ("m", m), ("v", v)):
        if t.dtype != torch.float32 or t.dim() != 1 or t.numel() != n or not t.is_contiguous():
            raise ValueError(f"adamw: {name} must be a contiguous flat fp32 buffer of {n} elements, got "
                             f"{t.dtype} {tuple(t.shape)}")
    if g.dim() != 1 or g.numel() != n or not g.is_contiguous() or not g.is_floating_point():
        raise ValueError(f"adamw: g must be a contiguous flat float buffer of {n} elements, got {g.dtype} "
                         f"{tuple(g.shape)}")
    if wd_mask is not None and (wd_mask.numel() != n or wd_mask.dtype not in (torch.bool, torch.uint8)
                                or not wd_mask.is_contiguous()):
        raise ValueError(f"adamw: wd_mask must be a flat bool/uint8 buffer of {n} elements, got {wd_mask.dtype} "
                         f"{tuple(wd_mask.shape)}")
    if not torch.is_tensor(step) and step < 1:
        raise ValueError(f"adamw: step counts from 1 (bias correction divides by 1 - beta^step), got {step}")


def adamw_step_triton_(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, wd_mask=None, n_decay=None,
                       p16=None, grad_scale=None, found_inf=None):
    """One fused launch over the flat buffers, in place; any device (CPU needs TRITON_INTERPRET=1).

    Decay: by `wd_mask`, else on [0, n_decay) (default: all). `step`: an int, or a 0-dim fp32 device tensor the
    caller has already advanced (nanopara/flat.py: a skipped step leaves it). p16: a flat low-precision buffer of
    at most n elements (bf16), written with the updated p[:len(p16)]. grad_scale / found_inf: 0-dim fp32 device tensors
    (g is divided by grad_scale; found_inf != 0 leaves everything as it was)."""
    _check(p, g, m, v, wd_mask, step)
    n = p.numel()
    if n == 0:
        return
    n_decay = n if n_decay is None else n_decay
    n16 = 0 if p16 is None else p16.numel()
    if p16 is not None and (n16 > n or p16.dim() != 1 or not p16.is_contiguous() or p16.dtype != torch.bfloat16):
        raise ValueError(f"adamw: p16 must be a contiguous flat bf16 buffer of at most {n} elements, got "
                         f"{p16.dtype} {tuple(p16.shape)}")
    p16 = None if p16 is None else p16.view(torch.int16)  # written as bits
    mask = None if wd_mask is None else wd_mask.view(torch.uint8)  # same bytes; uint8 loads are plain ints
    on_device = torch.is_tensor(step)
    t = 1 if on_device else step  # (host scalars unused when the kernel reads the step)
    # scalars in float64 on the host, exactly as torch computes them, then passed to the kernel as fp32
    scalars = (1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1 ** t), (1 - beta2 ** t) ** 0.5,
               eps, lr, math.log2(beta1) if beta1 > 0 else -1e30, math.log2(beta2) if beta2 > 0 else -1e30)
    # Whole blocks first: their n is a multiple of BLOCK, so Triton's divisibility specialisation lets the
    # bounds mask stay 16-byte uniform and every load/store vectorise; then the odd tail, if any, on its own.
    n_main = n - n % BLOCK
    for lo, hi in ((0, n_main), (n_main, n)):
        if hi > lo:
            sl = slice(lo, hi)
            has16 = n16 > lo
            _adamw_kernel[(cdiv(hi - lo, BLOCK),)](
                p[sl], g[sl], m[sl], v[sl], None if mask is None else mask[sl], p16[lo:] if has16 else None,
                grad_scale, found_inf, step if on_device else None, hi - lo, max(n_decay - lo, 0),
                max(n16 - lo, 0), *scalars, HAS_MASK=mask is not None, HAS_P16=has16, HAS_GS=grad_scale is not None,
                HAS_SKIP=found_inf is not None, DEVICE_STEP=on_device, BLOCK=BLOCK, num_warps=4)


def adamw_step_(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, wd_mask=None, **kw):
    """AdamW step on flat buffers, in place: Triton on CUDA, the PyTorch reference elsewhere (kw: n_decay, p16,
    grad_scale, found_inf, as adamw_step_triton_)."""
    if p.is_cuda:
        adamw_step_triton_(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, wd_mask, **kw)
    else:
        _check(p, g, m, v, wd_mask, step)
        adamw_ref(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, wd_mask, **kw)


# ---------------------------------------------------------------------------------------------------------------
# Parity + benchmark: python -m kernels.adamw [--quick] [--out FILE]


def gpt2_param_shapes(n_layer=12, n_embd=768, vocab=50304, block=1024):
    """GPT-2 124M parameter shapes (tied lm_head), for the benchmark."""
    C = n_embd
    layer = [(C,), (C,), (3 * C, C), (3 * C,), (C, C), (C,), (C,), (C,), (4 * C, C), (4 * C,), (C, 4 * C), (C,)]
    return [(vocab, C), (block, C)] + layer * n_layer + [(C,), (C,)]


def _flat_setup(shapes, device):
    n = sum(math.prod(s) for s in shapes)
    p = torch.randn(n, device=device) * 0.02
    g = torch.randn(n, device=device) * 1e-3
    mask = torch.cat([torch.full((math.prod(s),), len(s) >= 2, device=device) for s in shapes])
    return p, g, mask


def _torch_opt(p_flat, g_flat, shapes, mask, **kw):
    """Separate parameter tensors (as a model holds them) with torch.optim.AdamW; no decay on 1-D ones."""
    params, off = [], 0
    for s in shapes:
        k = math.prod(s)
        t = p_flat[off:off + k].clone().view(s).requires_grad_()
        t.grad = g_flat[off:off + k].clone().view(s)
        params.append(t)
        off += k
    groups = [dict(params=[t for t in params if t.dim() >= 2], weight_decay=0.1),
              dict(params=[t for t in params if t.dim() < 2], weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, **kw), params


def _parity(shapes, steps=5):
    p, g, mask = _flat_setup(shapes, "cuda")
    opt, params = _torch_opt(p, g, shapes, mask, foreach=False)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t in range(1, steps + 1):
        opt.step()
        adamw_step_(p, g, m, v, 6e-4, 0.9, 0.95, 1e-8, 0.1, t, wd_mask=mask)
    ref = torch.cat([q.detach().flatten() for q in params])
    # relative to the params' scale, not elementwise: an element that cancels to ~0 has no meaningful rel err
    err = ((p - ref).abs().max() / ref.abs().max()).item()
    print(f"parity vs torch.optim.AdamW(foreach=False), {p.numel() / 1e6:.1f}M params, {steps} steps: "
          f"max |p - p_torch| / max |p_torch| = {err:.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="124M only")
    parser.add_argument("--out", help="append JSON lines here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA GPU (tests run the kernel on CPU: pytest tests/test_adamw.py)")
    _parity(gpt2_param_shapes(n_layer=2))
    src = torch.empty(256 * 2**20, device="cuda")
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() * 4 / triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e6
    del src, dst
    print(f"{torch.cuda.get_device_name()}: measured D2D copy bandwidth {copy_gbs:.0f} GB/s")
    configs = [("124M", gpt2_param_shapes())]
    if not args.quick:
        configs.append(("350M", gpt2_param_shapes(n_layer=24, n_embd=1024)))
    print(f"{'model':>6} {'impl':>14} {'ms/step':>8} {'GB/s':>6} {'%copy':>6} {'vs fused':>9}")
    out = open(args.out, "a") if args.out else None
    for name, shapes in configs:
        p, g, mask = _flat_setup(shapes, "cuda")
        n = p.numel()
        bytes_moved = n * (16 + 12 + 1)  # p, g, m, v in + p, m, v out + mask byte
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        state = {"t": 0}

        def ours():
            state["t"] += 1
            adamw_step_(p, g, m, v, 6e-4, 0.9, 0.95, 1e-8, 0.1, state["t"], wd_mask=mask)

        results = {"triton-flat": triton.testing.do_bench(ours, return_mode="median")}
        # nanopara/flat.py's launch: decay on the leading (2-D) range instead of the mask, device scalars, and the
        # bf16 copy of the decayed weights (2 bytes more each; the mask byte less: the same 29-byte count below)
        n_dec = int(mask.sum())
        p16, one = torch.empty(n_dec, device="cuda", dtype=torch.bfloat16), torch.ones((), device="cuda")
        step_t, no_inf = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")

        def flat():
            step_t.add_(1.0)
            adamw_step_(p, g, m, v, 6e-4, 0.9, 0.95, 1e-8, 0.1, step_t, n_decay=n_dec, p16=p16, grad_scale=one,
                        found_inf=no_inf)
        results["triton-flat+bf16"] = triton.testing.do_bench(flat, return_mode="median")
        for impl, kw in (("torch-fused", dict(fused=True)), ("torch-foreach", dict(foreach=True))):
            opt, _ = _torch_opt(p, g, shapes, mask, **kw)
            results[impl] = triton.testing.do_bench(opt.step, return_mode="median")
            del opt
        for impl, ms in results.items():
            row = dict(op="adamw", impl=impl, model=name, n_params=n, ms=ms, gbs=bytes_moved / ms / 1e6,
                       pct_copy=100 * bytes_moved / ms / 1e6 / copy_gbs, speedup_vs_fused=results["torch-fused"] / ms,
                       device=torch.cuda.get_device_name())
            print(f"{name:>6} {impl:>14} {ms:8.3f} {row['gbs']:6.0f} {row['pct_copy']:5.0f}% "
                  f"{row['speedup_vs_fused']:8.2f}x")
            if out:
                out.write(json.dumps(row) + "\n")
    print("GB/s counts 29 bytes per parameter for every impl (torch's have no mask byte to read)")
    if out:
        out.close()


if __name__ == "__main__":
    main()
