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

Note [Deep copy windows]: with a copy window above 0 where copies overlap compute, a window's
bytes depend on the actions of elements further back than the previous one (what is still in
flight, what is fetched ahead: Note [Copy windows, priced] in :mod:`.costmodel`), which the DP's
state does not hold. The DP then counts, for those older elements, the most any allowed action
copies (:attr:`_Transitions.most`): an upper bound, so whatever the DP picks fits when simulated,
but a plan that fits only with the true older actions may be missed. So ``solve`` and
``min_budget_bytes`` also try the uniform plans and, when the DP found nothing, the DP's
least-peak plan, each checked by :func:`~.costmodel.simulate` (exact for any window), and keep
the best that fits. With windows of 0, or on CPU (copies done when issued), nothing is held for
an older element and the DP is exact.

Note [Lighter selective, as a descent]: the DP sees one selective per segment, its full choice
(Note [Lighter selective] in ``measure/profiler.py``); the lighter choices are tried after it.
Replacing, one segment at a time, a whole recomputation the DP chose by a lighter choice
(:func:`_lighter_selective`) misses the plan that spreads the bytes over several segments: on
the GPT of ``benchmarks/compile_budget.py`` at the compiler's 0.7 budget the DP kept one block
and recomputed another whole, the one-segment step then put that block on its lightest choice
(two of its four matmuls recomputed, +24 ms a step) where every block on its full choice but
one, which recomputes its smallest matmul (+4 ms), fits. So :func:`_selective_descent` also
starts from the DP's plan with every whole recomputation on the full choice and, until the plan
fits, moves one segment the DP keeps or recomputes a step down its choices (kept, full choice,
lighter choices, whole recomputation): the cheapest in milliseconds of those that free the bytes
still missing, else the cheapest per byte freed, as a greedy knapsack does. Simulated (the peak
is not a sum), the result is taken where it is faster than the one-segment steps' plan.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import Optional

import numpy as np

from ..actions import Action
from .costmodel import (
    CopyWindow, SegmentCosts, backward_need, boundary_kept, copied_bytes, elements, forward_own, internal_kept, outside_mask,
    recompute_ms, Prediction, referenced_outputs, resolve_windows, segment_costs, simulate_chain,
)
from ..errors import InfeasibleBudgetError
from .plan import Plan
from ..measure.model_profile import ModelProfile, SegmentProfile

__all__ = ["brute_force", "least_peak_plan", "min_budget_bytes", "solve"]

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


#: A window need that no budget meets: an action an element may not take (Note [What each
#: element may take]).
_FORBIDDEN = 1 << 60


def _runs(profile: ModelProfile, plan: Iterable[Action]) -> bool:
    """No segment gets an action it refused (Note [Refused actions] in model_profile.py);
    ``plan``: one action per element of the chain (a region outside the segments refuses none)."""
    return all(a not in e.refused for e, a in zip(elements(profile), plan))


def _element_actions(acts: tuple[Action, ...], is_outside: bool) -> tuple[Action, ...]:
    """Note [What each element may take]: a segment takes any allowed action; a region outside the
    segments (no module: nothing to recompute) is kept, or offloaded where the allowed actions
    offload at all."""
    if not is_outside:
        return acts
    return (Action.KEEP,) + ((Action.OFFLOAD,) if any(a.offloads for a in acts) else ())


class _Transitions:
    """Per-transition numbers of the cost model, precomputed for the DP (Note [Deep copy windows]).

    The chain is every element of :func:`~.costmodel.elements`; ``acts`` are the actions the DP
    indexes, the allowed ones and ``KEEP`` where only a region may take it."""

    def __init__(self, profile: ModelProfile, costs: SegmentCosts, allowed: tuple[Action, ...], window: CopyWindow) -> None:
        segs = elements(profile)
        self.outside = outside_mask(profile)
        self.n = n = len(segs)
        self.allowed = allowed
        acts = allowed if Action.KEEP in allowed or not any(self.outside) else allowed + (Action.KEEP,)
        self.acts = acts
        #: [i][a]: may element ``i`` take ``acts[a]``? Not an action it refused (Note [Refused
        #: actions] in model_profile.py).
        self.may = [[a in _element_actions(allowed, o) and a not in e.refused for a in acts] for e, o in zip(segs, self.outside)]
        k = len(acts)
        self.overlap = profile.copies_overlap
        self.window = window
        self.prefetch_bytes, self.inflight_bytes = window.prefetch_bytes, window.inflight_bytes
        self.copies = [[copied_bytes(s, a) for a in acts] for s in segs]
        #: The most any allowed action copies, per element: the bound for elements the state forgot.
        self.most = [max((c for c, ok in zip(row, may) if ok), default=0) for row, may in zip(self.copies, self.may)]
        # [i, p, a]: p == k is "no previous segment" (i == 0).
        self.fwd_need = np.zeros((n, k + 1, k), dtype=np.int64)
        self.bwd_need = np.zeros((n, k + 1, k), dtype=np.int64)
        self.add_kept = np.zeros((n, k + 1, k), dtype=np.int64)
        self.add_ms = np.zeros((n, k + 1, k), dtype=np.float64)
        self.segs = segs
        # Note [A region's output stays referenced in forward]: bounded as if never held by the
        # plan (the state does not know the boundary's actions); simulate is exact.
        refs = referenced_outputs(segs, self.outside)
        self.referenced = [sum(segs[r + 1].input_bytes for r in rs) for rs in refs]
        for i, s in enumerate(segs):
            prev = segs[i - 1] if i else None
            for pi in range(k + 1):
                p = acts[pi] if pi < k else None
                if (i == 0) == (p is None):
                    self._fill(profile, costs, i, prev, pi, p)
        self.tail_need = np.array([costs.tail_base_bytes + (self._in_flight(n, k, ai) if n else 0) for ai in range(k)], dtype=np.int64)

    def _before(self, i: int, known: int) -> int:
        """Bytes copied by the elements before ``i``: element ``i-1`` under the action the state
        knows (``known``), the older ones bounded (Note [Deep copy windows])."""
        return self.copies[i - 1][known] + sum(self.most[:i - 1]) if i else 0

    def _in_flight(self, i: int, pi: int, last: int, own: int = 0) -> int:
        """What is in flight in element ``i``'s forward window (past the end: the turnaround, the
        last element's action ``last``), bounded (Note [Copy windows, priced])."""
        if not self.overlap:
            return 0
        return min(self.inflight_bytes, self._before(i, last if i == self.n else pi) + own)

    def _prefetched(self, i: int, pi: int, own: int) -> int:
        if not self.prefetch_bytes:
            return 0
        # Note [Copy windows, priced]: the rest of this element's bytes and those before it,
        # within the window or one storage above it.
        largest = max((s.largest_offload_bytes for s in self.segs[: i + 1]), default=0)
        return min(max(self.prefetch_bytes, largest), own + self._before(i, pi))

    def _fill(self, profile: ModelProfile, costs: SegmentCosts, i: int, prev: Optional[SegmentProfile], pi: int, p: Optional[Action]) -> None:
        s = self.segs[i]
        per_tensor = self.prefetch_bytes == 0  # fetched per saved tensor; else per entry, what is ahead on top
        for ai, a in enumerate(self.acts):
            if not self.may[i][ai]:
                self.fwd_need[i, pi, ai] = _FORBIDDEN
                continue
            in_flight = self._in_flight(i, pi, pi, self.copies[i][ai])
            self.fwd_need[i, pi, ai] = costs.forward_base_bytes[i] + forward_own(s, a) + in_flight + self.referenced[i]
            need = backward_need(costs.backward_base_bytes[i], prev, p, s, a, per_tensor=per_tensor)
            self.bwd_need[i, pi, ai] = need + self._prefetched(i, pi, self.copies[i][ai])
            self.add_kept[i, pi, ai] = internal_kept(s, a) + boundary_kept(prev, p, s, a)
            self.add_ms[i, pi, ai] = self._ms(profile, i, ai, a)

    def _ms(self, profile: ModelProfile, i: int, ai: int, a: Action) -> float:
        """The time segment ``i`` adds: exact where every copy is waited for (windows of 0, or
        CPU), otherwise an estimate (the plan's numbers come from ``simulate``)."""
        s = self.segs[i]
        ms = recompute_ms(s, a)
        vol = self.copies[i][ai]
        if not self.overlap:
            return ms + vol / profile.d2h_bytes_per_ms + vol / profile.h2d_bytes_per_ms
        ms += max(0.0, vol / profile.d2h_bytes_per_ms - (s.forward_ms if self.inflight_bytes else 0.0))
        return ms + max(0.0, vol / profile.h2d_bytes_per_ms - (s.backward_ms if self.prefetch_bytes else 0.0))

    @property
    def exact(self) -> bool:
        """Does the state (previous action) see every element the windows reach (Note [Deep copy
        windows])? Only where nothing is held ahead or in flight."""
        return not self.overlap or (not self.prefetch_bytes and not self.inflight_bytes)


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
    allowed_need = chain.fwd_need[chain.fwd_need < _FORBIDDEN]
    width = (budget if budget is not None else max(int(allowed_need.max(initial=1)), 1) * 4) / max_states
    # One front per previous action: kept bytes, score, and back-pointers.
    fronts: dict[int, tuple[np.ndarray, np.ndarray]] = {k: (np.zeros(1, np.int64), np.array([float(fixed_peak) if minimise_peak else 0.0]))}
    history: list[dict[int, tuple[np.ndarray, np.ndarray]]] = []
    for i in range(n):
        new: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = {}
        for pi, (kept, score) in fronts.items():
            for ai in range(k):
                if not chain.may[i][ai]:
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


def _uniform_plans(chain: _Transitions) -> list[list[Action]]:
    """Note [Never slower than a uniform plan]: every segment given one allowed action, the
    regions outside kept, and (where they may) offloaded."""
    plans = []
    for action in chain.allowed:
        for region in (Action.KEEP, Action.OFFLOAD):
            plan = [region if o else action for o in chain.outside]
            if all(a in chain.acts and chain.may[i][chain.acts.index(a)] for i, a in enumerate(plan)) and plan not in plans:
                plans.append(plan)
    return plans


def _min_peak_plan(profile: ModelProfile, costs: SegmentCosts, chain: _Transitions, max_states: int) -> tuple[list[Action], Prediction]:
    """The plan of least predicted peak (one action per element): the DP's, or where the DP only
    bounds the copy windows (Note [Deep copy windows]) the least of it and the uniform plans, as
    simulated."""
    acts, window = chain.acts, chain.window.keywords()
    result = _dp(chain, None, costs.fixed_peak_bytes, minimise_peak=True, max_states=max_states)
    if result is None:  # without a budget every plan is allowed, unless a segment refused them all
        stuck = [f"{e.name} ({e.refusal})" for e, ok in zip(chain.segs, chain.may) if not any(ok)]
        raise ValueError(f"`actions` {[a.value for a in acts]}: no allowed action runs on segment(s) {stuck}.")
    picks = [acts[a] for a in result[0]]
    best = (picks, simulate_chain(profile, picks, costs, **window))
    if not chain.exact:
        for uniform in _uniform_plans(chain):
            candidate = simulate_chain(profile, uniform, costs, **window)
            if candidate.peak_bytes < best[1].peak_bytes:
                best = (uniform, candidate)
    return best


def min_budget_bytes(
    profile: ModelProfile,
    *,
    actions: Optional[Iterable[Action]] = None,
    max_states: int = DEFAULT_MAX_STATES,
    prefetch_bytes: Optional[int | str] = None,
    inflight_bytes: Optional[int | str] = None,
) -> int:
    """The smallest predicted peak of any plan: the least budget ``solve`` can meet.
    ``prefetch_bytes`` / ``inflight_bytes``: as the runtime will run (Note [Copy windows, priced];
    ``None`` or ``"auto"``: the least over the planner's windows)."""
    return least_peak_plan(
        profile, actions=actions, max_states=max_states, prefetch_bytes=prefetch_bytes, inflight_bytes=inflight_bytes
    ).predicted_peak_bytes


def least_peak_plan(
    profile: ModelProfile,
    *,
    batch_size: Optional[int] = None,
    actions: Optional[Iterable[Action]] = None,
    max_states: int = DEFAULT_MAX_STATES,
    prefetch_bytes: Optional[int | str] = None,
    inflight_bytes: Optional[int | str] = None,
) -> Plan:
    """The lowest-memory plan: the least predicted peak any plan of ``actions`` reaches under the
    windows (the least over them, where the planner chooses), the faster on a tie of windows."""
    if batch_size is not None:
        profile = profile.at_batch(_check_int(batch_size, "batch_size"))
    acts = _allowed(actions)
    costs = segment_costs(profile)
    max_states = _check_int(max_states, "max_states")
    best: Optional[Plan] = None
    for window in resolve_windows(profile, prefetch_bytes, inflight_bytes):
        if not elements(profile):
            plan = _as_plan(profile, [], simulate_chain(profile, [], costs, **window.keywords()), None, window)
        else:
            picks, prediction = _min_peak_plan(profile, costs, _Transitions(profile, costs, acts, window), max_states)
            plan = _as_plan(profile, picks, prediction, None, window)
        if best is None or (plan.predicted_peak_bytes, plan.predicted_step_ms) < (best.predicted_peak_bytes, best.predicted_step_ms):
            best = plan
    assert best is not None
    return best


def _as_plan(profile: ModelProfile, picks: list[Action], prediction: Prediction, budget_bytes: Optional[int], window: CopyWindow) -> Plan:
    """The plan of one action per element (:func:`~.costmodel.elements`), priced under ``window``."""
    chain = profile.chain
    return Plan(
        actions={e.name: a for (e, o), a in zip(chain, picks) if not o},
        outside={e.name: a for (e, o), a in zip(chain, picks) if o},
        predicted_peak_bytes=prediction.peak_bytes,
        predicted_step_ms=prediction.step_ms,
        budget_bytes=budget_bytes,
        batch_size=profile.batch_size,
        rows=prediction.rows,
        prefetch_bytes=window.prefetch_bytes,
        inflight_bytes=window.inflight_bytes,
        selective_ops={
            e.name: e.selective_ops for (e, o), a in zip(chain, picks) if a is Action.SELECTIVE and e.selective_ops is not None
        },
    )


def _fastest_fitting(
    profile: ModelProfile, costs: SegmentCosts, chain: _Transitions, budget_bytes: int, max_states: int
) -> Optional[tuple[list[Action], Prediction, ModelProfile]]:
    """The DP's plan, or a uniform one that is faster (Note [Never slower than a uniform plan]),
    or where the DP is not exact and found none, the least-peak plan if it fits; all simulated;
    then lighter selective choices where they are faster (:func:`_lighter_selective`). With the
    profile that prices it (its segments' selective choices the plan's)."""
    window = chain.window.keywords()
    best: Optional[tuple[list[Action], Prediction]] = None
    if costs.fixed_peak_bytes > budget_bytes:
        return None
    if not chain.n:
        return [], simulate_chain(profile, [], costs, **window), profile
    result = _dp(chain, budget_bytes, costs.fixed_peak_bytes, minimise_peak=False, max_states=max_states)
    if result is not None:
        picks = [chain.acts[a] for a in result[0]]
        best = (picks, simulate_chain(profile, picks, costs, **window))
    # Note [Never slower than a uniform plan]: the plans a user writes by hand (every segment
    # kept, checkpointed, selective, offloaded...) are candidates too. The DP is exact below
    # ``max_states`` and they are in its search space, but thinning may lose one; comparing
    # costs n simulations and makes "auto is at least as fast as the fastest uniform plan that
    # fits", in prediction, a guarantee rather than a property of the search.
    candidates = _uniform_plans(chain)
    if best is None and not chain.exact:
        candidates.append(_min_peak_plan(profile, costs, chain, max_states)[0])
    for plan in candidates:
        if (best is not None and plan == best[0]) or not _runs(profile, plan):
            continue
        candidate = simulate_chain(profile, plan, costs, **window)
        if candidate.peak_bytes <= budget_bytes and (best is None or candidate.step_ms < best[1].step_ms - 1e-9):
            best = (plan, candidate)
    if best is None:
        return None
    found = _lighter_selective(profile, costs, chain, *best, budget_bytes)
    descent = _selective_descent(profile, costs, chain, best[0], budget_bytes)
    if descent is not None and descent[1].step_ms < found[1].step_ms - 1e-9:
        return descent
    return found


def _lighter_selective(
    profile: ModelProfile, costs: SegmentCosts, chain: _Transitions, picks: list[Action], prediction: Prediction, budget_bytes: int,
) -> tuple[list[Action], Prediction, ModelProfile]:
    """Note [Lighter selective] (``profiler.py``): the DP chooses per segment among the actions,
    selective with its full choice of saved ops; between that and whole recomputation lie the
    lighter choices, a few per segment, which would multiply the DP's actions. So after it, each
    segment the plan recomputes whole tries them, the fastest first, the rest of the plan fixed;
    one that fits and is faster replaces recomputation. The one of fewest bytes is tried first:
    where it does not fit, the others are unlikely to (they keep more), so a tight budget costs one
    simulation per recomputed segment. Every candidate simulated: the plan stays within the
    budget and is never slower than the DP's."""
    if Action.SELECTIVE not in chain.acts:
        return picks, prediction, profile
    selective = chain.acts.index(Action.SELECTIVE)
    window = chain.window.keywords()
    chosen: dict[str, tuple[str, ...]] = {}
    priced = profile
    for i, (e, a) in enumerate(zip(chain.segs, picks)):
        if chain.outside[i] or a is not Action.RECOMPUTE or not e.selective_variants or not chain.may[i][selective]:
            continue
        acts = picks[:i] + [Action.SELECTIVE] + picks[i + 1:]

        def tried(ops: tuple[str, ...]) -> Optional[tuple[ModelProfile, Prediction]]:
            trial = profile.with_selective_ops({**chosen, e.name: ops})
            candidate = simulate_chain(trial, acts, costs, **window)
            fits = candidate.peak_bytes <= budget_bytes and candidate.step_ms < prediction.step_ms - 1e-9
            return (trial, candidate) if fits else None

        if tried(min(e.selective_variants, key=lambda v: v[1])[0]) is None:
            continue
        for ops in (v[0] for v in e.selective_variants):  # the fastest first; the lightest fits
            found = tried(ops)
            if found is not None:
                picks, (priced, prediction) = acts, found
                chosen[e.name] = ops
                break
    return picks, prediction, priced


def _descent_choices(e: SegmentProfile, kept: bool) -> list[tuple[Action, Optional[tuple[str, ...]], float, float]]:
    """Note [Lighter selective, as a descent]: segment ``e``'s choices, from keeping it (where
    ``kept``) through selective's full choice and its lighter choices down to whole recomputation:
    each (action, ops selective keeps, bytes kept inside the segment, milliseconds recomputation
    adds, as the cost model prices them)."""
    choices: list[tuple[Action, Optional[tuple[str, ...]], float, float]] = []
    if kept:
        choices.append((Action.KEEP, None, float(e.internal_saved_bytes), 0.0))
    choices.append((Action.SELECTIVE, e.selective_ops, float(e.heavy_bytes), recompute_ms(e, Action.SELECTIVE)))
    for k, v in enumerate(e.selective_variants):
        lighter = e.lighter(k)
        choices.append((Action.SELECTIVE, v[0], float(lighter.heavy_bytes), recompute_ms(lighter, Action.SELECTIVE)))
    choices.append((Action.RECOMPUTE, None, 0.0, recompute_ms(e, Action.RECOMPUTE)))
    return choices


def _next_step(chain: _Transitions, choices: dict, level: dict[int, int], missing: float) -> Optional[tuple[int, int]]:
    """Note [Lighter selective, as a descent]: the next step, (segment, choice): the cheapest in
    milliseconds of those that free the ``missing`` bytes, else the cheapest per byte freed."""
    covering: Optional[tuple[float, int, int]] = None  # (ms, segment, choice)
    cheapest: Optional[tuple[float, int, int]] = None  # (ms per byte, segment, choice)
    for i, own in choices.items():
        at = level[i]
        for to in range(at + 1, len(own)):
            gained = own[at][2] - own[to][2]
            if gained > 0 and chain.may[i][chain.acts.index(own[to][0])]:
                added = max(own[to][3] - own[at][3], 0.0)
                if gained >= missing and (covering is None or added < covering[0]):
                    covering = (added, i, to)
                if cheapest is None or added / gained < cheapest[0]:
                    cheapest = (added / gained, i, to)
    step = covering or cheapest
    return None if step is None else (step[1], step[2])


def _selective_descent(
    profile: ModelProfile, costs: SegmentCosts, chain: _Transitions, picks: list[Action], budget_bytes: int,
) -> Optional[tuple[list[Action], Prediction, ModelProfile]]:
    """Note [Lighter selective, as a descent]: the DP's plan with every segment it recomputes whole
    on selective's full choice instead, then, until the plan fits, one segment the DP keeps or
    recomputes a step down its choices (:func:`_descent_choices`): the step adding the fewest
    milliseconds of those that free the bytes still missing, else the fewest per byte freed;
    simulated once the bytes freed reach the excess. ``None`` where the DP recomputes nothing
    whole that selective may take, or nothing fits."""
    if Action.SELECTIVE not in chain.acts or Action.RECOMPUTE not in chain.acts:
        return None
    selective = chain.acts.index(Action.SELECTIVE)
    movable = [
        i for i, (e, a) in enumerate(zip(chain.segs, picks))
        if not chain.outside[i] and a in (Action.KEEP, Action.RECOMPUTE, Action.SELECTIVE) and chain.may[i][selective]
        and e.selective_ops is not None
    ]
    if not any(picks[i] is Action.RECOMPUTE for i in movable):
        return None
    window = chain.window.keywords()
    acts = list(picks)
    choices = {i: _descent_choices(chain.segs[i], picks[i] is Action.KEEP) for i in movable}
    level = {i: 0 for i in movable}
    for i in movable:
        acts[i] = choices[i][0][0]
    chosen: dict[str, tuple[str, ...]] = {}
    freed, excess = 0.0, None
    for _ in range(sum(len(own) for own in choices.values())):
        if excess is None or freed >= excess:
            trial = profile.with_selective_ops(chosen)
            prediction = simulate_chain(trial, acts, costs, **window)
            if prediction.peak_bytes <= budget_bytes:
                return acts, prediction, trial
            excess, freed = float(prediction.peak_bytes - budget_bytes), 0.0
        step = _next_step(chain, choices, level, excess - freed)
        if step is None:
            return None
        i, to = step
        freed += choices[i][level[i]][2] - choices[i][to][2]
        level[i] = to
        action, ops = choices[i][to][0], choices[i][to][1]
        acts[i] = action
        chosen.pop(chain.segs[i].name, None)
        if action is Action.SELECTIVE and ops != chain.segs[i].selective_ops:
            chosen[chain.segs[i].name] = ops
    trial = profile.with_selective_ops(chosen)
    prediction = simulate_chain(trial, acts, costs, **window)
    return (acts, prediction, trial) if prediction.peak_bytes <= budget_bytes else None


def solve(
    profile: ModelProfile,
    *,
    budget_bytes: int,
    batch_size: Optional[int] = None,
    actions: Optional[Iterable[Action]] = None,
    max_states: int = DEFAULT_MAX_STATES,
    prefetch_bytes: Optional[int | str] = None,
    inflight_bytes: Optional[int | str] = None,
) -> Plan:
    """The plan with the least predicted step time whose predicted peak fits ``budget_bytes``.

    ``batch_size`` (default: the profile's) rescales the profile (Note [Batch scaling]);
    ``actions`` restricts the actions considered for the segments (the regions outside them are
    kept or offloaded: Note [What each element may take]); ``prefetch_bytes`` / ``inflight_bytes``
    are the copy windows the plan will run under (Note [Copy windows, priced]; ``None`` or
    ``"auto"``: the planner chooses, Note [The planner chooses the copy windows]); the plan
    records them. Raises
    :class:`InfeasibleBudgetError`, with the least budget any plan fits, when none fits.
    """
    budget_bytes = _check_int(budget_bytes, "budget_bytes")
    if batch_size is not None:
        batch_size = _check_int(batch_size, "batch_size")
        profile = profile.at_batch(batch_size)
    max_states = _check_int(max_states, "max_states")
    acts = _allowed(actions)
    costs = segment_costs(profile)
    windows = resolve_windows(profile, prefetch_bytes, inflight_bytes)
    keep = [Action.KEEP] * len(profile.chain)
    if Action.KEEP in acts and _runs(profile, keep):
        # No action is predicted faster than keeping (each adds time or none), and the DP keeps
        # the first of equals: where plain fits, it is the plan, found without the DP (2.5 ms of
        # a CPU step's 25 for a small model, at every new batch shape ``auto`` plans).
        prediction = simulate_chain(profile, keep, costs, **windows[0].keywords())
        if prediction.peak_bytes <= budget_bytes:
            return _as_plan(profile, keep, prediction, budget_bytes, windows[0])
    best: Optional[tuple[list[Action], Prediction, ModelProfile, CopyWindow]] = None
    for window in windows:
        found = _fastest_fitting(profile, costs, _Transitions(profile, costs, acts, window), budget_bytes, max_states)
        if found is not None and (best is None or found[1].step_ms < best[1].step_ms - 1e-9):
            best = (*found, window)
    if best is None:
        least = min(
            least_peak_plan(profile, actions=acts, max_states=max_states, **w.keywords()).predicted_peak_bytes for w in windows
        )
        raise InfeasibleBudgetError(budget_bytes=budget_bytes, min_budget_bytes=least, batch_size=profile.batch_size)
    picks, prediction, priced, window = best
    if prediction.peak_bytes > budget_bytes:  # the DP and the simulator disagree: a bug
        raise AssertionError(f"planner chose a plan predicted at {prediction.peak_bytes} bytes over the budget {budget_bytes}")
    plan = _as_plan(priced, picks, prediction, budget_bytes, window)
    log.debug("solved %d elements for %d bytes: %s", len(picks), budget_bytes, plan.summary())
    return plan


def brute_force(
    profile: ModelProfile,
    *,
    budget_bytes: int,
    actions: Optional[Iterable[Action]] = None,
    prefetch_bytes: Optional[int | str] = None,
    inflight_bytes: Optional[int | str] = None,
) -> Optional[tuple[tuple[Action, ...], float, int]]:
    """Reference for tests: every plan simulated (the regions outside the segments kept or
    offloaded too, under every window ``solve`` would price); the fastest that fits (the
    segments' actions, ms, peak), or None."""
    acts = _allowed(actions)
    costs = segment_costs(profile)
    mask = outside_mask(profile)
    best = None
    for window in resolve_windows(profile, prefetch_bytes, inflight_bytes):
        for combo in itertools.product(*(_element_actions(acts, o) for o in mask)):
            if not _runs(profile, combo):
                continue
            pred = simulate_chain(profile, combo, costs, **window.keywords())
            if pred.peak_bytes <= budget_bytes and (best is None or pred.step_ms < best[1] - 1e-9):
                best = (tuple(a for a, o in zip(combo, mask) if not o), pred.step_ms, pred.peak_bytes)
    return best
