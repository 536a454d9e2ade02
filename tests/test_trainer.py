"""The Trainer (nanopara/trainer.py), the one step object: the same numbers as the engine driven by hand, a
state_dict that resumes exactly, evaluation, and clear errors. Layouts run through it end to end in
tests/test_parallel_train.py (train.py's loop calls nothing else)."""
import copy

import pytest
import torch

from nanopara.cli import parse_args
from nanopara.mesh import Mesh
from nanopara.model import GPT
from nanopara.parallel import build_engine, parallelize


def _cfg(*extra):
    return parse_args(["--preset=tiny", "--device=cpu", "--model.n_layer=2", "--model.n_head=2",
                       "--model.n_embd=32", "--model.block_size=16", "--model.vocab_size=128",
                       "--train.micro_batch=2", "--train.seq_len=16", "--train.tokens_per_step=64", "--train.sample_tokens=0",
                       *extra])


def _batches(step: int, n: int = 2):
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(n):
        x = torch.randint(0, 128, (2, 17), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def test_trainer_equals_the_engine_driven_by_hand():
    """Two micro-steps a step (tokens_per_step = 2 x micro_batch x seq_len): forward_backward + step give the
    losses, norms and weights of the loop train.py used to write out (no_sync, loss / accum, engine.step)."""
    cfg = _cfg()
    mesh = Mesh.build(device="cpu")
    torch.manual_seed(0)
    trainer = parallelize(GPT(cfg.model), mesh, cfg)
    assert trainer.accum == 2 and trainer.pipeline is None and trainer.dtype is None  # fp32 on CPU
    torch.manual_seed(0)
    engine = build_engine(GPT(cfg.model), mesh, cfg)
    for step in range(4):
        batches = _batches(step)
        loss = trainer.forward_backward(batches)
        norm = trainer.step(1e-2)
        ref = torch.zeros(())
        for micro, (x, y) in enumerate(batches):
            with engine.no_sync(micro < 1):
                _, l = engine.model(x, y)
                engine.backward(l / 2)
            ref += l.detach()
        ref_norm = engine.step(1e-2)
        assert torch.equal(loss, ref / 2) and norm == ref_norm, step
    for (name, p), q in zip(trainer.model.named_parameters(), engine.model.parameters()):
        assert torch.equal(p, q), name


def test_state_dict_resumes_exactly_and_evaluate_is_the_mean_loss():
    cfg = _cfg()
    mesh = Mesh.build(device="cpu")
    torch.manual_seed(0)
    a = parallelize(GPT(cfg.model), mesh, cfg)
    for step in range(3):
        a.forward_backward(_batches(step))
        a.step(1e-2)
    saved = copy.deepcopy(a.state_dict())
    assert set(saved) >= {"model", "engine", "scaler", "tp_shards", "ep_shards", "buffers"}
    assert "transformer.h.1.mlp.c_fc.weight" in saved["model"]  # single-device (global) names
    torch.manual_seed(1)  # other initial weights: everything must come from the state dict
    b = parallelize(GPT(cfg.model), mesh, cfg)
    b.load_state_dict(saved)
    for step in range(3, 5):
        la, lb = a.forward_backward(_batches(step)), b.forward_backward(_batches(step))
        assert torch.equal(la, lb) and a.step(1e-2) == b.step(1e-2), step
    val = _batches(99, 3)
    with torch.no_grad():
        ref = sum(a.model(x, y)[1] for x, y in val) / 3
    assert a.evaluate(val) == pytest.approx(ref.item(), rel=1e-6) and a.model.training


def test_wrong_number_of_micro_batches_is_one_clear_error():
    cfg = _cfg()
    trainer = parallelize(GPT(cfg.model), Mesh.build(device="cpu"), cfg)
    with pytest.raises(ValueError, match="got 1 micro-batches; this layout runs 2"):
        trainer.forward_backward(_batches(0, 1))
