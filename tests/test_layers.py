"""The layer rule, read from the imports (ARCHITECTURE.md): core < runtime < engine < ui, and
sim over core only. A module imports no higher layer when it is imported (a lazy import inside
a function may reach up, e.g. ``JobHandle.dashboard()`` opening ui), and no modules import
each other in a circle, lazy imports counted. Imports under ``if TYPE_CHECKING:`` are for
annotations only and do not count; neither does the ``nbtrain`` package's own facade.

The checker is a few lines of ``ast`` here, so the test stands alone.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nbtrain"
LAYERS = {"core": 0, "runtime": 1, "engine": 2, "ui": 3, "sim": 1}
SIM_MAY_IMPORT = ("core", "sim")


@dataclass(frozen=True)
class Import:
    target: str
    lazy: bool  # inside a function: runs when called, not when the module is imported
    line: int


def modules(package: Path) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports_of(name: str, path: Path, known: set[str]) -> list[Import]:
    """The package modules ``name`` imports, each marked lazy or not; TYPE_CHECKING-only
    imports left out."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found: list[Import] = []

    def add(target: str, lazy: bool, line: int) -> None:
        if target in known and target != name:
            found.append(Import(target, lazy, line))

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, lazy)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, lazy, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here[: len(here) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            add(base, lazy, node.lineno)
            for alias in node.names:
                add(f"{base}.{alias.name}", lazy, node.lineno)
        inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def import_graph(package: Path) -> dict[str, list[Import]]:
    mods = modules(package)
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def upward_imports(graph: dict[str, list[Import]]) -> list[str]:
    """Imports that run when a module is imported and reach a higher layer (or, from sim,
    anything but core)."""
    bad = []
    for module, found in graph.items():
        mine = layer_of(module)
        if mine is None:
            continue
        for imp in found:
            theirs = layer_of(imp.target)
            if imp.lazy or theirs is None or theirs == mine:
                continue
            wrong = (theirs not in SIM_MAY_IMPORT if mine == "sim"
                     else LAYERS[theirs] > LAYERS[mine])
            if wrong:
                bad.append(f"{module} (line {imp.line}) -> {imp.target}")
    return bad


def circles(graph: dict[str, list[Import]], root: str) -> list[list[str]]:
    """Groups of modules that import each other, lazy imports counted (Tarjan's strongly
    connected components); the package facade ``root`` is left out."""
    edges = {m: sorted({i.target for i in found if i.target != root})
             for m, found in graph.items() if m != root}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:  # recursion depth <= number of modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, []):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def _describe(group: list[str], graph: dict[str, list[Import]]) -> str:
    links = sorted({(m, i.line, i.target, i.lazy) for m in group for i in graph[m]
                    if i.target in group})
    return " <-> ".join(group) + ": " + "; ".join(
        f"{m} (line {line}{', lazy' if lazy else ''}) -> {target}"
        for m, line, target, lazy in links)


def test_no_module_imports_a_higher_layer() -> None:
    bad = upward_imports(import_graph(PACKAGE))
    assert not bad, "imports up the layers (core < runtime < engine < ui; sim over core):\n" \
        + "\n".join(bad)


def test_no_import_circles() -> None:
    graph = import_graph(PACKAGE)
    found = circles(graph, PACKAGE.name)
    assert not found, "import circles (lazy imports counted):\n" + "\n".join(
        _describe(group, graph) for group in found)


def test_the_views_import_no_engine() -> None:
    """The ui modules read protocols (``JobView``, ``JobFeed``) and snapshots, never the
    engine, not even lazily."""
    graph = import_graph(PACKAGE)
    reaching = [f"{m} (line {i.line}) -> {i.target}" for m, found in graph.items()
                if layer_of(m) == "ui" for i in found if layer_of(i.target) == "engine"]
    assert not reaching, "ui modules importing the engine:\n" + "\n".join(reaching)


def test_the_class_page_needs_no_ipywidgets() -> None:
    """The class page runs in the scheduler's process, where ipywidgets has no place."""
    graph = import_graph(PACKAGE)
    seen, todo = set(), ["nbtrain.ui.clusterpage"]
    while todo:  # the page and every nbtrain module it imports, lazily or not
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += [i.target for i in graph[module]]
    names = modules(PACKAGE)
    widgets = sorted(m for m in seen if any(
        isinstance(n, ast.Import | ast.ImportFrom)
        and any(w in ast.unparse(n) for w in ("ipywidgets", "jupyter_bokeh"))
        for n in ast.walk(ast.parse(names[m].read_text()))))
    assert not widgets, f"the class page reaches ipywidgets through {widgets}"


def test_the_checker_sees_circles_upward_and_lazy_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    files = {
        "__init__.py": "from pkg.ui import view\n",
        "core/__init__.py": "",
        "core/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from pkg.engine import b\n",
        "engine/__init__.py": "",
        "engine/b.py": "def later():\n    from pkg.ui import view\n",
        "engine/c.py": "from . import b\n",
        "ui/__init__.py": "",
        "ui/view.py": "import pkg.engine.b\n",
        "sim/__init__.py": "",
        "sim/s.py": "from pkg.runtime import r\n",
        "runtime/__init__.py": "",
        "runtime/r.py": "from pkg.engine import c\n",
    }
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    graph = import_graph(pkg)
    assert [i.target for i in graph["pkg.core.a"]] == []  # TYPE_CHECKING only
    assert [(i.target, i.lazy) for i in graph["pkg.engine.b"]] == [("pkg.ui", True),
                                                                   ("pkg.ui.view", True)]
    assert {i.target for i in graph["pkg.engine.c"]} == {"pkg.engine", "pkg.engine.b"}
    assert circles(graph, "pkg") == [["pkg.engine.b", "pkg.ui.view"]]
    assert sorted({b.split(" ")[0] for b in upward_imports(graph)}) == [
        "pkg.runtime.r", "pkg.sim.s"]
