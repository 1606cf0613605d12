"""``um="all"``: the managed allocator under a ``torch.cuda.MemPool``, every CUDA allocation of
torch's caching allocator routed to that pool, and the repair older torch needs for the routing.

Note [Routing is not capture]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``um="all"`` routes the caching allocator's allocations on the device to our managed pool with
``torch._C._cuda_beginAllocateToPool(device, pool_id)``, which ``torch/csrc/cuda/Module.cpp``
binds to ``CUDACachingAllocator::beginAllocateToPool(device, id, [](cudaStream_t) { return
true; })``: every thread and stream. Up to torch 2.12 at least, that routing *is* the CUDA-graph
capture mechanism. In ``c10/cuda/CUDACachingAllocator.cpp`` (read in a 2.9-2.11 snapshot and in
the v2.12.0 excerpt quoted by pytorch/pytorch#189504; an older snapshot, before MemPools took an
allocator, gates ``malloc`` and ``free`` the same way),
``DeviceCachingAllocator::beginAllocateToPool`` appends ``(mempool_id, filter)`` to
``captures_underway``, and while that per-device list is not empty the allocator behaves as if a
graph were being captured:

- ``malloc`` calls ``process_events`` only ``if (C10_LIKELY(captures_underway.empty()))``: the
  events of cross-stream frees are never polled;
- ``free`` of a block with ``stream_uses`` (its tensor went through ``record_stream``) files it in
  ``deferred_blocks`` (``needs_events_deferred_until_no_capture`` in the older snapshot) instead of
  recording events, so the block is not reusable until routing ends: a leak per step for any code
  that frees after ``record_stream`` (the offload engine never does: its sources are freed after
  a compute-stream wait, Note [Stream protocol] rule 2; DDP or user code may);
- ``recordStream`` also files the stream in ``block_to_cudagraph_stream_uses``, and once routing
  ends, ``insert_events_deferred_until_no_capture`` -> ``remove_cudagraph_stream_uses`` drops those
  streams without waiting on them (right after a real capture, whose work never ran; wrong for
  ours, which did): the blocks return to the pool at once;
- ``release_cached_blocks`` (``torch.cuda.empty_cache()``, and the last retry before an
  out-of-memory error) leaves the default pool alone, and ``synchronize_and_free_events``
  asserts ``captures_underway.empty()``.

Routing one thread is no way out: ``_cuda_beginAllocateCurrentThreadToPool`` (2.8+, what
``torch.cuda.use_mem_pool`` uses: torch/cuda/memory.py:1447 in 2.14.1) appends to the same list,
its filter only picks the pool, and the gates test the list's emptiness (pytorch/pytorch#175015
reports this for every user MemPool). torch 2.14 separates the two: ``markCaptureBegin`` /
``markCaptureEnd`` mark a real capture, "Distinct from begin/endAllocateToPool, which only routes
allocations into a private mempool and can be invoked without an active cudaStreamBeginCapture
(e.g. from torch.cuda.use_mem_pool ...)" (torch/include/c10/cuda/CUDACachingAllocator.h:158-164
in the 2.14.1 wheel; the separation pytorch/pytorch#181830 and #175374 proposed). Its
``libc10_cuda.so`` asserts on ``num_active_captures_`` and ``is_capture_context()`` where the
2.9-2.11 snapshot asserts ``captures_underway.empty()``; its ``.cpp`` was not read, so that 2.14 no longer defers is inferred
from the header and the binary, and 2.13 (not read at all) is treated as affected.
``test_cuda_record_stream_frees_are_reclaimed`` checks the table below on the GPU machine's torch.

The choice, for torch 2.8 and newer:

- Route every thread with ``_cuda_beginAllocateToPool``, on every version. Autograd runs CUDA
  backward on its own device thread, which thread-local routing misses; torch's own
  ``torch.cuda._use_uvm`` (torch/cuda/memory.py:1600-1625 in 2.14.1) routes the calling thread
  and asks the user for ``torch.autograd.set_multithreading_enabled(False)`` (thread-local too),
  which changes how backward runs and still misses threads the user starts. On torch < 2.14
  thread-local routing would not avoid the capture state either (above).
- Not ``torch.cuda.memory.change_current_allocator(CUDAPluggableAllocator(...))``: it replaces
  the caching allocator itself, must precede the allocator's first use, and then every tensor's
  malloc and free is a call through our ``ctypes`` callbacks (the GIL each time) into
  ``cudaMallocManaged`` / ``cudaFree`` (which synchronizes the device), with no caching, no
  stream-ordered reuse and no ``record_stream``: rebuilding the caching allocator in Python, at a
  cost far over the 3% target. vLLM's ``CuMemAllocator`` (vllm/device_allocator/cumem.py) puts a
  MemPool over a pluggable allocator like we do, inside ``use_mem_pool`` and only around weight
  loading, on the calling thread; its free callback synchronizes because "The pluggable allocator
  path doesn't defer reclaim like the regular caching allocator".
- Where routing holds the capture state (:func:`routing_holds_capture_state`), repair it at step
  boundaries: :meth:`PoolRouting.reclaim` synchronizes the device (every stream use recorded while
  routing has then finished, so dropping them is right), ends routing, lets
  ``torch.cuda.empty_cache()`` run ``insert_events_deferred_until_no_capture`` (the deferred
  blocks go back to our pool's free lists; our pool is never freeable while its ``MemPool`` lives),
  and routes again. It runs from a global optimizer-step post hook (removed by :meth:`end`), only
  when the managed total grew since the last look or nears the cap, and only when the bytes freed
  but not reusable (the allocator's ``active_bytes`` less ``allocated_bytes``) pass
  ``reclaim_at_bytes`` (or any, near the cap). What stays unreclaimed is so bounded by
  ``reclaim_at_bytes`` plus one optimizer step's deferred frees; each reclaim costs one device
  synchronization, counted in ``reclaims``. ``end`` synchronizes before ending for the same reason.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["PoolRouting", "ROUTING_SEPARATE_FROM_CAPTURE", "routing_holds_capture_state"]

log = logging.getLogger(__name__)

#: The first torch whose caching allocator routes to a pool without entering its capture state
#: (Note [Routing is not capture]).
ROUTING_SEPARATE_FROM_CAPTURE = (2, 14)

#: ``reclaim_at_bytes`` is the larger of this and the cap / 16.
_MIN_RECLAIM_AT_BYTES = 256 << 20


def routing_holds_capture_state(version: tuple[int, int]) -> bool:
    """Whether routing allocations to a pool puts torch ``version``'s caching allocator in its
    CUDA-graph capture state (Note [Routing is not capture])."""
    return tuple(version) < ROUTING_SEPARATE_FROM_CAPTURE


# -- the allocator behind um="all" --------------------------------------------------------
_MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)


class _ManagedAllocator:
    """``malloc(size, device, stream)`` / ``free(ptr, size, device, stream)`` with the
    signatures :class:`torch.cuda.memory.CUDAPluggableAllocator` expects, as C function
    pointers made by ``ctypes`` (Note [Callbacks take the GIL] in :mod:`.unified`). ``memory`` is
    the :class:`~lightning_swap.core.engine.unified.memory.ManagedMemory` they allocate from.

    Note [Managed memory outlives the session]: weights and optimizer state allocated under
    ``um="all"`` live in this allocator's segments after training ends, so the callbacks
    and the pool must never be collected: instances are kept in ``_LIVE`` for the life of
    the process (``unified._LIVE``). Closing a session only stops routing new allocations here.
    """

    def __init__(self, memory: Any) -> None:
        self.memory = memory
        self._malloc = _MALLOC(self._on_malloc)
        self._free = _FREE(self._on_free)
        self.allocator: Any = None
        self.pool: Any = None

    @property
    def function_pointers(self) -> tuple[int, int]:
        """The addresses of the C-callable malloc and free."""
        return ctypes.cast(self._malloc, ctypes.c_void_p).value, ctypes.cast(self._free, ctypes.c_void_p).value

    def build_pool(self) -> "_ManagedAllocator":
        """The torch allocator over the function pointers and the pool using it (needs CUDA)."""
        self.allocator = torch._C._cuda_customAllocator(*self.function_pointers)
        self.pool = torch.cuda.MemPool(self.allocator)
        return self

    def _on_malloc(self, size: int, device: int, stream: Optional[int]) -> int:
        try:
            return self.memory.alloc(int(size))
        except Exception:  # noqa: BLE001 - an exception cannot cross into C++
            log.exception("managed allocation of %d bytes failed", size)
            return 0

    def _on_free(self, ptr: Optional[int], size: int, device: int, stream: Optional[int]) -> None:
        try:
            if ptr:
                self.memory.free(int(ptr))
        except Exception:  # noqa: BLE001
            log.exception("freeing managed memory at %s failed", ptr)


# -- routing ---------------------------------------------------------------------------------
def _end_fn() -> Any:
    return getattr(torch._C, "_cuda_endAllocateToPool", None) or getattr(torch._C, "_cuda_endAllocateCurrentStreamToPool", None)


class PoolRouting:
    """Every thread's allocations on ``device_index`` go to the pool ``pool_id`` while active.

    ``memory`` is the pool's accounting (``managed_bytes`` and ``max_bytes``, read on the host).
    With ``holds_capture_state`` (torch < 2.14), :meth:`begin` also installs the reclaim of Note
    [Routing is not capture] on every optimizer step, and :meth:`end` removes it.
    """

    def __init__(self, device_index: int, pool_id: Any, memory: Any, *, holds_capture_state: bool,
                 reclaim_at_bytes: Optional[int] = None) -> None:
        self.device_index = device_index
        self.pool_id = pool_id
        self.memory = memory
        self.holds_capture_state = holds_capture_state
        self.reclaim_at_bytes = reclaim_at_bytes if reclaim_at_bytes is not None else max(_MIN_RECLAIM_AT_BYTES, memory.max_bytes // 16)
        self.active = False
        self.reclaims = 0
        self.reclaimed_bytes = 0
        self._hook: Optional[Any] = None
        self._managed_seen = 0
        self._warned = False

    def begin(self) -> None:
        if self.active:
            return
        torch._C._cuda_beginAllocateToPool(self.device_index, self.pool_id)
        self.active = True
        if self.holds_capture_state and self._hook is None:
            self._managed_seen = self.memory.managed_bytes
            self._hook = register_optimizer_step_post_hook(self._after_optimizer_step)
            log.info(
                "torch %s keeps its caching allocator in CUDA-graph capture state while um='all' routes "
                "allocations: blocks freed after record_stream are reclaimed at optimizer steps once more "
                "than %d bytes wait, each time synchronizing the device (Note [Routing is not capture]); "
                "torch >= %d.%d routes without it",
                torch.__version__, self.reclaim_at_bytes, *ROUTING_SEPARATE_FROM_CAPTURE,
            )

    def end(self) -> None:
        """Stop routing (idempotent). What was allocated in the pool stays valid."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if not self.active:
            return
        if self.holds_capture_state:
            # Ending routing drops the stream uses recorded during it without waiting on them
            # (Note [Routing is not capture]): they must have finished first.
            torch.cuda.synchronize(self.device_index)
        self._stop()
        self.active = False

    def _stop(self) -> None:
        _end_fn()(self.device_index, self.pool_id)
        torch._C._cuda_releasePool(self.device_index, self.pool_id)

    # -- the repair for torch < 2.14 ---------------------------------------------------------
    def pending_free_bytes(self) -> int:
        """Bytes whose tensors were freed but that the allocator cannot reuse yet (waiting on a
        stream's event, or deferred as if under capture): ``active_bytes`` less
        ``allocated_bytes``, whose ``free`` lowers the second at once and only ``free_block`` the
        first. A host-side read of the allocator's counters; no device synchronization."""
        stats = torch.cuda.memory_stats(self.device_index)
        return max(0, stats.get("active_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0))

    def reclaim(self) -> int:
        """Return the blocks deferred while routing to the pool (Note [Routing is not capture]);
        the bytes that became reusable. Synchronizes the device: call it between steps. Nothing
        to do (0) where routing does not hold the capture state."""
        if not (self.active and self.holds_capture_state):
            return 0
        before = self.pending_free_bytes()
        # Every stream use recorded while routing must have finished before routing ends, since
        # ending it drops them unwaited (remove_cudagraph_stream_uses).
        torch.cuda.synchronize(self.device_index)
        self._stop()
        try:
            # With no capture underway this runs insert_events_deferred_until_no_capture: the
            # deferred blocks go back to our pool's free lists.
            torch.cuda.empty_cache()
        finally:
            torch._C._cuda_beginAllocateToPool(self.device_index, self.pool_id)
        reclaimed = max(0, before - self.pending_free_bytes())
        self.reclaims += 1
        self.reclaimed_bytes += reclaimed
        self._managed_seen = self.memory.managed_bytes
        if not self._warned:
            self._warned = True
            log.warning(
                "um='all' on torch %s: reclaimed %d bytes freed after record_stream that the caching "
                "allocator held back while routing to the managed pool; each reclaim synchronizes the device "
                "once (counted in stats().reclaims). torch >= %d.%d needs none (Note [Routing is not capture]).",
                torch.__version__, reclaimed, *ROUTING_SEPARATE_FROM_CAPTURE,
            )
        else:
            log.debug("um='all': reclaimed %d deferred bytes", reclaimed)
        return reclaimed

    def maybe_reclaim(self) -> int:
        """:meth:`reclaim` when enough waits (see the Note); else 0, after reading only host-side
        counters. Called after every optimizer step while routing holds the capture state."""
        if not (self.active and self.holds_capture_state):
            return 0
        managed = self.memory.managed_bytes
        grew = managed > self._managed_seen
        self._managed_seen = max(self._managed_seen, managed)
        near_cap = managed + self.reclaim_at_bytes > self.memory.max_bytes
        if not (grew or near_cap):
            return 0  # no new managed segment: whatever waits costs nothing yet
        pending = self.pending_free_bytes()
        if pending >= self.reclaim_at_bytes or (near_cap and pending > 0):
            return self.reclaim()
        return 0

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.maybe_reclaim()
