"""The suite's per-test time limit (tests/conftest.py): a hang fails fast, says which limit it hit, prints every
thread's stack and ends the processes the test started (a spawn's workers, a subprocess and its children)."""
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent

INNER = textwrap.dedent('''
    import multiprocessing
    import subprocess
    import sys
    import threading
    import time

    import pytest

    sys.path.insert(0, {tests!r})
    from distributed import spawn

    PIDS = {pids!r}


    def record(pids):
        with open(PIDS, "a") as f:
            f.write("".join(f"{{p}}\\n" for p in pids))


    def sleep_forever(rank, world):
        time.sleep(600)


    def no_op(rank, world):
        pass


    def test_sleeps_past_the_limit():
        # a child with a child of its own: both must go when the limit hits
        child = subprocess.Popen([sys.executable, "-c",
                                  "import subprocess, sys, time; "
                                  "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
                                  f"open({{PIDS!r}}, 'a').write(f'{{{{p.pid}}}}\\\\n'); time.sleep(600)"])
        record([child.pid])
        time.sleep(600)


    @pytest.mark.timeout_s(120)
    def test_first_spawn_starts_the_fork_server():
        spawn(no_op, 1)


    @pytest.mark.timeout_s(3)  # the workers are up and sleeping well before (forks of the running server: ms)
    def test_a_hung_spawn():
        threading.Thread(target=lambda: (time.sleep(1), record(p.pid for p in multiprocessing.active_children())),
                         daemon=True).start()
        spawn(sleep_forever, 2)


    @pytest.mark.timeout_s(1)
    def test_marked():
        time.sleep(600)


    def test_fast_ones_pass():
        time.sleep(0.1)
''')


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_sleeping_test_fails_at_its_limit(tmp_path):
    pids = tmp_path / "pids"
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "test_inner.py").write_text(INNER.format(tests=str(TESTS), pids=str(pids)))
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout-s=2",
                          "-o", "timeout_s=300",
                          "-W", "ignore::pytest.PytestUnknownMarkWarning", "test_inner.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": ""})
    took = time.monotonic() - start
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "3 failed, 2 passed" in out, out
    # each hang is named, with its limit (--timeout-s over the ini's; the marker over both)
    assert "Timeout: call went over its 2 s limit" in out, out
    assert "Timeout: call went over its 1 s limit" in out, out
    assert "Timeout: call went over its 3 s limit" in out, out
    # every thread's stack, down to the line that hung
    assert "over its 2 s limit; every thread's stack" in out, out
    assert "in test_sleeps_past_the_limit" in out, out
    # the spawned workers' stacks too, whole: they print them on SIGTERM, and two printing at once cut each other's
    # lines ("in sleep_forever" in two) until the harness signalled them one at a time
    assert out.count("in sleep_forever") == 2, out
    # 2 + 3 + 1 s of limits, a few s to end processes, the rest starting python, torch and the fork server on a busy
    # machine
    assert took < 150, (took, out)
    recorded = [int(p) for p in pids.read_text().split()]
    assert len(recorded) == 4, recorded  # the subprocess, its child, the spawn's two workers
    deadline = time.monotonic() + 10
    while any(map(_alive, recorded)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in recorded if _alive(p)], "processes the timed-out tests started are still running"
