"""Tuned kernel choices kept on disk, so that a process compiles only the chosen config of each tuned kernel.

An entry maps (GPU name, tuner, source hash, tuning key) -> the choice. The tuner is "module:attribute" of an
`@triton.autotune`d kernel (choice: its Config's kwargs, num_warps, num_stages, num_ctas, maxnreg) or of a custom
tuner such as kernels/attention_hopper.py's forward (choice: a CONFIGS entry). The source hash covers the kernel's
source, every @jit function and constant it reaches, the candidates and the Triton version: an edited kernel is
tuned anew, a kernel moved in its file is not. The tuning key is what the tuner keys on (the autotuner's key values
and argument dtypes: e.g. attention's length and batch*heads buckets).
Two places are read: kernels/tuned/<gpu slug>.json (shipped, measured on that GPU, read-only) and the user cache
$XDG_CACHE_HOME/nanopara/tuned.json (default ~/.cache/nanopara/tuned.json), which wins where both hold a key. A new
tuning is merged into the user cache under an exclusive lock and written to a temporary file renamed over it, so
processes tuning at once (the ranks of one torchrun) all keep their entries. An unreadable file is ignored with a
warning; an entry whose source hash is not the current one is never used.
`compile_parallel` compiles a tuning's candidates on threads before they are timed one by one: Triton releases the
GIL in its MLIR and LLVM passes and runs ptxas as a subprocess, so ~80% of a compile overlaps with the others.
Callers: kernels/launch.py (every autotuned kernel launched through `fast()`), kernels/attention_hopper.py (the
forward's own tuner). Under TRITON_INTERPRET=1 the default store is off; tests pass `Store(path=tmp_path / ...)`.
Run: `python -m kernels.tuning --show` lists entries; `--export [--gpu NAME] [--out DIR]` writes this GPU's current
entries of the user cache to kernels/tuned/<slug>.json.
"""
import argparse
import contextlib
import fcntl
import hashlib
import importlib
import inspect
import json
import os
import re
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")
# compiles in flight while a tuning's candidates are built: the cores this process may use, at most 16
COMPILE_THREADS = min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
STATS = {"tuned": 0, "tune_s": 0.0, "from_store": 0}  # this process: tunings run, their seconds, choices read
TUNINGS = []  # this process: (what was tuned, seconds), in order (bench/cold_start.py prints them)
_NESTED = [0]  # tunings in progress (nested: the Gluon forward's timing may tune the Triton forward inside it)


def default_path() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "nanopara", "tuned.json")


def slug(gpu: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3': the shipped table's file name."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")


def _canon(key):
    """The JSON form of a tuning key (tuples become lists, dtypes strings), the same written and read back."""
    return json.loads(json.dumps(list(key), default=str))


def _entry_id(gpu, tuner, source, key) -> str:
    return json.dumps([gpu, tuner, source, _canon(key)])


# ---------------------------------------------------------------------------------------------------------------
# The files: {"format": 1, "entries": [one JSON object a line]}
# ---------------------------------------------------------------------------------------------------------------

_WARNED = set()


def _read(path) -> dict:
    """{entry id: entry} of a store file; {} if it is missing, and {} with a warning (once) if it is unreadable."""
    try:
        with open(path) as f:
            data = json.load(f)
        return {_entry_id(e["gpu"], e["tuner"], e["source"], e["key"]): e for e in data["entries"]}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        if path not in _WARNED:
            _WARNED.add(path)
            warnings.warn(f"nanopara: ignoring the tuning store {path} ({type(e).__name__}: {e}); kernels are tuned "
                          f"anew and the file is rewritten", stacklevel=2)
        return {}


def _write(path, entries: dict) -> None:
    """Atomically: a temporary file in the same directory, renamed over path (readers see the old or the new)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    lines = [json.dumps(e, sort_keys=True) for _, e in sorted(entries.items())]
    tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    try:
        with open(tmp, "w") as f:
            f.write('{"format": 1, "entries": [\n' + ",\n".join(lines) + "\n]}\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _merge_into(path, new: dict) -> None:
    """Add entries to a store file: read, merge and replace under an exclusive lock, so two writers never drop each
    other's entries."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the lock file is closed
        _write(path, {**_read(path), **new})


class Store:
    """The entries of the shipped tables (`shipped`: a directory, or None for none) and the user cache (`path`,
    default `default_path()` at first use), loaded once; `put` adds to both the loaded view and the user file."""

    def __init__(self, path=None, shipped=SHIPPED_DIR, enabled=True):
        self.path, self.shipped, self.enabled = path, shipped, enabled
        self._index = None

    def file(self) -> str:
        return str(self.path) if self.path else default_path()

    def _load(self) -> dict:
        if self._index is None:
            self._index = {}
            if self.shipped and os.path.isdir(self.shipped):
                for name in sorted(os.listdir(self.shipped)):
                    if name.endswith(".json"):
                        self._index.update(_read(os.path.join(self.shipped, name)))
            self._index.update(_read(self.file()))
        return self._index

    def get(self, gpu, tuner, source, key):
        """The stored choice, or None."""
        if not self.enabled:
            return None
        e = self._load().get(_entry_id(gpu, tuner, source, key))
        return None if e is None else e["choice"]

    def put(self, gpu, tuner, source, key, choice) -> None:
        if not self.enabled:
            return
        e = dict(gpu=gpu, tuner=tuner, source=source, key=_canon(key), choice=json.loads(json.dumps(choice)),
                 triton=_triton_version())
        eid = _entry_id(gpu, tuner, source, key)
        self._load()[eid] = e
        try:
            _merge_into(self.file(), {eid: e})
        except OSError as err:  # a read-only home: the choice still holds for this process
            warnings.warn(f"nanopara: could not write the tuning store {self.file()}: {err}", stacklevel=2)


STORE = Store(enabled=not _INTERPRET)


# ---------------------------------------------------------------------------------------------------------------
# What a tuner is keyed on: the GPU, and the source of what it tunes
# ---------------------------------------------------------------------------------------------------------------

_GPU = {}


def gpu_name() -> str:
    """The current CUDA device's name (the interpreter: a name no GPU has)."""
    if _INTERPRET:
        return "triton-interpreter"
    import torch
    dev = torch.cuda.current_device()
    if dev not in _GPU:
        _GPU[dev] = torch.cuda.get_device_name(dev)
    return _GPU[dev]


def _triton_version() -> str:
    import triton
    return triton.__version__


def _pyfunc(obj):
    """The Python function behind a Triton @jit function (compiled, Gluon or interpreted), else None."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITCallable
    fn = getattr(obj, "fn", None)
    return fn if isinstance(obj, (JITCallable, InterpretedFunction)) and inspect.isfunction(fn) else None


def source_hash(fn, extra=()) -> str:
    """Hash of a @jit function's source from its `def` (decorators and line numbers do not count), of every @jit
    function and scalar constant its source names, recursively, of `extra` (the candidates) and the Triton version."""
    h = hashlib.sha256(_triton_version().encode())
    seen = set()

    def visit(f):
        py = _pyfunc(f)
        if py is None or py in seen:
            return
        seen.add(py)
        src = inspect.getsource(py)
        src = src[re.search(r"^[ \t]*def\s", src, re.MULTILINE).start():]
        h.update(src.encode())
        for name in sorted(set(re.findall(r"[A-Za-z_]\w*", src))):
            g = py.__globals__.get(name)
            if _pyfunc(g) is not None:
                visit(g)
            elif isinstance(g, (bool, int, float, str)) or type(g).__name__ == "constexpr":
                h.update(f"{name}={g!r};".encode())
    visit(fn)
    h.update(repr(extra).encode())
    return h.hexdigest()[:16]


def config_record(cfg) -> dict:
    """A triton.Config as stored: what the autotuner passes to the JIT when it launches that config."""
    return {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "num_ctas": cfg.num_ctas, "maxnreg": cfg.maxnreg}


class Tuner:
    """One tuned kernel's view of the store (`STORE`, read at each call, so tests can swap it): its name, its source
    hash (computed at first use), get / put by tuning key on the current GPU, and the message while it tunes."""

    def __init__(self, name, fn, candidates):
        self.name, self.fn, self.candidates = name, fn, candidates
        self._source = None

    @classmethod
    def of(cls, autotuner):
        base = autotuner.base_fn
        return cls(f"{base.__module__}:{base.__name__}", autotuner.fn, [str(c) for c in autotuner.configs])

    @property
    def source(self) -> str:
        if self._source is None:
            self._source = source_hash(self.fn, self.candidates)
        return self._source

    def get(self, key):
        choice = STORE.get(gpu_name(), self.name, self.source, key)
        if choice is not None:
            STATS["from_store"] += 1
        return choice

    def put(self, key, choice) -> None:
        STORE.put(gpu_name(), self.name, self.source, key, choice)

    @contextlib.contextmanager
    def tuning(self, what):
        """Around a tuning: the one-line message (rank 0), and its count and seconds in STATS (seconds of the
        outermost tuning only: the Gluon forward's times the Triton forward, which may tune inside it)."""
        if os.environ.get("RANK", "0") == "0":
            print(f"nanopara: tuning {what} - first run on this GPU only", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        _NESTED[0] += 1
        try:
            yield
        finally:
            _NESTED[0] -= 1
        seconds = time.perf_counter() - t0
        STATS["tuned"] += 1
        STATS["tune_s"] += 0.0 if _NESTED[0] else seconds
        TUNINGS.append((what, seconds))


def compile_parallel(jit, calls) -> None:
    """Compile `jit` for each (grid, args, kwargs) of calls without launching, COMPILE_THREADS at a time, through
    Triton's AsyncCompileMode (the JIT's own compile step on a thread pool; the binaries enter the JIT's cache when
    the block ends), so the launches that follow find them compiled. A failed compile is left to that launch,
    which fails (or is skipped by the autotuner) exactly as it would have."""
    from triton import AsyncCompileMode
    from triton.runtime._async_compile import active_mode
    if len(calls) < 2 or COMPILE_THREADS < 2 or active_mode.get() is not None:
        return
    with ThreadPoolExecutor(min(COMPILE_THREADS, len(calls))) as pool, AsyncCompileMode(pool, ignore_errors=True):
        for grid, args, kwargs in calls:
            try:
                jit.warmup(*args, grid=grid, **kwargs)
            except Exception:  # noqa: BLE001  (see above)
                pass


# ---------------------------------------------------------------------------------------------------------------
# CLI: python -m kernels.tuning --show | --export
# ---------------------------------------------------------------------------------------------------------------

_CURRENT = {}


def current_source(tuner_name):
    """The source hash a tuner has in this checkout ("module:attribute" of an autotuned kernel or of a Tuner), or
    None if it no longer exists."""
    if tuner_name not in _CURRENT:
        from triton.runtime.autotuner import Autotuner
        try:
            module, attr = tuner_name.split(":")
            obj = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError):
            obj = None
        _CURRENT[tuner_name] = (Tuner.of(obj).source if isinstance(obj, Autotuner) else
                                obj.source if isinstance(obj, Tuner) else None)
    return _CURRENT[tuner_name]


def export(gpu, out_dir=SHIPPED_DIR, cache=None):
    """Write `gpu`'s current entries (the table already in out_dir, then the user cache over it) to
    out_dir/<slug>.json. Returns (path, entries written, stale entries left out)."""
    path = os.path.join(out_dir, slug(gpu) + ".json")
    mine = {i: e for i, e in {**_read(path), **_read(cache or default_path())}.items() if e["gpu"] == gpu}
    keep = {i: e for i, e in mine.items() if current_source(e["tuner"]) == e["source"]}
    _write(path, keep)
    return path, len(keep), len(mine) - len(keep)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--show", action="store_true", help="list the entries of the user cache and shipped tables")
    what.add_argument("--export", action="store_true", help="write GPU's current entries to OUT/<gpu slug>.json")
    ap.add_argument("--gpu", help="GPU name (default: this machine's CUDA device; --show: every GPU)")
    ap.add_argument("--cache", help="user cache file (default: $XDG_CACHE_HOME/nanopara/tuned.json)")
    ap.add_argument("--out", default=SHIPPED_DIR, help="--export: directory of the table (default kernels/tuned)")
    args = ap.parse_args(argv)
    if args.show:
        files = [args.cache or default_path()] + sorted(
            os.path.join(SHIPPED_DIR, n) for n in (os.listdir(SHIPPED_DIR) if os.path.isdir(SHIPPED_DIR) else [])
            if n.endswith(".json"))
        for f in files:
            entries = [e for e in _read(f).values() if args.gpu in (None, e["gpu"])]
            print(f"# {f}: {len(entries)} entries")
            for e in sorted(entries, key=lambda e: (e["gpu"], e["tuner"], json.dumps(e["key"]))):
                stale = "" if current_source(e["tuner"]) == e["source"] else "  (stale: source changed)"
                print(f"{e['gpu']} | {e['tuner']} | {e['key']} -> {e['choice']}{stale}")
        return
    gpu = args.gpu
    if gpu is None:
        import torch
        if not torch.cuda.is_available():
            raise SystemExit("--export: no CUDA device here; name the GPU with --gpu")
        gpu = torch.cuda.get_device_name()
    path, n, stale = export(gpu, args.out, args.cache)
    print(f"wrote {n} entries for {gpu} to {path}" + (f" ({stale} stale left out)" if stale else ""))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # also run as a script
    from kernels import tuning  # the module the kernels import: its Tuner objects are the ones to recognise
    tuning.main()
