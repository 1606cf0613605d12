"""The core of lightning-swap: measure, decide, act, scale. Imports torch only.

Layers (Note [Layer order], enforced by ``tests/house/test_architecture.py``), each importing only
the ones before it:

- vocabulary: ``config`` (the option table), ``tensors``, ``actions``, ``units``, ``errors``,
  ``segments``, ``compiled``, ``chunked_loss``;
- ``engine/``: the primitives measuring and acting share (streams, host pool, meter,
  recomputation, offload, unified memory);
- ``measure/``: one step becomes a frozen ``ModelProfile`` (``measure/model_profile.py``, the
  contract with decide);
- ``decide/``: plan, cost model, solver; imports the vocabulary and ``model_profile`` only;
- ``runtime/``: applies a plan and counts what it did;
- ``scale/``: the session an adapter drives, ``auto``, and the batch-size searches.

This module is the one import surface of the adapters (``lightning_swap``'s strategies and
finder, ``accelerate_swap``).
"""

from .actions import AUTO, Action, PolicyLike, resolve_policy
from .chunked_loss import ChunkedCrossEntropy, chunked_cross_entropy, hf_causal_lm_loss
from .config import (
    DEFAULT_MIN_OFFLOAD_BYTES, SwapConfig, UMMode, build_options, check_bool, describe_options, from_text, import_object, option,
    parse_bool, split_options,
)
from .decide.costmodel import Prediction, simulate
from .decide.plan import Plan, PlanRow
from .decide.solver import brute_force, min_budget_bytes, solve
from .engine.meter import DeviceMemoryMeter, host_allocation, mark_host
from .engine.unified.memory import UnifiedMemory, UnifiedMemoryStats, install_unified_memory, unified_memory_for
from .errors import BatchSearchError, InfeasibleBudgetError, InputMutatedError, UnifiedMemoryError, is_out_of_memory
from .measure.model_profile import ModelProfile, SegmentProfile
from .measure.profiler import measure_bandwidth, profile
from .measure.timeline import Timeline, TimelineRecorder
from .runtime.runtime import SwapRuntime
from .runtime.stats import StepStats
from .scale.batch_search import (
    ScaleConfig, ScaleResult, TrialMeasurement, predict_batch_size, search_batch_size,
)
from .scale.auto import StepKind
from .scale.collectives import Collectives, process_group_collectives
from .scale.hooked import HookedSwapSession
from .scale.loop_search import adopt_search_profile, search_for_loop
from .scale.session import SessionViews, SwapSession
from .segments import SegmentSpec, find_segments, refuse_own_checkpointing, split_call
from .tensors import tensors_in
from .units import ByteSize, format_bytes, parse_bytes

__all__ = [
    "AUTO",
    "Action",
    "BatchSearchError",
    "ByteSize",
    "ChunkedCrossEntropy",
    "Collectives",
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "DeviceMemoryMeter",
    "HookedSwapSession",
    "InfeasibleBudgetError",
    "InputMutatedError",
    "ModelProfile",
    "Plan",
    "PlanRow",
    "PolicyLike",
    "Prediction",
    "ScaleConfig",
    "ScaleResult",
    "SegmentProfile",
    "SegmentSpec",
    "SessionViews",
    "StepKind",
    "StepStats",
    "SwapConfig",
    "SwapRuntime",
    "SwapSession",
    "Timeline",
    "TimelineRecorder",
    "TrialMeasurement",
    "UMMode",
    "UnifiedMemory",
    "UnifiedMemoryError",
    "UnifiedMemoryStats",
    "brute_force",
    "build_options",
    "check_bool",
    "chunked_cross_entropy",
    "describe_options",
    "find_segments",
    "refuse_own_checkpointing",
    "split_call",
    "format_bytes",
    "from_text",
    "hf_causal_lm_loss",
    "host_allocation",
    "import_object",
    "install_unified_memory",
    "is_out_of_memory",
    "mark_host",
    "measure_bandwidth",
    "min_budget_bytes",
    "option",
    "parse_bool",
    "parse_bytes",
    "predict_batch_size",
    "process_group_collectives",
    "profile",
    "resolve_policy",
    "search_batch_size",
    "adopt_search_profile",
    "search_for_loop",
    "simulate",
    "solve",
    "split_options",
    "tensors_in",
    "unified_memory_for",
]
