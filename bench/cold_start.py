"""Cold start: seconds from `python train.py` starting to the end of its first optimizer step, in fresh processes.

States, each a new process training the preset (default gpt2_124m: its micro-batch, T=1024, bf16, one GPU) on a
random shard this script writes (no network):
    a          empty Triton cache, empty tuning store, no shipped table: every kernel tunes (a GPU never measured)
    a1         as a, candidates compiled one at a time (kernels/tuning.COMPILE_THREADS = 1): what the threads save
    b          empty Triton cache, the store a filled (run a first): only the chosen configs compile (a known GPU)
    b_shipped  empty Triton cache and user store, kernels/tuned/<gpu slug>.json on (where that table exists)
    c          everything warm after b (a second run)
    compile    PyTorch ops under torch.compile (nanoGPT's path), empty Inductor and Triton caches: the baseline
The clock stops in a global optimizer-step hook after a device sync; the process then exits at once. An untimed
process first loads torch and the device, so no state pays for reading the libraries from disk.
    python bench/cold_start.py [--out FILE] [--export] [--states a,a1,b,c,compile] [--preset P] [--device D]
--export writes a's choices to kernels/tuned/<gpu slug>.json and a copy beside --out (so a GPU call ships them).
CPU smoke run (plumbing only): python bench/cold_start.py --device cpu --preset tiny --states a,c
"""
import argparse
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
STATES = ("a", "a1", "b", "b_shipped", "c", "compile")


def child(t0: float, result: str, shipped: bool, threads: int, train_args: list) -> None:
    """Run train.py in this process; at the first optimizer step write the seconds since t0 and exit."""
    sys.path.insert(0, ROOT)
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from kernels import tuning
    if not shipped:
        tuning.STORE.shipped = None
    if threads:
        tuning.COMPILE_THREADS = threads

    def first_step_done(optimizer, args, kwargs):
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.time() - t0
        with open(result, "w") as f:
            json.dump(dict(first_step_s=seconds, gpu=torch.cuda.get_device_name() if cuda else "cpu",
                           **tuning.STATS, tunings=tuning.TUNINGS), f)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    register_optimizer_step_post_hook(first_step_done)
    sys.argv = [TRAIN, *train_args]
    runpy.run_path(TRAIN, run_name="__main__")
    raise SystemExit("train.py ended without an optimizer step")


def run_state(state, tmp, train_args, timeout) -> dict:
    """One fresh process in `state`'s caches; returns its result row (or one with an error)."""
    fresh = lambda name: tempfile.mkdtemp(prefix=f"{name}-", dir=tmp)  # noqa: E731
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    shipped, threads, extra = False, 0, []
    kept_store, kept_triton = os.path.join(tmp, "xdg_a"), os.path.join(tmp, "triton_b")  # a's store, b's cache
    if state == "a":
        env.update(TRITON_CACHE_DIR=fresh("triton"), XDG_CACHE_HOME=kept_store)
    elif state == "a1":
        env.update(TRITON_CACHE_DIR=fresh("triton"), XDG_CACHE_HOME=fresh("xdg"))
        threads = 1
    elif state in ("b", "c"):  # c runs after b: both caches warm
        env.update(TRITON_CACHE_DIR=kept_triton, XDG_CACHE_HOME=kept_store)
    elif state == "b_shipped":
        env.update(TRITON_CACHE_DIR=fresh("triton"), XDG_CACHE_HOME=fresh("xdg"))
        shipped = True
    elif state == "compile":
        env.update(TRITON_CACHE_DIR=fresh("triton"), TORCHINDUCTOR_CACHE_DIR=fresh("inductor"),
                   XDG_CACHE_HOME=fresh("xdg"))
        extra = ["--model.kernels=torch", "--train.compile=true"]
    result = os.path.join(tmp, f"result_{state}.json")
    args = [*train_args, f"--out_dir={fresh('run_' + state)}", *extra]
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(t0), result,
                               str(int(shipped)), str(threads), "--", *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        log = f"timed out after {timeout} s\n{e.stderr or ''}"
    row = dict(state=state, wall_s=time.time() - t0, tuning_lines=log.count("nanopara: tuning"))
    if os.path.exists(result):
        with open(result) as f:
            row.update(json.load(f))
    else:
        row["error"] = log[-3000:]
    return row


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--states", default="a,a1,b,b_shipped,c,compile", help=f"comma list of {', '.join(STATES)}")
    ap.add_argument("--preset", default="gpt2_124m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", help="append the rows as JSON lines here")
    ap.add_argument("--export", action="store_true", help="write a's tuned table to kernels/tuned/ and beside --out")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per process")
    args = ap.parse_args(argv)
    unknown = set(args.states.split(",")) - set(STATES)
    if unknown:
        raise SystemExit(f"unknown states {sorted(unknown)}; choose from {', '.join(STATES)}")
    return args


def setup(args, H) -> tuple[str, list]:
    """A temp folder with a random shard, train.py's arguments, and one untimed process that puts torch's libraries
    (and their bytecode) in the OS file cache for every state."""
    import numpy as np

    from nanopara.data import write_shard
    cfg = H.PRESETS[args.preset]()
    tmp = tempfile.mkdtemp(prefix="cold-start-")
    shard = os.path.join(tmp, "data", "cold_train_000.bin")
    rng = np.random.default_rng(0)
    write_shard(shard, rng.integers(0, cfg.model.vocab_size, 4 * cfg.train.micro_batch * cfg.train.seq_len + 1))
    train_args = [f"--preset={args.preset}", f"--device={args.device}", f"--data.dataset={shard}",
                  "--train.val_every=0", "--train.steps=10", "--train.log_every=1"]
    print(H.banner(f"cold start of {args.preset}: seconds from process start to the end of the first optimizer "
                   f"step (temp dir {tmp})"), flush=True)
    # Python's bytecode for every state alike: where site-packages holds no .pyc (read-only installs, as on our GPU
    # machines) each process would compile torch's ~2,000 modules from source, seconds that a pip install never pays
    os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(tmp, "pycache"))
    t0 = time.time()
    subprocess.run([sys.executable, "-c", "import torch, triton, torch._dynamo, train; "
                    f"torch.zeros(1, device={args.device!r})"],
                   cwd=ROOT, check=True, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    print(f"# warm-up process (import torch + triton, device init): {time.time() - t0:.1f} s", flush=True)
    return tmp, train_args


def export(args, tmp: str, gpu: str) -> None:
    """a's choices to kernels/tuned/<gpu slug>.json, and a copy beside --out."""
    from kernels import tuning
    path, n, _ = tuning.export(gpu, tuning.SHIPPED_DIR, os.path.join(tmp, "xdg_a", "nanopara", "tuned.json"))
    print(f"# exported {n} entries to {path}", flush=True)
    if args.out:
        copy = os.path.join(os.path.dirname(os.path.abspath(args.out)), "tuned", os.path.basename(path))
        os.makedirs(os.path.dirname(copy), exist_ok=True)
        shutil.copy(path, copy)
        print(f"# and copied to {copy}", flush=True)


def run_states(args, tmp: str, train_args: list) -> list[dict]:
    from kernels import tuning
    rows, gpu = [], None
    for state in args.states.split(","):
        table = os.path.join(tuning.SHIPPED_DIR, tuning.slug(gpu) + ".json") if gpu else None
        if state == "b_shipped" and not (table and os.path.exists(table)):
            print(f"# b_shipped: no shipped table for {gpu or 'this GPU'}: skipped", flush=True)
            continue
        row = run_state(state, tmp, train_args, args.timeout)
        rows.append(row)
        gpu = gpu or row.get("gpu")
        if "error" in row:
            print(f"# {state} failed:\n{row['error']}", flush=True)
            continue
        print(f"{state:>10s} {row['first_step_s']:7.1f} s  tuned {row['tuned']:3d} ({row['tune_s']:5.1f} s)"
              f"  from store {row['from_store']:3d}", flush=True)
        # in the order they ended: the Triton forward, tuned inside the Gluon forward's timing, comes first
        for what, seconds in row["tunings"]:
            print(f"{'':>12s}{seconds:6.1f} s  {what}", flush=True)
        if state == "a" and args.export:
            export(args, tmp, gpu)
    return rows


def main(argv=None):
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        t0, result, shipped, threads = sys.argv[2:6]
        return child(float(t0), result, shipped == "1", int(threads), sys.argv[sys.argv.index("--") + 1:])
    args = parse(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness as H  # (the parent only: a child's clock counts nothing train.py would not import)
    tmp, train_args = setup(args, H)
    try:
        rows = run_states(args, tmp, train_args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = next((r["first_step_s"] for r in rows if r["state"] == "compile" and "first_step_s" in r), None)
    for r in rows:
        r.update(preset=args.preset, vs_compile=r["first_step_s"] / base if base and "first_step_s" in r else None)
    print("\n" + H.table(rows, [("state", "state", ""), ("first_step_s", "first step s", ".1f"),
                                ("vs_compile", "vs compile", ".2f"), ("tuned", "tuned", "d"),
                                ("tune_s", "tune s", ".1f"), ("from_store", "from store", "d")]))
    print("tuned: tunings run in that process (tune s: their seconds); from store: choices read from the store")
    H.append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
