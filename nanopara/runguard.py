"""The run directory and the run's end: one trainer per out_dir, no mixing of runs, a clean stop on SIGTERM/SIGINT.

    <out_dir>/config.json, run_info.txt, metrics.jsonl, ckpt/ (checkpoint.py)   the run's settings, log, checkpoints
    <out_dir>/.lock   pid, host, start time and command of the trainer that holds it (rank 0), while it runs

train.py runs inside `with RunGuard(out_dir, mesh) as guard:`. On entry, before anything else touches out_dir,
rank 0 takes the lock: an flock on the open `.lock`, which the kernel drops however the process dies. A second
trainer gets one line naming the holder. A lock file whose holder died (its flock is free; on a filesystem without
flock: its pid is not alive on this host) is taken over, and that is said. The other ranks learn rank 0's outcome
from a broadcast, so every rank raises the same one-line error and none waits. On exit (or atexit) the file goes,
after a checkpoint still being written in the background (async_save.py) is published: the lock covers its write.
Then `prepare_run_dir` refuses to mix a new run with another run's checkpoints or log (unless --resume or
--overwrite) and removes partial saves a dead run left.

SIGTERM (a scheduler's preemption notice) and SIGINT (Ctrl-C) only set a flag. After every optimizer step the ranks
agree on it (`agree_stop`: an all-reduce MAX of one int over a gloo group, issued after one step and read after the
next: 0.11 ms of host time a step on two H200s, no step-time change within noise; a blocking one took 0.5 ms), so
all stop after the same step: train.between_steps saves a checkpoint (unless checkpoints are off: ckpt.every=0 and
ckpt.final=false), prints one line and `stop` exits with 128 + the signal number: 143 after SIGTERM, 130 after
SIGINT, what a shell reports for a process that signal killed, so schedulers and scripts see an unfinished run. A
second signal takes its default action at once, except a SIGTERM within REPEAT_S of the first (a scheduler that
signals every process while torchrun forwards its own: one notice, one save). Bound: two steps and one save after
the signal (torchrun's agent waits 30 s between its SIGTERM and its SIGKILL); `stop` waits for a background write.
"""
from __future__ import annotations

import atexit
import errno
import faulthandler
import fcntl
import os
import shutil
import stat
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from nanopara import async_save
from nanopara.config import ConfigError

REPEAT_S = 5.0  # a second SIGTERM sooner than this is the first notice again (the scheduler's and torchrun's copies)



def _late_copy(first_at: float):
    """SIGTERM's handler once a SIGTERM stop has left the guard: a copy within REPEAT_S of the first is dropped, a
    later one takes the default action (the process is normally gone by then)."""
    def handler(signum, frame):
        if time.monotonic() - first_at >= REPEAT_S:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
    handler.runguard_late_copy = True
    return handler


RUN_FILES = ("metrics.jsonl", "config.json", "run_info.txt")  # what a run writes beside ckpt/
LOCK_FILE = ".lock"


class CheckpointError(RuntimeError):
    """Missing, corrupt or incompatible checkpoint, or a run directory that cannot be used: one line."""


class AgreedError(CheckpointError, ConfigError):
    """A CheckpointError every rank raises with the same text, after a collective: train.main prints it once (as it
    does a ConfigError), not once per rank."""


class RunLocked(AgreedError):
    """--out_dir is in use by another trainer."""


class Stop(SystemExit):
    """Leaves the run after a signal's checkpoint; its code is 128 + the signal number."""


# ----------------------------------------------------------------------------------------------------------------
# the run directory

def ckpt_root(out_dir) -> str:
    return os.path.join(out_dir, "ckpt")


def step_dirs(out_dir) -> list[str]:
    try:  # (rank 0's writability probe in prepare_run_dir may create and remove an empty ckpt/ meanwhile)
        return sorted(d for d in os.listdir(ckpt_root(out_dir)) if d.startswith("step_"))
    except (FileNotFoundError, NotADirectoryError):
        return []


def check_out_dir(out_dir: str) -> None:
    """out_dir and its ckpt/ are directories or can become ones: one line otherwise."""
    for path, what in ((out_dir, "--out_dir"), (ckpt_root(out_dir), "the checkpoint folder of --out_dir")):
        try:  # one stat: rank 0's writability probe may make and remove an empty ckpt/ between two checks
            is_dir = stat.S_ISDIR(os.stat(path).st_mode)
        except (FileNotFoundError, NotADirectoryError):  # (under a file: the parent check below says so)
            continue
        if not is_dir:
            raise CheckpointError(f"{what} {path} is a file, not a directory")
    parent = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise CheckpointError(f"--out_dir {out_dir}: {parent} is a file, not a directory")


def prepare_run_dir(out_dir: str, resume: bool, overwrite: bool, is_main: bool) -> None:
    """Before any data or model work (train.py: under the run's lock): out_dir (and its ckpt/) must be a writable
    directory, and a new run must not mix with another run's checkpoints or log. Rank 0 then removes partial saves
    an interrupted run left, and with `overwrite` the other run's checkpoints and log (nothing else in out_dir)."""
    check_out_dir(out_dir)
    log = os.path.exists(os.path.join(out_dir, RUN_FILES[0]))
    held = step_dirs(out_dir)
    if (held or log) and not resume and not overwrite:
        if not held:  # interrupted before its first checkpoint: --resume starts it again (find_resume)
            raise CheckpointError(f"--out_dir {out_dir} holds the log of a run that stopped before its first "
                                  f"checkpoint ({RUN_FILES[0]}): add --resume to start that run again from step 0 "
                                  f"(its log goes on), --overwrite to discard it, or choose another --out_dir")
        raise CheckpointError(f"--out_dir {out_dir} already holds a run ({', '.join(held[:3])}"
                              f"{', ...' if len(held) > 3 else ''}): add --resume to continue it, --overwrite to "
                              f"replace it, or choose another --out_dir")
    if not is_main:
        return
    root = ckpt_root(out_dir)
    made = [p for p in (os.path.abspath(out_dir), os.path.abspath(root)) if not os.path.exists(p)]
    try:  # proven by writing (permissions alone say nothing for root, read-only mounts, /proc)
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"--out_dir {out_dir} is not writable: {e.strerror or e}") from None
    finally:  # leave no trace until the run really starts (a later error must not leave an empty run behind)
        for p in reversed(made):
            if os.path.isdir(p) and not os.listdir(p):
                os.rmdir(p)
    for f in RUN_FILES if overwrite else ():  # also where the old run saved no checkpoint (rl.py --save=0)
        if os.path.exists(os.path.join(out_dir, f)):
            os.remove(os.path.join(out_dir, f))
    for d in os.listdir(root) if os.path.isdir(root) else ():  # partial saves of a run that died (they may fill
        p = os.path.join(root, d)                                # the disk)
        if overwrite or d.startswith(("tmp-", "old-")) or d.endswith(".tmp"):
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.remove(p)


# ----------------------------------------------------------------------------------------------------------------
# the lock

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def read_holder(path: str) -> dict:
    """{pid, host, since, argv} from a lock file ({} when empty, unreadable or not ours)."""
    try:
        with open(path) as f:
            fields = dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)
        return {**fields, "pid": int(fields["pid"])}
    except (OSError, KeyError, ValueError):
        return {}


def _describe(h: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(h.get("since", 0))))
    return f"pid {h['pid']} on host {h.get('host', '?')}, since {when}"


def lock_state(out_dir: str) -> str:
    """Who holds out_dir's lock ("" when nobody), for the checkpoint listing (ckpt_inspect.py)."""
    path, holder = os.path.join(out_dir, LOCK_FILE), read_holder(os.path.join(out_dir, LOCK_FILE))
    if not holder:
        return ""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return ""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # free: its holder is gone (released again at once)
        return f"left by {_describe(holder)}, which is no longer running: the next run takes it over"
    except OSError:
        return f"held by {_describe(holder)}: a trainer is running in this directory"
    finally:
        os.close(fd)


class RunLock:
    """`<out_dir>/.lock`, held from construction to `release()` (see the module docstring)."""

    def __init__(self, out_dir: str):
        check_out_dir(out_dir)  # one line for an out_dir that is a file, or under one
        self.out_dir, self.path, self.fd, self.note = out_dir, os.path.join(out_dir, LOCK_FILE), None, ""
        self.made_dir = not os.path.exists(out_dir)
        try:
            os.makedirs(out_dir, exist_ok=True)
            while self.fd is None:  # until we hold the lock on the file that is at `path` (a releaser unlinks it)
                self.fd = self._try_lock()
        except OSError as e:
            self.release()
            raise CheckpointError(f"--out_dir {out_dir} is not writable: {e.strerror or e}") from None
        except RunLocked:
            self.release()
            raise
        prev = read_holder(self.path)
        if prev and prev["pid"] != os.getpid():
            self.note = f"took over the lock of {self.out_dir}, left by {_describe(prev)}, which is no longer running"
        text = (f"pid={os.getpid()}\nhost={socket.gethostname()}\nsince={time.time():.0f}\n"
                f"argv={' '.join(sys.argv)[:500]}\n")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text.encode(), 0)
        atexit.register(self.release)

    def _try_lock(self) -> int | None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(self.path)
            os.close(fd)
            raise RunLocked(f"--out_dir {self.out_dir} is in use by another trainer ("
                            f"{_describe(holder) if holder else 'starting up'}): wait for it to end, stop it, or "
                            f"choose another --out_dir") from None
        except OSError as e:  # no flock on this filesystem: the holder's pid says whether it is alive
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                os.close(fd)
                raise
            holder = read_holder(self.path)
            if holder and holder["pid"] != os.getpid() and (holder.get("host") != socket.gethostname()
                                                            or _alive(holder["pid"])):
                os.close(fd)
                raise RunLocked(f"--out_dir {self.out_dir} is in use by another trainer ({_describe(holder)}): "
                                f"wait for it to end, or remove {self.path} if it is gone") from None
        try:
            if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the holder released (unlinked) it between our open and our flock: take the new file
        return None

    def release(self) -> None:
        """Remove the lock file, then drop the flock; the run directory too if this lock made it and it is empty."""
        if self.fd is not None:
            try:
                if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                    os.remove(self.path)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None
        if self.made_dir and os.path.isdir(self.out_dir) and not os.listdir(self.out_dir):
            os.rmdir(self.out_dir)  # an error before the run wrote anything leaves no trace
        self.made_dir = False
        atexit.unregister(self.release)


# ----------------------------------------------------------------------------------------------------------------
# the guard: the lock on rank 0, the signal flag on every rank, and their agreement

class RunGuard:
    """`with RunGuard(out_dir, mesh) as guard:` around a run; collective (every rank enters it at the same point)."""

    def __init__(self, out_dir: str, mesh):
        self.out_dir, self.mesh = out_dir, mesh
        self.lock, self.signum, self._old, self._dump, self._pending = None, 0, {}, False, None
        self.group = None  # host-side collectives: the default group on CPU (gloo), a gloo group beside NCCL
        if mesh.world > 1 and mesh.device.type != "cpu":
            self.group = mesh.new_group(backend="gloo")

    def __enter__(self) -> "RunGuard":
        err = None
        if self.mesh.is_main:
            try:
                self.lock = RunLock(self.out_dir)
            except Exception as e:  # every rank must learn it: never leave the others waiting below
                err = (isinstance(e, RunLocked), str(e) if isinstance(e, CheckpointError) else
                       f"--out_dir {self.out_dir}: {type(e).__name__}: {e}")
        if self.mesh.world > 1:
            box = [err]
            dist.broadcast_object_list(box, src=0, group=self.group)
            err = box[0]
        if err:
            raise (RunLocked if err[0] else AgreedError)(err[1])  # (the same line on every rank: printed once)
        if self.lock is not None and self.lock.note:
            print(f"note: {self.lock.note}", flush=True)
        if threading.current_thread() is threading.main_thread():  # signal.signal works there only
            self._dump = faulthandler.unregister(signal.SIGTERM)  # a test worker's stack dump on SIGTERM (hangs)
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._on_signal)
            if self._dump:  # ... stays: it dumps, then chains to the flag
                faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
        return self

    def __exit__(self, *exc) -> bool:
        async_save.drain(self.out_dir, release=True)  # a checkpoint still being written is published first
        if self._dump:
            faulthandler.unregister(signal.SIGTERM)
        for sig, old in self._old.items():
            late = sig == self.signum == signal.SIGTERM and old == signal.SIG_DFL  # leaving after a SIGTERM stop:
            signal.signal(sig, _late_copy(self._first_at) if late else old)  # a late copy of it must not kill us
        if self._dump:
            faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
        self._old, self._dump = {}, False
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        return False

    def _on_signal(self, signum, frame) -> None:
        """Only a flag (printing here could re-enter a write in progress); a second signal: its old action, but a
        SIGTERM repeated within REPEAT_S of the first is the same notice delivered twice, and is dropped."""
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first_at = signum, now
            if signum != signal.SIGTERM:
                signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
            return
        if signum == signal.SIGTERM == self.signum and now - self._first_at < REPEAT_S:
            return
        old = self._old.get(signum, signal.SIG_DFL)
        signal.signal(signum, old)
        if callable(old):
            old(signum, frame)
        elif old == signal.SIG_DFL:
            os.kill(os.getpid(), signum)

    def agree_stop(self, last: bool = False) -> int:
        """The signal every rank stops for after this step (0: go on): the largest one any rank had received a step
        ago. Collective; every rank calls it after every step. The all-reduce of this step's flags is only issued
        here and read at the next step, so the host never waits for it (a blocking one cost ~0.5 ms a step on two
        H200s); a signal stops the run one step later. None is left in flight once a stop is agreed, or with
        `last` (the run's last step: it ends anyway, 0)."""
        if self.mesh.world == 1:
            return 0 if last else self.signum
        agreed = 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()  # issued a step ago on every rank: long done
            agreed, self._pending = int(flag.item()), None
        if not last and not agreed:
            flag = torch.tensor([self.signum], dtype=torch.int32)
            self._pending = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag
        return 0 if last else agreed

    def stop(self, step: int, signum: int, saved: str, log) -> None:
        """One line, then leave with 128 + signum (the caller has saved what it could: `saved` says what; a save
        written in the background is waited for here, and its failure replaces `saved`)."""
        saved = async_save.drain(self.out_dir) or saved
        code = 128 + signum
        log(f"stopped by {signal.Signals(signum).name} after step {step}: {saved} (exit code {code})")
        sys.stdout.flush()
        raise Stop(code)
