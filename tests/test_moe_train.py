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
from nanopara.data import write_shard
from nanopara.model import GPT
from nanopara.moe import MoEMLP
from nanopara.optim import param_groups
from tests.distributed import spawn

MOE_KEYS = ("moe_aux", "moe_z", "moe_drop", "moe_load_min", "moe_load_max")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("moeshards")
    rng = np.random.default_rng(0)
    toks = np.where(rng.random(40000) < 0.2, rng.integers(0, 250, 40000), np.tile(np.arange(0, 250, 7), 1200)[:40000])
    write_shard(str(d / "m_train_000000.bin"), toks)
    write_shard(str(d / "m_val_000000.bin"), toks[:5000])
    return str(d / "m_*.bin")


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
