"""Asynchronous checkpoints: a host copy of this rank's state taken at the step boundary, written to disk by a
background thread while training goes on (checkpoint.save_training under ckpt.async_; train.py's loop is the same).

    writer = writer_for(out_dir)            # this process's writer of that run directory
    waited = writer.wait()                  # one write in flight: a second save waits for the first
    host = snapshot(state, writer)          # training thread: copies, then training may change the originals
    writer.start(step, job(host, ...))      # background: this rank's shard and marker; rank 0 also publishes

Snapshot: CPU tensors are cloned. CUDA tensors go to pinned host buffers, kept from one save to the next. When the
GPU has room (the peak allocated so far plus the state within STAGE_FRACTION of its memory) they are first cloned
on the GPU (a copy at HBM bandwidth) and the background thread copies them to the host on its own stream, so
neither the host nor the GPU waits; else the host copies are queued on the training stream (the host does not
wait; the GPU does: bytes / PCIe bandwidth). Non-finite state is refused before any of this, on the training thread.
Completion across ranks, with no collective off the training thread (two threads' collectives on one group would
interleave): every rank writes `tmp-step_N/rank_R.pt` (checkpoint._write_shard: sha256 as it goes, fsync), then a
marker `rank_R.done` holding its size and sha256, or the error. Rank 0's thread waits for every marker (at most
parallel.timeout_s), then publishes as a blocking save does (meta.json, checks, rename, `latest`) and prunes; a
marker with an error, its own error or the timeout: the tmp directory goes, one warning line, training goes on.
A crash or kill leaves the previous checkpoint and `latest` as they were; the next start removes tmp-*.
One write in flight: a second save waits for the first (and says so), so every checkpoint is published; skipping
one would silently widen the window a kill can lose. Who else waits: the run's final save (blocking: the result is
the run's), a stop on SIGTERM/SIGINT and the end of the run (runguard.RunGuard: `drain`, before the lock goes).
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time

import torch

STAGE_FRACTION = 0.85  # GPU staging when peak allocated + the state's bytes fit in this share of the GPU's memory
POLL_S = 0.02          # rank 0's wait for the other ranks' markers


class _Slot:
    """Where the i-th CUDA tensor of a state goes once it is on the host."""
    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def _map(tree, fn, memo: dict):
    """`tree` (dicts, lists, tuples) with fn(tensor) for each tensor (once per tensor object: aliases stay aliases)."""
    if torch.is_tensor(tree):
        if id(tree) not in memo:
            memo[id(tree)] = fn(tree)
        return memo[id(tree)]
    if isinstance(tree, dict):
        return {k: _map(v, fn, memo) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(v, fn, memo) for v in tree)
    return tree


def _fill(tree, host: list):
    if isinstance(tree, _Slot):
        return host[tree.i]
    if isinstance(tree, dict):
        return {k: _fill(v, host) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_fill(v, host) for v in tree)
    return tree


class Writer:
    """One run directory's background writer in this process: at most one write in flight."""

    def __init__(self):
        self.thread, self.step, self.failure = None, None, None
        self.pinned: list = []  # host buffers of the CUDA tensors, reused while shapes and dtypes match
        self.stream = None      # the host copies' CUDA stream (GPU staging)

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def wait(self) -> float:
        """Seconds waited for the write in flight (0.0: none)."""
        if self.thread is None:
            return 0.0
        t0 = time.perf_counter()
        self.thread.join()
        self.thread = None
        return time.perf_counter() - t0

    def start(self, step: int, job) -> None:
        """Run job() -> failure message or None in the background (after wait())."""
        self.step, self.failure = step, None

        def run():
            try:
                self.failure = job()
            except BaseException as e:  # a bug in the job itself: said, never silent
                self.failure = f"the background writer failed: {type(e).__name__}: {e}"
                print(f"warning: checkpoint of step {step}: {self.failure}", flush=True)
        self.thread = threading.Thread(target=run, name=f"nanopara-ckpt-{step}", daemon=True)
        self.thread.start()

    def host_buffer(self, i: int, t: torch.Tensor) -> torch.Tensor:
        while len(self.pinned) <= i:
            self.pinned.append(None)
        b = self.pinned[i]
        if b is None or b.shape != t.shape or b.dtype != t.dtype:
            b = self.pinned[i] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return b


def reserve(state: dict, writer: Writer) -> float:
    """Pin the host buffers of `state`'s CUDA tensors now, in snapshot()'s order; seconds taken. Pinning a multi-GB
    state takes seconds and holds the CUDA driver, so the training thread's launches wait: on gpt_1b the first step
    after the first async save took 5.0 s instead of 0.44 (results/ckpt_async_profile_h100.txt). Done once after
    the first step (train.py), every save finds its buffers; a state whose shapes change later gets new ones."""
    t0 = time.perf_counter()
    for i, t in enumerate(_split(state, clone=False)[1]):
        writer.host_buffer(i, t)
    return time.perf_counter() - t0


def _split(state: dict, clone: bool = True) -> tuple:
    """(state with each CUDA tensor a _Slot and the CPU ones cloned, the CUDA tensors in slot order)."""
    cuda: list = []

    def grab(t):
        t = t.detach()
        if t.device.type == "cuda":
            cuda.append(t)
            return _Slot(len(cuda) - 1)
        return t.clone() if clone else t
    return _map(state, grab, {}), cuda


def snapshot(state: dict, writer: Writer):
    """Training thread: a callable that returns the host copy of `state` as it is now (the background thread calls
    it; on CUDA it waits there for the copies). The caller may change `state`'s tensors as soon as this returns."""
    shell, cuda = _split(state)
    if not cuda:
        return lambda: shell
    dev = cuda[0].device
    nbytes = sum(t.numel() * t.element_size() for t in cuda)
    room = STAGE_FRACTION * torch.cuda.get_device_properties(dev).total_memory - torch.cuda.max_memory_allocated(dev)
    if nbytes <= room:
        staged = [t.clone(memory_format=torch.contiguous_format) for t in cuda]  # on the training stream, in order
        ready = torch.cuda.Event()
        ready.record()

        def to_host():
            with torch.cuda.device(dev):  # (a new thread's current device is device 0)
                writer.stream = writer.stream or torch.cuda.Stream(dev)
                host = [writer.host_buffer(i, t) for i, t in enumerate(staged)]
                writer.stream.wait_event(ready)
                with torch.cuda.stream(writer.stream):
                    for h, s in zip(host, staged):
                        h.copy_(s, non_blocking=True)
                writer.stream.synchronize()
                staged.clear()  # the GPU copies go back to the allocator (their copies are done)
            return _fill(shell, host)
        return to_host
    host = [writer.host_buffer(i, t) for i, t in enumerate(cuda)]
    for h, t in zip(host, cuda):
        h.copy_(t, non_blocking=True)  # queued before the next step's kernels on this stream: the values of now
    done = torch.cuda.Event()
    done.record()

    def wait_host():
        done.synchronize()
        return _fill(shell, host)
    return wait_host


# ----------------------------------------------------------------------------------------------------------------
# the background job: shard, marker, and on rank 0 the wait for every marker and the publish

def _marker(tmp_dir: str, rank: int) -> str:
    return os.path.join(tmp_dir, f"rank_{rank:05d}.done")


def _mark(tmp_dir: str, rank: int, payload: dict) -> None:
    """This rank's outcome, atomically (rank 0 reads either nothing or all of it); the directory may be gone."""
    try:
        with open(_marker(tmp_dir, rank) + ".tmp", "w") as f:
            json.dump(payload, f)
        os.replace(_marker(tmp_dir, rank) + ".tmp", _marker(tmp_dir, rank))
    except OSError:
        pass  # rank 0 gave up on this save already and removed its directory


def _gather_marks(tmp_dir: str, world: int, timeout_s: float) -> tuple[list, str | None]:
    """Rank 0: [(error, bytes, sha256)] of ranks 1.. from their markers, or the first error / a timeout."""
    out, deadline = [], time.monotonic() + timeout_s
    for r in range(1, world):
        while not os.path.exists(_marker(tmp_dir, r)):
            if time.monotonic() > deadline:
                return out, f"rank {r} did not finish writing its shard within {timeout_s:g} s"
            time.sleep(POLL_S)
        with open(_marker(tmp_dir, r)) as f:
            m = json.load(f)
        if m.get("error"):
            return out, f"rank {r}: {m['error']}"
        out.append((None, m["bytes"], m["sha256"]))
    return out, None


def job(host, file: str, rank: int, world: int, write, publish, failed, timeout_s: float, why):
    """The background work of one save on this rank. write(state, file) -> (bytes, sha256); publish(written) on
    rank 0 with every rank's (None, bytes, sha256); failed(reason) -> the warning's text (printed by rank 0);
    why(exception) -> its reason in one line. Exceptions of any type from writing or publishing are failures."""
    tmp_dir = os.path.dirname(file)

    def run():
        err = size = sha = None
        try:
            state = host()
            size, sha = write(state, file)
            del state
        except Exception as e:  # OSError, torch.save's RuntimeError on a full disk, a pickling error, ...
            err = why(e)
        if rank != 0:
            _mark(tmp_dir, rank, {"error": err} if err else {"bytes": size, "sha256": sha})
            return None
        written = [(None, size, sha)]
        if err is None:
            others, err = _gather_marks(tmp_dir, world, timeout_s)
            written += others
        if err is None:
            try:
                for r in range(1, world):
                    os.remove(_marker(tmp_dir, r))
                publish(written)
                return None
            except Exception as e:
                err = why(e)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        msg = failed(err)
        print(f"warning: {msg}; training goes on and the next save tries again", flush=True)
        return msg
    return run


# ----------------------------------------------------------------------------------------------------------------
# the writers of this process, by run directory

_WRITERS: dict = {}  # realpath(out_dir) -> Writer: what RunGuard drains (it holds no mesh and no process group)


def writer_for(out_dir) -> Writer:
    return _WRITERS.setdefault(os.path.realpath(out_dir), Writer())


def drain(out_dir, release: bool = False) -> str | None:
    """Wait for out_dir's write in flight; the last write's failure message (None: published, or no write).
    release: also drop the writer and its host buffers (the run is over)."""
    key = os.path.realpath(out_dir)
    w = _WRITERS.get(key)
    if w is None:
        return None
    w.wait()
    if release:
        _WRITERS.pop(key, None)
    return w.failure
