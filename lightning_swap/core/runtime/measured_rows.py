"""Note [Measured rows]: the rows of a plan without predictions, measured in its first step."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch
from torch import nn

from ..decide.plan import Plan, PlanRow
from ..tensors import ModuleHook

__all__ = ["RowMeasure"]


class RowMeasure:
    """Note [Measured rows]: a plan without predictions (a forced policy: nothing was profiled)
    gets rows measured in its first step, so that its table has numbers. Each segment's
    forward is bracketed (module hooks, for that step only): the bytes it leaves alive on the
    device (its saved activations that stay, and its output) are "kept", less what is still in
    flight to the host; the engine counts what it offloads per segment; the recompute timer
    gives each segment's recomputation time and the bytes it brought back."""

    def __init__(self, runtime: Any) -> None:  # the SwapRuntime whose first step this measures
        self.runtime = runtime
        self.kept: dict[str, int] = {}
        self.offloaded: dict[str, int] = {}
        self.recompute: dict[str, list] = {}
        self.handles: list[Any] = []
        self.open = False

    def start(self) -> "RowMeasure":
        rt = self.runtime
        rt.timer.segments, rt.timer.meter = {}, rt.meter
        marks: dict[str, tuple[int, int]] = {}

        def inflight() -> int:
            return rt.engine.copies.inflight_bytes if rt.engine is not None else 0

        for module_name, entries in rt._calls.groups.items():  # one bracket per module, whatever its calls
            module = rt._modules[module_name]

            def now(module_name: str = module_name, single: str = entries[0][1]) -> Optional[str]:
                """The segment of the call running (Note [A segment per call] in ``calls.py``)."""
                if not rt._calls.per_call(module_name):
                    return single
                entry = rt._calls.entry_now(module_name)
                return entry[1] if entry is not None else None

            def pre(m: nn.Module, args: Any, now: Any = now) -> None:
                name = now()
                if torch.is_grad_enabled() and name is not None:
                    marks[name] = (rt.meter.current_bytes, inflight())

            def post(m: nn.Module, args: Any, out: Any, now: Any = now) -> None:
                name = now()
                if name in marks:
                    bytes0, flying0 = marks.pop(name)
                    left = rt.meter.current_bytes - bytes0 - (inflight() - flying0)
                    self.kept[name] = self.kept.get(name, 0) + max(0, left)

            self.handles.append(module.register_forward_pre_hook(ModuleHook(pre)))
            self.handles.append(module.register_forward_hook(ModuleHook(post)))
        self.open = True
        return self

    def stop(self, counters: Any) -> None:
        rt = self.runtime
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.recompute, rt.timer.segments, rt.timer.meter = rt.timer.segments or {}, None, None
        if counters is not None:
            self.offloaded = {rt._names[i]: b for i, b in counters.by_segment.items() if 0 <= i < len(rt._names)}
        self.open = False

    def plan(self, *, wait: bool) -> Optional[Plan]:
        rt = self.runtime
        rows = []
        for name, action in rt.plan.actions.items():
            timing, recomputed = self.recompute.get(name, (None, 0))
            ms = timing.resolve(wait=wait) if timing is not None else 0.0
            if ms is None:
                return None  # the device has not finished the step yet
            rows.append(PlanRow(name, action, self.kept.get(name, 0), self.offloaded.get(name, 0), recomputed, ms))
        return replace(rt.plan, rows=tuple(rows), measured=True)
