"""The core of lightning-swap: measure, decide, act, scale. Imports torch only."""

from .actions import Action, resolve_policy
from .chunked_loss import ChunkedCrossEntropy, chunked_cross_entropy, hf_causal_lm_loss
from .costmodel import Prediction, simulate
from .errors import InfeasibleBudgetError, UnifiedMemoryError
from .meter import DeviceMemoryMeter, host_allocation
from .plan import Plan, PlanRow, format_bytes
from .profiler import ModelProfile, SegmentProfile, measure_bandwidth, profile
from .runtime import DEFAULT_MIN_OFFLOAD_BYTES, StepStats, SwapRuntime
from .segments import find_segments
from .solver import brute_force, min_budget_bytes, solve
from .unified import UMMode, UnifiedMemory, UnifiedMemoryStats, install_unified_memory
from .units import parse_bytes

__all__ = [
    "Action",
    "ChunkedCrossEntropy",
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "DeviceMemoryMeter",
    "InfeasibleBudgetError",
    "ModelProfile",
    "Plan",
    "PlanRow",
    "Prediction",
    "SegmentProfile",
    "StepStats",
    "SwapRuntime",
    "UMMode",
    "UnifiedMemory",
    "UnifiedMemoryError",
    "UnifiedMemoryStats",
    "brute_force",
    "chunked_cross_entropy",
    "find_segments",
    "format_bytes",
    "hf_causal_lm_loss",
    "host_allocation",
    "install_unified_memory",
    "measure_bandwidth",
    "min_budget_bytes",
    "parse_bytes",
    "profile",
    "resolve_policy",
    "simulate",
    "solve",
]
