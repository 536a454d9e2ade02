"""The docs stay a guide with its evidence: README.md within 250 lines, every results/ file in results/README.md's
index (one table row per file or brace group, `archive/` for the archive), no index row naming a missing file, and
no results/ or notes/ path cited by the README or the notes that does not exist. Plain file reads: well under a
second."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 250


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def expand(token):
    """Shell-style brace expansion: `a_{x,y}.txt` -> a_x.txt, a_y.txt (`{,_2}` gives the empty alternative)."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [e for alt in m.group(1).split(",") for e in expand(token[:m.start()] + alt + token[m.end():])]


def results_files():
    """Every file under results/ but the index itself, relative to results/ (archive/NAME for the archive)."""
    base = os.path.join(ROOT, "results")
    out = set()
    for d, _, names in os.walk(base):
        out |= {os.path.relpath(os.path.join(d, n), base) for n in names}
    return out - {"README.md"}


def index_entries():
    """{file: line} for each file named in the first cell of a table row of results/README.md."""
    entries = {}
    for line in read("results/README.md").splitlines():
        cells = line.split("|")
        if not line.startswith("|") or len(cells) < 3 or set(cells[1].strip()) <= set("-: "):
            continue
        for token in re.findall(r"`([^`\s]+)`", cells[1]):
            for name in expand(token):
                entries[name] = line
    return entries


def cited_paths(text):
    """results/... and notes/... paths named in a text (brace groups expanded, globs kept as globs)."""
    paths = set()
    for token in re.findall(r"(?<![\w/.-])((?:results|notes)/[\w.{},*/-]*)", text):
        token = token.rstrip(".,;:)")
        paths |= set(expand(token))
    return paths


def test_readme_is_a_short_guide():
    n = len(read("README.md").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move logs to results/, " \
                                  f"knowledge to notes/<area>.md"


def test_every_results_file_is_indexed():
    missing = sorted(results_files() - set(index_entries()))
    assert not missing, f"results/ files missing from results/README.md's index: {missing}"


def test_every_index_entry_exists():
    files = results_files()
    dangling = sorted(name for name in index_entries() if name not in files)
    assert not dangling, f"results/README.md names files that do not exist: {dangling}"


def test_cited_paths_exist():
    docs = ["README.md", "results/README.md"] + sorted(os.path.relpath(p, ROOT) for p in
                                                       glob.glob(os.path.join(ROOT, "notes", "*.md")))
    bad = []
    for doc in docs:
        for path in sorted(cited_paths(read(doc))):
            if not glob.glob(os.path.join(ROOT, path)):
                bad.append(f"{doc}: {path}")
    assert not bad, "cited paths that do not exist:\n" + "\n".join(bad)


def test_helpers():
    assert expand("a{,_2}.{txt,json}") == ["a.txt", "a.json", "a_2.txt", "a_2.json"]
    assert cited_paths("see `results/x_{a,b}.txt`, notes/tp.md; results/ and bench/results/y") == \
        {"results/x_a.txt", "results/x_b.txt", "notes/tp.md", "results/"}
