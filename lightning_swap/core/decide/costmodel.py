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
On CUDA two copy engines (device-to-host, host-to-device) run beside compute: a segment's
device-to-host copy starts when its forward ends and the compute waits for it at the end of
the next segment's forward (so at most one segment's copies are in flight, and its bytes
count as alive during that forward); its host-to-device copy starts when the backward of the
next segment starts (one segment of prefetch) and the compute waits for it before the
segment's own backward (its bytes count as alive during the next segment's backward). The
queues are simulated against the compute timeline under those rules in :func:`simulate`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from ..actions import Action
from .plan import PlanRow
from ..measure.model_profile import ModelProfile, SegmentProfile

__all__ = ["Prediction", "SegmentCosts", "backward_need", "segment_costs", "simulate"]


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
    return own


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
        missing = [n for n in profile.names if n not in actions]
        if missing:
            raise ValueError(f"`actions` has no action for segments {missing}.")
        return [actions[n] for n in profile.names]
    actions = list(actions)
    if len(actions) != len(profile.segments):
        raise ValueError(f"`actions` has {len(actions)} entries for {len(profile.segments)} segments.")
    return actions


def simulate(profile: ModelProfile, actions: Mapping[str, Action] | Sequence[Action], costs: Optional[SegmentCosts] = None) -> Prediction:
    """Walk the step's timeline under ``actions`` (Notes [Memory model] and [Time model])."""
    acts = _as_list(profile, actions)
    costs = costs or segment_costs(profile)
    segs = profile.segments
    n = len(segs)
    overlap = profile.copies_overlap
    d2h_rate, h2d_rate = profile.d2h_bytes_per_ms, profile.h2d_bytes_per_ms
    copies = [copied_bytes(s, a) for s, a in zip(segs, acts)]
    fwd_peaks, bwd_peaks, kept_before, kept_rows = [], [], [], []
    added = [recompute_ms(s, a) for s, a in zip(segs, acts)]

    # Forward: compute clock and the device-to-host engine.
    clock = 0.0
    d2h_done: Optional[float] = None
    kept = 0
    for i, (s, a) in enumerate(zip(segs, acts)):
        prev, p = (segs[i - 1], acts[i - 1]) if i else (None, None)
        in_flight = copies[i - 1] if (overlap and i and d2h_done is not None) else 0
        fwd_peaks.append(costs.forward_base_bytes[i] + kept + forward_own(s, a, overlap=overlap) + in_flight)
        clock += s.forward_ms
        if d2h_done is not None:  # wait for the previous segment's copy to the host
            wait = max(0.0, d2h_done - clock)
            added[i - 1] += wait
            clock += wait
            d2h_done = None
        if copies[i]:
            if overlap:
                d2h_done = clock + copies[i] / d2h_rate
            else:  # synchronous memcpy on CPU
                clock += copies[i] / d2h_rate
                added[i] += copies[i] / d2h_rate
        kept_before.append(kept)
        step_kept = internal_kept(s, a) + boundary_kept(prev, p, s, a)
        kept_rows.append(step_kept)
        kept += step_kept
    tail_in_flight = copies[-1] if (overlap and d2h_done is not None) else 0
    tail_peak = costs.tail_base_bytes + kept + tail_in_flight
    clock += profile.tail_ms
    if d2h_done is not None:
        wait = max(0.0, d2h_done - clock)
        added[-1] += wait
        clock += wait

    # Backward, last segment first, with the host-to-device engine.
    h2d_done: Optional[float] = None  # the fetch of the segment whose backward comes next
    for i in range(n - 1, -1, -1):
        s, a = segs[i], acts[i]
        prev, p = (segs[i - 1], acts[i - 1]) if i else (None, None)
        if copies[i]:
            if overlap:
                if h2d_done is None:  # nothing prefetched it: fetch now
                    h2d_done = clock + copies[i] / h2d_rate
                wait = max(0.0, h2d_done - clock)
            else:
                wait = copies[i] / h2d_rate
            added[i] += wait
            clock += wait
        h2d_done = None
        prefetched = 0
        if overlap and i and copies[i - 1]:  # one segment of prefetch, issued as this backward starts
            h2d_done = clock + copies[i - 1] / h2d_rate
            prefetched = copies[i - 1]
        bwd_peaks.append(kept_before[i] + backward_need(costs.backward_base_bytes[i], prev, p, s, a, on_demand=not overlap) + prefetched)
        clock += s.backward_ms + recompute_ms(s, a)
    bwd_peaks.reverse()
    peak = max(costs.fixed_peak_bytes, tail_peak, *fwd_peaks, *bwd_peaks) if n else costs.fixed_peak_bytes
    rows = tuple(
        PlanRow(
            segment=s.name,
            action=a,
            kept_bytes=kept_rows[i],
            offloaded_bytes=copies[i],
            recomputed_bytes=(s.internal_saved_bytes - (s.heavy_bytes if a is Action.SELECTIVE else 0)) if a.recomputes else 0,
            added_ms=added[i],
        )
        for i, (s, a) in enumerate(zip(segs, acts))
    )
    return Prediction(
        peak_bytes=int(peak),
        step_ms=costs.base_ms + sum(added),
        forward_peak_bytes=tuple(fwd_peaks),
        backward_peak_bytes=tuple(bwd_peaks),
        tail_peak_bytes=int(tail_peak),
        rows=rows,
    )
