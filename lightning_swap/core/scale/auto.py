"""``policy="auto"`` over a training loop: when to observe a step, when to plan, when to check.

Note [Auto: observe, plan, check]: the adapters ask :meth:`AutoPlanner.kind` before every
training step and get one of

- ``"observe"``: no profile covers this batch (the first step, or a batch larger or shaped
  differently than the one observed): the step runs with every segment kept and the main
  process observes it (Note [Observe, do not re-run] in ``observe.py``);
- ``"plan"``: a plan is due: the first step after an observation (the optimizer state exists
  now: the profile is shifted to the steady state, Note [Steady-state shift]), the step after
  a new plan's first step (the check below), or the gradients and optimizer state grew;
- ``"run"``: the installed plan runs.

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
        #: Bytes the measured peaks exceeded the predictions by, learned from the checks.
        self.correction_bytes = 0

    # -- what the next step does ---------------------------------------------------------
    def kind(self, batch: Any, states: Any) -> str:
        session = self.session
        if session.budget_bytes() is None:
            return "plan" if session.plan is None else "run"
        size = infer_batch_size(batch)
        if self._adopt_shape:  # a profile made elsewhere (a batch-size search): this batch's shape
            self._adopt_shape = False
            self._profile_shape, self._planned_batch = _shape_key(batch), size
            return "plan"
        if self._profile_shape is None or _shape_key(batch) != self._profile_shape:
            return "observe"
        if size > self._profile_batch and not self._scalable:
            return "observe"
        if self._scalable and size != self._planned_batch:
            self._planned_batch = size
            return "plan"  # a profile measured at two batch sizes rescales (Note [Batch scaling])
        if session.plan is None or self._check_pending:
            return "plan"
        signature = _signature(session.model, states)
        if signature != self._signature:
            self._signature = signature
            if state_bytes(session.model, states) > self._planned_state:
                return "plan"
        return "run"

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
                error = measured - current.predicted_peak_bytes
                self.correction_bytes = max(self.correction_bytes, error)
                if measured <= budget and not grown:
                    return current
                log.info(
                    "lightning-swap: the plan's first step peaked at %s, over the budget of %s (predicted %s); "
                    "planning again for %s less.", format_bytes(measured), format_bytes(budget),
                    format_bytes(current.predicted_peak_bytes), format_bytes(self.correction_bytes),
                )
        profile = self.steady_profile(states)
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
        self._check_pending = plan.predicted_peak_bytes is not None and plan is not getattr(self, "_last_plan", None)
        self._last_plan = plan
