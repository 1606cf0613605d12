"""The budget held online: every ``policy="auto"`` step kept within its budget while it runs.

Note [The budget held online]: a plan is a prediction, and real code is not what was predicted
(a shape no profile saw, a branch on the batch's length, a second forward before the backward,
a fixed-size tensor beside the tokens). So the runtime does not rely on the plan being right:
before each segment's forward it reads the device bytes alive now (CPU: the meter's count;
CUDA: the caching allocator's counter, a read on the host that waits for nothing) and compares

    live now + (the largest level the rest of the step is predicted to reach under the actions
    in force - the level predicted here) * growth + the margin the step's plan was made with

with the budget, where the rest of the step is the rest of the forward, the tail, every backward
window and the optimizer step. ``live now - predicted here`` (the *shift*) is what this step holds
beyond the prediction (a second forward's graph, a larger batch), assumed held for the rest of
the step; under a plan made from another shape's profile, ``growth`` is how much more this forward
pass has added since its first segment than predicted (1 under a plan of the shape's own profile) (at least 1, at most ``MAX_GROWTH``; 1 until the pass was predicted to add ``GROWTH_MIN``
of the budget): where a shape was mispredicted every segment keeps more than its profile says, and the
segments still to come are assumed to, in the same proportion. When the sum is over, the segments and
regions still to come move to lower-memory actions one at a time (``keep`` -> ``offload`` ->
``recompute_offload``; ``selective`` -> ``recompute`` -> ``recompute_offload``; a region outside
the segments ``keep`` -> ``offload``), those keeping the most bytes first, each move priced by the
cost model (:func:`~..decide.costmodel.simulate_chain`), until the rest fits or nothing lower is
left. The walk is taken only when the check fails; the check itself is two subtractions and a
comparison per segment. A move never makes the rest of the step's predicted peak higher (one
that would is not made). What moved and why is in the step's ``StepStats.moved``, and ``auto``
re-plans from that step (Note [Auto learns from the steps it runs] in ``scale/auto.py``).

In backward, fetches ahead of need are made only within the room the budget leaves (Note
[Backward fetches within the budget] in ``engine/offload.py``).

Two limits, both said where they apply: under FSDP a move never recomputes (a recomputation
gathers its unit's parameters again, a collective the other ranks would not join: the moves stop
at ``offload``); and a compiled model's step on CPU runs without the meter (Note [No dispatch mode
under compile] in ``runtime.py``), so there is no live count to hold against: its plan alone keeps
the budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from ..actions import Action
from ..decide.costmodel import Prediction, chain_actions, elements, outside_mask, segment_costs, simulate_chain
from ..units import format_bytes

__all__ = ["LOWER", "OnlineBudget"]

#: Note [The budget held online]: the growth of a forward pass is read once it added this part of
#: the budget, and taken at most this large.
GROWTH_MIN = 0.02
MAX_GROWTH = 64.0

#: One step down in memory from each action (Note [The budget held online]).
LOWER = {
    Action.KEEP: Action.OFFLOAD,
    Action.SELECTIVE: Action.RECOMPUTE,
    Action.OFFLOAD: Action.RECOMPUTE_OFFLOAD,
    Action.RECOMPUTE: Action.RECOMPUTE_OFFLOAD,
}


def _rest(p: Prediction, i: int) -> int:
    """The highest level predicted from element ``i``'s forward to the end of the step."""
    return max(p.fixed_peak_bytes, p.tail_peak_bytes, *p.forward_peak_bytes[i:], *p.backward_peak_bytes, 0)


class OnlineBudget:
    """Holds ``budget_bytes`` over one plan's steps (Note [The budget held online]).

    ``profile``: the ``ModelProfile`` the plan was solved from (steady state, batch and refusals
    applied);
    ``actions`` / ``outside``: the plan's; ``window``: the copy-window keywords it was priced
    with (:func:`~..decide.costmodel.simulate_chain`'s); ``margin_bytes``: what the plan left
    unused for what the predictions missed before; ``recompute``: moves may recompute (not under
    FSDP); ``refused``: segments whose recomputation is refused; ``growth``: the plan's profile is
    another shape's, scaled (or a guess for a shape no profile covers), so a forward pass growing
    faster than predicted is read as the rest of it doing so too."""

    def __init__(
        self, profile: Any, actions: Mapping[str, Action], outside: Mapping[str, Action], *, budget_bytes: int,
        margin_bytes: int = 0, window: Optional[dict[str, Any]] = None, recompute: bool = True, refused: Sequence[str] = (),
        growth: bool = False,
    ) -> None:
        self._window = dict(window or {})
        self.profile = profile = profile.with_selective_ops(self._window.pop("selective_ops", None))
        self.budget_bytes = budget_bytes
        self.margin_bytes = max(0, margin_bytes)
        self._costs = segment_costs(profile)
        self._elements = elements(profile)
        self._outside = outside_mask(profile)
        self.names = [e.name for e in self._elements]
        self._index = {name: i for i, name in enumerate(self.names)}
        self._planned = chain_actions(profile, actions, outside)
        self._recompute, self._growth = recompute, growth
        self._refused = {name for name in refused} | {e.name for e in self._elements if Action.RECOMPUTE_OFFLOAD in e.refused}
        self._first = simulate_chain(profile, self._planned, self._costs, **self._window)
        self.begin_step()

    def begin_step(self) -> None:
        """A step starts under the plan's actions."""
        self.acts = list(self._planned)
        self._prediction = self._first
        #: What moved this step (``"name: keep -> offload"``), and the largest shift seen.
        self.moved: list[str] = []
        self.shift_bytes: Optional[int] = None
        #: The forward pass running: its first element checked, the bytes live and predicted there.
        self._pass: Optional[tuple[int, int, int]] = None

    @property
    def predicted_peak_bytes(self) -> int:
        """The step's peak under the actions in force, as predicted."""
        return self._prediction.peak_bytes

    def check(self, name: Optional[str], live_bytes: int) -> dict[str, Action]:
        """Before the forward of element ``name`` (``None``: the step's start, before the first
        element): the moves to make now, by element name (empty: the rest fits)."""
        i = 0 if name is None else self._index.get(name)
        if i is None:  # a call beyond the profile's (a loop that ran longer): nothing to compare with
            return {}
        starts = self._prediction.forward_start_bytes
        start = starts[i] if i < len(starts) else live_bytes
        shift = live_bytes - start
        self.shift_bytes = shift if self.shift_bytes is None else max(self.shift_bytes, shift)
        if name is not None and (self._pass is None or i <= self._pass[0]):  # a forward pass starts (a second one: again)
            self._pass = (i, live_bytes, start)
        growth = 1.0
        first, live_first, start_first = self._pass or (i, live_bytes, start)
        if self._growth and start - start_first > GROWTH_MIN * self.budget_bytes:
            growth = min(MAX_GROWTH, max(1.0, (live_bytes - live_first) / (start - start_first)))
        if self._expected(self._prediction, i, live_bytes, growth) <= self.budget_bytes:
            return {}
        return self._descend(i, shift, live_bytes, growth)

    def _expected(self, prediction: Prediction, i: int, live_bytes: int, growth: float) -> int:
        """The rest of the step's peak as expected from element ``i``'s start."""
        starts = prediction.forward_start_bytes
        start = starts[i] if i < len(starts) else live_bytes
        return int(live_bytes + max(0, _rest(prediction, i) - start) * growth + self.margin_bytes)

    def _candidates(self, i: int) -> list[int]:
        """Elements from ``i`` on with a lower action left, those keeping the most bytes first, every
        move to ``offload`` before any recomputation."""
        rows = self._prediction.rows
        found = []
        for j in range(i, len(self.acts)):
            lower = Action.OFFLOAD if self._outside[j] and self.acts[j] is Action.KEEP else (None if self._outside[j] else LOWER.get(self.acts[j]))
            if lower is None or (lower.recomputes and (not self._recompute or self.names[j] in self._refused)):
                continue
            found.append((lower.recomputes, -rows[j].kept_bytes, j))
        return [j for *_, j in sorted(found)]

    def _descend(self, i: int, shift: int, live_bytes: int, growth: float) -> dict[str, Action]:
        """Note [The budget held online]: lower the elements still to come until the rest fits."""
        moves: dict[str, Action] = {}
        said = len(self.moved)
        over = self._expected(self._prediction, i, live_bytes, growth)
        while over > self.budget_bytes:
            moved = False
            for j in self._candidates(i):
                before = self.acts[j]
                lower = Action.OFFLOAD if self._outside[j] else LOWER[before]
                self.acts[j] = lower
                trial = simulate_chain(self.profile, self.acts, self._costs, **self._window)
                if self._expected(trial, i, live_bytes, growth) > over:
                    self.acts[j] = before  # not lower here: the cost model says so
                    continue
                self._prediction, moved = trial, True
                moves[self.names[j]] = lower
                self.moved.append(f"{self.names[j]}: {before.value} -> {lower.value}")
                break
            if not moved:
                break
            over = self._expected(self._prediction, i, live_bytes, growth)
        why = f"{format_bytes(live_bytes)} live before {self.names[i]!r}, {format_bytes(max(0, shift))} over the prediction there"
        self.moved[said:] = [f"{m} ({why})" for m in self.moved[said:]]
        return moves
