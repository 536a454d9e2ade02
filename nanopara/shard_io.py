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


class _Hashing:
    """A binary file that hashes and counts what is written through it (torch.save writes it front to back)."""

    def __init__(self, f):
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.h.update(b)
        self.n += memoryview(b).nbytes
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def write_shard(state: dict, file: str) -> tuple[int, str]:
    """(bytes, sha256) of `state` written to `file` through a temporary name, on disk (fsync) when it returns."""
    with open(file + ".tmp", "wb") as f:
        out = _Hashing(f)
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
