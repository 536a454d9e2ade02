"""Activation checkpointing on one GPU: step time, memory and the largest micro-batch for none / full / selective.

    python bench/bench_recompute.py [--presets gpt2_1558m,gpt_1b] [--batch 8] [--seq 1024] [--quick] [--out F]

One model per preset, model.kernels=auto (the Triton kernels), train.py's step (parallel.parallelize -> Trainer:
bf16 autocast, global-norm clip, fused AdamW), synthetic tokens; the modes are switched on the same model
(nanopara/recompute.py's apply_activation_checkpointing). Per mode:
  time       median step at --batch: tok/s, MFU (model FLOPs only: the recomputation counts as overhead), peak
             memory, the ratio to none (goals: full <= 1.35, selective <= 1.10; issue #24) and the allocator's
             retries (cudaFree-and-retry when its cache cannot serve a request) during the timed steps
  act        what the blocks keep for backward, from memory_allocated after a forward through them at two
             micro-batches: per layer, in units of s*b*h bytes (nanopara/recompute.py: none 36, selective 24,
             full 6; Korthikanti et al. 2022: 34 + 5*a*s/h), and the per-parameter part (bf16 weight copies)
  max batch  the largest micro-batch whose training step runs: doubling from --batch, then bisection to 1/32
             (exact below 64); OOM caught, one step per probe, the allocator's cache emptied between probes
  profile    (--profile) one more step profiled (bench/harness.py): GPU span, busy (some kernel runs) and idle
             time, kernel count, the costliest kernels. Idle time that grows with the mode means the GPU waits for
             the host or the allocator; kernel time that grows means the recomputation itself.
The timings of all modes come first, then the searches. Before all, parity: on a 4-layer model of the parity
preset's width with dropout 0.1, loss and gradients of each mode against none (bf16 on GPU): exact, or the largest
difference relative to the largest gradient (none against a rerun of none: the noise floor).
JSON lines to --out as they come (--device cpu: a smoke run, no memory numbers), a table at the end. ~4-5 min on
an H100 (--quick: fewer steps, a coarser search; --no_search: the timings only).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import harness as H
from nanopara.mesh import Mesh
from nanopara.model import GPT
from nanopara.recompute import MODES, apply_activation_checkpointing

LR = 1e-5  # small: the weights barely move while the modes share the model


def tokens(dev, b: int, seq: int, vocab: int, seed: int = 0):
    g = torch.Generator(device=dev).manual_seed(seed)
    t = torch.randint(0, vocab, (b, seq + 1), device=dev, generator=g)
    return t[:, :-1], t[:, 1:]


def step_at(trainer, cfg, b: int, seq: int):
    """A training step at micro-batch b (the Trainer takes any batch shape outside a CUDA graph)."""
    batches = [tokens(trainer.device, b, seq, cfg.model.vocab_size)]
    return lambda: H.train_step(trainer, batches, LR)


def parity(args, mesh) -> list[dict]:
    """Gradients of each mode against none, on one shared model (a 4-layer GPT of the parity preset's width)."""
    cfg = H.make_cfg(args.parity_preset, {"model.n_layer": 4, "model.dropout": 0.1, "model.kernels": "auto"})
    torch.manual_seed(0)
    model, amp = GPT(cfg.model).to(mesh.device), H.autocast(cfg, mesh.device)[0]
    x, y = tokens(mesh.device, 4, min(256, cfg.model.block_size), cfg.model.vocab_size)

    def grads(mode):
        apply_activation_checkpointing(model.transformer.h, mode)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout masks in every mode
        with amp():
            _, loss = model(x, y)
        loss.backward()
        return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    l0, g0 = grads("none")
    scale = max(g.abs().max().item() for g in g0.values())
    rows = []
    for mode in ("none", "full", "selective"):
        l1, g1 = grads(mode)
        exact = torch.equal(l1, l0) and all(torch.equal(g1[n], g0[n]) for n in g0)
        diff = max((g1[n].float() - g0[n].float()).abs().max().item() for n in g0) / scale
        rows.append({"section": "parity", "mode": mode, "exact": exact, "loss_diff": abs(l1 - l0).item(),
                     "grad_max_rel_diff": diff})
    return rows


def retries() -> int:
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if torch.cuda.is_available() else 0


def timed(trainer, cfg, n_params, args) -> dict:
    r0 = retries()
    t = H.timed(step_at(trainer, cfg, args.batch, args.seq), args.steps, args.warmup, device=trainer.device, each=True)
    tok_s = args.batch * args.seq / t["median_s"]
    mfu = H.mfu(cfg, n_params, tok_s, 1, trainer.device)
    cuda = trainer.device.type == "cuda"
    return {"step_ms": t["median_s"] * 1e3, "tokens_per_s": tok_s, "mfu": mfu, "peak_mem_gb": t["peak_gb"] or None,
            "alloc_retries": retries() - r0 if cuda else None}


def profiled(trainer, cfg, args) -> dict:
    """One training step under the profiler (after timed(): warm): where its span goes, busy or idle."""
    s = H.kernel_summary(H.profile(step_at(trainer, cfg, args.batch, args.seq), trainer.device), args.profile_top)
    return {"prof_span_ms": s["span_ms"], "prof_busy_ms": s["busy_ms"], "prof_idle_ms": s["span_ms"] - s["busy_ms"],
            "prof_kernels": s["kernels"], "prof_top": s["top_kernels_ms"]}


def kept(model, cfg, args, amp, b1=1, b2=2) -> dict:
    """Bytes the blocks keep from forward to backward (their input included, their output handed on as the next
    LayerNorm would take it): the slope over the micro-batch per layer and s*b*h, and the part that does not grow
    with it (the bf16 weight copies the matmuls save) per block parameter."""
    h, L = cfg.model.n_embd, cfg.model.n_layer
    ops = model.ops_for(torch.device("cuda"))
    used = []
    for b in (b1, b2):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        x = torch.randn(b, args.seq, h, device="cuda", requires_grad=True)  # the embedding output
        with amp():
            r, m = x, None
            for block in model.transformer.h:
                r, m = block(r, ops, None, m)
            out = m + r  # what ln_f's fused add makes of the last block's output (and keeps itself)
        del r, m
        used.append(torch.cuda.memory_allocated() - before - out.nbytes)
        del x, out
    slope = (used[1] - used[0]) / (b2 - b1)
    block_params = sum(p.numel() for p in model.transformer.h.parameters())
    return {"act_sbh_per_layer": slope / (args.seq * h * L),
            "act_bytes_per_block_param": (used[0] - b1 * slope) / block_params}


def fits(trainer, cfg, args, b: int) -> bool:
    """One training step at micro-batch b; False on OOM. Whatever the failed step allocated (its activations, the
    autograd graph the exception's traceback holds, partial grads, autocast's weight cache) is freed before the
    next probe, so a failure does not make the following probes fail too."""
    oom = False
    try:
        step_at(trainer, cfg, b, args.seq)()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        oom = True  # no reference to the exception (its traceback holds the step's frames and tensors) survives
    trainer.model.zero_grad(set_to_none=True)  # an OOM in backward leaves some grads behind
    H.free()
    return not oom


def max_batch(trainer, cfg, args, start: int) -> tuple[int, int]:
    """(largest micro-batch that ran, smallest that did not) by doubling from `start`, then bisection."""
    lo, hi, b = 0, None, max(start, 1)
    while b <= args.max_batch:
        if not fits(trainer, cfg, args, b):
            hi = b
            break
        lo, b = b, 2 * b
    if hi is None:
        return lo, 0
    while hi - lo > max(1, lo // args.search_frac):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(trainer, cfg, args, mid) else (lo, mid)
    return lo, hi


def run_preset(preset: str, args, mesh, emit) -> None:
    """Timings, then the largest-micro-batch searches, of one preset. Everything it builds dies with the call
    (the Trainer closed, grads and optimizer state dropped), so the next preset starts from an empty GPU."""
    alloc = torch.cuda.memory_allocated() if mesh.device.type == "cuda" else 0
    if alloc > 256 * 2**20:
        print(f"WARNING: {alloc / 1e9:.2f} GB still allocated as preset {preset} starts", file=sys.stderr)
    cfg = H.make_cfg(preset, {"model.kernels": "auto", "train.seq_len": args.seq, "train.micro_batch": args.batch})
    trainer, n_params = H.build_trainer(cfg, mesh)
    model, rows, base = trainer.model, {}, None
    try:
        for mode in args.modes.split(","):  # the timings first: the search below probes the memory's limits
            apply_activation_checkpointing(model.transformer.h, mode)
            row = rows[mode] = {"section": "mode", "preset": preset, "mode": mode, "batch": args.batch, "seq": args.seq}
            try:
                row.update(timed(trainer, cfg, n_params, args))
                row.update(profiled(trainer, cfg, args) if args.profile else {})
            except torch.OutOfMemoryError:
                row["step_ms"] = None  # does not fit at --batch: the search still runs below it
                model.zero_grad(set_to_none=True)
            H.free()
            if row["step_ms"] is not None:
                base = row["step_ms"] if mode == "none" else base
                row["time_vs_none"] = row["step_ms"] / base if base else None
                row.update(kept(model, cfg, args, trainer.amp) if mesh.device.type == "cuda" else {})
                H.free()
            emit(row)
        for mode in args.modes.split(",") if mesh.device.type == "cuda" and not args.no_search else ():
            apply_activation_checkpointing(model.transformer.h, mode)
            lo, hi = max_batch(trainer, cfg, args, args.batch if rows[mode]["step_ms"] else 1)
            rows[mode].update(max_batch=lo, oom_at=hi)
            emit({"section": "max_batch", "preset": preset, "mode": mode, "max_batch": lo, "oom_at": hi})
    finally:
        trainer.close()
        trainer.engine.close()
        model.zero_grad(set_to_none=True)
        trainer.engine.optimizer = None
        del model, trainer
        H.free()


COLS = [("preset", "preset", ""), ("mode", "mode", ""), ("step_ms", "ms/step", ".1f"),
        ("time_vs_none", "x none", ".3f"), ("tokens_per_s", "tok/s", ",.0f"), ("mfu", "MFU", ".1%"),
        ("peak_mem_gb", "peak GB", ".1f"),
        ("act_sbh_per_layer", "act/sbh/layer", ".2f"), ("act_bytes_per_block_param", "B/param", ".2f"),
        ("max_batch", "max batch", "d"), ("oom_at", "OOM at", "d"), ("alloc_retries", "retries", "d"),
        ("prof_idle_ms", "idle ms", ".1f")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="gpt2_1558m,gpt_1b")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--batch", type=int, default=8, help="micro-batch of the timed steps")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max_batch", type=int, default=1024, help="stop doubling here")
    ap.add_argument("--search_frac", type=int, default=32, help="bisect until hi - lo <= lo / this")
    ap.add_argument("--no_search", action="store_true", help="skip the largest-micro-batch search")
    ap.add_argument("--quick", action="store_true", help="fewer steps, coarser search")
    ap.add_argument("--profile", action="store_true", help="one profiled step per mode: busy / idle time, top kernels")
    ap.add_argument("--profile_top", type=int, default=12, help="kernels listed per profiled mode")
    ap.add_argument("--out", default="", help="append JSON lines here")
    ap.add_argument("--parity_preset", default="gpt2_124m", help="the parity model's width (4 layers, dropout 0.1)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (no memory numbers)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.search_frac = 3, 8
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_recompute.py needs a CUDA GPU")
    mesh = Mesh.build(device=args.device)
    print(H.banner(f"bench_recompute seq {args.seq}, timed micro-batch {args.batch}", mesh), flush=True)
    t0, rows = time.perf_counter(), []

    def emit(row):  # printed and written as it comes: a crash later keeps what was measured
        rows.append(row)
        print({k: v for k, v in row.items() if k != "prof_top"}, flush=True)
        H.append_jsonl(args.out, {**row, "elapsed_s": round(time.perf_counter() - t0, 1)})

    for r in parity(args, mesh):
        emit(r)
    H.free()
    for preset in args.presets.split(","):
        run_preset(preset, args, mesh, emit)
    print("\n" + H.table([r for r in rows if r["section"] == "parity"], [
        ("mode", "parity vs none", ""), ("exact", "exact", ""), ("loss_diff", "loss diff", ".3g"),
        ("grad_max_rel_diff", "max grad diff / max grad", ".3g")]))
    print("\n" + H.table([r for r in rows if r["section"] == "mode"], COLS))
    for r in (r for r in rows if r.get("prof_top")):
        print(f"\nprofile {r['preset']} {r['mode']}: span {r['prof_span_ms']:.1f} ms = busy {r['prof_busy_ms']:.1f} + "
              f"idle {r['prof_idle_ms']:.1f}, {r['prof_kernels']} kernels")
        print("\n".join(f"  {ms:8.2f} ms {calls:5d}x  {name}" for name, ms, calls in r["prof_top"]))
    print(f"total {time.perf_counter() - t0:.0f} s")
    return rows


if __name__ == "__main__":
    main()
