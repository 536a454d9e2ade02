"""Prepare GPT-2 token shards: python data/prepare.py NAME [options]  or  python data/prepare.py text PATH [PATH ...]

Writes llm.c-layout `.bin` shards (nanopara/data.py) and manifest.json into <out>/<NAME>/ (default data/shards),
where `--data.dataset=NAME` finds them. Every document is prefixed by EOT (50256), as in llm.c.
  text PATH...     your own text: files, folders, .jsonl (reading, checks and the val pick: data/text.py); --name
                   NAME (default: the first PATH's stem), --val_frac (default 0.1). Holds the tokens in memory.
  sft FILE.jsonl.. supervised fine-tuning examples, one JSON object a line: {"prompt", "response"} or {"messages":
                   [{"role": system|user|assistant, "content"}]}; template, packing and masks: nanopara/sft.py.
                   Examples packed into rows of --seq_len tokens (default 1024; train with a multiple of it) and a
                   .mask file beside each shard; --val_jsonl FILE, else a seeded --val_frac of the examples.
  shakespeare      tinyshakespeare (338k tokens) from <mirror>/text/tinyshakespeare.txt, else GitHub; one document;
                   val = its first 10% of tokens (or --val_tokens).
  books            the offline corpus <mirror>/text/*.jsonl.xz + tinyshakespeare (43.2M tokens, 4,456 documents,
                   ~15 s on 2 cores), in sha1(source/id) order; val = the first documents up to --val_tokens
                   (default 500k), skipping any longer than val_tokens/8 so that no single book fills val.
  fineweb10B       modded-nanogpt's pre-tokenized FineWeb sample-10BT (Hugging Face kjj0/fineweb10B-gpt2; val + 103
  fineweb-edu10B   train shards of 100M tokens) and FineWeb-Edu (kjj0/finewebedu10B-gpt2, 99); --num_shards N.
<mirror>: --mirror DIR, else env NANOPARA_MIRROR, else ../shared/data beside the repo. Downloads (data/download.py)
look there first, then use HTTP (--hf_endpoint, default env HF_ENDPOINT or huggingface.co).
Shards: <NAME>_val_000000.bin, <NAME>_train_000001.bin, ... (--shard_tokens each, default 100M). A finished dataset
is skipped; one made from other settings or input is an error unless --force. Errors a user can cause (bad input,
no network) are one line naming the file or URL, exit code 2, before the long work starts.
Called by the Makefile (make data, make sft) or by hand. Tests: tests/test_data.py, tests/test_prepare.py,
tests/test_sft.py.
"""
import argparse
import hashlib
import json
import lzma
import multiprocessing as mp
import os
import re
import sys
import tempfile
import time

import numpy as np

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(DATA_DIR))  # the repo root, for nanopara: run as a script from anywhere
sys.path.insert(0, DATA_DIR)  # for text.py and download.py beside this file (data/ is a folder, not a package)
from download import DownloadError, Progress, download, fetch_shard  # noqa: E402
from nanopara.data import (DATASETS, EOT, REPO_ROOT, default_mirror, get_tokenizer, read_header,  # noqa: E402
                           write_shard)
from nanopara import sft  # noqa: E402
from nanopara.data import mask_path, write_mask  # noqa: E402
from text import (MIN_SPLIT_TOKENS, PrepareError, decode_text, read_texts, scan_text, split_documents,  # noqa: E402
                  val_target)

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
REMOTE = {  # name -> (Hugging Face dataset repo, file prefix, number of train shards upstream)
    "fineweb10B": ("kjj0/fineweb10B-gpt2", "fineweb", 103),
    "fineweb-edu10B": ("kjj0/finewebedu10B-gpt2", "finewebedu", 99),
}

# ----------------------------------------------------------------------------------------------------------------
# shard writing shared by every tokenized dataset


class ShardWriter:
    """Cuts a stream of token arrays into <dir>/<name>_<split>_%06d.bin files of `shard_tokens` tokens each."""

    def __init__(self, out_dir, name, shard_tokens, split="train", first=1):
        self.out_dir, self.name, self.shard_tokens, self.split, self.first = out_dir, name, shard_tokens, split, first
        self.chunks, self.count, self.written = [], 0, []

    def add(self, tokens):
        self.chunks.append(tokens)
        self.count += len(tokens)
        while self.count >= self.shard_tokens:
            buf = np.concatenate(self.chunks)
            self._write(buf[:self.shard_tokens])  # a document may continue in the next shard, as in llm.c
            self.chunks, self.count = [buf[self.shard_tokens:]], len(buf) - self.shard_tokens

    def close(self):
        if self.count:
            self._write(np.concatenate(self.chunks))
        return self.written

    def _write(self, tokens):
        path = os.path.join(self.out_dir, f"{self.name}_{self.split}_{self.first + len(self.written):06d}.bin")
        write_shard(path, tokens)
        self.written.append((os.path.basename(path), len(tokens)))


def _done(out_dir, settings, redo_hint="pass --force to redo it"):
    """True if a manifest with these settings and all its shards exist; error if made with other settings."""
    path = os.path.join(out_dir, "manifest.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        manifest = json.load(f)
    old = manifest.get("settings", {})
    if old != settings:
        differ = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        raise PrepareError(f"{out_dir} was prepared with other settings ({', '.join(differ)} differ); {redo_hint}")
    try:
        return all(read_header(os.path.join(out_dir, s["file"])) == s["tokens"] for s in manifest["shards"])
    except (OSError, ValueError):
        return False  # a shard is missing or damaged: redo


def _write_manifest(out_dir, name, settings, shards, seconds):
    """Record what was made, and remove shards of an earlier run (e.g. --force with fewer shards) not remade now."""
    keep = {f for f, _ in shards}
    for f in os.listdir(out_dir):
        if f.startswith(f"{name}_") and f.endswith(".bin") and f not in keep:
            os.remove(os.path.join(out_dir, f))
    manifest = {"dataset": name, "settings": settings, "seconds": round(seconds, 1),
                "tokens": sum(n for _, n in shards), "shards": [{"file": f, "tokens": n} for f, n in shards]}
    tmp = os.path.join(out_dir, "manifest.json.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "manifest.json"))
    for f, n in shards:
        print(f"  {f}: {n:,} tokens")


_ENC = None


def _encode_doc(text):
    """Worker: EOT + GPT-2 tokens of one document, as uint16."""
    global _ENC
    if _ENC is None:
        _ENC = get_tokenizer()
    return np.array([EOT] + _ENC.encode_ordinary(text), dtype=np.uint16)


def _encode_all(texts, procs, chars):
    """Yield _encode_doc of each text in order; in this process when the input is small (a pool costs ~1 s)."""
    if procs <= 1 or chars < 2_000_000:
        yield from map(_encode_doc, texts)
        return
    with mp.Pool(procs) as pool:
        yield from pool.imap(_encode_doc, texts, chunksize=16)

# ----------------------------------------------------------------------------------------------------------------
# your own text -> shards


def prepare_text(name, paths, out_dir, val_frac=0.1, shard_tokens=100_000_000, procs=1, force=False,
                 train_flag=None):
    """Tokenize your own text files into val + train shards (reading, checks and the val pick: data/text.py)."""
    files, docs, chars, used = scan_text(name, paths)  # every file read and checked before any tokenizing
    settings = {"files": used, "val_frac": val_frac, "shard_tokens": shard_tokens}
    flag = train_flag or f"--data.dataset={name}"
    if not force and _done(out_dir, settings, "pass --force to replace it, or --name NEW for a new dataset"):
        print(f"{name}: already prepared in {out_dir} (--force to redo); train on it with: python train.py {flag}")
        return

    t0 = time.time()
    progress = Progress(f"{name}: tokenizing", unit="tokens", docs=len(docs))
    toks = []
    for tokens in _encode_all(read_texts(files), procs, chars):
        toks.append(tokens)
        progress.update(len(tokens), docs=1)
    progress.done()
    sizes = [len(t) for t in toks]
    total = sum(sizes)
    target = val_target(total, val_frac, paths)

    # split, then write val (a cut tail first, then whole documents) and train (input order)
    train_idx, val_idx, tail = split_documents(sizes, [d[2] for d in docs], target)
    val = ShardWriter(out_dir, name, shard_tokens, "val", first=0)
    if tail:
        j, k = tail
        val.add(toks[j][-k:])
        toks[j] = toks[j][:-k]
    for i in val_idx:
        val.add(toks[i])
    train = ShardWriter(out_dir, name, shard_tokens, "train", first=1)
    for i in train_idx:
        train.add(toks[i])
    shards = val.close() + train.close()
    _write_manifest(out_dir, name, settings, shards, time.time() - t0)
    n_val = sum(n for f, n in shards if f.startswith(f"{name}_val_"))
    cut = f" (+ the last {tail[1]:,} tokens of {docs[tail[0]][0]})" if tail else ""
    n_docs = {k: f"{len(v):,} doc{'s' * (len(v) != 1)}" for k, v in (("train", train_idx), ("val", val_idx))}
    print(f"{name}: train {n_docs['train']}, {total - n_val:,} tokens; val {n_docs['val']}{cut}, {n_val:,} tokens; "
          f"in {out_dir}")
    print(f"train on it with: python train.py {flag}")

# ----------------------------------------------------------------------------------------------------------------
# supervised fine-tuning examples -> packed shards + loss masks


def _sft_examples(paths):
    """[(where, tokens, mask)] of every line of the JSONL files, all read and checked before any is written."""
    enc = get_tokenizer()
    try:
        return [(where, *sft.encode(enc, msgs)) for path in paths for where, msgs in sft.read_jsonl(path)]
    except sft.SFTError as e:
        raise PrepareError(str(e)) from None


def _sft_split(out_dir, name, split, examples, seq_len, one_per_row, shard_tokens, first):
    """Pack one split's examples and write its shards (whole rows + the closing token) and masks."""
    tokens, mask, skipped = sft.pack([(t, m) for _, t, m in examples], seq_len, one_per_row)
    if skipped:
        print(f"{name} {split}: skipped {len(skipped)} example(s) longer than --seq_len {seq_len} tokens, the first "
              f"at {examples[skipped[0]][0]}")
    rows = (len(tokens) - 1) // seq_len
    if rows == 0:
        raise PrepareError(f"{name}: no {split} example fits in --seq_len {seq_len} tokens")
    per = max(1, shard_tokens // seq_len)  # rows per shard: a shard never cuts a row
    shards = []
    for k, lo in enumerate(range(0, rows, per)):
        hi = min(rows, lo + per)
        path = os.path.join(out_dir, f"{name}_{split}_{first + k:06d}.bin")
        write_shard(path, tokens[lo * seq_len: hi * seq_len + 1])  # + the token after: the last row's closing EOT
        write_mask(mask_path(path), mask[lo * seq_len: hi * seq_len + 1], seq_len)
        shards.append((os.path.basename(path), (hi - lo) * seq_len + 1))
    trained = int(mask[:-1].sum())
    print(f"{name} {split}: {len(examples) - len(skipped):,} examples in {rows:,} rows of {seq_len} tokens "
          f"({trained:,} trained targets, {trained / (rows * seq_len):.1%} of the tokens)")
    return shards


def prepare_sft(name, paths, out_dir, seq_len=1024, val_jsonl=None, val_frac=0.1, one_per_row=False,
                shard_tokens=100_000_000, force=False, flag=None):
    """Tokenize JSONL prompt/response or chat examples into packed, loss-masked val + train shards."""
    files = [os.path.abspath(p) for p in paths] + ([os.path.abspath(val_jsonl)] if val_jsonl else [])
    for f in files:
        if not os.path.isfile(f):
            raise PrepareError(f"{f}: no such file (sft takes .jsonl files)")
    settings = {"files": [[f, os.path.getsize(f), os.path.getmtime(f)] for f in files], "seq_len": seq_len,
                "val_jsonl": bool(val_jsonl), "val_frac": None if val_jsonl else val_frac,
                "one_per_row": one_per_row, "shard_tokens": shard_tokens}
    flag = flag or f"--data.dataset={name}"
    if not force and _done(out_dir, settings, "pass --force to replace it, or --name NEW for a new dataset") and \
            all(os.path.isfile(mask_path(os.path.join(out_dir, f))) for f in os.listdir(out_dir) if f.endswith(".bin")):
        print(f"{name}: already prepared in {out_dir} (--force to redo); fine-tune on it with: python train.py {flag}")
        return
    t0 = time.time()
    train = _sft_examples(paths)
    if val_jsonl:
        val = _sft_examples([val_jsonl])
    else:  # a seeded pick, so input sorted by difficulty or source still gives a representative val
        n_val = max(1, round(len(train) * val_frac))
        if len(train) < 2:
            raise PrepareError(f"{name}: {len(train)} example(s): a train and a val split need at least 2 (or pass "
                               f"--val_jsonl FILE)")
        is_val = np.zeros(len(train), dtype=bool)
        is_val[np.random.default_rng(0).permutation(len(train))[:n_val]] = True
        train, val = [e for e, v in zip(train, is_val) if not v], [e for e, v in zip(train, is_val) if v]
    os.makedirs(out_dir, exist_ok=True)
    shards = _sft_split(out_dir, name, "val", val, seq_len, one_per_row, shard_tokens, 0)
    shards += _sft_split(out_dir, name, "train", train, seq_len, one_per_row, shard_tokens, 1)
    keep = {f for f, _ in shards}
    for f in os.listdir(out_dir):  # masks of shards an earlier run made and this one did not (bins: the manifest)
        if f.startswith(f"{name}_") and f.endswith(".mask") and f[:-5] + ".bin" not in keep:
            os.remove(os.path.join(out_dir, f))
    _write_manifest(out_dir, name, settings, shards, time.time() - t0)
    print(f"fine-tune on it with: python train.py {flag} --train.seq_len={seq_len} --ckpt.init_from=RUN_OR_GPT2_BIN")

# ----------------------------------------------------------------------------------------------------------------
# built-in text corpora -> shards


def read_jsonl_xz(path):
    """Yield the {"source", "id", "text"} documents of one xz-compressed JSONL file, in file order."""
    with lzma.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def books_documents(mirror):
    """Every document of <mirror>/text (*.jsonl.xz and tinyshakespeare.txt) as texts, in sha1(source/id) order."""
    text_dir = os.path.join(mirror, "text")
    files = sorted(f for f in os.listdir(text_dir) if f.endswith(".jsonl.xz")) if os.path.isdir(text_dir) else []
    if not files:
        raise PrepareError(f"books needs the offline corpus {text_dir}/*.jsonl.xz: pass --mirror DIR (the data "
                           f"bundle, e.g. ../shared/data) or set NANOPARA_MIRROR=DIR")
    docs = [(d["source"], d["id"], d["text"]) for f in files for d in read_jsonl_xz(os.path.join(text_dir, f))]
    shakespeare = os.path.join(text_dir, "tinyshakespeare.txt")
    if os.path.isfile(shakespeare):
        with open(shakespeare, encoding="utf-8") as f:
            docs.append(("tinyshakespeare", "input.txt", f.read()))
    docs.sort(key=lambda d: hashlib.sha1(f"{d[0]}/{d[1]}".encode()).hexdigest())
    return [text for _, _, text in docs]


def prepare_docs(name, docs, out_dir, val_tokens, shard_tokens, procs, force=False):
    """Tokenize documents (in order) into val + train shards; val = first docs up to val_tokens (see docstring)."""
    settings = {"val_tokens": val_tokens, "shard_tokens": shard_tokens, "documents": len(docs),
                "chars": sum(len(d) for d in docs)}
    if not force and _done(out_dir, settings):
        print(f"{name}: already prepared in {out_dir} (--force to redo)")
        return
    t0 = time.time()
    cap = max(1, val_tokens // 8)  # longest document val accepts, so val mixes at least ~8 documents
    val, n_val, train = [], 0, ShardWriter(out_dir, name, shard_tokens)
    progress = Progress(f"{name}: tokenizing", settings["chars"], "chars", docs=len(docs))
    for text, tokens in zip(docs, _encode_all(docs, procs, settings["chars"])):
        if n_val < val_tokens and len(tokens) <= cap:
            val.append(tokens)
            n_val += len(tokens)
        else:
            train.add(tokens)
        progress.update(len(text), docs=1)
    progress.done()
    if n_val == 0:
        raise PrepareError(f"{name}: no document is short enough for val (at most --val_tokens/8 = {cap:,} tokens, "
                           f"--val_tokens is {val_tokens:,}); raise --val_tokens")
    if train.count + len(train.written) == 0:
        raise PrepareError(f"{name}: every document went to val ({n_val:,} tokens); lower --val_tokens")
    val_file = f"{name}_val_000000.bin"
    write_shard(os.path.join(out_dir, val_file), np.concatenate(val))
    shards = [(val_file, n_val)] + train.close()
    _write_manifest(out_dir, name, settings, shards, time.time() - t0)


def prepare_shakespeare(out_dir, mirror, val_tokens=None, force=False, opener=None):
    """tinyshakespeare as one EOT-prefixed document; val = its first val_tokens (default 10%) tokens."""
    settings = {"val_tokens": val_tokens}
    if not force and _done(out_dir, settings):
        print(f"shakespeare: already prepared in {out_dir} (--force to redo)")
        return
    t0 = time.time()
    source = os.path.join(mirror, "text", "tinyshakespeare.txt") if mirror else None
    if not (source and os.path.isfile(source)):
        os.makedirs(out_dir, exist_ok=True)
        source = os.path.join(out_dir, "tinyshakespeare.txt")
        if not os.path.isfile(source):
            try:
                download(SHAKESPEARE_URL, source, opener)
            except DownloadError as e:
                raise PrepareError(f"{e}. To use a local copy: save that file as DIR/text/tinyshakespeare.txt and "
                                   f"pass --mirror DIR or set NANOPARA_MIRROR=DIR") from None
    with open(source, "rb") as f:
        text = decode_text(f.read(), source)
    if not text.strip():
        raise PrepareError(f"{source}: empty file (no text to train on)")
    tokens = np.array([EOT] + get_tokenizer().encode_ordinary(text), dtype=np.uint16)
    if val_tokens is not None and not 0 < val_tokens < len(tokens):
        raise PrepareError(f"--val_tokens must be in (0, {len(tokens):,}) for shakespeare ({source} has "
                           f"{len(tokens):,} tokens), got {val_tokens:,}")
    if val_tokens is None and len(tokens) < 2 * MIN_SPLIT_TOKENS:
        raise PrepareError(f"{source}: too small: {len(tokens):,} tokens, a train and a val split need at least "
                           f"{2 * MIN_SPLIT_TOKENS:,} ({MIN_SPLIT_TOKENS:,} each)")
    n_val = max(len(tokens) // 10, MIN_SPLIT_TOKENS) if val_tokens is None else val_tokens
    shards = [("shakespeare_val_000000.bin", n_val), ("shakespeare_train_000001.bin", len(tokens) - n_val)]
    write_shard(os.path.join(out_dir, shards[0][0]), tokens[:n_val])
    write_shard(os.path.join(out_dir, shards[1][0]), tokens[n_val:])
    _write_manifest(out_dir, "shakespeare", settings, shards, time.time() - t0)

# ----------------------------------------------------------------------------------------------------------------
# pre-tokenized shards, fetched by data/download.py


def prepare_remote(name, out_dir, mirror, num_shards=None, opener=None, endpoint="https://huggingface.co"):
    """The val shard and the first num_shards train shards (default: all) of a REMOTE dataset, named as upstream."""
    repo, prefix, upstream = REMOTE[name]
    n = upstream if num_shards is None else num_shards
    if not 1 <= n <= upstream:
        raise PrepareError(f"--num_shards must be in [1, {upstream}] for {name}, got {n}")
    files = [f"{prefix}_val_000000.bin"] + [f"{prefix}_train_{i:06d}.bin" for i in range(1, n + 1)]
    for i, file in enumerate(files):
        print(f"{name}: [{i + 1}/{len(files)}] {file}")
        try:
            fetch_shard(file, repo, name, out_dir, mirror, opener, endpoint)
        except DownloadError as e:
            raise PrepareError(str(e)) from None
    print(f"{name}: {len(files)} shards in {out_dir}")

# ----------------------------------------------------------------------------------------------------------------


def _dataset_name(a):
    """--name, or the first PATH's stem made safe for a folder name; checked so that --data.dataset=NAME finds it."""
    given = a.dataset_name is not None
    name = a.dataset_name if given else re.sub(r"[^A-Za-z0-9._-]+", "_",
                                               os.path.splitext(os.path.basename(os.path.abspath(a.paths[0])))[0])
    what = f"--name {name!r}" if given else f"the name {name!r} taken from {a.paths[0]} (pass --name NAME)"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name) or name.endswith(".bin"):
        raise PrepareError(f"{what}: use letters, digits, '.', '_' and '-' (it becomes the folder "
                           f"data/shards/NAME and --data.dataset=NAME)")
    if name in DATASETS or name == "text":
        raise PrepareError(f"{what} is a built-in dataset; pick another name")
    return name


def run(a):
    if a.name not in ("text", "sft", "shakespeare", "books", *REMOTE):
        raise PrepareError(f"unknown dataset {a.name!r}: choose text, sft, {', '.join(DATASETS)}; for your own text: "
                           f"python data/prepare.py text PATH [PATH ...] --name {a.name}")
    if a.name == "text" and not a.paths:
        raise PrepareError("text needs at least one PATH: a text file, a .jsonl file or a folder")
    if a.name == "sft" and not a.paths:
        raise PrepareError("sft needs at least one PATH: a .jsonl file of {prompt, response} or {messages} lines")
    if a.name != "sft" and (a.val_jsonl or a.no_pack or a.seq_len != 1024):
        raise PrepareError("--val_jsonl, --no_pack and --seq_len apply to sft only")
    if a.name not in ("text", "sft") and a.paths:
        raise PrepareError(f"{a.name} takes no PATH (got {' '.join(a.paths)}); for your own text: "
                           f"python data/prepare.py text PATH ...")
    for key, ok in (("val_tokens", a.val_tokens is None or a.val_tokens >= 1), ("shard_tokens", a.shard_tokens >= 1),
                    ("procs", a.procs >= 1), ("val_frac", 0 < a.val_frac < 1), ("seq_len", a.seq_len >= 2)):
        if not ok:
            raise PrepareError(f"--{key} must be {'in (0, 1)' if key == 'val_frac' else '>= 1'}, got "
                               f"{getattr(a, key)}")
    if a.mirror and not os.path.isdir(a.mirror):
        raise PrepareError(f"--mirror {a.mirror} is not a directory")
    mirror = a.mirror or default_mirror()
    name = _dataset_name(a) if a.name in ("text", "sft") else a.name
    out_dir = os.path.join(a.out, name)
    parent = os.path.abspath(out_dir)
    while not os.path.exists(parent):  # the nearest existing folder must be a writable folder
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise PrepareError(f"--out {a.out}: cannot write {out_dir} ({parent} is not a folder)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".prepare-check-", dir=parent))
    except OSError as e:
        raise PrepareError(f"--out {a.out}: cannot write {out_dir} ({parent}: {e.strerror})") from None
    if a.name in ("text", "sft", "shakespeare", "books"):
        try:
            get_tokenizer()  # fails now, offline without a tokenizer cache, not after reading the input
        except RuntimeError as e:
            raise PrepareError(str(e)) from None
    default_out = os.path.realpath(os.path.join(REPO_ROOT, "data", "shards"))
    flag = f"--data.dataset={name}" + ("" if os.path.realpath(a.out) == default_out else
                                       f" --data.data_dir={os.path.abspath(a.out)}")
    if a.name == "text":
        prepare_text(name, a.paths, out_dir, a.val_frac, a.shard_tokens, a.procs, a.force, flag)
    elif a.name == "sft":
        prepare_sft(name, a.paths, out_dir, a.seq_len, a.val_jsonl, a.val_frac, a.no_pack, a.shard_tokens,
                    a.force, flag)
    elif a.name == "shakespeare":
        prepare_shakespeare(out_dir, mirror, a.val_tokens, a.force)
    elif a.name == "books":
        if not mirror:
            raise PrepareError("books needs the offline corpus: pass --mirror DIR (e.g. ../shared/data) or set "
                               "NANOPARA_MIRROR=DIR")
        docs = books_documents(mirror)
        prepare_docs("books", docs, out_dir, a.val_tokens or 500_000, a.shard_tokens, a.procs, a.force)
    else:
        prepare_remote(a.name, out_dir, mirror, a.num_shards, endpoint=a.hf_endpoint)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("name", help=f"text, sft, or a built-in dataset: {', '.join(DATASETS)}")
    p.add_argument("paths", nargs="*", metavar="PATH", help="text: files, folders or .jsonl files; sft: .jsonl files")
    p.add_argument("--name", dest="dataset_name", default=None,
                   help="text, sft: dataset name (default: first PATH's stem)")
    p.add_argument("--val_frac", type=float, default=0.1,
                   help="text: share of tokens for val; sft: share of examples (default 0.1)")
    p.add_argument("--val_jsonl", default=None, help="sft: the val examples (default: --val_frac of PATH's)")
    p.add_argument("--seq_len", type=int, default=1024, help="sft: row length examples are packed into (1024)")
    p.add_argument("--no_pack", action="store_true", help="sft: one example per row (isolated, more padding)")
    p.add_argument("--mirror", default=None, help="offline data bundle (default: $NANOPARA_MIRROR or ../shared/data)")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "data", "shards"))
    p.add_argument("--val_tokens", type=int, default=None, help="shakespeare: 10%% of tokens; books: 500000")
    p.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per train shard (text, books)")
    p.add_argument("--num_shards", type=int, default=None, help="train shards to download (fineweb: all)")
    p.add_argument("--hf_endpoint", default=os.environ.get("HF_ENDPOINT") or "https://huggingface.co",
                   help="Hugging Face host for downloads (default: $HF_ENDPOINT or https://huggingface.co)")
    p.add_argument("--procs", type=int, default=os.cpu_count(), help="tokenizer processes (text, books)")
    p.add_argument("--force", action="store_true", help="redo a dataset that is already prepared")
    a = p.parse_intermixed_args(argv)
    try:
        run(a)
    except (PrepareError, OSError) as e:  # OSError here: the disk is full, a file vanished or is not readable
        msg = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else e
        print(f"prepare.py: error: {msg}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
