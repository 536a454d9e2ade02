"""Run a function, or a script, in N gloo processes on this machine (the CPU stand-in for torchrun + NCCL).

The processes come from a fork server that imported torch, numpy, train.py, nanopara and kernels once (the first
spawn of a run starts it): a spawn then costs tens of milliseconds instead of every process importing torch anew
(~3 s of CPU each on the 2-core machine). Each process otherwise starts as a spawned one would: the caller's
environment (os.environ at the call, not at the server's start), working directory and sys.path, its stdout and
stderr (so pytest captures what a worker prints, e.g. the stacks of a hang), fresh modules for anything the
server did not import, and no state from earlier spawns (each is forked from the server, never reused).

Threads: OMP_NUM_THREADS if set (tests/conftest.py sets 1 on CPU machines), else, as torchrun does for several
processes a machine, one thread a process. Two processes of two threads each on the 2-core machine made a TP step
~8x slower (OpenMP threads spin while waiting, taking the core the other rank needs: tp=2 x 20 steps 15-21 s ->
3 s, tp=4 26 -> 8 s, the same losses to the bit).
"""
import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import socket
import sys
import time

import torch
import torch.multiprocessing as mp

# what the fork server imports before it forks; a name that fails to import is skipped (the worker imports it)
PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "numpy", "triton", "train", "tests.distributed"] + [
    f"{pkg}.{name[:-3]}" for pkg in ("nanopara", "kernels")
    for name in sorted(os.listdir(os.path.join(os.path.dirname(__file__), "..", pkg)))
    if name.endswith(".py") and name != "__init__.py"]
_SERVER_ENV = dict(os.environ)  # at import (after conftest's set-up), before any test's changes to the environment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n distinct free ports (held together while chosen): several runs in one spawn need a fresh store each, and two
    runs handed the same port would meet the first run's store, still alive, and its stale gloo addresses."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def agree_port(rank: int, path: str, timeout_s: float = 60.0) -> int:
    """A free port that rank 0 picks just before its run binds it, read by every rank from `path` (a file none of
    them wrote before; one per run): a run chosen far ahead (free_ports) can find its port taken meanwhile, by
    another process or by gloo's own connections of the runs before it (notes/pp.md: a rare hang)."""
    if rank == 0:
        with open(path + ".tmp", "w") as f:
            f.write(str(free_port()))
        os.replace(path + ".tmp", path)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no port from rank 0 in {path} after {timeout_s:.0f} s")
        time.sleep(0.01)
    with open(path) as f:
        return int(f.read())


def _start_server() -> None:
    """The fork server, started (once; again if it died) with the environment of the test session's start."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    current = dict(os.environ)
    os.environ.clear()
    os.environ.update(_SERVER_ENV)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(current)


def _forked(rank, fn, parent, env, threads, args):
    """In the worker: become what a spawned process of the caller would be, then fn(rank, *args)."""
    os.environ.clear()
    os.environ.update(env)
    if threads:
        torch.set_num_threads(threads)
    for fd in (1, 2):  # the caller's stdout / stderr (pytest's capture of the running test), not the server's
        try:
            target = os.open(f"/proc/{parent}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue
        os.dup2(target, fd)
        os.close(target)
    fn(rank, *args)


def processes(fn, nprocs: int, *args) -> None:
    """fn(rank, *args) in nprocs forked processes, joined as torch.multiprocessing.spawn joins them (an exception in
    one process terminates the others and is raised here)."""
    _start_server()
    threads = os.environ.get("OMP_NUM_THREADS", "1" if nprocs > 1 else "")  # torchrun's default: 1 if several
    threads = int(threads) if threads.isdigit() else None  # (the server's torch read its own environment)
    mp.start_processes(_forked, args=(fn, os.getpid(), dict(os.environ), threads, args), nprocs=nprocs, join=True,
                       start_method="forkserver")


def _entry(rank, fn, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    # when one rank fails, mp.spawn terminates the others: each prints where it was (a hang's other half)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    fn(rank, world, *args)  # an exception propagates to the parent through mp.spawn as usual
    # Success: leave without the interpreter's teardown. Destroying gloo's threads at exit occasionally aborted a
    # worker (SIGABRT, ~1 run in 10 on the loaded 2-core machine) after all its work was done and checked.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world: int, *args, port: int | None = None) -> None:
    """fn(rank, world, *args) in `world` processes with torchrun's environment (MASTER_PORT: `port`, or a free one);
    raises if any process fails."""
    processes(_entry, world, fn, world, port or free_port(), args)


# ---- scripts -----------------------------------------------------------------------------------------------------
# `python SCRIPT ARGS` / `torchrun --nproc_per_node=N SCRIPT ARGS` without starting python, torch and the launcher
# again: a torchrun of two processes costs ~7 s on the 2-core machine before the script does anything (its agent and
# each worker import torch), a fork of the server tens of ms.

def _script(rank, path, argv, logs, cwd):
    """In a worker: the script as `__main__` with sys.argv and sys.path[0] as python gives them, in `cwd`, with one
    OpenMP thread (as OMP_NUM_THREADS=1 gives it); stdout to a file (the caller reads it), stderr to the caller's (a
    traceback shows in the failing test's report)."""
    fd = os.open(os.path.join(logs, f"stdout.{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.close(fd)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if cwd:
        os.chdir(cwd)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    runpy.run_path(path, run_name="__main__")
    sys.stdout.flush()


def _script_rank(rank, world, path, argv, logs, cwd):
    _script(rank, path, argv, logs, cwd)


def run_script(path: str, *argv: str, logs: str, nproc: int | None = None, cwd: str | None = None) -> str:
    """`python path ARGV` (nproc None: one process, without torchrun's environment) or `torchrun --standalone
    --nproc_per_node=nproc path ARGV`, as processes of the fork server; returns their stdout, rank 0's first. A
    failure raises (the stdout's tail printed to stderr; the workers' own stderr, a traceback included, is there)."""
    os.makedirs(logs, exist_ok=True)
    try:
        if nproc is None:
            processes(_script, 1, path, list(argv), logs, cwd)
        else:
            spawn(_script_rank, nproc, path, list(argv), logs, cwd)
    except BaseException:
        sys.stderr.write(f"--- stdout of {os.path.basename(path)} {' '.join(argv)}\n{_stdout(logs)[-3000:]}\n")
        raise
    return _stdout(logs)


def _stdout(logs: str) -> str:
    names = sorted((n for n in os.listdir(logs) if n.startswith("stdout.")), key=lambda n: int(n.split(".")[1]))
    out = ""
    for name in names:
        with open(os.path.join(logs, name)) as f:
            out += f.read()
    return out
