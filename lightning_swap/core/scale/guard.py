"""The guard steps of ``policy="auto"``: a batch no profile covers runs under the lowest-memory
plan, measured; the main process's verdict says what comes next (Note [Observe only what
fits]). :class:`GuardSteps` is the part of :class:`~.auto.AutoPlanner` that guards."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from ..actions import Action
from ..config import SwapConfig
from ..decide.costmodel import copy_window, on_demand
from ..decide.plan import Plan
from ..errors import InfeasibleBudgetError
from ..measure.model_profile import ModelProfile, refused_actions
from ..segments import split_call
from ..units import format_bytes
from .shapes import MAX_SHAPES, BatchKey, Phase, StepInputs, StepKind
from .steady_state import StateSizes, state_growth

__all__ = ["Guard", "GuardSteps", "Verdict", "guard_action"]

log = logging.getLogger(__name__)


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
# measurement]). Under FSDP2, where every segment is a unit of its own (``fully_shard`` per block),
# every rank runs each segment alone in the step's order, its unit gathered first and run by its
# own ``forward``, so the collectives match and nothing of the user's changes (Note [Sharded
# segments timed in lockstep] in ``sharded.py``): the guard's profile is made there as on one
# process, and ``auto`` plans a mix from it. Under FSDP1, or where a segment is no unit of its own
# or holds units, no segment runs alone (every rank runs every collective: Note [Observe every
# rank] in ``observe.py``), so no profile is made there: the bound below. Guard steps go on while a step grows the state (the optimizer state
# appearing in the first optimizer step, gradients under accumulation), so the guard's peak is
# that of a steady step: the lowest-memory plan's minimum, measured, and the profile is a
# steady step's. From that profile the main process predicts plain's peak (exactly, on the
# tests' models and their LM: the cost model run backwards) and decides for every
# process before any of them runs the next step: ``OBSERVE`` plain when it fits (its profile is
# then exact), else ``PLAN`` the fastest mix that fits from the guard's profile. Where no
# profile could be made (a segment that cannot be replayed; FSDP1, or an FSDP2 segment that is no
# unit of its own), plain's peak is bounded instead —
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
class Guard:
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
    passes: int = 1  # the most backward passes a guard step ran (Note [A step of several passes])
    #: The steady guard step's profile as plain's (the largest of every process's; None: not made)
    profile: Optional[ModelProfile] = None

    def covers(self, batch: BatchKey) -> bool:
        return self.batch.shape == batch.shape and batch.size <= self.batch.size

    @property
    def steady(self) -> bool:
        return self.bound is not None


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



class GuardSteps:
    """Guarding, for :class:`~.auto.AutoPlanner` (Note [Observe only what fits])."""

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
                f"or a sharded model whose segments cannot run alone: FSDP1, or FSDP2 segments that are not units "
                f"of their own), and plain training's peak, bounded at "
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

    # -- guarding (Note [Observe only what fits]) ------------------------------------------
    def _guarded(self, batch: BatchKey) -> Optional[StepKind]:
        """The step of a shape guarded or decided by its guard's verdict, taken first where it is
        due (on the main process, for every process); ``None``: the verdict was to plan, from a
        profile that covers ``batch``."""
        s = self._s
        if s.guard is None or not s.guard.covers(batch):
            self._go(s, Phase.GUARD, f"no guard step ran a batch of {batch.size} or more")
            return StepKind.GUARD
        if s.phase is Phase.VERDICT:
            self.take_verdict(self.on_main(self.guard_verdict))
        if s.phase is Phase.PLAN and not self._covered(batch):
            self._go(s, Phase.GUARD, f"the profile's batch ({s.profile_batch}) is smaller than this one ({batch.size})")
        self._least_now = s.phase is Phase.KEEP_LEAST
        return {Phase.GUARD: StepKind.GUARD, Phase.OBSERVE: StepKind.OBSERVE, Phase.KEEP_LEAST: StepKind.RUN}.get(s.phase)

    def guard_plan(self) -> Plan:
        """The lowest-memory plan (``Plan.lowest_memory``: :func:`guard_action` on every segment,
        the regions outside them offloaded); a segment whose recomputation was refused is
        offloaded instead (Note [Refused actions])."""
        refused = {split_call(name)[0] for name, why in self.refusals.items() if Action.RECOMPUTE_OFFLOAD in refused_actions(why)}
        return Plan.lowest_memory(self.segments, refused, action=self.guard_action)

    def begin_guard(self, step: StepInputs) -> Plan:
        """The lowest-memory plan for this step; :meth:`end_guard` takes what it measured."""
        if self._s.guard is None or not self._s.guard.covers(step.batch):
            self._s.guard = Guard(step.batch)
        self._s.guard.start = step.state
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
        self._go(self._s, Phase.VERDICT, "a guard step ended")
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
        if guard.profile is not None:  # plain predicted from the guard's profile (of a step that began with guard.start)
            predicted = guard.profile.peak_bytes + self.correction_bytes
            # Planned even where plain fits (the plan keeps every segment, and its first step,
            # observed, is plain's): the profile is this shape's at once, which a shorter or a
            # longer shape can start from (Notes [A smaller shape runs a larger one's plan], [A
            # larger shape predicted]), where an observed step would wait for the shape to return.
            return Verdict(StepKind.PLAN, predicted, least, guard.profile.batch_size)
        if plain <= budget:
            return Verdict(StepKind.OBSERVE, plain, least)
        return Verdict(StepKind.RUN, plain, least)

    def take_verdict(self, verdict: Verdict) -> None:
        """Every process, with the main process's verdict."""
        s, guard = self._s, self._s.guard
        decision = verdict.decision
        if decision in (StepKind.RUN, StepKind.PLAN) and dict(self.guard_plan().actions) != dict(guard.plan.actions):
            # A segment refused the recomputation the guard plan gave it (it ran on a copy of its
            # input): guard once more with it offloaded, and keep or plan from that step (Note
            # [Refused actions]).
            decision = StepKind.GUARD
            self._go(s, Phase.GUARD, "a segment refused the guard plan's recomputation: guarded with it offloaded")
        guard.least = verdict.least_bytes
        self.plain_predicted_bytes = verdict.plain_bound_bytes
        if decision is StepKind.GUARD:
            self._go(s, Phase.GUARD, "the verdict: no steady guard step yet")
        elif decision is StepKind.OBSERVE:
            self._go(s, Phase.OBSERVE, f"the verdict: plain's peak, predicted {format_bytes(verdict.plain_bound_bytes)}, fits")
        elif decision is StepKind.PLAN:  # plans from the guard's profile (every process holds it: guard_observed)
            self._adopt(BatchKey(guard.batch.shape, verdict.batch_size or guard.batch.size), guard.start)
            self._s.profile, self._s.refinable = guard.profile, True
            over = verdict.plain_bound_bytes > self.budget_bytes
            (log.info if over else log.debug)(
                "lightning-swap: plain training is predicted to need %s, %s the budget of %s: planning from the "
                "step measured under the lowest-memory plan (%s).", format_bytes(verdict.plain_bound_bytes),
                "over" if over else "within", format_bytes(self.budget_bytes), format_bytes(verdict.least_bytes),
            )
        elif verdict.plain_bound_bytes is None:  # RUN
            self._go(s, Phase.KEEP_LEAST, "the verdict: the step ran several passes")
            self._warn_passes(verdict.least_bytes)
        else:
            self._go(s, Phase.KEEP_LEAST, "the verdict: no profile, plain's bound over the budget")
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

    @property
    def guarding(self) -> bool:
        """A guard step is running: its measurements are taken when it is over."""
        return self._s.phase is Phase.GUARD and self._s.guard is not None

    @property
    def guard_measured(self) -> tuple[Optional[int], Optional[int]]:
        """The lowest-memory plan's measured steady peak and the batch size it ran at."""
        return (None, None) if self._s.guard is None else (self._s.guard.least, self._s.guard.batch.size)
