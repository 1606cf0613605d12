"""The layering DESIGN.md asks for, read from the code (Note [Layer order] in ``core/__init__.py``).

- the core imports torch (and the standard library) only;
- inside the core, layers import only the ones before them: the vocabulary (modules directly in
  ``core/``) imports only the vocabulary; ``engine/`` the vocabulary and itself; ``measure/``
  those and itself, never ``runtime/`` or ``scale/``; ``decide/`` only the vocabulary and the
  profile contract (``measure/model_profile.py``); ``runtime/`` the vocabulary, ``engine/`` and
  ``decide/``; ``scale/`` anything; no module inside the core imports the core's ``__init__``;
- no import cycle;
- the adapters (``lightning_swap``'s own modules, ``accelerate_swap``) import the core only
  through its surface, ``lightning_swap.core``.

Imports count wherever they are: at module level, in functions, or under ``TYPE_CHECKING``
(``ast.walk`` sees them all): a lazy import hides a dependency from the interpreter, not from a
reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import accelerate_swap
import lightning_swap

CORE = Path(lightning_swap.__file__).parent / "core"
PACKAGE = "lightning_swap.core"
FORBIDDEN = ("lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "accelerate_swap", "matplotlib")
LAYERS = ("engine", "measure", "decide", "runtime", "scale")
PROFILE_CONTRACT = "measure.model_profile"
VOCABULARY = "vocabulary"


def _core_modules(core: Path = CORE) -> dict[str, Path]:
    """Dotted name under the core (``engine.streams``, ``config``; ``__init__`` for the surface,
    ``engine`` for ``engine/__init__.py``) -> path."""
    out = {}
    for path in sorted(core.rglob("*.py")):
        parts = path.relative_to(core).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1] or ("__init__",)
        out[".".join(parts)] = path
    return out


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = (PACKAGE + ("" if module == "__init__" else "." + module)).split(".")
    if not is_package:
        parts = parts[:-1]
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path, module: str = "") -> set[str]:
    """Every absolute module name ``path`` imports (``from X import y`` gives ``X`` and ``X.y``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            absolute = _absolute(node, module, is_package)
            names.add(absolute)
            names.update(f"{absolute}.{alias.name}" for alias in node.names)
    return names


def _core_import_graph(core: Path = CORE) -> dict[str, set[str]]:
    """Core module -> the core modules it imports (``__init__`` when it imports the surface)."""
    modules = _core_modules(core)
    graph: dict[str, set[str]] = {}
    for here, path in modules.items():
        edges = set()
        for name in _imports(path, here):
            if name == PACKAGE:
                edges.add("__init__")
            elif name.startswith(PACKAGE + "."):
                rel = name[len(PACKAGE) + 1 :]
                if rel in modules:
                    edges.add(rel)
        edges.discard(here)
        graph[here] = edges
    return graph


def layer_of(module: str) -> str:
    head = module.split(".")[0]
    return head if head in LAYERS else VOCABULARY


def _allowed(source: str, target: str) -> bool:
    """Note [Layer order]: may core module ``source`` import core module ``target``?"""
    if target == "__init__" or target in LAYERS or target == "engine.unified":
        return source == "__init__" or target != "__init__" and layer_of(source) == layer_of(target)
    src, dst = layer_of(source), layer_of(target)
    if source == "__init__":
        return True
    if source == PROFILE_CONTRACT:  # the contract stands on the vocabulary alone
        return dst == VOCABULARY
    return {
        VOCABULARY: dst == VOCABULARY,
        "engine": dst in (VOCABULARY, "engine"),
        "measure": dst in (VOCABULARY, "engine", "measure"),
        "decide": dst in (VOCABULARY, "decide") or target == PROFILE_CONTRACT,
        "runtime": dst in (VOCABULARY, "engine", "decide", "runtime"),
        "scale": True,
    }[src]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{s} -> {t}" for s, targets in graph.items() for t in targets if not _allowed(s, t))


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


# -- the rules, on the code ---------------------------------------------------------------------
def test_core_imports_neither_lightning_nor_accelerate():
    offenders = {
        name: sorted({i.split(".")[0] for i in _imports(path, name)} & set(FORBIDDEN)) for name, path in _core_modules().items()
    }
    assert not {k: v for k, v in offenders.items() if v}


@pytest.mark.slow
@pytest.mark.parametrize("module", ["lightning_swap", "lightning_swap.core", "lightning_swap.core.decide.solver", "accelerate_swap"])
def test_importing_loads_no_lightning(module):
    """Issue 35: in a fresh interpreter, the package, the core (anything under it) and the
    Accelerate front end import no Lightning (Note [Strategies registered on import]); the core
    imports no Accelerate either; none of them adds an import hook."""
    import subprocess
    import sys

    code = (
        f"import sys\nfinders = list(sys.meta_path)\nimport {module}\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'lightning', 'pytorch_lightning', 'lightning_fabric', 'accelerate'}),"
        " sys.meta_path == finders)"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    # ...and no import hook: the finders on sys.meta_path are the interpreter's (issue 42)
    assert loaded == ("['accelerate'] True" if module == "accelerate_swap" else "[] True"), (module, loaded)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("code", "registered"),
    [
        # the README's order: every name of both front ends at `import lightning_swap`
        ("import lightning as L\nimport lightning_swap", (4, 2)),
        # the package before Lightning: no name (the Note's trade-off) until a class is used
        ("import lightning_swap\nimport lightning as L", (0, 0)),
        ("import lightning_swap\nimport lightning as L\nlightning_swap.CPUSwapStrategy", (4, 0)),
        ("import lightning_swap\nfrom lightning_swap.fabric import CPUSwapFabricStrategy", (0, 2)),
    ],
)
def test_strategy_names_are_registered_as_the_note_says(code, registered):
    """Note [Strategies registered on import] in ``lightning_swap/__init__.py``, in a fresh
    interpreter: how many of the Trainer's and Fabric's names Lightning knows after ``code``."""
    import subprocess
    import sys

    code += (
        "\nfrom lightning.pytorch.strategies import StrategyRegistry\nfrom lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "print(sum('cpu_swap' in n for n in StrategyRegistry), sum('cpu_swap' in n for n in STRATEGY_REGISTRY))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == " ".join(map(str, registered))


def test_graph_is_read_from_every_layer():
    graph = _core_import_graph()
    assert {layer_of(m) for m in graph} == {VOCABULARY, *LAYERS}
    assert "decide.plan" in graph["runtime.runtime"] and "measure.model_profile" in graph["decide.solver"]
    assert "engine.unified.cudart" in graph["engine.unified.memory"]  # a sub-package's relative import
    assert "config" in graph["engine.unified.memory"]  # three dots up


def test_layers_import_only_the_layers_before_them():
    violations = layer_violations(_core_import_graph())
    assert not violations, "imports against the layer order (Note [Layer order]):\n" + "\n".join(violations)


@pytest.mark.parametrize(
    ("source", "target", "allowed"),
    [
        ("measure.profiler", "runtime.runtime", False),  # the knot issue 19 untied: profiler -> runtime
        ("measure.observe", "runtime.stats", False),
        ("measure.profiler", "scale.session", False),
        ("decide.solver", "measure.profiler", False),  # decide reads the contract, not the machinery
        ("decide.costmodel", "engine.streams", False),
        ("decide.costmodel", "runtime.runtime", False),
        ("decide.solver", "measure.model_profile", True),
        ("decide.solver", "actions", True),
        ("measure.model_profile", "measure.trace", False),
        ("measure.model_profile", "units", True),
        ("config", "engine.unified.memory", False),  # the option table has no side effects
        ("tensors", "measure.profiler", False),
        ("engine.offload", "measure.trace", False),
        ("engine.recompute", "runtime.runtime", False),
        ("engine.unified.memory", "config", True),
        ("runtime.runtime", "decide.plan", True),
        ("runtime.runtime", "measure.trace", False),
        ("runtime.runtime", "scale.session", False),
        ("scale.session", "runtime.runtime", True),
        ("scale.auto", "__init__", False),  # nothing inside the core imports its surface
        ("__init__", "scale.session", True),
    ],
)
def test_layer_rule_table(source, target, allowed):
    """The checker itself: each forbidden arrow is reported (reintroducing ``profiler -> runtime``,
    the first row, fails :func:`test_layers_import_only_the_layers_before_them`)."""
    assert _allowed(source, target) is allowed
    assert (layer_violations({source: {target}}) == []) is allowed


def test_cycle_finder_sees_a_cycle_and_a_dag():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_core_has_no_import_cycle():
    """Layers flow one way (DESIGN.md): no core module imports, even lazily or for typing
    only, a module that imports it back."""
    graph = _core_import_graph()
    assert "actions" in graph["scale.session"] and "decide.solver" in graph["scale.batch_search"]  # the graph was read
    cycle = _find_cycle({k: v - {"__init__"} for k, v in graph.items()})
    assert not cycle, "import cycle in lightning_swap/core: " + " -> ".join(cycle)


def _adapter_files() -> dict[str, Path]:
    roots = {"lightning_swap": Path(lightning_swap.__file__).parent, "accelerate_swap": Path(accelerate_swap.__file__).parent}
    files = {}
    for package, root in roots.items():
        for path in sorted(root.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            files[name] = path
    return files


def test_adapters_import_only_the_core_surface():
    """``lightning_swap.core`` is the adapters' one door into the core: a name they need is
    exported there, so a move inside the core never reaches them."""
    offenders = {}
    for name, path in _adapter_files().items():
        package_module = name if path.stem == "__init__" else name.rsplit(".", 1)[0] + "._"
        deep = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package_module.split(".")
                absolute = node.module or "" if not node.level else ".".join(base[: len(base) - node.level] + [node.module or ""])
                if absolute.startswith(PACKAGE + "."):
                    deep.add(absolute)
            elif isinstance(node, ast.Import):
                deep.update(a.name for a in node.names if a.name.startswith(PACKAGE + "."))
        if deep:
            offenders[name] = sorted(deep)
    assert not offenders, offenders


# -- the whole package, adapters included (issue 42) ----------------------------------------------
def _package_modules() -> dict[str, Path]:
    """Dotted name -> path of every module of ``lightning_swap`` (the core's too) and ``accelerate_swap``."""
    out = {}
    for root in (CORE.parent, Path(accelerate_swap.__file__).parent):
        for path in sorted(root.rglob("*.py")):
            parts = (root.name, *path.relative_to(root).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _node(name: str) -> str:
    """The graph's node of a module: the core is one node, ``lightning_swap.core`` (its layers: above)."""
    return PACKAGE if name == PACKAGE or name.startswith(PACKAGE + ".") else name


def _package_import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the two packages it imports, wherever the import stands (the core
    as one node; ``from . import x`` is an edge to ``x``, not to the package)."""
    modules = _package_modules()
    graph: dict[str, set[str]] = {}
    for here, path in modules.items():
        package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or "" if not node.level else ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([node.module] if node.module else [])
                )
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        edges = {_node(t) for t in targets if t in modules or t.startswith(PACKAGE + ".")}
        graph.setdefault(_node(here), set()).update(edges - {_node(here)})
    return graph


def test_package_graph_is_read_with_the_adapters():
    graph = _package_import_graph()
    assert {"lightning_swap.strategy_base", "lightning_swap.fsdp"} <= graph["lightning_swap.strategy"]
    assert graph["lightning_swap.fabric"] == {PACKAGE} and "accelerate_swap.plugin" in graph["accelerate_swap.accelerator"]
    assert PACKAGE in graph["lightning_swap"] and "accelerate_swap.guard" in graph["accelerate_swap"]


def test_package_has_no_import_cycle_and_nothing_imports_back_up():
    """The package's import graph, adapters included: no cycle (``fsdp.py`` and ``strategy.py``
    imported each other until issue 42); nothing imports a package's ``__init__`` but the
    user (the core never imports an adapter, an adapter never its own package's surface); the
    Accelerate front end takes nothing of ``lightning_swap`` but its core."""
    graph = _package_import_graph()
    assert not _find_cycle(graph), " -> ".join(_find_cycle(graph))
    up = sorted(f"{s} -> {t}" for s, targets in graph.items() for t in targets if t in ("lightning_swap", "accelerate_swap"))
    assert up == []
    assert graph[PACKAGE] == set()  # the core imports neither package's adapters
    assert {t for s, ts in graph.items() if s.startswith("accelerate_swap") for t in ts if t.startswith("lightning_swap")} == {PACKAGE}


def test_public_api_is_listed():
    for name in lightning_swap.__all__:
        assert hasattr(lightning_swap, name), name
    for name in ("profile", "solve", "InfeasibleBudgetError", "CPUSwapStrategy", "SwapBatchSizeFinder", "Action"):
        assert name in lightning_swap.__all__


def test_public_api_is_unchanged():
    """Issue 19's restructuring moved files, not names: the public lists are as they were (plus
    issue 21's FSDP strategies and ``with_cpu_swap``)."""
    assert sorted(lightning_swap.__all__) == sorted([
        "Action", "BatchSearchError", "CPUSwapStrategy", "ChunkedCrossEntropy", "DDPCPUSwapStrategy", "DeviceMemoryMeter",
        "FSDPCPUSwapStrategy", "InfeasibleBudgetError", "ModelParallelCPUSwapStrategy", "ModelProfile", "PLCPUSwapStrategy", "PLDDPCPUSwapStrategy", "Plan", "PlanRow", "Prediction",
        "ScaleConfig", "ScaleResult", "SegmentProfile", "StepStats", "SwapBatchSizeFinder", "SwapConfig", "SwapRuntime",
        "SwapSession", "Timeline", "TimelineRecorder", "UMMode", "UnifiedMemory", "UnifiedMemoryError", "UnifiedMemoryStats",
        "chunked_cross_entropy", "find_segments", "hf_causal_lm_loss", "install_unified_memory", "min_budget_bytes",
        "plot_timelines", "profile", "search_batch_size", "simulate", "solve", "with_cpu_swap",
    ])
    assert sorted(accelerate_swap.__all__) == sorted([
        "Action", "AcceleratedSwapSession", "BatchSearchError", "ENV_CONFIG", "ENV_FLAG", "ENV_PREFIX", "Plan", "ScaleResult",
        "StepStats", "SwapAccelerator", "SwapPlugin", "find_batch_size",
    ])


def _readme_layout_bullets() -> dict[str, set[str]]:
    """``docs/development.md``'s ``## Layout`` (the README's until issue 32): the core's folder each
    sub-bullet describes (``""`` for the vocabulary, directly in ``core/``) -> the ``*.py`` files it names."""
    import re

    page = (CORE.parents[1] / "docs" / "development.md").read_text()
    section = page.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    core = section.split("- `lightning_swap/core/`", 1)[1].split("\n- ", 1)[0]
    out: dict[str, set[str]] = {}
    for bullet in core.split("\n  - ")[1:]:
        folder = "" if bullet.startswith("vocabulary") else re.match(r"`(\w+)/`", bullet).group(1)
        out[folder] = set(re.findall(r"`(\w+\.py)`", bullet))
    return out


def test_readme_layout_matches_the_core_tree():
    """The documented layout names each core module under its own layer, and no module that is not there."""
    tree: dict[str, set[str]] = {}
    for path in CORE.rglob("*.py"):
        if path.name != "__init__.py":
            parts = path.relative_to(CORE).parts
            tree.setdefault(parts[0] if len(parts) > 1 else "", set()).add(path.name)
    assert _readme_layout_bullets() == tree
