"""The project's modules import one another without cycles, nothing imports train.py, imported names exist.

Every .py of nanopara/, kernels/, bench/ and the top-level scripts (train.py, sample.py, eval.py) is parsed with `ast` (no
import runs), and each `import` / `from ... import` of a project module becomes an edge, including imports inside
functions: a lazy import that closes a cycle is still a cycle for a reader, who cannot read either file alone.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("nanopara", "kernels", "bench")
SCRIPTS = ("train.py", "sample.py", "eval.py", "rl.py")


def project_modules(root: str) -> dict:
    """{module name: path}: package modules as "pkg.mod" (the package's __init__ as "pkg"), scripts by stem."""
    mods = {}
    for pkg in PACKAGES:
        folder = os.path.join(root, pkg)
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                stem = name[:-3]
                mods[pkg if stem == "__init__" else f"{pkg}.{stem}"] = os.path.join(folder, name)
    for name in SCRIPTS:
        if os.path.isfile(os.path.join(root, name)):
            mods[name[:-3]] = os.path.join(root, name)
    return mods


def _resolve(name: str, mods: dict, here: str) -> str | None:
    """The project module `name` refers to from module `here`, or None. bench/ scripts put bench/ on sys.path
    (`from bench_dp import ...`), so a bare name there may mean a sibling."""
    if name in mods:
        return name
    pkg = here.rpartition(".")[0]
    if pkg == "bench" and f"bench.{name}" in mods:
        return f"bench.{name}"
    return None


def imports_of(module: str, path: str, mods: dict) -> set:
    """Project modules that `module` imports anywhere in its file (module level, functions, conditionals)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    package = module if os.path.basename(path) == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")  # `import a.b.c`: the deepest prefix that is a project module
                hit = next((m for m in (_resolve(".".join(parts[:i]), mods, module)
                                        for i in range(len(parts), 0, -1)) if m), None)
                if hit:
                    found.add(hit)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from pkg import mod` names a module; `from mod import name` the module
                hit = _resolve(f"{base}.{alias.name}", mods, module) or _resolve(base, mods, module)
                if hit:
                    found.add(hit)
    found.discard(module)
    return found


def import_graph(root: str) -> dict:
    mods = project_modules(root)
    return {m: imports_of(m, p, mods) for m, p in mods.items()}


def find_cycle(graph: dict) -> list | None:
    """One import cycle as [a, b, ..., a], or None when the graph is a DAG (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                cycle = visit(n)
                if cycle:
                    return cycle
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            if cycle:
                return cycle
    return None


def test_no_import_cycles():
    graph = import_graph(ROOT)
    assert {"nanopara.engine", "nanopara.parallel", "kernels.ops", "train"} <= graph.keys()  # the scan sees them
    assert "nanopara.engine" in graph["nanopara.dp"] and "nanopara.tp" in graph["nanopara.parallel"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_nothing_imports_train():
    """train.py is the script a user reads first: benchmarks and the package import from nanopara/, never from it."""
    graph = import_graph(ROOT)
    importers = sorted(m for m, deps in graph.items() if "train" in deps)
    assert not importers, f"{', '.join(importers)} import train.py: move what they need into nanopara/"


def top_level_names(path: str) -> set:
    """Names a module defines at its top level (functions, classes, assignments, imports), read with ast."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_imported_names_exist():
    """`from nanopara.x import name` names something x defines: a name that moved (say build_engine, from dp.py to
    parallel.py) fails here, not in the one benchmark run that imports it."""
    mods = project_modules(ROOT)
    missing = []
    for module, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module in mods:
                defined = top_level_names(mods[node.module])
                missing += [f"{module}: from {node.module} import {a.name}" for a in node.names
                            if a.name != "*" and a.name not in defined and f"{node.module}.{a.name}" not in mods]
    assert not missing, "names that do not exist: " + "; ".join(missing)


def test_the_scan_finds_lazy_and_relative_cycles(tmp_path):
    """The checker itself: a cycle closed by an import inside a function, and one through a relative import."""
    pkg = tmp_path / "nanopara"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from nanopara.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from nanopara import a\n    return a\n")
    (pkg / "c.py").write_text("import nanopara.d\n")
    (pkg / "d.py").write_text("from . import c\n")
    (tmp_path / "train.py").write_text("import nanopara.a\n")
    graph = import_graph(str(tmp_path))
    assert graph["nanopara.b"] == {"nanopara.a"} and graph["nanopara.d"] == {"nanopara.c"}
    assert graph["train"] == {"nanopara.a"} and graph["nanopara"] == set()
    assert find_cycle(graph) == ["nanopara.a", "nanopara.b", "nanopara.a"]
    del graph["nanopara.b"]
    assert find_cycle(graph) == ["nanopara.c", "nanopara.d", "nanopara.c"]
    del graph["nanopara.d"]
    assert find_cycle(graph) is None
