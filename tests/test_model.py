"""GPT-2 model: shapes, init, tied weights, loss at init, overfitting, KV-cache generation, HF weight mapping."""
import math

import pytest
import torch
import torch.nn.functional as F

from nanopara.config import ModelConfig
from nanopara.model import GPT, from_hf_state_dict, to_hf_state_dict


def small(**kw):
    base = dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=1000, vocab_multiple=128)
    base.update(kw)
    return ModelConfig(**base)


def test_shapes_and_padded_vocab():
    cfg = small()
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, 17))
    logits, loss = model(idx)
    assert logits.shape == (3, 17, 1024) and loss is None  # 1000 padded up to a multiple of 128


def test_tied_weights_and_param_count():
    model = GPT(small())
    assert model.lm_head.weight is model.transformer.wte.weight
    # GPT-2 124M's well-known count: 124,439,808 with the 50257-row embedding (nanoGPT counts wpe out: -786,432)
    big = GPT(ModelConfig())
    assert big.num_params(non_embedding=False) - (50304 - 50257) * 768 == 124_439_808


def test_gpt2_init():
    torch.manual_seed(0)
    cfg = small(n_layer=4, n_embd=128)
    model = GPT(cfg)
    w = model.transformer.h[0].mlp.c_fc.weight
    proj = torch.cat([b.mlp.c_proj.weight.flatten() for b in model.transformer.h])
    assert abs(w.std().item() - 0.02) < 0.001
    assert abs(proj.std().item() - 0.02 / math.sqrt(2 * cfg.n_layer)) < 0.0005
    assert model.transformer.h[0].attn.c_attn.bias.abs().max() == 0
    assert model.transformer.wte.weight[cfg.vocab_size:].abs().max() == 0  # padding rows


def test_untrained_loss_is_log_vocab():
    torch.manual_seed(0)
    cfg = small()
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (8, 64))
    tgt = torch.randint(0, cfg.vocab_size, (8, 64))
    _, loss = model(idx, tgt)
    # logits ~ N(0, (0.02*sqrt(64))^2) at init: expected loss ln(V) + var/2 ~ ln(V) + 0.013
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.05


def test_padding_logits_never_reach_the_loss():
    torch.manual_seed(0)
    model = GPT(small())
    idx = torch.randint(0, 1000, (2, 9))
    logits, loss = model(idx, idx)
    ref = F.cross_entropy(logits[..., :1000].reshape(-1, 1000), idx.reshape(-1))
    torch.testing.assert_close(loss, ref)
    with torch.no_grad():
        model.lm_head.weight[1000:].normal_()  # garbage in padding rows must not change the loss
    _, loss2 = model(idx, idx)
    torch.testing.assert_close(loss, loss2)


def test_ignore_index():
    torch.manual_seed(0)
    model = GPT(small())
    idx = torch.randint(0, 1000, (2, 9))
    tgt = idx.clone()
    tgt[:, :4] = -1
    logits, loss = model(idx, tgt)
    ref = F.cross_entropy(logits[:, 4:, :1000].reshape(-1, 1000), idx[:, 4:].reshape(-1))
    torch.testing.assert_close(loss, ref)


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT(small())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 1000, (4, 32))
    for _ in range(80):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1, loss.item()


def test_kv_cache_generation_equals_full_recompute():
    torch.manual_seed(0)
    model = GPT(small()).eval()
    prompt = torch.randint(0, 1000, (2, 5))
    out = model.generate(prompt, 12, temperature=0)
    seq = prompt
    for _ in range(12):  # no cache: recompute the whole sequence every step
        logits, _ = model(seq)
        seq = torch.cat([seq, logits[:, -1, :1000].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_sampling_is_seeded_and_never_picks_padding():
    model = GPT(small()).eval()
    with torch.no_grad():
        model.lm_head.weight[1000:] = 5.0  # padding logits would dominate if they were sampled
    prompt = torch.zeros(1, 1, dtype=torch.long)
    a = model.generate(prompt, 20, temperature=1.0, top_k=50, generator=torch.Generator().manual_seed(1))
    b = model.generate(prompt, 20, temperature=1.0, top_k=50, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.max() < 1000


def test_context_overflow_is_an_error():
    model = GPT(small(block_size=16))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_hf_mapping_round_trip_and_conv1d_semantics():
    torch.manual_seed(0)
    cfg = small(vocab_size=1000)
    src = GPT(cfg)
    hf = to_hf_state_dict(src)
    assert hf["transformer.wte.weight"].shape == (1000, 64)  # unpadded, as GPT2LMHeadModel stores it
    assert hf["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)  # Conv1D: (in, out)
    hf["transformer.h.0.attn.bias"] = torch.ones(1, 1, 64, 64)  # HF's causal-mask buffer is ignored
    dst = GPT(cfg)
    from_hf_state_dict(dst, hf)
    for (k, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(a, b), k
    # Conv1D computes x @ W + b: our Linear must give the same numbers
    x = torch.randn(3, 64)
    ref = x @ hf["transformer.h.1.mlp.c_fc.weight"] + hf["transformer.h.1.mlp.c_fc.bias"]
    torch.testing.assert_close(dst.transformer.h[1].mlp.c_fc(x), ref)
    idx = torch.randint(0, 1000, (2, 11))
    torch.testing.assert_close(src(idx)[0], dst(idx)[0], rtol=0, atol=0)


def test_hf_mapping_rejects_wrong_shapes():
    hf = to_hf_state_dict(GPT(small()))
    hf["transformer.wpe.weight"] = torch.zeros(32, 64)
    with pytest.raises(ValueError, match="transformer.wpe.weight"):
        from_hf_state_dict(GPT(small()), hf)


def test_triton_op_table_matches_torch_ops():
    """The model wired to the Triton kernels (CPU interpreter, fp32) gives the loss and grads of the torch path.
    Two layers: block 1's ln_1 and ln_f take the previous MLP output through the fused residual add."""
    from nanopara.model import TorchOps, TritonOps
    torch.manual_seed(0)
    cfg = small(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=200)
    idx = torch.randint(0, 200, (2, 19))
    tgt = idx.roll(-1, 1)
    tgt[0, :3] = -1
    results = []
    for ops in (TorchOps(), TritonOps(interpret=True)):
        torch.manual_seed(0)
        model = GPT(cfg)
        model._ops["cpu"] = ops
        _, loss = model(idx, tgt)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    # fp32 everywhere; different summation orders (tiled online softmax, blocked row reductions) -> ~1e-6
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)


def test_eager_triton_path_skips_the_custom_ops(monkeypatch):
    """Eager mode calls the autograd Functions directly: the torch.library custom ops (kernels/ops.py) cost ~300 us
    of host time per LayerNorm fwd+bwd and are only for torch.compile (tests/test_ops.py covers that path)."""
    from kernels import ops as kops
    from nanopara.model import TritonOps
    calls = []
    for name in ("attention", "layernorm", "add_layernorm"):
        monkeypatch.setattr(kops, name, lambda *a, _n=name, **k: calls.append(_n))
    model = GPT(small(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=200))
    model._ops["cpu"] = TritonOps(interpret=True)
    idx = torch.randint(0, 200, (1, 9))
    _, loss = model(idx, idx)
    loss.backward()
    assert calls == [] and torch.isfinite(loss)
