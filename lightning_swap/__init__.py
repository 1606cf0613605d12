"""lightning-swap: train with activations that do not fit in device memory.

``import lightning_swap`` registers the ``"cpu_swap"``, ``"ddp_cpu_swap"``, ``"fsdp_cpu_swap"``
and ``"model_parallel_cpu_swap"`` strategies with
Lightning (and with ``pytorch_lightning`` when it is installed), so
``Trainer(strategy="cpu_swap")`` works: at once when Lightning is imported already, else as
soon as it is (Note [Strategies registered when Lightning is imported] in ``_lazy.py``).

Layers: measure (:func:`profile`), decide (:func:`solve`), act (:class:`SwapRuntime`), scale
(:func:`search_batch_size`) in :mod:`lightning_swap.core`, which imports torch only; the
Lightning adapters (:class:`CPUSwapStrategy`, :class:`DDPCPUSwapStrategy`,
:class:`SwapBatchSizeFinder`) and :mod:`accelerate_swap` are thin. Importing this package (or
``lightning_swap.core``, or ``accelerate_swap``) imports no Lightning: the adapters' names are
loaded when first used.
"""

from .core import (
    Action,
    ChunkedCrossEntropy,
    DeviceMemoryMeter,
    InfeasibleBudgetError,
    ModelProfile,
    Plan,
    PlanRow,
    Prediction,
    SegmentProfile,
    StepStats,
    SwapRuntime,
    UMMode,
    UnifiedMemory,
    UnifiedMemoryError,
    UnifiedMemoryStats,
    chunked_cross_entropy,
    find_segments,
    hf_causal_lm_loss,
    install_unified_memory,
    min_budget_bytes,
    profile,
    simulate,
    solve,
)
from .core import BatchSearchError, ScaleConfig, ScaleResult, search_batch_size
from .core import SwapConfig
from .core import SwapSession
from .core import Timeline, TimelineRecorder
from ._lazy import ADAPTERS, load_adapter, register_when_lightning_is_imported

__version__ = "0.1.0"

__all__ = [
    "Action",
    "BatchSearchError",
    "CPUSwapStrategy",
    "ChunkedCrossEntropy",
    "DDPCPUSwapStrategy",
    "DeviceMemoryMeter",
    "FSDPCPUSwapStrategy",
    "InfeasibleBudgetError",
    "ModelParallelCPUSwapStrategy",
    "ModelProfile",
    "PLCPUSwapStrategy",
    "PLDDPCPUSwapStrategy",
    "Plan",
    "PlanRow",
    "Prediction",
    "ScaleConfig",
    "ScaleResult",
    "SegmentProfile",
    "StepStats",
    "SwapBatchSizeFinder",
    "SwapConfig",
    "SwapRuntime",
    "SwapSession",
    "Timeline",
    "TimelineRecorder",
    "UMMode",
    "UnifiedMemory",
    "UnifiedMemoryError",
    "UnifiedMemoryStats",
    "chunked_cross_entropy",
    "find_segments",
    "hf_causal_lm_loss",
    "install_unified_memory",
    "min_budget_bytes",
    "plot_timelines",
    "profile",
    "search_batch_size",
    "simulate",
    "solve",
    "with_cpu_swap",
]


def __getattr__(name: str):
    """The Lightning adapters, imported when first used (Note [Strategies registered when
    Lightning is imported])."""
    if name in ADAPTERS:
        return load_adapter(name)
    raise AttributeError(f"module 'lightning_swap' has no attribute {name!r}")


register_when_lightning_is_imported()
