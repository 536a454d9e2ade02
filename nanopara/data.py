"""Token shards and the distributed, deterministic, resumable loader.

Shard layout (llm.c's `.bin`, so shards made by llm.c and modded-nanogpt load unchanged and ours load there):
    header: 256 x int32 = [magic 20240520, version 1, n_tokens, 0, ...]   (1024 bytes)
    body:   n_tokens x uint16 GPT-2 token ids; documents are prefixed by EOT (50256)

Loader: a shard of n tokens holds (n - 1) // T windows of T+1 tokens taken with stride T (as llm.c does), so within
an epoch every token is a target exactly once. Epoch e visits the shards in a permutation drawn from (seed, e), the
windows of each in one drawn from (seed, e, shard); the epochs end to end are one stream of global samples k = 0, 1..
(none dropped). Each call takes the next world*B and rank r rows r*B .. (r+1)*B-1, so the ranks' batches stacked are
the world=1 loader's batch. The state is the samples consumed: the order depends on k only, so a resume may change
world and B under the same global batch without a window seen twice or skipped (reshard.py). Validation: `reset()`.

    x, y = next(loader)        # (B, T) int64 CPU tensors, y[:, t] = x[:, t+1] in the token stream (or -1: masked)

Loss masks (SFT, data/prepare.py sft): a sibling `NAME.mask` beside `NAME.bin` (the shard stays a plain llm.c shard):
header 256 x int32 = [magic 20240601, version 1, n_tokens, row_len, 0, ...], body n_tokens x uint8, 1 where the
token is trained as a target. Examples are packed into rows of row_len tokens, so train.seq_len must be a multiple
of row_len; with masks (`loss_mask`: auto = when every shard has one) the loader yields y = -1 where the mask is 0.
Split of a shard: the last part of its file name that is exactly `train` or `val`, else whether `train`/`val`
occurs in the name. Tokenizer: `get_tokenizer()`, tiktoken's GPT-2 encoding (offline: the mirror's tiktoken_cache/).

Callers: train.py (loaders, loader state in checkpoints), data/prepare.py (write_shard, tokenizer); torch is imported
only when a loader makes batches. Quick look and loader speed:  python -m nanopara.data shakespeare --batch 8
"""
import argparse
import glob
import os
import re
import time

import numpy as np

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256
MASK_MAGIC, MASK_VERSION = 20240601, 1
HEADER_BYTES = HEADER_INTS * 4
EOT = 50256  # GPT-2 <|endoftext|>
DATASETS = ("shakespeare", "books", "fineweb10B", "fineweb-edu10B")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------------------------------------------
# tokenizer


def default_mirror():
    """The offline data mirror (tokenizer files, corpora, eval sets), in the one order everything uses: env
    NANOPARA_MIRROR (the Makefile's MIRROR=DIR sets it), else ../shared/data beside the repository if it exists,
    else None (the public hosts). Callers: get_tokenizer (its tiktoken_cache/), data/prepare.py (whose --mirror DIR
    comes first)."""
    if os.environ.get("NANOPARA_MIRROR"):
        return os.environ["NANOPARA_MIRROR"]
    beside = os.path.join(REPO_ROOT, "..", "shared", "data")
    return os.path.normpath(beside) if os.path.isdir(beside) else None


# tiktoken caches each downloaded file under sha1(url); these are gpt2's vocab.bpe and encoder.json
_GPT2_CACHE_KEYS = ("6d1cbeee0f20b3d9449abfede4726ed8212e3aee", "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6")


def get_tokenizer():
    """tiktoken's GPT-2 encoding (n_vocab 50257, EOT 50256), offline through the mirror when needed."""
    import tiktoken
    if "TIKTOKEN_CACHE_DIR" not in os.environ and "DATA_GYM_CACHE_DIR" not in os.environ:
        import tempfile
        default_cache = os.path.join(tempfile.gettempdir(), "data-gym-cache")
        cached = all(os.path.exists(os.path.join(default_cache, k)) for k in _GPT2_CACHE_KEYS)
        mirror = default_mirror()
        if not cached and mirror and os.path.isdir(os.path.join(mirror, "tiktoken_cache")):
            # set in the environment (not passed) because tiktoken reads it there, as do prepare's worker processes
            os.environ["TIKTOKEN_CACHE_DIR"] = os.path.join(mirror, "tiktoken_cache")
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # tiktoken raises network errors of several libraries when offline
        mirror = default_mirror()
        cache = os.path.join(mirror, "tiktoken_cache") if mirror else ""
        if cache and os.path.isdir(cache) and os.environ.get("TIKTOKEN_CACHE_DIR") != cache:
            # a cache found first (TIKTOKEN_CACHE_DIR, or tiktoken's default in /tmp) lacked or spoilt the files
            os.environ["TIKTOKEN_CACHE_DIR"] = cache
            return get_tokenizer()
        raise RuntimeError(
            f"cannot load tiktoken's GPT-2 encoding ({type(e).__name__}: {str(e)[:200]}); offline, set "
            f"TIKTOKEN_CACHE_DIR to a folder of tiktoken's cached files (e.g. shared/data/tiktoken_cache) or "
            f"NANOPARA_MIRROR to the data mirror that holds tiktoken_cache/") from None

# ----------------------------------------------------------------------------------------------------------------
# shards


def write_shard(path, tokens):
    """Write tokens (any int array-like, values in [0, 65535]) as an llm.c shard; atomic (tmp file, then rename)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > 65535):
        raise ValueError(f"{path}: token ids must fit uint16 (got range {tokens.min()}..{tokens.max()})")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (MAGIC, VERSION, tokens.size)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16, copy=False).tobytes())
    os.replace(tmp, path)  # readers see the old file or the whole new one, never a half-written one


def read_header(path):
    """Token count of a shard from its header, after checking magic, version and file size (reads 1 KiB)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"shard {path} does not exist")
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ValueError(f"shard {path}: truncated or corrupt: {size} bytes, less than the {HEADER_BYTES}-byte header")
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if header[0] != MAGIC:
        raise ValueError(f"shard {path}: bad magic {int(header[0])} (expected {MAGIC}: not an llm.c .bin token shard)")
    if header[1] != VERSION:
        raise ValueError(f"shard {path}: unsupported version {int(header[1])} (only version 1 = GPT-2 uint16 "
                         f"tokens; version 2 is llm.c's Llama-3 uint32 format)")
    n = int(header[2])
    if size != HEADER_BYTES + 2 * n:
        raise ValueError(f"shard {path}: truncated or corrupt: header says {n} tokens = "
                         f"{HEADER_BYTES + 2 * n} bytes, file has {size} bytes")
    return n


def read_shard(path):
    """Validated shard as a read-only (n_tokens,) uint16 np.memmap."""
    n = read_header(path)
    if n == 0:  # mmap cannot map an empty region
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(n,))


def mask_path(shard_path):
    """The loss-mask file beside a shard: x.bin -> x.mask."""
    root, ext = os.path.splitext(shard_path)
    return (root if ext == ".bin" else shard_path) + ".mask"


def write_mask(path, mask, row_len):
    """Write a loss mask (0/1 per token) for the shard of the same length; atomic like write_shard."""
    mask = np.asarray(mask)
    if mask.size and (mask.min() < 0 or mask.max() > 1):
        raise ValueError(f"{path}: a loss mask holds only 0 and 1")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:4] = (MASK_MAGIC, MASK_VERSION, mask.size, row_len)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(mask.astype(np.uint8).tobytes())
    os.replace(tmp, path)


def read_mask(path, n_tokens):
    """(read-only (n_tokens,) uint8 memmap, row_len) of a loss-mask file, after checking it fits its shard."""
    size = os.path.getsize(path)
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS) if size >= HEADER_BYTES else np.zeros(4, np.int32)
    if header[0] != MASK_MAGIC or header[1] != MASK_VERSION:
        raise ValueError(f"loss mask {path}: not a version-{MASK_VERSION} mask file (magic {int(header[0])}, "
                         f"expected {MASK_MAGIC})")
    n, row_len = int(header[2]), int(header[3])
    if n != n_tokens or size != HEADER_BYTES + n or row_len < 1:
        raise ValueError(f"loss mask {path}: holds {n} tokens in {size} bytes (row_len {row_len}), its shard has "
                         f"{n_tokens}: re-prepare the data")
    return (np.memmap(path, dtype=np.uint8, mode="r", offset=HEADER_BYTES, shape=(n,)) if n
            else np.zeros(0, np.uint8)), row_len


def in_split(filename, split):
    """True if a shard file name belongs to `split` ('train' or 'val'); rule in the module docstring."""
    parts = [w for w in re.split(r"[^a-z]+", os.path.basename(filename).lower()) if w in ("train", "val")]
    return parts[-1] == split if parts else split in os.path.basename(filename)


def find_shards(dataset, split, data_dir="data/shards"):
    """Sorted shard paths of one split. `dataset`: a name (folder under data_dir) or a path/glob of .bin files
    whose names contain `train`/`val`."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if not os.path.isabs(data_dir) and not os.path.isdir(data_dir):
        data_dir = os.path.join(REPO_ROOT, data_dir)  # run from outside the repo root
    plain = not any(c in dataset for c in "/*?[") and not dataset.endswith(".bin")
    # a prepared dataset wins over a same-named folder in the working directory (often the text it was made from)
    if plain and (os.path.isdir(os.path.join(data_dir, dataset)) or not os.path.isdir(dataset)):
        pattern = os.path.join(data_dir, dataset, "*.bin")
        files = sorted(f for f in glob.glob(pattern) if in_split(f, split))
        if not files:
            how = (f"`make data DATASET={dataset}` or `python data/prepare.py {dataset}`" if dataset in DATASETS
                   else f"`python data/prepare.py NAME` (NAME in {', '.join(DATASETS)}), from your own text with "
                        f"`python data/prepare.py text PATH --name {dataset}`, or pass a path/glob of .bin shards")
            raise FileNotFoundError(f"no {split} shards for dataset {dataset!r} ({pattern}); make them with {how}")
        return files
    pattern = os.path.join(dataset, "*.bin") if os.path.isdir(dataset) else dataset
    files = sorted(f for f in glob.glob(pattern) if in_split(f, split))
    if not files:
        raise FileNotFoundError(f"no .bin files with {split!r} in their names match {pattern!r}")
    return files

# ----------------------------------------------------------------------------------------------------------------
# loader

_MAX_ID = {}  # (realpath, size, mtime_ns) -> max token id, so each shard is scanned once per process


def _max_token(path, tokens):
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _MAX_ID:
        _MAX_ID[key] = int(tokens.max()) if tokens.size else -1
    return _MAX_ID[key]


class TokenLoader:
    """Infinite iterator of (x, y) int64 (B, T) batches for data-parallel rank `rank` of `world` (see module doc)."""

    def __init__(self, files, batch_size, seq_len, rank=0, world=1, seed=0, vocab_size=50257, shuffle=True,
                 pin_memory=False, loss_mask="auto"):
        if isinstance(files, str):
            files = [files]
        if not files:
            raise ValueError("TokenLoader needs at least one shard file")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world={world}), got {rank}")
        self.files, self.B, self.T = list(files), batch_size, seq_len
        self.rank, self.world, self.seed, self.vocab_size = rank, world, seed, vocab_size
        self.shuffle, self.pin_memory = shuffle, pin_memory
        n_tokens = np.array([read_header(f) for f in self.files], dtype=np.int64)  # checks every header now
        self.n_windows = np.maximum(n_tokens - 1, 0) // seq_len  # windows of T+1 tokens, stride T
        self.rows = world * batch_size  # rows of one global batch
        total = int(self.n_windows.sum())
        if total < self.rows:
            raise ValueError(
                f"dataset too small: {int(n_tokens.sum())} tokens in {len(self.files)} shard(s) make {total} "
                f"windows of seq_len+1={seq_len + 1} tokens, fewer than one global batch of world*batch_size="
                f"{self.rows} rows; use a smaller batch or seq_len, or more data")
        self.batches_per_epoch = total // self.rows  # whole batches in one epoch's windows (validation's bound)
        self.total, self.sample = total, 0  # windows per epoch; global samples consumed (the stream's next index)
        self._mmaps, self._plans, self._perms = {}, {}, {}
        self.masks = self._open_masks(loss_mask, n_tokens)  # None, or one uint8 memmap per shard

    def _open_masks(self, loss_mask, n_tokens):
        """Loss masks per `loss_mask` (auto | on | off); every check that can fail runs here, before training."""
        if loss_mask not in ("auto", "on", "off"):
            raise ValueError(f"loss_mask must be auto, on or off, got {loss_mask!r}")
        have = [os.path.isfile(mask_path(f)) for f in self.files]
        if loss_mask == "off" or (loss_mask == "auto" and not any(have)):
            return None
        if not all(have):
            f = self.files[have.index(False)]
            raise ValueError(f"shard {f} has no loss mask {mask_path(f)}" + (
                " (data.loss_mask=on)" if loss_mask == "on" else " while other shards have one: mixing SFT and "
                "plain shards is ambiguous; set data.loss_mask=on or off, or re-prepare"))
        masks = []
        for f, n in zip(self.files, n_tokens):
            mask, row_len = read_mask(mask_path(f), int(n))
            if self.T % row_len:
                raise ValueError(f"{mask_path(f)}: examples are packed in rows of {row_len} tokens; train.seq_len="
                                 f"{self.T} would cut them: use a multiple of {row_len}, or re-prepare with "
                                 f"--seq_len {self.T}")
            if mask.size and int(mask.max()) > 1:
                raise ValueError(f"loss mask {mask_path(f)} holds values other than 0 and 1")
            masks.append(mask)
        return masks

    def __len__(self):
        return self.batches_per_epoch

    def __iter__(self):
        return self

    def reset(self):
        """Back to the first batch of epoch 0 (validation restarts from the same tokens each time)."""
        self.sample = 0

    @property
    def epoch(self):
        return self.sample // self.total

    def state_dict(self):
        """The global samples consumed and what the stream depends on (rows: world*B, informational)."""
        return {"sample": self.sample, "epoch": self.epoch, "seed": self.seed, "rows": self.rows, "seq_len": self.T,
                "windows": self.total, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state):
        """Continue at the saved global sample; world and B may differ from the saved loader's. A state of the
        format before samples (epoch, position in global batches of `rows`, leftovers dropped) continues at the
        same sample of its epoch (exact in epoch 0; later epochs lost their dropped windows)."""
        mine = self.state_dict()
        for k in ("seed", "seq_len", "windows", "shuffle"):
            if k in state and int(state[k]) != mine[k]:
                raise ValueError(f"loader state does not match this loader: {k}={int(state[k])} saved, {mine[k]} "
                                 f"now (resume needs the same data, seed and seq_len)")
        if "sample" in state:
            sample = int(state["sample"])
        else:
            sample = int(state["epoch"]) * self.total + int(state["position"]) * int(state.get("rows", self.rows))
        if sample < 0:
            raise ValueError(f"loader state sample {sample} is negative")
        self.sample = sample

    def _epoch_plan(self, epoch):
        """(shard order, cumulative window counts in that order) of `epoch`, cached (a batch spans at most two)."""
        if epoch not in self._plans:
            if len(self._plans) >= 2:
                self._plans.pop(next(iter(self._plans)))
            n = len(self.files)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._plans[epoch] = (order, np.cumsum(self.n_windows[order]))
        return self._plans[epoch]

    def _window_perm(self, epoch, shard):
        key = (epoch, shard)
        if key not in self._perms:
            if len(self._perms) >= 4:  # a batch touches at most a few shards; keep memory flat
                self._perms.pop(next(iter(self._perms)))
            rng = np.random.default_rng([self.seed, epoch, shard])
            self._perms[key] = rng.permutation(int(self.n_windows[shard]))
        return self._perms[key]

    def _tokens(self, shard):
        if shard not in self._mmaps:
            path = self.files[shard]
            tokens = read_shard(path)
            top = _max_token(path, tokens)
            if top >= self.vocab_size:
                raise ValueError(f"shard {path} holds token id {top} >= vocab_size {self.vocab_size} (wrong "
                                 f"tokenizer for this model? set model.vocab_size or re-prepare the data)")
            self._mmaps[shard] = tokens
        return self._mmaps[shard]

    def __next__(self):
        import torch  # here, not at the top: see the module docstring
        first = self.sample + self.rank * self.B  # this rank's rows, as global sample indices
        buf = np.empty((self.B, self.T + 1), dtype=np.uint16)  # (B, T+1)
        keep = np.ones((self.B, self.T), dtype=bool) if self.masks is not None else None  # (B, T) trained targets
        for i in range(self.B):
            epoch, k = divmod(first + i, self.total)  # k: index into the epoch's window list
            order, cum = self._epoch_plan(epoch)
            s = int(np.searchsorted(cum, k, side="right"))  # which shard (position in `order`) holds the window
            shard = int(order[s])
            j = int(k - (cum[s - 1] if s > 0 else 0))  # window index within the shard
            w = int(self._window_perm(epoch, shard)[j]) if self.shuffle else j
            buf[i] = self._tokens(shard)[w * self.T: w * self.T + self.T + 1]
            if keep is not None:  # the mask of each target token: positions 1..T of the window
                keep[i] = self.masks[shard][w * self.T + 1: w * self.T + self.T + 1] != 0
        self.sample += self.rows
        x = torch.from_numpy(buf[:, :-1].astype(np.int64))  # (B, T), astype copies into a contiguous array
        y = buf[:, 1:].astype(np.int64)  # (B, T)
        if keep is not None:
            y[~keep] = -1  # ignored by the loss (model.loss_fn, the cross-entropy kernels)
        y = torch.from_numpy(y)
        if self.pin_memory and torch.cuda.is_available():
            x, y = x.pin_memory(), y.pin_memory()
        return x, y

    next_batch = __next__


# ----------------------------------------------------------------------------------------------------------------

if __name__ == "__main__":
    p = argparse.ArgumentParser(description="inspect shards and time the loader")
    p.add_argument("dataset")
    p.add_argument("--split", default="train")
    p.add_argument("--data_dir", default="data/shards")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    files = find_shards(a.dataset, a.split, a.data_dir)
    for f in files[:5]:
        print(f"{f}: {read_header(f):,} tokens")
    print(f"{len(files)} shard(s), {sum(read_header(f) for f in files):,} tokens")
    loader = TokenLoader(files, a.batch, a.seq_len)
    x, _ = next(loader)
    print("sample:", repr(get_tokenizer().decode(x[0, :48].tolist())))
    t0 = time.perf_counter()
    for _ in range(a.steps):
        next(loader)
    dt = time.perf_counter() - t0
    print(f"{a.steps / dt:.0f} batches/s, {a.steps * a.batch * a.seq_len / dt / 1e6:.1f} M tokens/s "
          f"({len(loader)} batches per epoch)")
