"""The cost model: what a plan costs in device memory and step time, from a profile.

Note [Memory model]: the profile measures a plain step (all segments kept) and the peak bytes
of each window of it: each segment's forward, each segment's backward, the tail (head, loss
and its backward) and the parts before the first segment. Under a plan, a window's peak is
that measurement with the plan-dependent bytes swapped:

- ``kept`` before segment ``i``: what segments ``< i`` hold on the device until their backward
  (their saved storages that the action keeps, plus the boundary tensors between segments
  that someone keeps: a segment's output is held if it saves it itself, if the next segment
  keeps its input, or if any other part of the model saves it);
- the segment's own bytes in its window: in forward what its action keeps, in backward
  everything it saved when kept, since a recomputed segment rematerialises its activations
  during its own backward and an offloaded one fetches them back (``SELECTIVE`` also holds the
  outputs of heavy ops that a kept segment would not have saved).

``base = measured - kept_plain - own_plain`` is what the plan cannot change, and a plan's
window peak is ``base + kept_plan + own_plan``; so the all-``KEEP`` plan predicts the
measurement exactly, and each other plan is off only where actions interact in ways the
per-segment terms miss. Every term depends on one segment's action and the previous
segment's (the boundary), which is what makes the chain dynamic program of :mod:`.solver`
exact.

Note [Time model]: step time is the measured plain step, plus recomputation (a segment's
forward; ``SELECTIVE`` its forward minus the time in heavy ops), plus the part of the copies
that compute does not hide. On CPU the runtime copies synchronously, so all copy time shows.
On CUDA two copy engines (device-to-host, host-to-device) run beside compute, each a queue: a
segment's device-to-host copy is queued when its forward ends and the compute waits for it at
the end of the forward ``inflight_segments`` segments later (at once with 0; the backward's
start waits for all); its host-to-device copy is queued when the backward of one of the
``prefetch_segments`` segments after it starts (or on demand, when nothing prefetched it) and
the compute waits for it before the segment's own backward. The queues are simulated against
the compute timeline under those rules in :func:`simulate`.

Note [Copy windows]: what the offload engine holds beyond the segment running depends on two
runtime settings, which the plan must be made for (the runtime's defaults when not given):

- ``inflight_segments = m``: on CUDA the sources of the copies to the host of the last ``m``
  segments stay on the device until the compute waits for them (Note [Stream protocol], rule
  2), so segment ``i``'s forward window holds segments ``i-m .. i-1``'s copied bytes, and the
  tail segments ``n-m .. n-1``'s. On CPU copies are done when issued and the source drops at
  once: ``m`` changes nothing (measured: the same peak for ``m`` in 0..3).
- ``prefetch_segments = k``: when segment ``i``'s backward starts, segments ``i-1 .. i-k``
  are fetched back (Note [Prefetch schedule] in ``engine/offload.py``), on CPU too; so
  segment ``i``'s backward window holds those bytes, and segment ``i``'s own offloaded bytes
  arrive all at once (fetched when ``i+1``'s backward started) instead of one op at a time —
  except the last segment's, which nothing prefetches, and every segment's with ``k = 0`` on
  CPU (:func:`on_demand`). On CUDA the own bytes are counted all at once in any case.

Measured on CPU (a 6-layer GPT and a 7-segment MLP chain, plans mixing every action, ``k`` in
0..3): the predicted peak equals the measured one to within 3%, never under it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from ..actions import Action
from ..config import check_inflight_segments
from ..segments import split_call
from .plan import PlanRow
from ..measure.model_profile import ModelProfile, SegmentProfile

__all__ = ["Prediction", "SegmentCosts", "backward_need", "copy_window", "copy_window_of", "on_demand", "segment_costs", "simulate"]


def held_in(s: SegmentProfile, a: Action) -> bool:
    """Does segment ``s`` under ``a`` keep its input on the device until its backward?"""
    if a is Action.KEEP:
        return s.input_saved
    if a is Action.OFFLOAD:
        return s.input_saved and s.input_small
    if a in (Action.RECOMPUTE, Action.SELECTIVE):
        return True  # checkpoint keeps its inputs
    return s.input_small  # RECOMPUTE_OFFLOAD: the inputs go to the host unless small


def held_out(s: SegmentProfile, a: Action) -> bool:
    """Does segment ``s`` under ``a`` keep its output on the device until its backward?"""
    if a is Action.KEEP:
        return s.output_saved
    if a is Action.OFFLOAD:
        return s.output_saved and s.output_small
    if a is Action.SELECTIVE:
        return s.output_heavy
    return False


def internal_kept(s: SegmentProfile, a: Action) -> int:
    if a is Action.KEEP:
        return s.internal_saved_bytes
    if a is Action.OFFLOAD:
        return s.internal_small_bytes
    if a is Action.SELECTIVE:
        return s.heavy_bytes
    return 0


def forward_own(s: SegmentProfile, a: Action, *, overlap: bool) -> int:
    """Bytes of segment ``s`` alive at its own forward's peak beyond the window's base.

    Note [A forward that does not keep]: kept, a segment's forward ends holding everything it
    saves. Recomputed, or offloaded by copies done when issued (CPU), its saved tensors are not
    held for backward, yet its forward still holds what its own code references — a block's
    ``q, k, v`` stay alive in its frame to its end — which no trace of ops can see; so it is
    measured, by running the segment with nothing saved (:mod:`.costs`). With ``W`` that
    working set, ``S`` the saved bytes and ``w`` the kept forward's working bytes, the window's
    peak is its start level plus ``W``, i.e. the base plus ``S - w + W``; plus what the action
    keeps. Not measured (a fake profile): as kept, which never under-predicts. Offloaded with
    copies beside compute (CUDA), the sources stay until their copies are waited for (Note
    [Stream protocol], rule 2): all of it, as kept.
    """
    if a is Action.KEEP or (a is Action.OFFLOAD and overlap) or s.released_forward_working_bytes < 0:
        return s.internal_saved_bytes
    own = s.internal_saved_bytes - s.forward_working_bytes + s.released_forward_working_bytes
    return max(0, own) + internal_kept(s, a)


def copied_bytes(s: SegmentProfile, a: Action) -> int:
    """Bytes this segment sends to the host and back (no cross-segment de-duplication)."""
    if a is Action.OFFLOAD:
        return s.offload_bytes
    if a is Action.RECOMPUTE_OFFLOAD:
        return 0 if s.input_small else s.input_bytes
    return 0


#: Note [An action is never free]: the least any action but ``KEEP`` adds to a step (hooks,
#: bookkeeping, a copy's launch). Measured costs are differences of two noisy timings and came
#: out at 0 (issue 20: ``selective`` chosen at a budget everything fits, its row ``+0.00 ms``):
#: recomputation is floored at the forward of the ops it runs again (the whole segment's for
#: ``RECOMPUTE``; the ops outside the heavy ones for ``SELECTIVE``), and every action at this,
#: so that among plans of equal predicted time the one that does less (keep first) wins.
MIN_ACTION_MS = 0.01


def recompute_ms(s: SegmentProfile, a: Action) -> float:
    """What recomputing ``s`` under ``a`` adds: measured on the device when the profile timed the
    action (:mod:`.costs`), never less than the forward of the ops it runs again (Note [An
    action is never free]); ``OFFLOAD``'s floor (its copies are priced in :func:`simulate`)."""
    if a in (Action.RECOMPUTE, Action.RECOMPUTE_OFFLOAD):
        return max(s.recompute_ms or 0.0, s.forward_ms, MIN_ACTION_MS)
    if a is Action.SELECTIVE:
        return max(s.selective_ms or 0.0, s.forward_ms - s.heavy_forward_ms, MIN_ACTION_MS)
    if a is Action.OFFLOAD:
        return MIN_ACTION_MS
    return 0.0


def boundary_held(prev: Optional[SegmentProfile], p: Optional[Action], s: SegmentProfile, a: Action) -> bool:
    """Is segment ``s``'s input alive until ``s``'s backward (Note [Memory model])?"""
    mine = held_in(s, a) or s.input_held_elsewhere
    if s.input_from_previous and prev is not None and p is not None:
        return mine or held_out(prev, p)
    return mine


def boundary_kept(prev: Optional[SegmentProfile], p: Optional[Action], s: SegmentProfile, a: Action) -> int:
    """Bytes of the boundary before ``s`` that stay on the device past ``s``'s forward."""
    total = s.input_bytes if boundary_held(prev, p, s, a) else 0
    if not s.input_from_previous and prev is not None and p is not None:
        total += prev.output_bytes if (held_out(prev, p) or prev.output_held_elsewhere) else 0
    return total


def backward_own(prev: Optional[SegmentProfile], p: Optional[Action], s: SegmentProfile, a: Action, *, on_demand: bool) -> int:
    """Bytes of segment ``s`` alive during its backward, beyond ``kept``.

    ``on_demand``: offloaded tensors come back one op at a time (no prefetch, as on CPU), so an
    offloaded segment's backward peak is the profiler's estimate for that
    (Note [Offloaded backward fetches on demand] in :mod:`.trace`), not all of it at once.
    """
    own = s.internal_saved_bytes + (s.heavy_unsaved_bytes if a is Action.SELECTIVE else 0)
    if s.input_saved or a.recomputes or boundary_held(prev, p, s, a):
        own += s.input_bytes
    if s.output_saved or held_out(s, a):
        own += s.output_bytes
    if on_demand and a is Action.OFFLOAD:
        own -= max(0, s.backward_peak_bytes - s.offload_backward_peak_bytes)
    elif fetches_held_input(prev, p, s, a):
        own += s.input_bytes
    return own


def fetches_held_input(prev: Optional[SegmentProfile], p: Optional[Action], s: SegmentProfile, a: Action) -> bool:
    """Note [A fetched input beside its original]: a segment that offloads its input copies the
    storage, wherever it came from; when the previous segment (or another part of the model)
    keeps that same storage on the device, the bytes fetched back for the backward are a second
    device copy of it, alive beside the original for the whole backward window. Measured on CPU
    with a prefetch (an offloaded segment after a ``SELECTIVE`` one whose output is a heavy op's:
    the window was one input over the prediction). Fetched op by op (on demand), the profiler's
    estimate already covers it."""
    if a is Action.OFFLOAD:
        offloads_input = s.input_saved and not s.input_small
    elif a is Action.RECOMPUTE_OFFLOAD:
        offloads_input = not s.input_small
    else:
        return False
    if not offloads_input:
        return False
    if s.input_held_elsewhere:
        return True
    return s.input_from_previous and prev is not None and p is not None and held_out(prev, p)


def backward_need(base: int, prev: Optional[SegmentProfile], p: Optional[Action], s: SegmentProfile, a: Action, *, on_demand: bool) -> int:
    """Bytes of segment ``s``'s backward window beyond what earlier segments keep: its own bytes
    on top of the plan-independent ``base``; for a recomputed segment also the recomputation's
    forward, whose transient working set (cuDNN / cuBLAS workspaces included) runs before the
    backward's: the window's base without the backward's working bytes, plus the segment's
    input and its forward's working bytes."""
    need = base + backward_own(prev, p, s, a, on_demand=on_demand)
    if a.recomputes:
        need = max(need, base - s.backward_working_bytes + s.input_bytes + s.forward_working_bytes)
    return need


@dataclass(frozen=True, kw_only=True)
class SegmentCosts:
    """The plan-independent part of each window, derived from the all-``KEEP`` measurement."""

    forward_base_bytes: tuple[int, ...]
    backward_base_bytes: tuple[int, ...]
    tail_base_bytes: int
    fixed_peak_bytes: int  # windows no action changes (before the first segment, after its backward, the optimizer step)
    base_ms: float  # the plain step


def segment_costs(profile: ModelProfile) -> SegmentCosts:
    segs = profile.segments
    fwd, bwd = [], []
    kept = 0
    prev: Optional[SegmentProfile] = None
    for s in segs:
        p = Action.KEEP if prev is not None else None
        fwd.append(s.forward_peak_bytes - kept - internal_kept(s, Action.KEEP))
        bwd.append(s.backward_peak_bytes - kept - backward_own(prev, p, s, Action.KEEP, on_demand=False))
        kept += internal_kept(s, Action.KEEP) + boundary_kept(prev, p, s, Action.KEEP)
        prev = s
    return SegmentCosts(
        forward_base_bytes=tuple(fwd),
        backward_base_bytes=tuple(bwd),
        tail_base_bytes=profile.tail_peak_bytes - kept,
        fixed_peak_bytes=max(
            profile.prefix_forward_peak_bytes, profile.prefix_backward_peak_bytes, profile.static_bytes, profile.optimizer_peak_bytes
        ),
        base_ms=profile.step_ms,
    )


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the cost model predicts for one plan."""

    peak_bytes: int
    step_ms: float
    forward_peak_bytes: tuple[int, ...]
    backward_peak_bytes: tuple[int, ...]
    tail_peak_bytes: int
    rows: tuple[PlanRow, ...]


def _as_list(profile: ModelProfile, actions: Mapping[str, Action] | Sequence[Action]) -> list[Action]:
    if isinstance(actions, Mapping):
        # A plan may name a module run several times once, for every call (Note [A segment per call]).
        acts = [actions.get(n, actions.get(split_call(n)[0])) for n in profile.names]
        missing = [n for n, a in zip(profile.names, acts) if a is None]
        if missing:
            raise ValueError(f"`actions` has no action for segments {missing}.")
        return acts
    actions = list(actions)
    if len(actions) != len(profile.segments):
        raise ValueError(f"`actions` has {len(actions)} entries for {len(profile.segments)} segments.")
    return actions


def copy_window(prefetch_segments: Optional[int], inflight_segments: int, *, overlap: bool) -> tuple[int, int]:
    """``(prefetch, inflight)`` as the engine runs them (Note [Copy windows]): ``None`` prefetch
    is the engine's default for the device (one segment where copies overlap compute, none on
    CPU); on CPU copies are done when issued, so nothing is ever in flight."""
    if prefetch_segments is None:
        prefetch_segments = 1 if overlap else 0
    if isinstance(prefetch_segments, bool) or not isinstance(prefetch_segments, int) or prefetch_segments < 0:
        raise ValueError(f"`prefetch_segments` must be an int >= 0 or None; got {prefetch_segments!r}.")
    inflight_segments = check_inflight_segments(inflight_segments)
    return prefetch_segments, inflight_segments if overlap else 0


def copy_window_of(config: Any) -> dict[str, Any]:
    """The keywords of :func:`simulate` / ``solve`` / ``min_budget_bytes`` that a
    :class:`~lightning_swap.core.config.SwapConfig` sets (Note [Copy windows]): pass
    ``**copy_window_of(config)`` where a plan is made for a session's runtime."""
    return {"prefetch_segments": config.prefetch_segments, "inflight_segments": config.inflight_segments}


def on_demand(i: int, n: int, prefetch: int, *, overlap: bool) -> bool:
    """Does segment ``i``'s backward fetch its offloaded bytes one op at a time (Note [Copy
    windows])? On CPU, unless a later segment's backward prefetched them."""
    return not overlap and (prefetch == 0 or i == n - 1)


def _window(values: Sequence[int], lo: int, hi: int) -> int:
    """``sum(values[lo:hi])`` with ``lo`` clipped at 0."""
    return sum(values[max(lo, 0):max(hi, 0)])


@dataclass
class _Walk:
    """The state of one walk of :func:`simulate` over the step's timeline."""

    segs: tuple[SegmentProfile, ...]
    acts: list[Action]
    costs: SegmentCosts
    copies: list[int]
    added: list[float]
    prefetch: int
    inflight: int
    overlap: bool
    clock: float = 0.0
    kept_before: list[int] = field(default_factory=list)
    kept_rows: list[int] = field(default_factory=list)


def _wait_d2h(walk: _Walk, pending: dict[int, float], upto: int) -> None:
    """The compute stream waits for the copies to the host of segments ``<= upto`` (rule 2 of
    Note [Stream protocol]); the wait is charged to the last of them."""
    done = [j for j in pending if j <= upto]
    if not done:
        return
    wait = max(0.0, max(pending[j] for j in done) - walk.clock)
    walk.added[max(done)] += wait
    walk.clock += wait
    for j in done:
        del pending[j]


def _forward(walk: _Walk, profile: ModelProfile) -> tuple[list[int], int]:
    """Forward, with the device-to-host engine: the window peaks and the tail's."""
    segs, acts, copies, costs = walk.segs, walk.acts, walk.copies, walk.costs
    pending: dict[int, float] = {}  # segment -> when its copy to the host is done
    d2h_free = 0.0
    kept = 0
    peaks = []
    for i, (s, a) in enumerate(zip(segs, acts)):
        prev, p = (segs[i - 1], acts[i - 1]) if i else (None, None)
        in_flight = _window(copies, i - walk.inflight, i)
        peaks.append(costs.forward_base_bytes[i] + kept + forward_own(s, a, overlap=walk.overlap) + in_flight)
        walk.clock += s.forward_ms
        if copies[i] and walk.overlap:
            d2h_free = max(walk.clock, d2h_free) + copies[i] / profile.d2h_bytes_per_ms
            pending[i] = d2h_free
        elif copies[i]:  # synchronous memcpy on CPU
            walk.clock += copies[i] / profile.d2h_bytes_per_ms
            walk.added[i] += copies[i] / profile.d2h_bytes_per_ms
        _wait_d2h(walk, pending, i - walk.inflight)
        walk.kept_before.append(kept)
        walk.kept_rows.append(internal_kept(s, a) + boundary_kept(prev, p, s, a))
        kept += walk.kept_rows[-1]
    n = len(segs)
    tail_peak = costs.tail_base_bytes + kept + _window(copies, n - walk.inflight, n)
    walk.clock += profile.tail_ms
    _wait_d2h(walk, pending, n)  # the backward needs every source's copy
    return peaks, tail_peak


def _backward(walk: _Walk, profile: ModelProfile) -> list[int]:
    """Backward, last segment first, with the host-to-device engine: the window peaks."""
    segs, acts, copies, costs = walk.segs, walk.acts, walk.copies, walk.costs
    n = len(segs)
    fetched: dict[int, float] = {}  # segment -> when its fetch is done
    h2d_free = 0.0
    peaks = []
    for i in range(n - 1, -1, -1):
        s, a = segs[i], acts[i]
        prev, p = (segs[i - 1], acts[i - 1]) if i else (None, None)
        if copies[i]:
            if not walk.overlap:
                wait = copies[i] / profile.h2d_bytes_per_ms
            else:
                if i not in fetched:  # nothing prefetched it: fetch now
                    h2d_free = max(walk.clock, h2d_free) + copies[i] / profile.h2d_bytes_per_ms
                    fetched[i] = h2d_free
                wait = max(0.0, fetched[i] - walk.clock)
            walk.added[i] += wait
            walk.clock += wait
        for j in range(i - 1, i - walk.prefetch - 1, -1):  # issued as this backward starts
            if j >= 0 and copies[j] and j not in fetched:
                h2d_free = max(walk.clock, h2d_free) + copies[j] / profile.h2d_bytes_per_ms
                fetched[j] = h2d_free
        prefetched = _window(copies, i - walk.prefetch, i)
        demand = on_demand(i, n, walk.prefetch, overlap=walk.overlap)
        peaks.append(walk.kept_before[i] + backward_need(costs.backward_base_bytes[i], prev, p, s, a, on_demand=demand) + prefetched)
        walk.clock += s.backward_ms + recompute_ms(s, a)
    peaks.reverse()
    return peaks


def simulate(
    profile: ModelProfile,
    actions: Mapping[str, Action] | Sequence[Action],
    costs: Optional[SegmentCosts] = None,
    *,
    prefetch_segments: Optional[int] = None,
    inflight_segments: int = 1,
) -> Prediction:
    """Walk the step's timeline under ``actions`` (Notes [Memory model], [Time model] and [Copy
    windows]); ``prefetch_segments`` / ``inflight_segments`` as given to the runtime."""
    acts = _as_list(profile, actions)
    costs = costs or segment_costs(profile)
    segs = profile.segments
    prefetch, inflight = copy_window(prefetch_segments, inflight_segments, overlap=profile.copies_overlap)
    copies = [copied_bytes(s, a) for s, a in zip(segs, acts)]
    walk = _Walk(
        segs=segs, acts=acts, costs=costs, copies=copies, added=[recompute_ms(s, a) for s, a in zip(segs, acts)],
        prefetch=prefetch, inflight=inflight, overlap=profile.copies_overlap,
    )
    fwd_peaks, tail_peak = _forward(walk, profile)
    bwd_peaks = _backward(walk, profile)
    peak = max(costs.fixed_peak_bytes, tail_peak, *fwd_peaks, *bwd_peaks) if segs else costs.fixed_peak_bytes
    rows = tuple(
        PlanRow(
            segment=s.name,
            action=a,
            kept_bytes=walk.kept_rows[i],
            offloaded_bytes=copies[i],
            recomputed_bytes=(s.internal_saved_bytes - (s.heavy_bytes if a is Action.SELECTIVE else 0)) if a.recomputes else 0,
            added_ms=walk.added[i],
        )
        for i, (s, a) in enumerate(zip(segs, acts))
    )
    return Prediction(
        peak_bytes=int(peak),
        step_ms=costs.base_ms + sum(walk.added),
        forward_peak_bytes=tuple(fwd_peaks),
        backward_peak_bytes=tuple(bwd_peaks),
        tail_peak_bytes=int(tail_peak),
        rows=rows,
    )
