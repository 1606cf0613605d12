"""A profile measured under a plan, re-expressed as plain training's (the cost model run backwards).

Note [A step measured under a plan]: the cost model (Note [Memory model] in ``costmodel.py``)
writes each window's peak as ``base + terms(plan)``, where ``base`` is what no action changes
and the terms depend on the plan through per-segment quantities. A profile normally measures the
windows of a *plain* step and derives ``base`` from them. A step run under another plan ``P``
(``auto``'s first step, under the lowest-memory plan; a new shape's first step, under its plan
of ``keep`` and ``offload``) gives it too, but not through ``P``'s own window terms: those model
transients (an offloaded backward fetching op by op) that the model only bounds, and a bound run
backwards is an error of the other sign. So the forward windows are measured as plain's where the
meter can: on CPU the tracer's meter holds every storage ``P`` moved off the device as if kept
until its backward begins (Note [Regions held as kept] in ``measure/trace.py``), so those windows
*are* plain's and enter as kept; the backward windows are ``P``'s (the storages let go, fetched
back per saved tensor), and :func:`as_plain` adds to each the bytes its element holds under plain
as its backward starts less what it held under ``P`` (:func:`present_bytes`). On CUDA the
allocator's counts cannot be held: an offloaded element's forward is bounded by its rise under
``P`` plus its offloaded bytes, and what earlier elements keep is swapped for plain's. The
windows no action changes (before the first segment, after its backward, the optimizer step)
stay as measured. Measured on CPU (the tests' MLP, GPT and CNN): plain's peak predicted from a
step under ``OFFLOAD`` everywhere within 0.1% of the measured one
(``tests/measure/test_outside_regions.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Optional

from ..actions import Action
from ..measure.model_profile import ModelProfile
from ..measure.model_profile import SegmentProfile
from .costmodel import (
    boundary_held, boundary_kept, chain_actions, elements, held_out, internal_kept, outside_mask, segment_costs, simulate_chain,
)

__all__ = ["as_plain", "present_bytes"]


def _kept_before(segs: Sequence[SegmentProfile], acts: Sequence[Action]) -> list[int]:
    """What elements ``< i`` keep on the device until their backward, for each ``i`` (and the
    total, last), as ``simulate``'s forward walk counts it."""
    kept, out = 0, []
    prev = None
    for i, (s, a) in enumerate(zip(segs, acts)):
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


def _opened(
    start: int, rest: int, swap: int, segs: Sequence[SegmentProfile], acts: Sequence[Action], last: int, nxt: Optional[int],
) -> int:
    """Note [The tail opens holding the last input] in ``measure/trace.py``: the peak under plain
    of the window after the last segment (element ``last``), measured apart as its opening level
    and its peak after that, with ``swap`` what plain keeps before it less what the plan kept.
    The opening level already holds the last segment's input (its caller still does) and its
    output (just made): plain's keeping them adds nothing there; after it, the output stays under
    plain only where plain holds it and the plan did not (its saving region ``nxt``, when the
    tail is planned, else the segment itself or another part of the model)."""
    s, a = segs[last], acts[last]
    prev = segs[last - 1] if last else None
    held = boundary_held(prev, Action.KEEP if last else None, s, Action.KEEP) and not boundary_held(prev, acts[last - 1] if last else None, s, a)
    if nxt is None:
        output = held_out(s, Action.KEEP) and not held_out(s, a) and not s.output_held_elsewhere
    else:
        output = boundary_held(s, Action.KEEP, segs[nxt], Action.KEEP) and not boundary_held(s, a, segs[nxt], acts[nxt])
    return max(rest + swap + (s.output_bytes if output else 0), start + swap - (s.input_bytes if held else 0))


def _plain_tail(profile: ModelProfile, acts: Sequence[Action], kept_p: list[int], kept_k: list[int]) -> int:
    """The tail's peak under plain (the moment the loss's backward begins where the head and
    loss are a planned region, else the whole tail): what the plan kept swapped for what plain
    keeps, the tail's opening apart where measured so (:func:`_opened`)."""
    segs, mask = elements(profile), outside_mask(profile)
    n = len(acts)
    swap = kept_k[n] - kept_p[n]
    if n == 0 or profile.has_tail_region() or profile.tail_start_bytes < 0 or profile.tail_rest_bytes < 0:
        return profile.tail_peak_bytes + swap
    last = max(i for i, o in enumerate(mask) if not o)
    return _opened(profile.tail_start_bytes, profile.tail_rest_bytes, swap, segs, acts, last, None)


def _plain_elements(
    profile: ModelProfile, ran: Sequence[Action], measured: Sequence[Action], kept_p: list[int], kept_k: list[int],
    priced: Sequence[SegmentProfile],
) -> list[SegmentProfile]:
    """Each element's windows under plain (Note [A step measured under a plan]): the plan's kept
    bytes before it swapped for plain's, and in its backward its own present bytes. An element the
    meter held as kept (``measured`` ``KEEP``, ``ran`` ``OFFLOAD``: Note [Regions held as kept] in
    ``measure/trace.py``) was let go as its backward began: that window is the plan's. An element
    offloaded and not held (CUDA) rose in its forward by at most its offloaded bytes less.
    ``priced``: the elements as the plan ran them (its lighter selective choices: Note [Lighter
    selective]), for what the plan held at each backward."""
    segs, mask = elements(profile), outside_mask(profile)
    tail = len(segs) - 1 if profile.has_tail_region() else None
    out = []
    for i, (s, a, o) in enumerate(zip(segs, measured, mask)):
        prev = segs[i - 1] if i else None
        swap = kept_k[i] - kept_p[i]
        ran_prev, p = (priced[i - 1], measured[i - 1]) if i else (None, None)
        present = present_bytes(prev, Action.KEEP if i else None, s, Action.KEEP) - present_bytes(ran_prev, p, priced[i], a)
        forward = s.forward_peak_bytes + swap + (s.offload_bytes if a is Action.OFFLOAD else 0)
        if i == tail and profile.tail_start_bytes >= 0 and profile.tail_rest_bytes >= 0 and a is Action.KEEP:
            last = max(j for j, m in enumerate(mask[:i]) if not m)
            forward = _opened(profile.tail_start_bytes, profile.tail_rest_bytes, swap, segs, measured, last, i)
        out.append(dataclasses.replace(
            s, forward_peak_bytes=forward, backward_peak_bytes=s.backward_peak_bytes + swap + present,
            offload_backward_peak_bytes=s.offload_backward_peak_bytes + swap + present,
        ))
    return out


def as_plain(
    profile: ModelProfile, actions: Mapping[str, Action] | Sequence[Action], *, outside: Optional[Mapping[str, Action]] = None,
    held: bool = False, prefetch_bytes: Optional[int] = None, inflight_bytes: Optional[int] = None,
    selective_ops: Optional[Mapping[str, Sequence[str]]] = None,
) -> ModelProfile:
    """``profile`` was measured in a step run under ``actions`` (and ``outside`` for the regions
    outside the segments; ``held``: the meter counted what they offloaded as kept, Note [Regions
    held as kept] in ``measure/trace.py``), the tail's as measured (Note [A step measured under a
    plan]); the same profile with plain training's windows. The copy windows (accepted as the
    step ran them): what was still in flight at the tail is not taken off, a bound on CUDA (Note
    [Copy windows, priced]). ``selective_ops``: the plan's (Note [Lighter selective] in
    ``measure/profiler.py``: what its selective segments kept)."""
    ran = chain_actions(profile, actions, outside)
    mask = outside_mask(profile)
    measured = [Action.KEEP if held and a is Action.OFFLOAD else a for a in ran]
    keep = [Action.KEEP] * len(ran)
    segs = elements(profile.with_selective_ops(selective_ops))
    kept_p, kept_k = _kept_before(segs, measured), _kept_before(segs, keep)
    plain_elements = _plain_elements(profile, ran, measured, kept_p, kept_k, segs)
    plain = dataclasses.replace(
        profile, segments=tuple(e for e, o in zip(plain_elements, mask) if not o),
        outside=tuple(e for e, o in zip(plain_elements, mask) if o),
        tail_peak_bytes=_plain_tail(profile, measured, kept_p, kept_k),
    )
    peak = simulate_chain(plain, keep, segment_costs(plain)).peak_bytes
    return dataclasses.replace(plain, peak_bytes=peak)
