"""``policy="auto"`` over a training loop: when to guard a step, when to plan, when to check.

Note [Auto: observe, plan, check]: before every training step the session asks
:meth:`AutoPlanner.next_step` and gets a :class:`StepKind`:

- ``GUARD``: no profile covers this batch (the first step of a batch shape that no planned
  shape holds, or a batch larger than its shape's profile): the step runs under the lowest-memory plan, measured and observed
  on every process (Note [Observe only what fits]); before the next step the main process
  decides for every process (the guard's :class:`Verdict`, broadcast) what comes next;
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

Each batch shape has its own state through this table (Note [Plans per batch shape]), one
:class:`Phase` (Note [A shape's lifecycle]).

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

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Optional

from ..actions import Action
from ..config import SwapConfig
from ..decide.costmodel import AUTO_WINDOW, copy_window_of, simulate
from ..decide.plan import Plan
from ..decide.solver import min_budget_bytes, solve
from ..decide.under_plan import as_plain
from ..errors import InfeasibleBudgetError
from ..measure.model_profile import ModelProfile
from ..units import format_bytes
from .guard import GuardSteps, Verdict, guard_action
from .revisit import MAX_REVISITS, REVISIT_AFTER_STEPS, REVISIT_TOLERANCE, Revisits, choice
from .shapes import CHECKING, GUARDING, MAX_SHAPES, BatchKey, Phase, ShapeState, ShapeTable, StepInputs, StepKind, check_size
from .steady_state import StateSizes, state_growth

__all__ = [
    "MAX_REVISITS", "MAX_SHAPES", "REVISIT_AFTER_STEPS", "REVISIT_TOLERANCE", "AutoPlanner", "BatchKey", "Phase", "StepInputs",
    "StepKind", "Verdict", "guard_action",
]

log = logging.getLogger(__name__)


# Note [A plan's first step refines its profile]: the guard's profile predicts plain's windows
# from a step in which no segment was kept; each segment's rise when kept was measured alone,
# where small things differ from the step (when a parameter's gradient is made, what the next
# segment still holds: a few KiB on the tests' CNN, 0.1-0.3% of ResNet-18's peak, always over).
# The first plan made from it is therefore observed too, on every process, under that plan
# (Note [A step measured under a plan]): its kept segments are measured in the step itself, so
# the profile made from it is nearer to what plain and the plans near it hold. The check of that
# plan is made against the refined profile, and the plan is solved again from it (a budget at
# plain's peak gets every segment kept). Once per guard profile: later plans are checked only;
# and not where the first plan keeps every segment (plain fits): no choice is left to make, and
# the check measures its peak (an observed step costs about as much as a guard step).
class AutoPlanner(ShapeTable, GuardSteps, Revisits):
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
        on_main: Callable[[Callable[[], Verdict]], Verdict] = lambda decide: decide(),
    ) -> None:
        self.budget_bytes = budget_bytes
        #: Runs a decision on the main process and gives every process its answer (the guard's
        #: verdict: a collective, so every process asks for it at the same step).
        self.on_main = on_main
        #: The actions plans may use (``None``: all; Note [Selective around FSDP hooks]).
        self.actions = None if actions is None else tuple(actions)
        self.segments = tuple(segments)
        self.config = config
        self.grads_freed_before_backward = grads_freed_before_backward
        self.device_type = device_type
        self.guard_action = guard_action(device_type, config)
        #: Note [Plans per batch shape]: what is known and decided for each batch shape seen last
        #: (least recently used first), and the shape of the step running now.
        self._shapes: OrderedDict[tuple, ShapeState] = OrderedDict()
        self._s = ShapeState(None, Phase.PLAN if budget_bytes is None or not self.segments else Phase.GUARD)
        #: Note [A check is of its own batch]: (the shape whose plan ran, ``None`` where none did;
        #: the batch size) of the step running and of the one before; the shape whose plan (or
        #: kept lowest-memory plan) the session has installed.
        self._running: tuple[Optional[ShapeState], int] = (None, 0)
        self._previous: tuple[Optional[ShapeState], int] = (None, 0)
        self._installed: Optional[ShapeState] = None
        #: This step installs its shape's plan again, as it was (another shape's ran last).
        self._reinstalling = False
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
        """The profile the current batch shape's plans are solved from (on the main process; every
        process holds the same, merged from all of theirs)."""
        return self._s.profile

    @profile.setter
    def profile(self, value: Optional[ModelProfile]) -> None:
        self._s.profile = value

    @property
    def phase(self) -> Phase:
        """The current batch shape's phase (Note [A shape's lifecycle])."""
        return self._s.phase

    @property
    def check_pending(self) -> bool:
        """The plan applied last has not been checked yet: the step running it is measured."""
        return self._s.phase in CHECKING

    @property
    def refine_due(self) -> bool:
        """The plan just applied is the first made from a guard step's profile: its first step is
        observed under it (every process) and refines the profile (Note [A plan's first step
        refines its profile])."""
        return self._s.phase is Phase.REFINE

    @property
    def revisit_due(self) -> bool:
        """This step's plan is solved again from the steady state's measured times (Note
        [Re-plan from the steady state]): the session hands :meth:`plan` those times."""
        return self._s.phase is Phase.REVISIT

    @property
    def keeps_least(self) -> bool:
        """This step runs the lowest-memory plan a verdict kept (its peak is measured)."""
        return self._least_now

    # -- what the next step does ---------------------------------------------------------
    def next_step(self, step: StepInputs) -> StepKind:
        """The decision table (Note [Auto: observe, plan, check]), for the step's batch shape
        (Note [Plans per batch shape])."""
        if self.budget_bytes is None or not self.segments:
            return StepKind.RUN if self._s.phase is Phase.RUN else StepKind.PLAN
        if self._s.phase is Phase.VERDICT and self._s.shape != step.batch.shape:
            # Note [Plans per batch shape]: the verdict on the last shape's guard step is taken now,
            # not when that shape returns (under dynamic padding it may not), so its profile is
            # there for the shapes to come.
            self.take_verdict(self.on_main(self.guard_verdict))
        self._enter(step.batch.shape, step.batch.size, step.state)
        self._least_now = False
        kind = self._decide(step)
        if kind is StepKind.RUN and self._installed is not self._s:
            self._reinstalling = True  # another shape's plan is installed: this shape's, as it was
            kind = StepKind.PLAN
        ran, size = self._running
        if kind is StepKind.PLAN and ran is not None and ran.phase in CHECKING and size >= check_size(ran):
            ran.checkable = True  # Note [A check is of its own batch]: this plan() hears that step's peak
        self._previous = self._running
        self._running = (self._s if kind in (StepKind.RUN, StepKind.PLAN) else None, step.batch.size)
        self._count_least(kind, step.batch)
        return kind

    def _run_or_revisit(self) -> StepKind:
        """Note [Re-plan from the steady state]: the plan's ``REVISIT_AFTER_STEPS`` steps after its
        check are measured; the step after them revisits it (once per plan, a few per profile)."""
        self._s.steps_run += 1
        if (
            self._s.steps_run > REVISIT_AFTER_STEPS and self._s.revisits < MAX_REVISITS and self.profile_made_here
            and self._s.current is not None and self._s.current.predicted_step_ms is not None
            and choice(self._s.current) not in self._s.settled
        ):
            self._go(self._s, Phase.REVISIT, f"its {REVISIT_AFTER_STEPS} steps since the check were measured")
            return StepKind.PLAN
        return StepKind.RUN

    @property
    def profile_made_here(self) -> bool:
        """Every process knows whether the plans come from a profile of this run's steps (a
        guard's or an observed one's), not from a batch-size search's (whose steps were others)."""
        return not self._s.scalable

    def _covered(self, batch: BatchKey) -> bool:
        """The shape's profile holds ``batch`` (its shape, and its size or one it rescales to)."""
        s = self._s
        return batch.shape == s.profile_shape and (batch.size <= s.profile_batch or s.scalable)

    def _decide(self, step: StepInputs) -> StepKind:
        s, batch = self._s, step.batch
        if self._adopt_shape:  # a profile made elsewhere (a batch-size search): this batch's shape
            self._adopt_shape = False
            s.profile_shape, s.profile_of, s.planned_batch = batch.shape, batch.shape, batch.size
            return StepKind.PLAN
        if s.phase not in GUARDING and not self._covered(batch):
            self._go(s, Phase.GUARD, f"a batch of {batch.size}, larger than its profile's {s.profile_batch}")
        if s.phase in GUARDING:
            kind = self._guarded(batch)
            if kind is not None:
                return kind
        if s.scalable and batch.size != s.planned_batch:
            s.planned_batch = batch.size
            return StepKind.PLAN  # a profile measured at two batch sizes rescales (Note [Batch scaling])
        if s.phase is Phase.PLAN or len(self.refusals) != s.refusals_planned:
            return StepKind.PLAN  # ... or a segment refused an action since (Note [Refused actions])
        if s.phase in CHECKING:
            ran, size = self._running
            if s.checkable or (ran is s and size >= check_size(ran)) or step.state.total_bytes > s.planned_state:
                return StepKind.PLAN
            return StepKind.RUN  # Note [A check is of its own batch]: not yet measured at its own batch size
        if step.state.signature != s.signature:
            s.signature = step.state.signature
            if step.state.total_bytes > s.planned_state:
                return StepKind.PLAN
        return self._run_or_revisit()

    def _adopt(self, batch: BatchKey, state: StateSizes) -> None:
        """Every process: plans are made from now on from a profile of a step on ``batch`` that
        began with ``state``."""
        self._s.profile_shape = self._s.profile_of = batch.shape
        self._s.profile_batch = self._s.planned_batch = batch.size
        self._s.scalable, self._s.observed_state = False, state
        self._planning("a profile of this shape")

    def _planning(self, why: str) -> None:
        """The current shape's plans come from a new profile: the next step plans, and nothing
        checked or revisited of the last profile's plans carries over."""
        self._go(self._s, Phase.PLAN, why)
        self._s.revisits, self._s.settled = 0, []
        self._s.refinable, self._s.checkable, self._s.check_peak = False, False, None

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
        self._s.profile_shape = self._s.profile_of = None if batch is None else batch.shape
        self._s.profile_batch = profile.batch_size
        self._s.scalable = profile.reference is not None
        self._s.planned_batch = profile.batch_size if batch is None else batch.size
        if steady:
            self._s.observed_state = StateSizes(1 << 62, 1 << 62)
        self._planning("a profile was made" if batch is not None else "a profile made elsewhere")

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
        if self._reinstalling:
            return self._installed_plan()
        if s.phase is Phase.REVISIT:
            return self._revisit(state, step_times)
        grown = state.total_bytes > s.planned_state
        if s.phase in CHECKING and s.current is not None and s.current.predicted_peak_bytes is not None:
            measured = s.check_peak if s.checkable else None
            if s.phase is Phase.REFINED:
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
            self._s.observed_state, self._s.margin_bytes, self._s.profile_of = self._s.applied_state, 0, self._s.shape
            self._go(self._s, Phase.REFINED, "the plan's first step, observed under it, refined the profile")
        else:
            self._go(self._s, Phase.CHECK, "no profile from the plan's first step")

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
        effective = budget - self.correction_bytes - self._s.margin_bytes  # Note [A larger shape predicted]
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

    def applied(self, plan: Plan, state: StateSizes) -> None:
        """Every process, after applying ``plan``: what it was made for, and a check is due."""
        s = self._s
        self._installed = s
        if self._reinstalling:  # the shape's plan as it was, its check still pending where it was
            self._reinstalling = False
            if s.phase is Phase.REFINE:
                self._go(s, Phase.CHECK, "installed again: its first step was another shape's")
            return
        s.checkable, s.check_peak = False, None
        if s.phase is Phase.REVISIT:
            s.revisits += 1
            if s.current is not None and choice(plan) == choice(s.current):
                s.settled.append(choice(plan))
        s.signature, s.planned_state, s.applied_state = state.signature, state.total_bytes, state
        s.current, s.steps_run = plan, 0
        # By value, with the state it was made for: on the other processes every broadcast plan
        # is a new object (unpickled), and an identity test there made every step a check, a
        # broadcast rank 0 never entered. A plan kept after its check comes back equal in the
        # same state; a re-plan is new in value or made for another state.
        made_for = (plan, s.planned_state)
        checked = plan.predicted_peak_bytes is None or made_for == s.last_applied
        s.last_applied = made_for
        # Note [A plan's first step refines its profile]: a guard's profile whose plan keeps
        # everything (plain fits) has no choice left to refine: its first step is checked only.
        keeps_all = not s.margin_bytes and all(a is Action.KEEP for a in (*plan.actions.values(), *plan.outside.values()))
        refine, s.refinable = s.refinable and self.budget_bytes is not None and not keeps_all, False
        if refine:
            self._go(s, Phase.REFINE, "the first plan from a guard step's (or a predicted) profile: its first step is observed")
        elif checked:
            self._go(s, Phase.RUN, "the plan stays" if plan.predicted_peak_bytes is not None else "nothing to check")
        else:
            self._go(s, Phase.CHECK, "a plan applied: its first step at its own batch size checks it")
