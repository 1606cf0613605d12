"""A reusable pool of host buffers for offloaded activations.

On CUDA the buffers are pinned, so device-to-host and host-to-device copies are asynchronous
and run on the copy engines; allocating pinned memory is slow (``cudaHostAlloc``), so each
buffer is allocated once and reused every step.

Note [Host buffer reuse]: a released buffer carries the events of the copies that touched it
(the device-to-host copy that filled it, the host-to-device copy that read it back), and
:meth:`HostPool.acquire` hands those events out with the buffer; the next copy into it waits
on them *on its own stream* (rule 4 of Note [Stream protocol] in ``streams.py``). The host
never reads or writes the bytes, so ordering on the device is all that is needed and the host
never polls or waits: a buffer can be handed out again at once, without a new pinned
allocation, however far the host runs ahead of the device.

Note [Host pool bound]: buffers come in size classes (four per doubling) and a request is
served by the smallest free buffer of its class up to twice its size, so a batch of another
shape reuses the buffers of the last one. At the end of each step the pool keeps at most the
bytes that step had in use at once: free buffers the step did not use go first (a shape that
went away), and any free buffer while more than twice that is reserved. Reserved bytes thus
stay within the last step's need plus the current step's, whatever sequence of shapes runs.
A dropped pinned buffer goes back through torch's host allocator, which reuses it only after
the copies recorded on it (the engine's copies are ``non_blocking``).

Note [Pinned slabs]: torch's pinned-memory allocator (``CachingHostAllocator``, default
settings) rounds every request up to a power of two and keeps a freed block cached, for a later
request of the same rounded size, until ``torch.cuda.empty_host_cache()`` — which would wait
for the device. A buffer per saved tensor in size classes therefore holds up to twice the bytes
it reports, and what the pool drops stays pinned: on a soak of changing shapes (GPT, batch
sizes 4..9) torch held 3.45x the largest step's offloaded bytes where the pool counted 1.72x.
The engine's pool (:class:`SlabHostPool`) asks torch only for power-of-two slabs of at least
1 MiB — what torch really reserves — and cuts each offloaded tensor's buffer from one, in
order (512-byte aligned): a slab whose pieces have all been released is started again from its
beginning. Everything the pool holds is then counted, little is lost to rounding, and a slab
it drops is one torch hands back for its next slab of that size. The first piece cut from a
slab started again carries the events of every copy of its previous round (rule 4 of Note
[Stream protocol]); the pieces after it need none, since the copies into a pool's buffers are
all queued on its engine's one device-to-host stream, after that first one. Under unified
memory buffers stay one allocation each (:class:`HostPool`): a managed buffer is migrated on
its own, and neighbours sharing its pages would move with it.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import Any, Optional

import torch

from .meter import host_allocation, mark_host

__all__ = ["HostPool", "SlabHostPool"]

log = logging.getLogger(__name__)

_MIN_CLASS = 4096
_CLASSES_PER_DOUBLING = 4


def _size_class(nbytes: int) -> int:
    """The smallest size class holding ``nbytes``: 4 KiB, then four classes per doubling
    (``2**k * (1, 1.25, 1.5, 1.75)``), so a buffer wastes under a quarter of its bytes."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    base = 1 << ((nbytes - 1).bit_length() - 1)
    step = base // _CLASSES_PER_DOUBLING
    return base + -(-(nbytes - base) // step) * step


class HostPool:
    """Host byte buffers in size classes (Note [Host buffer reuse], Note [Host pool bound])."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        # size class -> free buffers, each with its events and the step that last used it.
        self._free: dict[int, list[tuple[torch.Tensor, tuple, int]]] = defaultdict(list)
        self._step = 0
        self._peak_in_use = 0
        self.reserved_bytes = 0
        #: The most bytes reserved at once since the pool was made.
        self.peak_reserved_bytes = 0
        self.in_use_bytes = 0
        self.allocations = 0
        self.freed_bytes = 0

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, tuple]:
        """A uint8 host tensor of at least ``nbytes`` bytes, and the events of the copies that
        last touched it (empty for a new buffer): the next copy into it must wait on them."""
        size = _size_class(nbytes)
        found = self._take_free(size)
        if found is not None:
            buffer, events = found
        else:
            with host_allocation():
                buffer = self._allocate(size)
            mark_host(buffer)
            events = ()
            self.reserved_bytes += size
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
            self.allocations += 1
        self.in_use_bytes += buffer.numel()
        self._peak_in_use = max(self._peak_in_use, self.in_use_bytes)
        return buffer, events

    def _take_free(self, size: int) -> Optional[tuple[torch.Tensor, tuple]]:
        """The smallest free buffer of at least ``size`` and at most twice as many bytes."""
        for cls in sorted(c for c, bucket in self._free.items() if bucket and size <= c <= 2 * size):
            buffer, events, _ = self._free[cls].pop()
            return buffer, events
        return None

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)

    # The offload engine calls these around its copies, on the copy's stream (``None`` on
    # CPU). Pinned memory needs nothing; managed memory migrates (Note [Managed host buffers]).
    def after_write(self, buffer: torch.Tensor, nbytes: int, stream: Any) -> None:
        """The device-to-host copy into ``buffer`` has been queued."""

    def before_read(self, buffer: torch.Tensor, nbytes: int, stream: Any) -> None:
        """The host-to-device copy out of ``buffer`` is about to be queued."""

    def after_read(self, buffer: torch.Tensor, nbytes: int, stream: Any) -> None:
        """The host-to-device copy out of ``buffer`` has been queued."""

    def release(self, buffer: torch.Tensor, events: tuple = ()) -> None:
        """Give ``buffer`` back with the events of the copies that used it."""
        self.in_use_bytes -= buffer.numel()
        self._free[buffer.numel()].append((buffer, tuple(e for e in events if e is not None), self._step))

    def end_step(self) -> None:
        """Note [Host pool bound]: keep what this step needed at once, drop the rest."""
        keep = self._peak_in_use
        for cls in sorted(self._free, reverse=True):
            bucket = self._free[cls]
            # Stale first (not used this step: a shape that went away), then the largest.
            bucket.sort(key=lambda item: item[2], reverse=True)
            while bucket and self.reserved_bytes > keep and (bucket[-1][2] < self._step or self.reserved_bytes > 2 * keep):
                buffer, _, _ = bucket.pop()
                self.reserved_bytes -= buffer.numel()
                self.freed_bytes += buffer.numel()
        self._step += 1
        self._peak_in_use = self.in_use_bytes

    def clear(self) -> None:
        """Drop every free buffer. The engine drains its copy streams first; pinned memory is
        returned through torch's host allocator, which itself waits for recorded copies."""
        if self.in_use_bytes:
            log.debug("HostPool cleared with %d bytes still referenced by live graphs", self.in_use_bytes)
        self._free.clear()
        self.reserved_bytes = self.in_use_bytes


_ALIGN = 512
_MIN_SLAB = 1 << 20


class _Slab:
    """One power-of-two allocation, and the pieces cut from it this round."""

    __slots__ = ("tensor", "offset", "live", "events", "reuse", "step")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.offset = 0
        self.live = 0
        #: Events of the copies that used pieces released this round.
        self.events: list = []
        #: Those of the previous round, handed out with its first piece of this one.
        self.reuse: tuple = ()
        self.step = -1


class SlabHostPool(HostPool):
    """Host buffers cut from power-of-two slabs (Note [Pinned slabs]); the same bound and the
    same interface as :class:`HostPool`."""

    def __init__(self, pin_memory: bool) -> None:
        super().__init__(pin_memory)
        self._slabs: list[_Slab] = []
        self._open: Optional[_Slab] = None
        self._pieces: dict[int, _Slab] = {}  # data pointer of a piece handed out -> its slab
        # release() may come from autograd's device thread, or from an entry the garbage
        # collector frees while this thread is inside acquire(): reentrant.
        self._lock = threading.RLock()

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, tuple]:
        size = -(-nbytes // _ALIGN) * _ALIGN
        with self._lock:
            slab = self._open
            if slab is None or slab.offset + size > slab.tensor.numel():
                slab = self._open = self._restart(size) or self._new_slab(size)
            events = slab.reuse if slab.offset == 0 else ()
            piece = slab.tensor[slab.offset : slab.offset + size]
            slab.offset += size
            slab.live += 1
            slab.step = self._step
            self._pieces[piece.data_ptr()] = slab
            self.in_use_bytes += size
            self._peak_in_use = max(self._peak_in_use, self.in_use_bytes)
        return piece, events

    def _restart(self, size: int) -> Optional[_Slab]:
        """The first slab with room for ``size`` whose pieces have all been released, started
        again from its beginning."""
        for slab in self._slabs:
            if slab.live == 0 and slab.tensor.numel() >= size:
                slab.offset = 0
                slab.reuse, slab.events = tuple(slab.events), []
                return slab
        return None

    def _new_slab(self, size: int) -> _Slab:
        nbytes = 1 << (max(size, _MIN_SLAB) - 1).bit_length()
        with host_allocation():
            tensor = self._allocate(nbytes)
        mark_host(tensor)
        slab = _Slab(tensor)
        self._slabs.append(slab)
        self.reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        self.allocations += 1
        return slab

    def release(self, buffer: torch.Tensor, events: tuple = ()) -> None:
        with self._lock:
            slab = self._pieces.pop(buffer.data_ptr())
            slab.live -= 1
            slab.events.extend(e for e in events if e is not None)
            self.in_use_bytes -= buffer.numel()

    def end_step(self) -> None:
        """Note [Host pool bound], by slabs: keep what this step had in use at once, drop
        slabs it did not use first."""
        with self._lock:
            keep = self._peak_in_use
            for slab in sorted(self._slabs, key=lambda s: (s.step, -s.tensor.numel())):
                stale = slab.step < self._step
                if slab.live == 0 and self.reserved_bytes > keep and (stale or self.reserved_bytes > 2 * keep):
                    self._drop(slab)
            self._step += 1
            self._peak_in_use = self.in_use_bytes

    def _drop(self, slab: _Slab) -> None:
        self._slabs.remove(slab)
        if self._open is slab:
            self._open = None
        self.reserved_bytes -= slab.tensor.numel()
        self.freed_bytes += slab.tensor.numel()

    def clear(self) -> None:
        """Drop every slab none of whose pieces a live graph still holds."""
        with self._lock:
            if self.in_use_bytes:
                log.debug("SlabHostPool cleared with %d bytes still referenced by live graphs", self.in_use_bytes)
            for slab in [s for s in self._slabs if s.live == 0]:
                self._drop(slab)
