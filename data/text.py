"""Your own text for `python data/prepare.py text PATH [PATH ...]`: find the files, read and check them, pick val.

Input: .txt/.md files (one document each, CRLF read as LF), .jsonl files (one document per line, from its "text"
field; blank lines skipped) or folders (their *.txt, *.md, *.jsonl, recursively, hidden entries skipped, in sorted
order). A file named twice counts once; empty files in a folder are skipped, an empty file named directly is an
error. Everything is read and checked before any tokenizing, so a bad line deep in a big file fails at once, as a
PrepareError naming file:line (not UTF-8, not JSON, no "text" field, "text" not a string).
Split: val = val_frac of the tokens, at least MIN_SPLIT_TOKENS for each split: whole documents in sha1(file:line)
order while they fit, topped up with the end of the longest train document. Train keeps the input order.
Called by prepare.py (prepare_text tokenizes, splits with split_documents and writes the shards); PrepareError, the
one-line user error, lives here as the first module prepare.py imports. Tests: tests/test_prepare.py.
"""
import hashlib
import json
import math
import os
import sys

TEXT_SUFFIXES = (".txt", ".md", ".jsonl")
MIN_SPLIT_TOKENS = 8 * 128 + 1  # one batch of the tiny preset (micro_batch 8 x seq_len 128, + 1 target), per split


class PrepareError(Exception):
    """A problem with the user's input or environment: prepare.py's main() prints it as one line, exit code 2."""


# your own text -> shards


def text_files(paths):
    """[(path, id, explicit)] of every input file: PATHs that are files, and each folder's *.txt/*.md/*.jsonl
    (recursively, hidden entries skipped, sorted). `id` (name within the folder) seeds the val pick."""
    files, seen = [], set()
    for p in paths:
        if not os.path.exists(p):
            raise PrepareError(f"{p}: no such file or directory")
        if os.path.isdir(p):
            found = []
            for root, dirs, names in os.walk(p):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                found += [os.path.join(root, n) for n in names if n.endswith(TEXT_SUFFIXES) and not n.startswith(".")]
            if not found:
                raise PrepareError(f"{p}: no {', '.join('*' + s for s in TEXT_SUFFIXES)} files in this folder "
                                   f"(searched recursively)")
            top = os.path.basename(os.path.abspath(p))
            entries = sorted((os.path.relpath(f, p).replace(os.sep, "/"), f) for f in found)
            files += [(f, f"{top}/{rel}", False) for rel, f in entries]
        else:
            files.append((p, os.path.basename(p), True))
    unique = []
    for f in files:  # a file named twice (itself and through its folder) counts once
        if os.path.realpath(f[0]) not in seen:
            seen.add(os.path.realpath(f[0]))
            unique.append(f)
    return unique


def decode_text(raw, where):
    """raw bytes as UTF-8 text (a BOM dropped); not UTF-8 is a PrepareError naming `where`."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise PrepareError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start}); convert it first, e.g. "
                           f"`iconv -f latin1 -t utf-8`") from None


def read_documents(path):
    """Yield (line, text) of one file's non-blank documents: a .jsonl's `text` fields, else the whole file (line 0)."""
    if path.endswith(".jsonl"):
        with open(path, "rb") as f:
            for i, raw in enumerate(f, 1):
                line = decode_text(raw, f"{path}:{i}").strip()
                if not line:
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise PrepareError(f"{path}:{i}: not JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(obj, dict) or "text" not in obj:
                    raise PrepareError(f'{path}:{i}: no "text" field (each line must be an object like '
                                       f'{{"text": "..."}})')
                if not isinstance(obj["text"], str):
                    raise PrepareError(f'{path}:{i}: "text" is {type(obj["text"]).__name__}, not a string')
                if obj["text"].strip():
                    yield i, obj["text"]
    else:
        with open(path, "rb") as f:
            text = decode_text(f.read(), path).replace("\r\n", "\n")
        if text.strip():
            yield 0, text


def scan_text(name, paths):
    """Read and check every input file: (files, docs, chars, used). docs = [(path, line, id)] of each non-blank
    document, chars = their total length, used = [[file id, bytes]] of the non-empty files (the dataset's settings)."""
    files = text_files(paths)
    docs, chars, used = [], 0, []
    for path, fid, explicit in files:
        n = len(docs)
        for line, text in read_documents(path):
            docs.append((path, line, f"{fid}:{line}"))
            chars += len(text)
        if len(docs) > n:
            used.append([fid, os.path.getsize(path)])
        elif explicit:
            raise PrepareError(f"{path}: empty file (no text to train on)")
        else:
            print(f"{name}: skipping empty file {path}", file=sys.stderr)
    if not docs:
        raise PrepareError(f"{', '.join(paths)}: no usable text (every file in it is empty)")
    return files, docs, chars, used


def read_texts(files):
    """Yield the text of every document of files (from scan_text), in order."""
    for path, _, _ in files:
        for _, text in read_documents(path):
            yield text


def val_target(total, val_frac, paths):
    """Tokens for val out of `total`; a PrepareError if train and val cannot both get MIN_SPLIT_TOKENS."""
    target = max(MIN_SPLIT_TOKENS, math.ceil(val_frac * total))
    if total < target + MIN_SPLIT_TOKENS:
        why = (f"{MIN_SPLIT_TOKENS:,} each for train and val" if target == MIN_SPLIT_TOKENS else
               f"{target:,} for val at --val_frac {val_frac} and {MIN_SPLIT_TOKENS:,} for train")
        raise PrepareError(f"{', '.join(paths)}: too small: {total:,} tokens, a train and a val split need at "
                           f"least {target + MIN_SPLIT_TOKENS:,} ({why})")
    return target


def split_documents(sizes, ids, target):
    """Pick val for a list of documents: (train indices, val indices, tail). Val takes whole documents in sha1(id)
    order while they fit in `target` tokens; if it is still short, tail = (j, k): the last k tokens of the longest
    train document j go to val. Every skipped document is longer than what val still lacks, so j keeps a head."""
    order = sorted(range(len(sizes)), key=lambda i: hashlib.sha1(ids[i].encode()).hexdigest())
    val, n_val = set(), 0
    for i in order:
        if n_val >= target:
            break
        if n_val + sizes[i] <= target:
            val.add(i)
            n_val += sizes[i]
    train = [i for i in range(len(sizes)) if i not in val]
    tail = None
    if n_val < target:
        j = max(train, key=lambda i: sizes[i])  # the first of the longest: deterministic
        tail = (j, target - n_val)
    return train, sorted(val), tail
