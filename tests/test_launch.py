"""kernels/launch.py: a compiled binary is reused only where the JIT would reuse it; an autotuned kernel takes its
stored choice without tuning, or tunes, announces it and stores its pick."""
import sys

import pytest
import torch
import triton
import triton.language as tl

from kernels import launch, tuning
from kernels.launch import _spec


def test_key_separates_what_the_jit_specialises_on():
    a = torch.zeros(64)
    assert _spec((a,)) == _spec((torch.zeros(64),))
    assert _spec((a,)) != _spec((a[1:],))  # 4-byte offset: no longer 16-byte aligned
    assert _spec((a,)) != _spec((a.double(),))  # dtype
    assert _spec((32,)) == _spec((48,))  # both divisible by 16
    assert len({_spec((x,)) for x in (1, 2, 16, 17, 2 ** 31, -(2 ** 31) - 1)}) == 5  # 16 vs 2**31: int32 or not
    assert _spec((True,)) != _spec((1,)) and _spec((None,)) != _spec((0,))
    assert _spec((0.5,)) == _spec((2.0,))  # floats are not specialised on their value
    # subclasses take the same key as their base (the fast path checks exact types first)
    assert _spec((torch.nn.Parameter(a),)) == _spec((a,))
    assert _spec((type("Size", (int,), {})(48),)) == _spec((32,))
    assert _spec((False,)) != _spec((0,))


@pytest.mark.gpu
def test_fast_launch_follows_alignment_and_shapes():
    """Aligned and misaligned views, and a new width, each get their own binary; results match the reference."""
    from kernels import layernorm as ln
    torch.manual_seed(0)
    M, C = 257, 768
    flat = torch.randn(M * 1000 + 8, device="cuda", dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(1000, device="cuda")
    b = 0.1 * torch.randn(1000, device="cuda")
    before = len(ln._fwd.cache)
    for start, width in ((0, C), (1, C), (0, C), (1, C), (0, 1000)):
        x = flat[start:start + M * width].view(M, width)
        got = ln.layernorm(x, w[:width], b[:width])
        want = ln.layernorm_ref(x, w[:width], b[:width])
        assert (got.float() - want.float()).abs().max().item() <= 0.05, (start, width)  # 1 bf16 ulp, |y| < 8
    assert len(ln._fwd.cache) - before == 3  # (aligned, C), (misaligned, C), (aligned, 1000)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fast_launch_keeps_one_binary_per_device():
    """The same call on a second GPU compiles (and runs) its own binary there, as the JIT does."""
    from kernels import layernorm as ln
    torch.manual_seed(0)
    sizes = []
    for dev in ("cuda:0", "cuda:1", "cuda:0", "cuda:1"):
        with torch.cuda.device(dev):
            x = torch.randn(129, 768, device=dev, dtype=torch.bfloat16)
            w, b = torch.ones(768, device=dev), torch.zeros(768, device=dev)
            got = ln.layernorm(x, w, b)
            want = ln.layernorm_ref(x, w, b)
            assert got.device == x.device
            assert (got.float() - want.float()).abs().max().item() <= 0.05, dev
        sizes.append(len(ln._fwd.cache))
    assert {key[0] for key in ln._fwd.cache} >= {0, 1}  # a binary per device
    assert sizes[1] == sizes[0] + 1 and sizes[3] == sizes[1]  # cuda:1 got its own; the second visits reuse them


# ---------------------------------------------------------------------------------------------------------------
# The miss path of an autotuned kernel with the tuning store (kernels/tuning.py), interpreted on CPU, compiled on a
# GPU: a kernel with two configs that writes its config's TAG, and a timing that makes the autotuner pick TAG 2

_TIMED = []  # TAGs the autotuner timed
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (conftest: the interpreter without a GPU)
_OUT = None  # the kernel's output, set by the `store` fixture


def _time_by_tag(kernel_call, quantiles=None):
    kernel_call()
    tag = int(_OUT[0])
    _TIMED.append(tag)
    return [1.0 if tag == 2 else 2.0] * 3


@triton.autotune(configs=[triton.Config({"TAG": 1}, num_warps=1), triton.Config({"TAG": 2}, num_warps=2)],
                 key=["n"], do_bench=_time_by_tag)
@triton.jit
def _tag_kernel(OUT, n, TAG: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(OUT + offs, tl.full([BLOCK], TAG, tl.int32), mask=offs < n)


@pytest.fixture
def store(tmp_path, monkeypatch):
    s = tuning.Store(path=tmp_path / "tuned.json", shipped=None)
    monkeypatch.setattr(tuning, "STORE", s)
    monkeypatch.setattr(sys.modules[__name__], "_OUT", torch.zeros(8, dtype=torch.int32, device=_DEVICE))
    _tag_kernel.cache.clear()
    _TIMED.clear()
    return s


def _tag_after_launch(kern, n=5):
    _OUT.zero_()
    kern[(1,)](_OUT, n, BLOCK=8)
    return int(_OUT[0])


def test_stored_config_launches_as_is_without_tuning(store, capsys):
    k = launch.fast(_tag_kernel)
    key = launch.autotune_key(_tag_kernel, (_OUT, 5), {"BLOCK": 8})
    store.put(tuning.gpu_name(), k.tuner.name, k.tuner.source, key, tuning.config_record(_tag_kernel.configs[0]))
    assert _tag_after_launch(k) == 1  # the stored config, though the autotuner would pick TAG 2
    assert _TIMED == [] and "tuning" not in capsys.readouterr().err
    assert _tag_kernel.best_config is _tag_kernel.configs[0]


def test_without_a_stored_config_it_tunes_announces_and_stores(store, capsys):
    k = launch.fast(_tag_kernel)
    assert _tag_after_launch(k) == 2 and sorted(_TIMED) == [1, 2]
    assert "nanopara: tuning tag for n=5 (2 candidates) - first run on this GPU only" in capsys.readouterr().err
    # the key the autotuner cached its pick under is the one FastKernel computes and stores
    assert list(_tag_kernel.cache) == [launch.autotune_key(_tag_kernel, (_OUT, 5), {"BLOCK": 8})]
    fresh = tuning.Store(path=store.path, shipped=None)
    assert fresh.get(tuning.gpu_name(), k.tuner.name, k.tuner.source, (5, "torch.int32")) == \
        tuning.config_record(_tag_kernel.configs[1])
    # a new process (a fresh autotuner cache) takes the stored pick: no timing, no message
    _tag_kernel.cache.clear()
    _TIMED.clear()
    assert _tag_after_launch(launch.fast(_tag_kernel)) == 2 and _TIMED == []
    assert "tuning" not in capsys.readouterr().err
    assert _tag_after_launch(k, n=6) == 2 and sorted(_TIMED) == [1, 2]  # a new key value: tuned anew


def test_stored_entry_of_an_edited_kernel_is_not_used(store):
    k = launch.fast(_tag_kernel)
    key = launch.autotune_key(_tag_kernel, (_OUT, 5), {"BLOCK": 8})
    store.put(tuning.gpu_name(), k.tuner.name, "an older source", key, tuning.config_record(_tag_kernel.configs[0]))
    assert _tag_after_launch(k) == 2 and sorted(_TIMED) == [1, 2]


@pytest.mark.gpu
def test_tuning_compiles_its_candidates_on_threads_then_times_them(store, monkeypatch):
    """Both candidates are compiled by compile_parallel's pool (the JIT's compile step records its thread), so the
    autotuner's timing loop on this thread compiles nothing; the pick is stored."""
    import threading
    jit = _tag_kernel.fn
    jit.device_caches[torch.cuda.current_device()]  # the binder exists, and with it jit.compile
    threads, compile_ = [], jit.compile

    def compile_and_record(*a, **kw):
        threads.append(threading.get_ident())
        return compile_(*a, **kw)
    monkeypatch.setattr(jit, "compile", compile_and_record)
    monkeypatch.setattr(tuning, "COMPILE_THREADS", 4)
    k = launch.fast(_tag_kernel)
    # n=16: a specialization (16-divisible) the tests above did not compile in this process
    assert _tag_after_launch(k, n=16) == 2 and sorted(_TIMED) == [1, 2]
    assert len(threads) == 2 and threading.get_ident() not in threads
    assert tuning.STORE.get(tuning.gpu_name(), k.tuner.name, k.tuner.source, (16, "torch.int32")) == \
        tuning.config_record(_tag_kernel.configs[1])


@triton.autotune(configs=[triton.Config({"TAG": 3}, num_warps=1), triton.Config({"TAG": 4, "EXTRA": 10}, num_warps=1)],
                 key=["n"], do_bench=_time_by_tag)
@triton.jit
def _defaulted_kernel(OUT, n, TAG: tl.constexpr, BLOCK: tl.constexpr, EXTRA: tl.constexpr = 0):
    offs = tl.arange(0, BLOCK)
    tl.store(OUT + offs, tl.full([BLOCK], TAG + EXTRA, tl.int32), mask=offs < n)


@pytest.mark.parametrize("tag", [3, 4])
def test_config_may_leave_out_a_defaulted_constexpr(store, tag):
    """A config without a constexpr that has a default (grouped_gemm's FLATTEN) launches, and its binary is
    relaunched with the default: the fast path once raised TypeError here, on GPUs only."""
    _defaulted_kernel.cache.clear()
    k = launch.fast(_defaulted_kernel)
    cfg = next(c for c in _defaulted_kernel.configs if c.kwargs["TAG"] == tag)
    key = launch.autotune_key(_defaulted_kernel, (_OUT, 5), {"BLOCK": 8})
    store.put(tuning.gpu_name(), k.tuner.name, k.tuner.source, key, tuning.config_record(cfg))
    for _ in range(2):  # the miss, then (on a GPU) the binary launch with the appended constexprs
        assert _tag_after_launch(k) == {3: 3, 4: 14}[tag]
    meta, tail = k.tail(2, {"BLOCK": 8})
    assert meta["EXTRA"] == (0 if tag == 3 else 10) and tail == (tag, 8, meta["EXTRA"])
