"""Checkpoint files on disk, durably and checksummed (checkpoint.py's save and verify, async_save.py's writer).

    n, sha = write_shard(state, file)    # torch.save through file.tmp, sha256 of the bytes as written, fsync, rename
    sha256_of(file)                      # the same digest from the file (`sha256sum` agrees), once per file version
    write_synced(path, text); fsync_dir(path)

torch.save writes its zip front to back through `write`, so hashing what passes through gives the file's sha256
without reading it back. Digests are cached by (device, inode, size, mtime): a process hashes a file once, and a
shard it wrote itself never. Thread-safe as used: one writer thread at a time, dict updates are atomic.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch

_HASHED: dict = {}  # (device, inode, size, mtime_ns) -> sha256 of that file, as this process wrote or read it


def _key(file: str) -> tuple:
    st = os.stat(file)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def sha256_of(file: str) -> str:
    key = _key(file)
    if key not in _HASHED:
        h = hashlib.sha256()
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        _HASHED[key] = h.hexdigest()
    return _HASHED[key]


KICK_BYTES = 256 << 20  # start the disk's writeback every this many bytes written
CHUNK_BYTES = 64 << 20  # torch.save hands over a tensor's bytes in one write: passed on in pieces this large
PARALLEL_HASH_BYTES = 1 << 20  # a write this large is hashed on a second thread beside the write itself


class _Hashing:
    """A binary file that hashes and counts what is written through it (torch.save writes it front to back).

    Every KICK_BYTES it asks the kernel to start writing the bytes so far back to disk (posix_fadvise DONTNEED
    starts writeback without waiting, and drops the pages once clean). Without it a host with a large page cache
    holds the whole shard dirty until the fsync, and the disk starts only then: hashing and copying (~10 s for
    12 GB) and the disk (~14 s at 0.87 GB/s) ran one after the other instead of together (notes/checkpoints.md).
    With a `pool`, a large write's sha256 runs on the pool's thread while this thread copies it into the file; the
    write returns only when both are done, so no buffer is read after torch.save takes it back."""

    def __init__(self, f, pool=None):
        self.f, self.h, self.n, self.kicked, self.pool = f, hashlib.sha256(), 0, 0, pool

    def write(self, b) -> int:
        """All of `b`, in CHUNK_BYTES pieces (a 4 GB tensor is one call): the kick then comes every KICK_BYTES
        within a tensor too (each piece hashed on the pool's thread beside its own copy into the file)."""
        mv = memoryview(b)
        if mv.nbytes <= CHUNK_BYTES or not mv.c_contiguous:
            return self._write(b)
        mv = mv.cast("B")
        return sum(self._write(mv[i:i + CHUNK_BYTES]) for i in range(0, mv.nbytes, CHUNK_BYTES))

    def _write(self, b) -> int:
        n = memoryview(b).nbytes
        if self.pool is not None and n >= PARALLEL_HASH_BYTES:  # hash on the pool's thread while this one writes
            hashed = self.pool.submit(self.h.update, b)  # (both release the GIL); done before `b` is given back
            written = self.f.write(b)
            hashed.result()
        else:
            self.h.update(b)
            written = self.f.write(b)
        self.n += n
        if self.n - self.kicked >= KICK_BYTES and hasattr(os, "posix_fadvise"):
            self.f.flush()
            os.posix_fadvise(self.f.fileno(), self.kicked, self.n - self.kicked, os.POSIX_FADV_DONTNEED)
            self.kicked = self.n
        return written

    def flush(self) -> None:
        self.f.flush()


def write_shard(state: dict, file: str) -> tuple[int, str]:
    """(bytes, sha256) of `state` written to `file` through a temporary name, on disk (fsync) when it returns."""
    with open(file + ".tmp", "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="nanopara-sha256") as pool:
        out = _Hashing(f, pool)
        torch.save(state, out)
        f.flush()
        os.fsync(f.fileno())
    os.replace(file + ".tmp", file)
    _HASHED[_key(file)] = out.h.hexdigest()
    return out.n, out.h.hexdigest()


def write_synced(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
