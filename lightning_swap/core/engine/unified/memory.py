"""CUDA unified (managed) memory as a third tier under the plan (Choi, Yeom, Kim 2021:
"Unified memory for deep learning", and NVIDIA's Unified Memory programming guide).

``cudaMallocManaged`` memory is reachable from host and device; the driver migrates its
pages on demand, so a program may hold more than the GPU has (page faults then dominate the
step time). ``cudaMemPrefetchAsync`` migrates a range ahead of need and ``cudaMemAdvise``
says where it should live. Two modes, chosen by ``um``:

- ``"offload"``: the host copies of offloaded activations are managed buffers (instead of
  pinned ones) advised to live on the CPU; before a segment's backward they are prefetched
  to the GPU on the engine's copy stream (Note [Managed host buffers]).
- ``"all"``: in addition, every torch CUDA allocation on the device comes from managed
  memory: a :class:`torch.cuda.MemPool` whose allocator is :class:`_ManagedAllocator`, with
  every thread's allocations routed to it (Note [Routing every allocation], and Note [Routing is
  not capture] in :mod:`.pool_routing` for what that does to torch < 2.14's caching allocator).
  Training that does not fit is then slow instead of crashing, up to ``um_max_bytes``; the plan's segments
  get their parameters prefetched ahead of their forward and backward once the managed
  memory outgrows the device (Note [Prefetch only when oversubscribed]).

Everything here is torch and ``ctypes`` (:mod:`.cudart`); no compiler is needed.

Note [Callbacks take the GIL]: torch calls the allocator's malloc/free through plain C
function pointers that ``ctypes`` made from Python functions; each call takes the GIL. The
caching allocator calls them with its own lock held, only when it needs a new segment or
returns one (not on every tensor), and torch releases the GIL around its operators, so the
lock order (allocator lock, then GIL) is never reversed by torch itself. Code that holds the
GIL while waiting for the CUDA allocator from another thread would deadlock; we know of none.

Note [Page-fault time]: the time the GPU spends waiting for faulted pages is not visible to
torch or the runtime API (it needs CUPTI's unified-memory counters); ``fault_ms`` is
``None`` and ``docs/unified-memory.md`` says so. The step time against the default allocator is the measure.
"""

from __future__ import annotations

import bisect
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from ...config import SwapConfig, UMMode, check_um_max_bytes
from .cudart import CPU_DEVICE, Advice, CudaRuntime
from ...errors import UnifiedMemoryError
from ..host_pool import HostPool
from .pool_routing import PoolRouting, _end_fn, _ManagedAllocator, routing_holds_capture_state

__all__ = [
    "ManagedHostPool",
    "ManagedMemory",
    "UMMode",
    "UnifiedMemory",
    "UnifiedMemoryStats",
    "check_um_max_bytes",
    "install_unified_memory",
    "unified_memory_for",
    "refusal",
]

log = logging.getLogger(__name__)


# -- refusals ---------------------------------------------------------------------------
#: What ``um="all"`` needs from torch: a MemPool that takes a custom allocator, a custom
#: allocator from function pointers, and routing of every thread's allocations to a pool.
_ALL_FEATURES = ("cuda.MemPool", "_C._cuda_customAllocator", "_C._cuda_beginAllocateToPool", "_C._cuda_releasePool")


#: The oldest torch whose MemPool takes a custom allocator and routes every thread to it
#: reliably (vLLM's allocator relies on the same three bindings from 2.8 on).
_ALL_MIN_TORCH = (2, 8)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _missing_features() -> list[str]:
    missing = []
    if _torch_version() < _ALL_MIN_TORCH:
        missing.append("torch >= %d.%d" % _ALL_MIN_TORCH)
    for name in _ALL_FEATURES:
        obj: Any = torch
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            missing.append("torch." + name)
    if _end_routing_fn() is None:
        missing.append("torch._C._cuda_endAllocateToPool")
    return missing


def _end_routing_fn() -> Any:
    return _end_fn()


def refusal(
    mode: UMMode,
    device: torch.device,
    *,
    cuda_available: bool,
    missing_features: Iterable[str] = (),
    reserved_bytes: int = 0,
    has_pool: bool = False,
) -> Optional[str]:
    """Why unified memory cannot be installed here, or ``None`` if it can.

    A pure function of what :func:`install_unified_memory` reads off torch, so every refusal
    is tested on a machine without a GPU."""
    if mode is UMMode.OFF:
        return None
    if device.type != "cuda" or not cuda_available:
        where = "CUDA is not available" if device.type == "cuda" else f"this run is on {device}"
        return (
            f"um={mode.value!r} needs a CUDA device, and {where}. Use um='off' (the default) on CPU; "
            "offload to CPU RAM and recomputation work without unified memory."
        )
    if mode is UMMode.ALL:
        missing = list(missing_features)
        if missing:
            return (
                f"um='all' needs {', '.join(missing)}, which torch {torch.__version__} lacks: upgrade torch "
                "(2.8 or newer: torch.cuda.MemPool with a custom allocator), or use um='offload', which "
                "works with this torch."
            )
        if reserved_bytes > 0 and not has_pool:
            return (
                f"um='all' must be installed before the first CUDA allocation, and torch already holds "
                f"{reserved_bytes} bytes on {device}: CUDA is in use. Do not move the model or any tensor to "
                "the GPU before the Trainer / Accelerator starts (it installs unified memory first), or "
                "use um='offload', which can be installed at any time."
            )
    return None


# -- managed memory and its accounting ----------------------------------------------------
class ManagedMemory:
    """Every managed allocation of this process on one device, under one cap.

    ``alloc`` returns 0 instead of exceeding ``max_bytes`` (torch then raises its ordinary
    out-of-memory error), so a test or a user's cap can never ask the driver for more.

    Note [Refusals are not always errors]: torch turns a NULL from the pool's allocator into
    ``torch.OutOfMemoryError``, and some callers catch that and carry on differently: cuDNN's
    convolution planner (``try_plans`` in ATen's ``Conv_v8.cpp``) moves to the next engine when its
    workspace cannot be allocated, so a cap the default allocator does not have can change which
    kernels run, their speed and their rounding. A refusal is therefore counted
    (``refused_allocations``, ``refused_bytes``, read on the host at no cost) and the first one of
    each installation is logged as a warning naming the cap and how to raise it.
    """

    def __init__(self, runtime: Any, device_index: int, max_bytes: int, *, cap_origin: str = "um_max_bytes") -> None:
        self.runtime = runtime
        self.device_index = device_index
        self.max_bytes = max_bytes
        #: Where ``max_bytes`` came from, for the refusal warning.
        self.cap_origin = cap_origin
        self._warned_refusal = False
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._sizes: dict[int, int] = {}
        self.managed_bytes = 0
        self.peak_managed_bytes = 0
        self.refused_allocations = 0
        self.refused_bytes = 0
        self.prefetched_to_device_bytes = 0
        self.prefetched_to_host_bytes = 0
        self.advised_bytes = 0

    def set_cap(self, max_bytes: int, origin: str) -> None:
        """A new installation's cap; its first refusal is warned about again."""
        with self._lock:
            self.max_bytes = max_bytes
            self.cap_origin = origin
            self._warned_refusal = False

    def alloc(self, nbytes: int) -> int:
        with self._lock:
            refused = self.managed_bytes + nbytes > self.max_bytes
            if refused:
                self._refused(nbytes)
                in_use, first = self.managed_bytes, not self._warned_refusal
                self._warned_refusal = True
            else:
                self.managed_bytes += nbytes  # reserved before the call: another thread sees it
        if refused:
            self._report_refusal(nbytes, in_use, first)
            return 0
        try:
            ptr = self.runtime.malloc_managed(nbytes)
        except Exception as exc:  # noqa: BLE001 - reported as a failed allocation
            log.warning("cudaMallocManaged(%d) failed: %s", nbytes, exc)
            ptr = 0
        with self._lock:
            if not ptr:
                self.managed_bytes -= nbytes
                self._refused(nbytes)
                return 0
            bisect.insort(self._starts, ptr)
            self._sizes[ptr] = nbytes
            self.peak_managed_bytes = max(self.peak_managed_bytes, self.managed_bytes)
        return ptr

    def _refused(self, nbytes: int) -> None:
        self.refused_allocations += 1
        self.refused_bytes += nbytes

    def _report_refusal(self, nbytes: int, in_use: int, first: bool) -> None:
        """Note [Refusals are not always errors]. Runs in the allocator's callback: logging only."""
        if not first:
            log.debug("managed allocation of %d bytes refused: cap um_max_bytes=%d", nbytes, self.max_bytes)
            return
        log.warning(
            "unified memory refused a managed allocation of %d bytes on cuda:%d: it would exceed the cap "
            "um_max_bytes=%d (%s), with %d bytes already managed. torch turns a refusal into an out-of-memory "
            "error, or picks a kernel needing less workspace (cuDNN convolutions), which changes speed and can "
            "change results. Raise um_max_bytes (the option of the strategy or plugin in use, or "
            "ACCELERATE_CPU_SWAP_UM_MAX_BYTES); above the device's free memory it oversubscribes the GPU. "
            "Refusals are counted in stats().refused_allocations; this is logged once per installation.",
            nbytes, self.device_index, self.max_bytes, self.cap_origin, in_use,
        )

    def free(self, ptr: int) -> None:
        with self._lock:
            nbytes = self._sizes.pop(ptr, None)
            if nbytes is None:
                return
            del self._starts[bisect.bisect_left(self._starts, ptr)]
            self.managed_bytes -= nbytes
        try:
            self.runtime.free(ptr)
        except Exception as exc:  # noqa: BLE001 - at exit the context may be gone
            log.debug("cudaFree(%#x) failed: %s", ptr, exc)

    def owns(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies inside one managed allocation."""
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i < 0:
                return False
            start = self._starts[i]
            return ptr + nbytes <= start + self._sizes[start]

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> None:
        self.runtime.prefetch(ptr, nbytes, device, stream)
        if device == CPU_DEVICE:
            self.prefetched_to_host_bytes += nbytes
        else:
            self.prefetched_to_device_bytes += nbytes

    def advise(self, ptr: int, nbytes: int, advice: Advice, device: int) -> None:
        self.runtime.advise(ptr, nbytes, advice, device)
        self.advised_bytes += nbytes


class _ManagedBlock:
    """One managed allocation outside torch's allocator (a host buffer), freed when the last
    tensor over it dies: torch keeps this object alive for as long as such a tensor exists."""

    def __init__(self, memory: ManagedMemory, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}
        weakref.finalize(self, memory.free, ptr)


class ManagedHostPool(HostPool):
    """:class:`HostPool` whose buffers are managed memory.

    Note [Managed host buffers]: a buffer is advised to prefer the CPU and to stay mapped
    for the device (``SetPreferredLocation(cpu)``, ``SetAccessedBy(device)``). After the
    device-to-host copy fills it, it is prefetched to the CPU on the same stream (so the
    GPU's physical pages are released); before the copy back it is prefetched to the GPU on
    the host-to-device stream, and after that copy back to the CPU again, so a released
    buffer never holds GPU pages the allocator cannot see. Each hook runs on the stream of
    the copy it follows or precedes, so stream order is the only synchronisation needed.
    """

    def __init__(self, memory: ManagedMemory, device: torch.device) -> None:
        super().__init__(pin_memory=False)
        self.memory = memory
        self.device = device

    def _allocate(self, nbytes: int) -> torch.Tensor:
        memory = self.memory
        ptr = memory.alloc(nbytes)
        if not ptr:
            raise torch.OutOfMemoryError(
                f"managed memory for an offloaded activation ({nbytes} bytes) would exceed um_max_bytes="
                f"{memory.max_bytes} ({memory.managed_bytes} bytes in use); raise um_max_bytes or use um='off'."
            )
        block = _ManagedBlock(memory, ptr, nbytes)
        memory.advise(ptr, nbytes, Advice.SET_PREFERRED_LOCATION, CPU_DEVICE)
        memory.advise(ptr, nbytes, Advice.SET_ACCESSED_BY, memory.device_index)
        return memory.runtime.as_tensor(block, self.device)

    def after_write(self, buffer: torch.Tensor, nbytes: int, stream: Any) -> None:
        self.memory.prefetch(buffer.data_ptr(), nbytes, CPU_DEVICE, _stream_handle(stream))

    def before_read(self, buffer: torch.Tensor, nbytes: int, stream: Any) -> None:
        self.memory.prefetch(buffer.data_ptr(), nbytes, self.memory.device_index, _stream_handle(stream))

    def after_read(self, buffer: torch.Tensor, nbytes: int, stream: Any) -> None:
        self.memory.prefetch(buffer.data_ptr(), nbytes, CPU_DEVICE, _stream_handle(stream))


def _stream_handle(stream: Any) -> int:
    return 0 if stream is None else int(stream.cuda_stream)


#: One managed allocator per device index, alive until the process ends
#: (Note [Managed memory outlives the session]).
_LIVE: dict[int, _ManagedAllocator] = {}


# -- the handle adapters hold -------------------------------------------------------------
@dataclass(frozen=True)
class UnifiedMemoryStats:
    """Unified-memory telemetry, cumulative since installation."""

    mode: str
    max_bytes: int
    managed_bytes: int
    peak_managed_bytes: int
    prefetched_to_device_bytes: int
    prefetched_to_host_bytes: int
    advised_bytes: int
    #: Managed allocations refused (the cap, or the driver): Note [Refusals are not always errors].
    refused_allocations: int
    refused_bytes: int = 0
    #: ``um="all"`` on torch < 2.14: times the blocks deferred by routing were reclaimed (each a
    #: device synchronization) and the bytes it made reusable (Note [Routing is not capture]).
    reclaims: int = 0
    reclaimed_bytes: int = 0
    #: Not measurable without CUPTI: Note [Page-fault time].
    fault_ms: Optional[float] = None


class UnifiedMemory:
    """Unified memory installed on one device; built by :func:`install_unified_memory`.

    ``close()`` stops routing allocations to managed memory (``um="all"``); what is already
    allocated stays valid. Idempotent.
    """

    def __init__(self, mode: UMMode, device: torch.device, memory: ManagedMemory, allocator: Optional[_ManagedAllocator]) -> None:
        self.mode = mode
        self.device = device
        self.memory = memory
        self._allocator = allocator
        self._router: Optional[PoolRouting] = None
        self._stream: Optional[Any] = None
        #: Prefetch the plan's parameters even when the managed memory fits the device (tests).
        self.always_prefetch_parameters = False
        self._device_total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0

    @property
    def routing(self) -> bool:
        """Whether torch's allocations on the device currently come from managed memory."""
        return self._router is not None and self._router.active

    @property
    def routing_holds_capture_state(self) -> bool:
        """Whether this torch's caching allocator behaves as under CUDA-graph capture while
        ``um="all"`` routes (torch < 2.14: Note [Routing is not capture])."""
        return routing_holds_capture_state(_torch_version())

    def _begin_routing(self) -> None:
        if self._allocator is None or self.routing:
            return
        if self._router is None:
            # Note [Routing every allocation]: ``torch.cuda.use_mem_pool`` routes only the calling
            # thread, and autograd runs the backward of CUDA work on its own device thread: its
            # allocations would bypass managed memory. ``_cuda_beginAllocateToPool`` routes every
            # thread and stream on the device; what that costs on torch < 2.14, and the repair, is
            # Note [Routing is not capture] (pool_routing.py).
            self._router = PoolRouting(
                self.device.index, self._allocator.pool.id, self.memory,
                holds_capture_state=self.routing_holds_capture_state,
            )
        self._router.begin()

    def close(self) -> None:
        if self._router is not None:
            self._router.end()

    def pending_free_bytes(self) -> int:
        """Bytes freed by torch that its allocator cannot reuse yet (``um="all"``; 0 otherwise):
        :meth:`PoolRouting.pending_free_bytes`. Reads the allocator's host-side counters."""
        return self._router.pending_free_bytes() if self.routing else 0

    def reclaim(self) -> int:
        """Make the blocks that routing deferred reusable now (torch < 2.14; the optimizer-step
        hook does it on its own): Note [Routing is not capture]. Synchronizes the device."""
        return self._router.reclaim() if self.routing else 0

    def host_pool(self) -> ManagedHostPool:
        return ManagedHostPool(self.memory, self.device)

    # Note [Prefetch only when oversubscribed]: pages of managed memory that fits the device
    # are touched first on the GPU and never leave it, so prefetching them costs driver calls
    # and saves nothing; once the managed total outgrows the device, the driver evicts pages,
    # and the parameters a segment is about to use are worth bringing back ahead of it.
    def should_prefetch_parameters(self) -> bool:
        if self.mode is not UMMode.ALL:
            return False
        return self.always_prefetch_parameters or self.memory.managed_bytes > self._device_total

    def prefetch_tensors(self, tensors: Iterable[torch.Tensor]) -> int:
        """Prefetch the managed storages of ``tensors`` to the device on this handle's side
        stream (a hint: managed memory is coherent, so compute does not wait for it). Returns
        the bytes queued."""
        seen = set()
        queued = 0
        stream = self._prefetch_stream()
        for t in tensors:
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if ptr in seen or nbytes == 0 or not self.memory.owns(ptr, nbytes):
                continue
            seen.add(ptr)
            self.memory.prefetch(ptr, nbytes, self.memory.device_index, stream)
            queued += nbytes
        return queued

    def _prefetch_stream(self) -> int:
        if self.device.type != "cuda":
            return 0
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return int(self._stream.cuda_stream)

    def stats(self) -> UnifiedMemoryStats:
        m = self.memory
        return UnifiedMemoryStats(
            mode=self.mode.value,
            max_bytes=m.max_bytes,
            managed_bytes=m.managed_bytes,
            peak_managed_bytes=m.peak_managed_bytes,
            prefetched_to_device_bytes=m.prefetched_to_device_bytes,
            prefetched_to_host_bytes=m.prefetched_to_host_bytes,
            advised_bytes=m.advised_bytes,
            refused_allocations=m.refused_allocations,
            refused_bytes=m.refused_bytes,
            reclaims=self._router.reclaims if self._router is not None else 0,
            reclaimed_bytes=self._router.reclaimed_bytes if self._router is not None else 0,
        )

    def __enter__(self) -> "UnifiedMemory":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def install_unified_memory(
    mode: Any,
    device: torch.device | str,
    *,
    max_bytes: Optional[int] = None,
    runtime: Optional[Any] = None,
) -> Optional[UnifiedMemory]:
    """Install unified memory ``mode`` on ``device``; ``None`` for ``"off"``.

    Raises :class:`~lightning_swap.core.errors.UnifiedMemoryError` saying why and what to do
    when it cannot be installed (:func:`refusal`). ``max_bytes`` caps every managed
    allocation of this process on the device; by default the device's free memory now, so
    nothing oversubscribes the GPU unless asked to: pass more to let training that does not
    fit run slowly instead of failing (only where the driver supports oversubscription).
    """
    mode = UMMode.parse(mode)
    max_bytes = check_um_max_bytes(max_bytes)
    if mode is UMMode.OFF:
        return None
    device = torch.device(device)
    available = torch.cuda.is_available()
    if device.type == "cuda" and available and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    index = device.index if device.type == "cuda" and device.index is not None else 0
    existing = _LIVE.get(index)
    why = refusal(
        mode,
        device,
        cuda_available=available,
        missing_features=_missing_features() if mode is UMMode.ALL and available else (),
        reserved_bytes=torch.cuda.memory_reserved(device) if available and device.type == "cuda" and torch.cuda.is_initialized() else 0,
        has_pool=existing is not None,
    )
    if why is not None:
        raise UnifiedMemoryError(why, mode=mode.value, device=str(device))
    free, total = torch.cuda.mem_get_info(device)
    origin = "set by um_max_bytes"
    if max_bytes is None:
        max_bytes, origin = free, "the default: the device's free memory at installation"
    elif max_bytes > free:
        log.warning(
            "um_max_bytes=%d exceeds the free memory of %s (%d bytes): managed memory may oversubscribe the GPU",
            max_bytes, device, free,
        )
    if existing is not None:
        memory = existing.memory
        memory.set_cap(max_bytes, origin)
    else:
        try:
            memory = ManagedMemory(runtime if runtime is not None else CudaRuntime(), index, max_bytes, cap_origin=origin)
        except OSError as exc:
            raise UnifiedMemoryError(f"um={mode.value!r}: {exc}", mode=mode.value, device=str(device)) from exc
    allocator = None
    if mode is UMMode.ALL:
        allocator = existing if existing is not None else _ManagedAllocator(memory).build_pool()
        _LIVE[index] = allocator
    handle = UnifiedMemory(mode, device, memory, allocator)
    handle._begin_routing()
    log.info("unified memory um=%r on %s, at most %d bytes managed", mode.value, device, max_bytes)
    return handle


def unified_memory_for(config: "SwapConfig", device: torch.device | str) -> Optional["UnifiedMemory"]:
    """Install ``config.um`` on ``device`` (``None`` when off). Adapters call it before the model
    reaches the device: ``um="all"`` must precede the first CUDA allocation."""
    return install_unified_memory(config.um, device, max_bytes=config.um_max_bytes)
