"""Fine-grained MoE (issue #44 item 5): model.moe_hidden (each routed expert's width) and model.moe_shared (always-on
shared experts, one dense MLP of moe_shared * moe_hidden added to the routed output), and the gpt2_moe_fine preset.

The layer against the per-expert loop at an awkward width (40, not 4C), the shared MLP's output exactly added, the
active-parameter count (MFU) and the planner's, the preset's FLOPs a token against dense gpt2_124m (counted on
the meta device: nothing allocated), train.py building and checkpointing the preset on CPU, and an ep2 layer (gloo)
against the single-device layer with the shared expert replicated (its gradient: this rank's tokens only).
"""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train
from nanopara.cli import parse_args
from nanopara.config import ConfigError
from nanopara.consolidate import full_model_state
from nanopara.ep import apply_ep, gather_experts
from nanopara.mesh import Mesh
from nanopara.model import GPT, TorchOps
from nanopara.moe import MoEConfig, MoEMLP, active_params
from nanopara.planner import Model
from nanopara.presets import PRESETS
from nanopara.report import flops_per_token
from tests.distributed import spawn
from tests.shards import tiny_shards
from tests.test_ep import reference_runs

# the interpreter reads loop bounds loaded from memory (group offsets) through a 1-element array's __index__
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _block(seed=0, **kw):
    cfg = MoEConfig(**{**dict(n_embd=24, n_layer=2, moe_experts=5, moe_top_k=2, moe_hidden=40), **kw})
    torch.manual_seed(seed)
    m = MoEMLP(cfg)
    with torch.no_grad():  # nonzero biases and a sharper router than the init, so every term is exercised
        for p in m.parameters():
            if p.dim() == 2 and p is not m.router.weight and p.shape[0] == m.n_experts:  # expert biases
                p.normal_(std=0.3)
        m.router.weight.normal_(std=0.5)
    return m


def _max_rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def _fwd_bwd(m, x, impl):
    m = copy.deepcopy(m)
    m.impl = impl
    xl = x.clone().requires_grad_(True)
    y = m(xl)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return [y.detach(), xl.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("impl", ["sorted", "grouped_mm", "triton"])
@pytest.mark.parametrize("kw", [dict(), dict(moe_capacity=0.8, moe_shared=2, moe_top_k=3)])
def test_hidden_width_matches_loop_reference(impl, kw):
    m = _block(**kw)
    assert m.experts.c_fc.weight.shape == (5, 40, 24) and m.experts.c_proj.weight.shape == (5, 24, 40)
    assert m.experts.c_fc.bias.shape == (5, 40)
    x = torch.randn(3, 13, 24, generator=_gen(8))
    want = _fwd_bwd(copy.deepcopy(m).double(), x.double(), "loop")
    got = _fwd_bwd(m, x, impl)
    assert len(got) == len(want) == 2 + 5 + 4 * bool(m.shared)  # y, dx, router, experts (4), shared (4)
    for i, (a, b) in enumerate(zip(got, want)):
        assert _max_rel(a, b) <= 1e-5, (i, _max_rel(a, b))


def test_default_width_is_4c_and_no_shared():
    m = MoEMLP(MoEConfig(n_embd=24, n_layer=2, moe_experts=4, moe_top_k=2))
    assert m.experts.c_fc.weight.shape == (4, 96, 24) and m.shared is None
    assert not any(n.startswith("shared") for n, _ in m.named_parameters())


@pytest.mark.parametrize("ops", [None, TorchOps()])
def test_shared_expert_adds_its_dense_mlp(ops):
    """y(moe_shared=2) = y(no shared, same router and experts) + c_proj(gelu(c_fc(x))), c_fc 24 -> 2*40."""
    m = _block(moe_shared=2, moe_capacity=1.0)
    plain = _block(moe_capacity=1.0)
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("shared.")})
    sh = m.shared
    assert sh.c_fc.weight.shape == (80, 24) and sh.c_proj.weight.shape == (24, 80)
    assert abs(sh.c_proj.weight.std().item() - 0.02 / 2) < 0.004  # c_proj's GPT-2 init, 0.02 / sqrt(2 n_layer)
    with torch.no_grad():
        sh.c_fc.bias.normal_(std=0.3)
        sh.c_proj.bias.normal_(std=0.3)
    x = torch.randn(2, 7, 24, generator=_gen(3))
    dense = F.linear(F.gelu(F.linear(x, sh.c_fc.weight, sh.c_fc.bias), approximate="tanh"), sh.c_proj.weight,
                     sh.c_proj.bias)
    torch.testing.assert_close(m(x, ops), plain(x, ops) + dense, rtol=1e-6, atol=1e-6)
    m(x, ops).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in sh.parameters())


def test_active_params_count_shared_and_k_routed_experts():
    C, H, E, k, S = 24, 40, 5, 3, 2
    m = _block(moe_top_k=k, moe_shared=S)
    mlp = lambda h: 2 * C * h + h + C  # noqa: E731  (weights and biases of C -> h -> C)
    assert active_params(m) == E * C + mlp(S * H) + k * mlp(H)
    assert sum(p.numel() for p in m.parameters()) == E * C + mlp(S * H) + E * mlp(H)


def _meta_gpt(cfg):
    with torch.device("meta"):  # shapes only: the 330M-parameter preset costs no memory
        return GPT(cfg)


@pytest.mark.parametrize("name", ["gpt2_moe", "gpt2_moe_fine", "tiny_moe"])
def test_planner_counts_the_models_parameters(name):
    cfg = PRESETS[name]()
    model = _meta_gpt(cfg.model)
    pm = Model.from_config(cfg.model, name)
    assert pm.params() == sum(p.numel() for p in model.parameters())
    assert pm.params(active=True) == active_params(model)
    T = cfg.train.seq_len
    assert pm.flops_per_token(T) == flops_per_token(cfg.model, model.num_params(), T)


def test_fine_preset_active_flops_match_dense_124m():
    fine, dense = PRESETS["gpt2_moe_fine"](), PRESETS["gpt2_124m"]()
    m = fine.model
    assert (m.n_embd, m.n_layer, m.n_head, m.moe_every) == (768, 12, 12, 2)
    assert (m.moe_experts, m.moe_top_k, m.moe_hidden, m.moe_shared) == (32, 3, 768, 1)
    fm, dm = _meta_gpt(fine.model), _meta_gpt(dense.model)
    T = fine.train.seq_len
    f_fine = flops_per_token(fine.model, fm.num_params(), T)
    f_dense = flops_per_token(dense.model, dm.num_params(), T)
    assert abs(f_fine / f_dense - 1) < 0.01, f_fine / f_dense
    assert 320e6 < sum(p.numel() for p in fm.parameters()) < 340e6  # gpt2_moe's 8 x 4C of experts, cut in 32


def test_config_checks():
    with pytest.raises(ConfigError, match="out of range"):
        parse_args(["--preset=tiny_moe", "--model.moe_hidden=-1"])
    with pytest.raises(ConfigError, match="out of range"):
        parse_args(["--preset=tiny_moe", "--model.moe_shared=-2"])
    with pytest.raises(ValueError, match="moe_hidden"):
        MoEConfig(moe_hidden=-8)
    c = parse_args(["--preset=gpt2_moe_fine"]).model
    assert (c.moe_hidden, c.moe_shared) == (768, 1)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tiny_shards(tmp_path_factory.mktemp("fineshards"), "f", n=20000)


def test_fine_preset_trains_on_cpu_and_checkpoints(shards, tmp_path):
    """train.py --preset=gpt2_moe_fine on CPU at the preset's width (768, 32 experts of 768, top-3, 1 shared),
    two blocks and a small vocabulary; the checkpoint rebuilds the model (moe_hidden / moe_shared saved)."""
    out = tmp_path / "run"
    s = train.main(["--preset=gpt2_moe_fine", "--device=cpu", f"--out_dir={out}", f"--data.dataset={shards}",
                    "--model.n_layer=2", "--model.vocab_size=250", "--model.kernels=torch", "--train.micro_batch=2",
                    "--train.seq_len=64", "--train.tokens_per_step=128", "--train.steps=2", "--train.warmup_steps=1",
                    "--train.val_every=0", "--train.sample_every=0", "--train.log_every=1", "--ckpt.every=2"])
    assert len(s["losses"]) == 2 and all(np.isfinite(s["losses"]))
    sd, cfg = full_model_state(str(out))
    assert (cfg.moe_hidden, cfg.moe_shared, cfg.moe_experts) == (768, 1, 32)
    assert sd["transformer.h.1.mlp.experts.c_fc.weight"].shape == (32, 768, 768)
    assert sd["transformer.h.1.mlp.shared.c_fc.weight"].shape == (768, 768)
    model = GPT(cfg)
    model.load_state_dict(sd)  # strict


# ----------------------------------------------------------------------------------------------------------------
# expert parallel: the routed experts sharded, the shared one replicated


def _ep_layer():
    torch.manual_seed(0)
    return MoEMLP(MoEConfig(n_embd=8, n_layer=2, moe_experts=4, moe_top_k=2, moe_hidden=12, moe_shared=1))


def _ep_worker(rank, world):
    torch.set_num_threads(1)
    Mesh.build(dp=world, device="cpu")  # the default group
    mesh = Mesh.build(dp=world, device="cpu", ep=2)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(2, 5, 8, generator=g) for _ in range(world)]
    ref = _ep_layer()
    outs, grads = reference_runs(ref, xs)  # the full layer on every rank's tokens
    layer = _ep_layer()
    apply_ep(layer, mesh)
    assert layer.experts.c_fc.weight.shape == (2, 12, 8) and layer.shared.c_fc.weight.shape == (12, 8)
    x = xs[rank].clone().requires_grad_(True)
    y = layer(x)
    (y * y).sum().backward()
    torch.testing.assert_close(y, outs[rank][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x.grad, outs[rank][1], atol=1e-6, rtol=1e-5)
    lo, hi = rank * 2, rank * 2 + 2
    for n, p in layer.named_parameters():
        # my experts saw both ranks' tokens; the router and the shared expert this rank's only (dp reduces them)
        want = sum(gr[n] for gr in grads)[lo:hi] if n.startswith("experts.") else grads[rank][n]
        torch.testing.assert_close(p.grad, want, atol=1e-6, rtol=1e-5, msg=n)
    assert torch.equal(gather_experts(layer, mesh)["experts.c_proj.weight"], ref.experts.c_proj.weight)


def test_ep2_layer_with_hidden_and_shared_equals_single_device():
    spawn(_ep_worker, 2)
