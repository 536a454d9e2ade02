"""Checkpoints: a save never publishes state that fails verification, and resume finds one that verifies.

    <out_dir>/ckpt/step_000100/  one checkpoint, renamed into place when whole (run directory: runguard.py)
        meta.json                step, layout, format, config, each shard's size and sha256 as written, write time
        rank_00000.pt ...        each rank's model/optimizer shard, loader, RNG, scaler (`sha256sum` agrees)
    <out_dir>/ckpt/latest        names the checkpoint to resume from (replaced atomically, after its checkpoint)

Save (collective): `save_training` refuses a state holding inf/NaN. Every rank writes `tmp-step_N/rank_R.pt`
through a temporary name, hashing the bytes as they go, and fsyncs (shard_io.py); the ranks exchange (error, size,
sha256). Any rank's error, of any type (torch.save raises RuntimeError on a full disk), fails the save on every rank
(`SaveError`): the tmp directory goes. Else rank 0 writes meta.json, checks every shard's size on disk, renames the
directory into place, points `latest` at it, and the ranks prune to the newest `keep` checkpoints that verify (by
write time). A crash at any point leaves the previous checkpoint and `latest` intact. Under ckpt.async_ (on GPU by
default) the same files are written by a background thread from a host copy, training goes on, and rank 0's thread
publishes once every rank's shard is on disk (async_save.py); the run's last save is blocking.
Verify: meta complete, a shard for every rank, sizes and sha256 as recorded (a checkpoint from before checksums:
sizes only, said). Each rank hashes its share of the shards (a process hashes a file once). Resume
(`find_resume`): `latest`, else the newest checkpoint that verifies, saying which and why; no checkpoint at all:
`NoCheckpoint`; a newer format or another model: one line before any model work (`check_model_matches`). Load:
`weights_only=True`, layout checked, inf/NaN refused, the ranks agree on the outcome.
`python -m nanopara.checkpoint DIR` lists, verifies, says what a resume would use.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from nanopara import async_save
from nanopara.mesh import Mesh
from nanopara.runguard import (RUN_FILES, AgreedError, CheckpointError, check_out_dir, ckpt_root,  # noqa: F401
                               prepare_run_dir, step_dirs as _step_dirs)  # (re-exported: train.py, rl.py, tests)
from nanopara.shard_io import fsync_dir as _fsync_dir, sha256_of, write_shard as _write_shard, \
    write_synced as _write_synced  # (by these names here: tests replace them)
from nanopara.trainer import CKPT_FORMAT as FORMAT  # 2: the loader's position in global samples; 1: before


class SaveError(AgreedError):
    """A checkpoint that was not written (non-finite state, or a write error on some rank); nothing was published."""


class NoCheckpoint(CheckpointError):
    """The run directory holds no checkpoint at all (no step directory, no `latest`)."""


def _all_gather(mesh: Mesh, obj) -> list:
    """Every rank's `obj`, in rank order (collective; [obj] in a world of one)."""
    if mesh is None or mesh.world == 1:
        return [obj]
    out = [None] * mesh.world
    dist.all_gather_object(out, obj)
    return out


def _first_error(mesh: Mesh, err: str | None) -> str | None:
    """The first rank's error (every rank learns it; collective)."""
    errs = [(r, e) for r, e in enumerate(_all_gather(mesh, err)) if e]
    return None if not errs else errs[0][1] if mesh is None or mesh.world == 1 else f"rank {errs[0][0]}: {errs[0][1]}"


def _why(e: BaseException) -> str:
    if isinstance(e, OSError):
        return e.strerror or str(e)
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"  # torch's run over several lines


def layout(mesh: Mesh) -> dict:
    ep = {"ep": mesh.sizes["ep"]} if mesh.sizes.get("ep", 1) > 1 else {}  # expert parallel (ep.py), carved from dp x cp
    return {"world": mesh.world, **{ax: mesh.sizes[ax] for ax in ("pp", "dp", "cp", "tp")}, **ep}


# ----------------------------------------------------------------------------------------------------------------
# save

def save(out_dir: str, step: int, mesh: Mesh, state: dict, meta: dict, keep: int = 2) -> str:
    """Write this rank's `state` (tensors, dicts, lists, numbers) as part of the checkpoint of `step`.

    Collective over the whole mesh: every rank must call it. Returns the final directory. On failure (SaveError on
    every rank) the tmp directory is removed and the previous checkpoints and `latest` are untouched.
    """
    root, name = ckpt_root(out_dir), f"step_{step:06d}"
    tmp_dir = _begin(root, name, mesh)
    file = os.path.join(tmp_dir, f"rank_{mesh.rank:05d}.pt")
    err = size = sha = None
    try:
        size, sha = _write_shard(state, file)
    except Exception as e:  # OSError, torch.save's RuntimeError on a full disk, a pickling error, ...
        err = _why(e)
        for f in (file + ".tmp", file):
            shutil.rmtree(f, ignore_errors=True) if os.path.isdir(f) else os.path.exists(f) and os.remove(f)
    written = _all_gather(mesh, (err, size, sha))  # every rank learns that one failed, none waits at a barrier
    errs = [(r, e) for r, (e, _, _) in enumerate(written) if e]
    err = None if not errs else errs[0][1] if mesh.world == 1 else f"rank {errs[0][0]}: {errs[0][1]}"
    if err is None and mesh.is_main:
        try:
            _publish(root, name, _with_shards({**meta, "step": step, "layout": layout(mesh)}, written))
        except Exception as e:
            err = _why(e)
    if err is not None and mesh.is_main:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    err = _all_gather(mesh, err)[0]  # rank 0's outcome (it knows the writers' errors too), to every rank
    if err is not None:
        raise SaveError(err)
    _prune(root, keep, name, mesh)
    return os.path.join(root, name)


def _begin(root: str, name: str, mesh: Mesh) -> str:
    """Rank 0 makes tmp-<name>, removing what failed or killed saves left (no write is in flight when a save
    begins: save_training waits for it); every rank learns the outcome (collective). Returns the tmp directory."""
    tmp_dir, err = os.path.join(root, "tmp-" + name), None
    if mesh.is_main:
        try:
            for d in os.listdir(root) if os.path.isdir(root) else ():
                if d.startswith("tmp-"):
                    shutil.rmtree(os.path.join(root, d), ignore_errors=True)
            os.makedirs(tmp_dir)
        except OSError as e:
            err = _why(e)
    err = _first_error(mesh, err)
    if err is not None:
        raise SaveError(err)
    return tmp_dir


def _with_shards(meta: dict, written: list) -> dict:
    """meta.json's contents: `meta` + completeness, write time and every rank's (error, bytes, sha256) shard."""
    return {**meta, "complete": True, "saved_at": time.time(),
            "shard_bytes": {f"rank_{r:05d}.pt": n for r, (_, n, _) in enumerate(written)},
            "shard_sha256": {f"rank_{r:05d}.pt": h for r, (_, _, h) in enumerate(written)}}


def _save_async(out_dir: str, step: int, mesh: Mesh, state: dict, meta: dict, keep: int, writer,
                timeout_s: float) -> str:
    """save() with the writing in the background (async_save.py): the snapshot is taken here, then it returns."""
    root, name, t0 = ckpt_root(out_dir), f"step_{step:06d}", time.perf_counter()
    tmp_dir = _begin(root, name, mesh)
    host = async_save.snapshot(state, writer)
    meta = {**meta, "step": step, "layout": layout(mesh)}

    def publish(written):  # rank 0's thread, once every shard is on disk
        _publish(root, name, _with_shards(meta, written))
        print(f"checkpoint {os.path.join(root, name)} published: {sum(n for _, n, _ in written) / 1e6:,.1f} MB "
              f"written in the background in {time.perf_counter() - t0:.1f} s", flush=True)
        _prune(root, keep, name, None)
    writer.start(step, async_save.job(host, os.path.join(tmp_dir, f"rank_{mesh.rank:05d}.pt"), mesh.rank,
                                      mesh.world, _write_shard, publish, lambda why: _failed(out_dir, step, why),
                                      timeout_s, _why))
    return os.path.join(root, name)


def _publish(root: str, name: str, meta: dict) -> None:
    """Rank 0: meta.json into the tmp directory, every shard checked on disk, rename into place, then `latest`."""
    tmp_dir, final_dir = os.path.join(root, "tmp-" + name), os.path.join(root, name)
    _write_synced(os.path.join(tmp_dir, "meta.json"), json.dumps(meta, indent=1))
    verify(tmp_dir, checksums=False)  # meta readable, a shard for every rank, each of the size written
    _fsync_dir(tmp_dir)
    _write_synced(os.path.join(root, "latest.tmp"), name + "\n")  # before anything moves: a full disk fails here
    old = None
    if os.path.exists(final_dir):  # re-saving a step (a resume from before it): move the old one aside first
        old = os.path.join(root, f"old-{name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final_dir, old)
    try:
        os.replace(tmp_dir, final_dir)
    except OSError:
        if old:
            os.replace(old, final_dir)
        raise
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    _fsync_dir(root)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _prune(root: str, keep: int, just_saved: str, mesh: Mesh) -> None:
    """Keep `just_saved` and the keep-1 other checkpoints that verify, written most recently (collective: each rank
    hashes its share of the shards; mesh None: this process hashes them all). Damaged ones are neither counted nor
    deleted (the listing shows them)."""
    others = [d for d in sorted(os.listdir(root)) if d.startswith("step_") and d != just_saved]
    share = None if mesh is None else (mesh.rank, mesh.world)
    views = _all_gather(mesh, {d: verify_error(os.path.join(root, d), share) for d in others})
    if mesh is not None and not mesh.is_main:
        return
    good = []
    for d in others:
        if all(v.get(d) is None for v in views):
            good.append((read_meta(os.path.join(root, d)).get("saved_at", 0.0), d))
    for _, d in sorted(good)[:max(0, len(good) - (keep - 1))]:
        try:  # renamed first: a kill while deleting leaves old-* (the next start removes it), never a damaged step_*
            os.replace(os.path.join(root, d), os.path.join(root, "old-" + d))
        except OSError:
            continue
        shutil.rmtree(os.path.join(root, "old-" + d), ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------
# verify, find and load

def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} has no readable meta.json ({e})") from None
    if not isinstance(meta, dict) or not meta.get("complete"):
        raise CheckpointError(f"checkpoint {path} is incomplete")
    return meta


def verify(path: str, share: tuple[int, int] | None = None, checksums: bool = True) -> dict:
    """meta of the checkpoint at `path` after checking: meta.json readable and complete, a shard for every rank of
    its layout, each of the size recorded, and of the sha256 recorded at save (only shards i with i % n == r for
    share=(r, n); none with checksums=False; sizes only for checkpoints written before checksums)."""
    meta = read_meta(path)
    sizes, shas = meta.get("shard_bytes", {}), meta.get("shard_sha256")
    n = meta["layout"].get("world") if isinstance(meta.get("layout"), dict) else 0
    missing = [r for r in range(n if isinstance(n, int) and sizes else 0) if f"rank_{r:05d}.pt" not in sizes]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: meta.json lists no shard for rank {missing[0]}")
    for i, (f, size) in enumerate(sorted(sizes.items())):
        file = os.path.join(path, f)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint {path} has no shard {f}")
        if os.path.getsize(file) != size:
            raise CheckpointError(f"checkpoint shard {file} is {os.path.getsize(file)} bytes, {size} were written: "
                                  f"truncated or corrupt")
        if checksums and shas is not None and (share is None or i % share[1] == share[0]):
            if sha256_of(file) != shas.get(f):
                raise CheckpointError(f"checkpoint shard {file} does not match the sha256 recorded when it was "
                                      f"written: corrupt")
    return meta


check_complete = verify  # (the name consolidate.py and sft.py know)


def verify_error(path: str, share=None, checksums: bool = True) -> str | None:
    try:
        verify(path, share, checksums)
    except (CheckpointError, OSError) as e:
        return str(e)
    return None


def latest(out_dir, checksums: bool = True) -> str | None:
    """Path of the checkpoint `latest` names if it verifies, else None (see find_resume for the fallback)."""
    try:
        with open(os.path.join(ckpt_root(out_dir), "latest")) as f:
            path = os.path.join(ckpt_root(out_dir), f.read().strip())
        verify(path, checksums=checksums)
        return path
    except (OSError, CheckpointError):
        return None


def find_resume(out_dir, mesh: Mesh | None = None) -> tuple[str, str]:
    """(checkpoint to resume from, a note: why it is not the one `latest` names, or that it has no checksums).
    With `mesh` each rank hashes its share of the shards and the ranks agree (collective); else all are hashed."""
    root = ckpt_root(out_dir)
    named, why = None, "no ckpt/latest file"
    try:
        with open(os.path.join(root, "latest")) as f:
            named = f.read().strip()
    except FileNotFoundError:
        pass
    except OSError as e:
        why = f"ckpt/latest is unreadable ({e.strerror or e})"
    order = ([named] if named else []) + [d for d in reversed(_step_dirs(out_dir)) if d != named]  # newest first
    if not order:
        raise NoCheckpoint(f"no checkpoint under {root}")
    share = None if mesh is None else (mesh.rank, mesh.world)
    failed = []
    for d in order:
        path = os.path.join(root, d)
        err = _first_error(mesh, verify_error(path, share))  # (the ranks agree)
        if err:
            if d == named:
                why = f"ckpt/latest names {named}, which is unusable ({err})"
            failed.append(f"{d}: {err}")
            continue
        note = "" if d == named else f"{why}; took the newest complete checkpoint {d} instead"
        if "shard_sha256" not in read_meta(path):
            note += ("; " if note else "") + (f"{d} records no checksums (written before nanopara recorded them): "
                                              f"verified by shard sizes only")
        return path, note
    raise AgreedError(f"--resume: no checkpoint under {root} verifies ({'; '.join(failed[:3])}): start over with "
                      f"--overwrite, or move the damaged ones away")


def load(path: str, mesh: Mesh) -> tuple[dict, dict]:
    """(this rank's state, meta) of the checkpoint at `path`, checked against this run's layout and its shard
    against the size and sha256 recorded at save."""
    meta = verify(path, share=(mesh.rank, mesh.world))  # this rank's shard is hashed (same layout)
    if meta["layout"] != layout(mesh):
        raise CheckpointError(f"checkpoint {path} was written with layout {meta['layout']} but this run is "
                              f"{layout(mesh)}; resume with the same parallel degrees")
    file = os.path.join(path, f"rank_{mesh.rank:05d}.pt")  # (verify: it exists, it is whole)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated/corrupt pickle, wrong format
        raise CheckpointError(f"checkpoint shard {file} is corrupt or unreadable: {_why(e)}") from None
    return state, meta


# ----------------------------------------------------------------------------------------------------------------
# what a training run saves: model + optimizer (the engine's shards), data position, loss scale, every RNG

def rng_state(device: torch.device) -> dict:
    s = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
         "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64))}  # tensors load with weights_only
    if device.type == "cuda":
        s["cuda"] = torch.cuda.get_rng_state(device)
    return s


def set_rng_state(s: dict, device: torch.device) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate((3, tuple(int(x) for x in s["python"]), None))
    st = np.random.get_state()
    np.random.set_state((st[0], s["numpy"].numpy().astype(np.uint32), 624, 0, 0.0))
    if device.type == "cuda" and "cuda" in s:
        torch.cuda.set_rng_state(s["cuda"], device)


def nonfinite(tree, name: str = "") -> list[str]:
    """Names of the floating-point tensors and floats in `tree` (nested dicts, lists) that hold inf or NaN."""
    names, flags = [], []

    def walk(x, at):
        if torch.is_tensor(x):
            if x.is_floating_point() and x.numel():
                names.append(at)
                flags.append(torch.isfinite(x if x.element_size() > 1 else x.float()).all())  # (fp8: no isfinite)
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{at}.{k}" if at else str(k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{at}.{i}")
        elif isinstance(x, float) and not math.isfinite(x):
            names.append(at)
            flags.append(torch.tensor(False))
    walk(tree, name)
    ok = {}
    for dev in {f.device for f in flags}:  # one host sync per device
        idx = [i for i, f in enumerate(flags) if f.device == dev]
        ok.update(zip(idx, torch.stack([flags[i] for i in idx]).tolist()))
    return [n for i, n in enumerate(names) if not ok[i]]


def _trained_state(sd: dict) -> dict:
    return {k: sd[k] for k in ("model", "engine", "buffers", "scaler", "fp8") if k in sd}


def saves_in_background(cfg, mesh: Mesh) -> bool:
    """ckpt.async_: true, or auto on a GPU."""
    return cfg.ckpt.async_ == "true" or (cfg.ckpt.async_ == "auto" and mesh.device.type == "cuda")


def reserve_async(out_dir: str, mesh: Mesh, trainer) -> float | None:
    """Pin the host buffers of the background saves to come now (async_save.reserve), if there are any: seconds."""
    cfg = trainer.cfg
    if not saves_in_background(cfg, mesh) or not 0 < cfg.ckpt.every < cfg.train.steps:
        return None
    return async_save.reserve(trainer.state_dict(), async_save.writer_for(out_dir))


def save_training(out_dir: str, step: int, mesh: Mesh, trainer, loader, meta: dict, keep: int,
                  background: bool | None = None) -> str:
    """Every rank's trainer state (trainer.Trainer.state_dict: global names + slice metadata), loader position and
    RNG streams as one checkpoint of `step`; collective. A state holding inf/NaN is not written (SaveError on every
    rank, `latest` stays on the last good checkpoint), nor is one any rank fails to write. background (None:
    ckpt.async_, auto = on GPU): written by a background thread (async_save.py); the run's last save is blocking.
    A write still in flight is waited for first (said)."""
    writer = async_save.writer_for(out_dir)
    busy, waited = writer.busy(), writer.wait()
    if busy and waited >= 0.1 and mesh.is_main:
        print(f"note: the save of step {step} waited {waited:.1f} s for the write of step {writer.step} to end (a "
              f"write takes longer than ckpt.every steps)", flush=True)
    sd = trainer.state_dict()
    bad = [f"{n} (rank {r})" if mesh.world > 1 else n
           for r, names in enumerate(_all_gather(mesh, nonfinite(_trained_state(sd))[:3])) for n in names]
    if bad:
        prev = latest(out_dir, checksums=False)
        raise SaveError(f"the checkpoint of step {step} was not written: non-finite values in {', '.join(bad[:3])}"
                        f"{', ...' if len(bad) > 3 else ''}; " + (f"ckpt/latest stays on {prev}" if prev else
                                                                  "no earlier checkpoint"))
    state = {**sd, "loader": loader.state_dict(), "rng": rng_state(mesh.device), "mesh": dict(mesh.coords)}
    meta = {**meta, "format": sd.get("ckpt_format", 1)}
    if trainer.pp_layers is not None:  # pp > 1: every chunk's global blocks
        meta["pp_layers"] = trainer.pp_layers
    cfg = trainer.cfg
    if background is None:
        background = saves_in_background(cfg, mesh)
    try:
        if background and step < cfg.train.steps:
            return _save_async(out_dir, step, mesh, state, meta, keep, writer, cfg.parallel.timeout_s)
        return save(out_dir, step, mesh, state, meta, keep=keep)
    except SaveError as e:
        raise SaveError(_failed(out_dir, step, str(e))) from None


def _failed(out_dir: str, step: int, why: str) -> str:
    prev = latest(out_dir, checksums=False)
    return (f"could not save the checkpoint of step {step} under {ckpt_root(out_dir)}: {why}; "
            + (f"the previous checkpoint {prev} is intact" if prev else "no earlier checkpoint"))


def check_format(meta: dict, state: dict | None, path: str) -> None:
    """A clear error for a checkpoint written by a newer format than this code reads (meta.json's "format", and
    its shards' "ckpt_format"; 1 = written before either was recorded)."""
    for where, v in (("meta.json", meta.get("format", 1)), ("its shards", (state or {}).get("ckpt_format", 1))):
        if not isinstance(v, int) or v > FORMAT:
            raise AgreedError(f"checkpoint {path} is of format {v} ({where}), newer than this nanopara reads "
                              f"(format {FORMAT} and older): resume it with the nanopara that wrote it")


def check_model_matches(path: str, model_cfg: dict) -> dict:
    """meta of the checkpoint, after checking its format (check_format) and that it was trained with the same
    model shape as this run: before any model work (train.find_resume)."""
    meta = read_meta(path)
    check_format(meta, None, path)
    saved = meta.get("config", {}).get("model", {})
    diff = [f"model.{k}={saved[k]} (this run: {v})" for k, v in model_cfg.items()
            if k in saved and k != "kernels" and saved[k] != v]
    if diff:
        raise AgreedError(f"checkpoint {path} was trained with a different model: " + ", ".join(diff))
    return meta


if __name__ == "__main__":  # python -m nanopara.checkpoint DIR: list, verify, say what --resume uses (ckpt_inspect.py)
    import runpy  # (run by name: ckpt_inspect imports this module, which imports nothing back)
    runpy.run_module("nanopara.ckpt_inspect", run_name="__main__")
