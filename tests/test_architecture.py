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
