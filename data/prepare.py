"""Prepare GPT-2 token shards: python data/prepare.py NAME [--mirror DIR] [--out data/shards] [--val_tokens N]

Writes llm.c-layout `.bin` shards (see nanopara/data.py) into <out>/<NAME>/, which `--data.dataset=NAME` finds.

  shakespeare      tinyshakespeare (338k tokens): <mirror>/text/tinyshakespeare.txt, else karpathy/char-rnn on
                   GitHub. One document, prefixed by EOT; val = the first 10% of tokens (or --val_tokens).
  books            the offline corpus <mirror>/text/*.jsonl.xz + tinyshakespeare (43.2M tokens, 4,456 documents;
                   ~15 s on 2 cores). Every document is prefixed by EOT (50256), as llm.c does. Document order is
                   sha1(source/id): fixed, and it interleaves the sources. Val = the first documents of that order
                   up to --val_tokens (default 500k), skipping any document longer than val_tokens/8 so that no
                   single book fills val; everything else is train.
  fineweb10B       pre-tokenized GPT-2 shards of FineWeb sample-10BT used by modded-nanogpt, from the Hugging Face
                   dataset kjj0/fineweb10B-gpt2: fineweb_val_000000.bin + fineweb_train_000001..000103.bin,
                   100M tokens each (~200 MB). --num_shards N downloads only the first N train shards.
  fineweb-edu10B   the same for FineWeb-Edu sample-10BT: kjj0/finewebedu10B-gpt2, finewebedu_{val,train}_*.bin
                   (99 train shards). Downloaded shards keep their upstream names; they hold `train`/`val`.

Outputs: <NAME>_val_000000.bin and <NAME>_train_000001.bin, ... (--shard_tokens per file, default 100M), plus
manifest.json (settings, shards, token counts). A finished dataset is skipped (idempotent); --force redoes it.
Downloads look in the mirror first (<mirror>/<NAME>/<file>, then <mirror>/<file>), then fetch over HTTP into
<file>.part with HTTP Range, so an interrupted download resumes where it stopped; the file is renamed when complete
and its header and size are checked.

Mirror: --mirror DIR, default env NANOPARA_MIRROR, else ../shared/data beside the repo when it exists (the offline
data bundle; it also holds tiktoken_cache/ for the tokenizer).
Tests: tests/test_data.py (shakespeare from the mirror, books reader on a synthetic corpus, resumable download).
"""
import argparse
import hashlib
import http.client
import json
import lzma
import multiprocessing as mp
import os
import shutil
import sys
import time
import urllib.error
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere
from nanopara.data import EOT, REPO_ROOT, default_mirror, get_tokenizer, read_header, write_shard  # noqa: E402

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
HF_URL = "https://huggingface.co/datasets/{repo}/resolve/main/{file}"
REMOTE = {  # name -> (Hugging Face dataset repo, file prefix, number of train shards upstream)
    "fineweb10B": ("kjj0/fineweb10B-gpt2", "fineweb", 103),
    "fineweb-edu10B": ("kjj0/finewebedu10B-gpt2", "finewebedu", 99),
}


class Progress:
    """One `\\r`-rewritten stderr line, at most every 0.5 s (no tqdm dependency)."""

    def __init__(self, label, total=None, unit=""):
        self.label, self.total, self.unit, self.n = label, total, unit, 0
        self.t0 = self.last = time.time()

    def update(self, n, force=False):
        self.n += n
        now = time.time()
        if force or now - self.last > 0.5:
            self.last = now
            pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
            of = f" / {self.total / 1e6:.1f}M" if self.total else ""
            sys.stderr.write(f"\r{self.label}: {self.n / 1e6:.1f}M{of} {self.unit}{pct}, {now - self.t0:.0f} s   ")
            sys.stderr.flush()

    def done(self):
        self.update(0, force=True)
        sys.stderr.write("\n")

# ----------------------------------------------------------------------------------------------------------------
# text corpora -> shards


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
        raise FileNotFoundError(f"books needs the offline corpus {text_dir}/*.jsonl.xz: pass --mirror DIR (the "
                                f"data bundle, e.g. ../shared/data) or set NANOPARA_MIRROR")
    docs = [(d["source"], d["id"], d["text"]) for f in files for d in read_jsonl_xz(os.path.join(text_dir, f))]
    shakespeare = os.path.join(text_dir, "tinyshakespeare.txt")
    if os.path.isfile(shakespeare):
        with open(shakespeare, encoding="utf-8") as f:
            docs.append(("tinyshakespeare", "input.txt", f.read()))
    docs.sort(key=lambda d: hashlib.sha1(f"{d[0]}/{d[1]}".encode()).hexdigest())
    return [text for _, _, text in docs]


_ENC = None


def _encode_doc(text):
    """Worker: EOT + GPT-2 tokens of one document, as uint16."""
    global _ENC
    if _ENC is None:
        _ENC = get_tokenizer()
    return np.array([EOT] + _ENC.encode_ordinary(text), dtype=np.uint16)


class ShardWriter:
    """Cuts a stream of token arrays into <dir>/<name>_train_%06d.bin files of `shard_tokens` tokens each."""

    def __init__(self, out_dir, name, shard_tokens):
        self.out_dir, self.name, self.shard_tokens = out_dir, name, shard_tokens
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
        path = os.path.join(self.out_dir, f"{self.name}_train_{len(self.written) + 1:06d}.bin")
        write_shard(path, tokens)
        self.written.append((os.path.basename(path), len(tokens)))


def _done(out_dir, settings):
    """True if a manifest with these settings and all its shards exist; error if made with other settings."""
    path = os.path.join(out_dir, "manifest.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        manifest = json.load(f)
    if manifest["settings"] != settings:
        raise SystemExit(f"{out_dir} was prepared with {manifest['settings']}, not {settings}; "
                         f"pass --force to redo it")
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
    progress = Progress(f"{name} tokenizing {len(docs):,} docs", settings["chars"], "chars")
    with mp.Pool(procs) as pool:
        for text, tokens in zip(docs, pool.imap(_encode_doc, docs, chunksize=8)):
            if n_val < val_tokens and len(tokens) <= cap:
                val.append(tokens)
                n_val += len(tokens)
            else:
                train.add(tokens)
            progress.update(len(text))
    progress.done()
    if n_val == 0:
        raise SystemExit(f"{name}: no document is short enough for val (<= val_tokens/8 = {cap} tokens); "
                         f"raise --val_tokens")
    val_file = f"{name}_val_000000.bin"
    write_shard(os.path.join(out_dir, val_file), np.concatenate(val) if val else np.zeros(0, np.uint16))
    shards = [(val_file, n_val)] + train.close()
    _write_manifest(out_dir, name, settings, shards, time.time() - t0)


def prepare_shakespeare(out_dir, mirror, val_tokens=None, force=False, opener=None):
    """tinyshakespeare as one EOT-prefixed document; val = its first val_tokens (default 10%) tokens."""
    settings = {"val_tokens": val_tokens}
    if not force and _done(out_dir, settings):
        print(f"shakespeare: already prepared in {out_dir} (--force to redo)")
        return
    t0 = time.time()
    local = os.path.join(mirror, "text", "tinyshakespeare.txt") if mirror else None
    if local and os.path.isfile(local):
        with open(local, encoding="utf-8") as f:
            text = f.read()
    else:
        with (opener or urllib.request.urlopen)(SHAKESPEARE_URL, timeout=60) as resp:
            text = resp.read().decode("utf-8")
    tokens = np.array([EOT] + get_tokenizer().encode_ordinary(text), dtype=np.uint16)
    n_val = len(tokens) // 10 if val_tokens is None else val_tokens
    if not 0 < n_val < len(tokens):
        raise SystemExit(f"--val_tokens must be in (0, {len(tokens)}) for shakespeare, got {n_val}")
    shards = [("shakespeare_val_000000.bin", n_val), ("shakespeare_train_000001.bin", len(tokens) - n_val)]
    write_shard(os.path.join(out_dir, shards[0][0]), tokens[:n_val])
    write_shard(os.path.join(out_dir, shards[1][0]), tokens[n_val:])
    _write_manifest(out_dir, "shakespeare", settings, shards, time.time() - t0)

# ----------------------------------------------------------------------------------------------------------------
# downloads of pre-tokenized shards


def download(url, dest, opener=None, retries=5, backoff=2.0, chunk=1 << 20):
    """Fetch url into dest through dest.part, resuming a partial .part with an HTTP Range request; rename at the end.
    `opener(request, timeout=...)` defaults to urllib.request.urlopen (tests pass a fake server)."""
    opener = opener or urllib.request.urlopen
    part, err = dest + ".part", None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(min(backoff * 2 ** (attempt - 1), 60))
        have = os.path.getsize(part) if os.path.exists(part) else 0
        req = urllib.request.Request(url, headers={"User-Agent": "nanopara-prepare"})
        if have:
            req.add_header("Range", f"bytes={have}-")
        try:
            with opener(req, timeout=60) as resp:
                status = getattr(resp, "status", None) or 200  # file:// responses carry no status
                if have and status == 206:  # server honoured the range: append
                    mode, total = "ab", int(resp.headers["Content-Range"].rsplit("/", 1)[1])
                else:  # fresh download, or the server ignored the range: start over
                    mode, have = "wb", 0
                    total = int(resp.headers["Content-Length"]) if resp.headers.get("Content-Length") else None
                progress = Progress(f"{os.path.basename(dest)}", total, "bytes")
                progress.n = have
                with open(part, mode) as f:
                    while block := resp.read(chunk):
                        f.write(block)
                        progress.update(len(block))
                progress.done()
            if total is not None and os.path.getsize(part) != total:
                raise http.client.IncompleteRead(b"", total - os.path.getsize(part))
            os.replace(part, dest)
            return dest
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:  # .part already holds the whole file
                os.replace(part, dest)
                return dest
            if e.code in (401, 403, 404):
                raise RuntimeError(f"download of {url} failed: HTTP {e.code} {e.reason}") from None
            err = e
        except (OSError, http.client.HTTPException) as e:  # URLError, resets, timeouts, short reads: resume
            err = e
        print(f"\n{os.path.basename(dest)}: {type(err).__name__}: {err}; retry {attempt + 1}/{retries}",
              file=sys.stderr)
    raise RuntimeError(f"download of {url} failed after {retries} retries ({err}); rerun to resume from {part}")


def fetch_shard(file, repo, name, out_dir, mirror, opener=None):
    """One pre-tokenized shard into out_dir: skip if present and valid, else copy from the mirror, else download."""
    dest = os.path.join(out_dir, file)
    try:
        read_header(dest)
        return dest
    except FileNotFoundError:
        pass
    except ValueError as e:
        print(f"{e}; fetching it again", file=sys.stderr)
        os.remove(dest)
    os.makedirs(out_dir, exist_ok=True)
    local = [os.path.join(mirror, d, file) for d in (name, "")] if mirror else []
    local = next((p for p in local if os.path.isfile(p)), None)
    if local:
        shutil.copyfile(local, dest + ".part")
        os.replace(dest + ".part", dest)
    else:
        download(HF_URL.format(repo=repo, file=file), dest, opener)
    try:
        read_header(dest)
    except ValueError as e:
        os.remove(dest)
        raise RuntimeError(f"{e} (removed; source: {local or repo})") from None
    return dest


def prepare_remote(name, out_dir, mirror, num_shards=None, opener=None):
    repo, prefix, upstream = REMOTE[name]
    n = upstream if num_shards is None else num_shards
    if not 1 <= n <= upstream:
        raise SystemExit(f"--num_shards must be in [1, {upstream}] for {name}, got {n}")
    files = [f"{prefix}_val_000000.bin"] + [f"{prefix}_train_{i:06d}.bin" for i in range(1, n + 1)]
    for i, file in enumerate(files):
        print(f"{name}: [{i + 1}/{len(files)}] {file}")
        fetch_shard(file, repo, name, out_dir, mirror, opener)
    print(f"{name}: {len(files)} shards in {out_dir}")

# ----------------------------------------------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("name", choices=["shakespeare", "books", *REMOTE])
    p.add_argument("--mirror", default=None, help="offline data bundle (default: $NANOPARA_MIRROR or ../shared/data)")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "data", "shards"))
    p.add_argument("--val_tokens", type=int, default=None, help="shakespeare: 10%% of tokens; books: 500000")
    p.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per train shard (books)")
    p.add_argument("--num_shards", type=int, default=None, help="train shards to download (fineweb: all)")
    p.add_argument("--procs", type=int, default=os.cpu_count(), help="tokenizer processes (books)")
    p.add_argument("--force", action="store_true", help="redo a dataset that is already prepared")
    a = p.parse_args(argv)
    mirror = a.mirror or default_mirror()
    if a.mirror and not os.path.isdir(a.mirror):
        raise SystemExit(f"--mirror {a.mirror} is not a directory")
    out_dir = os.path.join(a.out, a.name)
    if a.name == "shakespeare":
        prepare_shakespeare(out_dir, mirror, a.val_tokens, a.force)
    elif a.name == "books":
        if not mirror:
            raise SystemExit("books needs the offline corpus: pass --mirror DIR (e.g. ../shared/data) or set "
                             "NANOPARA_MIRROR")
        docs = books_documents(mirror)
        prepare_docs("books", docs, out_dir, a.val_tokens or 500_000, a.shard_tokens, a.procs, a.force)
    else:
        prepare_remote(a.name, out_dir, mirror, a.num_shards)


if __name__ == "__main__":
    main()
