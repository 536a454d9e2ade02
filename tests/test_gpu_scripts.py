"""The GPU scripts (bench/gpu_suite.sh, bench/gpu_multi.sh) parse, and every section their header lists is a case
of their dispatch (and the other way round): a broken script found here costs nothing, found on a lent GPU it
costs a call."""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["bench/gpu_suite.sh", "bench/gpu_multi.sh"]


def _sections(text: str) -> tuple[set, set]:
    """(sections named in the header comment, sections the case statement dispatches)."""
    header = set()
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        m = re.match(r"#   (\w+)\s", line)
        if m:
            header.add(m.group(1))
    cases = set()
    for m in re.finditer(r"^ {4}([\w|]+)\)", text, re.M):
        cases.update(m.group(1).split("|"))
    return header, cases


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", SCRIPTS)
def test_gpu_script_parses_and_lists_its_sections(script):
    path = os.path.join(ROOT, script)
    r = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with open(path) as f:
        header, cases = _sections(f.read())
    assert header, f"{script}: no sections found in the header comment"
    assert header - cases == set(), f"{script}: listed but not dispatched: {sorted(header - cases)}"
    assert cases - header == set(), f"{script}: dispatched but not listed: {sorted(cases - header)}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_suite_rejects_an_unknown_section(tmp_path):
    r = subprocess.run(["bash", os.path.join(ROOT, "bench/gpu_suite.sh"), "no_such_section"], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "OUT": str(tmp_path)})
    assert r.returncode == 2 and "unknown section no_such_section" in r.stdout


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None, reason="needs bash and tar")
def test_lanes_bring_every_lane_back_in_one_file_and_stop_at_the_limit(tmp_path):
    """bench/lanes.sh: each lane's OUT and log land in OUT/lanes.tgz; a lane past LIMIT is killed (exit 124)."""
    import tarfile
    out = tmp_path / "out"
    r = subprocess.run(["bash", os.path.join(ROOT, "bench/lanes.sh"), "0:echo made > $OUT/result.txt",
                        "1,2:sleep 60", "echo gpus=${CUDA_VISIBLE_DEVICES:-all}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "OUT": str(out), "LIMIT": "3", "PY": "true"})
    assert r.returncode == 0, r.stderr
    with tarfile.open(out / "lanes.tgz") as tar:
        files = {m.name.lstrip("./"): m for m in tar.getmembers()}
        read = lambda name: tar.extractfile(files[name]).read().decode()  # noqa: E731
        assert read("lane1/result.txt") == "made\n"
        assert "exit 0" in read("lane1/log")
        assert "exit 124" in read("lane2/log")  # killed at LIMIT, not left to run
        assert "gpus=all" in read("lane3/log")
