"""Batch shapes under ``policy="auto"``: a step's kinds, a batch's key, and what ``auto`` knows
and decided for each batch shape, through one lifecycle (Notes [Plans per batch shape], [A
shape's lifecycle]). :class:`ShapeTable` is the part of :class:`~.auto.AutoPlanner` that keeps
the shapes."""

from __future__ import annotations

import enum
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from ..decide.costmodel import copy_window_of
from ..decide.plan import Plan
from ..decide.solver import min_budget_bytes
from ..measure.larger_shape import PREDICTION_MARGIN, predict_larger
from ..measure.model_profile import ModelProfile
from ..tensors import infer_batch_size, tensors_in
from .revisit import MAX_REVISITS
from .steady_state import StateSizes, state_growth

__all__ = ["BatchKey", "Phase", "ShapeState", "ShapeTable", "StepInputs", "StepKind"]

log = logging.getLogger(__name__)


class StepKind(str, enum.Enum):
    """What a training step does under ``policy="auto"`` (Note [Auto: observe, plan, check])."""

    GUARD = "guard"
    OBSERVE = "observe"
    PLAN = "plan"
    RUN = "run"


@dataclass(frozen=True)
class BatchKey:
    """What the planner needs of a batch: each tensor's shape past the batch dimension and its
    dtype, and the batch size."""

    shape: tuple
    size: int

    @classmethod
    def of(cls, batch: Any) -> "BatchKey":
        return cls(tuple((tuple(t.shape[1:]), t.dtype) for t in tensors_in(batch)), infer_batch_size(batch))


@dataclass(frozen=True)
class StepInputs:
    """The step about to run, as the planner sees it (Note [Auto decides from values])."""

    batch: BatchKey
    state: StateSizes = StateSizes()


# Note [Plans per batch shape]: real training changes the batch's shape (dynamic padding pads
# each batch to its own longest sequence; the last batch of an epoch is smaller), and what a
# step holds depends on it. So everything the decision table (Note [Auto: observe, plan, check])
# knows and decides is kept per shape
# (the batch's shapes and dtypes past the batch dimension; a larger batch of a shape is guarded
# again, a smaller one runs that shape's plan): its guard steps and verdict, its profile, its
# plan, its check and revisits, in a :class:`ShapeState`. A shape that comes back finds its own: it
# is never guarded again, and its plan, already checked, is installed as it was (a ``PLAN``
# step whose plan is the one remembered: the session applies it where another is installed)
# rather than solved again. What holds for every shape stays on the planner: the budget, the
# correction the checks learned (a miss of the model on one shape is assumed on all), the
# refusals, and the state the last guard step ended with (gradients and optimizer state have
# no shape). The shapes are an LRU of ``MAX_SHAPES``: a run with more shapes than that guards
# a forgotten one again (and, guarding at every step, says so: Note [Say why the lowest-memory
# plan stays]). A revisit reads the plan's last ``REVISIT_AFTER_STEPS`` steps, which must all
# be its shape's: a step of another shape starts its count again.
# A new shape that no remembered shape holds is predicted where it can be (Note [A larger
# shape predicted] in ``measure/larger_shape.py``): from the (up to three) largest remembered
# shapes it holds that were planned and checked from measured profiles at one batch size, each
# shifted to the state alive now; the main process decides for every process whether a plan of
# the prediction fits the budget less its margin. If so the shape starts at ``PLAN`` with that
# profile (its first plan observed and refined like a guard profile's), else it is guarded.
# Note [A smaller shape runs a larger one's plan]: a shape seen for the first time is not guarded
# when a remembered shape holds it — every tensor of the same dtype and no larger in any
# dimension, the batch no larger than that shape's profile's — and has a plan of its own, checked
# (not the lowest-memory plan kept for want of a profile). It runs that plan, from the smallest
# such shape: what a step saves grows with every dimension of its batch (the sequence, the image,
# the batch itself, as Note [Batch scaling] has it for the batch), so the plan's checked peak
# bounds the new shape's. It is planned from that shape's profile from then on (where the state
# grows, say), and not revisited (the profile's times are another shape's). The plan is the
# larger shape's, so it may keep less than the new shape could; dynamic padding, whose lengths
# are many, then guards only a new longest length, and every shorter one runs a plan at once.
# Note [A check is of its own batch]: a plan is made for one batch size (its profile's: the
# largest of its shape that was measured) and smaller batches of the shape run it too. A smaller
# batch's step peaks lower, so it cannot check the plan: the plan is checked by the first step
# that ran it at the size it was made for (on a step with several passes, the profile's miss
# shows there and only there). The measured peak the session hands :meth:`AutoPlanner.plan` is
# the last step's; every process knows which shape and size that step ran (from the decisions),
# so every process knows whether it checks the plan of that step's shape, and the main process
# keeps the peak with that shape until its next step plans. Until then the plan runs unchecked
# (at batch sizes it over-provisions for) and stays pending.
# Note [A shape's lifecycle]: where a batch shape is in the table above is one :class:`Phase`,
# changed only by :meth:`AutoPlanner._go`, which logs each change at DEBUG with its reason and
# refuses one that ``NEXT`` does not allow (a bug of the planner's, not the user's):
#
#     GUARD -(a guard step ended)-> VERDICT -(the main process's verdict)-> GUARD (not steady
#         yet) | OBSERVE (plain fits) | PLAN (from the guard's profile) | KEEP_LEAST (no profile
#         could be made and plain's bound is over the budget, or the step ran several passes)
#     OBSERVE -(the observed step begins)-> PLAN
#     PLAN -(a plan applied)-> REFINE (the first made from a guard's profile: its first step is
#         observed, Note [A plan's first step refines its profile]) | CHECK (a plan to measure
#         at its own batch size, Note [A check is of its own batch]) | RUN
#     REFINE -(that step observed)-> REFINED (the profile refined: the check also re-solves) | CHECK
#     REFINED, CHECK -(the check)-> CHECK (another plan applied) | RUN (the plan stays)
#     RUN -(its steady steps measured)-> REVISIT -(re-priced)-> RUN | CHECK
#
# and from any phase to GUARD (a batch that neither the profile nor the guard steps cover: a
# larger batch of the shape sets its plan aside until the new verdict) or to PLAN (a profile made
# elsewhere: a batch-size search's). A plan solved again while running (the state grew, a
# segment refused its action) goes RUN -> CHECK. The phase is what every process decides alike:
# the verdict and the plans are the main process's, broadcast.
class Phase(enum.Enum):
    """Where one batch shape is in its lifecycle (Note [A shape's lifecycle])."""

    GUARD = "guard"
    VERDICT = "verdict"
    OBSERVE = "observe"
    KEEP_LEAST = "keep the lowest-memory plan"
    PLAN = "plan"
    REFINE = "refine"
    REFINED = "refined"
    CHECK = "check"
    RUN = "run"
    REVISIT = "revisit"


#: Note [A shape's lifecycle]: the changes allowed, besides any phase to ``GUARD`` or ``PLAN``.
NEXT = {
    Phase.GUARD: {Phase.VERDICT},
    Phase.VERDICT: {Phase.OBSERVE, Phase.KEEP_LEAST},
    Phase.OBSERVE: set(),
    Phase.KEEP_LEAST: set(),
    Phase.PLAN: {Phase.REFINE, Phase.CHECK, Phase.RUN},
    Phase.REFINE: {Phase.REFINED, Phase.CHECK, Phase.RUN},
    Phase.REFINED: {Phase.CHECK, Phase.RUN},
    Phase.CHECK: {Phase.RUN},
    Phase.RUN: {Phase.REVISIT, Phase.CHECK},
    Phase.REVISIT: {Phase.RUN, Phase.CHECK},
}
#: The phases whose steps run guard steps or what their verdict decided; the phases whose plan
#: awaits its check (Note [A check is of its own batch]).
GUARDING = frozenset({Phase.GUARD, Phase.VERDICT, Phase.OBSERVE, Phase.KEEP_LEAST})
CHECKING = frozenset({Phase.REFINE, Phase.REFINED, Phase.CHECK})
#: The phases of a shape with a profile, planned from (a plan made or due).
PLANNED = frozenset({Phase.PLAN, Phase.REFINE, Phase.REFINED, Phase.CHECK, Phase.RUN, Phase.REVISIT})


@dataclass(eq=False)
class ShapeState:
    """What ``auto`` knows and decided for one batch shape (Note [Plans per batch shape])."""

    shape: Optional[tuple]
    phase: Phase = Phase.GUARD  # Note [A shape's lifecycle]
    guard: Optional[Any] = None  # its guard steps: a guard.Guard (which imports this module)
    profile: Optional[ModelProfile] = None  # plans are solved from it (on the main process)
    profile_shape: Optional[tuple] = None  # every process: plans come from a profile of this shape
    profile_batch: int = 0
    scalable: bool = False  # the profile predicts other batch sizes (a batch-size search's)
    planned_batch: int = 0
    observed_state: StateSizes = StateSizes()
    signature: Optional[tuple[int, int]] = None
    planned_state: int = 0
    current: Optional[Plan] = None  # the last plan applied
    last_applied: Optional[tuple[Plan, int]] = None
    #: Note [A check is of its own batch]: a step ran the plan at its own batch size and a
    #: ``plan()`` heard its peak (every process knows), and that peak (the main process's).
    checkable: bool = False
    check_peak: Optional[int] = None
    #: Note [Re-plan from the steady state]: steps the current plan ran since its check, the
    #: revisits of this profile, and the plans a revisit kept.
    steps_run: int = 0
    revisits: int = 0
    settled: list[tuple] = field(default_factory=list)
    #: Note [A plan's first step refines its profile]: the profile is a guard step's, and the
    #: next plan applied is the first made from it.
    refinable: bool = False
    applied_state: StateSizes = StateSizes()
    refusals_planned: int = 0  # how many refusals the last plan knew of
    #: What its plans leave unused while the profile is a prediction (Note [A larger shape predicted]).
    margin_bytes: int = 0
    #: The shape its profile was measured on (``None``: predicted; another: a larger shape's plan
    #: runs, Note [A smaller shape runs a larger one's plan]); only a shape's own predicts others.
    profile_of: Optional[tuple] = None


#: Note [Plans per batch shape]: the batch shapes remembered, the least recently used forgotten.
MAX_SHAPES = 16


def fits_in(small: tuple, large: tuple) -> bool:
    """Every tensor of batch shape ``small`` is no larger in any dimension than the same tensor of
    ``large``, with its dtype (Note [A smaller shape runs a larger one's plan])."""
    if len(small) != len(large):
        return False
    for a, b in zip(small, large):
        if not (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2):
            return False  # not a (shape, dtype) pair: processes whose shapes differ (``_agreed``)
        (dims_a, dtype_a), (dims_b, dtype_b) = a, b
        if dtype_a != dtype_b or len(dims_a) != len(dims_b) or any(x > y for x, y in zip(dims_a, dims_b)):
            return False
    return True


def describe(shape: Optional[tuple]) -> str:
    """A batch shape for the log: each tensor's dimensions past the batch's, and its dtype."""
    if not shape:
        return "(none)"
    return " ".join(f"[{'x'.join(map(str, t[0]))}]{str(t[1]).removeprefix('torch.')}" if len(t) == 2 and isinstance(t[0], tuple) else str(t) for t in shape)


def _elements(shape: tuple) -> int:
    """The elements of one sample of a batch shape (for choosing the nearest larger shape)."""
    return sum(math.prod(dims) for dims, _ in shape)


def check_size(s: ShapeState) -> int:
    """Note [A check is of its own batch]: the batch size a step must run ``s``'s plan at to
    check it (the size the plan was made for)."""
    made_for = s.current.batch_size if s.current is not None else None
    return made_for or s.planned_batch


class ShapeTable:
    """The batch shapes of an :class:`~.auto.AutoPlanner` (Note [Plans per batch shape]): the
    current one's state, entered each step, and the one place a phase changes."""

    _shapes: OrderedDict
    _s: ShapeState

    def _go(self, s: ShapeState, phase: Phase, why: str) -> None:
        """Note [A shape's lifecycle]: the one place a shape's phase changes."""
        if s.phase is phase:
            return
        if phase not in (Phase.GUARD, Phase.PLAN) and phase not in NEXT[s.phase]:
            raise RuntimeError(f"lightning-swap: auto cannot go from {s.phase.value!r} to {phase.value!r} ({why}); please report this.")
        log.debug("lightning-swap: auto, batch shape %s: %s -> %s: %s.", describe(s.shape), s.phase.value, phase.value, why)
        s.phase = phase

    def _enter(self, shape: tuple, size: int = 0, state: Optional[StateSizes] = None) -> None:
        """Note [Plans per batch shape]: ``shape``'s state becomes the current one (made when the
        shape is new: from a planned shape it fits in, Note [A smaller shape runs a larger one's
        plan], or predicted from smaller ones, Note [A larger shape predicted], else afresh; the
        least recently used forgotten beyond ``MAX_SHAPES``)."""
        s = self._s
        if self._adopt_shape or s.shape is None:  # a profile adopted for the next step's shape, or the first step
            if self._shapes.get(s.shape) is s:
                del self._shapes[s.shape]
            s.shape = shape
        elif s.shape != shape:
            s = (
                self._shapes.get(shape) or self._within_planned(shape, size)
                or (state is not None and self._predicted(shape, size, state)) or ShapeState(shape)
            )
            s.steps_run = 0  # a revisit reads the plan's last steps, which must all be this shape's
        self._shapes[shape] = s
        self._shapes.move_to_end(shape)
        while len(self._shapes) > MAX_SHAPES:
            self._shapes.popitem(last=False)
        self._s = s

    def _within_planned(self, shape: tuple, size: int) -> Optional[ShapeState]:
        """Note [A smaller shape runs a larger one's plan]: a new shape's state, from the smallest
        remembered shape that holds it and has a plan or a profile: its plan, run as it is, or
        where none was made from its profile yet, that profile to plan from; ``None``: none."""
        best = None
        for m in self._shapes.values():
            if (
                m.phase not in PLANNED or m.profile_shape != m.shape or (size > m.profile_batch and not m.scalable)
                or not fits_in(shape, m.shape) or (m.current is None and m.profile_of is None)
            ):
                continue
            if best is None or _elements(m.shape) < _elements(best.shape):
                best = m
        if best is None:
            return None
        if best.current is not None and best.phase is not Phase.PLAN:
            log.debug("lightning-swap: auto, batch shape %s: runs the plan of %s (Note [A smaller shape runs a larger one's plan]).",
                      describe(shape), describe(best.shape))
            return replace(
                best, shape=shape, phase=Phase.RUN, profile_shape=shape, guard=None, settled=list(best.settled),
                revisits=MAX_REVISITS, refinable=False, checkable=False, check_peak=None,
            )
        log.debug("lightning-swap: auto, batch shape %s: planned from the profile of %s (Note [A smaller shape runs a larger "
                  "one's plan]).", describe(shape), describe(best.shape))
        return ShapeState(
            shape, Phase.PLAN, profile=best.profile, profile_shape=shape, profile_batch=best.profile_batch,
            scalable=best.scalable, planned_batch=size, observed_state=best.observed_state, margin_bytes=best.margin_bytes,
            profile_of=best.profile_of,
        )

    def _predicted(self, shape: tuple, size: int, state: StateSizes) -> Optional[ShapeState]:
        """Note [A larger shape predicted]: a new shape's state with a profile predicted from the
        (up to three) largest remembered shapes it holds, planned at one batch size from measured
        profiles, when the main process finds a plan of it within the budget less the margin (its
        prediction, from its state, broadcast: every process takes the same); ``None``: not."""
        known: dict[int, ShapeState] = {}
        for m in self._shapes.values():  # what every process knows alike
            if (
                m.phase in PLANNED and m.profile_of == m.shape and not m.scalable
                and size <= m.profile_batch and fits_in(m.shape, shape) and m.shape != shape
            ):
                known.setdefault(_elements(m.shape), m)
        points = sorted(known.items())[-3:]
        points = [(x, m) for x, m in points if m.profile_batch == points[-1][1].profile_batch] if points else []
        if len(points) < 2:
            return None
        margin = round(PREDICTION_MARGIN * self.budget_bytes)

        def now(m: ShapeState) -> ModelProfile:  # its profile shifted to the state alive now (Note [Steady-state shift])
            forward, backward = state_growth(m.observed_state, state, grads_freed_before_backward=self.grads_freed_before_backward)
            return m.profile.with_state(forward_bytes=forward, backward_bytes=backward)

        def predict() -> Optional[ModelProfile]:
            if any(m.profile is None or m.profile.batch_size != m.profile_batch for _, m in points):
                return None
            profile = predict_larger([(x, now(m)) for x, m in points], _elements(shape))
            least = min_budget_bytes(profile.refusing(self.refusals), **copy_window_of(self.config), actions=self.actions)
            return profile if least + self.correction_bytes + margin <= self.budget_bytes else None

        profile = self.on_main(predict)
        sources = ", ".join(describe(m.shape) for _, m in points)
        if profile is None:
            log.debug("lightning-swap: auto, batch shape %s: no plan of its prediction from %s fits: guarded.", describe(shape), sources)
            return None
        log.debug("lightning-swap: auto, batch shape %s: predicted from %s and planned (Note [A larger shape predicted]).",
                  describe(shape), sources)
        return ShapeState(
            shape, Phase.PLAN, profile=profile, profile_shape=shape, profile_batch=profile.batch_size, planned_batch=size,
            observed_state=state, refinable=True, margin_bytes=margin,
        )
