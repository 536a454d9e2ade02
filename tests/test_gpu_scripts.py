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
