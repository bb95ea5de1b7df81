"""The package's layering: every module imports on its own, and its imports form no cycle.

Every import counts: at module level, inside a function, and under ``if TYPE_CHECKING``. An import
moved into a function, or behind the type checker, still ties the two modules together; it only
hides the tie from Python's import order.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "autotune"


def _module_name(path: Path, package: Path) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(package: Path) -> list[str]:
    return sorted(_module_name(p, package) for p in package.rglob("*.py") if p.name != "__main__.py")


MODULES = _modules(PACKAGE)


def _imports(path: Path, package: Path, modules: set[str]) -> set[str]:
    """The modules of ``package`` that ``path`` imports, wherever the import statement stands."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = _module_name(path, package)
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    root = package.name
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == root)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != root:
                continue
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                found.add(sub if sub in modules else mod)
    found.discard(name)
    return found


def _graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules it imports. The package itself re-exports from its modules: it sits
    above all of them, so an import of a name it re-exports is not an edge back to it."""
    modules = set(_modules(package))
    root = package.name
    return {_module_name(p, package): _imports(p, package, modules) - {root} for p in package.rglob("*.py")}


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


def test_imports_form_no_cycle() -> None:
    graph = _graph(PACKAGE)
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "pkg"
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


def test_a_cycle_through_a_function_or_the_type_checker_is_found(tmp_path: Path) -> None:
    # The check the package passes fails on a package with a cycle, however its imports hide it.
    package = _package(tmp_path, {
        "__init__.py": "from .top import Top\n",
        "top.py": "from .sub.low import Low\n\nclass Top(Low):\n    pass\n",
        "sub/__init__.py": "",
        "sub/low.py": ("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ..top import Top\n\n"
                       "class Low:\n    def make(self) -> 'Top':\n        from pkg import top\n\n"
                       "        return top.Top()\n"),
    })
    assert _cycle(_graph(package)) == ["pkg.top", "pkg.sub.low", "pkg.top"]
    # Without the backward imports the same package has no cycle.
    (package / "sub" / "low.py").write_text("class Low:\n    pass\n")
    assert _cycle(_graph(package)) is None


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
