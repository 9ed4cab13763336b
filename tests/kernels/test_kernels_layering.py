"""`deepinfer_kernels/` sits at the bottom of the import arrows (services -> core -> kernels): none of its
modules may import the engine, the services, the benchmarks or the tests."""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "deepinfer_kernels"
ABOVE = ("deepinfer_core", "services", "benchmarks", "tests")


def _imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in the file, at any depth of the code."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def test_no_kernel_module_imports_a_package_above_it() -> None:
    modules = sorted(KERNELS.rglob("*.py"))
    assert modules
    upward = [
        f"{path.relative_to(KERNELS.parent)}:{line} imports {package}"
        for path in modules
        for line, package in _imported_packages(path)
        if package in ABOVE
    ]
    assert not upward, upward
