"""The FP8 MLP with GELU folded into the casts: kernels/fp8_prologue.py, the prologue of kernels/fp8_quant.py's
per-tensor kernels, nanopara/fp8.py's FP8MLPFunction and its dispatch (model.TorchOps.mlp, recompute.py).

CPU, interpreter (TRITON_INTERPRET=1), small awkward shapes (M = 70 tokens, C = 48, H = 200):
  GELU math     gelu and gelu' in fp32 against PyTorch's approximate="tanh" and float64, every finite bf16 input;
                the Triton functions bit-exact against their torch references (the same operations, SOFT exp)
  kernels       amax + cast with the prologue bit-exact against fp8_quantize_ref of the reference's fp32 values:
                q, q^T, scale, amax (delayed and not); column sums up to summation order
  FP8 MLP       y, dx, dW1, db1, dW2, db2 against the unfused FP8 path (c_proj(F.gelu(c_fc(x)))): equal up to
                summation order in fp32; under bf16 autocast within what rounding g and dh to bf16 moves (TOL_BF16);
                histories, the weight cast, the engine's gradient destinations, fallbacks, selective checkpointing
  tiny GPT      a few steps fused vs unfused give near-equal losses
GPU (`-m gpu`): fused vs unfused at gpt_1b's MLP (M = 8192, 2048 -> 8192 -> 2048).
"""
import copy
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import fp8_prologue as fp
from kernels.fp8_quant import E4M3, E5M2, fp8_quantize, fp8_quantize_ref
from nanopara.config import ModelConfig
from nanopara.fp8 import FP8Linear, FP8MLPFunction, FP8Recipe, apply_fp8, attach_fp8
from nanopara.model import GPT, Linear, TorchOps
from nanopara.recompute import apply_activation_checkpointing

M_TOK, C, H = 70, 48, 200
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# fused vs unfused FP8 MLP, relative Frobenius difference. fp32 (no autocast): g and dh are fp32 on both paths, the
# only differences are gelu's last bits (none moved an fp8 rounding here: measured 0) and db1's summation order
# (1.2e-7). bf16 autocast: the unfused path rounds g and dh to bf16 before quantizing, which moves ~1-2 % of the fp8
# roundings by one e4m3/e5m2 step; measured max over 8 inputs (M=70, C=48, H=200): y 1.8e-2, dx 2.5e-2, dW1 2.6e-2,
# db1 1.9e-3, dW2 1.6e-2, db2 0 (dY is the same on both paths). Tolerances ~1.5x that. Against an fp32 MLP without
# FP8 both paths err the same (5-9 %; fused / unfused <= 1.014 measured): fused must not be worse than 1.05x.
TOL_FP32 = 1e-5
TOL_BF16 = {"y": 0.027, "dx": 0.038, "dw1": 0.039, "db1": 0.003, "dw2": 0.024, "db2": 1e-6}
NO_WORSE = 1.05
NAMES = ("y", "dx", "dw1", "db1", "dw2", "db2")


def _rel(a, b):
    b = b.float()
    return ((a.float() - b).norm() / b.norm().clamp_min(1e-30)).item()


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _bf16_normals():
    """Every bf16 value but the subnormals (the interpreter upcasts bf16 subnormals wrongly: 2.76e-40 -> 5.9e-39),
    NaNs and infinities."""
    h = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    a = h.float().abs()
    return h[torch.isfinite(a) & ((a == 0) | (a >= torch.finfo(torch.bfloat16).tiny))]


# ---------------------------------------------------------------------------------------------------------------
# GELU math

def test_gelu_math_matches_pytorch_on_every_bf16_value():
    """gelu_tanh_ref / gelu_tanh_grad_ref (the kernels' math) against float64 and against PyTorch's fp32 GELU tanh
    and its backward, on every finite bf16 h. Measured: gelu within 12.75 x 2^-24 relative of float64 where
    |gelu| > 1e-3 (PyTorch: 650 x, its 1 + tanh(u) cancels for u << 0), at most 4.8e-7 from PyTorch's; gelu'
    within 1.5e-7 of float64 (PyTorch: 1.0e-6), 1.1e-6 from PyTorch's; finite everywhere (PyTorch's gelu' is NaN
    from |h| ~ 1.8e19: 0 * inf)."""
    h = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = h.float()[torch.isfinite(h.float())]
    ours, ours_d = fp.gelu_tanh_ref(x), fp.gelu_tanh_grad_ref(x)
    xr = x.clone().requires_grad_()
    torch_y = F.gelu(xr, approximate="tanh")
    torch_y.backward(torch.ones_like(xr))
    x64 = x.double().requires_grad_()
    y64 = 0.5 * x64 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    y64.backward(torch.ones_like(x64))
    assert torch.isfinite(ours).all() and torch.isfinite(ours_d).all()
    big = y64.abs() > 1e-3
    assert ((ours.double() - y64).abs() / y64.abs())[big].max() < 16 * 2.0 ** -24
    assert (ours - torch_y.detach()).abs().max() < 1e-6
    ok = torch.isfinite(x64.grad)
    assert (ours_d.double() - x64.grad)[ok].abs().max() < 3e-7
    ok = torch.isfinite(xr.grad)
    assert (ours_d - xr.grad)[ok].abs().max() < 2e-6
    assert ours[x.abs() > 20].eq(torch.where(x[x.abs() > 20] > 0, x[x.abs() > 20], 0.0)).all()  # the tails exactly


def test_triton_gelu_bit_exact_against_reference():
    """The @jit gelu_tanh / gelu_tanh_grad (SOFT exp, as under the interpreter) give the torch references' bits on
    every bf16 value but subnormals, NaN and inf."""
    import triton
    import triton.language as tl

    @triton.jit
    def _k(X, Y, G, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + offs, fp.gelu_tanh(x, True), mask=m)
        tl.store(G + offs, fp.gelu_tanh_grad(x, True), mask=m)
    h = _bf16_normals()
    y, g = torch.empty(h.numel()), torch.empty(h.numel())
    _k[(triton.cdiv(h.numel(), 8192),)](h, y, g, h.numel(), BLOCK=8192)
    assert torch.equal(_bits(y), _bits(fp.gelu_tanh_ref(h)))
    assert torch.equal(_bits(g), _bits(fp.gelu_tanh_grad_ref(h)))


# ---------------------------------------------------------------------------------------------------------------
# the amax and cast kernels with a prologue

def _mlp_data(M=M_TOK, N=H, seed=0):
    """h: a c_fc output (bias-shifted Gaussian, bf16) with zeros, a NaN and a few large values; dg: c_proj's dgrad."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, N, generator=g) * 2 + torch.randn(N, generator=g)
    dg = torch.randn(M, N, generator=g) * torch.logspace(-2, 1, N)[torch.randperm(N, generator=g)]
    if M > 9 and N > 11:
        h[3, :5] = torch.tensor([0.0, -0.0, 40.0, -40.0, -5.0])
        h[7, 11] = dg[9, 4] = float("nan")
    return h.to(torch.bfloat16), dg.to(torch.bfloat16)


@pytest.mark.parametrize("prologue,dtype,pow2,delayed", [
    ("gelu_tanh", E4M3, True, False),        # the forward: g = gelu(h) for c_proj's X
    ("gelu_tanh", E4M3, False, True),        # delayed: one pass, the given amax saturates, the new one recorded
    ("gelu_tanh_bwd", E5M2, True, False),    # the backward: dh = dg * gelu'(h) for c_fc's dY, with db's sums
    ("gelu_tanh_bwd", E4M3, False, True),
])
@pytest.mark.parametrize("shape", [(M_TOK, H), (5, 7)])
def test_prologue_casts_bit_exact(prologue, dtype, pow2, delayed, shape):
    h, dg = _mlp_data(*shape)
    x, kw = (h, {}) if prologue == "gelu_tanh" else (dg, {"h": h})
    v = fp.prologue_ref(x, prologue, kw.get("h"))  # fp32: gelu(h) or dg * gelu'(h)
    amax = torch.tensor([v.nan_to_num(0).abs().max().item() / 3]) if delayed else None
    got = fp8_quantize(x, dtype, "tensor", pow2, transpose=True, amax=amax, triton_path=True, colsum=True,
                       prologue=prologue, **kw)
    q, s, own = fp8_quantize_ref(v, dtype, None, pow2, amax)
    for name, a, b in (("q", got.q, q), ("qt", got.qt, q.t()), ("s", got.s, s), ("st", got.st, s),
                       ("amax", got.amax, own)):
        assert torch.equal(_bits(a.contiguous()), _bits(b.contiguous())), name
    want_sum = v.sum(0, dtype=torch.float32)
    torch.testing.assert_close(got.colsum, want_sum, rtol=1e-5, atol=1e-6 * max(1.0, v.nan_to_num(0).abs().max()),
                               equal_nan=True)
    # fp8_quantize's reference path is the same math
    ref = fp8_quantize(x, dtype, "tensor", pow2, transpose=True, amax=amax, colsum=True, prologue=prologue, **kw)
    assert torch.equal(_bits(ref.q), _bits(got.q)) and torch.equal(ref.s, got.s)


def test_prologue_checks():
    h, dg = _mlp_data(8, 16)
    with pytest.raises(ValueError, match="prologue must be one of"):
        fp8_quantize(h, prologue="relu", triton_path=True)
    with pytest.raises(ValueError, match="needs h of x's shape"):
        fp8_quantize(dg, prologue="gelu_tanh_bwd", triton_path=True)
    with pytest.raises(ValueError, match="needs h of x's shape"):
        fp8_quantize(dg, prologue="gelu_tanh_bwd", h=h[:, :8])
    with pytest.raises(ValueError, match="per tensor only"):
        fp8_quantize(h, granularity="1x128", prologue="gelu_tanh")
    # h with other strides than dg: read as a contiguous copy, same bytes
    ht = h.t().contiguous().t()
    a = fp8_quantize(dg, E5M2, prologue="gelu_tanh_bwd", h=ht, triton_path=True)
    b = fp8_quantize(dg, E5M2, prologue="gelu_tanh_bwd", h=h, triton_path=True)
    assert torch.equal(_bits(a.q), _bits(b.q))


# ---------------------------------------------------------------------------------------------------------------
# the FP8 MLP: fused against unfused

class _MLP(nn.Module):
    def __init__(self, c=C, hidden=H):
        super().__init__()
        self.c_fc, self.c_proj = Linear(c, hidden), Linear(hidden, c)

    def forward(self, x):
        return TorchOps.mlp(x, self.c_fc, self.c_proj)


def _base(seed=0, c=C, hidden=H):
    torch.manual_seed(seed)
    m = _MLP(c, hidden)
    with torch.no_grad():  # biases as trained ones are: not zero
        m.c_fc.bias.normal_(0, 0.5)
        m.c_proj.bias.normal_(0, 0.1)
    return m


def _fwd_bwd(m, x, dy, fused, autocast):
    """(y, dx, dW1, db1, dW2, db2) of one fwd+bwd; fused=False runs the three ops (the path before the fusion)."""
    x = x.clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = m(x) if fused else m.c_proj(F.gelu(m.c_fc(x), approximate="tanh"))
    y.backward(dy)
    return [y.detach(), x.grad, m.c_fc.weight.grad, m.c_fc.bias.grad, m.c_proj.weight.grad, m.c_proj.bias.grad]


def _inputs(seed, M=M_TOK, c=C, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(M, c, generator=g, device=device), torch.randn(M, c, generator=g, device=device)


@pytest.fixture
def calls(monkeypatch):
    """How many times FP8MLPFunction ran."""
    n = [0]
    apply = FP8MLPFunction.apply

    def counted(*args):
        n[0] += 1
        return apply(*args)
    monkeypatch.setattr(FP8MLPFunction, "apply", counted)
    return n


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_mlp_matches_unfused(autocast, calls):
    base = _base()
    x, dy = _inputs(1)
    fused = apply_fp8(copy.deepcopy(base), "tensor", interpret=True)
    got = _fwd_bwd(fused, x, dy, True, autocast)
    assert calls[0] == 1
    want = _fwd_bwd(apply_fp8(copy.deepcopy(base), "tensor", interpret=True), x, dy, False, autocast)
    assert calls[0] == 1  # the three ops: no fused call
    exact = _fwd_bwd(copy.deepcopy(base), x, dy, False, False)
    for name, g, w, e in zip(NAMES, got, want, exact):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        tol = TOL_BF16[name] if autocast else TOL_FP32
        assert _rel(g, w) <= tol, f"{name}: fused vs unfused {_rel(g, w):.2e} > {tol}"
        assert _rel(g, e) <= NO_WORSE * _rel(w, e) + 1e-6, f"{name}: fused {_rel(g, e):.3e} vs {_rel(w, e):.3e}"
    assert got[0].dtype == (torch.bfloat16 if autocast else torch.float32) and got[1].dtype == torch.float32
    assert fused.fp8.casts == 2  # each weight cast once


def test_fused_mlp_saves_no_more_than_unfused():
    """What the backward keeps: X^T, h, g^T and both W^T, as the three ops keep between them (h by F.gelu); 3-D
    input (B, T, C) in, (B, T, C) out."""
    base = _base()
    x = torch.randn(2, 35, C, requires_grad=True)

    def saved_bytes(fused):
        m = apply_fp8(copy.deepcopy(base), "tensor", interpret=True)
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = m(x) if fused else m.c_proj(F.gelu(m.c_fc(x), approximate="tanh"))
        y.float().sum().backward()
        assert y.shape == x.shape and x.grad.shape == x.shape
        x.grad = None
        return sum(sizes)
    assert saved_bytes(True) <= saved_bytes(False)


def test_delayed_histories_advance_like_unfused():
    """Per Linear and step the same pushes, into the same in-place buffers (CUDA-graph replays advance them): x and
    dy of c_fc and c_proj; the values of c_proj's x (g) and c_fc's dy (dh) differ by g's and dh's bf16 rounding."""
    base = _base(0, 32, 80)  # smaller than elsewhere: 6 fwd+bwd
    recipe = FP8Recipe(delayed=True, history=3)
    fused = apply_fp8(copy.deepcopy(base), "tensor", recipe=recipe, interpret=True)
    plain = apply_fp8(copy.deepcopy(base), "tensor", recipe=recipe, interpret=True)
    ptrs = None
    for step, k in enumerate((1.0, 3.0, 0.5)):
        x, dy = _inputs(step, 37, 32)
        _fwd_bwd(fused, x * k, dy, True, True)
        _fwd_bwd(plain, x * k, dy, False, True)
        hists = [(lin, key, getattr(getattr(m, lin), f"hist_{key}")) for m in (fused, plain)
                 for lin in ("c_fc", "c_proj") for key in ("x", "dy")]
        if ptrs is None:
            ptrs = [h.buf.data_ptr() for _, _, h in hists]
        assert [h.buf.data_ptr() for _, _, h in hists] == ptrs, step
        for (lin, key, a), (_, _, b) in zip(hists[:4], hists[4:]):
            exact = (lin, key) in (("c_fc", "x"), ("c_proj", "dy"))
            torch.testing.assert_close(a.buf, b.buf, rtol=0 if exact else 2.0 ** -7, atol=0,
                                       msg=lambda m, lin=lin, key=key: f"step {step} {lin}.{key}: {m}")
        assert fused.c_fc.hist_x.buf[0] == (x * k).abs().max()  # newest first


def test_grad_into_both_weights_and_frozen_c_fc(calls):
    """The engine's gradient destinations (engine.py `grad_into`) get dW1 and dW2 written straight into them; with
    c_fc frozen and x not requiring grad, dg is not computed and c_proj's gradients are unchanged."""
    base = _base(0, 32, 80)
    x, dy = _inputs(2, 37, 32)
    m = apply_fp8(copy.deepcopy(base), "tensor", interpret=True)
    want = _fwd_bwd(m, x, dy, True, True)
    m = apply_fp8(copy.deepcopy(base), "tensor", interpret=True)
    buckets = {n: torch.zeros(3 + getattr(m, n).weight.numel()) for n in ("c_fc", "c_proj")}
    for n, b in buckets.items():
        w = getattr(m, n).weight
        w.grad_into = lambda w, b=b: b[3:].view(w.shape)
    got = _fwd_bwd(m, x, dy, True, True)
    for n, i in (("c_fc", 2), ("c_proj", 4)):
        assert getattr(m, n).weight.grad.data_ptr() == buckets[n][3:].data_ptr()
        assert torch.equal(got[i], want[i])
    m = apply_fp8(copy.deepcopy(base), "tensor", interpret=True)
    m.c_fc.requires_grad_(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    y.backward(dy)
    assert m.c_fc.weight.grad is None and m.c_fc.bias.grad is None
    assert torch.equal(m.c_proj.weight.grad, want[4]) and torch.equal(m.c_proj.bias.grad, want[5])
    assert calls[0] == 3


def test_fallbacks_take_the_three_ops(calls):
    """Row and block modes, the reference path (no interpreter), only one Linear in FP8, Linears of two FP8 states,
    a forward hook, tp.py-style linears (attach_fp8 on another module): the three ops, as before."""
    x, dy = _inputs(3, M=6)
    cases = {
        "row": apply_fp8(_base(), "row", interpret=True),
        "block": apply_fp8(_base(), "block", interpret=True),
        "reference path": apply_fp8(_base(), "tensor"),
        "c_fc only": apply_fp8(_base(), "tensor", filter="c_fc", interpret=True),
        "c_proj only": apply_fp8(_base(), "tensor", filter="c_proj", interpret=True),
    }
    two = apply_fp8(_base(), "tensor", filter="c_fc", interpret=True)
    apply_fp8(two, "tensor", filter="c_proj", interpret=True)
    cases["two states"] = two
    hooked = apply_fp8(_base(), "tensor", interpret=True)
    seen = []
    hooked.c_proj.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    cases["hooked"] = hooked
    tp_like = _base()
    attach_fp8(tp_like.c_fc, apply_fp8(_base(), "tensor", interpret=True).fp8)  # not an FP8Linear: no fused_mlp
    cases["tp-style"] = tp_like
    for name, m in cases.items():
        _fwd_bwd(m, x, dy, True, False)
        assert calls[0] == 0, name
    assert seen == [(6, C)]
    assert not hasattr(tp_like.c_fc, "fused_mlp") and isinstance(cases["row"].c_fc, FP8Linear)


# ---------------------------------------------------------------------------------------------------------------
# a tiny GPT

def _gpt(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64, vocab_multiple=32,
                      kernels="torch")
    return apply_fp8(GPT(cfg), "tensor", filter="*.mlp.*", interpret=True)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 64, (2, 17), generator=g)
    data[:, 1::2] = (data[:, 0::2][:, :8] * 5 + 1) % 64  # every other token follows from the one before
    return data[:, :-1], data[:, 1:]


def test_selective_checkpointing_runs_the_fused_mlp(calls):
    """recompute.py's selective mlp takes the fused op (it keeps only h and FP8 copies: nothing to recompute):
    the gradients are those of the run without checkpointing, bit for bit. (fp32: under autocast selective hands
    c_fc a bf16 LayerNorm output where none hands it fp32, which an FP8 c_fc quantizes as it comes, fused or not.)"""
    grads = []
    for mode in ("none", "selective"):
        m = _gpt()
        apply_activation_checkpointing(m.transformer.h, mode)
        x, y = _batch()
        _, loss = m(x, y)
        loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert calls[0] == 2
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


@pytest.mark.parametrize("autocast,tol", [(False, 1e-5), (True, 2e-3)])
def test_tiny_gpt_trains_the_same_fused_and_unfused(autocast, tol, monkeypatch, calls):
    """4 AdamW steps on one batch (losses 4.16 -> 3.21), fused against the three ops (fused_mlp switched off).
    Measured largest loss gap: fp32 0 (the same FP8 values on both paths), bf16 autocast 1.1e-3 (g and dh rounded
    to bf16 on the unfused path only). A gelu' without its second term moved them by 6.6e-3 / 3.4e-3."""
    def train():
        m = _gpt()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)
        losses = []
        x, y = _batch()
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                _, loss = m(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            m.fp8.step()
            losses.append(loss.item())
        return losses
    fused = train()
    assert calls[0] == 4
    monkeypatch.setattr(FP8Linear, "fused_mlp", lambda self, x, c_proj: None)
    plain = train()
    assert calls[0] == 4
    assert fused[-1] < fused[0]
    assert max(abs(a - b) for a, b in zip(fused, plain)) <= tol, (fused, plain)


def test_bench_mlp_section_runs_on_cpu(tmp_path, monkeypatch):
    """bench/bench_fp8.py's mlp section at a tiny shape (interpreter): its four rows, the fused ones through
    FP8MLPFunction (the section checks which path made y)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import bench_fp8
    out = tmp_path / "mlp.jsonl"
    bench_fp8.mlp(str(out), device="cpu", M=20, C=16)
    rows = bench_fp8.H.read_jsonl(str(out))
    assert [r["variant"] for r in rows] == ["bf16", "FP8 tensor, three ops", "FP8 tensor fused",
                                            "FP8 tensor fused delayed"]
    assert all(r["section"] == "mlp" and r["ms"] > 0 and r["hidden"] == 64 for r in rows)


# ---------------------------------------------------------------------------------------------------------------
# GPU

@pytest.mark.gpu
def test_gpu_fused_mlp_at_gpt_1b_shape():
    """gpt_1b's MLP (8192 tokens, 2048 -> 8192 -> 2048) under bf16 autocast, fused against unfused FP8 within the
    CPU-measured tolerances, and no less accurate than unfused against the bf16 MLP."""
    base = _base(0, 2048, 8192).cuda()
    x, dy = _inputs(0, 8192, 2048, "cuda")
    fused = apply_fp8(copy.deepcopy(base), "tensor")
    got = _fwd_bwd(fused, x, dy, True, True)
    want = _fwd_bwd(apply_fp8(copy.deepcopy(base), "tensor"), x, dy, False, True)
    bf16 = _fwd_bwd(copy.deepcopy(base), x, dy, False, True)
    for name, g, w, e in zip(NAMES, got, want, bf16):
        assert torch.isfinite(g).all(), name
        assert _rel(g, w) <= TOL_BF16[name] + 1e-4, f"{name}: fused vs unfused {_rel(g, w):.2e}"
        assert _rel(g, e) <= NO_WORSE * _rel(w, e) + 1e-4, f"{name}: fused {_rel(g, e):.3e} vs {_rel(w, e):.3e}"
