"""accelerate-swap: the lightning-swap engine for Accelerate training loops.

``SwapAccelerator`` is a drop-in ``accelerate.Accelerator``; it is switched on by
``ACCELERATE_CPU_SWAP=true`` (which ``accelerate launch`` passes to every process), by a
config file named in ``ACCELERATE_CPU_SWAP_CONFIG``, or by ``swap_plugin=SwapPlugin(...)``.
``find_batch_size`` is the planned counterpart of ``accelerate.utils.find_executable_batch_size``;
``accelerate-swap estimate`` predicts a plan and the largest batch without training.
``accelerate_swap.hf.SwapTrainer`` is ``transformers.Trainer`` with the same switch (imported on
its own: transformers is optional).

Importing this package installs :data:`accelerate_swap.guard.GUARD`: a plain ``Accelerator``
built while the switch is on logs a warning once (Note [A switch never silently ignored]);
``accelerate_swap.guard.GUARD.remove()`` takes it out.
"""

from lightning_swap.core import Action, Plan, StepStats
from lightning_swap.core import BatchSearchError, ScaleResult

from .accelerator import AcceleratedSwapSession, SwapAccelerator
from .finder import find_batch_size
from .guard import GUARD
from .plugin import ENV_CONFIG, ENV_FLAG, ENV_PREFIX, SwapPlugin

__all__ = [
    "Action",
    "AcceleratedSwapSession",
    "BatchSearchError",
    "ENV_CONFIG",
    "ENV_FLAG",
    "ENV_PREFIX",
    "Plan",
    "ScaleResult",
    "StepStats",
    "SwapAccelerator",
    "SwapPlugin",
    "find_batch_size",
]

GUARD.install()
