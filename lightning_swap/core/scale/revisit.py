"""Re-planning from the steady state under ``policy="auto"``: a plan's measured steady steps
against its prediction (Note [Re-plan from the steady state]). :class:`Revisits` is the part of
:class:`~.auto.AutoPlanner` that revisits."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from dataclasses import replace

from ..decide.costmodel import simulate
from ..decide.plan import Plan
from ..decide.under_plan import time_factors
from ..errors import InfeasibleBudgetError
from .steady_state import StateSizes
from .warmup import SteadyRule

__all__ = ["MAX_REVISITS", "REVISIT_AFTER_STEPS", "REVISIT_TOLERANCE", "Revisits", "choice"]

log = logging.getLogger(__name__)


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


def still_changing(times: Sequence[tuple[float, float, float]]) -> bool:
    """Note [Auto's times in a fresh model's first steps]: the revisit's step times (the first of
    each tuple) are not steady; logged."""
    if _REVISIT_STEADY.steady([t[0] for t in times]):
        return False
    log.info("lightning-swap: the plan's last %d steps took %s ms, still changing: the plan is not re-priced from them.",
             len(times), ", ".join(f"{t[0]:.0f}" for t in times))
    return True


def choice(plan: Plan) -> tuple[dict, dict, dict]:
    """What a plan chose, by value: its segments' actions, its regions', and the ops its selective
    segments save (Note [Lighter selective] in ``measure/profiler.py``)."""
    return dict(plan.actions), dict(plan.outside), dict(plan.selective_ops)


class Revisits:
    """Revisiting, for :class:`~.auto.AutoPlanner` (Note [Re-plan from the steady state])."""

    # -- Note [Re-plan from the steady state] ---------------------------------------------------
    def _revisit(self, state: StateSizes, step_times: Sequence[tuple[float, float, float]]) -> Plan:
        """The plan's measured steady steps against its prediction: within
        ``REVISIT_TOLERANCE`` it stays; else the profile is re-priced with the measured times
        and re-solved, and the new plan replaces the current one only when predicted faster by
        ``REPLAN_GAIN`` (hysteresis). Logged, with the numbers, either way it changes."""
        current = self._s.current
        times = [t for t in step_times if t[0] is not None and t[0] > 0]
        if len(times) < REVISIT_AFTER_STEPS or still_changing(times):
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
        if choice(fresh) != choice(current) and fresh.predicted_step_ms < (1 - REPLAN_GAIN) * now:
            log.info("lightning-swap: re-planning with the measured times: %s; the new plan is predicted at %.1f ms, "
                     "the current one at %.1f ms.", why, fresh.predicted_step_ms, now)
            return fresh
        log.info("lightning-swap: re-priced the plan with the measured times (%s); it stays (now predicted at %.1f ms).", why, now)
        return replace(current, predicted_step_ms=now)
