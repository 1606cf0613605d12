"""A profile measured under a plan, re-expressed as plain training's (the cost model run backwards).

Note [A step measured under a plan]: the cost model (Note [Memory model] in ``costmodel.py``)
writes each window's peak as ``base + terms(plan)``, where ``base`` is what no action changes
and the terms depend on the plan through per-segment quantities. A profile normally measures the
windows of a *plain* step and derives ``base`` from them. A step run under another plan ``P``
(``auto``'s guard step, under the lowest-memory plan) gives it too, but not through ``P``'s own
window terms: those model transients (a recomputation's forward, an offloaded backward fetching
op by op) that the model only bounds, and a bound run backwards is an error of the other sign.
So the measurement is taken where ``P`` and plain differ only in bytes the model counts
exactly — where each segment's window *starts*: before its forward, what earlier segments keep;
before its backward, that and what the segment itself holds then (:func:`present_bytes`) — and
the segment's own rise above that start is plain's, measured by running it alone, kept (Note [A
segment measured alone] in ``measure/action_costs.py``). ``ObservedStep`` hands over, per
segment, ``start under P + rise when kept`` as the window's peak; :func:`as_plain` swaps ``P``'s
kept and present bytes for plain's, and the windows no action changes (before the first segment,
after its backward, the optimizer step) and the tail (which only earlier segments' kept bytes
change) stay as measured. Measured on CPU (the tests' MLP, GPT and CNN, the issue's LM in
``bf16-mixed``, ResNet-18): plain's peak predicted from a step under ``OFFLOAD`` or
``RECOMPUTE_OFFLOAD`` everywhere within 0.5% of the measured one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Optional

from ..actions import Action
from ..measure.model_profile import ModelProfile
from ..measure.model_profile import SegmentProfile
from .costmodel import (
    _as_list, _window, boundary_held, boundary_kept, copied_bytes, copy_window, held_out, internal_kept, recompute_ms, segment_costs,
    simulate,
)

__all__ = ["as_plain", "present_bytes", "time_factors"]


def _kept_before(profile: ModelProfile, acts: Sequence[Action]) -> list[int]:
    """What segments ``< i`` keep on the device until their backward, for each ``i`` (and the
    total, last), as ``simulate``'s forward walk counts it."""
    kept, out = 0, []
    prev = None
    for i, (s, a) in enumerate(zip(profile.segments, acts)):
        out.append(kept)
        p = acts[i - 1] if i else None
        kept += internal_kept(s, a) + boundary_kept(prev, p, s, a)
        prev = s
    return out + [kept]


def present_bytes(prev: Optional[SegmentProfile], p: Optional[Action], s: SegmentProfile, a: Action) -> int:
    """Bytes of segment ``s`` alive on the device as its backward starts under ``a`` (Note [A step
    measured under a plan]): what it keeps of its own, its input if held, its output if it holds
    it. Kept, everything it saved; offloaded or recomputed, only what stays (small or boundary
    tensors): the rest is fetched or recomputed after the start."""
    held_input = s.input_bytes if boundary_held(prev, p, s, a) else 0
    return internal_kept(s, a) + held_input + (s.output_bytes if held_out(s, a) else 0)


def _plain_tail(profile: ModelProfile, acts: Sequence[Action], kept_p: list[int], kept_k: list[int], copies: list[int], inflight: int) -> int:
    """The tail's peak under plain: what the plan kept swapped for what plain keeps. Where its
    opening level was measured apart (Note [The tail opens holding the last input] in
    ``measure/trace.py``), that level already holds the last segment's input (its caller still
    does) and its output (just made): plain's keeping them adds nothing there; after it, the
    output the last segment saves itself stays under plain only (``simulate`` leaves it in the
    tail's base, which a plain profile measures with it)."""
    n = len(acts)
    swap = kept_k[n] - kept_p[n] - _window(copies, n - inflight, n)
    if n == 0 or profile.tail_start_bytes < 0 or profile.tail_rest_bytes < 0:
        return profile.tail_peak_bytes + swap
    segs = profile.segments
    prev, p = (segs[n - 2], acts[n - 2]) if n > 1 else (None, None)
    last = segs[n - 1]
    held = boundary_held(prev, Action.KEEP if n > 1 else None, last, Action.KEEP) and not boundary_held(prev, p, last, acts[n - 1])
    output = held_out(last, Action.KEEP) and not held_out(last, acts[n - 1]) and not last.output_held_elsewhere
    return max(
        profile.tail_rest_bytes + swap + (last.output_bytes if output else 0),
        profile.tail_start_bytes + swap - (last.input_bytes if held else 0),
    )


def as_plain(
    profile: ModelProfile, actions: Mapping[str, Action] | Sequence[Action], *, prefetch_segments: Optional[int] = None,
    inflight_segments: int = 1,
) -> ModelProfile:
    """``profile`` was measured in a step run under ``actions``: each segment's window peaks are
    its window's start under ``actions`` plus its rise when kept, the tail's as measured (Note [A
    step measured under a plan]); the same profile with plain training's windows.
    ``prefetch_segments`` / ``inflight_segments``: as the step ran (the copies in flight at the
    tail)."""
    acts = _as_list(profile, actions)
    segs, n = profile.segments, len(profile.segments)
    keep = [Action.KEEP] * n
    _, inflight = copy_window(prefetch_segments, inflight_segments, overlap=profile.copies_overlap)
    copies = [copied_bytes(s, a) for s, a in zip(segs, acts)]
    kept_p, kept_k = _kept_before(profile, acts), _kept_before(profile, keep)
    segments = []
    for i, (s, a) in enumerate(zip(segs, acts)):
        prev, p = (segs[i - 1], acts[i - 1]) if i else (None, None)
        swap = kept_k[i] - kept_p[i]
        present = present_bytes(prev, Action.KEEP if i else None, s, Action.KEEP) - present_bytes(prev, p, s, a)
        segments.append(dataclasses.replace(
            s, forward_peak_bytes=s.forward_peak_bytes + swap, backward_peak_bytes=s.backward_peak_bytes + swap + present,
            offload_backward_peak_bytes=s.offload_backward_peak_bytes + swap + present,
        ))
    plain = dataclasses.replace(profile, segments=tuple(segments), tail_peak_bytes=_plain_tail(profile, acts, kept_p, kept_k, copies, inflight))
    window = {"prefetch_segments": prefetch_segments, "inflight_segments": inflight_segments}
    peak = simulate(plain, keep, segment_costs(plain), **window).peak_bytes
    return dataclasses.replace(plain, peak_bytes=peak)


#: Measured times are trusted to re-price a profile within this factor of the prediction.
_MOST_FACTOR = 10.0


def _factor(measured: float, predicted: float, default: float) -> float:
    if measured <= 0 or predicted <= 1e-9:
        return default
    return min(max(measured / predicted, 1 / _MOST_FACTOR), _MOST_FACTOR)


def time_factors(
    profile: ModelProfile, actions: Mapping[str, Action] | Sequence[Action], step_ms: float, recompute_ms_measured: float,
    transfer_ms: float, *, prefetch_segments: Optional[int] = None, inflight_segments: int = 1,
) -> tuple[float, float, float]:
    """Note [Re-plan from the steady state] in ``scale/auto.py``: by what ``profile``'s times are
    off, from a steady step measured under ``actions`` (its time, what recomputation took in it,
    what copies left exposed): (compute, recomputation, copies), for
    :meth:`~..measure.model_profile.ModelProfile.with_times`. The plain part of the step is what
    was measured less recomputation and copies; recomputation and copies are compared with what
    the model priced them at, and keep the compute factor (copies: 1) where the plan has none."""
    acts = _as_list(profile, actions)
    predicted = simulate(profile, acts, prefetch_segments=prefetch_segments, inflight_segments=inflight_segments)
    recompute = sum(recompute_ms(s, a) for s, a in zip(profile.segments, acts) if a.recomputes)
    floors = sum(recompute_ms(s, a) for s, a in zip(profile.segments, acts) if not a.recomputes)
    copies = max(0.0, predicted.step_ms - profile.step_ms - recompute - floors)
    plain = max(step_ms - recompute_ms_measured - transfer_ms, 0.1 * step_ms)
    compute = _factor(plain, profile.step_ms, 1.0)
    return compute, _factor(recompute_ms_measured, recompute, compute), _factor(transfer_ms, copies, 1.0)
