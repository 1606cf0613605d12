"""accelerate-swap: the lightning-swap engine for Accelerate training loops.

``SwapAccelerator`` is a drop-in ``accelerate.Accelerator``; it is switched on by
``ACCELERATE_CPU_SWAP=true`` (which ``accelerate launch`` passes to every process), by a
config file named in ``ACCELERATE_CPU_SWAP_CONFIG``, or by ``swap_plugin=SwapPlugin(...)``.
"""

from lightning_swap.core import Action, Plan, StepStats

from .accelerator import AcceleratedSwapSession, SwapAccelerator
from .plugin import ENV_CONFIG, ENV_FLAG, ENV_PREFIX, SwapPlugin

__all__ = [
    "Action",
    "AcceleratedSwapSession",
    "ENV_CONFIG",
    "ENV_FLAG",
    "ENV_PREFIX",
    "Plan",
    "StepStats",
    "SwapAccelerator",
    "SwapPlugin",
]
