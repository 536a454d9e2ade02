"""End-to-end single-process training: bit-exact resume, NaN handling, and clear errors before any work."""
import glob
import json
import os

import numpy as np
import pytest
import torch

import train
from nanopara import checkpoint
from nanopara.config import ConfigError
from nanopara.data import TokenLoader, write_shard
from nanopara.model import GPT


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    # a learnable stream: mostly a repeating pattern, some noise, ids < 256
    base = np.tile(np.arange(0, 200, 3), 400)
    noise = rng.integers(0, 256, base.size)
    toks = np.where(rng.random(base.size) < 0.1, noise, base)
    write_shard(str(d / "syn_train_000000.bin"), toks)
    write_shard(str(d / "syn_val_000000.bin"), toks[:3000])
    return str(d / "syn_*.bin")


def argv(shards, out_dir, *extra):
    return ["--preset=tiny", "--device=cpu", f"--out_dir={out_dir}", f"--data.dataset={shards}",
            "--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
            "--model.vocab_size=256", "--train.micro_batch=4", "--train.seq_len=16", "--train.steps=8",
            "--train.warmup_steps=2", "--train.val_every=4", "--train.val_steps=2", "--train.sample_tokens=0",
            "--train.lr=1e-2", "--train.log_every=1", *extra]


def final_weights(out_dir):
    state, _ = checkpoint.load(checkpoint.latest(out_dir), _mesh())
    return state["model"]


def _mesh():
    from nanopara.mesh import Mesh
    return Mesh.build(device="cpu")


def test_tiny_training_learns_and_logs(shards, tmp_path):
    out = tmp_path / "run"
    s = train.main(argv(shards, out, "--train.steps=30", "--train.val_every=10"))
    assert s["losses"][-1] < s["losses"][0] - 1.0
    lines = [json.loads(ln) for ln in open(out / "metrics.jsonl")]
    step_lines = [ln for ln in lines if "loss" in ln]
    assert [ln["step"] for ln in step_lines] == list(range(30))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gb"):
        assert key in step_lines[0]
    assert sum("val_loss" in ln for ln in lines) == 3
    assert (out / "config.json").exists() and (out / "run_info.txt").exists()


@pytest.mark.parametrize("accum", [1, 2])
def test_resume_is_bit_exact(shards, tmp_path, accum):
    tps = [f"--train.tokens_per_step={4 * 16 * accum}"]
    full = train.main(argv(shards, tmp_path / "full", *tps))
    part = train.main(argv(shards, tmp_path / "part", *tps, "--ckpt.every=3", "--ckpt.keep=10"))
    assert part["losses"] == full["losses"]
    # go back to the step-3 checkpoint, as if the run had died after it, and resume
    (tmp_path / "part" / "ckpt" / "latest").write_text("step_000003\n")
    resumed = train.main(argv(shards, tmp_path / "part", *tps, "--resume=true"))
    assert resumed["start"] == 3
    assert resumed["losses"] == full["losses"][3:]  # exact float equality
    a, b = final_weights(tmp_path / "full"), final_weights(tmp_path / "part")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    recs = [json.loads(ln) for ln in open(tmp_path / "part" / "metrics.jsonl")]
    steps = [r["step"] for r in recs if "loss" in r]
    assert steps == list(range(8)) + list(range(3, 8))  # appended, never clobbered: the first run's lines stay
    marker = next(i for i, r in enumerate(recs) if "resumed_from" in r)
    assert recs[marker]["step"] == 3 and recs[marker]["resumed_from"].endswith("step_000003")
    assert [r["loss"] for r in recs[marker:] if "loss" in r] == full["losses"][3:]
    from nanopara.report import read_metrics
    assert [r["loss"] for r in read_metrics(tmp_path / "part" / "metrics.jsonl")[0]] == full["losses"]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_step_numbers_are_read_one_step_late(shards, tmp_path, monkeypatch, dtype):
    """A step is logged after the next step is issued (so the GPU does not wait for the host between steps), except
    where something needs its numbers first: every step under fp16 (the loss scale), the steps before validation
    and checkpoints, and the last. The log holds every step once, in order, either way."""
    from nanopara.engine import Engine
    from nanopara.report import Metrics
    issued, seen = [], {}
    real_step, real_log = Engine.step, Metrics.log

    def step(self, *a, **k):
        issued.append(1)
        return real_step(self, *a, **k)

    def log(self, rec, line=None):
        if rec and "loss" in rec:
            seen[rec["step"]] = len(issued)  # optimizer steps issued when this step was logged
        return real_log(self, rec, line)
    monkeypatch.setattr(Engine, "step", step)
    monkeypatch.setattr(Metrics, "log", log)
    train.main(argv(shards, tmp_path / "run", f"--train.dtype={dtype}", "--train.steps=8", "--train.val_every=4",
                    "--ckpt.every=0"))
    assert list(seen) == list(range(8))
    late = {s: seen[s] - (s + 1) for s in seen}  # 1: logged after the next step was issued
    if dtype == "fp16":
        assert set(late.values()) == {0}
    else:  # step 3 precedes a validation pass, step 7 is the last
        assert late == {0: 1, 1: 1, 2: 1, 3: 0, 4: 1, 5: 1, 6: 1, 7: 0}, late


def test_failed_save_keeps_previous_checkpoint(shards, tmp_path, monkeypatch):
    out = tmp_path / "run"
    train.main(argv(shards, out, "--train.steps=2"))
    good = checkpoint.latest(out)
    real_save = torch.save

    def dying_save(obj, path, *a, **k):
        real_save(obj, path, *a, **k)
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(checkpoint.CheckpointError, match=r"step 4 under .*ckpt: disk full; the previous checkpoint "
                                                         r".*step_000002 is intact"):
        train.main(argv(shards, out, "--train.steps=4", "--resume"))
    assert checkpoint.latest(out) == good
    state, meta = checkpoint.load(good, _mesh())
    assert meta["step"] == 2 and "model" in state
    assert sorted(os.listdir(out / "ckpt")) == ["latest", "step_000002"]  # no half-written leftovers


def test_failed_periodic_save_warns_and_training_goes_on(shards, tmp_path, monkeypatch, capsys):
    real_save, calls = torch.save, {"n": 0}

    def flaky_save(obj, path, *a, **k):  # the first save fails (disk full), the later ones work
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *a, **k)
    monkeypatch.setattr(torch, "save", flaky_save)
    s = train.main(argv(shards, tmp_path / "run", "--train.steps=4", "--ckpt.every=2", "--train.val_every=0"))
    assert len(s["losses"]) == 4
    assert "could not save the checkpoint of step 2" in capsys.readouterr().out
    assert checkpoint.load(checkpoint.latest(tmp_path / "run"), _mesh())[1]["step"] == 4


def test_nan_loss_skips_then_stops(shards, tmp_path, monkeypatch):
    real = GPT.loss_fn
    calls = {"n": 0}

    def sometimes_nan(self, logits, targets):
        calls["n"] += 1
        loss = real(self, logits, targets)
        return loss * float("nan") if calls["n"] == 3 else loss
    monkeypatch.setattr(GPT, "loss_fn", sometimes_nan)
    s = train.main(argv(shards, tmp_path / "a", "--train.steps=5", "--train.val_every=0"))
    assert np.isnan(s["losses"][2]) and all(np.isfinite(s["losses"][i]) for i in (0, 1, 3, 4))

    monkeypatch.setattr(GPT, "loss_fn", lambda self, lg, t: real(self, lg, t) * float("nan"))
    with pytest.raises(train.TrainingError, match="non-finite for 3 steps in a row"):
        train.main(argv(shards, tmp_path / "b", "--train.max_bad_steps=3", "--train.val_every=0"))


def test_errors_before_any_work(shards, tmp_path):
    with pytest.raises(ConfigError, match="did you mean --train.steps"):
        train.main(argv(shards, tmp_path / "x", "--train.stepz=1"))
    with pytest.raises(FileNotFoundError, match="prepare"):
        train.main(argv(shards, tmp_path / "x", "--data.dataset=fineweb10B", f"--data.data_dir={tmp_path}/none"))
    with pytest.raises(ConfigError, match="not a multiple"):
        train.main(argv(shards, tmp_path / "x", "--train.tokens_per_step=100"))
    with pytest.raises(ValueError, match="token id .* >= vocab_size 100"):
        train.main(argv(shards, tmp_path / "x", "--model.vocab_size=100"))
    assert not (tmp_path / "x").exists()  # nothing was written: each error came before the run started


def test_corrupt_checkpoint_is_a_clear_error(shards, tmp_path):
    out = tmp_path / "run"
    train.main(argv(shards, out, "--train.steps=2"))
    step = os.path.join(out, "ckpt", "step_000002")
    with open(os.path.join(step, "rank_00000.pt"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(checkpoint.CheckpointError, match="truncated or corrupt"):
        train.main(argv(shards, out, "--train.steps=4", "--resume=true"))
    with open(os.path.join(step, "meta.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(checkpoint.CheckpointError, match="meta.json"):
        train.main(argv(shards, out, "--train.steps=4", "--resume=true"))


def test_incompatible_checkpoint_is_a_clear_error(shards, tmp_path):
    out = tmp_path / "run"
    train.main(argv(shards, out, "--train.steps=2"))
    with pytest.raises(checkpoint.CheckpointError, match=r"different model: model.n_embd=32 \(this run: 64\)"):
        train.main(argv(shards, out, "--train.steps=4", "--resume=true", "--model.n_embd=64"))


def test_fp16_autocast_with_dynamic_loss_scaling_trains(shards, tmp_path):
    s = train.main(argv(shards, tmp_path / "fp16", "--train.dtype=fp16", "--train.steps=12", "--train.val_every=0"))
    assert all(np.isfinite(s["losses"])) and s["losses"][-1] < s["losses"][0] - 0.5
    state, _ = checkpoint.load(checkpoint.latest(tmp_path / "fp16"), _mesh())
    assert state["scaler"]["scale"] >= 1.0 and state["scaler"]["good_steps"] > 0  # the scaler state is checkpointed


def test_init_from_hugging_face_weights(shards, tmp_path):
    """--ckpt.init_from loads a GPT2LMHeadModel state dict: step 0 then scores the data with those weights."""
    from nanopara.cli import parse_args
    from nanopara.model import to_hf_state_dict
    cfg = parse_args(argv(shards, tmp_path / "x"))
    torch.manual_seed(123)
    donor = GPT(cfg.model)
    torch.save(to_hf_state_dict(donor), tmp_path / "pytorch_model.bin")
    runs = [train.main(argv(shards, tmp_path / name, "--train.steps=1", "--train.val_every=0", *extra))["losses"][0]
            for name, extra in (("a", [f"--ckpt.init_from={tmp_path}/pytorch_model.bin"]), ("b", []))]
    first_batch = TokenLoader(sorted(glob.glob(shards.replace("*", "*train*"))), 4, 16, seed=cfg.seed, vocab_size=256)
    x, y = next(first_batch)  # the batch train.py's step 0 sees
    with torch.no_grad():
        expected = donor(x, y)[1].item()
    assert runs[0] == pytest.approx(expected, abs=1e-5) and runs[0] != runs[1]
    with pytest.raises(checkpoint.CheckpointError, match="no file"):
        train.main(argv(shards, tmp_path / "c", "--ckpt.init_from=/nonexistent.bin"))
