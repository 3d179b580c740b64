"""The project's import graph has no cycle: no module imports, at module level, a module that imports it
back, directly or through others. A cycle makes import order matter (a name used before the module that defines it
has finished running) and ties two files that should be read, mutated and replaced one at a time.

Edges are the imports a module runs when it is first imported: statements at module level, including those under
`if`/`try` there, not those inside functions (a deferred import is how a module reaches back on purpose).
`from package import name` is an edge to package.name where that is a module, else to the package; a package's
parents, which Python imports implicitly, are not edges."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("reference", "vendored", "harness", "bench", "mutants", "fixtures", "tests")


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def module_level_imports(tree: ast.Module):
    """Import statements that run at import time: module level and inside module-level if/try/with blocks."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    stack.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])


def edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    out = set()
    for node in module_level_imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        out.update(t for t in targets if t in modules and t != name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle():
    modules = module_files()
    assert "vendored.ops.ssd_scan" in modules and "harness.cli" in modules, sorted(modules)[:10]
    graph = {name: edges(name, path, modules) for name, path in modules.items()}
    assert sum(map(len, graph.values())) > 200, "too few imports found: the parser missed them"
    found = cycles(graph)
    assert not found, "modules that import each other at module level: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_planted_cycle(tmp_path):
    # the same machinery on a small tree with one cycle through three modules and a deferred import that is none
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from .a import f\n")
    (tmp_path / "pkg" / "a.py").write_text("from . import b\ndef f():\n    from . import c\n")
    (tmp_path / "pkg" / "b.py").write_text("try:\n    from pkg.c import g\nexcept ImportError:\n    pass\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\ng = 1\n")
    (tmp_path / "pkg" / "d.py").write_text("def h():\n    import pkg.a\n")
    modules = {"pkg": tmp_path / "pkg" / "__init__.py"} | {
        f"pkg.{m}": tmp_path / "pkg" / f"{m}.py" for m in "abcd"}
    graph = {name: edges(name, path, modules) for name, path in modules.items()}
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and graph["pkg.d"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
