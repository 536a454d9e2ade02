"""kernels/tuning.py: the store of tuned choices (round trip, two writers, corrupt files, source and GPU keys,
shipped tables, export). FastKernel's use of it: tests/test_launch.py."""
import json
import multiprocessing

import pytest
import triton
import triton.language as tl

from kernels import tuning

KEY = (True, 64, False, 1024, 512, "torch.bfloat16")
CFG = {"kwargs": {"BLOCK_M": 128, "BLOCK_N": 64}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}


def test_round_trip(tmp_path):
    path = tmp_path / "tuned.json"
    tuning.Store(path=path, shipped=None).put("GPU A", "m:k", "src1", KEY, CFG)
    assert tuning.Store(path=path, shipped=None).get("GPU A", "m:k", "src1", KEY) == CFG
    assert tuning.Store(path=path, shipped=None).get("GPU A", "m:k", "src1", KEY[:-1] + ("torch.float16",)) is None
    assert tuning.Store(path=path, shipped=None).get("GPU A", "m:k", "src1", list(KEY)) == CFG  # tuple or list
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 1 and entries[0]["choice"] == CFG and entries[0]["key"] == list(KEY)
    # a Gluon-tuner choice: a CONFIGS tuple comes back as a list, "triton" as itself
    s = tuning.Store(path=path, shipped=None)
    s.put("GPU A", "m:t", "src1", (64, True, 1024, 512), (128, 4, True))
    s.put("GPU A", "m:t", "src1", (128, True, 1024, 512), "triton")
    fresh = tuning.Store(path=path, shipped=None)
    assert fresh.get("GPU A", "m:t", "src1", (64, True, 1024, 512)) == [128, 4, True]
    assert fresh.get("GPU A", "m:t", "src1", (128, True, 1024, 512)) == "triton"


def test_two_writers_keep_both_entries(tmp_path):
    path = tmp_path / "tuned.json"
    a, b = tuning.Store(path=path, shipped=None), tuning.Store(path=path, shipped=None)
    a.get("GPU A", "m:k", "s", KEY)  # both loaded the empty file before either wrote
    b.get("GPU A", "m:k", "s", KEY)
    a.put("GPU A", "m:k", "s", (1,), CFG)
    b.put("GPU A", "m:k", "s", (2,), CFG)
    fresh = tuning.Store(path=path, shipped=None)
    assert fresh.get("GPU A", "m:k", "s", (1,)) == CFG and fresh.get("GPU A", "m:k", "s", (2,)) == CFG


def _writer(path, first):
    s = tuning.Store(path=path, shipped=None)
    for i in range(first, first + 25):
        s.put("GPU A", "m:k", "s", (i,), CFG)


def test_processes_writing_at_once_lose_nothing(tmp_path):
    """Four processes (as the ranks of one torchrun tune together) each add 25 entries to the same file."""
    path = str(tmp_path / "tuned.json")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, 100 * p)) for p in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    fresh = tuning.Store(path=path, shipped=None)
    assert all(fresh.get("GPU A", "m:k", "s", (100 * p + i,)) == CFG for p in range(4) for i in range(25))
    assert len(json.loads(open(path).read())["entries"]) == 100


def test_corrupt_file_is_ignored_with_a_warning_then_rewritten(tmp_path):
    path = tmp_path / "tuned.json"
    path.write_text('{"format": 1, "entries": [{"gpu": "GPU A", "tun')  # a torn write from an older tool
    tuning._WARNED.discard(str(path))
    with pytest.warns(UserWarning, match="ignoring the tuning store"):
        assert tuning.Store(path=path, shipped=None).get("GPU A", "m:k", "s", KEY) is None
    tuning.Store(path=path, shipped=None).put("GPU A", "m:k", "s", KEY, CFG)
    assert tuning.Store(path=path, shipped=None).get("GPU A", "m:k", "s", KEY) == CFG


def test_gpu_names_and_sources_are_separate_keys(tmp_path):
    s = tuning.Store(path=tmp_path / "tuned.json", shipped=None)
    s.put("NVIDIA H100 80GB HBM3", "m:k", "src1", KEY, CFG)
    assert s.get("NVIDIA H200", "m:k", "src1", KEY) is None
    assert s.get("NVIDIA H100 80GB HBM3", "m:k", "src2", KEY) is None  # the kernel changed: tune anew
    assert s.get("NVIDIA H100 80GB HBM3", "m:other", "src1", KEY) is None


def test_shipped_table_is_read_and_the_user_cache_wins(tmp_path):
    shipped = tmp_path / "tuned"
    other = dict(CFG, num_warps=8)
    tuning._write(str(shipped / "nvidia-h100.json"), {"x": dict(gpu="NVIDIA H100", tuner="m:k", source="s",
                                                                 key=list(KEY), choice=CFG)})
    user = tmp_path / "user.json"
    assert tuning.Store(path=user, shipped=str(shipped)).get("NVIDIA H100", "m:k", "s", KEY) == CFG
    assert tuning.Store(path=user, shipped=None).get("NVIDIA H100", "m:k", "s", KEY) is None  # table switched off
    tuning.Store(path=user, shipped=None).put("NVIDIA H100", "m:k", "s", KEY, other)
    assert tuning.Store(path=user, shipped=str(shipped)).get("NVIDIA H100", "m:k", "s", KEY) == other
    assert tuning.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_disabled_store_reads_and_writes_nothing(tmp_path):
    s = tuning.Store(path=tmp_path / "tuned.json", shipped=None, enabled=False)
    s.put("GPU A", "m:k", "s", KEY, CFG)
    assert s.get("GPU A", "m:k", "s", KEY) is None and not (tmp_path / "tuned.json").exists()
    assert tuning.STORE.enabled != tuning._INTERPRET  # CPU tests (the interpreter) never touch the user's cache


# ---------------------------------------------------------------------------------------------------------------
# Source hashes: a kernel, what it calls, its candidates


@triton.jit
def _helper(x):
    return x + 1


@triton.jit
def _other_helper(x):
    return x + 2


@triton.jit
def _kernel(OUT, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(OUT + offs, _helper(offs))


def test_source_hash_follows_called_functions_and_candidates(monkeypatch):
    h = tuning.source_hash(_kernel)
    assert h == tuning.source_hash(_kernel) and h != tuning.source_hash(_helper)
    assert tuning.source_hash(_kernel, ["BLOCK_M: 64"]) != tuning.source_hash(_kernel, ["BLOCK_M: 128"])
    monkeypatch.setitem(tuning._pyfunc(_kernel).__globals__, "_helper", _other_helper)  # an edited helper
    assert tuning.source_hash(_kernel) != h


def test_export_writes_this_gpus_current_entries(tmp_path, monkeypatch):
    cache, out = tmp_path / "user.json", tmp_path / "tuned"
    s = tuning.Store(path=cache, shipped=None)
    s.put("NVIDIA H100", "m:k", "now", (1,), CFG)
    s.put("NVIDIA H100", "m:k", "old", (2,), CFG)  # tuned before the kernel changed
    s.put("NVIDIA H200", "m:k", "now", (1,), CFG)
    monkeypatch.setitem(tuning._CURRENT, "m:k", "now")
    path, n, stale = tuning.export("NVIDIA H100", str(out), str(cache))
    assert path.endswith("nvidia-h100.json") and (n, stale) == (1, 1)
    entries = json.loads(open(path).read())["entries"]
    assert [(e["gpu"], e["key"]) for e in entries] == [("NVIDIA H100", [1])]
