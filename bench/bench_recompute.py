"""Activation checkpointing on one GPU: step time, memory and the largest micro-batch for none / full / selective.

    python bench/bench_recompute.py [--presets gpt2_1558m,gpt_1b] [--batch 8] [--seq 1024] [--quick] [--out F]

One model per preset, model.kernels=auto (the Triton kernels), bf16 autocast, AdamW through the project's engine
(parallel.build_engine on a one-process mesh: SingleDevice, fused AdamW, global-norm clipping), synthetic tokens;
the modes are switched on the same model (nanopara/recompute.py's apply_activation_checkpointing). Per mode:
  time       median step (forward + backward + clip + AdamW) at --batch: tok/s, MFU (model FLOPs only: the
             recomputation counts as overhead), peak memory, and the ratio to none (goals: full <= 1.35,
             selective <= 1.10; issue #24)
  act        what the blocks keep for backward, from memory_allocated after a forward through them at two
             micro-batches: per layer, in units of s*b*h bytes (nanopara/recompute.py: none 36, selective 24,
             full 6; Korthikanti et al. 2022: 34 + 5*a*s/h), and the per-parameter part (bf16 weight copies)
  max batch  the largest micro-batch whose training step runs: doubling from --batch, then bisection to 1/32
             (exact below 64); OOM caught, one step per probe, the allocator's cache emptied between probes
  profile    (--profile) one more step under torch.profiler: its GPU span, the time some kernel runs (union of
             kernel intervals) and the idle rest, the kernel count and the kernels that cost most; the allocator's
             retries (cudaFree-and-retry when the cache cannot serve a request) during the timed steps are in every
             time row. Idle time that grows with the mode means the GPU waits for the host (or the allocator);
             kernel time that grows means the recomputation itself.
The timings of all modes come first, then the searches. Before all, parity: on a 4-layer 124M-wide model with
dropout 0.1, loss and gradients of each mode against none on the GPU (bf16): exact, or the largest difference
relative to the largest gradient (none against a rerun of none: the noise floor; expected exact everywhere).
JSON lines to --out as they come (--device cpu: a smoke run, no memory numbers), a table at the end. ~4-5 min on
an H100 (--quick: fewer steps, a coarser search; --no_search: the timings only).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_layout's interval union

from nanopara.presets import PRESETS  # noqa: E402
from nanopara.mesh import Mesh  # noqa: E402
from nanopara.model import GPT  # noqa: E402
from nanopara.parallel import build_engine  # noqa: E402
from nanopara.recompute import MODES, apply_activation_checkpointing  # noqa: E402
from nanopara.report import flops_per_token, peak_flops  # noqa: E402

LR = 1e-5  # small: the weights barely move while the modes share the model


def autocast(dev):
    return torch.autocast(dev.type, dtype=torch.bfloat16)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def build(preset: str, args, mesh, **model_kw):
    cfg = PRESETS[preset]()
    cfg.model.kernels = "auto"
    for k, v in model_kw.items():
        setattr(cfg.model, k, v)
    cfg.train.seq_len, cfg.train.micro_batch = args.seq, args.batch
    torch.manual_seed(0)
    with torch.device(mesh.device):
        model = GPT(cfg.model)
    return cfg, model, build_engine(model, mesh, cfg)


def tokens(dev, b: int, seq: int, vocab: int, seed: int = 0):
    g = torch.Generator(device=dev).manual_seed(seed)
    t = torch.randint(0, vocab, (b, seq + 1), device=dev, generator=g)
    return t[:, :-1], t[:, 1:]


def train_step(model, engine, x, y):
    with autocast(x.device):
        _, loss = model(x, y)
    engine.backward(loss)
    engine.step(LR, sync=False)
    return loss


# ----------------------------------------------------------------------------------------------------------------
# sections

def parity(args, mesh) -> list[dict]:
    """Gradients of each mode against none on the GPU, on one shared model (a 4-layer, 124M-wide GPT)."""
    cfg, model, engine = build(args.parity_preset, args, mesh, n_layer=4, dropout=0.1)
    x, y = tokens(mesh.device, 4, min(256, cfg.model.block_size), cfg.model.vocab_size)

    def grads(mode):
        apply_activation_checkpointing(model.transformer.h, mode)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout masks in every mode
        with autocast(mesh.device):
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
    del model, engine
    return rows


def timed(model, engine, cfg, args) -> dict:
    dev = engine.device
    x, y = tokens(dev, args.batch, args.seq, cfg.model.vocab_size)
    for _ in range(args.warmup):
        train_step(model, engine, x, y)
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    r0 = retries() if dev.type == "cuda" else 0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        train_step(model, engine, x, y)
        sync(dev)
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    tok_s = args.batch * args.seq / dt
    flops = flops_per_token(cfg.model, model.num_params(), args.seq) * tok_s
    peak = peak_flops(dev)
    return {"step_ms": dt * 1e3, "tokens_per_s": tok_s, "tflops": flops / 1e12, "mfu": flops / peak if peak else 0.0,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else None,
            "alloc_retries": retries() - r0 if dev.type == "cuda" else None}


def retries() -> int:
    return torch.cuda.memory_stats().get("num_alloc_retries", 0)


def profiled(model, engine, cfg, args) -> dict:
    """One training step under torch.profiler (after timed(): warm): where its span goes, busy or idle."""
    from torch.profiler import ProfilerActivity, profile
    from bench_layout import _union
    dev = engine.device
    x, y = tokens(dev, args.batch, args.seq, cfg.model.vocab_size)
    train_step(model, engine, x, y)
    sync(dev)
    kind = torch.autograd.DeviceType.CUDA if dev.type == "cuda" else torch.autograd.DeviceType.CPU
    with profile(activities=[ProfilerActivity.CUDA if dev.type == "cuda" else ProfilerActivity.CPU]) as prof:
        train_step(model, engine, x, y)
        sync(dev)
    ev = [e for e in prof.events() if e.device_type == kind]
    busy, _ = _union([(e.time_range.start, e.time_range.end) for e in ev])
    span = max(e.time_range.end for e in ev) - min(e.time_range.start for e in ev) if ev else 0
    cost = {}
    for e in ev:
        n, t = cost.get(e.name, (0, 0.0))
        cost[e.name] = (n + 1, t + e.time_range.elapsed_us())
    top = sorted(cost.items(), key=lambda kv: -kv[1][1])[:args.profile_top]
    return {"prof_span_ms": span / 1e3, "prof_busy_ms": busy / 1e3, "prof_idle_ms": (span - busy) / 1e3,
            "prof_kernels": len(ev), "prof_top": [{"name": k[:120], "calls": n, "ms": t / 1e3} for k, (n, t) in top]}


def kept(model, cfg, args, b1=1, b2=2) -> dict:
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
        with autocast(x.device):
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


def fits(model, engine, cfg, args, b: int) -> bool:
    """One training step at micro-batch b; False on OOM. Whatever the failed step allocated (its activations, the
    autograd graph the exception's traceback holds, partial grads, autocast's weight cache) is freed before the
    next probe, so a failure does not make the following probes fail too."""
    oom = False
    x = y = None
    try:
        x, y = tokens(engine.device, b, args.seq, cfg.model.vocab_size)
        train_step(model, engine, x, y)
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        oom = True  # no reference to the exception (its traceback holds the step's frames and tensors) survives
    x = y = None
    model.zero_grad(set_to_none=True)  # an OOM in backward leaves some grads behind
    free()
    return not oom


def free(reset_peak: bool = False):
    """Collect cycles (exception tracebacks, rebound forwards) and hand the allocator's cache back."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.clear_autocast_cache()
        gc.collect()
        torch.cuda.empty_cache()
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()


def mem_row(preset: str, on_gpu: bool) -> dict:
    """What is allocated as a preset starts: ~0 unless something of the previous one is still alive."""
    alloc = torch.cuda.memory_allocated() if on_gpu else None
    reserved = torch.cuda.memory_reserved() if on_gpu else None
    if alloc is not None and alloc > 256 * 2**20:
        print(f"WARNING: {alloc / 1e9:.2f} GB still allocated as preset {preset} starts (a leak from the previous "
              f"one?)", file=sys.stderr, flush=True)
    return {"section": "preset_start", "preset": preset,
            "mem_allocated_gb": None if alloc is None else alloc / 1e9,
            "mem_reserved_gb": None if reserved is None else reserved / 1e9}


def max_batch(model, engine, cfg, args, start: int) -> tuple[int, int]:
    """(largest micro-batch that ran, smallest that did not) by doubling from `start`, then bisection."""
    lo, hi, b = 0, None, max(start, 1)
    while b <= args.max_batch:
        if not fits(model, engine, cfg, args, b):
            hi = b
            break
        lo, b = b, 2 * b
    if hi is None:
        return lo, 0
    while hi - lo > max(1, lo // args.search_frac):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(model, engine, cfg, args, mid) else (lo, mid)
    return lo, hi


# ----------------------------------------------------------------------------------------------------------------

def run_preset(preset: str, args, mesh, on_gpu: bool, rows: list, emit) -> None:
    """Timings, then the largest-micro-batch searches, of one preset. Everything it builds is local and torn down
    in `finally` (hooks removed, grads and optimizer state dropped), so the next preset starts from an empty GPU."""
    cfg, model, engine = build(preset, args, mesh)
    try:
        base = None
        for mode in args.modes.split(","):  # the timings first: the search below probes the memory's limits
            apply_activation_checkpointing(model.transformer.h, mode)
            row = {"section": "mode", "preset": preset, "mode": mode, "batch": args.batch, "seq": args.seq}
            try:
                row.update(timed(model, engine, cfg, args))
                if args.profile:
                    row.update(profiled(model, engine, cfg, args))
            except torch.OutOfMemoryError:
                row["step_ms"] = None  # does not fit at --batch: the search still runs below it
                model.zero_grad(set_to_none=True)
            free()
            if row["step_ms"] is not None:
                base = row["step_ms"] if mode == "none" else base
                row["time_vs_none"] = row["step_ms"] / base if base else None
                if on_gpu:
                    row.update(kept(model, cfg, args))
                    free()
            emit(row)
        for mode in args.modes.split(",") if on_gpu and not args.no_search else ():
            apply_activation_checkpointing(model.transformer.h, mode)
            timed_row = next(r for r in rows if r["section"] == "mode" and r["preset"] == preset and r["mode"] == mode)
            lo, hi = max_batch(model, engine, cfg, args, args.batch if timed_row["step_ms"] else 1)
            timed_row.update(max_batch=lo, oom_at=hi)
            emit({"section": "max_batch", "preset": preset, "mode": mode, "max_batch": lo, "oom_at": hi})
    finally:
        engine.close()
        model.zero_grad(set_to_none=True)
        engine.optimizer = None
        del model, engine, cfg
        free(reset_peak=True)


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
    on_gpu = mesh.device.type == "cuda"
    meta = {"gpu": torch.cuda.get_device_name() if on_gpu else "cpu", "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__}
    t_start = time.perf_counter()
    rows = []

    def emit(row):  # printed and written as it comes: a crash later keeps what was measured
        row = {**row, **meta, "elapsed_s": round(time.perf_counter() - t_start, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    for r in parity(args, mesh):
        emit(r)
    free()
    for preset in args.presets.split(","):
        free(reset_peak=True)
        emit(mem_row(preset, on_gpu))
        run_preset(preset, args, mesh, on_gpu, rows, emit)  # its model, engine and optimizer die with the call
        free(reset_peak=True)
    print(f"\n{meta['gpu']}  {meta['date']}  seq {args.seq}, timed micro-batch {args.batch}, bf16, model.kernels=auto")
    for r in rows:
        if r["section"] == "parity":
            print(f"parity vs none  {r['mode']:10s} exact={r['exact']!s:5s} loss diff {r['loss_diff']:.3g}  "
                  f"max grad diff / max grad {r['grad_max_rel_diff']:.3g}")
    print(f"{'preset':12s} {'mode':10s} {'ms/step':>8s} {'x none':>7s} {'tok/s':>9s} {'MFU':>6s} {'peak GB':>8s} "
          f"{'act/sbh/layer':>13s} {'B/param':>7s} {'max batch':>10s}")
    for r in rows:
        if r["section"] != "mode":
            continue
        f = (lambda k, fmt: format(r[k], fmt) if r.get(k) is not None else "-")
        mb = f"{r['max_batch']}" + (f" (<{r['oom_at']})" if r.get("oom_at") else "") if "max_batch" in r else "-"
        print(f"{r['preset']:12s} {r['mode']:10s} {f('step_ms', '8.1f'):>8s} {f('time_vs_none', '7.3f'):>7s} "
              f"{f('tokens_per_s', '9,.0f'):>9s} {(format(r['mfu'] * 100, '5.1f') + '%') if r.get('mfu') else '-':>6s} "
              f"{f('peak_mem_gb', '8.1f'):>8s} {f('act_sbh_per_layer', '13.2f'):>13s} "
              f"{f('act_bytes_per_block_param', '7.2f'):>7s} {mb:>10s}")
    for r in rows:
        if r.get("prof_span_ms") is None:
            continue
        print(f"\nprofile {r['preset']} {r['mode']}: span {r['prof_span_ms']:.1f} ms = busy {r['prof_busy_ms']:.1f} + "
              f"idle {r['prof_idle_ms']:.1f}, {r['prof_kernels']} kernels, allocator retries in the timed steps "
              f"{r.get('alloc_retries')}")
        for k in r["prof_top"]:
            print(f"  {k['ms']:8.2f} ms {k['calls']:5d}x  {k['name']}")
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
