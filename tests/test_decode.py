"""nanopara/decode.py: static-cache decoding equals GPT.generate and full forwards; rl.sample's static path equals
its dynamic one (EOT included); on a GPU, graph replays equal eager steps (fp32 and bf16 autocast)."""
import time

import pytest
import torch

from nanopara import decode, rl
from nanopara.config import ModelConfig
from nanopara.model import GPT


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: one thread is much faster than two fighting over a loaded machine's cores (as test_rl.py)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
    decode.clear_decoders()


def small(block=24, seed=0, **kw):
    """A tiny random GPT with weights N(0, 0.1): at GPT-2's init (0.02) greedy decoding mostly repeats the last
    token, which would make every comparison below trivially true."""
    torch.manual_seed(seed)
    base = dict(n_layer=2, n_head=4, n_embd=64, block_size=block, vocab_size=1000, vocab_multiple=128,
                kernels="torch")
    base.update(kw)
    model = GPT(ModelConfig(**base)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" not in name and p.dim() > 1:
                p.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("L", [1, 5])
@pytest.mark.parametrize("new", [6, 100])  # 100: cut to the context, the last step writes position block_size - 1
def test_greedy_equals_gpt_generate(B, L, new):
    model = small()
    idx = torch.randint(0, 1000, (B, L), generator=torch.Generator().manual_seed(B * 10 + L))
    want = model.generate(idx, new, temperature=0)
    got = decode.generate(model, idx, new, graph=False)
    assert got.shape == want.shape == (B, min(L + new, 24))
    assert torch.equal(got, want)


def test_sampling_equals_gpt_generate_seeded():
    """Same rule, same random numbers: temperature + top-k sampling draws the very tokens GPT.generate draws."""
    model = small()
    idx = torch.randint(0, 1000, (2, 3), generator=torch.Generator().manual_seed(7))
    want = model.generate(idx, 15, temperature=0.8, top_k=50, generator=torch.Generator().manual_seed(1))
    got = decode.generate(model, idx, 15, temperature=0.8, top_k=50, generator=torch.Generator().manual_seed(1),
                          graph=False)
    assert torch.equal(got, want)


def test_step_logits_equal_full_forward():
    """Teacher-forced: prefill a prompt, then step through a fixed sequence to the end of the context; each step's
    logits equal the full forward's at that position."""
    model = small(block=16)
    seq = torch.randint(0, 1000, (3, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(seq)[0][:, :, :1000]  # (3, 16, V)
    dec = decode.Decoder(model, 3, 16, torch.float32, graph=False)
    torch.testing.assert_close(dec.prefill(seq[:, :4]), full[:, 3], atol=1e-5, rtol=0)
    for t in range(4, 16):
        torch.testing.assert_close(dec.step(seq[:, t]), full[:, t], atol=1e-5, rtol=0, msg=f"position {t}")
    with pytest.raises(ValueError, match="all 16 positions"):
        dec.step(seq[:, 0])
    # a second prompt in the same decoder (another length): stale cache entries are masked, not cleared
    torch.testing.assert_close(dec.prefill(seq[:, :2]), full[:, 1], atol=1e-5, rtol=0)
    torch.testing.assert_close(dec.step(seq[:, 2]), full[:, 2], atol=1e-5, rtol=0)


def test_decoder_errors_and_reuse():
    model = small()
    with pytest.raises(ValueError, match="before prefill"):
        decode.Decoder(model, 1, 8, torch.float32, graph=False).step(torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        decode.Decoder(model, 1, 25, torch.float32, graph=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            decode.Decoder(model, 1, 8, torch.float32, graph=True)
    a = decode.decoder_for(model, 2, 10, torch.float32, False)
    assert decode.decoder_for(model, 2, 10, torch.float32, False) is a  # same shapes, same parameters: reused
    assert decode.decoder_for(model, 3, 10, torch.float32, False) is not a
    assert decode.decoder_for(small(), 2, 10, torch.float32, False) is not a  # another model
    assert not decode.graph_ok(model)  # CPU


def test_moe_model_decodes_eagerly():
    """MoE blocks run in the static-cache path (graph="auto" keeps them eager: moe.py's CPU path syncs)."""
    model = small(moe_experts=4, moe_top_k=2)
    idx = torch.randint(0, 1000, (2, 3), generator=torch.Generator().manual_seed(0))
    assert not decode.graph_ok(model)
    assert torch.equal(decode.generate(model, idx, 8), model.generate(idx, 8, temperature=0))


def test_rl_sample_static_equals_dynamic_with_eot():
    model = small(block=32)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8], [9, 10], [11, 12, 13]]
    free = rl.sample(model, prompts, 12, 0.0, eot=-1, sampler="dynamic")
    eot = free[1][3]  # a token the greedy continuation of row 1 emits: row 1 must stop at its 4th token or before
    static = rl.sample(model, prompts, 12, 0.0, eot=eot, sampler="static")
    dynamic = rl.sample(model, prompts, 12, 0.0, eot=eot, sampler="dynamic")
    assert static == dynamic
    assert len(static[1]) <= 4 and static[1][-1] == eot
    assert any(len(s) == 12 and eot not in s for s in static)  # and some row never emits it
    assert rl.sample(model, prompts, 12, 0.0, eot=-1, sampler="static") == free
    assert rl.sample(model, prompts, 12, 0.0, eot=eot) == dynamic  # "auto" on CPU: dynamic
    with pytest.raises(ValueError, match="sampler"):
        rl.sample(model, prompts, 4, 0.0, eot=eot, sampler="fast")


def test_every_row_at_eot_stops_early():
    """Once every row emitted EOT, decode stops at its next check and pads with EOT; rl cuts after the first."""
    model = small(block=48)
    with torch.no_grad():  # the final LayerNorm outputs its bias (ones): token 7's logit leads everywhere
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight[7] += 10.0
    out = decode.generate(model, torch.tensor([[1, 2], [3, 4]]), 40, temperature=1.0, eot=7,
                          generator=torch.Generator().manual_seed(0), graph=False, check_every=4)
    assert out.shape == (2, 42) and torch.all(out[:, 2:] == 7)
    assert next(reversed(decode._DECODERS.values())).n == 2 + 3  # stopped at the first check: 3 steps after prefill
    assert rl.sample(model, [[1, 2], [3, 4, 5]], 40, 1.0, 7, torch.Generator().manual_seed(0),
                     sampler="static") == [[7], [7]]


# ------------------------------------------------------------------------------------------------------------------
# GPU: graph replays against eager steps


def _tokens_per_s(fn, n_tokens):
    fn()  # warm-up (and, for graph=True, the capture)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return n_tokens / (time.perf_counter() - t0)


@pytest.mark.gpu
@pytest.mark.parametrize("bf16", [False, True])
def test_graph_equals_eager_on_cuda(bf16):
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=1000)).cuda().eval()
    idx = torch.randint(0, 1000, (4, 7), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16)
    with amp:
        eager = decode.generate(model, idx, 60, graph=False)
        graphed = decode.generate(model, idx, 60, graph=True)
        again = decode.generate(model, idx, 60, graph=True)  # the kept decoder: replays only
        assert torch.equal(graphed, eager) and torch.equal(again, eager)
        if not bf16:  # fp32: also the dynamic KV cache's tokens (bf16 rounds the masked attention differently)
            assert torch.equal(graphed, model.generate(idx, 60, temperature=0))
        dec = decode.decoder_for(model, 4, 67, torch.bfloat16 if bf16 else torch.float32, True)
        assert dec.graph is not None
        # step logits: graph replay against an eager decoder on the same tokens
        ref = decode.Decoder(model, 4, 67, dec.dtype, graph=False)
        torch.testing.assert_close(dec.prefill(idx), ref.prefill(idx))
        for t in range(7, 20):
            tok = eager[:, t]
            torch.testing.assert_close(dec.step(tok).clone(), ref.step(tok), atol=1e-4 if not bf16 else 2e-2,
                                       rtol=1e-4 if not bf16 else 2e-2)
        one = idx[:1]
        speed = {g: _tokens_per_s(lambda: decode.generate(model, one, 100, graph=g), 100) for g in (False, True)}
    print(f"\nbatch 1, {'bf16' if bf16 else 'fp32'}: eager {speed[False]:,.0f} tok/s, graph {speed[True]:,.0f} tok/s")
    with pytest.raises(ValueError, match="autocast"):  # a graph captured under one autocast state refuses another
        with torch.autocast("cuda", dtype=torch.float16, enabled=not bf16):
            dec.step(eager[:, 20])


@pytest.mark.gpu
def test_rl_sample_graph_equals_dynamic_on_cuda():
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=64, vocab_multiple=1)).cuda()
    prompts = [[1, 2, 3]] * 3 + [[4, 5]] * 2
    free = rl.sample(model, prompts, 20, 0.0, -1, sampler="dynamic")
    eot = free[0][5]
    assert rl.sample(model, prompts, 20, 0.0, eot) == rl.sample(model, prompts, 20, 0.0, eot, sampler="dynamic")


# ------------------------------------------------------------------------------------------------------------------
# left padding: prompts of different lengths in one batch


class OnePosition(decode.Decoder):
    """The decoder as it was before left padding: one (1, 1, T, T_max) mask and one (T,) position for the batch."""

    def _bind(self, slots):
        mask = (self.keys[None, :] <= slots[:, None])[None, None]
        for c in self.caches:
            c.pos, c.attn_mask = slots, mask
        return slots


def _prompts(lengths, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


def test_left_padded_batch_equals_each_prompt_alone():
    """Lengths 1, 4, 7 in one batch: each row's greedy tokens are its own decoding alone (and GPT.generate's), and
    teacher-forced on those tokens every step's logits match the lone decoder's within 1e-5."""
    model, new = small(block=24), 10
    prompts = _prompts([1, 4, 7])
    got = decode.generate(model, prompts, new, graph=False)
    for p, row in zip(prompts, got):
        assert row == decode.generate(model, [p], new, graph=False)[0]
        assert row == model.generate(torch.tensor([p]), new, temperature=0)[0, len(p):].tolist()
    assert len({tuple(r) for r in got}) == 3 and all(len(set(r)) > 2 for r in got)  # not degenerate
    L = 7
    dec = decode.Decoder(model, 3, L + new, torch.float32, graph=False)
    idx = torch.tensor([[999] * (L - len(p)) + p for p in prompts])  # any padding id
    batch = [dec.prefill(idx, [L - len(p) for p in prompts])]
    batch += [dec.step(torch.tensor([r[t] for r in got])) for t in range(new - 1)]
    for i, (p, row) in enumerate(zip(prompts, got)):
        one = decode.Decoder(model, 1, len(p) + new, torch.float32, graph=False)
        alone = [one.prefill(torch.tensor([p]))] + [one.step(torch.tensor([row[t]])) for t in range(new - 1)]
        for t, (a, b) in enumerate(zip(batch, alone)):
            torch.testing.assert_close(a[i], b[0], atol=1e-5, rtol=0, msg=f"row {i} step {t}")
    # the padding ids never matter; a second batch in the same decoder reuses its caches (stale slots masked)
    again = decode.Decoder(model, 3, L + new, torch.float32, graph=False)
    again.prefill(torch.zeros(3, 7, dtype=torch.long))  # fills every slot with other keys first
    torch.testing.assert_close(again.prefill(idx.masked_fill(idx == 999, 3), [6, 3, 0]), batch[0], atol=1e-6, rtol=0)


def test_padding_free_rows_equal_the_one_position_decoder_bit_for_bit():
    model = small(block=16)
    seq = torch.randint(0, 1000, (3, 16), generator=torch.Generator().manual_seed(3))
    a = decode.Decoder(model, 3, 16, torch.float32, graph=False)
    b = OnePosition(model, 3, 16, torch.float32, graph=False)
    assert torch.equal(a.prefill(seq[:, :5], [0, 0, 0]), b.prefill(seq[:, :5]))
    for t in range(5, 16):
        assert torch.equal(a.step(seq[:, t]), b.step(seq[:, t])), t


def test_list_prompts_fill_the_context_and_guard():
    """The longest prompt may fill the context up to block_size - max_new; beyond, a ValueError (the list API does
    not cut). EOT cuts each row after its first; empty inputs."""
    model, new = small(block=24), 6
    prompts = _prompts([24 - new, 2, 11], seed=9)
    got = decode.generate(model, prompts, new, graph=False)
    assert [len(r) for r in got] == [new] * 3
    for p, row in zip(prompts, got):
        assert row == model.generate(torch.tensor([p]), new, temperature=0)[0, len(p):].tolist()
    with pytest.raises(ValueError, match="exceeds the model's context of 24"):
        decode.generate(model, _prompts([24 - new + 1, 2]), new, graph=False)
    with pytest.raises(ValueError, match="at least one token"):
        decode.generate(model, [[1, 2], []], new, graph=False)
    with pytest.raises(ValueError, match="max_len 20"):
        decode.generate(model, prompts, new, graph=False, max_len=20)
    assert decode.generate(model, [], new) == []
    eot = got[1][2]
    cut = decode.generate(model, prompts, new, graph=False, eot=eot, max_len=24)  # a larger cache: same tokens
    assert cut == [r[:r.index(eot) + 1] if eot in r else r for r in got] and len(cut[1]) <= 3


def test_finished_callback_stops_the_batch_early():
    model = small(block=48)
    prompts = _prompts([2, 5])
    full = decode.generate(model, prompts, 40, graph=False)
    got = decode.generate(model, prompts, 40, graph=False, check_every=4, finished=lambda t: [t.shape[1] >= 6] * 2)
    assert got == [r[:8] for r in full]  # the check after 4 tokens says no, the one after 8 says yes
    assert next(reversed(decode._DECODERS.values())).n == 5 + 7


def test_rl_sample_static_equals_dynamic_mixed_lengths():
    """All prompts in one left-padded batch (or chunks of max_batch rows) = the dynamic path's length groups,
    greedy, with rows stopping at EOT and a prompt too long for max_new (cut to the context like the dynamic path)."""
    model = small(block=32)
    prompts = _prompts([1, 6, 3, 9, 3, 2, 24], seed=11)
    free = rl.sample(model, prompts, 12, 0.0, eot=-1, sampler="dynamic")
    assert len(free[6]) == 32 - 24  # cut to the context
    eot = free[3][4]
    dynamic = rl.sample(model, prompts, 12, 0.0, eot=eot, sampler="dynamic")
    assert sum(len(s) < 12 and s[-1] == eot for s in dynamic) >= 1 and any(len(s) == 12 for s in dynamic)
    for mb in (256, 3):
        assert rl.sample(model, prompts, 12, 0.0, eot=eot, sampler="static", max_batch=mb) == dynamic, mb
    assert rl.sample(model, prompts, 12, 0.0, eot=-1, sampler="static") == free
    assert rl._static_batches(prompts, 12, 32, 3) == [([3, 1, 2], 12), ([4, 5, 0], 12), ([6], 8)]  # longest first
    with pytest.raises(ValueError, match="max_batch"):
        rl.sample(model, prompts, 4, 0.0, eot=eot, sampler="static", max_batch=0)


@pytest.mark.gpu
@pytest.mark.parametrize("bf16", [True, False])
def test_left_padded_graph_equals_eager_on_cuda(bf16):
    """A left-padded batch of mixed lengths: graph replays = eager steps (tokens; bf16 autocast and fp32), and a
    second batch of other lengths replays the SAME captured graph (the pad counts are a static device buffer)."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=1000)).cuda().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" not in name and p.dim() > 1:
                p.normal_(0.0, 0.1)
    first, second = _prompts([1, 4, 7, 30, 13, 2]), _prompts([9, 30, 1, 1, 22, 5], seed=6)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        for prompts in (first, second):
            eager = decode.generate(model, prompts, 50, graph=False, max_len=96)
            graphed = decode.generate(model, prompts, 50, graph=True, max_len=96)
            assert graphed == eager
            if not bf16:  # fp32: each row also equals its own decoding alone
                assert graphed == [decode.generate(model, [p], 50, graph=False)[0] for p in prompts]
        # the single-row decoders above may have pushed the batch's out of the kept few: decode once more, then
        # the kept decoder's graph must serve another mix of lengths without a new capture
        decode.generate(model, first, 50, graph=True, max_len=96)
        dt = torch.bfloat16 if bf16 else torch.float32
        dec = decode.decoder_for(model, 6, 96, dt, True)
        graph = dec.graph
        assert graph is not None and decode.generate(model, second, 50, graph=True, max_len=96) == \
            decode.generate(model, second, 50, graph=False, max_len=96)
        assert dec.graph is graph  # replayed, not captured again
