"""The state a segment's forward saw, restored for its recomputation: every buffer as it was when
the forward entered the segment, the modules' training flags (Note [Recompute leaves buffers
alone] in ``recompute.py``), and Python's and numpy's global RNGs (torch's RNG and the autocast
state are ``torch.utils.checkpoint``'s).

Note [Buffers are kept from before they change]: a copy of a buffer's value at a call's entry
is needed only where something changes that buffer before the call's recomputation: the call
itself (spectral norm's power iteration, an observer's moving average, a counter), a later
call of the same module (the training pass after an ``eval()`` pass), or another segment's call
of a module both share (every block calls it, the last one updates its buffer). So each call
copies at entry the buffers its segment's calls in this mode were seen to change, and gives the
same copy, taken now, to each earlier call still waiting for its recomputation that has none
(the value now is that call's entry value if the buffer did not move since). A call in a mode
not seen before copies every buffer, watches which ones change (their version counter moves,
the module puts another tensor in their place, or an op writes into their storage: a write
through ``.data``, which no version counter sees) and keeps those; the others it holds until
its recomputation (BatchNorm statistics aside: a first step holds a copy of its recomputed
segments' buffers through its backward). A recomputation checks the buffers it has no copy of:
one another segment replaced is read from the tensor its forward saw (unchanged: free); one
written in place is rewound from the held copy, and the segment's next calls copy it first. The
copies live until the call's recomputation can no longer run (its graph is freed), so a second
backward restores them again. What a recomputation cannot rewind (a buffer written in place
with no copy held: first changed after the first calls, by another segment or by a call whose
mode was learned without that change, one that depends on a value) it runs on the changed
value, put back after it; the buffer is logged (once) and copied by the next calls, and the
segment is refused for recomputation (Note [Refused actions] in ``measure/model_profile.py``).
A write through ``.data`` by another segment moves nothing and is not seen.

Note [Python's and numpy's RNGs]: a forward that draws from Python's ``random`` or numpy's
global RNG (a random scale, a layer skipped at random) would draw again when recomputed: other
values, or another branch (checkpoint's ``CheckpointError``). So each call reads both states at
entry and exit (numpy's where ``numpy.random`` is imported), and the recomputation of a call
whose forward moved one sets it to its entry state and back afterwards: each RNG advances once,
as without recomputation. The reads cost about 70 us per call on a slow CPU, numpy's mostly (0.3%
of a GPT-2-small block's forward there); setting both around a recomputation about 120 us. Like
any Python object the forward mutates (an int counter), a ``random.Random`` or
``numpy.random.Generator`` it holds is not restored: torch's checkpoint's limit.
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import SyncBatchNorm, _BatchNorm, _NormBase
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["ForwardState", "written_args"]

log = logging.getLogger(__name__)


def written_args(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op writes into (its schema's mutable arguments)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        written.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return written


def _plain_batch_norm(m: nn.Module) -> bool:
    """A BatchNorm whose ``forward`` is torch's, which reads ``momentum`` and ``num_batches_tracked``
    as Note [Recompute leaves buffers alone] needs."""
    return isinstance(m, _BatchNorm) and type(m).forward in (_BatchNorm.forward, SyncBatchNorm.forward)


def _host_rngs() -> tuple[Any, Any]:
    """Python's and numpy's global RNG states (Note [Python's and numpy's RNGs])."""
    np_random = sys.modules.get("numpy.random")
    return random.getstate(), np_random.get_state() if np_random is not None else None


def _drawn(entry: tuple[Any, Any]) -> tuple[Any, Any]:
    """Of the states ``entry`` (a forward's), those of the RNGs the forward drew from, else None."""
    python, numpy = _host_rngs()
    # numpy's legacy state: (name, key array, pos, has_gauss, cached_gaussian)
    same = entry[1] is None or (entry[1][2:] == numpy[2:] and (entry[1][1] == numpy[1]).all())
    return (None if entry[0] == python else entry[0]), (None if same else entry[1])


def _set_rngs(states: tuple[Any, Any]) -> tuple[Any, Any]:
    """Python's and numpy's RNG set to ``states`` (None: left alone); returns what they were."""
    python, numpy = states
    np_random = sys.modules.get("numpy.random")
    before = random.getstate() if python is not None else None, np_random.get_state() if numpy is not None else None
    if python is not None:
        random.setstate(python)
    if numpy is not None:
        np_random.set_state(numpy)
    return before


def _assign(buffer: torch.Tensor, value: torch.Tensor) -> None:
    if buffer.shape != value.shape:  # an observer sizes its statistics on its first call
        buffer.resize_(value.shape)
    buffer.copy_(value)


class _Call:
    """One checkpointed call of a segment: its modules' training flags, and per buffer slot the
    tensor there, its version and (``saved``) its value at the call's entry; a call that was
    learning ``held`` the others' values too; ``rngs``: Note [Python's and numpy's RNGs]."""

    __slots__ = ("flags", "objects", "versions", "saved", "held", "trick", "rngs", "__weakref__")

    def __init__(self) -> None:
        self.flags: tuple[bool, ...] = ()
        self.objects: list[Optional[torch.Tensor]] = []
        self.versions: list[int] = []
        self.saved: dict[int, torch.Tensor] = {}
        self.held: dict[int, torch.Tensor] = {}
        self.rngs: tuple[Any, Any] = (None, None)
        #: Slots of torch's BatchNorms in training mode: never copied (Note [Recompute leaves buffers alone]).
        self.trick: set[int] = set()


class _Writes(TorchDispatchMode):
    """The buffer slots whose storage an op writes into (``.data`` writes included); it only looks."""

    def __init__(self, storages: dict[int, list[int]]) -> None:
        super().__init__()
        self._storages = storages
        self.slots: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in written_args(func, args, kwargs):
            if t.layout == torch.strided:
                self.slots.update(self._storages.get(t.untyped_storage().data_ptr(), ()))
        return func(*args, **kwargs)


#: In place of a copy: the value the call's forward saw is lost (Note [Buffers are kept from before
#: they change]), so the recomputation runs on the value now, which is put back after it.
_AFTER: Any = object()


def _copy(copies: dict[int, torch.Tensor], objects: list[Optional[torch.Tensor]], i: int) -> torch.Tensor:
    """Slot ``i``'s value now, copied once for every call that needs it (copies are only read)."""
    if i not in copies:
        copies[i] = objects[i].clone()  # type: ignore[union-attr]
    return copies[i]


class ForwardState:
    """Note [Buffers are kept from before they change] and Note [Recompute leaves buffers alone]
    (in ``recompute.py``), for one wrapped segment ``module`` named ``name``."""

    def __init__(self, module: nn.Module, name: str, on_refuse: Optional[Callable[[str, str], None]] = None) -> None:
        named = list(module.named_modules())
        self._name, self._on_refuse = name, on_refuse
        self._modules = [m for _, m in named]
        self._slots = [(m, b) for _, m in named for b in m._buffers]
        self._slot_names = [f"{p}.{b}" if p else b for p, m in named for b in m._buffers]
        own: dict[int, list[int]] = {}
        for i, (m, _) in enumerate(self._slots):
            own.setdefault(id(m), []).append(i)
        #: (position, its slots, torch's BatchNorm?) of each norm layer that may track statistics.
        self._norms = [(k, own.get(id(m), []), _plain_batch_norm(m)) for k, m in enumerate(self._modules) if isinstance(m, _NormBase)]
        self._batch_norms = [m for m in self._modules if _plain_batch_norm(m)]
        #: training flags -> the slots a call with them was seen to change (learned per mode).
        self._known: dict[tuple[bool, ...], set[int]] = {}
        self._pending: list[weakref.ref[_Call]] = []
        self._logged: set[int] = set()

    def call(self, eager: bool) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """The contexts of one checkpointed call, made when it starts: around its forward (``eager``:
        no compiled code runs in it, so a dispatch mode may watch it) and around its recomputation."""
        call = _Call()
        return (lambda: self.forward(call, eager)), (lambda: self.recompute(call))

    def _flags(self) -> tuple[bool, ...]:
        return tuple(m.training for m in self._modules)

    def _objects(self) -> list[Optional[torch.Tensor]]:
        return [m._buffers.get(b) for m, b in self._slots]

    def _statistics(self, flags: tuple[bool, ...]) -> tuple[set[int], set[int]]:
        """The slots of the norm layers that update statistics under ``flags``: torch's BatchNorms,
        whose recomputation updates them by a factor of 0 instead of copying them (Note [Recompute
        leaves buffers alone]), and the others (``native_batch_norm`` moves no version counter)."""
        plain: set[int] = set()
        others: set[int] = set()
        for k, slots, is_plain in self._norms:
            if flags[k] and self._modules[k].track_running_stats:
                (plain if is_plain else others).update(slots)
        return plain, others

    def _changing(self, flags: tuple[bool, ...]) -> tuple[set[int], set[int]]:
        """The slots a call with ``flags`` may change (all of them in a mode not seen yet), and of
        those the statistics of torch's BatchNorms in training mode."""
        known = self._known.get(flags)
        plain, others = self._statistics(flags)
        return (set(range(len(self._slots))) if known is None else known | others) | plain, plain

    def _protect(self, changing: set[int], objects: list[Optional[torch.Tensor]], copies: dict[int, torch.Tensor]) -> None:
        """Each earlier call still able to recompute gets the value now of the buffers about to
        change that it has no copy of, if they did not move since its entry (its held copy else)."""
        alive = []
        for ref in self._pending:
            earlier = ref()
            if earlier is None:
                continue
            alive.append(ref)
            for i in changing - earlier.saved.keys() - earlier.trick:
                if i in earlier.held:
                    earlier.saved[i] = earlier.held.pop(i)
                elif objects[i] is not None and objects[i] is earlier.objects[i] and objects[i]._version == earlier.versions[i]:
                    earlier.saved[i] = _copy(copies, objects, i)
        self._pending = alive

    def unchecked(self, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A call that is not checkpointed (no grad): it may change buffers earlier calls read."""
        if self._pending and self._slots:
            with torch.no_grad():
                self._protect(self._changing(self._flags())[0], self._objects(), {})
        return forward(*args, **kwargs)

    @contextlib.contextmanager
    def forward(self, call: _Call, eager: bool) -> Iterator[None]:
        call.flags, rngs = self._flags(), _host_rngs()
        if not self._slots:
            yield
            call.rngs = _drawn(rngs)
            return
        call.objects = self._objects()
        call.versions = [t._version if t is not None else -1 for t in call.objects]
        learning = call.flags not in self._known
        changing, call.trick = self._changing(call.flags)
        copies: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            self._protect(changing, call.objects, copies)
            call.saved = {i: _copy(copies, call.objects, i) for i in changing - call.trick if call.objects[i] is not None}
        watch = _Writes(self._storages(call.objects)) if learning and eager else None
        with watch if watch is not None else contextlib.nullcontext():
            yield
        call.rngs = _drawn(rngs)
        self._leave(call, learning, watch.slots if watch is not None else set())

    @staticmethod
    def _storages(objects: list[Optional[torch.Tensor]]) -> dict[int, list[int]]:
        found: dict[int, list[int]] = {}
        for i, t in enumerate(objects):
            if t is not None and t.layout == torch.strided and t.untyped_storage().nbytes() > 0:
                found.setdefault(t.untyped_storage().data_ptr(), []).append(i)
        return found

    def _leave(self, call: _Call, learning: bool, written: set[int]) -> None:
        """After the forward: learn what it changed; a call that was learning copies those, and holds
        the other copies until its recomputation."""
        objects = self._objects()
        moved = {i for i, t in enumerate(objects) if t is not call.objects[i] or (t is not None and t._version != call.versions[i])}
        changed = (moved | written | self._statistics(call.flags)[1]) - call.trick
        for i in changed - call.saved.keys():
            if call.objects[i] is not None and objects[i] is not call.objects[i]:
                call.saved[i] = call.objects[i]  # put in place of another tensor: the one it saw is its value
                continue
            call.saved[i] = _AFTER  # its value now is put back after the recomputation, at least
            self._lost(i, "in a mode (training flags) in which its earlier calls did not change it")
        self._known.setdefault(call.flags, set()).update(changed)
        if learning:  # another segment may change the others before the recomputation: held until then
            call.held = {i: v for i, v in call.saved.items() if i not in changed}
            call.saved = {i: v for i, v in call.saved.items() if i in changed}
        self._pending.append(weakref.ref(call))

    def _set_flags(self, flags: tuple[bool, ...]) -> tuple[bool, ...]:
        before = self._flags()
        for m, now, then in zip(self._modules, before, flags):
            if now != then:
                m.training = then
        return before

    def _rewind(self, i: int, value: torch.Tensor, call: _Call) -> tuple[int, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Slot ``i`` back to the tensor and value the call's forward saw; returns what undoes it."""
        m, b = self._slots[i]
        now, then = m._buffers.get(b), call.objects[i]
        if value is _AFTER:
            return i, now, now.clone() if now is not None else None
        kept = now.clone() if now is then and value is not then else None  # type: ignore[union-attr]
        m._buffers[b] = then
        if value is not then:
            _assign(then, value)  # type: ignore[arg-type]
        return i, now, kept

    def _moved(self, call: _Call) -> dict[int, Any]:
        """The slots the call kept no copy of that moved since its entry (another segment changed
        them), with the value its forward saw where it is known (Note [Buffers are kept from
        before they change])."""
        found: dict[int, Any] = {}
        for i, (m, b) in enumerate(self._slots):
            then, now = call.objects[i], m._buffers.get(b)
            if i in call.saved or i in call.trick or (now is then and (then is None or then._version == call.versions[i])):
                continue
            if then is None or then._version == call.versions[i]:
                found[i] = then  # put in place of another tensor: the one it saw is unchanged
                continue
            self._known.setdefault(call.flags, set()).add(i)  # the next calls copy it first
            if i in call.held:
                found[i] = call.held[i]
            else:
                self._lost(i, "outside the segment before its recomputation")
        return found

    def _lost(self, i: int, where: str) -> None:
        """A change to slot ``i`` that this call's recomputation cannot rewind: logged once, and the
        segment refused for recomputation (Note [Refused actions] in ``measure/model_profile.py``)."""
        if i not in self._logged:
            self._logged.add(i)
            why = f"buffer {self._slot_names[i]!r} changed {where}"
            log.warning("lightning-swap: segment %r: %s; this call's recomputation sees the changed value, later calls "
                        "copy it first (Note [Buffers are kept from before they change])", self._name, why)
            if self._on_refuse is not None:
                self._on_refuse(self._name, why)

    @contextlib.contextmanager
    def recompute(self, call: _Call) -> Iterator[None]:
        """Around the call's recomputation: its forward's training flags, buffers and host RNGs,
        and torch's BatchNorms updating their statistics by 0; afterwards everything as it was before."""
        flags, rngs = self._set_flags(call.flags), _set_rngs(call.rngs)
        try:
            with torch.no_grad():
                rewind = {**call.saved, **self._moved(call)}
                undo = [self._rewind(i, value, call) for i, value in rewind.items()]
            frozen = [(m, m.momentum, m.num_batches_tracked) for m in self._batch_norms if m.training and m.track_running_stats]
            for m, _, _ in frozen:
                m.momentum = 0.0
                m.num_batches_tracked = None
            try:
                yield
            finally:
                for m, momentum, count in frozen:
                    m.momentum = momentum
                    m.num_batches_tracked = count
                with torch.no_grad():
                    for i, now, kept in undo:
                        m, b = self._slots[i]
                        m._buffers[b] = now
                        if kept is not None:
                            _assign(now, kept)  # type: ignore[arg-type]
        finally:
            self._set_flags(flags)
            _set_rngs(rngs)
