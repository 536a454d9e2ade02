"""Asynchronous checkpoints (nanopara/async_save.py) and FP8 scaling state in checkpoints, on CPU (gloo, fp32).

An async save writes the same checkpoint as a blocking one; training goes on while the writer writes; a second
save waits for the first; a SIGKILL mid-write leaves `latest` on the previous checkpoint and --resume continues
bit-exactly; a writer error of any type, on rank 0 or on another rank, is one warning and training goes on. FP8
delayed scaling's amax histories: a same-layout resume is bit-exact (and is not without them); another layout
takes per linear the max over the saved ranks. A GPU test trains on CUDA and resumes on CPU. The bench's smoke run.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import train
from nanopara import async_save, checkpoint, fp8, reshard
from nanopara.ckpt_inspect import inspect
from nanopara.cli import parse_args
from nanopara.mesh import Mesh
from nanopara.model import GPT
from nanopara.parallel import parallelize
from tests.distributed import spawn
from tests.tiny_run import tiny_argv, write_tiny_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_tiny_shards(tmp_path_factory.mktemp("ashards"), seed=2)


argv = tiny_argv


ASYNC = ("--ckpt.async_=true", "--ckpt.every=2", "--ckpt.keep=4")
_BLOCKING = {}


@pytest.fixture(scope="module")
def blocking(shards, tmp_path_factory):
    """Losses of an uninterrupted 8-step run with blocking saves of steps 2, 4, 6, 8; its directory in _BLOCKING."""
    _BLOCKING["dir"] = tmp_path_factory.mktemp("blocking") / "run"
    return train.main(argv(shards, _BLOCKING["dir"], "--ckpt.async_=false", "--ckpt.every=2", "--ckpt.keep=4"))[
        "losses"]


def equal(a, b, at="") -> None:
    """Nested dicts / lists / tensors equal, tensors bit for bit."""
    assert type(a) is type(b), at
    if torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), at
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), at
        for k in a:
            equal(a[k], b[k], f"{at}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), at
        for i, (x, y) in enumerate(zip(a, b)):
            equal(x, y, f"{at}.{i}")
    else:
        assert a == b, at


def slow_writer(monkeypatch, steps, seconds, events):
    """checkpoint._write_shard sleeps `seconds` before writing the shards of `steps`; events: (what, step, time)."""
    real = checkpoint._write_shard

    def write(state, file):
        step = int(os.path.basename(os.path.dirname(file)).split("_")[-1])
        if step in steps:
            events.append(("write starts", step, time.monotonic()))
            time.sleep(seconds)
        out = real(state, file)
        events.append(("write ends", step, time.monotonic()))
        return out
    monkeypatch.setattr(checkpoint, "_write_shard", write)


def forwards(monkeypatch, events):
    real = GPT.forward

    def forward(self, *a, **k):
        if self.training:
            events.append(("forward", sum(e[0] == "forward" for e in events), time.monotonic()))
        return real(self, *a, **k)
    monkeypatch.setattr(GPT, "forward", forward)


# ----------------------------------------------------------------------------------------------------------------
# the async writer

def test_an_async_save_writes_what_a_blocking_save_writes(shards, tmp_path, blocking, capsys):
    out = tmp_path / "run"
    s = train.main(argv(shards, out, *ASYNC))
    said = capsys.readouterr().out
    assert s["losses"] == blocking
    for step in (2, 4, 6):  # (8: the run's last save, blocking in both)
        assert f"checkpoint {out}/ckpt/step_{step:06d} published: " in said
    for step in (2, 4, 6, 8):
        a, b = (os.path.join(d, "ckpt", f"step_{step:06d}") for d in (out, _BLOCKING["dir"]))
        equal(torch.load(f"{a}/rank_00000.pt", weights_only=True), torch.load(f"{b}/rank_00000.pt", weights_only=True))
        ma, mb = checkpoint.verify(a), checkpoint.verify(b)
        drop = ("saved_at", "shard_bytes", "shard_sha256", "config")
        assert {k: v for k, v in ma.items() if k not in drop} == {k: v for k, v in mb.items() if k not in drop}
        assert ma["format"] == reshard.FORMAT and ma["config"]["ckpt"]["async_"] == "true"
    assert sorted(os.listdir(out / "ckpt")) == ["latest"] + [f"step_{s:06d}" for s in (2, 4, 6, 8)]


def test_training_goes_on_while_the_writer_writes(shards, tmp_path, monkeypatch, blocking, capsys):
    """The write of step 4 takes 1.5 s: steps 4 and 5 run meanwhile; the save of step 6 waits for it (one note)."""
    events = []
    slow_writer(monkeypatch, {4}, 1.5, events)
    forwards(monkeypatch, events)
    s = train.main(argv(shards, tmp_path / "run", *ASYNC))
    assert s["losses"] == blocking
    t = {(what, n): at for what, n, at in events}
    assert t[("write starts", 4)] < t[("forward", 4)] < t[("forward", 5)] < t[("write ends", 4)]
    assert t[("write ends", 4)] < t[("write ends", 6)]
    waited = [ln for ln in capsys.readouterr().out.splitlines() if " waited " in ln]
    assert len(waited) == 1 and waited[0].startswith("note: the save of step 6 waited ")


def test_a_second_save_waits_for_the_first_and_every_checkpoint_is_published(shards, tmp_path, monkeypatch,
                                                                            blocking, capsys):
    events = []
    slow_writer(monkeypatch, {2}, 1.0, events)
    out = tmp_path / "run"
    s = train.main(argv(shards, out, "--ckpt.async_=true", "--ckpt.every=1", "--ckpt.keep=10"))
    assert s["losses"] == blocking
    said = capsys.readouterr().out.splitlines()
    waited = [i for i, ln in enumerate(said) if " waited " in ln]
    assert len(waited) == 1 and said[waited[0]].startswith("note: the save of step 3 waited ")
    published = [i for i, ln in enumerate(said) if ln.startswith(f"checkpoint {out}/ckpt/step_000002 published: ")]
    assert published and published[0] < waited[0]  # step 3's save began after step 2 was published
    assert [e[1] for e in events if e[0] == "write ends"] == list(range(1, 9))  # one at a time, in order
    assert sum(" published: " in ln for ln in said) == 7  # steps 1-7 in the background (8: the last, blocking)
    assert sorted(os.listdir(out / "ckpt")) == ["latest"] + [f"step_{s:06d}" for s in range(1, 9)]
    for step in range(1, 9):
        checkpoint.verify(str(out / "ckpt" / f"step_{step:06d}"))


SLOW = ("import runpy, sys, time\n"
        "from nanopara import checkpoint\n"
        "real = checkpoint._write_shard\n"
        "def write(state, file):\n"
        "    if 'step_000004' in file:\n"
        "        time.sleep(600)\n"
        "    return real(state, file)\n"
        "checkpoint._write_shard = write\n"
        "sys.argv = ['train.py'] + sys.argv[1:]\n"
        "runpy.run_path('train.py', run_name='__main__')\n")


def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint(shards, tmp_path, blocking, capsys):
    """SIGKILL while step 4's shard is being written (training has gone on to step 5): `latest` still names step 2,
    which verifies; --resume continues it bit-exactly and removes the half-written save."""
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-c", SLOW, *argv(shards, out, *ASYNC)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while not (out / "metrics.jsonl").exists() or sum('"loss"' in ln for ln in open(out / "metrics.jsonl")) < 6:
            assert p.poll() is None and time.time() - t0 < 120, p.communicate()
            time.sleep(0.1)
        assert "a save being written" in next(ln for ln in inspect(str(out))[0] if "tmp-step_000004" in ln)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        p.kill()
        p.communicate()
    assert (out / "ckpt" / "latest").read_text() == "step_000002\n" and checkpoint.latest(out).endswith("step_000002")
    assert sorted(os.listdir(out / "ckpt")) == ["latest", "step_000002", "tmp-step_000004"]
    assert "an interrupted save" in next(ln for ln in inspect(str(out))[0] if "tmp-step_000004" in ln)
    capsys.readouterr()
    resumed = train.main(argv(shards, out, "--resume", *ASYNC))
    assert resumed["start"] == 2 and resumed["losses"] == blocking[2:]
    assert not [d for d in os.listdir(out / "ckpt") if not d.startswith(("step_", "latest"))]


@pytest.mark.parametrize("kind", ["OSError", "RuntimeError", "meta.json"])
def test_a_writer_error_in_the_background_is_a_warning(shards, tmp_path, monkeypatch, capsys, kind):
    """Step 4's background write fails half-way (OSError from the file, torch.save's RuntimeError, or rank 0's
    meta.json at publishing): one warning, nothing of it left, `latest` stays on step 2, training goes on."""
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
    monkeypatch.setattr(*((checkpoint, "_write_synced", failing_meta) if kind == "meta.json" else
                          (torch, "save", failing_save)))
    out = tmp_path / "run"
    s = train.main(argv(shards, out, "--train.steps=6", "--ckpt.async_=true", "--ckpt.every=2", "--ckpt.keep=5"))
    said = capsys.readouterr().out.splitlines()
    why = "No space left on device" if kind != "RuntimeError" else "RuntimeError: .*unexpected pos 704 vs 598"
    warned = [ln for ln in said if ln.startswith("warning:")]
    assert len(s["losses"]) == 6 and len(warned) == 1
    assert __import__("re").fullmatch(rf"warning: could not save the checkpoint of step 4 under .*: {why}; the "
                                      rf"previous checkpoint .*step_000002 is intact; training goes on and the next "
                                      rf"save tries again", warned[0]), warned
    assert sorted(os.listdir(out / "ckpt")) == ["latest", "step_000002", "step_000006"]


def test_sigterm_waits_for_the_background_write_before_its_line(shards, tmp_path, monkeypatch, blocking, capsys):
    """SIGTERM during step 3: the stop's save of step 4 goes to the background writer (slow: 1 s), and the stop
    line, the exit and the lock's release wait for it; --resume continues exactly."""
    events, real = [], GPT.forward
    slow_writer(monkeypatch, {4}, 1.0, events)

    def forward(self, *a, **k):
        if self.training and len([e for e in events if e[0] == "forward"]) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        if self.training:
            events.append(("forward", 0, 0.0))
        return real(self, *a, **k)
    monkeypatch.setattr(GPT, "forward", forward)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        train.main(argv(shards, out, *ASYNC))
    said = capsys.readouterr().out.strip().splitlines()
    assert stop.value.code == 143 and not (out / ".lock").exists()
    assert said[-2].startswith(f"checkpoint {out}/ckpt/step_000004 published: ")
    assert said[-1] == (f"stopped by SIGTERM after step 3: saved checkpoint {out}/ckpt/step_000004; continue with "
                        f"--resume (exit code 143)")
    monkeypatch.undo()
    assert train.main(argv(shards, out, "--resume"))["losses"] == blocking[4:]


def _two_ranks(rank, world, args, fail_rank):
    torch.set_num_threads(1)
    if rank == fail_rank:  # this rank's shard of step 4 cannot be written
        real = checkpoint._write_shard

        def write(state, file):
            if "step_000004" in file:
                raise OSError(28, "No space left on device")
            return real(state, file)
        checkpoint._write_shard = write
    train.main(args)


def test_two_ranks_publish_through_markers_and_another_ranks_error_is_a_warning(shards, tmp_path, capfd):
    """dp=2, async: rank 0's writer publishes step 2 once rank 1's marker says its shard is on disk (no collective
    off the training thread); rank 1's failure at step 4 reaches rank 0 through its marker: one warning naming
    rank 1, the tmp directory goes, training goes on and the last save (step 6) is published."""
    out = tmp_path / "run"
    spawn(_two_ranks, 2, argv(shards, out, "--parallel.dp=2", "--train.micro_batch=2", "--train.steps=6",
                              "--ckpt.async_=true", "--ckpt.every=2", "--ckpt.keep=5", "--parallel.timeout_s=60"), 1)
    said = capfd.readouterr().out
    assert said.count("warning:") == 1 and "could not save the checkpoint of step 4 under " in said
    assert ": rank 1: No space left on device; the previous checkpoint " in said
    assert sorted(os.listdir(out / "ckpt")) == ["latest", "step_000002", "step_000006"]
    for step in (2, 6):
        meta = checkpoint.verify(str(out / "ckpt" / f"step_{step:06d}"))
        assert sorted(meta["shard_sha256"]) == ["rank_00000.pt", "rank_00001.pt"]
        assert not [f for f in os.listdir(out / "ckpt" / f"step_{step:06d}") if f.endswith((".done", ".tmp"))]


def test_rank_0_waits_for_the_markers_a_bounded_time(tmp_path):
    async_save._mark(str(tmp_path), 1, {"bytes": 10, "sha256": "ab"})
    assert async_save._gather_marks(str(tmp_path), 2, 0.1) == ([(None, 10, "ab")], None)
    assert async_save._gather_marks(str(tmp_path), 3, 0.1)[1] == "rank 2 did not finish writing its shard within 0.1 s"
    async_save._mark(str(tmp_path / "gone"), 2, {"error": "x"})  # a removed directory: nothing, no error


# ----------------------------------------------------------------------------------------------------------------
# FP8 delayed scaling: the amax histories

FP8 = ("--train.fp8=tensor", "--train.fp8_delayed=true")


def test_fp8_amax_histories_make_a_same_layout_resume_exact(shards, tmp_path, capsys):
    """Saved at step 4 with every linear's X and dY histories; the resume equals the uninterrupted run bit for bit.
    The same resume with the histories taken out of the checkpoint does not (so the test can tell)."""
    out = tmp_path / "run"
    full = train.main(argv(shards, out, *FP8, "--ckpt.every=2", "--ckpt.keep=4"))["losses"]
    step4 = out / "ckpt" / "step_000004"
    amax = torch.load(step4 / "rank_00000.pt", weights_only=True)["fp8"]["amax"]
    assert sorted(amax) == [f"transformer.h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "attn.c_proj",
                                                                                 "mlp.c_fc", "mlp.c_proj")]
    assert all(h[k].shape == (16,) and torch.isfinite(h[k]).all() and h[k].max() > 0 for h in amax.values()
               for k in ("x", "dy"))
    for later in ("step_000006", "step_000008"):
        shutil.rmtree(out / "ckpt" / later)
    (out / "ckpt" / "latest").write_text("step_000004\n")
    kept = tmp_path / "kept"
    shutil.copytree(out, kept)
    assert train.main(argv(shards, out, *FP8, "--resume"))["losses"] == full[4:]
    state = torch.load(kept / "ckpt" / "step_000004" / "rank_00000.pt", weights_only=True)
    del state["fp8"]  # a checkpoint without them (as before they were saved): the scales restart from the tensors
    n, sha = checkpoint._write_shard(state, str(kept / "ckpt" / "step_000004" / "rank_00000.pt"))
    meta = json.loads((kept / "ckpt" / "step_000004" / "meta.json").read_text())
    meta["shard_bytes"]["rank_00000.pt"], meta["shard_sha256"]["rank_00000.pt"] = n, sha
    (kept / "ckpt" / "step_000004" / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    afresh = train.main(argv(shards, kept, *FP8, "--resume"))["losses"]
    assert afresh != full[4:] and "holds no FP8 amax histories" in capsys.readouterr().out


def test_merge_amax_takes_the_max_over_the_ranks_that_hold_a_linear():
    a = {"l1": {"x": torch.tensor([1.0, 4.0]), "dy": None}, "l2": {"x": torch.tensor([2.0]), "dy": torch.ones(1)}}
    b = {"l1": {"x": torch.tensor([3.0, 2.0]), "dy": torch.tensor([5.0, 5.0])}}
    m = fp8.merge_amax([a, None, b], ["l1", "l2", "l3"])
    assert torch.equal(m["l1"]["x"], torch.tensor([3.0, 4.0])) and torch.equal(m["l1"]["dy"], torch.tensor([5.0, 5.0]))
    assert torch.equal(m["l2"]["x"], torch.tensor([2.0])) and m["l3"] == {"x": None, "dy": None}
    assert torch.equal(fp8._fit(torch.tensor([3.0, 2.0]), 4), torch.tensor([3.0, 2.0, 2.0, 2.0]))


def _fp8_tp2(rank, world, args):
    torch.set_num_threads(1)
    train.main(args)


def test_fp8_amax_histories_carry_over_to_another_layout(shards, tmp_path, capsys):
    """tp2 -> one process: every linear's histories after the restore are the max over the two tp ranks' saved
    ones (a row-parallel X and a column-parallel dY are sharded: the max of the shards' amaxes is the whole's)."""
    out = tmp_path / "run"
    spawn(_fp8_tp2, 2, argv(shards, out, *FP8, "--parallel.tp=2", "--train.steps=4", "--ckpt.every=2",
                            "--parallel.timeout_s=60"))
    path = str(out / "ckpt" / "step_000002")
    saved = [torch.load(f"{path}/rank_{r:05d}.pt", weights_only=True)["fp8"]["amax"] for r in range(2)]
    assert any(not torch.equal(saved[0][n]["x"], saved[1][n]["x"]) for n in saved[0])  # the shards' amaxes differ
    cfg = parse_args(argv(shards, out, *FP8, "--train.steps=4"))
    mesh = Mesh.build(device="cpu")
    try:
        loader, _ = train.build_loaders(cfg, mesh, lambda *a: None)
        trainer = parallelize(GPT(cfg.model), mesh, cfg)
        capsys.readouterr()
        assert reshard.restore_training(path, mesh, trainer, loader) == 2
        assert "FP8 amax histories of" in capsys.readouterr().out
        got = fp8.amax_state(trainer.model)
    finally:
        mesh.destroy()
    assert sorted(got) == sorted(saved[0])
    for name in got:
        for k in ("x", "dy"):
            assert torch.equal(got[name][k], torch.maximum(saved[0][name][k], saved[1][name][k])), (name, k)


# ----------------------------------------------------------------------------------------------------------------
# on a GPU: the async writer's CUDA paths, and a GPU checkpoint resumed on CPU

# GPU (bf16 autocast, Triton kernels) -> CPU (fp32, PyTorch ops): the continued losses agree loosely. Measured
# stand-in on CPU (tiny preset, these flags): a bf16-autocast run's step-4 checkpoint resumed in fp32 differs from
# the bf16 run's own steps 4-7 by at most 9.1e-6 relative (7.9e-5 absolute). 2e-3 leaves room for the GPU kernels'
# own bf16 rounding (flash attention, fused cross-entropy) and still catches a wrong or stale load: one step's loss
# change here is 3-6%.
GPU_CPU_RTOL = 2e-3


def tiny_gpu(shards, out_dir, *extra):
    return ["--preset=tiny", f"--out_dir={out_dir}", f"--data.dataset={shards}", "--train.steps=8",
            "--train.warmup_steps=2", "--train.val_every=0", "--train.sample_tokens=0", "--train.log_every=1",
            "--ckpt.every=4", "--ckpt.keep=4", *extra]


@pytest.mark.gpu
@pytest.mark.timeout_s(600)
def test_a_gpu_checkpoint_resumes_on_cpu(shards, tmp_path, capsys):
    """The tiny preset trains 8 steps on CUDA; its step-4 checkpoint (written by the async writer: ckpt.async_=auto)
    loads on CPU with parameters and AdamW states bit-equal to the saved ones, and the CPU continues with losses
    close to the GPU run's (GPU_CPU_RTOL)."""
    out = tmp_path / "run"
    gpu = train.main(tiny_gpu(shards, out, "--device=cuda"))["losses"]
    assert f"checkpoint {out}/ckpt/step_000004 published: " in capsys.readouterr().out
    path = str(out / "ckpt" / "step_000004")
    saved = torch.load(f"{path}/rank_00000.pt", weights_only=True)
    cfg = parse_args(tiny_gpu(shards, out, "--device=cpu"))
    mesh = Mesh.build(device="cpu")
    try:
        loader, _ = train.build_loaders(cfg, mesh, lambda *a: None)
        trainer = parallelize(GPT(cfg.model), mesh, cfg)
        assert reshard.restore_training(path, mesh, trainer, loader) == 4
        equal(trainer.engine.model_state_dict(), saved["model"])
        equal(trainer.engine.state_dict(), saved["engine"])
    finally:
        mesh.destroy()
    shutil.rmtree(out / "ckpt" / "step_000008")
    (out / "ckpt" / "latest").write_text("step_000004\n")
    cpu = train.main(tiny_gpu(shards, out, "--device=cpu", "--resume"))["losses"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(cpu, gpu[4:]))
    print(f"GPU -> CPU: continued losses within {rel:.2e} relative of the GPU run's")
    assert len(cpu) == 4 and rel <= GPU_CPU_RTOL, (cpu, gpu[4:])


class _Counter:
    def state_dict(self):
        return {"sample": 0}


def _tiny_gpu_trainer(tmp_path, monkeypatch, staged: bool):
    """(cfg, mesh, the tiny preset's Trainer on one GPU, a token batch), snapshots GPU-staged or not."""
    monkeypatch.setattr(async_save, "STAGE_FRACTION", 0.85 if staged else 0.0)
    cfg = parse_args(["--preset=tiny", "--device=cuda", f"--out_dir={tmp_path}", "--train.steps=100"])
    mesh = Mesh.build(device="cuda")
    trainer = parallelize(GPT(cfg.model), mesh, cfg)
    return cfg, mesh, trainer, torch.randint(0, 1000, (cfg.train.micro_batch, cfg.train.seq_len + 1), device="cuda")


@pytest.mark.gpu
@pytest.mark.timeout_s(300)
@pytest.mark.parametrize("staged", [True, False], ids=["gpu-staged", "pinned-on-the-stream"])
def test_the_gpu_snapshot_holds_the_values_at_the_save(tmp_path, monkeypatch, staged):
    """Both CUDA snapshot paths (a GPU copy then a background D2H; or D2H queued on the training stream): the
    checkpoint holds the state of the save's step although the training thread steps on before the write ends."""
    cfg, mesh, trainer, tok = _tiny_gpu_trainer(tmp_path, monkeypatch, staged)
    try:
        batches = [(tok[:, :-1], tok[:, 1:])]

        def step():
            trainer.forward_backward(batches)
            trainer.step(1e-3)
        step()
        want = {k: v.detach().cpu().clone() for k, v in trainer.engine.model_state_dict().items()}
        checkpoint.save_training(str(tmp_path), 1, mesh, trainer, _Counter(), {"config": cfg.to_dict()}, keep=2,
                                 background=True)
        for _ in range(3):  # the parameters move on while the copy and the write may still run
            step()
        assert async_save.drain(str(tmp_path), release=True) is None
        moved = trainer.engine.model_state_dict()
    finally:
        mesh.destroy()
    got = torch.load(tmp_path / "ckpt" / "step_000001" / "rank_00000.pt", weights_only=True)["model"]
    equal(got, want)
    assert any(not torch.equal(moved[k].cpu(), want[k]) for k in want)


# ----------------------------------------------------------------------------------------------------------------
# the benchmark (bench/bench_ckpt.py): a smoke run on CPU

def test_bench_ckpt_smoke_on_cpu(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_ckpt
    rows = bench_ckpt.main(["--device=cpu", "--preset=tiny", "--every=2", "--periods=2", "--base_periods=1",
                            "--seq=16", "--micro_batch=2", "--tokens_per_step=64", "--warmup=1", "--each",
                            f"--ckpt_dir={tmp_path / 'ck'}", f"--out={tmp_path / 'rows.jsonl'}", "--",
                            "--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
                            "--model.vocab_size=256", "--model.kernels=torch"])
    lines = [json.loads(ln) for ln in open(tmp_path / "rows.jsonl")]
    assert [r["mode"] for r in lines] == ["none", "blocking", "async", "none"]
    assert [r["saves"] for r in rows] == [0, 2, 2, 0]
    assert all(r["tokens_per_s"] > 0 and r["tokens_per_s_steps"] >= r["tokens_per_s"] and r["gpu"] == "cpu"
               for r in lines)
    assert abs(lines[0]["vs_none"] + lines[3]["vs_none"] - 2) < 1e-9  # against the mean of the two `none` rows
    assert all(len(r["step_ms_idle"]) + len(r["step_ms_writing"]) == r["steps"] for r in lines)  # --each: all steps
    assert capsys.readouterr().out.count(" published: ") == 2 and not os.listdir(tmp_path / "ck")


def test_the_shard_writer_starts_writeback_as_it_goes_and_hashes_the_file(tmp_path, monkeypatch):
    """shard_io kicks the disk every KICK_BYTES (posix_fadvise over the bytes since the last kick, in order, without
    gaps), hashes large writes on a second thread, and the sha256 it returns is the file's."""
    import hashlib
    from nanopara import shard_io
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise on this platform")
    import threading
    kicks, hashed_on, real_sha256 = [], set(), hashlib.sha256

    class Sha:  # hashlib's sha256, noting which threads fed it
        def __init__(self):
            self.h = real_sha256()

        def update(self, b):
            hashed_on.add(threading.current_thread().name.split("_")[0])
            self.h.update(b)

        def hexdigest(self):
            return self.h.hexdigest()
    monkeypatch.setattr(shard_io.hashlib, "sha256", Sha)
    monkeypatch.setattr(shard_io, "KICK_BYTES", 1 << 16)
    monkeypatch.setattr(shard_io, "PARALLEL_HASH_BYTES", 100_000)  # tensors on the second thread, headers here
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: kicks.append((off, n, advice)))
    state = {f"w{i}": torch.randn(40_000) for i in range(5)}  # 160 kB a tensor: a kick after each
    n, sha = shard_io.write_shard(state, str(tmp_path / "s.pt"))
    data = (tmp_path / "s.pt").read_bytes()
    assert n == len(data) and sha == real_sha256(data).hexdigest()
    assert hashed_on == {"MainThread", "nanopara-sha256"}
    assert len(kicks) >= 5 and all(a == os.POSIX_FADV_DONTNEED for *_, a in kicks)
    assert kicks[0][0] == 0 and all(o2 == o1 + n1 for (o1, n1, _), (o2, _, _) in zip(kicks, kicks[1:]))
    assert torch.equal(torch.load(tmp_path / "s.pt")["w3"], state["w3"])


def test_the_shard_writer_kicks_inside_one_large_tensor(tmp_path, monkeypatch):
    """torch.save hands a tensor's bytes over in one write: shard_io passes them on in CHUNK_BYTES pieces, so the
    writeback starts every KICK_BYTES within a tensor too (one 4 GB optimizer buffer would otherwise be one kick)."""
    from nanopara import shard_io
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise on this platform")
    kicks = []
    monkeypatch.setattr(shard_io, "KICK_BYTES", 1 << 16)
    monkeypatch.setattr(shard_io, "CHUNK_BYTES", 1 << 15)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: kicks.append((off, n)))
    state = {"flat": torch.randn(1 << 18)}  # 1 MiB in one storage
    n, sha = shard_io.write_shard(state, str(tmp_path / "s.pt"))
    assert len(kicks) >= 14 and all(k <= (1 << 16) + (1 << 15) for _, k in kicks)
    assert sha == shard_io.sha256_of(str(tmp_path / "s.pt")) and n == os.path.getsize(tmp_path / "s.pt")
    shard_io._HASHED.clear()
    assert sha == shard_io.sha256_of(str(tmp_path / "s.pt"))  # hashed again from the file: the same digest
    assert torch.equal(torch.load(tmp_path / "s.pt")["flat"], state["flat"])


def test_bench_writer_contention_smoke(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_writer_contention
    rows = bench_writer_contention.main(["--mb=8", f"--dir={tmp_path}", "--idle_s=0.05"])
    assert [(r["probe"], r["background"]) for r in rows][:4] == [("ticker", k) for k in
                                                                  ("idle", "raw", "write_shard_serial", "write_shard")]
    assert all(r.get("ops_per_s", 1) > 0 and r.get("worst_gap_ms", 1) > 0 for r in rows) and not os.listdir(tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# pinned host buffers reserved once, before the first save (async_save.reserve)

def test_train_reserves_the_host_buffers_once_after_its_first_step(shards, tmp_path, monkeypatch, capsys):
    """train.py pins the async saves' host buffers once, after its first step (the optimizer state exists then),
    and only when background saves will come: not under blocking saves or without ckpt.every."""
    calls = []
    real = async_save.reserve

    def spy(state, writer):
        calls.append(sorted(state["engine"]))  # the optimizer state is in it
        return real(state, writer)
    monkeypatch.setattr(async_save, "reserve", spy)
    train.main(argv(shards, tmp_path / "a", *ASYNC))
    assert len(calls) == 1 and calls[0], calls
    calls.clear()
    train.main(argv(shards, tmp_path / "b", "--ckpt.async_=false", "--ckpt.every=2"))
    train.main(argv(shards, tmp_path / "c", "--ckpt.async_=true", "--ckpt.every=0"))
    assert calls == []


@pytest.mark.gpu
@pytest.mark.timeout_s(300)
@pytest.mark.parametrize("staged", [True, False], ids=["gpu-staged", "pinned-on-the-stream"])
def test_a_save_after_reserve_pins_nothing_new(tmp_path, monkeypatch, staged):
    """reserve() pins a buffer per CUDA tensor in snapshot()'s order: the save then reuses every one of them."""
    cfg, mesh, trainer, tok = _tiny_gpu_trainer(tmp_path, monkeypatch, staged)
    try:
        trainer.forward_backward([(tok[:, :-1], tok[:, 1:])])
        trainer.step(1e-3)
        writer = async_save.writer_for(str(tmp_path))
        async_save.reserve(trainer.state_dict(), writer)
        pinned = [id(b) for b in writer.pinned]
        assert pinned and all(b.is_pinned() for b in writer.pinned)
        checkpoint.save_training(str(tmp_path), 1, mesh, trainer, _Counter(), {"config": cfg.to_dict()}, keep=2,
                                 background=True)
        assert async_save.drain(str(tmp_path), release=True) is None
        assert [id(b) for b in writer.pinned] == pinned
    finally:
        mesh.destroy()
