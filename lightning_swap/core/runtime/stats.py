"""What the runtime did in each step: :class:`StepStats`, and the history whose device times
are filled in lazily (Note [Stream protocol], rule 5, in ``engine/streams.py``)."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Optional

from ..engine.streams import Timing

__all__ = ["StatsHistory", "StepRecord", "StepStats"]


@dataclass(frozen=True)
class StepStats:
    """What the runtime did during one training step, from ``begin_step`` to ``end_step``: the
    forward, the loss and the backward, and the optimizer step where the adapter can see it end
    (the Lightning strategy does; Accelerate's loop ends the window at ``backward``).

    Byte counts and tensor counts are known when the step ends. The three times are measured on
    the device without making the host wait (Note [Stream protocol] in ``streams.py``): on CUDA
    they are ``None`` until the device has finished the step, and filled in later
    (:meth:`SwapRuntime.stats`); on CPU they are known at once.
    """

    #: Bytes: the most bytes alive on the device during the step (CUDA: the caching allocator's
    #: ``max_memory_allocated``; CPU: the live-storage meter, host pool excluded). ``None``: not
    #: measured, which happens only on CPU for a compiled model, whose steps run without the
    #: meter unless asked to (Note [No dispatch mode under compile] in ``runtime.py``).
    peak_device_bytes: Optional[int]
    #: Bytes copied to host memory in forward (each storage once: Note [One storage, one copy]).
    offloaded_bytes: int
    #: Bytes copied back to the device in backward, prefetched or on demand, each storage's first
    #: time in a backward (again: ``refetched_bytes``); with ``reused_bytes``, equals
    #: ``offloaded_bytes`` in a step with one backward.
    fetched_bytes: int
    #: Bytes of ``fetched_bytes`` copied ahead of need (Note [Copy windows] in ``engine/offload.py``).
    prefetched_bytes: int
    #: Saved tensors offloaded (distinct storages), and saved tensors that shared one of them.
    offloaded_tensors: int
    deduplicated_tensors: int
    #: Host memory reserved for offloaded activations at the end of the step, bytes.
    host_pool_bytes: int
    #: Milliseconds spent recomputing segments in backward.
    recompute_ms: Optional[float]
    #: Milliseconds the computation stood waiting for copies (on CPU: all copy time).
    exposed_transfer_ms: Optional[float]
    #: Milliseconds of the whole step on the device.
    step_ms: Optional[float]
    #: Unified memory (``um`` not ``"off"``): managed bytes at the end of the step, and bytes
    #: prefetched during it, either way (0 without unified memory).
    managed_bytes: int = 0
    um_prefetched_bytes: int = 0
    #: Managed allocations the ``um_max_bytes`` cap (or the driver) refused during the step: a
    #: refused cuDNN workspace silently changes the convolution algorithm.
    um_refused_allocations: int = 0
    #: Note [The budget held online] (``online.py``): the segments and regions ``policy="auto"``
    #: moved to lower-memory actions during the step to stay within the budget, each with why.
    moved: tuple[str, ...] = ()
    #: Offloaded bytes whose device original was still alive when backward needed them, used
    #: in place instead of fetched (Note [Used in place] in ``engine/offload.py``).
    reused_bytes: int = 0
    #: Bytes copied back again in the same backward: a window of 0 bytes fetches per saved tensor,
    #: so a storage several ops saved crosses once per op (Note [Copy windows] in ``engine/offload.py``).
    refetched_bytes: int = 0
    #: Note [Unplanned bytes] in ``engine/offload.py``: bytes saved for backward in this step
    #: (each storage once; parameters, buffers and the batch excluded) as far as the offload
    #: engine saw them (every region a plan offloads), and of those, the bytes that stayed on the
    #: device because no action can move them (under ``min_offload_bytes``, other layouts).
    #: ``None``: nothing offloads, so nothing was counted.
    saved_bytes: Optional[int] = None
    unplanned_bytes: Optional[int] = None

    @property
    def resolved(self) -> bool:
        """Whether the device-timed fields are filled in."""
        return self.step_ms is not None and self.recompute_ms is not None and self.exposed_transfer_ms is not None

    def as_metrics(self, prefix: str = "swap/") -> dict[str, float]:
        """Plain floats, one per numeric field, for a logger (times left out until resolved)."""
        return {prefix + k: float(v) for k, v in asdict(self).items() if isinstance(v, (int, float))}


class StepRecord:
    """A finished step whose device times may still be running (Note [Stream protocol], rule 5)."""

    __slots__ = ("stats", "step", "recompute", "exposed", "copy_ms")

    def __init__(self, stats: StepStats, step: Timing, recompute: Timing, exposed: Optional[Timing], copy_ms: float) -> None:
        self.stats = stats
        self.step = step
        self.recompute = recompute
        self.exposed = exposed
        self.copy_ms = copy_ms

    def resolve(self, wait: bool) -> bool:
        # The step's end event is the last one recorded on the compute stream: once it has
        # completed, so has every earlier timing event of the step. One wait at most.
        step = self.step.resolve(wait=wait)
        recompute = self.recompute.resolve()
        exposed = self.exposed.resolve() if self.exposed is not None else 0.0
        if step is None or recompute is None or exposed is None:
            return False
        self.stats = replace(self.stats, step_ms=step, recompute_ms=recompute, exposed_transfer_ms=exposed + self.copy_ms)
        return True


class StatsHistory:
    """The statistics of the last steps, oldest first, some with device times still running
    (Note [Stream protocol], rule 5, in ``streams.py``): reading never waits for the device
    unless asked to, outside a step."""

    def __init__(self, maxlen: int = 64) -> None:
        self._records: deque[StepRecord] = deque(maxlen=maxlen)
        #: How many steps were ever added (a position for :meth:`since`).
        self.count = 0

    def add(self, record: StepRecord) -> None:
        self._records.append(record)
        self.count += 1

    def resolve(self, *, wait: bool = False) -> None:
        for record in self._records:
            if not record.stats.resolved and not record.resolve(wait):
                break  # later steps finish later

    def latest(self, *, wait: bool = False) -> Optional[StepStats]:
        """The newest step whose times are known; with ``wait=True`` the newest step, waiting
        for the device if it must."""
        self.resolve(wait=wait)
        for record in reversed(self._records):
            if record.stats.resolved:
                return record.stats
        return None

    def newest_record(self) -> Optional[StepRecord]:
        """The newest step's record: another history may share it (a session's, across runtimes)."""
        return self._records[-1] if self._records else None

    def newest(self) -> Optional[StepStats]:
        """The newest step as known now (times may still be ``None``)."""
        return self._records[-1].stats if self._records else None

    def since(self, count: int, *, wait: bool = False) -> list[StepStats]:
        """The steps added after :attr:`count` was ``count`` (those still kept), oldest first."""
        self.resolve(wait=wait)
        new = min(self.count - count, len(self._records))
        return [r.stats for r in list(self._records)[len(self._records) - new:]] if new > 0 else []

    def all(self) -> list[StepStats]:
        self.resolve()
        return [r.stats for r in self._records]

    def clear(self) -> None:
        self._records.clear()
