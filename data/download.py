"""Downloads for data/prepare.py: one file over HTTP with retries; a pre-tokenized shard from the mirror or the web.

download(url, dest): fetches into dest.part, resuming a partial .part with an HTTP Range request, then renames it to
dest. Resets, timeouts and short reads retry with exponential backoff; a host that cannot be resolved or refuses
the connection fails after ~1.5 s ("its host name cannot be resolved (no network?)", "connection refused"); 401,
403, 404 and 410 fail at once. Failures raise DownloadError, whose str() is one line naming the URL and why.
fetch_shard(...): one llm.c-layout .bin shard into out_dir: kept if present and valid, else copied from the mirror
(<mirror>/<NAME>/<file>, then <mirror>/<file>), else downloaded from a Hugging Face dataset repo (--hf_endpoint).
Its DownloadError says how to use a local copy instead (--mirror DIR or NANOPARA_MIRROR=DIR).
Progress: the one-line stderr progress display, also used by prepare.py while tokenizing.
Called by prepare.py (shakespeare, fineweb10B, fineweb-edu10B), which puts the repo root on sys.path for nanopara.
Tests: tests/test_data.py (resume, retries, mirror), tests/test_prepare.py (no network).
"""
import http.client
import os
import shutil
import socket
import sys
import time
import urllib.error
import urllib.request

from nanopara.data import read_header

HF_PATH = "/datasets/{repo}/resolve/main/{file}"


def _human(n):
    return f"{n:,}" if n < 10_000 else f"{n / 1e3:.1f}k" if n < 1e6 else f"{n / 1e6:.1f}M" if n < 1e9 else \
        f"{n / 1e9:.2f}G"


class Progress:
    """One `\\r`-rewritten stderr line, at most every 0.5 s (no tqdm dependency); counts units, and documents."""

    def __init__(self, label, total=None, unit="", docs=None):
        self.label, self.total, self.unit, self.docs = label, total, unit, docs
        self.n = self.d = 0
        self.t0 = self.last = time.time()

    def update(self, n, docs=0, force=False):
        self.n += n
        self.d += docs
        now = time.time()
        if force or now - self.last > 0.5:
            self.last = now
            line = f"{_human(self.n)}{' / ' + _human(self.total) if self.total else ''} {self.unit}"
            if self.docs is not None:
                line += f", {self.d:,}/{self.docs:,} docs"
            frac = self.n / self.total if self.total else self.d / self.docs if self.docs else None
            pct = f" ({100 * frac:.0f}%)" if frac is not None else ""
            sys.stderr.write(f"\r{self.label}: {line}{pct}, {now - self.t0:.0f} s   ")
            sys.stderr.flush()

    def done(self):
        self.update(0, force=True)
        sys.stderr.write("\n")


class DownloadError(Exception):
    """A URL or shard that could not be fetched; str() names it and why, in one line."""


def _reason(e):
    """(why, kind) of a failed request: kind 'gone' (never retry), 'unreachable' (retry briefly) or 'transient'."""
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}", "gone" if e.code in (401, 403, 404, 410) else "transient"
    r = getattr(e, "reason", e)  # URLError wraps the socket error
    if isinstance(r, socket.gaierror):
        return "its host name cannot be resolved (no network?)", "unreachable"
    if isinstance(r, ConnectionRefusedError):
        return "connection refused", "unreachable"
    if isinstance(r, FileNotFoundError):
        return "no such file", "gone"
    if isinstance(r, OSError) and getattr(r, "errno", None) in (101, 113):  # ENETUNREACH, EHOSTUNREACH
        return "network unreachable", "unreachable"
    return f"{type(r).__name__}: {r}", "transient"


def download(url, dest, opener=None, retries=5, backoff=2.0, chunk=1 << 20, quick_retries=2):
    """Fetch url into dest through dest.part, resuming a partial .part with an HTTP Range request; rename at the end.
    Resets, timeouts and short reads retry `retries` times with exponential backoff; an unresolvable or refusing
    host only `quick_retries` times within ~1.5 s. `opener(request, timeout=...)` defaults to urlopen (tests fake
    it). Raises DownloadError."""
    opener = opener or urllib.request.urlopen
    part, attempt = dest + ".part", 0
    while True:
        have = os.path.getsize(part) if os.path.exists(part) else 0
        req = urllib.request.Request(url, headers={"User-Agent": "nanopara-prepare"})
        if have:
            req.add_header("Range", f"bytes={have}-")
        progress = None
        try:
            with opener(req, timeout=60) as resp:
                status = getattr(resp, "status", None) or 200  # file:// responses carry no status
                if have and status == 206:  # server honoured the range: append
                    mode, total = "ab", int(resp.headers["Content-Range"].rsplit("/", 1)[1])
                else:  # fresh download, or the server ignored the range: start over
                    mode, have = "wb", 0
                    total = int(resp.headers["Content-Length"]) if resp.headers.get("Content-Length") else None
                progress = Progress(os.path.basename(dest), total, "bytes")
                progress.n = have
                with open(part, mode) as f:
                    while block := resp.read(chunk):
                        f.write(block)
                        progress.update(len(block))
                progress.done()
                progress = None
            if total is not None and os.path.getsize(part) != total:
                raise http.client.IncompleteRead(b"", total - os.path.getsize(part))
            os.replace(part, dest)
            return dest
        except (OSError, http.client.HTTPException) as e:  # URLError/HTTPError are OSErrors
            if progress is not None:
                sys.stderr.write("\n")  # end the half-written progress line
            if isinstance(e, urllib.error.HTTPError) and e.code == 416 and have:  # .part already holds it all
                os.replace(part, dest)
                return dest
            why, kind = _reason(e)
        limit = {"gone": 0, "unreachable": quick_retries, "transient": retries}[kind]
        if attempt >= limit:
            resume = (f"; rerun to resume the {os.path.getsize(part):,} bytes in {part}"
                      if os.path.exists(part) and os.path.getsize(part) else "")
            tries = f" after {attempt + 1} tries" if attempt else ""
            raise DownloadError(f"could not fetch {url}{tries}: {why}{resume}")
        attempt += 1
        wait = 0.5 * 2 ** (attempt - 1) if kind == "unreachable" else min(backoff * 2 ** (attempt - 1), 60)
        print(f"{os.path.basename(dest)}: {why}; retry {attempt}/{limit} in {wait:.1f} s", file=sys.stderr)
        time.sleep(wait)


def fetch_shard(file, repo, name, out_dir, mirror, opener=None, endpoint="https://huggingface.co"):
    """One pre-tokenized shard into out_dir: skip if present and valid, else copy from the mirror, else download.
    Raises DownloadError (with the local-copy hint) if it cannot be had, or if what came is not a valid shard."""
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
    candidates = [os.path.join(mirror, d, file) for d in (name, "")] if mirror else []
    local = next((p for p in candidates if os.path.isfile(p)), None)
    if local:
        shutil.copyfile(local, dest + ".part")
        os.replace(dest + ".part", dest)
    else:
        try:
            download(endpoint.rstrip("/") + HF_PATH.format(repo=repo, file=file), dest, opener)
        except DownloadError as e:
            looked = f" (not in the mirror {mirror} either)" if mirror else ""
            raise DownloadError(f"{e}{looked}. To use a local copy: put the shards in a folder as DIR/{name}/{file} "
                                f"(or DIR/{file}) and pass --mirror DIR or set NANOPARA_MIRROR=DIR") from None
    try:
        read_header(dest)
    except ValueError as e:
        os.remove(dest)
        raise DownloadError(f"{e} (removed; source: {local or repo})") from None
    return dest

