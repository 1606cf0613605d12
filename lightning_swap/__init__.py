"""lightning-swap: train with activations that do not fit in device memory.

``import lightning_swap`` registers the ``"cpu_swap"`` and ``"ddp_cpu_swap"`` strategies with
Lightning (and with ``pytorch_lightning`` when it is installed), so
``Trainer(strategy="cpu_swap")`` works.
"""

from .core import (
    Action,
    DeviceMemoryMeter,
    Plan,
    PlanRow,
    StepStats,
    SwapRuntime,
    find_segments,
)
from .core.session import SwapConfig, SwapSession
from .finder import SwapBatchSizeFinder
from .strategy import CPUSwapStrategy, DDPCPUSwapStrategy, PLCPUSwapStrategy, PLDDPCPUSwapStrategy

__version__ = "0.1.0"

__all__ = [
    "Action",
    "CPUSwapStrategy",
    "DDPCPUSwapStrategy",
    "DeviceMemoryMeter",
    "PLCPUSwapStrategy",
    "PLDDPCPUSwapStrategy",
    "Plan",
    "PlanRow",
    "StepStats",
    "SwapBatchSizeFinder",
    "SwapConfig",
    "SwapRuntime",
    "SwapSession",
    "find_segments",
]
