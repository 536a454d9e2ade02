"""Test-wide set-up.

Without a GPU, Triton kernels run in Triton's CPU interpreter: TRITON_INTERPRET must be set before the first
`import triton`, which is why it is set here, before any test module is imported. Tests marked `gpu` are
skipped (and reported as skipped) when CUDA is absent.

Also without a GPU, torch runs on one thread (OMP_NUM_THREADS=1 unless set: this process, the spawned gloo workers
and every subprocess a test starts). The tests' tensors are tiny, and two OpenMP threads spin-wait for each other
whenever another process holds a core: test_fp8.py's tiny_gpt_trains_in_every_mode took 6.3 s with two threads
and 2.2 s with one on the 2-core machine at a load of ~2, and 88 s against 7 s beside two busy processes.
"""
import faulthandler
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)

# kernels/tuning.py's store of tuned choices goes to a throwaway folder: tests never write the user's ~/.cache
os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="nanopara-test-cache-"))
os.environ.setdefault("TIKTOKEN_CACHE_DIR",
                      os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "tiktoken_cache"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- a time limit for every test ------------------------------------------------------------------------------------
# Each phase of a test (setup, call, teardown) gets `timeout_s` seconds (the ini option; `--timeout-s=N` overrides it,
# 0 turns it off), or N from @pytest.mark.timeout_s(N). When the limit hits, SIGALRM on the main thread prints every
# thread's stack, ends every process the test started (a spawn's gloo workers, a train.py subprocess, and theirs) and
# fails the test naming the limit. If the main thread is stuck in C code where no Python signal handler can run,
# faulthandler prints the stacks a little later and exits the run: a hang fails fast either way.
_TIMEOUT_GRACE_S = 60  # how long after the limit the hard exit waits for the soft one to have worked
_TERM_ONE_S = 1.0  # how long one process's SIGTERM may take (it prints its stacks and ends) before the next's
_TERM_ALL_S = 3.0  # how long all the SIGTERMs may take before SIGKILL
_started_key = pytest.StashKey[float]()  # when the test's setup began, in /proc's clock ticks


def pytest_addoption(parser):
    parser.addini("timeout_s", "each test phase's time limit in seconds (0: none); @pytest.mark.timeout_s(N) for more",
                  default="240")
    parser.addoption("--timeout-s", type=float, default=None, dest="timeout_s",
                     help="each test phase's time limit in seconds, overriding the ini's timeout_s (0: none)")


def _limit_s(item) -> float:
    if item.config.getoption("usepdb", False):
        return 0.0  # a debugging session waits for the person at the prompt
    marker = item.get_closest_marker("timeout_s")
    if marker is not None:
        return float(marker.args[0])
    option = item.config.getoption("timeout_s")
    return float(option if option is not None else item.config.getini("timeout_s"))


def _proc_stat(pid) -> list[str]:
    """/proc/PID/stat's fields after "pid (comm)": [state, ppid, ..., starttime at 19, ...]; [] when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return []
    return stat[stat.rindex(")") + 2:].split()


def _now_ticks() -> float:
    """Now, in the clock ticks since boot that /proc/PID/stat's starttime counts."""
    try:
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def _descendants_since(ticks: float) -> set[int]:
    """This process's descendants started since `ticks` (Linux /proc; none elsewhere): what a test started, not the
    run's long-lived helpers such as multiprocessing's resource tracker."""
    tree: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit() and len(fields := _proc_stat(entry)) > 19:
            tree.setdefault(int(fields[1]), []).append((int(entry), int(fields[19])))
    out, todo = set(), [os.getpid()]
    while todo:
        for child, started in tree.get(todo.pop(), []):
            if child not in out:
                todo.append(child)
                if started >= ticks - 1:
                    out.add(child)
    return out


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except OSError:
        return False


def _wait_gone(pids: set[int], until: float) -> set[int]:
    """Waits until none of `pids` runs (gone or a zombie) or `until` (time.monotonic()); returns those still running."""
    while True:
        pids = {pid for pid in pids if _proc_stat(pid)[:1] not in ([], ["Z"])}
        if not pids or time.monotonic() >= until:
            return pids
        time.sleep(0.01)


def _end_processes(pids: set[int]) -> None:
    """SIGTERM, then SIGKILL what is left. A spawned worker prints its stacks on SIGTERM (the other half of a hang):
    faulthandler writes them in many small writes to the test's captured stderr, so two workers signalled together
    interleave theirs mid-line ("in sleep_forever" came out cut in two). Hence one SIGTERM at a time, parents first
    (a supervisor hears it before its ranks stop), each waiting up to _TERM_ONE_S for that process to end: a dead
    process has written all it will. A process that lives on (it saves first, or ignores SIGTERM) costs that wait."""
    def started(pid):
        fields = _proc_stat(pid)
        return int(fields[19]) if len(fields) > 19 else 0, pid

    deadline = time.monotonic() + _TERM_ALL_S
    termed = set()
    for pid in sorted(pids, key=started):
        if _signal(pid, signal.SIGTERM):
            termed.add(pid)
            _wait_gone({pid}, min(deadline, time.monotonic() + _TERM_ONE_S))
    killed = {pid for pid in _wait_gone(termed, deadline) if _signal(pid, signal.SIGKILL)}
    _wait_gone(killed, time.monotonic() + 3)
    multiprocessing.active_children()  # reaps the multiprocessing children among them


def _stderr_fd(config) -> int:
    from _pytest.faulthandler import fault_handler_stderr_fd_key  # the terminal's stderr, outside capture
    try:
        return config.stash[fault_handler_stderr_fd_key]
    except KeyError:
        return sys.__stderr__.fileno()


def _time_limited(item, phase):
    limit = _limit_s(item)
    if limit <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return (yield)
    if phase == "setup":
        item.stash[_started_key] = _now_ticks()
    started = item.stash.get(_started_key, 0.0)

    def on_alarm(signum, frame):
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stderr.write(f"\n+++ {item.nodeid} {phase}: over its {limit:g} s limit; every thread's stack:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr if _has_fd(sys.stderr) else sys.__stderr__, all_threads=True)
        _end_processes(_descendants_since(started))
        pytest.fail(f"Timeout: {phase} went over its {limit:g} s limit (tests/conftest.py; a slow test may take "
                    f"more with @pytest.mark.timeout_s(N))", pytrace=True)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    faulthandler.dump_traceback_later(limit + _TIMEOUT_GRACE_S, exit=True, file=_stderr_fd(item.config))
    try:
        return (yield)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


def _has_fd(stream) -> bool:
    try:
        return stream.fileno() >= 0
    except (AttributeError, OSError, ValueError):
        return False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _time_limited(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _time_limited(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _time_limited(item, "teardown"))
