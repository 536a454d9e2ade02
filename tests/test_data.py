"""Tests of nanopara/data.py (shards, loader) and data/prepare.py (shakespeare, books reader, downloads).
Your own text, prepare's error messages and the no-network case: tests/test_prepare.py.

Run: .venv/bin/python -m pytest tests/test_data.py -q   (~10 s on 2 cores; needs the mirror ../shared/data)
Synthetic shards hold tokens that encode their own position (shard*10000 + index), so a batch tells exactly
which windows it came from.
"""
import importlib.util
import io
import lzma
import json
import os
import sys
import urllib.error

import numpy as np
import pytest
import torch

from nanopara.data import (EOT, TokenLoader, find_shards, get_tokenizer, read_header, read_shard, write_shard)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIRROR = os.path.join(ROOT, "..", "shared", "data")


def _load_prepare():
    spec = importlib.util.spec_from_file_location("prepare", os.path.join(ROOT, "data", "prepare.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["prepare"] = mod  # so Pool workers can unpickle prepare._encode_doc
    spec.loader.exec_module(mod)
    return mod


prepare = _load_prepare()
SIZES = (1237, 998, 3001)  # tokens per synthetic shard: odd sizes, not multiples of T+1


@pytest.fixture
def shards(tmp_path):
    files = []
    for i, n in enumerate(SIZES):
        files.append(str(tmp_path / f"syn_train_{i:06d}.bin"))
        write_shard(files[-1], i * 10000 + np.arange(n))
    return files


def batches(loader, n):
    return [next(loader) for _ in range(n)]

# ----------------------------------------------------------------------------------------------------------------
# tokenizer and shard files


def test_tokenizer():
    enc = get_tokenizer()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257 and enc.eot_token == EOT == 50256


def test_tokenizer_error_is_one_clear_line(monkeypatch):
    import tiktoken

    def offline(name):
        raise ConnectionError("no network")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", os.environ.get("TIKTOKEN_CACHE_DIR", ""))  # restored after the test
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(RuntimeError, match="set TIKTOKEN_CACHE_DIR") as e:
        get_tokenizer()
    assert "\n" not in str(e.value)


def test_tokenizer_falls_back_to_the_mirror(monkeypatch, tmp_path):
    """A cache dir that lacks (or holds spoilt) files makes tiktoken try the network; offline, get_tokenizer then
    takes the mirror's tiktoken_cache/ (a GPU machine whose /tmp cache was spoilt failed this way)."""
    import tiktoken
    real, mirror = tiktoken.get_encoding, tmp_path / "mirror"
    (mirror / "tiktoken_cache").mkdir(parents=True)

    def offline_unless_mirror(name):
        if os.environ.get("TIKTOKEN_CACHE_DIR") != str(mirror / "tiktoken_cache"):
            raise ConnectionError("no network")
        return real(name)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("NANOPARA_MIRROR", str(mirror))
    monkeypatch.setattr(tiktoken, "get_encoding", offline_unless_mirror)
    assert get_tokenizer().n_vocab == 50257


def test_shard_roundtrip(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 65536, size=1009)
    path = str(tmp_path / "a.bin")
    write_shard(path, tokens)
    got = read_shard(path)
    assert got.dtype == np.uint16 and np.array_equal(got, tokens)
    assert read_header(path) == 1009 and os.path.getsize(path) == 1024 + 2 * 1009
    assert not [f for f in os.listdir(tmp_path) if "tmp" in f]  # atomic write leaves no temporary behind
    write_shard(str(tmp_path / "empty.bin"), [])
    assert len(read_shard(str(tmp_path / "empty.bin"))) == 0


def test_llmc_header_compatibility(tmp_path):
    # written exactly as llm.c's dev/data/data_common.py write_datafile does
    tokens = np.array([EOT, 15496, 995, 0, 65535], dtype=np.uint16)
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    theirs = tmp_path / "llmc_val_000000.bin"
    with open(theirs, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())
    assert np.array_equal(read_shard(str(theirs)), tokens)
    write_shard(str(tmp_path / "ours.bin"), tokens.astype(np.int64))
    assert (tmp_path / "ours.bin").read_bytes() == theirs.read_bytes()  # and ours load in llm.c


def test_shard_errors(tmp_path):
    good = str(tmp_path / "good.bin")
    write_shard(good, np.arange(100))
    raw = open(good, "rb").read()

    def variant(name, data):
        path = str(tmp_path / name)
        open(path, "wb").write(data)
        return path
    bad_magic = variant("magic.bin", np.int32(7).tobytes() + raw[4:])
    bad_version = variant("version.bin", raw[:4] + np.int32(2).tobytes() + raw[8:])
    truncated = variant("trunc.bin", raw[:-3])
    tiny = variant("tiny.bin", raw[:100])
    with pytest.raises(FileNotFoundError, match=r"shard .*missing\.bin does not exist"):
        read_shard(str(tmp_path / "missing.bin"))
    with pytest.raises(ValueError, match=r"magic\.bin: bad magic 7"):
        read_shard(bad_magic)
    with pytest.raises(ValueError, match=r"version\.bin: unsupported version 2"):
        read_shard(bad_version)
    with pytest.raises(ValueError, match=r"trunc\.bin: truncated or corrupt: header says 100 tokens"):
        read_shard(truncated)
    with pytest.raises(ValueError, match=r"tiny\.bin: truncated or corrupt"):
        read_shard(tiny)
    with pytest.raises(ValueError, match="must fit uint16"):
        write_shard(str(tmp_path / "big.bin"), [1, 70000])
    with pytest.raises(ValueError, match="truncated"):  # the loader checks every header before any work
        TokenLoader([good, truncated], 2, 8)


def test_token_id_beyond_vocab(tmp_path):
    path = str(tmp_path / "x_train.bin")
    write_shard(path, np.r_[np.arange(200), 50300])
    loader = TokenLoader([path], 2, 8, vocab_size=50257)
    with pytest.raises(ValueError, match=r"x_train\.bin holds token id 50300 >= vocab_size 50257"):
        next(loader)
    next(TokenLoader([path], 2, 8, vocab_size=50304))  # a padded vocab accepts it


def test_find_shards(tmp_path, shards):
    d = tmp_path / "shards" / "books"
    for name in ("books_val_000000.bin", "books_train_000002.bin", "books_train_000001.bin"):
        write_shard(str(d / name), np.arange(10))
    assert [os.path.basename(f) for f in find_shards("books", "train", str(tmp_path / "shards"))] == \
        ["books_train_000001.bin", "books_train_000002.bin"]
    assert find_shards(str(d / "*.bin"), "val") == [str(d / "books_val_000000.bin")]
    assert find_shards(str(d), "val") == [str(d / "books_val_000000.bin")]
    with pytest.raises(FileNotFoundError, match="make data DATASET=shakespeare.*python data/prepare.py shakespeare"):
        find_shards("shakespeare", "train", str(tmp_path / "shards"))
    with pytest.raises(FileNotFoundError, match="no .bin files with 'val'"):
        find_shards(str(tmp_path / "syn_*.bin"), "val")
    with pytest.raises(FileNotFoundError, match=r"python data/prepare.py text PATH --name mine"):
        find_shards("mine", "train", str(tmp_path / "shards"))


def test_find_shards_split_by_name_part(tmp_path, monkeypatch):
    """A dataset whose name holds `val` or `train` still splits by the last such part of each file name."""
    for ds in ("interval", "train_notes"):
        for split in ("val_000000", "train_000001"):
            write_shard(str(tmp_path / "shards" / ds / f"{ds}_{split}.bin"), np.arange(10))
        for split in ("train", "val"):
            assert [os.path.basename(f) for f in find_shards(ds, split, str(tmp_path / "shards"))] == \
                [f"{ds}_{split}_{'000001' if split == 'train' else '000000'}.bin"]
    write_shard(str(tmp_path / "old" / "tiny_validation.bin"), np.arange(10))  # no exact part: substring rule
    assert find_shards(str(tmp_path / "old"), "val") == [str(tmp_path / "old" / "tiny_validation.bin")]
    # a folder `interval/` in the working directory (say, the text it was made from) does not hide the dataset
    monkeypatch.chdir(tmp_path)
    (tmp_path / "interval").mkdir(exist_ok=True)
    (tmp_path / "interval" / "notes.txt").write_text("text")
    assert len(find_shards("interval", "train", str(tmp_path / "shards"))) == 1

# ----------------------------------------------------------------------------------------------------------------
# loader


def window_ids(x):
    """(shard, window start) of each row, decoded from the synthetic token values."""
    return [(int(v) // 10000, int(v) % 10000) for v in x[:, 0]]


def test_loader_batches_are_shifted_windows(shards):
    T = 13
    loader = TokenLoader(shards, 3, T, seed=5)
    n_windows = sum((n - 1) // T for n in SIZES)
    assert len(loader) == n_windows // 3
    seen = []
    for _ in range(len(loader)):  # one epoch
        x, y = next(loader)
        assert x.shape == y.shape == (3, T) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y, x + 1)  # synthetic tokens count up, so the target is the next token
        assert all(start % T == 0 for _, start in window_ids(x))  # windows on the stride-T grid
        seen += window_ids(x)
    assert len(set(seen)) == len(seen) == len(loader) * 3  # no window twice in an epoch
    assert loader.state_dict()["sample"] == len(loader) * 3 and loader.epoch == 0  # 2 windows left in epoch 0
    seen += window_ids(next(loader)[0])  # ... which this batch takes before epoch 1's first
    assert len(set(seen[:n_windows])) == n_windows and loader.epoch == 1  # none dropped


def test_loader_deterministic_from_seed(shards):
    a, b, c = (batches(TokenLoader(shards, 4, 11, seed=s), 30) for s in (1, 1, 2))
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))


def test_epoch_wrap_reshuffles(shards):
    loader = TokenLoader(shards, 4, 11, seed=3)
    n = len(loader)
    ids = [w for x, _ in batches(loader, 2 * n + 2) for w in window_ids(x)]
    total = loader.total  # the epochs end to end (a batch may run past an epoch's end)
    ids0, ids1 = ids[:total], ids[total:2 * total]
    assert ids0 != ids1 and sorted(ids0) == sorted(ids1) and len(set(ids1)) == len(ids1) == total


@pytest.mark.parametrize("world", [2, 3])
def test_rank_slices_disjoint_and_union_is_world1(shards, world):
    B, T, steps = 2, 7, 500  # 500 steps cross several epoch boundaries
    ranks = [TokenLoader(shards, B, T, rank=r, world=world, seed=9) for r in range(world)]
    whole = TokenLoader(shards, world * B, T, rank=0, world=1, seed=9)
    for _ in range(steps):
        parts = [next(r) for r in ranks]
        x, y = next(whole)
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
        tokens = [set(p[0].flatten().tolist()) for p in parts]
        assert all(tokens[i].isdisjoint(tokens[j]) for i in range(world) for j in range(i))


def test_exact_resume(shards):
    B, T = 3, 10
    n_epoch = len(TokenLoader(shards, B, T))
    N, M = n_epoch - 2, 7  # resume just before an epoch boundary, continue across it
    straight = batches(TokenLoader(shards, B, T, seed=4), N + M)
    first = TokenLoader(shards, B, T, seed=4)
    batches(first, N)
    state = first.state_dict()
    assert all(type(v) is int for v in state.values())
    resumed = TokenLoader(shards, B, T, seed=4)
    resumed.load_state_dict(state)
    for (xs, ys), (xr, yr) in zip(straight[N:], batches(resumed, M)):
        assert torch.equal(xs, xr) and torch.equal(ys, yr)
    # the state is in global samples, so a 3-rank run may resume a 1-rank run, and another batch size too
    half = TokenLoader(shards, 1, T, world=3, rank=1, seed=4)
    half.load_state_dict(state)
    assert torch.equal(next(half)[0], straight[N][0][1:2])
    wide = TokenLoader(shards, 6, T, seed=4)
    wide.load_state_dict(state)
    assert torch.equal(next(wide)[0], torch.cat([straight[N][0], straight[N + 1][0]]))
    with pytest.raises(ValueError, match="seq_len=10 saved, 11 now"):
        TokenLoader(shards, 3, 11, seed=4).load_state_dict(state)


def test_validation_order_and_reset(shards):
    T = 16
    val = TokenLoader(shards, 5, T, shuffle=False)
    x, y = next(val)
    assert window_ids(x) == [(0, i * T) for i in range(5)]
    next(val)
    val.reset()
    assert torch.equal(next(val)[0], x)


def test_dataset_smaller_than_global_batch(tmp_path):
    path = str(tmp_path / "s_val.bin")
    write_shard(path, np.arange(50))
    with pytest.raises(ValueError, match=r"dataset too small: 50 tokens .* 3 windows .* world\*batch_size=4 rows"):
        TokenLoader([path], 2, 16, world=2)

# ----------------------------------------------------------------------------------------------------------------
# prepare.py


def test_prepare_shakespeare_from_mirror(tmp_path, capsys):
    prepare.main(["shakespeare", "--mirror", MIRROR, "--out", str(tmp_path)])
    val, train = find_shards("shakespeare", "val", str(tmp_path)), find_shards("shakespeare", "train", str(tmp_path))
    n_val, n_train = read_header(val[0]), read_header(train[0])
    assert n_val + n_train == 338_025 + 1  # the mirror README's count + one EOT
    assert n_val == (n_val + n_train) // 10 and read_shard(val[0])[0] == EOT
    assert get_tokenizer().decode(read_shard(val[0])[1:6].tolist()) == "First Citizen:\nBefore"
    mtime = os.path.getmtime(train[0])
    prepare.main(["shakespeare", "--mirror", MIRROR, "--out", str(tmp_path)])
    assert "already prepared" in capsys.readouterr().out and os.path.getmtime(train[0]) == mtime
    next(TokenLoader(val, 4, 64, shuffle=False))


def test_books_reader_on_synthetic_corpus(tmp_path):
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "Hello", "world", "!", "\n"]
    texts = {}
    (tmp_path / "text").mkdir()
    for name in ("b_docs", "a_docs"):
        with lzma.open(tmp_path / "text" / f"{name}.jsonl.xz", "wt", encoding="utf-8") as f:
            for i in range(9):
                text = " ".join(rng.choice(words, size=int(rng.integers(3, 60))))
                texts[(name, str(i))] = text
                f.write(json.dumps({"source": name, "id": str(i), "text": text}) + "\n")
    (tmp_path / "text" / "tinyshakespeare.txt").write_text("To be, or not to be: that is the question.\n")
    docs = prepare.books_documents(str(tmp_path))
    assert len(docs) == 19 and docs == prepare.books_documents(str(tmp_path))  # deterministic order
    out = tmp_path / "out" / "books"
    prepare.prepare_docs("books", docs, str(out), val_tokens=200, shard_tokens=97, procs=2)
    manifest = json.loads((out / "manifest.json").read_text())
    files = [str(out / s["file"]) for s in manifest["shards"]]
    assert len(files) > 3 and all(read_header(f) == 97 for f in files[1:-1])  # train cut into 97-token shards
    tokens = np.concatenate([read_shard(f) for f in files]).tolist()
    assert len(tokens) == manifest["tokens"] and tokens[0] == EOT and tokens.count(EOT) == 19
    enc = get_tokenizer()
    pieces, cur = [], []
    for t in tokens[1:] + [EOT]:
        if t == EOT:
            pieces.append(enc.decode(cur))
            cur = []
        else:
            cur.append(t)
    assert sorted(pieces) == sorted(docs)  # every document exactly once, val + train
    n_val = read_header(files[0])
    expect = 0  # val: the first documents, in order, up to 200 tokens, skipping any longer than 200 // 8
    for d in docs:
        n = len(enc.encode_ordinary(d)) + 1
        expect += n if expect < 200 and n <= 200 // 8 else 0
    assert n_val == expect > 0
    with pytest.raises(prepare.PrepareError, match="no document is short enough"):
        prepare.prepare_docs("books", docs, str(tmp_path / "v"), val_tokens=8, shard_tokens=97, procs=1)
    assert find_shards(str(out), "val") == files[:1]


class FakeServer:
    """opener(request, timeout) serving `data`; honours Range unless told not to; can drop the connection once."""

    def __init__(self, data, ranges=True, fail_after=None):
        self.data, self.ranges, self.fail_after, self.requests = data, ranges, fail_after, []

    def __call__(self, req, timeout=None):
        rng = req.get_header("Range")
        self.requests.append(rng)
        start = int(rng[len("bytes="):-1]) if rng and self.ranges else 0
        body = io.BytesIO(self.data[start:])
        server = self

        class Resp:
            status = 206 if start else 200
            headers = {"Content-Length": str(len(server.data) - start),
                       "Content-Range": f"bytes {start}-{len(server.data) - 1}/{len(server.data)}"}

            def read(self, n):
                if server.fail_after is not None and body.tell() >= server.fail_after:
                    server.fail_after = None
                    raise ConnectionResetError("connection reset by peer")
                return body.read(min(n, 1000))

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False
        return Resp()


def test_download_resumes_from_part(tmp_path):
    data = os.urandom(10_000)
    dest = str(tmp_path / "f.bin")
    server = FakeServer(data, fail_after=3000)  # first attempt dies after 3000 bytes
    prepare.download("https://x/f.bin", dest, opener=server, backoff=0)
    assert open(dest, "rb").read() == data and server.requests == [None, "bytes=3000-"]
    assert not os.path.exists(dest + ".part")

    open(dest + ".part", "wb").write(data[:1234])  # left by an earlier, interrupted run
    server = FakeServer(data)
    prepare.download("https://x/f.bin", dest, opener=server, backoff=0)
    assert open(dest, "rb").read() == data and server.requests == ["bytes=1234-"]

    open(dest + ".part", "wb").write(b"junk")  # a server that ignores Range: start over
    prepare.download("https://x/f.bin", dest, opener=FakeServer(data, ranges=False), backoff=0)
    assert open(dest, "rb").read() == data

    src = tmp_path / "src.bin"
    src.write_bytes(data)
    prepare.download(src.as_uri(), str(tmp_path / "g.bin"))  # file:// through urllib itself
    assert (tmp_path / "g.bin").read_bytes() == data

    def not_found(req, timeout=None):
        raise urllib.error.HTTPError(req.full_url, 404, "Not Found", {}, None)
    with pytest.raises(prepare.DownloadError, match="could not fetch https://x/h.bin: HTTP 404"):
        prepare.download("https://x/h.bin", str(tmp_path / "h.bin"), opener=not_found, backoff=0)


def test_fineweb_from_mirror(tmp_path):
    mirror = tmp_path / "mirror"
    write_shard(str(mirror / "fineweb10B" / "fineweb_val_000000.bin"), np.arange(300))
    write_shard(str(mirror / "fineweb10B" / "fineweb_train_000001.bin"), np.arange(500))

    def no_network(req, timeout=None):
        raise AssertionError("must not download what the mirror has")
    out = tmp_path / "shards" / "fineweb10B"
    prepare.prepare_remote("fineweb10B", str(out), str(mirror), num_shards=1, opener=no_network)
    prepare.prepare_remote("fineweb10B", str(out), str(mirror), num_shards=1, opener=no_network)  # idempotent
    assert [read_header(f) for f in find_shards("fineweb10B", "train", str(tmp_path / "shards"))] == [500]
    assert sorted(os.listdir(out)) == ["fineweb_train_000001.bin", "fineweb_val_000000.bin"]
    (mirror / "fineweb10B" / "fineweb_train_000002.bin").write_bytes(b"\0" * 2000)  # corrupt mirror file
    with pytest.raises(prepare.PrepareError, match="fineweb_train_000002.bin: bad magic"):
        prepare.prepare_remote("fineweb10B", str(out), str(mirror), num_shards=2, opener=no_network)
    assert not os.path.exists(out / "fineweb_train_000002.bin")
