"""kernels/cross_entropy.py: fused CE (loss + in-place dlogits) and the vocab-parallel shard pieces.

CPU: the Triton kernels run in the interpreter with small vocabularies padded like GPT-2's (1000 -> 1024,
257 -> 384) and BLOCK_V=128, so every row takes several chunks, a partial chunk and an all-padding chunk.
Oracle: cross_entropy_ref in fp32 autograd (itself checked against F.cross_entropy).
GPU (`-m gpu`): 16384 x 50304 bf16 against "kernel error vs fp32 reference <= 2x PyTorch's bf16 error + eps",
and peak extra memory O(N).
"""
import pytest
import torch
import torch.nn.functional as F

from kernels.cross_entropy import (ce_shard_grad, ce_shard_grad_triton, ce_shard_stats, ce_shard_stats_triton,
                                   cross_entropy, cross_entropy_ref, cross_entropy_triton)

BV = 128  # interpreter-sized vocab chunk
# fp32: exp/log and the order of the sums differ from torch's (measured ~1e-7); fp16/bf16 dlogits are the fp32
# value rounded once (|dz| <= 1/n_valid, so a few ulps of that), the loss is computed in fp32 in both
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-4, rtol=2e-3),
       torch.bfloat16: dict(atol=5e-4, rtol=1e-2)}


def _case(N, V, Vp, dtype, n_ignored=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, Vp, generator=g) * 4).to(dtype)
    logits[:, V:] = 30.0  # large padding values: any leak into max/sum-exp would show
    targets = torch.randint(0, V, (N,), generator=g)
    targets[torch.randperm(N, generator=g)[:n_ignored]] = -1
    targets[0] = V - 1  # the last real column
    return logits, targets


def _ref_loss_grad(logits, targets, V, reduction="mean"):
    z = logits.detach().float().clone().requires_grad_()  # .float() of fp32 is the same tensor
    loss = cross_entropy_ref(z, targets, V, reduction=reduction)
    loss.backward()
    return loss.detach(), z.grad


def _triton_loss_grad(logits, targets, V, reduction="mean", scale=1.0):
    leaf = logits.clone().requires_grad_()
    z = leaf.view(logits.shape)  # non-leaf: the in-place path, as with lm_head's output
    loss = cross_entropy_triton(z, targets, V, reduction=reduction, block_v=BV)
    (loss * scale).backward()
    return loss.detach(), leaf.grad


def test_reference_matches_torch():
    logits, targets = _case(37, 1000, 1000, torch.float32)
    torch.testing.assert_close(cross_entropy_ref(logits, targets),
                               F.cross_entropy(logits, targets, ignore_index=-1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("N,V,Vp,dtype", [
    (37, 1000, 1024, torch.float32),
    (37, 257, 384, torch.float16),
    (19, 257, 384, torch.bfloat16),  # no tl.dot here, so bf16 is fine in the interpreter
    (5, 130, 130, torch.float32),  # unpadded, one partial chunk
])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_and_grad_match_reference(N, V, Vp, dtype, reduction):
    logits, targets = _case(N, V, Vp, dtype)
    loss, grad = _triton_loss_grad(logits, targets, V, reduction)
    ref_loss, ref_grad = _ref_loss_grad(logits, targets, V, reduction)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.float(), ref_grad, **TOL[dtype])
    assert torch.all(grad[:, V:] == 0), "padding columns must get exactly zero gradient"
    assert torch.all(grad[targets == -1] == 0), "ignored rows must get exactly zero gradient"


@pytest.mark.parametrize("stages", [1, 4])
def test_chunk_pipelining_depth_gives_the_same_result(monkeypatch, stages):
    """STAGES (the tuned launch constant, 3) changes how far ahead the chunk loads run, never the result."""
    import kernels.cross_entropy as ce
    monkeypatch.setattr(ce, "STAGES", stages)
    logits, targets = _case(37, 1000, 1024, torch.float32)
    loss, grad = _triton_loss_grad(logits, targets, 1000)
    ref_loss, ref_grad = _ref_loss_grad(logits, targets, 1000)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, **TOL[torch.float32])
    assert torch.all(grad[:, 1000:] == 0) and torch.all(grad[targets == -1] == 0)


def test_incoming_grad_scales_result():
    """backward multiplies by the incoming scalar (e.g. loss / grad_accum_steps); 1.0 is a no-op fast path."""
    logits, targets = _case(13, 257, 384, torch.float32)
    _, ref_grad = _ref_loss_grad(logits, targets, 257)
    _, grad = _triton_loss_grad(logits, targets, 257, scale=0.25)
    torch.testing.assert_close(grad, 0.25 * ref_grad, **TOL[torch.float32])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_scale_is_folded_into_the_forward(reduction):
    """loss_scale (e.g. 1/grad_accum) scales the loss and the gradient written in the forward; backward sees 1."""
    logits, targets = _case(13, 257, 384, torch.float32)
    ref_loss, ref_grad = _ref_loss_grad(logits, targets, 257, reduction)
    leaf = logits.clone().requires_grad_()
    loss = cross_entropy_triton(leaf.view(13, 384), targets, 257, reduction=reduction, loss_scale=0.25, block_v=BV)
    loss.backward()
    torch.testing.assert_close(loss, 0.25 * ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(leaf.grad, 0.25 * ref_grad, **TOL[torch.float32])
    torch.testing.assert_close(cross_entropy_ref(logits, targets, 257, reduction=reduction, loss_scale=0.25),
                               0.25 * ref_loss, atol=1e-6, rtol=1e-6)


def test_second_backward_is_a_clear_error():
    logits, targets = _case(5, 257, 384, torch.float32)
    leaf = logits.clone().requires_grad_()
    loss = cross_entropy_triton(leaf * 1, targets, 257, block_v=BV)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


def test_all_rows_ignored_gives_zero_not_nan():
    logits, targets = _case(7, 257, 384, torch.float32)
    targets[:] = -1
    loss, grad = _triton_loss_grad(logits, targets, 257)
    assert loss.item() == 0.0 and torch.count_nonzero(grad) == 0
    assert cross_entropy_ref(logits, targets, 257).item() == 0.0


def test_other_ignore_index():
    logits, targets = _case(11, 257, 384, torch.float32)
    targets[targets == -1] = -100
    leaf = logits.clone().requires_grad_()
    loss = cross_entropy_triton(leaf.view(11, 384), targets, 257, ignore_index=-100, block_v=BV)
    loss.backward()
    torch.testing.assert_close(loss, F.cross_entropy(logits[:, :257], targets, ignore_index=-100),
                               atol=1e-5, rtol=1e-5)
    assert torch.all(leaf.grad[targets == -100] == 0)


def test_inplace_semantics():
    logits, targets = _case(9, 257, 384, torch.float32)
    # a non-leaf activation receives its own gradient (that is the memory saving)
    leaf = logits.clone().requires_grad_()
    z = leaf * 1.0
    cross_entropy_triton(z, targets, 257, block_v=BV).backward()
    torch.testing.assert_close(z.detach(), leaf.grad, atol=0, rtol=0)
    # a leaf is the caller's data: untouched
    leaf = logits.clone().requires_grad_()
    cross_entropy_triton(leaf, targets, 257, block_v=BV).backward()
    assert torch.equal(leaf.detach(), logits)
    # inplace=False: untouched too
    leaf = logits.clone().requires_grad_()
    z = leaf * 1.0
    cross_entropy_triton(z, targets, 257, inplace=False, block_v=BV).backward()
    assert torch.equal(z.detach(), logits)
    # no grad needed: nothing written
    z = logits.clone()
    with torch.no_grad():
        loss = cross_entropy_triton(z, targets, 257, block_v=BV)
    assert torch.equal(z, logits)
    torch.testing.assert_close(loss, cross_entropy_ref(logits, targets, 257), atol=1e-5, rtol=1e-5)


def test_inplace_fails_loudly_when_logits_were_saved():
    """tanh saves its output for backward; overwriting it must raise, not corrupt gradients."""
    logits, targets = _case(9, 257, 384, torch.float32)
    leaf = logits.clone().requires_grad_()
    z = torch.tanh(leaf) * 1  # the *1 output is not saved: fine
    cross_entropy_triton(z, targets, 257, block_v=BV).backward()
    z = torch.tanh(leaf)  # this output is saved by TanhBackward
    loss = cross_entropy_triton(z, targets, 257, block_v=BV)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_non_contiguous_logits():
    logits, targets = _case(9, 257, 384, torch.float32)
    leaf = logits.t().contiguous().requires_grad_()  # (Vp, N) storage
    loss = cross_entropy_triton(leaf.t(), targets, 257, block_v=BV)  # column stride != 1: copied
    loss.backward()
    ref_loss, ref_grad = _ref_loss_grad(logits, targets, 257)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(leaf.grad.t(), ref_grad, **TOL[torch.float32])


def test_public_op_on_cpu_is_reference():
    logits, targets = _case(9, 257, 384, torch.float32)
    torch.testing.assert_close(cross_entropy(logits, targets, 257), cross_entropy_ref(logits, targets, 257),
                               atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_shards_reassemble_the_full_loss(dtype):
    """3 shards of 128 columns (the last has 1 real column + padding): stats combined as tp.py would
    all-reduce them give the full loss, and the shard gradients concatenate to the full gradient."""
    N, V, Vp, S = 23, 257, 384, 128
    logits, targets = _case(N, V, Vp, dtype)
    shards = [(logits[:, i * S:(i + 1) * S], i * S, max(0, min(S, V - i * S))) for i in range(Vp // S)]
    stats = [ce_shard_stats_triton(z, targets, v0, nv, block_v=64) for z, v0, nv in shards]
    for (z, v0, nv), got in zip(shards, stats):  # Triton pieces == reference pieces
        for a, b in zip(got, ce_shard_stats(z, targets, v0, nv)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    row_max = torch.stack([s[0] for s in stats]).max(0).values  # all_reduce(MAX)
    sumexp = sum(s[1] * torch.exp(s[0] - row_max) for s in stats)  # all_reduce(SUM) after rescaling
    zt = sum(s[2] for s in stats)  # all_reduce(SUM): exactly one shard holds the target
    lse = row_max + torch.log(sumexp)
    valid = targets != -1
    loss = torch.where(valid, lse - zt, 0.0).sum() / valid.sum()
    ref_loss, ref_grad = _ref_loss_grad(logits, targets, V)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    scale = 1.0 / valid.sum()
    grads = [ce_shard_grad_triton(z, targets, v0, nv, lse, scale, block_v=64) for z, v0, nv in shards]
    torch.testing.assert_close(torch.cat(grads, 1).float(), ref_grad, **TOL[dtype])
    for (z, v0, nv), g in zip(shards, grads):
        torch.testing.assert_close(g, ce_shard_grad(z, targets, v0, nv, lse, scale), **TOL[dtype])
    # in place into the shard buffer
    z0 = shards[0][0].clone()
    out = ce_shard_grad_triton(z0, targets, 0, S, lse, scale, out=z0, block_v=64)
    assert out is z0 and torch.equal(z0, grads[0])


def test_user_errors():
    logits, targets = _case(4, 10, 16, torch.float32)
    with pytest.raises(ValueError, match="n_vocab"):
        cross_entropy_triton(logits, targets, 17)
    with pytest.raises(ValueError, match="targets"):
        cross_entropy_triton(logits, targets[:3], 10)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy_triton(logits, targets, 10, reduction="none")
    with pytest.raises(ValueError, match="integer"):
        cross_entropy_triton(logits, targets.float(), 10)


# ---------------------------------------------------------------------------------------------------------------
# GPU: GPT-2 size, bf16


@pytest.mark.gpu
def test_gpu_bf16_gpt2_vocab():
    torch.manual_seed(0)
    N, V, Vp = 16384, 50257, 50304
    logits = torch.randn(N, Vp, device="cuda", dtype=torch.bfloat16) * 4
    targets = torch.randint(0, V, (N,), device="cuda")
    targets[::9] = -1
    ref_loss, ref_grad = _ref_loss_grad(logits, targets, V)
    zb = logits[:, :V].clone().requires_grad_()
    torch_loss = F.cross_entropy(zb, targets, ignore_index=-1)  # PyTorch's own bf16 path
    torch_loss.backward()
    loss, grad = _triton_loss_grad(logits, targets, V)
    e_loss, t_loss = (loss - ref_loss).abs().item(), (torch_loss.float() - ref_loss).abs().item()
    e_grad = (grad[:, :V].float() - ref_grad[:, :V]).abs().max().item()
    t_grad = (zb.grad.float() - ref_grad[:, :V]).abs().max().item()
    assert e_loss <= 2 * t_loss + 1e-4, (e_loss, t_loss)
    assert e_grad <= 2 * t_grad + 1e-7, (e_grad, t_grad)
    assert torch.all(grad[:, V:] == 0) and torch.all(grad[targets == -1] == 0)


@pytest.mark.gpu
def test_gpu_peak_extra_memory_is_o_n():
    N, V, Vp = 16384, 50257, 50304
    leaf = torch.randn(N, Vp, device="cuda", dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (N,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    cross_entropy(leaf.view(N, Vp), targets, V).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 64 * N + 2**20, f"extra {extra} bytes: expected O(N), not O(N * Vp)"
