"""The package's layering: every module imports on its own, and its imports form no cycle.

Every import counts: at module level, inside a function, and under ``if TYPE_CHECKING``. An import
moved into a function, or behind the type checker, still ties the two modules together; it only
hides the tie from Python's import order.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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



TORCH_PRIVATE = {("supervise.py", "_worker_pids_set"), ("supervise.py", "_shutdown"),
                 ("supervise.py", "_iterator"), ("serving.py", "_IterableDataset_len_called")}
"""Torch's own iterator and loader attributes: set as torch's shutdown sets them where workers are
stopped from outside (NOTE [ Shut-down under signals ] in supervise.py), and the flag behind torch's
warning on a stream longer than the len() asked, carried from the user's loader to the inner one."""


def _foreign_private_writes(path: Path) -> list[tuple[str, int]]:
    """``(attribute, line)`` of every assignment to ``obj._name`` where ``obj`` is not ``self`` or
    ``cls``: state another object owns, written from outside it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target):
                if (isinstance(t, ast.Attribute) and t.attr.startswith("_") and not t.attr.startswith("__")
                        and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))):
                    found.append((t.attr, t.lineno))
    return found


def test_no_module_writes_another_object_s_private_state() -> None:
    found = [(str(p.relative_to(PACKAGE)), attr, line) for p in sorted(PACKAGE.rglob("*.py"))
             for attr, line in _foreign_private_writes(p)]
    assert [(f, a, n) for f, a, n in found if (f, a) not in TORCH_PRIVATE] == []


def test_a_write_to_another_object_s_private_state_is_found(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("def f(loader):\n    loader._inner_loaders += 1\n    self._mine = 1\n"
                    "    a, loader._pair = 1, 2\n    loader.public = 3\n")
    assert _foreign_private_writes(path) == [("_inner_loaders", 2), ("_pair", 4)]

PRELOADED = ("torch", "torchvision", "optuna", "psutil")
"""Imported once before the forks: the dependencies every module would otherwise import again."""

_EACH_ALONE = r"""
import importlib, json, os, runpy, shutil, sys, tempfile, traceback

fresh, preload, jobs, width = json.loads(sys.argv[1])
for name in preload:
    importlib.import_module(name)
early = sorted(m for m in sys.modules if m.split(".")[0] in fresh)
if early:
    sys.exit(f"imported before the fork: {early}")


def run(job):
    if "module" in job:  # as `python -c "import MODULE"`
        importlib.import_module(job["module"])
    else:  # as `python SCRIPT ARGV...`: the script's folder first on sys.path, not the working one
        sys.argv = [job["script"], *job["argv"]]
        sys.path[0] = os.path.dirname(os.path.abspath(job["script"]))
        runpy.run_path(job["script"], run_name="__main__")


def child(job, out, err):
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    code = 0
    try:
        run(job)
    except SystemExit as e:  # as the interpreter reads it
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


folder = tempfile.mkdtemp(prefix="each-alone-")
results, running, pending = {}, {}, list(enumerate(jobs))
sys.stdout.flush()
sys.stderr.flush()
while pending or running:
    if pending and len(running) < width:
        i, job = pending.pop(0)
        out, err = (os.path.join(folder, f"{i}.{name}") for name in ("out", "err"))
        pid = os.fork()
        if pid == 0:  # nothing of the fresh packages is loaded in the child: it imports them itself
            child(job, out, err)
        running[pid] = (job["name"], out, err)
        continue
    pid, status = os.wait()
    name, out, err = running.pop(pid)
    results[name] = {"code": os.waitstatus_to_exitcode(status),
                     "out": open(out).read(), "err": open(err).read()[-3000:]}
shutil.rmtree(folder)
print(json.dumps(results))
"""
"""Imports the preloaded modules and checks that no module of the fresh packages came with them, then
runs each job in a child forked from that state, a few at a time: a job imports a module, or runs a
script by its path with its arguments. Prints each job's exit status, stdout and end of stderr."""


def run_each_alone(root: Path, jobs: list[dict[str, Any]], *, fresh: tuple[str, ...],
                   preload: tuple[str, ...] = PRELOADED) -> dict[str, dict[str, Any]]:
    """``jobs`` run in ``root`` as ``_EACH_ALONE`` runs them: each job's ``code``, ``out`` and ``err``
    by its ``name``; an AssertionError when the preloading imported a fresh package."""
    width = max(2, len(os.sched_getaffinity(0)))
    proc = subprocess.run([sys.executable, "-c", _EACH_ALONE, json.dumps([fresh, preload, jobs, width])],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results: dict[str, dict[str, Any]] = json.loads(proc.stdout.splitlines()[-1])
    return results


def _import_failures(root: Path, package: str, modules: list[str], preload: tuple[str, ...] = PRELOADED,
                     ) -> dict[str, str]:
    done = run_each_alone(root, [{"name": m, "module": m} for m in modules], fresh=(package,),
                          preload=preload)
    return {m: r["err"] or f"exit status {r['code']}" for m, r in done.items() if r["code"] != 0}


def test_each_module_imports_alone() -> None:
    # Each module imported in a process where no module of the package was imported before it (a
    # fork of one that imported only the heavy dependencies): an import that only works after
    # another module was imported first fails here.
    failures = _import_failures(PACKAGE.parent, PACKAGE.name, MODULES)
    assert not failures, failures


def test_an_import_that_needs_another_module_first_fails_alone(tmp_path: Path) -> None:
    # ``pkg.b`` uses ``pkg.a`` without importing it: it imports after ``pkg.a``, never alone.
    _package(tmp_path, {"__init__.py": "", "a.py": "VALUE = 1\n", "b.py": "import pkg\n\nX = pkg.a.VALUE\n",
                        "c.py": "from pkg import a\n\nX = a.VALUE\n"})
    failures = _import_failures(tmp_path, "pkg", ["pkg", "pkg.a", "pkg.b", "pkg.c"], preload=())
    assert list(failures) == ["pkg.b"] and "has no attribute 'a'" in failures["pkg.b"], failures
    # A module of the package loaded before the forks would hide that: the check refuses to run.
    with pytest.raises(AssertionError, match=r"imported before the fork: \['pkg', 'pkg.a'\]"):
        _import_failures(tmp_path, "pkg", ["pkg.b"], preload=("pkg.a",))
