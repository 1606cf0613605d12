"""Recomputation of a segment (activation checkpointing) that is invisible to training.

Built on non-reentrant ``torch.utils.checkpoint`` (Chen et al. 2016), which restores the RNG
state (dropout masks repeat) and the autocast state for the recomputation; Python's and numpy's
RNGs are restored too (Note [Python's and numpy's RNGs] in ``forward_state.py``). ``SELECTIVE`` uses
``create_selective_checkpoint_contexts``: outputs of compute-heavy ops are saved, the rest is
recomputed.

Note [Recompute leaves buffers alone]: a recomputation reruns the segment against the state its
forward saw, and leaves every buffer as plain training leaves it (updated once). Plain
``torch.utils.checkpoint`` restores the RNG and autocast state only: it reruns the forward in
the modules' mode at backward time (a pass in ``eval()`` whose backward runs after
``model.train()``: other ops, checkpoint or selective refuse them) and against buffers the
forward already updated (spectral norm's power iteration, a quantization observer's moving
average, a call counter, an EMA written through ``.data``: other values, silently), then updates
them a second time. So each call records its modules' training flags, and copies the buffers it
or a later call changes from before they change (Note [Buffers are kept from before they change]
in ``forward_state.py``); its recomputation runs with those flags and values, and then puts back
the flags and the buffers' values of that moment.
BatchNorm's running statistics (and ``num_batches_tracked``) are the one exception: they are not
copied, since the forward reads them only in ``eval()``. During the recomputation each
BatchNorm layer of the segment that tracks statistics in training mode runs with ``momentum``
0 and no ``num_batches_tracked``: the batch is not counted and the running statistics are
updated by a factor of 0 (``r * 1 + 0 * m``), which leaves them equal. The layer is still given
its running statistics, so the recomputation saves exactly the tensors the forward saved (with
none, ``native_batch_norm`` saves two fewer and checkpoint refuses the mismatch), and since
training mode normalises with the batch's own statistics its output is the same. No kernel is
launched to save or restore anything.
Under ``torch.compile`` the segment's graph specialises on ``momentum`` and on
``num_batches_tracked`` being ``None``, so the recomputation runs a second graph (compiled once per
block class, then reused) with the same effect (``tests/runtime/test_compile.py`` checks the statistics).
Norm layers whose ``forward`` is not torch's BatchNorm one are copied as other buffers are; they
are listed by type, since ``native_batch_norm`` writes statistics without bumping the version.

Note [Checkpointed segments must not modify their input]: the recomputation reruns the
segment on its saved input; if the forward changed that input in place (DenseNet's stem
``relu0`` made a segment of its own, a block whose first op is ``relu_`` on its argument), the
rerun would see the changed values. A segment's first checkpointed call (per wrapper) therefore
runs under :class:`_InPlaceWatch` (eagerly, compiled or not, and so does its recomputation: a
compiled graph saves other tensors than the eager ops, which checkpoint refuses), a dispatch mode that looks at every op writing into a tensor:
when one is about to write into the storage of an input checkpoint saved, the input is copied
first and the recomputation reruns on the copy, so the step is exact. The segment is then
reported (``on_refuse``: ``auto`` plans no recomputation for it) and warned about once, naming the
op and the module; its later calls copy their inputs when checkpoint saves them (the copy is what
the recomputation needs; it costs the input's bytes until the segment's backward). The
recomputation writes into its input again, so it runs on a copy of what was held (the input's
bytes once more, while it runs): a second backward reruns on the value the first saw, and no
offload copy still reading the held tensor is written under; for the same reason the first call
gives its input to the offload hooks only when its forward ends. A write the
watch cannot see (inside a compiled kernel) still moves the input's version counter: that
raises :class:`InputMutatedError`, naming the segment and the op, rather than train wrongly.

Note [A recomputed segment fills no cache]: a Hugging Face layer given a key/value cache
(``transformers``' ``Cache``: ``use_cache=True``, the default of many configs, in training too)
appends its keys to it in forward, and again when the recomputation reruns it: the cache then
holds the keys twice, the layer reads a longer cache than it did (and, from transformers 5.24,
slices it), so the recomputation runs other ops than the forward (``selective`` fails with
"encountered during backward but not found in storage") and the cache is wrong afterwards. So
a recomputed segment is called without its cache argument (``None`` in its place), in forward
and in the recomputation, as transformers' own gradient checkpointing does (``cache=None``
under ``GradientCheckpointingLayer``): training does not read it. Logged once per segment.

Note [Selective never replays a mutated tensor]: ``SELECTIVE`` caches the outputs of
compute-heavy ops (``create_selective_checkpoint_contexts``) by reference; torch refuses at
backward time (``Tensor cached during selective activation checkpoint has been mutated``) when
a later op of the forward wrote into one: EfficientNet's squeeze-excitation runs
``SiLU(inplace=True)`` on a convolution's output, a residual ``out += x`` adds into one. The
recomputation would need the value from before the write, which no longer exists, so such an
entry is recomputed instead: when the forward ends and again when the recomputation starts
(:class:`_DropMutated`), every cached entry whose version moved since it was cached becomes
torch's recompute marker, and the op runs again on recomputed inputs, as plain recomputation
would. Ops that write into a buffer given to
them (``mm.out``: the ``out=`` overloads) are not cached at all: the buffer belongs to the caller.
Entries never mutated are replayed as before, so the policy is narrowed per op and per call.

Note [A second backward through selective]: torch marks a cached entry consumed once a
recomputation replayed it, so that its memory goes with the first backward; a second backward
over the segment's retained graph (``retain_graph=True``; a gradient penalty's
``create_graph=True``) recomputes the segment again, and torch then refuses ("Trying to
backward an extra time"). So when a recomputation starts, every consumed entry becomes the
recompute marker (:class:`_DropMutated`): the op runs again on recomputed inputs, as under
``RECOMPUTE``, against the same state (Note [Recompute leaves buffers alone]), and gives the
values it gave the forward. The first backward keeps its memory behaviour; no action is refused.

Note [Selective under compile]: a segment whose forward is compiled (regional, or inside a
compiled model) runs, under Inductor, generated code that calls a few ops through the
dispatcher (matmuls, convolutions) and reuses their output buffers for later kernels that write
through raw pointers, without moving the version counter: a cached output could change under
the cache with nothing to detect it. So where the eager checkpoint recomputes a compiled segment
(Note [Recomputation inside the compiled graph] in ``compiled.py`` says where: a module with
buffers, an older torch), its ``SELECTIVE`` caches nothing and recomputes the whole segment, as
``RECOMPUTE`` does (logged once per segment; the planner is told through ``on_refuse``, so
``auto`` does not pick ``selective`` for it). Elsewhere a compiled segment's ``SELECTIVE`` runs
inside its graph, where no cache exists: the partitioner saves the chosen outputs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from torch.utils._pytree import tree_leaves

from ..actions import Action
from ..compiled import compile_with, eager_stance
from ..errors import InputMutatedError
from .forward_state import ForwardState, written_args
from .streams import StreamOps, Timing

__all__ = ["RecomputeTimer", "checkpointed", "compute_heavy_ops", "written_args"]

log = logging.getLogger(__name__)

try:  # torch >= 2.4
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
except ImportError:  # pragma: no cover - older torch
    CheckpointPolicy = None
    create_selective_checkpoint_contexts = None

_HEAVY_OP_NAMES = (
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "cudnn_convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward", "_efficient_attention_forward",
)


@functools.lru_cache(maxsize=1)
def compute_heavy_ops() -> frozenset:
    """The aten ops whose outputs ``SELECTIVE`` saves rather than recomputes."""
    ops = set()
    for name in _HEAVY_OP_NAMES:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.update(getattr(packet, o) for o in packet.overloads())
    # ``out=`` overloads write into a buffer their caller owns (Note [Selective never replays a
    # mutated tensor]).
    return frozenset(op for op in ops if not op._schema.is_mutable)


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    if op in compute_heavy_ops():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def op_call(op: str, k: int) -> str:
    """The name of op ``op``'s ``k``-th call in a segment's forward (Note [Selective saves per call]
    in ``measure/profiler.py``)."""
    return f"{op}#{k}"


def _measured_policy(save_ops: frozenset) -> Callable[..., Any]:
    """Note [Who decides under compile]: the plan's op-level choice (Note [Which ops selective
    recomputation saves] in ``measure/profiler.py``) saves the outputs of ``save_ops`` and
    recomputes every other op. Both are ``MUST_``: the plan priced exactly these bytes and
    milliseconds, and the min-cut partitioner of ``torch.compile`` (and its
    ``activation_memory_budget``) may overrule ``PREFER_`` tags. The plan decides inside the
    segments it recomputes, eager or compiled (Note [Recomputation inside the compiled graph] in
    ``compiled.py``: the policy tags the compiled graph's ops), the partitioner inside the
    compiled segments the plan keeps; a compiled segment the eager checkpoint recomputes caches
    nothing (Note [Selective under compile]). An
    ``out=`` overload is never saved, whatever its name (Note [Selective never replays a
    mutated tensor]), and what a later op wrote into is dropped from the cache as for the
    compute-heavy rule (:class:`_DropMutated`).

    ``save_ops`` names calls (``op#k``, the ``k``-th call of ``op`` in the segment's forward:
    Note [Selective saves per call]) or ops (every call). Calls are counted apart in the forward
    and in the recomputation, which run the same ops in the same order; a new policy per
    checkpointed call (its contexts are made per call), so the counts start at 0 each time."""
    ops = frozenset(save_ops)
    calls: dict[tuple[bool, Any], int] = {}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        key = (bool(getattr(ctx, "is_recompute", False)), op)
        k = calls.get(key, 0)
        calls[key] = k + 1
        name = str(op)
        if (name in ops or op_call(name, k) in ops) and not op._schema.is_mutable:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_RECOMPUTE

    return policy


class RecomputeTimer:
    """Accumulates the time spent recomputing: timing events on the compute stream, read later
    (Note [Stream protocol] in ``streams.py``); wall clock on CPU. With ``segments`` set (a
    step whose segments are measured one by one), also each segment's own time and the bytes
    its recomputation brought back (the meter's bytes alive after it, less before it)."""

    def __init__(self, ops: StreamOps) -> None:
        self.ops = ops
        self.timing = Timing(ops)
        #: name -> [Timing, recomputed bytes], while a step's segments are measured; else None.
        self.segments: Optional[dict[str, list]] = None
        self.meter: Any = None

    @contextlib.contextmanager
    def measure(self, name: str = ""):
        segments = self.segments
        if segments is None:
            with self.timing.measure(self.ops.compute_stream()):
                yield
            return
        own = segments.setdefault(name, [Timing(self.ops), 0])
        before = self.meter.current_bytes if self.meter is not None else 0
        try:
            with self.timing.measure(self.ops.compute_stream()), own[0].measure(self.ops.compute_stream()):
                yield
        finally:  # checkpoint stops a recomputation early by raising through here
            if self.meter is not None:
                own[1] += max(0, self.meter.current_bytes - before)

    def take(self) -> Timing:
        """This step's timing (resolved later); the next step starts a new one."""
        timing, self.timing = self.timing, Timing(self.ops)
        return timing


class _Chain:
    """Enters context managers (or factories of them) in order when entered itself."""

    def __init__(self, *parts: Any) -> None:
        self._parts = parts
        self._stack: Optional[contextlib.ExitStack] = None

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        try:
            for part in self._parts:
                stack.enter_context(part() if callable(part) and not hasattr(part, "__enter__") else part)
        except BaseException:
            stack.close()
            raise
        self._stack = stack

    def __exit__(self, *exc: Any) -> Optional[bool]:
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc) if stack is not None else None


class _Named:
    """An error raised in a segment's checkpointed forward or recomputation (torch's, from deep
    inside checkpoint) carries a note naming the segment: every error about a segment names it."""

    def __init__(self, name: str, phase: str) -> None:
        self._note = f"lightning-swap: raised in the {phase} of segment {name!r}" if name else ""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Optional[BaseException], tb: Any) -> None:
        if exc is not None and self._note and hasattr(exc, "add_note") and self._note not in getattr(exc, "__notes__", ()):
            exc.add_note(self._note)


class _DropMutated:
    """Note [Selective never replays a mutated tensor]: turns every cache entry written into since
    it was cached into a recompute marker, when the forward ends (``at_exit``: the cache lets the
    written tensor go) and again when the recomputation starts, before torch's replaying mode
    (a write after the forward: the next segment's). Without the torch internals it reads
    (``_VersionWrapper``, ``_RECOMPUTE``; torch >= 2.4), the policy caches nothing
    (:func:`_selective_contexts`). When the recomputation starts, an entry an earlier one replayed
    (torch's ``_CONSUMED``) becomes a recompute marker too (Note [A second backward through
    selective])."""

    def __init__(self, storage: dict, *, at_exit: bool = False) -> None:
        self._storage = storage
        self._at_exit = at_exit

    def drop(self, consumed: Any = None) -> None:
        for entries in self._storage.values():
            for index, entry in list(entries.items()):
                leaves = tree_leaves(entry, is_leaf=lambda x: isinstance(x, _torch_checkpoint._VersionWrapper))
                if (consumed is not None and entry is consumed) or any(_written_since_cached(x) for x in leaves):
                    entries[index] = _torch_checkpoint._RECOMPUTE

    def __enter__(self) -> None:
        if not self._at_exit:
            self.drop(getattr(_torch_checkpoint, "_CONSUMED", None))

    def __exit__(self, *exc: Any) -> None:
        if self._at_exit:
            self.drop()


def _written_since_cached(entry: Any) -> bool:
    version = getattr(entry, "version", None)
    value = getattr(entry, "val", None)
    return version is not None and isinstance(value, torch.Tensor) and value._version != version


def _cache_is_checkable() -> bool:
    return hasattr(_torch_checkpoint, "_VersionWrapper") and hasattr(_torch_checkpoint, "_RECOMPUTE")


def _recompute_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _caches(action: Action, eager_around_compiled: bool, name: str, on_refuse: Optional[Callable[[str, str], None]]) -> bool:
    """Whether the eager checkpoint caches what ``SELECTIVE`` saves: not around compiled code
    (Note [Selective under compile]), where it recomputes everything and says so. A segment
    recomputed inside its graph (Note [Recomputation inside the compiled graph]) takes the eager
    checkpoint only while its compiled code runs eagerly (its first call, the meter's steps),
    where caching is safe, or when it writes into its input: then it caches nothing."""
    if action is not Action.SELECTIVE:
        return False
    if create_selective_checkpoint_contexts is None:
        raise RuntimeError("Action.SELECTIVE needs torch.utils.checkpoint.create_selective_checkpoint_contexts (torch >= 2.4).")
    if not eager_around_compiled:
        return True
    log.info("lightning-swap: segment %r is compiled: selective recomputes all of it (Note [Selective under compile])", name)
    if on_refuse is not None:
        on_refuse(name, "selective: compiled, recomputes everything (Note [Selective under compile])")
    return False


def _policy(save_ops: Optional[frozenset]) -> Callable[..., Any]:
    """``SELECTIVE``'s policy: the plan's ops saved (Note [Who decides under compile]), else the compute-heavy ones."""
    return _selective_policy if save_ops is None else _measured_policy(frozenset(save_ops))


def _in_graph(
    graph: Optional[tuple[Any, Callable[..., Any]]], action: Action, outer: Optional[Callable[[], Any]], save_ops: Optional[frozenset]
) -> Optional[Callable[..., Any]]:
    """The segment's checkpoint compiled as one graph with its forward (Note [Recomputation inside
    the compiled graph] in ``compiled.py``), or ``None`` where it recomputes eagerly."""
    if graph is None or outer is not None or action not in (Action.RECOMPUTE, Action.SELECTIVE):
        return None
    ctx, forward = graph
    if action is Action.SELECTIVE:
        # A new policy per call: Note [Selective saves per call] counts calls from 0 each time.
        options = {"context_fn": lambda: create_selective_checkpoint_contexts(_policy(save_ops))}
    else:
        options = {}

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _no_caches(args, kwargs)  # Note [A recomputed segment fills no cache]: traced, ``run`` is not
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **options, **kwargs)

    # A code object per policy: Dynamo caches compiled code per code object and does not guard
    # on the policy a closure holds, so segments (and plans) with other ops saved would share
    # the first one's graph; segments with the same policy share theirs, as without the library.
    key = (action.value, None if save_ops is None else tuple(sorted(save_ops)))
    code = _POLICY_CODE.setdefault(key, recomputed.__code__.replace(co_name=f"recomputed_{len(_POLICY_CODE)}"))
    recomputed = types.FunctionType(code, recomputed.__globals__, code.co_name, None, recomputed.__closure__)
    compiled = compile_with(ctx, recomputed)  # Note [Random numbers under Inductor] in compiled.py
    compiled.traced = recomputed  # for a graph that encloses the segment (runtime's _TracedForward)
    return compiled


#: (action, ops saved) -> the code object its compiled checkpoints run (:func:`_in_graph`).
_POLICY_CODE: dict[tuple, Any] = {}


def _selective_contexts(save_ops: Optional[frozenset] = None) -> tuple[Any, Any]:
    """The two contexts of ``SELECTIVE`` (Note [Selective never replays a mutated tensor]),
    saving the ops ``save_ops`` names (the plan's: Note [Who decides under compile]), else the
    compute-heavy ones."""
    if not _cache_is_checkable():  # pragma: no cover - a torch without the internals read here
        return create_selective_checkpoint_contexts(_recompute_everything)
    fwd, rec = create_selective_checkpoint_contexts(_policy(save_ops))
    if hasattr(fwd, "respect_saved_tensors_hooks"):
        # checkpoint sets it only on a bare caching mode, and ours comes in a chain: the hooks
        # around a segment hold its inputs, not what SELECTIVE caches (_checkpoint_options).
        fwd.respect_saved_tensors_hooks = False
    return _Chain(_DropMutated(fwd.storage, at_exit=True), fwd), _Chain(_DropMutated(fwd.storage), rec)


@functools.lru_cache(maxsize=1)
def _checkpoint_options() -> dict:
    """``respect_saved_tensors_hooks=False`` where checkpoint has it (torch >= 2.11): the hooks
    around a segment's checkpoint hold its inputs only; what ``SELECTIVE`` caches stays on the
    device, as it always did, and torch does not warn that this default will change."""
    import inspect

    return {"respect_saved_tensors_hooks": False} if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {}


_UNPACKED: Any = object()


class _Held:
    """An input checkpoint saved, as the saved-tensor hooks around it hold it: what the outer
    hooks (offload; none: the tensor itself) made of it, or of a copy taken before the segment
    wrote into it, which then replaces it (the written tensor is not what backward needs, and
    offload's unpack refuses it as modified, as autograd does). Under the watch the outer hooks
    get the input when the forward ends (:meth:`release`), unless it was copied first: an offload
    copy started with the forward would read the input while the segment writes into it."""

    __slots__ = ("tensor", "packed", "pack", "written")

    def __init__(self, tensor: torch.Tensor, pack: Callable[[torch.Tensor], Any], *, watched: bool = False) -> None:
        #: Only while the segment's forward runs (the watch reads it): never kept for backward.
        self.tensor: Optional[torch.Tensor] = tensor
        self.pack = pack
        self.packed = _UNPACKED if watched else pack(tensor)
        self.written = False

    def release(self) -> None:
        """The forward ended: the input goes to the outer hooks if the watch held it back."""
        if self.packed is _UNPACKED:
            self.packed = self.pack(self.tensor)
        self.tensor = None

    def before_write(self) -> None:
        """The input is about to be written: backward gets a copy taken now, packed as the input
        was (offloaded, under ``RECOMPUTE_OFFLOAD``: the device copy does not stay)."""
        assert self.tensor is not None
        with _beneath_selective():
            self.packed = self.pack(self.tensor.detach().clone())
        self.written = True


@contextlib.contextmanager
def _beneath_selective() -> Any:
    """Note [Selective saves per call]: the copy the watch takes (:meth:`_Held.before_write`) is
    not an op of the segment, and its recomputation never runs it; seen by selective's caching
    mode (above the watch on the mode stack, the watch inside the checkpointed forward), it would
    shift that mode's count of the op's calls and the policy's, and a later call of the same op
    would be saved under one index and replayed under another: another tensor, silently. So the
    caching modes above are set aside while it runs (the meter, below them, still counts it)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode_temporarily

    caching = getattr(torch.utils.checkpoint, "_CachingTorchDispatchMode", None)
    with contextlib.ExitStack() as stack:
        while caching is not None and (modes := _get_current_dispatch_mode_stack()) and isinstance(modes[-1], caching):
            stack.enter_context(_pop_mode_temporarily())
        yield


class _InPlaceWatch(TorchDispatchMode):
    """Note [Checkpointed segments must not modify their input]: before an op writes into the
    storage of a held input, the input is copied (once) and the op and module are remembered."""

    def __init__(self, held: list[_Held], module: nn.Module) -> None:
        super().__init__()
        # By the storage's address (an empty storage has none worth the name: never watched).
        self._held = {
            h.tensor.untyped_storage().data_ptr(): h for h in held
            if h.tensor is not None and h.tensor.layout == torch.strided and h.tensor.untyped_storage().nbytes() > 0
        }
        self._module = module
        self._names = {id(m): f"{n} ({type(m).__name__})" for n, m in module.named_modules() if n}
        self._stack: list[str] = []
        self.writes: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in written_args(func, args, kwargs):
            written = t.layout == torch.strided and t.untyped_storage().nbytes() > 0
            held = self._held.get(t.untyped_storage().data_ptr()) if written else None
            if held is not None and not held.written and held.tensor is not None:
                held.before_write()
                where = self._stack[-1] if self._stack else type(self._module).__name__
                self.writes.append(f"{func} in {where}")
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def tracking_modules(self):
        """The innermost module running, for the message (global module hooks, removed after)."""
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def pre(m: nn.Module, args: Any) -> None:
            if id(m) in self._names:
                self._stack.append(self._names[id(m)])

        def post(m: nn.Module, args: Any, out: Any) -> None:
            if id(m) in self._names and self._stack:
                self._stack.pop()

        handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def _is_cache(value: Any) -> bool:
    """A transformers key/value cache, by its interface (no import of transformers). Not
    ``tensors.is_kv_cache``: this runs inside compiled graphs, where walking the class's MRO
    breaks the graph (test_compile's Hugging Face tests count the graphs)."""
    return type(value).__name__.endswith("Cache") and callable(getattr(value, "update", None)) and hasattr(value, "get_seq_length")


def _without_caches(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Note [A recomputed segment fills no cache]."""
    if not any(map(_is_cache, args)) and not any(map(_is_cache, kwargs.values())):
        return args, kwargs
    if name not in _DROPPED_CACHE:
        _DROPPED_CACHE.add(name)
        log.info("lightning-swap: segment %r is recomputed, so it runs without its key/value cache argument "
                 "(Note [A recomputed segment fills no cache])", name)
    return _no_caches(args, kwargs)


def _no_caches(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tuple(None if _is_cache(a) else a for a in args), {k: None if _is_cache(v) else v for k, v in kwargs.items()}


_DROPPED_CACHE: set[str] = set()


def _outer_functions(outer: Optional[Callable[[], Any]]) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    if outer is None:
        return (lambda t: t), (lambda p: p)
    hooks = outer()  # a torch.autograd.graph.saved_tensors_hooks
    return hooks.pack_hook, hooks.unpack_hook


class _InputGuard:
    """Note [Checkpointed segments must not modify their input], for one wrapped segment."""

    def __init__(self, module: nn.Module, name: str, on_refuse: Optional[Callable[[str, str], None]]) -> None:
        self.module = module
        self.name = name
        self.on_refuse = on_refuse
        #: None: not seen yet; "" : never writes into its inputs; else the writes, for messages.
        self.verdict: Optional[str] = None

    def hooks(self, outer: Optional[Callable[[], Any]], held: list[_Held]) -> Any:
        """The saved-tensor hooks around the checkpoint call: ``outer``'s alone for a segment known
        not to write into its inputs; else ones that hold the inputs (copied for one that does)."""
        if self.verdict == "":
            return outer() if outer is not None else contextlib.nullcontext()
        pack_outer, unpack_outer = _outer_functions(outer)
        copy, watched = bool(self.verdict), self.verdict is None

        def pack(t: torch.Tensor) -> _Held:
            h = _Held(t.detach().clone() if copy else t, pack_outer, watched=watched)
            held.append(h)
            return h

        def unpack(h: _Held) -> torch.Tensor:
            # The recomputation writes into its input again: into a copy, so a second backward
            # reruns on the value the first saw, and no offload copy still reading it races.
            return unpack_outer(h.packed).clone() if self.verdict else unpack_outer(h.packed)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def watched(self, forward: Callable[..., Any], held: list[_Held]) -> Callable[..., Any]:
        """``forward`` under :class:`_InPlaceWatch` on its first call, run eagerly (a dispatch mode
        and compiled code); its recomputation eagerly too, unwatched: a compiled graph may save
        other tensors than the eager ops did, which checkpoint refuses."""
        if self.verdict is not None:
            return forward

        def first(*args: Any, **kwargs: Any) -> Any:
            from ..compiled import force_eager

            recomputing = torch._C._current_graph_task_id() != -1
            watch = _InPlaceWatch(held, self.module)
            stance = force_eager()
            try:
                if recomputing:
                    return forward(*args, **kwargs)
                with watch.tracking_modules(), watch:
                    out = forward(*args, **kwargs)
            finally:
                if stance is not None:
                    stance.__exit__(None, None, None)
            self._judge(watch.writes)
            return out

        return first

    def _judge(self, writes: list[str]) -> None:
        self.verdict = "; ".join(writes)
        if writes:
            log.warning(
                "lightning-swap: segment %r writes into its input in place (%s); recomputing it keeps a copy "
                "of its input until its backward. Keep or offload it (policy={%r: 'offload'}), or pass "
                "`segments=` that start after that op (Note [Checkpointed segments must not modify their input]).",
                self.name, self.verdict, self.name,
            )
            if self.on_refuse is not None:
                self.on_refuse(self.name, f"writes into its input in place ({self.verdict})")

    def check(self, inputs: list[torch.Tensor], versions: list[int]) -> None:
        """A write the watch could not see (inside compiled code): refuse rather than train wrongly."""
        if self.verdict:
            return  # its inputs were copied before the writes
        for t, v in zip(inputs, versions):
            if t._version != v:
                node = type(t.grad_fn).__name__ if t.grad_fn is not None else "an in-place op"
                raise InputMutatedError(segment=self.name or type(self.module).__name__, op=node)


def checkpointed(
    module: nn.Module,
    forward: Callable[..., Any],
    action: Action,
    timer: RecomputeTimer,
    outer: Optional[Callable[[], Any]] = None,
    name: str = "",
    *,
    compiled: bool = False,
    on_refuse: Optional[Callable[[str, str], None]] = None,
    save_ops: Optional[frozenset] = None,
    graph: Optional[tuple[Any, Callable[..., Any]]] = None,
) -> Callable[..., Any]:
    """``forward`` wrapped so the segment is recomputed in backward.

    ``outer`` (for ``RECOMPUTE_OFFLOAD``) gives the offload hooks (a ``saved_tensors_hooks``):
    they receive exactly what checkpoint keeps, the segment's inputs, while checkpoint's own
    inner hooks drop everything else. ``compiled``: the forward runs compiled code.
    ``on_refuse(name, reason)`` hears of an action this segment cannot run as asked (Notes
    [Checkpointed segments must not modify their input] and [Selective under compile]). ``save_ops`` (``SELECTIVE``): the ops whose outputs are saved,
    by name, as the plan chose them (Note [Who decides under compile]); ``None``: the
    compute-heavy ops. ``graph``: (Dynamo context, uncompiled forward) of a segment recomputed
    in its compiled graph (Note [Recomputation inside the compiled graph] in ``compiled.py``)."""
    state = ForwardState(module, name, on_refuse)
    inputs_guard = _InputGuard(module, name, on_refuse)
    selective = _caches(action, compiled and graph is None, name, on_refuse)
    in_graph = _in_graph(graph, action, outer, save_ops)

    def context_fn():
        caching = selective and (graph is None or inputs_guard.verdict in (None, ""))  # see _caches
        fwd, rec = _selective_contexts(save_ops) if caching else (contextlib.nullcontext(), contextlib.nullcontext())
        # Eager: a first call (_InputGuard.watched). The state's copies are no ops of the segment (outside
        # selective's modes). Checkpoint enters the first context now, the second in each backward.
        on_forward, on_recompute = state.call(eager=not compiled or inputs_guard.verdict is None)
        around_forward = _Chain(_Named(name, "forward"), on_forward, fwd)
        return around_forward, _Chain(_Named(name, "recomputation"), lambda: timer.measure(name), on_recompute, rec)

    @functools.wraps(forward, updated=())  # not a compiled forward's Dynamo attributes (compiled.py)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return state.unchecked(forward, *args, **kwargs)
        args, kwargs = _without_caches(name, args, kwargs)
        if in_graph is not None and inputs_guard.verdict == "" and not eager_stance():
            return in_graph(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in inputs]
        held: list[_Held] = []
        with inputs_guard.hooks(outer, held):
            fn = inputs_guard.watched(forward, held)
            out = checkpoint(
                fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn, **_checkpoint_options(), **kwargs
            )
        for h in held:
            h.release()  # the watch is over; what backward needs is in ``packed`` (offloaded, maybe)
        inputs_guard.check(inputs, versions)
        return out

    # The checkpoint for a graph that encloses the segment, once its first call found it fit.
    run.inline = lambda: in_graph.traced if in_graph is not None and inputs_guard.verdict == "" else None  # type: ignore[attr-defined]
    return run
