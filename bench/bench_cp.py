"""Context parallel on N GPUs: CP efficiency of a training step, zigzag load balance, exposed communication.

    torchrun --nproc_per_node=2 bench/bench_cp.py --out=DIR                 # gpt_1b, T = 16384: ~2-3 minutes
    torchrun --nproc_per_node=2 bench/bench_cp.py --out=DIR --memory        # + peak memory at T/2 and T, AC on/off
    torchrun --nproc_per_node=4 bench/bench_cp.py --out=DIR --seq_len=32768  # cp=4 (N = the processes: cp = N)
    torchrun --nproc_per_node=2 bench/bench_cp.py --device=cpu --n_layer=2 --n_embd=64 --n_head=2 --seq_len=64 \
        --out=/tmp/cp  # CPU smoke test of the logic (gloo, reference blocks)

Every step runs the trainer's path (parallel.parallelize -> engine.model / backward / step) on synthetic tokens:
gpt_1b (18 blocks of 2048, 16 heads of 128) with block_size = seq_len, micro-batch 1, bf16 autocast, the Triton
kernels. Sections (rank 0 prints; DIR/cp.json holds all numbers with the GPU name and date):
1. step     one GPU: each rank trains the single-device model alone (a world-of-one mesh, no communication);
            cp=N: the N GPUs share one sequence (ring attention; the dp x cp gradient all-reduce of DDP).
            CP efficiency = t_1gpu / (N * t_cpN); tok/s, MFU (6N + 12 L C T FLOPs a token, causal not
            discounted, as train.py; dense bf16 peak) and peak memory per GPU. If one GPU runs out of memory, both
            runs repeat with full activation checkpointing (said in the output).
2. exposed  the cp=N step with ring attention's send/recv replaced by a no-op (same kernels and shapes, wrong
            values): (t_cpN - t_nocomm) / n_layer = communication not hidden behind compute, per layer, fwd + bwd;
            beside it the time of the messages themselves (one K/V ping between the GPUs, x the messages a layer
            sends: cp-1 K/V forward, cp-1 K/V + cp-1 dK/dV parts (at most a K/V block each) backward).
   ulysses  the cp=N step with parallel.cp_impl=ulysses (all-to-all heads <-> sequence): time, CP efficiency.
3. balance  one layer's ring attention fwd + bwd at (1, 16, T/N, 128) bf16 per rank, zigzag vs contiguous split:
            compute per rank (no communication; CUDA events), max/min over ranks, and the ring's wall time.
4. memory   (--memory) peak memory at T/2 and T, 1 GPU and cp=N, activation checkpointing none and full, and the
            longest T each would fit in the GPU's memory on a straight line through the two points (activations
            grow linearly in T with flash attention) -- an extrapolation, labelled so.
--profile writes DIR/trace_cpN_rank{0,1,..}.json: a chrome trace of one cp=N step per rank (ui.perfetto.dev).
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

from nanopara import ring_attention as cp  # noqa: E402
from nanopara.presets import PRESETS  # noqa: E402
from nanopara.mesh import Mesh  # noqa: E402
from nanopara.model import GPT  # noqa: E402
from nanopara.parallel import parallelize  # noqa: E402
from nanopara.report import flops_per_token, peak_flops  # noqa: E402

GB = 1e9


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for cp.json")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seq_len", type=int, default=16384)
    ap.add_argument("--n_layer", type=int, default=18)
    ap.add_argument("--n_embd", type=int, default=2048)
    ap.add_argument("--n_head", type=int, default=16)
    ap.add_argument("--ac", default="none", choices=["none", "full", "selective"], help="activation checkpointing")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    ap.add_argument("--memory", action="store_true", help="section 4: peak memory at T/2 and T, AC none and full")
    ap.add_argument("--profile", action="store_true", help="a torch.profiler trace of one cp=2 step per rank")
    return ap.parse_args()


def make_cfg(args, cp_degree: int, T: int, ac: str, impl: str = "ring"):
    cfg = PRESETS["gpt_1b"]()
    m, t = cfg.model, cfg.train
    m.n_layer, m.n_embd, m.n_head, m.block_size = args.n_layer, args.n_embd, args.n_head, args.seq_len
    m.kernels = "auto"
    t.seq_len, t.micro_batch, t.activation_checkpointing = T, 1, ac
    t.dtype = "bf16" if args.device == "cuda" else "fp32"
    cfg.device, cfg.parallel.dp, cfg.parallel.cp, cfg.parallel.cp_impl = args.device, 1, cp_degree, impl
    t.sample_tokens = 0
    cfg.check()
    return cfg


def solo_mesh(mesh: Mesh) -> Mesh:
    """A world-of-one mesh on this rank's device: the single-device baseline, run by each rank on its own GPU."""
    solo = Mesh(0, 1, mesh.local_rank, mesh.device, {"pp": 1, "dp": 1, "cp": 1, "tp": 1},
                {"pp": 0, "dp": 0, "cp": 0, "tp": 0})
    solo._make_groups()
    return solo


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(engine, x, y, n, amp):
    for _ in range(n):
        with amp():
            _, loss = engine.model(x, y)
        engine.backward(loss.float())
        engine.step(1e-4, sync=False)


def time_config(args, mesh, run_mesh, cp_degree, T, ac, warmup=2, trace="", impl="ring"):
    """Seconds per step (slowest rank of the run) and peak GB (max over ranks); None values after an OOM."""
    cfg = make_cfg(args, cp_degree, T, ac, impl)
    dev = mesh.device
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if dev.type == "cuda" else contextlib.nullcontext
    result, engine = {"cp": cp_degree, "impl": impl, "seq_len": T, "ac": ac}, None
    try:
        torch.manual_seed(1337)
        with torch.device(dev):
            model = GPT(cfg.model)
        n_params = model.num_params()
        engine = parallelize(model, run_mesh, cfg)
        del model
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randint(0, cfg.model.vocab_size, (1, T), generator=g).to(dev)  # the same sequence on every rank
        y = torch.randint(0, cfg.model.vocab_size, (1, T), generator=g).to(dev)
        run_steps(engine, x, y, warmup, amp)  # autotuning, allocator
        sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        if run_mesh.world > 1:
            dist.barrier(group=run_mesh.groups["cp"])
        t0 = time.perf_counter()
        run_steps(engine, x, y, args.steps, amp)
        sync(dev)
        dt = (time.perf_counter() - t0) / args.steps
        if trace:  # one more step under the profiler: kernels and NCCL send/recv on their streams, per rank
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run_steps(engine, x, y, 1, amp)
                sync(dev)
            prof.export_chrome_trace(trace)
        mem = torch.cuda.max_memory_allocated(dev) / GB if dev.type == "cuda" else 0.0
        tok_s = T / dt  # one sequence per step, whatever the number of GPUs sharing it
        peak = peak_flops(dev)
        result.update(step_s=dt, tok_s=tok_s, peak_mem_gb=mem,
                      mfu=flops_per_token(cfg.model, n_params, T) * tok_s / (cp_degree * peak) if peak else 0.0)
    except torch.OutOfMemoryError:
        result.update(step_s=None, oom=True)
    finally:
        del engine
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    got = [None] * mesh.world
    dist.all_gather_object(got, result)
    out = dict(result)
    if any(r.get("oom") for r in got):
        out.update(step_s=None, oom=True)
    else:
        out["step_s"] = max(r["step_s"] for r in got)
        out["tok_s"] = T / out["step_s"]
        out["peak_mem_gb"] = max(r["peak_mem_gb"] for r in got)
        out["mfu"] = min(r["mfu"] for r in got)
    return out


class NoComm:
    """Context: ring attention's send/recv replaced by 'the block in hand stays here' (same work, no messages)."""

    def __enter__(self):  # K/V blocks stay put; the dK/dV parts going home are not sent (their buffers not written)
        self.saved = cp._send_recv, cp._post
        cp._send_recv, cp._post = (lambda t, ring: (t, ([], t))), (lambda ops: [])

    def __exit__(self, *exc):
        cp._send_recv, cp._post = self.saved


# ----------------------------------------------------------------------------------------------------------------
# section 3: one layer's ring attention per rank

def attention_times(mesh, T, n_head, head_dim, layout, comm: bool, reps=10):
    """Seconds of one fwd + bwd of ring attention on this rank (events on its stream), gathered over ranks."""
    dev = mesh.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(mesh.rank)
    q, k, v, do = (torch.randn(1, n_head, T // mesh.cp, head_dim, generator=g).to(dev, dtype) for _ in range(4))
    prev, nxt = mesh.neighbours("cp")
    ring = cp.Ring(mesh.groups["cp"], mesh.cp_rank, mesh.cp, prev, nxt, layout=layout, triton=dev.type == "cuda")

    def once():
        out, lse = cp.ring_fwd(q, k, v, ring)
        cp.ring_bwd(do, q, k, v, out, lse, ring)

    with NoComm() if not comm else contextlib.nullcontext():
        once()  # warm-up (autotuning at this shape)
        sync(dev)
        dist.barrier(group=mesh.groups["cp"])
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                once()
            end.record()
            sync(dev)
            dt = start.elapsed_time(end) / 1e3 / reps
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                once()
            dt = (time.perf_counter() - t0) / reps
    got = [None] * mesh.world
    dist.all_gather_object(got, dt)
    return got


def ping_s(mesh, shape, dtype, reps=10):
    """Seconds of one send/recv exchange of a tensor of `shape` with the ring neighbours."""
    dev = mesh.device
    t = torch.zeros(shape, dtype=dtype, device=dev)
    prev, nxt = mesh.neighbours("cp")
    ring = cp.Ring(mesh.groups["cp"], mesh.cp_rank, mesh.cp, prev, nxt)
    cp._wait(cp._send_recv(t, ring)[1])
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        cp._wait(cp._send_recv(t, ring)[1])
    sync(dev)
    return (time.perf_counter() - t0) / reps


# ----------------------------------------------------------------------------------------------------------------

def main():
    args = parse()
    mesh = Mesh.build(dp=1, cp=int(os.environ.get("WORLD_SIZE", "1")), device=args.device)
    n = mesh.cp
    if n < 2:
        raise SystemExit("bench_cp.py runs on N >= 2 processes (cp = N): torchrun --nproc_per_node=2 bench/bench_cp.py")
    log = print if mesh.is_main else (lambda *a, **k: None)
    T, dev = args.seq_len, mesh.device
    res = {"bench": "cp", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "model": {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "seq_len": T,
                     "micro_batch": 1}}
    os.makedirs(args.out, exist_ok=True)

    def save():
        if mesh.is_main:
            with open(os.path.join(args.out, "cp.json"), "w") as f:
                json.dump(res, f, indent=1)

    # 1. step: one GPU vs cp=N ---------------------------------------------------------------------------------
    ac = args.ac
    one = time_config(args, mesh, solo_mesh(mesh), 1, T, ac)
    if one.get("oom") and ac == "none":
        log(f"one GPU: out of memory at T={T} without activation checkpointing; both runs use ac=full")
        ac = "full"
        one = time_config(args, mesh, solo_mesh(mesh), 1, T, ac)
    two = time_config(args, mesh, mesh, n, T, ac,
                      trace=os.path.join(args.out, f"trace_cp{n}_rank{mesh.rank}.json") if args.profile else "")
    res["step"] = {"one_gpu": one, f"cp{n}": two, "ac": ac}
    if one.get("step_s") and two.get("step_s"):
        res["step"]["cp_efficiency"] = one["step_s"] / (n * two["step_s"])
    for name, r in (("1 GPU", one), (f"cp={n} ", two)):
        log(f"{name} T={T} ac={ac}: " + ("out of memory" if r.get("oom") else
            f"{r['step_s'] * 1e3:8.1f} ms/step | {r['tok_s']:9,.0f} tok/s | MFU {r['mfu'] * 100:5.1f}% | "
            f"peak {r['peak_mem_gb']:.1f} GB/GPU"))
    if "cp_efficiency" in res["step"]:
        log(f"CP efficiency t1 / ({n} t_cp{n}) = {res['step']['cp_efficiency'] * 100:.1f}%")
    save()

    # 2. exposed communication ---------------------------------------------------------------------------------
    if two.get("step_s"):
        with NoComm():
            quiet = time_config(args, mesh, mesh, n, T, ac)
        hd = args.n_embd // args.n_head
        kv = ping_s(mesh, (2, 1, args.n_head, T // n, hd), torch.bfloat16 if dev.type == "cuda" else torch.float32)
        dkv = kv  # a dK/dV part going home: at most a K/V block's size, in the same dtype
        msgs = 3 * (n - 1) * kv  # one layer's messages, fwd + bwd, if none were overlapped (parts counted whole)
        exposed = (two["step_s"] - quiet["step_s"]) / args.n_layer if quiet.get("step_s") else None
        res["exposed"] = {"step_s_nocomm": quiet.get("step_s"), "exposed_per_layer_s": exposed,
                          "kv_message_s": kv, "dkv_message_s": dkv, "messages_per_layer_s": msgs}
        if exposed is not None:
            log(f"exposed communication: {exposed * 1e3:.2f} ms per layer (fwd+bwd) of {msgs * 1e3:.2f} ms of "
                f"messages (K/V or dK/dV part {kv * 1e3:.2f} ms each); step without messages "
                f"{quiet['step_s'] * 1e3:.1f} ms")
        save()

    # 2b. Ulysses: the same step with all-to-all attention (heads <-> sequence) instead of the ring
    uly = time_config(args, mesh, mesh, n, T, ac, impl="ulysses")
    res["ulysses"] = uly
    if one.get("step_s") and uly.get("step_s"):
        res["ulysses"]["cp_efficiency"] = one["step_s"] / (n * uly["step_s"])
        log(f"cp={n} Ulysses: {uly['step_s'] * 1e3:8.1f} ms/step | CP efficiency "
            f"{res['ulysses']['cp_efficiency'] * 100:.1f}% | peak {uly['peak_mem_gb']:.1f} GB/GPU")
    save()

    # 3. load balance: one layer's ring attention ----------------------------------------------------------------
    hd = args.n_embd // args.n_head
    res["balance"] = {}
    for layout in ("zigzag", "contiguous"):
        compute = attention_times(mesh, T, args.n_head, hd, layout, comm=False)
        wall = attention_times(mesh, T, args.n_head, hd, layout, comm=True)
        res["balance"][layout] = {"compute_s": compute, "max_over_min": max(compute) / min(compute),
                                  "ring_s": max(wall)}
        log(f"{layout:10s} attention fwd+bwd per rank {', '.join(f'{c * 1e3:.2f}' for c in compute)} ms: "
            f"max/min {max(compute) / min(compute):.3f}; ring with messages {max(wall) * 1e3:.2f} ms")
    save()

    # 4. memory: peak at T/2 and T, and the longest sequence on a straight line ------------------------------
    if args.memory:
        cap = torch.cuda.get_device_properties(dev).total_memory / GB if dev.type == "cuda" else 0.0
        res["memory"] = {"gpu_gb": cap, "note": "max_seq_len: linear extrapolation of peak memory in T"}
        for mode in ("none", "full"):
            for cpd, run_mesh in ((1, solo_mesh(mesh)), (n, mesh)):
                pts = [time_config(args, mesh, run_mesh, cpd, L, mode, warmup=1) for L in (T // 2, T)]
                row = {"points": [(p["seq_len"], p.get("peak_mem_gb")) for p in pts]}
                if all(p.get("peak_mem_gb") for p in pts):
                    (t0, m0), (t1, m1) = row["points"]
                    slope = (m1 - m0) / (t1 - t0)
                    row["max_seq_len"] = int(t1 + (0.95 * cap - m1) / slope) if slope > 0 else None
                res["memory"][f"cp{cpd}_ac_{mode}"] = row
                log(f"memory cp={cpd} ac={mode}: {row['points']} -> longest T ~ {row.get('max_seq_len')} "
                    f"(extrapolated)")
                save()
    log(f"wrote {os.path.join(args.out, 'cp.json')}")
    mesh.destroy()


if __name__ == "__main__":
    main()
