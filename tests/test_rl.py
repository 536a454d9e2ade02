"""GRPO (nanopara/rl.py, rl.py): the math against plain loops, the sampler, a tiny run that learns, dp2 = 1 rank,
rl.py end to end (--oversample's kept groups too) and bench/post_train_demo.py at smoke sizes."""
import json
import math
import os

import pytest
import torch

import rl as rl_script
from nanopara import rl
from nanopara.checkpoint import save
from nanopara.config import ModelConfig
from nanopara.consolidate import full_model_state
from nanopara.data import get_tokenizer
from nanopara.mesh import Mesh
from nanopara.model import GPT
from nanopara.optim import param_groups
from nanopara.parallel import parallelize
from tests.distributed import spawn

EOT_TOY = 15  # the toy vocabulary's stop token


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: one thread is ~10x faster than two fighting over a loaded machine's cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def toy(vocab=16, block=32, seed=0, n_layer=2, n_embd=32):
    torch.manual_seed(seed)
    return GPT(ModelConfig(n_layer=n_layer, n_head=2, n_embd=n_embd, block_size=block, vocab_size=vocab,
                           vocab_multiple=1))


# ----------------------------------------------------------------------------------------------------------------
# the math against straightforward loops

def ref_advantages(rewards, eps=1e-4):
    out = []
    for group in rewards:
        m = sum(group) / len(group)
        sd = math.sqrt(sum((r - m) ** 2 for r in group) / len(group))
        out.append([(r - m) / (sd + eps) for r in group])
    return out


def test_group_advantages():
    r = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    got = rl.group_advantages(torch.tensor(r))
    torch.testing.assert_close(got, torch.tensor(ref_advantages(r)))
    assert torch.equal(got[2:], torch.zeros(2, 4)) and not got.isnan().any()  # all-equal groups: exactly 0
    torch.testing.assert_close(got[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-3, rtol=0)  # std 0.5, mean 0.5
    assert torch.equal(rl.group_advantages(torch.tensor([[1.0]])), torch.zeros(1, 1))  # G = 1: no NaN either


def ref_loss(logp, old, adv, mask, eps, ref=None, beta=0.0):
    total, n, clipped, kl = 0.0, 0, 0, 0.0
    for i in range(len(logp)):
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - old[i][t])
            loss = -min(ratio * adv[i], min(max(ratio, 1 - eps), 1 + eps) * adv[i])
            if ref is not None:
                d = ref[i][t] - logp[i][t]
                k3 = math.exp(d) - d - 1
                kl += k3
                loss += beta * k3
            total, n, clipped = total + loss, n + 1, clipped + (abs(ratio - 1) > eps)
    return total / n, clipped, kl


def test_policy_loss_hand_numbers():
    # ratio 1.5 with A = 1: clipped to 1.2 -> -1.2; ratio 0.5 with A = -1: min(-0.5, -0.8) -> 0.8; mean 0.2 / 2
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    loss, st = rl.policy_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]), 0.2)
    assert loss.item() == pytest.approx(-1.2)
    loss, _ = rl.policy_loss(logp[:, 1:], torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), 0.2)
    assert loss.item() == pytest.approx(0.8)
    assert st["clipped"].item() == 1


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_policy_loss_and_grad_against_loops(beta):
    g = torch.Generator().manual_seed(0)
    B, T = 5, 7
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()  # ratios 0.5 .. 2
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.3, -0.7, 0.0, 2.0, -1.1], dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.7).double()
    loss, st = rl.policy_loss(logp, old, adv, mask, 0.2, ref, beta)
    want, clipped, kl = ref_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, ref.tolist(), beta)
    assert 0 < clipped < mask.sum()  # both branches of the min are exercised
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert st["clipped"].item() == clipped and st["kl"].item() == pytest.approx(kl, rel=1e-12)
    loss.backward()
    assert torch.all(logp.grad[mask == 0] == 0)  # prompt and padding positions get no gradient
    num = torch.zeros(B, T, dtype=torch.float64)  # finite differences of the loop reference
    for i in range(B):
        for t in range(T):
            for s in (1, -1):
                x = logp.detach().clone()
                x[i, t] += s * 1e-6
                num[i, t] += s * ref_loss(x.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2,
                                          ref.tolist(), beta)[0] / 2e-6
    torch.testing.assert_close(logp.grad, num, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# sampling and log-probs

def test_sample_greedy_equals_generate_and_stops_at_eot():
    model = toy().eval()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8], [9, 1]]
    outs = rl.sample(model, prompts, max_new=10, temperature=0.0, eot=EOT_TOY)
    for p, new in zip(prompts, outs):
        want = model.generate(torch.tensor([p]), 10, temperature=0.0)[0, len(p):].tolist()
        cut = want.index(EOT_TOY) + 1 if EOT_TOY in want else len(want)
        assert new == want[:cut]
    # every token the EOT: each row stops after one token
    with torch.no_grad():  # the final LayerNorm outputs its bias (ones): EOT's logit leads by >= 10 * n_embd
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight[EOT_TOY] += 10.0
    assert rl.sample(model, prompts, 10, 1.0, EOT_TOY, torch.Generator().manual_seed(0)) == [[EOT_TOY]] * 4


def test_static_sampler_batches_mixed_lengths_and_samples():
    """sampler="static": prompts of many lengths (G copies each, as a step samples them) in left-padded chunks of
    max_batch rows = the dynamic path's length groups, greedy; seeded sampling is reproducible, in the vocabulary,
    and a completion is cut right after its EOT."""
    model = toy(vocab=64, block=40).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" not in name and p.dim() > 1:
                p.normal_(0.0, 0.2)  # GPT-2's init would mostly repeat one token
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (1, 9, 4, 4, 13, 2)] * 2
    eot = rl.sample(model, prompts, 10, 0.0, eot=-1, sampler="dynamic")[4][3]
    dynamic = rl.sample(model, prompts, 10, 0.0, eot=eot, sampler="dynamic")
    assert any(len(c) < 10 for c in dynamic) and any(len(c) == 10 for c in dynamic)
    for mb in (256, 5):
        assert rl.sample(model, prompts, 10, 0.0, eot=eot, sampler="static", max_batch=mb) == dynamic
    drawn = [rl.sample(model, prompts, 10, 1.0, eot, torch.Generator().manual_seed(1), sampler="static")
             for _ in range(2)]
    assert drawn[0] == drawn[1]
    assert all(0 < len(c) <= 10 and all(0 <= t < 64 for t in c) and eot not in c[:-1] for c in drawn[0])


def test_token_logprobs_ignore_padding():
    model = toy()
    prompts, completions = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10, EOT_TOY]]
    ro = rl.make_rollout(prompts, completions, torch.zeros(2), "cpu")
    lp = rl.token_logprobs(model, ro.tokens, ro.mask, temperature=0.7)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        s = torch.tensor([p + c])
        want = (model(s)[0][0, :-1, :16] / 0.7).log_softmax(-1).gather(1, s[0, 1:, None])[:, 0]
        torch.testing.assert_close(lp[i, len(p) - 1:len(p) + len(c) - 1], want[len(p) - 1:])
        assert ro.mask[i].sum() == len(c) and torch.all(lp[i][ro.mask[i] == 0] == 0)


# ----------------------------------------------------------------------------------------------------------------
# the update through the Trainer; a tiny run learns; dp2 equals one process

def toy_trainer(model, rows, micro=0, world=1, eps=1e-8, grad_clip=1.0):
    """The Trainer rl.py builds around a policy (AdamW betas 0.9 / 0.95, no weight decay)."""
    cfg = rl.trainer_config(model.cfg, rows=rows, micro=micro, world=world, device="cpu", eps=eps,
                            grad_clip=grad_clip)
    return parallelize(model, Mesh.build(dp=world, device="cpu"), cfg)


def toy_step(trainer, gen, prompts, G=8, target=7, updates=1, lr=1e-2):
    """One GRPO step on the toy task 'the first new token is `target`'; returns the mean reward sampled."""
    model = trainer.model
    rows = [p for p in prompts for _ in range(G)]
    new = rl.sample(model, rows, max_new=3, temperature=1.0, eot=EOT_TOY, generator=gen)
    r = torch.tensor([float(c[0] == target) for c in new]).view(-1, G)
    ro = rl.make_rollout(rows, new, rl.group_advantages(r).flatten(), "cpu")
    ro.old_logp = rl.token_logprobs(model, ro.tokens, ro.mask).detach()
    for _ in range(updates):
        rl.update(trainer, ro, lr, clip_eps=0.2)
    return r.mean().item()


def test_tiny_run_improves_reward():
    trainer = toy_trainer(toy(seed=1, n_layer=1, n_embd=16), rows=4 * 8)
    gen, data = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    rewards = []
    for _ in range(15):
        prompts = [torch.randint(0, 14, (int(n),), generator=data).tolist()
                   for n in torch.randint(2, 5, (4,), generator=data)]
        rewards.append(toy_step(trainer, gen, prompts, updates=2))
    assert sum(rewards[:3]) / 3 < 0.2 and sum(rewards[-3:]) / 3 > 0.9, rewards  # chance: 1/16


@pytest.mark.parametrize("micro", [0, 3])
def test_update_through_the_trainer_equals_the_plain_loop(micro):
    """rl.update (Trainer: loss_fn, accum, the engine's clip and AdamW) = the loop rl.py ran before it: the loss
    summed over response tokens / their count, one backward per micro-batch, clip_grad_norm_, torch's AdamW."""
    prompts, comps, adv = fixed_rollout()
    model, ref_model = toy(seed=3), toy(seed=3)
    trainer = toy_trainer(model, rows=4, micro=micro, grad_clip=0.05)  # clipping active
    opt = torch.optim.AdamW(param_groups(ref_model.named_parameters(), 0.0), lr=3e-3, betas=(0.9, 0.95))
    for it in range(3):
        ro = rl.make_rollout(prompts, comps, adv, "cpu")
        with torch.no_grad():
            ro.old_logp = rl.token_logprobs(model, ro.tokens, ro.mask) - 0.05
            ro.ref_logp = ro.old_logp + 0.1
        got = rl.update(trainer, ro, 3e-3, clip_eps=0.2, kl_coef=0.1)
        n, want = ro.mask.sum(), 0.0
        for s in range(0, 4, micro or 4):
            sl = slice(s, s + (micro or 4))
            logp = rl.token_logprobs(ref_model, ro.tokens[sl], ro.mask[sl])
            loss, _ = rl.policy_loss(logp, ro.old_logp[sl], ro.adv[sl], ro.mask[sl], 0.2, ro.ref_logp[sl], 0.1, n)
            loss.backward()
            want += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert got["loss"] == pytest.approx(want, rel=1e-5, abs=1e-7) and got["grad_norm"] == pytest.approx(norm)
        assert got["response_tokens"] == 12 and got["trained_tokens"] == ro.tokens.numel()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):  # summation order: fp32 rounding
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=f"{name} after update {it}")


def test_trainer_loss_fn_of_the_lm_loss_equals_the_default_step():
    """forward_backward(loss_fn=) runs a caller's loss under the Trainer's micro-steps: given the LM loss itself it
    takes the same step as the default path (two micro-batches, so accum's 1/m is in both)."""
    from nanopara.cli import parse_args
    cfg = parse_args(["--preset=tiny", "--device=cpu", "--model.n_layer=1", "--model.n_embd=32",
                      "--model.n_head=2", "--model.block_size=16", "--model.vocab_size=64", "--train.micro_batch=2",
                      "--train.seq_len=16", "--train.tokens_per_step=64", "--train.sample_tokens=0"])
    g = torch.Generator().manual_seed(0)
    batches = [(x[:, :-1], x[:, 1:]) for x in torch.randint(0, 64, (2, 2, 17), generator=g)]
    out = []
    for loss_fn in (None, lambda model, b: model(*b)[1]):
        torch.manual_seed(0)
        trainer = parallelize(GPT(cfg.model), Mesh.build(device="cpu"), cfg)
        loss = trainer.forward_backward(batches, loss_fn=loss_fn)
        out.append((loss, trainer.step(1e-2), [p.detach().clone() for p in trainer.model.parameters()]))
    assert torch.equal(out[0][0], out[1][0]) and out[0][1] == out[1][1]
    assert all(torch.equal(a, b) for a, b in zip(out[0][2], out[1][2]))


def fixed_rollout():
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 14, (int(n),), generator=g).tolist() for n in (3, 4, 2, 5)]
    comps = [torch.randint(0, 16, (int(n),), generator=g).tolist() for n in (2, 6, 1, 3)]
    adv = torch.randn(4, generator=g)
    return prompts, comps, adv


def rollout_step(model, prompts, comps, adv, world=1, kl=0.1):
    ro = rl.make_rollout(prompts, comps, adv, "cpu")
    with torch.no_grad():
        ro.old_logp = rl.token_logprobs(model, ro.tokens, ro.mask) - 0.05  # ratios away from 1: clipping active
        ro.ref_logp = ro.old_logp + 0.1
    # Adam's eps far above the gradients (an SGD of lr / eps): Adam with eps 1e-8 would blow c_attn's key-bias
    # gradient (rounding noise: a key bias cancels in the softmax) up to a full step of lr, so the two runs'
    # weights would differ by lr there
    trainer = toy_trainer(model, rows=len(prompts), micro=1, world=world, eps=0.5, grad_clip=0.0)
    return [rl.update(trainer, ro, 0.5, clip_eps=0.2, kl_coef=kl) for _ in range(2)]


def _dp_rank(rank, world, out):
    torch.set_num_threads(1)
    model = toy(seed=2)
    prompts, comps, adv = fixed_rollout()
    stats = rollout_step(model, prompts[rank::world], comps[rank::world], adv[rank::world], world)
    if rank == 0:
        torch.save({"sd": model.state_dict(), "stats": stats}, out)


def test_dp2_update_equals_one_process(tmp_path):
    model = toy(seed=2)
    stats = rollout_step(model, *fixed_rollout())
    spawn(_dp_rank, 2, str(tmp_path / "dp2.pt"))
    two = torch.load(tmp_path / "dp2.pt", weights_only=True)
    for k, v in model.state_dict().items():  # gradient sums in another order: fp32 rounding only
        torch.testing.assert_close(two["sd"][k], v, atol=1e-6, rtol=1e-5, msg=k)
    for a, b in zip(stats, two["stats"]):
        assert a["response_tokens"] == b["response_tokens"] == 12
        for k in ("loss", "clip_frac", "kl", "grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
    assert stats[1]["clip_frac"] > 0


@pytest.mark.gpu
def test_cuda_bf16_first_update_has_ratio_one():
    """Triton kernels + bf16 autocast: the recomputed old log-probs equal the update's own (no token is clipped even
    at clip_eps 1e-6), so the first update is the plain policy gradient."""
    model = toy(vocab=64, block=64, n_embd=64).cuda()
    amp = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    rows = [[1, 2, 3]] * 8 + [[4, 5]] * 8
    new = rl.sample(model, rows, 6, 1.0, 63, torch.Generator("cuda").manual_seed(0), amp)
    ro = rl.make_rollout(rows, new, torch.randn(16), "cuda")
    ro.old_logp = rl.token_logprobs(model, ro.tokens, ro.mask, amp=amp).detach()
    cfg = rl.trainer_config(model.cfg, rows=16, micro=0, world=1, device="cuda", dtype="bf16")
    st = rl.update(parallelize(model, Mesh.build(device="cuda"), cfg), ro, 1e-3, clip_eps=1e-6)
    assert st["clip_frac"] == 0 and math.isfinite(st["loss"])


# ----------------------------------------------------------------------------------------------------------------
# the script

@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """A tiny GPT-2-vocabulary checkpoint written as train.py writes one (one process). Its final LayerNorm outputs
    its bias, so every position favours " 1", " 2" and EOT: count answers of 1 or 2 are hit by chance, and the
    rewards of a group differ (a learning signal)."""
    d = tmp_path_factory.mktemp("policy")
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=64))
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        for t in get_tokenizer().encode(" 1 2") + [50256]:
            model.transformer.wte.weight[t] += 0.5  # logit +8 over the rest
    mesh = {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    save(str(d), 1, Mesh.build(dp=1, device="cpu"), {"model": model.state_dict(), "mesh": mesh},
         {"config": {"model": vars(model.cfg)}})
    return str(d)


@pytest.mark.parametrize("extra, want", [([], {"eps": 1e-8, "betas": (0.9, 0.95), "weight_decay": 0.0}),
                                         (["--adam_eps=1e-5", "--weight_decay=0.1"], {"eps": 1e-5,
                                                                                       "weight_decay": 0.1})])
def test_optimizer_keys_reach_the_optimizer(policy_dir, tmp_path, monkeypatch, extra, want):
    made = []
    real_step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: made.append(self) or real_step(self, *a, **k))
    argv = [f"--init={policy_dir}", f"--out_dir={tmp_path / 'r'}", "--device=cpu", "--steps=1", "--prompts=2",
            "--group=2", "--max_new=4", "--train_n=4", "--test_n=2", "--save=0", *extra]
    assert rl_script.main(argv) == 0 and made
    assert all(made[0].param_groups[0][k] == v for k, v in want.items()), made[0].param_groups[0]


def test_script_runs_and_writes_a_loadable_checkpoint(policy_dir, tmp_path):
    out = tmp_path / "rl"
    argv = [f"--init={policy_dir}", "--task=count", "--steps=2", "--prompts=2", "--group=2", "--max_new=4",
            "--train_n=20", "--test_n=4", "--eval_every=1", f"--out_dir={out}", "--device=cpu", "--kl_coef=0.1",
            "--updates=2", "--lr=1e-3"]
    assert rl_script.main(argv) == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 0 <= r["reward"] <= 1 and 1 <= r["response_len"] <= 4 and r["kl"] >= 0 and r["tokens_per_s"] > 0
    assert steps[0]["kl"] == 0 and steps[1]["kl"] > 0  # the policy moved away from the reference after step 1
    assert [r["step"] for r in recs if "test_exact_match" in r] == [0, 1, 2]
    sd, cfg = full_model_state(str(out))
    assert cfg.n_embd == 16 and not torch.equal(sd["transformer.h.0.mlp.c_fc.weight"],
                                                full_model_state(policy_dir)[0]["transformer.h.0.mlp.c_fc.weight"])
    assert rl_script.main(argv) == 2  # the run directory is taken: --overwrite=1 replaces it


def _script_rank(rank, world, argv):
    torch.set_num_threads(1)
    assert rl_script.main(argv) == 0


def test_script_on_two_gloo_ranks(policy_dir, tmp_path):
    """Sampling, metrics, held-out scoring and the checkpoint with dp=2 (completions differ from one process's:
    each rank samples with its own generator, so this checks the plumbing; test_dp2_update_equals_one_process
    checks the numbers)."""
    out = tmp_path / "rl2"
    spawn(_script_rank, 2, [f"--init={policy_dir}", "--task=count", "--steps=2", "--prompts=4", "--group=2",
                            "--max_new=4", "--train_n=20", "--test_n=5", f"--out_dir={out}", "--device=cpu"])
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["pass_at_group"] <= 1 for r in steps)
    assert [r["test_n"] for r in recs if "test_exact_match" in r] == [5, 5]
    assert full_model_state(str(out))[1].n_embd == 16


# --oversample (DAPO's dynamic sampling): the stubs below record what rl.py samples, builds and trains

def record_steps(monkeypatch):
    """Wraps rl.sample (sampling calls only: the held-out eval is greedy), rl.make_rollout and rl.update, as rl.py
    calls them; returns the lists they append to."""
    got = {"sampled": [], "rollouts": [], "updates": []}
    real_sample, real_make, real_update = rl.sample, rl.make_rollout, rl.update

    def sample(model, prompts, max_new, temperature=1.0, *args, **kw):
        new = real_sample(model, prompts, max_new, temperature, *args, **kw)
        if temperature > 0:
            got["sampled"].append((prompts, new))
        return new

    def make_rollout(prompts, completions, adv, device):
        got["rollouts"].append((prompts, completions, adv.clone()))
        return real_make(prompts, completions, adv, device)

    def update(trainer, ro, lr, **kw):
        out = real_update(trainer, ro, lr, **kw)
        got["updates"].append((ro.tokens.clone(), ro.mask.clone(), ro.adv.clone(), out))
        return out
    monkeypatch.setattr(rl, "sample", sample)
    monkeypatch.setattr(rl, "make_rollout", make_rollout)
    monkeypatch.setattr(rl, "update", update)
    return got


def step_lines(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "reward" in json.loads(x)]


def test_oversample_1_is_todays_step(policy_dir, tmp_path, monkeypatch):
    """--oversample=1 (the default) samples and trains what rl.py did before the key: the prompts drawn from
    f"{seed}/{step}", G copies each in that order, the completions the rank's generator gives them, the advantages
    of the checker's rewards; with and without the key the same rollouts, losses and metrics."""
    import random
    from nanopara import tasks
    from nanopara.sft import EOT, prompt_ids
    assert rl_script.Args().oversample == 1.0
    argv = [f"--init={policy_dir}", "--task=count", "--steps=2", "--prompts=3", "--group=4", "--max_new=4",
            "--train_n=20", "--test_n=2", "--device=cpu", "--save=0", "--lr=1e-3", "--seed=7"]
    runs = []
    for extra in ([], ["--oversample=1"]):
        with monkeypatch.context() as mp:
            got = record_steps(mp)
            assert rl_script.main(argv + [f"--out_dir={tmp_path / str(len(runs))}", *extra]) == 0
        runs.append((got, step_lines(tmp_path / str(len(runs)))))
    (got, recs), (got1, recs1) = runs
    assert len(got["updates"]) == len(got1["updates"]) == 2
    for a, b in zip(got["updates"], got1["updates"]):
        assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3])) and a[3] == b[3]
    timing = ("gen_tokens_per_s", "tokens_per_s", "step_s")
    assert [{k: v for k, v in r.items() if k not in timing} for r in recs] == \
        [{k: v for k, v in r.items() if k not in timing} for r in recs1]
    # step 1 by today's rule, from the starting policy
    enc, task = get_tokenizer(), tasks.get_task("count")
    train = tasks.make_examples("count", 20, "train", 1337)
    drawn = random.Random("7/1").sample(range(20), 3)
    rows = [prompt_ids(enc, train[i].prompt) for i in drawn for _ in range(4)]
    new = rl.sample(rl_script.load_policy(policy_dir), rows, 4, 1.0, EOT, torch.Generator().manual_seed(7))
    r = torch.tensor([task.check(enc.decode([t for t in c if t != EOT]), train[i].answer)
                      for i, c in zip([i for i in drawn for _ in range(4)], new)]).view(3, 4)
    want = rl.make_rollout(rows, new, rl.group_advantages(r).flatten(), "cpu")
    tokens, mask, adv, _ = got1["updates"][0]
    assert torch.equal(tokens, want.tokens) and torch.equal(mask, want.mask) and torch.equal(adv, want.adv)
    assert recs1[0]["reward"] == r.sum().item() / r.numel()
    assert recs1[0]["informative_groups"] == pytest.approx(1 - recs1[0]["zero_adv_groups"])  # all groups trained


@pytest.mark.parametrize("mixed", [{1, 4, 6}, {0, 2, 3, 5, 7}])
def test_oversample_trains_the_informative_groups_first(policy_dir, tmp_path, monkeypatch, mixed):
    """P = 4 prompts, F = 2: 8 groups sampled. A stub checker gives the groups at the positions in `mixed` (sampled
    order) rewards 1, 0, 1, 0 and the others all 1 or all 0, so the kept groups are predictable: the mixed ones in
    sampled order, then the first all-equal ones to make 4. The update has 4 x G rows; reward, pass_at_group and
    zero_adv_groups are of all 8 groups; flop_tokens counts every sampled row (a hand count)."""
    import random
    from nanopara import tasks
    from nanopara.sft import prompt_ids
    P, G, F, seed = 4, 4, 2.0, 5
    drawn = random.Random(f"{seed}/1").sample(range(40), 8)
    kind = {i: "mixed" if g in mixed else ("one" if g % 2 else "zero") for g, i in enumerate(drawn)}
    calls = {}

    def check(text, answer):
        if answer.startswith("test"):
            return 0.0
        i = int(answer[len("train"):])
        calls[i] = calls.get(i, 0) + 1
        return {"mixed": float(calls[i] % 2), "one": 1.0, "zero": 0.0}[kind[i]]

    def examples(name, n, split, seed, gsm8k=""):  # distinct prompts, the index as the answer
        return [tasks.Example(f"How many times does {i} appear in {split}?", "", f"{split}{i}") for i in range(n)]
    monkeypatch.setattr(tasks, "make_examples", examples)
    monkeypatch.setattr(tasks, "get_task", lambda name: tasks.Task(name, check, None))
    got = record_steps(monkeypatch)
    out = tmp_path / "rl"
    argv = [f"--init={policy_dir}", "--task=count", "--steps=1", f"--prompts={P}", f"--group={G}", "--max_new=4",
            "--train_n=40", "--test_n=2", f"--out_dir={out}", "--device=cpu", "--save=0", f"--seed={seed}",
            f"--oversample={F}"]
    assert rl_script.main(argv) == 0
    (rows, new), = got["sampled"]
    enc = get_tokenizer()
    train_ids = [prompt_ids(enc, ex.prompt) for ex in examples("count", 40, "train", 0)]
    assert rows == [train_ids[i] for i in drawn for _ in range(G)]  # 8 groups sampled, in drawn order
    keep = sorted((sorted(mixed) + [g for g in range(8) if g not in mixed])[:P])
    (prompts, comps, adv), = got["rollouts"]
    assert prompts == [train_ids[drawn[g]] for g in keep for _ in range(G)]
    assert comps == [new[g * G + j] for g in keep for j in range(G)]
    informative = [g in mixed for g in keep for _ in range(G)]
    assert all((a != 0) == m for a, m in zip(adv.tolist(), informative))
    (tokens, _, _, up), = got["updates"]
    assert tokens.shape[0] == P * G
    (rec,) = step_lines(out)
    n_mixed, n_one = len(mixed), sum(kind[i] == "one" for i in drawn)
    assert rec["informative_groups"] == min(n_mixed, P) / P
    assert rec["reward"] == (n_mixed * 0.5 + n_one) / 8 and rec["pass_at_group"] == (n_mixed + n_one) / 8
    assert rec["zero_adv_groups"] == (8 - n_mixed) / 8
    sampled = sum(len(p) + len(c) for p, c in zip(rows, new))  # 8 x G rows, trained or not
    trained = sum(len(prompts[k]) + len(comps[k]) for k in range(P * G))
    assert sampled > trained and up["trained_tokens"] == tokens.numel()
    # sampling + the no-grad old log-probs forward + 3 x the update's tokens (padding counted)
    assert rec["flop_tokens"] == sampled + tokens.numel() + 3 * tokens.numel()


def _oversample_rank(rank, world, argv, out):
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        got = record_steps(mp)
        assert rl_script.main(argv) == 0
    torch.save({"sampled": got["sampled"], "rollouts": [(p, c, a.tolist()) for p, c, a in got["rollouts"]],
                "rows": [u[0].shape[0] for u in got["updates"]]}, f"{out}.{rank}")


def test_oversample_on_two_gloo_ranks(policy_dir, tmp_path):
    """dp = 2, P = 4, F = 1.5: 3 groups a rank, the ranks' shares of one global draw of 6 (as without the key: drawn
    from f"{seed}/{step}", split by rank); each rank trains 2 groups (2 x G rows: the ranks stay in lockstep), kept
    in sampled order; informative_groups counts both ranks' trained groups."""
    import random
    from nanopara import tasks
    from nanopara.sft import prompt_ids
    out, G = tmp_path / "rl", 2
    argv = [f"--init={policy_dir}", "--task=count", "--steps=2", "--prompts=4", f"--group={G}", "--max_new=4",
            "--train_n=20", "--test_n=2", f"--out_dir={out}", "--device=cpu", "--save=0", "--oversample=1.5"]
    spawn(_oversample_rank, 2, argv, str(tmp_path / "got"))
    ranks = [torch.load(tmp_path / f"got.{r}", weights_only=False) for r in range(2)]
    enc = get_tokenizer()
    train_ids = [prompt_ids(enc, ex.prompt) for ex in tasks.make_examples("count", 20, "train", 1337)]
    recs = step_lines(out)
    for step in (1, 2):
        drawn = random.Random(f"1337/{step}").sample(range(20), 6)
        informative = 0
        for r, got in enumerate(ranks):
            rows, new = got["sampled"][step - 1]
            assert rows == [train_ids[i] for i in drawn[r::2] for _ in range(G)]
            prompts, comps, adv = got["rollouts"][step - 1]
            assert got["rows"][step - 1] == len(prompts) == 2 * G
            groups = [rows.index(prompts[k]) // G for k in range(0, 2 * G, G)]  # distinct prompts: unambiguous
            assert groups == sorted(groups) and comps == [new[g * G + j] for g in groups for j in range(G)]
            informative += sum(any(a != 0 for a in adv[k:k + G]) for k in range(0, 2 * G, G))
        assert recs[step - 1]["informative_groups"] == informative / 4


@pytest.mark.parametrize("extra, fragment", [
    (["--group=1"], "--group must be >= 2"), (["--task=chess"], "unknown task"), (["--lr=0"], "--lr must be"),
    (["--temperature=0"], "--temperature"), (["--grpup=4"], "did you mean --group"), (["--init=/nope"], "no such"),
    (["--max_new=60"], "exceeds the policy's context"), (["--prompts=3"], None),
    (["--adam_eps=0"], "--adam_eps"), (["--test_seed=-1"], "--test_seed must be"), (["--adam_eps=1e-5"], None),
    (["--optim=sgd"], "unknown key --optim"), (["--oversample=0.5"], "--oversample must be in [1, 16]"),
    (["--oversample=17"], "--oversample must be in [1, 16]"), (["--oversample=3"], "more than --train_n=4"),
    (["--oversample=1.5"], None),
])
def test_user_errors_are_one_line(policy_dir, tmp_path, capsys, extra, fragment):
    argv = [f"--init={policy_dir}", f"--out_dir={tmp_path / 'r'}", "--device=cpu", "--steps=1", "--prompts=2",
            "--group=2", "--max_new=4", "--train_n=4", "--test_n=2", *extra]
    code = rl_script.main(argv)
    err = capsys.readouterr().err
    if fragment is None:  # a valid variant: runs
        assert code == 0
        return
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and fragment in err, err
    assert not os.path.exists(tmp_path / "r" / "metrics.jsonl")


# ----------------------------------------------------------------------------------------------------------------
# bench/post_train_demo.py: seeds, one held-out set, the control, the report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def demo_module():
    import importlib.util
    import sys
    bench = os.path.join(ROOT, "bench")
    if bench not in sys.path:  # the demo imports bench/harness.py beside it (whatever ran before this test)
        sys.path.insert(0, bench)
    spec = importlib.util.spec_from_file_location("post_train_demo", os.path.join(bench, "post_train_demo.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def run_demo(out, *extra):
    """The demo's smoke sizes on CPU, train.py and rl.py inside its one process (a fork of the test's server, as
    `python bench/post_train_demo.py` would run it without starting python and torch again); its rows."""
    from tests.distributed import run_script
    run_script(os.path.join(ROOT, "bench", "post_train_demo.py"), f"--out={out}", "--device=cpu", "--smoke=1",
               "--inproc=1", *extra, logs=f"{out}_stdout", cwd=ROOT)
    return [json.loads(line) for line in (out / "post_train.jsonl").read_text().splitlines()]


def test_demo_runs_of_other_example_counts_share_a_work_directory(tmp_path):
    """Each (task, examples, row length) gets its own SFT shards under --work, so a second demo with another
    --examples in the same --work prepares its own (it used to stop on prepare.py's 'prepared with other settings'
    with a traceback); a clash that remains is one line, not a traceback."""
    demo = demo_module()
    a = demo.parse([f"--out={tmp_path}", "--smoke=1", "--device=cpu"])
    b = demo.parse([f"--out={tmp_path}", "--smoke=1", "--device=cpu"])
    b.examples = 200  # (--smoke sets its own count)
    for args in (a, b, a):
        demo.prepare(args)
        assert os.path.isdir(os.path.join(args.work, "shards", demo.sft_dataset(args)))
    assert demo.sft_dataset(a) != demo.sft_dataset(b)
    train_jsonl = os.path.join(a.work, "data", f"{a.task}_{a.examples}.jsonl")
    with open(train_jsonl, "a") as f:  # the same name, other contents: prepare.py's settings check says so
        f.write('{"prompt": "1+1", "response": "2"}\n')
    with pytest.raises(SystemExit, match="post_train_demo: .*prepared with other settings"):
        demo.prepare(a)


def test_demo_recipes_as_measured(tmp_path):
    """The recipes' labelled-example counts are the measured ones (results/post_train_small_os4_ex15k_h100.txt,
    post_train_base_h100.txt): small from scratch on 15,000, small_base from a pre-trained base on 5,000 (at 15,000
    the base's SFT leaves RL +5.7 points); small_base differs from small in nothing else, and an explicit
    --examples still wins."""
    demo = demo_module()
    small, base = (demo.parse([f"--out={tmp_path}", f"--recipe={r}"]) for r in ("small", "small_base"))
    assert (small.examples, base.examples, small.tag, base.tag) == (15_000, 5_000, "small", "small_base")
    same = {k for k in demo.RECIPES["small"] if k != "examples"}
    assert same and all(getattr(small, k) == getattr(base, k) for k in same)
    assert demo.parse([f"--out={tmp_path}", "--recipe=small_base", "--examples=700"]).examples == 700


def test_demo_without_its_tokenizer_stops_in_one_line_before_any_work(tmp_path, monkeypatch):
    """Offline without tiktoken's cache (a GPU machine without the mirror: it happened, 2026-12-07) the demo stopped
    with a traceback from inside the data step; now one line, before the work directory is made."""
    demo = demo_module()

    def offline():
        raise RuntimeError("cannot load tiktoken's GPT-2 encoding (ConnectionError: ...); offline, set "
                           "TIKTOKEN_CACHE_DIR")
    monkeypatch.setattr(demo, "get_tokenizer", offline)
    with pytest.raises(SystemExit, match="^post_train_demo: cannot load tiktoken's GPT-2 encoding"):
        demo.main([f"--out={tmp_path / 'out'}", "--smoke=1", "--device=cpu"])
    assert not os.path.exists(tmp_path / "out" / "work")


def test_demo_generation_speed_runs_on_cpu():
    """bench/post_train_demo.py's generation speed (--gen_speed=1), in this process."""
    rows = demo_module().generation_speed(toy(vocab=64, block=16), torch.device("cpu"), batches=(1, 3), prompt=4,
                                          new=5)
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["rl_sample_tokens_per_s"] > 0 and r["model_generate_tokens_per_s"] > 0 for r in rows), rows


def test_plot_draws_a_post_train_record(tmp_path):
    """bench/plot.py on a post_train_demo record (.json, and a .jsonl line chosen by --index)."""
    pytest.importorskip("matplotlib")
    import subprocess
    import sys
    rec = {"task": "digits", "train_examples": 20, "gpu": "cpu", "date": "2026-11-27T00:00:00", "rl_from_step": 2,
           "sft_final_exact_match": 0.1, "sft_curve": [{"step": 1, "test_exact_match": 0.0},
                                                      {"step": 2, "test_exact_match": 0.1}],
           "rl_runs": [{"lr": 2e-5, "curve": [{"step": 0, "test_exact_match": 0.1},
                                              {"step": 3, "test_exact_match": 0.3}],
                        "reward": [{"step": s, "reward": 0.1 * s} for s in (1, 2, 3)]}]}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "a.json").write_text(json.dumps(rec))
    (tmp_path / "b.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "rl_runs": []}) + "\n")
    for args, png in ((["a.json"], "a.png"), (["b.jsonl", "--index=0", "--out=c.png"], "c.png")):
        r = subprocess.run([sys.executable, os.path.join(root, "bench", "plot.py"), *args], cwd=tmp_path,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert (tmp_path / png).stat().st_size > 1000


@pytest.mark.timeout_s(180)
def test_demo_two_seeds_one_held_out_set_a_fair_control_and_the_report(tmp_path):
    """post_train_demo --smoke=1 --seeds=1,2 (~15 s): per seed SFT (train.py --seed), RL (rl.py --seed) and the
    continued-SFT control; every score on the one held-out set; the control's compute = RL's to within one SFT step;
    the report row's mean / std / min / max are those of the seed rows."""
    import statistics
    from nanopara import tasks
    rows = run_demo(tmp_path, "--seeds=1,2")
    seeds, (rep,) = [r for r in rows if r["kind"] == "seed"], [r for r in rows if r["kind"] == "report"]
    assert [r["seed"] for r in seeds] == [1, 2] and rep["seeds"] == [1, 2]
    held_out = tasks.make_examples("digits", 16, "test", tasks.TEST_SEED)
    assert tasks.make_examples("digits", 16, "test", tasks.TEST_SEED) == held_out  # nothing but TEST_SEED picks it
    runs = tmp_path / "work" / "runs"
    losses = []
    for r in seeds:
        run = runs / f"smoke_scratch_s{r['seed']}"
        # the held-out prompts: one set for SFT's scores, RL's and the control's, whatever the seed
        assert r["held_out"] == {"seed": tasks.TEST_SEED, "n": 16, "sha1": tasks.digest(held_out)}
        assert r["rl_test_set"] == [tasks.digest(held_out)] and rep["held_out"] == [tasks.digest(held_out)]
        # the seeds reach SFT (initial weights: its first loss) and RL (sampling)
        losses.append(json.loads((run / "sft" / "metrics.jsonl").read_text().splitlines()[0])["loss"])
        assert json.loads((run / "rl" / "config.json").read_text())["rl"]["seed"] == r["seed"]
        # RL starts from SFT's last checkpoint: its step-0 score is SFT's final one
        assert r["rl_start_exact_match"] == r["sft_final_exact_match"] == r["sft_curve"][-1]["test_exact_match"]
        assert [c["step"] for c in r["sft_curve"]] == [2, 4]
        # the control: continued SFT for RL's compute (forward-token equivalents), counted by train.py's steps
        rl_steps = [json.loads(x) for x in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
        assert r["rl_flop_tokens"] == [x for x in rl_steps if "reward" in x][-1]["flop_tokens"] > 0
        ctl = [json.loads(x) for x in (run / "control" / "metrics.jsonl").read_text().splitlines()]
        assert len([x for x in ctl if "loss" in x and "val_loss" not in x]) == r["control_steps"]
        tok = r["sft_tokens_per_step"]
        assert tok == 4 * 64 and r["control_flop_tokens"] == 3 * tok * r["control_steps"]
        assert r["rl_flop_tokens"] <= r["control_flop_tokens"] < r["rl_flop_tokens"] + 3 * tok
        assert r["control_curve"][-1]["step"] == r["control_steps"]
        assert r["gain_over_best"] == pytest.approx(100 * (r["rl_final_exact_match"] - max(
            r["sft_final_exact_match"], r["control_final_exact_match"])))
    assert losses[0] != losses[1]
    for m in ("sft_final_exact_match", "rl_final_exact_match", "control_final_exact_match", "gain_over_best"):
        v = [r[m] for r in seeds]
        assert rep[m] == {"mean": statistics.mean(v), "std": statistics.stdev(v), "min": min(v), "max": max(v),
                          "values": v}, m
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "post_train.png").stat().st_size > 1000
    except ImportError:  # the plot extra is optional
        pass


@pytest.mark.timeout_s(180)
def test_demo_arms_share_the_sft_run(tmp_path):
    """--arm: a second RL arm from each seed's one SFT checkpoint, at its own lr and rl.py keys, with its own control;
    a row and a report per arm (tag+name), the SFT fields the same in both."""
    rows = run_demo(tmp_path, "--seeds=1", "--arm=os2:5e-4:--oversample=2")
    seeds = {r["tag"]: r for r in rows if r["kind"] == "seed"}
    assert sorted(seeds) == ["smoke", "smoke+os2"]
    assert sorted(r["tag"] for r in rows if r["kind"] == "report") == ["smoke", "smoke+os2"]
    base, arm = seeds["smoke"], seeds["smoke+os2"]
    for k in ("sft_curve", "sft_final_exact_match", "sft_train_exact_match", "held_out"):
        assert base[k] == arm[k], k
    assert (arm["rl_lr"], arm["rl_args"]) == (5e-4, "--oversample=2") and base["rl_lr"] == 1e-3
    run = tmp_path / "work" / "runs" / "smoke_scratch_s1"
    cfg = json.loads((run / "rl_os2" / "config.json").read_text())["rl"]
    assert (cfg["lr"], cfg["oversample"]) == (5e-4, 2.0)
    assert json.loads((run / "rl" / "config.json").read_text())["rl"]["oversample"] == 1
    assert (run / "control_os2" / "metrics.jsonl").exists()
    demo = demo_module()
    with pytest.raises(SystemExit, match="NAME:LR:ARGS"):
        demo.parse([f"--out={tmp_path}", "--arm=os2"])


@pytest.mark.timeout_s(180)
def test_demo_arm_that_fails_loses_only_its_own_row(tmp_path):
    """An arm whose rl.py stops (here on a bad key) is reported; the seed's other arms keep their rows and report."""
    rows = run_demo(tmp_path, "--seeds=1", "--control=0", "--arm=bad:1e-3:--oversample=0")
    assert [r["tag"] for r in rows if r["kind"] == "seed"] == ["smoke"]
    assert [r["tag"] for r in rows if r["kind"] == "report"] == ["smoke"]
    said = "".join(f.read_text() for f in (tmp_path.parent / f"{tmp_path.name}_stdout").glob("stdout.*"))
    assert "smoke+bad seed 1 failed: rl.py failed" in said


def test_demo_report_of_seed_rows(tmp_path):
    """--report: rows of several files grouped by recipe, start and GPU; mean, sample std, min, max; the goal (RL over
    the better baseline: mean >= 10 points, every seed >= 5)."""
    demo = demo_module()

    def seed_row(seed, rl_em, gpu="H100", init="scratch"):
        sft, ctl = 0.10, 0.12
        r = {"kind": "seed", "tag": "t", "init": init, "task": "digits", "gpu": gpu, "seed": seed,
             "held_out": {"sha1": "abc"}, "seconds": {"total": 100.0 + seed}, "sft_final_exact_match": sft,
             "rl_final_exact_match": rl_em, "control_final_exact_match": ctl}
        return {**r, **demo.gains(r)}
    rows = [seed_row(1, 0.30), seed_row(2, 0.20), seed_row(3, 0.25), seed_row(1, 0.13, gpu="H200"),
            seed_row(1, 0.40, init="base")]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[2:]) + json.dumps(
        {"kind": "report", "tag": "old"}) + "\n")
    demo.main(["--out", str(tmp_path / "rep"), "--report", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")])
    reps = [json.loads(x) for x in (tmp_path / "rep" / "post_train.jsonl").read_text().splitlines()]
    by = {(r["init"], r["gpu"]): r for r in reps}
    assert set(by) == {("scratch", "H100"), ("scratch", "H200"), ("base", "H100")}
    h100 = by[("scratch", "H100")]
    g = h100["gain_over_best"]
    assert h100["seeds"] == [1, 2, 3] and g["values"] == pytest.approx([18.0, 8.0, 13.0])
    assert g["mean"] == pytest.approx(13.0) and g["std"] == pytest.approx(5.0) and (g["min"], g["max"]) == \
        pytest.approx((8.0, 18.0))
    assert h100["goal_met"] and not by[("scratch", "H200")]["goal_met"]  # +1 point
    assert by[("scratch", "H200")]["gain_over_best"]["std"] == 0.0  # one seed
    assert h100["rl_final_exact_match"]["mean"] == pytest.approx(0.25)


@pytest.mark.timeout_s(120)
def test_demo_from_a_pre_trained_base(tmp_path):
    """--base with --pretrain_steps: the base is trained once (here on random-token shards), SFT starts from it
    (train.py --ckpt.init_from), and a second run reuses the checkpoint instead of training it again."""
    from nanopara.data import write_shard
    import numpy as np
    rng = np.random.default_rng(0)
    for split, n in (("train_000001", 20000), ("val_000000", 3000)):
        write_shard(str(tmp_path / f"pt_{split}.bin"), rng.integers(0, 50257, n))
    base = tmp_path / "base"
    args = [f"--base={base}", "--pretrain_steps=2", f"--pretrain_data={tmp_path}/pt_*.bin", "--seeds=1",
            "--control=0", f"--work={tmp_path / 'work'}"]
    rows = run_demo(tmp_path / "a", *args)
    (b,), (s,) = [r for r in rows if r["kind"] == "base"], [r for r in rows if r["kind"] == "seed"]
    assert b["pretrain_steps"] == 2 and b["val_loss"] > 0 and s["init"] == "base" and s["base"] == str(base)
    sft_log = tmp_path / "work" / "runs" / "smoke_base_s1" / "sft.log"
    assert "initialised from trainer checkpoint" in sft_log.read_text()
    mtime = (base / "metrics.jsonl").stat().st_mtime
    demo = demo_module()
    again = demo.pretrain(demo.parse([f"--out={tmp_path / 'b'}", "--device=cpu", "--smoke=1", *args]))
    assert (base / "metrics.jsonl").stat().st_mtime == mtime and again["val_loss"] == b["val_loss"]  # kept


