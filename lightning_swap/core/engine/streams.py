"""The stream protocol: the one module that orders work between the compute stream and the copy
streams, and the only one that touches CUDA streams and events.

Note [Stream protocol]: on CUDA an offloaded activation crosses three streams: the *compute*
stream (the current stream, where the model runs), a device-to-host (*d2h*) copy stream and a
host-to-device (*h2d*) copy stream, one of each per engine (torchtune's ``OffloadActivations``
and torchao's ``CPUOffloadOptimizer`` use the same shape). The rules, each enforced here and
checked on CPU by an adversarial double of this module (``tests/stream_double.py``):

1. A copy reads only what is ready: before a d2h copy the d2h stream waits on an event recorded
   on the compute stream now (the bytes were produced there); before an h2d copy the h2d stream
   waits on the event of the d2h copy that filled the host buffer.
2. Device memory read by a d2h copy goes back to the allocator without the host ever waiting:
   the source is held in a stash while the copy overlaps the forward, until more than the
   in-flight window's bytes are stashed (Note [Copy windows] in ``offload.py``); then the
   *compute* stream waits on the oldest copies' events and their references are dropped. The
   block belongs to the compute stream's pool, so any later reuse is ordered after that wait (no
   ``record_stream``: under ``um="all"`` the allocator never reclaims blocks freed after one,
   and without it memory is freed at a point the host, the meter and the planner all agree on).
   This also bounds what is in flight: a fast forward cannot pile activations up behind a
   slow copy. In backward nothing new is copied out, and what is still stashed is let go
   without a wait once the host sees its copy complete (:meth:`CopyStreams.retire_done`), the
   rest when the step ends.
3. Device memory an h2d copy writes is allocated on the compute stream, and the h2d stream
   first waits on an event recorded on the compute stream at allocation (the allocator may hand
   back a block that queued compute work still uses). Before the bytes are used — or dropped
   unused — the compute stream waits on the copy's event (:meth:`CopyStreams.consume`); from then
   on it is an ordinary compute-stream block that autograd may free whenever it likes.
4. A host buffer is reused only after every copy that touched it: the next copy into it waits,
   on its own stream, on the events of the previous ones (``HostPool`` hands them out with the
   buffer). The host never touches the bytes, so device-side ordering is enough.
5. The host never waits on the device inside a step: no ``synchronize()``, no
   ``elapsed_time()`` on an event that has not completed. Timing events are read later, when
   :meth:`StreamOps.done` says they completed (:class:`Timing`).

:class:`StreamOps` is the seam: :class:`CudaOps` (real streams), :class:`SyncOps` (CPU: every
copy is done when issued) and, in tests, a recording double that performs copies late or out of
order, so a missing wait produces wrong numbers on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

__all__ = ["CopyStreams", "CudaOps", "StreamOps", "SyncOps", "Timing", "default_ops", "override_stream_ops"]


class StreamOps:
    """What the protocol needs from a device's streams and events (an interface).

    ``asynchronous`` says whether copies run beside compute (CUDA, the test double) or are done
    when issued (CPU). Events are opaque; ``None`` stands for "already complete".
    """

    asynchronous: bool = False

    def compute_stream(self) -> Any:
        raise NotImplementedError

    def new_stream(self) -> Any:
        raise NotImplementedError

    def record(self, stream: Any, *, timing: bool = False) -> Any:
        """An event recorded on ``stream`` now (after the work queued there so far)."""
        raise NotImplementedError

    def wait(self, stream: Any, event: Any) -> None:
        """``stream`` waits (on the device) for ``event``; the host does not."""
        raise NotImplementedError

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Queue ``dst.copy_(src)`` on ``stream``."""
        raise NotImplementedError

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """Device bytes allocated on the compute stream."""
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        """Make ``stream`` current inside the block (for hooks that queue work on it)."""
        return contextlib.nullcontext()

    def done(self, event: Any) -> bool:
        """Whether ``event`` completed; never blocks."""
        raise NotImplementedError

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two completed timing events."""
        raise NotImplementedError

    def synchronize(self, event: Any) -> None:
        """The host waits for ``event``: only outside a step (teardown, a user asking for numbers)."""
        raise NotImplementedError


class SyncOps(StreamOps):
    """CPU: one queue, every copy done when issued, every event complete."""

    asynchronous = False

    def compute_stream(self) -> Any:
        return None

    def new_stream(self) -> Any:
        return None

    def record(self, stream: Any, *, timing: bool = False) -> Any:
        return time.perf_counter() if timing else None

    def wait(self, stream: Any, event: Any) -> None:
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        dst.copy_(src)

    def done(self, event: Any) -> bool:
        return True

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return (end - start) * 1e3

    def synchronize(self, event: Any) -> None:
        return None


class CudaOps(StreamOps):
    """Real CUDA streams and events on one device."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def compute_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def record(self, stream: Any, *, timing: bool = False) -> Any:
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        if event is not None:
            stream.wait_event(event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def done(self, event: Any) -> bool:
        return event is None or event.query()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end)

    def synchronize(self, event: Any) -> None:
        if event is not None:
            event.synchronize()


_OVERRIDE: Optional[Callable[[torch.device], StreamOps]] = None


@contextlib.contextmanager
def override_stream_ops(factory: Callable[[torch.device], StreamOps]) -> Iterator[None]:
    """Runtimes built inside the block get ``factory(device)`` instead of the device's own
    stream layer (the test double of Note [Stream protocol]); restored on exit."""
    global _OVERRIDE
    previous, _OVERRIDE = _OVERRIDE, factory
    try:
        yield
    finally:
        _OVERRIDE = previous


def default_ops(device: torch.device) -> StreamOps:
    if _OVERRIDE is not None:
        return _OVERRIDE(device)
    return CudaOps(device) if device.type == "cuda" else SyncOps()


class Timing:
    """Milliseconds measured on the device without waiting for it (Note [Stream protocol], rule 5).

    ``add(start, end)`` keeps a pair of timing events; :meth:`resolve` adds up the pairs that have
    completed and returns ``None`` while any is still pending (or waits, with ``wait=True``,
    outside a step). On CPU the events are ``perf_counter`` readings and resolve at once.
    """

    __slots__ = ("ops", "_pairs", "_ms")

    def __init__(self, ops: StreamOps) -> None:
        self.ops = ops
        self._pairs: list[tuple[Any, Any]] = []
        self._ms = 0.0

    def add(self, start: Any, end: Any) -> None:
        self._pairs.append((start, end))

    def add_ms(self, ms: float) -> None:
        self._ms += ms

    def resolve(self, *, wait: bool = False) -> Optional[float]:
        if self._pairs:
            last = self._pairs[-1][1]
            if wait:
                self.ops.synchronize(last)
            elif not self.ops.done(last):
                return None
            self._ms += sum(self.ops.elapsed_ms(a, b) for a, b in self._pairs)
            self._pairs.clear()
        return self._ms

    @contextlib.contextmanager
    def measure(self, stream: Any) -> Iterator[None]:
        start = self.ops.record(stream, timing=True)
        try:
            yield
        finally:
            self.add(start, self.ops.record(stream, timing=True))


class CopyStreams:
    """The copy streams of one offload engine and the rules of Note [Stream protocol].

    ``exposed`` accumulates the time the compute stream stood waiting for a copy.
    """

    def __init__(self, device: torch.device, ops: StreamOps) -> None:
        self.device = device
        self.ops = ops
        self.asynchronous = ops.asynchronous
        self.d2h = ops.new_stream() if ops.asynchronous else None
        self.h2d = ops.new_stream() if ops.asynchronous else None
        # (source bytes, d2h event), oldest first: rule 2.
        self._stash: list[tuple[torch.Tensor, Any]] = []
        self.exposed = Timing(ops)

    # -- forward: device to host ---------------------------------------------------------
    def to_host(self, src: torch.Tensor, host: torch.Tensor, *, after: tuple = (), then: Optional[Callable[[Any], None]] = None) -> Any:
        """Queue ``host.copy_(src)``; returns its event. ``after``: events of earlier copies that
        touched ``host`` (rule 4); ``then(stream)`` queues more work after the copy on its stream."""
        ops = self.ops
        if not self.asynchronous:
            ops.copy(host, src, None)
            if then is not None:
                then(None)
            return None
        ops.wait(self.d2h, ops.record(ops.compute_stream()))  # rule 1
        for event in after:  # rule 4
            ops.wait(self.d2h, event)
        ops.copy(host, src, self.d2h)
        copied = ops.record(self.d2h)
        # rule 2: freeing the source waits for the copy only, not for what ``then`` queues
        # (Note [Two events] in :meth:`to_device`).
        self._stash.append((src, copied))
        if then is not None:
            with ops.use(self.d2h):
                then(self.d2h)
            done = ops.record(self.d2h)
        else:
            done = copied
        return done

    def retire(self, limit_bytes: int = 0) -> None:
        """The compute stream waits on the copies of the oldest stashed sources, whose references
        then drop (rule 2), until at most ``limit_bytes`` of sources remain in flight (all retire
        with 0: Note [Copy windows] in ``offload.py``)."""
        total = sum(src.numel() for src, _ in self._stash)
        cut, last = 0, None
        while cut < len(self._stash) and total > limit_bytes:
            total -= self._stash[cut][0].numel()
            last = self._stash[cut][1]
            cut += 1
        if last is not None:
            # One stream's events complete in order: waiting on the newest covers the rest.
            self._wait_compute(last)
            del self._stash[:cut]

    def retire_done(self) -> None:
        """Drop the stashed sources whose copies the host sees complete (rule 2, without a wait:
        nothing later can overlap a finished copy); one stream's events complete in order."""
        done = 0
        for _, event in self._stash:
            if not self.ops.done(event):
                break
            done += 1
        del self._stash[:done]

    def stashed_ptrs(self) -> set[int]:
        """The data pointers of the sources whose copies are in flight (rule 2)."""
        return {src.untyped_storage().data_ptr() for src, _ in self._stash}

    @property
    def inflight_bytes(self) -> int:
        return sum(src.numel() for src, _ in self._stash)

    # -- backward: host to device --------------------------------------------------------
    def to_device(self, host: torch.Tensor, nbytes: int, *, after: tuple = (), before: Optional[Callable[[Any], None]] = None, then: Optional[Callable[[Any], None]] = None) -> tuple[torch.Tensor, Any, Any]:
        """Device bytes holding ``host[:nbytes]``, the event the compute stream waits on before
        using them, and the event after which ``host`` may be reused (``None`` when done).
        ``after``: events the copy must follow (the d2h copy that filled ``host``: rule 1);
        ``before`` / ``then`` queue work on the copy's stream around it.

        Note [Two events]: the first event is recorded right after the copy, so that compute
        never waits for what ``then`` queues (under unified memory, the migration of the buffer
        back to the CPU); the second after ``then``, since the buffer is not free before that
        has run."""
        ops = self.ops
        dst = ops.empty(nbytes, self.device)  # on the compute stream: rule 3
        if not self.asynchronous:
            if before is not None:
                before(None)
            ops.copy(dst, host, None)
            if then is not None:
                then(None)
            return dst, None, None
        ops.wait(self.h2d, ops.record(ops.compute_stream()))  # rule 3
        for event in after:  # rule 1
            ops.wait(self.h2d, event)
        with ops.use(self.h2d):
            if before is not None:
                before(self.h2d)
            ops.copy(dst, host, self.h2d)
            landed = ops.record(self.h2d)
            if then is None:
                return dst, landed, landed
            then(self.h2d)
        return dst, landed, ops.record(self.h2d)

    def consume(self, event: Any) -> None:
        """The compute stream waits for a copy's event before using (or dropping) its bytes."""
        if event is not None:
            self._wait_compute(event)

    def _wait_compute(self, event: Any) -> None:
        ops = self.ops
        if ops.done(event):  # nothing to wait for: no timing events either
            return
        compute = ops.compute_stream()
        start = ops.record(compute, timing=True)
        ops.wait(compute, event)
        self.exposed.add(start, ops.record(compute, timing=True))

    def close(self) -> None:
        """Retire everything and wait for the copy streams (teardown: the host may wait here)."""
        self.retire()
        if self.asynchronous:
            for stream in (self.d2h, self.h2d):
                self.ops.synchronize(self.ops.record(stream))
