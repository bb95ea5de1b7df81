"""The package's layering: every module imports on its own, and module-level imports form no cycle.

A module that needs one above it (the result builds the drop-in, the report) imports it inside the
function that needs it; the graph here is the one Python follows when the package is imported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "autotune"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = sorted(_module_name(p) for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")


def _imports(path: Path) -> set[str]:
    """The autotune modules ``path`` imports at module level (``if TYPE_CHECKING`` blocks aside)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("autotune"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("autotune"):
                continue
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                found.add(sub if sub in MODULES else mod)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_module_level_imports_form_no_cycle() -> None:
    graph = _graph()
    # The package itself re-exports from its modules: it sits above all of them.
    graph = {k: {v for v in vs if v != "autotune"} for k, vs in graph.items()}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_each_module_imports_alone() -> None:
    # A fresh interpreter per module, a few at a time: an import that only works after another
    # module was imported first fails here.
    failures: dict[str, str] = {}
    pending = list(MODULES)
    while pending:
        batch, pending = pending[:4], pending[4:]
        procs = {m: subprocess.Popen([sys.executable, "-c", f"import {m}"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, cwd=PACKAGE.parent)
                 for m in batch}
        for m, proc in procs.items():
            _, err = proc.communicate(timeout=300)
            if proc.returncode != 0:
                failures[m] = err[-1500:]
    assert not failures, failures
