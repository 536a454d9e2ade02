"""Run directories never lose work: refusing to mix runs, resume fallbacks, pruning, step times, one-line errors."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import train
from nanopara import checkpoint
from nanopara.config import ConfigError
from nanopara.data import write_shard
from nanopara.model import GPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(1)
    toks = np.where(rng.random(30000) < 0.1, rng.integers(0, 256, 30000), np.tile(np.arange(0, 200, 3), 500)[:30000])
    write_shard(str(d / "r_train_000000.bin"), toks)
    write_shard(str(d / "r_val_000000.bin"), toks[:3000])
    return str(d / "r_*.bin")


def argv(shards, out_dir, *extra):
    return ["--preset=tiny", "--device=cpu", f"--out_dir={out_dir}", f"--data.dataset={shards}",
            "--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
            "--model.vocab_size=256", "--train.micro_batch=4", "--train.seq_len=16", "--train.steps=6",
            "--train.warmup_steps=2", "--train.val_every=0", "--train.sample_tokens=0", "--train.lr=1e-2",
            "--train.log_every=1", *extra]


def snapshot(out):
    files = {}
    for dirpath, _, names in os.walk(out):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                files[os.path.relpath(p, out)] = f.read()
    return files


def steps_logged(out):
    return [json.loads(ln)["step"] for ln in open(out / "metrics.jsonl") if '"loss"' in ln]


def test_a_second_run_into_the_same_directory_refuses_and_loses_nothing(shards, tmp_path):
    out = tmp_path / "run"
    train.main(argv(shards, out, "--ckpt.every=2"))
    before = snapshot(out)
    with pytest.raises(checkpoint.CheckpointError, match="already holds a run .*--resume.*--overwrite.*--out_dir"):
        train.main(argv(shards, out, "--train.steps=2", "--ckpt.every=2"))
    assert snapshot(out) == before  # not one byte changed
    train.main(argv(shards, out, "--train.steps=2", "--ckpt.every=2", "--overwrite"))  # asked for: starts afresh
    assert sorted(os.listdir(out / "ckpt")) == ["latest", "step_000002"]
    assert checkpoint.latest(out).endswith("step_000002") and steps_logged(out) == [0, 1]
    with pytest.raises(ConfigError, match="contradict"):
        train.main(argv(shards, out, "--resume", "--overwrite"))


def test_pruning_never_removes_the_checkpoint_just_saved(shards, tmp_path):
    out = tmp_path / "run"
    train.main(argv(shards, out, "--ckpt.every=2", "--ckpt.keep=2"))
    assert sorted(os.listdir(out / "ckpt")) == ["latest", "step_000004", "step_000006"]
    (out / "ckpt" / "latest").write_text("step_000004\n")  # go back to step 4 and train to step 5
    train.main(argv(shards, out, "--train.steps=5", "--resume"))
    kept = sorted(os.listdir(out / "ckpt"))
    assert "step_000005" in kept and checkpoint.latest(out).endswith("step_000005")
    assert kept == ["latest", "step_000005", "step_000006"]  # by write time: step 4 is the oldest written


def _two_checkpoints(shards, tmp_path):
    out = tmp_path / "run"
    full = train.main(argv(shards, out, "--ckpt.every=2", "--ckpt.keep=3", "--train.steps=4",
                           "--ckpt.final=false"))
    return out, full


@pytest.mark.parametrize("damage", ["truncated", "no_latest", "dangling_latest", "bad_meta"])
def test_resume_falls_back_to_the_newest_complete_checkpoint(shards, tmp_path, capsys, damage):
    out, full = _two_checkpoints(shards, tmp_path)
    newest = out / "ckpt" / "step_000004"
    if damage == "truncated":
        with open(newest / "rank_00000.pt", "r+b") as f:
            f.truncate(1000)
    elif damage == "no_latest":
        os.remove(out / "ckpt" / "latest")
    elif damage == "dangling_latest":
        (out / "ckpt" / "latest").write_text("step_000099\n")
    else:
        (newest / "meta.json").write_text("{half")
    resumed = train.main(argv(shards, out, "--resume"))
    said = capsys.readouterr().out
    if damage in ("no_latest", "dangling_latest"):  # step 4 is intact: it is the newest complete one
        assert resumed["start"] == 4 and "took the newest complete checkpoint step_000004" in said
    else:
        assert resumed["start"] == 2 and "took the newest complete checkpoint step_000002" in said
        assert resumed["losses"][:2] == full["losses"][2:4]  # bit-exact continuation from step 2
    assert "no ckpt/latest" in said if damage == "no_latest" else "unusable" in said


def test_resume_with_nothing_left_to_train_is_an_error(shards, tmp_path):
    out = tmp_path / "run"
    train.main(argv(shards, out, "--train.steps=3"))
    before = snapshot(out)
    with pytest.raises(ConfigError, match="step 3 and --train.steps=3: nothing left to train"):
        train.main(argv(shards, out, "--train.steps=3", "--resume"))
    assert snapshot(out) == before  # config.json and the log untouched


@pytest.mark.parametrize("case", ["out_dir_is_a_file", "under_a_file", "ckpt_is_a_file", "unwritable"])
def test_unusable_out_dir_is_one_line_before_any_work(tmp_path, case):
    (tmp_path / "f").write_text("x")
    out = {"out_dir_is_a_file": tmp_path / "f", "under_a_file": tmp_path / "f" / "run",
           "ckpt_is_a_file": tmp_path / "run", "unwritable": "/proc/nanopara_run"}[case]
    if case == "ckpt_is_a_file":
        os.makedirs(out)
        (out / "ckpt").write_text("x")
    # a dataset that does not exist: the out_dir error must come first, before data or model work
    with pytest.raises(checkpoint.CheckpointError, match="--out_dir|checkpoint folder of --out_dir") as e:
        train.main(argv("/nonexistent/*.bin", out))
    assert {"out_dir_is_a_file": "is a file", "under_a_file": "is a file", "ckpt_is_a_file": "is a file",
            "unwritable": "not writable"}[case] in str(e.value)


def test_cpu_step_times_are_each_steps_own(shards, tmp_path, monkeypatch):
    """A clock that advances only inside the model's forward, by (k+1)/10 s in step k: each logged step time must be
    exactly its own step's (not a neighbour's, not two steps' for step 0, not ~0 for the last), so they add up."""
    import types

    from nanopara import report
    clock, real = {"t": 100.0, "calls": 0}, GPT.forward

    def forward(self, *a, **k):
        clock["calls"] += 1
        if self.training:  # one forward per step (one micro-step, no validation)
            clock["t"] += clock["calls"] / 10
        return real(self, *a, **k)
    monkeypatch.setattr(GPT, "forward", forward)
    monkeypatch.setattr(report, "time", types.SimpleNamespace(perf_counter=lambda: clock["t"]))
    train.main(argv(shards, tmp_path / "run", "--ckpt.final=false"))
    dts = [json.loads(ln)["step_time_s"] for ln in open(tmp_path / "run" / "metrics.jsonl")]
    np.testing.assert_allclose(dts, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], rtol=1e-9)


def _cli(*runs):
    """`python train.py ARGS` with ENV added, for each (ARGS, ENV) of `runs`, all at once (each starts python and
    torch: ~3 s of one core); their CompletedProcess-like results, in order."""
    procs = [subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, **env}) for args, env in runs]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def test_config_errors_print_one_line_once(tmp_path):
    bad = ["--preset=tiny", "--device=cpu", f"--out_dir={tmp_path}/x", "--train.log_every=0"]
    check = ["--check_world=4", "--preset=tiny", "--device=cpu", "--parallel.tp=8", f"--out_dir={tmp_path}/y"]
    r0, r1, r = _cli((bad, {"RANK": "0"}), (bad, {"RANK": "1"}), (check, {}))  # (as two ranks under torchrun)
    assert r0.returncode == r1.returncode == 2
    assert r0.stderr.strip().splitlines() == ["error: --train.log_every=0 is out of range: it must be >= 1"]
    assert r1.stderr.strip() == ""  # the same error on every rank is printed by rank 0 only
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_make_train_checks_once_before_launching_and_honours_a_preset_in_args(tmp_path):
    def make(args):
        return subprocess.run(["make", "-s", "train", f"PY={sys.executable}", "NGPU=2", f"ARGS={args}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
    r = make(f"--device=cpu --parallel.tp=3 --data.dataset={tmp_path}/*.bin --out_dir={tmp_path}/run")
    said = [ln for ln in r.stderr.splitlines() if not ln.startswith("make")]  # make adds its own "Error 2" line
    assert r.returncode != 0 and len(said) == 1 and said[0].startswith("error: model.n_head=4"), r.stderr
    dry = subprocess.run(["make", "-n", "train", "PY=/no/python", "ARGS=--preset=gpt2_124m --device=cpu"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60).stdout  # (no GPU probe: no torch)
    line = next(ln for ln in dry.splitlines() if "train.py" in ln)
    assert "--preset=gpt2_124m" in line and "--preset=tiny" not in line and line.count("--device=") == 1


def test_out_of_memory_is_one_line_with_the_way_out(shards, tmp_path, monkeypatch):
    import torch

    def oom(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    monkeypatch.setattr(GPT, "forward", oom)
    with pytest.raises(train.TrainingError, match="out of GPU memory .*lower --train.micro_batch"):
        train.main(argv(shards, tmp_path / "run"))

    def no_room(self, *a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")
    monkeypatch.setattr(GPT, "__init__", no_room)
    with pytest.raises(ConfigError, match="does not fit in host memory .*block_size=32"):
        train.main(argv(shards, tmp_path / "run2"))


def test_runs_latest_links_the_newest_run_under_runs_only(tmp_path, monkeypatch):
    """`make sample` / `make plot` read runs/latest: a run under a `runs/` folder points it at itself (relative,
    replaced on the next run); a run anywhere else leaves its parent alone."""
    from nanopara.cli import parse_args
    from nanopara.mesh import Mesh
    monkeypatch.chdir(tmp_path)
    mesh = Mesh.build(device="cpu")
    for name in ("a", "b"):
        cfg = parse_args(["--preset=tiny", "--device=cpu", f"--out_dir=runs/{name}"])
        os.makedirs(cfg.out_dir)
        train.write_run_info(cfg, mesh)
        assert os.readlink(tmp_path / "runs" / "latest") == name and (tmp_path / "runs/latest/config.json").exists()
    cfg = parse_args(["--preset=tiny", "--device=cpu", "--out_dir=elsewhere/c"])
    os.makedirs(cfg.out_dir)
    train.write_run_info(cfg, mesh)
    assert not os.path.lexists(tmp_path / "elsewhere" / "latest")


def test_a_ckpt_folder_removed_between_checks_is_not_a_file(tmp_path, monkeypatch):
    """Another rank's check of the run directory while rank 0's writability probe makes and removes an empty ckpt/:
    the folder may vanish between two calls (exists, then isdir: the old check called that "a file", a CI failure of
    a tp2 test). One stat sees a directory or nothing."""
    from nanopara import runguard
    out = tmp_path / "run"
    (out / "ckpt").mkdir(parents=True)
    real_isdir = os.path.isdir

    def isdir_after_rank0_removes_it(p):
        if str(p).endswith("ckpt") and real_isdir(p):
            os.rmdir(p)  # rank 0's `finally` removes the empty folder it made
        return real_isdir(p)
    monkeypatch.setattr(os.path, "isdir", isdir_after_rank0_removes_it)
    runguard.check_out_dir(str(out))  # no error
    monkeypatch.undo()
    if (out / "ckpt").is_dir():
        (out / "ckpt").rmdir()
    (out / "ckpt").write_text("x")
    with pytest.raises(checkpoint.CheckpointError, match="is a file, not a directory"):
        runguard.check_out_dir(str(out))


def test_overwrite_discards_the_log_of_a_run_that_saved_no_checkpoint(tmp_path):
    """--overwrite on a directory whose run wrote metrics.jsonl but no ckpt/ (rl.py --save=0): the old log goes, so
    the new run's metrics are not appended to it (the post-training demo's curves once held two runs' evals)."""
    from nanopara.runguard import RUN_FILES, prepare_run_dir
    out = tmp_path / "rl"
    out.mkdir()
    for f in RUN_FILES:
        (out / f).write_text("old\n")
    (out / "keep.txt").write_text("mine")
    with pytest.raises(checkpoint.CheckpointError, match="--overwrite to discard it"):
        prepare_run_dir(str(out), resume=False, overwrite=False, is_main=True)
    assert all((out / f).exists() for f in RUN_FILES)  # refused: nothing touched
    prepare_run_dir(str(out), resume=False, overwrite=True, is_main=True)
    assert not any((out / f).exists() for f in RUN_FILES)
    assert (out / "keep.txt").read_text() == "mine"  # only a run's own files go
