"""The import graph of mxmoe has no circle: a module never imports, directly or through others,
a module that imports it. Every import counts (at module level, inside a function, or under
TYPE_CHECKING); a package's `__init__` counts for what it imports, not as an importer of its
children. The graph is read from the source (ast), so the test imports nothing of mxmoe."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "mxmoe"


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the mxmoe modules it imports (the deepest existing module each import names)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for n in names:
                while n not in mods and "." in n:
                    n = n.rpartition(".")[0]
                if n in mods and n != m:
                    graph[m].add(n)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles (each: modules that import each other): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_the_check_finds_a_circle():
    """The check itself: a two-module circle and a three-module one are found, a chain is not."""
    g = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert circles(g) == [["a", "b"], ["c", "d", "e"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_lazy_and_relative_imports():
    g = import_graph()
    assert "mxmoe.comm.transport" in g["mxmoe.comm.nccl"]
    assert "mxmoe.token_dispatch" in g["mxmoe.models.routing"]
    assert not any(m.startswith("mxmoe.comm") for m in g["mxmoe.models.routing"])
