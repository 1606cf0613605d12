"""The Lightning adapters, loaded when used.

Note [Strategies registered when Lightning is imported]: ``import lightning_swap.core`` (and so
``import accelerate_swap``) runs this package's ``__init__`` first, which must not import
Lightning (5 s, and a dependency the core and the Accelerate front end do not have). Yet
``import lightning_swap`` promises ``Trainer(strategy="cpu_swap")``, and Lightning resolves
that name from its registry when the ``Trainer`` is built. So the strategies are registered
when Lightning itself is: at once when ``lightning.pytorch`` (or ``pytorch_lightning``,
``lightning.fabric``) is imported already, else right after its module has run, by a finder on
``sys.meta_path`` that wraps that one module's loader and removes itself once every watched
module was seen. The adapters' public names (``CPUSwapStrategy``, ``SwapBatchSizeFinder``, ...)
are loaded by the package's ``__getattr__`` when first used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from typing import Any, Callable

#: Public name -> the adapter module that defines it.
ADAPTERS = {
    "CPUSwapStrategy": "strategy", "DDPCPUSwapStrategy": "strategy", "PLCPUSwapStrategy": "strategy",
    "PLDDPCPUSwapStrategy": "strategy", "FSDPCPUSwapStrategy": "fsdp", "ModelParallelCPUSwapStrategy": "fsdp",
    "with_cpu_swap": "fsdp", "SwapBatchSizeFinder": "finder", "plot_timelines": "report",
}


def load_adapter(name: str) -> Any:
    return getattr(importlib.import_module(f"lightning_swap.{ADAPTERS[name]}"), name)


def _register_trainer_strategies() -> None:
    # ``strategy`` registers every Trainer strategy as it runs (the sharded ones through
    # ``fsdp``, imported at its end); when it is the module that imported Lightning, it is
    # running now and finishes that itself.
    if "lightning_swap.strategy" not in sys.modules:
        importlib.import_module("lightning_swap.strategy")


def _register_fabric_strategies() -> None:
    try:
        fabric = importlib.import_module("lightning_swap.fabric")
    except ImportError:  # pragma: no cover - no Fabric adapter in this build
        return
    register = getattr(fabric, "register_fabric_strategies", None)
    if register is not None:
        register()


#: Module -> what registers the strategies once it has run.
_WATCHED: dict[str, Callable[[], None]] = {
    "lightning.pytorch": _register_trainer_strategies,
    "pytorch_lightning": _register_trainer_strategies,
    "lightning.fabric": _register_fabric_strategies,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Registers the strategies right after a watched module has run (the Note)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        register = _WATCHED.get(fullname)
        if register is None:
            return None
        spec = _real_spec(self, fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _WATCHED.pop(fullname, None)
            if not _WATCHED and self in sys.meta_path:
                sys.meta_path.remove(self)
            register()

        spec.loader.exec_module = exec_module  # this module's own loader object only
        return spec


def _real_spec(finder: _AfterImport, fullname: str, path: Any, target: Any) -> Any:
    for other in sys.meta_path:
        if other is finder or not hasattr(other, "find_spec"):
            continue
        spec = other.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def register_when_lightning_is_imported() -> None:
    """Register now for the watched modules imported already; watch for the others."""
    for name in [n for n in _WATCHED if n in sys.modules]:
        _WATCHED.pop(name)()
    if _WATCHED and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
