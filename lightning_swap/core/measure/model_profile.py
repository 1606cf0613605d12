"""The contract between measuring and deciding: a frozen :class:`ModelProfile` of one training
step, one :class:`SegmentProfile` per segment.

The planner (``decide/``) reads profiles and nothing else of ``measure/``. Note [Batch scaling]
and Note [Steady-state shift] describe how a profile is moved to another batch size or state.

Note [Regions outside the segments]: a model's step also saves tensors outside its repeated
blocks — the stem, the code between blocks, the head and the loss — and under the lowest-memory
plan these are most of what stays on the device (ResNet-50's stem: 5.3 MiB of the 11.7 MiB left
above parameters and gradients at batch 34; GPT's logits saved by the loss). Each
such region that saves something is profiled as a segment is (``outside``, a
:class:`SegmentProfile` with its own forward and backward windows: Note [Windows outside the
segments] in ``trace.py``) and placed in the chain between the segments (:attr:`ModelProfile.chain`);
the planner gives it an action as it gives a segment one, ``KEEP`` or ``OFFLOAD`` (it is no
module: nothing recomputes it), and the runtime offloads it through hooks held over the whole
step (Note [Regions outside the segments are hooked for the whole step] in ``engine/offload.py``).
A region that saves nothing is not planned: its windows are folded into its neighbours'.

Note [Refused actions]: ``auto`` never plans an action for a segment that has not run as planned
there. Each segment's recomputing actions are tried on it after the observed step (``.costs``:
one that raises is refused), and the runtime reports what it found in real steps (a segment
that writes into its input, a compiled segment's selective: ``SwapRuntime.refusals``); the
session keeps those and :meth:`ModelProfile.refusing` marks them on the profile before each
plan, so the solver leaves them out for that segment only. The lowest-memory plan of a guard
step offloads a segment whose recomputation is refused instead of recomputing it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from ..actions import Action
from ..segments import for_segment, split_call

__all__ = ["ModelProfile", "SegmentProfile", "max_profile"]


@dataclass(frozen=True, kw_only=True)
class SegmentProfile:
    """What one segment costs in a plain (all kept) step; bytes are device bytes.

    ``*_saved`` / ``*_small`` / ``*_heavy`` say whether the segment's input (output) storage is
    saved for backward by this segment, is under ``min_offload_bytes``, is produced by a
    compute-heavy op; ``input_from_previous`` whether the input is the previous segment's
    output; ``*_held_elsewhere`` whether another part of the model saves it as well.
    """

    name: str
    forward_ms: float
    backward_ms: float
    heavy_forward_ms: float
    input_bytes: int
    output_bytes: int
    saved_bytes: int  # all storages saved for backward, parameters excluded
    internal_saved_bytes: int  # ... other than the input and output
    internal_small_bytes: int  # ... of those, under min_offload_bytes (never offloaded)
    heavy_bytes: int  # outputs of the ops SELECTIVE saves (selective_ops), other than the input and output
    heavy_unsaved_bytes: int  # ... of those, not saved for backward when kept
    offload_bytes: int  # what OFFLOAD copies to the host
    #: ... of which the largest single storage (what a byte window fetches ahead at least)
    largest_offload_bytes: int = 0
    gradient_bytes: int  # parameter gradients allocated during this segment's backward
    forward_working_bytes: int  # forward peak above the bytes alive when it starts
    backward_working_bytes: int  # backward peak above the bytes alive when it starts
    forward_peak_bytes: int  # peak bytes alive during the forward (all segments kept)
    backward_peak_bytes: int  # peak bytes alive during the backward (all segments kept)
    #: the same, estimated for this segment offloaded and fetched on demand (no prefetch)
    offload_backward_peak_bytes: int
    #: ... and how much lower that is when nothing else holds the segment's input, so that it
    #: too comes back on demand (Note [Offloaded backward fetches on demand] in ``trace.py``)
    offload_input_saving_bytes: int = 0
    #: ... and, fetched per saved tensor (a prefetch window of 0 bytes: Note [Copy windows] in
    #: ``engine/offload.py``), how much lower than ``offload_backward_peak_bytes`` with
    #: the input and output held by neighbours, and how much lower than that again with the input,
    #: the output, or both fetched per tensor too
    tensor_saving_bytes: int = 0
    tensor_input_saving_bytes: int = 0
    tensor_output_saving_bytes: int = 0
    tensor_both_saving_bytes: int = 0
    #: the forward's peak above its start with its saved tensors not held for backward
    #: (recomputed, or offloaded by synchronous copies), where a profile measured it; -1: not
    #: measured (Note [A forward that does not keep] in ``costmodel.py``)
    released_forward_working_bytes: int = -1
    input_saved: bool
    input_small: bool
    input_from_previous: bool
    input_held_elsewhere: bool
    output_saved: bool
    output_small: bool
    output_heavy: bool
    output_held_elsewhere: bool
    #: What ``RECOMPUTE`` and ``SELECTIVE`` add to a step, where a profile measured it on the
    #: device; ``None``: estimated from the forward's time.
    recompute_ms: Optional[float] = None
    selective_ms: Optional[float] = None
    #: Whether ``SELECTIVE``'s time is floored at the forward of the ops it runs again (Note [An
    #: action is never free] in ``decide/costmodel.py``); ``False`` where ``selective_ms`` was
    #: measured recomputing inside the compiled graph, whose backward kernels fuse those ops (a
    #: profile given them: ``auto``'s traced steps run eagerly on CPU and leave it ``True``).
    selective_floor: bool = True
    #: The ops whose outputs ``SELECTIVE`` saves, decided from this segment's measured forward
    #: (Note [Which ops selective recomputation saves] in ``profiler.py``); ``None``: the fixed
    #: rule (compute-heavy ops: ``engine/recompute.py``), which ``heavy_*`` then describe.
    selective_ops: Optional[tuple[str, ...]] = None
    #: Lighter choices than ``selective_ops`` (Note [Lighter selective] in ``profiler.py``): each
    #: the ops it saves and its ``heavy_bytes``, ``heavy_unsaved_bytes`` and ``heavy_forward_ms``
    #: as fractions of the full choice's (:meth:`lighter`).
    selective_variants: tuple[tuple[tuple[str, ...], float, float, float], ...] = ()
    #: Under FSDP: bytes of the parameters gathered while this segment computes (its unit's, on
    #: this rank), freed again after its forward and gathered anew for its backward; part of
    #: every window's measured base whatever the plan (Note [Sharded state is local] in
    #: ``sharded.py``). 0 for a model that is not sharded.
    gathered_parameter_bytes: int = 0
    #: Actions this segment did not run as planned when tried (Note [Refused actions]): the
    #: planner never gives it one of them. ``refusal`` says why, for the log.
    refused: tuple[Action, ...] = ()
    refusal: str = ""

    def lighter(self, index: int) -> "SegmentProfile":
        """This segment with its ``index``-th lighter selective choice in place of its own (Note
        [Lighter selective] in ``profiler.py``): fewer bytes kept, more of the forward recomputed
        (a measured ``selective_ms`` grows by the forward time no longer saved)."""
        ops, nbytes, unsaved, ms = self.selective_variants[index]
        heavy_ms = self.heavy_forward_ms * ms
        return dataclasses.replace(
            self, selective_ops=ops, selective_variants=(), heavy_bytes=round(self.heavy_bytes * nbytes),
            heavy_unsaved_bytes=round(self.heavy_unsaved_bytes * unsaved), heavy_forward_ms=heavy_ms,
            selective_ms=None if self.selective_ms is None else self.selective_ms + self.heavy_forward_ms - heavy_ms,
        )

    def with_selective_ops(self, ops: Optional[Iterable[str]]) -> "SegmentProfile":
        """This segment as a plan that saves ``ops`` under selective prices it: its own choice, or
        the lighter one that saves exactly those (itself where none does)."""
        if ops is None or self.selective_ops is None or tuple(ops) == self.selective_ops:
            return self
        wanted = tuple(ops)
        return next((self.lighter(i) for i, v in enumerate(self.selective_variants) if v[0] == wanted), self)


#: Note [Refused actions]: a segment that writes into its input cannot be recomputed from it
#: as it was (it is, from a copy, at the copy's cost, so the planner leaves recomputation out);
#: a compiled segment the eager checkpoint recomputes (Note [Recomputation inside the compiled
#: graph] in ``compiled.py`` says which) recomputes everything under selective (Note [Selective
#: under compile]).
_RECOMPUTING = (Action.RECOMPUTE, Action.SELECTIVE, Action.RECOMPUTE_OFFLOAD)
SELECTIVE_REFUSAL = "selective:"


def refused_actions(why: str) -> tuple[Action, ...]:
    """The actions a refusal rules out: ``SELECTIVE`` alone for one that starts with
    :data:`SELECTIVE_REFUSAL`, else every recomputing action."""
    return (Action.SELECTIVE,) if why.startswith(SELECTIVE_REFUSAL) else _RECOMPUTING


_SCALED_INT_FIELDS = tuple(
    f.name for f in dataclasses.fields(SegmentProfile)
    if f.type in ("int", int) and f.name.endswith("_bytes") and f.name != "released_forward_working_bytes"
)


_SCALED_MS_FIELDS = ("forward_ms", "backward_ms", "heavy_forward_ms")
#: Note [A shape scaled from another]: the fields that are levels of the whole step (the forward's
#: first), and those that do not grow with the batch's activations.
_LEVEL_FIELDS = ("forward_peak_bytes", "backward_peak_bytes", "offload_backward_peak_bytes")
_FIXED_FIELDS = ("gradient_bytes", "gathered_parameter_bytes")


_MEASURED_MS_FIELDS = ("recompute_ms", "selective_ms")


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """A measured (or fake-measured) training step at ``batch_size``.

    ``prefix_*`` is the part of the model before the first segment, ``tail_*`` the part after
    the last (head and loss). ``static_bytes`` is what is alive before the step (parameters,
    buffers, batch, existing gradients, tracked optimizer state).
    """

    segments: tuple[SegmentProfile, ...]
    batch_size: int
    device_type: str
    fake: bool
    min_offload_bytes: int
    static_bytes: int
    parameter_bytes: int
    gradient_bytes: int  # all parameter gradients allocated in the step
    prefix_forward_peak_bytes: int
    prefix_backward_peak_bytes: int
    tail_peak_bytes: int
    peak_bytes: int  # measured peak of the whole plain step
    prefix_ms: float
    tail_ms: float
    step_ms: float
    d2h_bytes_per_ms: float
    h2d_bytes_per_ms: float
    #: The same model measured at another batch size (Note [Batch scaling]); ``None``: no scaling.
    reference: Optional["ModelProfile"] = None
    #: Peak bytes of the optimizer step (after the backward), when the profiled step included
    #: it (a real step observed by the adapters): foreach AdamW's parameter-sized temporaries.
    optimizer_peak_bytes: int = 0
    #: Note [Regions outside the segments]: the code before the first segment, between two
    #: segments and after the last (head and loss) that saves tensors for backward, each profiled
    #: as a segment is, in its own windows; ``outside_after[j]`` is the index in ``segments`` of
    #: the segment ``outside[j]`` runs after (-1: before the first).
    outside: tuple[SegmentProfile, ...] = ()
    outside_after: tuple[int, ...] = ()
    #: The window after the last segment's forward (the tail: head and loss, planned or not) in
    #: two parts, where the meter tells them apart (CPU): the level as it opens and its peak after
    #: that; -1: not apart (Note [The tail opens holding the last input] in ``trace.py``; used by
    #: ``decide/under_plan.py``).
    tail_start_bytes: int = -1
    tail_rest_bytes: int = -1
    #: Processes the model is sharded over (FSDP); every byte above is this process's own
    #: (Note [Sharded state is local] in ``sharded.py``), so a budget is per process.
    world_size: int = 1
    #: Bytes of every storage the step saved for backward, in the segments or not (parameters
    #: excluded): what the segments' ``saved_bytes`` are a part of (Note [Finding the blocks]
    #: in ``segments.py``); -1: not known.
    total_saved_bytes: int = -1
    #: The part of those saved while a segment's forward ran (each storage once): the segments'
    #: coverage is ``segment_saved_bytes / total_saved_bytes`` (:meth:`coverage`); -1: not known.
    segment_saved_bytes: int = -1

    def coverage(self) -> Optional[float]:
        """The fraction of the step's saved bytes that the segments hold (Note [Finding the blocks]
        in ``segments.py``); ``None`` when not measured."""
        if self.total_saved_bytes <= 0 or self.segment_saved_bytes < 0:
            return None
        return min(self.segment_saved_bytes / self.total_saved_bytes, 1.0)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.segments)

    def refusing(self, refusals: Mapping[str, str]) -> "ModelProfile":
        """This profile with the actions ``refusals`` (segment name -> why) rule out
        (Note [Refused actions]); a name without a call number covers every call of its module."""
        if not refusals:
            return self
        segments = []
        for seg in self.segments:
            why = refusals.get(seg.name) or refusals.get(split_call(seg.name)[0])
            if why:
                refused = tuple(dict.fromkeys(seg.refused + refused_actions(why)))
                seg = dataclasses.replace(seg, refused=refused, refusal=seg.refusal or why)
            segments.append(seg)
        reference = self.reference.refusing(refusals) if self.reference is not None else None
        return dataclasses.replace(self, segments=tuple(segments), reference=reference)

    def with_selective_ops(self, selective_ops: Optional[Mapping[str, Iterable[str]]]) -> "ModelProfile":
        """This profile as a plan's ``selective_ops`` price it: each segment the plan gives a
        lighter selective choice (Note [Lighter selective] in ``profiler.py``) has that choice's
        bytes and times (:meth:`SegmentProfile.with_selective_ops`)."""
        if not selective_ops:
            return self
        segments = tuple(
            s.with_selective_ops(for_segment(selective_ops, s.name)) for s in self.segments
        )
        if all(a is b for a, b in zip(segments, self.segments)):
            return self
        return dataclasses.replace(self, segments=segments)

    @property
    def chain(self) -> tuple[tuple[SegmentProfile, bool], ...]:
        """Segments and outside regions in execution order, each with whether it is an outside
        region (Note [Regions outside the segments])."""
        before: dict[int, list[SegmentProfile]] = {}
        for region, after in zip(self.outside, self.outside_after):
            before.setdefault(after, []).append(region)
        out = [(r, True) for r in before.get(-1, ())]
        for i, s in enumerate(self.segments):
            out.append((s, False))
            out.extend((r, True) for r in before.get(i, ()))
        return tuple(out)

    @property
    def outside_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.outside)

    def has_prefix_region(self) -> bool:
        """Whether the part before the first segment is planned (a region of ``outside``):
        then its windows are the region's, not fixed."""
        return -1 in self.outside_after

    def has_tail_region(self) -> bool:
        """Whether the head and loss are planned: then ``tail_peak_bytes`` is only the moment the
        loss's backward begins (Note [Windows outside the segments] in ``trace.py``)."""
        return bool(self.segments) and len(self.segments) - 1 in self.outside_after

    @property
    def copies_overlap(self) -> bool:
        """Copies run on their own engines (CUDA); on CPU they are synchronous memcpys."""
        return self.device_type == "cuda"

    def with_state(self, *, forward_bytes: int, backward_bytes: int) -> "ModelProfile":
        """This profile with more bytes alive than when it was measured.

        Note [Steady-state shift]: the first step, which is the one profiled, has no gradients
        and no optimizer state; every later one has the optimizer state alive throughout, and
        the last step's gradients alive during the forward (and during the backward too, unless
        the loop frees them in between, as Lightning's closure does with ``zero_grad``).
        ``forward_bytes`` is added to every window up to the backward (the prefix's forward,
        the segments' forwards, the tail), ``backward_bytes`` to the backward windows. The
        optimizer step's own window was measured with its state and is left alone.
        """
        f, b = int(forward_bytes), int(backward_bytes)
        if f == 0 and b == 0:
            return self

        def shifted(elements: tuple[SegmentProfile, ...]) -> tuple[SegmentProfile, ...]:
            return tuple(
                dataclasses.replace(
                    seg, forward_peak_bytes=seg.forward_peak_bytes + f, backward_peak_bytes=seg.backward_peak_bytes + b,
                    offload_backward_peak_bytes=seg.offload_backward_peak_bytes + b,
                )
                for seg in elements
            )

        reference = self.reference.with_state(forward_bytes=f, backward_bytes=b) if self.reference is not None else None
        return dataclasses.replace(
            self, segments=shifted(self.segments), outside=shifted(self.outside), static_bytes=self.static_bytes + f,
            prefix_forward_peak_bytes=self.prefix_forward_peak_bytes + f,
            prefix_backward_peak_bytes=self.prefix_backward_peak_bytes + b, tail_peak_bytes=self.tail_peak_bytes + max(f, b),
            peak_bytes=self.peak_bytes + max(f, b), reference=reference,
        )

    def scaled(self, factor: float, batch_size: Optional[int] = None) -> "ModelProfile":
        """This profile for a batch holding ``factor`` times its activations (Note [A shape
        scaled from another] in ``scale/auto.py``): every activation's bytes and every time times
        ``factor``, each window's level its fixed part (what was alive before the step; in
        backward, every gradient too) plus ``factor`` times the rest; the parameters' gradients,
        the gathered parameters and the optimizer step as they are. ``batch_size``: the batch's."""
        if factor == 1 and batch_size in (None, self.batch_size):
            return self
        static, grads = self.static_bytes, self.gradient_bytes

        def grown(v: int) -> int:
            return max(0, round(v * factor))

        def level(v: int, base: int) -> int:
            return v if v <= base else base + grown(v - base)

        def scaled(s: SegmentProfile) -> SegmentProfile:
            changes: dict[str, Any] = {f: grown(getattr(s, f)) for f in _SCALED_INT_FIELDS if f not in _LEVEL_FIELDS + _FIXED_FIELDS}
            changes.update(forward_peak_bytes=level(s.forward_peak_bytes, static))
            changes.update({f: level(getattr(s, f), static + grads) for f in _LEVEL_FIELDS[1:]})
            changes.update({f: getattr(s, f) * factor for f in _SCALED_MS_FIELDS})
            changes.update({f: getattr(s, f) * factor for f in _MEASURED_MS_FIELDS if getattr(s, f) is not None})
            if s.released_forward_working_bytes >= 0:
                changes["released_forward_working_bytes"] = grown(s.released_forward_working_bytes)
            return dataclasses.replace(s, **changes)

        top = dict(
            prefix_forward_peak_bytes=level(self.prefix_forward_peak_bytes, static), tail_peak_bytes=level(self.tail_peak_bytes, static),
            prefix_backward_peak_bytes=level(self.prefix_backward_peak_bytes, static + grads), peak_bytes=level(self.peak_bytes, static),
        )
        for f in ("tail_start_bytes", "tail_rest_bytes"):
            if getattr(self, f) >= 0:
                top[f] = level(getattr(self, f), static)
        for f in ("total_saved_bytes", "segment_saved_bytes"):
            if getattr(self, f) >= 0:
                top[f] = grown(getattr(self, f))
        return dataclasses.replace(
            self, segments=tuple(scaled(s) for s in self.segments), outside=tuple(scaled(s) for s in self.outside),
            batch_size=batch_size or self.batch_size, prefix_ms=self.prefix_ms * factor, tail_ms=self.tail_ms * factor,
            step_ms=self.step_ms * factor, reference=None, **top,
        )

    def at_batch(self, batch_size: int) -> "ModelProfile":
        """This profile at another batch size (Note [Batch scaling])."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"`batch_size` must be an int > 0; got {batch_size!r}.")
        if batch_size == self.batch_size:
            return self
        ref = self.reference
        if ref is None or ref.batch_size == self.batch_size:
            raise ValueError(
                "`batch_size`: this profile was measured at one batch size only "
                f"({self.batch_size}); profile with scale=True to predict other batch sizes."
            )
        ratio = batch_size / self.batch_size
        # Note [Batch scaling]: the line through this profile and its reference, or beyond the
        # reference, through it and the reference's own (a farther point), where there is one.
        lo = self
        far = ref.reference
        if far is not None and batch_size > ref.batch_size and far.batch_size > ref.batch_size:
            lo, ref = ref, far
        b0, b1 = lo.batch_size, ref.batch_size

        def line(v0: float, v1: float) -> int:
            return max(0, round(v0 + (v0 - v1) / (b0 - b1) * (batch_size - b0)))

        def scaled(s: SegmentProfile, r: Optional[SegmentProfile]) -> SegmentProfile:
            # A region the other batch did not have: not scaled.
            low = next((e for e in (*lo.segments, *lo.outside) if e.name == s.name), s) if lo is not self else s
            r = r if r is not None else low
            changes: dict[str, Any] = {f: line(getattr(low, f), getattr(r, f)) for f in _SCALED_INT_FIELDS}
            changes.update({f: getattr(s, f) * ratio for f in _SCALED_MS_FIELDS})
            changes.update({f: getattr(s, f) * ratio for f in _MEASURED_MS_FIELDS if getattr(s, f) is not None})
            if s.released_forward_working_bytes >= 0:  # a working set grows with the batch
                changes["released_forward_working_bytes"] = round(s.released_forward_working_bytes * ratio)
            return dataclasses.replace(s, **changes)

        segments = [scaled(s, r) for s, r in zip(self.segments, ref.segments)]
        theirs = {r.name: r for r in ref.outside}
        outside = tuple(scaled(s, theirs.get(s.name)) for s in self.outside)
        top = {
            f: line(getattr(lo, f), getattr(ref, f))
            for f in ("static_bytes", "prefix_forward_peak_bytes", "prefix_backward_peak_bytes", "tail_peak_bytes", "peak_bytes")
        }
        for f in ("total_saved_bytes", "segment_saved_bytes"):
            if getattr(lo, f) >= 0 and getattr(ref, f) >= 0:
                top[f] = line(getattr(lo, f), getattr(ref, f))
        return dataclasses.replace(
            self,
            segments=tuple(segments),
            outside=outside,
            batch_size=batch_size,
            prefix_ms=self.prefix_ms * ratio,
            tail_ms=self.tail_ms * ratio,
            step_ms=self.step_ms * ratio,
            reference=dataclasses.replace(self, reference=None),
            **top,
        )


def _largest(values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    if not known:
        return None
    if isinstance(known[0], bool):
        return any(known)
    if isinstance(known[0], (int, float)):
        return max(known)
    if isinstance(known[0], tuple):  # refused actions: refused on any process, refused
        return tuple(dict.fromkeys(a for v in known for a in v))
    if any(v != known[0] for v in known):
        raise ValueError(f"`profiles` disagree on a value every process must share: {known}.")
    return known[0]


def max_profile(profiles: "list[ModelProfile]") -> "ModelProfile":
    """One profile from the same step measured on several processes (Note [Observe every rank]
    in ``observe.py``): every byte count and time the largest any process measured, every
    yes/no true if it was true on any (the conservative reading; they agree when the processes
    run the same model), names and kinds as they all have them (a ``ValueError`` if they do not:
    the processes cut the model differently). One process's profile is itself."""
    profiles = list(profiles)
    if not profiles:
        raise ValueError("`profiles` is empty.")
    first = profiles[0]
    if len(profiles) == 1:
        return first
    if any(len(p.segments) != len(first.segments) for p in profiles):
        raise ValueError(f"`profiles` have different numbers of segments: {[len(p.segments) for p in profiles]}.")
    segments = tuple(_max_segment(column) for column in zip(*(p.segments for p in profiles)))
    outside, outside_after = _max_outside(profiles)
    refs = [p.reference for p in profiles]
    skip = ("segments", "reference", "outside", "outside_after")
    top = {f.name: _largest([getattr(p, f.name) for p in profiles]) for f in dataclasses.fields(ModelProfile) if f.name not in skip}
    reference = max_profile(refs) if all(r is not None for r in refs) else None
    return ModelProfile(segments=segments, reference=reference, outside=outside, outside_after=outside_after, **top)


def _max_segment(column: "tuple[SegmentProfile, ...]") -> SegmentProfile:
    """One segment (or region outside the segments) as several processes measured it (Note
    [Observe every rank]): the largest of each field; the first refusal given; the ops
    ``SELECTIVE`` saves, those every process chose (one plan runs on all of them: an op one
    process found not worth its bytes is recomputed everywhere, so no process saves more than
    its own ``heavy_bytes`` priced)."""
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(SegmentProfile):
        values = [getattr(s, f.name) for s in column]
        if f.name == "refusal":
            fields[f.name] = next((v for v in values if v), "")
        elif f.name == "selective_ops":
            chosen = [v for v in values if v is not None]
            fields[f.name] = tuple(op for op in chosen[0] if all(op in v for v in chosen[1:])) if chosen else None
        elif f.name == "selective_variants":  # Note [Lighter selective]: those every process found, priced high
            found = [{v[0]: v for v in vs} for vs in values]
            fields[f.name] = tuple(
                (ops, max(b[ops][1] for b in found), max(b[ops][2] for b in found), min(b[ops][3] for b in found))
                for ops in found[0] if all(ops in b for b in found)
            )
        else:
            fields[f.name] = _largest(values)
    return SegmentProfile(**fields)


def _max_outside(profiles: "list[ModelProfile]") -> "tuple[tuple[SegmentProfile, ...], tuple[int, ...]]":
    """The regions outside the segments (Note [Regions outside the segments]) of several
    processes' profiles, matched by name: each the largest any process measured; a region only
    some processes planned (it saved something there only) is planned, as they measured it."""
    columns: dict[str, list[SegmentProfile]] = {}
    after: dict[str, int] = {}
    for p in profiles:
        for region, position in zip(p.outside, p.outside_after):
            columns.setdefault(region.name, []).append(region)
            after.setdefault(region.name, position)
    names = sorted(columns, key=lambda name: after[name])  # stable: the first process's order within a gap
    return tuple(_max_segment(tuple(columns[n])) for n in names), tuple(after[n] for n in names)
