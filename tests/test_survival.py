"""No way of losing work loses it: non-finite state is never checkpointed, a writer error of any type is a warning,
damaged checkpoints are verified out of resume and pruning, a resume that cannot work is one line before any work,
one trainer per out_dir, a directory interrupted before its first checkpoint is not stuck, SIGTERM/SIGINT save and
stop (one process and two gloo processes). Asynchronous saves: tests/test_async_ckpt.py."""
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import train
from nanopara import checkpoint, runguard
from nanopara.ckpt_inspect import main as inspect_main
from nanopara.model import GPT
from nanopara.report import TrainingError
from tests.distributed import free_port
from tests.tiny_run import tiny_argv, write_tiny_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_tiny_shards(tmp_path_factory.mktemp("svshards"), seed=2)


argv = tiny_argv


_FULL = {}


@pytest.fixture(scope="module")
def full(shards, tmp_path_factory):
    """The losses of an uninterrupted 8-step run, which every resume must continue bit-exactly; its run directory
    (checkpoints of steps 2, 4, 6, 8) is copied by `a_copy` for the tests that damage one."""
    _FULL["dir"] = tmp_path_factory.mktemp("full") / "run"
    return train.main(argv(shards, _FULL["dir"], "--ckpt.every=2", "--ckpt.keep=4"))["losses"]


def a_copy(tmp_path, latest, later=()):
    """A copy of the full run's directory as if it had died after the checkpoint of step `latest` (which
    ckpt/latest names): of the later checkpoints, only those of the steps in `later` are there."""
    import shutil
    out = tmp_path / "run"
    shutil.copytree(_FULL["dir"], out)
    (out / "ckpt" / "latest").write_text(f"step_{latest:06d}\n")
    for step in (4, 6, 8):
        if step > latest and step not in later:
            shutil.rmtree(out / "ckpt" / f"step_{step:06d}")
    return out


def listing(path):
    """(exit code, lines) of `python -m nanopara.checkpoint path`, in this process."""
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = inspect_main([str(path)])
    return code, buf.getvalue().splitlines()


def corrupt(file, at=0.5):
    """Same size, other bytes: what a bad disk or a copy gone wrong leaves."""
    with open(file, "r+b") as f:
        f.seek(int(os.path.getsize(file) * at))
        b = f.read(64)
        f.seek(-len(b), 1)
        f.write(bytes(x ^ 0xFF for x in b))


def kill_at(monkeypatch, forward_no, what):
    """GPT.forward calls `what(model)` at its forward_no-th training call (0-based: step k's forward with accum 1)."""
    real, calls = GPT.forward, {"n": 0}

    def forward(self, *a, **k):
        if self.training:
            if calls["n"] == forward_no:
                what(self)
            calls["n"] += 1
        return real(self, *a, **k)
    monkeypatch.setattr(GPT, "forward", forward)


# ----------------------------------------------------------------------------------------------------------------
# numerical faults

def test_nan_weights_are_never_checkpointed_and_resume_recovers(shards, tmp_path, monkeypatch, full, capsys):
    """A NaN written into a weight at step 5: the saves of steps 6 and 8 are refused, `latest` stays on step 4, which
    pruning (keep=1) never deletes; the final save's refusal is the run's one error, and --resume continues exactly."""
    out = tmp_path / "run"
    kill_at(monkeypatch, 5, lambda m: m.transformer.h[0].mlp.c_fc.weight.data.fill_(float("nan")))
    with pytest.raises(checkpoint.SaveError, match=r"step 8 was not written: non-finite values in "
                                                   r"model\.transformer\.h\.0\.mlp\.c_fc\.weight; ckpt/latest stays "
                                                   r"on .*step_000004"):
        train.main(argv(shards, out, "--ckpt.every=2", "--ckpt.keep=1"))
    said = capsys.readouterr().out
    assert "warning: the checkpoint of step 6 was not written: non-finite" in said
    assert "warning: step 5: loss is nan; update skipped (1 in a row)" in said
    assert sorted(os.listdir(out / "ckpt")) == ["latest", "step_000004"] and not os.path.exists(out / ".lock")
    monkeypatch.undo()
    resumed = train.main(argv(shards, out, "--resume"))
    assert resumed["start"] == 4 and resumed["losses"] == full[4:]


def test_a_nan_gradient_norm_counts_as_a_bad_step(shards, tmp_path, monkeypatch):
    """Finite loss, NaN gradients from step 3 on: skipped steps that count towards train.max_bad_steps; the weights
    stay finite, so the checkpoint of step 4 is written and verifies."""
    out = tmp_path / "run"
    kill_at(monkeypatch, 3, lambda m: m.transformer.h[1].attn.c_proj.weight.register_hook(lambda g: g * float("nan")))
    with pytest.raises(TrainingError, match="loss or gradient norm was non-finite for 3 steps in a row"):
        train.main(argv(shards, out, "--ckpt.every=2", "--train.max_bad_steps=3"))
    recs = [json.loads(ln) for ln in open(out / "metrics.jsonl")]  # (step 5's record: the error came first)
    assert [r["skipped"] for r in recs] == [False] * 3 + [True] * 2 and math.isfinite(recs[4]["loss"])
    path = checkpoint.latest(out)
    assert path.endswith("step_000004") and not checkpoint.nonfinite(torch.load(
        os.path.join(path, "rank_00000.pt"), weights_only=True)["engine"])


# ----------------------------------------------------------------------------------------------------------------
# writer errors (a full disk)

@pytest.mark.parametrize("kind", ["OSError", "RuntimeError", "meta.json"])
def test_a_writer_error_of_any_type_is_a_warning_and_leaves_nothing(shards, tmp_path, monkeypatch, capsys, kind):
    """The save of step 4 fails half-way (OSError from the file, torch.save's RuntimeError, or rank 0's meta.json):
    a warning, no temporary file left, `latest` stays on step 2, and training goes on to save step 6."""
    real_save, real_write, calls = torch.save, checkpoint._write_synced, {"n": 0}

    def failing_save(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            f.write(b"x" * 1000)  # a partial file, as a full disk leaves
            raise (OSError(28, "No space left on device") if kind == "OSError" else RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
        return real_save(obj, f, *a, **k)

    def failing_meta(path, text):
        if path.endswith("meta.json") and "step_000004" in path:
            raise OSError(28, "No space left on device")
        return real_write(path, text)
    if kind == "meta.json":
        monkeypatch.setattr(checkpoint, "_write_synced", failing_meta)
    else:
        monkeypatch.setattr(torch, "save", failing_save)
    out = tmp_path / "run"
    s = train.main(argv(shards, out, "--train.steps=6", "--ckpt.every=2", "--ckpt.keep=5"))
    said = capsys.readouterr().out
    why = "No space left on device" if kind != "RuntimeError" else "RuntimeError: .*unexpected pos 704 vs 598"
    assert len(s["losses"]) == 6
    assert any(__import__("re").search(rf"warning: could not save the checkpoint of step 4 under .*: {why}; the "
                                       rf"previous checkpoint .*step_000002 is intact; training goes on", ln)
               for ln in said.splitlines()), said
    assert sorted(os.listdir(out / "ckpt")) == ["latest", "step_000002", "step_000006"]


def test_the_only_save_failing_on_a_full_filesystem_is_one_line(shards, tmp_path):
    """A real writer error (a file size limit, as a full disk: EFBIG inside torch.save becomes its RuntimeError) at
    the final save of a run with no earlier checkpoint: exit 2, one line on stderr, no temporary file left."""
    out = tmp_path / "run"
    limit = ("import resource, signal, runpy, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
             "resource.setrlimit(resource.RLIMIT_FSIZE, (60000, 60000)); sys.argv = ['train.py'] + sys.argv[1:]; "
             "runpy.run_path('train.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", limit, *argv(shards, out, "--train.steps=2")], cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(r.stderr.strip().splitlines()) == 1 and "could not save the checkpoint of step 2" in r.stderr
    assert "no earlier checkpoint" in r.stderr and os.listdir(out / "ckpt") == []


# ----------------------------------------------------------------------------------------------------------------
# damaged checkpoints: resume, pruning and the listing verify them

def test_a_same_size_corrupt_shard_is_found_by_its_checksum(shards, tmp_path, full, capsys):
    out = a_copy(tmp_path, latest=4)
    corrupt(out / "ckpt" / "step_000004" / "rank_00000.pt", at=0.9)  # the optimizer state: the end of the file
    with pytest.raises(checkpoint.CheckpointError, match="does not match the sha256 recorded"):
        checkpoint.load(str(out / "ckpt" / "step_000004"), runguard_mesh())
    code, lines = listing(out)
    assert code == 0 and any("step_000004" in ln and "DAMAGED" in ln and "<- latest" in ln for ln in lines), lines
    assert lines[-1].startswith(f"--resume would use {out}/ckpt/step_000002: ckpt/latest names step_000004, which is "
                                f"unusable")
    capsys.readouterr()
    resumed = train.main(argv(shards, out, "--resume"))
    said = capsys.readouterr().out
    assert "sha256" in said and "took the newest complete checkpoint step_000002" in said and "weights_only" not in said
    assert resumed["start"] == 2 and resumed["losses"] == full[2:]


@pytest.mark.parametrize("damage", ["truncated", "same size"])
def test_pruning_never_deletes_a_complete_checkpoint_for_a_damaged_one(shards, tmp_path, full, damage):
    """Resumed at step 4 with step 6 damaged, keep=2: the save of step 8 keeps step 4 (the newest other checkpoint
    that verifies) and deletes step 2; the damaged step 6, written later than step 4, is neither kept nor deleted."""
    out = a_copy(tmp_path, latest=4, later=[6])
    shard = out / "ckpt" / "step_000006" / "rank_00000.pt"
    if damage == "truncated":
        with open(shard, "r+b") as f:
            f.truncate(1000)
    else:
        corrupt(shard)
    train.main(argv(shards, out, "--resume", "--ckpt.keep=2"))
    assert sorted(os.listdir(out / "ckpt")) == ["latest", "step_000004", "step_000006", "step_000008"]
    code, lines = listing(out)
    why = "truncated or corrupt" if damage == "truncated" else "does not match the sha256"
    assert code == 0 and why in next(ln for ln in lines if "step_000006" in ln)


def test_old_checkpoints_without_checksums_load_by_size(shards, tmp_path, full, capsys):
    out = a_copy(tmp_path, latest=4)
    meta_file = out / "ckpt" / "step_000004" / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["shard_sha256"]
    meta_file.write_text(json.dumps(meta))
    assert "ok (sizes only: no checksums recorded)" in "\n".join(listing(out)[1])
    capsys.readouterr()
    resumed = train.main(argv(shards, out, "--resume"))
    said = capsys.readouterr().out
    assert said.count("records no checksums") == 1 and resumed["losses"] == full[4:]


def test_listing_exit_codes(shards, tmp_path):
    out = tmp_path / "run"
    assert listing(tmp_path / "nothing")[0] == 2
    os.makedirs(out)
    assert listing(out) == (0, [f"{out}/ckpt:", "--resume would start from step 0: no checkpoint yet"])
    train.main(argv(shards, out, "--train.steps=2"))
    os.makedirs(out / "ckpt" / "tmp-step_000004")
    code, lines = listing(out)
    assert code == 0 and "an interrupted save" in lines[2] and "ok (1 shard, sha256)  <- latest" in lines[1]
    (out / "ckpt" / "step_000002" / "meta.json").write_text("{")
    code, lines = listing(out)
    assert code == 1 and lines[-1].startswith("--resume would stop: --resume: no checkpoint under")
    assert listing(out / "ckpt" / "step_000002")[0] == 1


def test_a_missing_shard_falls_back_to_the_newest_checkpoint_that_has_all(shards, tmp_path, full, capsys):
    out = a_copy(tmp_path, latest=4)
    os.remove(out / "ckpt" / "step_000004" / "rank_00000.pt")
    capsys.readouterr()
    resumed = train.main(argv(shards, out, "--resume"))
    said = capsys.readouterr().out
    assert "has no shard rank_00000.pt" in said and "took the newest complete checkpoint step_000002" in said
    assert resumed["start"] == 2 and resumed["losses"] == full[2:]


@pytest.mark.parametrize("case", ["missing shard", "another model", "a layout that cannot hold it", "newer format"])
def test_a_resume_that_cannot_work_is_one_line_before_any_work(shards, tmp_path, full, monkeypatch, case):
    """Every failure a user can cause on resume: one line (train.main prints it as `error: ...`, exit 2), raised
    before any model is built, the run directory untouched."""
    import re
    from nanopara.config import ConfigError
    out, extra = a_copy(tmp_path, latest=4), []
    if case == "missing shard":  # in every checkpoint
        for d in ("step_000002", "step_000004"):
            os.remove(out / "ckpt" / d / "rank_00000.pt")
        want = (rf"--resume: no checkpoint under {out}/ckpt verifies \(step_000004: checkpoint \S+ has no shard "
                rf"rank_00000.pt; step_000002: .*\): start over with --overwrite, or move the damaged ones away")
    elif case == "another model":
        extra, want = ["--model.n_layer=3"], r"trained with a different model: model.n_layer=2 \(this run: 3\)$"
    elif case == "a layout that cannot hold it":
        extra, want = ["--parallel.tp=4"], r"^model.n_head=2 is not divisible by parallel.tp=4$"
    else:
        meta_file = out / "ckpt" / "step_000004" / "meta.json"
        meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "format": checkpoint.FORMAT + 1}))
        want = (rf"checkpoint {out}/ckpt/step_000004 is of format {checkpoint.FORMAT + 1} \(meta.json\), newer than "
                rf"this nanopara reads \(format {checkpoint.FORMAT} and older\): resume it with the nanopara that "
                rf"wrote it$")
    before = {p: open(os.path.join(d, p), "rb").read() for d, _, ps in os.walk(out) for p in ps}
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("a model was built before the error"))
    with pytest.raises((checkpoint.CheckpointError, ConfigError)) as e:
        train.main(argv(shards, out, "--resume", *extra))
    assert re.search(want, str(e.value)) and "\n" not in str(e.value), str(e.value)
    assert {p: open(os.path.join(d, p), "rb").read() for d, _, ps in os.walk(out) for p in ps} == before


def runguard_mesh():
    from nanopara.mesh import Mesh
    return Mesh.build(device="cpu")


# ----------------------------------------------------------------------------------------------------------------
# the run directory: one trainer at a time, and never stuck

def test_a_second_trainer_is_refused_and_a_dead_ones_lock_taken_over(shards, tmp_path, capsys):
    out = tmp_path / "run"
    train.main(argv(shards, out, "--train.steps=2"))
    before = {p: open(os.path.join(d, p), "rb").read() for d, _, ps in os.walk(out) for p in ps}
    held = runguard.RunLock(str(out))  # another trainer, as far as the flock can tell
    try:
        with pytest.raises(runguard.RunLocked, match=rf"--out_dir {out} is in use by another trainer \(pid "
                                                     rf"{os.getpid()} on host {socket.gethostname()}, since"):
            train.main(argv(shards, out, "--train.steps=4", "--overwrite"))  # --overwrite must not delete its run
    finally:
        held.release()
    assert {p: open(os.path.join(d, p), "rb").read() for d, _, ps in os.walk(out) for p in ps} == before
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    (out / ".lock").write_text(f"pid={dead.pid}\nhost={socket.gethostname()}\nsince=0\nargv=train.py\n")
    capsys.readouterr()
    train.main(argv(shards, out, "--train.steps=4", "--resume"))
    assert f"note: took over the lock of {out}, left by pid {dead.pid}" in capsys.readouterr().out
    assert not (out / ".lock").exists()


def test_without_flock_the_lock_holders_pid_decides(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_flock)
    (tmp_path / ".lock").write_text(f"pid={os.getppid()}\nhost={socket.gethostname()}\nsince=0\n")  # alive
    with pytest.raises(runguard.RunLocked, match=f"pid {os.getppid()} on host"):
        runguard.RunLock(str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    (tmp_path / ".lock").write_text(f"pid={dead.pid}\nhost={socket.gethostname()}\nsince=0\n")
    lock = runguard.RunLock(str(tmp_path))
    assert "no longer running" in lock.note and runguard.read_holder(lock.path)["pid"] == os.getpid()
    lock.release()
    assert os.listdir(tmp_path) == []


def test_a_run_interrupted_before_its_first_checkpoint_is_not_stuck(shards, tmp_path, full, capsys):
    out = tmp_path / "run"
    train.main(argv(shards, out, "--train.steps=3", "--ckpt.final=false"))  # a log, no checkpoint
    with pytest.raises(checkpoint.CheckpointError, match="holds the log of a run that stopped before its first "
                                                         "checkpoint .*add --resume to start that run again"):
        train.main(argv(shards, out))
    capsys.readouterr()
    s = train.main(argv(shards, out, "--resume"))
    assert "holds no checkpoint yet: starting from step 0" in capsys.readouterr().out
    assert s["start"] == 0 and s["losses"] == full
    with pytest.raises(checkpoint.CheckpointError, match="already holds a run"):
        train.main(argv(shards, out))


# ----------------------------------------------------------------------------------------------------------------
# SIGTERM / SIGINT

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_at_the_next_step_boundary_and_resume_is_exact(shards, tmp_path, monkeypatch, full, capsys,
                                                                     sig):
    out = tmp_path / "run"
    old = signal.getsignal(sig)
    kill_at(monkeypatch, 3, lambda m: os.kill(os.getpid(), sig))  # during step 3
    with pytest.raises(SystemExit) as stop:
        train.main(argv(shards, out))
    now = signal.getsignal(sig)  # restored; after SIGTERM a handler that drops a late copy of it (runguard.REPEAT_S)
    assert now is old or (sig == signal.SIGTERM and getattr(now, "runguard_late_copy", False))
    signal.signal(sig, old)
    assert stop.value.code == 128 + sig and not (out / ".lock").exists()
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == (f"stopped by {sig.name} after step 3: saved checkpoint {out}/ckpt/step_000004; continue with "
                    f"--resume (exit code {128 + sig})")
    monkeypatch.undo()
    resumed = train.main(argv(shards, out, "--resume"))
    assert resumed["start"] == 4 and resumed["losses"] == full[4:]


def test_a_signal_with_checkpoints_off_saves_nothing(shards, tmp_path, monkeypatch, capsys):
    kill_at(monkeypatch, 1, lambda m: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(SystemExit, match="143"):
        train.main(argv(shards, tmp_path / "run", "--ckpt.final=false", "--ckpt.every=0"))
    assert capsys.readouterr().out.strip().endswith("after step 1: nothing saved (ckpt.every=0 and ckpt.final=false) "
                                                    "(exit code 143)")


def _steps_logged(out) -> int:
    try:
        return sum('"loss"' in ln for ln in open(out / "metrics.jsonl"))
    except FileNotFoundError:
        return 0


def _wait_for_steps(out, n, procs, timeout=180):
    t0 = time.time()
    while _steps_logged(out) < n:
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.time() - t0 < timeout, "the trainer never got going"
        time.sleep(0.2)


def _stopped_at(proc, out) -> int:
    """The step a SIGTERM stopped `proc` after: exit 143, no stderr, the stop line last, its checkpoint published."""
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143 and stderr == "", stderr
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("stopped by SIGTERM after step ")
    assert last.endswith("; continue with --resume (exit code 143)")
    step = int(last.split("after step ")[1].split(":")[0])
    assert checkpoint.latest(out).endswith(f"step_{step + 1:06d}")
    return step


def _train_cli(shards, out, *extra, env=None):
    return subprocess.Popen([sys.executable, "train.py", *argv(shards, out, "--train.steps=100000", *extra)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def test_sigterm_to_a_cli_run_saves_and_a_second_trainer_is_refused(shards, tmp_path):
    out = tmp_path / "run"
    a = _train_cli(shards, out)
    try:
        _wait_for_steps(out, 3, [a])
        b = subprocess.run([sys.executable, "train.py", *argv(shards, out, "--overwrite")], cwd=ROOT,
                           capture_output=True, text=True, timeout=240)
        assert b.returncode == 2 and b.stderr.strip().splitlines() == [
            ln for ln in b.stderr.strip().splitlines() if ln.startswith(f"error: --out_dir {out} is in use by "
                                                                       f"another trainer (pid {a.pid} on host")]
        assert len(b.stderr.strip().splitlines()) == 1 and a.poll() is None
        assert f"lock: held by pid {a.pid} on host" in listing(out)[1][-2]
        a.send_signal(signal.SIGTERM)
        step = _stopped_at(a, out)
    finally:
        a.kill()
    assert not (out / ".lock").exists()
    logged = [json.loads(ln)["step"] for ln in open(out / "metrics.jsonl") if '"loss"' in ln]
    assert logged == list(range(step + 1))  # one run's log, every step up to the stop, none twice


def test_a_sigterm_delivered_twice_is_one_notice_and_still_saves(shards, tmp_path):
    """A scheduler signals every process while torchrun forwards its own SIGTERM: the second copy, within
    runguard.REPEAT_S, must not kill the run before its save (it did: the second signal took the default action)."""
    out = tmp_path / "run"
    a = _train_cli(shards, out, "--model.n_embd=256", "--model.n_layer=4", "--train.micro_batch=32",
                   "--train.seq_len=32")  # steps of ~0.2 s: the second copy lands inside the step the first stops
    try:
        _wait_for_steps(out, 3, [a])
        a.send_signal(signal.SIGTERM)
        time.sleep(0.03)
        a.send_signal(signal.SIGTERM)
        _stopped_at(a, out)  # one stop line, its checkpoint published: the second copy did not kill the run
    finally:
        a.kill()


def _two_ranks(shards, out, *extra):
    port = free_port()
    return [_train_cli(shards, out, "--parallel.timeout_s=120", *extra,
                       env=dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), LOCAL_RANK=str(r),
                                WORLD_SIZE="2", OMP_NUM_THREADS="1")) for r in (0, 1)]


def test_a_second_trainer_of_two_gloo_ranks_is_refused_without_waiting(shards, tmp_path):
    out = tmp_path / "run"
    os.makedirs(out)
    held = runguard.RunLock(str(out))  # another trainer: rank 0 is refused, rank 1 learns it, neither waits
    procs = _two_ranks(shards, out)
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        held.release()
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [2, 2], outs
    errors = [ln for _, err in outs for ln in err.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith(f"error: --out_dir {out} is in use by another trainer (pid "
                                                     f"{os.getpid()}")


@pytest.mark.timeout_s(420)
def test_sigterm_to_one_rank_or_both_stops_two_gloo_ranks_at_the_same_step(shards, tmp_path):
    out = tmp_path / "run"
    for round_, targets, extra in (("one rank", [1], ()), ("both", [0, 1], ("--resume",))):
        procs = _two_ranks(shards, out, *extra)
        try:
            _wait_for_steps(out, 3 + (_steps_logged(out) if extra else 0), procs)
            for r in targets:
                procs[r].send_signal(signal.SIGTERM)
            outs = [p.communicate(timeout=180) for p in procs]
        finally:
            for p in procs:
                p.kill()
        assert [p.returncode for p in procs] == [143, 143], (round_, outs)
        last = outs[0][0].strip().splitlines()[-1]
        assert last.startswith("stopped by SIGTERM after step ") and "saved checkpoint" in last, (round_, last)
        assert outs[1][0].strip() == "" and outs[1][1].strip() == ""  # rank 1 says nothing
        step = int(last.split("after step ")[1].split(":")[0])
        meta = checkpoint.verify(checkpoint.latest(out))
        assert meta["step"] == step + 1 and sorted(meta["shard_sha256"]) == ["rank_00000.pt", "rank_00001.pt"]
    assert not (out / ".lock").exists()
