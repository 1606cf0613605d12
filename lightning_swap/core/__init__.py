"""The core of lightning-swap: measure, decide, act, scale. Imports torch only."""

from .actions import Action, resolve_policy
from .meter import DeviceMemoryMeter, host_allocation
from .plan import Plan, PlanRow, format_bytes
from .runtime import DEFAULT_MIN_OFFLOAD_BYTES, StepStats, SwapRuntime
from .segments import find_segments

__all__ = [
    "Action",
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "DeviceMemoryMeter",
    "Plan",
    "PlanRow",
    "StepStats",
    "SwapRuntime",
    "find_segments",
    "format_bytes",
    "host_allocation",
    "resolve_policy",
]
