"""kernels/launch.py: a compiled binary is reused only where the JIT would reuse it."""
import pytest
import torch

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
