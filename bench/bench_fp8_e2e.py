"""FP8 training end to end on one GPU: nanopara's --train.fp8 modes and torchao float8 against bf16 (issue #26).

    python bench/bench_fp8_e2e.py [--presets gpt_1b,gpt2_124m] [--modes M,...] [--steps 15] [--warmup 5]
        [--batch gpt_1b=8,gpt2_124m=32] [--seq 1024] [--profile] [--out F.jsonl]
    python bench/bench_fp8_e2e.py --compare RUN_A RUN_B [--plot F.png]     # two train.py runs' loss curves
    python bench/bench_fp8_e2e.py --device cpu --presets tiny --modes bf16,tensor --steps 1 --warmup 1  # smoke

Throughput (the default). Each mode builds its own fresh model on a one-process mesh and goes through train.py's
own path: GPT(cfg.model) with model.kernels=auto -> parallel.parallelize (which applies train.fp8 with
fp8.apply_fp8 and registers model.fp8.step as an engine step hook: the FP8 weights are re-cast after every
optimizer update) -> forward under bf16 autocast, engine.backward, engine.step (global-norm clip + fused AdamW).
Synthetic tokens. Modes:
    bf16                  train.fp8=none (the reference of each preset: `x bf16` is tok/s over its tok/s)
    tensor | row | block  train.fp8=tensor|row|block (nanopara/fp8.py; lm_head stays bf16)
    ao_tensorwise         torchao.float8.convert_to_float8_training (recipe "tensorwise") on the same GPT, lm_head
    ao_rowwise            excluded, same engine and optimizer, eager (a benchmark-only comparison: torchao is
                          imported from .carry/torchao when that folder exists; if it does not import, the row
                          records why and the run goes on)
    nanogpt               gpt2_124m only: bench_gpt.py's `torch+compile` mode (PyTorch ops under torch.compile:
                          nanoGPT's training step, the project's e2e baseline, notes/e2e.md)
    bf16+graph, tensor+graph, row+graph   the same modes with forward + backward replayed from a CUDA graph
                          (nanopara/graph.py, train.py's --train.cuda_graph=true; GPU only): the host's share gone
Per mode: median step ms over --steps timed steps after --warmup (the FP8 GEMMs tune themselves on first use:
the warmup covers it), tok/s, TFLOP/s and MFU (nanopara/report.py), peak memory, loss of the last step, ratio to
the preset's bf16. Between modes everything is freed and memory_allocated checked (a warning above 256 MB).
--profile: afterwards one more fresh model of the first preset in the best nanopara FP8 mode measured (or
--profile_mode), --warmup steps, then one step under torch.profiler: GPU kernel time per family (fp8 GEMMs,
quantization, bf16 GEMMs, attention, LayerNorm, cross-entropy, optimizer, elementwise, reductions, ...) and the
top kernels: where the non-GEMM time goes. ~4 min on an H100 with the defaults where the FP8 GEMMs' tunings are
stored already (~/.cache/nanopara/tuned.json); a fresh machine tunes each new GEMM shape once in the warmup (each
row's `tunings`, `tune_s`), a few minutes more.

Loss curves (not run here; ~2-3 min each on an H100): gpt_1b on the book corpus, bf16 against FP8 tensor, then
the comparison (bench/gpu_suite.sh's `fp8` section runs all of this; offline, as there, with
TIKTOKEN_CACHE_DIR=$PWD/.carry/data/tiktoken_cache and the mirror in .carry/data):

    [ -f data/shards/books/books_val_000000.bin ] || python3 data/prepare.py books --mirror .carry/data
    for m in none tensor; do python3 train.py --preset=gpt_1b --data.dataset=books --out_dir=$OUT/fp8_curve_$m \
        --train.fp8=$m --train.steps=1000 --train.micro_batch=8 --train.warmup_steps=100 --train.log_every=50 \
        --train.val_every=250 --ckpt.final=false; done
    python3 bench/bench_fp8_e2e.py --compare $OUT/fp8_curve_none $OUT/fp8_curve_tensor --plot $OUT/fp8_curve.png

--compare: final train loss (mean of the last --tail steps) and last validation loss of each run, their relative
gap (goal: within 1 %), the largest gap over the common validation steps, the median tok/s of each run; a PNG of
both curves if matplotlib imports.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
if os.path.isdir(os.path.join(ROOT, ".carry", "torchao")):  # the GPU machine cannot pip install: a carried wheel
    sys.path.insert(0, os.path.join(ROOT, ".carry", "torchao"))

from bench_recompute import free, tokens  # noqa: E402
from kernels.tuning import STATS as TUNING  # noqa: E402
from nanopara.presets import PRESETS  # noqa: E402
from nanopara.mesh import Mesh  # noqa: E402
from nanopara.model import GPT  # noqa: E402
from nanopara.parallel import parallelize  # noqa: E402
from nanopara.report import flops_per_token, peak_flops, read_metrics  # noqa: E402

NANOPARA_FP8 = ("tensor", "row", "block")
TORCHAO = {"ao_tensorwise": "tensorwise", "ao_rowwise": "rowwise"}
GRAPHED = ("bf16+graph", "tensor+graph", "row+graph")  # the same, forward + backward replayed from a CUDA graph
MODES = ("bf16", *NANOPARA_FP8, *TORCHAO, "nanogpt", *GRAPHED)
DEFAULT_BATCH = {"gpt_1b": 8, "gpt2_124m": 32, "tiny": 2}
LR = 1e-5  # small: the weights barely move over the timed steps
LEAK_BYTES = 256 * 2**20


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def amp(dev):
    """bf16 autocast on the GPU (train.py's default there); fp32 on the CPU (its default there)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()


def torchao_convert(model, recipe: str):
    """torchao float8 training on every Linear but lm_head (the same set nanopara's FP8 takes)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: not fqn.endswith("lm_head"))
    return model


def build(preset: str, mode: str, batch: int, seq: int, mesh):
    """(cfg, model, engine) for a mode, through train.py's path (parallelize applies train.fp8 and its hook)."""
    mode = mode.split("+")[0]  # "tensor+graph": tensor, replayed (timed())
    cfg = PRESETS[preset]()
    cfg.model.kernels = "auto"
    cfg.train.seq_len, cfg.train.micro_batch = seq, batch
    cfg.train.fp8 = mode if mode in NANOPARA_FP8 else "none"
    torch.manual_seed(0)
    with torch.device(mesh.device):
        model = GPT(cfg.model)
    if mode in TORCHAO:
        torchao_convert(model, TORCHAO[mode])
    engine = parallelize(model, mesh, cfg)
    return cfg, model, engine


def train_step(engine, x, y, graphed=None):
    if graphed is not None:  # nanopara/graph.py, as train.py's --train.cuda_graph=true
        loss = graphed(x, y)
    else:
        with amp(x.device):
            _, loss = engine.model(x, y)
        engine.backward(loss)
    engine.step(LR, sync=False)  # engine.step_hooks: model.fp8.step() for the nanopara FP8 modes
    return loss


def teardown(model, engine):
    engine.close()
    model.zero_grad(set_to_none=True)
    engine.optimizer = None


def timed(preset, mode, args, mesh) -> dict:
    """One fresh model in `mode`: warmup, then the timed steps; everything freed before returning."""
    dev = mesh.device
    batch, seq = batch_for(preset, args), seq_for(preset, args)
    cfg, model, engine = build(preset, mode, batch, seq, mesh)
    try:
        n_params = model.num_params()
        fp8_linears = sum(type(m).__name__ in ("FP8Linear", "Float8Linear") for m in model.modules())
        x, y = tokens(dev, batch, seq, cfg.model.vocab_size)
        graphed = None
        if mode.endswith("+graph"):
            from nanopara.graph import GraphedMicroStep
            graphed = GraphedMicroStep(engine.model, lambda: amp(dev), 1.0, engine)
        for _ in range(args.warmup):
            loss = train_step(engine, x, y, graphed)
        sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loss = train_step(engine, x, y, graphed)
            sync(dev)
            times.append(time.perf_counter() - t0)
        loss = loss.item()
        casts = model.fp8.casts if hasattr(model, "fp8") else None
    finally:
        teardown(model, engine)
        del model, engine
    dt = statistics.median(times)
    tok_s = batch * seq / dt
    flops = flops_per_token(cfg.model, n_params, seq) * tok_s
    peak = peak_flops(dev)
    return {"step_ms": dt * 1e3, "step_ms_min": min(times) * 1e3, "tokens_per_s": tok_s, "tflops": flops / 1e12,
            "mfu": flops / peak if peak else 0.0, "loss_last": loss, "fp8_linears": fp8_linears,
            "weight_casts": casts,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else None}


def nanogpt(preset, args, mesh) -> dict:
    """bench_gpt.py's torch+compile mode (PyTorch ops, SDPA, fused AdamW, torch.compile): nanoGPT's step."""
    if mesh.device.type != "cuda":
        raise RuntimeError("nanogpt (torch+compile) is timed on CUDA only")
    import bench_gpt
    torch._dynamo.reset()
    ns = argparse.Namespace(preset=preset, batch=batch_for(preset, args), seq=seq_for(preset, args), steps=args.steps,
                            warmup=args.warmup, profile=None)
    r = bench_gpt.run_mode("torch+compile", ns, mesh)
    torch._dynamo.reset()  # the compiled graph holds the model
    return {k: r[k] for k in ("step_ms", "tokens_per_s", "tflops", "mfu", "peak_mem_gb", "loss_last")} | {
        "bench_gpt_mode": "torch+compile"}


def batch_for(preset, args) -> int:
    return args.batch_map.get(preset, DEFAULT_BATCH.get(preset, 8))


def seq_for(preset, args) -> int:
    """--seq, or the preset's context where that is shorter (tiny: 256)."""
    return min(args.seq, PRESETS[preset]().model.block_size)


# ----------------------------------------------------------------------------------------------------------------
# profile: GPU time per kernel family of one step

# first match wins (lower-case substrings of the kernel name); nanopara's Triton kernels by name (kernels/*.py),
# cuBLAS / torch kernels by their usual name parts
FAMILIES = [
    ("nccl", ("nccl",)),
    ("fp8 quantization/cast", ("_amax_kernel", "_cast_kernel", "_rows_kernel", "_blocks_kernel", "amax",
                               "float8", "to_fp8", "scale_kernel_fp8")),
    ("fp8 gemm", ("_fp8_matmul", "e4m3", "e5m2", "f8f8", "fp8", "scaled_mm")),
    ("bf16 gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk", "wgmma", "aten::mm", "aten::addmm",
                   "aten::bmm", "aten::linear", "aten::matmul")),
    ("attention", ("_attn_", "flash", "fmha", "cudnn", "sdpa", "attention")),
    ("layernorm", ("_layernorm", "layer_norm")),
    ("cross-entropy", ("_ce_", "_scale_kernel", "cross_entropy", "log_softmax", "nll_loss")),
    ("optimizer+clip", ("_adamw", "adam", "multi_tensor", "foreach", "_amp_", "norm")),
    ("elementwise (gelu, adds, copies)", ("elementwise", "vectorized", "gelu", "copy", "fill", "add", "mul",
                                          "cat", "triton_")),
    ("reductions (bias grads, sums)", ("reduce", "sum")),
    ("other", ("",)),
]


def family(name: str) -> str:
    n = name.lower()
    return next(f for f, keys in FAMILIES if any(k in n for k in keys))


def profile(preset, mode, args, mesh, step_ms=None) -> dict:
    """A fresh model in `mode`, --warmup steps, then one step profiled: time per kernel family and top kernels."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    dev = mesh.device
    batch, seq = batch_for(preset, args), seq_for(preset, args)
    cfg, model, engine = build(preset, mode, batch, seq, mesh)
    try:
        x, y = tokens(dev, batch, seq, cfg.model.vocab_size)
        for _ in range(max(args.warmup, 1)):
            train_step(engine, x, y)
        sync(dev)
        act = ProfilerActivity.CUDA if dev.type == "cuda" else ProfilerActivity.CPU
        with tprofile(activities=[act]) as prof:
            train_step(engine, x, y)
            sync(dev)
    finally:
        teardown(model, engine)
        del model, engine
    if dev.type == "cuda":
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        t_of = (lambda e: e.self_device_time_total)
    else:  # CPU smoke: aten ops' self time stands in for kernels
        events = list(prof.key_averages())
        t_of = (lambda e: e.self_cpu_time_total)
    events.sort(key=lambda e: -t_of(e))
    total = sum(t_of(e) for e in events) or 1
    fam = {}
    for e in events:
        f = family(e.key)
        fam[f] = fam.get(f, 0) + t_of(e)
    fams = {f: {"ms": t / 1e3, "share": t / total} for f, t in sorted(fam.items(), key=lambda kv: -kv[1])}
    gemm = sum(v["ms"] for f, v in fams.items() if f.endswith("gemm"))
    top = [{"ms": t_of(e) / 1e3, "calls": e.count, "name": e.key[:160], "family": family(e.key)}
           for e in events[:20]]
    return {"section": "profile", "preset": preset, "mode": mode, "batch": batch, "seq": seq,
            "kernel_ms": total / 1e3, "gemm_ms": gemm, "non_gemm_ms": total / 1e3 - gemm,
            "step_ms": step_ms, "families": fams, "top_kernels": top}


def print_profile(r):
    print(f"\nprofile {r['preset']} {r['mode']} B={r['batch']}: kernel time {r['kernel_ms']:.1f} ms in one step "
          f"(GEMMs {r['gemm_ms']:.1f}, the rest {r['non_gemm_ms']:.1f})"
          + (f", timed step {r['step_ms']:.1f} ms" if r.get("step_ms") else ""))
    for f, v in r["families"].items():
        print(f"  {f:34s} {v['ms']:8.2f} ms {100 * v['share']:5.1f}%")
    print("  top kernels (ms, calls, family, name):")
    for k in r["top_kernels"][:15]:
        print(f"  {k['ms']:8.2f} {k['calls']:5d}  {k['family'][:20]:20s} {k['name'][:100]}")


# ----------------------------------------------------------------------------------------------------------------
# --compare: two train.py runs

def _metrics_path(run: str) -> str:
    return run if run.endswith(".jsonl") else os.path.join(run, "metrics.jsonl")


def compare_runs(a: str, b: str, tail: int = 50) -> dict:
    """Final train loss (mean over the last `tail` steps both runs logged), last validation loss, their relative
    gaps (b - a) / a, the largest validation gap over the common steps, median tok/s of each run."""
    (sa, va), (sb, vb) = read_metrics(_metrics_path(a)), read_metrics(_metrics_path(b))
    la = {r["step"]: r["loss"] for r in sa if r["loss"] == r["loss"]}
    lb = {r["step"]: r["loss"] for r in sb if r["loss"] == r["loss"]}
    common = sorted(set(la) & set(lb))
    if not common:
        raise SystemExit(f"error: {a} and {b} have no training step in common")
    last = common[-tail:]
    ta, tb = statistics.fmean(la[s] for s in last), statistics.fmean(lb[s] for s in last)
    res = {"section": "compare", "run_a": a, "run_b": b, "last_step": common[-1], "tail_steps": len(last),
           "train_a": ta, "train_b": tb, "train_gap": (tb - ta) / ta}
    xa, xb = {r["step"]: r["val_loss"] for r in va}, {r["step"]: r["val_loss"] for r in vb}
    vcommon = sorted(set(xa) & set(xb))
    if vcommon:
        s = vcommon[-1]
        res.update(val_step=s, val_a=xa[s], val_b=xb[s], val_gap=(xb[s] - xa[s]) / xa[s],
                   val_gap_max=max(abs(xb[t] - xa[t]) / xa[t] for t in vcommon))
    for k, recs in (("a", sa), ("b", sb)):
        tps = [r["tokens_per_s"] for r in recs[1:] if r.get("tokens_per_s")]  # the first step compiles/tunes
        res[f"tokens_per_s_{k}"] = statistics.median(tps) if tps else None
    res["within_1pct"] = abs(res["train_gap"]) <= 0.01 and abs(res.get("val_gap", 0.0)) <= 0.01
    return res


def plot_runs(a: str, b: str, out: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"no plot: {e}")
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run, color in ((a, "tab:blue"), (b, "tab:orange")):
        steps, vals = read_metrics(_metrics_path(run))
        name = os.path.basename(os.path.normpath(run.removesuffix("metrics.jsonl")))
        xs, ys, ema, sm = [], [], None, []
        for r in steps:
            if r["loss"] == r["loss"]:
                xs.append(r["step"])
                ys.append(r["loss"])
                ema = r["loss"] if ema is None else 0.95 * ema + 0.05 * r["loss"]
                sm.append(ema)
        ax.plot(xs, ys, color=color, alpha=0.2, lw=0.7)
        ax.plot(xs, sm, color=color, lw=1.5, label=f"{name} train (EMA 0.95)")
        if vals:
            ax.plot([r["step"] for r in vals], [r["val_loss"] for r in vals], "o--", color=color, ms=3,
                    label=f"{name} val")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return out


def print_compare(r):
    print(f"{'':14s} {'A':>9s} {'B':>9s} {'gap (B-A)/A':>12s}")
    print(f"{'train (last ' + str(r['tail_steps']) + ')':14s} {r['train_a']:9.4f} {r['train_b']:9.4f} "
          f"{100 * r['train_gap']:+11.2f}%")
    if "val_a" in r:
        print(f"{'val @' + str(r['val_step']):14s} {r['val_a']:9.4f} {r['val_b']:9.4f} {100 * r['val_gap']:+11.2f}%"
              f"   (largest |gap| over the common val steps {100 * r['val_gap_max']:.2f}%)")
    if r.get("tokens_per_s_a") and r.get("tokens_per_s_b"):
        print(f"{'tok/s (median)':14s} {r['tokens_per_s_a']:9,.0f} {r['tokens_per_s_b']:9,.0f} "
              f"{r['tokens_per_s_b'] / r['tokens_per_s_a']:11.2f}x")
    print(f"within 1 %: {'yes' if r['within_1pct'] else 'NO'}  (A = {r['run_a']}, B = {r['run_b']})")


# ----------------------------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="gpt_1b,gpt2_124m")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {','.join(MODES)}")
    ap.add_argument("--batch", default="", help="micro-batch per preset, e.g. gpt_1b=8,gpt2_124m=32 "
                                                f"(defaults {DEFAULT_BATCH})")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="profile one step of the first preset's best FP8 mode")
    ap.add_argument("--profile_mode", default="best", help="best (fastest nanopara FP8 mode measured) | a mode")
    ap.add_argument("--out", default="", help="append JSON lines here")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run (fp32, references)")
    ap.add_argument("--compare", nargs=2, metavar=("RUN_A", "RUN_B"), help="compare two train.py runs and exit")
    ap.add_argument("--tail", type=int, default=50, help="--compare: train loss = mean of the last TAIL steps")
    ap.add_argument("--plot", default="", help="--compare: PNG path (default: none)")
    args = ap.parse_args(argv)

    def emit(row):  # printed and appended as it comes: a crash later keeps what was measured
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    if args.compare:
        r = compare_runs(*args.compare, tail=args.tail)
        if args.plot:
            try:
                r["plot"] = plot_runs(*args.compare, args.plot)
            except Exception as e:  # the numbers matter more than the picture
                r["plot"] = None
                print(f"plot failed: {type(e).__name__}: {e}", flush=True)
        emit(r)
        print_compare(r)
        return [r]

    args.batch_map = {k: int(v) for k, v in (kv.split("=") for kv in args.batch.split(",") if kv)}
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}; known: {MODES}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_fp8_e2e.py needs a CUDA GPU (or --device cpu for a smoke run)")
    mesh = Mesh.build(device=args.device)
    on_gpu = mesh.device.type == "cuda"
    meta = {"gpu": torch.cuda.get_device_name() if on_gpu else "cpu", "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__}
    try:
        import torchao
        meta["torchao"] = torchao.__version__
    except Exception as e:  # recorded on the torchao rows too
        meta["torchao"] = f"not importable: {type(e).__name__}: {str(e)[:200]}"
    t0 = time.perf_counter()
    rows = []

    for preset in args.presets.split(","):
        base = None
        for mode in modes:
            if mode == "nanogpt" and preset != "gpt2_124m":
                continue  # the nanoGPT baseline is GPT-2 124M's
            if mode.endswith("+graph") and not on_gpu:
                continue  # CUDA graphs
            free(reset_peak=True)
            alloc = torch.cuda.memory_allocated() if on_gpu else 0
            if alloc > LEAK_BYTES:
                print(f"WARNING: {alloc / 1e9:.2f} GB still allocated before {preset} {mode} (a leak from the "
                      f"previous mode?)", file=sys.stderr, flush=True)
            row = {"section": "throughput", "preset": preset, "mode": mode, "batch": batch_for(preset, args),
                   "seq": seq_for(preset, args),
                   "mem_before_gb": alloc / 1e9 if on_gpu else None}
            tuned0 = dict(TUNING)
            try:
                row.update(nanogpt(preset, args, mesh) if mode == "nanogpt" else timed(preset, mode, args, mesh))
            except ImportError as e:
                if mode not in TORCHAO:
                    raise
                row["error"] = f"torchao not importable: {type(e).__name__}: {str(e)[:300]}"
            except Exception as e:  # one failing mode must not hide the others' numbers
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(traceback.format_exc()[-2000:], file=sys.stderr, flush=True)
            row["tunings"] = TUNING["tuned"] - tuned0["tuned"]  # kernels tuned in this mode's warmup (first run)
            row["tune_s"] = round(TUNING["tune_s"] - tuned0["tune_s"], 1)
            if mode == "bf16" and "tokens_per_s" in row:
                base = row
            if base is not None and "tokens_per_s" in row:
                row["vs_bf16"] = row["tokens_per_s"] / base["tokens_per_s"]
                if row.get("peak_mem_gb") and base.get("peak_mem_gb"):
                    row["mem_vs_bf16"] = row["peak_mem_gb"] / base["peak_mem_gb"]
            row = {**row, **meta, "elapsed_s": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            emit(row)
    free(reset_peak=True)

    if args.profile:
        preset = args.presets.split(",")[0]
        measured = {r["mode"]: r for r in rows if r["preset"] == preset and "tokens_per_s" in r}
        pmode = args.profile_mode
        if pmode == "best":
            fp8 = [m for m in NANOPARA_FP8 if m in measured]
            pmode = max(fp8, key=lambda m: measured[m]["tokens_per_s"]) if fp8 else "tensor"
        try:
            prow = profile(preset, pmode, args, mesh, measured.get(pmode, {}).get("step_ms"))
            prow = {**prow, **meta, "elapsed_s": round(time.perf_counter() - t0, 1)}
            rows.append(prow)
            emit(prow)
            print_profile(prow)
        except Exception as e:
            print(f"profile {preset} {pmode}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            print(traceback.format_exc()[-2000:], file=sys.stderr, flush=True)
        free(reset_peak=True)

    print(f"\n{meta['gpu']}  {meta['date']}  torch {meta['torch']}  torchao {meta['torchao']}  T<={args.seq}, "
          f"{'bf16 autocast' if on_gpu else 'fp32 (CPU smoke)'}, model.kernels=auto")
    print(f"{'preset':10s} {'mode':14s} {'B':>3s} {'ms/step':>8s} {'tok/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s} "
          f"{'peak GB':>8s} {'x bf16':>7s} {'x nanoGPT':>9s} {'loss':>7s}")
    ng = {r["preset"]: r["tokens_per_s"] for r in rows if r["mode"] == "nanogpt" and "tokens_per_s" in r}
    for r in rows:
        if r["section"] != "throughput":
            continue
        if "error" in r:
            print(f"{r['preset']:10s} {r['mode']:14s} {r['batch']:3d}  FAILED {r['error'][:90]}")
            continue
        mem = f"{r['peak_mem_gb']:8.1f}" if r.get("peak_mem_gb") is not None else f"{'-':>8s}"
        vs = f"{r['vs_bf16']:7.3f}" if r.get("vs_bf16") is not None else f"{'-':>7s}"
        vn = f"{r['tokens_per_s'] / ng[r['preset']]:9.3f}" if r["preset"] in ng else f"{'-':>9s}"
        print(f"{r['preset']:10s} {r['mode']:14s} {r['batch']:3d} {r['step_ms']:8.1f} {r['tokens_per_s']:10,.0f} "
              f"{r['tflops']:8.1f} {100 * r['mfu']:5.1f}% {mem} {vs} {vn} {r['loss_last']:7.3f}")
    print(f"total {time.perf_counter() - t0:.0f} s (kernel tunings {TUNING['tuned']}, {TUNING['tune_s']:.0f} s of it)")
    return rows


if __name__ == "__main__":
    main()
