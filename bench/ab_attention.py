"""A/B of the attention kernels against another checkout's, on one GPU (the forward: Hopper).

    python bench/ab_attention.py --old DIR [--op fwd|bwd] [--out FILE]
    python bench/ab_attention.py --dq-groups 1,4,8,16 [--out FILE]
    python bench/ab_attention.py --dkdv-configs 32x4,32x5,32x6 [--out FILE]

DIR is a checkout of an earlier commit (e.g. `git worktree add /tmp/old HEAD~1`). --op fwd (default) times the Gluon
forward, kernels/attention_hopper.py's attention_fwd; --op bwd the backward, kernels/attention.py's
attention_block_bwd (dq + dK/dV; the old module's Triton kernels, and on Hopper the current Gluon dK/dV kernel).
For each shape and layout (the model's packed qkv views, and (B, H, T, D) memory) both modules tune as in training
(first call), then their GPU time (CUDA-graph replay) is taken in three interleaved rounds and each keeps its best:
the same D128 forward drifts 6-10% within seconds on an H100, so one timing each would compare moments, not
kernels. --dq-groups times this checkout's backward with each head-group size of the dq kernel's program order
(kernels/attention.py DQ_HEAD_GROUP) instead; --dkdv-configs times it at head dim 128 with each (query block, ring
stages) of the Gluon dK/dV kernel (kernels/attention_hopper.py BWD_CONFIGS).
"""
import argparse
import importlib.util
import os

import torch

import harness as H
from kernels import attention as A
from kernels import attention_hopper as new_hopper

SHAPES = [(16, 12, 1024, 64), (4, 16, 4096, 128), (8, 16, 2048, 64), (8, 16, 2048, 128)]


def _load(path, name):
    spec = importlib.util.spec_from_file_location(f"{name}_old", os.path.join(path, "kernels", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # (its `kernels.*` imports resolve to ours: the launcher did not change)
    return mod


def _knob_sweep(name, values, set_value, head_dims, out_path):
    """The backward's GPU time (packed qkv inputs) per value of one knob, set by set_value(v), interleaved rounds."""
    print(H.banner(f"ab_attention: {name} sweep"))
    rows = []
    for B, nh, T, D in [s for s in SHAPES if s[3] in head_dims]:
        q, k, v = A.split_qkv(torch.randn(B, T, 3 * nh * D, device="cuda", dtype=torch.bfloat16), nh)
        out, lse = A.attention_block_fwd(q, k, v, True)
        do = torch.randn_like(out)
        ms = {x: float("inf") for x in values}
        for _ in range(3):
            for x in values:
                set_value(x)
                ms[x] = min(ms[x], new_hopper._graph_ms(lambda: A.attention_block_bwd(do, q, k, v, out, lse, True)))
        rows.append(dict(B=B, H=nh, T=T, D=D, **{f"{name}{x}_ms": ms[x] for x in ms}))
        print(f"bwd B{B} H{nh} T{T} D{D} packed: " + ", ".join(f"{name} {x}: {t:.3f} ms" for x, t in ms.items()),
              flush=True)
    H.append_jsonl(out_path, rows)


def _dq_groups(groups, out_path):
    """The backward's GPU time per dq head-group size (both head-dim classes set alike)."""
    saved = dict(A.DQ_HEAD_GROUP)
    _knob_sweep("group", groups, lambda g: A.DQ_HEAD_GROUP.update({False: g, True: g}), (64, 128), out_path)
    A.DQ_HEAD_GROUP.update(saved)


def _dkdv_configs(configs, out_path):
    """The backward's GPU time at head dim 128 per (query block, ring stages) of the Gluon dK/dV kernel."""
    saved = list(new_hopper.BWD_CONFIGS[128])
    _knob_sweep("dkdv", configs, lambda c: new_hopper.BWD_CONFIGS.update({128: [c]}), (128,), out_path)
    new_hopper.BWD_CONFIGS[128] = saved


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="a checkout whose kernels are timed too")
    ap.add_argument("--dq-groups", help="comma-separated head-group sizes of the dq kernel to time (no --old)")
    ap.add_argument("--dkdv-configs", help="comma-separated BLOCK_QxNUM_BUF of the D128 dK/dV kernel (no --old)")
    ap.add_argument("--op", choices=["fwd", "bwd"], default="fwd")
    ap.add_argument("--out", help="append JSON lines here")
    args = ap.parse_args()
    if args.dq_groups:
        return _dq_groups([int(g) for g in args.dq_groups.split(",")], args.out)
    if args.dkdv_configs:
        return _dkdv_configs([tuple(int(n) for n in c.split("x")) for c in args.dkdv_configs.split(",")], args.out)
    if not args.old:
        ap.error("--old DIR (or --dq-groups)")
    new = new_hopper if args.op == "fwd" else A
    old = _load(args.old, new.__name__.split(".")[-1])
    print(H.banner(f"ab_attention {args.op}: this tree against {args.old}"))
    rows = []
    for B, nh, T, D in SHAPES:
        for packed in (True, False):
            if packed:
                q, k, v = A.split_qkv(torch.randn(B, T, 3 * nh * D, device="cuda", dtype=torch.bfloat16), nh)
            else:
                q, k, v = (torch.randn(B, nh, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            if args.op == "fwd":  # ours gets the Triton forward as its tuning candidate, as attention.py passes it
                kw = {"old": {}, "new": {"fallback": A.attention_block_fwd_triton}}
                calls = {name: (lambda m=m, name=name: m.attention_fwd(q, k, v, True, **kw[name]))
                         for name, m in (("old", old), ("new", new))}
            else:
                out, lse = A.attention_block_fwd(q, k, v, True)
                do = torch.randn_like(out)
                calls = {name: (lambda m=m: m.attention_block_bwd(do, q, k, v, out, lse, True))
                         for name, m in (("old", old), ("new", new))}
            for fn in calls.values():
                fn()  # tune this shape outside the graph capture
            ms = {name: float("inf") for name in calls}
            for _ in range(3):
                for name, fn in calls.items():
                    ms[name] = min(ms[name], new_hopper._graph_ms(fn))
            key = (D, True, 1 << (T - 1).bit_length(), min(1 << (B * nh - 1).bit_length(), 1024))
            cfg = {n: str(m._TUNED.get(key)) if args.op == "fwd" else "" for n, m in (("old", old), ("new", new))}
            row = dict(op=args.op, B=B, H=nh, T=T, D=D,
                       layout="packed" if packed else "bhtd", old_ms=ms["old"], new_ms=ms["new"],
                       old_config=cfg["old"], new_config=cfg["new"], speedup=ms["old"] / ms["new"])
            rows.append(row)
            tag = {n: f" ({cfg[n]})" if cfg[n] else "" for n in cfg}
            print(f"{args.op} B{B} H{nh} T{T} D{D} {row['layout']:>6}: old {ms['old']:.3f} ms{tag['old']}, new "
                  f"{ms['new']:.3f} ms{tag['new']}: {row['speedup']:.3f}x", flush=True)
    H.append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
