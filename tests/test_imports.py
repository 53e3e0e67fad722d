"""The import graph of parallel3d/, models/ and kernels/ has no cycle, and no module defines a name twice.

Every import counts, wherever it is written: at module level, inside a function (a lazy
import that dodges a cycle is still the cycle) or under ``TYPE_CHECKING`` (a type-only
cycle is still two modules that need each other). Importing ``a.b.c`` from outside package
``a.b`` also runs ``a/__init__`` and ``a/b/__init__``, so those edges count too. The graph is
read from the source (``ast``), not by importing anything.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("parallel3d", "models", "kernels")
ALLOWED_EDGES: set[tuple[str, str]] = set()  # none: every cycle is a failure

Edge = tuple[str, str]


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``packages``."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict) -> list[str]:
    """The modules of ``modules`` an import statement in ``module`` names (relative imports resolved;
    ``from a.b import c`` names the submodule ``a.b.c`` if there is one, else ``a.b``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    named = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    return [t for t in named if t in modules]


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_edges(modules: dict[str, Path]) -> set[Edge]:
    """(importer, imported) for every import of a module in ``modules``, including the package
    ``__init__`` modules the import runs (module doc)."""
    edges: set[Edge] = set()
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, name, path.name == "__init__.py", modules):
                    for reached in {target} | (_ancestors(target) - _ancestors(name)):
                        if reached in modules and reached != name:
                            edges.add((name, reached))
    return edges


def cycles(edges: set[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (a few hundred)
        index[v] = low[v] = len(index)
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


def test_no_import_cycle():
    edges = import_edges(module_files(ROOT, PACKAGES)) - ALLOWED_EDGES
    found = cycles(edges)
    described = [" <-> ".join(c) + ": " + ", ".join(f"{a} -> {b}" for a, b in sorted(edges) if a in c and b in c)
                 for c in found]
    assert described == []


def test_the_allowed_edge_still_exists():
    """An allow-list entry whose edge is gone must be deleted (it would hide a new cycle)."""
    assert ALLOWED_EDGES <= import_edges(module_files(ROOT, PACKAGES))


@pytest.mark.parametrize("where", ["function", "type_checking", "package_init"])
def test_the_checker_sees_every_kind_of_cycle(tmp_path, where):
    """The checker on a two-module package whose cycle hides the way a real one would."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.b import B\n" if where == "package_init" else "")
    (pkg / "a.py").write_text("from pkg.sub.b import B\n" if where != "package_init" else "from pkg.sub.c import C\n")
    (pkg / "sub" / "c.py").write_text("C = 1\n")
    hidden = {
        "function": "def f():\n    from pkg.a import A\n",
        "type_checking": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n",
        "package_init": "import pkg.a\n",
    }[where]
    (pkg / "sub" / "b.py").write_text(hidden + "B = 1\n")
    found = cycles(import_edges(module_files(tmp_path, ("pkg",))))
    assert found and "pkg.a" in found[0]


def test_no_module_defines_a_top_level_name_twice():
    """A second ``def`` of the same name silently replaces the first (config.py had two
    ``_check_writable_dir``s, the first one dead)."""
    twice = []
    for name, path in module_files(ROOT, PACKAGES).items():
        seen: dict[str, int] = {}
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name in seen:
                    twice.append(f"{name}.{node.name} (lines {seen[node.name]} and {node.lineno})")
                seen[node.name] = node.lineno
    assert twice == []


def test_the_scan_covers_every_source_file():
    files = {p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    assert set(module_files(ROOT, PACKAGES).values()) == files and len(files) > 100
