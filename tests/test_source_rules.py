"""The sources stay readable one file at a time: every nanopara/ file within 450 lines, a kernels/ file past 450
lines only with its reason in its first lines ("Long file: ..."), every module docstring (nanopara/, kernels/,
data/, bench/, the top-level scripts) within 25 lines, and no source or notes file citing a markdown document
that is not in this repository (documents outside it, such as the team's shared folder, do not travel with the
code). Plain file reads: well under a second.
"""
import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 450          # nanopara/: one idea per file, readable in one sitting
MAX_DOCSTRING = 25       # a module docstring is one screen
REASON = re.compile(r"^Long file: \S")  # a longer kernels/ file says why, within its first REASON_WITHIN lines
REASON_WITHIN = 12
DOCSTRING_DIRS = ("nanopara", "kernels", "data", "bench")
CITING_DIRS = ("nanopara", "kernels", "data", "bench", "tests")
OUTSIDE = {"shared", ".git", ".venv", "out", "runs"}  # not the repository's own documents, even where present
# `dir/name.md` or `NAME.md` as a whole token (not a `*.md` glob, not a suffix like `.md` alone, not inside a URL)
CITATION = re.compile(r"(?<![\w./*-])((?:[\w.-]+/)*\w[\w.-]*\.md)\b")
NOT_CITATIONS = {("tests/test_prepare.py", "sub/b.md")}  # a file that test writes into its input folder


def rel(path: str) -> str:
    return os.path.relpath(path, ROOT).replace(os.sep, "/")


def lines_of(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def python_files(dirs) -> list:
    files = [p for d in dirs for p in sorted(glob.glob(os.path.join(ROOT, d, "*.py")))]
    return files + sorted(glob.glob(os.path.join(ROOT, "*.py")))


def docstring_lines(path: str) -> int:
    """Lines of the module docstring (0 without one)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    first = tree.body[0] if tree.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def in_repo(cited: str, citing: str) -> bool:
    """Whether `cited` names a file of this repository: from the root (notes/x, results/README), or beside the
    citing file."""
    for base in (ROOT, os.path.dirname(os.path.join(ROOT, citing))):
        path = os.path.normpath(os.path.join(base, cited))
        inside = os.path.relpath(path, ROOT)
        if inside.startswith("..") or inside.split(os.sep)[0] in OUTSIDE:
            continue
        if os.path.isfile(path):
            return True
    return False


def test_nanopara_files_fit_one_sitting():
    long = [f"{rel(p)} ({n} lines)" for p in sorted(glob.glob(os.path.join(ROOT, "nanopara", "*.py")))
            if (n := len(lines_of(p))) > MAX_LINES]
    assert not long, f"over {MAX_LINES} lines (split by idea): " + "; ".join(long)


def test_long_kernel_files_say_why():
    silent = []
    for p in sorted(glob.glob(os.path.join(ROOT, "kernels", "*.py"))):
        lines = lines_of(p)
        if len(lines) > MAX_LINES and not any(REASON.match(s) for s in lines[:REASON_WITHIN]):
            silent.append(f"{rel(p)} ({len(lines)} lines)")
    assert not silent, (f"kernels/ files over {MAX_LINES} lines without a 'Long file: <reason>' line in their first "
                        f"{REASON_WITHIN} lines: " + "; ".join(silent))


def test_module_docstrings_fit_one_screen():
    long = [f"{rel(p)} ({n} lines)" for p in python_files(DOCSTRING_DIRS) if (n := docstring_lines(p)) > MAX_DOCSTRING]
    assert not long, (f"module docstrings over {MAX_DOCSTRING} lines (long knowledge belongs in notes/<area>): "
                      + "; ".join(long))


def test_cited_documents_exist():
    here = rel(os.path.abspath(__file__))
    files = [rel(p) for p in python_files(CITING_DIRS) + sorted(glob.glob(os.path.join(ROOT, "notes", "*.md")))]
    files += [name for name in ("pyproject.toml", "Makefile") if os.path.isfile(os.path.join(ROOT, name))]
    dangling = []
    for f in files:
        if f == here:
            continue
        for n, line in enumerate(lines_of(os.path.join(ROOT, f)), 1):
            for cited in CITATION.findall(line):
                if (f, cited) not in NOT_CITATIONS and not in_repo(cited, f):
                    dangling.append(f"{f}:{n} cites {cited}")
    assert not dangling, "documents not in this repository (cite the README, notes/ or the module): " + \
        "; ".join(dangling)


def test_the_citation_pattern():
    """The checker itself: what counts as a citation, and what resolves."""
    md = "." + "md"  # (spelled apart, so this file cites nothing)
    found = CITATION.findall(f"see notes/pp{md} and DESIGN{md}; *{md} globs, .txt/{md} suffixes and "
                             f"https://example.com/a/README{md} are not citations")
    assert found == [f"notes/pp{md}", f"DESIGN{md}"]
    assert in_repo(f"notes/pp{md}", "nanopara/pp.py") and in_repo(f"README{md}", "nanopara/pp.py")
    assert in_repo(f"README{md}", "results/x.txt")  # beside the citing file: results/README
    assert not in_repo(f"DESIGN{md}", "nanopara/pp.py") and not in_repo(f"shared/TRITON_CPU{md}", "kernels/ops.py")
