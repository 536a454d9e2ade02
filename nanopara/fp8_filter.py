"""train.fp8_filter=auto: which Linears gain from FP8, a measured per-shape rule (issue #43 items 4-5).

    filter = resolve_filter("auto", "tensor", tokens_per_micro_step, "cuda")   # -> apply_fp8(model, mode, filter)
    print(share_line(fp8_share(model), "tensor", "auto", tokens))                # train.py's start-up line

A Linear (K -> N) at M tokens saves GEMM time in proportion to M*K*N in FP8 and pays the casts of X (M, K) and dY
(M, N) in proportion to M*(K + N): M cancels, so FP8 gains where K*N/(K + N) is large enough (AUTO_MIN_KN, from the
table below). Callers: nanopara/parallel.py (train.fp8_filter), bench/bench_fp8.py (its `auto rule` column),
bench/bench_fp8_e2e.py (the share a row ran in FP8). Choices and numbers: notes/fp8.md.
"""
from __future__ import annotations

import torch.nn as nn

from nanopara.fp8 import DEFAULT_EXCLUDE

# The measurement behind AUTO_MIN_KN: FP8Linear fwd+bwd against the bf16 Linear, one H100, M = 8192 tokens (results/fp8_h100.txt, `bench/bench_fp8.py --quick`,
# 2026-11-26, the weight's cast reused):
#     gpt_1b Linear  K -> N        K*N/(K+N)   tensor    row    block
#     attn.c_proj    2048 -> 2048       1024    0.28x   0.24x   0.27x   (a mistuned tile: 0.37x cuBLAS, issue #43)
#     c_attn         2048 -> 6144       1536    0.99x   0.75x   0.31x
#     c_fc           2048 -> 8192       1638    1.15x   0.82x   0.75x
#     mlp.c_proj     8192 -> 2048       1638    1.19x   1.01x   0.73x
# Paying the weight's cast each step too (one micro-step a step; 'W fp32 tensor' 70 us at 8192 x 2048, same file):
# tensor 0.94x / 1.08x / 1.11x on the last three. Hence: tensor from gpt_1b's MLP size up; row none (its one gain,
# 1.01x, is noise: c_fc of the same size 0.82x, and below 1x with the weight cast); block none. The 124M shapes
# (K*N/(K+N) 384-614) lie below every row, and the whole 124M step in FP8 tensor ran 0.71x (fp8_e2e_h100.txt).
# No row has M < 8192: smaller micro-steps stay bf16 until measured. Re-measure and edit after kernel changes.
AUTO_MIN_KN = {"tensor": 2048 * 8192 / (2048 + 8192), "row": None, "block": None}  # None: no shape measured to gain
AUTO_MIN_TOKENS = 8192


def linear_shape(mod: nn.Module):
    """(K, N, FLOPs a token / 2) of a Linear, a tp shard's linear (its shard) or MoE experts (their c_fc, both of
    their Linears per routed token); None for anything else."""
    if isinstance(mod, nn.Linear) or getattr(mod, "takes_fp8", False) and getattr(mod, "weight", None) is not None:
        N, K = mod.weight.shape[-2:]
        return K, N, K * N
    if getattr(mod, "takes_fp8", False) and hasattr(mod, "c_fc"):
        N, K = mod.c_fc.weight.shape[-2:]
        return K, N, 2 * K * N
    return None


def auto_gains(mode: str, K: int, N: int, tokens: int) -> bool:
    """The rule: a Linear K -> N at `tokens` a micro-step runs faster in FP8 `mode` than in bf16 (table above)."""
    least = AUTO_MIN_KN[mode]
    return least is not None and tokens >= AUTO_MIN_TOKENS and K * N / (K + N) >= least


def resolve_filter(filter: str, mode: str, tokens: int, device_type: str):
    """train.fp8_filter -> apply_fp8's filter: "auto" = the Linears but lm_head that auto_gains picks at `tokens`
    a micro-step on CUDA (on a CPU, the reference path of the tests, nothing is measured: every one but lm_head);
    "all" or "" = every Linear but lm_head; anything else = comma-separated globs of module names."""
    f = filter.strip()
    if f in ("", "all") or f == "auto" and device_type != "cuda":
        return None
    if f != "auto":
        return f

    def keep(name, mod):
        shape = linear_shape(mod)
        return name.rpartition(".")[2] not in DEFAULT_EXCLUDE and shape is not None and \
            auto_gains(mode, shape[0], shape[1], tokens)
    return keep


def fp8_share(model: nn.Module) -> dict:
    """How much of the model's Linears (lm_head included) runs in FP8: counts, and the share of their FLOPs."""
    n = n8 = f = f8 = 0
    for _, mod in model.named_modules():
        shape = linear_shape(mod)
        if shape is None:
            continue
        on = getattr(mod, "fp8_state", None) is not None
        n, n8, f, f8 = n + 1, n8 + on, f + shape[2], f8 + shape[2] * on
    return {"fp8_linears": n8, "linears": n, "fp8_flop_share": f8 / f if f else 0.0}


def share_line(share: dict, mode: str, filter: str, tokens: int, device_type: str = "cuda") -> str:
    """The start-up line: which share of the Linears runs in FP8, and why where the rule chose none."""
    line = (f"train.fp8={mode} fp8_filter={filter or 'all'}: {share['fp8_linears']} of {share['linears']} Linears "
            f"in FP8, {share['fp8_flop_share']:.0%} of their FLOPs")
    if filter.strip() == "auto" and device_type != "cuda":
        line += f" (on {device_type} nothing is measured: every Linear but lm_head)"
    elif share["fp8_linears"] == 0 and filter.strip() == "auto":
        why = (f"{tokens} tokens a micro-step < {AUTO_MIN_TOKENS}, the smallest measured" if
               tokens < AUTO_MIN_TOKENS and AUTO_MIN_KN[mode] is not None else
               f"no Linear of K*N/(K+N) >= {AUTO_MIN_KN[mode]:.0f}" if AUTO_MIN_KN[mode] is not None else
               f"no shape measured to gain in {mode} mode")
        line += f" ({why}: nanopara/fp8_filter.py AUTO_MIN_KN; --train.fp8_filter=all forces them)"
    return line
