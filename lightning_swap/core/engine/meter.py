"""Device memory meter: peak bytes alive on the training device over a window.

On CUDA it reads the caching allocator's peak statistics. On CPU, where the "device" and the
host are the same memory, it tracks live tensor storages itself: a ``TorchDispatchMode`` sees
every tensor an op produces and follows its storage with a weak reference until it is freed,
as ``torch.distributed._tools.mem_tracker`` does. Storages made inside
:func:`host_allocation` or marked with :func:`mark_host` (the offload host pool) are not
device memory and are not counted, nor are views of them.

Note [Storages resized in place]: FSDP2 allocates each unit's all-gather buffers once and
then frees and re-allocates their bytes every step with ``UntypedStorage.resize_`` (0 after
the unit's forward, the full size before its backward), a method the dispatcher never sees.
While a CPU meter is open, ``resize_`` is wrapped (as ``torch.distributed._tools.mem_tracker``
does) so that a tracked storage's bytes follow it, and a storage that grows from nothing on
the device starts being counted. A ``DTensor`` (FSDP2's sharded parameters, gradients and
optimizer state) is counted by its local shard, the bytes this process holds.

Note [Holds are tokens, not ids]: a storage held (:meth:`DeviceMemoryMeter.hold`) and then freed
stays counted until let go; once freed, its ``id`` is free for Python to give to the next
storage, which a later region may hold too. Holds keyed by ``id`` would merge the two: letting
go of the later region (its backward starts first) would release the earlier one's bytes as
well, at random (wherever the allocator reused the address), and a traced step's profile would
come out up to a storage lower in every backward window (about 1 run in 10; a plan chosen from
it measured 4.5% over its budget). So each hold is a token; a freed storage's bytes go when the
last token holding it is let go (a storage two regions saved stays counted until the earlier
region's backward, as it would stay alive if kept).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..compiled import force_eager
from ..tensors import local_tensor

__all__ = ["DeviceMemoryMeter", "host_allocation", "in_host_allocation", "mark_host"]

_local = threading.local()
# Storages that are host memory even though they sit on the CPU device (the offload host
# pool): id(storage) -> weak reference, so any view of them is recognised too.
_host_storages: dict[int, weakref.ref] = {}


def mark_host(t: torch.Tensor) -> None:
    """Declare ``t``'s storage host memory: the CPU meter never counts it, nor its views."""
    storage = t.untyped_storage()
    key = id(storage)
    _host_storages[key] = weakref.ref(storage, lambda _ref, key=key: _host_storages.pop(key, None))


#: CPU meters open now, told of every ``UntypedStorage.resize_`` (Note [Storages resized in place]).
_resize_listeners: list["DeviceMemoryMeter"] = []
_original_resize: list[Any] = []


def _resize_(storage: torch.UntypedStorage, size: int) -> Any:
    out = _original_resize[0](storage, size)
    for meter in list(_resize_listeners):
        meter._resized(storage)
    return out


def _listen_to_resizes(meter: "DeviceMemoryMeter") -> None:
    if not _resize_listeners:
        _original_resize.append(torch.UntypedStorage.resize_)
        torch.UntypedStorage.resize_ = _resize_
    _resize_listeners.append(meter)


def _stop_listening(meter: "DeviceMemoryMeter") -> None:
    if meter in _resize_listeners:
        _resize_listeners.remove(meter)
        if not _resize_listeners:
            torch.UntypedStorage.resize_ = _original_resize.pop()


def _is_host(storage: torch.UntypedStorage) -> bool:
    ref = _host_storages.get(id(storage))
    return ref is not None and ref() is storage


@contextlib.contextmanager
def host_allocation() -> Iterator[None]:
    """Tensors produced inside this block are host memory: the CPU meter ignores them."""
    previous = getattr(_local, "host", False)
    _local.host = True
    try:
        yield
    finally:
        _local.host = previous


def in_host_allocation() -> bool:
    """Inside :func:`host_allocation` (the offload engine's own copies to the host)."""
    return getattr(_local, "host", False)


class _StorageTracker(TorchDispatchMode):
    def __init__(self, meter: "DeviceMemoryMeter") -> None:
        super().__init__()
        self._meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not in_host_allocation():
            self._meter._observe(tree_leaves(out))
        return out


@dataclasses.dataclass(eq=False)
class _Held:
    """One held storage (Note [Holds are tokens, not ids]): its ``id`` while alive, the holds on
    it, and its bytes once freed."""

    key: int
    tokens: set = dataclasses.field(default_factory=set)
    freed_bytes: int = 0


class DeviceMemoryMeter:
    """Context manager measuring the peak bytes alive on ``device`` while it is open.

    Note [CPU meter baseline]: on CPU only storages the meter has seen are counted: those
    produced by ops inside the window, and those handed to :meth:`track` (parameters,
    gradients, optimizer state, the batch). On CUDA the allocator counts everything, so the
    caller should track the same things to make the two comparable; tracking is a no-op there.
    """

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        # CPU tensors report ``cpu``, never ``cpu:N`` (Accelerate's multi-CPU device name).
        self.device = torch.device("cpu") if device.type == "cpu" else device
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        #: Note [Holds are tokens, not ids]: the held storages alive, by ``id``, and every hold
        #: by its token (:meth:`hold`); a hold outlives its storage's ``id``.
        self._holding: dict[int, _Held] = {}
        self._holds: dict[int, _Held] = {}
        self._tokens = itertools.count(1)
        self._current = 0
        self._peak = 0
        #: CPU: bytes of storages freed but still counted (held), and the peak without them.
        self._unheld = 0
        self._real_peak = 0
        self._mode: Optional[_StorageTracker] = None
        self._stance: Optional[Any] = None
        self._open = False
        #: Called with the bytes alive after every change the CPU tracker sees (timelines).
        self.listeners: list = []

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    # -- window -------------------------------------------------------------------------
    def __enter__(self) -> "DeviceMemoryMeter":
        if self._open:
            raise RuntimeError("DeviceMemoryMeter is already open")
        self._open = True
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._storages.clear()
            self._holding.clear()
            self._holds.clear()
            self._current = self._peak = self._unheld = self._real_peak = 0
            # Compiled code runs eagerly under the mode; say so to Dynamo, or fullgraph=True raises.
            self._stance = force_eager()
            self._mode = _StorageTracker(self)
            self._mode.__enter__()
            _listen_to_resizes(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.is_cuda:
            # One read of the allocator's statistics (each read builds the whole table).
            stats = torch.cuda.memory_stats(self.device)
            self._peak = stats.get("allocated_bytes.all.peak", 0)
            self._current = stats.get("allocated_bytes.all.current", 0)
        else:
            assert self._mode is not None
            _stop_listening(self)
            self._mode.__exit__(*exc)
            self._mode = None
            if self._stance is not None:
                self._stance.__exit__(None, None, None)
                self._stance = None
            # Drop the weak references so their callbacks cannot touch a closed meter.
            self._storages.clear()
        self._open = False

    # -- readings -----------------------------------------------------------------------
    @property
    def peak_bytes(self) -> int:
        if self.is_cuda and self._open:
            return torch.cuda.max_memory_allocated(self.device)
        return self._peak

    @property
    def current_bytes(self) -> int:
        if self.is_cuda and self._open:
            return torch.cuda.memory_allocated(self.device)
        return self._current

    def reset_peak(self, *, after_next_change: bool = False) -> None:
        """Restart the peak from the bytes alive now; ``after_next_change`` (CPU): from the bytes
        alive after the next allocation or free, leaving out the level now (a window that opens
        while its caller still holds what it is about to drop: Note [The tail opens holding the
        last input] in ``measure/trace.py``)."""
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._peak = 0 if after_next_change and not self.is_cuda else self._current
        self._real_peak = 0 if after_next_change and not self.is_cuda else self._current - self._unheld

    @property
    def real_bytes(self) -> int:
        """CPU: the bytes alive now, the storages held once freed (:meth:`hold`) left out."""
        return self._current - self._unheld

    @property
    def real_peak_bytes(self) -> int:
        """CPU: the peak of :attr:`real_bytes` since the last :meth:`reset_peak`."""
        return self._real_peak

    def hold(self, storage: torch.UntypedStorage) -> Optional[int]:
        """CPU: count ``storage`` as alive once freed too, until :meth:`let_go` names the token
        returned (a storage a plan moved to the host, counted as if kept: Note [Regions held as
        kept] in ``measure/trace.py``); ``None`` where nothing is held (CUDA, a closed meter)."""
        if self.is_cuda or not self._open:
            return None
        token = next(self._tokens)
        held = self._holding.setdefault(id(storage), _Held(id(storage)))
        held.tokens.add(token)
        self._holds[token] = held
        return token

    def let_go(self, tokens: Iterable[int]) -> None:
        """Drop these holds (tokens from :meth:`hold`): a freed storage's bytes go once no hold
        on it is left (Note [Holds are tokens, not ids])."""
        for token in tokens:
            held = self._holds.pop(token, None)
            if held is None:
                continue
            held.tokens.discard(token)
            if held.tokens:
                continue
            if held.freed_bytes:
                self._unheld -= held.freed_bytes
                self._changed(-held.freed_bytes)
            elif self._holding.get(held.key) is held:  # still alive: no longer held
                del self._holding[held.key]

    # -- CPU tracking -------------------------------------------------------------------
    def track(self, tensors: Iterable[Any]) -> None:
        """Count these tensors' storages as alive from now until they are freed."""
        if not self.is_cuda and self._open:
            self._observe(tensors)

    def _observe(self, leaves: Iterable[Any]) -> None:
        for t in leaves:
            if not isinstance(t, torch.Tensor):
                continue
            t = local_tensor(t)
            if t.device != self.device or t.layout != torch.strided:
                continue
            try:
                storage = t.untyped_storage()
            except (NotImplementedError, RuntimeError):  # tensors without storage
                continue
            self._add(storage)

    def _add(self, storage: torch.UntypedStorage) -> None:
        if _is_host(storage):
            return
        key = id(storage)
        entry = self._storages.get(key)
        if entry is not None and entry[0]() is storage:
            return
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        ref = weakref.ref(storage, self._make_release(key))
        self._storages[key] = (ref, nbytes)
        self._changed(nbytes)

    def _changed(self, delta: int) -> None:
        self._current += delta
        if self._current > self._peak:
            self._peak = self._current
        self._real_peak = max(self._real_peak, self._current - self._unheld)
        for listener in self.listeners:
            listener(self._current)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """Note [Storages resized in place]."""
        key = id(storage)
        entry = self._storages.get(key)
        if entry is None or entry[0]() is not storage:
            if storage.device == self.device and not in_host_allocation():
                self._add(storage)  # grown from nothing on the device: an allocation
            return
        nbytes = storage.nbytes()
        self._storages[key] = (entry[0], nbytes)
        self._changed(nbytes - entry[1])

    def _make_release(self, key: int):
        def release(ref: weakref.ref) -> None:
            entry = self._storages.get(key)
            if entry is not None and entry[0] is ref:
                del self._storages[key]
                held = self._holding.pop(key, None)
                if held is not None:  # counted until every hold is let go (Note [Holds are tokens, not ids])
                    held.freed_bytes = entry[1]
                    self._unheld += entry[1]
                    return
                self._current -= entry[1]
                self._peak = max(self._peak, self._current)  # a peak restarted after the next change
                for listener in self.listeners:
                    listener(self._current)

        return release
