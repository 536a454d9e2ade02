"""Run directories and checkpoints: nothing written is lost, and resume always finds a complete checkpoint.

    <out_dir>/config.json, run_info.txt, metrics.jsonl    the run's settings, environment and log (appended)
    <out_dir>/ckpt/step_000100/                           one complete checkpoint (renamed into place when whole)
        meta.json                                         step, layout, config, shard sizes, write time, pp chunks
        rank_00000.pt ...                                 each rank's model/optimizer shard, loader, RNG, scaler
    <out_dir>/ckpt/latest                                 names the newest complete checkpoint (replaced atomically)

A new run refuses an out_dir that holds another run unless told `--resume` or `--overwrite` (`prepare_run_dir`,
before any data or model work, which also proves the directory writable). Save: every rank writes into
`tmp-step_N/` through temporary names, a barrier, then rank 0 writes meta.json, renames the directory into place,
points `latest` at it and prunes the oldest checkpoints *by write time*, never the one just saved. A crash at any
point leaves the previous checkpoint and `latest` intact. Resume (`find_resume`) takes `latest`, or, when it is
missing, dangling, or names a checkpoint whose meta or shards are damaged (a shard's size differs from the one
recorded), the newest complete checkpoint, and says which and why. Load: `weights_only=True`, after checking the
layout matches this run.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist

from nanopara.mesh import Mesh

RUN_FILES = ("metrics.jsonl", "config.json", "run_info.txt")  # what a run writes beside ckpt/


class CheckpointError(RuntimeError):
    """Missing, corrupt or incompatible checkpoint, or a run directory that cannot be used: one line."""


def _barrier(mesh: Mesh):
    if mesh.world > 1:
        dist.barrier()


def _ckpt_root(out_dir) -> str:
    return os.path.join(out_dir, "ckpt")


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def layout(mesh: Mesh) -> dict:
    ep = {"ep": mesh.sizes["ep"]} if mesh.sizes.get("ep", 1) > 1 else {}  # expert parallel (ep.py), carved from dp x cp
    return {"world": mesh.world, **{ax: mesh.sizes[ax] for ax in ("pp", "dp", "cp", "tp")}, **ep}


# ----------------------------------------------------------------------------------------------------------------
# the run directory

def _step_dirs(out_dir) -> list[str]:
    try:  # (rank 0's writability probe in prepare_run_dir may create and remove an empty ckpt/ meanwhile)
        return sorted(d for d in os.listdir(_ckpt_root(out_dir)) if d.startswith("step_"))
    except (FileNotFoundError, NotADirectoryError):
        return []


def prepare_run_dir(out_dir: str, resume: bool, overwrite: bool, is_main: bool) -> None:
    """Before any data or model work: out_dir (and its ckpt/) must be a writable directory, and a new run must not
    mix with another run's checkpoints or log. With `overwrite`, rank 0 removes those (nothing else in out_dir)."""
    for path, what in ((out_dir, "--out_dir"), (_ckpt_root(out_dir), f"the checkpoint folder of --out_dir")):
        if os.path.exists(path) and not os.path.isdir(path):
            raise CheckpointError(f"{what} {path} is a file, not a directory")
    parent = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise CheckpointError(f"--out_dir {out_dir}: {parent} is a file, not a directory")
    held = [f for f in RUN_FILES[:1] if os.path.exists(os.path.join(out_dir, f))] + _step_dirs(out_dir)
    if held and not resume and not overwrite:
        raise CheckpointError(f"--out_dir {out_dir} already holds a run ({', '.join(held[:3])}"
                              f"{', ...' if len(held) > 3 else ''}): add --resume to continue it, --overwrite to "
                              f"replace it, or choose another --out_dir")
    if not is_main:
        return
    made = [p for p in (os.path.abspath(out_dir), os.path.abspath(_ckpt_root(out_dir))) if not os.path.exists(p)]
    try:  # proven by writing (permissions alone say nothing for root, read-only mounts, /proc)
        os.makedirs(_ckpt_root(out_dir), exist_ok=True)
        probe = os.path.join(_ckpt_root(out_dir), f".probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"--out_dir {out_dir} is not writable: {e.strerror or e}") from None
    finally:  # leave no trace until the run really starts (a later error must not leave an empty run behind)
        for p in reversed(made):
            if os.path.isdir(p) and not os.listdir(p):
                os.rmdir(p)
    if overwrite and os.path.isdir(_ckpt_root(out_dir)):  # (a fresh out_dir was removed again above)
        for d in os.listdir(_ckpt_root(out_dir)):
            p = os.path.join(_ckpt_root(out_dir), d)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
        for f in RUN_FILES:
            if os.path.exists(os.path.join(out_dir, f)):
                os.remove(os.path.join(out_dir, f))


# ----------------------------------------------------------------------------------------------------------------
# save

def save(out_dir: str, step: int, mesh: Mesh, state: dict, meta: dict, keep: int = 2) -> str:
    """Write this rank's `state` (tensors, dicts, lists, numbers) as part of the checkpoint of `step`.

    Collective over the whole mesh: every rank must call it. Returns the final directory. On failure the tmp
    directory is removed and the previous checkpoints and `latest` are untouched.
    """
    root = _ckpt_root(out_dir)
    name = f"step_{step:06d}"
    tmp_dir, final_dir = os.path.join(root, "tmp-" + name), os.path.join(root, name)
    if mesh.is_main:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # leftovers of a crashed save of the same step
        os.makedirs(tmp_dir)
    _barrier(mesh)
    path = os.path.join(tmp_dir, f"rank_{mesh.rank:05d}.pt")
    error = None
    try:
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    except OSError as e:
        error = e
    failed = torch.tensor([error is not None], dtype=torch.float32, device=mesh.device)
    if mesh.world > 1:  # every rank learns that one failed, instead of waiting at a barrier forever
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        if mesh.is_main:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise error or OSError(f"another rank could not write its shard under {tmp_dir}")
    if mesh.is_main:
        sizes = {f: os.path.getsize(os.path.join(tmp_dir, f)) for f in os.listdir(tmp_dir) if f.endswith(".pt")}
        meta = {**meta, "step": step, "layout": layout(mesh), "complete": True, "saved_at": time.time(),
                "shard_bytes": sizes}
        _atomic_write_text(os.path.join(tmp_dir, "meta.json"), json.dumps(meta, indent=1))
        old = None
        if os.path.exists(final_dir):  # re-saving a step (a resume from before it): move the old one aside first
            old = os.path.join(root, f"old-{name}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final_dir, old)
        os.replace(tmp_dir, final_dir)
        _atomic_write_text(os.path.join(root, "latest"), name + "\n")
        if old:
            shutil.rmtree(old, ignore_errors=True)
        _prune(root, keep, name)
    _barrier(mesh)
    return final_dir


def _prune(root: str, keep: int, just_saved: str) -> None:
    """Keep `just_saved` and the keep-1 other complete checkpoints written most recently."""
    others = []
    for d in os.listdir(root):
        if d.startswith("step_") and d != just_saved:
            try:
                with open(os.path.join(root, d, "meta.json")) as f:
                    others.append((json.load(f).get("saved_at", 0.0), d))
            except (OSError, ValueError):
                pass  # incomplete or damaged: never counted as kept, never deleted here
    for _, d in sorted(others)[:max(0, len(others) - (keep - 1))]:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------
# find and load

def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} has no readable meta.json ({e})") from None
    if not meta.get("complete"):
        raise CheckpointError(f"checkpoint {path} is incomplete")
    return meta


def check_complete(path: str) -> dict:
    """meta of the checkpoint at `path` if its meta is readable and every shard has the size recorded there."""
    meta = read_meta(path)
    for f, size in meta.get("shard_bytes", {}).items():
        file = os.path.join(path, f)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint {path} has no shard {f}")
        if os.path.getsize(file) != size:
            raise CheckpointError(f"checkpoint shard {file} is {os.path.getsize(file)} bytes, {size} were written: "
                                  f"truncated or corrupt")
    return meta


def latest(out_dir) -> str | None:
    """Path of the checkpoint `latest` names if it is complete, else None (see find_resume for the fallback)."""
    try:
        with open(os.path.join(_ckpt_root(out_dir), "latest")) as f:
            path = os.path.join(_ckpt_root(out_dir), f.read().strip())
        check_complete(path)
        return path
    except (OSError, CheckpointError):
        return None


def find_resume(out_dir) -> tuple[str, str]:
    """(checkpoint to resume from, a note saying why it was chosen if it is not the one `latest` names)."""
    root = _ckpt_root(out_dir)
    named, why = None, "no ckpt/latest file"
    try:
        with open(os.path.join(root, "latest")) as f:
            named = f.read().strip()
        check_complete(os.path.join(root, named))
        return os.path.join(root, named), ""
    except FileNotFoundError:
        pass
    except (OSError, CheckpointError) as e:
        why = f"ckpt/latest names {named}, which is unusable ({e})" if named else str(e)
    for d in sorted(_step_dirs(out_dir), reverse=True):  # newest step first
        try:
            check_complete(os.path.join(root, d))
            return os.path.join(root, d), f"{why}; took the newest complete checkpoint {d} instead"
        except CheckpointError:
            continue
    raise CheckpointError(f"--resume: no complete checkpoint under {root} ({why}); start a new run without --resume")


def load(path: str, mesh: Mesh) -> tuple[dict, dict]:
    """(this rank's state, meta) of the checkpoint at `path`, checked against this run's layout."""
    meta = read_meta(path)
    if meta["layout"] != layout(mesh):
        raise CheckpointError(f"checkpoint {path} was written with layout {meta['layout']} but this run is "
                              f"{layout(mesh)}; resume with the same parallel degrees")
    file = os.path.join(path, f"rank_{mesh.rank:05d}.pt")
    if not os.path.isfile(file):
        raise CheckpointError(f"checkpoint {path} has no shard for rank {mesh.rank} ({file})")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated/corrupt pickle, wrong format
        raise CheckpointError(f"checkpoint shard {file} is corrupt or unreadable: {type(e).__name__}: {e}") from None
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


def save_training(out_dir: str, step: int, mesh: Mesh, trainer, loader, meta: dict, keep: int) -> str:
    """Every rank's trainer state (trainer.Trainer.state_dict: global names + slice metadata), loader position and
    RNG streams as one checkpoint of `step`; collective."""
    state = {**trainer.state_dict(), "loader": loader.state_dict(), "rng": rng_state(mesh.device),
             "mesh": dict(mesh.coords)}
    if trainer.pp_layers is not None:  # pp > 1: every chunk's global blocks
        meta = {**meta, "pp_layers": trainer.pp_layers}
    try:
        return save(out_dir, step, mesh, state, meta, keep=keep)
    except OSError as e:
        prev = latest(out_dir)
        raise CheckpointError(f"could not save the checkpoint of step {step} under {_ckpt_root(out_dir)}: "
                              f"{e.strerror or e}; "
                              + (f"the previous checkpoint {prev} is intact" if prev else "no earlier checkpoint")
                              ) from None


def check_model_matches(path: str, model_cfg: dict) -> dict:
    """meta of the checkpoint, after checking it was trained with the same model shape as this run."""
    meta = read_meta(path)
    saved = meta.get("config", {}).get("model", {})
    diff = [f"model.{k}={saved[k]} (this run: {v})" for k, v in model_cfg.items()
            if k in saved and k != "kernels" and saved[k] != v]
    if diff:
        raise CheckpointError(f"checkpoint {path} was trained with a different model: " + ", ".join(diff))
    return meta


def restore_training(path: str, mesh: Mesh, trainer, loader) -> int:
    """Load this rank's shard into the trainer, loader and RNGs; returns the step to continue from."""
    state, meta = load(path, mesh)
    if meta.get("pp_layers") != trainer.pp_layers:
        raise CheckpointError(f"checkpoint {path} holds pipeline chunks of blocks {meta.get('pp_layers')}, this run "
                              f"splits {trainer.pp_layers}: resume with the saved run's "
                              f"parallel.pp_virtual and parallel.pp_layers")
    try:
        trainer.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path} does not fit this run: {e}") from None
    loader.load_state_dict(state["loader"])
    set_rng_state(state["rng"], mesh.device)
    return meta["step"]
