"""The plan's log: what is logged when a plan is made and when it is first measured, one
implementation for every front end (Note [The plan's log]).

Note [The plan's log]: with ``log_plan`` on, the main process logs a plan's table
(:meth:`Plan.render`) when ``auto`` makes it in a step, unless its actions are those of the plan
logged last, or it is a plan already logged (the same object: ``auto`` installs a batch shape's
plan again after another shape's, Note [A shape scaled from another] in ``auto.py``). A plan
without numbers — a forced policy's, ``auto``'s without a budget — gets the rows its first step
measured (Note [Measured rows] in ``runtime/measured_rows.py``) and is logged with them: once,
after that step (a forced policy's), or again, "measured in its first step",
when it was logged before without them (``auto``'s without a budget). The session decides when;
where the text goes is the adapter's one choice (the sink): :mod:`logging` by default, Lightning
prints it above its progress bar. No adapter logs a plan itself.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Optional

from ..decide.plan import Plan
from .auto import MAX_ENTRIES

__all__ = ["PlanLog", "plan_text"]

log = logging.getLogger(__name__)

#: Where a plan's text goes.
PlanSink = Callable[[str], None]


def plan_text(plan: Plan, why: str = "") -> str:
    """The plan as one block: a title line (its summary, and why it is logged again), its table."""
    return f"lightning-swap plan ({plan.summary()}){': ' + why if why else ''}\n{plan.render()}"


def _to_logging(text: str) -> None:
    log.info("%s", text)


class PlanLog:
    """Note [The plan's log]. ``enabled``: ``log_plan`` on this process (the main one); the
    bookkeeping (which plan was logged last, whether it had numbers) runs either way."""

    def __init__(self, sink: Optional[PlanSink], *, enabled: bool) -> None:
        self._sink = sink if sink is not None else _to_logging
        self.enabled = enabled
        self._logged: Optional[Plan] = None
        #: The plans logged lately, by identity: one per batch shape ``auto`` remembers.
        self._recent: deque[Plan] = deque(maxlen=MAX_ENTRIES)

    def made(self, plan: Plan, why: str = "") -> None:
        """``plan`` was made (``why``: what kind of plan, for the title): logged unless its actions
        are those of the plan logged last, or it was logged already (a shape's plan installed again)."""
        if self._logged is not None and _same_actions(self._logged, plan):
            return  # the same actions again (a plan made again for the same decision): said once
        self._log(plan, why)

    def measured(self, plan: Plan) -> None:
        """``plan``: a plan with the rows its first step measured; logged unless the plan logged
        last has those actions and numbers already ("measured in its first step" when it has the
        actions without the numbers)."""
        previous = self._logged
        same = previous is not None and _same_actions(previous, plan)
        if same and (previous.rows or previous.measured):
            self._logged = plan
            return
        self._log(plan, "measured in its first step" if same else "")

    def _log(self, plan: Plan, why: str) -> None:
        if any(plan is seen for seen in self._recent):
            return
        previous, self._logged = self._logged, plan
        self._recent.append(plan)
        if self.enabled and not (previous is not None and _same_actions(previous, plan) and not why):
            self._sink(plan_text(plan, why))


def _same_actions(a: Plan, b: Plan) -> bool:
    return (dict(a.actions), dict(a.selective_ops)) == (dict(b.actions), dict(b.selective_ops))
