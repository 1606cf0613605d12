"""Offload of saved activations to host memory through ``saved_tensors_hooks``.

The mechanism of vDNN / TensorFlow LMS / Capuchin, done with PyTorch's saved-tensor hooks:
in forward, each tensor autograd saves inside an offloaded segment is copied to a host
buffer (device-to-host on a side stream on CUDA) and the device copy is dropped; in backward
the bytes come back (host-to-device on a second side stream), prefetched one segment ahead of
need so that the copy hides behind the previous segment's backward. On CPU the same code
runs with synchronous copies and no streams.

Note [What is never offloaded]: parameters and buffers (their storage is alive anyway, so a
copy would cost bandwidth and free nothing), tensors smaller than ``min_offload_bytes``,
tensors on another device, and tensor subclasses or non-strided layouts (their storage is
not a plain byte array). These are returned to autograd unchanged.

Note [One storage, one copy]: several ops often save the same storage (a block's output is
saved by its last ReLU and by the next block's first conv; ``x`` and ``x.t()`` share one
storage). The whole storage is copied once per version of its content and each saved tensor
keeps only its view (dtype, size, stride, offset) into the shared entry. On the way back the
device copy is shared too, as long as any unpacked view of it is alive.

Note [Stream discipline]: a device tensor is released only after the event recorded after its
device-to-host copy has completed (we keep a reference until then); the host-to-device copy
of a buffer starts after that buffer's device-to-host event; compute waits on the event of
the prefetch it needs, never on the whole device; a host buffer goes back to the pool with
the events of the copies that use it (Note [Host buffer reuse]). The device memory a
prefetch copies into is allocated on the compute stream, so the copy stream first waits for
the compute stream: the allocator may have just recycled that block from compute work.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .host_pool import HostPool
from .meter import host_allocation

__all__ = ["OffloadCounters", "OffloadEngine"]


@dataclass
class OffloadCounters:
    offloaded_bytes: int = 0
    offloaded_tensors: int = 0
    deduplicated_tensors: int = 0
    fetched_bytes: int = 0
    prefetched_bytes: int = 0
    exposed_transfer_ms: float = 0.0


class _Entry:
    """One storage's bytes in a host buffer."""

    __slots__ = (
        "__weakref__", "segment", "nbytes", "buffer", "host", "source", "version",
        "d2h_event", "h2d_event", "pending_source", "prefetched", "landed", "pool", "lock",
    )

    def __init__(self, segment: int, nbytes: int, buffer: torch.Tensor, pool: HostPool) -> None:
        self.segment = segment
        self.nbytes = nbytes
        self.buffer = buffer
        self.host = buffer[:nbytes]
        self.pool = pool
        self.source: Optional[weakref.ref] = None
        self.version = -1
        self.d2h_event = None
        self.h2d_event = None
        self.pending_source: Optional[torch.Tensor] = None
        self.prefetched: Optional[tuple[torch.Tensor, Any]] = None
        self.landed: Optional[weakref.ref] = None

    def __del__(self) -> None:
        try:
            self.pool.release(self.buffer, (self.d2h_event, self.h2d_event))
        except Exception:  # interpreter shutdown
            pass


class _Packed:
    """What autograd holds instead of an offloaded tensor: a view into an entry."""

    __slots__ = ("entry", "dtype", "size", "stride", "offset")

    def __init__(self, entry: _Entry, t: torch.Tensor) -> None:
        self.entry = entry
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()


def _as_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


class OffloadEngine:
    """Owns the copy streams, the host pool and the per-step bookkeeping of offloaded tensors."""

    def __init__(
        self,
        device: torch.device,
        *,
        min_offload_bytes: int,
        prefetch_segments: int,
        pool: Optional[HostPool] = None,
    ) -> None:
        self.device = device
        self.min_offload_bytes = min_offload_bytes
        self.prefetch_segments = prefetch_segments
        self.is_cuda = device.type == "cuda"
        # Pinned buffers by default; managed ones under unified memory (unified.py).
        self.pool = pool if pool is not None else HostPool(pin_memory=self.is_cuda)
        if self.is_cuda:
            # One side stream per direction, owned here (Note [Stream discipline]).
            self._d2h = torch.cuda.Stream(device)
            self._h2d = torch.cuda.Stream(device)
        self._lock = threading.RLock()
        self._skip_ptrs: frozenset[int] = frozenset()
        self._by_storage: dict[int, weakref.ref] = {}
        self._by_segment: dict[int, list[weakref.ref]] = {}
        self._pending_sources: list[_Entry] = []
        self._waits: list[tuple[Any, Any]] = []
        self.counters = OffloadCounters()

    # -- step ---------------------------------------------------------------------------
    def begin_step(self, skip: Any) -> None:
        """Start a step; ``skip`` are tensors never offloaded (Note [What is never offloaded])."""
        self._skip_ptrs = frozenset(t.untyped_storage().data_ptr() for t in skip)
        self._by_storage.clear()
        self._by_segment.clear()
        self._waits.clear()
        self.counters = OffloadCounters()

    def end_step(self) -> OffloadCounters:
        self._poll_sources(wait=True)
        if self.is_cuda and self._waits:
            self._waits[-1][1].synchronize()
            self.counters.exposed_transfer_ms += sum(a.elapsed_time(b) for a, b in self._waits)
            self._waits.clear()
        return self.counters

    def close(self) -> None:
        self._poll_sources(wait=True)
        self._by_storage.clear()
        self._by_segment.clear()
        self.pool.clear()

    # -- hooks --------------------------------------------------------------------------
    def hooks(self, segment: int) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._packer(segment), self._unpack)

    def _packer(self, segment: int) -> Callable[[torch.Tensor], Any]:
        def pack(t: torch.Tensor) -> Any:
            return self._pack(segment, t)

        return pack

    def _should_offload(self, t: torch.Tensor) -> bool:
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            return False
        if t.device != self.device:
            return False
        storage = t.untyped_storage()
        if storage.nbytes() < max(self.min_offload_bytes, 1):
            return False
        return storage.data_ptr() not in self._skip_ptrs

    def _pack(self, segment: int, t: torch.Tensor) -> Any:
        if not self._should_offload(t):
            return t
        if segment not in self._by_segment:
            self._by_segment[segment] = []
        self._poll_sources(wait=False)
        storage = t.untyped_storage()
        key = id(storage)
        ref = self._by_storage.get(key)
        entry = ref() if ref is not None else None
        if entry is not None and entry.source is not None and entry.source() is storage and entry.version == t._version:
            self.counters.deduplicated_tensors += 1
            return _Packed(entry, t)
        entry = self._copy_out(segment, storage, t._version)
        self._by_storage[key] = weakref.ref(entry)
        self._by_segment[segment].append(weakref.ref(entry))
        return _Packed(entry, t)

    def _copy_out(self, segment: int, storage: torch.UntypedStorage, version: int) -> _Entry:
        nbytes = storage.nbytes()
        with self._lock:
            buffer = self.pool.acquire(nbytes)
        entry = _Entry(segment, nbytes, buffer, self.pool)
        entry.source = weakref.ref(storage)
        entry.version = version
        with torch.no_grad():
            src = _as_bytes(storage, self.device)
            if self.is_cuda:
                compute = torch.cuda.current_stream(self.device)
                self._d2h.wait_stream(compute)  # the bytes are produced on the compute stream
                with torch.cuda.stream(self._d2h), host_allocation():
                    entry.host.copy_(src, non_blocking=True)
                    self.pool.after_write(entry.buffer, nbytes, self._d2h)
                    entry.d2h_event = torch.cuda.Event()
                    entry.d2h_event.record(self._d2h)
                entry.pending_source = src  # keep the device bytes alive until the copy is done
                self._pending_sources.append(entry)
            else:
                start = time.perf_counter()
                with host_allocation():
                    entry.host.copy_(src)
                    self.pool.after_write(entry.buffer, nbytes, None)
                self.counters.exposed_transfer_ms += (time.perf_counter() - start) * 1e3
        self.counters.offloaded_bytes += nbytes
        self.counters.offloaded_tensors += 1
        return entry

    def _poll_sources(self, wait: bool) -> None:
        if not self._pending_sources:
            return
        still = []
        for entry in self._pending_sources:
            if wait:
                entry.d2h_event.synchronize()
            if entry.d2h_event.query():
                entry.pending_source = None
            else:
                still.append(entry)
        self._pending_sources = still

    def _copy_in(self, entry: _Entry) -> tuple[torch.Tensor, Any]:
        with torch.no_grad():
            dst = torch.empty(entry.nbytes, dtype=torch.uint8, device=self.device)
            if not self.is_cuda:
                start = time.perf_counter()
                self.pool.before_read(entry.buffer, entry.nbytes, None)
                dst.copy_(entry.host)
                self.pool.after_read(entry.buffer, entry.nbytes, None)
                self.counters.exposed_transfer_ms += (time.perf_counter() - start) * 1e3
                self.counters.fetched_bytes += entry.nbytes
                return dst, None
            compute = torch.cuda.current_stream(self.device)
            self._h2d.wait_stream(compute)  # ``dst`` may be a block compute just released
            self._h2d.wait_event(entry.d2h_event)  # the host bytes must have landed
            with torch.cuda.stream(self._h2d):
                self.pool.before_read(entry.buffer, entry.nbytes, self._h2d)
                dst.copy_(entry.host, non_blocking=True)
                self.pool.after_read(entry.buffer, entry.nbytes, self._h2d)
                event = torch.cuda.Event(enable_timing=False)
                event.record(self._h2d)
            entry.h2d_event = event
            self.counters.fetched_bytes += entry.nbytes
            return dst, event

    def _prefetch_segment(self, segment: int) -> None:
        for ref in self._by_segment.get(segment, ()):
            entry = ref()
            if entry is None or entry.prefetched is not None:
                continue
            if entry.landed is not None and entry.landed() is not None:
                continue
            dst, event = self._copy_in(entry)
            entry.prefetched = (dst, event)
            self.counters.prefetched_bytes += entry.nbytes

    def _prefetch_after(self, segment: int) -> None:
        """Bring back the rest of ``segment`` and the ``prefetch_segments`` before it."""
        if self.prefetch_segments <= 0:
            return
        for j in range(segment, segment - self.prefetch_segments - 1, -1):
            if j in self._by_segment:
                self._prefetch_segment(j)

    def backward_started(self, segment: int) -> None:
        """Note [Prefetch schedule]: when segment ``i``'s backward starts (the gradient of its
        output is ready), the host-to-device copies of segments ``i-1 .. i-k`` are queued, so
        they run on the copy engine while ``i`` computes; ``k = prefetch_segments``. An unpack
        that finds its bytes not yet queued copies them on demand."""
        if self.prefetch_segments <= 0:
            return
        with self._lock:
            for j in range(segment - 1, segment - self.prefetch_segments - 1, -1):
                if j in self._by_segment:
                    self._prefetch_segment(j)

    def _device_bytes(self, entry: _Entry) -> torch.Tensor:
        if entry.landed is not None:
            storage = entry.landed()
            if storage is not None:
                return _as_bytes(storage, self.device)
        if entry.prefetched is not None:
            dst, event = entry.prefetched
            entry.prefetched = None
        else:
            dst, event = self._copy_in(entry)
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            before = torch.cuda.Event(enable_timing=True)
            after = torch.cuda.Event(enable_timing=True)
            before.record(compute)
            compute.wait_event(event)  # compute waits for this prefetch only
            after.record(compute)
            self._waits.append((before, after))
        entry.landed = weakref.ref(dst.untyped_storage())
        return dst

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        entry = packed.entry
        with self._lock:
            self._poll_sources(wait=False)
            self._prefetch_after(entry.segment)
            dst = self._device_bytes(entry)
        with torch.no_grad():
            out = torch.empty(0, dtype=packed.dtype, device=self.device)
            out.set_(dst.untyped_storage(), packed.offset, packed.size, packed.stride)
        return out
