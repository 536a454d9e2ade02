"""Host (CPU) cost of launching our kernels, per call: where Python time goes before the GPU sees work.

    python bench/bench_launch.py [--n 2000] [--out F.jsonl]

Each line times n back-to-back calls on a tiny problem (the GPU finishes each in a few us, so the loop is bound by
the CPU) and prints us per call:
  - one LayerNorm forward kernel launched three ways: through the autotuner (`kernel[grid](...)`), through the JIT
    with the tuned config (`kernel.fn[grid](..., BLOCK_M=.., num_warps=..)`), and the compiled binary directly
    (`compiled[grid](...)`, what kernels/launch.py does after the first call)
  - whole ops as the model calls them (autograd forward + backward): our LayerNorm / attention / cross-entropy vs
    F.layer_norm / SDPA / F.cross_entropy
In a training step the CPU runs ahead of the GPU only while its per-op cost stays below the kernels' time.
"""
import argparse

import torch
import torch.nn.functional as F
import triton

import harness as H
from kernels import layernorm as ln
from kernels import ops
from kernels.attention import attention
from kernels.cross_entropy import cross_entropy


def per_call_us(fn, n):
    """Host us per call over n back-to-back calls (20 first, untimed), synced before and after."""
    return H.timed(fn, n, 20, device="cuda")["step_s"] * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--out", default="", help="append the rows as JSON lines here")
    ap.add_argument("--profile", default="", help="cProfile the rows whose name contains this text (top 25 by "
                    "own time)")
    args = ap.parse_args()
    dev, bf = "cuda", torch.bfloat16
    M, C = 4, 768
    x = torch.randn(M, C, device=dev, dtype=bf)
    w, b = torch.ones(C, device=dev), torch.zeros(C, device=dev)
    y = torch.empty_like(x)
    mean, rstd = torch.empty(M, device=dev), torch.empty(M, device=dev)
    k = ln._layernorm_fwd_kernel
    a = (x, None, None, y, w, b, mean, rstd, M, C, C, 0, 0, C, 1e-5)
    const = dict(ADD_RESIDUAL=False, HAS_BIAS=True, BLOCK_C=1024)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]),)  # noqa: E731
    compiled = k[grid](*a, **const)
    cfg = k.best_config
    print(H.banner(f"bench_launch: host us per call (n={args.n}), triton {triton.__version__}; tuned fwd config "
                   f"{cfg}"))
    g = (triton.cdiv(M, cfg.kwargs["BLOCK_M"]), 1, 1)
    rows = {
        "LN fwd kernel via autotuner": lambda: k[grid](*a, **const),
        "LN fwd kernel via JIT + config": lambda: k.fn[g](*a, **const, **cfg.all_kwargs()),
        "LN fwd kernel, compiled binary": lambda: compiled[g](*a, *const.values(), *cfg.kwargs.values()),
    }
    xg = x.clone().requires_grad_()
    wg, bg = w.clone().requires_grad_(), b.clone().requires_grad_()
    dy = torch.randn_like(x)
    rows["LN fwd+bwd ours (autograd)"] = lambda: ln.layernorm(xg, wg, bg).backward(dy)
    rows["LN fwd+bwd ours (custom op, as the model)"] = lambda: ops.layernorm(xg, wg, bg, 1e-5).backward(dy)
    rows["LN fwd+bwd F.layer_norm"] = lambda: F.layer_norm(xg, (C,), wg.to(bf), bg.to(bf)).backward(dy)
    q = torch.randn(1, 2, 64, 64, device=dev, dtype=bf, requires_grad=True)
    kk, v = torch.randn_like(q).requires_grad_(), torch.randn_like(q).requires_grad_()
    do = torch.randn_like(q)
    rows["attention fwd+bwd ours"] = lambda: attention(q, kk, v, causal=True).backward(do)
    rows["attention fwd+bwd ours (custom op)"] = lambda: ops.attention(q, kk, v, causal=True).backward(do)
    rows["attention fwd+bwd SDPA"] = lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=True).backward(do)
    logits = torch.randn(64, 50304, device=dev, dtype=bf, requires_grad=True)
    tgt = torch.randint(0, 50257, (64,), device=dev)
    rows["cross-entropy fwd+bwd ours"] = lambda: cross_entropy(logits, tgt).backward()
    rows["cross-entropy fwd+bwd F.cross_entropy"] = lambda: F.cross_entropy(logits.float(), tgt).backward()
    out = []
    for name, fn in rows.items():
        out.append({"op": name, "us_per_call": per_call_us(fn, args.n), "n": args.n})
        print(f"  {name:40s} {out[-1]['us_per_call']:8.1f} us", flush=True)
        if args.profile and args.profile in name:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.runcall(per_call_us, fn, 500)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
                per_call_us(fn, 200)
            print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    H.append_jsonl(args.out, out)


if __name__ == "__main__":
    main()
