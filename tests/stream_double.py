"""A model of CUDA's ordering rules on the CPU, as strict as CUDA: the test double of the stream
layer (Note [Stream protocol] in ``lightning_swap/core/engine/streams.py``), so that stream-order
bugs show as wrong numbers, or as reported violations, on a machine without a GPU.

Note [Strict stream model]: CUDA promises an order only where one is declared, and so does this
model. Every stream carries a *vector clock*: for each stream, how far into that stream the work
it queues from now on is ordered after. A side stream's position is the length of its queue; the
compute stream's is a tick counter advanced by every aten op, counted by a ``TorchDispatchMode``
(:class:`ComputeStream`): the CPU runs compute work when it is issued, so each op is one unit
of compute-stream work. Orders come only from what CUDA offers:

- ``record(stream)`` snapshots the stream's clock (and its own position) into an event;
  ``wait(stream, event)`` merges the snapshot into the stream's clock (``wait_event``); events
  compose, so orders are transitive across streams;
- the host observing an event complete (``done`` true, ``synchronize``) orders everything any
  stream queues afterwards after it;
- one stream's work runs in queue order.

Hazards are checked on storages, when work is issued, with the clock the work is issued under:

1. A copy on a side stream is *unordered* if its device side was last written by compute work
   (a d2h source: the op that produced it; an h2d destination: its allocation, see 3) that the
   copy's stream is not ordered after. An unordered copy writes POISON (``0xFF``: NaN in every
   float format) into its destination when it runs, and is reported: on a GPU it may run
   before or under that work.
2. A copy conflicting (one of the two writes) with a copy on another side stream that touched
   the same bytes (a host buffer reused: Note [Host buffer reuse]) must be ordered after it;
   compute work touching them must be ordered after any side-stream copy that conflicts with
   it (reading an h2d destination before the copy landed; writing a d2h source the copy may
   not have read yet). Violations are reported. Bytes, not storages: the pieces of one host
   slab (Note [Pinned slabs]) are separate memory, as they are to CUDA.
3. The caching allocator: ``empty`` allocates on the current stream (the compute stream, unless
   inside ``use(stream)``); the block may be one that stream's earlier work used, so the
   allocation counts as a write by that stream now. A storage freed while a side-stream copy
   that uses it is not ordered before its stream (the compute stream's pool) is reported: the
   allocator would hand the block to the next compute op while the copy still runs — unless
   ``record_stream(tensor, stream)`` was called, which (as on CUDA) defers reuse until that
   stream's work is done; the model keeps such a storage alive until then.
4. Host (pinned) buffers are exempt from 1 and 3: the host allocator records copies itself; 2
   still applies, which is rule 4 of Note [Stream protocol].

Side-stream work runs only when something forces it — the compute stream or the host waiting on
an event recorded after it, another stream's queued wait being forced — and never earlier; and
it reads its source and writes its destination then, so a source modified before the copy ran
gives wrong numbers too. Two legal schedules of a real GPU are played: ``"late"`` (a side stream
runs only what is forced) and ``"early"`` (when anything is forced, every other side stream
first runs all it has, so copies on different streams land in the other order). Memory from
:meth:`StreamDouble.empty` is POISON until a copy lands in it; a copy whose source was freed
before it ran writes POISON.

Use: ``with DoubleFactory("late") as factory: ...`` — it enters the compute stream's clock and
makes every runtime built inside get a double (``override_stream_ops``); ``factory.violations``
and ``factory.drain()`` read what the whole run did. (``with override_stream_ops(factory):``
works too: the clock then starts with the first runtime built.) ``log`` records every record, wait and
copy; ``host_syncs`` counts every time the host waited.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode as _current_dispatch_mode

from lightning_swap.core.engine.streams import StreamOps, override_stream_ops

POISON = 0xFF


def _merge(into: dict, other: dict) -> None:
    for stream, position in other.items():
        if into.get(stream, -1) < position:
            into[stream] = position


class FakeStream:
    """A side stream: a queue of ``("wait", event)`` and ``("copy", dst_ref, src_ref, poison)``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: list[tuple] = []
        self.executed = 0
        #: Note [Strict stream model]: stream -> position the work queued from now on follows.
        self.vc: dict[Any, int] = {}

    @property
    def position(self) -> int:
        return len(self.queue)

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    __slots__ = ("stream", "position", "time", "vc")

    def __init__(self, stream: Any, position: int, when: Optional[float], vc: Optional[dict] = None) -> None:
        self.stream = stream
        self.position = position  # work of ``stream`` that must have run
        self.time = when
        self.vc = dict(vc or {})
        self.vc[stream] = position


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


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a view can reach: ``[lo, hi)``."""
    size = t.element_size()
    lo = t.storage_offset() * size
    if t.numel() == 0:
        return lo, lo
    reach = 1 + sum((n - 1) * abs(st) for n, st in zip(t.size(), t.stride()))
    return lo, lo + reach * size


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class _Uses:
    """Side-stream copies that touched one storage: ``(stream, "r"|"w", lo, hi) -> newest
    position``, by the byte range touched (pieces of one host slab are separate memory)."""

    __slots__ = ("ref", "device", "pool", "last", "recorded", "kept")

    def __init__(self, ref: weakref.ref, device: bool) -> None:
        self.ref = ref
        self.device = device
        self.pool: Optional[FakeStream] = None  # the stream whose pool the block goes back to; None: compute
        self.last: dict[tuple[Any, str, int, int], int] = {}
        self.recorded: set = set()  # streams named by record_stream
        self.kept: Optional[torch.UntypedStorage] = None


# -- the compute stream ------------------------------------------------------------------------
_SCHEMAS: dict[Any, Any] = {}


def _schema(func: Any) -> tuple[list[tuple[str, Optional[str]]], list[bool]]:
    """Per argument, ``"r"`` (read), ``"w"`` (written in place) or ``None`` (aliased: a view, no
    access); per return, whether it is fresh memory (written by the op)."""
    cached = _SCHEMAS.get(func)
    if cached is None:
        try:
            schema = func._schema
            args = [(a.name, None if a.alias_info is not None and not a.alias_info.is_write else ("w" if a.alias_info is not None else "r")) for a in schema.arguments]
            rets = [r.alias_info is None for r in schema.returns]
        except Exception:  # no schema: everything read, every output fresh
            args, rets = [], []
        cached = _SCHEMAS[func] = (args, rets)
    return cached


#: Ops whose schema marks ``self`` written although they change only its metadata (which storage,
#: offset, sizes and strides it views): the engine rebuilds saved tensors' views with ``set_``.
_METADATA_ONLY = frozenset({torch.ops.aten.set_, torch.ops.aten.as_strided_, torch.ops.aten.detach_})


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _storage(t: torch.Tensor) -> Optional[torch.UntypedStorage]:
    try:
        return t.untyped_storage()
    except Exception:  # no storage (sparse, nested): nothing a copy could share
        return None


class ComputeStream(TorchDispatchMode):
    """The compute stream: every aten op dispatched while it is entered is one tick of its work.
    Shared by the doubles of one :class:`DoubleFactory` (one device, one compute stream)."""

    name = "compute"

    def __init__(self) -> None:
        super().__init__()
        self.ticks = 0
        self.active = False
        self.vc: dict[Any, int] = {}
        self.violations: list[str] = []
        #: Every side stream of the doubles sharing this compute stream (host observations order them all).
        self.sides: list[FakeStream] = []
        #: id(storage) -> [weakref, tick of the last compute write] (Note [Strict stream model], 1).
        self._written: dict[int, list] = {}
        #: id(storage) -> _Uses for storages side-stream copies touched (2, 3).
        self.uses: dict[int, _Uses] = {}
        self._paused = 0
        #: The stream ``empty`` allocates on (``use``); None: this one.
        self.current: Optional[FakeStream] = None

    @property
    def position(self) -> int:
        return self.ticks

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def paused(self):
        """Work that is not the compute stream's (a side-stream copy running, the model's own
        bookkeeping): not counted, not checked."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        if self.current is not None:
            # On CUDA this kernel would run on the side stream: work the model does not place.
            self.violations.append(f"compute: {func} issued inside use({self.current.name}); the model runs only copies on side streams")
        self.ticks += 1
        out = func(*args, **kwargs)
        if func.overloadpacket in _METADATA_ONLY:
            return out  # re-points a tensor at a storage: no byte is read or written
        arg_kinds, fresh = _schema(func)
        accesses = []
        for i, value in enumerate(args):
            kind = arg_kinds[i][1] if i < len(arg_kinds) else "r"
            if kind is not None:
                accesses += [(t, kind) for t in _tensors(value)]
        names = dict(arg_kinds)
        for name, value in kwargs.items():
            kind = names.get(name, "r")
            if kind is not None:
                accesses += [(t, kind) for t in _tensors(value)]
        outs = out if isinstance(out, (list, tuple)) and len(fresh) != 1 else (out,)
        for i, value in enumerate(outs):
            if not fresh or (fresh[i] if i < len(fresh) else True):
                accesses += [(t, "w") for t in _tensors(value)]
        for t, kind in accesses:
            self._access(t, kind, func)
        return out

    def _access(self, t: torch.Tensor, kind: str, func: Any) -> None:
        storage = _storage(t)
        if storage is None:
            return
        key = id(storage)
        uses = self.uses.get(key)
        if uses is not None and uses.ref() is storage:
            span = _span(t)
            for (stream, side_kind, lo, hi), position in uses.last.items():
                if (kind == "w" or side_kind == "w") and self.vc.get(stream, -1) < position and _overlap(span, (lo, hi)):
                    self.violations.append(
                        f"compute: {func} {'wrote' if kind == 'w' else 'read'} memory a copy on {stream.name} "
                        f"{'writes' if side_kind == 'w' else 'reads'} without waiting for it"
                    )
        if kind == "w":
            self.wrote(storage, self.ticks)

    def wrote(self, storage: torch.UntypedStorage, tick: int) -> None:
        key = id(storage)
        entry = self._written.get(key)
        if entry is None or entry[0]() is not storage:
            written = self._written
            self._written[key] = [weakref.ref(storage, lambda _r, key=key: written.pop(key, None)), tick]
        else:
            entry[1] = tick

    def last_write(self, storage: torch.UntypedStorage) -> int:
        entry = self._written.get(id(storage))
        return entry[1] if entry is not None and entry[0]() is storage else -1

    def uses_of(self, storage: torch.UntypedStorage, device: bool) -> _Uses:
        key = id(storage)
        uses = self.uses.get(key)
        if uses is None or uses.ref() is not storage:
            registry = self.uses
            uses = _Uses(weakref.ref(storage, lambda _r, key=key: self._freed(registry.pop(key, None))), device)
            registry[key] = uses
        return uses

    def _freed(self, uses: Optional[_Uses]) -> None:
        """Note [Strict stream model], 3: the block goes back to the compute stream's pool now."""
        if uses is None or not uses.device:
            return
        pool = uses.pool if uses.pool is not None else self
        for (stream, kind, _, _), position in uses.last.items():
            if stream is not pool and pool.vc.get(stream, -1) < position and stream not in uses.recorded:
                self.violations.append(f"{pool.name}: memory a copy on {stream.name} uses was freed before the {pool.name} stream waited for the copy (and no record_stream)")

    def observed(self, vc: dict) -> None:
        """The host saw an event complete: everything queued from now on, anywhere, follows it."""
        _merge(self.vc, vc)
        for stream in self.sides:
            _merge(stream.vc, {s: p for s, p in vc.items() if s is not stream})


# -- the double ------------------------------------------------------------------------------
class StreamDouble(StreamOps):
    """The stream layer of one runtime. Build them with :class:`DoubleFactory` (which shares one
    compute stream among them and enters its clock); a double built alone gets its own compute
    stream, whose clock is not running: it then sees only side-stream hazards."""

    asynchronous = True

    def __init__(self, device: torch.device, *, mode: str = "late", compute: Optional[ComputeStream] = None) -> None:
        if mode not in ("late", "early"):
            raise ValueError(f"`mode` must be 'late' or 'early'; got {mode!r}.")
        self.device = device
        self.mode = mode
        self.compute = compute if compute is not None else ComputeStream()
        self.sides: list[FakeStream] = []
        self.log: list[tuple] = []
        self.host_syncs = 0
        self.violations: list[str] = []
        self.copies_done = 0
        self._forcing = False
        self._allocated: dict[int, weakref.ref] = {}  # storages of ``empty``: the device side of an h2d copy
        self._kept: list[_Uses] = []  # record_stream'd storages kept alive for their copies

    # -- the interface -------------------------------------------------------------------
    def compute_stream(self) -> ComputeStream:
        return self.compute

    def new_stream(self) -> FakeStream:
        stream = FakeStream(f"side{len(self.compute.sides)}")
        self.sides.append(stream)
        self.compute.sides.append(stream)
        return stream

    def record(self, stream: Any, *, timing: bool = False) -> FakeEvent:
        self.log.append(("record", stream.name))
        if stream is self.compute:
            return FakeEvent(stream, stream.position, time.perf_counter(), stream.vc)
        return FakeEvent(stream, stream.position, None, stream.vc)

    def wait(self, stream: Any, event: Optional[FakeEvent]) -> None:
        if event is None:
            return
        self.log.append(("wait", stream.name, event.stream.name))
        if stream is self.compute:
            self._force(event)
        else:
            stream.queue.append(("wait", event))
        _merge(stream.vc, {s: p for s, p in event.vc.items() if s is not stream})

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        self.log.append(("copy", stream.name, src.numel() * src.element_size()))
        if stream is self.compute:
            dst.copy_(src)
            return
        with self.compute.paused():
            poison = self._check_copy(dst, src, stream)
            stream.queue.append(("copy", _Ref(dst), _Ref(src), poison))

    def _check_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: FakeStream) -> bool:
        """Note [Strict stream model], 1 and 2; registers the copy's uses. True: poison."""
        compute = self.compute
        dst_storage, src_storage = dst.untyped_storage(), src.untyped_storage()
        ref = self._allocated.get(id(dst_storage))
        h2d = ref is not None and ref() is dst_storage
        device_storage = dst_storage if h2d else src_storage
        poison = False
        needed = compute.last_write(device_storage)
        if stream.vc.get(compute, -1) < needed:
            poison = True
            self.violations.append(
                f"{stream.name}: {'an h2d copy into a block' if h2d else 'a d2h copy of memory'} the compute stream "
                f"{'allocated' if h2d else 'wrote'} at tick {needed}, not ordered after it (ordered after {stream.vc.get(compute, -1)})"
            )
        position = stream.position + 1
        for t, storage, kind, device in ((dst, dst_storage, "w", h2d), (src, src_storage, "r", not h2d)):
            uses = compute.uses_of(storage, device)
            span = _span(t)
            for (other, other_kind, lo, hi), other_position in uses.last.items():
                if other is not stream and (kind == "w" or other_kind == "w") and stream.vc.get(other, -1) < other_position and _overlap(span, (lo, hi)):
                    poison = True
                    self.violations.append(f"{stream.name}: a copy touching memory a copy on {other.name} touches, not ordered after it")
            uses.last[(stream, kind, *span)] = position
        return poison

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """Note [Strict stream model], 3: a block of the current stream's pool, POISON until written."""
        side = self.compute.current
        if side is None:
            out = torch.full((nbytes,), POISON, dtype=torch.uint8, device=device)  # a compute write now
        else:
            with self.compute.paused():
                out = torch.full((nbytes,), POISON, dtype=torch.uint8, device=device)
                uses = self.compute.uses_of(out.untyped_storage(), True)
                uses.pool = side
                uses.last[(side, "w", 0, nbytes)] = side.position
        storage = out.untyped_storage()
        allocated = self._allocated
        allocated[id(storage)] = weakref.ref(storage, lambda _r, key=id(storage): allocated.pop(key, None))
        return out

    @contextlib.contextmanager
    def use(self, stream: Any):
        previous, self.compute.current = self.compute.current, (None if stream is self.compute else stream)
        try:
            yield
        finally:
            self.compute.current = previous

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        """``tensor.record_stream(stream)``: its block is reused only after the work ``stream`` has
        queued when it is freed (Note [Strict stream model], 3); kept alive until then."""
        with self.compute.paused():
            uses = self.compute.uses_of(tensor.untyped_storage(), True)
            uses.recorded.add(stream)
            uses.kept = tensor.untyped_storage()
            self._kept.append(uses)

    def done(self, event: Optional[FakeEvent]) -> bool:
        if event is None or event.stream is self.compute:
            return True
        if event.stream.executed >= event.position:
            self.compute.observed(event.vc)
            return True
        return False

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        return max(0.0, (end.time or 0.0) - (start.time or 0.0)) * 1e3

    def synchronize(self, event: Optional[FakeEvent]) -> None:
        self.host_syncs += 1
        self.log.append(("host-sync",))
        if event is not None:
            self._force(event)
            self.compute.observed(event.vc)

    # -- running queued work -----------------------------------------------------------------
    def _force(self, event: FakeEvent) -> None:
        if event.stream is self.compute or event.stream.executed >= event.position:
            return
        with self.compute.paused():
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
                self._copy(stream, op[1], op[2], op[3])
        if self._kept:
            self._release_kept()

    def _copy(self, stream: FakeStream, dst_ref: _Ref, src_ref: _Ref, poison: bool) -> None:
        dst, src = dst_ref.get(), src_ref.get()
        self.copies_done += 1
        if dst is None:
            self.violations.append(f"{stream.name}: a copy landed in memory freed before it ran")
            return
        with torch.no_grad():
            if src is None:
                self.violations.append(f"{stream.name}: a copy read memory freed before it ran")
                poison = True
            if poison:
                dst.view(torch.uint8).fill_(POISON)
            else:
                dst.copy_(src)

    def _release_kept(self) -> None:
        """Storages kept for ``record_stream`` go once no stream has queued work on them left."""
        done = [u for u in self._kept if all(s.executed >= p for (s, *_), p in u.last.items())]
        self._kept = [u for u in self._kept if u not in done]
        for uses in done:
            uses.kept = None

    def drain(self) -> None:
        """Run everything still queued (a test's teardown): late copies are checked too."""
        for stream in self.sides:
            self._run(stream, len(stream.queue))

    @property
    def pending(self) -> int:
        return sum(len(s.queue) - s.executed for s in self.sides)


class DoubleFactory:
    """``with DoubleFactory(mode) as factory:`` — every runtime built inside gets its own double,
    all on one compute stream whose clock runs inside the block (Note [Strict stream model]);
    kept here so a test can read what happened across a whole run."""

    def __init__(self, mode: str = "late") -> None:
        self.mode = mode
        self.doubles: list[StreamDouble] = []
        self.compute = ComputeStream()
        self._override: Optional[contextlib.AbstractContextManager] = None

    def __call__(self, device: torch.device) -> StreamDouble:
        if not self.compute.active:
            # Used as ``with override_stream_ops(factory):`` (the older form): the clock starts
            # with the first runtime and stops at ``drain()`` or, at the latest, when the test
            # ends (tests/conftest.py), so compute work before the runtime is not counted.
            self.compute.__enter__()
            _LAZY.append(self)
        double = StreamDouble(device, mode=self.mode, compute=self.compute)
        self.doubles.append(double)
        return double

    def __enter__(self) -> "DoubleFactory":
        self.compute.__enter__()
        self._override = override_stream_ops(self)
        self._override.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._override is not None
        self._override.__exit__(*exc)
        self.compute.__exit__(*exc)

    @property
    def host_syncs(self) -> int:
        return sum(d.host_syncs for d in self.doubles)

    @property
    def violations(self) -> list[str]:
        return self.compute.violations + [v for d in self.doubles for v in d.violations]

    def drain(self) -> None:
        with self.compute.paused():
            for d in self.doubles:
                d.drain()
        if self in _LAZY and _current_dispatch_mode() is self.compute:
            _LAZY.remove(self)
            self.compute.__exit__(None, None, None)


#: Factories whose compute stream started with their first runtime (``DoubleFactory.__call__``).
_LAZY: list[DoubleFactory] = []


def stop_lazy_clocks() -> None:
    """Stop the clocks factories started on their own (a test's teardown), newest first."""
    while _LAZY:
        _LAZY.pop().compute.__exit__(None, None, None)
