"""Resume under any layout (nanopara/reshard.py): a checkpoint written by one layout continues under another.

Each pair of the matrix: the source layout trains STEPS steps and saves after step SAVE; the target layout (1) loads
that checkpoint and saves it again at once, and the two checkpoints consolidate (reshard.full_state: parameters and
AdamW's m, v, single-device) to bit-equal tensors and the same loader position; (2) resumes it and trains the
STEPS - SAVE steps left, whose losses must match the source's own continuation to RTOL (relative; fp32, CPU, dropout
0, the same global batch: 256 tokens a step, whatever dp, cp and micro-batch). Pairs marked exact must match bit for
bit (the same reduction order: reshard.py's docstring). The loader tests count windows: across a resume that changes
dp and the micro-batch no window is seen twice or skipped, also across an epoch's end.
Run: .venv/bin/python -m pytest tests/test_reshard.py -q   (tiny 4-block models on gloo; ~70 s on 2 loaded cores)
"""
import json
import os
import shutil

import numpy as np
import pytest
import torch

import train
from nanopara import checkpoint, reshard
from nanopara.cli import parse_args
from nanopara.reshard import full_optimizer_state
from nanopara.data import TokenLoader, write_shard
from nanopara.mesh import Mesh
from nanopara.parallel import parallelize
from tests.distributed import free_ports, spawn
from tests.shards import tiny_shards

STEPS, SAVE = 6, 1  # the source saves after step SAVE; the target trains the 5 steps left
RTOL = 1e-5


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tiny_shards(tmp_path_factory.mktemp("rshards"), "r", val=None)


def argv(shards, out_dir, layout):
    """layout: "mb=N" (micro-batch, default 8), "moe" (tiny_moe) and --parallel.* keys, e.g. "dp=2 zero=1"."""
    keys = dict(kv.split("=") if "=" in kv else (kv, "") for kv in layout.split())
    return [f"--preset={'tiny_moe' if 'moe' in keys else 'tiny'}", "--device=cpu", f"--out_dir={out_dir}",
            f"--data.dataset={shards}", "--model.n_layer=4", "--model.n_head=4", "--model.n_embd=32",
            "--model.block_size=32", "--model.vocab_size=250", "--model.kernels=torch",
            f"--train.micro_batch={keys.pop('mb', 8)}", "--train.seq_len=16", f"--train.steps={STEPS}",
            "--train.warmup_steps=2", "--train.val_every=0", "--train.sample_tokens=0", "--train.lr=1e-2",
            "--train.tokens_per_step=256", "--train.log_every=1", "--ckpt.final=false", "--parallel.timeout_s=120",
            *[f"--parallel.{k}={v}" for k, v in keys.items() if k != "moe"]]


def world_of(layout):
    keys = dict(kv.split("=") for kv in layout.split() if "=" in kv)
    return int(np.prod([int(keys.get(k, 1)) for k in ("dp", "tp", "pp", "cp")]))


def _source(rank, world, args, out_file):
    torch.set_num_threads(1)
    losses = train.main(args)["losses"]
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(losses, f)


def _target(rank, world, args, ports, path, copy_dir, out_file):
    """Load the checkpoint under this layout and save it again (copy_dir), then resume and train to STEPS."""
    torch.set_num_threads(1)
    os.environ["MASTER_PORT"] = str(ports[0])
    cfg = parse_args(args)
    p = cfg.parallel
    mesh = Mesh.build(p.dp, p.pp, p.cp, p.tp, cfg.device, p.timeout_s, ep=p.ep)
    loader, _ = train.build_loaders(cfg, mesh, lambda *a: None)
    trainer = parallelize(train.build_model(cfg, True, lambda *a: None), mesh, cfg)
    step = reshard.restore_training(path, mesh, trainer, loader)
    checkpoint.save_training(copy_dir, step, mesh, trainer, loader, {"config": cfg.to_dict()}, keep=1)
    trainer.close()
    mesh.destroy()
    os.environ["MASTER_PORT"] = str(ports[1])
    losses = train.main(args + ["--resume"])["losses"]
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(losses, f)


def run(fn, world, *args):
    """fn(rank, world, *args) in `world` gloo processes; one process: here (train.py's single-process path)."""
    if world > 1:
        return spawn(fn, world, *args)
    threads = torch.get_num_threads()
    try:
        fn(0, 1, *args)
    finally:
        torch.set_num_threads(threads)


_SOURCES = {}


def source(shards, tmp_path_factory, layout):
    """(losses, checkpoint of step SAVE) of a source layout, trained once per module."""
    if layout not in _SOURCES:
        d = tmp_path_factory.mktemp("src")
        args = argv(shards, d / "run", layout) + ["--ckpt.every=1", "--ckpt.keep=10"]
        run(_source, world_of(layout), args, str(d / "losses.json"))
        _SOURCES[layout] = (json.loads((d / "losses.json").read_text()), str(d / "run" / "ckpt" / f"step_{SAVE:06d}"))
    return _SOURCES[layout]


MATRIX = [  # (source layout, target layout, exact: the same reduction order, so bit-equal losses)
    ("dp=2 mb=4", "mb=8", False),                                             # dp2 -> one process
    ("dp=2 mb=4", "dp=2 mb=4 zero=1", True),                                  # DDP -> ZeRO-1 at the same dp
    ("dp=4 zero=3 mb=2", "dp=2 zero=1 mb=4", False),                          # ZeRO-3 dp4 -> ZeRO-1 dp2
    ("dp=4 zero=3 mb=2", "tp=2 cp=2", False),                                 # ZeRO-3 dp4 -> tp2 x cp2
    ("tp=2 sp=true", "dp=2", False),                                          # tp2 + sp -> dp2
    ("pp=2 pp_schedule=1f1b mb=2", "tp=2", False),                            # pp2 (1F1B) -> tp2
    ("pp=2 pp_schedule=1f1b mb=2", "pp=2 pp_schedule=gpipe mb=2", True),      # another schedule
    ("pp=2 pp_schedule=1f1b mb=2", "pp=2 pp_layers=1,3 pp_schedule=zb mb=2", False),  # another split
    ("pp=2 dp=2 mb=2", "pp=4 mb=2", False),                                   # pp2 x dp2 -> pp4
    ("cp=2", "dp=2 mb=4", False),                                             # cp2 -> dp2
    ("moe ep=2 dp=2 zero=1 mb=4", "moe mb=4", False),                         # ep2 -> one process
    ("tp=2 pp=2 dp=2 sp=true zero=1 mb=4", "mb=8", False),                    # tp2 x pp2 x dp2 -> one process
    ("mb=8", "pp=2 dp=2 pp_schedule=interleaved pp_virtual=2 zero=1 mb=2", False),  # one -> interleaved x ZeRO-1
    ("tp=2 sp=true", "dp=4 zero=3 mb=2", False),                              # tp2 + sp -> ZeRO-3 dp4
    ("dp=2 mb=4", "dp=2 zero=2 mb=4", False),                                 # DDP -> ZeRO-2 (sums per micro-step)
]


@pytest.mark.parametrize("src, dst, exact", MATRIX, ids=[f"{a}->{b}".replace(" ", ",") for a, b, _ in MATRIX])
def test_resume_under_another_layout(shards, tmp_path_factory, tmp_path, src, dst, exact):
    ref, ckpt = source(shards, tmp_path_factory, src)
    run_dir = tmp_path / "run"
    os.makedirs(run_dir / "ckpt")
    shutil.copytree(ckpt, run_dir / "ckpt" / os.path.basename(ckpt))
    (run_dir / "ckpt" / "latest").write_text(os.path.basename(ckpt) + "\n")
    run(_target, world_of(dst), argv(shards, run_dir, dst), free_ports(2), ckpt, str(tmp_path / "copy"),
        str(tmp_path / "losses.json"))
    # (1) loaded under the new layout and saved again: the same single-device tensors, bit for bit
    copy = os.path.join(tmp_path / "copy", "ckpt", os.path.basename(ckpt))
    for (name, a), (name_b, b) in zip(reshard.full_state(ckpt), reshard.full_state(copy), strict=True):
        assert name == name_b
        for key in a:
            assert a[key] is not None and torch.equal(a[key], b[key]), f"{name} {key}"
    opt = full_optimizer_state(ckpt)  # the same joins, in engine.py's "full" form
    assert opt["step"] == SAVE and all(torch.equal(opt["state"][n][k], s[k]) for n, s in reshard.full_state(copy)
                                       if n in opt["state"] for k in ("exp_avg", "exp_avg_sq"))
    loaded = [torch.load(f"{d}/rank_00000.pt", weights_only=True)["loader"]["sample"] for d in (ckpt, copy)]
    assert loaded[0] == loaded[1] == SAVE * 256 // 16
    # (2) the continued losses
    got = json.loads((tmp_path / "losses.json").read_text())
    want = ref[SAVE:]
    rel = float(np.max(np.abs(np.subtract(got, want)) / np.abs(want)))
    print(f"{src} -> {dst}: max relative loss difference {rel:.2e}")
    assert len(got) == STEPS - SAVE
    if exact:
        assert got == want
    assert rel <= RTOL, (got, want)


# ----------------------------------------------------------------------------------------------------------------
# the loader's position in global samples: windows counted across a resume that changes dp and the micro-batch

SIZES, T = (1237, 998, 3001), 7  # odd shard sizes; 746 windows an epoch


def _stream(loaders, accum, steps):
    """Window ids (the first token: shard*10000 + offset) in global sample order: micro-step, rank, row."""
    out = []
    for _ in range(steps):
        for _ in range(accum):
            for ld in loaders:
                out += next(ld)[0][:, 0].tolist()
    return out


@pytest.mark.parametrize("src, dst", [((2, 3, 2), (3, 4, 1)), ((1, 12, 1), (4, 1, 3)), ((3, 2, 2), (1, 2, 6))])
def test_no_window_twice_or_skipped_across_a_resume(tmp_path, src, dst):
    """(world, micro-batch, micro-steps) of 12 samples a step; the resume (after 60 steps) and the epoch's end (at
    62.2 steps) fall close, so the continued steps cross it."""
    files = []
    for i, n in enumerate(SIZES):
        files.append(str(tmp_path / f"w_train_{i}.bin"))
        write_shard(files[-1], i * 10000 + np.arange(n))

    def loaders(world, B):
        return [TokenLoader(files, B, T, rank=r, world=world, seed=3) for r in range(world)]
    total = sum((n - 1) // T for n in SIZES)
    whole = _stream(loaders(1, 12), 1, 70)
    first = loaders(*src[:2])
    got = _stream(first, src[2], 60)
    state = first[0].state_dict()
    assert state["sample"] == 60 * 12 and all(ld.state_dict() == state for ld in first)
    second = loaders(*dst[:2])
    for ld in second:
        ld.load_state_dict(state)
    got += _stream(second, dst[2], 10)
    assert got == whole  # the order depends on the global sample index only
    assert len(got[:total]) == len(set(got[:total])) == total  # epoch 0: every window once
    assert len(set(got[total:])) == len(got) - total  # epoch 1 goes on without repeats


def test_loader_state_of_the_format_before_samples(tmp_path):
    path = str(tmp_path / "o_train.bin")
    write_shard(path, np.arange(1000))
    ld = TokenLoader([path], 2, T, world=3, seed=1)
    ld.load_state_dict({"epoch": 0, "position": 5, "seed": 1, "rows": 4, "seq_len": T, "windows": 142, "shuffle": 1})
    assert ld.sample == 20  # 5 global batches of the saved 4 rows
    with pytest.raises(ValueError, match="seed=2 saved, 1 now"):
        ld.load_state_dict({"sample": 0, "seed": 2})


def test_a_newer_checkpoint_format_is_one_clear_error():
    reshard.check_format({"format": reshard.FORMAT}, {"ckpt_format": reshard.FORMAT}, "ck")
    reshard.check_format({}, {}, "ck")  # format 1: written before the version was recorded
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoint ck is of format 3 \(its shards\), newer than "
                                                         r"this nanopara reads \(format 2 and older\)"):
        reshard.check_format({}, {"ckpt_format": 3}, "ck")


def test_a_rank_reads_only_the_tensors_its_part_meets(shards, tmp_path_factory, monkeypatch):
    """Streaming: a ZeRO-3 rank's part (each flat's [lo, hi)) is built from the parameters that meet it, one full
    tensor at a time, and equals what that rank saved, bit for bit."""
    _, ckpt = source(shards, tmp_path_factory, "dp=4 zero=3 mb=2")
    src = reshard.Source(ckpt)
    asked, full = [], reshard.Source.full
    monkeypatch.setattr(reshard.Source, "full", lambda self, name, key="param": asked.append(name) or
                        full(self, name, key))
    own = torch.load(f"{ckpt}/rank_00001.pt", weights_only=True)
    built = reshard._local_state(src, own)
    meets = {n for f in own["model"]["flats"] for n, shape, off in f["params"]
             if off < f["hi"] and off + int(np.prod(shape)) > f["lo"]}
    assert set(asked) == meets and len(meets) < len({n for n, _ in reshard.full_state(ckpt)})
    for part in ("model", "engine"):
        for f, g in zip(own[part]["flats"], built[part]["flats"], strict=True):
            for key in reshard.KEYS:
                assert key not in f or torch.equal(f[key], g[key]), (part, key)
