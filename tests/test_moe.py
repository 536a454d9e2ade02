"""MoE: routing, permute / unpermute, grouped GEMM (kernels/moe_route.py, kernels/grouped_gemm.py) and the MoE MLP
block (nanopara/moe.py).

CPU: the Triton kernels run in the interpreter at small awkward sizes (37 tokens, 5 or 33 experts, widths 24/40,
empty experts, one expert holding everything, k > 1, dropped tokens). Routing is integer work: equal to the
reference exactly. Float results are judged against float64 oracles: fp32 paths differ by summation order only
(observed <= ~2e-6 relative), fp16 by the rounding of stored intermediates. tl.dot on bf16 is wrong in the
interpreter (notes/triton_cpu.md), so GEMMs are tested in fp32/fp16 here and in bf16 on the GPU (`-m gpu`).
"""
import copy
import math

import pytest
import torch

from kernels import grouped_gemm as gg
from kernels.moe_route import (padded_dest, permute_ref, permute_triton, route_ref, route_triton, unpermute_ref,
                               unpermute_triton)
from nanopara.moe import (MoEConfig, MoEMLP, active_params, collect_stats, gate_weights, load_balance_loss,
                          moe_layers, set_aux_grad_scale, update_expert_bias, z_loss)


# the interpreter reads loop bounds loaded from memory (group offsets) through a 1-element array's __index__
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------------------------
# routing


def _logits(N, E, kind, seed=0):
    z = torch.randn(N, E, generator=_gen(seed))
    if kind == "one":  # one expert is everyone's first choice
        z[:, 2 % E] += 100
    elif kind == "ties":  # all equal: the lowest ids win
        z = torch.zeros(N, E)
    elif kind == "empty":  # experts 0 and 1 are never chosen
        z[:, :2] -= 100
    return z


ROUTES = [  # (N, E, k, score, bias, capacity, logits kind)
    (37, 5, 2, "softmax", False, None, "random"),
    (37, 5, 2, "sigmoid", True, 9, "random"),  # dropped tokens
    (37, 5, 2, "softmax", True, None, "empty"),  # empty experts; softmax + bias ranks the probabilities
    (37, 5, 3, "softmax", False, 7, "one"),  # one expert holds everything first, capped
    (37, 33, 4, "softmax", False, None, "random"),  # E not a power of 2, k = 4
    (9, 4, 4, "softmax", False, None, "ties"),  # k = E, ties
    (50, 7, 1, "softmax", False, 4, "random"),  # k = 1 with capacity
    (1, 3, 2, "sigmoid", False, 0, "random"),  # capacity 0: everything dropped
    (0, 4, 2, "softmax", False, None, "random"),  # no tokens
]


@pytest.mark.parametrize("N,E,k,score,bias,capacity,kind", ROUTES)
def test_route_matches_reference(N, E, k, score, bias, capacity, kind):
    z = _logits(N, E, kind)
    b = 0.3 * torch.randn(E, generator=_gen(1)) if bias else None
    got, want = route_triton(z, k, score, b, capacity), route_ref(z, k, score, b, capacity)
    for name in ("idx", "dest", "counts", "offsets"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.rows == want.rows


@pytest.mark.parametrize("N,E,k,score,bias,capacity,kind", ROUTES)
def test_route_reference_is_a_stable_grouping(N, E, k, score, bias, capacity, kind):
    """The spec's properties, checked independently of its argsort: expert e's kept rows are offsets[e] +
    0, 1, ... over its assignments in slot-major order (j, then t), cut at the capacity; top-k picks the largest
    keys best first, lowest id on ties."""
    z = _logits(N, E, kind)
    b = 0.3 * torch.randn(E, generator=_gen(1)) if bias else None
    r = route_ref(z, k, score, b, capacity)
    cap = capacity if capacity is not None else N * k
    key = z if score == "softmax" and b is None else (z.softmax(-1) if score == "softmax" else z.sigmoid()) + (
        0 if b is None else b)
    for t in range(N):
        order = sorted(range(E), key=lambda e: (-key[t, e].item(), e))
        assert r.idx[t].tolist() == order[:k]
    for e in range(E):
        mine = [(j, t) for j in range(k) for t in range(N) if r.idx[t, j] == e]
        assert r.counts[e] == len(mine)
        kept = min(len(mine), cap)
        assert r.offsets[e + 1] - r.offsets[e] == kept
        assert [r.dest[t, j].item() for j, t in mine] == [r.offsets[e].item() + i for i in range(kept)] + \
            [-1] * (len(mine) - kept)


# ----------------------------------------------------------------------------------------------------------------
# permute / unpermute


def _leaf(t):
    return t.detach().clone().requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])  # no tl.dot: bf16 is fine
@pytest.mark.parametrize("route_case", [0, 1, 3])  # dropless; dropped tokens; one expert capped
def test_permute_unpermute_match_reference(route_case, dtype):
    N, E, k, score, bias, capacity, kind = ROUTES[route_case]
    r = route_ref(_logits(N, E, kind), k, score, 0.3 * torch.randn(E, generator=_gen(1)) if bias else None,
                  capacity)
    used = int(r.offsets[-1])
    C = 40
    x = torch.randn(N, C, generator=_gen(2)).to(dtype)
    ys = torch.randn(r.rows, C, generator=_gen(3)).to(dtype)
    w = torch.rand(N, k, generator=_gen(4))
    dxs = torch.randn(r.rows, C, generator=_gen(5)).to(dtype)
    dy = torch.randn(N, C, generator=_gen(6)).to(dtype)

    xa, xb = _leaf(x), _leaf(x)
    xs_t, xs_r = permute_triton(xa, r.dest, r.rows), permute_ref(xb, r.dest, r.rows)
    assert torch.equal(xs_t[:used], xs_r[:used])  # a copy: exact
    xs_t.backward(dxs)
    xs_r.backward(dxs)
    # dx sums a token's k rows in fp32 and rounds once; the reference accumulates in the dtype itself
    torch.testing.assert_close(xa.grad.float(), xb.grad.float(), **_TOL[dtype])

    ya, wa, yb, wb = _leaf(ys), _leaf(w), _leaf(ys.double()), _leaf(w.double())
    out_t, out_r = unpermute_triton(ya, r.dest, wa), unpermute_ref(yb, r.dest, wb)
    assert out_t.dtype == dtype
    torch.testing.assert_close(out_t.double(), out_r, **_TOL[dtype])
    out_t.backward(dy)
    out_r.backward(dy.double())
    torch.testing.assert_close(ya.grad[:used].double(), yb.grad[:used], **_TOL[dtype])
    torch.testing.assert_close(wa.grad.double(), wb.grad, atol=1e-4 * C, rtol=1e-4)  # fp32 dot over C columns
    dropped = r.dest < 0
    assert (wa.grad[dropped] == 0).all()


@pytest.mark.parametrize("route_case", [1, 3, 6])  # dropped tokens; one expert capped; k = 1 with capacity
def test_padded_dest_and_unweighted_moves(route_case):
    """padded_dest (expert parallel's fixed-size buffer, E x capacity rows): each kept assignment lands at
    e * capacity + its rank within expert e, drops stay -1. The unweighted unpermute (ep.py's move back from the
    local experts' order) equals the reference, and its backward is the permute: rows no assignment owns get
    nothing (left unwritten), the others exactly their token's gradient."""
    N, E, k, score, bias, capacity, kind = ROUTES[route_case]
    r = route_ref(_logits(N, E, kind), k, score, 0.3 * torch.randn(E, generator=_gen(1)) if bias else None,
                  capacity)
    pad = padded_dest(r, capacity)
    assert pad.dtype == torch.int32 and pad.shape == r.dest.shape
    assert torch.equal(pad < 0, r.dest < 0)
    for t in range(N):
        for j in range(k):
            if r.dest[t, j] >= 0:
                e = r.idx[t, j].item()
                assert pad[t, j] == e * capacity + r.dest[t, j] - r.offsets[e]
    rows, C = E * capacity, 24
    ys = torch.randn(rows, C, generator=_gen(2))
    ya, yb = _leaf(ys), _leaf(ys)
    out_t, out_r = unpermute_triton(ya, pad, None), unpermute_ref(yb, pad, None)
    torch.testing.assert_close(out_t, out_r, rtol=1e-6, atol=1e-6)  # fp32 sums of k rows in slot order
    dy = torch.randn(N, C, generator=_gen(3))
    out_t.backward(dy)
    out_r.backward(dy)
    owned = torch.zeros(rows, dtype=torch.bool)
    owned[pad[pad >= 0].long()] = True
    assert torch.equal(ya.grad[owned], yb.grad[owned])  # copies of dy rows: exact


# fp32: summation order; fp16/bf16: one rounding of an fp32 sum to 11 / 8 mantissa bits (values ~1-3)
_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=2e-3),
        torch.bfloat16: dict(atol=3e-2, rtol=1e-2)}


# ----------------------------------------------------------------------------------------------------------------
# grouped GEMM


def _max_rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def _mlp_params(E, C, H, bias, seed=0):
    g = _gen(seed)
    w_fc, w_proj = 0.3 * torch.randn(E, H, C, generator=g), 0.2 * torch.randn(E, C, H, generator=g)
    b_fc = 0.3 * torch.randn(E, H, generator=g) if bias else None
    b_proj = 0.3 * torch.randn(E, C, generator=g) if bias else None
    return [w_fc, b_fc, w_proj, b_proj]


def _run_mlp(fn, x, params, offsets, dy, used):
    leaves = [_leaf(x)] + [None if p is None else _leaf(p) for p in params]
    y = fn(leaves[0], *leaves[1:], offsets)
    loss = (y[:used].double() * dy[:used]).sum()  # a sum: with no rows at all the backward still runs
    if loss.requires_grad:  # (the reference with no groups never touches the parameters)
        loss.backward()
    grads = [None if t is None else (t.grad if t.grad is not None else torch.zeros_like(t)) for t in leaves]
    grads[0] = grads[0][:used]
    return [y[:used]] + grads


# rows past the last group (unused buffer rows) are never read or written
@pytest.mark.parametrize("sizes,dtype,bias", [
    ([5, 0, 20, 1, 11], torch.float32, True),  # an empty group, a 1-row group, partial tiles
    ([37, 0, 0], torch.float16, True),  # one group holds everything
    ([3, 17, 9, 2, 10], torch.float32, False),  # no bias
    ([0, 0, 0], torch.float32, True),  # nothing at all: dw and db are zeros
])
def test_grouped_mlp_matches_reference(sizes, dtype, bias):
    E, C, H = len(sizes), 24, 40
    offsets = gg.offsets_of(sizes, "cpu")
    used = sum(sizes)
    R = used + 3
    x = torch.randn(R, C, generator=_gen(1)).to(dtype)
    params = _mlp_params(E, C, H, bias)
    dy = torch.randn(R, C, generator=_gen(2)).to(dtype)
    got = _run_mlp(gg.grouped_mlp_triton, x, params, offsets, dy, used)
    want = _run_mlp(gg.grouped_mlp_ref, x.double(), [None if p is None else p.double() for p in params],
                    offsets, dy.double(), used)
    assert got[0].dtype == dtype and all(g is None or g.dtype == torch.float32 for g in got[2:])  # fp32 params
    # fp32: summation order (~1e-6); fp16: h, gelu(h) and dh are stored in fp16 (2**-11) and feed the next GEMM
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None:
            assert a is None
        elif used == 0:
            assert (a == 0).all() and (b == 0).all(), i
        else:
            assert _max_rel(a, b) <= tol, (i, _max_rel(a, b))


def test_grouped_linear_and_wgrad_of_empty_groups():
    """One Linear per group (no GELU epilogue); an empty group's dw and db are exactly zero."""
    sizes = [0, 13, 0, 30]
    E, K, N = len(sizes), 40, 24
    offsets = gg.offsets_of(sizes, "cpu")
    x = torch.randn(43, K, generator=_gen(1))
    w, b = 0.2 * torch.randn(E, N, K, generator=_gen(2)), torch.randn(E, N, generator=_gen(3))
    dy = torch.randn(43, N, generator=_gen(4))
    xa, wa, ba = _leaf(x), _leaf(w), _leaf(b)
    y = gg.grouped_linear_triton(xa, wa, ba, offsets)
    y.backward(dy)
    xb, wb, bb = _leaf(x.double()), _leaf(w.double()), _leaf(b.double())
    gg.grouped_linear_ref(xb, wb, bb, offsets).backward(dy.double())
    for a, r in ((y, gg.grouped_linear_ref(x.double(), w.double(), b.double(), offsets)), (xa.grad, xb.grad),
                 (wa.grad, wb.grad), (ba.grad, bb.grad)):
        assert _max_rel(a, r) <= 1e-5
    assert (wa.grad[[0, 2]] == 0).all() and (ba.grad[[0, 2]] == 0).all()


# the TMA kernel (_grouped_mm_tma_kernel): the interpreter emulates tensor descriptors (zero fill past a descriptor's
# shape, stores clipped to it), so its schedule and per-group descriptors run here; 16 x 16 x 16 tiles, 2 programs
TMA_CASES = [  # sizes, dtype, bias; K = 40, N = 24: neither a multiple of the 16-wide tiles
    ([5, 0, 20, 1, 11], torch.float32, True),  # an empty group, a 1-row group, partial m tiles
    ([37, 0, 0], torch.float16, True),  # one group holds every row
    ([0, 13, 0, 30], torch.float32, False),  # empty first group, no bias
    ([40, 3, 0, 33], torch.float32, True),  # 18 tiles over 2 programs: the persistent loop crosses groups
    ([0, 0, 0], torch.float32, True),  # no rows at all
]


@pytest.mark.parametrize("sizes,dtype,bias", TMA_CASES)
def test_grouped_tma_matches_reference(sizes, dtype, bias):
    E, K, N = len(sizes), 40, 24
    offsets = gg.offsets_of(sizes, "cpu")
    used = sum(sizes)
    R = used + 3  # unused buffer rows past offsets[E]
    x = torch.randn(R, K, generator=_gen(1)).to(dtype)
    w = (0.2 * torch.randn(E, N, K, generator=_gen(2))).to(dtype)
    b = torch.randn(E, N, generator=_gen(3)).to(dtype) if bias else None
    dy = torch.randn(R, N, generator=_gen(4)).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 5e-3

    def check(got, want, ptr):
        assert got.dtype == dtype and got.shape == ptr.shape == (R, want.shape[1])
        if used:
            assert _max_rel(got[:used], want[:used]) <= tol, _max_rel(got[:used], want[:used])
            assert _max_rel(got[:used], ptr[:used].double()) <= tol  # the pointer kernel agrees

    h_ref = gg.grouped_linear_ref(x.double(), w.double(), None if b is None else b.double(), offsets)
    y, none = gg.grouped_fwd(x, w, b, offsets, tma=True)
    assert none is None
    check(y, h_ref, gg.grouped_fwd(x, w, b, offsets, tma=False)[0])
    g, h = gg.grouped_fwd(x, w, b, offsets, gelu=True, tma=True)
    g_ptr, h_ptr = gg.grouped_fwd(x, w, b, offsets, gelu=True, tma=False)
    check(h, h_ref, h_ptr)
    check(g, torch.nn.functional.gelu(h[:used].double(), approximate="tanh"), g_ptr)  # gelu of the stored h
    dx_ref = gg.grouped_linear_ref(dy.double(), w.double().transpose(1, 2), None, offsets)  # dy @ w[e]
    check(gg.grouped_dgrad(dy, w, offsets, tma=True), dx_ref, gg.grouped_dgrad(dy, w, offsets, tma=False))
    pre = torch.randn(R, K, generator=_gen(5)).to(dtype)  # a GELU input of dx's shape (R, K)
    p = pre[:used].double().requires_grad_()
    slope, = torch.autograd.grad(torch.nn.functional.gelu(p, approximate="tanh").sum(), p)
    check(gg.grouped_dgrad(dy, w, offsets, pre=pre, tma=True), dx_ref[:used] * slope,
          gg.grouped_dgrad(dy, w, offsets, pre=pre, tma=False))


def _wgrad_ref(dy, x, offsets):
    """float64 dw[e] = dy[group e]^T @ x[group e], db[e] = column sums of dy[group e] (zeros for an empty group)."""
    E, bounds = offsets.shape[0] - 1, offsets.tolist()
    dw = torch.zeros(E, dy.shape[1], x.shape[1], dtype=torch.float64, device=dy.device)
    db = torch.zeros(E, dy.shape[1], dtype=torch.float64, device=dy.device)
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        dw[e], db[e] = dy[lo:hi].double().t() @ x[lo:hi].double(), dy[lo:hi].double().sum(0)
    return dw, db


# the TMA weight gradient (_grouped_wgrad_tma_kernel), 16 x 16 dw tiles, BLOCK_R = 16, 2 programs; N = 24, K = 40
# are not multiples of the tiles; the unused rows past offsets[E] hold 1e4 (they would dominate any sum they entered)
WGRAD_TMA_CASES = [  # sizes, dtype (of dy and x), dw's dtype (None: dy's), bias
    ([5, 0, 20, 1, 11], torch.float32, None, True),  # an empty group, a 1-row group, partial row tiles
    ([37, 0, 0], torch.float16, None, True),  # one group holds every row (last group empty too)
    ([0, 13, 0, 30], torch.float32, None, False),  # empty first group, no bias
    ([40, 3, 0, 33], torch.float32, None, True),  # 24 dw tiles over 2 programs: the persistent loop crosses groups
    ([16, 1, 0, 32], torch.float16, torch.float32, True),  # whole row tiles; fp32 dw / db from fp16 (master grads)
    ([0, 0, 0], torch.float32, None, True),  # no rows at all: zeros
]


@pytest.mark.parametrize("sizes,dtype,out_dtype,bias", WGRAD_TMA_CASES)
def test_grouped_wgrad_tma_matches_reference(monkeypatch, sizes, dtype, out_dtype, bias):
    calls = []
    monkeypatch.setattr(gg, "WGRAD_DB_MMA", False)  # db on the CUDA cores (the tensor cores': the next test)
    launch = gg._launch_wgrad_tma
    monkeypatch.setattr(gg, "_launch_wgrad_tma", lambda *a, **k: calls.append(1) or launch(*a, **k))
    E, K, N = len(sizes), 40, 24
    offsets = gg.offsets_of(sizes, "cpu")
    used = sum(sizes)
    R = used + 3
    x = torch.randn(R, K, generator=_gen(1)).to(dtype)
    dy = torch.randn(R, N, generator=_gen(4)).to(dtype)
    x[used:], dy[used:] = 1e4, 1e4  # unused buffer rows: never read
    dw, db = gg.grouped_wgrad(dy, x, offsets, dtype=out_dtype, bias=bias, tma=True)
    assert calls == [1]
    dw_p, db_p = gg.grouped_wgrad(dy, x, offsets, dtype=out_dtype, bias=bias, tma=False)
    assert len(calls) == 1  # tma=False: the pointer kernel
    dw_ref, db_ref = _wgrad_ref(dy, x, offsets)
    want = out_dtype or dtype
    assert dw.dtype == want and dw.shape == (E, N, K) and (db is None) == (not bias)
    # fp32: summation order; fp16 out: dw / db rounded to fp16 (2**-11); fp32 out from fp16 operands: exact products
    tol = 5e-3 if want == torch.float16 else 1e-5
    empty = [e for e, n in enumerate(sizes) if n == 0]
    for got, ptr, ref in ((dw, dw_p, dw_ref), (db, db_p, db_ref)):
        if got is None:
            assert ptr is None
            continue
        assert got.dtype == want and got.shape == ref.shape
        assert (got[empty] == 0).all()  # written, not left as torch.empty's garbage
        if used:
            assert _max_rel(got, ref) <= tol, _max_rel(got, ref)
            assert _max_rel(got, ptr.double()) <= tol  # the pointer kernel agrees
        else:
            assert (got == 0).all()


def test_grouped_wgrad_tma_host_checks(monkeypatch):
    """grouped_wgrad(tma=True) raises where its descriptors cannot be made; the flag falls back to the pointer
    kernel there, and takes the TMA kernel (interpreter) where they can."""
    offsets = gg.offsets_of([3, 4], "cpu")
    dy, x = torch.randn(7, 24, generator=_gen(1)), torch.randn(7, 40, generator=_gen(2))
    x37 = torch.randn(7, 37, generator=_gen(3))  # 148-byte rows
    with pytest.raises(ValueError, match="16-byte"):
        gg.grouped_wgrad(dy, x37, offsets, tma=True)
    x4 = torch.randn(7, 4, generator=_gen(4))  # 16-byte rows of x, but 8-byte rows of an fp16 dw
    with pytest.raises(ValueError, match="dw rows"):
        gg.grouped_wgrad(dy, x4, offsets, dtype=torch.float16, tma=True)
    calls = []
    launch = gg._launch_wgrad_tma
    monkeypatch.setattr(gg, "_launch_wgrad_tma", lambda *a, **k: calls.append(1) or launch(*a, **k))
    monkeypatch.setattr(gg, "TMA", True)
    dw_ref, db_ref = _wgrad_ref(dy, x37, offsets)
    dw, db = gg.grouped_wgrad(dy, x37, offsets)  # falls back
    assert calls == [] and _max_rel(dw, dw_ref) <= 1e-5 and _max_rel(db, db_ref) <= 1e-5
    dw, db = gg.grouped_wgrad(dy, x, offsets)  # the flag: TMA
    dw_ref, db_ref = _wgrad_ref(dy, x, offsets)
    assert calls == [1] and _max_rel(dw, dw_ref) <= 1e-5 and _max_rel(db, db_ref) <= 1e-5
    monkeypatch.setattr(gg, "TMA", None)  # None: CUDA tensors only, so the pointer kernel on CPU
    gg.grouped_wgrad(dy, x, offsets)
    assert calls == [1]


def test_grouped_mlp_takes_the_tma_kernel_under_the_flag(monkeypatch):
    """gg.TMA (NANOPARA_GROUPED_TMA=1) sends the autograd Functions' fwd, dgrad and wgrad GEMMs to the TMA
    kernels."""
    calls, wgrads = [], []
    launch, launch_w = gg._launch_mm_tma, gg._launch_wgrad_tma
    monkeypatch.setattr(gg, "_launch_mm_tma", lambda *a, **k: calls.append(a[2]) or launch(*a, **k))
    monkeypatch.setattr(gg, "_launch_wgrad_tma", lambda *a, **k: wgrads.append(a[0].shape) or launch_w(*a, **k))
    monkeypatch.setattr(gg, "TMA", True)
    sizes = [5, 0, 20, 1, 11]
    E, C, H = len(sizes), 24, 40
    offsets = gg.offsets_of(sizes, "cpu")
    used = sum(sizes)
    x = torch.randn(used + 3, C, generator=_gen(1))
    params = _mlp_params(E, C, H, True)
    dy = torch.randn(used + 3, C, generator=_gen(2))
    got = _run_mlp(gg.grouped_mlp_triton, x, params, offsets, dy, used)
    want = _run_mlp(gg.grouped_mlp_ref, x.double(), [p.double() for p in params], offsets, dy.double(), used)
    assert sorted(calls) == [False, False, True, True]  # 2 forwards (trans_b), 2 dgrads
    assert sorted(wgrads) == [(used + 3, C), (used + 3, H)]  # c_proj's (dy) and c_fc's (dh) weight gradients
    for i, (a, b) in enumerate(zip(got, want)):
        assert _max_rel(a, b) <= 1e-5, (i, _max_rel(a, b))


def test_grouped_tma_host_checks(monkeypatch):
    """tma=True raises where descriptors cannot be made; tma=None (the flag) falls back to the pointer kernel."""
    offsets = gg.offsets_of([3, 4], "cpu")
    x = torch.randn(7, 40, generator=_gen(1))
    w_t = torch.randn(2, 40, 24, generator=_gen(2)).transpose(1, 2)  # (E, N, K) with K not the unit stride
    with pytest.raises(ValueError, match="unit stride"):
        gg.grouped_fwd(x, w_t, None, offsets, tma=True)
    x37, w37 = torch.randn(7, 37, generator=_gen(1)), torch.randn(2, 24, 37, generator=_gen(2))  # 148-byte rows
    with pytest.raises(ValueError, match="16-byte"):
        gg.grouped_fwd(x37, w37, None, offsets, tma=True)
    with pytest.raises(ValueError, match="16-byte multiples"):  # aligned operands, but (R, 3) fp32 output rows
        gg.grouped_fwd(x, torch.randn(2, 3, 40, generator=_gen(3)), None, offsets, tma=True)
    monkeypatch.setattr(gg, "TMA", True)
    monkeypatch.setattr(gg, "_launch_mm_tma", None)  # never reached: the flag falls back
    want = gg.grouped_linear_ref(x37.double(), w37.double(), None, offsets)
    assert _max_rel(gg.grouped_fwd(x37, w37, None, offsets)[0], want) <= 1e-5
    assert gg.tma_supported("cpu")[0]  # the interpreter emulates TMA
    monkeypatch.setattr(gg, "_INTERPRET", False)
    ok, why = gg.tma_supported("cpu")
    assert not ok and "CUDA" in why
    assert gg._use_tma(None, x, w_t, 24) is False


# ----------------------------------------------------------------------------------------------------------------
# the MoE block against the per-expert loop


def _block(seed=0, **kw):
    cfg = MoEConfig(**{**dict(n_embd=24, n_layer=2, moe_experts=5, moe_top_k=2), **kw})
    torch.manual_seed(seed)
    m = MoEMLP(cfg)
    with torch.no_grad():  # nonzero biases and a sharper router than the init, so every term is exercised
        for lin in (m.experts.c_fc, m.experts.c_proj):
            if lin.bias is not None:
                lin.bias.normal_(std=0.3)
        m.router.weight.normal_(std=0.5)
    return m


def _fwd_bwd(m, x, impl):
    m = copy.deepcopy(m)
    m.impl = impl
    xl = _leaf(x)
    y = m(xl)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=y.device).view_as(y)).sum().backward()
    return [y.detach(), xl.grad] + [p.grad for p in m.parameters()], m.stats


BLOCKS = {  # name: MoEConfig overrides (+ a nonzero balancing bias where moe_bias_rate > 0)
    "softmax_top2_dropless": dict(),
    "sigmoid_top2_capacity_bias": dict(moe_score="sigmoid", moe_capacity=0.8, moe_bias_rate=0.01),
    "switch_top1_capacity": dict(moe_top_k=1, moe_renorm=False, moe_capacity=1.0, moe_aux_coef=0.1),
    "top3_of_4_no_bias": dict(moe_experts=4, moe_top_k=3, bias=False, moe_z_coef=0.0),
}


@pytest.mark.parametrize("impl", ["sorted", "grouped_mm", "triton"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_moe_block_matches_loop_reference(name, impl):
    m = _block(**BLOCKS[name])
    if m.bias_rate > 0:
        m.expert_bias.copy_(0.2 * torch.randn(m.n_experts, generator=_gen(7)))
    x = torch.randn(3, 13, 24, generator=_gen(8))
    want, want_stats = _fwd_bwd(copy.deepcopy(m).double(), x.double(), "loop")
    got, got_stats = _fwd_bwd(m, x, impl)
    for i, (a, b) in enumerate(zip(got, want)):  # y, dx, d router, d c_fc w/b, d c_proj w/b (aux grads included)
        assert _max_rel(a, b) <= 1e-5, (i, _max_rel(a, b))
    for key in want_stats:
        torch.testing.assert_close(got_stats[key].double(), want_stats[key].double(), rtol=1e-5, atol=1e-6)
    if m.capacity_factor > 0:
        assert got_stats["drop"] > 0  # the capacity bites at these sizes


# ----------------------------------------------------------------------------------------------------------------
# aux losses, capacity, balancing bias


# softmax probabilities of 4 tokens over 3 experts; top-1 picks experts 0, 1, 2, 0; top-2 picks {0,1} {1,2} {2,0}
# (a tie at 0.2: the lower id) {0,1}
P = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6], [0.7, 0.2, 0.1]], dtype=torch.float64)
SHIFT = torch.tensor([0.0, 1.0, -2.0, 0.5], dtype=torch.float64)  # logits = log P + shift: logsumexp = shift


def _fixed_block(k, **kw):
    """A block whose router gives logits log P + shift for the 4 tokens x = identity rows."""
    m = MoEMLP(MoEConfig(n_embd=4, n_layer=1, moe_experts=3, moe_top_k=k, **kw)).double()
    logits = P.log() + SHIFT[:, None]
    with torch.no_grad():
        m.router.weight.copy_(logits.t())  # (E, C) = (3, 4): x = I gives logits
    return m, torch.eye(4, dtype=torch.float64)


@pytest.mark.parametrize("k,counts", [(1, [2, 1, 1]), (2, [3, 3, 2])])
def test_aux_losses_on_fixed_numbers(k, counts):
    m, x = _fixed_block(k, moe_aux_coef=0.01, moe_z_coef=0.001)
    m(x)
    f = torch.tensor(counts, dtype=torch.float64) / (4 * k)
    Pm = P.mean(0)  # 0.375, 0.325, 0.3
    lb = 3 * (f * Pm).sum().item()  # k=1: 3 * (0.5*0.375 + 0.25*0.325 + 0.25*0.3) = 1.03125; k=2: 1.0125
    assert lb == pytest.approx(1.03125 if k == 1 else 1.0125)
    z = (SHIFT ** 2).mean().item()  # 1.3125
    s = m.stats
    assert s["aux"].item() == pytest.approx(lb) and s["z"].item() == pytest.approx(z)
    assert m.aux_loss.item() == pytest.approx(0.01 * lb + 0.001 * z)
    assert s["drop"].item() == 0
    mean = 4 * k / 3
    assert s["load_min"].item() == pytest.approx(min(counts) / mean)
    assert s["load_max"].item() == pytest.approx(max(counts) / mean)


def test_sigmoid_balance_loss_normalises_scores():
    z = torch.tensor([[0.0, 1.0, -1.0], [2.0, 0.0, 0.0]], dtype=torch.float64)
    s = z.sigmoid()
    p = s / s.sum(-1, keepdim=True)
    counts = torch.tensor([1, 2, 1])
    want = 3 * (counts / 4.0 * p.mean(0)).sum()
    assert load_balance_loss(z, counts, 2, "sigmoid").item() == pytest.approx(want.item())
    assert z_loss(z).item() == pytest.approx(torch.logsumexp(z, -1).pow(2).mean().item())


def test_aux_loss_gradient_reaches_the_router_through_the_output():
    """With no gradient from the output itself, the router's gradient is exactly aux_grad_scale * d(aux)/dW."""
    m, x = _fixed_block(2, moe_aux_coef=0.5, moe_z_coef=0.25)
    w = m.router.weight
    logits = x @ w.t()
    aux = 0.5 * load_balance_loss(logits, torch.tensor([3, 3, 2]), 2) + 0.25 * z_loss(logits)
    want = torch.autograd.grad(aux, w)[0]
    set_aux_grad_scale(m, 0.25)
    y = m(x)
    y.backward(torch.zeros_like(y))
    torch.testing.assert_close(w.grad, 0.25 * want)


def test_capacity_keeps_first_choices_before_second_choices():
    """E = 2, k = 2 (every token picks both experts), capacity ceil(0.5 * 4 * 2 / 2) = 2. Tokens 0, 1 prefer
    expert 1 and tokens 2, 3 expert 0: in token order expert 0 would keep tokens 0, 1 (their second choices); the
    first-choice priority keeps tokens 2, 3. So every first choice is kept and every second choice dropped."""
    z = torch.tensor([[0.0, 1.0], [0.0, 2.0], [1.0, 0.0], [3.0, 0.0]])
    for fn in (route_ref, route_triton):
        r = fn(z, 2, capacity=2)
        assert (r.dest[:, 0] >= 0).all() and (r.dest[:, 1] == -1).all(), fn.__name__
        assert r.counts.tolist() == [4, 4] and r.offsets.tolist() == [0, 2, 4]
    m = _block(moe_experts=2, moe_top_k=2, moe_capacity=0.5)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[:, 0] = torch.tensor([-1.0, 1.0])  # x[:, 0] > 0 prefers expert 1
    x = torch.randn(4, 24, generator=_gen(3))
    x[:, 0] = torch.tensor([5.0, 5.0, -5.0, -5.0])
    y = m(x)
    assert m.stats["drop"].item() == 0.5
    g = gate_weights(m.router_logits(x), torch.tensor([[1, 0], [1, 0], [0, 1], [0, 1]]))
    first = [1, 1, 0, 0]
    want = torch.stack([g[t, 0] * m.experts.mlp(first[t], x[t:t + 1])[0] for t in range(4)])
    torch.testing.assert_close(y, want)


def test_expert_bias_steers_selection_and_updates_by_sign():
    m = _block(moe_experts=4, moe_top_k=1, moe_renorm=False, moe_bias_rate=0.1)
    x = torch.randn(2, 9, 24, generator=_gen(4))
    m.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # expert 3 wins every selection...
    y = m(x)
    assert m.load.tolist() == [0, 0, 0, 18]
    # ...but the gate is expert 3's unbiased probability
    logits = m.router_logits(x.reshape(-1, 24))
    g = logits.softmax(-1)[:, 3:4]
    want = g * m.experts.mlp(3, x.reshape(-1, 24))
    torch.testing.assert_close(y.reshape(-1, 24), want)
    calls = []

    def fake_all_reduce(t):  # two replicas with the same loads
        calls.append(t.clone())
        t.mul_(2)

    update_expert_bias(m, fake_all_reduce)
    assert len(calls) == 1 and calls[0].tolist() == [0, 0, 0, 18]
    torch.testing.assert_close(m.expert_bias, torch.tensor([0.1, 0.1, 0.1, 9.9]))  # sign(mean - load) * 0.1
    assert m.load.sum() == 0
    m.eval()
    m(x)
    assert m.load.sum() == 0  # eval forwards do not count


def test_top1_gate_scales():
    """moe_renorm=False at k = 1: the gate is the chosen expert's score, softmax s_e (~1/E at init) or sigmoid
    sigma(z_e) (~1/2); renormalised, it is 1 whatever the router says."""
    z = torch.randn(6, 8, generator=_gen(11))
    idx = z.argmax(-1, keepdim=True)
    torch.testing.assert_close(gate_weights(z, idx, "sigmoid", False), z.gather(1, idx).sigmoid())
    torch.testing.assert_close(gate_weights(z, idx, "softmax", False), z.softmax(-1).gather(1, idx))
    assert torch.equal(gate_weights(z, idx, "sigmoid", True), torch.ones(6, 1))
    MoEConfig(moe_top_k=1, moe_score="sigmoid", moe_renorm=False)  # a valid layout (Llama 4's top-1 gate)


def test_config_checks():
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(moe_experts=4, moe_top_k=5)
    with pytest.raises(ValueError, match="moe_score"):
        MoEConfig(moe_score="relu")
    with pytest.raises(ValueError, match="moe_capacity"):
        MoEConfig(moe_capacity=-1.0)
    with pytest.raises(ValueError, match="moe_impl"):
        MoEConfig(moe_impl="cuda")


# ----------------------------------------------------------------------------------------------------------------
# a tiny GPT with MoE MLPs trains


def _tiny_moe_gpt(every=1, **kw):
    from nanopara.config import ModelConfig
    from nanopara.model import GPT
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=97, vocab_multiple=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    moe_cfg = MoEConfig(n_embd=32, n_layer=2, **{**dict(moe_experts=4, moe_top_k=2), **kw})
    for i, block in enumerate(model.transformer.h):
        if i % every == 0:
            block.mlp = MoEMLP(moe_cfg)
    model.reset_parameters()  # GPT-2's init by name reaches the expert weights (experts.c_proj.weight scaled)
    return model


def test_tiny_gpt_with_moe_mlp_trains():
    model = _tiny_moe_gpt(moe_bias_rate=1e-3)
    layers = moe_layers(model)
    assert len(layers) == 2
    proj = layers[0].experts.c_proj.weight
    assert abs(proj.std().item() - 0.02 / math.sqrt(4)) < 0.002
    idx = torch.randint(0, 97, (4, 16), generator=_gen(5))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        update_expert_bias(model)
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses
    stats = collect_stats(model)
    assert set(stats) == {"moe_aux", "moe_z", "moe_drop", "moe_load_min", "moe_load_max"}
    assert stats["moe_drop"] == 0 and stats["moe_load_min"] <= 1 <= stats["moe_load_max"]
    assert any(m.expert_bias.abs().sum() > 0 for m in layers)
    expert_params = sum(p.numel() for p in layers[0].experts.parameters())
    assert active_params(model) == sum(p.numel() for p in model.parameters()) - 2 * expert_params // 2


def test_tiny_gpt_triton_moe_path_matches_sorted():
    """The whole model, one step: the Triton MoE path (interpreter) gives the loss and grads of the PyTorch one."""
    results = []
    for impl in ("sorted", "triton"):
        model = _tiny_moe_gpt(every=2, moe_capacity=1.0, moe_impl=impl)
        idx = torch.randint(0, 97, (2, 16), generator=_gen(6))
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for n in g0:  # fp32, different summation orders
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)


def test_bench_moe_smoke(tmp_path):
    """bench/bench_moe.py end to end on CPU (interpreter, tiny shapes): a broken benchmark wastes a GPU call."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_moe
    out = tmp_path / "moe.jsonl"
    rows = bench_moe.main(["--smoke", "--out", str(out)])
    sections = {r["section"] for r in rows}
    assert sections == {"parity", "gemm", "moves", "layer"}
    assert len(out.read_text().splitlines()) == len(rows)
    parity = {r["impl"]: r for r in rows if r["section"] == "parity"}
    assert parity["triton"]["y"] < 1e-5 and parity["triton"]["dx"] < 1e-5  # fp32 on CPU
    gemm = {(r["op"], r["impl"]) for r in rows if r["section"] == "gemm" and "ms" in r}
    assert {(op, impl) for op in ("fwd", "dgrad", "wgrad") for impl in ("triton", "triton_tma")} <= gemm
    layer = {r["impl"] for r in rows if r["section"] == "layer" and "ms" in r}
    assert {"loop", "sorted", "grouped_mm", "triton", "grouped_mlp_only"} <= layer


@pytest.mark.timeout_s(60)
def test_bench_moe_step_smoke(tmp_path):
    """bench_moe.py's step section (train.py's step, eager vs CUDA graph): on CPU the eager rows only."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_moe
    rows = bench_moe.main(["--smoke", "--sections=step", "--step-steps=1", "--step-warmup=1", "--step-profile",
                           "--step-optimizers=torch,flat", "--out", str(tmp_path / "step.jsonl")])
    assert [(r["capacity"], r["mode"], r["optimizer"]) for r in rows] == [
        (1.0, "eager", "torch"), (1.0, "eager", "flat"), (0.0, "eager", "torch"), (0.0, "eager", "flat")]
    assert all(r["tokens_per_s"] > 0 and math.isfinite(r["loss_last"]) for r in rows)
    assert rows[0]["loss_last"] == pytest.approx(rows[1]["loss_last"], rel=1e-5)  # the same step either way
    assert all(r["kernels"] > 0 and r["kernel_ms_by_kind"] for r in rows)  # --step-profile: the step's kinds


# ----------------------------------------------------------------------------------------------------------------
# GPU: bf16 at the model's width


@pytest.mark.gpu
@pytest.mark.parametrize("skew", ["balanced", "skewed", "one"])
def test_grouped_mlp_bf16_error_within_twice_torch(skew):
    """bf16 grouped MLP at C = 768, E = 8 (one group holding everything included) vs an fp32 reference: error at
    most 2x PyTorch's per-group bf16 matmuls (+ a small floor)."""
    E, C, H, R = 8, 768, 3072, 8192
    offsets = gg.offsets_of(gg.group_sizes(R - 5, E, skew), "cuda")
    used = R - 5
    x = torch.randn(R, C, generator=_gen(1)).cuda()
    params = [None if p is None else p.cuda() * 0.1 for p in _mlp_params(E, C, H, True)]
    dy = torch.randn(R, C, generator=_gen(2)).cuda()
    ref = _run_mlp(gg.grouped_mlp_ref, x, params, offsets, dy, used)
    got = _run_mlp(gg.grouped_mlp_triton, x.bfloat16(), params, offsets, dy, used)
    base = _run_mlp(gg.grouped_mlp_ref, x.bfloat16(), [p.bfloat16() for p in params], offsets, dy, used)
    for i, (a, b, r) in enumerate(zip(got, base, ref)):
        assert _max_rel(a.float(), r) <= 2 * _max_rel(b.float(), r) + 1e-3, (i, _max_rel(a.float(), r))


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", [0.0, 1.0])
def test_triton_moe_bf16_error_within_twice_torch(capacity):
    """Triton MoE under bf16 autocast vs the loop in fp32: its error is at most 2x the PyTorch sorted path's bf16
    error (+ a small floor)."""
    cfg = MoEConfig(n_embd=768, moe_experts=8, moe_top_k=2, moe_capacity=capacity)
    torch.manual_seed(0)
    m = MoEMLP(cfg).cuda()
    x = torch.randn(4, 1024, 768, device="cuda")
    ref, _ = _fwd_bwd(m, x, "loop")
    errs = {}
    for impl in ("sorted", "triton"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got, _ = _fwd_bwd(m, x, impl)
        errs[impl] = [_max_rel(a.float(), b.double()) for a, b in zip(got, ref)]
    for i, (e_t, e_s) in enumerate(zip(errs["triton"], errs["sorted"])):
        assert e_t <= 2 * e_s + 1e-3, (i, errs)


@pytest.mark.gpu
def test_grouped_tma_bf16_matches_pointer_kernel():
    """The TMA kernel against the pointer kernel and an fp32 reference in bf16 at c_fc's shape (N = 3072,
    K = 768; dgrad: 768 x 3072), E = 8 with empty groups and partial tiles: fwd (bias, GELU) and dgrad (GELU')."""
    if not gg.tma_supported(torch.device("cuda"))[0]:
        pytest.skip(gg.tma_supported(torch.device("cuda"))[1])
    sizes = [1500, 0, 1001, 3, 0, 900, 599, 90]  # 4093 rows: 3 unused buffer rows
    E, N, K, R, used = 8, 3072, 768, 4096, sum(sizes)
    offsets = gg.offsets_of(sizes, "cuda")
    x = torch.randn(R, K, generator=_gen(1)).cuda().bfloat16()
    w = (torch.randn(E, N, K, generator=_gen(2)) / K ** 0.5).cuda().bfloat16()
    b = (0.1 * torch.randn(E, N, generator=_gen(3))).cuda().bfloat16()
    w2 = w.transpose(1, 2).contiguous()  # (E, K, N): c_proj's weight, whose dgrad meets c_fc's GELU'
    dy = torch.randn(R, K, generator=_gen(4)).cuda().bfloat16()
    g_t, h_t = gg.grouped_fwd(x, w, b, offsets, gelu=True, tma=True)
    g_p, h_p = gg.grouped_fwd(x, w, b, offsets, gelu=True, tma=False)
    h_ref = gg.grouped_linear_ref(x.float(), w.float(), b.float(), offsets)[:used]
    p = h_p[:used].float().requires_grad_()
    g_ref = torch.nn.functional.gelu(p, approximate="tanh")
    slope, = torch.autograd.grad(g_ref.sum(), p)
    dx_ref = gg.grouped_linear_ref(dy.float(), w2.float().transpose(1, 2), None, offsets)[:used] * slope
    dx_t = gg.grouped_dgrad(dy, w2, offsets, pre=h_p, tma=True)
    dx_p = gg.grouped_dgrad(dy, w2, offsets, pre=h_p, tma=False)
    for name, got, ptr, ref in (("h", h_t, h_p, h_ref), ("g", g_t, g_p, g_ref.detach()), ("dx", dx_t, dx_p, dx_ref)):
        e_t, e_p = _max_rel(got[:used].float(), ref.double()), _max_rel(ptr[:used].float(), ref.double())
        assert e_t <= 2 * e_p + 1e-3, (name, e_t, e_p)
        assert _max_rel(got[:used].float(), ptr[:used].double()) <= 1e-2, name


@pytest.mark.parametrize("sizes,out_dtype", [([5, 0, 20, 1, 11], None), ([16, 1, 0, 32], torch.float32)])
def test_grouped_wgrad_tma_bias_on_tensor_cores(monkeypatch, sizes, out_dtype):
    """WGRAD_DB_MMA: db as dy^T @ (ones in the first column) on the tensor cores, fp16 operands: the same dw, and db
    equal to the CUDA-core sums to fp32 rounding (fp32 out) or fp16's (fp16 out), partial and empty groups included."""
    E, K, N = len(sizes), 40, 24
    offsets = gg.offsets_of(sizes, "cpu")
    used = sum(sizes)
    x = torch.randn(used + 3, K, generator=_gen(1)).half()
    dy = torch.randn(used + 3, N, generator=_gen(4)).half()
    x[used:], dy[used:] = 1e4, 1e4  # unused buffer rows: never read
    monkeypatch.setattr(gg, "WGRAD_DB_MMA", False)
    dw_sum, db_sum = gg.grouped_wgrad(dy, x, offsets, dtype=out_dtype, tma=True)
    monkeypatch.setattr(gg, "WGRAD_DB_MMA", True)
    dw_mma, db_mma = gg.grouped_wgrad(dy, x, offsets, dtype=out_dtype, tma=True)
    _, db_ref = _wgrad_ref(dy, x, offsets)
    assert torch.equal(dw_mma, dw_sum)
    assert (db_mma[[e for e, n in enumerate(sizes) if n == 0]] == 0).all()
    tol = 1e-5 if out_dtype == torch.float32 else 5e-3
    assert _max_rel(db_mma, db_ref) <= tol and _max_rel(db_mma, db_sum.double()) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("db_mma", [False, True])
def test_grouped_wgrad_tma_bf16_matches_pointer_kernel(monkeypatch, db_mma):
    """The TMA weight gradient against the pointer kernel and an fp32 reference in bf16 at c_fc's shape (dw
    (8, 3072, 768)), with empty groups, a 3-row group, partial row tiles and 3 unused buffer rows (filled with
    large values): bf16 dw / db, and fp32 dw / db (fp32 master weights); db on the CUDA or the tensor cores."""
    monkeypatch.setattr(gg, "WGRAD_DB_MMA", db_mma)
    if not gg.tma_supported(torch.device("cuda"))[0]:
        pytest.skip(gg.tma_supported(torch.device("cuda"))[1])
    sizes = [1500, 0, 1001, 3, 0, 900, 599, 90]
    E, N, K, R, used = 8, 3072, 768, 4096, sum(sizes)
    offsets = gg.offsets_of(sizes, "cuda")
    x = torch.randn(R, K, generator=_gen(1)).cuda().bfloat16()
    dy = (0.1 * torch.randn(R, N, generator=_gen(4))).cuda().bfloat16()
    x[used:], dy[used:] = 1e4, 1e4
    dw_ref, db_ref = _wgrad_ref(dy, x, offsets)  # float64 on the GPU
    for dtype in (torch.bfloat16, torch.float32):
        dw_t, db_t = gg.grouped_wgrad(dy, x, offsets, dtype=dtype, tma=True)
        dw_p, db_p = gg.grouped_wgrad(dy, x, offsets, dtype=dtype, tma=False)
        assert dw_t.dtype == db_t.dtype == dtype
        assert (dw_t[[1, 4]] == 0).all() and (db_t[[1, 4]] == 0).all()
        for name, got, ptr, ref in (("dw", dw_t, dw_p, dw_ref), ("db", db_t, db_p, db_ref)):
            e_t, e_p = _max_rel(got.float(), ref), _max_rel(ptr.float(), ref)
            assert e_t <= 2 * e_p + 1e-3, (name, dtype, e_t, e_p)
            assert _max_rel(got.float(), ptr.double()) <= 1e-2, (name, dtype)
