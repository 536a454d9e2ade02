"""End-to-end training throughput of GPT-2 on one GPU: nanopara's Triton kernels against PyTorch's best path.

Modes, all with the same model, batch, bf16 autocast and fused AdamW, in the same process:
    torch          PyTorch ops (SDPA, F.layer_norm, F.cross_entropy), eager
    torch+compile  the same model under torch.compile (the baseline the kernel issue must beat by 1.30x)
    triton         nanopara's kernels (flash attention, fused LayerNorm(+residual), fused cross-entropy), eager
    triton+compile nanopara's kernels as custom ops (kernels/ops.py), the rest (matmuls, GELU, adds) compiled
Variants append `:key=value` options to a mode (notes/e2e.md has the measurements):
    ce=inplace|op   triton loss: eager fused kernel, in place (a graph break under compile) | custom ops
    attn=sdpa       triton mode with PyTorch's SDPA instead of our attention (isolates the attention kernel)
    attn=triton     our attention with the Triton kernels only (no Gluon Hopper forward / dK-dV: their A/B)
    cmode=M         torch.compile(mode=M), e.g. max-autotune-no-cudagraphs, reduce-overhead
    graph=1         eager mode with each forward + backward replayed from a CUDA graph (nanopara/graph.py)
e.g. `--modes torch+compile,triton+compile:ce=op,triton+compile:attn=sdpa`.

    python bench/bench_gpt.py [--preset gpt2_124m] [--batch 32] [--seq 1024] [--steps 20] [--modes a,b] [--out F]
        [--profile DIR]   also profile one step per mode: top-15 kernels and time per kernel family

A step = forward + backward + clip + AdamW on one micro-batch of synthetic tokens (the loader costs ~nothing).
tokens/s from the median step time; TFLOP/s and MFU from nanopara/report.py's FLOP count and peak table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanopara.presets import PRESETS  # noqa: E402
from nanopara.parallel import build_engine  # noqa: E402
from nanopara.graph import GraphedMicroStep  # noqa: E402
from nanopara.mesh import Mesh  # noqa: E402
from nanopara.model import GPT, TorchOps, TritonOps  # noqa: E402
from nanopara.report import flops_per_token, peak_flops  # noqa: E402


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
    return kernels, comp == "compile", kv


def make_step(mode: str, args, mesh: Mesh):
    """Build model + engine for a mode; returns (cfg, model, engine, step_fn(batch) -> loss)."""
    kernels, compiled, kv = parse_mode(mode)
    cfg = PRESETS[args.preset]()
    cfg.model.kernels = kernels
    cfg.train.seq_len, cfg.train.micro_batch = args.seq, args.batch
    torch.manual_seed(0)
    model = GPT(cfg.model).to(mesh.device)
    from kernels import attention as attention_mod
    attention_mod.HOPPER_FWD = attention_mod.HOPPER_BWD = kv.get("attn") != "triton"  # read at each call
    if kernels == "triton":
        cls = _TritonSdpaOps if kv.get("attn") == "sdpa" else TritonOps
        model._ops[mesh.device.type] = cls(ce=kv.get("ce", "inplace"))
    engine = build_engine(model, mesh, cfg)
    if compiled:
        engine.model = torch.compile(engine.model, mode=kv.get("cmode"))

    if kv.get("graph") == "1":  # forward + backward replayed from a CUDA graph (train.py --train.cuda_graph)
        if compiled:
            raise ValueError(f"{mode}: graph=1 is for eager modes (compiled ones use cmode=reduce-overhead)")
        graphed = GraphedMicroStep(engine.model, lambda: torch.autocast("cuda", dtype=torch.bfloat16), 1.0, engine)

        def step(b):
            loss = graphed(b[:, :-1], b[:, 1:])
            engine.step(1e-4)
            return loss
        return cfg, model, engine, step

    def step(b):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = engine.model(b[:, :-1], b[:, 1:])
        engine.backward(loss)
        engine.step(1e-4)
        return loss

    return cfg, model, engine, step


def run_mode(mode: str, args, mesh: Mesh) -> dict:
    cfg, model, engine, step = make_step(mode, args, mesh)
    n_params = model.num_params()
    g = torch.Generator(device=mesh.device).manual_seed(0)
    batches = [torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq + 1), device=mesh.device, generator=g)
               for _ in range(4)]
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        b = batches[i % len(batches)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(b)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
    dt = statistics.median(times)
    tok_s = args.batch * args.seq / dt
    tflops = flops_per_token(cfg.model, n_params, cfg.train.seq_len) * tok_s / 1e12
    peak = peak_flops(mesh.device)
    res = {"mode": mode, "preset": args.preset, "batch": args.batch, "seq": args.seq, "step_ms": dt * 1e3,
           "tokens_per_s": tok_s, "tflops": tflops, "mfu": tflops * 1e12 / peak if peak else 0.0,
           "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9, "loss_last": losses[-1],
           "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    if args.profile:
        profile_step(mode, step, batches[0], args.profile)
    del engine, model, batches, step
    torch.cuda.empty_cache()
    return res


# kernel families for the profile summary: first match wins (lower-case substrings of the kernel name)
FAMILIES = [("attention", ("_attn_", "flash", "fmha", "cudnn", "sdpa")),
            ("layernorm", ("_layernorm", "layer_norm")),
            ("cross-entropy", ("_ce_", "_row_", "_scale_kernel", "cross_entropy", "log_softmax", "nll_loss")),
            ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk")),
            ("optimizer+clip", ("adam", "multi_tensor", "foreach", "_amp_", "norm")),
            ("inductor fused", ("triton_",)), ("other", ("",))]


def profile_step(mode, step, batch, out_dir):
    """Profile one (warm) step: print the top-15 kernels by device time and the time per kernel family."""
    from torch.profiler import ProfilerActivity, profile
    os.makedirs(out_dir, exist_ok=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(batch)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events)
    fam = {}
    for e in events:
        name = e.key.lower()
        f = next(f for f, keys in FAMILIES if any(k in name for k in keys))
        fam[f] = fam.get(f, 0) + e.self_device_time_total
    lines = [f"profile {mode}: GPU kernel time {total / 1e3:.1f} ms in one step"]
    lines += [f"  {f:16s} {t / 1e3:7.2f} ms {100 * t / total:5.1f}%"
              for f, t in sorted(fam.items(), key=lambda x: -x[1])]
    lines += [f"  top-15 kernels (ms, calls, name):"]
    lines += [f"  {e.self_device_time_total / 1e3:7.2f} {e.count:4d}  {e.key[:110]}" for e in events[:15]]
    text = "\n".join(lines)
    print(text, flush=True)
    safe = mode.replace(":", "_").replace("=", "-").replace("+", "_")
    with open(os.path.join(out_dir, f"profile_{safe}.txt"), "w") as fh:
        fh.write(text + "\n\n" + prof.key_averages().table(sort_by="self_device_time_total", row_limit=60))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt2_124m", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--modes", default="torch,torch+compile,triton,triton:graph=1,triton+compile")
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    ap.add_argument("--profile", default=None, metavar="DIR", help="profile one step per mode, tables into DIR")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup = 10, 5
    if not torch.cuda.is_available():
        sys.exit("bench_gpt.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    mesh = Mesh.build(device="cuda")
    rows = []
    for mode in args.modes.split(","):
        torch._dynamo.reset()  # each mode compiles its own model from scratch
        try:
            rows.append(run_mode(mode, args, mesh))
        except Exception as e:  # one failing mode must not hide the others' numbers
            print(f"{mode}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            print("".join(traceback.format_exc())[-1500:], file=sys.stderr, flush=True)
            continue
        r = rows[-1]
        print(f"{mode:32s} {r['step_ms']:8.1f} ms  {r['tokens_per_s']:>10,.0f} tok/s  {r['tflops']:6.1f} TFLOP/s  "
              f"MFU {r['mfu'] * 100:5.1f}%  mem {r['peak_mem_gb']:5.1f} GB  loss {r['loss_last']:.3f}", flush=True)
    base = next((r for r in rows if r["mode"] == "torch+compile"), None)
    print(f"\n{rows[0]['gpu'] if rows else ''} {args.preset} B={args.batch} T={args.seq} bf16")
    print(f"{'mode':32s} {'tok/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s} {'mem GB':>7s} {'vs torch.compile':>17s}")
    for r in rows:
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        r["vs_torch_compile"] = ratio
        print(f"{r['mode']:32s} {r['tokens_per_s']:>10,.0f} {r['tflops']:8.1f} {r['mfu'] * 100:5.1f}% "
              f"{r['peak_mem_gb']:7.1f} {ratio:16.2f}x")
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
