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
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch

from .meter import host_allocation, mark_host

__all__ = ["HostPool"]

log = logging.getLogger(__name__)

_SMALL = 1 << 20


def _round_up(nbytes: int) -> int:
    granularity = 4096 if nbytes < _SMALL else _SMALL
    return max(granularity, (nbytes + granularity - 1) // granularity * granularity)


class HostPool:
    """Host byte buffers, bucketed by rounded size (Note [Host buffer reuse])."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._free: dict[int, list[tuple[torch.Tensor, tuple]]] = defaultdict(list)
        self.reserved_bytes = 0
        self.in_use_bytes = 0
        self.allocations = 0

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, tuple]:
        """A uint8 host tensor of at least ``nbytes`` bytes, and the events of the copies that
        last touched it (empty for a new buffer): the next copy into it must wait on them."""
        size = _round_up(nbytes)
        bucket = self._free[size]
        if bucket:
            buffer, events = bucket.pop()
        else:
            with host_allocation():
                buffer = self._allocate(size)
            mark_host(buffer)
            events = ()
            self.reserved_bytes += size
            self.allocations += 1
        self.in_use_bytes += size
        return buffer, events

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
        self._free[buffer.numel()].append((buffer, tuple(e for e in events if e is not None)))

    def clear(self) -> None:
        """Drop every free buffer. The engine drains its copy streams first; pinned memory is
        returned through torch's host allocator, which itself waits for recorded copies."""
        if self.in_use_bytes:
            log.debug("HostPool cleared with %d bytes still referenced by live graphs", self.in_use_bytes)
        self._free.clear()
        self.reserved_bytes = self.in_use_bytes
