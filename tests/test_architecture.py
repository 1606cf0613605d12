"""The layering DESIGN.md asks for: the core imports torch (and the standard library) only."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_swap

CORE = Path(lightning_swap.__file__).parent / "core"
FORBIDDEN = ("lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "accelerate_swap", "matplotlib")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_core_imports_neither_lightning_nor_accelerate():
    offenders = {p.name: sorted(_imports(p) & set(FORBIDDEN)) for p in CORE.glob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}


def test_public_api_is_listed():
    for name in lightning_swap.__all__:
        assert hasattr(lightning_swap, name), name
    for name in ("profile", "solve", "InfeasibleBudgetError", "CPUSwapStrategy", "SwapBatchSizeFinder", "Action"):
        assert name in lightning_swap.__all__


def _core_import_graph(core: Path) -> dict[str, set[str]]:
    """Module -> the core modules it imports, at module level, in functions, or under
    ``TYPE_CHECKING`` alike (``ast.walk`` sees them all): a lazy import hides a cycle from the
    interpreter, not from a reader."""
    package = "lightning_swap.core"
    modules = {p.stem for p in core.glob("*.py")}

    def target(absolute: str) -> set[str]:
        if absolute == package:
            return set()
        if absolute.startswith(package + "."):
            name = absolute[len(package) + 1 :].split(".")[0]
            return {name} if name in modules else set()
        return set()

    graph: dict[str, set[str]] = {}
    for path in sorted(core.glob("*.py")):
        here = path.stem
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    edges |= target(alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)])
                    absolute = f"{base}.{node.module}" if node.module else base
                else:
                    absolute = node.module or ""
                if absolute == package:  # `from . import x`: a module, or a name of __init__
                    for alias in node.names:
                        edges.add(alias.name if alias.name in modules else "__init__")
                else:
                    edges |= target(absolute)
        edges.discard(here)
        graph[here] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle as a path that ends where it starts, or ``[]``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return []


def test_cycle_finder_sees_a_cycle_and_a_dag():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_core_has_no_import_cycle():
    """Layers flow one way (DESIGN.md): no core module imports, even lazily or for typing
    only, a module that imports it back."""
    graph = _core_import_graph(CORE)
    assert "actions" in graph["session"] and "solver" in graph["scale"]  # the graph was read
    cycle = _find_cycle(graph)
    assert not cycle, "import cycle in lightning_swap/core: " + " -> ".join(cycle)
