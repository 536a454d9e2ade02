"""What every benchmark shares: the run (config -> GPT -> parallelize), timing, profiles, tables and result rows.

    import harness as H
    cfg = H.make_cfg("gpt2_124m", {"train.micro_batch": 16})        # a preset with checked overrides
    trainer, n_params = H.build_trainer(cfg, mesh)                   # train.py's model and step object
    batches = H.synthetic_batches(cfg, trainer.accum, mesh.device)   # one optimizer step of random tokens
    t = H.timed(lambda: H.train_step(trainer, batches), steps=10, warmup=5, mesh=mesh)
    H.kernel_summary(H.profile(lambda: H.train_step(trainer, batches), mesh.device))
    print(H.table(rows, [("mode", "mode", ""), ("tokens_per_s", "tok/s", ",.0f")]))
    H.append_jsonl(path, rows)                                       # each row with gpu, date and git revision

Timing: host clock between device syncs, every rank's seconds max-reduced over the mesh (the slowest rank sets the
pace); each=True also syncs and times every step alone (median, min, max: a one-time cost, e.g. an autotune,
shows as one slow step). Clock stamps CUDA events on GPU, the host clock on CPU. Profiles: the GPU kernels of one
step (name, start_us, end_us); on CPU (smoke runs) the operators' self times laid end to end stand in for them.
From a profile: `comm` = the union of the communication (NCCL) kernels' intervals, `exposed` = the part of it
during which no compute kernel runs (what the step waits on communication), `busy` = the union of the compute
kernels (GPU-busy share = busy / span), and GPU ms per kernel kind (KINDS: the first kind one of whose name parts
the kernel's name holds).
"""
from __future__ import annotations

import datetime
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nanopara.cli import parse_args  # noqa: E402
from nanopara.config import Config  # noqa: E402
from nanopara.mesh import Mesh, grid_coords  # noqa: E402
from nanopara.model import GPT  # noqa: E402
from nanopara.parallel import parallelize  # noqa: E402
from nanopara.presets import PRESETS  # noqa: E402, F401  (the benches' --preset choices)
from nanopara.report import flops_per_token, peak_flops  # noqa: E402
from nanopara.trainer import autocast  # noqa: E402

GB = 1e9


# ----------------------------------------------------------------------------------------------------------------
# the run: train.py's config, model and step object

def make_cfg(preset: str, overrides: dict | None = None) -> Config:
    """The preset with `--key=value` overrides {"train.micro_batch": 8, ...}, typed and checked as train.py does
    (no text samples: a bench never draws one, and a short block_size would have to fit them)."""
    keys = {"train.sample_tokens": 0, **(overrides or {})}
    return parse_args([f"--preset={preset}"] + [f"--{k}={v}" for k, v in keys.items()])


def build_trainer(cfg: Config, mesh: Mesh, prepare=None):
    """GPT(cfg.model) on the host, `prepare(model)` (a bench's change: other ops, torchao), parallel.parallelize:
    (Trainer, parameter count of the whole model as report.flops_per_token counts it)."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    n_params = model.num_params()
    if prepare is not None:
        prepare(model)
    return parallelize(model, mesh, cfg), n_params


def synthetic_batches(cfg: Config, n: int, device, seed: int = 0) -> list:
    """n micro-batches [(x, y)] of random tokens on the device (y = x shifted by one): one step of `n` micro-steps.
    Seed by dp rank: tp and cp ranks of one replica must see the same tokens."""
    t = cfg.train
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, cfg.model.vocab_size, (n, t.micro_batch, t.seq_len + 1), generator=g).to(device)
    return [(tok[i, :, :-1], tok[i, :, 1:]) for i in range(n)]


def train_step(trainer, batches: list, lr: float = 1e-4) -> torch.Tensor:
    """One optimizer step as train.py takes it; the loss unread (nothing waits for the GPU)."""
    loss = trainer.forward_backward(batches)
    trainer.step(lr, sync=False)
    return loss


def solo_mesh(device) -> Mesh:
    """A world-of-one mesh on this rank's device inside a multi-process job: the single-GPU baseline that each
    rank (or one of them) runs alone, no process group involved."""
    sizes = {"pp": 1, "dp": 1, "cp": 1, "tp": 1}
    mesh = Mesh(0, 1, device.index or 0, device, sizes, grid_coords(0, sizes))
    mesh._make_groups()
    return mesh


def amp(device, dtype: str = "auto"):
    """train.py's autocast (nanopara.trainer.autocast) for a dtype name: auto = bf16 on GPU, none (fp32) on CPU."""
    return autocast(dtype, torch.device(device))[0]


def mfu(cfg: Config, n_params: int, tokens_per_s: float, n_gpu: int, device) -> float:
    """Model FLOPs (report.flops_per_token: 6N + attention) over the dense bf16 peak of n_gpu such GPUs; 0 on CPU."""
    peak = peak_flops(torch.device(device))
    return flops_per_token(cfg.model, n_params, cfg.train.seq_len) * tokens_per_s / (n_gpu * peak) if peak else 0.0


def free() -> None:
    """Collect cycles (a failed step's traceback holds its tensors) and hand the allocator's cache back."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.clear_autocast_cache()
        gc.collect()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------------
# timing

def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def max_over_ranks(values: list[float], mesh: Mesh | None = None) -> list[float]:
    """Each value's maximum over the mesh's ranks (its whole world); as given for a world of one."""
    if mesh is None or mesh.world == 1 or not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=mesh.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def peak_gb(device) -> float:
    return torch.cuda.max_memory_allocated(device) / GB if torch.device(device).type == "cuda" else 0.0


def reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def timed(step, steps: int, warmup: int = 0, mesh: Mesh | None = None, device=None, each: bool = False,
          peak_from_start: bool = False) -> dict:
    """Warm-up calls of step(), then `steps` timed ones. Seconds per step (step_s: over all timed steps; with each:
    median_s, min_s, max_s of steps synced one by one) and peak GB, each the maximum over the mesh's ranks; `last`
    is the last call's return value. Peak memory counts from after the warm-up, or from the start where
    peak_from_start (a CUDA graph's pool is allocated at its capture, in the warm-up, and held for good)."""
    dev = mesh.device if mesh is not None else torch.device(device or "cpu")
    if peak_from_start:
        reset_peak(dev)
    for _ in range(warmup):
        step()
    sync(dev)
    if not peak_from_start:
        reset_peak(dev)
    if mesh is not None and mesh.world > 1:
        dist.barrier()
    times, last = [], None
    t0 = time.perf_counter()
    for _ in range(steps):
        t1 = time.perf_counter()
        last = step()
        if each:
            sync(dev)
            times.append(time.perf_counter() - t1)
    sync(dev)
    mean = (time.perf_counter() - t0) / max(steps, 1)
    times = times or [mean]
    vals = max_over_ranks([mean, statistics.median(times), min(times), max(times), peak_gb(dev)], mesh)
    return dict(zip(("step_s", "median_s", "min_s", "max_s", "peak_gb"), vals), times=times, last=last)


def bench_ms(fn, device="cuda", reps: int = 3, grad_to_none=None) -> float:
    """ms of one call of fn: the median of Triton's do_bench on CUDA (grad_to_none: tensors whose .grad it resets
    before each call); on CPU (smoke runs, numbers that mean nothing) the mean of `reps` calls."""
    if torch.device(device).type == "cuda":
        import triton
        return triton.testing.do_bench(fn, grad_to_none=grad_to_none, return_mode="median")
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


class Clock:
    """Timestamps on the compute stream: CUDA events on GPU, the host clock on CPU; ms(a, b) between two."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


# ----------------------------------------------------------------------------------------------------------------
# profiles: where a step's GPU time goes

# (kind, lower-case name parts): the first kind with a part in the kernel's name wins; none: "other"
KINDS = (("comm", ("nccl", "c10d::", "gloo")),
         ("attention", ("attn", "flash", "fmha", "sdpa", "cudnn")),
         ("fp8 cast", ("_amax", "_cast_kernel", "_rows_kernel", "_blocks_kernel", "float8", "to_fp8")),
         ("fp8 gemm", ("_fp8_matmul", "e4m3", "e5m2", "f8f8", "scaled_mm")),
         ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk", "wgmma", "_matmul", "_mm_", "aten::mm",
                   "aten::addmm", "aten::bmm", "_wgrad")),  # _wgrad: the MoE grouped GEMM's weight gradient
         ("adamw", ("adamw", "adam", "multi_tensor", "foreach")),
         ("layernorm", ("layernorm", "layer_norm", "_ln_")),
         ("cross entropy", ("_ce_", "cross_entropy", "log_softmax", "nll_loss")),
         ("inductor fused", ("triton_poi", "triton_red", "triton_per")),
         ("elementwise", ("elementwise", "vectorized", "gelu", "copy", "fill")),
         ("reduction", ("reduce", "sum")))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, parts in KINDS if any(p in low for p in parts)), "other")


def profile(step, device, on: bool = True) -> list[tuple[str, float, float]]:
    """One call of step() under torch.profiler: its GPU kernels (name, start_us, end_us). on=False runs step()
    unprofiled (a rank that only takes part in the collectives of rank 0's profiled step)."""
    dev = torch.device(device)
    sync(dev)
    if not on:
        step()
        sync(dev)
        return []
    from torch.profiler import ProfilerActivity
    cuda = dev.type == "cuda"
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step()
        sync(dev)
    if cuda:
        return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA]
    out, t = [], 0.0
    for e in prof.key_averages():  # CPU: each operator's self time, end to end
        if e.self_cpu_time_total > 0:
            out.append((e.key, t, t + e.self_cpu_time_total))
            t += e.self_cpu_time_total
    return out


def _union(iv) -> tuple[float, list]:
    """Total length of a union of (start, end) intervals, and the merged list."""
    merged = []
    for a, b in sorted(iv):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return sum(b - a for a, b in merged), merged


def _overlap(xs, ys) -> float:
    """Length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        total += max(0.0, min(xs[i][1], ys[j][1]) - max(xs[i][0], ys[j][0]))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernel_summary(kernels, top: int = 15) -> dict:
    """ms of a profiled step (kernels in us): span, compute-busy, comm, exposed comm, per kind, costliest names."""
    if not kernels:
        return {"span_ms": 0.0, "busy_ms": 0.0, "gpu_busy_share": 0.0, "comm_ms": 0.0, "exposed_comm_ms": 0.0,
                "kernels": 0, "kernel_ms_by_kind": {}, "top_kernels_ms": []}
    comm, comm_iv = _union([(s, e) for n, s, e in kernels if kernel_kind(n) == "comm"])
    busy, busy_iv = _union([(s, e) for n, s, e in kernels if kernel_kind(n) != "comm"])
    span = max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)
    kinds, names = {}, {}
    for n, s, e in kernels:
        kinds[kernel_kind(n)] = kinds.get(kernel_kind(n), 0.0) + (e - s) / 1e3
        calls, ms = names.get(n[:100], (0, 0.0))
        names[n[:100]] = (calls + 1, ms + (e - s) / 1e3)
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "gpu_busy_share": busy / span if span else 0.0,
            "comm_ms": comm / 1e3, "exposed_comm_ms": (comm - _overlap(comm_iv, busy_iv)) / 1e3,
            "kernels": len(kernels),
            "kernel_ms_by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": [[n, ms, calls] for n, (calls, ms) in sorted(names.items(), key=lambda kv: -kv[1][1])
                               [:top]]}


def summary_lines(s: dict, label: str = "") -> str:
    """A kernel_summary as text: the step's span, busy share, comm, then ms per kind and the costliest kernels."""
    lines = [f"profile {label}: span {s['span_ms']:.2f} ms, compute busy {s['busy_ms']:.2f} ms "
             f"({100 * s['gpu_busy_share']:.1f}%), comm {s['comm_ms']:.2f} ms, exposed {s['exposed_comm_ms']:.2f} ms, "
             f"{s['kernels']} kernels",
             "  ms by kind: " + ", ".join(f"{k} {v:.2f}" for k, v in s["kernel_ms_by_kind"].items())]
    return "\n".join(lines + [f"  {ms:8.2f} ms {calls:5d}x  {n}" for n, ms, calls in s["top_kernels_ms"]])


# ----------------------------------------------------------------------------------------------------------------
# results: stamped rows, tables

def git_rev() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def gpu_name(device=None) -> str:
    dev = torch.device(device) if device is not None else None
    if (dev is None and torch.cuda.is_available()) or (dev is not None and dev.type == "cuda"):
        return torch.cuda.get_device_name(dev)
    return "cpu"


@functools.lru_cache(maxsize=None)
def stamp() -> dict:
    """What every result row carries: the GPU (or cpu), today's date, the git revision, torch's version."""
    return {"gpu": gpu_name(), "date": datetime.date.today().isoformat(), "git": git_rev(),
            "torch": torch.__version__}


def append_jsonl(path: str | None, rows) -> None:
    """Append rows (one dict or a list) as JSON lines, each stamped (stamp()); a row's own keys win."""
    if not path:
        return
    rows = [rows] if isinstance(rows, dict) else rows
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.writelines(json.dumps({**stamp(), **r}, default=str) + "\n" for r in rows)


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def table(rows: list[dict], cols: list[tuple], title: str = "") -> str:
    """Rows as aligned text: cols are (key, header, format spec); a missing or None value prints '-'. A spec
    ending in '%' formats a fraction as a percentage (format(0.5, '.1%') = 50.0%)."""
    def cell(r, key, spec):
        v = r.get(key)
        if v is None or (isinstance(v, float) and v != v):
            return "-"
        return format(v, spec) if spec else str(v)
    body = [[cell(r, k, spec) for k, _, spec in cols] for r in rows]
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, (_, h, _) in enumerate(cols)]
    first = [c[2] == "" for c in cols]  # text columns align left, numbers right
    fmt = lambda cells: "  ".join(c.ljust(w) if left else c.rjust(w)  # noqa: E731
                                  for c, w, left in zip(cells, widths, first)).rstrip()
    lines = ([title] if title else []) + [fmt([h for _, h, _ in cols])] + [fmt(b) for b in body]
    return "\n".join(lines)


def banner(what: str, mesh: Mesh | None = None) -> str:
    """One line: what runs, on how many of which GPU, the date and revision (the first line of a bench's output)."""
    s, n = stamp(), mesh.world if mesh is not None else 1
    gpu = gpu_name(mesh.device if mesh else None)
    return f"{what} | {n} x {gpu} | {s['date']} | git {s['git']} | torch {s['torch']}"


def printer(mesh: Mesh | None):
    """print on rank 0, nothing on the others."""
    return print if mesh is None or mesh.is_main else (lambda *a, **k: None)
