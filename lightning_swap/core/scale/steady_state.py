"""The gradients and optimizer state a step starts with, as values, and what they add to a
profile or a timeline measured without them (Note [Steady-state shift] in
``measure/model_profile.py``).

:class:`StateSizes` is what the session hands :class:`~.auto.AutoPlanner` instead of the model
and the optimizer states: the planner decides from numbers, so its decisions are tested from
numbers (``tests/scale/test_auto.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from ..tensors import gradient_bytes, storage_bytes, tensors_in

__all__ = ["StateSizes", "state_growth"]


@dataclass(frozen=True)
class StateSizes:
    """Bytes alive besides the batch (distinct storages): the parameters' gradients and the
    optimizer state; ``signature`` (how many gradients, how many optimizer state entries) is
    cheap to take every step, and says when the bytes must be summed again.

    Note [Re-plan when the optimizer state appears]: the first step runs before the optimizer
    has state (momentum, Adam moments) and before gradients exist; from the second step on
    both are alive during the forward. An auto plan is re-made when ``total_bytes`` grows.
    """

    gradient_bytes: int = 0
    optimizer_bytes: int = 0
    signature: tuple[int, int] = (0, 0)

    @property
    def total_bytes(self) -> int:
        return self.gradient_bytes + self.optimizer_bytes

    @classmethod
    def of(cls, model: nn.Module, states: Any, previous: Optional["StateSizes"] = None) -> "StateSizes":
        """The sizes alive now; ``previous`` is returned as it is when the signature did not
        change (the bytes are summed only when it does)."""
        grads = sum(1 for p in model.parameters() if p.grad is not None)
        entries = sum(len(s) for s in states) if isinstance(states, (list, tuple)) else 0
        if previous is not None and previous.signature == (grads, entries):
            return previous
        return cls(gradient_bytes(model), storage_bytes(tensors_in(states)), (grads, entries))


def state_growth(before: StateSizes, now: StateSizes, *, grads_freed_before_backward: bool) -> tuple[int, int]:
    """(forward bytes, backward bytes) that a step beginning with ``now`` holds beyond one that
    began with ``before`` (Note [Steady-state shift]): the optimizer state throughout, the
    last gradients in the forward, and in the backward too unless the loop frees them first
    (Lightning's closure calls ``zero_grad`` between forward and backward)."""
    grads = max(0, now.gradient_bytes - before.gradient_bytes)
    optimizer = max(0, now.optimizer_bytes - before.optimizer_bytes)
    return grads + optimizer, optimizer + (0 if grads_freed_before_backward else grads)
