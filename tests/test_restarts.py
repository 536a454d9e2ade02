"""Restarts without a person (nanopara/supervise.py): a killed rank restarts the group from the newest complete
checkpoint and the losses continue exactly; 20 kills at seeded random moments (mid-save included) lose nothing but
the steps since the last published checkpoint and never leave a corrupt or half-published one; errors and stops are
not retried; a frozen rank becomes a failure through the collective timeout; fewer processes only when allowed.

Each supervised run is a real `python -m nanopara.supervise` in its own session, killed with all its processes in a
`finally`; the uninterrupted runs it is compared with are gloo processes of the fork server (tests/distributed.py).
"""
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

import train
from nanopara import checkpoint, supervise
from tests.distributed import spawn
from tests.tiny_run import tiny_argv, write_tiny_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_tiny_shards(tmp_path_factory.mktemp("rsshards"), seed=3)


def argv(shards, out_dir, *extra):
    return tiny_argv(shards, out_dir, "--parallel.timeout_s=60", *extra, steps=None)


def _reference(rank, world, args):
    train.main(args)


def reference(shards, out, world, *extra) -> dict:
    """{step: (loss, grad_norm, lr)} of an uninterrupted run of `world` gloo processes."""
    spawn(_reference, world, argv(shards, out, *extra)) if world > 1 else train.main(argv(shards, out, *extra))
    return {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in rows(out) if "loss" in r}


def rows(out) -> list[dict]:
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(ln) for ln in f if ln.strip()]
    except FileNotFoundError:
        return []


class Run:
    """`python -m nanopara.supervise ... -- train.py ARGS` in its own session; stdout and stderr to files."""

    def __init__(self, tmp_path, sup_args, train_args):
        self.log, self.err = tmp_path / "supervise.out", tmp_path / "supervise.err"
        with open(self.log, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "nanopara.supervise", *sup_args, "--", "train.py",
                                          *train_args], cwd=ROOT, stdout=out, stderr=err, start_new_session=True,
                                         env={**os.environ, "OMP_NUM_THREADS": "1"})

    def workers(self) -> dict:
        return workers_of(self.proc.pid)

    def wait_for_workers(self, n, not_in=(), timeout=60) -> dict:
        t0 = time.monotonic()
        while True:
            w = self.workers()
            if len(w) == n and not set(w.values()) & set(not_in):
                return w
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() - t0 < timeout, f"no new group of {n} started\n{self.output()}"
            time.sleep(0.02)

    def wait(self, timeout) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the supervised run did not end in {timeout} s\n{self.output()}")

    def output(self) -> str:
        return f"--- stdout\n{self.log.read_text()[-4000:]}\n--- stderr\n{self.err.read_text()[-4000:]}"

    def kill_all(self) -> None:
        """The supervisor and every process under it (each worker leads its own process group)."""
        pids = _descendants(self.proc.pid)
        for pid in [self.proc.pid, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.wait(timeout=30)


def workers_of(parent) -> dict:
    """{rank: pid} of the train.py processes `parent` started that are running (not yet ended)."""
    found = {}
    for pid in _children_now(parent):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                script = b"train.py" in f.read()
        except OSError:
            continue
        if script and b"RANK" in env and _state(pid) not in ("Z", ""):
            found[int(env[b"RANK"])] = pid
    return found


def _stat(pid) -> list[str]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return []
    return s[s.rindex(")") + 2:].split()


def _state(pid) -> str:
    return (_stat(pid) or [""])[0]


def _children(pid) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _stat(p)[1:2] == [str(pid)]]


def _children_now(pid) -> list[int]:
    """_children from the kernel's per-thread lists (/proc/PID/task/TID/children): one read, where _children reads
    every process's stat (~5 ms a call on the loaded 2-core machine: a quarter of a core at the pollers' 20 ms, taken
    from the ranks). The lists may miss a child that starts or ends during the read: for polling, not for kill_all."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    kids = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(k) for k in f.read().split()]
        except OSError:  # a thread that ended, or a kernel without the lists: the full scan
            return _children(pid)
    return kids


def _descendants(pid) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def _gone(pids) -> bool:
    return all(_state(p) in ("", "Z") for p in pids)


def wait_rows(run, out, n, timeout=120) -> list[dict]:
    t0 = time.monotonic()
    while len(got := [r for r in rows(out) if "loss" in r]) < n:
        assert run.proc.poll() is None, run.output()
        assert time.monotonic() - t0 < timeout, f"fewer than {n} steps logged\n{run.output()}"
        time.sleep(0.02)
    return got


def published(out) -> tuple[int, list[int]]:
    """(the step ckpt/latest names, 0 without one; the steps of every checkpoint directory), after checking that
    every step directory verifies as a resume would verify it (meta complete, every shard's size and sha256)."""
    root = out / "ckpt"
    names = sorted(d for d in os.listdir(root) if d.startswith("step_")) if root.is_dir() else []
    steps = [checkpoint.verify(str(root / d))["step"] for d in names]  # raises on a damaged one
    latest = (root / "latest").read_text().strip() if (root / "latest").exists() else None
    assert latest is None or latest in names, (latest, names)
    return (int(latest[5:]) if latest else 0), steps


# ----------------------------------------------------------------------------------------------------------------
# the supervisor's rules, without processes

def test_exit_codes_decide_what_happens():
    assert [supervise.kind(c) for c in (1, -9, -6, -11, 137, 3)] == ["crash"] * 6
    assert [supervise.kind(c) for c in (130, 143, -2, -15)] == ["stop"] * 4 and supervise.kind(2) == "error"
    assert supervise.describe(-9) == "killed by SIGKILL" and supervise.describe(1) == "exited with code 1"
    assert supervise.exit_code(-9) == 137 and supervise.exit_code(2) == 2
    assert supervise.resume_args(["--overwrite", "--a=1", "--resume=false", "--overwrite=true"]) == ["--a=1",
                                                                                                   "--resume"]


def test_a_bad_command_line_is_one_line_and_starts_nothing(capsys):
    assert supervise.main(["--nproc=2", "--", "train.py", "--preset=tiny", "--trian.steps=3"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown")
    assert supervise.main(["--nproc=2", "--min_nproc=3", "--", "train.py", "--preset=tiny"]) == 2
    assert "min_nproc from 1 to nproc" in capsys.readouterr().err


def test_fewer_gpus_than_asked_and_no_permission_stops(capsys):
    sup = supervise.Supervisor("train.py", ["--preset=tiny"], nproc=4, restarts=3, min_nproc=3)
    sup.usable_devices = lambda: ["0", "2"]
    assert sup.fewer_processes(4, "rank 1 killed by SIGKILL") == (0, None)
    assert capsys.readouterr().err.strip() == ("supervise: rank 1 killed by SIGKILL; only 2 GPUs answer and min_nproc "
                                               "is 3: stopped")
    sup.usable_devices = lambda: ["0", "1", "2", "3"]
    assert sup.fewer_processes(4, "") is None  # all answer: the same layout
    never = supervise.Supervisor("train.py", ["--preset=tiny"], nproc=4, restarts=3)
    never.usable_devices = lambda: pytest.fail("probed without min_nproc < nproc")
    assert never.fewer_processes(4, "") is None


# ----------------------------------------------------------------------------------------------------------------
# one kill, exact continuation

@pytest.mark.timeout_s(240)
def test_a_killed_rank_of_four_restarts_and_the_losses_continue_exactly(shards, tmp_path):
    """SIGKILL to rank 2 of a 4-process gloo run after its checkpoint of step 10: the supervisor restarts the group
    from that checkpoint and the run finishes by itself, every logged step bit-equal to an uninterrupted run's."""
    extra = ("--train.steps=40", "--ckpt.every=10")
    want = reference(shards, tmp_path / "ref", 4, *extra)
    out = tmp_path / "run"
    run = Run(tmp_path, ["--restarts=2", "--nproc=4"], argv(shards, out, *extra))
    try:
        pids = run.wait_for_workers(4)
        wait_rows(run, out, 13)
        os.kill(pids[2], signal.SIGKILL)
        code = run.wait(180)
    finally:
        run.kill_all()
    assert code == 0, run.output()
    lines = [ln for ln in run.log.read_text().splitlines() if ln.startswith("supervise:")]
    assert len(lines) == 1 and re.fullmatch(r"supervise: rank 2 killed by SIGKILL; restart 1 of 2, from the "
                                            r"checkpoint of step (\d+) \(.*step_0000\1\)", lines[0]), run.output()
    resumed = [r for r in rows(out) if "resumed_from" in r]
    assert len(resumed) == 1 and resumed[0]["step"] == int(lines[0].split("of step ")[1].split()[0]) >= 10
    assert "Traceback" not in run.err.read_text(), run.output()  # the others' broken collectives: not shown
    log = rows(out)
    after = log[log.index(resumed[0]) + 1:]
    assert [r["step"] for r in after if "loss" in r] == list(range(resumed[0]["step"], 40))
    got = [(r["step"], (r["loss"], r["grad_norm"], r["lr"])) for r in log if "loss" in r]  # before the kill too
    assert all(v == want[s] for s, v in got), [(s, v, want[s]) for s, v in got if v != want[s]][:3]


# ----------------------------------------------------------------------------------------------------------------
# twenty kills

# The supervised run's length. Its ten kills landed within its first 15 steps on the 2-core machine (most while it
# starts); the steps after them cost ~50 ms each there, in the last attempt and again in the reference. 120 leaves
# room for a faster machine, where a kill "while starting" can land some steps into training.
KILLS_STEPS = 120


@pytest.fixture(scope="module")
def uninterrupted(shards, tmp_path_factory):
    """{step: (loss, grad_norm, lr)} of the uninterrupted 2-process run that both writers' kills are compared with:
    checkpoints change no number, so one run serves both."""
    return reference(shards, tmp_path_factory.mktemp("kills_ref"), 2, f"--train.steps={KILLS_STEPS}",
                     "--ckpt.final=false")


def _kill_when(run, out, rng, moment, pids) -> None:
    """Wait for the seeded moment of this attempt, then SIGKILL a seeded rank: `start` (0.1-2.5 s after the group
    started: mostly while it imports, builds or loads), `step` (1-8 steps into training), `save` (1-6 steps in, the
    instant a checkpoint's temporary directory appears: during its writes, or its publication; by then the start
    has removed what earlier kills left)."""
    rank, logged = rng.randrange(2), sum("loss" in r for r in rows(out))
    if moment == "start":
        time.sleep(rng.uniform(0.1, 2.5))
    else:
        wait_rows(run, out, logged + rng.randint(1, 8 if moment == "step" else 6))
    if moment == "save":
        root, t0 = out / "ckpt", time.monotonic()
        while not any(d.startswith("tmp-") for d in (os.listdir(root) if root.is_dir() else ())):
            assert time.monotonic() - t0 < 60 and run.proc.poll() is None, run.output()
            time.sleep(0.0005)
    os.kill(pids[rank], signal.SIGKILL)


@pytest.mark.timeout_s(240)
@pytest.mark.parametrize("writer", ["blocking", "async"])
def test_ten_kills_at_random_moments_lose_only_the_steps_since_the_last_checkpoint(shards, uninterrupted, tmp_path,
                                                                                    writer):
    """One supervised run of 2 processes, --restarts=10, a checkpoint every 2 steps written by the blocking save or
    the background writer (async_save.py), and 10 SIGKILLs to a random rank at seeded random moments (while starting,
    while training, mid-save): 20 kills over the two writers. After each kill, once the group is gone: every
    checkpoint directory verifies (sha256 of every shard), `latest` names one, and the restart resumes from exactly
    that one (blocking saves: at most the 2 steps since it are lost; background ones also lose those trained while
    it was written). The run then finishes by itself, and every step it logged, in every attempt, is bit-equal to an
    uninterrupted run's."""
    kills_n, steps, every, want = 10, KILLS_STEPS, 2, uninterrupted
    rng = random.Random(f"{writer}-41")
    extra = (f"--train.steps={steps}", f"--ckpt.every={every}", "--ckpt.keep=2",
             f"--ckpt.async_={'true' if writer == 'async' else 'false'}")
    out, kills, dead, t0 = tmp_path / "run", [], set(), time.monotonic()
    run = Run(tmp_path, [f"--restarts={kills_n}", "--nproc=2"], argv(shards, out, *extra))
    try:
        for _ in range(kills_n):
            pids = run.wait_for_workers(2, not_in=dead)
            moment = rng.choice(["start", "start", "step", "save", "save"])
            _kill_when(run, out, rng, moment, pids)
            while not _gone(pids.values()):
                time.sleep(0.005)
            dead |= set(pids.values())
            left = [d for d in os.listdir(out / "ckpt") if not d.startswith("step_") and d != "latest"] \
                if (out / "ckpt").is_dir() else []
            latest, _ = published(out)  # nothing damaged, nothing half-published
            logged = [r["step"] for r in rows(out) if "loss" in r]
            kills.append((moment, latest, max(logged, default=-1), left))
        code = run.wait(120)
    finally:
        run.kill_all()
    took = time.monotonic() - t0
    assert code == 0, run.output()
    said = [ln for ln in run.log.read_text().splitlines() if ln.startswith("supervise:")]
    assert [int(re.search(rf"restart (\d+) of {kills_n}", ln).group(1)) for ln in said] == \
        list(range(1, kills_n + 1)), said
    claimed = [int(m.group(1)) if (m := re.search(r"from the checkpoint of step (\d+)", ln)) else 0 for ln in said]
    assert claimed == [k[1] for k in kills], (claimed, kills)  # the newest published checkpoint, every time
    for claim, attempt in zip(claimed, run.log.read_text().split("supervise: ")[1:]):  # what train.py then did
        m = re.search(r"^resumed from .* at step (\d+)$", attempt, re.M)
        fresh = "holds no checkpoint yet: starting from step 0" in attempt
        assert (m is None or int(m.group(1)) == claim) and (not fresh or claim == 0), attempt[:2000]
    assert "took the newest complete checkpoint" not in run.log.read_text()  # `latest` always verified
    if writer == "blocking":
        assert all(last + 1 - latest <= every for _, latest, last, _ in kills), kills  # lost: the steps since it
    assert any(left for *_, left in kills), kills  # at least one kill interrupted a save (its tmp- files were left)
    got = [(r["step"], (r["loss"], r["grad_norm"], r["lr"])) for r in rows(out) if "loss" in r]
    assert {s for s, _ in got} == set(range(steps)) and all(v == want[s] for s, v in got), \
        [(s, v, want[s]) for s, v in got if v != want[s]][:3]
    assert published(out)[0] == steps
    print(f"{kills_n} kills ({', '.join(k[0] for k in kills)}), {sum(bool(k[3]) for k in kills)} left a save "
          f"unfinished, {took:.0f} s")


# ----------------------------------------------------------------------------------------------------------------
# what is not restarted, what gives up, what a hang becomes

@pytest.mark.parametrize("target", ["supervisor", "rank 1", "every process", "supervisor killed"])
def test_sigterm_is_a_stop_after_the_save_and_nothing_restarts(shards, tmp_path, target):
    """SIGTERM to the supervisor (passed on to both ranks) or to one rank (runguard: all stop at one step): rank 0
    saves and says so, every process exits 143, and so does the supervisor, with no restart. The supervisor killed
    (SIGKILL): its processes get SIGTERM (their parent-death signal) and stop the same way."""
    out = tmp_path / "run"
    run, pids = Run(tmp_path, ["--restarts=3", "--nproc=2"], argv(shards, out, "--train.steps=100000",
                                                                  "--ckpt.every=1000")), {}
    try:
        pids = run.wait_for_workers(2)
        wait_rows(run, out, 3)
        for pid in {"rank 1": [pids[1]], "every process": [run.proc.pid, *pids.values()]}.get(target, [run.proc.pid]):
            os.kill(pid, signal.SIGKILL if target == "supervisor killed" else signal.SIGTERM)  # (every process: as a
            # scheduler's preemption does; the supervisor must not pass a second SIGTERM on, which would kill them)
        code = run.wait(120)
        t0 = time.monotonic()
        while not _gone(pids.values()) and time.monotonic() - t0 < 120:
            time.sleep(0.05)
    finally:
        run.kill_all()
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert code == (-9 if target == "supervisor killed" else 143) and run.err.read_text() == "", run.output()
    said = [ln for ln in run.log.read_text().splitlines() if ln.startswith(("stopped by", "supervise:"))]
    assert said and re.fullmatch(r"stopped by SIGTERM after step (\d+): saved checkpoint .*; continue with --resume "
                                 r"\(exit code 143\)", said[0]), run.output()
    if target == "rank 1":  # (either rank may end first)
        assert len(said) == 2 and re.fullmatch(r"supervise: rank [01] exited with code 143: a stop, not a failure "
                                               r"\(the run saves before it stops\); not restarted", said[1]), said
    else:
        assert len(said) == 1, said
    assert published(out)[0] == int(said[0].split("after step ")[1].split(":")[0]) + 1


def test_an_error_the_run_reports_is_not_retried(shards, tmp_path):
    """A layout that only the world size refutes (dp 4 on 2 processes): exit 2, train.py's one line and the
    supervisor's, no restart."""
    run = Run(tmp_path, ["--restarts=3", "--nproc=2"], argv(shards, tmp_path / "run", "--parallel.dp=4"))
    try:
        code = run.wait(120)
    finally:
        run.kill_all()
    lines = run.err.read_text().splitlines()
    assert code == 2 and len(lines) == 2 and lines[0].startswith("error: "), run.output()
    assert re.fullmatch(r"supervise: rank [01] exited with code 2 \(the error above\); not restarted", lines[1])


def test_one_process_restarts_then_gives_up_in_one_line(shards, tmp_path):
    """nproc=1 (a plain process), --restarts=1: the first SIGKILL restarts it from its checkpoint, the second ends
    the run with one line on stderr naming what --resume would continue from, and the exit code of a SIGKILL."""
    out = tmp_path / "run"
    run = Run(tmp_path, ["--restarts=1"], argv(shards, out, "--train.steps=100000", "--ckpt.every=5"))
    dead = set()
    try:
        for _ in range(2):
            pid = run.wait_for_workers(1, not_in=dead)[0]
            wait_rows(run, out, len([r for r in rows(out) if "loss" in r]) + 7)
            os.kill(pid, signal.SIGKILL)
            dead.add(pid)
        code = run.wait(120)
    finally:
        run.kill_all()
    assert code == 137, run.output()
    assert re.fullmatch(r"supervise: rank 0 killed by SIGKILL; restart 1 of 1, from the checkpoint of step \d+ .*",
                        [ln for ln in run.log.read_text().splitlines() if ln.startswith("supervise:")][0])
    assert re.fullmatch(r"supervise: rank 0 killed by SIGKILL; no restart left \(1 of 1 used\): stopped; --resume "
                        r"would continue from the checkpoint of step (\d+) \(.*step_0*\1\)\n", run.err.read_text())


FROZEN_TIMEOUT_S = 5


@pytest.mark.timeout_s(180)
def test_a_frozen_rank_becomes_a_failure_at_the_collective_timeout(shards, tmp_path):
    """SIGSTOP to rank 1 (a hang, not a death): rank 0's gloo collective fails after parallel.timeout_s, the
    supervisor sees rank 0 exit 1, kills the frozen rank and restarts; the run finishes. (A timeout of 5 s, not
    10: the test waits it out once; the ranks start together, so their rendezvous is well within it.)"""
    out = tmp_path / "run"
    run = Run(tmp_path, ["--restarts=1", "--nproc=2"], argv(shards, out, "--train.steps=40", "--ckpt.every=5",
                                                             f"--parallel.timeout_s={FROZEN_TIMEOUT_S}"))
    try:
        pids = run.wait_for_workers(2)
        wait_rows(run, out, 8)
        os.kill(pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        run.wait_for_workers(2, not_in=pids.values(), timeout=120)
        waited = time.monotonic() - t0
        code = run.wait(120)
    finally:
        run.kill_all()
    assert code == 0 and waited >= FROZEN_TIMEOUT_S, (waited, run.output())
    said = [ln for ln in run.log.read_text().splitlines() if ln.startswith("supervise:")]
    assert len(said) == 1 and said[0].startswith("supervise: rank 0 exited with code 1; restart 1 of 1, from the "
                                                 "checkpoint of step "), said
    err = run.err.read_text().lower()  # rank 0's traceback (it failed first, so it is shown): gloo's timeout
    assert "timed out" in err or "timeout" in err, err


# ----------------------------------------------------------------------------------------------------------------
# fewer processes

@pytest.mark.timeout_s(240)
def test_a_restart_continues_on_fewer_processes_when_allowed(shards, tmp_path, capfd):
    """min_nproc=1 of 2, and after rank 1's SIGKILL one GPU answers the probe (stubbed here: a CPU machine): the
    supervisor checks that 1 process takes the layout, restarts on it and train.py reshards the 2-process
    checkpoint (reshard.py). The same global batch (tokens_per_step): the losses continue those of the uninterrupted
    2-process run to fp32 rounding (dp 2 -> 1 sums the micro-batches in another order)."""
    import threading
    extra = ("--train.steps=40", "--ckpt.every=5", "--train.tokens_per_step=128")
    want = reference(shards, tmp_path / "ref", 2, *extra)
    out = tmp_path / "run"
    sup = supervise.Supervisor(os.path.join(ROOT, "train.py"), argv(shards, out, *extra), nproc=2, restarts=1,
                               min_nproc=1)
    sup.usable_devices = lambda: ["0"]
    killed = []

    def killer():
        t0 = time.monotonic()
        while len(pids := workers_of(os.getpid())) < 2 or len([r for r in rows(out) if "loss" in r]) < 8:
            if time.monotonic() - t0 > 120:
                return
            time.sleep(0.02)
        os.kill(pids[1], signal.SIGKILL)
        killed.append(pids[1])
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        code = sup.run()
    finally:
        for w in sup.workers:
            w.signal(signal.SIGKILL)
        thread.join(timeout=10)
    said = capfd.readouterr().out
    assert code == 0 and killed, said
    line = [ln for ln in said.splitlines() if ln.startswith("supervise:")]
    assert len(line) == 1 and re.fullmatch(r"supervise: rank 1 killed by SIGKILL; restart 1 of 1 on 1 processes, "
                                           r"GPUs 0 \(was 2\), from the checkpoint of step (\d+) .*", line[0]), line
    log = rows(out)
    start = next(r["step"] for r in log if "resumed_from" in r)
    after = [r for r in log[log.index(next(r for r in log if "resumed_from" in r)):] if "loss" in r]
    assert [r["step"] for r in after] == list(range(start, 40))
    for r in after:
        assert r["loss"] == pytest.approx(want[r["step"]][0], rel=1e-5), (r, want[r["step"]])


def test_make_train_runs_the_supervisor_when_asked():
    def dry(*extra):  # PY: a python that is not there, so the Makefile's GPU probe (import torch, ~2 s) fails fast
        return subprocess.run(["make", "-n", "train", "NGPU=2", "ARGS=--data.dataset=x/s_train.bin", "PY=/no/python",
                               *extra], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    assert "/no/python -m nanopara.supervise --restarts=3 --nproc=2 --min_nproc=2 -- train.py --preset=tiny " \
        "--device=cpu --data.dataset=x/s_train.bin" in dry("RESTARTS=3")
    assert "--min_nproc=1 -- train.py" in dry("RESTARTS=3", "MIN_NGPU=1")
    assert "supervise" not in dry() and "torch.distributed.run --standalone --nproc_per_node=2 train.py" in dry()
