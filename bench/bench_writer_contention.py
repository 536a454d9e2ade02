"""Does the background checkpoint writer slow the training thread on the host? (notes/checkpoints.md)

    python bench/bench_writer_contention.py [--mb 1536] [--dir /tmp] [--out F.jsonl]     (tests: a smoke run)

The async save (nanopara/async_save.py) writes a shard through shard_io.write_shard on a background thread while
the training thread launches the next steps. Two probes of the training thread, each while the background thread
does nothing (`idle`), writes raw bytes with hashlib (`raw`), or runs write_shard (`write_shard`: torch.save
through the hashing writer, large writes hashed on a second thread; `write_shard_serial`: hashed in line):
- a ticker sleeping 0.5 ms: its worst gap shows a long stretch in which the writer held the GIL;
- a loop of small in-place torch ops (the host side of launching kernels): its rate shows any other slow-down.
Host only (CPU tensors, no GPU); a GPU host's answer can differ (more cores, page cache size, CPU frequency).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import threading
import time

import torch

import harness as H
from nanopara import shard_io


def _ticker(stop, out):
    n, worst, last = 0, 0.0, time.perf_counter()
    while not stop.is_set():
        time.sleep(0.0005)
        now = time.perf_counter()
        worst, last, n = max(worst, now - last), now, n + 1
    out.update(ticks=n, worst_gap_ms=1e3 * worst)


def _ops(stop, out):
    a, n, t0 = torch.zeros(16), 0, time.perf_counter()
    while not stop.is_set():
        for _ in range(100):
            a.add_(1)
        n += 100
    out.update(ops_per_s=n / (time.perf_counter() - t0))


def _raw(state, path):
    with open(path, "wb") as f:
        h = hashlib.sha256()
        for t in state.values():
            mv = memoryview(t.numpy()).cast("B")
            h.update(mv)
            f.write(mv)
        f.flush()
        os.fsync(f.fileno())


def probe(kind: str, work, state, path: str, idle_s: float) -> dict:
    stop, out = threading.Event(), {}
    th = threading.Thread(target=work, args=(stop, out))
    th.start()
    t0 = time.perf_counter()
    if kind == "idle":
        time.sleep(idle_s)
    elif kind == "raw":
        _raw(state, path)
    else:
        parallel = shard_io.PARALLEL_HASH_BYTES
        shard_io.PARALLEL_HASH_BYTES = parallel if kind == "write_shard" else float("inf")
        try:
            shard_io.write_shard(state, path)
        finally:
            shard_io.PARALLEL_HASH_BYTES = parallel
    seconds = time.perf_counter() - t0
    stop.set()
    th.join()
    if os.path.exists(path):
        os.remove(path)
    return {"background": kind, "probe": work.__name__.strip("_"), "seconds": seconds, **out}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=1536, help="the shard's size")
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--idle_s", type=float, default=2.0, help="how long the `idle` rows probe")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    n = a.mb * (1 << 20) // 4 // 8
    state = {f"t{i}": torch.randn(n) for i in range(8)}
    path = os.path.join(a.dir, f"bench_writer_{os.getpid()}.bin")
    print(H.banner(f"bench_writer_contention, a {a.mb} MB shard, {os.cpu_count()} CPUs"), flush=True)
    rows = [probe(kind, work, state, path, a.idle_s) for work in (_ticker, _ops)
            for kind in ("idle", "raw", "write_shard_serial", "write_shard")]
    print(H.table(rows, [("probe", "probe", ""), ("background", "background", ""), ("seconds", "s", ".2f"),
                         ("worst_gap_ms", "worst gap ms", ".1f"), ("ops_per_s", "small ops/s", ",.0f")]))
    H.append_jsonl(a.out, rows)
    return rows


if __name__ == "__main__":
    main()
