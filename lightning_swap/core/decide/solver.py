"""The planner: one action per segment, least predicted step time within a memory budget.

Algorithm: dynamic programming over the chain of segments with memory as state, as in
Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova, *Optimal checkpointing for heterogeneous
chains* (2019) and Beaumont, Eyraud-Dubois, Shilova, *Efficient combination of
rematerialization and offloading for training DNNs* (NeurIPS 2021). Going forward through the
segments, a state is ``(bytes kept by the segments so far, previous action)``; every window
of the cost model (:mod:`.costmodel`) depends only on those and the current action, so a
state with fewer kept bytes and less time dominates. The DP keeps, per previous action, the
Pareto front of (kept bytes, time) with exact byte counts.

Note [Thinning keeps feasibility]: on long chains the fronts can grow large; above
``max_states`` a front is thinned to the fastest state per memory bucket. The state with the
fewest kept bytes is always kept: the future constraints only grow with kept bytes, so a plan
that fits is still found whenever one exists. Thinning can cost optimality (a bucket's worth
of memory); below ``max_states`` the DP is exact. Either way the chosen plan is re-evaluated
by :func:`~.costmodel.simulate`, whose numbers the plan reports, and never exceeds the budget.

Note [Deep copy windows]: with ``prefetch_segments`` or ``inflight_segments`` above one, a
window's bytes depend on the actions of segments further back than the previous one, which the
DP's state does not hold. The DP then counts, for those older segments, the most any allowed
action copies (:attr:`_Transitions.most`): an upper bound, so whatever the DP picks fits when
simulated, but a plan that fits only with the true older actions may be missed. So ``solve``
and ``min_budget_bytes`` also try the uniform plans and, when the DP found nothing, the DP's
least-peak plan, each checked by :func:`~.costmodel.simulate` (exact for any window), and keep
the best that fits. With both settings at most one (the runtime's defaults) the state sees
every segment the windows reach and the DP is exact as before.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import Optional

import numpy as np

from ..actions import Action
from .costmodel import (
    SegmentCosts, backward_need, boundary_kept, copied_bytes, copy_window, forward_own, internal_kept, on_demand, recompute_ms,
    Prediction, segment_costs, simulate,
)
from ..errors import InfeasibleBudgetError
from .plan import Plan
from ..measure.model_profile import ModelProfile, SegmentProfile

__all__ = ["brute_force", "min_budget_bytes", "solve"]

log = logging.getLogger(__name__)

DEFAULT_MAX_STATES = 512


def _check_int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"`{field}` must be an int > 0; got {value!r} ({type(value).__name__}).")
    if value <= 0:
        raise ValueError(f"`{field}` must be an int > 0; got {value!r}.")
    return int(value)


def _allowed(actions: Optional[Iterable[Action]]) -> tuple[Action, ...]:
    if actions is None:
        return tuple(Action)
    out = tuple(Action.parse(a, field="actions") for a in actions)
    if not out:
        raise ValueError("`actions` must allow at least one Action.")
    return tuple(dict.fromkeys(out))


def _runs(profile: ModelProfile, plan: Iterable[Action]) -> bool:
    """No segment gets an action it refused (Note [Refused actions] in model_profile.py)."""
    return all(a not in s.refused for s, a in zip(profile.segments, plan))


class _Transitions:
    """Per-transition numbers of the cost model, precomputed for the DP (Note [Deep copy windows])."""

    def __init__(self, profile: ModelProfile, costs: SegmentCosts, acts: tuple[Action, ...], window: tuple[int, int]) -> None:
        segs = profile.segments
        self.n = n = len(segs)
        self.acts = acts
        k = len(acts)
        self.overlap = profile.copies_overlap
        self.prefetch, self.inflight = window
        #: Note [Refused actions] in model_profile.py: what each segment may run.
        self.allowed = [[a not in s.refused for a in acts] for s in segs]
        self.copies = [[copied_bytes(s, a) for a in acts] for s in segs]
        #: The most any allowed action copies, per segment: the bound for segments the state forgot.
        self.most = [max(row) for row in self.copies]
        # [i, p, a]: p == k is "no previous segment" (i == 0).
        self.fwd_need = np.zeros((n, k + 1, k), dtype=np.int64)
        self.bwd_need = np.zeros((n, k + 1, k), dtype=np.int64)
        self.add_kept = np.zeros((n, k + 1, k), dtype=np.int64)
        self.add_ms = np.zeros((n, k + 1, k), dtype=np.float64)
        for i, s in enumerate(segs):
            prev = segs[i - 1] if i else None
            for pi in range(k + 1):
                p = acts[pi] if pi < k else None
                if (i == 0) == (p is None):
                    self._fill(profile, costs, i, prev, pi, p)
        self.tail_need = np.array(
            [costs.tail_base_bytes + (self._window(n, k, ai, self.inflight) if n else 0) for ai in range(k)], dtype=np.int64
        )

    def _window(self, i: int, pi: int, last: int, depth: int) -> int:
        """Bytes copied by segments ``i-depth .. i-1``: segment ``i-1`` under the action the
        state knows (``pi``; ``last`` when ``i`` is past the end), the older ones bounded."""
        if depth == 0 or i == 0:
            return 0
        known = self.copies[i - 1][last if i == self.n else pi]
        return known + sum(self.most[max(i - depth, 0):i - 1])

    def _fill(self, profile: ModelProfile, costs: SegmentCosts, i: int, prev: Optional[SegmentProfile], pi: int, p: Optional[Action]) -> None:
        segs, n = profile.segments, self.n
        s = segs[i]
        in_flight = self._window(i, pi, pi, self.inflight)
        prefetched = self._window(i, pi, pi, self.prefetch)
        demand = on_demand(i, n, self.prefetch, overlap=self.overlap)
        for ai, a in enumerate(self.acts):
            self.fwd_need[i, pi, ai] = costs.forward_base_bytes[i] + forward_own(s, a, overlap=self.overlap) + in_flight
            self.bwd_need[i, pi, ai] = backward_need(costs.backward_base_bytes[i], prev, p, s, a, on_demand=demand) + prefetched
            self.add_kept[i, pi, ai] = internal_kept(s, a) + boundary_kept(prev, p, s, a)
            self.add_ms[i, pi, ai] = self._ms(profile, i, pi, p, ai, a)

    def _ms(self, profile: ModelProfile, i: int, pi: int, p: Optional[Action], ai: int, a: Action) -> float:
        """The time segment ``i`` adds (exact for one segment in flight and one prefetched;
        otherwise an estimate: the plan's numbers come from ``simulate``)."""
        segs, n, s = profile.segments, self.n, profile.segments[i]
        ms = recompute_ms(s, a)
        vol = self.copies[i][ai]
        if not self.overlap:
            return ms + vol / profile.d2h_bytes_per_ms + vol / profile.h2d_bytes_per_ms
        hidden = sum(t.forward_ms for t in segs[i + 1:i + 1 + self.inflight])
        if i + self.inflight >= n and self.inflight:
            hidden += profile.tail_ms
        ms += max(0.0, vol / profile.d2h_bytes_per_ms - hidden)
        if p is not None and self.copies[i - 1][pi] and self.prefetch:
            ms += max(0.0, self.copies[i - 1][pi] / profile.h2d_bytes_per_ms - s.backward_ms - recompute_ms(s, a))
        if i == n - 1 or not self.prefetch:
            ms += vol / profile.h2d_bytes_per_ms
        return ms

    @property
    def exact(self) -> bool:
        """Does the state (previous action) see every segment the windows reach?"""
        return self.prefetch <= 1 and self.inflight <= 1


def _pareto(kept: np.ndarray, score: np.ndarray, max_states: int, width: float) -> np.ndarray:
    """Indices of the (kept, score) Pareto front, thinned (Note [Thinning keeps feasibility])."""
    if kept.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((score, kept))
    s = score[order]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], s[:-1])))
    keep = order[s < best_before]
    if keep.size > max_states:
        # Along the front kept ascends and score descends: a bucket's last state is its fastest.
        bucket = kept[keep] // max(int(width), 1)
        last = np.concatenate((bucket[1:] != bucket[:-1], [True]))
        last[0] = True  # the fewest kept bytes: Note [Thinning keeps feasibility]
        keep = keep[last]
    return keep


def _dp(chain: _Transitions, budget: Optional[int], fixed_peak: int, *, minimise_peak: bool, max_states: int) -> Optional[tuple[list[int], float]]:
    """Best action indices and their score (time, or peak when ``minimise_peak``), or None."""
    k = len(chain.acts)
    n = chain.n
    limit = np.iinfo(np.int64).max if budget is None else budget
    width = (budget if budget is not None else max(int(chain.fwd_need.max(initial=1)), 1) * 4) / max_states
    # One front per previous action: kept bytes, score, and back-pointers.
    fronts: dict[int, tuple[np.ndarray, np.ndarray]] = {k: (np.zeros(1, np.int64), np.array([float(fixed_peak) if minimise_peak else 0.0]))}
    history: list[dict[int, tuple[np.ndarray, np.ndarray]]] = []
    for i in range(n):
        new: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = {}
        for pi, (kept, score) in fronts.items():
            for ai in range(k):
                if not chain.allowed[i][ai]:
                    continue
                need = kept + np.maximum(chain.fwd_need[i, pi, ai], chain.bwd_need[i, pi, ai])
                ok = need <= limit
                if not ok.any():
                    continue
                idx = np.nonzero(ok)[0]
                nk = kept[idx] + chain.add_kept[i, pi, ai]
                ns = np.maximum(score[idx], need[idx]) if minimise_peak else score[idx] + chain.add_ms[i, pi, ai]
                new.setdefault(ai, []).append((nk, ns, np.full(idx.size, pi), idx))
        if not new:
            return None
        fronts, back = {}, {}
        for ai, parts in new.items():
            nk = np.concatenate([p[0] for p in parts])
            ns = np.concatenate([p[1] for p in parts])
            keep = _pareto(nk, ns, max_states, width)
            fronts[ai] = (nk[keep], ns[keep])
            back[ai] = (np.concatenate([p[2] for p in parts])[keep], np.concatenate([p[3] for p in parts])[keep])
        history.append(back)
    best: Optional[tuple[float, int, int]] = None
    for ai, (kept, score) in fronts.items():
        need = kept + chain.tail_need[ai]
        final = np.maximum(score, need) if minimise_peak else np.where(need <= limit, score, np.inf)
        j = int(np.argmin(final))
        if np.isfinite(final[j]) and (best is None or final[j] < best[0]):
            best = (float(final[j]), ai, j)
    if best is None:
        return None
    score, ai, j = best
    picks = []
    for i in range(n - 1, -1, -1):
        picks.append(ai)
        pis, idxs = history[i][ai]
        ai, j = int(pis[j]), int(idxs[j])
    return picks[::-1], score


def _min_peak_plan(profile: ModelProfile, costs: SegmentCosts, chain: _Transitions, max_states: int) -> tuple[list[Action], Prediction]:
    """The plan of least predicted peak: the DP's, or where the DP only bounds the copy windows
    (Note [Deep copy windows]) the least of it and the uniform plans, as simulated."""
    acts, window = chain.acts, (chain.prefetch, chain.inflight)
    result = _dp(chain, None, costs.fixed_peak_bytes, minimise_peak=True, max_states=max_states)
    if result is None:  # without a budget every plan is allowed, unless a segment refused them all
        stuck = [f"{s.name} ({s.refusal})" for s, ok in zip(profile.segments, chain.allowed) if not any(ok)]
        raise ValueError(f"`actions` {[a.value for a in acts]}: no allowed action runs on segment(s) {stuck}.")
    picks = [acts[a] for a in result[0]]
    best = (picks, simulate(profile, picks, costs, prefetch_segments=window[0], inflight_segments=window[1]))
    if not chain.exact:
        for action in acts:
            uniform = [action] * chain.n
            if not _runs(profile, uniform):
                continue
            candidate = simulate(profile, uniform, costs, prefetch_segments=window[0], inflight_segments=window[1])
            if candidate.peak_bytes < best[1].peak_bytes:
                best = (uniform, candidate)
    return best


def min_budget_bytes(
    profile: ModelProfile,
    *,
    actions: Optional[Iterable[Action]] = None,
    max_states: int = DEFAULT_MAX_STATES,
    prefetch_segments: Optional[int] = None,
    inflight_segments: int = 1,
) -> int:
    """The smallest predicted peak of any plan: the least budget ``solve`` can meet.
    ``prefetch_segments`` / ``inflight_segments``: as the runtime will run (Note [Copy windows])."""
    acts = _allowed(actions)
    costs = segment_costs(profile)
    if not profile.segments:
        return costs.fixed_peak_bytes
    window = copy_window(prefetch_segments, inflight_segments, overlap=profile.copies_overlap)
    return _min_peak_plan(profile, costs, _Transitions(profile, costs, acts, window), max_states)[1].peak_bytes


def _fastest_fitting(
    profile: ModelProfile, costs: SegmentCosts, chain: _Transitions, budget_bytes: int, max_states: int
) -> Optional[tuple[list[Action], Prediction]]:
    """The DP's plan, or a uniform one that is faster (Note [Never slower than a uniform plan]),
    or where the DP is not exact and found none, the least-peak plan if it fits; all simulated."""
    window = {"prefetch_segments": chain.prefetch, "inflight_segments": chain.inflight}
    best: Optional[tuple[list[Action], Prediction]] = None
    if costs.fixed_peak_bytes > budget_bytes:
        return None
    if not profile.segments:
        return [], simulate(profile, [], costs, **window)
    result = _dp(chain, budget_bytes, costs.fixed_peak_bytes, minimise_peak=False, max_states=max_states)
    if result is not None:
        picks = [chain.acts[a] for a in result[0]]
        best = (picks, simulate(profile, picks, costs, **window))
    # Note [Never slower than a uniform plan]: the plans a user writes by hand (every segment
    # kept, checkpointed, selective, offloaded...) are candidates too. The DP is exact below
    # ``max_states`` and they are in its search space, but thinning may lose one; comparing
    # costs n simulations and makes "auto is at least as fast as the fastest uniform plan that
    # fits", in prediction, a guarantee rather than a property of the search.
    candidates = [[action] * chain.n for action in chain.acts]
    if best is None and not chain.exact:
        candidates.append(_min_peak_plan(profile, costs, chain, max_states)[0])
    for plan in candidates:
        if (best is not None and plan == best[0]) or not _runs(profile, plan):
            continue
        candidate = simulate(profile, plan, costs, **window)
        if candidate.peak_bytes <= budget_bytes and (best is None or candidate.step_ms < best[1].step_ms - 1e-9):
            best = (plan, candidate)
    return best


def solve(
    profile: ModelProfile,
    *,
    budget_bytes: int,
    batch_size: Optional[int] = None,
    actions: Optional[Iterable[Action]] = None,
    max_states: int = DEFAULT_MAX_STATES,
    prefetch_segments: Optional[int] = None,
    inflight_segments: int = 1,
) -> Plan:
    """The plan with the least predicted step time whose predicted peak fits ``budget_bytes``.

    ``batch_size`` (default: the profile's) rescales the profile (Note [Batch scaling]);
    ``actions`` restricts the actions considered; ``prefetch_segments`` / ``inflight_segments``
    are the runtime's settings the plan will run under (Note [Copy windows]; ``None``: the
    runtime's default for the device). Raises :class:`InfeasibleBudgetError`, with the least
    budget any plan fits, when none fits.
    """
    budget_bytes = _check_int(budget_bytes, "budget_bytes")
    if batch_size is not None:
        batch_size = _check_int(batch_size, "batch_size")
        profile = profile.at_batch(batch_size)
    max_states = _check_int(max_states, "max_states")
    acts = _allowed(actions)
    window = copy_window(prefetch_segments, inflight_segments, overlap=profile.copies_overlap)
    costs = segment_costs(profile)
    chain = _Transitions(profile, costs, acts, window)
    found = _fastest_fitting(profile, costs, chain, budget_bytes, max_states)
    if found is None:
        least = min_budget_bytes(profile, actions=acts, max_states=max_states, prefetch_segments=window[0], inflight_segments=window[1])
        raise InfeasibleBudgetError(budget_bytes=budget_bytes, min_budget_bytes=least, batch_size=profile.batch_size)
    picks, prediction = found
    if prediction.peak_bytes > budget_bytes:  # the DP and the simulator disagree: a bug
        raise AssertionError(f"planner chose a plan predicted at {prediction.peak_bytes} bytes over the budget {budget_bytes}")
    plan = Plan(
        actions=dict(zip(profile.names, picks)),
        predicted_peak_bytes=prediction.peak_bytes,
        predicted_step_ms=prediction.step_ms,
        budget_bytes=budget_bytes,
        batch_size=profile.batch_size,
        rows=prediction.rows,
    )
    log.debug("solved %d segments for %d bytes: %s", len(picks), budget_bytes, plan.summary())
    return plan


def brute_force(
    profile: ModelProfile,
    *,
    budget_bytes: int,
    actions: Optional[Iterable[Action]] = None,
    prefetch_segments: Optional[int] = None,
    inflight_segments: int = 1,
) -> Optional[tuple[tuple[Action, ...], float, int]]:
    """Reference for tests: every plan simulated; the fastest that fits (actions, ms, peak), or None."""
    acts = _allowed(actions)
    costs = segment_costs(profile)
    best = None
    for combo in itertools.product(acts, repeat=len(profile.segments)):
        if not _runs(profile, combo):
            continue
        pred = simulate(profile, combo, costs, prefetch_segments=prefetch_segments, inflight_segments=inflight_segments)
        if pred.peak_bytes <= budget_bytes and (best is None or pred.step_ms < best[1] - 1e-9):
            best = (combo, pred.step_ms, pred.peak_bytes)
    return best
