"""Profiling the training step that runs anyway.

Note [Observe, do not re-run]: the user's step runs exactly as often as in plain training.
``policy="auto"`` needs a profile of the model's step, and a profile made by calling the user's
step function again would run its side effects again (counters, metric updates, ``self.log``,
lists the user appends to), and fake mode breaks on a step that calls ``.item()``. So the
adapters let a training step run as it would (inside the precision plugin's context, the user's
own loss and optimizer step included) and observe it (:class:`~.trace.StepTracer`); the segments
are then timed on their own (:mod:`.action_costs`, no user code), and the plans for the steps
that follow are solved from that profile, shifted to the steady state (Note [Steady-state shift]
in ``model_profile.py``).

The same machinery observes a step run under a plan (``under``: ``auto``'s guard step, under
the lowest-memory plan): the windows are measured as the step ran, each segment the plan does
not keep is measured alone (Note [A segment measured alone] in ``action_costs.py``), and the
profile's windows are the plan's, for ``decide/under_plan.py`` to turn into plain's (Note [A
step measured under a plan]).

Note [Planning costs a few steps]: what the observation adds to training is the segments'
runs on their own (Note [Timing a segment leaves no trace]): each costs a segment's forward
and backward, so their number is the cost, and it is kept to a few steps' worth: each segment
runs plain three times (a median), ``SELECTIVE`` once, ``RECOMPUTE`` not at all (its price is
its forward's), once forward without saving (its working bytes) and, under a plan, once traced
if the plan does not keep it. Timing every action four times each costs about twelve steps'
worth (14-26 s added to an 8-step run of ~1.9 s steps); the steady state's measurements correct
the prices afterwards instead (Note [Re-plan from the steady state] in ``scale/revisit.py``).

Note [An observed step holds no batch]: an observed step (plain, a guard step, a plan's first
step) must hold on the device what the same step holds in plain training, or its measured peak
is not plain's. A user's loop may drop its batch once the forward has used it (Accelerate:
``loss = loss_fn(model(x))`` with a temporary ``x``; the autograd graph frees it in the
backward), so an observation that kept the batch until the step's end held it through the
optimizer step, where ResNet's peak is: every ``auto`` step observed measured one batch (24 KiB
on the zoo's ResNet) over plain's and every forced policy's peak, and a budget at plain's peak
was declared infeasible. So nothing here keeps the batch or the step's arguments past
``__init__`` (its size is kept; the tracer counts the batch by a weak reference and drops its
list of static tensors when it begins); the session keeps the batch's key, and for its
out-of-memory fallback the batch's tensors by weak references (``WeakBatch`` in
``scale/fallback.py``, Note [The observed step does not fit]).
``tests/scale/test_auto_every_step.py`` checks that ``auto``'s steps peak at plain's where plain
fits, under Accelerate and Lightning.

Note [Observe every rank]: under FSDP every process runs every collective of the step (the
gathers of each unit's parameters, the gradients' reduce-scatters), so nothing that runs the
model may run on one process alone, and every process observes the same step. Under FSDP2, where
every segment is a unit of its own, the segments are then timed and traced alone on every rank
in lockstep (Note [Sharded segments timed in lockstep] in ``sharded.py``), as they are without
FSDP: a guard step is observed under its plan and ``auto`` plans a mix from it. Elsewhere (FSDP1,
or a segment that is no unit, or holds units) they are not (``time_actions`` is off:
recomputation is priced from the forward's time, and a forward's working set without saved
tensors is taken as the kept one's, which never under-predicts: on CPU an offloading segment's
forward is priced up to its saved bytes over, measured 5% of the peak on the tests' GPT at batch
8), nor measured alone (Note [A segment measured alone]: so a guard step is not observed under
its plan there, and plain's peak is bounded from the guard's measurements instead: Note [Observe
only what fits] in ``scale/guard.py``). What each process measured is its own (its shards, the
units it gathered); the plan is made from the largest of every process's measurements
(:func:`~.model_profile.max_profile`), so it fits the fullest rank. Without FSDP every process
observes too, and measures its segments alone on its own.

Note [A segment that cannot be replayed]: a segment's replay (Note [A replay has no side effects]
in ``replay.py``) can still fail: a layer that reads state the step set up around it, an argument
that cannot be copied. Such a segment is planned without its replay, and said so in one WARNING
per model and segment (a DEBUG line buried it before, while ``auto`` stayed on its slowest plan):

- observed plain (or under a plan that keeps it): its forward and backward times are the step's
  own (its marks), its recomputation is refused (Note [Refused actions] in ``model_profile.py``:
  what was never run alone is not recomputed), and its released working bytes are taken as the
  kept ones (which never under-predicts: Note [Observe every rank]);
- under a plan that does not keep it (``auto``'s guard step): what it saves when kept is known
  only from its run alone (Note [A segment measured alone]), so no profile is made from that
  step: ``auto`` keeps the lowest-memory plan unless the guard's bound says plain training fits
  (Note [Observe only what fits] in ``scale/guard.py``), and the WARNING says so. A later step on
  the same shape reuses the costs measured then (``costs``): a segment they leave out is taken
  as unreplayable again.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn

from ..actions import Action
from ..compiled import compile_context, is_compiled, recomputes_in_graph
from ..engine.streams import StreamOps, default_ops
from ..segments import named_modules, split_call
from ..sharded import runs_alone
from ..tensors import infer_batch_size, tensors_in
from .action_costs import ActionCosts, measure_action_costs
from .model_profile import SELECTIVE_REFUSAL, ModelProfile
from .profiler import _offload_savings, assemble, selective_choice
from .trace import Mark, MarkKind, StepTrace, StepTracer, Window, WindowKind, boundary_keys, region_times

__all__ = ["ObservedStep"]

log = logging.getLogger(__name__)

#: The segments already named in a WARNING, per model (Note [A segment that cannot be replayed]).
_WARNED: "weakref.WeakKeyDictionary[nn.Module, set[str]]" = weakref.WeakKeyDictionary()

#: Note [A segment that cannot be replayed]: the refusal of a segment whose replay failed (every
#: recomputing action: :func:`~.model_profile.refused_actions`).
REPLAY_REFUSAL = "its replay failed"


class ObservedStep:
    """One real training step, traced while it runs, and the profile it yields.

    ``begin()`` before the forward, ``backward_begins()`` before the loss's backward,
    ``backward_done()`` after it, ``close()`` once the step (optimizer step included) is over
    (it ends the trace: before any mode opened earlier is closed), ``finish()`` for the profile;
    ``abort()`` on failure. ``track`` is what is alive before the step besides the model (the
    batch, the optimizer state), nested in containers. ``under``: the plan the step runs under
    (``None``: plain; the profile's windows are then the plan's: Note [A step measured under a
    plan]); ``costs``: the segments' :class:`~.action_costs.ActionCosts` measured already (on
    this batch shape), not measured again.
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
        time_actions: bool = True,
        under: Optional[Mapping[str, Action]] = None,
        costs: Optional[dict[str, ActionCosts]] = None,
    ) -> None:
        self.model = model
        self.names = list(names)
        self.device = device
        self.min_offload_bytes = min_offload_bytes
        self.batch_size = infer_batch_size(batch)  # the batch itself is not kept (Note [An observed step holds no batch])
        self.ops = ops if ops is not None else default_ops(device)
        self.modules = modules if modules is not None else dict(named_modules(model))  # canonical names, compiled or not
        self.time_actions = time_actions and runs_alone(model, self._modules_of(self.names).values())  # Note [Observe every rank]
        self.under = None if under is None else dict(under)
        self.costs = costs
        #: Segment -> why it could not be replayed (Note [A segment that cannot be replayed]).
        self.unreplayable: dict[str, str] = {}
        params = list(model.parameters())
        static = [*params, *model.buffers(), *(p.grad for p in params if p.grad is not None), *tensors_in([batch, track])]
        self.tracer = StepTracer(
            model, self.names, device=device, static=static, params=params, fake=False,
            min_offload_bytes=min_offload_bytes, ops=self.ops, capture_inputs=self.time_actions,
        )
        #: Under a plan, the regions outside the segments are measured as kept where the meter
        #: can hold them (CPU: Note [Regions held as kept] in ``trace.py``).
        self.regions_held = self.under is not None and not self.tracer.meter.is_cuda
        self.tracer.rec.hold_regions = self.regions_held
        self.open = False
        self.backward_over = False
        self.trace: Optional[StepTrace] = None

    @property
    def meter(self):
        return self.tracer.meter

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

    @property
    def acting(self) -> list[str]:
        """The segments the step's plan does not keep (none for a plain step), one per call of a
        module run several times (Note [A segment per call]: a plan may name the module alone)."""
        under = self.under
        if under is None:
            return []
        names = self.trace.names if self.trace is not None else self.names
        return [n for n in names if under.get(n, under.get(split_call(n)[0], Action.KEEP)) is not Action.KEEP]

    def _modules_of(self, names: list[str]) -> dict[str, nn.Module]:
        return {name: self.modules.get(name) or self.modules[split_call(name)[0]] for name in names}

    def _in_graph(self, name: str) -> bool:
        """Whether segment ``name`` recomputes inside a compiled graph (Note [Recomputation inside
        the compiled graph])."""
        module_name = split_call(name)[0]
        module = self.modules.get(module_name)
        return module is not None and recomputes_in_graph(module) and compile_context(self.model, module_name) is not None

    def _compiled(self, name: str) -> str:
        """Note [Selective under compile]: the selective of a compiled segment that does not
        recompute inside its graph (Note [Recomputation inside the compiled graph]) is refused
        for planning."""
        module_name = split_call(name)[0]
        module = self.modules.get(module_name)
        if self._in_graph(name):
            return ""  # Note [Recomputation inside the compiled graph]
        if compile_context(self.model, module_name) is not None or (module is not None and is_compiled(module)):
            return f"{SELECTIVE_REFUSAL} compiled, it would recompute everything (Note [Selective under compile])"
        return ""

    def _measured_costs(self, trace: StepTrace, names: list[str], order: list[int]) -> dict[str, ActionCosts]:
        """The segments' costs: given, or measured now (each segment measured alone where the plan
        does not keep it); selective timed saving the ops the step's own forward chose, as the
        plan will run it (Note [Which ops selective recomputation saves] in ``profiler.py``)."""
        if self.costs is None and self.time_actions and trace.inputs:
            calls = {names[i]: call for i, call in trace.inputs.items()}
            # What a segment saves is known from this step only where the plan kept it (the
            # others are measured alone after): the early-stop cut (Note [Selective saves per
            # call]) needs it, so it applies to kept segments here.
            acting = set(self.acting)
            save_ops = {
                names[i]: selective_choice(
                    trace.ops[i], set(boundary_keys(trace, order, i)), frozenset(trace.mutated),
                    None if names[i] in acting else trace.saved.get(i, {}), in_graph=i in trace.in_graph,
                )[0]
                for i in trace.inputs if trace.ops.get(i)
            }
            self.costs = measure_action_costs(
                self.model, self._modules_of(names), calls, self.ops, device=self.device, alone=self.acting,
                min_offload_bytes=self.min_offload_bytes, save_ops=save_ops, failed=self.unreplayable,
            )
        elif self.costs is not None:
            # Measured on this shape already (a guard step's): a segment left out could not be
            # replayed then, and is not now (Note [A segment that cannot be replayed]).
            for i in trace.inputs:
                if names[i] not in self.costs:
                    self.unreplayable.setdefault(names[i], "it could not be replayed in an earlier step")
        return self.costs or {}

    def _warn_unreplayable(self, planned: bool) -> None:
        """Note [A segment that cannot be replayed]: one WARNING naming the segments not yet named
        for this model, with the first reason."""
        try:
            warned = _WARNED.setdefault(self.model, set())
        except TypeError:  # a model that cannot be weakly referenced: named every time
            warned = set()
        new = {name: why for name, why in self.unreplayable.items() if name not in warned}
        if not new:
            return
        warned.update(new)
        how = (
            "planned from this step's own timings, without recomputation" if planned else
            "what it saves when kept is known only from such a run, so no profile is made from this step under the "
            "lowest-memory plan, and auto keeps that plan unless its bound says plain training fits"
        )
        first = next(iter(new.values()))
        log.warning(
            "lightning-swap: segment%s %s could not be run again on its own to be measured (%s): %s "
            "(Note [A segment that cannot be replayed])",
            "s" if len(new) > 1 else "", ", ".join(repr(n) for n in new), first, how,
        )

    def finish(self) -> Optional[ModelProfile]:
        """Close the trace, time each segment's actions (unless ``costs`` were given), and build
        the profile; ``None`` when a segment the plan does not keep could not be measured alone."""
        self.close()
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
        costs = self._measured_costs(trace, names, order)
        if any(costs.get(name) is None or costs[name].alone is None for name in self.acting):
            self._warn_unreplayable(planned=False)
            log.debug("observed a step under a plan, but not every segment it does not keep was measured alone")
            return None
        self._warn_unreplayable(planned=True)
        measured: dict[int, tuple[Optional[float], Optional[float], int, str, bool]] = {}
        for i, name in enumerate(names):
            c = costs.get(name)
            if c is not None:
                fwd[i], bwd[i] = c.forward_ms, c.backward_ms
                refusal = c.refusal or self._compiled(name)
                # A unit was gathered before its lone forward: its gathered bytes are the step's (Note
                # [A sharded segment's forward alone] in ``sharded.py``; 0 unsharded).
                working = c.released_working_bytes + trace.gathered_bytes.get(i, 0) if c.released_working_bytes >= 0 else -1
                measured[i] = (c.recompute_ms, c.selective_ms, working, refusal, not c.selective_in_graph)
            elif name in self.unreplayable:  # Note [A segment that cannot be replayed]: the step's own times
                measured[i] = (None, None, -1, f"{REPLAY_REFUSAL}: {self.unreplayable[name]}"[:300], True)
        alone = {name: costs[name].alone for name in self.acting}
        _splice_alone(trace, {names.index(name): own for name, own in alone.items()})
        heavy = {i: fwd[i] * trace.heavy_op_ms.get(i, 0.0) / max(trace.all_op_ms.get(i, 0.0), 1e-9) for i in range(n)}
        step_ms = outside + sum(fwd.values()) + sum(bwd.values())
        profile = assemble(
            trace, self.model, names, batch_size=self.batch_size, device=self.device, fake=False,
            min_offload_bytes=self.min_offload_bytes, fwd={**fwd, **{k: v[0] for k, v in regions.items()}},
            bwd={**bwd, **{k: v[1] for k, v in regions.items()}}, heavy=heavy, step_ms=step_ms, measured=measured,
        )
        profile = _with_alone_working(profile, trace, names, alone)
        log.debug("observed a step at batch %d: peak %d bytes, %.1f ms", self.batch_size, profile.peak_bytes, step_ms)
        return profile


def _splice_alone(trace: StepTrace, alone: dict[int, StepTrace]) -> None:
    """Note [A segment measured alone]: what each segment measured alone saves (and its heavy
    ops' outputs, its ops) becomes the segment's in the step's trace: its input and output
    storages are the step's, the rest new keys (negative: the step's are positive). An input
    alive before the step (the batch) is not saved by it, as the step's own trace would have it."""
    fresh = itertools.count(-1, -1)
    for i, own in alone.items():  # (one trace may stand for several identical segments: not changed)
        static = own.input_key[0][0] if i in trace.static_inputs and 0 in own.input_key else None
        mapping = {}
        for keys_of in ("input_key", "output_key"):
            mine, real = getattr(own, keys_of).get(0), getattr(trace, keys_of).get(i)
            if mine is not None and real is not None:
                mapping.setdefault(mine[0], real[0])

        def key(k: int) -> int:
            if k not in mapping:
                mapping[k] = next(fresh)
            return mapping[k]

        trace.saved[i] = {key(k): b for k, b in own.saved.get(0, {}).items() if k != static}
        trace.heavy[i] = {key(k): b for k, b in own.heavy.get(0, {}).items() if k != static}
        # Its ops and their outputs in the same keys: what selective would save is chosen from them
        # (Note [Which ops selective recomputation saves] in ``profiler.py``).
        trace.ops[i] = {op: [ms, {key(k): b for k, b in made.items()}, *est] for op, (ms, made, *est) in own.ops.get(0, {}).items()}
        trace.mutated.update(mapping[k] for k in own.mutated if k in mapping)


def _with_alone_working(profile: ModelProfile, trace: StepTrace, names: list[str], alone: dict[str, StepTrace]) -> ModelProfile:
    """Note [A step measured under a plan] in ``decide/under_plan.py``: for each segment measured
    alone, its working bytes above its windows' starts (its rise when kept), and its windows'
    peaks as ``start under the plan + that rise``; the on-demand and per-tensor offload estimates
    stay the same distances below the backward's peak as alone."""
    segments = list(profile.segments)
    for pos, s in enumerate(segments):
        own = alone.get(s.name)
        if own is None:
            continue
        i = names.index(s.name)
        forward, backward = Window(WindowKind.FORWARD, 0), Window(WindowKind.BACKWARD, 0)  # the one segment's, alone
        fwd, bwd = own.window_peak.get(forward, 0), own.window_peak.get(backward, 0)
        rise_f = max(0, fwd - own.window_start.get(forward, fwd))
        rise_b = max(0, bwd - own.window_start.get(backward, bwd))
        start_f = trace.window_start.get(Window(WindowKind.FORWARD, i), s.forward_peak_bytes - s.forward_working_bytes)
        start_b = trace.window_start.get(Window(WindowKind.BACKWARD, i), s.backward_peak_bytes - s.backward_working_bytes)
        segments[pos] = dataclasses.replace(
            s, forward_working_bytes=rise_f, backward_working_bytes=rise_b, forward_peak_bytes=start_f + rise_f,
            backward_peak_bytes=start_b + rise_b, offload_backward_peak_bytes=start_b + rise_b + min(0, own.offload_bwd_peak.get(0, bwd) - bwd),
            **_offload_savings(own, 0, bwd),  # the per-tensor estimates, as savings below it
        )
    return dataclasses.replace(profile, segments=tuple(segments))
