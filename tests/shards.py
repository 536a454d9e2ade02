"""The small token shards the CPU training tests read: 250-token vocabulary, a repeating pattern (learnable) with
20 % random tokens, one train and (optionally) one val shard, always the same tokens for the same arguments."""
import os

import numpy as np

from nanopara.data import write_shard


def tiny_shards(d, prefix: str, n: int = 40_000, val: int | None = 5_000) -> str:
    """Write {prefix}_train_000000.bin (n tokens) and {prefix}_val_000000.bin (its first `val`; None: no val shard)
    into folder d; returns the glob train.py's --data.dataset takes."""
    rng = np.random.default_rng(0)
    pattern = np.arange(0, 250, 7)
    toks = np.where(rng.random(n) < 0.2, rng.integers(0, 250, n), np.tile(pattern, n // len(pattern) + 1)[:n])
    write_shard(os.path.join(str(d), f"{prefix}_train_000000.bin"), toks)
    if val:
        write_shard(os.path.join(str(d), f"{prefix}_val_000000.bin"), toks[:val])
    return os.path.join(str(d), f"{prefix}_*.bin")
