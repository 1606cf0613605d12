"""``find_batch_size``: the planned counterpart of ``accelerate.utils.find_executable_batch_size``.

Accelerate's decorator calls ``train(batch_size)`` and, on each out-of-memory error, again
with 10% less. This one first searches with the planner: it profiles one training step of the
prepared model, predicts the largest (``mode="max"``) or fastest (``mode="throughput"``) batch
for which a plan of offload and recomputation fits the budget, confirms it with a few real
trial steps (:func:`lightning_swap.core.scale.loop_search.search_for_loop`), restores the model and the
optimizer, and only then calls ``train(batch_size)`` with the batch found. The
``SwapAccelerator`` then plans for that batch on its first training forward.

Thin by design: the search is the core's; this module only runs the user's step in an
Accelerate loop and restores state.

Note [Out of memory after the search]: the search measures the step it is given, not the rest
of ``train`` (evaluation, a different loss, other tensors it keeps). When ``train`` still
raises out-of-memory (by type, then by message), the decorator does what Accelerate's does:
frees memory, lowers the batch by 10% (at least one, never below ``min_batch_size``), forgets
the plan (so the next forward plans for the new batch) and calls ``train`` again, up to
``max_trials`` calls; then it raises :class:`~lightning_swap.core.scale.batch_search.BatchSearchError`
from the last error. Any other error propagates at once.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from accelerate.utils import send_to_device
from torch import nn
from torch.utils._pytree import tree_map

from lightning_swap.core import is_out_of_memory
from lightning_swap.core import StepStats
from lightning_swap.core import BatchSearchError, ScaleConfig, ScaleResult, build_options, describe_options
from lightning_swap.core import adopt_search_profile, search_for_loop
from lightning_swap.core import ByteSize, parse_bytes

from .accelerator import SwapAccelerator

__all__ = ["find_batch_size"]

log = logging.getLogger(__name__)

#: The batch the step is warmed up and profiled at when ``profile_batch_size`` is not given
#: (clipped to the searched range): large enough for BatchNorm, small enough to fit.
DEFAULT_PROFILE_BATCH_SIZE = 8
#: What Accelerate's decorator keeps of the batch after each out-of-memory error.
_FALLBACK_FACTOR = 0.9


def _check_positive(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1; got {value!r}.")


def find_batch_size(
    function: Optional[Callable[..., Any]] = None,
    *,
    accelerator: SwapAccelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    make_batch: Callable[[int], Any],
    step_fn: Callable[[nn.Module, Any], torch.Tensor],
    budget_bytes: Optional[ByteSize] = None,
    profile_batch_size: Optional[int] = None,
    **search_options: Any,
) -> Callable[..., Any]:
    """Decorate ``train(batch_size, *args, **kwargs)``; calling ``train(*args, **kwargs)``
    searches the batch size, then calls ``train`` with it (Note [Out of memory after the search]).

    Usable as ``@find_batch_size(accelerator=..., ...)`` or ``find_batch_size(train, ...)``.
    The wrapper's ``result`` attribute holds the last search's
    :class:`~lightning_swap.core.scale.batch_search.ScaleResult` (its ``render()`` is the trial table).

    Args:
        accelerator: a :class:`SwapAccelerator` with the plugin switched on (policy ``"auto"``,
            or a single action, which the search then keeps).
        model: the model ``accelerator.prepare`` returned; the one trained with the plan.
        optimizer: the prepared optimizer stepped by the trial steps.
        make_batch: ``make_batch(batch_size)`` returns one batch of that size (moved to the
            accelerator's device here): per process under ``accelerate launch``.
        step_fn: ``step_fn(model, batch)`` runs the forward and returns the loss, as the
            training loop does. The trials call it on ``model`` and pass the loss to
            ``accelerator.backward``; the profile calls it on the unwrapped model.
        budget_bytes: the device budget, bytes as an ``int`` or a size string (``"12GiB"``; not a
            fraction of device memory). Default: the plugin's ``budget_bytes``, else the free
            CUDA memory less 10%. Required on CPU, where it is the simulated capacity.
        profile_batch_size: the batch the step is warmed up and profiled at (default 8,
            clipped to ``[min_batch_size, max_batch_size]``); pass the batch you train with.
            In ``mode="throughput"`` it is also the base batch: plain training at it is
            measured, and the batch found runs at least as many samples/s
            (``wrapper.result.render()`` states the comparison).
        **search_options: the search's options, ``ScaleConfig``'s fields, as for
            :class:`~lightning_swap.SwapBatchSizeFinder` (``max_trials`` also bounds the calls of
            ``train`` after out-of-memory errors):
{search_options}
    """
    config = build_options(ScaleConfig, search_options, owner="find_batch_size")
    budget_bytes = parse_bytes(budget_bytes, field="budget_bytes", allow_none=True)
    _check_arguments(accelerator, model, optimizer, make_batch, step_fn)
    profile_batch_size = _profile_batch_size(profile_batch_size, config)
    search = functools.partial(_search, accelerator, model, optimizer, make_batch, step_fn, budget_bytes, config, profile_batch_size)
    decorate = functools.partial(_decorate, search=search, accelerator=accelerator, config=config)
    return decorate if function is None else decorate(function)


find_batch_size.__doc__ = find_batch_size.__doc__.replace("{search_options}", describe_options(ScaleConfig, "            "))


def _decorate(train: Callable[..., Any], *, search: Callable[[], ScaleResult], accelerator: SwapAccelerator, config: ScaleConfig) -> Callable[..., Any]:
    """``train`` wrapped: each call searches, then calls ``train(batch_size, ...)`` with the batch found."""
    if not callable(train):
        raise ValueError(f"`function` must be callable (the training function); got {train!r}.")

    @functools.wraps(train)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = search()
        wrapper.result = result
        log.info("find_batch_size:\n%s", result.render())
        return _call_with_fallback(train, accelerator, result.batch_size, config, args, kwargs)

    wrapper.result = None
    return wrapper


def _check_arguments(accelerator: Any, model: Any, optimizer: Any, make_batch: Any, step_fn: Any) -> None:
    if not isinstance(accelerator, SwapAccelerator) or not accelerator.swap_enabled:
        raise ValueError(
            "`accelerator` must be a SwapAccelerator with the swap plugin switched on "
            f"(swap_plugin=SwapPlugin(...) or ACCELERATE_CPU_SWAP=true); got {accelerator!r}."
        )
    if not isinstance(model, nn.Module):
        raise ValueError(f"`model` must be the nn.Module returned by accelerator.prepare; got {type(model).__name__}.")
    if not hasattr(optimizer, "step") or not hasattr(optimizer, "state_dict"):
        raise ValueError(f"`optimizer` must be the optimizer returned by accelerator.prepare; got {type(optimizer).__name__}.")
    for name, fn in (("make_batch", make_batch), ("step_fn", step_fn)):
        if not callable(fn):
            raise ValueError(f"`{name}` must be callable; got {fn!r}.")


def _profile_batch_size(profile_batch_size: Optional[int], config: ScaleConfig) -> int:
    """The batch the search profiles at (default :data:`DEFAULT_PROFILE_BATCH_SIZE`, clipped)."""
    if profile_batch_size is None:
        profile_batch_size = min(max(DEFAULT_PROFILE_BATCH_SIZE, config.min_batch_size), config.max_batch_size)
    _check_positive(profile_batch_size, "profile_batch_size")
    if not config.min_batch_size <= profile_batch_size <= config.max_batch_size:
        raise ValueError(
            f"`profile_batch_size` ({profile_batch_size}) must lie in [min_batch_size, max_batch_size] "
            f"= [{config.min_batch_size}, {config.max_batch_size}]."
        )
    return profile_batch_size


# -- the search ----------------------------------------------------------------------------------
def _host_copy(obj: Any) -> Any:
    return tree_map(lambda t: t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t, obj)


@contextmanager
def _restored(accelerator: SwapAccelerator, inner: nn.Module, optimizer: Any) -> Iterator[None]:
    """Model weights and buffers, gradients, optimizer state, RNG and the accelerator's step
    counters are as they were afterwards (copies kept in host memory, which the meter does not
    count and the device does not hold)."""
    weights = _host_copy(inner.state_dict())
    opt_state = _host_copy(optimizer.state_dict())
    grads = [(p, None if p.grad is None else p.grad.detach().to("cpu", copy=True)) for p in inner.parameters()]
    counters = (accelerator.swap_steps, accelerator.swap_step_stats)
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            inner.load_state_dict(weights)
            optimizer.load_state_dict(opt_state)
            for p, g in grads:
                p.grad = None if g is None else g.to(p.device)
        accelerator.swap_steps, accelerator.swap_step_stats = counters


def _search(
    accelerator: SwapAccelerator,
    model: nn.Module,
    optimizer: Any,
    make_batch: Callable[[int], Any],
    step_fn: Callable[[nn.Module, Any], torch.Tensor],
    budget_bytes: Optional[int],
    config: ScaleConfig,
    profile_batch_size: int,
) -> ScaleResult:
    session = accelerator.swap_session
    if session is None:
        raise ValueError("`accelerator` has no model prepared with the plan: call `accelerator.prepare(model, optimizer)` first.")
    inner = accelerator.unwrap_model(model, keep_torch_compile=False)
    if inner is not session.model:
        raise ValueError("`model` is not the model this accelerator plans; pass the model `accelerator.prepare` returned.")
    budget = budget_bytes if budget_bytes is not None else session.budget_bytes()
    if budget is None:
        raise ValueError(
            f"`budget_bytes` is needed on {accelerator.device.type}, where it is the simulated device "
            "capacity: pass it to find_batch_size or to SwapPlugin."
        )

    def batch_of(batch_size: int) -> Any:
        return send_to_device(make_batch(batch_size), accelerator.device)

    accelerator._swap_searching = True
    try:
        with _restored(accelerator, inner, optimizer), session.planning_suspended():
            return search_for_loop(
                session,
                budget,
                _step_runner(accelerator, model, optimizer, batch_of, step_fn),
                step_fn,
                make_batch=batch_of,
                profile_batch_size=profile_batch_size,
                config=config,
                track=lambda: [getattr(o, "optimizer", o).state for o in accelerator._optimizers],
                collectives=session.collectives,
                base_batch_size=profile_batch_size,
            )
    finally:
        accelerator._swap_searching = False
        # The next training forward plans from the search's steady-state profile at its own
        # batch size, instead of observing a step of that size without a plan.
        adopt_search_profile(session)
        _free_device_memory(accelerator)


def _step_runner(
    accelerator: SwapAccelerator, model: nn.Module, optimizer: Any, batch_of: Callable[[int], Any],
    step_fn: Callable[[nn.Module, Any], torch.Tensor],
) -> Callable[[int, int], list[StepStats]]:
    """``run_steps`` for :func:`search_for_loop`: the user's step, ``steps`` times."""
    session = accelerator.swap_session

    def run_steps(batch_size: int, steps: int) -> list[StepStats]:
        out = []
        for _ in range(steps):
            batch = batch_of(batch_size)
            optimizer.zero_grad(set_to_none=True)
            session.last_stats = None
            accelerator.backward(step_fn(model, batch))  # the hook opened the window; backward closes it
            optimizer.step()
            if session.last_stats is None:
                raise RuntimeError(
                    "`step_fn` made no measured training step: it must call the model it is given "
                    "(in training mode, with autograd on) and return the loss."
                )
            out.append(session.last_stats)
            del batch
        optimizer.zero_grad(set_to_none=True)
        return out

    return run_steps


def _free_device_memory(accelerator: SwapAccelerator) -> None:
    gc.collect()
    if accelerator.device.type == "cuda":
        torch.cuda.empty_cache()


# -- after the search: Note [Out of memory after the search] ----------------------------------
def _call_with_fallback(
    function: Callable[..., Any], accelerator: SwapAccelerator, batch_size: int, config: ScaleConfig, args: tuple, kwargs: dict
) -> Any:
    tried: list[int] = []
    while True:
        tried.append(batch_size)
        try:
            return function(batch_size, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - only out-of-memory is retried
            if not is_out_of_memory(err):
                raise
            lower = max(config.min_batch_size, min(batch_size - 1, int(batch_size * _FALLBACK_FACTOR)))
            if len(tried) >= config.max_trials or batch_size <= config.min_batch_size:
                raise BatchSearchError(
                    f"`{getattr(function, '__name__', 'function')}` ran out of memory at every batch size tried "
                    f"after the search ({tried}; max_trials={config.max_trials}, min_batch_size="
                    f"{config.min_batch_size}): it uses more memory than the step the search measured."
                ) from err
            log.warning("out of memory at batch %d after the search; retrying at %d", batch_size, lower)
            del err
            session = accelerator.swap_session
            if session is not None:
                session.reset()
            _free_device_memory(accelerator)
            batch_size = lower
