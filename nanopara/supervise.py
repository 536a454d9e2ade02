"""Restarts without a person: train.py's processes, started again with --resume after a failure.

    python -m nanopara.supervise --restarts=3 --nproc=4 -- train.py --preset=tiny --device=cpu --ckpt.every=50
    make train NGPU=4 RESTARTS=3 [MIN_NGPU=2] ARGS="..."           # the same through make

The supervisor starts the processes itself: one plain process for nproc=1, else nproc with torchrun's environment
(MASTER_ADDR/PORT on a fresh port each attempt, RANK, LOCAL_RANK, WORLD_SIZE), each in its own process group with
SIGTERM as its parent-death signal. The first process that fails decides (the others are then killed: at once
after a crash, as a NCCL peer of a dead rank would wait in its collective; after grace_s after an error):
    exit 2                     an error train.py reported (configuration, data, checkpoint, NaN streak): not retried
    130/143, SIGINT/SIGTERM    a stop, after the run saved (runguard.py): preemption means stop, so no restart
    anything else              a crash: exit 1 (an exception, a collective that failed or timed out), SIGKILL (the
                               OOM killer), SIGABRT (NCCL's watchdog), SIGSEGV: restarted, at most `restarts` times
A restart runs the same command with --resume (without --overwrite): train.py continues from the newest complete
checkpoint. Each restart is one line (which rank, how, restart k of N, the step it resumes from); after N restarts
the next failure is one line and that process's exit code. SIGINT/SIGTERM to the supervisor reach every process
once (they save at the next step and exit 130/143; a second one: their default action), and nothing restarts; a
SIGTERM only TERM_S later and where a process has not had one (a scheduler's preemption signals every process).
Fewer processes only when asked (min_nproc < nproc, GPU runs): before a restart every GPU is probed, and with
fewer answering the largest count >= min_nproc that `train.py --check_world` accepts continues, resharded
(reshard.py: train.py resumes any layout). Otherwise the layout never changes by itself.
A traceback on a process's stderr is held until the process ends (or runs on for HELD_S): the tracebacks of the
processes that failed after the first one (a peer's death broke their collective) are not shown.
What this survives and what it does not: notes/restarts.md.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from nanopara.cli import parse_args
from nanopara.config import ConfigError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOPS = {128 + s: s for s in STOP_SIGNALS}  # runguard.stop's exit codes
HELD_S = 2.0    # a held traceback of a process still running after this long is shown (the process handled it)
TERM_S = 2.0    # a SIGTERM is passed on this long after it came, to the processes that have not had one
POLL_S = 0.05   # how often the supervisor looks at its processes
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
PR_SET_PDEATHSIG = 1


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def kind(code: int) -> str:
    """'stop' (SIGINT/SIGTERM: the user or a scheduler), 'error' (exit 2: train.py's one-line errors) or 'crash'."""
    sig = -code if code < 0 else STOPS.get(code)
    if sig in (signal.SIGINT, signal.SIGTERM):
        return "stop"
    return "error" if code == 2 else "crash"


def exit_code(code: int) -> int:
    return 128 - code if code < 0 else code  # a signal's death as a shell reports it


def resume_args(args: list[str]) -> list[str]:
    """The command line of a restart: --resume, and no --overwrite (it would delete the checkpoints)."""
    return [a for a in args if a.split("=", 1)[0] not in ("--resume", "--overwrite")] + ["--resume"]


def resume_point(out_dir: str) -> str:
    """Where train.py --resume will continue: ckpt/latest, else the newest checkpoint whose shards are whole (sizes;
    train.py also checks their sha256 and says so if it falls back further)."""
    from nanopara import checkpoint, runguard  # (torch: imported once a restart needs it)
    root = checkpoint.ckpt_root(out_dir)
    try:
        with open(os.path.join(root, "latest")) as f:
            named = [f.read().strip()]
    except OSError:
        named = []
    for d in named + list(reversed(runguard.step_dirs(out_dir))):
        path = os.path.join(root, d)
        if d and checkpoint.verify_error(path, checksums=False) is None:
            return f"the checkpoint of step {checkpoint.read_meta(path)['step']} ({path})"
    return "step 0 (no checkpoint yet)"


def _child_setup(parent: int) -> None:
    """In a new process before it runs the script: its own process group (the supervisor signals the group, and a
    terminal's Ctrl-C reaches only the supervisor, which passes it on once), SIGTERM when the supervisor dies."""
    os.setpgid(0, 0)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])  # (the supervisor holds SIGINT/SIGTERM while it starts them)
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the supervisor died before prctl
            os.kill(os.getpid(), signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------------------------
class Worker:
    """One process of the group. Its stderr is passed on line by line, except a traceback: held until the process
    ends, then shown or dropped (`finish`), or shown once the process has run on for HELD_S. The supervisor reads
    every stderr from its one thread (select): a parent-death signal is sent each time the thread a child hangs
    from ends, so helper threads would send a second SIGTERM, which runguard takes as "stop without saving"."""

    def __init__(self, rank: int, cmd: list[str], env: dict):
        parent = os.getpid()
        self.rank, self.code, self.ended, self.eof, self.told = rank, None, 0.0, 0.0, False
        self.held, self.since, self.partial = None, 0.0, b""
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, preexec_fn=lambda: _child_setup(parent))
        self.fd = self.proc.stderr.fileno()
        os.set_blocking(self.fd, False)

    def read(self) -> None:
        """What its stderr holds now (the end of it: the time it ended, closer than the polling)."""
        while not self.eof:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            if not data:
                self.eof = time.monotonic()
                if self.partial:
                    self._line(self.partial)
                return
            *lines, self.partial = (self.partial + data).split(b"\n")
            for line in lines:
                self._line(line + b"\n")

    def _line(self, line: bytes) -> None:
        if self.held is None and b"Traceback (most recent call last)" in line:
            self.held, self.since = [], time.monotonic()
        if self.held is not None:
            self.held.append(line)
        else:
            _write_err(line)

    def poll(self) -> int | None:
        if self.code is None and (code := self.proc.poll()) is not None:
            self.code, self.ended = code, self.eof or time.monotonic()
        if self.code is None and self.held and time.monotonic() - self.since > HELD_S:
            _write_err(b"".join(self.held))
            self.held = None
        return self.code

    def catches_sigterm(self) -> bool:
        """Whether runguard's SIGTERM handler is set and has not fired (it puts the default action back when it
        does): /proc/PID/status's SigCgt mask; True without /proc."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                caught = next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigCgt:"))
        except (OSError, StopIteration, ValueError, IndexError):
            return True
        return bool(caught >> (signal.SIGTERM - 1) & 1)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except OSError:  # gone already
            pass

    def finish(self, show: bool) -> None:
        """After the process ended: the rest of its stderr read, its held traceback shown (or dropped), closed."""
        self.read()
        if show and self.held:
            _write_err(b"".join(self.held))
        self.held = None
        self.proc.stderr.close()


def _write_err(b: bytes) -> None:
    sys.stderr.flush()
    sys.stderr.buffer.write(b)
    sys.stderr.buffer.flush()


# ----------------------------------------------------------------------------------------------------------------
class Supervisor:
    """`Supervisor(script, args, nproc, restarts).run()` -> the exit code (see the module docstring)."""

    def __init__(self, script: str, args: list[str], nproc: int = 1, restarts: int = 3, min_nproc: int = 0,
                 grace_s: float = 3.0, python: str = sys.executable):
        self.cfg = parse_args(args)  # a ConfigError: one line before anything starts
        if nproc < 1 or restarts < 0 or grace_s < 0 or not 0 <= min_nproc <= nproc:
            raise ConfigError(f"supervise: needs nproc >= 1 (got {nproc}), restarts >= 0 (got {restarts}), "
                              f"grace_s >= 0 (got {grace_s}) and min_nproc from 1 to nproc (got {min_nproc})")
        self.script, self.args, self.nproc, self.restarts = script, list(args), nproc, restarts
        self.min_nproc, self.grace_s, self.python = min_nproc or nproc, grace_s, python
        self.workers: list[Worker] = []
        self.signum, self.since = 0, 0.0

    def say(self, text: str, err: bool = False) -> None:
        print(f"supervise: {text}", file=sys.stderr if err else sys.stdout, flush=True)

    def run(self) -> int:
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        try:
            return self._run()
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            for w in self.workers:  # (none is left running on the normal paths)
                if w.poll() is None:
                    w.signal(signal.SIGKILL)

    def _on_signal(self, signum, frame) -> None:
        """No restart after this. SIGINT (a terminal's Ctrl-C reaches only the supervisor): passed on to every process
        at once. SIGTERM: passed on TERM_S later, to the processes that still catch it (`pass_on`): a scheduler's
        preemption signals every process, and a second SIGTERM would take a process's default action, without its
        save. Any later signal: passed on to every process at once (their default action: stop now)."""
        first, self.signum = not self.signum, self.signum or signum
        if first:
            self.since = time.monotonic()
        if first and signum == signal.SIGTERM:
            return
        for w in self.workers:
            if w.code is None:
                w.signal(signum)
                w.told = True

    def pass_on(self) -> None:
        if self.signum == signal.SIGTERM and time.monotonic() - self.since >= TERM_S:
            for w in self.workers:
                if w.code is None and not w.told and w.catches_sigterm():
                    w.signal(signal.SIGTERM)
                    w.told = True

    def _run(self) -> int:
        if self.cfg.ckpt.every == 0:
            self.say("warning: --ckpt.every=0: a restart starts the run over from step 0; set --ckpt.every=N")
        args, nproc, devices, used = self.args, self.nproc, None, 0
        while True:
            held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # a stop now waits for the whole group
            try:
                if self.signum:  # the user's (or a scheduler's) stop: rank 0 said what was saved, if it ran
                    return 128 + self.signum
                self.launch(args, nproc, devices)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)  # ... and then reaches every process
            first = self.watch()
            if first is None:
                return 0
            what = f"rank {first.rank} {describe(first.code)}"
            if self.signum:
                return 128 + self.signum
            if kind(first.code) == "stop":
                self.say(f"{what}: a stop, not a failure (the run saves before it stops); not restarted")
                return exit_code(first.code)
            if kind(first.code) == "error":
                self.say(f"{what} (the error above); not restarted", err=True)
                return 2
            if used == self.restarts:
                self.say(f"{what}; no restart left ({used} of {self.restarts} used): stopped; --resume would continue "
                         f"from {resume_point(self.cfg.out_dir)}", err=True)
                return exit_code(first.code)
            used += 1
            smaller = self.fewer_processes(nproc, what)
            if smaller is not None:
                if smaller[0] == 0:
                    return exit_code(first.code)
                note = f" on {smaller[0]} processes, GPUs {','.join(smaller[1])} (was {nproc})"
                nproc, devices = smaller
            else:
                note = ""
            args = resume_args(self.args)
            self._drop_lock()
            self.say(f"{what}; restart {used} of {self.restarts}{note}, from {resume_point(self.cfg.out_dir)}")

    def launch(self, args: list[str], nproc: int, devices: list[str] | None) -> None:
        """Start the group: nproc processes of the script, with torchrun's environment."""
        env, port = dict(os.environ), _free_port()
        env.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: OpenMP threads of several processes fight
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        cmd = [self.python, self.script, *args]
        self.workers = [Worker(r, cmd, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(nproc)]

    def watch(self) -> Worker | None:
        """Wait for the group to end; None when every process ended with 0, else the first that failed."""
        first, deadline = None, None
        while None in [w.poll() for w in self.workers]:  # (every one polled)
            streams = {w.fd: w for w in self.workers if not w.eof}
            if streams:  # (wakes at once for a line, or for the end of a stream: a process ending)
                for fd in select.select(list(streams), [], [], POLL_S)[0]:
                    streams[fd].read()
            else:
                time.sleep(POLL_S)
            self.pass_on()
            failed = sorted((w for w in self.workers if w.code not in (None, 0)), key=lambda w: w.ended)
            if failed and first is None:  # after a crash nothing is left to wait for; an error: the others' lines
                first = failed[0]            # (a stop saves: every process is waited for)
                deadline = {"crash": 0.0, "error": self.grace_s}.get(kind(first.code))
                deadline = None if deadline is None else time.monotonic() + deadline
            if deadline is not None and time.monotonic() > deadline:
                for w in self.workers:
                    if w.code is None:
                        w.signal(signal.SIGKILL)
                deadline = None
        failed = sorted((w for w in self.workers if w.code != 0), key=lambda w: w.ended)
        first = first or (failed[0] if failed else None)
        for w in self.workers:  # the others' tracebacks only repeat that a peer died
            w.finish(show=w is first or first is None or kind(first.code) != "crash")
        return first

    def _drop_lock(self) -> None:
        """The run lock (runguard.py) rank 0 left when it died: removed, so the restart says nothing about it."""
        from nanopara import runguard
        path = os.path.join(self.cfg.out_dir, runguard.LOCK_FILE)
        if runguard.read_holder(path).get("pid") in {w.proc.pid for w in self.workers}:
            try:
                os.remove(path)
            except OSError:
                pass

    # ------------------------------------------------------------------------------------------------------------
    # fewer processes, when the user allows it

    def usable_devices(self) -> list[str] | None:
        """The GPUs that answer a small allocation (one probe process each, 60 s at most); None for a CPU run."""
        if self.cfg.device == "cpu":
            return None
        probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            ids = ([d for d in visible.split(",") if d.strip()] if visible is not None else
                   [str(i) for i in range(int(subprocess.run([self.python, "-c", probe], capture_output=True,
                                                             text=True, timeout=120).stdout.strip() or 0))])
        except (subprocess.TimeoutExpired, ValueError):
            return None
        if not ids:
            return None
        check = "import torch; torch.ones(1, device='cuda').sum().item()"
        procs = [subprocess.Popen([self.python, "-c", check], env={**os.environ, "CUDA_VISIBLE_DEVICES": d},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for d in ids]
        deadline, ok = time.monotonic() + 60, []
        for d, p in zip(ids, procs):
            try:
                if p.wait(timeout=max(0.1, deadline - time.monotonic())) == 0:
                    ok.append(d)
            except subprocess.TimeoutExpired:
                p.kill()
        return ok

    def fewer_processes(self, nproc: int, what: str) -> tuple | None:
        """Before a restart: (k, the GPUs) for a restart on k < nproc processes, (0, None) to stop, None for no
        change. Only a GPU run with min_nproc < nproc probes its GPUs."""
        if self.min_nproc >= nproc:
            return None
        devices = self.usable_devices()
        if devices is None or len(devices) >= nproc:
            return None
        if len(devices) < self.min_nproc:
            self.say(f"{what}; only {len(devices)} GPUs answer and min_nproc is {self.min_nproc}: stopped", err=True)
            return 0, None
        why = ""
        for k in range(len(devices), self.min_nproc - 1, -1):
            r = subprocess.run([self.python, self.script, f"--check_world={k}", *resume_args(self.args)],
                               capture_output=True, text=True, timeout=600)
            if r.returncode == 0:
                return k, devices[:k]
            why = (r.stderr.strip().splitlines() or [""])[-1]
        self.say(f"{what}; {len(devices)} GPUs answer, and no layout of {self.min_nproc} to {len(devices)} "
                 f"processes takes this run ({why}): stopped", err=True)
        return 0, None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanopara.supervise", description=__doc__.split("\n")[0])
    p.add_argument("--restarts", type=int, default=3, help="restarts after failures before it gives up")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) of the run")
    p.add_argument("--min_nproc", type=int, default=0, help="fewest processes a restart may continue on when GPUs "
                                                            "stop answering (default: nproc, never fewer)")
    p.add_argument("--grace_s", type=float, default=3.0, help="after a failure, seconds the others get to end")
    p.add_argument("script", help="train.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if "--help" in a.args or "-h" in a.args:  # the script's own help, nothing to supervise
        return subprocess.call([sys.executable, a.script, *a.args])
    try:
        sup = Supervisor(a.script, a.args, a.nproc, a.restarts, a.min_nproc, a.grace_s)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
