"""Tests for kernels/attention.py: the Triton flash attention against attention_ref.

On CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1) in fp32 and fp16 (bf16 dots are
broken in the interpreter, notes/triton_cpu.md); bf16 at real sizes runs in the `gpu` tests.
Shapes are small and awkward: T not a multiple of the interpreter tiles (BLOCK 64 x 32), odd B*H, Tq != Tk.
"""
import pytest
import torch

import kernels.attention as attention_mod
from kernels.attention import (attention, attention_block_bwd, attention_block_fwd, attention_qkv,
                               attention_qkv_triton, attention_ref, attention_triton, split_qkv)

# the interpreter itself trips a numpy deprecation on every scalar loop bound; it says nothing about our code
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

# fp32 in the interpreter: both sides do the same fp32 math in a different order (blockwise online softmax vs one
# logsumexp); measured errors are ~1e-6 on O(1) values, so 1e-4 / 1e-5 leaves room without hiding a wrong mask.
F32 = dict(atol=1e-4, rtol=1e-5)


def _qkv(B, H, Tq, Tk, D, dtype=torch.float32, strided=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if strided:  # views of a fused projection, as the model makes them: (B, T, 3, H, D) permuted to (B, H, T, D)
        assert Tq == Tk
        qkv = torch.randn(B, Tq, 3, H, D, generator=g).to(dtype)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, D), non-contiguous
        return q, k, v
    return (torch.randn(B, H, Tq, D, generator=g).to(dtype), torch.randn(B, H, Tk, D, generator=g).to(dtype),
            torch.randn(B, H, Tk, D, generator=g).to(dtype))


def _grads(fn, q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))  # detach keeps strides (clone might not)
    out = fn(q, k, v)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


# --------------------------------------------------------------------------------------------------------------
# CPU (interpreter)
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("B,H,Tq,Tk,D,causal,strided", [
    (1, 3, 17, 17, 64, True, False),
    (2, 1, 129, 129, 64, True, True),  # 129 = 2 full query tiles + 1 row: diagonal, unmasked and tail paths
    (1, 1, 127, 127, 128, True, False),
    (1, 2, 1, 1, 64, True, False),
    (2, 1, 129, 100, 64, False, False),  # Tq != Tk, key tail of 4 after 3 full key tiles
    (1, 3, 33, 33, 128, False, True),
    (1, 1, 17, 40, 80, False, False),  # D=80 padded to 128 inside the kernel
    (1, 1, 45, 45, 32, True, False),
    (1, 2, 37, 37, 18, True, False),  # D=18 (72-byte fp32 rows): padded to 32 inside the kernel
    (3, 4, 33, 33, 128, True, False),  # 12 (b, h) pairs: the dq kernel's head groups of 8 and a short one of 4
])
@pytest.mark.parametrize("loads", ["auto", "tma", "pointers"])
def test_fwd_bwd_match_reference_fp32(B, H, Tq, Tk, D, causal, strided, loads, monkeypatch):
    # tile loads: TMA from D=128 up (auto), TMA at every head dim whose rows allow it, or pointers everywhere
    monkeypatch.setattr(attention_mod, "TMA_MIN_BLOCK_D", {"auto": 128, "tma": 16, "pointers": 4096}[loads])
    q, k, v = _qkv(B, H, Tq, Tk, D, strided=strided)
    assert q.is_contiguous() != strided
    do = torch.randn(B, H, Tq, D, generator=torch.Generator().manual_seed(1))
    out, lse = attention_block_fwd(q, k, v, causal)
    out_ref, lse_ref = attention_ref(q, k, v, causal)
    torch.testing.assert_close(out, out_ref, **F32)
    torch.testing.assert_close(lse, lse_ref, **F32)
    got = _grads(lambda a, b, c: attention_triton(a, b, c, causal), q, k, v, do)
    want = _grads(lambda a, b, c: attention_ref(a, b, c, causal)[0], q, k, v, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, **F32, msg=lambda m: f"{name}: {m}")


def test_tma_loads_only_where_descriptors_can_read():
    meta128, meta64 = dict(BLOCK_D=128), dict(BLOCK_D=64)
    q, k, v = _qkv(1, 2, 33, 33, 128, strided=True)  # views of the packed projection: 16-byte strides
    assert attention_mod._use_tma(meta128, q, k, v)
    assert not attention_mod._use_tma(meta64, *_qkv(1, 2, 33, 33, 64))  # below TMA_MIN_BLOCK_D: pointers
    odd = torch.randn(1, 2, 33, 128 + 1)[..., 1:]  # base 4 bytes past 16-byte alignment
    assert not attention_mod._use_tma(meta128, q, odd, v)
    assert not attention_mod._use_tma(meta128, q.transpose(2, 3), k, v)  # D is not the unit-stride dim
    assert not attention_mod._use_tma(meta128, torch.randn(1, 1, 5, 18))  # 72-byte rows


@pytest.mark.parametrize("causal", [True, False])
def test_fp16_matches_reference(causal):
    # fp16 inputs, fp32 reference on the same (rounded) inputs. The kernel rounds P and dS to fp16 before their
    # dots and the outputs to fp16 (relative 2^-11 ~ 5e-4 each); on these O(1)-O(10) values that is well under 2e-2.
    q, k, v = _qkv(1, 2, 71, 71, 64, dtype=torch.float16)
    do = torch.randn(1, 2, 71, 64, generator=torch.Generator().manual_seed(1)).half()
    got = _grads(lambda a, b, c: attention_triton(a, b, c, causal), q, k, v, do)
    want = _grads(lambda a, b, c: attention_ref(a, b, c, causal)[0], q.float(), k.float(), v.float(), do.float())
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == torch.float16
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=1e-2, msg=lambda m: f"{name}: {m}")


def _merge(o1, l1, o2, l2):
    """Combine two partial attentions over disjoint key sets by their lse (what ring attention does)."""
    lse = torch.logaddexp(l1, l2)
    return o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None], lse


def test_lse_merge_of_key_blocks_noncausal():
    q, k, v = _qkv(1, 3, 23, 50, 64)
    o1, l1 = attention_block_fwd(q, k[:, :, :13], v[:, :, :13], causal=False)
    o2, l2 = attention_block_fwd(q, k[:, :, 13:], v[:, :, 13:], causal=False)
    out, lse = _merge(o1, l1, o2, l2)
    out_ref, lse_ref = attention_ref(q, k, v, causal=False)
    torch.testing.assert_close(out, out_ref, **F32)  # fp32 everywhere; the merge adds a few ulps
    torch.testing.assert_close(lse, lse_ref, **F32)


def _causal_split(T1=37, T2=29):
    """Queries of the second chunk of a causal sequence against (earlier chunk, full) + (own chunk, causal)."""
    q, k, v = _qkv(2, 1, T1 + T2, T1 + T2, 64, seed=3)
    q2, k1, v1, k2, v2 = q[:, :, T1:], k[:, :, :T1], v[:, :, :T1], k[:, :, T1:], v[:, :, T1:]
    return q, k, v, q2, k1, v1, k2, v2


def test_lse_merge_causal_diagonal_plus_earlier_block():
    T1 = 37
    q, k, v, q2, k1, v1, k2, v2 = _causal_split(T1)
    o1, l1 = attention_block_fwd(q2, k1, v1, causal=False)
    o2, l2 = attention_block_fwd(q2, k2, v2, causal=True)
    out, lse = _merge(o1, l1, o2, l2)
    out_ref, lse_ref = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(out, out_ref[:, :, T1:], **F32)
    torch.testing.assert_close(lse, lse_ref[:, :, T1:], **F32)


@pytest.mark.parametrize("D", [64, 48])  # 48: a head dim that is not a power of two (masked columns)
def test_merge_kernel_in_place_on_views(D):
    """attention_merge_ (the ring's one-pass merge) on strided views of a longer sequence equals the formula,
    leaves the rows outside the view alone, and keeps a row whose two blocks are both empty at lse -inf, out 0."""
    from kernels.attention import attention_merge_
    g = torch.Generator().manual_seed(5)
    B, H, T = 2, 3, 41
    out = torch.randn(B, T, H, D, generator=g).transpose(1, 2)  # (B, H, T, D) view of (B, T, H, D) memory
    lse = torch.randn(B, H, T, generator=g)
    rows, n = slice(7, 36), 29
    o = torch.randn(B, n, H, D, generator=g).transpose(1, 2).to(torch.float16)
    l = torch.randn(B, H, n, generator=g) * 3
    lse[0, 1, 10], l[0, 1, 10 - 7] = float("-inf"), float("-inf")  # both empty at one row
    want_o, want_l = _merge(out[:, :, rows].clone(), lse[:, :, rows].clone(), o.float(), l)
    want_o[0, 1, 3], want_l[0, 1, 3] = 0.0, float("-inf")
    before = out.clone()
    attention_merge_(out[:, :, rows], lse[:, :, rows], o, l)
    torch.testing.assert_close(out[:, :, rows], want_o, **F32)
    torch.testing.assert_close(lse[:, :, rows], want_l, **F32)
    torch.testing.assert_close(out[:, :, :7], before[:, :, :7], rtol=0, atol=0)
    torch.testing.assert_close(out[:, :, 36:], before[:, :, 36:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="fp32"):
        attention_merge_(out[:, :, rows].half(), lse[:, :, rows], o, l)


def test_block_bwd_uses_given_merged_lse():
    # Ring attention's backward: each block's backward gets the merged (global) out and lse; the sums of the
    # block grads must equal the grads of full causal attention (upstream grad only on the second chunk's rows).
    T1 = 37
    q, k, v, q2, k1, v1, k2, v2 = _causal_split(T1)
    out_ref, lse_ref = attention_ref(q, k, v, causal=True)
    out2, lse2 = out_ref[:, :, T1:], lse_ref[:, :, T1:]
    do2 = torch.randn(out2.shape, generator=torch.Generator().manual_seed(5))
    dq_a, dk1, dv1 = attention_block_bwd(do2, q2, k1, v1, out2, lse2, causal=False)
    dq_b, dk2, dv2 = attention_block_bwd(do2, q2, k2, v2, out2, lse2, causal=True)
    do = torch.cat([torch.zeros_like(out_ref[:, :, :T1]), do2], dim=2)
    _, dq, dk, dv = _grads(lambda a, b, c: attention_ref(a, b, c, True)[0], q, k, v, do)
    torch.testing.assert_close(dq_a + dq_b, dq[:, :, T1:], **F32)
    torch.testing.assert_close(torch.cat([dk1, dk2], 2), dk, **F32)
    torch.testing.assert_close(torch.cat([dv1, dv2], 2), dv, **F32)


def test_sm_scale_and_output_layout():
    q, k, v = _qkv(1, 2, 19, 19, 64)
    out, lse = attention_block_fwd(q, k, v, causal=True, sm_scale=0.3)
    out_ref, lse_ref = attention_ref(q, k, v, causal=True, sm_scale=0.3)
    torch.testing.assert_close(out, out_ref, **F32)
    torch.testing.assert_close(lse, lse_ref, **F32)
    # out is a (B, H, T, D) view of (B, T, H, D) memory so merging heads afterwards needs no copy
    assert out.transpose(1, 2).is_contiguous()


def test_zero_stride_upstream_grad():
    # out.sum().backward() hands the backward an expanded dO with all strides 0; the kernels read it in place
    q, k, v = _qkv(1, 2, 21, 21, 64)
    got = _grads(lambda a, b, c: attention_triton(a, b, c, True).sum()[None], q, k, v, torch.ones(1))
    want = _grads(lambda a, b, c: attention_ref(a, b, c, True)[0].sum()[None], q, k, v, torch.ones(1))
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, **F32)


def _qkv_grads(fn, qkv, do):
    qkv = qkv.detach().requires_grad_()
    out = fn(qkv)
    out.backward(do)
    return out.detach(), qkv.grad


@pytest.mark.parametrize("B,T,H,D", [(2, 129, 3, 64), (1, 17, 1, 128), (3, 1, 2, 64), (1, 45, 2, 80)])
def test_packed_qkv_grad_is_one_buffer(B, T, H, D):
    """attention over a packed (B, T, 3*H*D) projection: out and d(qkv) equal the reference through the split
    views, and d(qkv) comes back as one contiguous buffer (the kernels wrote its q, k and v columns)."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, T, 3 * H * D, generator=g)
    do = torch.randn(B, H, T, D, generator=g)
    out, dqkv = _qkv_grads(lambda t: attention_qkv_triton(t, H), qkv, do)
    out_ref, dqkv_ref = _qkv_grads(lambda t: attention_ref(*split_qkv(t, H), True)[0], qkv, do)
    torch.testing.assert_close(out, out_ref, **F32)
    torch.testing.assert_close(dqkv, dqkv_ref, **F32)
    assert dqkv.is_contiguous() and dqkv.shape == qkv.shape
    torch.testing.assert_close(attention_qkv(qkv, H), out_ref, **F32)  # CPU tensors: the SDPA path
    with pytest.raises(ValueError, match="3 \\* n_head"):
        split_qkv(qkv[..., :-1], H)


def test_cpu_fallback_matches_reference():
    q, k, v = _qkv(2, 3, 31, 31, 64)
    for causal in (True, False):
        torch.testing.assert_close(attention(q, k, v, causal), attention_ref(q, k, v, causal)[0], **F32)


def test_bad_inputs_fail_early():
    q, k, v = _qkv(1, 2, 8, 12, 64)
    with pytest.raises(ValueError, match="Tq == Tk"):
        attention_block_fwd(q, k, v, causal=True)
    with pytest.raises(ValueError, match="disagree"):
        attention_block_fwd(q, k[..., :32], v, causal=False)
    with pytest.raises(ValueError, match="dtypes"):
        attention_block_fwd(q, k.half(), v, causal=False)
    with pytest.raises(ValueError, match="B, H, T, D"):
        attention(q[0], k[0], v[0], causal=False)


def test_empty_query_launches_nothing():
    q, k, v = _qkv(1, 2, 0, 5, 64)
    out, lse = attention_block_fwd(q, k, v, causal=False)
    assert out.shape == (1, 2, 0, 64) and lse.shape == (1, 2, 0)


# --------------------------------------------------------------------------------------------------------------
# GPU: bf16 against an fp32 reference, judged by PyTorch SDPA's own bf16 error on the same inputs
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("B,H,T,D,causal", [
    (4, 12, 1024, 64, True),  # GPT-2 124M
    (1, 4, 4096, 128, True),
    (2, 3, 1, 64, True),
    (2, 3, 17, 64, True),
    (2, 3, 129, 128, True),
    (2, 3, 1000, 64, True),
    (2, 3, 1000, 128, False),
    (2, 3, 129, 96, True),  # padded head dim
])
def test_gpu_bf16_within_2x_sdpa_error(B, H, T, D, causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
    ref = _grads(lambda a, b, c: attention_ref(a, b, c, causal)[0], q.float(), k.float(), v.float(), do.float())
    ours = _grads(lambda a, b, c: attention(a, b, c, causal), q, k, v, do)
    sdpa = _grads(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal),
                  q, k, v, do)
    for name, o, s, r in zip(("out", "dq", "dk", "dv"), ours, sdpa, ref):
        assert o.dtype == torch.bfloat16 and torch.isfinite(o).all(), name
        err, err_sdpa = (o.float() - r).abs().max().item(), (s.float() - r).abs().max().item()
        # eps: 0.1% of the largest value, under bf16's 0.4% resolution; 1e-5 covers all-zero grads (T=1: dq = 0)
        eps = 1e-3 * r.abs().max().item() + 1e-5
        assert err <= 2 * err_sdpa + eps, f"{name}: ours {err:.3e} vs sdpa {err_sdpa:.3e} (+eps {eps:.1e})"


@pytest.mark.gpu
def test_gpu_packed_qkv_within_2x_sdpa_error():
    B, T, H, D = 4, 1024, 12, 64  # GPT-2 124M
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(B, T, 3 * H * D, device="cuda", generator=g, dtype=torch.bfloat16)
    do = torch.randn(B, H, T, D, device="cuda", generator=g, dtype=torch.bfloat16)
    ref = _qkv_grads(lambda t: attention_ref(*split_qkv(t, H), True)[0], qkv.float(), do.float())
    ours = _qkv_grads(lambda t: attention_qkv(t, H), qkv, do)
    sdpa = _qkv_grads(lambda t: torch.nn.functional.scaled_dot_product_attention(*split_qkv(t, H), is_causal=True),
                      qkv, do)
    for name, o, s, r in zip(("out", "dqkv"), ours, sdpa, ref):
        err, err_sdpa = (o.float() - r).abs().max().item(), (s.float() - r).abs().max().item()
        eps = 1e-3 * r.abs().max().item() + 1e-5  # as in test_gpu_bf16_within_2x_sdpa_error
        assert err <= 2 * err_sdpa + eps, f"{name}: ours {err:.3e} vs sdpa {err_sdpa:.3e} (+eps {eps:.1e})"


@pytest.mark.gpu
def test_gpu_strided_qkv_views_and_lse():
    B, T, H, D = 2, 333, 12, 64
    qkv = torch.randn(B, T, 3, H, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, D), strided views
    out, lse = attention_block_fwd(q, k, v, causal=True)
    out_ref, lse_ref = attention_ref(q, k, v, causal=True)
    # bf16 out: one rounding of O(1) values (2^-8 relative) plus bf16-P dot rounding; lse is fp32 from bf16 scores
    torch.testing.assert_close(out, out_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-3)
