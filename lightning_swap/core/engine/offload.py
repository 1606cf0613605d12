"""Offload of saved activations to host memory through ``saved_tensors_hooks``.

The mechanism of vDNN / TensorFlow LMS / Capuchin, done with PyTorch's saved-tensor hooks:
in forward, each tensor autograd saves inside an offloaded segment is copied to a host
buffer (device-to-host on a side stream on CUDA) and the device copy is dropped; in backward
the bytes come back (host-to-device on a second side stream), prefetched ahead of need so
that the copy hides behind the backward of later segments. Every ordering between streams is
:mod:`.streams`'s business (Note [Stream protocol]); this module decides *what* moves *when*.
On CPU the same code runs with synchronous copies.

Note [What is never offloaded]: whatever is alive before the step anyway — parameters (any
``nn.Parameter``, also one swapped in during the step, as FSDP does with its gathered ones),
buffers and the tensors the caller tracks (the batch): a copy would cost bandwidth and free
nothing —, any view of the parameters a sharded model gathered for the segment running (a
transposed FSDP2 weight, FSDP1's views into its flat parameter; FSDP frees and gathers them
again itself: :meth:`OffloadEngine.segment_parameters`), tensors smaller than
``min_offload_bytes``, tensors on another device, and tensor subclasses or non-strided layouts
(their storage is not a plain byte array). These are returned to autograd as they are, detached (Note [No reference cycle]).

Note [One storage, one copy]: several ops often save the same storage (a block's output is
saved by its last ReLU and by the next block's first conv; ``x`` and ``x.t()`` share one
storage). The whole storage is copied out once per version of its content and each saved
tensor keeps only its view (dtype, size, stride, offset) into the shared entry. It is copied
back once too: the device copy is held from its first unpack until every saved tensor that
refers to it has been unpacked (``pending``), so ``fetched_bytes == offloaded_bytes`` in a
step with one backward; reading ``ctx.saved_tensors`` twice counts once per saved tensor
(``round``). A second backward over a retained graph fetches again only if the
first one's device copy died. ``fetched_bytes`` counts each storage's first crossing in a round;
a crossing again in the same round (a window of 0 bytes: Note [Copy windows]) counts in
``refetched_bytes``.

Note [Copy windows]: what is in flight to the host and what is fetched ahead are bounded in
bytes, so that a large segment does not pin its whole size twice:

- ``inflight_bytes = W``: after each copy to the host, the oldest sources are retired (the
  compute stream waits on their copies, rule 2 of Note [Stream protocol]) until at most ``W``
  bytes of sources remain in flight; ``0`` waits for each copy right after it is issued;
- ``prefetch_bytes = W > 0``: in backward, entries are fetched ahead in the reverse of the order
  they were offloaded in (the order backward mostly needs them in), whenever an unpack makes
  room, while the bytes fetched and not yet unpacked stay within ``W`` (one entry at least,
  however large); each entry at most once per step, and only one no unpack has reached yet. A
  fetched entry is held until its last unpack (Note [One storage, one copy]).
- ``prefetch_bytes = 0``: fetch on demand at the granularity of one saved tensor, as
  ``save_on_cpu`` does: an unpack fetches the bytes it needs, and the device copy is not held
  for the storage's later unpacks — it lives as long as the op that unpacked it holds it (a later
  unpack while it is alive reuses it: ``landed``). A storage several ops saved may come back more
  than once (the log-probabilities ``cross_entropy`` saves twice; a block input its branch and
  its skip connection save), which is the price of the device holding only what the running op
  reads, the least any plan can hold: the crossings after a storage's first in a backward are
  ``refetched_bytes``, so ``fetched_bytes + reused_bytes == offloaded_bytes`` still.

Note [Default copy windows]: a window left ``None`` (not given, and the plan priced none: a
forced policy, a plan written by hand; the planner always prices and records both) is one
element's worth where copies overlap compute — the most bytes one segment's forward, or one
stretch of code between segments, has offloaded so far in the step — and ``0`` where they do not
(CPU: every copy is done when issued, so nothing is ever in flight, and fetching ahead only
raises the peak); there a storage fetched on demand is held until its last unpack (Note [One
storage, one copy]), fetched once, as a window of 0 given does not. So a forced ``offload`` on
CUDA keeps about one segment's copies in flight and one segment's bytes fetched ahead, sized to
the model without a profile; the cost model prices it as the largest element's copied bytes
under the plan (Note [Copy windows, priced] in ``decide/costmodel.py``), which the running
maximum here reaches in backward (the forward is over) and stays under in forward.

Note [Used in place]: an offloaded storage may still be on the device when backward needs it
— its copy was still in flight when backward started (within ``inflight_bytes``), or something
else holds it (the batch, a kept segment's saved tensor, the user). Then the original is used
(and held by the entry until its last unpack, as a fetched copy would be) instead of a second
device copy: nothing is fetched while its original is alive.
The version check (Note [Saved version check]) guards that the bytes are still those saved.
Backward does not wait for the copies still reading those originals (both only read them):
the copy streams let go of each source once the host sees its copy complete, without waiting,
and of the rest when the step ends (rule 2 of Note [Stream protocol]).

Note [Saved version check]: with saved-tensor hooks autograd no longer compares a saved
tensor's version counter at unpack (it cannot see through the hooks), so the engine does it:
each saved tensor keeps the version it had when packed and something that shares its version
counter — the tensor detached when it is not offloaded, else a storage-less alias of it — and
unpack raises autograd's own RuntimeError, same text, at the same point (the unpack), when an
in-place operation changed it since. The message names the tensor's current ``grad_fn`` as
autograd does while the tensor is alive; once nothing holds it (its new ``grad_fn`` is gone
with it), the op that produced the saved version; and a saved *output* changed in place by
its new ``grad_fn`` (autograd names the node that saved it: a pack hook cannot tell an output
from an input).

Note [No reference cycle]: what ``pack`` returns is held by the graph's node; returning the
saved tensor itself, when an op saves its own output, makes tensor -> grad_fn -> node ->
tensor a cycle that only backward breaks (a graph dropped without backward, or after
``retain_graph=True``, would live until the garbage collector runs, with its host buffers).
Kept tensors are therefore held detached (no ``grad_fn``), and nothing else the engine holds
per step refers to a graph strongly.

Note [Saved metadata]: dtype, size, stride and storage offset are those of the saved view;
the lazy conjugate and negative bits are not in the bytes, so they are kept and put back.

Note [Regions outside the segments are hooked for the whole step]: the stem, the code between
segments and the head with its loss are no modules the runtime can wrap, yet under the
lowest-memory plan they hold most of what stays on the device (Note [Regions outside the
segments] in ``measure/model_profile.py``). When a plan offloads any of
them, the runtime enters :meth:`OffloadEngine.outside_hooks` for the whole step (``begin_step``
to ``end_step``), below every segment's own hooks: inside a segment's forward it sees only what
the segment's action leaves to it (a kept segment's saved tensors, the inputs a checkpoint
saves), which it keeps; outside, it offloads for the regions the plan offloads, by the region's
name, which the runtime resolves from the last segment that ran (``region`` is ``None`` to
keep). During a backward (a reentrant checkpoint recomputing, a double backward) nothing is
offloaded. A forward after a backward in the same step (accumulation) starts with the prefix
again; two forwards before one backward (micro-batches summed into one loss) run the second's
prefix under the tail's action (the runtime cannot tell them apart until a segment runs).
A module run several times (Note [A segment per call] in ``segments.py``) ends a region at each
call: the region after call ``k`` is named after the call's segment when the plan names calls.

Note [Regions outside the segments under FSDP]: the code outside the blocks runs with the root
unit's parameters gathered (the embedding's, the head's); the head's matmul saves a view of its
gathered weight, which is no activation and is freed or kept by FSDP itself. Before an offloaded
region saves its first tensor after a segment (or at the step's start), the runtime names every
parameter the model holds now to :meth:`OffloadEngine.segment_parameters`, as a segment names
its own unit's, so none is offloaded and none is counted as saved (Note [What is never offloaded]).

Note [Unplanned bytes]: a region whose action offloads still leaves some of its saved tensors
on the device — those Note [What is never offloaded] lists that would not be alive anyway
(small, subclasses, other layouts and devices). They are what no plan can move; the engine
counts them per step against every storage it saw saved (``OffloadCounters.saved_bytes``), and
the runtime reports both (``StepStats.unplanned_bytes`` / ``saved_bytes``).
"""

from __future__ import annotations

import itertools
import re
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

from ..compiled import dynamo_disable
from .host_pool import HostPool, SlabHostPool
from .meter import host_allocation
from .streams import CopyStreams, StreamOps, Timing, default_ops
from ..tensors import local_tensor

__all__ = ["OffloadCounters", "OffloadEngine"]


@dataclass
class OffloadCounters:
    offloaded_bytes: int = 0
    offloaded_tensors: int = 0
    deduplicated_tensors: int = 0
    fetched_bytes: int = 0
    #: Offloaded bytes whose device original was still alive when needed: used in place, not
    #: fetched (Note [Used in place]); ``fetched + reused == offloaded`` for one backward.
    reused_bytes: int = 0
    #: Bytes that crossed back again in the same backward, fetched per saved tensor under a window
    #: of 0 bytes (Note [Copy windows]); not in ``fetched_bytes``.
    refetched_bytes: int = 0
    prefetched_bytes: int = 0
    #: Host-measured copy time on CPU (synchronous copies); on CUDA see ``CopyStreams.exposed``.
    copy_ms: float = 0.0
    #: Bytes offloaded, by segment index, and by region outside the segments (its name).
    by_segment: dict = field(default_factory=dict)
    by_region: dict = field(default_factory=dict)
    #: Note [Unplanned bytes]: saved storages the engine saw this step (each once, parameters,
    #: buffers and the batch excluded), and of those, the bytes that stayed on the device although
    #: their region's action moves its saved tensors: under ``min_offload_bytes``, tensor
    #: subclasses, other layouts or devices.
    saved_bytes: int = 0
    unplanned_bytes: int = 0


class _Entry:
    """One storage's bytes in a host buffer, and its way back."""

    __slots__ = (
        "__weakref__", "segment", "nbytes", "buffer", "host", "source", "version", "pool",
        "d2h_event", "h2d_event", "fetch", "device", "landed", "packs", "pending", "round", "ahead", "observed",
    )

    def __init__(self, segment: int, nbytes: int, buffer: torch.Tensor, pool: HostPool) -> None:
        self.segment = segment
        self.nbytes = nbytes
        self.buffer = buffer
        self.host = buffer[:nbytes]
        self.pool = pool
        self.source: Optional[weakref.ref] = None
        self.version = -1
        self.d2h_event: Any = None
        self.h2d_event: Any = None
        #: The key, in the engine's ``_fetches``, of a queued host-to-device copy of this entry
        #: that the compute stream has not waited for yet.
        self.fetch: Optional[int] = None
        #: The device copy, held while saved tensors referring to it remain to be unpacked.
        self.device: Optional[torch.Tensor] = None
        #: The same, weakly, once all have been unpacked (a second backward may reuse it).
        self.landed: Optional[weakref.ref] = None
        self.packs = 0
        self.pending = 0
        #: Counts the times every saved tensor referring to the entry has been unpacked.
        self.round = 0
        #: Fetched ahead under a byte window and not unpacked yet (Note [Copy windows]).
        self.ahead = False
        #: What the engine's observer said of each pack, handed back at the first unpack (Note [A
        #: traced step sees what the plan moves] in ``measure/trace.py``).
        self.observed: list[Any] = []

    def __del__(self) -> None:
        try:
            self.pool.release(self.buffer, (self.d2h_event, self.h2d_event))
        except Exception:  # interpreter shutdown
            pass


class _Saved:
    """What autograd's own check needs to see an in-place change of a saved tensor (Note [Saved
    version check]): the version the tensor had when saved and how autograd names it."""

    __slots__ = ("version", "what", "output_nr", "producer", "tensor_ref")

    def __init__(self, t: torch.Tensor) -> None:
        self.version = t._version
        self.what = f"{t.type()} {list(t.size())}"
        self.output_nr = t.output_nr
        self.producer = t.grad_fn.name() if t.grad_fn is not None else None
        # Weakly: autograd names a saved input by its grad_fn at unpack (an in-place change
        # replaced it), and holding it strongly would keep its graph alive.
        self.tensor_ref = weakref.ref(t)

    def check(self, current: int) -> None:
        if current == self.version:
            return
        t = self.tensor_ref()
        fn = t.grad_fn.name() if t is not None and t.grad_fn is not None else self.producer
        which = f", which is output {self.output_nr} of {re.sub(r'Backward[0-9]*$', '', fn)}," if fn else ""
        hint = (
            " Hint: the backtrace further above shows the operation that failed to compute its gradient. "
            "The variable in question was changed in there or anywhere later. Good luck!"
            if torch.is_anomaly_enabled()
            else " Hint: enable anomaly detection to find the operation that failed to compute its gradient, "
            "with torch.autograd.set_detect_anomaly(True, check_nan=False)."
        )
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{self.what}]{which} is at version {current}; expected version {self.version} instead.{hint}"
        )


def _version_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor sharing ``t``'s version counter but not its storage (Note [Saved version check])."""
    version = t._version
    with torch.no_grad():
        alias = t.detach()
        # Without the lazy bits, which would make ``set_`` go through their fallbacks.
        if alias.is_conj():
            alias = alias.conj()
        if alias.is_neg():
            alias = torch._neg_view(alias)
        alias.set_(torch.empty(0, dtype=t.dtype, device=t.device).untyped_storage())
    # ``set_`` bumped the shared counter: put it back, so that autograd's checks of copies of
    # ``t`` saved outside the hooks and our own comparison see the version ``t`` really has.
    torch._C._autograd._unsafe_set_version_counter((t,), (version,))
    return alias


class _Kept(_Saved):
    """What autograd holds for a saved tensor the engine does not offload: the tensor detached
    (Note [No reference cycle]) and its version."""

    __slots__ = ("tensor",)

    def __init__(self, t: torch.Tensor) -> None:
        super().__init__(t)
        self.tensor = t.detach()


class _Packed(_Saved):
    """What autograd holds instead of an offloaded tensor: a view into an entry."""

    __slots__ = ("entry", "dtype", "size", "stride", "offset", "conj", "neg", "alias", "round")

    def __init__(self, entry: _Entry, t: torch.Tensor) -> None:
        super().__init__(t)
        self.entry = entry
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        # Note [Saved metadata]: the lazy conjugate and negative bits are not in the bytes.
        self.conj = t.is_conj()
        self.neg = t.is_neg()
        self.alias = _version_alias(t)
        #: The entry's unpack round this saved tensor was last unpacked in (Note [One storage, one copy]).
        self.round = -1
        entry.packs += 1
        entry.pending += 1

    def rebuild(self, dst: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = torch.empty(0, dtype=self.dtype, device=dst.device)
            out.set_(dst.untyped_storage(), self.offset, self.size, self.stride)
            if self.conj:
                out = out.conj()
            if self.neg:
                out = torch._neg_view(out)
        return out


def _as_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


class OffloadEngine:
    """Owns the copy streams, the host pool and the per-step bookkeeping of offloaded tensors."""

    def __init__(
        self,
        device: torch.device,
        *,
        min_offload_bytes: int,
        pool: Optional[HostPool] = None,
        ops: Optional[StreamOps] = None,
        prefetch_bytes: Optional[int] = None,
        inflight_bytes: Optional[int] = None,
    ) -> None:
        self.device = device
        self.min_offload_bytes = min_offload_bytes
        #: Note [Copy windows]; ``None``: Note [Default copy windows].
        self.prefetch_bytes, self.inflight_bytes = prefetch_bytes, inflight_bytes
        ops = ops if ops is not None else default_ops(device)
        self.copies = CopyStreams(device, ops)
        # Pinned slabs by default (Note [Pinned slabs]); managed buffers under unified memory.
        self.pool = pool if pool is not None else SlabHostPool(pin_memory=device.type == "cuda")
        self._lock = threading.RLock()
        self._skip_ptrs: frozenset[int] = frozenset()
        self._gathered_ptrs: frozenset[int] = frozenset()
        self._by_storage: dict[int, weakref.ref] = {}
        self._backward = False
        # Queued fetches the compute stream has not waited for yet, by id: held here, not only by
        # their entries, so that one is never dropped unwaited (rule 3 of Note [Stream protocol]).
        self._fetches: dict[int, tuple[torch.Tensor, Any]] = {}
        self._fetch_ids = itertools.count()
        self.counters = OffloadCounters()
        #: Entry -> the unpack round it last crossed back in (Note [One storage, one copy]).
        self._crossed: "weakref.WeakKeyDictionary[_Entry, int]" = weakref.WeakKeyDictionary()
        #: Storages counted in ``saved_bytes`` this step (Note [Unplanned bytes]), by id, weakly
        #: (an offloaded storage dies at once on CPU, and its id is reused).
        self._seen: dict[int, weakref.ref] = {}
        #: Entries in the order they were offloaded, and the next one a byte window fetches
        #: (Note [Copy windows]); bytes fetched ahead and not unpacked yet.
        self._order: list[weakref.ref] = []
        self._cursor = -1
        self._ahead_bytes = 0
        #: Note [Default copy windows]: bytes offloaded by the element running, and the most by one.
        self._element_bytes = self._most_bytes = 0
        #: A traced step's recorder (Note [A traced step sees what the plan moves] in
        #: ``measure/trace.py``): ``moved(t, offloaded)`` with every tensor a hook of this engine is
        #: asked to save; ``unpacked(what moved returned)`` before an offloaded one's first unpack,
        #: and ``fetched(what moved returned, the copy)`` after it; ``None``: nobody listens.
        self.observer: Any = None
        #: Note [Backward fetches within the budget]: the device bytes the budget leaves now, or
        #: ``None`` (no budget held online).
        self.room: Optional[Callable[[], int]] = None

    # -- step ---------------------------------------------------------------------------
    def begin_step(self, skip: Iterable[torch.Tensor]) -> None:
        """Start a step; ``skip`` are tensors never offloaded (Note [What is never offloaded])."""
        self._skip_ptrs = frozenset(local_tensor(t).untyped_storage().data_ptr() for t in skip)
        self._gathered_ptrs = frozenset()
        self._by_storage.clear()
        self._backward = False
        self.counters = OffloadCounters()
        self._seen.clear()
        self._order.clear()
        self._cursor, self._ahead_bytes, self._element_bytes, self._most_bytes = -1, 0, 0, 0

    def end_step(self) -> tuple[OffloadCounters, Timing]:
        """The step's counters and the time the compute stream stood waiting for copies (read
        later: Note [Stream protocol], rule 5). Nothing waits on the host: copies still in flight
        and prefetches nobody consumed retire onto the compute stream."""
        self._settle()
        self.pool.end_step()  # Note [Host pool bound]
        exposed, self.copies.exposed = self.copies.exposed, Timing(self.copies.ops)
        return self.counters, exposed

    def abort_step(self) -> None:
        """A step that raised: release everything this step held — sources whose copies are in
        flight (the compute stream waits on them, rule 2), prefetched device copies nobody
        consumed (rule 3) and the entries' device copies — without the step's statistics."""
        self._settle()
        for ref in self._by_storage.values():
            entry = ref()
            if entry is not None:
                entry.device = None
                entry.landed = None
        self._by_storage.clear()
        self._order.clear()
        self._cursor, self._ahead_bytes = -1, 0
        self._backward = False
        self.copies.exposed = Timing(self.copies.ops)
        self.pool.end_step()

    def _settle(self) -> None:
        self.copies.retire()
        for _, event in self._fetches.values():
            self.copies.consume(event)
        self._fetches.clear()

    def close(self) -> None:
        self._settle()
        self.copies.close()
        self._by_storage.clear()
        self.pool.clear()

    # -- hooks --------------------------------------------------------------------------
    def hooks(self, segment: int) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._packer(segment), self._unpack)

    def segment_started(self) -> None:
        """A segment's forward starts (with autograd recording)."""
        self._backward = False
        self._element_bytes = 0  # Note [Default copy windows]: a new element

    def segment_parameters(self, tensors: Iterable[torch.Tensor]) -> None:
        """The parameters of the segment whose forward starts, as they are now: under FSDP the
        gathered (unsharded) ones, whose storage FSDP re-allocates at every gather, so they are
        named per segment rather than once per step (Note [What is never offloaded])."""
        self._gathered_ptrs = frozenset(t.untyped_storage().data_ptr() for t in tensors)

    def segment_ended(self) -> None:
        """A segment's forward ended: what runs next is another element (Note [Default copy windows])."""
        self._element_bytes = 0

    def _packer(self, segment: int) -> Callable[[torch.Tensor], Any]:
        def pack(t: torch.Tensor) -> Any:
            return self._pack(segment, t)

        return pack

    def outside_hooks(self, region: Callable[[], Optional[str]]) -> torch.autograd.graph.saved_tensors_hooks:
        """Note [Regions outside the segments are hooked for the whole step]: ``region()`` names
        the offloaded region running now, or is ``None`` to keep."""

        # Note [Whole-step hooks are not traced]: the hooks are active while Dynamo traces the
        # model's own frames (the regions outside the segments run there, compiled with the
        # model); traced, the pack hook's ``set_`` (Note [Saved version check]) broke the graph
        # and made the hook look as if it modified its input. So they always run eagerly.
        @dynamo_disable
        def pack(t: torch.Tensor) -> Any:
            name = region() if torch._C._current_graph_task_id() == -1 else None
            if name is None:
                if self.observer is not None:
                    self.observer.moved(t, False)
                self._count_saved(t)
                return _Kept(t)
            return self._pack(None, t, region=name)

        return torch.autograd.graph.saved_tensors_hooks(pack, dynamo_disable(self._unpack))

    def _count_saved(self, t: torch.Tensor) -> Optional[torch.UntypedStorage]:
        """Note [Unplanned bytes]: counts ``t``'s storage once per step; returns it (``None`` for
        a tensor without a plain storage, or one alive before the step)."""
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.device != self.device:
            return None  # a parameter is alive anyway, as in _should_offload
        storage = t.untyped_storage()
        if storage.data_ptr() in self._skip_ptrs or storage.data_ptr() in self._gathered_ptrs:
            return None  # alive anyway: a parameter FSDP gathered is no saved activation either
        if not self._was_seen(storage):
            self._seen[id(storage)] = weakref.ref(storage)
            self.counters.saved_bytes += storage.nbytes()
        return storage

    def _was_seen(self, storage: torch.UntypedStorage) -> bool:
        ref = self._seen.get(id(storage))
        return ref is not None and ref() is storage

    def _should_offload(self, t: torch.Tensor) -> bool:
        # Any parameter, the model's or not, is alive anyway: one not in ``skip`` was swapped
        # in during the step (FSDP's gathered unsharded parameters) or belongs to another model.
        if type(t) is not torch.Tensor or t.layout != torch.strided:
            return False
        if t.device != self.device:
            return False
        storage = t.untyped_storage()
        if storage.nbytes() < max(self.min_offload_bytes, 1):
            return False
        return storage.data_ptr() not in self._skip_ptrs and storage.data_ptr() not in self._gathered_ptrs

    def _pack(self, segment: Optional[int], t: torch.Tensor, *, region: Optional[str] = None) -> Any:
        plain = type(t) is torch.Tensor and t.layout == torch.strided
        first = plain and not self._was_seen(t.untyped_storage())
        storage = self._count_saved(t)
        offload = self._should_offload(t)
        observed = self.observer.moved(t, offload) if self.observer is not None else None
        if not offload:
            if storage is not None and first:  # Note [Unplanned bytes]: it stays, against the plan
                self.counters.unplanned_bytes += storage.nbytes()
            return _Kept(t)
        storage = t.untyped_storage()
        key = id(storage)
        ref = self._by_storage.get(key)
        entry = ref() if ref is not None else None
        if entry is not None and entry.source is not None and entry.source() is storage and entry.version == t._version:
            self.counters.deduplicated_tensors += 1
            entry.observed.append(observed)
            return _Packed(entry, t)
        entry = self._copy_out(segment, storage, t._version)
        entry.observed.append(observed)
        if region is not None:
            self.counters.by_region[region] = self.counters.by_region.get(region, 0) + entry.nbytes
        self._by_storage[key] = weakref.ref(entry)
        self._order.append(weakref.ref(entry))
        return _Packed(entry, t)

    def _copy_out(self, segment: Optional[int], storage: torch.UntypedStorage, version: int) -> _Entry:
        nbytes = storage.nbytes()
        with self._lock:
            buffer, reuse_events = self.pool.acquire(nbytes)
        entry = _Entry(segment if segment is not None else -1, nbytes, buffer, self.pool)
        entry.source = weakref.ref(storage)
        entry.version = version
        pool = self.pool
        start = time.perf_counter()
        with torch.no_grad(), host_allocation():
            entry.d2h_event = self.copies.to_host(
                _as_bytes(storage, self.device),
                entry.host,
                after=reuse_events,
                then=lambda stream: pool.after_write(buffer, nbytes, stream),
            )
        self._element_bytes += nbytes
        self._most_bytes = max(self._most_bytes, self._element_bytes)
        self.copies.retire(self._window(self.inflight_bytes))
        if not self.copies.asynchronous:
            self.counters.copy_ms += (time.perf_counter() - start) * 1e3
        self.counters.offloaded_bytes += nbytes
        self.counters.offloaded_tensors += 1
        if segment is not None:  # a region outside the segments: counted by the caller
            self.counters.by_segment[segment] = self.counters.by_segment.get(segment, 0) + nbytes
        return entry

    def _fetch(self, entry: _Entry) -> tuple[torch.Tensor, Any]:
        """Queue the copy of ``entry`` back to the device (the compute stream has not waited yet)."""
        pool, buffer, nbytes = self.pool, entry.buffer, entry.nbytes
        start = time.perf_counter()
        with torch.no_grad():
            dst, event, reusable = self.copies.to_device(
                entry.host,
                nbytes,
                after=(entry.d2h_event,),
                before=lambda stream: pool.before_read(buffer, nbytes, stream),
                then=lambda stream: pool.after_read(buffer, nbytes, stream),
            )
        if not self.copies.asynchronous:
            self.counters.copy_ms += (time.perf_counter() - start) * 1e3
        entry.h2d_event = reusable  # rule 4, after the copy and what follows it
        if self._crossed.get(entry) == entry.round:
            self.counters.refetched_bytes += nbytes
        else:
            self._crossed[entry] = entry.round
            self.counters.fetched_bytes += nbytes
        return dst, event

    def _start_backward(self) -> None:
        if not self._backward:
            self._backward = True
            self._cursor = len(self._order) - 1
            # Note [Used in place]: the sources still in flight are handed to their entries
            # (not dropped and fetched straight back); the compute stream still waits on their
            # copies before they can ever be freed (rule 2).
            stashed = self.copies.stashed_ptrs()
            for ref in list(self._by_storage.values()) if stashed else ():
                entry = ref()
                storage = entry.source() if entry is not None and entry.source is not None else None
                if storage is not None and entry.device is None and storage.data_ptr() in stashed:
                    self._use_in_place(entry, storage)
        # Not retire(): reading a source in place needs no order with its copy, which only reads
        # it too; only freeing it does (Note [Used in place]).
        self.copies.retire_done()

    def _use_in_place(self, entry: _Entry, storage: torch.UntypedStorage) -> torch.Tensor:
        entry.device = _as_bytes(storage, self.device)
        self.counters.reused_bytes += entry.nbytes
        return entry.device

    def _prefetch_entry(self, entry: _Entry) -> int:
        """Fetch ``entry`` ahead of need; the bytes it newly brought (0: not needed, or alive, or no
        room for it in the budget: Note [Backward fetches within the budget])."""
        if entry.fetch is not None or entry.device is not None:
            return 0
        if entry.landed is not None and entry.landed() is not None:
            return 0
        storage = entry.source() if entry.source is not None else None
        if storage is not None:  # still on the device: held from now, not fetched
            self._use_in_place(entry, storage)
            return 0
        # Note [Backward fetches within the budget]: under ``policy="auto"`` a fetch ahead of need
        # is made only where the budget has room for it now; otherwise the tensor is fetched when
        # its backward reads it (on demand, one storage at a time), which the plan's peak allows.
        if self.room is not None and entry.nbytes > self.room():
            return 0
        entry.fetch = next(self._fetch_ids)
        self._fetches[entry.fetch] = self._fetch(entry)
        self.counters.prefetched_bytes += entry.nbytes
        return entry.nbytes

    def _window(self, given: Optional[int]) -> int:
        """A copy window in bytes: ``given``, else Note [Default copy windows]."""
        if given is not None:
            return given
        return self._most_bytes if self.copies.asynchronous else 0

    def _prefetch_window(self, limit: int) -> None:
        """Note [Copy windows]: fetch ahead, newest offloaded first, while the bytes fetched and
        not unpacked stay under ``limit`` (one entry at least)."""
        while self._cursor >= 0:
            entry = self._order[self._cursor]()
            if entry is not None and self._ahead_bytes and self._ahead_bytes + entry.nbytes > limit:
                return  # no room: it waits for the next unpack
            if entry is not None and self.room is not None and entry.nbytes > self.room():
                return  # none in the budget either (Note [Backward fetches within the budget])
            self._cursor -= 1
            if entry is None or entry.round > 0 or entry.pending < entry.packs:
                continue  # gone, or unpacked already: backward is past it
            if self._prefetch_entry(entry):
                entry.ahead = True
                self._ahead_bytes += entry.nbytes

    def _device_bytes(self, entry: _Entry) -> torch.Tensor:
        if entry.device is not None:
            return entry.device
        if entry.landed is not None:
            storage = entry.landed()
            if storage is not None:
                return _as_bytes(storage, self.device)
        fetch = self._fetches.pop(entry.fetch, None) if entry.fetch is not None else None
        entry.fetch = None
        storage = entry.source() if entry.source is not None else None
        if fetch is None and storage is not None:
            return self._use_in_place(entry, storage)
        if fetch is not None:
            dst, event = fetch
        else:
            dst, event = self._fetch(entry)
        self.copies.consume(event)  # rule 3: the compute stream waits before the first use
        entry.device = dst
        return dst

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Kept):
            packed.check(packed.tensor._version)
            return packed.tensor
        packed.check(packed.alias._version)
        entry = packed.entry
        observed, observer = entry.observed if self.observer is not None else [], self.observer
        if observed:  # its first unpack: plain training's copy is counted as the fetched one from here
            observer.unpacked(observed)
            entry.observed = []
        with self._lock:
            self._start_backward()
            dst = self._device_bytes(entry)
            if observed:
                observer.fetched(observed, dst)
            if entry.ahead:  # Note [Copy windows]: it leaves the window
                entry.ahead = False
                self._ahead_bytes -= entry.nbytes
            if packed.round != entry.round:  # a second unpack of one saved tensor counts once
                packed.round = entry.round
                entry.pending -= 1
            ahead = self._window(self.prefetch_bytes)
            if entry.device is not None and (entry.pending <= 0 or self.prefetch_bytes == 0):
                # Note [One storage, one copy]: every saved view has been handed out; or, fetched
                # per saved tensor (a window of 0 given: Note [Copy windows]), not held for the
                # others.
                entry.landed = weakref.ref(entry.device.untyped_storage())
                entry.device = None
            if entry.pending <= 0:
                entry.pending = entry.packs  # a second backward unpacks each once more
                entry.round += 1
            if ahead:
                self._prefetch_window(ahead)
        return packed.rebuild(dst)
