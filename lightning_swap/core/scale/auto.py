"""``policy="auto"`` over a training loop: when to observe a step, when to plan, when to check.

Note [Auto: observe, plan, check]: before every training step the session asks
:meth:`AutoPlanner.next_step` and gets a :class:`StepKind`:

- ``GUARD``: no profile covers this batch (the first step, or a batch larger or shaped
  differently than the one observed) and plain training is not known to fit the budget: the
  step runs under the lowest-memory plan, measured (Note [Observe only what fits]); after it
  the main process decides for every process (``VERDICT``, broadcast) what comes next;
- ``OBSERVE``: the guard steps bound plain's peak within the budget: the step runs with every
  segment kept and every process observes it (Note [Observe, do not re-run] in
  ``observe.py``; the profiles merge by their largest values: Note [Decide from the largest
  measurement] in ``collectives.py``);
- ``PLAN``: a plan is due: the first step after an observation (the profile is shifted to the
  state alive now, Note [Steady-state shift]), the step after a new plan's first step (the
  check below), or the gradients and optimizer state grew;
- ``RUN``: the installed plan runs (the lowest-memory one where plain's bound is over budget).

The answer depends only on what every data-parallel process sees alike (batch shapes, the
order of steps, the sizes of gradients and optimizer state), so all enter the plan's broadcast
together; the main process alone solves, from the largest of every process's measurements.

The check: the first step under a new plan is measured. If its peak exceeded the prediction,
the difference is learned (the model misses allocator rounding, workspaces, ...: it only grows)
and, if the peak also exceeded the budget, the plan is solved again with the budget less what
was learned — logged once, with the numbers. A plan that cannot be kept raises
:class:`~.errors.InfeasibleBudgetError` before it runs; its ``min_budget_bytes`` is the least
budget for the steady state (gradients and optimizer state included), plus what was learned.

Note [Auto decides from values]: the planner never sees the model, the optimizer or the
session. Its inputs are values — the budget, the segment names and the options when it is
made; per step a :class:`StepInputs` (the batch's shapes and size, the :class:`StateSizes`
alive); what a step measured (peaks, rows) when it is over — and its outputs are decisions (a
``StepKind``, a :class:`Verdict`, a :class:`~.plan.Plan`) that the session carries out. So
the decision table is tested from numbers (``tests/test_auto_decisions.py``), without a model.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

from ..actions import Action
from ..config import SwapConfig
from ..decide.costmodel import copy_window_of
from ..decide.plan import Plan, format_bytes
from ..decide.solver import min_budget_bytes, solve
from ..errors import InfeasibleBudgetError
from ..measure.model_profile import ModelProfile
from ..tensors import infer_batch_size, tensors_in
from .steady_state import StateSizes, state_growth

__all__ = ["AutoPlanner", "BatchKey", "StepInputs", "StepKind", "Verdict"]

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
    do (``OBSERVE``, ``GUARD`` again or ``RUN`` the lowest-memory plan), plain's bound and the
    lowest-memory plan's measured peak (Note [Observe only what fits])."""

    decision: StepKind
    plain_bound_bytes: Optional[int]
    least_bytes: Optional[int]


# Note [Observe only what fits]: the profile that plans are solved from is taken by observing a
# plain step (Note [Observe, do not re-run]), and a plain step can need several times the budget
# (issue 20: 2.4x on a 6-block MLP). So a plain step is observed only once it is known to fit.
# The first step on a new batch shape runs under the lowest-memory plan instead (every segment
# ``recompute_offload``: if any plan fits, it does), measured, with its rows (Note [Measured
# rows]): each segment's recomputed bytes (what keeping it would hold) and offloaded bytes.
# Guard steps go on while a step grows the state (the optimizer state appearing in the first
# optimizer step, gradients under accumulation), so the guard's peak is that of a steady step:
# the lowest-memory plan's minimum, measured. Plain's peak is bounded without running user code:
#
#     plain <= guard peak + sum over segments (recomputed + offloaded bytes)
#
# (at every moment plain holds at most what the guard held plus the saved tensors the guard did
# not hold on the device). Only when that bound is within the budget is
# the next step observed plainly; otherwise the lowest-memory plan stays (its measured peak is
# within the budget, or InfeasibleBudgetError names it: nothing uses less). The bound is decided
# on the main process and broadcast with the plans, so every process takes the same branch
# before any of them runs the step. ``training_step`` still runs once per step: the guard step is
# an ordinary step of training.
@dataclass
class _Guard:
    """The guard steps on one batch shape (Note [Observe only what fits])."""

    batch: BatchKey
    peak: int = 0  # the largest measured peak of a guard step
    backward_peak: Optional[int] = None  # the same up to the end of the backward
    held: int = 0  # the saved bytes the lowest-memory plan did not hold (recomputed + offloaded)
    grown: int = 0  # what the last guard step grew the state by, as a steady backward holds it
    bound: Optional[int] = None  # plain's bound, once a guard step began in the steady state
    least: Optional[int] = None  # the lowest-memory plan's steady peak (from the verdict)
    start: StateSizes = StateSizes()  # the state the running guard step began with
    refused: int = 0  # the refusals its plan knew of (Note [Refused actions])
    decision: Optional[StepKind] = None
    open: bool = False

    def covers(self, batch: BatchKey) -> bool:
        return self.batch.shape == batch.shape and batch.size <= self.batch.size


class AutoPlanner:
    """The ``policy="auto"`` decisions of one session (Note [Auto: observe, plan, check]),
    from values (Note [Auto decides from values]).

    ``budget_bytes``: the budget plans are solved for (``None``: none, every segment is kept);
    ``segments``: the names plans act on; ``config``: the copy windows plans are priced for;
    ``grads_freed_before_backward``: the loop frees the gradients between forward and backward
    (Lightning's closure calls ``zero_grad`` there), so the steady backward does not hold them.
    """

    def __init__(
        self, *, budget_bytes: Optional[int], segments: Sequence[str], config: SwapConfig = SwapConfig(),
        grads_freed_before_backward: bool = False, actions: Optional[Sequence[Action]] = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        #: The actions plans may use (``None``: all; Note [Selective around FSDP hooks]).
        self.actions = None if actions is None else tuple(actions)
        self.segments = tuple(segments)
        self.config = config
        self.grads_freed_before_backward = grads_freed_before_backward
        self.profile: Optional[ModelProfile] = None
        self._profile_shape: Optional[tuple] = None
        self._profile_batch = 0
        self._scalable = False  # the profile predicts other batch sizes (a batch-size search's)
        self._adopt_shape = False
        self._planned_batch = 0
        self._observing: Optional[BatchKey] = None
        self._observed_state = StateSizes()
        self._signature: Optional[tuple[int, int]] = None
        self._planned_state = 0
        self._plan_due = True  # no plan made for the profile in use (or none at all)
        self._current: Optional[Plan] = None  # the last plan applied
        self._last_applied: Optional[tuple[Plan, int]] = None
        self._check_pending = False
        self._guard: Optional[_Guard] = None
        self._guard_end: Optional[StateSizes] = None  # the state the last guard step ended with
        #: Bytes the measured peaks exceeded the predictions by, learned from the checks.
        self.correction_bytes = 0
        #: Segment -> why its recomputation cannot run as planned, as the session's steps found
        #: (Note [Refused actions] in ``model_profile.py``): never planned, offloaded when guarding.
        self.refusals: dict[str, str] = {}
        self._refusals_planned = 0  # how many of them the last plan knew of

    @property
    def check_pending(self) -> bool:
        """The plan applied last has not been checked yet: the step running it is measured."""
        return self._check_pending

    # -- what the next step does ---------------------------------------------------------
    def next_step(self, step: StepInputs) -> StepKind:
        """The decision table (Note [Auto: observe, plan, check])."""
        if self.budget_bytes is None or not self.segments:
            return StepKind.PLAN if self._plan_due else StepKind.RUN
        batch = step.batch
        if self._adopt_shape:  # a profile made elsewhere (a batch-size search): this batch's shape
            self._adopt_shape = False
            self._profile_shape, self._planned_batch = batch.shape, batch.size
            return StepKind.PLAN
        if self._profile_shape is None or batch.shape != self._profile_shape:
            return self._observe_or_guard(batch)
        if batch.size > self._profile_batch and not self._scalable:
            return self._observe_or_guard(batch)
        if self._scalable and batch.size != self._planned_batch:
            self._planned_batch = batch.size
            return StepKind.PLAN  # a profile measured at two batch sizes rescales (Note [Batch scaling])
        if self._plan_due or self._check_pending or len(self.refusals) != self._refusals_planned:
            return StepKind.PLAN  # ... or a segment refused an action since (Note [Refused actions])
        if step.state.signature != self._signature:
            self._signature = step.state.signature
            if step.state.total_bytes > self._planned_state:
                return StepKind.PLAN
        return StepKind.RUN

    # -- guarding (Note [Observe only what fits]) ------------------------------------------
    def _observe_or_guard(self, batch: BatchKey) -> StepKind:
        guard = self._guard
        if guard is None or not guard.covers(batch):
            return StepKind.GUARD
        if guard.decision is None:
            return StepKind.VERDICT  # after every guard step, on every process: the main process decides
        return guard.decision

    def begin_guard(self, step: StepInputs) -> Plan:
        """The lowest-memory plan for this step; :meth:`end_guard` takes what it measured."""
        if self._guard is None or not self._guard.covers(step.batch):
            self._guard = _Guard(step.batch)
        self._guard.start, self._guard.decision, self._guard.open = step.state, None, True
        self._guard.refused = len(self.refusals)  # recomputation refused: offloaded (Note [Refused actions])
        return Plan.lowest_memory(self.segments, self.refusals)

    def guard_backward_done(self, peak_bytes: int) -> None:
        """The guard step's peak up to the end of its backward (its optimizer step not yet run)."""
        self._guard.backward_peak = max(self._guard.backward_peak or 0, peak_bytes)

    def end_guard(self, peak_bytes: Optional[int], rows: Optional[Sequence[Any]], state: StateSizes) -> None:
        """A guard step is over: its measured peak, the rows it measured (each with
        ``recomputed_bytes`` and ``offloaded_bytes``) and the state alive after it. Guarding goes
        on while the step grew the state (the optimizer state appearing in the first optimizer
        step, the gradients of accumulation): the peak that counts is that of a step that begins
        in the steady state, so the lowest-memory plan's minimum is measured, not predicted."""
        guard = self._guard
        guard.open = False
        if peak_bytes is None or not rows:
            return  # nothing measured: the verdict is to guard again
        guard.peak = max(guard.peak, peak_bytes)
        guard.held = max(guard.held, sum(r.recomputed_bytes + r.offloaded_bytes for r in rows))
        # What a step that began with the state alive now would add in its backward.
        guard.grown = state_growth(guard.start, state, grads_freed_before_backward=self.grads_freed_before_backward)[1]
        # Steady once a step ends with no more state than the previous guard step ended with
        # (gradients freed between steps by ``zero_grad`` come back every step: not growth).
        previous, self._guard_end = self._guard_end, state  # the state has no shape: kept across guards
        if (
            previous is not None and state.gradient_bytes <= previous.gradient_bytes
            and state.optimizer_bytes <= previous.optimizer_bytes
        ):
            guard.bound = guard.peak + guard.held

    def guard_verdict(self) -> Verdict:
        """What the next steps do, decided on the main process (the session broadcasts it).
        Raises :class:`InfeasibleBudgetError` as soon as a guard step was over the budget:
        nothing uses less memory than it."""
        guard, budget = self._guard, self.budget_bytes
        least, plain = guard.peak, guard.bound
        if plain is None:
            # Not yet steady: a steady step's forward and backward hold what this one grew (the
            # optimizer step already ran with it, so its part of the peak stays).
            backward = guard.peak if guard.backward_peak is None else guard.backward_peak
            least = max(guard.peak, backward + guard.grown)
        if guard.peak > budget or (plain is not None and least > budget):
            raise InfeasibleBudgetError(budget_bytes=budget, min_budget_bytes=least, batch_size=guard.batch.size)
        if plain is None:
            # The same bound on the predicted steady peak: when even that fits, plain is observed
            # at once rather than after a second guard step (a budget far above plain's peak runs
            # one step under the lowest-memory plan, not two).
            if least + guard.held <= budget:
                return Verdict(StepKind.OBSERVE, least + guard.held, least)
            return Verdict(StepKind.GUARD, None, least)
        return Verdict(StepKind.OBSERVE if plain <= budget else StepKind.RUN, plain, least)

    def take_verdict(self, verdict: Verdict) -> None:
        """Every process, with the main process's verdict."""
        decision = verdict.decision
        if decision is StepKind.RUN and len(self.refusals) > self._guard.refused:
            # A segment refused the recomputation the guard plan gave it (it ran on a copy of its
            # input): guard once more with it offloaded, and keep that plan (Note [Refused actions]).
            decision = StepKind.GUARD
        self._guard.decision, self._guard.least = decision, verdict.least_bytes
        if decision is StepKind.RUN:
            log.info(
                "lightning-swap: plain training may need up to %s, over the budget of %s: every segment stays "
                "recompute_offload (measured %s) rather than observe a step that would not fit.",
                format_bytes(verdict.plain_bound_bytes), format_bytes(self.budget_bytes), format_bytes(verdict.least_bytes),
            )

    @property
    def guarding(self) -> bool:
        """A guard step is running: its measurements are taken when it is over."""
        return self._guard is not None and self._guard.open

    @property
    def guard_measured(self) -> tuple[Optional[int], Optional[int]]:
        """The lowest-memory plan's measured steady peak and the batch size it ran at."""
        return (None, None) if self._guard is None else (self._guard.least, self._guard.batch.size)

    # -- observing ------------------------------------------------------------------------
    def begin_observe(self, step: StepInputs) -> None:
        """Every process, as the observed step begins (each traces it): what was observed is
        recorded everywhere, so that all take the same decisions afterwards."""
        self._plan_due, self._check_pending = True, False
        self._profile_shape, self._profile_batch = step.batch.shape, step.batch.size
        self._observing, self._observed_state = step.batch, step.state

    def finish_observe(self, profile: ModelProfile) -> None:
        """Every process: the observed step's profile (the largest over the processes), which the
        next plans are solved from."""
        self.set_profile(profile, self._observing)

    def set_profile(self, profile: ModelProfile, batch: Optional[BatchKey], *, steady: bool = False) -> None:
        """Use ``profile`` (of a step on ``batch``; ``None``: on the next step's) from now on: the
        next step plans. ``steady``: it was measured in the steady state (a batch-size search
        warms up first), so no shift is added; a profile measured at two batch sizes is used at
        any."""
        self.profile = profile
        self._adopt_shape = batch is None
        self._profile_shape = None if batch is None else batch.shape
        self._profile_batch = profile.batch_size
        self._scalable = profile.reference is not None
        self._planned_batch = profile.batch_size if batch is None else batch.size
        if steady:
            self._observed_state = StateSizes(1 << 62, 1 << 62)
        self._plan_due, self._check_pending = True, False

    # -- planning --------------------------------------------------------------------------
    def steady_shift(self, state: StateSizes) -> tuple[int, int]:
        """(forward bytes, backward bytes) the state alive now adds to the observed step's
        (Note [Steady-state shift])."""
        return state_growth(self._observed_state, state, grads_freed_before_backward=self.grads_freed_before_backward)

    def steady_profile(self, state: StateSizes) -> ModelProfile:
        """The observed profile shifted to the state alive now (Note [Steady-state shift])."""
        forward, backward = self.steady_shift(state)
        return self.profile.with_state(forward_bytes=forward, backward_bytes=backward)

    def plan(self, state: StateSizes, measured_peak_bytes: Optional[int] = None) -> Plan:
        """The plan for the steps to come (the main process; the session broadcasts it).
        ``measured_peak_bytes``: the newest step's measured peak, the check of the plan applied
        last when one is pending."""
        self._refusals_planned = len(self.refusals)
        if self.budget_bytes is None or not self.segments:
            return Plan(actions={name: Action.KEEP for name in self.segments})
        grown = state.total_bytes > self._planned_state
        if self._check_pending and self._current is not None and self._current.predicted_peak_bytes is not None:
            self._check_pending = False
            if measured_peak_bytes is not None and self._checked(measured_peak_bytes, grown):
                return self._current
        return self._solve(state)

    def _checked(self, measured: int, grown: bool) -> bool:
        """The check of the plan applied last against its first step's ``measured`` peak: whether
        it stays. A miss is learned only when nothing else explains it: gradients or optimizer
        state that grew since the plan was made are priced by the re-plan (Note [Steady-state
        shift]), not stored as a permanent correction."""
        budget, predicted = self.budget_bytes, self._current.predicted_peak_bytes
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

    def _solve(self, state: StateSizes) -> Plan:
        """The fastest plan within the budget less what the checks learned."""
        budget, window = self.budget_bytes, dict(copy_window_of(self.config), actions=self.actions)
        profile = self.steady_profile(state).refusing(self.refusals)
        if self._scalable and self._planned_batch != profile.batch_size:
            profile = profile.at_batch(self._planned_batch)
        effective = budget - self.correction_bytes
        try:
            if effective <= 0:
                raise InfeasibleBudgetError(budget_bytes=budget, min_budget_bytes=min_budget_bytes(profile, **window), batch_size=profile.batch_size)
            plan = solve(profile, budget_bytes=effective, **window)
        except InfeasibleBudgetError as err:
            raise InfeasibleBudgetError(
                budget_bytes=budget, min_budget_bytes=err.min_budget_bytes + self.correction_bytes, batch_size=profile.batch_size,
            ) from None
        if effective != budget:
            plan = replace(plan, budget_bytes=budget)
        return plan

    def applied(self, plan: Plan, state: StateSizes) -> None:
        """Every process, after applying ``plan``: what it was made for, and a check is due."""
        self._signature, self._planned_state = state.signature, state.total_bytes
        self._current, self._plan_due = plan, False
        # By value, with the state it was made for: on the other processes every broadcast plan
        # is a new object (unpickled), and an identity test there made every step a check, a
        # broadcast rank 0 never entered. A plan kept after its check comes back equal in the
        # same state; a re-plan is new in value or made for another state.
        made_for = (plan, self._planned_state)
        self._check_pending = plan.predicted_peak_bytes is not None and made_for != self._last_applied
        self._last_applied = made_for
