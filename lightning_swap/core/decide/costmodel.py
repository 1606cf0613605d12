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
On CUDA two copy engines (device-to-host, host-to-device) run beside compute, each a queue
drained at its measured bandwidth, and the compute waits for a copy where the copy windows say
so (Note [Copy windows, priced]); :func:`simulate` walks the queues against the compute timeline.

Note [Copy windows, priced]: what the offload engine holds beyond the element running depends
on its copy windows (Note [Copy windows] in ``engine/offload.py``), which the plan must be made
for; each independent of the other:

- in flight ``W``: an element's forward window holds its own sources only up to ``W`` (the rest
  retire as it runs: its forward is priced as one whose copies are done when issued, plus
  ``min(W, bytes in flight)``). Time: the device-to-host queue drains at its bandwidth during
  each forward; when it holds more than ``W`` the compute waits for the excess; with ``W = 0``
  every copy is waited for when issued, all of it exposed; the backward's start waits for the rest.
- prefetched ``W > 0``: when an element's backward starts, the elements before it are fetched
  in order while the bytes fetched and not yet needed stay within ``W`` (one element at least);
  its backward window holds what is fetched ahead, the rest of its own bytes first (at most
  ``W``, or the largest storage), on top of its own as they come back storage by storage, each
  held to its last unpack (the profiler's on-demand estimate): conservative, since the window
  cannot be placed within the element's backward (measured on CPU: up to one storage over).
- prefetched ``W = 0``: every element's bytes come back per saved tensor when needed (the
  profiler's per-tensor estimate, Note [Offloaded backward fetches on demand] in ``trace.py``),
  all of the copy time exposed.
- not given (``None``: a plan the planner did not make): Note [Default copy windows] in
  ``engine/offload.py``, priced as the largest element's copied bytes under the plan where
  copies overlap compute, else as nothing fetched ahead, each storage held from its first unpack
  to its last (the profiler's on-demand estimate), not per saved tensor: the engine fetches per
  tensor only under a ``0`` given. The planner always prices given windows, or chooses them
  (:func:`window_candidates`), and the plan records them.

On CPU copies are done when issued: nothing is in flight whatever ``W``, and a prefetch only
raises the peak; the planner uses ``0`` for both there (:func:`window_candidates`). The start of
the backward is still priced as waiting for the copies in flight, though the engine uses their
sources in place (Note [Used in place]): conservative in time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from ..actions import Action
from ..config import check_window_bytes
from ..segments import for_segment
from .plan import PlanRow
from ..measure.model_profile import ModelProfile, SegmentProfile

__all__ = [
    "AUTO_WINDOW", "CopyWindow", "OUTSIDE_ACTIONS", "Prediction", "SegmentCosts", "backward_need", "chain_actions", "copy_window_of",
    "elements", "outside_mask", "referenced_outputs", "resolve_windows", "segment_costs", "simulate", "simulate_chain",
    "window_candidates",
]


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


def forward_own(s: SegmentProfile, a: Action) -> int:
    """Bytes of segment ``s`` alive at its own forward's peak beyond the window's base.

    Note [A forward that does not keep]: kept, a segment's forward ends holding everything it
    saves. Recomputed, or offloaded, its saved tensors are not held for backward (what is still
    in flight to the host is the in-flight window's: Note [Copy windows, priced]), yet its forward
    still holds what its own code references — a block's ``q, k, v`` stay alive in its frame to
    its end — which no trace of ops can see. Where it was
    measured (``SegmentProfile.released_forward_working_bytes``, ``W``), with ``S`` the saved
    bytes and ``w`` the kept forward's working bytes, the window's peak is its start level plus
    ``W``, i.e. the base plus ``S - w + W``; plus what the action keeps. Not measured (``auto``
    runs no segment outside the user's step to measure it: Note [Observe, do not re-run] in
    ``measure/observe.py``): as kept, which never under-predicts, and never more than kept (a
    segment's forward that saves less holds no more than the kept one).
    """
    if a is Action.KEEP or s.released_forward_working_bytes < 0:
        return s.internal_saved_bytes
    own = s.internal_saved_bytes - s.forward_working_bytes + s.released_forward_working_bytes
    return min(s.internal_saved_bytes, max(0, own) + internal_kept(s, a))


def copied_bytes(s: SegmentProfile, a: Action) -> int:
    """Bytes this segment sends to the host and back (no cross-segment de-duplication)."""
    if a is Action.OFFLOAD:
        return s.offload_bytes
    if a is Action.RECOMPUTE_OFFLOAD:
        return 0 if s.input_small else s.input_bytes
    return 0


#: Note [An action is never free]: the least any action but ``KEEP`` adds to a step (hooks,
#: bookkeeping, a copy's launch). Measured costs are differences of two noisy timings and can
#: come out at 0 (``selective`` chosen at a budget where everything fits, priced ``+0.00 ms``):
#: recomputation is floored at the forward of the ops it runs again (the whole segment's for
#: ``RECOMPUTE``; the ops outside the heavy ones for ``SELECTIVE``, unless measured inside a
#: compiled graph, whose backward fuses them: ``SegmentProfile.selective_floor``), and every
#: action at this, so that among plans of equal
#: predicted time the one that does less (keep first) wins.
MIN_ACTION_MS = 0.01


def recompute_ms(s: SegmentProfile, a: Action) -> float:
    """What recomputing ``s`` under ``a`` adds: measured on the device when a profile timed the
    action (``SegmentProfile.recompute_ms``, ``selective_ms``), never less than the forward of the ops it runs again
    (Note [An action is never free]); ``OFFLOAD``'s floor (its copies are priced in
    :func:`simulate`)."""
    if a in (Action.RECOMPUTE, Action.RECOMPUTE_OFFLOAD):
        return max(s.recompute_ms or 0.0, s.forward_ms, MIN_ACTION_MS)
    if a is Action.SELECTIVE:
        if s.selective_ms is not None and not s.selective_floor:  # fused in a compiled backward: as measured
            return max(s.selective_ms, MIN_ACTION_MS)
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


def backward_own(
    prev: Optional[SegmentProfile], p: Optional[Action], s: SegmentProfile, a: Action, *, per_tensor: bool = False,
    free_output: bool = False,
) -> int:
    """Bytes of segment ``s`` alive during its backward, beyond ``kept``.

    Offloaded tensors come back storage by storage as the backward reads them, so an offloaded
    segment's backward peak is the profiler's estimate for that (Note [Offloaded backward
    fetches on demand] in :mod:`.trace`), not all of it at once (what a prefetch holds ahead is
    the caller's); ``per_tensor``: and each only while an op reads it (a prefetch window of 0
    bytes), its output too where ``free_output`` (the next element does not hold it).
    """
    own = s.internal_saved_bytes + (s.heavy_unsaved_bytes if a is Action.SELECTIVE else 0)
    if s.input_saved or a.recomputes or boundary_held(prev, p, s, a):
        own += s.input_bytes
    if s.output_saved or held_out(s, a):
        own += s.output_bytes
    if a is Action.OFFLOAD:
        own -= max(0, s.backward_peak_bytes - s.offload_backward_peak_bytes)
        free_input = s.input_saved and not boundary_held(prev, p, s, a)  # it comes back on demand too
        if per_tensor:
            extra = (s.tensor_both_saving_bytes if free_input else s.tensor_output_saving_bytes) if free_output else (
                s.tensor_input_saving_bytes if free_input else 0
            )
            own -= s.tensor_saving_bytes + extra
        elif free_input:
            own -= s.offload_input_saving_bytes
    elif fetches_held_input(prev, p, s, a):
        own += s.input_bytes
    return own


def fetches_held_input(prev: Optional[SegmentProfile], p: Optional[Action], s: SegmentProfile, a: Action) -> bool:
    """Note [A fetched input beside its original]: ``RECOMPUTE_OFFLOAD`` copies its input's
    storage, wherever it came from; when the previous segment (or another part of the model)
    keeps that same storage on the device, the bytes fetched back for the recomputation are a
    second device copy of it, alive beside the original for the whole backward window. (An
    offloaded segment's are fetched storage by storage: the profiler's estimate covers it.)"""
    if a is not Action.RECOMPUTE_OFFLOAD or s.input_small:
        return False
    return s.input_held_elsewhere or (s.input_from_previous and prev is not None and p is not None and held_out(prev, p))


def backward_need(
    base: int, prev: Optional[SegmentProfile], p: Optional[Action], s: SegmentProfile, a: Action, *, per_tensor: bool = False,
    free_output: bool = False,
) -> int:
    """Bytes of segment ``s``'s backward window beyond what earlier segments keep: its own bytes
    on top of the plan-independent ``base``; for a recomputed segment also the recomputation's
    forward, whose transient working set (cuDNN / cuBLAS workspaces included) runs before the
    backward's: the window's base without the backward's working bytes, plus the segment's
    input and its forward's working bytes."""
    need = base + backward_own(prev, p, s, a, per_tensor=per_tensor, free_output=free_output)
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


def elements(profile: ModelProfile) -> tuple[SegmentProfile, ...]:
    """What a plan acts on, in execution order: the segments and the regions outside them
    (Note [Regions outside the segments] in ``measure/model_profile.py``)."""
    return tuple(e for e, _ in profile.chain)


def outside_mask(profile: ModelProfile) -> tuple[bool, ...]:
    return tuple(o for _, o in profile.chain)


#: What a region outside the segments may be given: it is no module, so nothing recomputes it.
OUTSIDE_ACTIONS = (Action.KEEP, Action.OFFLOAD)


def chain_actions(
    profile: ModelProfile, actions: Mapping[str, Action] | Sequence[Action], outside: Optional[Mapping[str, Action]] = None
) -> list[Action]:
    """One action per element of :func:`elements`: the segments' from ``actions``, the regions'
    from ``outside`` (by name; a region not named is kept)."""
    seg_acts = iter(_as_list(profile, actions))
    outside = outside or {}
    out = []
    for e, is_outside in profile.chain:
        if not is_outside:
            out.append(next(seg_acts))
            continue
        a = outside.get(e.name, Action.KEEP)
        if a not in OUTSIDE_ACTIONS:
            raise ValueError(f"`outside[{e.name!r}]` must be one of {[x.value for x in OUTSIDE_ACTIONS]}; got {a!r}.")
        out.append(a)
    return out


def segment_costs(profile: ModelProfile) -> SegmentCosts:
    segs = elements(profile)
    fwd, bwd = [], []
    kept = 0
    prev: Optional[SegmentProfile] = None
    for s in segs:
        p = Action.KEEP if prev is not None else None
        fwd.append(s.forward_peak_bytes - kept - internal_kept(s, Action.KEEP))
        bwd.append(s.backward_peak_bytes - kept - backward_own(prev, p, s, Action.KEEP))
        kept += internal_kept(s, Action.KEEP) + boundary_kept(prev, p, s, Action.KEEP)
        prev = s
    return SegmentCosts(
        forward_base_bytes=tuple(fwd),
        backward_base_bytes=tuple(bwd),
        tail_base_bytes=profile.tail_peak_bytes - kept,
        fixed_peak_bytes=max(
            0 if profile.has_prefix_region() else profile.prefix_forward_peak_bytes,
            0 if profile.has_prefix_region() else profile.prefix_backward_peak_bytes,
            profile.static_bytes, profile.optimizer_peak_bytes,
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
    #: Each element's level as its forward starts, and the windows no action changes (the
    #: optimizer step's, before the first element): Note [The budget held online].
    forward_start_bytes: tuple[int, ...] = ()
    fixed_peak_bytes: int = 0


def _as_list(profile: ModelProfile, actions: Mapping[str, Action] | Sequence[Action]) -> list[Action]:
    if isinstance(actions, Mapping):
        # A plan may name a module run several times once, for every call (Note [A segment per call]).
        acts = [for_segment(actions, n) for n in profile.names]
        missing = [n for n, a in zip(profile.names, acts) if a is None]
        if missing:
            raise ValueError(f"`actions` has no action for segments {missing}.")
        return acts
    actions = list(actions)
    if len(actions) != len(profile.segments):
        raise ValueError(f"`actions` has {len(actions)} entries for {len(profile.segments)} segments.")
    return actions


#: ``prefetch_bytes="auto"`` (or ``None``) for ``solve`` and its kin: the planner chooses the
#: byte windows (:func:`window_candidates`), and the plan records the ones it was priced with.
AUTO_WINDOW = "auto"


@dataclass(frozen=True)
class CopyWindow:
    """The copy windows one plan is priced for (Note [Copy windows, priced])."""

    prefetch_bytes: int
    inflight_bytes: int

    def keywords(self) -> dict[str, Any]:
        return {"prefetch_bytes": self.prefetch_bytes, "inflight_bytes": self.inflight_bytes}


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def window_candidates(profile: ModelProfile) -> list[tuple[int, int]]:
    """Note [The planner chooses the copy windows]: ``(prefetch_bytes, inflight_bytes)`` pairs a
    plan may be priced with. On CPU nothing overlaps, so ``(0, 0)``: copies waited for as issued,
    fetches per saved tensor (the least memory, at no cost in time there). On CUDA also windows
    sized from the measured bandwidths: what each copy engine moves during the median element's
    forward (in flight) and backward (prefetch), and four times that; the solver keeps the
    fastest plan that fits over all of them."""
    if not profile.copies_overlap:
        return [(0, 0)]
    segs = [e for e in elements(profile) if e.offload_bytes]
    h2d = int(profile.h2d_bytes_per_ms * _median([e.backward_ms for e in segs]))
    d2h = int(profile.d2h_bytes_per_ms * _median([e.forward_ms for e in segs]))
    out = [(0, 0)]
    for k in (1, 4):
        if (k * h2d, k * d2h) not in out and (h2d or d2h):
            out.append((k * h2d, k * d2h))
    return out


def resolve_windows(profile: ModelProfile, prefetch_bytes: Any, inflight_bytes: Any) -> list[CopyWindow]:
    """The windows to price: one, as given, or the planner's candidates where ``prefetch_bytes``
    or ``inflight_bytes`` is :data:`AUTO_WINDOW` or ``None`` (the other, if given, kept)."""
    auto = (prefetch_bytes in (None, AUTO_WINDOW), inflight_bytes in (None, AUTO_WINDOW))
    fixed_p = None if auto[0] else check_window_bytes(prefetch_bytes, "prefetch_bytes")
    fixed_i = None if auto[1] else check_window_bytes(inflight_bytes, "inflight_bytes")
    if not any(auto):
        return [CopyWindow(fixed_p, fixed_i)]
    out = []
    for p_bytes, i_bytes in window_candidates(profile):
        w = CopyWindow(p_bytes if auto[0] else fixed_p, i_bytes if auto[1] else fixed_i)
        if w not in out:
            out.append(w)
    return out


def copy_window_of(config: Any) -> dict[str, Any]:
    """The keywords of :func:`simulate` / ``solve`` / ``min_budget_bytes`` that a
    :class:`~lightning_swap.core.config.SwapConfig` sets: pass ``**copy_window_of(config)`` where a
    plan is made for a session's runtime (``None``: the planner's to choose)."""
    return {"prefetch_bytes": config.prefetch_bytes, "inflight_bytes": config.inflight_bytes}


@dataclass
class _Walk:
    """The state of one walk of :func:`simulate` over the step's timeline."""

    segs: tuple[SegmentProfile, ...]
    acts: list[Action]
    costs: SegmentCosts
    copies: list[int]
    added: list[float]
    overlap: bool
    #: Note [Copy windows, priced], the defaults resolved.
    prefetch_bytes: int
    inflight_bytes: int
    per_tensor: bool  # a prefetch window of 0 given: fetched per saved tensor
    clock: float = 0.0
    kept_before: list[int] = field(default_factory=list)
    kept_rows: list[int] = field(default_factory=list)
    #: Each element's level as its forward starts (Note [The budget held online] in
    #: ``runtime/online.py`` compares it with the level measured there).
    starts: list[int] = field(default_factory=list)


def referenced_outputs(segs: Sequence[SegmentProfile], mask: Sequence[bool]) -> list[list[int]]:
    """Note [A region's output stays referenced in forward]: the code outside the segments hands
    its output to a call that runs the segments after it (``self.blocks(self.stem(x))``), and
    that call's arguments hold it until it returns, whatever the plan does with the saved
    copies. So an outside element ``i``'s output, when the segment after it takes it as input,
    is alive in the forward windows of the elements after that segment, up to the next region
    outside the segments (where such a call has returned, or a loop rebound it; assumed). Per
    window ``j``: the ``i`` whose output is alive there so."""
    refs: list[list[int]] = [[] for _ in segs]
    for i, outside in enumerate(mask):
        if not outside or i + 1 >= len(segs) or mask[i + 1] or not segs[i + 1].input_from_previous:
            continue
        j = i + 2
        while j < len(segs) and not mask[j]:
            refs[j].append(i)
            j += 1
    return refs


def _start(base: int, s: SegmentProfile) -> int:
    """The level as an element's forward starts, from its window's base (what no action changes)
    plus what the plan holds then: its kept peak less its kept rise."""
    return max(0, base + s.internal_saved_bytes - s.forward_working_bytes)


def _forward(walk: _Walk, profile: ModelProfile) -> tuple[list[int], int]:
    """Forward, with the device-to-host engine (Note [Copy windows, priced]): the window peaks
    and the tail's."""
    segs, acts, copies, costs = walk.segs, walk.acts, walk.copies, walk.costs
    limit, bw = walk.inflight_bytes, profile.d2h_bytes_per_ms
    refs = referenced_outputs(segs, outside_mask(profile))
    queue, kept, last, peaks = 0.0, 0, 0, []
    for i, (s, a) in enumerate(zip(segs, acts)):
        prev, p = (segs[i - 1], acts[i - 1]) if i else (None, None)
        in_flight = min(limit, int(queue) + copies[i]) if walk.overlap else 0
        referenced = sum(segs[r + 1].input_bytes for r in refs[i] if not boundary_held(segs[r], acts[r], segs[r + 1], acts[r + 1]))
        peaks.append(costs.forward_base_bytes[i] + kept + forward_own(s, a) + in_flight + referenced)
        walk.starts.append(_start(costs.forward_base_bytes[i] + kept + in_flight + referenced, s))
        walk.clock += s.forward_ms
        if copies[i]:
            last = i
        if not walk.overlap or limit == 0:  # waited for as issued: all exposed
            wait = copies[i] / bw
        else:
            queue = max(0.0, queue + copies[i] - bw * s.forward_ms)
            wait = max(0.0, queue - limit) / bw
            queue = min(queue, float(limit))
        walk.added[i] += wait
        walk.clock += wait
        walk.kept_before.append(kept)
        walk.kept_rows.append(internal_kept(s, a) + boundary_kept(prev, p, s, a))
        kept += walk.kept_rows[-1]
    n = len(segs)
    tail_peak = costs.tail_base_bytes + kept + (min(limit, int(queue)) if walk.overlap else 0)
    walk.clock += profile.tail_ms
    wait = max(0.0, queue / bw - profile.tail_ms)  # the backward's start waits for the rest
    walk.added[last if n else 0] += wait
    walk.clock += wait
    return peaks, tail_peak


def _backward(walk: _Walk, profile: ModelProfile) -> list[int]:
    """Backward, last element first, with the host-to-device engine (Note [Copy windows,
    priced]): the window peaks."""
    segs, acts, copies, costs = walk.segs, walk.acts, walk.copies, walk.costs
    limit, bw = walk.prefetch_bytes, profile.h2d_bytes_per_ms
    fetched: dict[int, float] = {}  # element -> when its bytes are on the device
    ahead: list[int] = []  # elements fetched and not yet needed, newest last
    h2d_free, peaks, n = 0.0, [], len(segs)
    for i in range(n - 1, -1, -1):
        s, a = segs[i], acts[i]
        prev, p = (segs[i - 1], acts[i - 1]) if i else (None, None)
        if copies[i]:
            if limit == 0 or not walk.overlap:
                wait = copies[i] / bw
            else:
                if i not in fetched:  # nothing fetched it ahead: now
                    h2d_free = max(walk.clock, h2d_free) + copies[i] / bw
                    fetched[i] = h2d_free
                wait = max(0.0, fetched[i] - walk.clock)
            walk.added[i] += wait
            walk.clock += wait
        if i in ahead:
            ahead.remove(i)
        j = min(ahead, default=i) - 1
        while limit and j >= 0 and (not ahead or sum(copies[k] for k in ahead) + copies[j] <= limit):
            if copies[j]:
                h2d_free = max(walk.clock, h2d_free) + copies[j] / bw
                fetched[j] = h2d_free
                ahead.append(j)
            j -= 1
        # The engine fetches ahead storage by storage, the rest of this element's first: within
        # the window, or one storage above it.
        largest = max((segs[k].largest_offload_bytes for k in range(i + 1) if copies[k]), default=0)
        held_ahead = min(max(limit, largest), sum(copies[: i + 1])) if limit else 0
        # Per tensor, the output is there only while read, unless the next element holds it (known
        # here, not to the solver's state, which bounds it as held).
        free_output = i + 1 < n and segs[i + 1].input_from_previous and not boundary_held(s, a, segs[i + 1], acts[i + 1])
        need = backward_need(costs.backward_base_bytes[i], prev, p, s, a, per_tensor=walk.per_tensor, free_output=free_output and walk.per_tensor)
        peaks.append(walk.kept_before[i] + need + held_ahead)
        walk.clock += s.backward_ms + recompute_ms(s, a)
    peaks.reverse()
    return peaks


def simulate(
    profile: ModelProfile,
    actions: Mapping[str, Action] | Sequence[Action],
    costs: Optional[SegmentCosts] = None,
    *,
    outside: Optional[Mapping[str, Action]] = None,
    prefetch_bytes: Optional[int] = None,
    inflight_bytes: Optional[int] = None,
    selective_ops: Optional[Mapping[str, Sequence[str]]] = None,
) -> Prediction:
    """Walk the step's timeline under ``actions`` (Notes [Memory model], [Time model] and [Copy
    windows, priced]) for the segments and ``outside`` for the regions outside them (by name; a
    region not named is kept); ``prefetch_bytes`` / ``inflight_bytes`` as the runtime runs them;
    ``selective_ops``: a plan's, its lighter selective choices priced (Note [Lighter selective] in
    ``measure/profiler.py``). The prediction's windows and rows are per element of :func:`elements`."""
    profile = profile.with_selective_ops(selective_ops)
    return simulate_chain(
        profile, chain_actions(profile, actions, outside), costs, prefetch_bytes=prefetch_bytes, inflight_bytes=inflight_bytes
    )


def simulate_chain(
    profile: ModelProfile,
    acts: Sequence[Action],
    costs: Optional[SegmentCosts] = None,
    *,
    prefetch_bytes: Optional[int] = None,
    inflight_bytes: Optional[int] = None,
) -> Prediction:
    """:func:`simulate` with one action per element of :func:`elements` (``acts``)."""
    acts = list(acts)
    costs = costs or segment_costs(profile)
    segs = elements(profile)
    if len(acts) != len(segs):
        raise ValueError(f"`acts` has {len(acts)} entries for {len(segs)} elements.")
    copies = [copied_bytes(s, a) for s, a in zip(segs, acts)]
    default = max(copies, default=0) if profile.copies_overlap else 0  # Note [Copy windows, priced]: not given
    windows = [check_window_bytes(w, name) for w, name in ((prefetch_bytes, "prefetch_bytes"), (inflight_bytes, "inflight_bytes"))]
    walk = _Walk(
        segs=segs, acts=acts, costs=costs, copies=copies, added=[recompute_ms(s, a) for s, a in zip(segs, acts)],
        overlap=profile.copies_overlap, prefetch_bytes=default if windows[0] is None else windows[0],
        inflight_bytes=default if windows[1] is None else windows[1], per_tensor=windows[0] == 0,
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
        forward_start_bytes=tuple(walk.starts),
        fixed_peak_bytes=int(costs.fixed_peak_bytes),
    )
