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
