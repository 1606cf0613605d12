"""lightning-swap: train with activations that do not fit in device memory.

Layers: measure (:func:`profile`), decide (:func:`solve`), act (:class:`SwapRuntime`), scale
(:func:`search_batch_size`) in :mod:`lightning_swap.core`, which imports torch only; the
Lightning adapters (:class:`CPUSwapStrategy`, ... in ``strategy.py``; Fabric's in ``fabric.py``;
``pytorch_lightning``'s in ``pl.py``; :class:`SwapBatchSizeFinder`) and :mod:`accelerate_swap`
are thin. Importing this package (or ``lightning_swap.core``, or ``accelerate_swap``) imports no
Lightning: the adapters' names are imported when first used (``__getattr__`` below).

Note [Strategies registered on import]: Lightning resolves ``Trainer(strategy="cpu_swap")`` and
``Fabric(strategy="cpu_swap")`` in its ``StrategyRegistry`` when the object is built, and offers
a package no other way in (no entry point for strategies: the only entry points it reads are
callback factories, read after the strategy is resolved). So a name exists once a module that
imports Lightning has registered it: ``strategy.py`` ("cpu_swap", "ddp_cpu_swap",
"fsdp_cpu_swap", "model_parallel_cpu_swap"), ``fabric.py`` (Fabric's "cpu_swap",
"ddp_cpu_swap") and ``pl.py`` (``pytorch_lightning``'s four) each register theirs when imported.
This file cannot import them unconditionally: ``import lightning_swap.core`` (and so
``import accelerate_swap``) runs it first, and neither may load Lightning (5 s, and a front end
the user did not ask for). It imports the adapter modules of the Lightning packages already
imported, so ``import lightning as L`` then ``import lightning_swap`` (the README's order) has
every name; and using a class (``lightning_swap.CPUSwapStrategy``, ``from lightning_swap.fabric
import ...``) imports its module, which registers its names. The trade-off: when this package is
imported *before* Lightning (and no adapter class is used), a name alone is unknown to Lightning
(``Trainer(strategy="cpu_swap")`` raises Lightning's "invalid strategy name"): import Lightning
first, or pass the class. Lifting that needs a global import hook watching for Lightning's import
(a ``sys.meta_path`` finder, as this package had until issue 42), which every import in the
process would pass through; a reader and an IDE could not follow it.
"""

import importlib
import sys

from .core import (
    Action, BatchSearchError, ChunkedCrossEntropy, DeviceMemoryMeter, InfeasibleBudgetError, ModelProfile, Plan, PlanRow,
    Prediction, ScaleConfig, ScaleResult, SegmentProfile, StepStats, SwapConfig, SwapRuntime, SwapSession, Timeline,
    TimelineRecorder, UMMode, UnifiedMemory, UnifiedMemoryError, UnifiedMemoryStats, chunked_cross_entropy, find_segments,
    hf_causal_lm_loss, install_unified_memory, min_budget_bytes, profile, search_batch_size, simulate, solve,
)

__version__ = "0.1.0"

#: Public name -> the adapter module that defines it (imported when the name is first used).
_ADAPTERS = {
    "CPUSwapStrategy": "strategy", "DDPCPUSwapStrategy": "strategy", "FSDPCPUSwapStrategy": "strategy",
    "ModelParallelCPUSwapStrategy": "strategy", "with_cpu_swap": "strategy", "PLCPUSwapStrategy": "pl",
    "PLDDPCPUSwapStrategy": "pl", "SwapBatchSizeFinder": "finder", "plot_timelines": "report",
}

__all__ = [
    "Action", "BatchSearchError", "ChunkedCrossEntropy", "DeviceMemoryMeter", "InfeasibleBudgetError", "ModelProfile", "Plan",
    "PlanRow", "Prediction", "ScaleConfig", "ScaleResult", "SegmentProfile", "StepStats", "SwapConfig", "SwapRuntime",
    "SwapSession", "Timeline", "TimelineRecorder", "UMMode", "UnifiedMemory", "UnifiedMemoryError", "UnifiedMemoryStats",
    "chunked_cross_entropy", "find_segments", "hf_causal_lm_loss", "install_unified_memory", "min_budget_bytes", "profile",
    "search_batch_size", "simulate", "solve",
    # the adapters (_ADAPTERS), literal for the tools that read __all__ without running it
    "CPUSwapStrategy", "DDPCPUSwapStrategy", "FSDPCPUSwapStrategy", "ModelParallelCPUSwapStrategy", "PLCPUSwapStrategy",
    "PLDDPCPUSwapStrategy", "SwapBatchSizeFinder", "plot_timelines", "with_cpu_swap",
]

#: Each Lightning package -> the adapter module that registers its strategy names (the Note).
_REGISTERED_BY = {"lightning.pytorch": "strategy", "lightning.fabric": "fabric", "pytorch_lightning": "pl"}


def __getattr__(name: str):
    """The adapters, imported when first used (Note [Strategies registered on import])."""
    if name in _ADAPTERS:
        return getattr(importlib.import_module(f"{__name__}.{_ADAPTERS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


for _package, _module in _REGISTERED_BY.items():
    if _package in sys.modules:  # the Note: this Lightning package is imported already
        importlib.import_module(f"{__name__}.{_module}")
