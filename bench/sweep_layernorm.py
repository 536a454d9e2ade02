"""Tile sweeps of kernels/layernorm.py (GPU time, CUDA-graph replay): where its tuning numbers come from.

    python bench/sweep_layernorm.py [--old DIR] [--shapes 16384x768,...] [--groups 1,4] [--out FILE]

Per shape (bf16 rows; "+res" = add_layernorm with an fp32 residual stream, as in the model): the tiles the
autotuner picked and its five fastest candidates, then the forward and the backward alone in GPU time (CUDA-graph
replay) with the bandwidth they reach as a share of the measured copy bandwidth. `--old DIR` also times the
layernorm module of another checkout (e.g. `git archive <rev> | tar -x -C DIR`) in the same process: A/B of a
kernel change on one GPU.
"""
import argparse
import importlib.util
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import layernorm as ln  # noqa: E402

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="a checkout whose kernels/layernorm.py is timed too")
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--shapes", help="only these, e.g. 16384x768,32768x768+res (default: all of SHAPES)")
    ap.add_argument("--groups", default="", help="also time the backward at these row groups per SM, e.g. 1,4")
    args = ap.parse_args()
    copy = ln._copy_bandwidth()
    old = _load(args.old) if args.old else None
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy:.0f} GB/s")
    out = open(args.out, "a") if args.out else None
    for M, C, res in SHAPES:
        if args.shapes and f"{M}x{C}{'+res' if res else ''}" not in args.shapes.split(","):
            continue
        name = f"{M}x{C}{'+res' if res else ''}"
        row = dict(shape=name, device=torch.cuda.get_device_name(), copy_gbs=copy)
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
        if out:
            out.write(json.dumps(row) + "\n")
    if out:
        out.close()


if __name__ == "__main__":
    main()
