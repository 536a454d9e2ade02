"""Data-parallel engines (nanopara/dp.py, zero.py, zero3.py: DDP, ZeRO-1/2/3) against torch's DistributedDataParallel.

    torchrun --nproc_per_node=N bench/bench_dp.py [--quick] [--out FILE] [--micro_batch 16] [--large gpt2_1558m]

1. throughput  GPT-2 124M with model.kernels=torch (so only the engines differ), micro_batch x T=1024 per GPU, bf16
   autocast, synthetic tokens, grad clip 1.0, fused AdamW; warm-up, then timed steps. tok/s from the slowest rank,
   MFU against 989 TFLOP/s, memory as base / peak / transient / engine.memory_bytes(). torch_ddp is
   DistributedDataParallel(bucket_cap_mb=25, gradient_as_bucket_view=True) + clip_grad_norm_ + the same AdamW.
   "tail ms" = GPU time the compute stream waits for gradient communication after backward (the exposed part);
   "med ms" = the slowest rank's median step by CUDA events (robust to host stalls); "host ms" = CPU time to issue
   a forward + backward while the GPU is held busy. Modes: torch_ddp, ddp, zero1..3 and variants written
   MODE[@MB][:OPTION] — `ddp@50` (50 MB buckets), `ddp:bf16` (bf16 reduction), `ddp:nocomm` (no all-reduce: the
   upper bound of scaling), `ddp:single` (N independent one-GPU runs: what the machine loses), `ddp:normfirst`
   (norm read before the update), `ddp:dest` / `zero2:nodest` (gradient destinations on / off), `zero2:i4`
   (4 reductions in flight), `zero3:p2` (prefetch 2 units), `zero3:u2` (units of 2 blocks).
2. memory      a large preset (gpt2_1558m) at micro_batch 1 per ZeRO stage: the states a rank holds next to the
   ZeRO paper's formulas (16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N), the step transient and the peak.

Rank 0 prints one row per mode; --out writes JSON. ~2 minutes on 4 H100s (--quick: ~1). Scaling 1 -> N: run with
N = 1 and N on the same machine and compare tok/s / N.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanopara.presets import PRESETS  # noqa: E402
from nanopara.dp import SingleDevice  # noqa: E402
from nanopara.mesh import Mesh  # noqa: E402
from nanopara.model import GPT  # noqa: E402
from nanopara.optim import build_adamw  # noqa: E402
from nanopara.parallel import build_engine  # noqa: E402
from nanopara import zero3  # noqa: E402

PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s
MODES = ["torch_ddp", "ddp", "zero1", "zero2", "zero3"]
ACCUM = 1  # micro-steps per optimizer step (--accum)
GB = 1e9


def make_cfg(preset: str, micro_batch: int, zero: int, seq_len: int, device: str = "cuda"):
    cfg = PRESETS[preset]()
    cfg.model.kernels, cfg.train.dtype = "torch", "bf16" if device == "cuda" else "fp32"
    cfg.train.micro_batch, cfg.train.seq_len, cfg.parallel.zero = micro_batch, seq_len, zero
    return cfg


def build(cfg, mesh):
    torch.manual_seed(1337)
    with torch.device(mesh.device):
        model = GPT(cfg.model)
    return model


def amp(device):
    """bf16 autocast on GPU; plain fp32 for the --device=cpu smoke test."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def torch_ddp_step_fn(model, mesh, cfg, phases):
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[mesh.local_rank] if mesh.device.type == "cuda" else None, bucket_cap_mb=25,
        gradient_as_bucket_view=True)
    opt = build_adamw(model.named_parameters(), cfg.train, mesh.device)

    def fwd_bwd(x, y):
        for m in range(ACCUM):  # the same micro-batch ACCUM times: the timing, not the data, is measured
            with ddp.no_sync() if m < ACCUM - 1 else contextlib.nullcontext():
                with amp(mesh.device):
                    _, loss = ddp(x, y)
                if m == 0:
                    phases.mark("fwd")
                (loss / ACCUM).backward()
        phases.mark("bwd")
        phases.mark("grads")  # torch DDP waits for its last bucket inside backward

    def finish():
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        phases.mark("end")
        return norm.item()  # our engines return the norm as a float too (train.py logs it)

    def step(x, y):
        phases.mark("start")
        fwd_bwd(x, y)
        return finish()
    step.fwd_bwd, step.finish = fwd_bwd, finish
    return step, None


class _Done:
    def wait(self):
        pass


class Phases:
    """CUDA events on the compute stream at each timed step's phase boundaries, on every rank (--phases):
    start | forward | fwd | backward | bwd | tail (the wait for gradient communication; torch DDP waits inside its
    backward) | grads | clip + optimizer | end | gap (GPU time until the next step's start: the host issuing it).
    Each phase's GPU time includes any idle of the stream inside it (waiting for the host or for NCCL). Also the
    host time spent in Python's garbage collector during the timed steps (gc.callbacks), per generation."""

    NAMES = ("fwd", "bwd", "tail", "opt", "gap")

    def __init__(self):
        self.on, self.steps, self.gc_ms, self.gc_n, self._t = False, [], 0.0, [0, 0, 0], 0.0

    def start(self):
        self.on = True
        gc.callbacks.append(self._gc)

    def stop(self):
        self.on = False
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)

    def _gc(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.gc_ms += (time.perf_counter() - self._t) * 1e3
            self.gc_n[info["generation"]] += 1

    def mark(self, name):
        if not self.on:
            return
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        if name == "start":
            self.steps.append({})
        self.steps[-1][name] = e

    def table(self) -> list[list[float]]:
        """Per step (that has a next one): ms of each phase."""
        order = ("start", "fwd", "bwd", "grads", "end")
        return [[st[a].elapsed_time(st[b]) for a, b in zip(order, order[1:])]
                + [st["end"].elapsed_time(self.steps[i + 1]["start"])] for i, st in enumerate(self.steps[:-1])]

    def summary(self) -> list[float]:
        """Median ms of each phase, their sum, the mean and the median step (start to start), gc ms per step, gc
        runs of generation 0, 1, 2 over the timed steps."""
        rows = self.table()
        med = [sorted(col)[len(col) // 2] for col in zip(*rows)]
        steps = sorted(sum(r) for r in rows)
        return (med + [sum(med), sum(steps) / len(steps), steps[len(steps) // 2], self.gc_ms / len(rows)]
                + [float(n) for n in self.gc_n])


PHASE_KEYS = Phases.NAMES + ("sum", "mean", "median", "gc_ms", "gc0", "gc1", "gc2")


def phase_line(label: str, rank: int, v: list[float]) -> str:
    """One rank's Phases.summary() as a printed line."""
    g = PHASE_KEYS.index("gc0")
    return (f"phases {label:>12} rank {rank}: " + " ".join(f"{n} {t:6.2f}" for n, t in zip(PHASE_KEYS[:g], v))
            + " | gc runs " + "/".join(f"{n:.0f}" for n in v[g:]))


def engine_step_fn(model, mesh, cfg, phases, variant=""):
    if variant.startswith("p"):  # "zero3:p2": ZeRO-3 gathers 2 units ahead (zero3.PREFETCH, read at each hook)
        zero3.PREFETCH = int(variant[1:])
    engine = SingleDevice(model, mesh, cfg) if variant == "single" else build_engine(model, mesh, cfg)
    if variant.startswith("i"):  # "zero2:i4": ZeRO-2/3 keep up to 4 full-size reductions in flight (max_inflight)
        engine.max_inflight = int(variant[1:])
    if variant == "nocomm":  # control, not a result: the engine's hooks and buffers, its all-reduces skipped
        engine._launch = lambda i: _Done()
    if variant == "normfirst":  # the step that reads the norm before issuing the update (CPU's path)
        engine.async_step = False
    if variant == "nodest":  # ZeRO-2 without gradient destinations: every gradient copied into its bucket
        engine._set_grad_dests([])
    if variant == "dest":  # DDP with them (parallel.grad_dests=on)
        engine._set_grad_dests(engine.params)
    tails = []  # (start, end) CUDA events around the gradient wait at the step: exposed communication
    if mesh.device.type == "cuda":
        finish_grads = engine._finish_grads

        def timed_finish():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            finish_grads()
            b.record()
            tails.append((a, b))
            phases.mark("grads")
        engine._finish_grads = timed_finish

    def fwd_bwd(x, y):
        for m in range(ACCUM):
            with engine.no_sync(m < ACCUM - 1):
                with amp(mesh.device):
                    _, loss = engine.model(x, y)
                if m == 0:
                    phases.mark("fwd")
                engine.backward(loss / ACCUM)
        phases.mark("bwd")

    def finish():
        norm = engine.step(cfg.train.lr)
        phases.mark("end")
        return norm

    def step(x, y):
        phases.mark("start")
        fwd_bwd(x, y)
        return finish()
    step.tails, step.fwd_bwd, step.finish = tails, fwd_bwd, finish
    return step, engine


def _union_ms(spans):
    """Length of the union of (start, end) intervals, in ms (inputs in us)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def host_ms(step, x, y, mesh) -> float:
    """CPU time to issue one step's forward + backward while a sleep kernel keeps the GPU busy (so the CPU never
    waits for it). Near or above the GPU time of the same work, the step is bound by the host (Python, launches),
    not by the GPU. The step is then finished normally (every rank does the same: collectives)."""
    if mesh.device.type != "cuda":
        return float("nan")
    sync(mesh.device)
    dist.barrier()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s at H100/H200 clocks
    slept = torch.cuda.Event()
    slept.record()
    t0 = time.perf_counter()
    step.fwd_bwd(x, y)
    dt = time.perf_counter() - t0
    busy = not slept.query()  # still sleeping when the last backward kernel was issued: a valid measurement.
    # Otherwise nan: the CPU waited for the GPU somewhere, e.g. a full launch queue (~1000 pending kernels; DDP's
    # per-parameter gradient accumulation kernels take it over that at 124M)
    step.finish()
    sync(mesh.device)
    return dt * 1e3 if busy else float("nan")


def profile_step(step, x, y, mesh, label, out_dir):
    """One step under torch.profiler on rank 0 (every rank runs it: collectives). Prints how much of the step's
    GPU span the compute kernels fill, the NCCL kernels' time, and the top compute kernels."""
    from torch.profiler import ProfilerActivity, profile
    if mesh.device.type != "cuda":  # GPU kernels only; every rank takes the same branch
        return
    sync(mesh.device)
    dist.barrier()
    if not mesh.is_main:
        step(x, y)
        sync(mesh.device)
        return
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(x, y)
        sync(mesh.device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return
    comm = [e for e in kernels if "nccl" in e.name.lower()]
    compute = [e for e in kernels if "nccl" not in e.name.lower()]
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / 1e3
    busy = _union_ms([(e.time_range.start, e.time_range.end) for e in compute])
    by_name = {}
    for e in compute:
        by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
    nccl = _union_ms([(e.time_range.start, e.time_range.end) for e in comm])
    lines = [f"profile {label} (rank 0, one step): GPU span {span:.2f} ms, compute kernels busy {busy:.2f} ms "
             f"(idle {span - busy:.2f} ms), NCCL kernels {nccl:.2f} ms"]
    lines += [f"  {t:7.2f} ms  {n[:100]}" for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]]
    lines += ["  largest compute-stream gaps (ms, where in the step, kernel before -> kernel after):"]
    order, t0 = sorted(compute, key=lambda e: e.time_range.start), min(e.time_range.start for e in kernels)
    gaps, end, last = [], order[0].time_range.end, order[0]
    for e in order[1:]:
        if e.time_range.start > end:
            gaps.append(((e.time_range.start - end) / 1e3, (end - t0) / 1e3, last.name, e.name))
        if e.time_range.end > end:
            end, last = e.time_range.end, e
    lines += [f"  {g:7.2f} at {at:6.1f}  {a[:45]} -> {b[:45]}" for g, at, a, b in sorted(gaps, reverse=True)[:10]]
    lines += ["  the last NCCL kernels (start .. end ms in the step, ms):"]
    lines += [f"  {(e.time_range.start - t0) / 1e3:7.2f} .. {(e.time_range.end - t0) / 1e3:7.2f} "
              f"{(e.time_range.end - e.time_range.start) / 1e3:6.2f}  {e.name[:60]}"
              for e in sorted(comm, key=lambda e: e.time_range.start)[-6:]]
    print("\n".join(lines), flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"profile_dp_{label.replace(':', '_').replace('@', '_')}.txt"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


def run_mode(mode, cfg, mesh, warmup, steps, variant="", profile_dir="", phases=False):
    cuda = mesh.device.type == "cuda"
    start, prefetch = torch.cuda.memory_allocated() if cuda else 0, zero3.PREFETCH
    model = build(cfg, mesh)
    n_params, psi = model.num_params(), sum(p.numel() for p in model.parameters())  # the tied weight once
    ph = Phases()
    if mode == "torch_ddp":
        step, engine = torch_ddp_step_fn(model, mesh, cfg, ph)
    else:
        step, engine = engine_step_fn(model, mesh, cfg, ph, variant)
    B, T = cfg.train.micro_batch, cfg.train.seq_len
    g = torch.Generator(device=mesh.device).manual_seed(mesh.rank)
    xy = torch.randint(0, cfg.model.vocab_size, (B, T + 1), device=mesh.device, generator=g)
    x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
    for _ in range(warmup):
        step(x, y)
    sync(mesh.device)
    gc.collect()
    if cuda:  # no empty_cache() here: the first timed step would cudaMalloc every activation again (+22-44 ms
        torch.cuda.reset_peak_memory_stats()  # on 2 x H100 at B=16, --phases: 1.1-2.4% of 30 steps' time)
    base = torch.cuda.memory_allocated() / GB if cuda else 0.0  # the states (and the batch): what a step starts from
    tails = getattr(step, "tails", None)
    if tails is not None:
        tails.clear()
    dist.barrier()
    if cuda:  # (a few CUDA events per step: the median step; the phases themselves are printed with --phases)
        ph.start()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    ph.mark("start")  # the end of the last step's gap
    sync(mesh.device)
    dt_mine = time.perf_counter() - t0
    ph.stop()
    per_rank = steps_rank0 = None
    if ph.steps:  # every rank took this branch (cuda is the same everywhere)
        mine = torch.tensor(ph.summary(), device=mesh.device)
        every = [torch.empty_like(mine) for _ in range(mesh.world)]
        dist.all_gather(every, mine)
        per_rank, steps_rank0 = [t.tolist() for t in every], ph.table()
    peak = torch.cuda.max_memory_allocated() / GB if cuda else 0.0
    tail = sum(a.elapsed_time(b) for a, b in tails) / steps if tails else float("nan")
    stats = torch.tensor([dt_mine, peak, base, peak - base, tail, -dt_mine], device=mesh.device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    dt, peak, base, transient, tail, dt_fastest = stats.tolist()
    host = host_ms(step, x, y, mesh)
    if profile_dir:
        profile_step(step, x, y, mesh, mode + (f":{variant}" if variant else ""), profile_dir)
    zero3.PREFETCH = prefetch  # a "zero3:pK" variant changed it for its own run only
    states = engine.memory_bytes() if engine is not None else None
    if engine is not None:
        engine.close()
    del step, engine, model, xy, x, y
    gc.collect()
    left = 0.0
    if cuda:
        torch.cuda.empty_cache()
        left = (torch.cuda.memory_allocated() - start) / GB
        if left > 0.1:  # cuBLAS workspaces (tens of MB) may stay after the first mode; a model would not
            print(f"WARNING rank {mesh.rank}: {mode} left {left:.2f} GB allocated after cleanup; the next mode's "
                  f"memory numbers include it", flush=True)
    if per_rank and phases and mesh.is_main:
        label = mode + (f":{variant}" if variant else "")
        for r, v in enumerate(per_rank):
            print(phase_line(label, r, v), flush=True)
    return {"mode": mode + (f":{variant}" if variant else ""), "tok_s": mesh.world * B * T * ACCUM * steps / dt,
            "phases": None if per_rank is None else [dict(zip(PHASE_KEYS, v)) for v in per_rank],
            "phase_steps_rank0": steps_rank0,
            "step_ms": dt / steps * 1e3,
            "step_ms_median": max(v[PHASE_KEYS.index("median")] for v in per_rank) if per_rank else float("nan"),
            "host_ms": host, "fastest_rank_step_ms": -dt_fastest / steps * 1e3,
            "tail_ms": tail,
            "peak_GB": peak,
            "base_GB": base, "transient_GB": transient, "left_GB": left,
            "states_GB": None if states is None else sum(states.values()) / GB, "n_params": n_params, "psi": psi}


def formula_bytes(stage: int, psi: int, n: int) -> float:
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--micro_batch", type=int, default=16, help="sequences per GPU per step (124M part)")
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--baseline", default="", help="the --out JSON of a 1-GPU run on this machine: adds scaling "
                    "= tok/s / (N * 1-GPU tok/s of the same engine; ours at dp=1 is the SingleDevice engine)")
    ap.add_argument("--accum", type=int, default=1, help="micro-steps per optimizer step (gradient accumulation; "
                    "communication on the last one only). GPT-2's 0.5M-token batch at B=16 x T=1024: 32 / N GPUs")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per mode")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="after each mode's timed steps, profile one step on rank 0 (GPU idle, NCCL time, top kernels)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    ap.add_argument("--phases", action="store_true", help="per-rank medians of each step phase's GPU time "
                    "(forward, backward, tail, clip + optimizer, gap to the next step; CUDA events)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    ap.add_argument("--large", default="gpt2_1558m", help="preset of the memory part ('' skips it)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a gloo smoke test of this script on the tiny preset, not a measurement")
    args = ap.parse_args()
    global ACCUM
    ACCUM = args.accum
    mesh = Mesh.build(dp=-1, device=args.device)
    if not dist.is_initialized():  # one process (the dp=1 baseline): torch DDP and barriers still want a group
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1,
                                device_id=mesh.device if args.device == "cuda" else None)
    n = mesh.world
    warmup, steps = (2, 5) if args.quick else (args.warmup, args.steps)
    name = torch.cuda.get_device_name(mesh.device) if args.device == "cuda" else "CPU (smoke test)"
    small, big = ("gpt2_124m", args.large) if args.device == "cuda" else ("tiny", "tiny" if args.large else "")
    peak_flops = next((v for k, v in PEAK.items() if k in name), 0.0)

    rows = []
    for mode in args.modes.split(","):
        # "ddp@50": 50 MB buckets (a bucket-size sweep); "ddp:bf16": parallel.reduce_dtype=bf16; "ddp:nocomm": the
        # control with every gradient all-reduce skipped (what the engine costs without communication);
        # "zero3:p2" / "zero3:u2": ZeRO-3 prefetching 2 units / with units of 2 blocks
        mode, _, variant = mode.partition(":")
        base_mode, _, bucket = mode.partition("@")
        zero = {"torch_ddp": 0, "ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[base_mode]
        cfg = make_cfg(small, args.micro_batch, zero, args.seq_len, args.device)
        if bucket:
            cfg.parallel.bucket_mb = float(bucket)
        if variant == "bf16":
            cfg.parallel.reduce_dtype = "bf16"
        if variant.startswith("u"):  # "zero3:u2": units of 2 transformer blocks
            cfg.parallel.zero3_unit_blocks = int(variant[1:])
        r = run_mode(mode, cfg, mesh, warmup, steps, variant, args.profile, args.phases)
        m = cfg.model
        fpt = 6 * r["n_params"] + 12 * m.n_layer * m.n_embd * args.seq_len
        r["mfu"] = fpt * r["tok_s"] / (n * peak_flops) if peak_flops else 0.0
        rows.append(r)
    base = next((r["tok_s"] for r in rows if r["mode"] == "torch_ddp"), None)

    large = []
    if big:
        for stage in range(4):
            cfg = make_cfg(big, 1, stage, args.seq_len, args.device)
            r = run_mode("ddp" if stage == 0 else f"zero{stage}", cfg, mesh, 1, 2)
            r.update(stage=stage, formula_GB=formula_bytes(stage, r["psi"], n) / GB)
            large.append(r)

    if mesh.is_main:
        print(f"data parallel on {n} x {name}, torch {torch.__version__}, {datetime.date.today()}; {small}, "
              f"B={args.micro_batch}/GPU x {args.accum} micro-steps, T={args.seq_len}, bf16 autocast, kernels=torch, "
              f"{steps} timed steps")
        print(f"{'mode':>12} | {'tok/s':>10} {'vs torch':>8} {'scaling':>7} {'MFU':>6} {'step ms':>8} {'fast ms':>7} "
              f"{'tail ms':>7} {'host ms':>7} {'med ms':>7} {'med scal':>8} | {'peak GB':>8} {'states GB':>9} "
              f"{'base GB':>8} {'transient':>9}")
        one, accum1 = {}, args.accum
        if args.baseline:
            with open(args.baseline) as f:
                b = json.load(f)
            one, accum1 = {r["mode"]: r for r in b["rows"]}, b.get("accum", 1)
        for r in rows:
            ref = one.get("torch_ddp" if r["mode"] == "torch_ddp" else "ddp")
            r["scaling"] = r["tok_s"] / (n * ref["tok_s"]) if ref else None
            r["scaling_median"] = (args.accum * ref.get("step_ms_median", float("nan"))  # per-GPU tokens a ms
                                   / (accum1 * r["step_ms_median"]) if ref else None)
            msc = "-" if r["scaling_median"] is None else f"{100 * r['scaling_median']:.1f}%"
            rel = f"{r['tok_s'] / base:.3f}" if base else "-"
            st = f"{r['states_GB']:.2f}" if r["states_GB"] is not None else "-"
            tail = "-" if r["tail_ms"] != r["tail_ms"] else f"{r['tail_ms']:.2f}"
            scale = "-" if r["scaling"] is None else f"{100 * r['scaling']:.1f}%"
            print(f"{r['mode']:>12} | {r['tok_s']:10,.0f} {rel:>8} {scale:>7} {r['mfu'] * 100:5.1f}% "
                  f"{r['step_ms']:8.1f} {r['fastest_rank_step_ms']:7.1f} {tail:>7} {r['host_ms']:7.1f} "
                  f"{r['step_ms_median']:7.1f} {msc:>8} | "
                  f"{r['peak_GB']:8.2f} {st:>9} {r['base_GB']:8.2f} {r['transient_GB']:9.2f}")
        if large:
            print(f"\n{big}: Ψ = {large[0]['psi'] / 1e9:.3f}B parameters, B=1, per ZeRO stage on {n} GPUs")
            print(f"{'stage':>6} | {'states GB':>9} {'formula GB':>10} {'(paper)':>16} | {'base GB':>8} "
                  f"{'transient':>9} {'peak GB':>8} | {'tok/s':>9}")
            paper = ["16Ψ", "8Ψ+8Ψ/N", "4Ψ+12Ψ/N", "16Ψ/N"]
            for r in large:
                print(f"{r['stage']:>6} | {r['states_GB']:9.2f} {r['formula_GB']:10.2f} {paper[r['stage']]:>16} | "
                      f"{r['base_GB']:8.2f} {r['transient_GB']:9.2f} {r['peak_GB']:8.2f} | {r['tok_s']:9,.0f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"bench": "dp", "gpus": n, "accum": args.accum, "device": name, "torch": torch.__version__,
                           "date": str(datetime.date.today()), "micro_batch": args.micro_batch,
                           "seq_len": args.seq_len, "rows": rows, "large": large}, f, indent=1)
    mesh.destroy()


if __name__ == "__main__":
    main()
