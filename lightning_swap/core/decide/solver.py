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
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import Optional

import numpy as np

from ..actions import Action
from .costmodel import SegmentCosts, backward_need, boundary_kept, copied_bytes, forward_own, internal_kept, recompute_ms, segment_costs, simulate
from ..errors import InfeasibleBudgetError
from .plan import Plan
from ..measure.model_profile import ModelProfile

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


class _Chain:
    """Per-transition numbers of the cost model, precomputed for the DP."""

    def __init__(self, profile: ModelProfile, costs: SegmentCosts, acts: tuple[Action, ...]) -> None:
        segs = profile.segments
        self.n = len(segs)
        self.acts = acts
        k = len(acts)
        n = self.n
        overlap = profile.copies_overlap
        d2h, h2d = profile.d2h_bytes_per_ms, profile.h2d_bytes_per_ms
        # [i, p, a]: p == k is "no previous segment" (i == 0).
        self.fwd_need = np.zeros((n, k + 1, k), dtype=np.int64)
        self.bwd_need = np.zeros((n, k + 1, k), dtype=np.int64)
        self.add_kept = np.zeros((n, k + 1, k), dtype=np.int64)
        self.add_ms = np.zeros((n, k + 1, k), dtype=np.float64)
        copies = [[copied_bytes(s, a) for a in acts] for s in segs]
        for i, s in enumerate(segs):
            prev = segs[i - 1] if i else None
            for pi in range(k + 1):
                p = acts[pi] if pi < k else None
                if (i == 0) != (p is None):
                    continue
                in_flight = copies[i - 1][pi] if (overlap and p is not None) else 0
                for ai, a in enumerate(acts):
                    self.fwd_need[i, pi, ai] = costs.forward_base_bytes[i] + forward_own(s, a, overlap=overlap) + in_flight
                    self.bwd_need[i, pi, ai] = backward_need(costs.backward_base_bytes[i], prev, p, s, a, on_demand=not overlap) + in_flight
                    self.add_kept[i, pi, ai] = internal_kept(s, a) + boundary_kept(prev, p, s, a)
                    ms = recompute_ms(s, a)
                    vol = copies[i][ai]
                    if overlap:
                        window = segs[i + 1].forward_ms if i + 1 < n else profile.tail_ms
                        ms += max(0.0, vol / d2h - window)
                        if p is not None and copies[i - 1][pi]:
                            ms += max(0.0, copies[i - 1][pi] / h2d - s.backward_ms - recompute_ms(s, a))
                        if i == n - 1:
                            ms += vol / h2d
                    else:
                        ms += vol / d2h + vol / h2d
                    self.add_ms[i, pi, ai] = ms
        self.tail_need = np.array(
            [costs.tail_base_bytes + (copies[-1][ai] if overlap and n else 0) for ai in range(k)], dtype=np.int64
        )


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


def _dp(chain: _Chain, budget: Optional[int], fixed_peak: int, *, minimise_peak: bool, max_states: int) -> Optional[tuple[list[int], float]]:
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


def min_budget_bytes(profile: ModelProfile, *, actions: Optional[Iterable[Action]] = None, max_states: int = DEFAULT_MAX_STATES) -> int:
    """The smallest predicted peak of any plan: the least budget ``solve`` can meet."""
    acts = _allowed(actions)
    costs = segment_costs(profile)
    if not profile.segments:
        return costs.fixed_peak_bytes
    result = _dp(_Chain(profile, costs, acts), None, costs.fixed_peak_bytes, minimise_peak=True, max_states=max_states)
    assert result is not None  # without a budget every plan is allowed
    picks, _ = result
    return simulate(profile, [acts[a] for a in picks], costs).peak_bytes


def solve(
    profile: ModelProfile,
    *,
    budget_bytes: int,
    batch_size: Optional[int] = None,
    actions: Optional[Iterable[Action]] = None,
    max_states: int = DEFAULT_MAX_STATES,
) -> Plan:
    """The plan with the least predicted step time whose predicted peak fits ``budget_bytes``.

    ``batch_size`` (default: the profile's) rescales the profile (Note [Batch scaling]);
    ``actions`` restricts the actions considered. Raises :class:`InfeasibleBudgetError`, with
    the least budget any plan fits, when none fits.
    """
    budget_bytes = _check_int(budget_bytes, "budget_bytes")
    if batch_size is not None:
        batch_size = _check_int(batch_size, "batch_size")
        profile = profile.at_batch(batch_size)
    max_states = _check_int(max_states, "max_states")
    acts = _allowed(actions)
    costs = segment_costs(profile)
    result = None
    if costs.fixed_peak_bytes <= budget_bytes and profile.segments:
        result = _dp(_Chain(profile, costs, acts), budget_bytes, costs.fixed_peak_bytes, minimise_peak=False, max_states=max_states)
    if result is None and profile.segments or costs.fixed_peak_bytes > budget_bytes:
        raise InfeasibleBudgetError(
            budget_bytes=budget_bytes, min_budget_bytes=min_budget_bytes(profile, actions=acts, max_states=max_states),
            batch_size=profile.batch_size,
        )
    picks = [acts[a] for a in result[0]] if result is not None else []
    prediction = simulate(profile, picks, costs)
    # Note [Never slower than a uniform plan]: the plans a user writes by hand (every segment
    # kept, checkpointed, selective, offloaded...) are candidates too. The DP is exact below
    # ``max_states`` and they are in its search space, but thinning may lose one; comparing
    # costs n simulations and makes "auto is at least as fast as the fastest uniform plan that
    # fits", in prediction, a guarantee rather than a property of the search.
    for action in acts:
        uniform = [action] * len(profile.segments)
        if uniform == picks or not uniform:
            continue
        candidate = simulate(profile, uniform, costs)
        if candidate.peak_bytes <= budget_bytes and candidate.step_ms < prediction.step_ms - 1e-9:
            picks, prediction = uniform, candidate
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


def brute_force(profile: ModelProfile, *, budget_bytes: int, actions: Optional[Iterable[Action]] = None) -> Optional[tuple[tuple[Action, ...], float, int]]:
    """Reference for tests: every plan simulated; the fastest that fits (actions, ms, peak), or None."""
    acts = _allowed(actions)
    costs = segment_costs(profile)
    best = None
    for combo in itertools.product(acts, repeat=len(profile.segments)):
        pred = simulate(profile, combo, costs)
        if pred.peak_bytes <= budget_bytes and (best is None or pred.step_ms < best[1] - 1e-9):
            best = (combo, pred.step_ms, pred.peak_bytes)
    return best

