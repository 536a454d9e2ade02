"""kernels/mlp.py: the fused MLP block (GEMM + GELU epilogues) against the PyTorch reference.

CPU: the Triton kernels run in the interpreter (one 32 x 32 x 16 tile, 3 "SMs": several M, N and K tiles, partial
tails, the grid stride, the split epilogue, two db_fc partial rows per tile) at awkward sizes: 1, 17, 129 rows,
C = 24 and 40 (H = 96, 160), biases on and off, fp32 and fp16 (the interpreter's bf16 dots are broken). The oracle
is the reference in float64. GPU (`-m gpu`): M = 4096, C = 768, bf16, judged by "error vs an fp32 reference <= 2x
PyTorch's own bf16 error + a small atol".
"""
import pytest
import torch
import torch.nn.functional as F

from kernels import mlp as mm
from kernels.mlp import mlp, mlp_fc_fwd, mlp_ref, mlp_triton, proj_dgelu_bwd

# max |error| / max |oracle| per output. fp32: the kernels' fp32 sums in another order than float64 (measured
# <= 5e-7). fp16: pre, h and dpre are each rounded once to 11 mantissa bits (2^-11 = 4.9e-4; measured <= 6.6e-4)
REL_TOL = {torch.float32: 1e-5, torch.float16: 4e-3}
NAMES = ("y", "dx", "dw_fc", "db_fc", "dw_proj", "db_proj")


def _inputs(shape, dtype, bias=True, seed=0, hidden=None):
    """x ~ N(0, 1), weights scaled by 1/sqrt(fan_in) (so pre, h, y are O(1)), biases 0.1 N(0, 1); all in dtype."""
    g = torch.Generator().manual_seed(seed)
    C = shape[-1]
    H = hidden or 4 * C
    x = torch.randn(shape, generator=g)
    w_fc = torch.randn(H, C, generator=g) * C ** -0.5
    b_fc = 0.1 * torch.randn(H, generator=g) if bias else None
    w_proj = torch.randn(C, H, generator=g) * H ** -0.5
    b_proj = 0.1 * torch.randn(C, generator=g) if bias else None
    dy = torch.randn(shape, generator=g)
    return [None if t is None else t.to(dtype) for t in (x, w_fc, b_fc, w_proj, b_proj)], dy.to(dtype)


def _run(fn, tensors, dy):
    """y and the grads of every non-None input, on leaf copies."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    y = fn(*leaves)
    y.backward(dy.to(y.dtype))
    return [y] + [t.grad for t in leaves if t is not None]


def _assert_rel_close(got, want, tol, names):
    assert len(got) == len(want)
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, name
        err = (a.double() - b.double()).abs().max().item()
        scale = b.double().abs().max().item()
        assert err <= tol * scale + 1e-12, f"{name}: max err {err:.3e} > {tol} x max |ref| {scale:.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("C", [24, 40])
@pytest.mark.parametrize("rows", [1, 17, 129])
def test_mlp_matches_reference(rows, C, bias, dtype):
    ts, dy = _inputs((rows, C), dtype, bias=bias, seed=rows + C)
    got = _run(mlp_triton, ts, dy)
    want = _run(mlp_ref, [None if t is None else t.double() for t in ts], dy.double())
    assert all(t.dtype == dtype for t in got)
    names = [n for n, t in zip(NAMES, [dy] + ts) if t is not None]
    _assert_rel_close(got, want, REL_TOL[dtype], names)


def test_leading_dims_and_partial_grads():
    """x (B, T, C); only some inputs need grads (the Function skips the others' products)."""
    ts, dy = _inputs((3, 5, 40), torch.float32)
    x, w_fc, b_fc, w_proj, b_proj = ts
    w_fc, b_proj = w_fc.clone().requires_grad_(), b_proj.clone().requires_grad_()
    y = mlp_triton(x, w_fc, b_fc, w_proj, b_proj)
    assert y.shape == (3, 5, 40)
    y.backward(dy)
    ref = [t.detach().double().requires_grad_() for t in (w_fc, b_proj)]
    y_ref = mlp_ref(x.double(), ref[0], b_fc.double(), w_proj.double(), ref[1])
    y_ref.backward(dy.double())
    _assert_rel_close([y, w_fc.grad, b_proj.grad], [y_ref, ref[0].grad, ref[1].grad], REL_TOL[torch.float32],
                      ("y", "dw_fc", "db_proj"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_saved_pre_and_h(dtype):
    """The forward kernel's two outputs: pre is F.linear (fp32 accumulation, one rounding) and h is F.gelu(tanh)
    of that stored pre (up to h's own rounding, 1 ulp)."""
    (x, w_fc, b_fc, _, _), _ = _inputs((129, 40), dtype)
    pre, h = mlp_fc_fwd(x, w_fc, b_fc)
    want_pre = F.linear(x.double(), w_fc.double(), b_fc.double())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)  # 1-2 ulp in fp16
    torch.testing.assert_close(pre.double(), want_pre, **tol)
    torch.testing.assert_close(h.double(), F.gelu(pre.double(), approximate="tanh"), **tol)


def _dgelu_oracle(dy, w_proj, pre):
    """(dpre, db_fc) in float64: dpre = (dy @ w_proj) * gelu'(pre) through autograd of F.gelu."""
    p = pre.double().requires_grad_()
    dh = dy.double() @ w_proj.double()
    (dpre,) = torch.autograd.grad(F.gelu(p, approximate="tanh"), p, dh)
    return dpre, dpre.sum(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_kernel_outputs(dtype):
    """dpre and db_fc (the fp32 partial rows, summed) of the backward kernel alone, 129 rows: 5 M tiles writing
    2 partial rows each, the last of those rows past cdiv(129, PART_M) = 9 masked."""
    (x, w_fc, b_fc, w_proj, _), dy = _inputs((129, 40), dtype, seed=1)
    pre, _ = mlp_fc_fwd(x, w_fc, b_fc)
    dpre, db = proj_dgelu_bwd(dy, w_proj, pre)
    want_dpre, want_db = _dgelu_oracle(dy, w_proj, pre)
    assert dpre.dtype == dtype and db.dtype == dtype
    _assert_rel_close([dpre, db], [want_dpre, want_db], REL_TOL[dtype], ("dpre", "db_fc"))
    assert proj_dgelu_bwd(dy, w_proj, pre, need_bias_grad=False)[1] is None


@pytest.mark.parametrize("block_m,epi_split,num_sms", [(16, 1, 1), (32, 2, 4), (64, 1, 3), (64, 2, 7)])
def test_tiles_and_partial_rows(block_m, epi_split, num_sms):
    """Other tiles than the interpreter's default through the raw kernels: one partial row per tile (BLOCK_M =
    PART_M), four (BLOCK_M = 4 PART_M, most of them past the end and masked), whole-tile epilogue, 1 to 7 programs."""
    M, C = 129, 40
    (x, w_fc, b_fc, w_proj, _), dy = _inputs((M, C), torch.float32, seed=2)
    N = 4 * C
    tile = dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=16, GROUP_M=3, EPI_SPLIT=epi_split, NUM_SMS=num_sms,
                DOT_PRECISION="ieee")
    grid = (num_sms,)
    pre, h = torch.full((M, N), float("nan")), torch.full((M, N), float("nan"))
    mm._fc_gelu_fwd.fn[grid](x, w_fc, b_fc, pre, h, M, N, C, 256, HAS_BIAS=True, **tile)
    want_pre = F.linear(x.double(), w_fc.double(), b_fc.double())
    _assert_rel_close([pre, h], [want_pre, F.gelu(want_pre, approximate="tanh")], 1e-5, ("pre", "h"))
    part_rows = -(-M // mm.PART_M)
    dpre, part = torch.full((M, N), float("nan")), torch.full((part_rows, N), float("nan"))
    mm._proj_dgelu_bwd.fn[grid](dy, w_proj, pre, dpre, part, M, N, C, part_rows, 256, PART_M=mm.PART_M,
                                PREFETCH=False, **tile)
    want_dpre, want_db = _dgelu_oracle(dy, w_proj, pre)
    assert not part.isnan().any()  # every partial row written, by exactly the tile that owns it
    _assert_rel_close([dpre, part.sum(0)], [want_dpre, want_db], 1e-5, ("dpre", "db_fc"))


def test_public_op_on_cpu_is_reference():
    ts, _ = _inputs((5, 24), torch.float32)
    torch.testing.assert_close(mlp(*ts), mlp_ref(*ts), atol=0, rtol=0)


def test_autocast_reference_path():
    """The model's setting on CPU: fp32 params under autocast(bf16) take the reference, which autocasts like any
    F.linear: output in bf16, grads in the params' (and x's) fp32."""
    ts, dy = _inputs((17, 24), torch.float32)
    leaves = [t.clone().requires_grad_() for t in ts]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mlp(*leaves)
    assert y.dtype == torch.bfloat16
    y.backward(dy.to(torch.bfloat16))
    assert all(t.grad.dtype == torch.float32 for t in leaves)
    want = _run(mlp_ref, [t.double() for t in ts], dy.double())
    # bf16 (8 mantissa bits): the inputs, pre, h and y each rounded once
    _assert_rel_close([y] + [t.grad for t in leaves], want, 3e-2, NAMES)


def test_autocast_triton_path():
    """mlp_triton under autocast casts x, weights and biases to the autocast dtype outside its Function (fp16 here:
    the interpreter cannot run bf16 dots): y in fp16, every grad in its input's fp32, the same numbers as
    autocast's own F.linear path up to fp16 rounding."""
    ts, dy = _inputs((17, 40), torch.float32, seed=3)
    got_leaves = [t.clone().requires_grad_() for t in ts]
    ref_leaves = [t.clone().requires_grad_() for t in ts]
    with torch.autocast("cpu", dtype=torch.float16):
        y = mlp_triton(*got_leaves)
        y_ref = mlp_ref(*ref_leaves)
    assert y.dtype == torch.float16 and y_ref.dtype == torch.float16
    y.backward(dy.half())
    y_ref.backward(dy.half())
    assert all(t.grad.dtype == torch.float32 for t in got_leaves)
    _assert_rel_close([y] + [t.grad for t in got_leaves], [y_ref] + [t.grad for t in ref_leaves],
                      REL_TOL[torch.float16], NAMES)


def test_empty_input_launches_nothing():
    ts, _ = _inputs((0, 24), torch.float32)
    leaves = [t.clone().requires_grad_() for t in ts]
    y = mlp_triton(*leaves)
    assert y.shape == (0, 24)
    y.sum().backward()
    assert all(torch.count_nonzero(t.grad) == 0 for t in leaves[1:])


def test_user_errors():
    ts, _ = _inputs((4, 24), torch.float32)
    x, w_fc, b_fc, w_proj, b_proj = ts
    with pytest.raises(ValueError, match="want w_fc"):
        mlp_triton(x, w_fc[:, :16], b_fc, w_proj, b_proj)
    with pytest.raises(ValueError, match="dtypes differ"):
        mlp_triton(x.half(), w_fc, b_fc, w_proj, b_proj)
    ts, _ = _inputs((4, 20), torch.float16)  # 40-byte rows: not a TMA row stride
    with pytest.raises(ValueError, match="16-byte rows"):
        mlp_triton(*ts)


# ---------------------------------------------------------------------------------------------------------------
# GPU: a real size, bf16


@pytest.mark.gpu
@pytest.mark.parametrize("M", [4096, 4099])
def test_gpu_mlp_bf16(M):
    C = 768
    g = torch.Generator(device="cuda").manual_seed(0)
    ts = [torch.randn(M, C, device="cuda", generator=g),
          torch.randn(4 * C, C, device="cuda", generator=g) * C ** -0.5,
          0.1 * torch.randn(4 * C, device="cuda", generator=g),
          torch.randn(C, 4 * C, device="cuda", generator=g) * (4 * C) ** -0.5,
          0.1 * torch.randn(C, device="cuda", generator=g)]
    ts = [t.bfloat16() for t in ts]
    dy = torch.randn(M, C, device="cuda", generator=g).bfloat16()
    ref = _run(mlp_ref, [t.float() for t in ts], dy.float())
    ours = _run(mlp, ts, dy)
    theirs = _run(mlp_ref, ts, dy)  # PyTorch's own bf16 path: cuBLAS, GELU in bf16
    for name, o, t, r in zip(NAMES, ours, theirs, ref):
        assert o.dtype == torch.bfloat16
        e, e_t = (o.float() - r).abs().max().item(), (t.float() - r).abs().max().item()
        assert e <= 2 * e_t + 1e-3, f"{name}: kernel err {e:.3e} > 2 x PyTorch bf16 err {e_t:.3e}"
