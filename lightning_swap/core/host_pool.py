"""A reusable pool of host buffers for offloaded activations.

On CUDA the buffers are pinned, so device-to-host and host-to-device copies are asynchronous
and run on the copy engines; allocating pinned memory is slow (``cudaHostAlloc``), so each
buffer is allocated once and reused every step. A buffer is handed out again only after the
copies that read or write it have finished (their events), see Note [Host buffer reuse].
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Optional

import torch

from .meter import host_allocation, mark_host

__all__ = ["HostPool"]

log = logging.getLogger(__name__)

_SMALL = 1 << 20


def _round_up(nbytes: int) -> int:
    granularity = 4096 if nbytes < _SMALL else _SMALL
    return max(granularity, (nbytes + granularity - 1) // granularity * granularity)


class HostPool:
    """Host byte buffers, bucketed by rounded size.

    Note [Host buffer reuse]: ``release(buffer, events)`` does not make the buffer available
    at once: it waits in ``_pending`` until every event (the device-to-host copy that filled
    it, the host-to-device copy that read it) has completed. Reusing it earlier would let a
    new copy overwrite bytes an in-flight copy has not read yet.
    """

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._pending: list[tuple[torch.Tensor, tuple]] = []
        self.reserved_bytes = 0
        self.in_use_bytes = 0
        self.allocations = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of at least ``nbytes`` bytes."""
        size = _round_up(nbytes)
        bucket = self._free[size]
        if not bucket:
            self._reclaim()
        if bucket:
            buffer = bucket.pop()
        else:
            with host_allocation():
                buffer = self._allocate(size)
            mark_host(buffer)
            self.reserved_bytes += size
            self.allocations += 1
        self.in_use_bytes += size
        return buffer

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
        self.in_use_bytes -= buffer.numel()
        events = tuple(e for e in events if e is not None)
        if events:
            self._pending.append((buffer, events))
        else:
            self._free[buffer.numel()].append(buffer)

    def _reclaim(self) -> None:
        still = []
        for buffer, events in self._pending:
            if all(e.query() for e in events):
                self._free[buffer.numel()].append(buffer)
            else:
                still.append((buffer, events))
        self._pending = still

    def synchronize(self) -> None:
        """Wait for every pending copy and make all released buffers reusable."""
        for _, events in self._pending:
            for e in events:
                e.synchronize()
        self._reclaim()

    def owns_free(self, buffer: Optional[torch.Tensor]) -> bool:
        return buffer is not None and any(buffer is b for b in self._free[buffer.numel()])

    def clear(self) -> None:
        """Free every buffer (waiting for in-flight copies first)."""
        self.synchronize()
        if self.in_use_bytes:
            log.debug("HostPool cleared with %d bytes still referenced by live graphs", self.in_use_bytes)
        self._free.clear()
        self.reserved_bytes = self.in_use_bytes
