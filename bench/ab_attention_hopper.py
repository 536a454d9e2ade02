"""A/B of the Gluon attention forward (kernels/attention_hopper.py) against another checkout's, on one Hopper GPU.

    python bench/ab_attention_hopper.py --old DIR [--out FILE]

DIR is a checkout of an earlier commit (e.g. `git worktree add /tmp/old HEAD~1`). For each shape and layout (the
model's packed qkv views, and (B, H, T, D) memory) both modules tune their forward as in training (first call), then
their GPU time (CUDA-graph replay) is taken in three interleaved rounds and each keeps its best: the same D128
forward drifts 6-10% within seconds on an H100 (results/attention_h100_s8.txt), so one timing each would compare
moments, not kernels.
"""
import argparse
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import attention as A  # noqa: E402
from kernels import attention_hopper as new  # noqa: E402

SHAPES = [(16, 12, 1024, 64), (4, 16, 4096, 128), (8, 16, 2048, 64), (8, 16, 2048, 128)]


def _load(path):
    spec = importlib.util.spec_from_file_location("attention_hopper_old",
                                                  os.path.join(path, "kernels", "attention_hopper.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # (its `kernels.launch` import resolves to ours: the launcher did not change)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="a checkout whose kernels/attention_hopper.py is timed too")
    ap.add_argument("--out", help="also write JSON lines here")
    args = ap.parse_args()
    old = _load(args.old)
    print(torch.cuda.get_device_name())
    rows = []
    for B, H, T, D in SHAPES:
        for packed in (True, False):
            if packed:
                q, k, v = A.split_qkv(torch.randn(B, T, 3 * H * D, device="cuda", dtype=torch.bfloat16), H)
            else:
                q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            mods = {"old": old, "new": new}
            for m in mods.values():
                m.attention_fwd(q, k, v, True)  # tune this shape outside the graph capture
            ms = {name: float("inf") for name in mods}
            for _ in range(3):
                for name, m in mods.items():
                    ms[name] = min(ms[name], new._graph_ms(lambda: m.attention_fwd(q, k, v, True)))
            key = (D, True, 1 << (T - 1).bit_length(), min(1 << (B * H - 1).bit_length(), 1024))
            row = dict(gpu=torch.cuda.get_device_name(), B=B, H=H, T=T, D=D, layout="packed" if packed else "bhtd",
                       old_ms=ms["old"], new_ms=ms["new"], old_config=str(old._TUNED[key]),
                       new_config=str(new._TUNED[key]), speedup=ms["old"] / ms["new"])
            rows.append(row)
            print(f"B{B} H{H} T{T} D{D} {row['layout']:>6}: old {ms['old']:.3f} ms ({row['old_config']}), new "
                  f"{ms['new']:.3f} ms ({row['new_config']}): {row['speedup']:.3f}x", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
