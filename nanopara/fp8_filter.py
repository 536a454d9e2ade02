"""train.fp8_filter=auto: which Linears gain from FP8, a measured per-shape rule (issue #43 items 4-5).

    filter = resolve_filter("auto", "tensor", tokens_per_micro_step, "cuda")   # -> apply_fp8(model, mode, filter)
    print(share_line(fp8_share(model), "tensor", "auto", tokens))                # train.py's start-up line

A Linear (K -> N) at M tokens saves GEMM time in proportion to M*K*N in FP8 and pays the casts of X (M, K) and dY
(M, N) in proportion to M*(K + N): M cancels, so FP8 gains where K*N/(K + N) is large enough (AUTO_MIN_KN, from the
table below). Callers: nanopara/parallel.py (train.fp8_filter), bench/bench_fp8.py (its `auto rule` column),
bench/bench_fp8_e2e.py (the share a row ran in FP8), nanopara/planner.py (which Linears it times in FP8). Choices
and numbers: notes/fp8.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a module is looked at: the rule itself (auto_gains) is the planner's too
    import torch.nn as nn

# The measurement behind AUTO_MIN_KN: FP8Linear fwd+bwd against the bf16 Linear, one H100, M = 8192 tokens, the casts'
# tiles autotuned per shape (results/fp8_mlp_linear_h100.txt, `bench/bench_fp8.py --quick --only linear`, 2026-12-07;
# the weight's cast reused, then paid every call):
#     gpt_1b Linear  K -> N        K*N/(K+N)   tensor         row            block
#     attn.c_proj    2048 -> 2048       1024    0.56x / 0.47   0.46x / 0.39   0.59x / 0.51
#     c_attn         2048 -> 6144       1536    1.14x / 1.07   1.07x / 0.99   0.71x / 0.68
#     c_fc           2048 -> 8192       1638    1.21x / 1.15   1.16x / 1.07   0.76x / 0.73
#     mlp.c_proj     8192 -> 2048       1638    1.23x / 1.17   1.18x / 1.08   0.74x / 0.72
# Hence: tensor from c_attn's size up (1536; end to end, gpt_1b delayed + graph with c_attn in FP8 too ran
# 1.121-1.128x bf16: results/fp8_e2e_peer_h100.txt, fp8_e2e_fused_h100.txt). Under CUDA graphs with the Gluon
# promoted GEMMs (results/fp8_linear_graph_h100.txt, one H100, 2026-12-07, weight cast reused / paid) every shape
# above gains in tensor (1.19 / 1.13x at 1024, 1.36-1.54 / 1.28-1.41x at 1536-2458: gpt_3b included) and row (1.11 /
# 1.04x at 1024, 1.27-1.45 / 1.18-1.33x from 1536), and block loses at every one (0.78-0.97x: its 1x128 x 1x128 wgrad
# runs at 0.42-0.45x cuBLAS, fp8_ws_gemm_h100.txt). Row takes 1638, where eager gains too: its loss-checked step
# agreed (gpt_1b row + graph with c_attn and the MLP in FP8: 1.128x the best bf16, loss 0.8 % above bf16's after 16
# steps, inside bench_fp8_e2e's 3 % check: results/fp8_e2e_rowblock_h100.txt, one H100, 2026-12-08). Tensor keeps
# 1536: below it the eager table loses (0.56x). No row has M < 8192: smaller micro-steps stay bf16.
# The 124M shapes (K*N/(K+N) 384-614) lie below every row. Re-measure and edit after kernel changes.
AUTO_MIN_KN = {"tensor": 2048 * 6144 / (2048 + 6144), "row": 2048 * 8192 / (2048 + 8192),
               "block": None}  # None: no threshold yet
AUTO_MIN_TOKENS = 8192


def linear_shape(mod: nn.Module):
    """(K, N, FLOPs a token / 2) of a Linear, a tp shard's linear (its shard) or MoE experts (their c_fc, both of
    their Linears per routed token); None for anything else."""
    import torch.nn as nn
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
    from nanopara.fp8 import DEFAULT_EXCLUDE
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
               f"no threshold for {mode} mode yet")
        line += f" ({why}: nanopara/fp8_filter.py AUTO_MIN_KN; --train.fp8_filter=all forces them)"
    return line
