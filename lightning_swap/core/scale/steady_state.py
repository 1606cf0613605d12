"""The gradients and optimizer state a step starts with, as values, and what they add to a
profile or a timeline measured without them (Note [Steady-state shift] in
``measure/model_profile.py``).

:class:`StateSizes` is what the session hands :class:`~.auto.AutoPlanner` instead of the model
and the optimizer states: the planner decides from numbers, so its decisions are tested from
numbers (``tests/scale/test_auto.py``).
"""

from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..engine.meter import DeviceMemoryMeter
from ..tensors import gradient_bytes, local_tensor, storage_bytes, tensors_in

__all__ = ["FirstStepWindows", "StateSizes", "predicted_first_step", "state_growth"]


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
        """The sizes alive now; ``states``: the optimizers (or their ``state``); ``previous`` is
        returned as it is when the signature did not change (the bytes are summed only when it does)."""
        states = [getattr(s, "state", s) for s in states] if isinstance(states, (list, tuple)) else states
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


def predicted_first_step(optimizer: Any, device_type: str) -> Optional[tuple[int, int]]:
    """Note [An optimizer's state before its first step]: (the state, the peak above what is alive
    before it) in bytes on ``device_type`` that ``optimizer``'s first step will make; ``(0, 0)``
    where it has state already (Adagrad makes its state when built: its temporaries are not
    predicted). Its own step runs once on a shallow copy holding meta copies of
    its parameters, each with a meta gradient, under a meter of the meta device: the state is made
    as the real step makes it (Adam's two moments, SGD's momentum, their dtypes) and so are its
    temporaries, with no data and no device memory; the user's optimizer, its hooks and its
    parameters are not touched. ``None`` where that step cannot run so (a closure optimizer such
    as LBFGS, a kernel without a meta implementation): known once the optimizer has stepped."""
    if optimizer.state:
        return 0, 0
    try:
        dry = copy.copy(optimizer)
        dry.state = defaultdict(dict)
        dry._optimizer_step_pre_hooks, dry._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
        dry.param_groups = [{**group, "params": [_meta_with_grad(p) for p in group["params"]]} for group in optimizer.param_groups]
        step = getattr(type(optimizer).step, "__wrapped__", type(optimizer).step)  # torch's hooks (ours too) left out
        with DeviceMemoryMeter("meta") as meter:
            meter.track(t for group in dry.param_groups for p in group["params"] for t in (p, p.grad))
            alive = meter.current_bytes
            step(dry)
    except Exception:  # noqa: BLE001 - any failure means: not predictable this way
        return None
    host = sum(t.numel() * t.element_size() for t in tensors_in(list(dry.state.values())) if t.device.type == device_type)
    return meter.current_bytes - alive + host, meter.peak_bytes - alive + host


def _meta_with_grad(p: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_like(local_tensor(p), device="meta").requires_grad_(p.requires_grad)
    if p.requires_grad:
        meta.grad = torch.empty_like(meta)
    return meta


class FirstStepWindows:
    """Note [The least budget from the first step]: the first step runs before gradients and
    optimizer state exist (``auto`` runs its lowest-memory plan there); every later step holds
    them. Its steady peak is predicted window by window. The step is cut where a backward pass
    begins and ends and where an optimizer step begins and ends (the session's global
    optimizer-step hooks, so every front end's loop is seen); a window's steady peak is its peak in the first
    step plus what a later step holds then that the first did not:

    - the optimizer state not made yet when the window ended: the state the next step begins
      with (with :func:`predicted_first_step` for an optimizer that has not stepped) less the
      state then (an optimizer step's window makes the state inside, and its peak holds it);
    - the gradients the next step begins with less those alive at the window's start, or at its
      end for a backward window (the gradients it makes are in its first-step peak; a later
      step's backward accumulates into those still alive). A gradient freed in the first step
      (``zero_grad``) is freed at the same point of every step; one freed after the optimizer
      step, wherever the loop does it, is gone when the next step begins.

    A window's peak is the step's running peak as the window ends: the meter's peak cannot
    restart without losing the step's, and the running peak is exact for the window that raised
    it and above the others. The least is the largest window's, so never below what the plan
    needs but for a transient the first step cannot show: a later step's backward allocating a
    gradient before adding it to the one kept (one parameter's gradient at a time).

    The least is known as the second step begins. Before, a lower bound is checked (``check``)
    just before each optimizer update: as an optimizer step begins after a backward, or as a
    closure's backward ends (a closure's step begins before its forward): the windows so far, each with the optimizers' whole state (predicted) and
    no gradient charged (the loop may free them before the next step) but where
    ``grads_in_forward`` says the loop keeps them into the next forward (Lightning's closure frees
    them after it), and the update from the bytes alive now, its state and temporaries predicted.
    So a budget below it is refused before the optimizer updates a weight in a loop of one
    optimizer; with several, before the first whose update shows it."""

    def __init__(
        self, meter: Any, model: nn.Module, optimizers: Any, device_type: str, *, grads_in_forward: bool, check: Callable[[int], None],
        in_update: bool,
    ) -> None:
        self._meter, self._model, self._device_type = meter, model, device_type
        self._optimizers = [o for o in optimizers if hasattr(o, "param_groups")] if isinstance(optimizers, (list, tuple)) else []
        self._states, self._grads_in_forward, self._check = optimizers, grads_in_forward, check
        #: (peak as the window ended, optimizer bytes then, gradient bytes it is charged from, a backward's).
        self._windows: list[tuple[int, int, int, bool]] = []
        self._last, self._in_update = StateSizes.of(model, optimizers), in_update

    def cut(self, *, backward: bool) -> None:
        """A window ends now: a backward pass's (``backward``) or another. A closure's backward
        ends inside its optimizer step, just before the update: the bound is checked."""
        now = StateSizes.of(self._model, self._states, self._last)
        self._windows.append((self._meter.peak_bytes, now.optimizer_bytes, now.gradient_bytes if backward else self._last.gradient_bytes, backward))
        self._last = now
        if backward and self._in_update:
            self._check(self.least_bytes(update=True))

    def update_begins(self) -> None:
        """An optimizer step begins (``in_update``: the step began inside one, a closure's)."""
        self.cut(backward=False)
        self._in_update = True
        if any(backward for *_, backward in self._windows):  # after a backward (no closure): the update is next
            self._check(self.least_bytes(update=True))

    def update_ends(self) -> None:
        self.cut(backward=False)
        self._in_update = False

    def least_bytes(self, next_step: Optional[StateSizes] = None, *, update: bool = False) -> int:
        """The least budget, from ``next_step``, the state the second step begins with; without
        it, the lower bound while the step runs (``update``: an optimizer step is about to run)."""
        now = next_step or StateSizes.of(self._model, self._states, self._last)
        made = [predicted_first_step(o, self._device_type) or (0, 0) for o in self._optimizers]
        final_state = now.optimizer_bytes + sum(state for state, _ in made)
        if next_step is not None:
            return max(peak + max(0, final_state - state) + max(0, now.gradient_bytes - grads) for peak, state, grads, _ in self._windows)
        kept = self._grads_in_forward  # the loop keeps its gradients into the next forward (Lightning's closure)
        bound = max(peak + max(0, final_state - state) + (max(0, now.gradient_bytes - grads) if kept and not bw else 0) for peak, state, grads, bw in self._windows)
        if update:  # the optimizer step from what is alive now: its state and temporaries
            bound = max(bound, self._meter.current_bytes + max((peak - state for state, peak in made), default=0) + sum(state for state, _ in made))
        return bound

    def close(self) -> None:
        """The step is over: its last window ends."""
        self.cut(backward=False)
