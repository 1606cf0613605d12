"""What each action costs each segment, measured on the real device.

The cost model needs, per segment, the time of its forward and backward and what recomputing
it adds. Guessing the last from the forward's time misses what recomputation really runs:
checkpoint's bookkeeping, selective checkpointing's dispatch on every op (on the first H100
run ``selective`` was slower than ``recompute`` on both GPT-2 and ResNet-50 although the
roofline said the opposite), compiled blocks. So after the profiled step each segment is run
again on its own, on arguments shaped like the ones it got in that step
(:class:`~.trace.CapturedCall`), in the autocast state it ran in: plain, under ``RECOMPUTE``
and under ``SELECTIVE`` — the runtime's own wrappers — forward and backward each time, timed
with events on the compute stream.

Note [Timing a segment leaves no trace]: the model's buffers (BatchNorm statistics) and the
RNG state are restored afterwards, gradients are taken with ``torch.autograd.grad`` so no
parameter's ``.grad`` changes, and the user's ``training_step`` is not involved: only the
segments' modules run (their forward hooks, if the user registered any, run too).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..actions import Action
from ..engine.recompute import RecomputeTimer, checkpointed
from ..engine.streams import StreamOps, Timing
from .model_profile import SELECTIVE_REFUSAL
from .trace import CapturedCall

__all__ = ["ActionCosts", "measure_action_costs", "measure_released_working"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActionCosts:
    """Milliseconds of one segment: its forward and backward kept, and what ``RECOMPUTE`` and
    ``SELECTIVE`` add to a step (``None`` where it could not be measured); and the bytes its
    forward holds above its start when nothing is saved for backward (-1: not measured)."""

    forward_ms: float
    backward_ms: float
    recompute_ms: Optional[float]
    selective_ms: Optional[float]
    released_working_bytes: int = -1
    #: Why an action cannot run on this segment as planned, "" if all ran (Note [Refused actions]
    #: in ``model_profile.py``): the first refusal seen.
    refusal: str = ""


def measure_released_working(module: nn.Module, call: CapturedCall, device: torch.device) -> int:
    """Note [A forward that does not keep] in ``costmodel.py``: the most bytes the segment's
    forward holds above its start (its arguments already made) when autograd saves nothing."""
    from ..engine.meter import DeviceMemoryMeter

    args, kwargs = call.make()
    autocast = torch.autocast(call.autocast[0], dtype=call.autocast[1]) if call.autocast else contextlib.nullcontext()
    meter = DeviceMemoryMeter(device)
    start = torch.cuda.memory_allocated(device) if meter.is_cuda else 0
    with meter, autocast, torch.autograd.graph.saved_tensors_hooks(lambda t: None, lambda packed: packed):
        out = module(*args, **kwargs)
        del out
    return max(0, meter.peak_bytes - start)


def _grad_inputs(args: Any, module: nn.Module) -> list[torch.Tensor]:
    tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad]
    return tensors + [p for p in module.parameters() if p.requires_grad]


def _run(module: nn.Module, forward: Any, call: CapturedCall, ops: StreamOps) -> tuple[float, float]:
    """One forward and backward of the segment; (forward ms, backward ms) once the device is done."""
    args, kwargs = call.make()
    autocast = torch.autocast(call.autocast[0], dtype=call.autocast[1]) if call.autocast else contextlib.nullcontext()
    compute = ops.compute_stream()
    fwd, bwd = Timing(ops), Timing(ops)
    with fwd.measure(compute), autocast:
        out = forward(*args, **kwargs)
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if outs:
        with bwd.measure(compute):
            inputs = _grad_inputs((args, kwargs), module)
            torch.autograd.grad(outs, inputs, [torch.ones_like(t) for t in outs], allow_unused=True)
    del out, outs
    return fwd.resolve(wait=True) or 0.0, bwd.resolve(wait=True) or 0.0


def _worst(refusals: list[str]) -> str:
    """The refusal that rules out most: one of every recomputing action over selective's alone."""
    broad = [r for r in refusals if not r.startswith(SELECTIVE_REFUSAL)]
    return (broad or refusals or [""])[0]


def _time_variants(
    module: nn.Module, name: str, call: CapturedCall, ops: StreamOps, repeats: int, *, save_ops: Optional[tuple[str, ...]] = None,
) -> tuple[dict, list[str]]:
    """(action -> median (forward ms, backward ms) or ``None`` where it failed, the refusals):
    the segment kept, recomputed and selectively recomputed (saving ``save_ops``, as the plan
    will run it) through the runtime's own wrappers."""
    timer = RecomputeTimer(ops)
    refusals: list[str] = []

    def refuse(segment: str, why: str) -> None:
        refusals.append(why)

    variants = {
        Action.KEEP: module.forward,
        Action.RECOMPUTE: checkpointed(module, module.forward, Action.RECOMPUTE, timer, name=name, on_refuse=refuse),
        Action.SELECTIVE: checkpointed(module, module.forward, Action.SELECTIVE, timer, name=name, on_refuse=refuse, save_ops=save_ops),
    }
    best: dict[Action, Optional[tuple[float, float]]] = {}
    for action, forward in variants.items():
        try:
            _run(module, forward, call, ops)  # warm-up (allocator, kernels, compiled graphs)
            runs = [_run(module, forward, call, ops) for _ in range(repeats)]
            # Medians, not minima: a minimum of a shared machine's timings is its luckiest
            # run, and a lucky KEEP against an unlucky RECOMPUTE misprices both (issue 20).
            best[action] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
        except Exception as exc:  # noqa: BLE001 - an action that cannot run here is not timed, nor planned
            log.debug("timing %s under %s failed: %s", name, action.value, exc)
            best[action] = None
            if action is not Action.KEEP:
                prefix = SELECTIVE_REFUSAL + " " if action is Action.SELECTIVE else ""
                refusals.append(f"{prefix}{action.value} failed: {type(exc).__name__}: {exc}"[:300])
    return best, refusals


def measure_action_costs(
    model: nn.Module,
    modules: dict[str, nn.Module],
    calls: dict[str, CapturedCall],
    ops: StreamOps,
    *,
    device: torch.device,
    repeats: int = 3,
    save_ops: Optional[dict[str, tuple[str, ...]]] = None,
) -> dict[str, ActionCosts]:
    """Time every segment in ``calls`` kept, recomputed and selectively recomputed (the median
    of ``repeats`` runs after one warm-up; selectively saving ``save_ops[name]`` where given:
    Note [Which ops selective recomputation saves] in ``profiler.py``). Note [Timing a segment
    leaves no trace]."""
    out: dict[str, ActionCosts] = {}
    with torch.no_grad():
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
    rng = torch.random.fork_rng(devices=[torch.cuda.current_device()] if ops.asynchronous and torch.cuda.is_available() else [])
    rng.__enter__()
    try:
        for name, call in calls.items():
            module = modules[name]
            best, refusals = _time_variants(module, name, call, ops, repeats, save_ops=(save_ops or {}).get(name))
            keep = best[Action.KEEP]
            if keep is None:
                continue
            base = sum(keep)

            def extra(action: Action, floor: float = 0.0) -> Optional[float]:
                timed = best[action]
                return None if timed is None else max(floor, sum(timed) - base)

            try:
                working = measure_released_working(module, call, device)
            except Exception as exc:  # noqa: BLE001
                log.debug("measuring %s's forward without saving failed: %s", name, exc)
                working = -1
            # Recomputing reruns the whole forward: it adds at least the kept forward's time. A smaller
            # difference is the noise of a shared machine, and would make recomputation look free.
            out[name] = ActionCosts(
                keep[0], keep[1], extra(Action.RECOMPUTE, floor=keep[0]), extra(Action.SELECTIVE), working, _worst(refusals),
            )
    finally:
        rng.__exit__(None, None, None)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return out
