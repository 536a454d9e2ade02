"""Tests of data/prepare.py as a user meets it: `text` on your own files, one-line errors, downloads with no network.

Run: .venv/bin/python -m pytest tests/test_prepare.py -q   (~10 s on 2 cores; the tokenizer from ../shared/data)
Most tests run the script as a subprocess, as a user would, and check its exit code and stderr.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error

import numpy as np
import pytest

from nanopara.data import EOT, TokenLoader, find_shards, get_tokenizer, read_shard
from test_data import prepare  # data/prepare.py loaded as a module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "data", "prepare.py")
WORDS = "the cat sat on a mat and then it went home to sleep in the warm sun while birds sang".split()


def run(*args, cwd=None):
    env = dict(os.environ, NANOPARA_MIRROR=os.path.join(ROOT, "..", "shared", "data"))
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=60)


def one_line_error(r, *parts):
    """Exit code 2 and exactly one error line, holding every part; no traceback."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("prepare.py: error: "), r.stderr
    for p in parts:
        assert p in errors[0], (p, errors[0])
    return errors[0]


def doc(rng, n):
    return " ".join(rng.choice(WORDS, size=n)) + "\n"


@pytest.fixture
def corpus(tmp_path):
    """A folder with two text files (one in a subfolder), a .jsonl, and files that must be ignored; ~3k tokens."""
    rng = np.random.default_rng(0)
    d = tmp_path / "notes"
    (d / "sub").mkdir(parents=True)
    (d / ".hidden").mkdir()
    docs = {"a.txt": doc(rng, 900), "sub/b.md": doc(rng, 700)}
    for name, text in docs.items():
        (d / name).write_text(text)
    lines = [doc(rng, 40 + 30 * i) for i in range(8)]
    (d / "c.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(lines)) + "\n")
    (d / "skip.csv").write_text("not,text\n")
    (d / ".hidden" / "x.txt").write_text("hidden")
    return d, list(docs.values()) + lines


def documents(out, name):
    """Decoded documents of a prepared dataset: val then train, each split at EOT. A shard's leading tokens before
    its first EOT (a document's tail) come back as a separate piece marked with a leading '+'."""
    enc, pieces = get_tokenizer(), []
    for split in ("val", "train"):
        for f in find_shards(name, split, str(out)):
            tokens = read_shard(f).tolist()
            starts = [i for i, t in enumerate(tokens) if t == EOT] + [len(tokens)]
            if starts[0] > 0:
                pieces.append("+" + enc.decode(tokens[:starts[0]]))
            pieces += [enc.decode(tokens[a + 1:b]) for a, b in zip(starts, starts[1:])]
    return pieces

# ----------------------------------------------------------------------------------------------------------------
# your own text


def test_text_folder_roundtrip(tmp_path, corpus):
    folder, texts = corpus
    r = run("text", folder, "--out", tmp_path / "shards")
    assert r.returncode == 0, r.stderr
    assert f"python train.py --data.dataset=notes --data.data_dir={tmp_path / 'shards'}" in r.stdout
    assert "10/10 docs" in r.stderr  # the progress line counts documents
    val, train = (find_shards("notes", s, str(tmp_path / "shards")) for s in ("val", "train"))
    assert [os.path.basename(f) for f in val + train] == ["notes_val_000000.bin", "notes_train_000001.bin"]
    n_val, n_train = len(read_shard(val[0])), len(read_shard(train[0]))
    assert n_val == prepare.MIN_SPLIT_TOKENS and n_train > n_val  # 10% of ~3k tokens is below the minimum
    pieces = documents(tmp_path / "shards", "notes")
    tails = [p[1:] for p in pieces if p.startswith("+")]
    whole = [p for p in pieces if not p.startswith("+")]
    assert len(tails) <= 1  # at most one document is cut, its tail first in val
    if tails:
        heads = [w for w in whole if w not in texts]
        assert len(heads) == 1 and heads[0] + tails[0] in texts
        whole = [heads[0] + tails[0] if w == heads[0] else w for w in whole]
    assert sorted(whole) == sorted(texts)  # every document exactly once; nothing from skip.csv or .hidden/
    x, y = next(TokenLoader(val, 8, 128, shuffle=False))  # one batch of the tiny preset
    assert x.shape == (8, 128) and next(TokenLoader(train, 8, 128))[0].shape == (8, 128)
    again = run("text", folder, "--out", tmp_path / "shards")
    assert again.returncode == 0 and "already prepared" in again.stdout


def test_text_split_is_deterministic_and_by_document(tmp_path, corpus):
    folder, texts = corpus
    moved = tmp_path / "elsewhere" / "notes"
    shutil.copytree(folder, moved)
    for src, out in ((folder, "o1"), (moved, "o2")):
        assert run("text", src, "--out", tmp_path / out, "--val_frac", "0.5", "--name", "mine").returncode == 0
    files = sorted(os.listdir(tmp_path / "o1" / "mine"))
    assert files == sorted(os.listdir(tmp_path / "o2" / "mine"))
    for f in files:
        if f.endswith(".bin"):
            assert (tmp_path / "o1" / "mine" / f).read_bytes() == (tmp_path / "o2" / "mine" / f).read_bytes()
    # the rule itself: whole documents in sha1(id) order while they fit, then the tail of the longest train doc
    sizes, ids = [50, 400, 30, 300], ["a", "b", "c", "d"]
    train, val, tail = prepare.split_documents(sizes, ids, 80)
    assert val == [0, 2] and tail is None and train == [1, 3]  # 50 + 30 fill 80 exactly
    train, val, tail = prepare.split_documents(sizes, ids, 100)
    assert sum(sizes[i] for i in val) + tail[1] == 100 and tail[0] == 1 and 1 in train
    assert prepare.split_documents([500], ["only"], 100) == ([0], [], (0, 100))  # one document: split inside it


def test_text_jsonl_and_files_with_name(tmp_path, corpus):
    folder, _ = corpus
    r = run("text", folder / "a.txt", folder / "c.jsonl", "--name", "interval", "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "9/9 docs" in r.stderr  # a.txt and the eight lines of c.jsonl
    # `interval` holds "val": the shard names must still split right
    assert [os.path.basename(f) for f in find_shards("interval", "train", str(tmp_path))] == \
        ["interval_train_000001.bin"]
    assert [os.path.basename(f) for f in find_shards("interval", "val", str(tmp_path))] == ["interval_val_000000.bin"]


@pytest.mark.parametrize("case", ["missing", "empty", "tiny", "not_json", "no_text", "no_files", "not_utf8",
                                  "bad_name"])
def test_text_errors_are_one_line(tmp_path, case):
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "data.csv").write_text("a,b\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "tiny.txt").write_text("hello world")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n\n{"text": "also fine"}\n{"text": oops}\n')
    (tmp_path / "notext.jsonl").write_text('{"text": "fine"}\n{"body": "x"}\n')
    (tmp_path / "latin.txt").write_bytes("café".encode("latin-1"))
    path, parts = {
        "missing": ("nope.txt", ["nope.txt: no such file or directory"]),
        "empty": ("empty.txt", ["empty.txt: empty file"]),
        "tiny": ("tiny.txt", ["tiny.txt: too small: 3 tokens", "at least 2,050"]),
        "not_json": ("bad.jsonl", ["bad.jsonl:4: not JSON"]),
        "no_text": ("notext.jsonl", ['notext.jsonl:2: no "text" field']),
        "no_files": ("folder", ["folder: no *.txt, *.md, *.jsonl files"]),
        "not_utf8": ("latin.txt", ["latin.txt: not UTF-8 text"]),
        "bad_name": ("tiny.txt", ["--name 'my data'"]),
    }[case]
    extra = ["--name", "my data"] if case == "bad_name" else []
    r = run("text", path, "--out", tmp_path / "shards", *extra, cwd=tmp_path)
    line = one_line_error(r, *parts)
    assert "--val_tokens" not in line
    assert not (tmp_path / "shards").exists()  # nothing written


def test_empty_and_tiny_builtin_dataset(tmp_path):
    """Not only `text`: a broken or tiny shakespeare source names the file, not an option the user never passed."""
    mirror = tmp_path / "mirror"
    (mirror / "text").mkdir(parents=True)
    src = mirror / "text" / "tinyshakespeare.txt"
    src.write_text("")
    one_line_error(run("shakespeare", "--mirror", mirror, "--out", tmp_path), f"{src}: empty file")
    src.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    line = one_line_error(run("shakespeare", "--mirror", mirror, "--out", tmp_path), f"{src}: too small")
    assert "--val_tokens" not in line


def test_unknown_dataset_points_to_text(tmp_path):
    one_line_error(run("mybooks", "--out", tmp_path), "unknown dataset 'mybooks'",
                   "python data/prepare.py text PATH [PATH ...] --name mybooks")

# ----------------------------------------------------------------------------------------------------------------
# no network


def test_no_network_fails_fast_with_mirror_hint(tmp_path):
    (tmp_path / "mirror").mkdir()
    t0 = time.time()
    r = run("fineweb10B", "--num_shards", "1", "--out", tmp_path, "--mirror", tmp_path / "mirror",
            "--hf_endpoint", "http://127.0.0.1:9")  # port 9 (discard): nothing listens, the connection is refused
    assert time.time() - t0 < 10
    url = "http://127.0.0.1:9/datasets/kjj0/fineweb10B-gpt2/resolve/main/fineweb_val_000000.bin"
    line = one_line_error(r, f"could not fetch {url}", "connection refused", "--mirror DIR", "NANOPARA_MIRROR=DIR",
                          "DIR/fineweb10B/fineweb_val_000000.bin")
    assert ".part" not in line  # nothing was downloaded, so there is nothing to resume
    assert "retry 2/2" in r.stderr and "retry 3/" not in r.stderr
    assert not os.path.exists(tmp_path / "fineweb10B" / "fineweb_val_000000.bin.part")


def test_unresolvable_host_retries_briefly(tmp_path, monkeypatch):
    sleeps = []
    monkeypatch.setattr(prepare.time, "sleep", sleeps.append)

    def offline(req, timeout=None):
        raise urllib.error.URLError(socket.gaierror(-2, "Name or service not known"))
    with pytest.raises(prepare.DownloadError, match=r"could not fetch https://x/f\.bin after 3 tries: its host name "
                                                    r"cannot be resolved") as e:
        prepare.download("https://x/f.bin", str(tmp_path / "f.bin"), opener=offline)
    assert sleeps == [0.5, 1.0] and "\n" not in str(e.value)
