"""The engine core's import graph: no cycles, and no networking.

Every import statement counts, wherever it is (module level, inside a function, under
TYPE_CHECKING): a function-level import that closes a circle still ties the two modules together.
`from pkg import name` is an edge to `pkg.name` when that is a module of the package, else to `pkg`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "deepinfer_core"
FORBIDDEN = ("services", "grpc", "ray")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported_modules(path: Path) -> list[str]:
    """The module of every import statement of the file, as written."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


def _edges(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules a file imports."""
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules.keys()
            edges |= submodules
            if len(submodules) < len(node.names) and node.module in modules:
                edges.add(node.module)  # a name the module itself defines
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


def test_the_engine_core_has_no_import_cycles():
    modules = _modules()
    graph = {name: _edges(path, modules) - {name} for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_engine_core_imports_no_networking():
    offenders = [
        f"{path.relative_to(ROOT)}: {target}"
        for path in _modules().values()
        for target in _imported_modules(path)
        if target.split(".")[0] in FORBIDDEN
    ]
    assert offenders == []
