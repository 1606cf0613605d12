"""``policy="auto"``: which plan each step runs, learned only from the steps the user runs.

Note [Auto learns from the steps it runs]: two jobs, kept apart (DESIGN, layer 4).

- **Safety is online.** Every step runs under the budget held as it runs (Note [The budget held
  online] in ``runtime/online.py``): a step never relies on a prediction being right to stay
  within its budget. So nothing here guards a step against the plan being wrong.
- **Speed is learned from the user's own steps.** The very first step, with no profile at all,
  runs the lowest-memory plan (every segment and region ``offload``, copies waited for, fetched per
  tensor) and is traced (Note [Observe, do not re-run] in ``measure/observe.py``); its profile,
  turned into plain training's (Note [A step measured under a plan] in ``decide/under_plan.py``),
  is the first *entry* of a table of profiles, one per batch shape traced. Every later step runs
  the fastest plan the cost model finds within the budget for the entry that covers its batch
  (Note [A shape scaled from another]); a batch no entry covers (a new longest sequence, a new
  image size) runs the plan of the nearest entry scaled to it, with ``keep`` and ``offload`` only,
  and is traced (Note [A traced step sees what the plan moves] in ``measure/trace.py``): its own
  step becomes its entry. Nothing is re-run outside the user's step.

Each plan is checked by the first step that runs it, and every step after: the step's measured
peak against the plan's prediction (the largest over the processes), and whether the online budget
moved anything. A *miss* — a step over the budget (a transient between two checks), one the online
budget held only by moving segments, or one that held more than its plan predicted by more than
``MISS_TOLERANCE`` of the budget (at its peak, or at a segment's start: a second pass on the first
one's bytes) — is learned as the *correction* (one value: what the measurements exceeded the
predictions by, a little more after each move), and every plan is made again for the budget less
it (less ``MARGIN`` at least for a plan that is not plain training, whose peak the first step
measured: what the model misses inside a window, between two checks); the correction only
grows, so plans settle. A step under its prediction teaches
nothing: the prediction of another plan need not be as far off (a plan made for the room one
plan's step left ran another over its budget). A miss on a scaled entry also traces the next step of that key: it becomes an entry of its own.
Plans are re-made when the gradients or optimizer state grow (the first optimizer step) and when a
segment refuses an action (Note [Refused actions] in ``measure/model_profile.py``).

Where a plan is in that cycle is one :class:`Phase`, changed only by :func:`transition` over
``NEXT`` (``tests/scale/test_auto.py`` holds every edge and every refused one):

    FIRST -(a traced step gave a profile)-> CHECK;  FIRST -(none: no segment ran, no backward)-> FIRST
    CHECK -(the step held its prediction)-> RUN
    CHECK, RUN -(a miss, a move, a new profile, the state grew, a refusal: re-planned)-> CHECK
    RUN -(held)-> RUN

Note [Auto decides from values]: the planner never sees the model, the optimizer or the session.
Its inputs are values (the budget, the segment names and options; per step a :class:`StepInputs`;
after it an :class:`Outcome` and, from a traced step, a profile) and its outputs decisions (a
:class:`Decision`, a :class:`~..decide.plan.Plan`, an :class:`~..runtime.online.OnlineBudget`),
which the session carries out. Every data-parallel process decides alike from agreed values (the
batch key agreed, measurements reduced to their largest); the main process alone solves, and the
session broadcasts its plan.

Note [A shape scaled from another]: a batch's *shape* is each tensor's shape past the batch
dimension, with its dtype; an entry *covers* a batch when the batch's shape fits in the entry's
(every tensor no larger in any dimension) and the batch holds no more than ``COVER_FACTOR`` times
the entry's activations. What a step keeps grows with its batch's elements (a sample's tokens or
pixels, times the batch size: exactly so for the batch size, Note [Batch scaling]), so the entry is
used scaled by the ratio of elements (:meth:`~..measure.model_profile.ModelProfile.scaled`); a
shorter sequence under eager attention keeps less than linearly less, so scaling down over-predicts
and never under. A batch beyond every entry is scaled by the ratio's square (what eager
attention's ``L x L`` scores grow by; more than any linear part does), for the one step that
traces it. Ratios are rounded up to a ``1/SCALE_STEPS`` grid, so that dynamic padding's many
lengths share a few plans. Entries are kept by what they cover: beyond ``MAX_ENTRIES`` the one
another entry covers (else the smallest) goes.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from ..actions import Action
from ..config import SwapConfig
from ..decide.costmodel import AUTO_WINDOW, copy_window_of
from ..decide.plan import Plan
from ..decide.solver import min_budget_bytes, solve
from ..decide.under_plan import as_plain
from ..errors import InfeasibleBudgetError
from ..measure.model_profile import ModelProfile
from ..runtime.online import OnlineBudget
from ..tensors import infer_batch_size, tensors_in
from ..units import format_bytes
from .steady_state import StateSizes, state_growth

__all__ = ["AutoPlanner", "BatchKey", "Decision", "Event", "Outcome", "Phase", "StepInputs", "StepKind", "transition"]

log = logging.getLogger(__name__)

#: Note [Auto learns from the steps it runs]: a step over its prediction by more than this part
#: of the budget is learned.
MISS_TOLERANCE = 0.01
#: What a plan leaves unused of the budget before any step taught a correction: what the cost
#: model misses inside a window, between two of the online budget's checks (1.4% on the zoo's T5).
MARGIN = 0.02
#: Note [A shape scaled from another].
COVER_FACTOR = 1.25
SCALE_STEPS = 32
MAX_ENTRIES = 16


class StepKind(str, enum.Enum):
    """What a training step does under ``policy="auto"`` (Note [Auto learns from the steps it runs])."""

    FIRST = "first"  # no profile yet: the lowest-memory plan, traced
    TRACE = "trace"  # a batch no profile covers: a plan of keep and offload, traced
    PLAN = "plan"  # a plan made for this step, checked by it
    RUN = "run"  # the plan in force runs


class Phase(enum.Enum):
    """Where the current plan is (Note [Auto learns from the steps it runs])."""

    FIRST = "first"
    CHECK = "check"
    RUN = "run"


class Event(enum.Enum):
    """What a step told ``auto``."""

    PROFILED = "a traced step gave a profile"
    UNPROFILED = "a traced step gave none"
    HELD = "the step held its prediction"
    MISSED = "the step missed its prediction, or the online budget moved a segment"
    CHANGED = "the state grew, a segment refused an action, or the batch needs another plan"


#: Note [Auto learns from the steps it runs]: the edges of the lifecycle.
NEXT: dict[Phase, dict[Event, Phase]] = {
    Phase.FIRST: {Event.PROFILED: Phase.CHECK, Event.UNPROFILED: Phase.FIRST},
    Phase.CHECK: {
        Event.HELD: Phase.RUN, Event.MISSED: Phase.CHECK, Event.CHANGED: Phase.CHECK, Event.PROFILED: Phase.CHECK,
        Event.UNPROFILED: Phase.CHECK,
    },
    Phase.RUN: {
        Event.HELD: Phase.RUN, Event.MISSED: Phase.CHECK, Event.CHANGED: Phase.CHECK, Event.PROFILED: Phase.CHECK,
        Event.UNPROFILED: Phase.RUN,
    },
}


def transition(phase: Phase, event: Event) -> Phase:
    """The one place a phase changes (a refused edge is a bug of the planner's: it raises)."""
    nxt = NEXT[phase].get(event)
    if nxt is None:
        raise RuntimeError(f"lightning-swap: auto cannot take {event.name} in phase {phase.value!r}; please report this.")
    return nxt


@dataclass(frozen=True)
class BatchKey:
    """What the planner needs of a batch: each tensor's shape past the batch dimension and its
    dtype, and the batch size."""

    shape: tuple
    size: int

    @classmethod
    def of(cls, batch: Any) -> "BatchKey":
        return cls(tuple((tuple(t.shape[1:]), t.dtype) for t in tensors_in(batch)), infer_batch_size(batch))

    @property
    def elements(self) -> int:
        """The batch's elements: a sample's (every tensor's) times the batch size."""
        return max(1, self.size) * max(1, sum(math.prod(dims) for dims, _ in _pairs(self.shape)))


def _pairs(shape: tuple) -> list[tuple[tuple, Any]]:
    return [t for t in shape if isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], tuple)]


def fits_in(small: tuple, large: tuple) -> bool:
    """Every tensor of batch shape ``small`` is no larger in any dimension than the same tensor of
    ``large``, with its dtype (Note [A shape scaled from another])."""
    a, b = _pairs(small), _pairs(large)
    if len(a) != len(small) or len(a) != len(b):
        return False
    return all(
        da == db and len(x) == len(y) and all(i <= j for i, j in zip(x, y)) for (x, da), (y, db) in zip(a, b)
    )


@dataclass(frozen=True)
class StepInputs:
    """The step about to run, as the planner sees it (Note [Auto decides from values])."""

    batch: BatchKey
    state: StateSizes = StateSizes()


@dataclass(frozen=True)
class Outcome:
    """What a step measured (the largest over the processes): its peak (``None``: not measured),
    whether the online budget moved anything, and the largest shift it saw (Note [The budget held
    online])."""

    peak_bytes: Optional[int]
    moved: bool = False
    shift_bytes: Optional[int] = None


@dataclass(frozen=True)
class Decision:
    """What the next step runs: its kind, its plan's key, whether it is traced, and the plan when
    one is in hand (else the main process solves it: :meth:`AutoPlanner.plan`)."""

    kind: StepKind
    key: Optional[tuple] = None
    trace: bool = False
    plan: Optional[Plan] = None


def _growth(batch: BatchKey, entry: "_Entry") -> float:
    """How much larger ``batch`` is than ``entry``'s shape (Note [A shape scaled from another]): its
    largest tensor's growth (a fixed-size tensor beside the tokens does not hide the tokens'),
    times the batch size's; by elements where the tensors do not pair up."""
    mine, theirs = _pairs(batch.shape), _pairs(entry.shape)
    if len(mine) != len(theirs) or not mine or len(mine) != len(batch.shape):
        return batch.elements / entry.elements
    size = max(1, batch.size) / max(1, round(entry.elements / max(1, sum(math.prod(d) for d, _ in theirs))))
    return size * max(math.prod(a) / max(1, math.prod(b)) for (a, _), (b, _) in zip(mine, theirs))


def _keeps_all(plan: Plan) -> bool:
    return all(a is Action.KEEP for a in (*plan.actions.values(), *plan.outside.values()))


@dataclass
class _Entry:
    """A profile of one traced batch shape, as plain training's, and the state it began with."""

    shape: tuple
    elements: int
    profile: ModelProfile
    state: StateSizes


@dataclass
class _Planned:
    plan: Plan
    checked: bool = False
    online: Optional[OnlineBudget] = None
    predicted_bytes: int = 0


@dataclass
class AutoPlanner:
    """The ``policy="auto"`` decisions of one session (Note [Auto learns from the steps it runs]).

    ``budget_bytes``: the budget (``None``: none, every segment kept); ``segments``: the names
    plans act on; ``config``: the copy windows plans are priced for; ``grads_freed_before_backward``:
    the loop frees gradients between forward and backward (Note [Steady-state shift]);
    ``device_type``: where steps run; ``actions``: what plans may use (``None``: all);
    ``sharded``: under FSDP (online moves never recompute: Note [The budget held online])."""

    budget_bytes: Optional[int]
    segments: Sequence[str]
    config: SwapConfig = SwapConfig()
    grads_freed_before_backward: bool = False
    device_type: str = "cpu"
    actions: Optional[Sequence[Action]] = None
    sharded: bool = False
    phase: Phase = Phase.FIRST
    #: Segment -> why its recomputation cannot run as planned (the session's, shared).
    refusals: dict[str, str] = field(default_factory=dict)
    #: The lowest-memory plan's steady peak: predicted after the first step, measured once a step
    #: ran it steady (what :class:`InfeasibleBudgetError` states as the least budget).
    least_bytes: Optional[int] = None
    _entries: list[_Entry] = field(default_factory=list)
    _plans: dict[tuple, _Planned] = field(default_factory=dict)
    #: Note [Auto learns from the steps it runs]: what the steps measured beyond their plans'
    #: predictions (only grows); every plan is made for the budget less it.
    correction_bytes: int = 0
    _retrace: set = field(default_factory=set)
    _state: StateSizes = StateSizes()
    _refusals_planned: int = 0
    _current: Optional[tuple] = None  # the key of the step running, and its plan
    _running: Optional[_Planned] = None

    def __post_init__(self) -> None:
        self.segments = tuple(self.segments)
        if self.budget_bytes is None or not self.segments:
            self.phase = Phase.RUN

    @property
    def profile(self) -> Optional[ModelProfile]:
        """The newest entry's profile (``None`` before the first traced step)."""
        return self._entries[-1].profile if self._entries else None

    def _go(self, event: Event) -> None:
        before, self.phase = self.phase, transition(self.phase, event)
        if before is not self.phase:
            log.debug("lightning-swap: auto: %s -> %s: %s.", before.value, self.phase.value, event.value)

    # -- before a step -------------------------------------------------------------------
    def lowest_memory(self) -> Plan:
        """The first step's plan: every segment and region offloaded, copies waited for, fetched per
        saved tensor (Note [A traced step sees what the plan moves]: no recomputation, so the
        trace sees every saved tensor)."""
        return Plan.lowest_memory(self.segments, self.segments, action=Action.OFFLOAD)

    def _is_lowest(self, plan: Plan) -> bool:
        lowest = self.lowest_memory()
        return dict(plan.actions) == dict(lowest.actions) and dict(plan.outside) == dict(lowest.outside)

    def next_step(self, step: StepInputs) -> Decision:
        """The decision for the step about to run (Note [Auto learns from the steps it runs])."""
        if self.budget_bytes is None or not self.segments:  # nothing to plan against: every segment kept
            if self._running is not None:
                return Decision(StepKind.RUN, ("keep",), plan=self._running.plan)
            return Decision(StepKind.PLAN, ("keep",), plan=Plan(actions={name: Action.KEEP for name in self.segments}))
        if not self._entries:
            return Decision(StepKind.FIRST, ("first",), trace=True, plan=self.lowest_memory())
        if step.state.total_bytes > self._state.total_bytes or len(self.refusals) != self._refusals_planned:
            self._plans.clear()  # Note [Steady-state shift]; Note [Refused actions]
            self._state, self._refusals_planned = step.state, len(self.refusals)
            if self.phase is not Phase.FIRST:
                self._go(Event.CHANGED)
        index, factor, covered = self._nearest(step.batch)
        bucket = math.ceil(factor * SCALE_STEPS) / SCALE_STEPS
        key = (id(self._entries[index]), bucket)
        trace = not covered or key in self._retrace
        planned = self._plans.get(key)
        if trace:
            return Decision(StepKind.TRACE, key, trace=True)
        if planned is None:
            return Decision(StepKind.PLAN, key)
        return Decision(StepKind.RUN if planned.checked else StepKind.PLAN, key, plan=planned.plan)

    def _nearest(self, batch: BatchKey) -> tuple[int, float, bool]:
        """The entry to plan ``batch`` from, the ratio of activations, and whether it covers the
        batch (Note [A shape scaled from another]): the smallest that covers it, else the largest."""
        elements = batch.elements
        covering = [
            (e.elements, i) for i, e in enumerate(self._entries)
            if fits_in(batch.shape, e.shape) and elements <= COVER_FACTOR * e.elements
        ]
        if covering:
            size, index = min(covering)
            return index, elements / size, True
        index = max(range(len(self._entries)), key=lambda i: self._entries[i].elements)
        return index, _growth(batch, self._entries[index]), False

    # -- planning (the main process) -----------------------------------------------------------
    def _window(self) -> dict[str, Any]:
        return copy_window_of(self.config)

    def _profile(self, key: tuple) -> ModelProfile:
        """The profile a key's plans are solved from: its entry scaled (a batch beyond the entry's
        activations as if they grew with its square: Note [A shape scaled from another]), shifted
        to the state alive now (Note [Steady-state shift]), refusals marked."""
        entry = self._entry(key)
        forward, backward = state_growth(entry.state, self._state, grads_freed_before_backward=self.grads_freed_before_backward)
        factor = key[1] if key[1] <= 1 else key[1] ** 2
        size = max(1, round(entry.profile.batch_size * key[1]))
        return entry.profile.scaled(factor, size).with_state(forward_bytes=forward, backward_bytes=backward).refusing(self.refusals)

    def _entry(self, key: tuple) -> _Entry:
        for entry in self._entries:
            if id(entry) == key[0]:
                return entry
        raise RuntimeError(f"lightning-swap: auto has no profile for plan key {key}; please report this.")

    def plan(self, decision: Decision) -> Plan:
        """The plan of ``decision`` (solved on the main process; the session broadcasts it): the
        fastest the cost model finds within the budget less the key's correction; for a traced
        step, of ``keep`` and ``offload`` only (Note [A traced step sees what the plan moves]).
        Raises :class:`InfeasibleBudgetError` where even the lowest-memory plan is known not to fit."""
        if decision.plan is not None:
            return decision.plan
        profile = self._profile(decision.key)
        effective = self.budget_bytes - self._margin()
        actions = (Action.KEEP, Action.OFFLOAD) if decision.trace else self.actions
        window = {k: v for k, v in self._window().items()}
        try:
            if effective <= 0:
                raise InfeasibleBudgetError(budget_bytes=self.budget_bytes, min_budget_bytes=self.budget_bytes - effective, batch_size=profile.batch_size)
            plan = solve(profile, budget_bytes=self.budget_bytes - self.correction_bytes, actions=actions, **window)
            if not _keeps_all(plan):  # plain's peak is measured, a mix's predicted: MARGIN for that
                plan = solve(profile, budget_bytes=effective, actions=actions, **window)
        except InfeasibleBudgetError as err:
            if self.least_bytes is not None and self.least_bytes > self.budget_bytes:
                raise InfeasibleBudgetError(budget_bytes=self.budget_bytes, min_budget_bytes=self.least_bytes, batch_size=profile.batch_size) from None
            log.debug("no plan predicted within %s (least %s): the lowest-memory plan, held online", effective, err.min_budget_bytes)
            plan = replace(self.lowest_memory(), predicted_peak_bytes=err.min_budget_bytes, batch_size=profile.batch_size)
        return replace(plan, budget_bytes=self.budget_bytes)

    def applied(self, decision: Decision, plan: Plan) -> None:
        """Every process, with the plan the step runs (the main process's)."""
        self._current = decision.key
        if decision.kind is StepKind.FIRST or self.budget_bytes is None or not self.segments:
            self._running = _Planned(plan)
            return
        planned = self._plans.get(decision.key)
        if planned is None or planned.plan != plan:
            profile = self._profile(decision.key)
            online = OnlineBudget(
                profile, plan.actions, plan.outside, budget_bytes=self.budget_bytes, window=self._priced(plan),
                margin_bytes=self.correction_bytes if _keeps_all(plan) else self._margin(), recompute=not (self.sharded or decision.trace),
                refused=tuple(self.refusals), growth=decision.trace or decision.key[1] != 1.0,
            )
            planned = _Planned(plan, online=online, predicted_bytes=online.predicted_peak_bytes)
            if self._is_lowest(plan) and self.least_bytes is not None:
                # Measured, not modelled: the lowest-memory plan's steady peak is known, and the
                # model's moves below it are guesses (on CPU its offload fetches per saved tensor,
                # which the model prices high, and recomputation rematerialises more).
                online.margin_bytes = self.least_bytes - online.predicted_peak_bytes
                planned.predicted_bytes = self.least_bytes
            if not decision.trace:
                self._plans[decision.key] = planned
        self._running = planned

    def _margin(self) -> int:
        """What plans leave unused: the correction the steps taught, at least ``MARGIN``."""
        return max(self.correction_bytes, int(MARGIN * self.budget_bytes))

    def _priced(self, plan: Plan) -> dict[str, Any]:
        """What prices ``plan`` as the runtime runs it: the copy windows the config sets, else those
        it was priced for; its selective choices."""
        window = self._window()
        for key in ("prefetch_bytes", "inflight_bytes"):
            if window[key] is None or window[key] == AUTO_WINDOW:
                window[key] = getattr(plan, key)
        return dict(window, selective_ops=dict(plan.selective_ops))

    @property
    def online(self) -> Optional[OnlineBudget]:
        """The budget the running step holds (``None``: the first step, with nothing to hold it by)."""
        return self._running.online if self._running is not None else None

    @property
    def check_pending(self) -> bool:
        """The plan in force has not been checked yet: its step is measured."""
        return self.phase is not Phase.RUN

    # -- after a step ----------------------------------------------------------------------
    def traced(self, profile: Optional[ModelProfile], batch: BatchKey, state: StateSizes, plan: Plan) -> None:
        """Every process: a traced step's profile under ``plan`` (the largest of every process's;
        ``None``: none), which began with ``state``: a new entry, as plain training's."""
        if profile is None:
            self._go(Event.UNPROFILED)
            return
        held = self.device_type != "cuda"  # Note [Regions held as kept]
        plain = as_plain(profile, plan.actions, outside=plan.outside, held=held, **{k: v for k, v in self._priced(plan).items()})
        entry = _Entry(batch.shape, batch.elements, plain, state)
        self._entries = [e for e in self._entries if e.shape != batch.shape or e.elements != batch.elements] + [entry]
        self._evict()
        self._plans.clear()
        self._retrace.discard(self._current)
        self._go(Event.PROFILED)

    def _evict(self) -> None:
        """Note [A shape scaled from another]: entries kept by what they cover."""
        while len(self._entries) > MAX_ENTRIES:
            covered = [
                i for i, e in enumerate(self._entries)
                if any(j != i and fits_in(e.shape, o.shape) and e.elements <= o.elements for j, o in enumerate(self._entries))
            ]
            drop = covered[0] if covered else min(range(len(self._entries)), key=lambda i: self._entries[i].elements)
            del self._entries[drop]

    def finished(self, outcome: Outcome, *, first: bool) -> None:
        """Every process: the step is over, with ``outcome`` (Note [Auto learns from the steps it
        runs]; its peak ``None`` where it ran no backward: nothing is learned; the first step's
        teaches the least budget only, which the session sets: Note [The least budget from the
        first step]). Raises :class:`InfeasibleBudgetError` as soon as the lowest-memory plan is
        known not to fit."""
        if self.budget_bytes is None or not self.segments or first:
            return
        running, key = self._running, self._current
        if running is None or outcome.peak_bytes is None or key is None:
            return
        if self._is_lowest(running.plan):
            if not outcome.moved:
                self.least_bytes = outcome.peak_bytes  # measured: the least budget is this peak
            if outcome.peak_bytes > self.budget_bytes:  # the floor, its moves lower still: nothing fits
                raise InfeasibleBudgetError(budget_bytes=self.budget_bytes, min_budget_bytes=outcome.peak_bytes, batch_size=running.plan.batch_size)
        budget, predicted = self.budget_bytes, running.predicted_bytes
        miss, shift = outcome.peak_bytes - predicted, 0 if running.online is None else outcome.shift_bytes or 0
        learned = max(miss, shift if key[1] == 1.0 else 0) + (MISS_TOLERANCE * budget if outcome.moved else 0)
        if outcome.moved or outcome.peak_bytes > budget or learned > self.correction_bytes + MISS_TOLERANCE * budget:
            # Over the budget (a transient between two checks), held within it only by moves, or
            # holding more than predicted (a second pass on the first one's bytes): planned again.
            self.correction_bytes = int(max(self.correction_bytes, learned))
            if key[1] != 1.0 and (outcome.moved or outcome.peak_bytes > budget):
                self._retrace.add(key)  # a scaled entry missed: its next step is traced
            self._plans.clear()
            log.info(
                "lightning-swap: a step under the auto plan peaked at %s against %s predicted%s; planning again for %s less "
                "(the budget, %s, was held online).", format_bytes(outcome.peak_bytes), format_bytes(predicted),
                " (segments moved to stay within the budget)" if outcome.moved else "", format_bytes(self.correction_bytes),
                format_bytes(budget),
            )
            self._go(Event.MISSED)
        else:
            running.checked = True
            self._go(Event.HELD)

    def adopt(self, profile: ModelProfile, batch: Optional[BatchKey], *, steady: bool = False) -> None:
        """Every process: plan from ``profile`` (a plain step's, made elsewhere: a batch-size
        search's, ``steady``: measured in the steady state) as the entry of ``batch``'s shape."""
        key = batch or BatchKey((), profile.batch_size)
        state = StateSizes(1 << 62, 1 << 62) if steady else StateSizes()
        self._entries = [e for e in self._entries if e.shape != key.shape] + [_Entry(key.shape, key.elements, profile, state)]
        self._plans.clear()
        if self.phase is Phase.FIRST:
            self.phase = Phase.CHECK
        else:
            self._go(Event.PROFILED)

    def min_budget_bytes(self) -> Optional[int]:
        """The least budget known: the lowest-memory plan's, measured or predicted from the first
        step; else the cost model's least for the newest entry."""
        if self.least_bytes is not None:
            return self.least_bytes
        if not self._entries:
            return None
        return min_budget_bytes(self._entries[-1].profile, actions=self.actions, **self._window())
