"""The layering of docs/architecture.md holds in the imports, and its checker can fail.

`memledger > (workers | replay) > projections > ledger`: `make lint` runs import-linter
with the contract in pyproject.toml. These tests show the checker rejects an upward
import, and check what import-linter cannot see: dynamic imports between our packages
and import cycles inside a package.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("memledger", "ledger", "projections", "workers", "replay")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def _copy_tree(dst: Path) -> None:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")


@pytest.mark.parametrize(("module", "line"), [
    ("ledger/events.py", "import memledger  # an upward import"),
    ("projections/reads.py", "def _hidden() -> None:\n    from replay import audit  # lazy\n"),
    ("workers/policy.py", "from replay import progress  # sideways"),
])
def test_checker_rejects_an_upward_or_sideways_import(tmp_path: Path, module: str,
                                                      line: str) -> None:
    """A copy of the tree with one bad import added fails the contract `make lint` runs,
    naming the offending import; the unchanged copy passes."""
    _copy_tree(tmp_path)
    clean = _lint_imports(tmp_path)
    assert clean.returncode == 0, clean.stdout[-2000:]
    target = tmp_path / module
    target.write_text(target.read_text() + "\n" + line + "\n")
    broken = _lint_imports(tmp_path)
    assert broken.returncode != 0
    assert "BROKEN" in broken.stdout
    assert module.removesuffix(".py").replace("/", ".") in broken.stdout


def test_no_dynamic_import_hides_an_edge() -> None:
    """No `importlib.import_module` or `__import__` names one of our packages: every edge
    between modules is a static import that the checker sees."""
    offenders = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            dynamic = (isinstance(f, ast.Name) and f.id == "__import__") or (
                isinstance(f, ast.Attribute) and f.attr == "import_module")
            if not dynamic:
                continue
            arg = node.args[0] if node.args else None
            literal = arg.value if isinstance(arg, ast.Constant) else None
            if not isinstance(literal, str) or literal.split(".")[0] in PACKAGES:
                offenders.append(f"{name}:{node.lineno}")
    # A dynamic import of a computed name is allowed only for optional third-party
    # model packages, each listed here with why.
    allowed = {"projections.embedding"}  # loads the optional sentence-transformers model
    assert [o for o in offenders if o.split(":")[0] not in allowed] == []


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under `if TYPE_CHECKING:`, which never run: a type-only
    back-reference (the appender naming `Store` in annotations) is not an import cycle."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) \
                and node.test.id == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _edges() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _runtime_nodes(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")
                    base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                    mod = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod
                           for a in node.names]
            for tgt in targets:
                while tgt and tgt not in mods:
                    tgt = tgt.rpartition(".")[0]
                if tgt and tgt != name:
                    graph[name].add(tgt)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles among modules of one package (a package's `__init__` re-exporting
    its modules is not one)."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt.split(".")[0] != node.split(".")[0] or "." not in nxt:
                continue
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod)
    return cycles


def test_no_import_cycle_inside_a_package() -> None:
    """Modules of one package import each other without cycles, lazy imports inside
    functions included (the projections once formed bulk -> runner -> vectors -> bulk)."""
    graph = _edges()
    assert "projections.registry" in graph["projections.runner"]  # the walk sees edges
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle() -> None:
    """The check above can fail: a cycle of three modules is found, a package's
    `__init__` importing its own modules is not a cycle."""
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a", "p"}, "p": {"p.a"}}
    assert _cycles(graph) == [["p.a", "p.b", "p.c", "p.a"]]


BACKEND_BRANCH = re.compile(
    r"dialect\s*(?:==|!=|\bin\b)|dialects\.(?:sqlite|postgresql)|pg_insert|sqlite_insert")


def test_backend_differences_live_in_one_place_per_layer() -> None:
    """Only the recorder modules (`ledger/backends/`) and the views' SQL helpers
    (`projections/sql.py`) branch on the database or use dialect-specific statements."""
    places = sorted(str(p.relative_to(ROOT)) for p in _modules().values()
                    if BACKEND_BRANCH.search(p.read_text()))
    assert all(p.startswith("ledger/backends/") or p == "projections/sql.py"
               for p in places), places
