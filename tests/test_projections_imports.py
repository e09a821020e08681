"""The projections package imports without cycles, and only `projections/sql.py` knows
which database it runs on (docs/projections.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "projections"


def import_graph() -> dict[str, set[str]]:
    """`projections` module -> the `projections` modules it imports (lazy ones too)."""
    mods = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for m in mods:
        edges: set[str] = set()
        for node in ast.walk(ast.parse((PKG / f"{m}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "projections":
                    edges.update(a.name for a in node.names if a.name in mods)
                elif node.module.startswith("projections."):
                    edges.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                edges.update(a.name.split(".")[1] for a in node.names
                             if a.name.startswith("projections."))
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in (
                    "import_module", "__import__"):
                arg = node.args[0] if node.args else None
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("projections"):
                    edges.add(str(arg.value).split(".")[-1])
        graph[m] = edges - {m}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return [*path[path.index(n):], n]
            if n not in state and (found := visit(n)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_projections_import_graph_has_no_cycle() -> None:
    """No module of `projections` imports, directly or through others, itself."""
    graph = import_graph()
    assert graph["runner"] >= {"registry"}  # the walk sees real edges
    assert cycle(graph) is None, " -> ".join(cycle(graph) or [])


def test_cycle_finder_finds_a_cycle() -> None:
    """The check above can fail: a cycle of three is found."""
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_only_sql_module_names_the_dialect() -> None:
    """Backend differences of the views live in `projections/sql.py` alone."""
    naming = sorted(p.name for p in PKG.glob("*.py") if "dialect" in p.read_text())
    assert naming == ["sql.py"]
