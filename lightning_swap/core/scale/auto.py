"""``policy="auto"`` over a training loop: when to observe a step, when to plan, when to check.

Note [Auto: observe, plan, check]: the adapters ask :meth:`AutoPlanner.kind` before every
training step and get one of

- ``"guard"``: no profile covers this batch (the first step, or a batch larger or shaped
  differently than the one observed) and plain training is not known to fit the budget: the
  step runs under the lowest-memory plan, measured (Note [Observe only what fits]); after it
  the main process decides for every process (``"verdict"``, broadcast) what comes next;
- ``"observe"``: the guard steps bound plain's peak within the budget: the step runs with every
  segment kept and the main process observes it (Note [Observe, do not re-run] in
  ``observe.py``);
- ``"plan"``: a plan is due: the first step after an observation (the profile is shifted to the
  state alive now, Note [Steady-state shift]), the step after a new plan's first step (the
  check below), or the gradients and optimizer state grew;
- ``"run"``: the installed plan runs (the lowest-memory one where plain's bound is over budget).

The answer depends only on what every data-parallel process sees alike (batch shapes, the
order of steps, the sizes of gradients and optimizer state), so all enter the plan's broadcast
together; the main process alone solves.

The check: the first step under a new plan is measured. If its peak exceeded the prediction,
the difference is learned (the model misses allocator rounding, workspaces, ...: it only grows)
and, if the peak also exceeded the budget, the plan is solved again with the budget less what
was learned — logged once, with the numbers. A plan that cannot be kept raises
:class:`~.errors.InfeasibleBudgetError` before it runs; its ``min_budget_bytes`` is the least
budget for the steady state (gradients and optimizer state included), plus what was learned.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ..actions import Action
from ..errors import InfeasibleBudgetError
from ..measure.observe import ObservedStep
from ..decide.plan import Plan, format_bytes
from ..measure.model_profile import ModelProfile
from ..tensors import gradient_bytes, infer_batch_size, state_bytes, storage_bytes, tensors_in
from ..decide.costmodel import copy_window_of
from ..decide.solver import min_budget_bytes, solve

__all__ = ["AutoPlanner"]

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
_GUARD = "guard"
VERDICT = "verdict"

log = logging.getLogger(__name__)


def _signature(model: Any, states: Any) -> tuple[int, int]:
    """Cheap to compute every step: how many parameters have gradients, how many optimizer
    state entries exist. Bytes are summed only when this changes."""
    grads = sum(1 for p in model.parameters() if p.grad is not None)
    entries = sum(len(s) for s in states) if isinstance(states, (list, tuple)) else 0
    return grads, entries


def _shape_key(batch: Any) -> tuple:
    return tuple((tuple(t.shape[1:]), t.dtype) for t in tensors_in(batch))


class AutoPlanner:
    """The ``policy="auto"`` decisions of one :class:`~.session.SwapSession` (Note [Auto:
    observe, plan, check]); the session owns it and this module does not import the session."""

    def __init__(self, session: Any, *, grads_freed_before_backward: bool = False) -> None:
        self.session = session
        #: The loop frees the gradients between forward and backward (Lightning's closure calls
        #: ``zero_grad`` there): the steady state's backward does not hold the last step's.
        self.grads_freed_before_backward = grads_freed_before_backward
        self.profile: Optional[ModelProfile] = None
        self.observing: Optional[ObservedStep] = None
        self._profile_shape: Optional[tuple] = None
        self._profile_batch = 0
        self._scalable = False  # the profile predicts other batch sizes (a batch-size search's)
        self._adopt_shape = False
        self._planned_batch = 0
        self._observed_state = (0, 0)  # gradient bytes, optimizer state bytes
        self._signature: Optional[tuple[int, int]] = None
        self._planned_state = 0
        self._check_pending = False
        #: The step under the lowest-memory plan and its verdict (Note [Observe only what fits]).
        self._guard: Optional[dict] = None
        self._guard_end: Optional[tuple[int, int]] = None
        #: Bytes the measured peaks exceeded the predictions by, learned from the checks.
        self.correction_bytes = 0
        #: How many refusals the last plan knew of (Note [Refused actions] in ``model_profile.py``).
        self._refusals_planned = 0

    # -- what the next step does ---------------------------------------------------------
    def kind(self, batch: Any, states: Any) -> str:
        session = self.session
        if session.budget_bytes() is None or not session.segments:
            return "plan" if session.plan is None else "run"
        size = infer_batch_size(batch)
        if self._adopt_shape:  # a profile made elsewhere (a batch-size search): this batch's shape
            self._adopt_shape = False
            self._profile_shape, self._planned_batch = _shape_key(batch), size
            return "plan"
        if self._profile_shape is None or _shape_key(batch) != self._profile_shape:
            return self._observe_or_guard(batch, states)
        if size > self._profile_batch and not self._scalable:
            return self._observe_or_guard(batch, states)
        if self._scalable and size != self._planned_batch:
            self._planned_batch = size
            return "plan"  # a profile measured at two batch sizes rescales (Note [Batch scaling])
        if session.plan is None or self._check_pending or len(session.refusals) != self._refusals_planned:
            return "plan"  # ... or a segment refused an action since (Note [Refused actions])
        signature = _signature(session.model, states)
        if signature != self._signature:
            self._signature = signature
            if state_bytes(session.model, states) > self._planned_state:
                return "plan"
        return "run"

    # -- guarding (Note [Observe only what fits]) ------------------------------------------
    def _observe_or_guard(self, batch: Any, states: Any) -> str:
        guard = self._guard
        if guard is None or guard["key"][0] != _shape_key(batch) or infer_batch_size(batch) > guard["key"][1]:
            return _GUARD
        if guard["decision"] is None:
            return VERDICT  # after every guard step, on every process: the main process decides
        return guard["decision"]

    def begin_guard(self, batch: Any, states: Any) -> Plan:
        """The lowest-memory plan for this step; :meth:`end_guard` reads what it measured."""
        key = (_shape_key(batch), infer_batch_size(batch))
        if self._guard is None or self._guard["key"][0] != key[0] or key[1] > self._guard["key"][1]:
            self._guard = {"key": key, "peak": 0, "bound": None, "least": None, "held": 0, "grown": 0}
        refused = dict(self.session.refusals)  # recomputation refused: offloaded (Note [Refused actions])
        self._guard.update(states=states, state=self._state_parts(states), decision=None, open=True, refused=len(refused))
        return Plan(actions={name: Action.OFFLOAD if name in refused else Action.RECOMPUTE_OFFLOAD for name in self.session.segments})

    def end_guard(self, peak: Optional[int], rows: Any) -> None:
        """A guard step is over. Guarding goes on while the step grew the state (the optimizer
        state appearing in the first optimizer step, the gradients of accumulation): the peak
        that counts is that of a step that begins in the steady state, so the lowest-memory
        plan's minimum is measured, not predicted (Note [Observe only what fits])."""
        guard = self._guard
        guard["open"] = False
        if peak is None or not rows:
            return  # nothing measured: the verdict is to guard again
        guard["peak"] = max(guard["peak"], peak)
        guard["held"] = max(guard["held"], sum(r.recomputed_bytes + r.offloaded_bytes for r in rows))
        (grads0, opt0), (grads, opt) = guard["state"], self._state_parts(guard["states"])
        # What a step that began with the state alive now would add (Note [Steady-state shift]):
        # the optimizer state throughout, the last gradients unless the loop frees them first.
        guard["grown"] = max(0, opt - opt0) + (0 if self.grads_freed_before_backward else max(0, grads - grads0))
        # Steady once a step ends with no more state than the previous guard step ended with
        # (gradients freed between steps by ``zero_grad`` come back every step: not growth).
        previous, self._guard_end = self._guard_end, (grads, opt)  # the state has no shape: kept across guards
        if previous is not None and grads <= previous[0] and opt <= previous[1]:
            guard["bound"] = guard["peak"] + guard["held"]

    def guard_backward_done(self, peak: int) -> None:
        """The guard step's peak up to the end of its backward (its optimizer step not yet run)."""
        self._guard["backward_peak"] = max(self._guard.get("backward_peak", 0), peak)

    def _state_parts(self, states: Any) -> tuple[int, int]:
        return gradient_bytes(self.session.model), storage_bytes(tensors_in(states))

    def guard_verdict(self, states: Any) -> tuple[str, Optional[int], Optional[int]]:
        """(what the next steps do: ``"guard"``, ``"observe"`` or ``"run"``; plain's bound; the
        lowest-memory plan's measured peak), decided on the main process (the session
        broadcasts it). Raises :class:`InfeasibleBudgetError` as soon as a guard step was over
        the budget: nothing uses less memory than it."""
        guard, budget = self._guard, self.session.budget_bytes()
        least, plain = guard["peak"], guard["bound"]
        if plain is None:
            # Not yet steady: a steady step's forward and backward hold what this one grew (the
            # optimizer step already ran with it, so its part of the peak stays).
            least = max(guard["peak"], guard.get("backward_peak", guard["peak"]) + guard["grown"])
        if guard["peak"] > budget or (plain is not None and least > budget):
            raise InfeasibleBudgetError(budget_bytes=budget, min_budget_bytes=least, batch_size=guard["key"][1])
        if plain is None:
            # The same bound on the predicted steady peak: when even that fits, plain is observed
            # at once rather than after a second guard step (a budget far above plain's peak runs
            # one step under the lowest-memory plan, not two).
            if least + guard["held"] <= budget:
                return "observe", least + guard["held"], least
            return _GUARD, None, least
        return ("observe" if plain <= budget else "run"), plain, least

    @property
    def guarding(self) -> bool:
        """A guard step is running: its measurements are read when it is over."""
        return self._guard is not None and self._guard.get("open", False)

    @property
    def guard_measured(self) -> tuple[Optional[int], Optional[int]]:
        """The lowest-memory plan's measured steady peak and the batch size it ran at."""
        return (None, None) if self._guard is None else (self._guard.get("least"), self._guard["key"][1])

    def take_verdict(self, verdict: tuple[str, Optional[int], Optional[int]]) -> None:
        decision, plain, least = verdict
        if decision == "run" and len(self.session.refusals) > self._guard.get("refused", 0):
            # A segment refused the recomputation the guard plan gave it (it ran on a copy of its
            # input): guard once more with it offloaded, and keep that plan (Note [Refused actions]).
            decision = _GUARD
        self._guard["decision"], self._guard["least"] = decision, least
        if decision == "run":
            log.info(
                "lightning-swap: plain training may need up to %s, over the budget of %s: every segment stays "
                "recompute_offload (measured %s) rather than observe a step that would not fit.",
                format_bytes(plain), format_bytes(self.session.budget_bytes()), format_bytes(least),
            )

    # -- observing ------------------------------------------------------------------------
    def begin_observe(self, batch: Any, track: Any, states: Any, *, is_main: bool = True) -> Optional[ObservedStep]:
        """Run this step with every segment kept; the main process traces it. Every process
        records what was observed, so that all take the same decisions afterwards."""
        session = self.session
        session.remove()
        session.plan = None
        self._check_pending = False
        self._profile_shape, self._profile_batch = _shape_key(batch), infer_batch_size(batch)
        if not is_main:
            return None
        self.observing = ObservedStep(
            session.model, list(session.segments), device=session.device, batch=batch, track=track,
            min_offload_bytes=session.config.min_offload_bytes, modules=session.modules,
        ).begin()
        self._observed_state = (gradient_bytes(session.model), storage_bytes(tensors_in(states)))
        self._observed_batch = batch
        return self.observing

    def finish_observe(self) -> ModelProfile:
        observed, self.observing = self.observing, None
        assert observed is not None
        self.set_profile(observed.finish(), self._observed_batch)
        self._observed_batch = None
        return self.profile

    def abort_observe(self) -> None:
        if self.observing is not None:
            self.observing.abort()
            self.observing = None

    def set_profile(self, profile: ModelProfile, batch: Any, *, steady: bool = False) -> None:
        """Use ``profile`` (of a step on a batch shaped like ``batch``; ``None``: like the next
        step's) from now on: the next step plans. ``steady``: it was measured in the steady state
        (a batch-size search warms up first), so no shift is added; a profile measured at two
        batch sizes is used at any."""
        self.profile = profile
        self._adopt_shape = batch is None
        self._profile_shape = None if batch is None else _shape_key(batch)
        self._profile_batch = profile.batch_size
        self._scalable = profile.reference is not None
        self._planned_batch = profile.batch_size if batch is None else infer_batch_size(batch)
        if steady:
            self._observed_state = (1 << 62, 1 << 62)
        self.session.plan = None
        self._check_pending = False

    # -- planning --------------------------------------------------------------------------
    def steady_profile(self, states: Any) -> ModelProfile:
        """The observed profile shifted to the state alive now (Note [Steady-state shift])."""
        grads, opt = gradient_bytes(self.session.model), storage_bytes(tensors_in(states))
        grads0, opt0 = self._observed_state
        forward = max(0, grads - grads0) + max(0, opt - opt0)
        backward = max(0, opt - opt0) + (0 if self.grads_freed_before_backward else max(0, grads - grads0))
        return self.profile.with_state(forward_bytes=forward, backward_bytes=backward)

    def plan(self, states: Any) -> Plan:
        """The plan for the steps to come (the main process; the caller broadcasts it)."""
        session = self.session
        budget = session.budget_bytes()
        self._refusals_planned = len(session.refusals)
        if budget is None or not session.segments:
            if budget is None:
                session.warn_no_budget()
            return Plan(actions={name: Action.KEEP for name in session.segments})
        current = session.plan
        grown = state_bytes(session.model, states) > self._planned_state
        if self._check_pending and current is not None and current.predicted_peak_bytes is not None:
            self._check_pending = False
            stats = session.records.newest()
            measured = stats.peak_device_bytes if stats is not None else None
            if measured is not None:
                # A miss is learned only when nothing else explains it: gradients or optimizer
                # state that grew since the plan was made are priced by the re-plan below
                # (Note [Steady-state shift]), not stored as a permanent correction.
                if not grown:
                    self.correction_bytes = max(self.correction_bytes, measured - current.predicted_peak_bytes)
                if measured <= budget and not grown:
                    return current
                if measured > budget:
                    log.info(
                        "lightning-swap: the plan's first step peaked at %s, over the budget of %s (predicted %s); "
                        "planning again for %s less.", format_bytes(measured), format_bytes(budget),
                        format_bytes(current.predicted_peak_bytes), format_bytes(self.correction_bytes),
                    )
                else:
                    log.info(
                        "lightning-swap: the gradients or optimizer state grew since the plan was made (its first "
                        "step peaked at %s, within the budget of %s); planning again for the state alive now.",
                        format_bytes(measured), format_bytes(budget),
                    )
        profile = self.steady_profile(states).refusing(session.refusals)
        if self._scalable and self._planned_batch != profile.batch_size:
            profile = profile.at_batch(self._planned_batch)
        effective = budget - self.correction_bytes
        try:
            if effective <= 0:
                raise InfeasibleBudgetError(budget_bytes=budget, min_budget_bytes=min_budget_bytes(profile, **copy_window_of(session.config)), batch_size=profile.batch_size)
            plan = solve(profile, budget_bytes=effective, **copy_window_of(session.config))
        except InfeasibleBudgetError as err:
            raise InfeasibleBudgetError(
                budget_bytes=budget, min_budget_bytes=err.min_budget_bytes + self.correction_bytes, batch_size=profile.batch_size,
            ) from None
        if effective != budget:
            plan = Plan(
                actions=plan.actions, predicted_peak_bytes=plan.predicted_peak_bytes, predicted_step_ms=plan.predicted_step_ms,
                budget_bytes=budget, batch_size=plan.batch_size, rows=plan.rows,
            )
        return plan

    def applied(self, plan: Plan, states: Any) -> None:
        """Every process, after applying ``plan``: what it was made for, and a check is due."""
        self._signature = _signature(self.session.model, states)
        self._planned_state = state_bytes(self.session.model, states)
        # By value, with the state it was made for: on the other processes every broadcast plan
        # is a new object (unpickled), and an identity test there made every step a check, a
        # broadcast rank 0 never entered. A plan kept after its check comes back equal in the
        # same state; a re-plan is new in value or made for another state.
        made_for = (plan, self._planned_state)
        self._check_pending = plan.predicted_peak_bytes is not None and made_for != getattr(self, "_last_plan", None)
        self._last_plan = made_for
