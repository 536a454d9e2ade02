"""The tiny CLI run the survival, async-checkpoint and restart tests share: its token shards and train.py flags."""
import numpy as np

from nanopara.data import write_shard


def write_tiny_shards(d, seed: int) -> str:
    """A train and a val shard in directory d: a repeating pattern with 10 % noise (the loss falls fast); the glob."""
    rng = np.random.default_rng(seed)
    toks = np.where(rng.random(30000) < 0.1, rng.integers(0, 256, 30000), np.tile(np.arange(0, 200, 3), 500)[:30000])
    write_shard(str(d / "s_train_000000.bin"), toks)
    write_shard(str(d / "s_val_000000.bin"), toks[:3000])
    return str(d / "s_*.bin")


def tiny_argv(shards, out_dir, *extra, steps: int | None = 8) -> list:
    """train.py's flags for a 2-layer, 32-wide GPT on CPU; `extra` last (the last repeated key wins)."""
    return ["--preset=tiny", "--device=cpu", f"--out_dir={out_dir}", f"--data.dataset={shards}",
            "--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
            "--model.vocab_size=256", "--model.kernels=torch", "--train.micro_batch=4", "--train.seq_len=16",
            *([f"--train.steps={steps}"] if steps is not None else []), "--train.warmup_steps=2",
            "--train.val_every=0", "--train.sample_tokens=0", "--train.lr=1e-2", "--train.log_every=1", *extra]
