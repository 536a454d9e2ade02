"""The README's first-ten-minutes recipes, run as a new user runs them: the command lines between the
`<!-- cpu-recipes` and `<!-- /cpu-recipes -->` markers, in order, with bash, in a fresh copy of the working tree
(tracked and untracked files, none that git ignores: no venv, no runs/, no data/shards/).

The copy reuses this Python (`PY=`, so nothing reinstalls torch) and the data mirror that nanopara/data.py finds
from here (`NANOPARA_MIRROR=`, since ../shared/data is not beside the copy); nothing else of the test environment.
The slow test runs only with NANOPARA_RECIPES=1, as `.ci/run` does after `make test` (about 3 minutes on 2 cores):

    NANOPARA_RECIPES=1 .venv/bin/python -m pytest -q -s tests/test_readme_recipes.py
"""
import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- cpu-recipes", "<!-- /cpu-recipes -->"
RECIPE_TIMEOUT_S = 600  # one command: the tiny runs take 1-2 minutes on 2 idle cores, 6 under a busy machine


def cpu_recipes(text: str) -> list[str]:
    """The command lines of the marked block's bash fence, `\\`-continued lines joined; comments stay (bash drops
    them) so each line is exactly what the README shows."""
    start, end = text.index(BEGIN), text.index(END)
    block = text[start:end].splitlines()
    fence = [i for i, line in enumerate(block) if line.startswith("```")]
    assert len(fence) == 2 and block[fence[0]].strip() == "```bash", "the cpu-recipes block holds one ```bash fence"
    commands, pending = [], ""
    for line in block[fence[0] + 1:fence[1]]:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        if (pending + line).strip():
            commands.append((pending + line).strip())
        pending = ""
    return commands


def readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_cpu_recipe_block():
    commands = cpu_recipes(readme())
    assert commands and all(c.startswith("make ") for c in commands), commands
    assert commands[0].startswith("make train"), "the first recipe trains: the others read its run"


def fresh_copy(dest: str) -> None:
    """The working tree as a fresh clone would have it (plus uncommitted and untracked, not ignored, files)."""
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listing):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src) or os.path.islink(src):  # a deleted-but-tracked file is skipped
            os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel), follow_symlinks=False)


def user_env() -> dict:
    sys.path.insert(0, ROOT)
    from nanopara.data import default_mirror
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST", "TRITON_", "NANOPARA_", "TIKTOKEN_", "XDG_CACHE_HOME"))}
    env["PY"] = sys.executable
    mirror = default_mirror()
    if mirror:
        env["NANOPARA_MIRROR"] = os.path.abspath(mirror)
    return env


@pytest.mark.slow
@pytest.mark.timeout_s(1200)
@pytest.mark.skipif(os.environ.get("NANOPARA_RECIPES") != "1",
                    reason="runs the README's CPU recipes (minutes): NANOPARA_RECIPES=1, as .ci/run does")
def test_cpu_recipes_run_as_written(tmp_path):
    repo = str(tmp_path / "nanopara")
    fresh_copy(repo)
    env = user_env()
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    total = time.perf_counter()
    for cmd in cpu_recipes(readme()):
        t0 = time.perf_counter()
        r = subprocess.run(["bash", "-c", cmd], cwd=repo, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=RECIPE_TIMEOUT_S)
        out = r.stdout + r.stderr
        print(f"\n$ {cmd}\n{out[-3000:]}[{time.perf_counter() - t0:.0f} s, exit {r.returncode}]", flush=True)
        assert r.returncode == 0, f"README recipe failed ({r.returncode}): {cmd}\n{out[-5000:]}"
        assert "Traceback" not in out and "UserWarning" not in out, f"{cmd} printed a traceback or warning"
    print(f"\nREADME CPU recipes: {time.perf_counter() - total:.0f} s in all", flush=True)
    latest = os.path.join(repo, "runs", "latest")
    assert os.path.islink(latest) and not os.path.isabs(os.readlink(latest))
    assert os.path.isfile(os.path.join(repo, "runs", "tiny", "loss.png"))
    assert os.path.isfile(os.path.join(repo, "runs", "tiny_dp2", "metrics.jsonl"))
