"""Tensor-parallel benchmark: throughput, MFU, memory, communication share, and SP's activation memory.

    torchrun --nproc_per_node=N bench/bench_tp.py [--preset gpt2_124m|gpt_1b] [--sp] [--quick] [--out F.jsonl]

All N GPUs form one tp group (dp = 1); train.py's step (parallel.parallelize -> Trainer: bf16 autocast, clip, fused
AdamW), model.kernels="torch" (SDPA, F.layer_norm, ...), synthetic tokens (the same on every rank, as a tp group
needs). Four sections, rank 0 prints, --out appends one JSON line per section:
1. baseline   the unsharded model on one GPU (each rank trains its own copy on a world-of-one mesh): tok/s, MFU.
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
MFU: report.flops_per_token over the dense bf16 peak of the GPUs. ~1-3 minutes at the defaults. --device cpu: 1-2.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import harness as H
from nanopara import comm
from nanopara.mesh import Mesh


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt2_124m", choices=sorted(H.PRESETS))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: sections 1-2, a smoke run")
    ap.add_argument("--sp", action="store_true", help="sequence parallel in the tp and comm sections")
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--out", default="", help="append JSON lines here")
    ap.add_argument("--micro_batch", type=int, default=0, help="sequences per step (default: the preset's)")
    ap.add_argument("--seq_len", type=int, default=1024)
    return ap.parse_args()


def make_cfg(args, n: int, sp: bool):
    return H.make_cfg(args.preset, {"model.kernels": "torch", "train.seq_len": args.seq_len, "parallel.dp": 1,
                                    "train.micro_batch": args.micro_batch or H.PRESETS[args.preset]().train.micro_batch,
                                    "train.tokens_per_step": 0, "parallel.tp": n, "parallel.sp": sp and n > 1})


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


def activation_memory(cfg, mesh, batches):
    """Bytes each block keeps after its forward (mean over blocks), and of the whole forward."""
    trainer, _ = H.build_trainer(cfg, mesh)
    deltas, marks = [], {}

    def pre(mod, args):
        marks[id(mod)] = torch.cuda.memory_allocated()

    def post(mod, args, out):
        deltas.append(torch.cuda.memory_allocated() - marks[id(mod)])
    for block in trainer.model.transformer.h:
        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)
    torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated()
    with trainer.amp():
        _, loss = trainer.model(*batches[0])
    whole = torch.cuda.memory_allocated() - m0
    trainer.engine.close()
    del loss, trainer
    H.free()
    return sum(deltas) / len(deltas), whole


def formulas(s, b, h, a, t, sp):
    paper = s * b * h / t * (34 + 5 * a * s / h) if sp else s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    ours = s * b * h / t * 36 if sp else s * b * h * (12 + 24 / t)
    return paper, ours


def steps(trainer, batches, mesh, warmup, n):
    return H.timed(lambda: H.train_step(trainer, batches), n, warmup, mesh=mesh)


def main():
    args = parse()
    n = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = make_cfg(args, n, args.sp)  # heads / width / sequence divisible by N: one line, before any GPU work
    mesh = Mesh.build(dp=1, tp=n, device=args.device)
    log, timer, (warmup, k) = H.printer(mesh), CommTimer(), (2, 4) if args.quick else (3, 10)
    m, B, T = cfg.model, cfg.train.micro_batch, cfg.train.seq_len
    batches = H.synthetic_batches(cfg, 1, mesh.device)  # the same tokens on every rank
    log(H.banner(f"bench_tp {args.preset} B={B} T={T} kernels=torch sp={cfg.parallel.sp}", mesh))
    emit = lambda row: H.append_jsonl(args.out if mesh.is_main else "", dict(row, preset=args.preset, n_gpu=n,  # noqa
                                                                            micro_batch=B, seq_len=T))
    # 1. baseline: one GPU, the whole model (every rank alone, nothing to wait for)
    trainer, n_params = H.build_trainer(make_cfg(args, 1, False), H.solo_mesh(mesh.device))
    t = steps(trainer, batches, mesh, warmup, k)
    trainer.engine.close()
    del trainer
    H.free()
    base = {"section": "baseline", "tokens_per_s": B * T / t["step_s"], "peak_mem_gb": t["peak_gb"],
            "mfu": H.mfu(cfg, n_params, B * T / t["step_s"], 1, mesh.device)}
    # 2. tensor parallel over N GPUs
    trainer, _ = H.build_trainer(cfg, mesh)
    t = steps(trainer, batches, mesh, warmup, k)
    tp = {"section": "tp", "tokens_per_s": B * T / t["step_s"], "peak_mem_gb": t["peak_gb"], "step_ms": t["step_s"]
          * 1e3, "mfu": H.mfu(cfg, n_params, B * T / t["step_s"], n, mesh.device), "sp": cfg.parallel.sp}
    tp["mfu_vs_1gpu"] = tp["mfu"] / base["mfu"] if base["mfu"] else None
    log(H.table([dict(base, layout="1 GPU"), dict(tp, layout=f"tp={n}")], [
        ("layout", "layout", ""), ("tokens_per_s", "tok/s", ",.0f"), ("mfu", "MFU", ".1%"),
        ("peak_mem_gb", "peak GB/GPU", ".2f"), ("mfu_vs_1gpu", "MFU / 1-GPU MFU", ".2f")]))
    emit(base)
    emit(tp)
    if mesh.device.type != "cuda":  # (CUDA events and memory: sections 3 and 4 on GPU only)
        return mesh.destroy()
    # 3. communication: the same steps, collectives timed
    if n > 1:
        timer.on = True
        steps(trainer, batches, mesh, 0, k)
        timer.on = False
        rows, comm_ms, share = timer.table(k, n, m.n_layer, t["step_s"])
        log(f"{comm_ms:.1f} ms/step waiting on collectives = {share * 100:.1f}% of the step\n" + H.table(rows, [
            ("op", "op", ""), ("mb", "MB", ".3f"), ("calls_per_step", "calls/step", ".1f"),
            ("calls_per_layer", "/layer", ".2f"), ("ms_per_step", "ms/step", ".2f"), ("ms_per_call", "ms/call", ".3f"),
            ("busbw_gb_s", "busbw GB/s", ".1f")]))
        emit({"section": "comm", "ms_per_step": comm_ms, "share_of_step": share, "ops": rows})
    trainer.engine.close()
    del trainer
    H.free()
    # 4. activation memory per layer, SP off and on (bf16 activations, so the formulas count bytes)
    act = []
    for sp in ((False, True) if n > 1 else (False,)):
        per_layer, whole = activation_memory(make_cfg(args, n, sp), mesh, batches)
        paper, ours = formulas(T, B, m.n_embd, m.n_head, n, sp)
        act.append({"section": "act_mem", "sp": sp, "measured_per_layer_mb": per_layer / 1e6, "paper_mb": paper / 1e6,
                    "this_model_mb": ours / 1e6, "forward_total_gb": whole / 1e9})
        emit(act[-1])
    log(H.table(act, [("sp", "sp", ""), ("measured_per_layer_mb", "measured MB/layer", ".1f"),
                      ("paper_mb", "Korthikanti 2022", ".1f"), ("this_model_mb", "this model", ".1f"),
                      ("forward_total_gb", "whole forward GB", ".2f")]))
    mesh.destroy()


if __name__ == "__main__":
    main()
