"""Tensor-parallel benchmark: throughput, MFU, memory, communication share, and SP's activation memory.

    torchrun --nproc_per_node=N bench/bench_tp.py [--preset gpt2_124m|gpt_1b] [--sp] [--quick] [--out FILE]

All N GPUs form one tp group (dp = 1); bf16 autocast, model.kernels="torch" (SDPA, F.layer_norm, ...), fused
AdamW, synthetic tokens (the same on every rank, as a tp group needs). Four sections, rank 0 prints:

1. baseline   the unsharded model on one GPU (each rank runs its own copy, no communication): tok/s, MFU.
2. tp         the same global batch over N GPUs: tok/s, MFU over N GPUs, peak memory per GPU (max over ranks),
              and the ratio to the baseline's MFU (1.0 = TP costs nothing per GPU).
3. comm       a few more steps with every collective bracketed by CUDA events on the compute stream, i.e. the
              time the step waits for it: ms per step by (op, size), calls per layer, bus bandwidth
              (all-reduce moves 2(N-1)/N of the tensor per rank, all-gather/reduce-scatter (N-1)/N).
4. act mem    activation memory per layer, SP off vs on: memory allocated across each block's forward (what the
              block keeps for backward, plus its output), next to Korthikanti et al. 2022 (Table 2), bytes per layer
                  TP:      s*b*h*(10 + 24/t + 5*a*s/(h*t))        TP+SP:  s*b*h/t * (34 + 5*a*s/h)
              and the same count for this model: flash attention keeps no s^2 scores, dropout 0 keeps no masks,
              and the residual stream / LayerNorm inputs are fp32 under autocast (4 bytes, not 2):
                  TP:      s*b*h*(12 + 24/t)                      TP+SP:  s*b*h/t * 36

MFU = (6 * params + 12 * n_layer * n_embd * T) * tokens/s / (N * 989 TFLOP/s), the dense bf16 peak of H100/H200.
Runs in ~1-3 minutes at the defaults.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanopara import comm, tp as tpmod  # noqa: E402
from nanopara.presets import PRESETS  # noqa: E402
from nanopara.mesh import Mesh  # noqa: E402
from nanopara.model import GPT  # noqa: E402

PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt2_124m", choices=["gpt2_124m", "gpt_1b"])
    ap.add_argument("--sp", action="store_true", help="sequence parallel in the tp and comm sections")
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--micro_batch", type=int, default=0, help="sequences per step (default: the preset's)")
    ap.add_argument("--seq_len", type=int, default=1024)
    return ap.parse_args()


def build(cfg, mesh, sp, shard=True):
    torch.manual_seed(1337)
    with torch.device(mesh.device):
        model = GPT(cfg.model)
    if shard and mesh.tp > 1:
        tpmod.apply_tp(model, mesh, sp=sp)
    return model


def train_steps(model, opt, mesh, x, y, n):
    for _ in range(n):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        tpmod.sync_partial_grads(model, mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss


def timed(model, mesh, x, y, warmup, steps):
    """Seconds per step (slowest rank) and peak memory (GB, max over ranks) of `steps` AdamW steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    train_steps(model, opt, mesh, x, y, warmup)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    train_steps(model, opt, mesh, x, y, steps)
    torch.cuda.synchronize()
    buf = torch.tensor([(time.perf_counter() - t0) / steps, torch.cuda.max_memory_allocated() / 1e9],
                       device=mesh.device)
    if mesh.world > 1:
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return buf[0].item(), buf[1].item(), opt


class CommTimer:
    """Wraps the torch.distributed collectives comm.py calls, recording CUDA events around each while `on`."""

    def __init__(self):
        self.on, self.records = False, []
        names = ["all_reduce", comm._gather_fn().__name__, comm._reduce_scatter_fn().__name__]
        for name in names:
            self._wrap(name)

    def _wrap(self, name):
        orig = getattr(dist, name)
        full_arg = 0 if name == "all_reduce" else (1 if "reduce_scatter" in name else 0)  # the N-rank-sized one

        def wrapper(*args, **kwargs):
            if not self.on:
                return orig(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = orig(*args, **kwargs)
            end.record()
            t = args[full_arg]
            self.records.append((name, t.numel() * t.element_size(), start, end))
            return out
        setattr(dist, name, wrapper)

    def table(self, steps, n, n_layer, step_s):
        torch.cuda.synchronize()
        agg = {}
        for name, nbytes, s, e in self.records:
            a = agg.setdefault((name, nbytes), [0, 0.0])
            a[0] += 1
            a[1] += s.elapsed_time(e)
        rows = []
        for (name, nbytes), (calls, ms) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
            factor = 2 * (n - 1) / n if name == "all_reduce" else (n - 1) / n
            rows.append({"op": name, "mb": nbytes / 1e6, "calls_per_step": calls / steps,
                         "calls_per_layer": calls / steps / n_layer, "ms_per_step": ms / steps,
                         "ms_per_call": ms / calls, "busbw_gb_s": nbytes * factor / (ms / calls / 1e3) / 1e9})
        total = sum(r["ms_per_step"] for r in rows)
        return rows, total, total / (step_s * 1e3)


def activation_memory(cfg, mesh, sp, x, y):
    """Bytes each block keeps after its forward (mean over blocks), and of the whole forward."""
    model = build(cfg, mesh, sp)
    deltas, marks = [], {}

    def pre(mod, args):
        marks[id(mod)] = torch.cuda.memory_allocated()

    def post(mod, args, out):
        deltas.append(torch.cuda.memory_allocated() - marks[id(mod)])
    for block in model.transformer.h:
        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)
    torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(x, y)
    whole = torch.cuda.memory_allocated() - m0
    del loss, model
    torch.cuda.empty_cache()
    return sum(deltas) / len(deltas), whole


def formulas(s, b, h, a, t, sp):
    paper = s * b * h / t * (34 + 5 * a * s / h) if sp else s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    ours = s * b * h / t * 36 if sp else s * b * h * (12 + 24 / t)
    return paper, ours


def main():
    args = parse()
    n = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = PRESETS[args.preset]()
    cfg.model.kernels = "torch"
    B, T = args.micro_batch or cfg.train.micro_batch, args.seq_len
    cfg.train.seq_len = T
    cfg.parallel.tp, cfg.parallel.sp = n, args.sp and n > 1
    cfg.check()  # heads / width / sequence divisible by N: one line, before any GPU work
    mesh = Mesh.build(dp=1, tp=n, device="cuda")
    log = print if mesh.is_main else (lambda *a, **k: None)
    timer = CommTimer()
    warmup, steps = (2, 4) if args.quick else (3, 10)
    m = cfg.model
    gen = torch.Generator(device=mesh.device).manual_seed(1234)  # same tokens on every rank
    x = torch.randint(0, m.vocab_size, (B, T), device=mesh.device, generator=gen)
    y = torch.randint(0, m.vocab_size, (B, T), device=mesh.device, generator=gen)
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK.items() if k in name), 989e12)
    with torch.device("meta"):
        n_params = GPT(m).num_params()
    fpt = 6 * n_params + 12 * m.n_layer * m.n_embd * T
    tokens = B * T
    res = {"preset": args.preset, "gpu": name, "n_gpu": n, "sp": cfg.parallel.sp, "micro_batch": B, "seq_len": T,
           "params": n_params, "torch": torch.__version__, "date": datetime.date.today().isoformat()}
    log(f"{args.preset} ({n_params / 1e6:.0f}M params) | {n} x {name} | B={B} T={T} | bf16 autocast, kernels=torch"
        f" | sp={cfg.parallel.sp}")

    # 1. baseline: one GPU, the whole model (every rank alone, nothing to wait for)
    model = build(cfg, mesh, sp=False, shard=False)
    base_s, base_mem, opt = timed(model, mesh, x, y, warmup, steps)
    del model, opt
    torch.cuda.empty_cache()
    base_mfu = fpt * tokens / base_s / peak
    res["baseline"] = {"tokens_per_s": tokens / base_s, "mfu": base_mfu, "peak_mem_gb": base_mem}
    log(f"[1 GPU ] {tokens / base_s:12,.0f} tok/s | MFU {base_mfu * 100:5.1f}% | peak mem {base_mem:6.2f} GB")

    # 2. tensor parallel over N GPUs
    model = build(cfg, mesh, cfg.parallel.sp)
    step_s, mem, opt = timed(model, mesh, x, y, warmup, steps)
    mfu = fpt * tokens / step_s / (n * peak)
    res["tp"] = {"tokens_per_s": tokens / step_s, "mfu": mfu, "peak_mem_gb": mem, "step_ms": step_s * 1e3,
                 "mfu_vs_1gpu": mfu / base_mfu}
    log(f"[tp={n:<3d}] {tokens / step_s:12,.0f} tok/s | MFU {mfu * 100:5.1f}% | peak mem {mem:6.2f} GB/GPU | "
        f"{step_s * 1e3:.1f} ms/step | MFU / 1-GPU MFU = {mfu / base_mfu:.2f}")

    # 3. communication: the same steps, collectives timed
    if n > 1:
        timer.on = True
        train_steps(model, opt, mesh, x, y, steps)
        timer.on = False
        rows, comm_ms, share = timer.table(steps, n, m.n_layer, step_s)
        res["comm"] = {"ms_per_step": comm_ms, "share_of_step": share, "ops": rows}
        log(f"[comm  ] {comm_ms:.1f} ms/step waiting on collectives = {share * 100:.1f}% of the step")
        log(f"  {'op':22s} {'MB':>9s} {'calls/step':>10s} {'/layer':>7s} {'ms/step':>8s} {'ms/call':>8s} "
            f"{'busbw GB/s':>10s}")
        for r in rows:
            log(f"  {r['op']:22s} {r['mb']:9.3f} {r['calls_per_step']:10.1f} {r['calls_per_layer']:7.2f} "
                f"{r['ms_per_step']:8.2f} {r['ms_per_call']:8.3f} {r['busbw_gb_s']:10.1f}")
    del model, opt
    torch.cuda.empty_cache()

    # 4. activation memory per layer, SP off and on (bf16 activations, so the formulas count bytes)
    res["act_mem"] = []
    log(f"[act   ] per layer, s={T} b={B} h={m.n_embd} a={m.n_head} t={n}: measured | Korthikanti 2022 | this model")
    for sp in ((False, True) if n > 1 else (False,)):
        per_layer, whole = activation_memory(cfg, mesh, sp, x, y)
        paper, ours = formulas(T, B, m.n_embd, m.n_head, n, sp)
        res["act_mem"].append({"sp": sp, "measured_per_layer_mb": per_layer / 1e6, "paper_mb": paper / 1e6,
                               "this_model_mb": ours / 1e6, "forward_total_mb": whole / 1e6})
        log(f"  sp={str(sp):5s} {per_layer / 1e6:9.1f} MB | {paper / 1e6:9.1f} MB | {ours / 1e6:9.1f} MB   "
            f"(whole forward incl. embeddings/logits: {whole / 1e9:.2f} GB)")

    if args.out and mesh.is_main:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
        log(f"wrote {args.out}")
    mesh.destroy()


if __name__ == "__main__":
    main()
