"""Memory timelines: device bytes over one training step, segment boundaries marked.

On CPU the meter reports every allocation and free, so the timeline has one sample per
change; the x axis counts those events (memory events, not seconds). On CUDA the allocator's
``memory_allocated`` is sampled at each segment boundary (forward start and end, backward
start), a coarser picture of the same curve. Rendering is separate
(:func:`lightning_swap.report.plot_timelines`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..engine.meter import DeviceMemoryMeter
from ..tensors import on_backward_start
from ..segments import resolve_modules

__all__ = ["Timeline", "TimelineRecorder"]


@dataclass(frozen=True)
class Timeline:
    """``samples``: (x, bytes alive); ``marks``: (x, label) at segment boundaries."""

    label: str
    samples: tuple[tuple[int, int], ...]
    marks: tuple[tuple[int, str], ...]
    peak_bytes: int
    device_type: str


class TimelineRecorder:
    """Records a :class:`Timeline` while open, listening to ``meter`` (which must be open over
    the same step) and marking the segments named in ``segments``."""

    def __init__(self, model: nn.Module, segments: list[str], meter: DeviceMemoryMeter, label: str) -> None:
        self.model = model
        self.segments = list(segments)
        self.meter = meter
        self.label = label
        self._samples: list[tuple[int, int]] = []
        self._marks: list[tuple[int, str]] = []
        self._handles: list[Any] = []
        self.timeline: Optional[Timeline] = None

    def _sample(self, current: Optional[int] = None) -> None:
        if current is None:
            current = self.meter.current_bytes
        self._samples.append((len(self._samples), current))

    def _mark(self, label: str) -> None:
        if self.meter.is_cuda:
            self._sample()
        self._marks.append((max(len(self._samples) - 1, 0), label))

    def __enter__(self) -> "TimelineRecorder":
        modules = resolve_modules(self.model, self.segments)  # canonical names, compiled or not
        for name in self.segments:
            module = modules[name]
            self._handles.append(module.register_forward_pre_hook(self._pre(name)))
            self._handles.append(module.register_forward_hook(self._post(name)))
        if not self.meter.is_cuda:
            self.meter.listeners.append(self._sample)
        self._sample()
        return self

    def _pre(self, name: str):
        def hook(module: nn.Module, args: Any) -> None:
            self._mark(f"F {name}")

        return hook

    def _post(self, name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                on_backward_start(output, lambda: self._mark(f"B {name}"))

        return hook

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._sample in self.meter.listeners:
            self.meter.listeners.remove(self._sample)
        self._sample()
        self.timeline = Timeline(
            label=self.label,
            samples=tuple(self._samples),
            marks=tuple(self._marks),
            peak_bytes=max(b for _, b in self._samples),
            device_type=self.meter.device.type,
        )
