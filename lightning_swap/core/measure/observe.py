"""Profiling the training step that runs anyway.

Note [Observe, do not re-run]: the user's step runs exactly as often as in plain training, and
nothing the library measures runs any of the user's code again. ``policy="auto"`` needs a
profile of the model's step; a profile made by calling the user's step function again, or by
running a segment again on its own, would run its side effects again (counters, metric updates,
``self.log``, lists and hooks the user appends to, Python's and numpy's random state), and
measure another program than the one trained (an input replayed as random values takes another
branch). So the adapters let a training step run as it would (inside the precision plugin's
context, the user's own loss and optimizer step included) and trace it (:class:`~.trace.StepTracer`)
under the plan it runs (``under``): its windows, what each segment and region saves (through
the runtime's hooks where the plan moves it: Note [A traced step sees what the plan moves] in
``trace.py``), each segment's time from events at its bounds, and the time of each op of its
forward (for the selective choice). What cannot be measured there is priced by the cost model
(a recomputation at its forward's time, a forward that does not keep as the kept one) and
corrected by the steps that follow (Note [Auto learns from the steps it runs] in
``scale/auto.py``). The profile's windows are the plan's; ``decide/under_plan.py`` turns them
into plain's (Note [A step measured under a plan]).

Note [An observed step holds no batch]: a traced step must hold on the device what the same step
holds untraced, or its measured peak is not that step's. A user's loop may drop its batch once
the forward has used it (Accelerate: ``loss = loss_fn(model(x))`` with a temporary ``x``; the
autograd graph frees it in the backward), so an observation that kept the batch until the step's
end held it through the optimizer step, where ResNet's peak is. So nothing here keeps the batch
or the step's arguments past ``__init__`` (its size is kept; the tracer counts the batch by a
weak reference and drops its list of static tensors when it begins).

Note [Observe every rank]: under DDP and FSDP every process traces the same step, its own part of
it (under FSDP its shards and the units it gathered: Note [Sharded state is local] in
``sharded.py``), and the plan is made from the largest of every process's measurements
(:func:`~.model_profile.max_profile`), so it fits the fullest rank. Nothing runs on one process
alone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn

from ..actions import Action
from ..compiled import compile_context, is_compiled, recomputes_in_graph
from ..engine.streams import StreamOps, default_ops
from ..segments import named_modules, split_call
from ..tensors import infer_batch_size, tensors_in
from .model_profile import SELECTIVE_REFUSAL, ModelProfile
from .profiler import assemble
from .trace import Mark, MarkKind, StepTrace, StepTracer, region_times, released_working

__all__ = ["ObservedStep"]

log = logging.getLogger(__name__)


class ObservedStep:
    """One real training step, traced while it runs, and the profile it yields.

    ``begin()`` before the forward, ``backward_begins()`` before the loss's backward,
    ``backward_done()`` after it, ``close()`` once the step (optimizer step included) is over
    (it ends the trace: before any mode opened earlier is closed), ``finish()`` for the profile;
    ``abort()`` on failure. ``track`` is what is alive before the step besides the model (the
    batch, the optimizer state), nested in containers. ``under``: the plan the step runs under
    (``None``: plain; the profile's windows are then the plan's: Note [A step measured under a
    plan]); its runtime hands the tracer what its hooks save (:attr:`observer`).
    """

    def __init__(
        self,
        model: nn.Module,
        names: list[str],
        *,
        device: torch.device,
        batch: Any,
        track: Any,
        min_offload_bytes: int,
        modules: Optional[dict[str, nn.Module]] = None,
        ops: Optional[StreamOps] = None,
        under: Optional[Mapping[str, Action]] = None,
        contexts: Optional[Mapping[str, Any]] = None,
    ) -> None:
        self.model = model
        self.names = list(names)
        self.device = device
        self.min_offload_bytes = min_offload_bytes
        self.batch_size = infer_batch_size(batch)  # the batch itself is not kept (Note [An observed step holds no batch])
        self.ops = ops if ops is not None else default_ops(device)
        self.modules = modules if modules is not None else dict(named_modules(model))  # canonical names, compiled or not
        self.under = None if under is None else dict(under)
        #: Each segment's module -> its compiled context, as the runtime found it before setting a
        #: regional compilation aside (Note [Regional compilation is taken over] in ``runtime.py``).
        self.contexts = dict(contexts) if contexts is not None else None
        params = list(model.parameters())
        static = [*params, *model.buffers(), *(p.grad for p in params if p.grad is not None), *tensors_in([batch, track])]
        self.tracer = StepTracer(
            model, self.names, device=device, static=static, params=params, fake=False, min_offload_bytes=min_offload_bytes, ops=self.ops,
        )
        #: Under a plan, what it moves off the device is measured as kept where the meter can
        #: hold it (CPU: Note [Regions held as kept] in ``trace.py``).
        self.held = self.under is not None and not self.tracer.meter.is_cuda
        self.tracer.rec.hold = self.held
        self.open = False
        self.backward_over = False
        self.trace: Optional[StepTrace] = None

    @property
    def meter(self):
        return self.tracer.meter

    @property
    def observer(self):
        """What the runtime's offload engine tells of each tensor its hooks save and fetch back
        (Note [A traced step sees what the plan moves] in ``trace.py``)."""
        return self.tracer.rec

    def begin(self) -> "ObservedStep":
        self.tracer.begin()
        self.open = True
        return self

    def backward_begins(self) -> None:
        self.tracer.backward_begins()

    def backward_done(self) -> None:
        self.tracer.backward_done()
        self.backward_over = True

    def abort(self) -> None:
        if self.open:
            self.open = False
            self.tracer.abort()

    def close(self) -> None:
        """The step is over: the trace ends here (its modes closed), the profile is built later."""
        if self.open:
            self.open = False
            self.tracer.rec.mark(MarkKind.STOP)
            self.trace = self.tracer.finish()

    def _context(self, module_name: str) -> Any:
        if self.contexts is not None and module_name in self.contexts:
            return self.contexts[module_name]
        return compile_context(self.model, module_name)

    def _in_graph(self, name: str) -> bool:
        """Whether segment ``name`` recomputes inside a compiled graph (Note [Recomputation inside
        the compiled graph])."""
        module_name = split_call(name)[0]
        module = self.modules.get(module_name)
        return module is not None and recomputes_in_graph(module) and self._context(module_name) is not None

    def _compiled(self, name: str) -> str:
        """Note [Selective under compile]: the selective of a compiled segment that does not
        recompute inside its graph (Note [Recomputation inside the compiled graph]) is refused
        for planning."""
        module_name = split_call(name)[0]
        module = self.modules.get(module_name)
        if self._in_graph(name):
            return ""
        if self._context(module_name) is not None or (module is not None and is_compiled(module)):
            return f"{SELECTIVE_REFUSAL} compiled, it would recompute everything (Note [Selective under compile])"
        return ""

    def finish(self) -> Optional[ModelProfile]:
        """Close the trace and build the profile (``None``: no segment ran in the step, as when a
        ``training_step`` returns early)."""
        try:
            self.close()
        except ValueError as missing:  # a segment did not run: a step that is no model step
            log.debug("no profile from this step: %s", missing)
            return None
        trace = self.trace
        names = trace.names  # one per call of a module run several times (Note [A segment per call])
        n = len(names)
        marks = trace.marks
        end = marks.get(Mark(MarkKind.END), 0.0)

        def span(first: MarkKind, last: MarkKind, i: int, default: float) -> float:
            return max(marks.get(Mark(last, i), default) - marks.get(Mark(first, i), default), 0.0)

        fwd = {i: span(MarkKind.FORWARD_START, MarkKind.FORWARD_END, i, 0.0) for i in range(n)}
        bwd = {i: span(MarkKind.BACKWARD_START, MarkKind.BACKWARD_END, i, end) for i in range(n)}
        # Outside the segments: the rest of the step, its optimizer step included (STOP), as a
        # step's measured time (StepStats.step_ms) covers it.
        outside = max(marks.get(Mark(MarkKind.STOP), end) - sum(fwd.values()) - sum(bwd.values()), 0.0)
        order = [names.index(name) for name in trace.order]
        regions = region_times(marks, order, end)
        # Note [Selective under compile chooses compute-heavy calls] in ``profiler.py``.
        trace.in_graph = {i for i, name in enumerate(names) if self._in_graph(name)}
        released = (lambda i: released_working(trace, i)) if self.held else (lambda i: -1)
        measured = {i: (None, None, released(i), self._compiled(name), True) for i, name in enumerate(names)}
        heavy = {i: fwd[i] * trace.heavy_op_ms.get(i, 0.0) / max(trace.all_op_ms.get(i, 0.0), 1e-9) for i in range(n)}
        step_ms = outside + sum(fwd.values()) + sum(bwd.values())
        profile = assemble(
            trace, self.model, names, batch_size=self.batch_size, device=self.device, fake=False,
            min_offload_bytes=self.min_offload_bytes, fwd={**fwd, **{k: v[0] for k, v in regions.items()}},
            bwd={**bwd, **{k: v[1] for k, v in regions.items()}}, heavy=heavy, step_ms=step_ms, measured=measured,
        )
        log.debug("traced a step at batch %d: peak %d bytes, %.1f ms", self.batch_size, profile.peak_bytes, step_ms)
        return profile
