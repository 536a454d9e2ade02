"""Tile sweeps of kernels/layernorm.py (GPU time, CUDA-graph replay): where its tuning numbers come from.

    python bench/sweep_layernorm.py [--old DIR] [--shapes 16384x768,...] [--groups 1,4] [--profile] [--out FILE]
    python bench/sweep_layernorm.py --dwdb [--out FILE]

Per shape (bf16 rows; "+res" = add_layernorm with an fp32 residual stream, as in the model): the tiles the
autotuner picked and its five fastest candidates, then the forward and the backward alone in GPU time (CUDA-graph
replay) with the bandwidth they reach as a share of the measured copy bandwidth. `--old DIR` also times the
layernorm module of another checkout (e.g. `git archive <rev> | tar -x -C DIR`) in the same process: A/B of a
kernel change on one GPU. `--profile`: the backward's kernels one by one (torch.profiler, mean GPU us a call), to
see what the partials' second stage and the row kernel each take. `--dwdb`: the second stage alone (column sums of
the (n_groups, C) partials) over its launch parameters, at the partial shapes the backward makes.
"""
import argparse
import importlib.util
import os
import sys

import torch
import triton

import harness as H
from kernels import layernorm as ln

SHAPES = [(16384, 768, False), (32768, 768, True), (8192, 4096, False), (4096, 8192, False), (4096, 8192, True),
          (8192, 8192, False), (2048, 16384, False)]


def _load(path):
    spec = importlib.util.spec_from_file_location("layernorm_old", os.path.join(path, "kernels", "layernorm.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, path)  # its own `kernels.launch`
    spec.loader.exec_module(mod)
    sys.path.remove(path)
    return mod


def _top(kernel, n=5):
    timings = getattr(kernel, "configs_timings", None) or {}
    best = sorted(timings.items(), key=lambda kv: kv[1][0] if isinstance(kv[1], list) else kv[1])[:n]
    fmt = lambda c: ",".join(f"{k[:1] if k != 'PROGRAMS_PER_SM' else 'P'}{v}" for k, v in c.kwargs.items())  # noqa
    return " ".join(f"[{fmt(c)},w{c.num_warps} {(t[0] if isinstance(t, list) else t) * 1e3:.1f}us]" for c, t in best)


def _time(mod, M, C, res, groups_per_sm=None):
    """(fwd us, bwd us) in graph replay, and the bytes each must move."""
    x = torch.randn(M, C, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(M, C, device="cuda", dtype=torch.float32) if res else None
    w, b = 1 + 0.1 * torch.randn(C, device="cuda"), 0.1 * torch.randn(C, device="cuda")
    dy = torch.randn(M, C, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(M, C, device="cuda", dtype=torch.float32) if res else None
    fwd = lambda: mod.layernorm_fwd(x, w, b, 1e-5, residual=r, out_dtype=torch.bfloat16)  # noqa: E731
    y, h, mean, rstd = fwd()
    xs = x if h is None else h
    n = groups_per_sm * torch.cuda.get_device_properties(0).multi_processor_count if groups_per_sm else None
    bwd = lambda: mod.layernorm_bwd(dy, xs, w, True, mean, rstd, dh=dh, n_groups=n)  # noqa: E731
    bwd()
    t_f = triton.testing.do_bench_cudagraph(fwd, return_mode="median") * 1e3
    t_b = triton.testing.do_bench_cudagraph(bwd, return_mode="median") * 1e3
    e_x, e_h = 2, (4 if res else 2)
    fwd_bytes = M * C * (e_x + (4 + e_h if res else 0) + 2)  # x (+ r in, h out), y out (bf16)
    bwd_bytes = M * C * (e_h + 2 + (4 if res else 0) + e_h)  # h, dy (+ dh) in, dx out
    return t_f, t_b, fwd_bytes, bwd_bytes


def _profile(M, C, res, calls=20):
    """{kernel name: mean GPU us per backward call} of the backward at this shape."""
    x = torch.randn(M, C, device="cuda", dtype=torch.float32 if res else torch.bfloat16)
    w = 1 + 0.1 * torch.randn(C, device="cuda")
    dy = torch.randn(M, C, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(M, C, device="cuda", dtype=torch.float32) if res else None
    mean, rstd = x.float().mean(-1), torch.rsqrt(x.float().var(-1, unbiased=False) + 1e-5)
    ln.layernorm_bwd(dy, x, w, True, mean, rstd, dh=dh)  # tuned outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            ln.layernorm_bwd(dy, x, w, True, mean, rstd, dh=dh)
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / calls for e in prof.key_averages() if e.device_time_total > 0}


def _dwdb_sweep(out):
    """GPU time of the partials' second stage per (BLOCK_C, BLOCK_G, num_warps), against the committed launch."""
    for M, C in ((16384, 768), (32768, 768), (8192, 4096), (4096, 8192), (2048, 16384)):
        n = ln._bwd_groups(M, C, torch.device("cuda"))[0]  # the partials the backward makes at this shape
        part = torch.randn(2, n, C, device="cuda")
        dw, db = torch.empty(C, device="cuda"), torch.empty(C, device="cuda")
        res = {}
        for bc in (8, 16, 32, 64, 128):
            for bg in (16, 32, 64, 128, 256):
                for w in (1, 2, 4, 8):
                    if bc * bg < 32 * w or bc * bg > 8192:
                        continue
                    def run(bc=bc, bg=bg, w=w):
                        ln._layernorm_dwdb_kernel[(triton.cdiv(C, bc),)](part[0], part[1], dw, db, n, C, HAS_BIAS=True,
                                                                        BLOCK_G=bg, BLOCK_C=bc, num_warps=w)
                    run()
                    res[(bc, bg, w)] = triton.testing.do_bench_cudagraph(run, rep=20) * 1e3
        best = sorted(res.items(), key=lambda kv: kv[1])[:5]
        print(f"  dwdb {n} groups x {C}: committed (8, 256, w4) {res[(8, 256, 4)]:.2f} us; best " +
              " ".join(f"[C{k[0]} G{k[1]} w{k[2]} {t:.2f}us]" for k, t in best))
        H.append_jsonl(out, dict(kind="dwdb", groups=n, C=C, us={f"{k[0]}x{k[1]}w{k[2]}": t for k, t in res.items()}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="a checkout whose kernels/layernorm.py is timed too")
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--shapes", help="only these, e.g. 16384x768,32768x768+res (default: all of SHAPES)")
    ap.add_argument("--dwdb", action="store_true", help="sweep the partials' second stage only")
    ap.add_argument("--profile", action="store_true", help="also list the backward's kernels with their GPU times")
    ap.add_argument("--groups", default="", help="also time the backward at these row groups per SM, e.g. 1,4")
    args = ap.parse_args()
    if args.dwdb:
        return _dwdb_sweep(args.out)
    copy = ln._copy_bandwidth()
    old = _load(args.old) if args.old else None
    print(H.banner(f"sweep_layernorm: copy bandwidth {copy:.0f} GB/s"))
    for M, C, res in SHAPES:
        if args.shapes and f"{M}x{C}{'+res' if res else ''}" not in args.shapes.split(","):
            continue
        name = f"{M}x{C}{'+res' if res else ''}"
        row = dict(shape=name, copy_gbs=copy)
        for label, mod in (("new", ln), ("old", old)):
            if mod is None:
                continue
            t_f, t_b, fb, bb = _time(mod, M, C, res)
            pf, pb = 100 * fb / t_f / 1e3 / copy, 100 * bb / t_b / 1e3 / copy
            row.update({f"{label}_fwd_us": t_f, f"{label}_bwd_us": t_b, f"{label}_fwd_pct": pf, f"{label}_bwd_pct": pb})
            print(f"  {name:>15} {label}: fwd {t_f:6.1f} us ({pf:4.1f}% of copy)  bwd {t_b:6.1f} us ({pb:4.1f}%)")
            if label == "new":
                print(f"      fwd picked {ln._layernorm_fwd_kernel.best_config}; top {_top(ln._layernorm_fwd_kernel)}")
                print(f"      bwd picked {ln._layernorm_bwd_kernel.best_config}; top {_top(ln._layernorm_bwd_kernel)}")
        for g in filter(None, args.groups.split(",")):
            _, t_b, _, bb = _time(ln, M, C, res, int(g))
            row[f"new_bwd_us_groups{g}"] = t_b
            print(f"  {name:>15} new, {g} row groups per SM: bwd {t_b:6.1f} us ({100 * bb / t_b / 1e3 / copy:4.1f}%)")
        if args.profile:
            row["bwd_kernels_us"] = _profile(M, C, res)
            print("      bwd kernels: " + ", ".join(f"{k[:40]} {v:.1f} us" for k, v in row["bwd_kernels_us"].items()))
        H.append_jsonl(args.out, row)


if __name__ == "__main__":
    main()
