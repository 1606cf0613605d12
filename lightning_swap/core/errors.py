"""Exceptions that carry the data a caller needs to recover, and how out-of-memory is recognised.

A leaf of the core: it imports torch only, so every layer (the session, the auto-scaler, the
adapters) can ask :func:`is_out_of_memory` without importing another.
"""

from __future__ import annotations

import torch

__all__ = ["BatchSearchError", "InfeasibleBudgetError", "InputMutatedError", "UnifiedMemoryError", "is_out_of_memory"]

#: What an out-of-memory error says when it does not carry the type (older torch, cuDNN,
#: the CPU allocator, errors re-raised as plain ``RuntimeError``).
_OOM_MARKERS = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",
    "DefaultCPUAllocator: can't allocate memory",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """Out-of-memory, by type first (``torch.OutOfMemoryError``), by message second."""
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(marker in text for marker in _OOM_MARKERS)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


class InfeasibleBudgetError(ValueError):
    """No plan fits the memory budget; ``min_budget_bytes`` is the smallest budget one fits in
    (``lower_bound``: at least that, found before the first step was over: Note [The least budget
    from the first step])."""

    def __init__(self, *, budget_bytes: int, min_budget_bytes: int, batch_size: int | None = None, lower_bound: bool = False) -> None:
        self.budget_bytes = int(budget_bytes)
        self.min_budget_bytes = int(min_budget_bytes)
        self.batch_size, self.lower_bound = batch_size, lower_bound
        at = f" at batch size {batch_size}" if batch_size is not None else ""
        least = "at least " if lower_bound else ""
        super().__init__(
            f"No plan fits a budget of {_mib(self.budget_bytes)}{at}: the smallest budget any plan "
            f"fits in is {least}{_mib(self.min_budget_bytes)} ({self.min_budget_bytes} bytes)"
            + (", found before the first step was over." if lower_bound else ".")
        )

    def __reduce__(self):  # keyword-only __init__: make pickling (DDP, multiprocessing) work
        return (_rebuild, (self.budget_bytes, self.min_budget_bytes, self.batch_size, self.lower_bound))


def _rebuild(budget_bytes: int, min_budget_bytes: int, batch_size: int | None, lower_bound: bool = False) -> InfeasibleBudgetError:
    return InfeasibleBudgetError(budget_bytes=budget_bytes, min_budget_bytes=min_budget_bytes, batch_size=batch_size, lower_bound=lower_bound)


class UnifiedMemoryError(RuntimeError):
    """Unified memory cannot be installed here; the message says why and what to do.
    ``mode`` is the requested ``um`` value, ``device`` where it was asked for."""

    def __init__(self, message: str, *, mode: str, device: str) -> None:
        super().__init__(message)
        self.mode = mode
        self.device = device

    def __reduce__(self):
        return (_rebuild_um, (str(self), self.mode, self.device))


def _rebuild_um(message: str, mode: str, device: str) -> "UnifiedMemoryError":
    return UnifiedMemoryError(message, mode=mode, device=device)


class InputMutatedError(RuntimeError):
    """A recomputed segment wrote into its own input in a way the runtime could not see coming
    (Note [Checkpointed segments must not modify their input] in ``engine/recompute.py``);
    ``segment`` is its name, ``op`` what wrote (an autograd node or aten op name)."""

    def __init__(self, *, segment: str, op: str) -> None:
        self.segment = segment
        self.op = op
        super().__init__(
            f"segment {segment!r} modified its input in place ({op}), so recomputing it would rerun it on "
            "changed values. Keep or offload this segment (policy={" + repr(segment) + ": 'offload'}), or pass "
            "`segments=` that start after the in-place op (Note [Checkpointed segments must not modify their input])."
        )

    def __reduce__(self):
        return (_rebuild_mutated, (self.segment, self.op))


def _rebuild_mutated(segment: str, op: str) -> "InputMutatedError":
    return InputMutatedError(segment=segment, op=op)


class BatchSearchError(RuntimeError):
    """The batch-size search found no batch size that fits; ``trials`` says what was tried (the
    search's ``Trial`` records, ``scale/batch_search.py``)."""

    def __init__(self, message: str, *, trials: tuple = ()) -> None:
        super().__init__(message)
        self.trials = trials
