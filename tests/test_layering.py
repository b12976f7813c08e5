"""The package graph has no circles, and serving code never loads training code.

Packages are `app/<subpackage>`, top-level modules of `app` (the CLI) as `app`, `deployments`, `kernels` and
`loadtest`. An edge is any import written in the source, inside functions too; only imports under
`if TYPE_CHECKING:` are left out (they never run).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("app", "deployments", "kernels", "loadtest")


def _package(module: str) -> str | None:
    """`app.engine.worker` -> `app.engine`; `app.cli` -> `app`; `kernels.pack` -> `kernels`; others None."""
    parts = module.split(".")
    if parts[0] not in ROOTS:
        return None
    if parts[0] == "app" and len(parts) > 1 and (REPO / "app" / parts[1]).is_dir():
        return f"app.{parts[1]}"
    return parts[0]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports_in(source: str, package: list[str]) -> list[str]:
    """Absolute names of every module `source` imports; `package` resolves relative imports."""
    tree = ast.parse(source)
    skip = _type_checking_nodes(tree)
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            out.append(module)
            out += [f"{module}.{alias.name}" for alias in node.names]  # `from app import training`
    return out


def _imported_modules(path: Path) -> list[str]:
    package = _module_name(path).split(".")
    return imports_in(path.read_text(), package if path.name == "__init__.py" else package[:-1])


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            src = _package(_module_name(path))
            targets = {_package(m) for m in _imported_modules(path)}
            graph.setdefault(src, set()).update(t for t in targets if t and t != src)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` as a path [a, b, ..., a], or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node], _ = 2, path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_finds_circles_and_only_circles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": {"y2"}, "y2": {"y"}}) == ["y", "y2", "y"]


def test_imports_inside_functions_count_and_type_checking_ones_do_not():
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import app.training.train\n"
              "def f():\n    from app.engine import engine\n    from . import pools\n")
    seen = imports_in(source, ["app", "cache"])
    assert "app.engine" in seen and "app.cache.pools" in seen and "app.training.train" not in seen
    assert {_package(m) for m in seen} == {"app.engine", "app.cache", None}


def test_no_import_circles_between_packages():
    graph = package_graph()
    assert {"app.engine", "app.models", "app.dasc", "app.cache", "kernels", "deployments"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("module", ["app.engine.engine", "app.api.routes", "deployments.builder", "app.cli"])
def test_serving_modules_load_no_training_module(module):
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert module in loaded
    assert [m for m in loaded if m == "app.training" or m.startswith("app.training.")] == []
