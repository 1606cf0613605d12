"""The plan: one :class:`Action` per segment, with what the planner predicted for it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Optional

from ..actions import Action
from ..segments import outside_region_names
from ..units import format_bytes

__all__ = ["Plan", "PlanRow"]



@dataclass(frozen=True)
class PlanRow:
    """What one segment's action costs and saves, as the planner predicts it."""

    segment: str
    action: Action
    kept_bytes: int = 0
    offloaded_bytes: int = 0
    recomputed_bytes: int = 0
    added_ms: float = 0.0


@dataclass(frozen=True)
class Plan:
    """One action per segment, in execution order.

    A forced policy gives a plan without predictions (``predicted_*`` are ``None``); the
    planner fills them, and ``rows`` with the per-segment detail.
    """

    actions: Mapping[str, Action]
    predicted_peak_bytes: Optional[int] = None
    predicted_step_ms: Optional[float] = None
    budget_bytes: Optional[int] = None
    batch_size: Optional[int] = None
    rows: tuple[PlanRow, ...] = field(default=())
    #: ``rows`` were measured in the plan's first step (Note [Measured rows]), not predicted.
    measured: bool = False
    #: The regions outside the segments (Note [Regions outside the segments] in
    #: ``measure/model_profile.py``), by name (:func:`outside_region_names`), kept or offloaded;
    #: a region not named is kept.
    outside: Mapping[str, Action] = field(default_factory=dict)
    #: The copy windows the plan was priced for (Note [Copy windows, priced] in ``costmodel.py``),
    #: which the runtime then uses unless told otherwise; ``None``: Note [Default copy windows].
    prefetch_bytes: Optional[int] = None
    inflight_bytes: Optional[int] = None
    #: For ``SELECTIVE`` segments, the ops whose outputs are saved, decided from the profile's
    #: measured forward (Note [Which ops selective recomputation saves] in
    #: ``measure/profiler.py``): calls ``op#k`` (the ``k``-th call of ``op`` in the segment's
    #: forward, Note [Selective saves per call]) or ops (every call), the segment's own choice or a
    #: lighter one (Note [Lighter selective]); a segment not named saves the compute-heavy ops.
    selective_ops: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", MappingProxyType(dict(self.actions)))
        outside = dict(self.outside)
        for name, action in outside.items():
            if action not in (Action.KEEP, Action.OFFLOAD):
                raise ValueError(f"`outside[{name!r}]` must be Action.KEEP or Action.OFFLOAD (a region is not a module); got {action!r}.")
        object.__setattr__(self, "outside", MappingProxyType(outside))
        object.__setattr__(self, "selective_ops", MappingProxyType({k: tuple(v) for k, v in self.selective_ops.items()}))

    def __reduce__(self):
        # A mapping proxy does not pickle; plans cross processes (broadcast under DDP).
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["actions"] = dict(self.actions)
        state["outside"] = dict(self.outside)
        state["selective_ops"] = dict(self.selective_ops)
        return (_rebuild_plan, (state,))

    @classmethod
    def lowest_memory(
        cls, segments: "tuple[str, ...] | list[str]", refused: "Container[str]" = (), *, action: Action = Action.RECOMPUTE_OFFLOAD,
    ) -> "Plan":
        """The plan that leaves the least on the device without a profile: every segment
        ``action`` (``RECOMPUTE_OFFLOAD``; ``auto``'s first step gives ``OFFLOAD``, whose saved
        tensors its trace sees: Note [A traced step sees what the plan moves] in
        ``measure/trace.py``), ``OFFLOAD`` for one in
        ``refused``, whose recomputation is refused (Note [Refused actions] in
        ``measure/model_profile.py``), every region outside them offloaded (Note [Names of the
        regions outside the segments] in ``segments.py``), copies waited for when issued and
        fetched per saved tensor (Note [Copy windows] in ``engine/offload.py``)."""
        return cls(
            actions={name: Action.OFFLOAD if name in refused else action for name in segments},
            outside={name: Action.OFFLOAD for name in outside_region_names(segments)}, prefetch_bytes=0, inflight_bytes=0,
        )

    @property
    def offloads_outside(self) -> bool:
        return any(a is Action.OFFLOAD for a in self.outside.values())

    @property
    def segments(self) -> tuple[str, ...]:
        return tuple(self.actions)

    def counts(self) -> dict[Action, int]:
        """How many segments get each action (every action listed, zeros included)."""
        c = Counter(self.actions.values())
        return {a: c.get(a, 0) for a in Action}

    def summary(self) -> str:
        """``keep=12 offload=4``, and ``outside offload=2`` when regions outside the segments
        are offloaded."""
        text = " ".join(f"{a.value}={n}" for a, n in self.counts().items() if n)
        moved = sum(a is Action.OFFLOAD for a in self.outside.values())
        return f"{text} outside offload={moved}" if moved else text

    def __str__(self) -> str:
        """The table (``print(accelerator.swap_plan)``); ``repr`` stays the dataclass's."""
        return self.render()

    def render(self) -> str:
        """The plan as a text table: segment, action, and — predicted by the planner, or measured
        in the plan's first step (Note [Measured rows]) — bytes kept, offloaded and recomputed and
        milliseconds added; before either exists, a line saying so instead of empty columns."""
        if self.rows:
            header = ("segment", "action", "kept", "offloaded", "recomputed", "+ms")
            body = [
                (r.segment, r.action.value, format_bytes(r.kept_bytes), format_bytes(r.offloaded_bytes),
                 format_bytes(r.recomputed_bytes), f"{r.added_ms:.2f}")
                for r in self.rows
            ]
        else:
            header = ("segment", "action")
            body = [(name, action.value) for name, action in {**self.actions, **self.outside}.items()]
        widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(header)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in body]
        tail = []
        if not self.rows:
            tail.append("bytes and times not measured yet (they are, in the plan's first step)")
        elif self.measured:
            tail.append("bytes and +ms (recomputation) measured in the plan's first step")
        if self.predicted_peak_bytes is not None:
            tail.append(f"predicted peak {format_bytes(self.predicted_peak_bytes)}")
        if self.budget_bytes is not None:
            tail.append(f"budget {format_bytes(self.budget_bytes)}")
        if self.predicted_step_ms is not None:
            tail.append(f"predicted step {self.predicted_step_ms:.1f} ms")
        if self.batch_size is not None:
            tail.append(f"batch {self.batch_size}")
        if self.prefetch_bytes is not None or self.inflight_bytes is not None:
            tail.append(f"copy windows {format_bytes(self.prefetch_bytes)} ahead, {format_bytes(self.inflight_bytes)} in flight")
        if tail:
            lines.append(", ".join(tail))
        return "\n".join(lines)


def _rebuild_plan(state: dict) -> Plan:
    return Plan(**state)
