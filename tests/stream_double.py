"""A recording, adversarial double of the CUDA stream layer (Note [Stream protocol] in
``lightning_swap/core/streams.py``), so that stream-order bugs show on a machine without a GPU.

The compute stream is the CPU itself: its work happens when it is issued. Work queued on a
side stream (a copy) is only *recorded*; it runs when something forces it — the compute stream
or the host waiting on an event recorded after it, or another stream's queued wait being
forced — and never earlier. Two legal schedules of a real GPU are played:

- ``"late"``: a side stream runs only what is forced, as late as possible;
- ``"early"``: whenever anything is forced, every other side stream first runs all it can,
  so copies on different streams land in the other order.

A missing wait then produces wrong numbers, not just another trace: device memory from
:meth:`StreamDouble.empty` is filled with ``0xFF`` bytes (NaN in every float format) until a
copy lands in it, a copy whose source was freed before it ran writes ``0xFF`` bytes and is
reported, and a copy into freed device memory is reported (on a GPU it would overwrite
whatever the allocator put there). ``log`` records every record, wait and copy;
``host_syncs`` counts every time the host waited.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Optional

import torch

from lightning_swap.core.engine.streams import StreamOps

POISON = 0xFF


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: list[tuple] = []  # ("wait", event) | ("copy", dst_ref, src_ref, nbytes)
        self.executed = 0

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    __slots__ = ("stream", "position", "time")

    def __init__(self, stream: FakeStream, position: int, when: Optional[float]) -> None:
        self.stream = stream
        self.position = position  # ops of ``stream`` that must have run
        self.time = when


class _Ref:
    """A tensor held weakly: its storage and its view."""

    __slots__ = ("storage", "dtype", "size", "stride", "offset", "device")

    def __init__(self, t: torch.Tensor) -> None:
        self.storage = weakref.ref(t.untyped_storage())
        self.dtype, self.size, self.stride, self.offset, self.device = t.dtype, t.size(), t.stride(), t.storage_offset(), t.device

    def get(self) -> Optional[torch.Tensor]:
        storage = self.storage()
        if storage is None:
            return None
        return torch.empty(0, dtype=self.dtype, device=self.device).set_(storage, self.offset, self.size, self.stride)


class StreamDouble(StreamOps):
    """The double; build one per runtime with ``override_stream_ops(lambda d: StreamDouble(d))``
    or share one (``DoubleFactory``) to read what a whole run did."""

    asynchronous = True

    def __init__(self, device: torch.device, *, mode: str = "late") -> None:
        if mode not in ("late", "early"):
            raise ValueError(f"`mode` must be 'late' or 'early'; got {mode!r}.")
        self.device = device
        self.mode = mode
        self.compute = FakeStream("compute")
        self.sides: list[FakeStream] = []
        self.log: list[tuple] = []
        self.host_syncs = 0
        self.violations: list[str] = []
        self.copies_done = 0
        self._forcing = False

    # -- the interface -------------------------------------------------------------------
    def compute_stream(self) -> FakeStream:
        return self.compute

    def new_stream(self) -> FakeStream:
        stream = FakeStream(f"side{len(self.sides)}")
        self.sides.append(stream)
        return stream

    def record(self, stream: FakeStream, *, timing: bool = False) -> FakeEvent:
        self.log.append(("record", stream.name))
        if stream is self.compute:
            return FakeEvent(stream, 0, time.perf_counter())
        return FakeEvent(stream, len(stream.queue), None)

    def wait(self, stream: FakeStream, event: Optional[FakeEvent]) -> None:
        if event is None:
            return
        self.log.append(("wait", stream.name, event.stream.name))
        if stream is self.compute:
            self._force(event)
        else:
            stream.queue.append(("wait", event))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("copy", stream.name, src.numel() * src.element_size()))
        if stream is self.compute:
            dst.copy_(src)
            return
        stream.queue.append(("copy", _Ref(dst), _Ref(src)))

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.full((nbytes,), POISON, dtype=torch.uint8, device=device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def done(self, event: Optional[FakeEvent]) -> bool:
        return event is None or event.stream is self.compute or event.stream.executed >= event.position

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        return max(0.0, (end.time or 0.0) - (start.time or 0.0)) * 1e3

    def synchronize(self, event: Optional[FakeEvent]) -> None:
        self.host_syncs += 1
        self.log.append(("host-sync",))
        if event is not None:
            self._force(event)

    # -- running queued work -----------------------------------------------------------------
    def _force(self, event: FakeEvent) -> None:
        if self.done(event):
            return
        if self.mode == "early" and not self._forcing:
            self._forcing = True
            try:
                for other in self.sides:
                    if other is not event.stream:
                        self._run(other, len(other.queue))
            finally:
                self._forcing = False
        self._run(event.stream, event.position)
        if event.time is None:
            event.time = time.perf_counter()

    def _run(self, stream: FakeStream, upto: int) -> None:
        while stream.executed < upto:
            op = stream.queue[stream.executed]
            stream.executed += 1  # before running: a wait may recurse into this stream's past only
            if op[0] == "wait":
                self._force(op[1])
            else:
                self._copy(stream, op[1], op[2])

    def _copy(self, stream: FakeStream, dst_ref: _Ref, src_ref: _Ref) -> None:
        dst, src = dst_ref.get(), src_ref.get()
        self.copies_done += 1
        if dst is None:
            self.violations.append(f"{stream.name}: a copy landed in memory freed before it ran")
            return
        with torch.no_grad():
            if src is None:
                self.violations.append(f"{stream.name}: a copy read memory freed before it ran")
                dst.view(torch.uint8).fill_(POISON)
            else:
                dst.copy_(src)

    def drain(self) -> None:
        """Run everything still queued (a test's teardown): late copies are checked too."""
        for stream in self.sides:
            self._run(stream, len(stream.queue))

    @property
    def pending(self) -> int:
        return sum(len(s.queue) - s.executed for s in self.sides)


class DoubleFactory:
    """``override_stream_ops(DoubleFactory(mode))``: every runtime gets its own double, all
    kept here so a test can read what happened across a whole run."""

    def __init__(self, mode: str = "late") -> None:
        self.mode = mode
        self.doubles: list[StreamDouble] = []

    def __call__(self, device: torch.device) -> StreamDouble:
        double = StreamDouble(device, mode=self.mode)
        self.doubles.append(double)
        return double

    @property
    def host_syncs(self) -> int:
        return sum(d.host_syncs for d in self.doubles)

    @property
    def violations(self) -> list[str]:
        return [v for d in self.doubles for v in d.violations]

    def drain(self) -> None:
        for d in self.doubles:
            d.drain()
