"""Checkpoints: one directory per step, each rank's shard in its own file, written atomically.

    <out_dir>/ckpt/step_000100/          complete checkpoint (renamed into place only when every rank finished)
        meta.json                        step, layout (mesh sizes), config, per-rank shard metadata, code version
        rank_00000.pt ...                this rank's model shard, optimizer shard, loader/RNG/scaler state
    <out_dir>/ckpt/latest                text file naming the newest complete checkpoint (replaced atomically)

Save: every rank writes into `tmp-step_N/` (each file through a temporary name + os.replace), a barrier, then
rank 0 writes meta.json, renames the directory, points `latest` at it and prunes old ones beyond `keep`. A crash
at any point leaves the previous checkpoint and `latest` intact. Load: `weights_only=True`, after checking that
the checkpoint's layout matches this run (a different layout is a clear error, not silent garbage).
"""
from __future__ import annotations

import json
import os
import shutil
import threading

import torch
import torch.distributed as dist

from nanopara.mesh import Mesh


class CheckpointError(RuntimeError):
    """Missing, corrupt or incompatible checkpoint: printed as one line."""


def _barrier(mesh: Mesh):
    if mesh.world > 1:
        dist.barrier()


def _ckpt_root(out_dir: str) -> str:
    return os.path.join(out_dir, "ckpt")


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def layout(mesh: Mesh) -> dict:
    return {"world": mesh.world, **{ax: mesh.sizes[ax] for ax in ("pp", "dp", "cp", "tp")}}


def save(out_dir: str, step: int, mesh: Mesh, state: dict, meta: dict, keep: int = 2) -> str:
    """Write this rank's `state` (tensors, dicts, lists, numbers) as part of the checkpoint of `step`.

    Collective over the whole mesh: every rank must call it. Returns the final directory.
    """
    root = _ckpt_root(out_dir)
    name = f"step_{step:06d}"
    tmp_dir, final_dir = os.path.join(root, "tmp-" + name), os.path.join(root, name)
    if mesh.is_main:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # leftovers of a crashed save of the same step
        os.makedirs(tmp_dir)
    _barrier(mesh)
    path = os.path.join(tmp_dir, f"rank_{mesh.rank:05d}.pt")
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    _barrier(mesh)
    if mesh.is_main:
        meta = {**meta, "step": step, "layout": layout(mesh), "complete": True}
        _atomic_write_text(os.path.join(tmp_dir, "meta.json"), json.dumps(meta, indent=1))
        shutil.rmtree(final_dir, ignore_errors=True)  # re-saving a step (e.g. after a resume) replaces it
        os.replace(tmp_dir, final_dir)
        _atomic_write_text(os.path.join(root, "latest"), name + "\n")
        done = sorted(d for d in os.listdir(root) if d.startswith("step_"))
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    _barrier(mesh)
    return final_dir


def latest(out_dir: str) -> str | None:
    """Path of the newest complete checkpoint, or None."""
    root = _ckpt_root(out_dir)
    try:
        with open(os.path.join(root, "latest")) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(root, name)
    return path if os.path.isfile(os.path.join(path, "meta.json")) else None


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} has no readable meta.json ({e})") from None
    if not meta.get("complete"):
        raise CheckpointError(f"checkpoint {path} is incomplete")
    return meta


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


class AsyncSaver:
    """Copy the state to CPU now, write it in a background thread; `wait()` before the next save or exit.

    Only the disk write overlaps training; everything collective (barriers, rename) runs in `wait()`-free order
    because the background thread does the whole `save()` — so it is used only for single-process runs.
    """

    def __init__(self):
        self.thread = None
        self.error = None

    def submit(self, *args, **kwargs):
        self.wait()

        def run():
            try:
                save(*args, **kwargs)
            except BaseException as e:  # surfaced on the next wait()
                self.error = e
        self.thread = threading.Thread(target=run, daemon=False)
        self.thread.start()

    def wait(self):
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise err


def to_cpu(obj):
    """Deep copy of a state tree with every tensor on the CPU (detached, cloned)."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
