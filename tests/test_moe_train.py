"""MoE in the trainer (issue #27, integration step 1): tiny_moe trains and logs its stats, dp=2 equals one process,
resume is bit-exact (expert_bias included), sample/consolidate read an MoE checkpoint, unbuilt layouts refused."""
import json

import numpy as np
import pytest
import torch

import sample
import train
from nanopara import checkpoint
from nanopara.cli import parse_args
from nanopara.config import ConfigError, ModelConfig
from nanopara.consolidate import full_model_state
from nanopara.graph import GraphedMicroStep
from nanopara.model import GPT
from nanopara.moe import MoEMLP
from nanopara.optim import param_groups
from tests.distributed import spawn
from tests.shards import tiny_shards

MOE_KEYS = ("moe_aux", "moe_z", "moe_drop", "moe_load_min", "moe_load_max")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tiny_shards(tmp_path_factory.mktemp("moeshards"), "m")


def argv(shards, out_dir, *extra, steps=8):
    return ["--preset=tiny_moe", "--device=cpu", f"--out_dir={out_dir}", f"--data.dataset={shards}",
            "--model.n_layer=2", "--model.n_head=4", "--model.n_embd=32", "--model.block_size=32",
            "--model.vocab_size=250", "--model.kernels=torch", "--train.micro_batch=4", "--train.seq_len=16",
            f"--train.steps={steps}", "--train.warmup_steps=2", "--train.val_every=0", "--train.sample_tokens=4",
            "--train.lr=1e-2", "--train.log_every=1", "--model.moe_capacity=1.0", "--model.moe_bias_rate=0.01",
            *extra]


def records(out):
    return [json.loads(ln) for ln in open(out / "metrics.jsonl") if '"loss"' in ln]


def test_tiny_moe_trains_and_logs_stats(shards, tmp_path):
    s = train.main(argv(shards, tmp_path / "run", steps=30))
    assert np.mean(s["losses"][-5:]) < s["losses"][0] - 0.5
    recs = records(tmp_path / "run")
    assert len(recs) == 30 and all(k in r for r in recs for k in MOE_KEYS)
    assert all(0 <= r["moe_drop"] < 1 and r["moe_load_min"] <= 1 <= r["moe_load_max"] for r in recs)
    sd = torch.load(f"{checkpoint.latest(tmp_path / 'run')}/rank_00000.pt", weights_only=True)
    assert sd["buffers"]["transformer.h.1.mlp.expert_bias"].abs().sum() > 0  # the bias moved and was saved


def _worker(rank, world, args, out_file):
    s = train.main(args)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(s["losses"], f)


def test_dp2_equals_single_process(shards, tmp_path):
    one = train.main(argv(shards, tmp_path / "one", "--train.tokens_per_step=128"))  # 2 micro-steps of 4 x 16
    out = tmp_path / "dp2.json"
    spawn(_worker, 2, argv(shards, tmp_path / "dp2", "--train.tokens_per_step=128"), str(out))
    assert np.allclose(json.loads(out.read_text()), one["losses"], atol=1e-4, rtol=0)
    a, _ = full_model_state(str(tmp_path / "one"))
    b, _ = full_model_state(str(tmp_path / "dp2"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=5e-5) for k in a)  # expert_bias too


def test_resume_bit_exact_and_sample(shards, tmp_path):
    full = train.main(argv(shards, tmp_path / "full"))
    part = train.main(argv(shards, tmp_path / "part", "--ckpt.every=3", "--ckpt.keep=10"))
    assert part["losses"] == full["losses"]
    (tmp_path / "part" / "ckpt" / "latest").write_text("step_000003\n")
    resumed = train.main(argv(shards, tmp_path / "part", "--resume=true"))
    assert resumed["start"] == 3 and resumed["losses"] == full["losses"][3:]
    a, cfg = full_model_state(str(tmp_path / "full"))
    b, _ = full_model_state(str(tmp_path / "part"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert cfg.moe_experts == 4 and "transformer.h.1.mlp.experts.c_fc.weight" in a
    model = GPT(cfg)
    model.load_state_dict(a)  # strict: the shape comes from the saved config
    assert isinstance(model.transformer.h[1].mlp, MoEMLP) and not isinstance(model.transformer.h[0].mlp, MoEMLP)
    assert sample.main([f"--out_dir={tmp_path / 'full'}", "--tokens=4", "--device=cpu"]) == 0


def test_decay_groups():
    dense = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=100))
    by_dim = [{id(p) for _, p in dense.named_parameters() if p.dim() >= 2}]
    assert {id(p) for p in param_groups(dense.named_parameters(), 0.1)[0]["params"]} == by_dim[0]
    moe = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=100, moe_experts=4))
    decayed = {id(p) for p in param_groups(moe.named_parameters(), 0.1)[0]["params"]}
    names = {id(p): n for n, p in moe.named_parameters()}
    assert "transformer.h.1.mlp.experts.c_fc.weight" in {names[i] for i in decayed}
    assert not any(names[i].endswith("bias") for i in decayed)
    assert moe.num_params() < sum(p.numel() for p in moe.parameters()) - moe.transformer.wpe.weight.numel()


@pytest.mark.parametrize("extra, msg", [
    (["--parallel.ep=3"], "not divisible by parallel.ep=3"),
    (["--model.moe_top_k=5"], "moe_top_k"),
    (["--model.moe_score=relu"], "moe_score"),
    (["--model.moe_impl=fast"], "moe_impl"),
    (["--model.moe_capacity=-1"], "out of range"),
    (["--model.moe_every=0"], "out of range"),
])
def test_config_errors(extra, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_args(["--preset=tiny_moe", *extra])


def test_presets():
    c = parse_args(["--preset=gpt2_moe"]).model
    assert (c.n_embd, c.moe_experts, c.moe_top_k, c.moe_every) == (768, 8, 2, 2)
    assert parse_args(["--preset=tiny"]).model.moe_experts == 0


# ----------------------------------------------------------------------------------------------------------------
# MoE under train.cuda_graph (graph.py): the step's state lives in device buffers, the capture's warm-up counts once


def _moe_step_cfg(capacity, device, graph=False, **model):
    return parse_args(["--preset=gpt2_moe" if device == "cuda" else "--preset=tiny_moe", "--model.n_layer=2",
                       f"--model.moe_capacity={capacity}", "--model.moe_bias_rate=0.001", "--train.sample_tokens=0",
                       f"--train.cuda_graph={'true' if graph else 'false'}",
                       *[f"--model.{k}={v}" for k, v in model.items()]])


def _moe_losses(cfg, device, steps, accum, graphed_cls=None):
    """Trainer steps on fresh random batches of 256 token ids at most (the loss falls as the model learns which):
    (losses, MoE loads and stats per step, expert biases). graphed_cls: a GraphedMicroStep class to install by hand
    (CPU: one that replays eagerly)."""
    from nanopara.mesh import Mesh
    from nanopara.moe import moe_layers
    from nanopara.parallel import parallelize
    t = cfg.train
    t.tokens_per_step = accum * t.micro_batch * t.seq_len
    torch.manual_seed(0)
    trainer = parallelize(GPT(cfg.model), Mesh.build(device=device), cfg)
    if graphed_cls is not None:
        trainer.graphed = graphed_cls(trainer.engine.model, trainer.amp, 1 / accum, trainer.engine)
    assert (trainer.graphed is not None) == (cfg.train.cuda_graph == "true" or graphed_cls is not None)
    g = torch.Generator().manual_seed(1)
    losses, stats = [], []
    for _ in range(steps):
        batches = []
        for _ in range(accum):
            tok = torch.randint(0, min(cfg.model.vocab_size, 256), (t.micro_batch, t.seq_len + 1), generator=g)
            batches.append((tok[:, :-1].to(device), tok[:, 1:].to(device)))
        losses.append(trainer.forward_backward(batches).item())
        loads = [m.load.tolist() for m in moe_layers(trainer.engine.model)]  # what the bias update will read
        trainer.step(1e-3)
        stats.append({"loads": loads, **{k: v.item() for k, v in trainer.moe_stats.items()}})
    biases = [m.expert_bias.clone() for m in moe_layers(trainer.engine.model)]
    if graphed_cls is None:
        trainer.close()
    return losses, stats, biases


class _EagerReplayStep(GraphedMicroStep):
    """graph.GraphedMicroStep on CPU: its warm-up calls and `_before_capture` as graph.py runs them, then a 'graph'
    whose replay re-runs `_fwd_bwd` eagerly on the static inputs."""

    def _capture(self, x, y):
        self.x, self.y = x.clone(), y.clone()
        for _ in range(self.warmup):
            self._fwd_bwd(self.x, self.y)
        self._before_capture()
        self.loss = torch.zeros(())
        self.graph = self

    def replay(self):
        self.loss.copy_(self._fwd_bwd(self.x, self.y))


@pytest.mark.timeout_s(60)
@pytest.mark.parametrize("capacity", [1.0, 0.0])
def test_graph_step_keeps_moe_state_as_eager(capacity):
    """The Trainer with a graphed micro-step (replayed eagerly here: CPU) equals the eager Trainer exactly: the aux
    scale, stats and loads are device buffers a replay updates, and the first call's warm-up forwards count their
    expert loads once (Trainer._moe_capture), so the aux-loss-free biases move as in eager mode."""
    eager, graphed = (_moe_losses(_set_shape(_moe_step_cfg(capacity, "cpu", n_embd=32, n_head=2, vocab_size=128)),
                                  "cpu", 4, 2, graphed_cls=cls) for cls in (None, _EagerReplayStep))
    assert graphed[0] == eager[0] and graphed[1] == eager[1]
    assert all(torch.equal(a, b) for a, b in zip(graphed[2], eager[2])) and eager[2][0].abs().sum() > 0


def _set_shape(cfg, micro_batch=2, seq_len=16):
    cfg.train.micro_batch, cfg.train.seq_len = micro_batch, seq_len
    return cfg


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", [1.0, 0.0])
def test_graphed_moe_training_equals_eager_on_gpu(capacity):
    """gpt2_moe at 2 layers (one MoE layer, the Triton path), bf16, 2 micro-steps a step, aux-loss-free bias on:
    train.cuda_graph=true replays each micro-step from one CUDA graph; losses, MoE stats and expert biases equal
    the eager run's (the replay launches the kernels eager mode launched, on the same inputs: rel 1e-5)."""
    runs = [_moe_losses(_set_shape(_moe_step_cfg(capacity, "cuda", graph=g), 4, 512), "cuda", 6, 2)
            for g in (False, True)]
    (el, es, eb), (gl, gs, gb) = runs
    assert gl == pytest.approx(el, rel=1e-5, abs=1e-5)
    assert gl[-1] < gl[0]
    for a, b in zip(gs, es):
        assert a.pop("loads") == b.pop("loads") and a == pytest.approx(b, rel=1e-5, abs=1e-6)
    for a, b in zip(gb, eb):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_cuda_graph_config_with_moe():
    """train.cuda_graph=true takes MoE on the Triton path (capacity or dropless) and refuses the PyTorch paths (host
    bounds) and expert parallel; auto graphs tp / pp MoE runs in capacity mode, dropless stays eager (unmeasured)."""
    from nanopara.parallel import check_layout, use_cuda_graph
    for extra in ([], ["--model.moe_capacity=1.0"], ["--model.moe_impl=triton"]):
        cfg = parse_args(["--preset=tiny_moe", "--train.cuda_graph=true", *extra])
        assert check_layout(cfg, 1, "cuda") == 1 and use_cuda_graph(cfg, 1, "cuda") == (True, "")
    for extra, msg in ((["--model.moe_impl=sorted"], "moe_impl=sorted"), (["--model.moe_impl=grouped_mm"], "host"),
                       (["--parallel.ep=2"], "expert parallel")):
        with pytest.raises(ConfigError, match=msg):
            parse_args(["--preset=tiny_moe", "--train.cuda_graph=true", *extra])
    cfg = parse_args(["--preset=tiny_moe", "--parallel.tp=2", "--model.moe_capacity=1.0"])
    assert use_cuda_graph(cfg, 2, "cuda") == (True, "")
    cfg.model.moe_capacity = 0.0
    on, why = use_cuda_graph(cfg, 2, "cuda")
    assert not on and "MoE" in why
