"""kernels/grouped_gemm_fp8.py: the experts' MLP with its forward and input-gradient GEMMs in FP8. The Triton path
(the interpreter here) against the same Function on PyTorch GEMMs (the same quantizations: only summation order
and the fp8 roundings it tips differ), and both against the fp32 MLP within FP8's error."""
import pytest
import torch

from kernels import grouped_gemm as gg
from kernels.grouped_gemm_fp8 import grouped_mlp_fp8
from tests.test_moe import _gen, _mlp_params, _run_mlp


def _rel(a, b):
    """Relative Frobenius error."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("sizes,bias", [([5, 0, 20, 1, 11], True), ([37, 0, 0], False)])
def test_fp8_grouped_mlp_triton_matches_reference_path(sizes, bias):
    E, C, H = len(sizes), 32, 48
    offsets = gg.offsets_of(sizes, "cpu")
    used = sum(sizes)
    x = torch.randn(used + 3, C, generator=_gen(1))  # rows past the last group: never read
    dy = torch.randn(used + 3, C, generator=_gen(2))
    params = _mlp_params(E, C, H, bias)
    run = lambda triton: _run_mlp(lambda *a: grouped_mlp_fp8(*a, triton=triton), x, params, offsets, dy, used)  # noqa: E731
    got, ref = run(True), run(False)
    exact = _run_mlp(gg.grouped_mlp_ref, x.double(), [None if p is None else p.double() for p in params], offsets,
                     dy.double(), used)
    for i, (a, b, e) in enumerate(zip(got, ref, exact)):
        if e is None:
            assert a is None and b is None
            continue
        assert _rel(a, b) < SAME, (i, _rel(a, b))
        assert _rel(b, e) < FP8, (i, _rel(b, e))


# measured 3.3e-7 (summation order); a rounding tipped by it moves one element by an fp8 step (~6 %): ~2e-3 here
SAME = 5e-3
# measured 0.034-0.060 (y, dx, dw_fc, db_fc, dw_proj): four e4m3 GEMMs in a row; the same + ~25 % as tests/test_fp8.py
FP8 = 0.075


def test_moe_model_trains_with_fp8_experts(tmp_path):
    """train.fp8 on a MoE model: apply_fp8 marks the experts, whose MLP then runs the FP8 Function (the reference
    GEMMs on the CPU); it trains within FP8's error of the fp32 run, and not identically (FP8 is on)."""
    import numpy as np

    import train
    from tests.shards import tiny_shards
    tiny_shards(tmp_path, "m", n=20_000, val=3_000)
    args = ["--preset=tiny_moe", "--device=cpu", f"--data.dataset={tmp_path}/m_*.bin", "--model.n_layer=2",
            "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32", "--model.vocab_size=250",
            "--model.kernels=torch", "--train.micro_batch=4", "--train.seq_len=16", "--train.steps=8",
            "--train.warmup_steps=2", "--train.val_every=0", "--train.sample_tokens=0", "--train.lr=1e-2",
            "--ckpt.final=false"]
    fp32 = train.main([*args, f"--out_dir={tmp_path / 'a'}"])["losses"]
    experts_only = train.main([*args, f"--out_dir={tmp_path / 'b'}", "--train.fp8=row",
                               "--train.fp8_filter=*.experts"])["losses"]
    off = max(abs(a - b) for a, b in zip(experts_only, fp32))  # measured 0.0055 (no FP8: the same path, exactly 0)
    assert 0 < off < 0.05 and experts_only[-1] < experts_only[0] - 0.5


@pytest.mark.gpu
def test_fp8_grouped_mlp_on_gpu_at_gpt2_moe_shapes():
    """gpt2_moe's experts (C 768, H 3072, 8 groups, skewed, 4099 rows) on the GPU in bf16: the Triton FP8 path
    against the same Function's PyTorch GEMMs (fast accumulation in the tensor cores: looser than on the CPU, not
    yet measured) and against fp32 within FP8's error."""
    torch.manual_seed(0)
    E, R, C, H = 8, 4099, 768, 3072
    offsets = gg.offsets_of(gg.group_sizes(R, E, "skewed"), "cuda")
    x = torch.randn(R, C, device="cuda").bfloat16()
    dy = torch.randn(R, C, device="cuda").bfloat16()
    params = [p.cuda() for p in _mlp_params(E, C, H, True)]
    params[0], params[2] = params[0] * 0.1, params[2] * 0.05  # GPT-2-like magnitudes at this width
    run = lambda fn: _run_mlp(fn, x, params, offsets, dy, R)  # noqa: E731
    got = run(lambda *a: grouped_mlp_fp8(*a, triton=True))
    ref = run(lambda *a: grouped_mlp_fp8(*a, triton=False))
    exact = _run_mlp(gg.grouped_mlp_ref, x.double(), [p.double() for p in params], offsets, dy.double(), R)
    for i, (a, b, e) in enumerate(zip(got, ref, exact)):
        assert _rel(a, b) < 0.02, (i, _rel(a, b))
        assert _rel(a, e) < FP8, (i, _rel(a, e))
