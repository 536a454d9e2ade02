"""kernels/layernorm.py: Triton LayerNorm and add+LayerNorm against the PyTorch reference.

CPU: the Triton kernels run in the interpreter on small awkward shapes (37 rows, widths 768/1000/97, leading
dims, uneven row groups). The oracle is the reference evaluated in float64, so the only error left is the
kernel's own fp32 arithmetic (observed ~1e-6) or the rounding of its fp16/bf16 outputs.
GPU (`-m gpu`): real sizes in bf16, judged by "kernel error vs fp32 reference <= 2x PyTorch's bf16 error + eps".
"""
import pytest
import torch
import torch.nn.functional as F
import triton

from kernels import layernorm as ln
from kernels.layernorm import (MAX_C, add_layernorm, add_layernorm_ref, add_layernorm_triton, layernorm,
                               layernorm_bwd, layernorm_fwd, layernorm_ref, layernorm_triton)

# fp32 kernel vs float64 oracle: reduction order only (measured <= ~2e-6); half-precision outputs are rounded
# once to 11 (fp16) or 8 (bf16) mantissa bits, and the grads of 37 rows accumulate in fp32 from those inputs
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=4e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def _inputs(shape, dtype, param_dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = shape[-1]
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)
    w = (1 + 0.3 * torch.randn(C, generator=g)).to(param_dtype)
    b = (0.2 * torch.randn(C, generator=g)).to(param_dtype) if bias else None
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, w, b, dy


def _grads(fn, tensors, outs_grads):
    """Run fn on leaf copies of tensors; return outputs and grads of every non-None input."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, [g.to(o.dtype) for o, g in zip(outs, outs_grads)])
    return list(outs) + [t.grad for t in leaves if t is not None]


def _oracle(fn, tensors, outs_grads):
    """The same, in float64."""
    return _grads(fn, [None if t is None else t.double() for t in tensors], [g.double() for g in outs_grads])


def _assert_all_close(got, want, dtype):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a.double(), b, **TOL[dtype], msg=lambda m: f"output/grad #{i}: {m}")


@pytest.mark.parametrize("shape,dtype,bias", [
    ((37, 768), torch.float32, True),
    ((3, 5, 1000), torch.float32, True),  # leading dims, width not a power of 2
    ((37, 97), torch.float32, False),  # no bias, prime width
    ((37, 1000), torch.float16, True),
    ((11, 768), torch.bfloat16, True),  # no tl.dot here, so bf16 is fine in the interpreter
])
def test_layernorm_matches_reference(shape, dtype, bias):
    x, w, b, dy = _inputs(shape, dtype, bias=bias)
    got = _grads(lambda x, w, b: layernorm_triton(x, w, b), (x, w, b), (dy,))
    want = _oracle(lambda x, w, b: layernorm_ref(x, w, b), (x, w, b), (dy,))
    assert got[0].dtype == dtype and got[1].dtype == dtype  # y, dx in x's dtype
    assert all(t.dtype == torch.float32 for t in got[2:])  # dw, db in the params' dtype
    _assert_all_close(got, want, dtype)


def test_layernorm_half_params():
    """Params in the activation dtype (no autocast): grads come back in that dtype."""
    x, w, b, dy = _inputs((37, 1000), torch.float16, param_dtype=torch.float16)
    got = _grads(lambda x, w, b: layernorm_triton(x, w, b), (x, w, b), (dy,))
    want = _oracle(lambda x, w, b: layernorm_ref(x, w, b), (x, w, b), (dy,))
    assert got[2].dtype == torch.float16 and got[3].dtype == torch.float16
    # dw, db sum 37 rows of |dy * xhat| ~ 1 and are then rounded to fp16 (~37 * 2**-11 absolute)
    _assert_all_close(got[:2], want[:2], torch.float16)
    torch.testing.assert_close(got[2].double(), want[2], atol=3e-2, rtol=4e-3)
    torch.testing.assert_close(got[3].double(), want[3], atol=3e-2, rtol=4e-3)


# (M, C, n_groups). The second stage's launch depends on both: 8-column strips up to 1024 wide and 16 above (a
# masked strip at 1100); up to 192 groups 64 group rows a step (100 groups: two steps, the second partial), above
# that 256 (230 groups: one partial step)
@pytest.mark.parametrize("M,C,n_groups", [(37, 200, 1), (37, 200, 2), (37, 200, 5), (37, 200, 37),
                                          (150, 1100, 100), (230, 1100, 230)])
def test_backward_row_groups(M, C, n_groups):
    """dw/db partials must add up however rows are split into groups (uneven and one-tile groups included)."""
    x, w, b, dy = _inputs((M, C), torch.float32, seed=n_groups)
    y, _, mean, rstd = layernorm_fwd(x, w, b, 1e-5)
    dx, dw, db = layernorm_bwd(dy, x, w, True, mean, rstd, n_groups=n_groups)
    want = _oracle(lambda x, w, b: layernorm_ref(x, w, b), (x, w, b), (dy,))
    _assert_all_close([y, dx, dw, db], want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_layernorm_matches_reference(dtype):
    """Both outputs carry a gradient: dx = dresidual = dLN/dh + dh."""
    x, w, b, dy = _inputs((37, 768), dtype)
    r = torch.randn(37, 768, generator=torch.Generator().manual_seed(1)).to(dtype)
    dh = torch.randn(37, 768, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = _grads(lambda x, r, w, b: add_layernorm_triton(x, r, w, b), (x, r, w, b), (dy, dh))
    want = _oracle(lambda x, r, w, b: add_layernorm_ref(x, r, w, b), (x, r, w, b), (dy, dh))
    # h is x + r rounded once to their dtype in both: compare it to the same-dtype sum exactly
    torch.testing.assert_close(got[1], x + r, atol=0, rtol=0)
    _assert_all_close(got, want, dtype)


def test_add_layernorm_half_branch_into_fp32_stream():
    """The model's case under autocast: a bf16/fp16 branch output added to an fp32 residual stream. h (and y)
    follow PyTorch's promotion to fp32, so the stream is never truncated; each input's grad is in its dtype."""
    x, w, b, _ = _inputs((13, 1000), torch.float16)
    r = torch.randn(13, 1000, generator=torch.Generator().manual_seed(3))
    dy, dh = (torch.randn(13, 1000, generator=torch.Generator().manual_seed(i)) for i in (4, 5))
    got = _grads(lambda x, r, w, b: add_layernorm_triton(x, r, w, b), (x, r, w, b), (dy, dh))
    assert [t.dtype for t in got[:4]] == [torch.float32, torch.float32, torch.float16, torch.float32]
    want = _oracle(lambda x, r, w, b: add_layernorm_ref(x, r, w, b), (x, r, w, b), (dy, dh))
    torch.testing.assert_close(got[1], x.float() + r, atol=0, rtol=0)
    _assert_all_close(got[:2] + got[3:], want[:2] + want[3:], torch.float32)
    _assert_all_close(got[2:3], want[2:3], torch.float16)  # dx: the fp32 grad rounded to fp16 once


def test_backward_tiles_fit_the_groups_per_sm(monkeypatch):
    """The GPU tile pruner must assume as many backward row groups per SM as layernorm_bwd launches: one from 8192
    wide (so 3-stage tiles, two 64 KB rows in flight, stay candidates at 16384: assuming two groups had ruled them
    out), two below (so no candidate's two groups overflow shared memory)."""
    monkeypatch.setattr(ln, "_INTERPRET", False)  # the GPU candidate list and pruning, evaluated on CPU
    prune = ln._pruner("bwd")["early_config_prune"]
    for C, per_sm in ((16384, 1), (8192, 1), (4096, 2), (768, 2)):
        assert ln._bwd_groups_per_sm(C) == per_sm
        x = torch.empty(1, C, dtype=torch.bfloat16)
        kept = prune(ln._configs("bwd"), dict(X=x, DY=x, DH=None, C=C), BLOCK_C=triton.next_power_of_2(C))
        smem = [per_sm * (c.kwargs["STAGES"] - 1) * c.kwargs["BLOCK_M"] * C * 4 for c in kept]
        assert kept and max(smem) <= ln.SMEM_BYTES, (C, smem)
        if C == 16384:
            assert max(c.kwargs["STAGES"] for c in kept) == 3, [c.kwargs for c in kept]


@pytest.mark.parametrize("block_m,programs_per_sm", [(1, 0), (4, 0), (2, 1), (4, 3)])
def test_forward_tile_walks(block_m, programs_per_sm):
    """One program per tile (PROGRAMS_PER_SM = 0) and the persistent grid stride (k programs per SM, here 2 "SMs":
    some programs take two tiles, the last tile is partial) normalise every row exactly once."""
    M, C = 37, 97
    x, w, b, _ = _inputs((M, C), torch.float32)
    y, mean, rstd = torch.full_like(x, float("nan")), torch.empty(M), torch.empty(M)
    grid = ln._fwd_grid(M, 2, dict(BLOCK_M=block_m, PROGRAMS_PER_SM=programs_per_sm))
    assert grid == ((M + block_m - 1) // block_m if programs_per_sm == 0 else 2 * programs_per_sm,)
    ln._layernorm_fwd_kernel.fn[grid](x, None, None, y, w, b, mean, rstd, M, C, C, 0, 0, C, 1e-5,
                                      ADD_RESIDUAL=False, HAS_BIAS=True, BLOCK_M=block_m, BLOCK_C=128, STAGES=2,
                                      PROGRAMS_PER_SM=programs_per_sm)
    torch.testing.assert_close(y, layernorm_ref(x, w, b), **TOL[torch.float32])
    torch.testing.assert_close(mean, x.mean(-1), **TOL[torch.float32])


def test_public_op_on_cpu_is_reference():
    x, w, b, _ = _inputs((5, 64), torch.float32)
    torch.testing.assert_close(layernorm(x, w, b), layernorm_ref(x, w, b), atol=0, rtol=0)
    torch.testing.assert_close(layernorm(x, w, b), F.layer_norm(x, (64,), w, b), atol=1e-5, rtol=1e-5)
    y, h = add_layernorm(x, x, w, b)
    torch.testing.assert_close(h, 2 * x, atol=0, rtol=0)


def test_empty_input_launches_nothing():
    x = torch.empty(0, 768)
    w, b = torch.ones(768, requires_grad=True), torch.zeros(768, requires_grad=True)
    y = layernorm_triton(x.requires_grad_(), w, b)
    assert y.shape == (0, 768)
    y.sum().backward()
    assert torch.count_nonzero(w.grad) == 0 and torch.count_nonzero(b.grad) == 0


def test_user_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="shape"):
        layernorm_triton(x, torch.ones(7), torch.zeros(8))
    with pytest.raises(ValueError, match="not supported"):
        layernorm_triton(torch.randn(1, MAX_C + 1), torch.ones(MAX_C + 1), None)
    with pytest.raises(ValueError, match="residual"):
        add_layernorm_triton(x, torch.randn(4, 9), torch.ones(8), None)


# ---------------------------------------------------------------------------------------------------------------
# GPU: real sizes, bf16


def _bf16_errors(fn, ref_fn, tensors, outs_grads):
    """max |kernel - fp32 ref| and max |PyTorch bf16 - fp32 ref| per output/grad."""
    got = _grads(fn, tensors, outs_grads)
    torch_bf16 = _grads(ref_fn, tensors, outs_grads)
    ref = _grads(ref_fn, [None if t is None else t.float() for t in tensors], [g.float() for g in outs_grads])
    return ([(a.float() - r).abs().max().item() for a, r in zip(got, ref)],
            [(a.float() - r).abs().max().item() for a, r in zip(torch_bf16, ref)])


def _eager_bf16_layernorm(x, w, b):
    """PyTorch's own bf16 path: F.layer_norm with bf16 params (eager rejects mixed dtypes)."""
    return F.layer_norm(x, (x.shape[-1],), w.to(x.dtype), None if b is None else b.to(x.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("M,C", [(16384, 768), (4099, 1600), (2048, 8192)])
def test_gpu_layernorm_bf16(M, C):
    torch.manual_seed(0)
    x = torch.randn(M, C, device="cuda", dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(C, device="cuda")
    b = 0.1 * torch.randn(C, device="cuda")
    dy = torch.randn(M, C, device="cuda", dtype=torch.bfloat16)
    ours, theirs = _bf16_errors(layernorm, _eager_bf16_layernorm, (x, w, b), (dy,))
    for name, e, t in zip(("y", "dx", "dw", "db"), ours, theirs):
        assert e <= 2 * t + 1e-3, f"{name}: kernel err {e:.3e} > 2 x PyTorch bf16 err {t:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("stream_dtype", [torch.bfloat16, torch.float32])
def test_gpu_add_layernorm_bf16(stream_dtype):
    torch.manual_seed(0)
    M, C = 16384, 768
    x, dy = (torch.randn(M, C, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    r, dh = (torch.randn(M, C, device="cuda", dtype=stream_dtype) for _ in range(2))
    w = 1 + 0.1 * torch.randn(C, device="cuda")
    b = 0.1 * torch.randn(C, device="cuda")

    def eager(x, r, w, b):
        h = x + r
        return _eager_bf16_layernorm(h, w, b), h

    ours, theirs = _bf16_errors(add_layernorm, eager, (x, r, w, b), (dy, dh))
    for name, e, t in zip(("y", "h", "dx", "dres", "dw", "db"), ours, theirs):
        assert e <= 2 * t + 1e-3, f"{name}: kernel err {e:.3e} > 2 x PyTorch bf16 err {t:.3e}"
