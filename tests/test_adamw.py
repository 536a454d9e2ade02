"""kernels/adamw.py: the fused flat-buffer AdamW against torch.optim.AdamW(foreach=False).

CPU: the Triton kernel runs in the interpreter over an odd-sized flat buffer (params of several shapes, 1-D ones
without weight decay). Both sides do the same fp32 ops in the same order from the same float64 scalars; what
differs is rounding: torch's lerp/addcmul fuse a*b+c into one FMA rounding where the interpreter rounds twice
(and the GPU compiler contracts where it likes). That is an ulp of the *operands*, so a result that cancels to
near 0 (m + 0.1 (g - m) with g ~ -9m, or p - update ~ 0) can be off by much more than 1e-6 of *itself*. Hence
the check, per parameter tensor: |a - b| <= 1e-6 |b| + 1e-6 max|b| (measured worst: 1e-7 of max|b|).
GPU (`-m gpu`): same check at GPT-2 124M size with the compiled kernel.
"""
import math

import pytest
import torch

from kernels.adamw import adamw_ref, adamw_step_, adamw_step_triton_, gpt2_param_shapes

SHAPES = [(37, 13), (13,), (5, 7, 3), (101,), (1,), (64, 33)]  # 3338 elements: not a multiple of BLOCK
HP = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _assert_close_per_tensor(a, b, shapes, rel=1e-6, what=""):
    """1e-6 relative to each element and to its tensor's scale (see the module docstring for why)."""
    off = 0
    for s in shapes:
        k = math.prod(s)
        x, y = a[off:off + k], b[off:off + k]
        torch.testing.assert_close(x, y, rtol=rel, atol=rel * y.abs().max().item(),
                                   msg=lambda m: f"{what} tensor {s} at offset {off}: {m}")
        off += k


def _setup(shapes, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    params = [torch.randn(s, generator=g, device=device).requires_grad_() for s in shapes]
    mask = torch.cat([torch.full((p.numel(),), p.dim() >= 2, device=device) for p in params])
    opt = torch.optim.AdamW([dict(params=[p for p in params if p.dim() >= 2], weight_decay=HP["weight_decay"]),
                             dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)],
                            lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], foreach=False)
    flat_p = torch.cat([p.detach().flatten() for p in params])
    return params, opt, flat_p, mask, g


def _flat(ts):
    return torch.cat([t.flatten() for t in ts])


@pytest.mark.parametrize("impl", [adamw_step_triton_, adamw_ref])
def test_matches_torch_adamw_over_several_steps(impl):
    params, opt, p, mask, gen = _setup(SHAPES)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, 6):
        for q in params:  # gradients of very different scales, some exactly zero
            q.grad = torch.randn(q.shape, generator=gen) * 10 ** torch.randint(-6, 1, (), generator=gen).item()
        params[1].grad.zero_()
        opt.step()
        impl(p, _flat([q.grad for q in params]), m, v, HP["lr"], HP["beta1"], HP["beta2"], HP["eps"],
             HP["weight_decay"], step, wd_mask=mask)
        _assert_close_per_tensor(p, _flat([q.detach() for q in params]), SHAPES, what=f"step {step} p")
        _assert_close_per_tensor(m, _flat([opt.state[q]["exp_avg"] for q in params]), SHAPES, what="m")
        _assert_close_per_tensor(v, _flat([opt.state[q]["exp_avg_sq"] for q in params]), SHAPES, what="v")


def test_mask_none_decays_everything_and_bf16_grad():
    n = 1001
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).bfloat16()  # a bf16 grad buffer is widened in the kernel
    p1, m1, v1 = p0.clone(), torch.zeros(n), torch.zeros(n)
    p2, m2, v2 = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step in (1, 2, 3):
        adamw_step_triton_(p1, g, m1, v1, 1e-2, 0.9, 0.999, 1e-8, 0.5, step)
        adamw_ref(p2, g, m2, v2, 1e-2, 0.9, 0.999, 1e-8, 0.5, step)
    _assert_close_per_tensor(p1, p2, [(n,)])
    _assert_close_per_tensor(m1, m2, [(n,)])
    _assert_close_per_tensor(v1, v2, [(n,)])


def test_mask_really_skips_decay():
    """With a zero gradient only weight decay moves p: masked-out elements must not move at all."""
    n = 300
    p = torch.ones(n)
    mask = torch.arange(n) % 3 == 0
    adamw_step_triton_(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), 0.1, 0.9, 0.95, 1e-8, 0.5, 1,
                       wd_mask=mask.to(torch.uint8))
    assert torch.all(p[~mask] == 1.0)
    torch.testing.assert_close(p[mask], torch.full((100,), 1 - 0.1 * 0.5))


def test_public_op_on_cpu_is_reference():
    params, opt, p, mask, gen = _setup(SHAPES[:2])
    g = torch.randn(p.shape, generator=gen)
    a, b = p.clone(), p.clone()
    st = [torch.zeros_like(p) for _ in range(4)]
    adamw_step_(a, g, st[0], st[1], **HP, step=1, wd_mask=mask)
    adamw_ref(b, g, st[2], st[3], **HP, step=1, wd_mask=mask)
    assert torch.equal(a, b)


def test_user_errors():
    p, g = torch.zeros(10), torch.zeros(10)
    with pytest.raises(ValueError, match="fp32"):
        adamw_step_triton_(p.double(), g, p.clone(), p.clone(), **HP, step=1)
    with pytest.raises(ValueError, match="g must be"):
        adamw_step_triton_(p, torch.zeros(9), p.clone(), p.clone(), **HP, step=1)
    with pytest.raises(ValueError, match="wd_mask"):
        adamw_step_triton_(p, g, p.clone(), p.clone(), **HP, step=1, wd_mask=torch.ones(10))
    with pytest.raises(ValueError, match="step"):
        adamw_step_triton_(p, g, p.clone(), p.clone(), **HP, step=0)


@pytest.mark.gpu
def test_gpu_124m_matches_torch_adamw():
    shapes = gpt2_param_shapes()
    params, opt, p, mask, gen = _setup(shapes, device="cuda")
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, 4):
        for q in params:
            q.grad = torch.randn(q.shape, generator=gen, device="cuda") * 1e-2
        opt.step()
        adamw_step_(p, _flat([q.grad for q in params]), m, v, HP["lr"], HP["beta1"], HP["beta2"], HP["eps"],
                    HP["weight_decay"], step, wd_mask=mask)
    assert p.numel() == sum(math.prod(s) for s in shapes)
    _assert_close_per_tensor(p, _flat([q.detach() for q in params]), shapes, what="p")
    _assert_close_per_tensor(m, _flat([opt.state[q]["exp_avg"] for q in params]), shapes, what="m")
