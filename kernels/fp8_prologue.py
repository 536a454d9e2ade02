"""Elementwise prologues of the per-tensor FP8 casts (kernels/fp8_quant.py): the MLP's GELU folded into a cast.

The FP8 MLP (nanopara/fp8.py, FP8MLPFunction) quantizes c_proj's input g = gelu(h) and c_fc's output gradient
dh = dg * gelu'(h) without writing g or dh: the amax and cast passes read h (and dg) and compute them in fp32 on the
way. GELU with PyTorch's approximate="tanh" (Hendrycks & Gimpel 2016), in fp32 from a bf16 (or any) h:
    u = beta (h + kappa h^3),   beta = sqrt(2/pi), kappa = 0.044715          (PyTorch's `inner`, same order)
    s = sigmoid(2u) = (1 + tanh(u)) / 2                                        so 1 - tanh(u)^2 = 4 s (1 - s)
    gelu(h)  = h s                                                             = 0.5 h (1 + tanh(u))
    gelu'(h) = s + 2 h s (1 - s) beta (1 + 3 kappa h^2)                        PyTorch's left + right derivative
s and 1 - s both come from e = exp(-|2u|) in (0, 1]: 1 / (1 + e) and e / (1 + e), without the cancellation of
1 + tanh(u) near u << 0. Against F.gelu / its backward on every finite bf16 h (fp32 math): see tests/test_fp8_mlp.py.
exp: the GPU's (tl.exp, ex2.approx); under TRITON_INTERPRET (SOFT) one written in +, -, *, / only (Cody-Waite
reduction, degree-7 Taylor, exact 2^k), which `gelu_tanh_ref` repeats op for op in torch, so the CPU tests are
bit-exact (numpy's and torch's own exp differ in the last bit on ~5 % of bf16 inputs).
PROLOGUE constexpr: 0 none, 1 gelu_tanh(x), 2 x * gelu_tanh'(h) (x = dg, h through a second pointer).
Callers: kernels/fp8_quant.py (`_amax_kernel`, `_cast_kernel`, `fp8_quantize(prologue=...)`), tests/test_fp8_mlp.py.
"""
import torch
import triton
import triton.language as tl

PROLOGUES = {None: 0, "gelu_tanh": 1, "gelu_tanh_bwd": 2}  # fp8_quantize's `prologue` -> the kernels' constexpr

BETA, KAPPA = 0.7978845608028654, 0.044715  # sqrt(2/pi), GELU tanh's cubic coefficient
KAPPA3 = 0.134145  # 3 kappa rounded once (PyTorch's fp32 3 * kKappa is 1 ulp below: rounded twice)
LOG2E = 1.4426950408889634
LN2_HI, LN2_LO = 0.693145751953125, 1.4286068203094173e-06  # ln 2 = HI + LO; HI has 16 bits: k * HI is exact
EXP_MIN = -87.0  # exp(a) for a below this (subnormal results) is taken as 0
ROUND = 12582912.0  # 1.5 * 2^23: (v + ROUND) - ROUND rounds |v| < 2^22 to the nearest integer (ties to even)
HPOLY = 20.0  # |h| cap in the second term of gelu': s (1 - s) is 0 from |h| > 10.3, and 0 * inf (h^2, 2h) is NaN
# the same numbers as the kernels see them (a @jit function reads only constexpr globals)
_BETA, _KAPPA, _KAPPA3, _LOG2E = tl.constexpr(BETA), tl.constexpr(KAPPA), tl.constexpr(KAPPA3), tl.constexpr(LOG2E)
_LN2_HI, _LN2_LO, _EXP_MIN = tl.constexpr(LN2_HI), tl.constexpr(LN2_LO), tl.constexpr(EXP_MIN)
_ROUND, _HPOLY = tl.constexpr(ROUND), tl.constexpr(HPOLY)


# ---------------------------------------------------------------------------------------------------------------
# reference: the same operations in the same order, in fp32

def _exp_neg_ref(a):
    """exp(a) for a <= 0 (fp32), as the kernels' SOFT path computes it."""
    ok = a >= EXP_MIN
    a = torch.where(ok, a, EXP_MIN)
    k = (a * LOG2E + ROUND) - ROUND
    r = (a - k * LN2_HI) - k * LN2_LO
    p = 1.0 / 5040.0
    for c in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        p = p * r + c
    scale = ((k.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(ok, p * scale, 0.0)


def _sigmoids_ref(h):
    """(s, 1 - s) of s = sigmoid(2u) for fp32 h."""
    u = BETA * (h + KAPPA * (h * h * h))
    z = u + u
    e = _exp_neg_ref(-z.abs())
    sp = 1.0 / (1.0 + e)
    sn = e * sp
    pos = z >= 0
    return torch.where(pos, sp, sn), torch.where(pos, sn, sp)


def gelu_tanh_ref(h):
    """gelu(h) in fp32, the kernels' math (SOFT exp)."""
    h = h.float()
    return h * _sigmoids_ref(h)[0]


def gelu_tanh_grad_ref(h):
    """gelu'(h) in fp32, the kernels' math (SOFT exp)."""
    h = h.float()
    s, s1 = _sigmoids_ref(h)
    hc = h.clamp(-HPOLY, HPOLY)
    return s + ((hc + hc) * (s * s1)) * (BETA * (1.0 + KAPPA3 * (hc * hc)))


def prologue_ref(x, prologue=None, h=None):
    """What the cast kernels quantize for `prologue` (a key of PROLOGUES): x, gelu(x) or x * gelu'(h), in fp32
    (x itself, unchanged, for None)."""
    if prologue is None:
        return x
    if prologue == "gelu_tanh":
        return gelu_tanh_ref(x)
    if prologue == "gelu_tanh_bwd":
        return x.float() * gelu_tanh_grad_ref(h)
    raise ValueError(f"fp8 prologue must be one of {list(PROLOGUES)}, got {prologue!r}")


# ---------------------------------------------------------------------------------------------------------------
# Triton: the same math on fp32 tiles

@triton.jit
def _exp_neg(a, SOFT: tl.constexpr):
    """exp(a), a <= 0. SOFT: the reference's operations (interpreter); else the GPU's exp."""
    if SOFT:
        ok = a >= _EXP_MIN
        a = tl.where(ok, a, _EXP_MIN)
        k = (a * _LOG2E + _ROUND) - _ROUND
        r = (a - k * _LN2_HI) - k * _LN2_LO
        p = r * (1.0 / 5040.0) + (1.0 / 720.0)
        p = p * r + (1.0 / 120.0)
        p = p * r + (1.0 / 24.0)
        p = p * r + (1.0 / 6.0)
        p = p * r + 0.5
        p = p * r + 1.0
        p = p * r + 1.0
        scale = ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
        e = tl.where(ok, p * scale, 0.0)
    else:
        e = tl.exp(a)
    return e


@triton.jit
def _sigmoids(h, SOFT: tl.constexpr):
    u = _BETA * (h + _KAPPA * (h * h * h))
    z = u + u
    e = _exp_neg(-tl.abs(z), SOFT)
    sp = 1.0 / (1.0 + e)
    sn = e * sp
    pos = z >= 0
    return tl.where(pos, sp, sn), tl.where(pos, sn, sp)


@triton.jit
def gelu_tanh(h, SOFT: tl.constexpr):
    s, s1 = _sigmoids(h, SOFT)
    return h * s


@triton.jit
def gelu_tanh_grad(h, SOFT: tl.constexpr):
    s, s1 = _sigmoids(h, SOFT)
    hc = tl.where(h < -_HPOLY, -_HPOLY, tl.where(h > _HPOLY, _HPOLY, h))  # NaN stays NaN
    return s + ((hc + hc) * (s * s1)) * (_BETA * (1.0 + _KAPPA3 * (hc * hc)))


@triton.jit
def apply_prologue(x, H, offs, mask, PROLOGUE: tl.constexpr, SOFT: tl.constexpr):
    """x (an fp32 tile loaded from offsets `offs`) -> what is quantized: x, gelu(x), or x * gelu'(h) with h loaded
    from H at the same offsets (masked elements: x = 0 there, and every prologue maps 0 to 0)."""
    if PROLOGUE == 1:
        x = gelu_tanh(x, SOFT)
    elif PROLOGUE == 2:
        h = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
        x = x * gelu_tanh_grad(h, SOFT)
    return x
