"""End-to-end training throughput of GPT-2 on one GPU: nanopara's Triton kernels against PyTorch's best path.

Modes, each train.py's step (parallel.parallelize -> Trainer: bf16 autocast, clip, fused AdamW) on the same model
and batch, in one process:
    torch          PyTorch ops (SDPA, F.layer_norm, F.cross_entropy), eager
    torch+compile  the same model under torch.compile (the baseline the kernel issue must beat by 1.30x)
    triton         nanopara's kernels (flash attention, fused LayerNorm(+residual), fused cross-entropy), eager
    triton+compile nanopara's kernels as custom ops (kernels/ops.py), the rest (matmuls, GELU, adds) compiled
Variants append `:key=value` options to a mode (notes/e2e.md has the measurements):
    ce=inplace|op   triton loss: eager fused kernel, in place (a graph break under compile) | custom ops
    attn=sdpa       triton mode with PyTorch's SDPA instead of our attention (isolates the attention kernel)
    attn=triton     our attention with the Triton kernels only (no Gluon Hopper forward / dK-dV: their A/B)
    cmode=M         torch.compile(mode=M), e.g. max-autotune-no-cudagraphs, reduce-overhead
    graph=1         eager mode with each forward + backward replayed from a CUDA graph (train.cuda_graph=true)
e.g. `--modes torch+compile,triton+compile:ce=op,triton+compile:attn=sdpa`.

    python bench/bench_gpt.py [--preset gpt2_124m] [--batch 32] [--seq 1024] [--steps 20] [--modes a,b] [--out F]
        [--profile]   also profile one step per mode: GPU ms per kernel kind and the costliest kernels

A step = one micro-batch of synthetic tokens. tokens/s from the median step; TFLOP/s and MFU (report.py); every
mode's ratio to torch+compile.
"""
from __future__ import annotations

import argparse
import sys
import traceback

import torch

import harness as H
from nanopara.mesh import Mesh
from nanopara.model import TorchOps, TritonOps
from nanopara.report import flops_per_token


class _TritonSdpaOps(TritonOps):
    """Our kernels except attention, which is PyTorch's SDPA (cuDNN/flash): isolates the attention kernel."""
    attention_qkv = staticmethod(TorchOps.attention_qkv)


def parse_mode(mode: str):
    """'triton+compile:ce=op:cmode=X' -> ('triton', True, {'ce': 'op', 'cmode': 'X'})"""
    base, *opts = mode.split(":")
    kernels, _, comp = base.partition("+")
    if kernels not in ("torch", "triton") or comp not in ("", "compile"):
        raise ValueError(f"unknown mode {mode!r}")
    kv = dict(o.split("=", 1) for o in opts)
    unknown = set(kv) - {"ce", "attn", "cmode", "graph"}
    if unknown:
        raise ValueError(f"unknown mode options {sorted(unknown)} in {mode!r}")
    if kv.get("graph") == "1" and comp:
        raise ValueError(f"{mode}: graph=1 is for eager modes (compiled ones use cmode=reduce-overhead)")
    return kernels, comp == "compile", kv


def make_trainer(mode: str, args, mesh: Mesh):
    """The mode's Trainer: its kernels and ops on the model before parallelize, torch.compile and CUDA graph
    through the config (cmode: a compile mode of its own, applied to the engine's model)."""
    kernels, compiled, kv = parse_mode(mode)
    cfg = H.make_cfg(args.preset, {"model.kernels": kernels, "train.seq_len": args.seq, "train.micro_batch": args.batch,
                                   "train.compile": compiled and "cmode" not in kv,
                                   "train.cuda_graph": "true" if kv.get("graph") == "1" else "false"})
    from kernels import attention as attention_mod
    attention_mod.HOPPER_FWD = attention_mod.HOPPER_BWD = kv.get("attn") != "triton"  # read at each call

    def prepare(model):
        if kernels == "triton":
            cls = _TritonSdpaOps if kv.get("attn") == "sdpa" else TritonOps
            model._ops[mesh.device.type] = cls(ce=kv.get("ce", "inplace"))
    trainer, n_params = H.build_trainer(cfg, mesh, prepare)
    if compiled and "cmode" in kv:
        trainer.engine.model = torch.compile(trainer.engine.model, mode=kv["cmode"])
    return cfg, trainer, n_params


def run_mode(mode: str, args, mesh: Mesh) -> dict:
    cfg, trainer, n_params = make_trainer(mode, args, mesh)
    batches = H.synthetic_batches(cfg, 1, mesh.device)

    def step():
        return H.train_step(trainer, batches)
    t = H.timed(step, args.steps, args.warmup, mesh=mesh, each=True, peak_from_start=cfg.train.cuda_graph == "true")
    tok_s = args.batch * args.seq / t["median_s"]
    res = {"mode": mode, "preset": args.preset, "batch": args.batch, "seq": args.seq, "step_ms": t["median_s"] * 1e3,
           "tokens_per_s": tok_s, "tflops": flops_per_token(cfg.model, n_params, args.seq) * tok_s / 1e12,
           "mfu": H.mfu(cfg, n_params, tok_s, 1, mesh.device), "peak_mem_gb": t["peak_gb"],
           "loss_last": t["last"].item()}
    if args.profile:
        res["profile"] = H.kernel_summary(H.profile(step, mesh.device))
        print(H.summary_lines(res["profile"], mode), flush=True)
    trainer.close()
    del trainer, batches
    H.free()
    return res


COLS = [("mode", "mode", ""), ("step_ms", "ms", ".1f"), ("tokens_per_s", "tok/s", ",.0f"), ("tflops", "TFLOP/s", ".1f"),
        ("mfu", "MFU", ".1%"), ("peak_mem_gb", "mem GB", ".1f"), ("loss_last", "loss", ".3f"),
        ("vs_torch_compile", "vs torch.compile", ".2f")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt2_124m", choices=sorted(H.PRESETS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--modes", default="torch,torch+compile,triton,triton:graph=1,triton+compile")
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    ap.add_argument("--profile", action="store_true", help="profile one step per mode")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 10, 5
    if not torch.cuda.is_available():
        sys.exit("bench_gpt.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    mesh = Mesh.build(device="cuda")
    print(H.banner(f"bench_gpt {args.preset} B={args.batch} T={args.seq} bf16", mesh), flush=True)
    rows = []
    for mode in args.modes.split(","):
        torch._dynamo.reset()  # each mode compiles its own model from scratch
        try:
            rows.append(run_mode(mode, args, mesh))
        except Exception as e:  # one failing mode must not hide the others' numbers
            print(f"{mode}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            print(traceback.format_exc()[-1500:], file=sys.stderr, flush=True)
            continue
        print(H.table(rows[-1:], COLS[:-1]), flush=True)
    base = next((r for r in rows if r["mode"] == "torch+compile"), None)
    for r in rows:
        r["vs_torch_compile"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
    print("\n" + H.table(rows, COLS))
    H.append_jsonl(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
