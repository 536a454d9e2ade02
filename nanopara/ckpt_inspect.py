"""`python -m nanopara.checkpoint DIR`: the checkpoints of a run, whether each verifies, and what --resume would use.

    $ python -m nanopara.checkpoint runs/tiny
    runs/tiny/ckpt:
      step_000004             10.4 MB  step 4  world 1  2026-11-28 05:14  ok (1 shard, sha256)
      step_000006             10.4 MB  step 6  world 1  2026-11-28 05:14  ok (1 shard, sha256)  <- latest
    --resume would use runs/tiny/ckpt/step_000006 (named by ckpt/latest)

DIR: a run directory, its ckpt/, or one step directory. Each checkpoint is verified as a resume would verify it
(checkpoint.verify: meta.json complete, a shard for every rank, sizes and the sha256 recorded at save; sizes only
for checkpoints from before checksums), and partial saves of an interrupted run are listed as such. Exit code: 0,
or 1 when checkpoints exist and none verifies (a resume would stop), 2 for a DIR that does not exist.
"""
from __future__ import annotations

import os
import sys
import time

from nanopara.checkpoint import CheckpointError, NoCheckpoint, ckpt_root, find_resume, read_meta, verify_error
from nanopara.runguard import lock_state


def inspect(path: str) -> tuple[list[str], int]:
    """Lines listing the checkpoints of a run directory (or its ckpt/, or one step directory) and whether each
    verifies, then what a resume would use; exit code 0, or 1 when checkpoints exist and none verifies."""
    path = os.path.normpath(path)
    one = os.path.exists(os.path.join(path, "meta.json")) or os.path.basename(path).startswith(("step_", "tmp-"))
    run = None if one else os.path.dirname(path) if os.path.basename(path) == "ckpt" else path
    root = os.path.dirname(path) if one else ckpt_root(run)
    names = [os.path.basename(path)] if one else sorted(os.listdir(root)) if os.path.isdir(root) else []
    try:
        with open(os.path.join(root, "latest")) as f:
            named = f.read().strip()
    except OSError:
        named = None
    lines, ok = [f"{root}:"], 0
    lock = lock_state(run) if run is not None else ""
    for d in names:
        p = os.path.join(root, d)
        if not os.path.isdir(p):
            continue
        mb = sum(os.path.getsize(os.path.join(p, f)) for f in os.listdir(p)) / 1e6
        if not d.startswith("step_"):
            lines.append(f"  {d:<18} {mb:9.1f} MB  " + ("a save being written (or left by a failed one), not a "
                                                       "checkpoint yet" if lock.startswith("held") else
                                                       "an interrupted save, not a checkpoint (a run starting here "
                                                       "removes it)"))
            continue
        err = verify_error(p)
        try:
            meta = read_meta(p)
        except CheckpointError:
            meta = {}
        lay = meta.get("layout") if isinstance(meta.get("layout"), dict) else {}
        lay = (" ".join(f"{k}{v}" for k, v in lay.items() if k != "world" and isinstance(v, int) and v > 1)
               or f"world {lay.get('world', '?')}")
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(meta.get("saved_at", 0)))
        n = len(meta.get("shard_bytes", {}))
        status = f"DAMAGED: {err}" if err else (f"ok ({n} shard{'s' * (n != 1)}, sha256)" if "shard_sha256" in meta
                                                else "ok (sizes only: no checksums recorded)")
        ok += not err
        lines.append(f"  {d:<18} {mb:9.1f} MB  step {meta.get('step', '?')}  {lay}  {when}  {status}"
                     f"{'  <- latest' if d == named else ''}")
    if run is None:
        return lines, 0 if ok else 1
    if lock:
        lines.append(f"lock: {lock}")
    try:
        chosen, note = find_resume(run)
        lines.append(f"--resume would use {chosen}" + (f": {note}" if note else " (named by ckpt/latest)"))
    except NoCheckpoint:
        lines.append("--resume would start from step 0: no checkpoint yet")
    except CheckpointError as e:
        lines.append(f"--resume would stop: {e}")
        return lines, 1
    return lines, 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: python -m nanopara.checkpoint RUN_DIR|CKPT_DIR|STEP_DIR: lists the checkpoints, verifies them "
              "(sizes, sha256 recorded at save, completeness) and says which one --resume would use")
        return 0 if args and args[0] in ("-h", "--help") else 2
    if not os.path.isdir(args[0]):
        print(f"error: no such run or checkpoint directory: {args[0]}", file=sys.stderr)
        return 2
    lines, code = inspect(args[0])
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    sys.exit(main())
