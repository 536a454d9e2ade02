"""Plan a run before renting the GPUs: predicted peak memory and step time of a layout, or the best layouts of N GPUs.

    python plan.py --preset=gpt_1b --parallel.tp=2 --train.micro_batch=8 --gpus=2     # one layout (train.py's keys)
    python plan.py --model=llama3_70b --gpus=1024 [--gpu=H100] [--tokens=16777216]    # search: best layouts first
    python plan.py --layers=48 --d=6144 --heads=48 --kv_heads=8 --ffn=16384 --swiglu --vocab=128256 --gpus=64
    python plan.py --check        # predicted against measured for results/plan_manifest.jsonl (plan_check.txt)
    python plan.py --published    # public Llama 3 runs on H100 against the prediction (notes/planner.md)

A layout prints its memory per GPU (parameters, gradients, optimizer states, bf16 weights, activations, logits,
workspace, communication buffers, allocator slack) and whether it fits, then its step time by item (GEMMs,
attention, memory-bound kernels, each axis's exposed communication, the pipeline bubble, the host floor), tokens/s
and MFU. A search prints the fastest layouts that fit with what dominates each. --fabric_gbs / --gpus_per_node
override the inter-node fabric (nanopara/gpus.py FABRIC); --fp8=tensor searches FP8 layouts. Bad input is one line
on stderr and exit code 2. The model: nanopara/planner.py, plan_time.py; the GPU table: nanopara/gpus.py.
"""
from __future__ import annotations

import argparse
import sys

from nanopara import gpus as G
from nanopara.config import ConfigError
from nanopara.planner import Model, PlanError


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=0, help="GPU count (a train.py layout: its world size)")
    ap.add_argument("--gpu", default="H100", help="GPU type: " + ", ".join(G.table()))
    ap.add_argument("--model", default="", help="a preset or llama3_8b / llama3_70b / llama3_405b (search)")
    ap.add_argument("--tokens", type=int, default=0, help="tokens a step (default: the model's)")
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default: the model's)")
    for k in ("layers", "d", "heads", "kv_heads", "ffn", "vocab", "experts", "top_k"):
        ap.add_argument(f"--{k}", type=int, default=0)
    ap.add_argument("--swiglu", action="store_true")
    ap.add_argument("--fp8", default="none", choices=["none", "tensor", "row", "block"])
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--fabric_gbs", type=float, default=0.0, help="inter-node GB/s a GPU (default: gpus.FABRIC)")
    ap.add_argument("--gpus_per_node", type=int, default=0)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--published", action="store_true")
    own = [a for a in argv if "." not in a.split("=")[0] and not a.startswith("--preset")]
    return ap.parse_args(own), [a for a in argv if a not in own]


def fabric(args) -> dict:
    fab = dict(G.FABRIC)
    if args.fabric_gbs:
        fab["nic_gbs"] = args.fabric_gbs
    if args.gpus_per_node:
        fab["gpus_per_node"] = args.gpus_per_node
    return fab


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, keys = parse(argv)
        if args.check:
            from nanopara.plan_check import check, render
            print(render(check()))
            return 0
        if args.published:
            from nanopara.plan_published import render
            print(render())
            return 0
        if keys:  # one layout, given as train.py's keys
            from nanopara.cli import parse_args
            from nanopara.plan_run import fmt_layout, predict_config
            cfg = parse_args(keys)
            p = predict_config(cfg, args.gpus or 1, args.gpu, fabric(args))
            print(fmt_layout(p))
            return 0
        from nanopara.plan_search import named_model, search
        if args.layers:
            model = Model(name="custom", n_layer=args.layers, d=args.d, n_head=args.heads, kv_heads=args.kv_heads,
                          ffn=args.ffn, vocab=args.vocab or 50304, swiglu=args.swiglu, tied=not args.swiglu,
                          positions=0 if args.swiglu else 1024, experts=args.experts, top_k=args.top_k or 2)
            seq, tokens = 8192 if args.swiglu else 1024, 2 ** 22
        else:
            model, seq, tokens = named_model(args.model or "gpt2_124m")
        seq, tokens = args.seq or seq, args.tokens or tokens
        if args.gpus < 1:
            raise PlanError("--gpus=N: how many GPUs to plan for (1 to 16384)")
        res = search(model, args.gpus, seq, tokens, args.gpu, args.top, args.fp8, fabric(args))
        print(f"{model.name}: {model.params() / 1e9:.2f}B parameters, {tokens:,} tokens a step of {seq}-token "
              f"sequences, {args.gpus} x {G.lookup(args.gpu).name}: {res['fit']} of {res['tried']} layouts fit")
        for i, (lay, p, why) in enumerate(res["ranked"]):
            print(f"{i + 1}. {lay.label():52s} {p['tokens_per_s']:13,.0f} tok/s  MFU {p['mfu']:5.1%}  {why}")
        return 0
    except (PlanError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
