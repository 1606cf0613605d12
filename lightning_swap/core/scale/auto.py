"""``policy="auto"`` over a training loop: when to guard a step, when to plan, when to check.

Note [Auto: observe, plan, check]: before every training step the session asks
:meth:`AutoPlanner.next_step` and gets a :class:`StepKind`:

- ``GUARD``: no profile covers this batch (the first step of a batch shape that no planned
  shape holds, or a batch larger than its shape's profile): the step runs under the lowest-memory plan, measured and observed
  on every process (Note [Observe only what fits]); after it the main process decides for every
  process (``VERDICT``, broadcast) what comes next;
- ``OBSERVE``: the guard step's profile predicts that plain training fits (or, where none could
  be made, its bound does): the step runs with every segment kept and every process observes
  it (Note [Observe, do not re-run] in ``observe.py``);
- ``PLAN``: a plan is due: the first step after a profile was made (the profile is shifted to
  the state alive now, Note [Steady-state shift]), the step after a new plan's first step (the
  check below), the gradients and optimizer state grew, a segment refused an action since
  (Note [Refused actions] in ``model_profile.py``), the plan's steady state has been
  measured (Note [Re-plan from the steady state]), or the step's shape has a plan of its own
  while another shape's is installed (Note [Plans per batch shape]: that plan, as it was);
- ``RUN``: the installed plan runs (the lowest-memory one where plain's bound is over budget).

Each batch shape has its own state through this table (Note [Plans per batch shape]).

The answer depends only on what every data-parallel process sees alike (batch shapes agreed
across processes, the order of steps, the sizes of gradients and optimizer state), so all
enter the plan's broadcast together; the main process alone solves, from the largest of every
process's measurements (the profiles merge by their largest values: Note [Decide from the
largest measurement] in ``collectives.py``).

The check: the first step under a new plan at the batch size it was made for is measured (Note
[A check is of its own batch]). If its peak exceeded the prediction,
the difference is learned (the model misses allocator rounding, workspaces, ...: it only grows)
and, if the peak also exceeded the budget, the plan is solved again with the budget less what
was learned — logged once, with the numbers. A plan that cannot be kept raises
:class:`~.errors.InfeasibleBudgetError` before it runs; its ``min_budget_bytes`` is the least
budget for the steady state (gradients and optimizer state included), plus what was learned.

Note [Auto decides from values]: the planner never sees the model, the optimizer or the
session. Its inputs are values — the budget, the segment names and the options when it is
made; per step a :class:`StepInputs` (the batch's shapes and size, the :class:`StateSizes`
alive); what a step measured (peaks, rows, profiles, step times) when it is over — and its
outputs are decisions (a ``StepKind``, a :class:`Verdict`, a :class:`~.plan.Plan`) that the
session carries out. So the decision table is tested from numbers
(``tests/scale/test_auto_decisions.py``), without a model.
"""

from __future__ import annotations

import enum
import logging
import math
import statistics
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from ..actions import Action
from ..config import SwapConfig
from ..decide.costmodel import AUTO_WINDOW, copy_window, copy_window_of, on_demand, simulate
from ..decide.plan import Plan
from ..units import format_bytes
from ..decide.solver import min_budget_bytes, solve
from ..decide.under_plan import as_plain, time_factors
from ..errors import InfeasibleBudgetError
from ..measure.model_profile import ModelProfile, refused_actions
from ..segments import split_call
from ..tensors import infer_batch_size, tensors_in
from .steady_state import StateSizes, state_growth
from .warmup import SteadyRule

__all__ = ["AutoPlanner", "BatchKey", "StepInputs", "StepKind", "Verdict", "guard_action"]

log = logging.getLogger(__name__)


class StepKind(str, enum.Enum):
    """What a training step does under ``policy="auto"`` (Note [Auto: observe, plan, check])."""

    GUARD = "guard"
    #: Not a step's kind but a decision due first: the guard steps' verdict (broadcast).
    VERDICT = "verdict"
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


@dataclass(frozen=True)
class Verdict:
    """The guard steps' verdict, decided on the main process and broadcast: what the next steps
    do (``OBSERVE`` plain, ``PLAN`` from the guard step's profile, ``GUARD`` again or ``RUN`` the
    lowest-memory plan), plain's predicted peak (or bound) and the lowest-memory plan's measured
    peak (Note [Observe only what fits])."""

    decision: StepKind
    plain_bound_bytes: Optional[int]
    least_bytes: Optional[int]
    #: ``PLAN``: the batch size the profile was measured at (the largest of the processes'
    #: batches; a larger batch later guards again)
    batch_size: Optional[int] = None


def guard_action(device_type: str, config: SwapConfig = SwapConfig()) -> Action:
    """The action of the lowest-memory uniform plan (Note [Observe only what fits]): where
    offloaded bytes come back one op at a time (CPU with no prefetch: Note [Copy windows]),
    ``OFFLOAD``, whose backward never holds a segment's saved tensors all at once (measured on
    the tests' GPT and CNN: 5.1 and 1.8 MiB against ``RECOMPUTE_OFFLOAD``'s 6.1 and 3.1);
    elsewhere ``RECOMPUTE_OFFLOAD``, which copies only the segments' inputs and holds one
    segment's activations in its backward, where a prefetching offload holds two."""
    overlap = device_type == "cuda"
    prefetch, _ = copy_window(config.prefetch_segments, config.inflight_segments, overlap=overlap)
    return Action.OFFLOAD if on_demand(0, 2, prefetch, overlap=overlap) else Action.RECOMPUTE_OFFLOAD


# Note [Observe only what fits]: the profile that plans are solved from was first taken by
# observing a plain step (Note [Observe, do not re-run]), and a plain step can need several
# times the budget (2.4x on a 6-block MLP). So the first step on a new batch shape
# runs under the lowest-memory plan instead (:func:`guard_action` on every segment: if any plan
# fits, it does), measured, with its rows (Note [Measured rows]), and observed on every process
# as a step under that plan (Note [A step measured under a plan] in ``decide/under_plan.py``):
# its windows, and each segment measured alone, kept (Note [A segment measured alone]); the
# processes' profiles merge by their largest values (Note [Decide from the largest
# measurement]). Under FSDP no segment runs alone (every rank runs every collective: Note
# [Observe every rank] in ``observe.py``), so no profile is made there: the bound below. Guard steps go on while a step grows the state (the optimizer state
# appearing in the first optimizer step, gradients under accumulation), so the guard's peak is
# that of a steady step: the lowest-memory plan's minimum, measured, and the profile is a
# steady step's. From that profile the main process predicts plain's peak (exactly, on the
# tests' models and their LM: the cost model run backwards) and decides for every
# process before any of them runs the next step: ``OBSERVE`` plain when it fits (its profile is
# then exact), else ``PLAN`` the fastest mix that fits from the guard's profile. Where no
# profile could be made (a segment that cannot run alone, FSDP), plain's peak is bounded instead —
#
#     plain <= guard peak + recomputed bytes + offloaded bytes (segments and regions)
#
# (at every moment plain holds at most what the guard held plus the saved tensors the guard did
# not hold on the device). Every byte counts: the lowest-memory plan offloads the regions outside
# the segments too (the stem, the glue between blocks, the head's input, the loss: Note [Regions
# outside the segments] in ``model_profile.py``), and a model whose stem saves more than its
# blocks holds most of plain's activations there, so the step's offloaded bytes in all are
# added, not the segments' rows alone. Plain is observed only when the bound fits; otherwise the
# lowest-memory plan stays. Either way the guard's measured peak is within the budget, or
# InfeasibleBudgetError names it: nothing known uses less. ``training_step`` still runs once
# per step: the guard step is an ordinary step of training.
# Note [A step of several passes]: a step is everything from a training batch's start to its end
# (every forward, backward, closure call and optimizer step of that batch), and its window
# measures all of it. The profile and the cost model know one forward and one backward; a step
# that runs several backward passes (LBFGS or a SAM-style optimizer calling its closure again,
# two optimizers stepping in one manual ``training_step``, a second backward) is not predicted by
# them. So when a guard step ran several, the lowest-memory plan, measured over the whole step,
# is what ``auto`` keeps for that shape: guarded until the state is steady (the infeasible check
# applies to that steady peak), then run, with one WARNING that says why. Such steps are not
# planned pass by pass.
@dataclass
class _Guard:
    """The guard steps on one batch shape (Note [Observe only what fits])."""

    batch: BatchKey
    peak: int = 0  # the largest measured peak of a guard step
    backward_peak: Optional[int] = None  # the same up to the end of the backward
    forward_peak: Optional[int] = None  # the same up to the start of the backward
    grown_forward: int = 0  # what the last guard step grew the state by, as a steady forward holds it
    held: int = 0  # the saved bytes the lowest-memory plan did not hold: recomputed, offloaded (regions included)
    grown: int = 0  # what the last guard step grew the state by, as a steady backward holds it
    bound: Optional[int] = None  # plain's bound, once a guard step began in the steady state
    least: Optional[int] = None  # the lowest-memory plan's steady peak (from the verdict)
    start: StateSizes = StateSizes()  # the state the running guard step began with
    plan: Plan = field(default_factory=lambda: Plan(actions={}))  # the lowest-memory plan it ran (Note [Refused actions])
    decision: Optional[StepKind] = None
    open: bool = False
    passes: int = 1  # the most backward passes a guard step ran (Note [A step of several passes])
    #: The steady guard step's profile as plain's (the largest of every process's; None: not made)
    profile: Optional[ModelProfile] = None

    def covers(self, batch: BatchKey) -> bool:
        return self.batch.shape == batch.shape and batch.size <= self.batch.size

    @property
    def steady(self) -> bool:
        return self.bound is not None


# Note [A plan's first step refines its profile]: the guard's profile predicts plain's windows
# from a step in which no segment was kept; each segment's rise when kept was measured alone,
# where small things differ from the step (when a parameter's gradient is made, what the next
# segment still holds: a few KiB on the tests' CNN, 0.1-0.3% of ResNet-18's peak, always over).
# The first plan made from it is therefore observed too, on every process, under that plan
# (Note [A step measured under a plan]): its kept segments are measured in the step itself, so
# the profile made from it is nearer to what plain and the plans near it hold. The check of that
# plan is made against the refined profile, and the plan is solved again from it (a budget at
# plain's peak gets every segment kept). Once per guard profile: later plans are checked only.
# Note [Re-plan from the steady state]: the times that price plans come from warm runs (each
# segment timed alone after the guard steps, medians: Note [Planning costs a few steps] in
# ``observe.py``), not from the first step, but they are still a few runs of a shared machine,
# and ``RECOMPUTE`` is priced at its forward. So once a plan has run ``REVISIT_AFTER_STEPS``
# steps after its check, the median of their measured step times (with what recomputation and
# exposed copies took in them) is compared with the plan's prediction. Within
# ``REVISIT_TOLERANCE`` the plan stays. Otherwise the profile's times are re-priced by what was
# measured (:func:`~..decide.under_plan.time_factors`: the plain part, recomputation and copies
# each by its own factor) and the plan solved again; the new plan replaces the old only when it
# is predicted ``REPLAN_GAIN`` faster than the old one re-priced (hysteresis: two plans of
# nearly equal cost do not alternate), and a profile's plans are revisited ``MAX_REVISITS``
# times at most. The step that revisits is decided from the step count, which every process
# sees alike, and solved on the main process like every plan; the log says why a re-plan
# happened, with the numbers.
REVISIT_AFTER_STEPS = 5
REVISIT_TOLERANCE = 0.15
MAX_REVISITS = 2
REPLAN_GAIN = 0.05
# Note [Auto's times in a fresh model's first steps]: auto reads times within a run's first
# dozen steps: the observed (or guard) step's own time, each segment timed alone right after
# it, and the revisit's ``REVISIT_AFTER_STEPS`` steps. On a CPU that pays for denormals a fresh
# model's first steps run several times slower (Note [Steady before timing] in ``warmup.py``).
# Such a transient lies mostly in the loss and the head's backward, outside every segment, so
# it adds the same time to every plan and changes no choice; what it changes is the plan's
# predicted step time, which the revisit then reads against steadier steps. On a GPU it does
# not arise: fp32 denormals run at full rate, and the first-call costs (the allocator's growth,
# kernel selection) fall in the first step of a batch shape, the guard or observed step, whose
# time prices no segment (segments are timed alone afterwards, medians). So, on any device: a
# revisit whose steps are still changing (the last more than ``REVISIT_TOLERANCE`` from the one
# two steps before: a transient's decay, or a neighbour's burst; Note [Steady before timing]
# with windows of one step, all five steps allow) neither re-prices nor re-plans, and the log
# says so; the state machine is unchanged (such a revisit counts as one that kept the plan).
_REVISIT_STEADY = SteadyRule(window=1, tolerance=REVISIT_TOLERANCE, max_steps=REVISIT_AFTER_STEPS)


def _still_changing(times: Sequence[tuple[float, float, float]]) -> bool:
    """Note [Auto's times in a fresh model's first steps]: the revisit's step times (the first of
    each tuple) are not steady; logged."""
    if _REVISIT_STEADY.steady([t[0] for t in times]):
        return False
    log.info("lightning-swap: the plan's last %d steps took %s ms, still changing: the plan is not re-priced from them.",
             len(times), ", ".join(f"{t[0]:.0f}" for t in times))
    return True


def _choice(plan: Plan) -> tuple[dict, dict, dict]:
    """What a plan chose, by value: its segments' actions, its regions', and the ops its selective
    segments save (Note [Lighter selective] in ``measure/profiler.py``)."""
    return dict(plan.actions), dict(plan.outside), dict(plan.selective_ops)


# Note [Plans per batch shape]: real training changes the batch's shape (dynamic padding pads
# each batch to its own longest sequence; the last batch of an epoch is smaller), and what a
# step holds depends on it. So everything the table above knows and decides is kept per shape
# (the batch's shapes and dtypes past the batch dimension; a larger batch of a shape is guarded
# again, a smaller one runs that shape's plan): its guard steps and verdict, its profile, its
# plan, its check and revisits, in a :class:`_Shape`. A shape that comes back finds its own: it
# is never guarded again, and its plan, already checked, is installed as it was (a ``PLAN``
# step whose plan is the one remembered: the session applies it where another is installed)
# rather than solved again. What holds for every shape stays on the planner: the budget, the
# correction the checks learned (a miss of the model on one shape is assumed on all), the
# refusals, and the state the last guard step ended with (gradients and optimizer state have
# no shape). The shapes are an LRU of ``MAX_SHAPES``: a run with more shapes than that guards
# a forgotten one again (and, guarding at every step, says so: Note [Say why the lowest-memory
# plan stays]). A revisit reads the plan's last ``REVISIT_AFTER_STEPS`` steps, which must all
# be its shape's: a step of another shape starts its count again.
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
@dataclass(eq=False)
class _Shape:
    """What ``auto`` knows and decided for one batch shape (Note [Plans per batch shape])."""

    shape: Optional[tuple]
    guard: Optional[_Guard] = None
    profile: Optional[ModelProfile] = None  # the main process's: plans are solved from it
    profile_shape: Optional[tuple] = None  # every process: plans come from a profile of this shape
    profile_batch: int = 0
    scalable: bool = False  # the profile predicts other batch sizes (a batch-size search's)
    planned_batch: int = 0
    observed_state: StateSizes = StateSizes()
    signature: Optional[tuple[int, int]] = None
    planned_state: int = 0
    plan_due: bool = True  # no plan made for the profile in use (or none at all)
    current: Optional[Plan] = None  # the last plan applied
    last_applied: Optional[tuple[Plan, int]] = None
    check_pending: bool = False
    #: Note [A check is of its own batch]: a step ran the plan at its own batch size and a
    #: ``plan()`` heard its peak (every process knows), and that peak (the main process's).
    checkable: bool = False
    check_peak: Optional[int] = None
    #: Note [Re-plan from the steady state]: steps the current plan ran since its check, the
    #: revisits of this profile, whether this step revisits, and the plans a revisit kept.
    steps_run: int = 0
    revisits: int = 0
    revisit_due: bool = False
    settled: list[tuple] = field(default_factory=list)
    #: Note [A plan's first step refines its profile]: the next plan applied is observed (every
    #: process), this one is, and its step's profile has replaced the guard's.
    refinable: bool = False
    refine_due: bool = False
    refined: bool = False
    applied_state: StateSizes = StateSizes()
    refusals_planned: int = 0  # how many refusals the last plan knew of
    #: The plan stays as it is; only installed again, the step after another shape's.
    reinstall: bool = False


#: Note [Plans per batch shape]: the batch shapes remembered, the least recently used forgotten.
MAX_SHAPES = 16


def _fits_in(small: tuple, large: tuple) -> bool:
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


def _elements(shape: tuple) -> int:
    """The elements of one sample of a batch shape (for choosing the nearest larger shape)."""
    return sum(math.prod(dims) for dims, _ in shape)


def _check_size(s: _Shape) -> int:
    """Note [A check is of its own batch]: the batch size a step must run ``s``'s plan at to
    check it (the size the plan was made for)."""
    made_for = s.current.batch_size if s.current is not None else None
    return made_for or s.planned_batch


# Note [Say why the lowest-memory plan stays]: the lowest-memory plan is the slowest; a user who
# gave a budget it runs well within should not find out from the step times alone. When more
# than ``LEAST_STEPS_BEFORE_WARNING`` steps in a row ran it (guard steps, or the plan kept after a
# verdict) while its measured peak left at least ``LEAST_HEADROOM`` of the budget unused, one
# WARNING names the reason, from what the planner knows: no profile to plan from (plain's peak
# only bounded, over the budget), a batch shape new at every step (more than ``MAX_SHAPES``), or
# guard steps that never began in the steady state. Once per planner; a step of several passes
# has its own warning (Note [A step of several passes]).
LEAST_STEPS_BEFORE_WARNING = 4
LEAST_HEADROOM = 0.05


class AutoPlanner:
    """The ``policy="auto"`` decisions of one session (Note [Auto: observe, plan, check]),
    from values (Note [Auto decides from values]).

    ``budget_bytes``: the budget plans are solved for (``None``: none, every segment is kept);
    ``segments``: the names plans act on; ``config``: the copy windows plans are priced for;
    ``grads_freed_before_backward``: the loop frees the gradients between forward and backward
    (Lightning's closure calls ``zero_grad`` there), so the steady backward does not hold them;
    ``device_type``: where the steps run (the guard's plan depends on it: :func:`guard_action`).
    """

    def __init__(
        self, *, budget_bytes: Optional[int], segments: Sequence[str], config: SwapConfig = SwapConfig(),
        grads_freed_before_backward: bool = False, device_type: str = "cpu", actions: Optional[Sequence[Action]] = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        #: The actions plans may use (``None``: all; Note [Selective around FSDP hooks]).
        self.actions = None if actions is None else tuple(actions)
        self.segments = tuple(segments)
        self.config = config
        self.grads_freed_before_backward = grads_freed_before_backward
        self.device_type = device_type
        self.guard_action = guard_action(device_type, config)
        #: Note [Plans per batch shape]: what is known and decided for each batch shape seen last
        #: (least recently used first), and the shape of the step running now.
        self._shapes: OrderedDict[tuple, _Shape] = OrderedDict()
        self._s = _Shape(None)
        #: Note [A check is of its own batch]: (the shape whose plan ran, ``None`` where none did;
        #: the batch size) of the step running and of the one before; the shape whose plan (or
        #: kept lowest-memory plan) the session has installed.
        self._running: tuple[Optional[_Shape], int] = (None, 0)
        self._previous: tuple[Optional[_Shape], int] = (None, 0)
        self._installed: Optional[_Shape] = None
        self._warned_passes = False
        self._adopt_shape = False
        self._observing: Optional[BatchKey] = None
        self._guard_end: Optional[StateSizes] = None  # the state the last guard step ended with
        #: Bytes the measured peaks exceeded the predictions by, learned from the checks.
        self.correction_bytes = 0
        #: Plain training's peak as the last guard verdict predicted (or bounded) it.
        self.plain_predicted_bytes: Optional[int] = None
        #: Segment -> why its recomputation cannot run as planned, as the session's steps found
        #: (Note [Refused actions] in ``model_profile.py``): never planned, offloaded when guarding.
        self.refusals: dict[str, str] = {}
        #: Note [Say why the lowest-memory plan stays]: its steps in a row, and whether it was said.
        self._least_steps = 0
        self._least_shapes: set[tuple] = set()  # the shapes of those steps
        self._least_now = False  # this step runs the lowest-memory plan a verdict kept
        self._guard_peak: Optional[int] = None  # the last guard step's measured peak
        self._warned_least = False

    @property
    def profile(self) -> Optional[ModelProfile]:
        """The profile the current batch shape's plans are solved from (the main process's)."""
        return self._s.profile

    @profile.setter
    def profile(self, value: Optional[ModelProfile]) -> None:
        self._s.profile = value

    @property
    def check_pending(self) -> bool:
        """The plan applied last has not been checked yet: the step running it is measured."""
        return self._s.check_pending

    @property
    def refine_due(self) -> bool:
        """The plan just applied is the first made from a guard step's profile: its first step is
        observed under it (every process) and refines the profile (Note [A plan's first step
        refines its profile])."""
        return self._s.refine_due

    @property
    def revisit_due(self) -> bool:
        """This step's plan is solved again from the steady state's measured times (Note
        [Re-plan from the steady state]): the session hands :meth:`plan` those times."""
        return self._s.revisit_due

    # -- what the next step does ---------------------------------------------------------
    def next_step(self, step: StepInputs) -> StepKind:
        """The decision table (Note [Auto: observe, plan, check]), for the step's batch shape
        (Note [Plans per batch shape])."""
        if self.budget_bytes is None or not self.segments:
            return StepKind.PLAN if self._s.plan_due else StepKind.RUN
        self._enter(step.batch.shape, step.batch.size)
        self._least_now = False
        kind = self._decide(step)
        if kind is StepKind.RUN and self._installed is not self._s:
            self._s.reinstall = True  # another shape's plan is installed: this shape's, as it was
            kind = StepKind.PLAN
        if kind is not StepKind.VERDICT:  # the step's kind is decided: it runs now
            ran, size = self._running
            if kind is StepKind.PLAN and ran is not None and ran.check_pending and size >= _check_size(ran):
                ran.checkable = True  # Note [A check is of its own batch]: this plan() hears that step's peak
            self._previous = self._running
            self._running = (self._s if kind in (StepKind.RUN, StepKind.PLAN) else None, step.batch.size)
            self._count_least(kind, step.batch)
        return kind

    def _enter(self, shape: tuple, size: int = 0) -> None:
        """Note [Plans per batch shape]: ``shape``'s state becomes the current one (made when the
        shape is new: from a planned shape it fits in, Note [A smaller shape runs a larger one's
        plan], else afresh; the least recently used forgotten beyond ``MAX_SHAPES``)."""
        s = self._s
        if self._adopt_shape or s.shape is None:  # a profile adopted for the next step's shape, or the first step
            if self._shapes.get(s.shape) is s:
                del self._shapes[s.shape]
            s.shape = shape
        elif s.shape != shape:
            s = self._shapes.get(shape) or self._within_planned(shape, size) or _Shape(shape)
            s.steps_run = 0  # a revisit reads the plan's last steps, which must all be this shape's
        self._shapes[shape] = s
        self._shapes.move_to_end(shape)
        while len(self._shapes) > MAX_SHAPES:
            self._shapes.popitem(last=False)
        self._s = s

    def _within_planned(self, shape: tuple, size: int) -> Optional[_Shape]:
        """Note [A smaller shape runs a larger one's plan]: a new shape's state, taken from the
        smallest remembered shape that holds it and has a checked plan of its own; ``None``: none."""
        best = None
        for m in self._shapes.values():
            if (
                m.current is None or m.plan_due or m.check_pending or m.profile_shape != m.shape
                or (size > m.profile_batch and not m.scalable) or not _fits_in(shape, m.shape)
            ):
                continue
            if best is None or _elements(m.shape) < _elements(best.shape):
                best = m
        if best is None:
            return None
        return replace(
            best, shape=shape, profile_shape=shape, guard=None, settled=list(best.settled), revisits=MAX_REVISITS,
            revisit_due=False, refine_due=False, refinable=False, refined=False, checkable=False, check_peak=None, reinstall=False,
        )

    def _decide(self, step: StepInputs) -> StepKind:
        batch = step.batch
        if self._adopt_shape:  # a profile made elsewhere (a batch-size search): this batch's shape
            self._adopt_shape = False
            self._s.profile_shape, self._s.planned_batch = batch.shape, batch.size
            return StepKind.PLAN
        if self._s.profile_shape is None or batch.shape != self._s.profile_shape:
            return self._observe_or_guard(batch)
        if batch.size > self._s.profile_batch and not self._s.scalable:
            return self._observe_or_guard(batch)
        if self._s.scalable and batch.size != self._s.planned_batch:
            self._s.planned_batch = batch.size
            return StepKind.PLAN  # a profile measured at two batch sizes rescales (Note [Batch scaling])
        if self._s.plan_due or len(self.refusals) != self._s.refusals_planned:
            return StepKind.PLAN  # ... or a segment refused an action since (Note [Refused actions])
        if self._s.check_pending:
            ran, size = self._running
            if (
                self._s.checkable or (ran is self._s and size >= _check_size(ran))
                or step.state.total_bytes > self._s.planned_state
            ):
                return StepKind.PLAN
            return StepKind.RUN  # Note [A check is of its own batch]: not yet measured at its own batch size
        if step.state.signature != self._s.signature:
            self._s.signature = step.state.signature
            if step.state.total_bytes > self._s.planned_state:
                return StepKind.PLAN
        return self._run_or_revisit()

    def _count_least(self, kind: StepKind, batch: BatchKey) -> None:
        """Note [Say why the lowest-memory plan stays]."""
        if kind is not StepKind.GUARD and not self._least_now:
            self._least_steps, self._least_shapes = 0, set()
            return
        self._least_steps += 1
        self._least_shapes.add(batch.shape)
        guard = self._s.guard
        least = guard.least if self._least_now else self._guard_peak
        if (
            self._warned_least or self._warned_passes or self._least_steps <= LEAST_STEPS_BEFORE_WARNING
            or least is None or least > (1 - LEAST_HEADROOM) * self.budget_bytes
        ):
            return
        self._warned_least = True
        if self._least_now:
            why = (
                f"no profile could be made from the step measured under it (a segment that cannot run alone, "
                f"or a sharded model, whose segments never run alone), and plain training's peak, bounded at "
                f"{format_bytes(self.plain_predicted_bytes or 0)}, may exceed the budget"
            )
        elif len(self._least_shapes) > 1:
            why = (
                f"the batch shape was new in each of the last {self._least_steps} steps ({len(self._least_shapes)} "
                f"shapes; {MAX_SHAPES} are remembered), and a new shape is guarded: pad batches to a few lengths"
            )
        else:
            why = (
                "the gradients or the optimizer state grew in every guard step, so no steady step was measured "
                "to plan from"
            )
        log.warning(
            "lightning-swap: policy='auto' ran the lowest-memory plan (every segment %s) for %d steps, measured at "
            "%s within a budget of %s: %s.", self.guard_action.value, self._least_steps, format_bytes(least),
            format_bytes(self.budget_bytes), why,
        )

    def _run_or_revisit(self) -> StepKind:
        """Note [Re-plan from the steady state]: the plan's ``REVISIT_AFTER_STEPS`` steps after its
        check are measured; the step after them revisits it (once per plan, a few per profile)."""
        self._s.steps_run += 1
        if (
            self._s.steps_run > REVISIT_AFTER_STEPS and self._s.revisits < MAX_REVISITS and self.profile_made_here
            and self._s.current is not None and self._s.current.predicted_step_ms is not None
            and _choice(self._s.current) not in self._s.settled
        ):
            self._s.revisit_due = True
            return StepKind.PLAN
        return StepKind.RUN

    @property
    def profile_made_here(self) -> bool:
        """Every process knows whether the plans come from a profile of this run's steps (a
        guard's or an observed one's), not from a batch-size search's (whose steps were others)."""
        return not self._s.scalable

    # -- guarding (Note [Observe only what fits]) ------------------------------------------
    def _observe_or_guard(self, batch: BatchKey) -> StepKind:
        guard = self._s.guard
        if guard is None or not guard.covers(batch):
            return StepKind.GUARD
        if guard.decision is None:
            return StepKind.VERDICT  # after every guard step, on every process: the main process decides
        self._least_now = guard.decision is StepKind.RUN  # the lowest-memory plan stays for this shape
        return guard.decision

    def guard_plan(self) -> Plan:
        """The lowest-memory plan (``Plan.lowest_memory``: :func:`guard_action` on every segment,
        the regions outside them offloaded); a segment whose recomputation was refused is
        offloaded instead (Note [Refused actions])."""
        refused = {split_call(name)[0] for name, why in self.refusals.items() if Action.RECOMPUTE_OFFLOAD in refused_actions(why)}
        return Plan.lowest_memory(self.segments, refused, action=self.guard_action)

    def begin_guard(self, step: StepInputs) -> Plan:
        """The lowest-memory plan for this step; :meth:`end_guard` takes what it measured."""
        if self._s.guard is None or not self._s.guard.covers(step.batch):
            self._s.guard = _Guard(step.batch)
        self._s.guard.start, self._s.guard.decision, self._s.guard.open = step.state, None, True
        self._s.guard.plan = self.guard_plan()  # what it runs, refusals known (Note [Refused actions])
        self._installed = self._s
        return self._s.guard.plan

    def guard_forward_done(self, peak_bytes: int) -> None:
        """The guard step's peak up to the start of its backward (the loss computed)."""
        self._s.guard.forward_peak = max(self._s.guard.forward_peak or 0, peak_bytes)

    def guard_passes(self, passes: int) -> None:
        """How many backward passes the guard step ran (Note [A step of several passes])."""
        self._s.guard.passes = max(self._s.guard.passes, passes)

    def guard_backward_done(self, peak_bytes: int) -> None:
        """The guard step's peak up to the end of its backward (its optimizer step not yet run)."""
        self._s.guard.backward_peak = max(self._s.guard.backward_peak or 0, peak_bytes)

    def end_guard(
        self, peak_bytes: Optional[int], rows: Optional[Sequence[Any]], state: StateSizes, *, offloaded_bytes: Optional[int] = None,
    ) -> None:
        """A guard step is over: its measured peak, the rows it measured (each segment's
        ``recomputed_bytes`` and ``offloaded_bytes``), the state alive after it, and the bytes the
        step offloaded in all (the segments' and the regions' outside them: Note [Observe only
        what fits]; ``None``: the rows' alone). Guarding goes
        on while the step grew the state (the optimizer state appearing in the first optimizer
        step, the gradients of accumulation): the peak that counts is that of a step that begins
        in the steady state, so the lowest-memory plan's minimum is measured, not predicted.
        :attr:`guard_steady` says whether this one was such a step."""
        guard = self._s.guard
        guard.open = False
        if peak_bytes is None or not rows:
            return  # nothing measured: the verdict is to guard again
        guard.peak = max(guard.peak, peak_bytes)
        self._guard_peak = peak_bytes
        offloaded = max(sum(r.offloaded_bytes for r in rows), offloaded_bytes or 0)
        guard.held = max(guard.held, sum(r.recomputed_bytes for r in rows) + offloaded)
        # What a step that began with the state alive now would add in its backward.
        guard.grown_forward, guard.grown = state_growth(guard.start, state, grads_freed_before_backward=self.grads_freed_before_backward)
        # Steady once a step ends with no more state than the previous guard step ended with
        # (gradients freed between steps by ``zero_grad`` come back every step: not growth).
        previous, self._guard_end = self._guard_end, state  # the state has no shape: kept across guards
        if (
            previous is not None and state.gradient_bytes <= previous.gradient_bytes
            and state.optimizer_bytes <= previous.optimizer_bytes
        ):
            guard.bound = guard.peak + guard.held

    @property
    def guard_steady(self) -> bool:
        """The guard step that just ended began in the steady state: its profile is the one to
        plan from (every process makes it: :meth:`guard_observed`)."""
        return self._s.guard is not None and self._s.guard.steady

    def guard_observed(self, profile: Optional[ModelProfile]) -> None:
        """Every process: the steady guard step observed under the lowest-memory plan (its
        windows as measured: Note [A step measured under a plan]); ``None``: no profile."""
        if profile is not None:
            profile = self._held_gradients(self._as_plain(profile, self._s.guard.plan), self._s.guard.start)
        self._s.guard.profile = profile

    def _held_gradients(self, profile: ModelProfile, start: StateSizes) -> ModelProfile:
        """Note [Steady-state shift] under accumulation: a step observed with gradients alive may
        have freed them before its backward (Lightning's first micro-batch of a cycle calls
        ``zero_grad`` there) while the next micro-batch's backward accumulates into them; where
        the loop does not free them before every backward, the observed backward is priced as
        holding them (over for a first micro-batch, never under)."""
        if self.grads_freed_before_backward or not start.gradient_bytes:
            return profile
        return profile.with_state(forward_bytes=0, backward_bytes=start.gradient_bytes)

    def guard_verdict(self) -> Verdict:
        """What the next steps do, decided on the main process (the session broadcasts it).
        Raises :class:`InfeasibleBudgetError` as soon as a guard step was over the budget:
        nothing known uses less memory than it."""
        guard, budget = self._s.guard, self.budget_bytes
        least, plain = guard.peak, guard.bound
        if plain is None:
            # Not yet steady: a steady step's forward and backward hold what this one grew (the
            # optimizer step already ran with it, so its part of the peak stays); its forward
            # also the last step's gradients, which a loop may free only before the backward.
            backward = guard.peak if guard.backward_peak is None else guard.backward_peak
            forward = backward if guard.forward_peak is None else guard.forward_peak
            least = max(guard.peak, backward + guard.grown, forward + guard.grown_forward)
        if guard.peak > budget or (plain is not None and least > budget):
            raise InfeasibleBudgetError(budget_bytes=budget, min_budget_bytes=least, batch_size=guard.batch.size)
        if guard.passes > 1:  # Note [A step of several passes]: guarded until steady, then kept
            return Verdict(StepKind.GUARD if plain is None else StepKind.RUN, None, least)
        if plain is None:
            # The same bound on the predicted steady peak: when even that fits, plain is observed
            # at once rather than after a second guard step (a budget far above plain's peak runs
            # one step under the lowest-memory plan, not two).
            if least + guard.held <= budget:
                return Verdict(StepKind.OBSERVE, least + guard.held, least)
            return Verdict(StepKind.GUARD, None, least)
        if guard.profile is not None:  # plain predicted from the guard's profile
            self._s.profile, self._s.observed_state = guard.profile, guard.start
            predicted = self.steady_profile(guard.start).peak_bytes + self.correction_bytes
            if predicted > budget:
                return Verdict(StepKind.PLAN, predicted, least, guard.profile.batch_size)
            if guard.profile.batch_size == guard.batch.size:
                return Verdict(StepKind.OBSERVE, predicted, least)
            return Verdict(StepKind.GUARD, predicted, least)  # another process's batch was larger: guard on
        if plain <= budget:
            return Verdict(StepKind.OBSERVE, plain, least)
        return Verdict(StepKind.RUN, plain, least)

    def take_verdict(self, verdict: Verdict) -> None:
        """Every process, with the main process's verdict."""
        guard = self._s.guard
        decision = verdict.decision
        if decision in (StepKind.RUN, StepKind.PLAN) and dict(self.guard_plan().actions) != dict(guard.plan.actions):
            # A segment refused the recomputation the guard plan gave it (it ran on a copy of its
            # input): guard once more with it offloaded, and keep or plan from that step (Note
            # [Refused actions]).
            decision = StepKind.GUARD
        guard.decision, guard.least = decision, verdict.least_bytes
        self.plain_predicted_bytes = verdict.plain_bound_bytes
        if decision is StepKind.PLAN:  # plans from the guard's profile (on the main process)
            guard.decision = StepKind.GUARD  # a batch it covers but the profile does not: guarded again
            self._adopt(BatchKey(guard.batch.shape, verdict.batch_size or guard.batch.size), guard.start)
            self._s.refinable = True
            log.info(
                "lightning-swap: plain training is predicted to need %s, over the budget of %s: planning from the "
                "step measured under the lowest-memory plan (%s).", format_bytes(verdict.plain_bound_bytes),
                format_bytes(self.budget_bytes), format_bytes(verdict.least_bytes),
            )
        elif decision is StepKind.RUN and verdict.plain_bound_bytes is None:
            self._warn_passes(verdict.least_bytes)
        elif decision is StepKind.RUN:
            log.info(
                "lightning-swap: plain training may need up to %s, over the budget of %s: every segment stays "
                "%s (measured %s) rather than observe a step that would not fit.",
                format_bytes(verdict.plain_bound_bytes), format_bytes(self.budget_bytes), self.guard_action.value,
                format_bytes(verdict.least_bytes),
            )

    def _warn_passes(self, least: Optional[int]) -> None:
        if self._warned_passes:
            return
        self._warned_passes = True
        log.warning(
            "lightning-swap: a training step ran %d backward passes (a closure optimizer such as LBFGS or SAM, several "
            "optimizers, a second backward): policy='auto' plans one forward and one backward, so it keeps the "
            "lowest-memory plan (every segment %s, measured %s over the whole step, within the budget of %s). "
            "A forced policy may be faster: e.g. policy='offload'.", self._s.guard.passes, self.guard_action.value,
            format_bytes(least or 0), format_bytes(self.budget_bytes),
        )

    def _adopt(self, batch: BatchKey, state: StateSizes) -> None:
        """Every process: plans are made from now on from a profile of a step on ``batch`` that
        began with ``state`` (the main process holds the profile)."""
        self._s.profile_shape, self._s.profile_batch, self._s.planned_batch = batch.shape, batch.size, batch.size
        self._s.scalable, self._s.observed_state = False, state
        self._s.plan_due, self._s.check_pending, self._s.revisits, self._s.settled = True, False, 0, []
        self._s.refinable, self._s.checkable, self._s.check_peak = False, False, None

    @property
    def guarding(self) -> bool:
        """A guard step is running: its measurements are taken when it is over."""
        return self._s.guard is not None and self._s.guard.open

    @property
    def guard_measured(self) -> tuple[Optional[int], Optional[int]]:
        """The lowest-memory plan's measured steady peak and the batch size it ran at."""
        return (None, None) if self._s.guard is None else (self._s.guard.least, self._s.guard.batch.size)

    # -- observing ------------------------------------------------------------------------
    def begin_observe(self, step: StepInputs) -> None:
        """Every process, as the observed step begins (each traces it): what was observed is
        recorded everywhere, so that all take the same decisions afterwards."""
        self._adopt(step.batch, step.state)
        self._observing = step.batch
        self._installed = None  # the step runs plain

    def finish_observe(self, profile: ModelProfile) -> None:
        """Every process: the observed step's profile (the largest over the processes), which the
        next plans are solved from."""
        self.set_profile(profile, self._observing)

    def set_profile(self, profile: ModelProfile, batch: Optional[BatchKey], *, steady: bool = False) -> None:
        """Use ``profile`` (of a step on ``batch``; ``None``: on the next step's) from now on: the
        next step plans. ``steady``: it was measured in the steady state (a batch-size search
        warms up first), so no shift is added; a profile measured at two batch sizes is used at
        any."""
        if batch is not None and self._s.shape not in (None, batch.shape):
            self._enter(batch.shape)
        self._s.profile = profile
        self._adopt_shape = batch is None
        self._s.profile_shape = None if batch is None else batch.shape
        self._s.profile_batch = profile.batch_size
        self._s.scalable = profile.reference is not None
        self._s.planned_batch = profile.batch_size if batch is None else batch.size
        if steady:
            self._s.observed_state = StateSizes(1 << 62, 1 << 62)
        self._s.plan_due, self._s.check_pending, self._s.revisits, self._s.settled = True, False, 0, []
        self._s.checkable, self._s.check_peak = False, None

    # -- planning --------------------------------------------------------------------------
    def steady_shift(self, state: StateSizes) -> tuple[int, int]:
        """(forward bytes, backward bytes) the state alive now adds to the observed step's
        (Note [Steady-state shift])."""
        return state_growth(self._s.observed_state, state, grads_freed_before_backward=self.grads_freed_before_backward)

    def steady_profile(self, state: StateSizes) -> ModelProfile:
        """The observed profile shifted to the state alive now (Note [Steady-state shift])."""
        forward, backward = self.steady_shift(state)
        return self._s.profile.with_state(forward_bytes=forward, backward_bytes=backward)

    def plan(
        self, state: StateSizes, measured_peak_bytes: Optional[int] = None, step_times: Sequence[tuple[float, float, float]] = (),
    ) -> Plan:
        """The plan for the steps to come (the main process; the session broadcasts it).
        ``measured_peak_bytes``: the newest step's measured peak, the check of the plan applied
        last when one is pending; ``step_times``: when :attr:`revisit_due`, the measured (step,
        recomputation, exposed copies) milliseconds of the plan's last steps."""
        s = self._s
        s.refusals_planned = len(self.refusals)
        if self.budget_bytes is None or not self.segments:
            return Plan(actions={name: Action.KEEP for name in self.segments})
        ran = self._previous[0]
        if ran is not None and ran.checkable and ran.check_peak is None:
            ran.check_peak = measured_peak_bytes  # Note [A check is of its own batch]: that step's
        if s.reinstall:
            return self._installed_plan()
        if s.revisit_due:
            return self._revisit(state, step_times)
        grown = state.total_bytes > s.planned_state
        if s.check_pending and s.current is not None and s.current.predicted_peak_bytes is not None:
            measured = s.check_peak if s.checkable else None
            s.check_pending = False
            if s.refined:
                s.refined = False
                return self._after_refinement(state, measured, grown)
            if measured is not None and self._checked(measured, grown):
                return s.current
        return self._solve(state)

    def _installed_plan(self) -> Plan:
        """Note [Plans per batch shape]: the plan this shape ran last, installed again after another
        shape's step: its current plan, or the lowest-memory plan where that stays."""
        guard = self._s.guard
        if self._least_now or self._s.current is None:
            return replace(guard.plan, predicted_peak_bytes=guard.least, budget_bytes=self.budget_bytes, batch_size=guard.batch.size)
        return self._s.current

    def _after_refinement(self, state: StateSizes, measured: Optional[int], grown: bool) -> Plan:
        """Note [A plan's first step refines its profile]: the plan is checked against the refined
        profile (a miss learned as a correction) and solved again from it; a plan measured within
        the budget stays unless the re-solved one is predicted faster."""
        current, priced = self._s.current, self._as_run(self._s.current)
        refined = self._profile_for(self._s.applied_state)
        stays = measured is not None and not grown and measured <= self.budget_bytes
        if measured is not None and not grown:
            self.correction_bytes = max(self.correction_bytes, measured - simulate(refined, current.actions, **priced).peak_bytes)
        fresh = self._solve(state)
        if stays and fresh.predicted_step_ms >= simulate(self._profile_for(state), current.actions, **priced).step_ms:
            return current
        return fresh

    def refine(self, profile: Optional[ModelProfile]) -> None:
        """Every process: the first step of the plan applied last, observed under it (Note [A
        plan's first step refines its profile]); ``None``: no profile, the guard's stays, as it
        does when the step's batch was not the profile's (a smaller last batch)."""
        if profile is not None and profile.batch_size == self._s.profile_batch:
            self._s.profile = self._held_gradients(self._as_plain(profile, self._s.current), self._s.applied_state)
            self._s.observed_state, self._s.refined = self._s.applied_state, True

    def _checked(self, measured: int, grown: bool) -> bool:
        """The check of the plan applied last against its first step's ``measured`` peak: whether
        it stays. A miss is learned only when nothing else explains it: gradients or optimizer
        state that grew since the plan was made are priced by the re-plan (Note [Steady-state
        shift]), not stored as a permanent correction."""
        budget, predicted = self.budget_bytes, self._s.current.predicted_peak_bytes
        if not grown:
            self.correction_bytes = max(self.correction_bytes, measured - predicted)
        if measured <= budget and not grown:
            return True
        if measured > budget:
            log.info(
                "lightning-swap: the plan's first step peaked at %s, over the budget of %s (predicted %s); "
                "planning again for %s less.", format_bytes(measured), format_bytes(budget),
                format_bytes(predicted), format_bytes(self.correction_bytes),
            )
        else:
            log.info(
                "lightning-swap: the gradients or optimizer state grew since the plan was made (its first "
                "step peaked at %s, within the budget of %s); planning again for the state alive now.",
                format_bytes(measured), format_bytes(budget),
            )
        return False

    def _profile_for(self, state: StateSizes) -> ModelProfile:
        profile = self.steady_profile(state).refusing(self.refusals)
        if self._s.scalable and self._s.planned_batch != profile.batch_size:
            profile = profile.at_batch(self._s.planned_batch)
        return profile

    def _solve(self, state: StateSizes, profile: Optional[ModelProfile] = None) -> Plan:
        """The fastest plan within the budget less what the checks learned; where the model finds
        none but the guard's measured peak fits, the lowest-memory plan."""
        budget = self.budget_bytes
        allowed = dict(copy_window_of(self.config), actions=self.actions)  # Note [Selective around FSDP hooks]
        profile = profile if profile is not None else self._profile_for(state)
        effective = budget - self.correction_bytes
        try:
            if effective <= 0:
                raise InfeasibleBudgetError(budget_bytes=budget, min_budget_bytes=min_budget_bytes(profile, **allowed), batch_size=profile.batch_size)
            plan = solve(profile, budget_bytes=effective, **allowed)
        except InfeasibleBudgetError as err:
            least = self._guard_least(profile.batch_size)  # measured: what the guard step needs
            if least is not None and least <= budget:
                guard = self._s.guard.plan  # the plan that measured it
                return replace(
                    guard, predicted_peak_bytes=least, predicted_step_ms=simulate(profile, guard.actions, **self._as_run(guard)).step_ms,
                    budget_bytes=budget, batch_size=profile.batch_size,
                )
            least = err.min_budget_bytes + self.correction_bytes if least is None else least
            raise InfeasibleBudgetError(budget_bytes=budget, min_budget_bytes=least, batch_size=profile.batch_size) from None
        if effective != budget:
            plan = replace(plan, budget_bytes=budget)
        return plan

    def _as_run(self, plan: Plan) -> dict[str, Any]:
        """What prices ``plan`` as the runtime runs it (:func:`simulate`'s keywords): its regions
        outside the segments, and the copy windows the config sets, else those it was priced for."""
        window = copy_window_of(self.config)
        for key in ("prefetch_bytes", "inflight_bytes"):
            if window[key] is None or window[key] == AUTO_WINDOW:
                window[key] = getattr(plan, key)
        return dict(window, outside=dict(plan.outside), selective_ops=dict(plan.selective_ops))

    def _as_plain(self, profile: ModelProfile, plan: Plan) -> ModelProfile:
        """``profile``, observed under ``plan``, as plain's (Note [A step measured under a plan]):
        on CPU its regions outside the segments were measured as kept (Note [Regions held as kept])."""
        return as_plain(profile, plan.actions, regions_held=self.device_type != "cuda", **self._as_run(plan))

    def _guard_least(self, batch_size: int) -> Optional[int]:
        """The lowest-memory plan's measured steady peak, when a guard measured it for this shape
        and batch size (or a larger one)."""
        guard = self._s.guard
        if guard is None or guard.least is None or not guard.covers(BatchKey(self._s.profile_shape, batch_size)):
            return None
        return guard.least

    # -- Note [Re-plan from the steady state] ---------------------------------------------------
    def _revisit(self, state: StateSizes, step_times: Sequence[tuple[float, float, float]]) -> Plan:
        """The plan's measured steady steps against its prediction: within
        ``REVISIT_TOLERANCE`` it stays; else the profile is re-priced with the measured times
        and re-solved, and the new plan replaces the current one only when predicted faster by
        ``REPLAN_GAIN`` (hysteresis). Logged, with the numbers, either way it changes."""
        current = self._s.current
        times = [t for t in step_times if t[0] is not None and t[0] > 0]
        if len(times) < REVISIT_AFTER_STEPS or _still_changing(times):
            return current
        measured = tuple(statistics.median(t[i] or 0.0 for t in times) for i in range(3))
        predicted = current.predicted_step_ms
        if abs(measured[0] - predicted) <= REVISIT_TOLERANCE * predicted:
            return current
        priced = self._as_run(current)
        factors = time_factors(self._profile_for(state), current.actions, *measured, **priced)
        self._s.profile = self._s.profile.with_times(*factors)
        profile = self._profile_for(state)
        try:
            fresh = self._solve(state, profile)
        except InfeasibleBudgetError:
            fresh = current
        now = simulate(profile, current.actions, **priced).step_ms
        why = (
            f"its steady steps took {measured[0]:.1f} ms (median of {len(times)}), {100 * (measured[0] / predicted - 1):+.0f}% "
            f"from the {predicted:.1f} ms predicted"
        )
        if _choice(fresh) != _choice(current) and fresh.predicted_step_ms < (1 - REPLAN_GAIN) * now:
            log.info("lightning-swap: re-planning with the measured times: %s; the new plan is predicted at %.1f ms, "
                     "the current one at %.1f ms.", why, fresh.predicted_step_ms, now)
            return fresh
        log.info("lightning-swap: re-priced the plan with the measured times (%s); it stays (now predicted at %.1f ms).", why, now)
        return replace(current, predicted_step_ms=now)

    def applied(self, plan: Plan, state: StateSizes) -> None:
        """Every process, after applying ``plan``: what it was made for, and a check is due."""
        self._installed = self._s
        if self._s.reinstall:  # the shape's plan as it was, its check still pending where it was
            self._s.reinstall, self._s.refine_due = False, False
            return
        self._s.checkable, self._s.check_peak = False, None
        if self._s.revisit_due:
            self._s.revisit_due, self._s.revisits = False, self._s.revisits + 1
            if self._s.current is not None and _choice(plan) == _choice(self._s.current):
                self._s.settled.append(_choice(plan))
        self._s.signature, self._s.planned_state, self._s.applied_state = state.signature, state.total_bytes, state
        self._s.current, self._s.plan_due, self._s.steps_run = plan, False, 0
        self._s.refine_due, self._s.refinable = self._s.refinable and self.budget_bytes is not None, False
        # By value, with the state it was made for: on the other processes every broadcast plan
        # is a new object (unpickled), and an identity test there made every step a check, a
        # broadcast rank 0 never entered. A plan kept after its check comes back equal in the
        # same state; a re-plan is new in value or made for another state.
        made_for = (plan, self._s.planned_state)
        self._s.check_pending = plan.predicted_peak_bytes is not None and made_for != self._s.last_applied
        self._s.last_applied = made_for
