"""Run a function in N gloo processes on this machine (the CPU stand-in for torchrun + NCCL)."""
import faulthandler
import os
import signal
import socket
import sys

import torch.multiprocessing as mp


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
    mp.spawn(_entry, args=(fn, world, port or free_port(), args), nprocs=world, join=True)
