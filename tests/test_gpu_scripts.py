"""bench/run_set.py, the one entry that runs a named set of benchmarks on a GPU machine (`make bench-all`): its plan
for a given number of GPUs, and a run of a set: each job in its own process, a job that needs more GPUs than are
visible skipped with a line that says so, one that fails or hangs reported while the others go on. A broken plan
found here costs nothing; found on a GPU machine it costs the machine's time."""
import ast
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import run_set  # noqa: E402


def test_layouts_plan_on_two_gpus_runs_what_fits_and_skips_the_rest(tmp_path):
    out = str(tmp_path)
    plan = run_set.plan("layouts", 2, out)
    by = {s["name"]: s for s in plan}
    runs = [s["name"] for s in plan if s["skip"] is None]
    assert runs[:11] == ["layout_1gpu", "layout_dp2", "layout_tp2", "layout_tp2_sp", "layout_pp2_gpipe",
                         "layout_pp2_1f1b", "layout_pp2_zb", "layout_pp2_interleaved", "layout_1gpu_16k",
                         "layout_cp2_16k", "layout_cp2_16k_nokeep"]
    assert runs[11:] == ["dp", "tp", "pp", "cp", "comm", "tuned"]  # every run ends with the tuning table
    assert by["layout_dp4_zero1"]["skip"] == "needs 4 GPUs, 2 visible"
    assert by["layout_tp2_pp2_dp2"]["skip"] == "needs 8 GPUs, 2 visible"
    tp2 = by["layout_tp2"]["argv"]  # one bench_layout process per layout over torchrun, every row in one file
    assert tp2[:4] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert tp2[4] == "bench/bench_layout.py" and tp2[tp2.index("--out") + 1] == f"{out}/layouts.jsonl"
    assert tp2[tp2.index("--baseline") + 1] == "1gpu" and "--parallel.tp=2" in tp2 and "--preset=gpt_1b" in tp2
    cp2 = by["layout_cp2_16k"]["argv"]
    assert cp2[cp2.index("--baseline") + 1] == "1gpu_16k" and "--parallel.cp=2" in cp2
    assert by["layout_cp2_16k_nokeep"]["argv"] == cp2[:cp2.index("cp2_16k")] + ["cp2_16k_nokeep"] + \
        cp2[cp2.index("cp2_16k") + 1:] + ["--parallel.cp_keep_kv=false"]  # the same run, K/V not kept
    assert by["layout_1gpu"]["argv"][3] == "--nproc_per_node=1" and "--baseline" in by["layout_1gpu"]["argv"]
    assert by["dp"]["argv"][3] == "--nproc_per_node=2" and by["tuned"]["argv"][-1] == f"{out}/tuned"


def test_the_pending_set_runs_on_one_gpu_and_stays_out_of_all(tmp_path):
    """`pending`: the one-GPU rows the open goals wait for, each a script that exists, all run on one GPU; `all`
    (every area's set) does not repeat them."""
    plan = run_set.plan("pending", 1, str(tmp_path))
    assert [s["name"] for s in plan if s["skip"] is None] == ["fp8_ws_tests", "fp8_e2e_ao_row", "flat_tests",
                                                               "flat_adamw", "flat_step_moe", "tuned"]
    for s in plan[:-1]:  # each short enough that two or three fit one device call
        pytest = s["argv"][:2] == ["-m", "pytest"]
        script = next(a for a in s["argv"] if a.startswith("tests/")) if pytest else s["argv"][0]
        script = s["argv"][1].replace(".", "/") + ".py" if script == "-m" else script  # python -m a module
        assert os.path.isfile(os.path.join(run_set.ROOT, script)) and s["timeout_s"] <= 360, s
    assert not {s["name"] for s in plan[:-1]} & {s["name"] for s in run_set.plan("all", 8, str(tmp_path))}


def test_plans_for_one_and_eight_gpus():
    one = run_set.plan("layouts", 1, "o")
    assert [s["name"] for s in one if s["skip"] is None] == ["layout_1gpu", "layout_1gpu_16k", "tuned"]
    assert run_set.plan("moe", 1, "o")[1]["skip"] == "needs 2 GPUs, 1 visible"
    eight = run_set.plan("layouts", 8, "o")
    assert all(s["skip"] is None for s in eight)
    assert {s["name"]: s for s in eight}["comm"]["argv"][3] == "--nproc_per_node=8"  # every visible GPU
    none = run_set.plan("kernels", 0, "o")  # a machine without a GPU: everything but the table export skips
    assert [s["name"] for s in none if s["skip"] is None] == ["tuned"]


def test_every_set_runs_scripts_and_modules_that_exist():
    names = []
    for name in run_set.ORDER:
        for s in run_set.plan(name, 8, "/o")[:-1]:
            names.append(s["name"])
            argv = s["argv"]
            if argv[:2] == ["-m", "torch.distributed.run"]:
                argv = argv[4:]
            if argv[0] == "-m":
                path = os.path.join(ROOT, *argv[1].split(".")) + ".py"
            else:
                path = os.path.join(ROOT, argv[0])
            assert os.path.isfile(path), (name, s["name"], path)
            assert s["timeout_s"] > 0
    assert len(names) == len(set(names)), "job names are their log files: unique"
    assert [s["name"] for s in run_set.plan("all", 8, "/o")] == names + ["tuned"]
    assert [s["name"] for s in run_set.plan("fp8", 8, "/o", only="fp8_e2e")] == ["fp8_e2e", "tuned"]
    with pytest.raises(SystemExit, match="unknown set"):
        run_set.plan("layoutz", 2, "/o")
    with pytest.raises(SystemExit, match="no job nope"):
        run_set.plan("fp8", 2, "/o", only="nope")


def test_a_run_goes_on_past_skipped_failed_and_hung_jobs(tmp_path, monkeypatch, capsys):
    J = run_set.Job
    monkeypatch.setattr(run_set, "SETS", {"demo": [
        J("writes", 0, ["-c", "open('{out}/made.txt', 'w').write('x'); print('hello from a job')"], 60),
        J("big", 99, ["-c", "print('never')"]),
        J("fails", 0, ["-c", "import sys; sys.exit(3)"], 60),
        J("hangs", 0, ["-c", "import time; time.sleep(60)"], 2),
        J("after", 0, ["-c", "import os; print('still ran with', os.environ['NANOPARA_DEMO'])"], 60,
          {"NANOPARA_DEMO": "its env"})]})
    monkeypatch.setattr(run_set, "ORDER", ("demo",))
    monkeypatch.setattr(run_set, "TUNED", J("tuned", 0, ["-c", "print('table')"], 60))
    monkeypatch.setattr(run_set, "visible_gpus", lambda: 1)
    steps = run_set.main(["demo", "--out", str(tmp_path)])
    status = {s["name"]: s["status"] for s in steps}
    assert status == {"writes": "ok", "big": "skipped: needs 99 GPUs, 1 visible", "fails": "failed (exit 3)",
                      "hangs": "timed out after 2 s", "after": "ok", "tuned": "ok"}
    assert (tmp_path / "made.txt").read_text() == "x"
    assert "hello from a job" in (tmp_path / "writes.log").read_text()
    text = capsys.readouterr().out
    assert "set demo: 6 jobs on 1 GPUs, files to" in text and "== big: skipped: needs 99 GPUs, 1 visible" in text
    assert "still ran with its env" in text and "files written under" in text and "made.txt" in text
    monkeypatch.undo()  # the real sets: the NCCL protocol rows carry their env, not flags
    scaleout = {s["name"]: s for s in run_set.plan("scaleout", 2, "/o")}
    assert scaleout["layout_tp2_graph_ll128"]["env"] == {"NCCL_PROTO": "LL128"}
    assert scaleout["layout_tp2_graph"]["env"] == {} and "NCCL_PROTO" not in os.environ


@pytest.mark.timeout_s(120)
def test_a_detached_set_outlives_its_caller_and_wait_reports_it(tmp_path):
    """--detach returns at once with the set running in its own session; a second --detach into the same folder is
    refused while it runs; --wait exits 3 while it runs and then with the set's own exit code (here 1: on a machine
    without a GPU every job skips and the tuning table's export fails), the set's table in its log."""
    def cli(*args):
        return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run_set.py"), *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=100,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    out = str(tmp_path / "set")
    started = cli("pending", "--out", out, "--detach")
    assert started.returncode == 0 and "detached (pid" in started.stdout, started.stderr
    running = cli("--wait", "0", "--out", out)  # the set's own Python is still importing torch
    assert running.returncode == 3 and "still running after 0 s" in running.stdout, running.stdout + running.stderr
    again = cli("pending", "--out", out, "--detach")
    assert again.returncode == 1 and "a detached set already runs into" in again.stderr, again.stderr
    ended = cli("--wait", "90", "--out", out)
    assert ended.returncode == 1 and "the detached set ended, exit 1" in ended.stdout, ended.stdout + ended.stderr
    assert re.search(r"fp8_e2e_ao_row +0 s  skipped: needs 1 GPUs, 0 visible", ended.stdout), ended.stdout
    assert open(os.path.join(out, "run_set.done")).read().strip() == "1"
    assert cli("--wait", "1", "--out", str(tmp_path / "none")).stderr.startswith("run_set: no detached set in")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_targets_call_the_set_runner():
    def dry(*args):
        r = subprocess.run(["make", "-n", *args, "PY=python3"], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return r.stdout
    assert "python3 bench/run_set.py layouts --out /tmp/b" in dry("bench-all", "SET=layouts", "OUT=/tmp/b")
    assert "python3 bench/run_set.py all --out runs/bench" in dry("bench-all")
    assert "python3 bench/run_set.py kernels --out runs/bench" in dry("bench")


def test_no_device_tool_machinery_left_in_the_benchmarks():
    """One plain entry: no lanes / per-call file limits / carried folders, nothing a user's GPU machine lacks."""
    for gone in ("gpu_suite.sh", "gpu_multi.sh", "lanes.sh"):
        assert not os.path.exists(os.path.join(ROOT, "bench", gone))
    for path in [p for p in glob.glob(os.path.join(ROOT, "bench", "*")) if os.path.isfile(p)] + \
            [os.path.join(ROOT, "Makefile")]:
        with open(path) as f:
            text = f.read()
        for phrase in (".carry", "lanes", "at most 8 files", "device call", "make carry"):
            assert phrase not in text, f"{os.path.relpath(path, ROOT)} mentions {phrase!r}"


def test_bench_scripts_keep_short_docstrings_and_mains():
    """Each bench says what it measures in one screen (docstring <= 25 lines); its main() reads in one (<= 60)."""
    for path in sorted(glob.glob(os.path.join(ROOT, "bench", "*.py"))):
        tree = ast.parse(open(path).read())
        doc = ast.get_docstring(tree, clean=False) or ""
        assert doc and len(doc.splitlines()) <= 25, f"{os.path.basename(path)}: docstring of {len(doc.splitlines())}"
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "main":
                n = node.end_lineno - node.lineno + 1
                assert n <= 60, f"{os.path.basename(path)}: main() of {n} lines"
