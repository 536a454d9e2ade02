"""Optimizer pieces: decay groups, LR schedule, clipping, fp16 loss scaling and skipped steps."""
import math

import torch

from nanopara.config import Config, ModelConfig, TrainConfig
from nanopara.dp import build_engine
from nanopara.mesh import Mesh
from nanopara.model import GPT
from nanopara.optim import LossScaler, lr_at, param_groups


def tiny_engine(clip=1.0):
    cfg = Config(device="cpu")
    cfg.model = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64, kernels="torch")
    cfg.train.grad_clip = clip
    torch.manual_seed(0)
    model = GPT(cfg.model)
    return model, build_engine(model, Mesh.build(device="cpu"), cfg)


def test_weight_decay_only_on_matrices_and_tied_weight_once():
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=64))
    decay, no_decay = param_groups(model.named_parameters(), 0.1)
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert sum(p is model.transformer.wte.weight for p in decay["params"]) == 1
    n = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert n == model.num_params(non_embedding=False)


def test_lr_schedule_warmup_then_cosine():
    t = TrainConfig(lr=1.0, warmup_steps=10, steps=110, min_lr_frac=0.1)
    assert lr_at(0, t) == 0.1 and lr_at(9, t) == 1.0  # linear warm-up reaches the peak at the last warm-up step
    assert abs(lr_at(60, t) - 0.55) < 1e-12  # half way through the cosine: (1 + 0.1) / 2
    assert abs(lr_at(110, t) - 0.1) < 1e-12 and lr_at(500, t) == 0.1
    assert all(lr_at(s, t) >= lr_at(s + 1, t) for s in range(10, 120))


def test_clipping_bounds_the_update_norm():
    model, engine = tiny_engine(clip=0.01)
    x = torch.randint(0, 64, (2, 8))
    _, loss = model(x, x)
    engine.backward(loss)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    norm = engine.step(0.0)  # lr 0: weights only move by weight decay (0 at lr 0)
    assert norm > 0.01
    assert math.isclose(norm, math.sqrt(sum(g.pow(2).sum().item() for g in grads.values())), rel_tol=1e-5)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_non_finite_gradients_skip_the_step():
    model, engine = tiny_engine()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, 64, (2, 8))
    _, loss = model(x, x)
    engine.backward(loss * float("inf"))
    norm = engine.step(1e-2)
    assert not math.isfinite(norm)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in model.parameters())  # grads cleared for the next step


def test_fp16_loss_scale_halves_on_overflow_and_grows_after_clean_steps():
    s = LossScaler(enabled=True, init_scale=1024.0, growth_interval=3)
    s.update(finite=False)
    assert s.scale == 512.0
    for _ in range(3):
        s.update(finite=True)
    assert s.scale == 1024.0
    restored = LossScaler(enabled=True)
    restored.load_state_dict(s.state_dict())
    assert restored.scale == 1024.0 and restored.good_steps == 3
    off = LossScaler(enabled=False)
    off.update(finite=False)
    assert off.scale == 1.0


def test_grad_scale_is_divided_out():
    """engine.step(grad_scale=S) on grads of S*loss gives the same update as step() on grads of loss."""
    results = []
    for scale in (1.0, 1024.0):
        model, engine = tiny_engine()
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        _, loss = model(x, x)
        engine.backward(loss * scale)
        norm = engine.step(1e-2, grad_scale=scale)
        results.append((norm, [p.detach().clone() for p in model.parameters()]))
    assert math.isclose(results[0][0], results[1][0], rel_tol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        # power-of-two scale: exact up to rounding of the clip coef
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
