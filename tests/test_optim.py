"""Optimizer pieces: decay groups, LR schedule, clipping, fp16 loss scaling and skipped steps.

The engine's step has two paths (engine.Engine.step): CPU reads the norm first; GPU (`async_step`) hands the clip
divisor and the skip flag to the fused AdamW kernel as tensors and reads the norm last. The clipping, skipping and
grad-scale tests run both, the GPU path here on CPU with torch's fused CPU AdamW (same grad_scale / found_inf).
"""
import math

import pytest
import torch

from nanopara.config import Config, ModelConfig, TrainConfig
from nanopara.parallel import build_engine
from nanopara.mesh import Mesh
from nanopara.model import GPT
from nanopara.optim import LossScaler, lr_at, param_groups


def tiny_engine(clip=1.0, async_step=False):
    cfg = Config(device="cpu")
    cfg.model = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64, kernels="torch")
    cfg.train.grad_clip = clip
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine = build_engine(model, Mesh.build(device="cpu"), cfg)
    if async_step:  # the GPU path: a fused AdamW (CPU has one too), norm read after the update
        t = cfg.train
        engine.optimizer = torch.optim.AdamW(param_groups(model.named_parameters(), t.weight_decay), lr=t.lr,
                                             betas=(t.beta1, t.beta2), eps=t.eps, fused=True)
        engine.async_step = True
    return model, engine


PATHS = pytest.mark.parametrize("async_step", [False, True], ids=["norm-first", "norm-last"])


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


@PATHS
def test_clipping_bounds_the_update_norm(async_step):
    model, engine = tiny_engine(clip=0.01, async_step=async_step)
    x = torch.randint(0, 64, (2, 8))
    _, loss = model(x, x)
    engine.backward(loss)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    norm = engine.step(0.0)  # lr 0: weights only move by weight decay (0 at lr 0)
    assert norm > 0.01
    assert math.isclose(norm, math.sqrt(sum(g.pow(2).sum().item() for g in grads.values())), rel_tol=1e-5)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


@PATHS
def test_non_finite_gradients_skip_the_step(async_step):
    model, engine = tiny_engine(async_step=async_step)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, 64, (2, 8))
    _, loss = model(x, x)
    engine.backward(loss * float("inf"))
    norm = engine.step(1e-2)
    assert not math.isfinite(norm)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in model.parameters())  # grads cleared for the next step
    assert all(int(st["step"]) == 0 for st in engine.optimizer.state.values())  # the skipped step is not counted


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


@PATHS
def test_grad_scale_is_divided_out(async_step):
    """engine.step(grad_scale=S) on grads of S*loss gives the same update as step() on grads of loss."""
    results = []
    for scale in (1.0, 1024.0):
        model, engine = tiny_engine(async_step=async_step)
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        _, loss = model(x, x)
        engine.backward(loss * scale)
        norm = engine.step(1e-2, grad_scale=scale)
        results.append((norm, [p.detach().clone() for p in model.parameters()]))
    assert math.isclose(results[0][0], results[1][0], rel_tol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        # power-of-two scale: exact up to rounding of the clip coef
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_async_step_reads_the_norm_after_the_update(monkeypatch):
    """The GPU path issues the update before its one host read (the norm), and its clipped update equals the CPU
    path's up to fp32 rounding (the kernel divides by 1/coef where the CPU path multiplies by coef)."""
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    out = {}
    for async_step in (False, True):
        model, engine = tiny_engine(clip=0.05, async_step=async_step)
        _, loss = model(x, x)
        engine.backward(loss)
        events, item, update = [], torch.Tensor.item, engine.optimizer.step
        monkeypatch.setattr(torch.Tensor, "item", lambda t: events.append("read") or item(t))
        monkeypatch.setattr(engine.optimizer, "step", lambda: events.append("update") or update())
        norm = engine.step(1e-2)
        monkeypatch.undo()
        assert norm > 0.05  # clipping is active
        before_update = events[:events.index("update")]  # (the for-loop AdamW reads its step counters itself)
        assert ("read" in before_update) != async_step and "read" in events, events
        out[async_step] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_gpu_step_clips_and_skips_like_the_cpu_step():
    """On CUDA the engine step takes the async path (fused AdamW given the clip divisor and the skip flag as device
    tensors, norm read last): its clipped update equals the CPU path's (norm first, for-loop AdamW), and a
    non-finite norm leaves the weights and AdamW's step counters as they were. AdamW's eps is set large (1e-3,
    above every clipped gradient element) so the first update is ~lr * g / eps, proportional to the clipped gradient:
    with the default 1e-8 it is ~lr * sign(g) and would not show whether the clip was applied."""
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    out = {}
    for dev, clip in (("cpu", 0.05), ("cpu", 0.0), ("cuda", 0.05)):
        cfg = Config(device=dev)
        cfg.model = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64, kernels="torch")
        cfg.train.grad_clip, cfg.train.eps = clip, 1e-3
        torch.manual_seed(0)
        model = GPT(cfg.model).to(dev)
        engine = build_engine(model, Mesh.build(device=dev), cfg)
        assert engine.async_step == (dev == "cuda")
        xd = x.to(dev)
        engine.backward(model(xd, xd)[1])  # fp32: no autocast
        out[dev, clip] = engine.step(1e-2), [p.detach().cpu().clone() for p in model.parameters()]
    (norm_cpu, ref), (_, unclipped), (norm_gpu, after) = out["cpu", 0.05], out["cpu", 0.0], out["cuda", 0.05]
    assert norm_gpu > 0.05 and math.isclose(norm_gpu, norm_cpu, rel_tol=1e-5)  # clipping is active

    def diff(a, b):
        return max((u - v).abs().max().item() for u, v in zip(a, b))
    print(f"max |cpu - cuda| after one clipped step {diff(ref, after):.2e}; clipped vs unclipped "
          f"{diff(ref, unclipped):.2e}")
    assert diff(ref, after) < 1e-3 * diff(ref, unclipped), (diff(ref, after), diff(ref, unclipped))
    engine.backward(model(xd, xd)[1] * float("inf"))
    assert not math.isfinite(engine.step(1e-2))
    assert all(torch.equal(a, p.detach().cpu()) for a, p in zip(after, model.parameters()))
    assert all(int(st["step"]) == 1 for st in engine.optimizer.state.values())
