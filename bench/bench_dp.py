"""Data-parallel engines (nanopara/dp.py, zero.py, zero3.py: DDP, ZeRO-1/2/3) against torch's DistributedDataParallel.

    torchrun --nproc_per_node=N bench/bench_dp.py [--quick] [--out F.jsonl] [--micro_batch 16] [--large gpt2_1558m]

1. throughput  GPT-2 124M with model.kernels=torch (so only the engines differ), micro_batch x T=1024 per GPU,
   synthetic tokens; each engine through train.py's step (parallel.parallelize -> Trainer: bf16 autocast, micro-
   steps under no_sync, grad clip 1.0, fused AdamW); warm-up, then timed steps. tok/s from the slowest rank, MFU,
   memory as base / peak / transient / engine.memory_bytes(). torch_ddp, the baseline: DistributedDataParallel(
   bucket_cap_mb=25, gradient_as_bucket_view=True) + clip_grad_norm_ + the same AdamW, its own loop.
   "tail ms" = GPU time the compute stream waits for gradient communication after backward (the exposed part);
   "med ms" = the slowest rank's median step by CUDA events (robust to host stalls); "host ms" = CPU time to issue
   a step's forwards + backwards while the GPU is held busy. Modes: torch_ddp, ddp, zero1..3 and variants written
   MODE[@MB][:OPTION]: `ddp@50` (50 MB buckets), `ddp:bf16` (bf16 reduction), `ddp:nocomm` (no all-reduce: the
   upper bound of scaling), `ddp:single` (N independent one-GPU runs: what the machine loses), `ddp:normfirst`
   (norm read before the update), `ddp:dest` / `zero2:nodest` (gradient destinations on / off), `zero2:i4`
   (4 reductions in flight), `zero3:p2` (prefetch 2 units), `zero3:u2` (units of 2 blocks). --phases: per-rank
   medians of each phase of the step (forward, backward with the loss's mean over dp, tail, optimizer, gap).
2. memory      a large preset (gpt2_1558m) at micro_batch 1 per ZeRO stage: the states a rank holds next to the
   ZeRO paper's formulas (16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N), the step transient and the peak.
Rank 0 prints a table; --out appends a JSON line per row. ~2 minutes on 4 H100s (--quick: ~1). Scaling 1 -> N:
run with N = 1 and --out F, then with N and --baseline F on the same machine: tok/s / (N x 1-GPU tok/s).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import time

import torch
import torch.distributed as dist

import harness as H
from nanopara import zero3
from nanopara.mesh import Mesh
from nanopara.model import GPT
from nanopara.optim import build_adamw

MODES = ["torch_ddp", "ddp", "zero1", "zero2", "zero3"]


def make_cfg(preset: str, micro_batch: int, seq_len: int, zero: int, dp: int, accum: int, variant: str = "",
             bucket: str = ""):
    keys = {"model.kernels": "torch", "train.micro_batch": micro_batch, "train.seq_len": seq_len,
            "parallel.zero": zero, "train.tokens_per_step": accum * micro_batch * seq_len * dp}
    if bucket:
        keys["parallel.bucket_mb"] = float(bucket)
    if variant == "bf16":
        keys["parallel.reduce_dtype"] = "bf16"
    if variant.startswith("u"):  # "zero3:u2": units of 2 transformer blocks
        keys["parallel.zero3_unit_blocks"] = int(variant[1:])
    return H.make_cfg(preset, keys)


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
        if name == "start":
            self.steps.append({})
        if name not in self.steps[-1]:  # a phase's first mark in the step (each micro-step marks "fwd")
            self.steps[-1][name] = torch.cuda.Event(enable_timing=True)
            self.steps[-1][name].record()

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


def torch_ddp_step(mesh, cfg, phases, batches):
    """The baseline: torch's DistributedDataParallel, clip_grad_norm_ and the same fused AdamW, its own loop."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).to(mesh.device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[mesh.local_rank] if mesh.device.type == "cuda" else None, bucket_cap_mb=25,
        gradient_as_bucket_view=True)
    opt, amp = build_adamw(model.named_parameters(), cfg.train, mesh.device), H.autocast(cfg, mesh.device)[0]
    sizes = {"n_params": model.num_params(), "psi": sum(p.numel() for p in model.parameters())}

    def fwd_bwd():
        for m, (x, y) in enumerate(batches):
            with ddp.no_sync() if m < len(batches) - 1 else contextlib.nullcontext():
                with amp():
                    _, loss = ddp(x, y)
                phases.mark("fwd")
                (loss / len(batches)).backward()
        phases.mark("bwd")
        phases.mark("grads")  # torch DDP waits for its last bucket inside backward

    def finish():
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        phases.mark("end")
        return norm

    return fwd_bwd, finish, model, None, sizes


def trainer_step(mesh, cfg, phases, batches, variant=""):
    """One of ours through the Trainer, its engine changed by the variant; phase marks by a forward hook and
    around the engine's wait for its gradients."""
    if variant.startswith("p"):  # "zero3:p2": ZeRO-3 gathers 2 units ahead (zero3.PREFETCH, read at each hook)
        zero3.PREFETCH = int(variant[1:])
    sizes = {}  # of the whole model, before ZeRO-3 shards it (the tied weight once)
    trainer, _ = H.build_trainer(cfg, H.solo_mesh(mesh.device) if variant == "single" else mesh, lambda m: sizes.update(
        n_params=m.num_params(), psi=sum(p.numel() for p in m.parameters())))
    engine = trainer.engine
    if variant.startswith("i"):  # "zero2:i4": ZeRO-2/3 keep up to 4 full-size reductions in flight (max_inflight)
        engine.max_inflight = int(variant[1:])
    if variant == "nocomm":  # control, not a result: the engine's hooks and buffers, its all-reduces skipped
        engine._launch = lambda i: _Done()
    if variant == "normfirst":  # the step that reads the norm before issuing the update (CPU's path)
        engine.async_step = False
    if variant in ("nodest", "dest"):  # ZeRO-2 without gradient destinations / DDP with them
        engine._set_grad_dests([] if variant == "nodest" else engine.params)
    trainer.model.register_forward_hook(lambda *a: phases.mark("fwd"))
    engine.tails = []  # (start, end) CUDA events around the gradient wait at the step: exposed communication
    if mesh.device.type == "cuda":
        finish_grads = engine._finish_grads

        def timed_finish():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            finish_grads()
            b.record()
            engine.tails.append((a, b))
            phases.mark("grads")
        engine._finish_grads = timed_finish

    def fwd_bwd():
        trainer.forward_backward(batches)
        phases.mark("bwd")

    def finish():
        norm = trainer.step(cfg.train.lr, sync=False)
        phases.mark("end")
        return norm
    return fwd_bwd, finish, trainer, engine, sizes


def host_ms(fwd_bwd, finish, mesh) -> float:
    """CPU time to issue one step's forwards + backwards while a sleep kernel keeps the GPU busy (so the CPU never
    waits for it). Near or above the GPU time of the same work, the step is bound by the host (Python, launches),
    not by the GPU. The step is then finished normally (every rank does the same: collectives)."""
    if mesh.device.type != "cuda":
        return float("nan")
    H.sync(mesh.device)
    dist.barrier()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s at H100/H200 clocks
    slept = torch.cuda.Event()
    slept.record()
    t0 = time.perf_counter()
    fwd_bwd()
    dt = time.perf_counter() - t0
    busy = not slept.query()  # still sleeping when the last backward kernel was issued: a valid measurement.
    # Otherwise nan: the CPU waited for the GPU somewhere, e.g. a full launch queue (~1000 pending kernels; DDP's
    # per-parameter gradient accumulation kernels take it over that at 124M)
    finish()
    H.sync(mesh.device)
    return dt * 1e3 if busy else float("nan")


def profile_step(step, mesh, label) -> dict | None:
    """One step profiled on rank 0 (every rank runs it: collectives): the harness's summary, and the largest gaps
    of the compute stream (where in the step, between which kernels)."""
    kernels = H.profile(step, mesh.device, on=mesh.is_main and mesh.device.type == "cuda")
    if not kernels:
        return None
    s = H.kernel_summary(kernels, top=12)
    compute = sorted((k for k in kernels if H.kernel_kind(k[0]) != "comm"), key=lambda k: k[1])
    t0, gaps, end, last = min(k[1] for k in kernels), [], compute[0][2], compute[0][0]
    for name, a, b in compute[1:]:
        if a > end:
            gaps.append(((a - end) / 1e3, (end - t0) / 1e3, last, name))
        if b > end:
            end, last = b, name
    s["gaps"] = sorted(gaps, reverse=True)[:10]
    print(H.summary_lines(s, f"{label} (rank 0, one step)") + "\n  largest compute-stream gaps (ms, at ms, "
          "kernel before -> after):\n" + "\n".join(f"  {g:7.2f} at {at:6.1f}  {a[:45]} -> {b[:45]}"
                                                   for g, at, a, b in s["gaps"]), flush=True)
    return s


def run_mode(mode, cfg, mesh, args, accum, warmup, steps, variant="") -> dict:
    cuda, label = mesh.device.type == "cuda", mode + (f":{variant}" if variant else "")
    start, prefetch = torch.cuda.memory_allocated() if cuda else 0, zero3.PREFETCH
    batches = H.synthetic_batches(cfg, 1, mesh.device, seed=mesh.rank) * accum  # timing, not data: one repeated
    ph = Phases()
    fwd_bwd, finish, owner, engine, sizes = (torch_ddp_step(mesh, cfg, ph, batches) if mode == "torch_ddp"
                                             else trainer_step(mesh, cfg, ph, batches, variant))

    def step():
        ph.mark("start")
        fwd_bwd()
        return finish()
    H.timed(step, 0, warmup, device=mesh.device)
    gc.collect()  # no empty_cache() here: the first timed step would cudaMalloc every activation again
    base = torch.cuda.memory_allocated() / H.GB if cuda else 0.0  # the states (and the batch): what a step starts from
    if engine is not None:
        engine.tails.clear()
    if cuda:  # (a few CUDA events per step: the median step; the phases themselves are printed with --phases)
        ph.start()
    t = H.timed(step, steps, mesh=mesh)
    ph.mark("start")  # the end of the last step's gap
    ph.stop()
    per_rank = None
    if ph.steps:  # every rank took this branch (cuda is the same everywhere)
        mine = torch.tensor(ph.summary(), device=mesh.device)
        every = [torch.empty_like(mine) for _ in range(mesh.world)]
        dist.all_gather(every, mine)
        per_rank = [e.tolist() for e in every]
    tails = getattr(engine, "tails", None)
    tail = sum(a.elapsed_time(b) for a, b in tails) / steps if tails else float("nan")
    fastest, tail, base = H.max_over_ranks([-t["step_s"], tail, base], mesh)
    row = {"section": "throughput", "mode": label, "accum": accum, "micro_batch": cfg.train.micro_batch,
           "tok_s": mesh.world * cfg.train.micro_batch * cfg.train.seq_len * accum / t["step_s"],
           "step_ms": t["step_s"] * 1e3, "fastest_rank_step_ms": -fastest * 1e3, "tail_ms": tail,
           "phases": None if per_rank is None else [dict(zip(PHASE_KEYS, v)) for v in per_rank],
           "step_ms_median": max(v[PHASE_KEYS.index("median")] for v in per_rank) if per_rank else float("nan"),
           "host_ms": host_ms(fwd_bwd, finish, mesh), "peak_GB": t["peak_gb"], **sizes}
    row.update(base_GB=base, transient_GB=row["peak_GB"] - base)
    row["profile"] = profile_step(step, mesh, label) if args.profile else None
    zero3.PREFETCH = prefetch  # a "zero3:pK" variant changed it for its own run only
    states = engine.memory_bytes() if engine is not None else None
    row["states_GB"] = None if states is None else sum(states.values()) / H.GB
    if engine is not None:
        owner.close()
        engine.close()
    del fwd_bwd, finish, owner, engine, batches
    H.free()
    row["left_GB"] = (torch.cuda.memory_allocated() - start) / H.GB if cuda else 0.0
    if row["left_GB"] > 0.1:  # cuBLAS workspaces (tens of MB) may stay after the first mode; a model would not
        print(f"WARNING rank {mesh.rank}: {label} left {row['left_GB']:.2f} GB allocated after cleanup", flush=True)
    if per_rank and args.phases and mesh.is_main:
        print("\n".join(phase_line(label, r, v) for r, v in enumerate(per_rank)), flush=True)
    return row


def formula_bytes(stage: int, psi: int, n: int) -> float:
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


def throughput(args, mesh, small: str, warmup: int, steps: int) -> list[dict]:
    rows = []
    for spec in args.modes.split(","):
        mode, _, variant = spec.partition(":")
        base_mode, _, bucket = mode.partition("@")
        zero = {"torch_ddp": 0, "ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[base_mode]
        cfg = make_cfg(small, args.micro_batch, args.seq_len, zero, 1 if variant == "single" else mesh.world,
                       args.accum, variant, bucket)
        r = run_mode(mode, cfg, mesh, args, args.accum, warmup, steps, variant)
        r["mfu"] = H.mfu(cfg, r["n_params"], r["tok_s"], mesh.world, mesh.device)
        rows.append(r)
    base = next((r["tok_s"] for r in rows if r["mode"] == "torch_ddp"), None)
    one = {r["mode"]: r for r in H.read_jsonl(args.baseline) if r.get("section") == "throughput"} if args.baseline \
        else {}
    for r in rows:
        ref = one.get("torch_ddp" if r["mode"] == "torch_ddp" else "ddp")
        r["vs_torch_ddp"] = r["tok_s"] / base if base else None
        r["scaling"] = r["tok_s"] / (mesh.world * ref["tok_s"]) if ref else None
        r["scaling_median"] = (args.accum * ref["step_ms_median"] / (ref["accum"] * r["step_ms_median"])
                               if ref else None)  # per-GPU tokens a ms, by the median steps
    return rows


def memory(args, mesh, big: str) -> list[dict]:
    rows = []
    for stage in range(4):
        cfg = make_cfg(big, 1, args.seq_len, stage, mesh.world, 1)
        r = run_mode("ddp" if stage == 0 else f"zero{stage}", cfg, mesh, args, 1, 1, 2)
        r.update(section="memory", stage=stage, formula_GB=formula_bytes(stage, r["psi"], mesh.world) / H.GB,
                 paper=["16Ψ", "8Ψ+8Ψ/N", "4Ψ+12Ψ/N", "16Ψ/N"][stage])
        rows.append(r)
    return rows


COLS = [("mode", "mode", ""), ("tok_s", "tok/s", ",.0f"), ("vs_torch_ddp", "vs torch", ".3f"),
        ("scaling", "scaling", ".1%"), ("mfu", "MFU", ".1%"), ("step_ms", "step ms", ".1f"),
        ("fastest_rank_step_ms", "fast ms", ".1f"), ("tail_ms", "tail ms", ".2f"), ("host_ms", "host ms", ".1f"),
        ("step_ms_median", "med ms", ".1f"), ("scaling_median", "med scal", ".1%"), ("peak_GB", "peak GB", ".2f"),
        ("states_GB", "states GB", ".2f"), ("base_GB", "base GB", ".2f"), ("transient_GB", "transient", ".2f")]
MEM_COLS = [("stage", "stage", "d"), ("states_GB", "states GB", ".2f"), ("formula_GB", "formula GB", ".2f"),
            ("paper", "(paper)", ""), ("base_GB", "base GB", ".2f"), ("transient_GB", "transient", ".2f"),
            ("peak_GB", "peak GB", ".2f"), ("tok_s", "tok/s", ",.0f")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--out", default="", help="append the rows as JSON lines here")
    ap.add_argument("--micro_batch", type=int, default=16, help="sequences per GPU per step (124M part)")
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--baseline", default="", help="the --out of a 1-GPU run on this machine: adds scaling = tok/s / "
                    "(N * 1-GPU tok/s of the same engine; ours at dp=1 is the SingleDevice engine)")
    ap.add_argument("--accum", type=int, default=1, help="micro-steps per optimizer step (gradient accumulation; "
                    "communication on the last one only). GPT-2's 0.5M-token batch at B=16 x T=1024: 32 / N GPUs")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per mode")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    ap.add_argument("--profile", action="store_true", help="after each mode's timed steps, profile one step on rank 0")
    ap.add_argument("--phases", action="store_true", help="per-rank medians of each step phase's GPU time")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}, with variants")
    ap.add_argument("--large", default="gpt2_1558m", help="preset of the memory part ('' skips it)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a gloo smoke test of this script on the tiny preset, not a measurement")
    args = ap.parse_args()
    mesh = Mesh.build(dp=-1, device=args.device)
    if not dist.is_initialized():  # one process (the dp=1 baseline): torch DDP and barriers still want a group
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1,
                                store=dist.HashStore(), device_id=mesh.device if args.device == "cuda" else None)
    warmup, steps = (2, 5) if args.quick else (args.warmup, args.steps)
    small, big = ("gpt2_124m", args.large) if args.device == "cuda" else ("tiny", "tiny" if args.large else "")
    rows = throughput(args, mesh, small, warmup, steps)
    large = memory(args, mesh, big) if big else []
    log = H.printer(mesh)
    log(H.banner(f"bench_dp {small}, B={args.micro_batch}/GPU x {args.accum} micro-steps, T={args.seq_len}, "
                 f"kernels=torch, {steps} timed steps", mesh))
    log(H.table(rows, COLS))
    if large:
        log(f"\n{big}: Ψ = {large[0]['psi'] / 1e9:.3f}B parameters, B=1, per ZeRO stage on {mesh.world} GPUs")
        log(H.table(large, MEM_COLS))
    if mesh.is_main:
        H.append_jsonl(args.out, [dict(r, gpus=mesh.world, seq_len=args.seq_len, preset=small) for r in rows]
                       + [dict(r, gpus=mesh.world, preset=big) for r in large])
    mesh.destroy()


if __name__ == "__main__":
    main()
