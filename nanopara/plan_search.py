"""Layout search: every layout of N GPUs that fits, ranked by tokens/s, each with what dominates its step.

The space: tp in 1, 2, 4, 8 (within a node; dividing heads, MLP width, vocabulary, KV heads), cp (from 16k-token
sequences), pp dividing what is left (<= blocks), dp the rest (dividing the batch's sequences), micro-batch sizes
with m >= pp, ZeRO 0-3 (0-1 under pp), 1F1B or interleaved (v = 2), activation checkpointing none -> selective ->
full (the first that fits: recomputing only costs), sequence parallel on whenever tp > 1, ep for MoE. Pruned by a
memory bound before any timing: the states alone must fit (ZeRO-3 / full checkpointing are their floor). Fast
enough for 16,384 GPUs (a few thousand predictions; each prediction evaluates one block per kind).
Models: the presets (nanopara/presets.py) and Llama 3 8B / 70B / 405B (grouped-query attention with 8 KV heads,
SwiGLU, 128,256 vocabulary, untied head, rotary positions; Dubey et al. 2024, Table 3). A model that fits nowhere
on N GPUs: the smallest power-of-two count that fits, said in one line. Called by plan.py.
"""
from __future__ import annotations

from dataclasses import replace

from nanopara import gpus as G
from nanopara.plan_time import predict
from nanopara.planner import Layout, Model, PlanError, Run, memory

LLAMA = {"llama3_8b": (32, 4096, 32, 14336), "llama3_70b": (80, 8192, 64, 28672),
         "llama3_405b": (126, 16384, 128, 53248)}


def named_model(name: str) -> tuple[Model, int, int]:
    """(model, seq, tokens a step) for a preset or a Llama 3 name; ValueError with the list."""
    if name in LLAMA:
        L, d, h, f = LLAMA[name]
        return (Model(name=name, n_layer=L, d=d, n_head=h, kv_heads=8, ffn=f, vocab=128256, swiglu=True, tied=False,
                      positions=0, norm_params=1, bias=False), 8192, 16 * 2 ** 20)
    from nanopara.presets import PRESETS
    if name not in PRESETS:
        raise PlanError(f"unknown model {name!r}: choose one of {', '.join(list(PRESETS) + list(LLAMA))}, or give "
                        f"--layers --d --heads [--kv_heads --ffn --vocab --swiglu]")
    cfg = PRESETS[name]()
    t = cfg.train
    return Model.from_config(cfg.model, name), t.seq_len, t.tokens_per_step or 2 ** 19


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if d <= cap and n % d == 0]


def candidates(model: Model, n: int, seq: int, tokens: int, fp8: str = "none"):
    """Every layout of the space above for n GPUs (unchecked against memory)."""
    seqs = tokens // seq
    for tp in _divisors(n, 8):
        if model.n_head % tp or model.ffn % tp or model.vocab % tp or (model.kv_heads % tp and tp % model.kv_heads):
            continue
        for cp in _divisors(n // tp, max(1, seq // 8192)):
            for pp in _divisors(n // (tp * cp), model.n_layer):
                dp = n // (tp * cp * pp)
                if seqs % dp:
                    continue
                for b in (1, 2, 4, 8, 16, 32):
                    if (seqs // dp) % b or (pp > 1 and seqs // dp // b < pp):
                        continue
                    for zero in ((0, 1) if pp > 1 else (0, 1, 2, 3)) if dp * cp > 1 else (0,):
                        for sched, v in ((("1f1b", 1), ("interleaved", 2)) if pp > 1 else (("1f1b", 1),)):
                            if v > 1 and model.n_layer < 2 * pp:
                                continue
                            ep = max((e for e in _divisors(dp * cp, model.experts or 1) if model.experts % e == 0),
                                     default=1) if model.experts else 1
                            yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, sp=tp > 1, schedule=sched,
                                         virtual=v, micro_batch=b, fp8=fp8)


def search(model: Model, n: int, seq: int, tokens: int, gpu: str = "H100", top: int = 5, fp8: str = "none",
           fabric: dict | None = None) -> dict:
    """{"ranked": [(layout, prediction, reason)], "tried", "fit"}; PlanError when nothing fits."""
    G.lookup(gpu)
    fab = fabric or dict(G.FABRIC)
    if tokens % seq:
        raise PlanError(f"the batch of {tokens} tokens is not a whole number of {seq}-token sequences")
    fit, tried = [], 0
    for lay in candidates(model, n, seq, tokens, fp8):
        tried += 1
        floor = replace(lay, ac="full", micro_batch=1, zero=3 if lay.pp == 1 and lay.dp * lay.cp > 1 else lay.zero)
        if not memory(Run(model, floor, seq, tokens, gpu, fab))["fits"]:
            continue
        for ac in ("none", "selective", "full"):
            run = Run(model, replace(lay, ac=ac), seq, tokens, gpu, fab)
            if memory(run)["fits"]:
                fit.append((run.layout, predict(run)))
                break
    if not tried:
        raise PlanError(f"no layout of {n} GPUs divides {model.name} ({model.n_head} heads, {model.n_layer} blocks) "
                        f"and the batch of {tokens // seq} sequences into tp x cp x pp x dp: choose a GPU count "
                        f"that does (a power of two, or a divisor of the batch times tp x pp)")
    if not fit:
        raise PlanError(nowhere(model, n, seq, tokens, gpu, fab))
    fit.sort(key=lambda lp: -lp[1]["tokens_per_s"])
    best = fit[0][1]
    ranked = [(lay, p, reason(p, best, i == 0)) for i, (lay, p) in enumerate(fit[:top])]
    return {"ranked": ranked, "tried": tried, "fit": len(fit)}


NAMES = {"gemm": "GEMMs", "attention": "attention", "memory_bound": "memory-bound kernels", "recompute": "recompute",
         "head": "lm head + loss", "params_pass": "weight casts + grad accumulation", "tp_comm": "TP/SP comm",
         "cp_comm": "CP comm", "ep_comm": "EP all-to-all", "pp_p2p": "pipeline p2p", "bubble": "pipeline bubble",
         "host_excess": "host floor (GPU waits for Python)", "dp_exposed": "exposed DP reduction",
         "dp_contention": "DP overlap slowdown", "optimizer": "optimizer", "kernel_gaps": "gaps between kernels"}


def shares(p: dict) -> dict:
    it, step = p["time"]["items"], p["step_s"]
    return {k: v / step for k, v in sorted(it.items(), key=lambda kv: -kv[1]) if v / step >= 0.005}


def reason(p: dict, best: dict, first: bool) -> str:
    """What this layout's step is made of; for a loser, the item that costs it most against the winner."""
    sh = shares(p)
    overhead = {k: v for k, v in sh.items() if k not in ("gemm", "attention", "memory_bound", "head")}
    top = max(overhead, key=overhead.get) if overhead else "gemm"
    mem = f"{p['reserved_gb']:.0f} of {p['memory']['capacity'] / 1e9:.0f} GB"
    if first:
        return f"fastest: GEMMs {sh.get('gemm', 0):.0%} of its step, largest overhead {NAMES[top]} " \
               f"{overhead.get(top, 0):.0%}; {mem}"
    b_items, items = best["time"]["items"], p["time"]["items"]
    worst = max(items, key=lambda k: items[k] * best["tokens_per_step"] / p["tokens_per_step"] - b_items.get(k, 0))
    return f"{1 - p['tokens_per_s'] / best['tokens_per_s']:.0%} slower: more {NAMES[worst]} " \
           f"({items[worst] / p['step_s']:.0%} of its step); {mem}"


def nowhere(model: Model, n: int, seq: int, tokens: int, gpu: str, fab: dict) -> str:
    """The one line for a model that fits no layout of n GPUs: the smallest power-of-two count that would."""
    k = 1
    while k <= 2 ** 20:
        k *= 2
        if k <= n:
            continue
        seqs = max(tokens // seq, k)
        for lay in candidates(model, k, seq, seqs * seq):
            floor = replace(lay, ac="full", micro_batch=1, zero=3 if lay.pp == 1 and lay.dp * lay.cp > 1 else lay.zero)
            if memory(Run(model, floor, seq, seqs * seq, gpu, fab))["fits"]:
                return (f"{model.name} ({model.params() / 1e9:.1f}B parameters) fits no layout of {n} x {gpu}; the "
                        f"smallest power-of-two count that fits is {k} GPUs (e.g. {floor.label()})")
    return f"{model.name} fits no layout of up to 2^20 x {gpu}"
