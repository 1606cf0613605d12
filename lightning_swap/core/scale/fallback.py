"""When the observed step is out of memory all the same: a profile on fake tensors.

Note [The observed step does not fit]: under ``policy="auto"`` the observed step runs without a
plan, and only once the guard steps bound its peak within the budget (Note [Observe only what
fits] in ``guard.py``). When it is out of memory all the same (the bound comes from a model: a
last resort, not the path), the step is profiled in fake mode — the adapter's step function
runs once more, on fake tensors, with the RNG, buffers and gradients restored by the profiler —
on the main process, broadcast, and planned; the RNG is set back to the state the failed step
started with, so the step run again under the plan draws what plain training would have drawn.
The user's side effects of the failed attempt and of the fake one (a counter, a metric update)
cannot be undone: that is the one case where the user's step runs more often than in plain
training, and the session warns so (:func:`planned_after_out_of_memory`). The Lightning strategy
runs the step again itself; an Accelerate or Fabric loop is the user's, so there the error
propagates and the user's retry of the step runs under the plan (Note [Out of memory in the
observed step] in ``hooked.py``). One implementation for every front end:
:meth:`SwapSession.step_failed` (Note [One step API] in ``session.py``); no adapter retries.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..config import SwapConfig
from ..measure.model_profile import ModelProfile
from ..measure.profiler import profile
from ..tensors import tensors_in
from .collectives import Collectives

__all__ = ["WeakBatch", "fake_profile_on_main", "planned_after_out_of_memory", "restore_rng_state", "rng_state"]


@dataclass(frozen=True)
class _WeakTensor:
    ref: weakref.ref
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    def resolve(self) -> torch.Tensor:
        t = self.ref()
        if t is not None:
            return t
        return torch.empty(self.shape, dtype=self.dtype, device=self.device).requires_grad_(self.requires_grad)


class WeakBatch:
    """An observed step's batch, its tensors held by weak references (Note [An observed step
    holds no batch] in ``measure/observe.py``): the fallback profiles it on fake tensors, where
    only shapes, dtypes and devices count. :meth:`resolve` is the batch again: each tensor the
    user's where it is still alive, else an uninitialised one like it (its own bytes were freed,
    so it fits where it did). Containers pytree does not open are kept as they are."""

    def __init__(self, batch: Any) -> None:
        def weak(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            return _WeakTensor(weakref.ref(v), tuple(v.shape), v.dtype, v.device, v.requires_grad)

        self._tree = tree_map(weak, batch)

    def resolve(self) -> Any:
        return tree_map(lambda v: v.resolve() if isinstance(v, _WeakTensor) else v, self._tree)


def rng_state(device: torch.device) -> tuple:
    """The CPU generator's state, and the device's on CUDA."""
    return torch.random.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def restore_rng_state(device: torch.device, state: Optional[tuple]) -> None:
    if state is not None:
        torch.random.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)


def fake_profile_on_main(
    model: nn.Module, batch: WeakBatch, step_fn: Callable[[nn.Module, Any], Any], *, segments: Sequence[str], states: Any,
    config: SwapConfig, device: torch.device, collectives: Collectives, advice: str, cause: BaseException,
) -> ModelProfile:
    """The step that did not fit (its ``batch`` by weak references), profiled on fake tensors on
    the main process and handed to every process (Note [The observed step does not fit]). When
    that fails too, a ``RuntimeError`` from ``cause`` says so and gives ``advice`` (the
    adapter's way to choose a policy instead)."""
    gc.collect()  # what the failed attempt held
    if device.type == "cuda":
        torch.cuda.empty_cache()

    def fake() -> ModelProfile:
        return profile(
            model, batch.resolve(), step_fn=step_fn, segments=list(segments), track=tensors_in(states), fake=True, scale=False,
            min_offload_bytes=config.min_offload_bytes, device=device,
        )

    try:
        return collectives.on_main(fake)
    except Exception as err:
        raise RuntimeError(
            "lightning-swap: the training step that policy='auto' runs without a plan to observe it "
            f"is out of memory on {device}, and profiling it on fake tensors failed too ({type(err).__name__}: "
            f"{err}). {advice}"
        ) from cause


def planned_after_out_of_memory(runs_again: bool) -> str:
    """The warning after the fallback planned: what ran once more, and who runs the step again
    (the adapter: ``runs_again``; else the user's loop, which got the error)."""
    then = (
        "runs again under the plan. Side effects of the failed attempt (counters, metric updates) were not undone."
        if runs_again else
        "planned. The error is raised as it was: run the step again (catch torch.OutOfMemoryError) and it runs under "
        "the plan, from the RNG state it started with."
    )
    return (
        "lightning-swap: the observed training step is out of memory without a plan; it was profiled on fake tensors "
        f"(its forward ran once more) and {then}"
    )
