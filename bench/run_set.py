"""Run a named set of benchmarks on this machine's GPUs; every file they write lands in one folder.

    python bench/run_set.py [SET] [--out DIR] [--only JOB,...] [--list] [--detach]   (make bench-all SET=...)

  kernels     each kernel's parity and GB/s or TFLOP/s against PyTorch's best path (attention and its Hopper
              kernels, LayerNorm, cross-entropy, AdamW); host cost of a launch; GPT-2 124M's training step with
              them against PyTorch eager and torch.compile (bench_gpt). `make bench` runs this set
  e2e         activation checkpointing: time, memory, largest batch (bench_recompute); seconds to the first
              step from cold caches (cold_start)
  layouts     bench_layout on gpt_1b, one row per layout: 1 GPU, dp2, tp2, tp2+sp, pp2 (gpipe, 1f1b, interleaved,
              zb), cp2 16k (K/V kept, not), on 4 and 8 GPUs dp and 3D rows; then engines against torch DDP (bench_dp),
              tp (bench_tp), pp schedules and bubbles (bench_pp), cp (bench_cp), ring all-reduce vs NCCL (bench_comm)
  scaleout    gpt_1b on 2 GPUs against one GPU: tp2 (+sp, +tp_streams), pp2 (schedules, eager, graphed), dp2
  fp8         FP8 GEMMs, casts and linear against cuBLAS (bench_fp8); FP8 training against bf16 and torchao
  moe         grouped GEMM, routing and the MoE layer against PyTorch (bench_moe); expert parallel (bench_ep)
  post_train  generation against Hugging Face (bench_generate); SFT (bench_sft); SFT then RL (post_train_demo)
  curves      loss curves on the offline books (NANOPARA_MIRROR or data/shards): GPT-2 124M, gpt_1b bf16 vs FP8
  pending     one GPU, ~20 min: the rows the open goals wait for (the notes say which); all: the sets above but it
Each job runs in its own process from the repo root with this Python (PY=python3 make bench-all), its output kept
in DIR/<job>.log. A job needing more GPUs than are visible is skipped with a line that says so; one that fails or
passes its time limit is reported and the set goes on. Every run ends with this machine's kernel tuning table in
DIR/tuned (kernels/tuning.py --export: copy it over kernels/tuned/ so that fresh machines skip those tunings), then
the jobs' table and files. --list: the plan only. --detach: the set in its own session, outliving the shell (log
and exit code: DIR/run_set.log, .done); `--wait S --out DIR`: up to S s for it, exit 3 while it still runs.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Job:
    name: str
    gpus: int       # GPUs it needs; more visible than that: it still runs on `gpus` (or on all, via {ngpu})
    argv: list      # after the Python executable; "{out}" = the set's folder, "{ngpu}" = the GPUs visible
    timeout_s: int = 1800
    env: dict | None = None  # added to the job's environment (e.g. NCCL_PROTO)


def torchrun(n, *args) -> list:
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *args]


def layout(name: str, gpus: int, flags: str, preset: str = "gpt_1b", base: str = "1gpu", out: str = "layouts",
           steps: int = 10, env: dict | None = None) -> Job:
    """One bench_layout row of `preset` at T=1024 and 32 sequences a step (unless the flags say otherwise)."""
    common = f"--preset={preset} --train.seq_len=1024 --train.tokens_per_step=32768"
    return Job(f"layout_{name}", gpus, torchrun(gpus, "bench/bench_layout.py", "--label", name, "--baseline", base,
                                                 "--steps", str(steps), "--warmup", str(max(steps // 2, 3)),
                                                 "--out", f"{{out}}/{out}.jsonl", "--",
                                                 *f"{common} {flags}".split()), 600, env)


def scaleout(name: str, gpus: int, flags: str, base: str = "1gpu_mb8", env: dict | None = None) -> Job:
    """A row of issue #42's table (bench/run_set.py --set scaleout): gpt_1b, 32 sequences of 1,024 a step unless
    the flags say otherwise, against the one-GPU row at the same micro-batch."""
    return layout(name, gpus, flags, base=base, out="scaleout", steps=6, env=env)


T16K = "--train.seq_len=16384 --model.block_size=16384 --train.micro_batch=1 --train.tokens_per_step=16384"
PP2 = "--train.micro_batch=4 --parallel.pp=2"
PP2_MB2 = "--train.micro_batch=2 --parallel.pp=2"
BOOKS = "--data.dataset=books --train.warmup_steps=200 --train.log_every=50 --ckpt.final=false"

SETS = {
    "kernels": [Job(f"kernel_{k}", 1, ["-m", f"kernels.{k}", "--quick", "--out", "{out}/kernels.jsonl"], 900)
                for k in ("attention", "layernorm", "cross_entropy", "adamw")]
    + [Job("kernel_attention_hopper", 1, ["-m", "kernels.attention_hopper"], 900),
       Job("launch", 1, ["bench/bench_launch.py", "--out", "{out}/launch.jsonl"], 300),
       Job("gpt", 1, ["bench/bench_gpt.py", "--profile", "--out", "{out}/gpt.jsonl"])],
    "e2e": [Job("recompute", 1, ["bench/bench_recompute.py", "--profile", "--out", "{out}/recompute.jsonl"]),
            Job("cold_start", 1, ["bench/cold_start.py", "--out", "{out}/cold_start.jsonl"]),
            Job("ckpt", 1, ["bench/bench_ckpt.py", "--out", "{out}/ckpt.jsonl"], 600)],
    "layouts": [
        layout("1gpu", 1, "--train.micro_batch=8", base=""),
        layout("dp2", 2, "--train.micro_batch=8 --parallel.dp=2"),
        layout("tp2", 2, "--train.micro_batch=8 --parallel.tp=2"),
        layout("tp2_sp", 2, "--train.micro_batch=8 --parallel.tp=2 --parallel.sp=true"),
        *[layout(f"pp2_{s}", 2, f"{PP2} --parallel.pp_schedule={s} --parallel.pp_layers=10,8") for s in ("gpipe",
                                                                                                       "1f1b", "zb")],
        layout("pp2_interleaved", 2, f"{PP2} --parallel.pp_schedule=interleaved --parallel.pp_virtual=2 "
                                     "--parallel.pp_layers=5,5,5,3"),
        layout("1gpu_16k", 1, T16K, base=""),
        layout("cp2_16k", 2, f"{T16K} --parallel.cp=2", base="1gpu_16k"),  # cp_keep_kv auto: on at cp = 2
        layout("cp2_16k_nokeep", 2, f"{T16K} --parallel.cp=2 --parallel.cp_keep_kv=false", base="1gpu_16k"),
        layout("dp4_zero1", 4, "--train.micro_batch=8 --parallel.dp=4 --parallel.zero=1"),
        layout("tp2_dp2", 4, "--train.micro_batch=8 --parallel.tp=2"),
        layout("tp2_pp2", 4, f"{PP2} --parallel.tp=2 --parallel.pp_layers=10,8"),
        layout("dp8_zero1", 8, "--train.micro_batch=4 --parallel.dp=8 --parallel.zero=1"),
        layout("tp2_pp2_dp2", 8, f"{PP2} --parallel.tp=2 --parallel.pp_layers=10,8 --parallel.zero=1"),
        Job("dp", 2, torchrun("{ngpu}", "bench/bench_dp.py", "--quick", "--out", "{out}/dp.jsonl")),
        Job("tp", 2, torchrun(2, "bench/bench_tp.py", "--preset", "gpt_1b", "--quick", "--out", "{out}/tp.jsonl")),
        Job("pp", 2, torchrun(2, "bench/bench_pp.py", "--kernels", "auto", "--n_micro", "8,16", "--out",
                              "{out}/pp.jsonl")),
        Job("cp", 2, torchrun(2, "bench/bench_cp.py", "--out", "{out}/cp.jsonl")),
        Job("comm", 2, torchrun("{ngpu}", "bench/bench_comm.py", "--quick", "--out", "{out}/comm.jsonl"), 600)],
    "scaleout": [
        scaleout("1gpu_mb8", 1, "--train.micro_batch=8", base=""),
        scaleout("1gpu_mb2", 1, "--train.micro_batch=2", base=""),
        scaleout("tp2_graph", 2, "--train.micro_batch=8 --parallel.tp=2 --train.cuda_graph=true"),
        *[scaleout(f"tp2_graph_{proto.lower()}", 2, "--train.micro_batch=8 --parallel.tp=2 --train.cuda_graph=true",
                   env={"NCCL_PROTO": proto}) for proto in ("LL128", "Simple")],  # NCCL picks LL for 32 MB
        scaleout("tp2_graph_streams2", 2, "--train.micro_batch=8 --parallel.tp=2 --train.cuda_graph=true "
                 "--parallel.tp_streams=2"),
        scaleout("tp2_sp_graph", 2, "--train.micro_batch=8 --parallel.tp=2 --parallel.sp=true --train.cuda_graph=true"),
        scaleout("tp2_sp_graph_streams2", 2, "--train.micro_batch=8 --parallel.tp=2 --parallel.sp=true "
                 "--train.cuda_graph=true --parallel.tp_streams=2"),
        scaleout("dp2_ddp", 2, "--train.micro_batch=8 --parallel.dp=2 --parallel.zero=0"),  # (layouts has a dp2)
        scaleout("dp2_zero1", 2, "--train.micro_batch=8 --parallel.dp=2 --parallel.zero=1"),
        scaleout("dp2_zero1_noprefetch", 2, "--train.micro_batch=8 --parallel.dp=2 --parallel.zero=1 "
                                            "--parallel.zero_prefetch=false"),
        scaleout("dp2_zero1_graph", 2, "--train.micro_batch=8 --parallel.dp=2 --parallel.zero=1 --train.cuda_graph=true"),
        scaleout("dp2_zero3", 2, "--train.micro_batch=8 --parallel.dp=2 --parallel.zero=3"),
        scaleout("pp2_1f1b_mb2_eager", 2, f"{PP2_MB2} --parallel.pp_layers=10,8", base="1gpu_mb2"),
        scaleout("pp2_1f1b_mb2_graph", 2, f"{PP2_MB2} --parallel.pp_layers=10,8 --train.cuda_graph=true",
                 base="1gpu_mb2"),
        scaleout("pp2_interleaved_mb2_graph", 2, f"{PP2_MB2} --parallel.pp_schedule=interleaved "
                 "--parallel.pp_virtual=2 --parallel.pp_layers=5,5,5,3 --train.cuda_graph=true", base="1gpu_mb2"),
        scaleout("pp2_1f1b_mb8_m16_graph", 2, "--train.micro_batch=8 --parallel.pp=2 --parallel.pp_layers=10,8 "
                 "--train.tokens_per_step=131072 --train.cuda_graph=true"),
        scaleout("pp2_1f1b_mb8_m4_graph", 2, "--train.micro_batch=8 --parallel.pp=2 --parallel.pp_layers=10,8 "
                 "--train.cuda_graph=true"),
        scaleout("pp2_zb_mb8_m4_graph", 2, "--train.micro_batch=8 --parallel.pp=2 --parallel.pp_layers=10,8 "
                 "--parallel.pp_schedule=zb --train.cuda_graph=true")],
    "fp8": [Job("fp8", 1, ["bench/bench_fp8.py", "--quick", "--out", "{out}/fp8.jsonl"]),
            # the FP8 Linear table as graphed steps run it (the auto rule's row / block evidence), the Gluon GEMMs
            Job("fp8_linear_graph", 1, ["bench/bench_fp8.py", "--only", "linear", "--linear_graph",
                                        "--linear_models", "gpt_1b,gpt_3b", "--out", "{out}/fp8.jsonl"], 300),
            Job("fp8_ws_gemm", 1, ["bench/bench_fp8.py", "--only", "gemm", "--accum", "precise", "--ws",
                                   "--gemm_modes", "tensor,row,block", "--gemm_shapes", "gpt_1b",
                                   "--out", "{out}/fp8.jsonl"], 180),
            Job("fp8_e2e", 1, ["bench/bench_fp8_e2e.py", "--profile", "--out", "{out}/fp8_e2e.jsonl"]),
            # issue #43's last goal: FP8's gain with dp2 (ZeRO-1) and tp2 + sp within 5 points of one GPU's; every
            # row under a CUDA graph (FP8's eager step is host-bound), bf16 and FP8 tensor (delayed) at each layout
            *[layout(f"fp8_{name}_{dt}", gpus, f"--train.micro_batch=8 --train.cuda_graph=true{flags}"
                     + (" --train.fp8=tensor --train.fp8_delayed=true" if dt == "fp8" else ""),
                     base="" if gpus == 1 else f"fp8_1gpu_{dt}", out="fp8_scale", steps=6)
              for name, gpus, flags in (("1gpu", 1, ""), ("dp2", 2, " --parallel.dp=2 --parallel.zero=1"),
                                        ("tp2_sp", 2, " --parallel.tp=2 --parallel.sp=true"))
              for dt in ("bf16", "fp8")]],
    "moe": [Job("moe", 1, ["bench/bench_moe.py", "--quick", "--out", "{out}/moe.jsonl"]),
            Job("ep2", 2, torchrun(2, "bench/bench_ep.py", "--profile", "--out", "{out}/ep.jsonl")),
            Job("ep4", 4, torchrun(4, "bench/bench_ep.py", "--layouts", "single,dp4,ep4,ep2", "--out",
                                   "{out}/ep.jsonl")),
            # issue #44 item 4: capacity-mode ep2 with the exchanges in 2 and 4 pipelined pieces (parallel.ep_chunks),
            # and with the rows out in FP8 (parallel.ep_fp8)
            Job("ep2_chunks", 2, torchrun(2, "bench/bench_ep.py", "--capacity=1.0", "--layouts",
                                          "single,ep2,ep2c2,ep2c4,ep2f8", "--profile", "--out",
                                          "{out}/ep_chunks.jsonl")),
            # issue #44's dp2 goal (>= 1.85x one GPU) with both steps graphed (capacity mode), fp32 and bf16 reduction
            *[Job(f"dp2_graph_{dt}", 2, torchrun(2, "bench/bench_ep.py", "--capacity=1.0", "--graph", "--layouts",
                                                 "single,dp2", f"--reduce_dtype={dt}", "--profile", "--out",
                                                 "{out}/dp2_graph.jsonl")) for dt in ("fp32", "bf16")],
            # issue #44 item 5: gpt2_moe_fine against dense gpt2_124m on books, 3 seeds each, six runs sharing one
            # GPU (the mirror's text/ through NANOPARA_MIRROR); ~10 min on an H100 (estimate)
            Job("prepare_books_moe", 0, ["data/prepare.py", "books"]),
            Job("moe_books", 1, ["bench/moe_books.py", "--out={out}/moe_books", "--jobs=6"], 1800)],
    "post_train": [Job("generate", 1, ["bench/bench_generate.py", "--out", "{out}/generate.jsonl"]),
                   Job("generate_mixed", 1, ["bench/bench_generate.py", "--mixed", "--out", "{out}/generate.jsonl"]),
                   Job("sft", 1, ["bench/bench_sft.py", "--out", "{out}/sft"]),
                   Job("post_train", 1, ["bench/post_train_demo.py", "--recipe=small", "--seeds=1,2,3", "--jobs=3",
                                                  "--out", "{out}/post_train"], 7200),
                   # the small recipe at 20,000 labelled examples (+7.8 points, post_train_small_os4_600_h100.txt);
                   # the default (15,000) is the post_train job above (+17.4, post_train_small_os4_ex15k_h100.txt)
                   Job("post_train_os4", 1, ["bench/post_train_demo.py", "--recipe=small", "--seeds=1,2,3",
                                             "--jobs=3", "--examples=20000", "--tag=small_os4",
                                             "--out={out}/post_train_os4"], 600),
                   # issue #46's pre-trained path (118 s, then 506 s on an H100, post_train_base_h100.txt): a books
                   # base of the small model (the mirror's text/ through NANOPARA_MIRROR), then the small_base recipe
                   # from it. On H200, with post_train: the repeat (two --detach sets, one GPU: post_train_base's
                   # three seeds then share it with post_train's, hence its longer limit)
                   Job("pretrain_small", 1, ["bench/post_train_demo.py", "--recipe=small", "--seeds=",
                                             "--base={out}/base_small", "--pretrain_steps=2000",
                                             "--out={out}/post_train_base"], 600),
                   Job("post_train_base", 1, ["bench/post_train_demo.py", "--recipe=small_base", "--seeds=1,2,3",
                                              "--jobs=3", "--base={out}/base_small", "--pretrain_steps=2000",
                                              "--out={out}/post_train_base"], 1800)],
    # one GPU, ~20 min: the rows issue #43's open goals wait for (notes/fp8.md): row under auto (the MLP since
    # fp8_e2e_rowblock_h100.txt: 1.128x with c_attn too) against torchao rowwise + torch.compile, which needs torchao
    # on PYTHONPATH (a benchmark-only wheel: `pip download torchao==0.18.0 --no-deps`, unzipped, carried); without it
    # the torchao row says why. The Gluon GEMMs' GPU tests (passed on H200, tests_gpu_fp8_ws_h200.txt)
    "pending": [Job("fp8_ws_tests", 1, ["-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                        "tests/test_fp8_ws.py"], 300),
                Job("fp8_e2e_ao_row", 1, ["bench/bench_fp8_e2e.py", "--presets", "gpt_1b", "--modes",
                                          "bf16,bf16+graph,row+graph,ao_rowwise+compile", "--steps", "12",
                                          "--warmup", "4", "--out", "{out}/fp8_e2e.jsonl"], 360),
                # issue #44: train.optimizer=flat (nanopara/flat.py) on a GPU for the first time: its GPU tests, then
                # gpt2_moe's step with it against torch's fused AdamW, eager and graphed, one run
                Job("flat_tests", 1, ["-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                      "tests/test_flat.py", "tests/test_adamw.py"], 300),
                Job("flat_adamw", 1, ["-m", "kernels.adamw", "--quick", "--out", "{out}/adamw.jsonl"], 120),
                Job("flat_step_moe", 1, ["bench/bench_moe.py", "--sections=step", "--step-capacities=1.0",
                                         "--step-optimizers=torch,flat", "--out", "{out}/moe_flat.jsonl"], 360)],
    # the planner's GPU table (nanopara/gpus.py): GEMMs, attention, bandwidth, host cost, collectives; < 240 s
    "calibrate": [Job("calibrate", 1, torchrun("{ngpu}", "bench/bench_calibrate.py", "--out", "{out}/plan_gpus.json"),
                      300)],
    "curves": [Job("prepare_books", 0, ["data/prepare.py", "books"]),
               Job("curve_124m", 1, ["train.py", "--preset=gpt2_124m", *BOOKS.split(), "--train.micro_batch=16",
                                     "--train.steps=3000", "--train.lr=1.2e-3", "--train.val_every=250",
                                     "--out_dir={out}/curve_124m", "--overwrite=true"], 5400),
               *[Job(f"curve_1b_fp8_{m}", 1, ["train.py", "--preset=gpt_1b", *BOOKS.split(), f"--train.fp8={m}",
                                              *(["--train.fp8_filter=all"] if m != "none" else []),
                                              "--train.micro_batch=8", "--train.steps=1000", "--train.val_every=250",
                                              f"--out_dir={{out}}/curve_1b_fp8_{m}", "--overwrite=true"], 3600)
                 for m in ("none", "tensor", "row", "block")],
               *[Job(f"curve_1b_fp8_compare_{m}", 0, ["bench/bench_fp8_e2e.py", "--compare", "{out}/curve_1b_fp8_none",
                                                       f"{{out}}/curve_1b_fp8_{m}", "--plot",
                                                       f"{{out}}/curve_1b_fp8_{m}.png", "--out", "{out}/fp8_e2e.jsonl"],
                     300) for m in ("tensor", "row", "block")]],
}
ORDER = ("kernels", "e2e", "layouts", "scaleout", "fp8", "moe", "post_train", "curves")
TUNED = Job("tuned", 0, ["-m", "kernels.tuning", "--export", "--out", "{out}/tuned"], 120)


def plan(name: str, ngpu: int, out: str, only: str = "") -> list[dict]:
    """The jobs of set `name` (then `tuned`) for `ngpu` visible GPUs: name, GPUs, argv, time limit, and why it is
    skipped (None: it runs)."""
    if name != "all" and name not in SETS:
        raise SystemExit(f"unknown set {name!r}: choose one of {', '.join(SETS)}, all")
    jobs = [j for s in (ORDER if name == "all" else (name,)) for j in SETS[s]]
    if only:
        wanted = set(only.split(","))
        unknown = wanted - {j.name for j in jobs}
        if unknown:
            raise SystemExit(f"--only: no job {', '.join(sorted(unknown))} in set {name}")
        jobs = [j for j in jobs if j.name in wanted]
    steps = []
    for j in jobs + [TUNED]:
        argv = [a.replace("{out}", out).replace("{ngpu}", str(ngpu)) for a in j.argv]
        skip = f"needs {j.gpus} GPUs, {ngpu} visible" if j.gpus > ngpu else None
        steps.append({"name": j.name, "gpus": j.gpus, "argv": argv, "timeout_s": j.timeout_s, "skip": skip,
                      "env": j.env or {}})
    return steps


def run(step: dict, out: str) -> tuple[str, float]:
    """One job in its own process group (a time limit ends torchrun and its workers too); its output printed and
    written to OUT/<job>.log. Returns (status, seconds)."""
    t0 = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **step.get("env", {})}
    with open(os.path.join(out, f"{step['name']}.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, *step["argv"]], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        late = threading.Event()

        def kill():
            late.set()
            os.killpg(proc.pid, signal.SIGKILL)
        timer = threading.Timer(step["timeout_s"], kill)
        timer.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            timer.cancel()
    status = f"timed out after {step['timeout_s']} s" if late.is_set() else "ok" if rc == 0 else f"failed (exit {rc})"
    return status, time.time() - t0


def visible_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except ImportError:
        return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("set", nargs="?", default="all", help=f"one of {', '.join(SETS)}, all (the default)")
    ap.add_argument("--out", default="runs/bench", help="the folder for every file (default runs/bench)")
    ap.add_argument("--only", default="", help="these jobs of the set (comma-separated names; --list shows them)")
    ap.add_argument("--list", action="store_true", help="print the plan and exit")
    ap.add_argument("--detach", action="store_true", help="start the set in its own session and return at once")
    ap.add_argument("--wait", type=float, default=None, metavar="S",
                    help="wait up to S seconds for a set detached into --out, then print its log's tail")
    args = ap.parse_args(argv)
    if args.wait is not None:
        return wait(os.path.abspath(args.out), args.wait)
    if args.detach:
        out = os.path.abspath(args.out)  # the child runs from the repo root: its --out made absolute (the last wins)
        return detach(out, [a for a in (sys.argv[1:] if argv is None else argv) if a != "--detach"] + ["--out", out])
    out, ngpu = os.path.abspath(args.out), visible_gpus()
    steps = plan(args.set, ngpu, out, args.only)
    print(f"set {args.set}: {len(steps)} jobs on {ngpu} GPUs, files to {out}", flush=True)
    if args.list:
        for s in steps:
            print(f"  {s['name']:22s} {s['skip'] or 'python ' + ' '.join(s['argv'])}")
        return steps
    os.makedirs(out, exist_ok=True)
    before = {f: os.path.getmtime(f) for f in _files(out)}
    for s in steps:
        if s["skip"]:
            s["status"], s["seconds"] = f"skipped: {s['skip']}", 0.0
        else:
            print(f"\n== {s['name']}: python {' '.join(s['argv'])}", flush=True)
            s["status"], s["seconds"] = run(s, out)
        print(f"== {s['name']}: {s['status']}", flush=True)
    written = sorted(f for f in _files(out) if before.get(f) != os.path.getmtime(f))
    print(f"\nset {args.set} on {ngpu} GPUs:")
    for s in steps:
        print(f"  {s['name']:22s} {s['seconds']:7.0f} s  {s['status']}")
    print(f"files written under {out}:")
    for f in written:
        print(f"  {os.path.relpath(f, out)}  ({os.path.getsize(f):,} bytes)")
    return steps


def detach(out: str, argv: list) -> list:
    """This script with `argv` in a new process session, its output in OUT/run_set.log and its exit code, once it
    ends, in OUT/run_set.done; refuses a folder where a detached set still runs."""
    os.makedirs(out, exist_ok=True)
    log, done = os.path.join(out, "run_set.log"), os.path.join(out, "run_set.done")
    if os.path.exists(log) and not os.path.exists(done):
        raise SystemExit(f"run_set: a detached set already runs into {out} (its log: {log}); wait for it with "
                         f"--wait S --out {out}, or choose another --out")
    if os.path.exists(done):
        os.remove(done)
    cmd = (f"{shlex.join([sys.executable, os.path.abspath(__file__), *argv])}; "
           f"echo $? > {shlex.quote(done)}.tmp && mv {shlex.quote(done)}.tmp {shlex.quote(done)}")  # whole or absent
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    print(f"run_set: detached (pid {proc.pid}), output to {log}; then: python {sys.argv[0]} --wait S --out {out}",
          flush=True)
    return []


def wait(out: str, seconds: float) -> list:
    """Up to `seconds` for the set detached into `out` to end; then its log's last lines. SystemExit(3) while it still
    runs, its exit code once it has ended."""
    log, done = os.path.join(out, "run_set.log"), os.path.join(out, "run_set.done")
    if not os.path.exists(log):
        raise SystemExit(f"run_set: no detached set in {out} (no {log})")
    end = time.time() + seconds
    while not os.path.exists(done) and time.time() < end:
        time.sleep(1)
    with open(log, errors="replace") as f:
        print("".join(f.readlines()[-40:]), end="", flush=True)
    if not os.path.exists(done):
        print(f"run_set: still running after {seconds:.0f} s (log {log})", flush=True)
        raise SystemExit(3)
    rc = open(done).read().strip()
    print(f"run_set: the detached set ended, exit {rc}", flush=True)
    raise SystemExit(int(rc) if rc.isdigit() else 1)


def _files(folder: str) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names]


if __name__ == "__main__":
    done = main()
    sys.exit(1 if any(s.get("status", "ok") != "ok" and not s["skip"] for s in done) else 0)
