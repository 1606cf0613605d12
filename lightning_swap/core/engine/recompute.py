"""Recomputation of a segment (activation checkpointing) that is invisible to training.

Built on non-reentrant ``torch.utils.checkpoint`` (Chen et al. 2016), which restores the RNG
state (dropout masks repeat) and the autocast state for the recomputation. ``SELECTIVE`` uses
``create_selective_checkpoint_contexts``: outputs of compute-heavy ops are saved, the rest is
recomputed.

Note [Recompute leaves buffers alone]: plain ``torch.utils.checkpoint`` runs the segment's
forward twice, so BatchNorm's running statistics (and ``num_batches_tracked``) are updated
twice per step, and the model drifts from plain training. During the recomputation each
BatchNorm layer of the segment that tracks statistics in training mode runs with ``momentum``
0 and no ``num_batches_tracked``: the batch is not counted and the running statistics are
updated by a factor of 0 (``r * 1 + 0 * m``), which leaves them equal. The layer is still given
its running statistics, so the recomputation saves exactly the tensors the forward saved (with
none, ``native_batch_norm`` saves two fewer and checkpoint refuses the mismatch), and since
training mode normalises with the batch's own statistics its output is the same. No kernel is
launched to save or restore anything.
Under ``torch.compile`` the segment's graph specialises on ``momentum`` and on
``num_batches_tracked`` being ``None``, so the recomputation runs a second graph (compiled once per
block class, then reused) with the same effect (``tests/test_compile.py`` checks the statistics).
Any other buffer the real forward mutates (its version counter moves; norm layers whose
``forward`` is not torch's BatchNorm one are listed by type, since ``native_batch_norm``
writes statistics without bumping the version) is snapshot when the recomputation starts and
copied back when it ends.

Note [Checkpointed segments must not modify their input]: the recomputation reruns the
segment on its saved input; if the forward changed that input in place, the rerun would see
the changed values. We compare the input's version before and after the forward and refuse.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import SyncBatchNorm, _BatchNorm, _NormBase
from torch.utils.checkpoint import checkpoint
from torch.utils._pytree import tree_leaves

from ..actions import Action
from .streams import StreamOps, Timing

__all__ = ["RecomputeTimer", "checkpointed", "compute_heavy_ops"]

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
            ops.update(packet.overloads() and [getattr(packet, o) for o in packet.overloads()])
    return frozenset(ops)


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    if op in compute_heavy_ops():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _measured_policy(save_ops: frozenset) -> Callable[..., Any]:
    """Note [Who decides under compile]: the plan's op-level choice (Note [Which ops selective
    recomputation saves] in ``measure/profiler.py``) saves the outputs of ``save_ops`` and
    recomputes every other op. Both are ``MUST_``: under ``torch.compile`` the min-cut
    partitioner (and its ``activation_memory_budget``) may overrule ``PREFER_`` tags, and the
    plan priced exactly these bytes and milliseconds, so the plan decides inside the segments it
    recomputes; the partitioner decides inside the segments the plan keeps, whose activations
    the plan leaves to the compiled graph."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if str(op) in save_ops else CheckpointPolicy.MUST_RECOMPUTE

    return policy


def _respects_hooks_keyword() -> dict[str, Any]:
    """``respect_saved_tensors_hooks=False`` where torch has it: what selective checkpointing
    saves stays on the device (it is what the plan keeps), the legacy behaviour, without the
    warning torch 2.15 gives when saved-tensor hooks (the offload engine's) are active."""
    import inspect

    return {"respect_saved_tensors_hooks": False} if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {}


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


def _plain_batch_norm(m: nn.Module) -> bool:
    """A BatchNorm whose ``forward`` is torch's, which reads ``momentum`` and ``num_batches_tracked``
    as Note [Recompute leaves buffers alone] needs."""
    return isinstance(m, _BatchNorm) and type(m).forward in (_BatchNorm.forward, SyncBatchNorm.forward)


class _BufferGuard:
    """Note [Recompute leaves buffers alone]."""

    def __init__(self, module: nn.Module) -> None:
        self._batch_norms = [m for m in module.modules() if _plain_batch_norm(m)]
        flipped = {id(b) for m in self._batch_norms for b in m.buffers(recurse=False)}
        self._other_norms = [m for m in module.modules() if isinstance(m, _NormBase) and not _plain_batch_norm(m)]
        self._others = [b for b in module.buffers() if b is not None and id(b) not in flipped]
        self.mutated: list[torch.Tensor] = []

    @contextlib.contextmanager
    def watch_forward(self):
        if not self._others:
            yield
            return
        versions = [b._version for b in self._others]
        yield
        mutated = {id(b): b for b, v in zip(self._others, versions) if b._version != v}
        for m in self._other_norms:
            if m.training and m.track_running_stats:
                for b in (m.running_mean, m.running_var, m.num_batches_tracked):
                    if b is not None:
                        mutated[id(b)] = b
        self.mutated = list(mutated.values())

    @contextlib.contextmanager
    def preserve(self):
        frozen = [(m, m.momentum, m.num_batches_tracked) for m in self._batch_norms if m.training and m.track_running_stats]
        for m, _, _ in frozen:
            m.momentum = 0.0
            m.num_batches_tracked = None
        with torch.no_grad():
            saved = [b.clone() for b in self.mutated]
        try:
            yield
        finally:
            for m, momentum, count in frozen:
                m.momentum = momentum
                m.num_batches_tracked = count
            with torch.no_grad():
                for b, s in zip(self.mutated, saved):
                    b.copy_(s)


def checkpointed(
    module: nn.Module,
    forward: Callable[..., Any],
    action: Action,
    timer: RecomputeTimer,
    outer: Optional[Callable[[], contextlib.AbstractContextManager]] = None,
    name: str = "",
    save_ops: Optional[frozenset] = None,
) -> Callable[..., Any]:
    """``forward`` wrapped so the segment is recomputed in backward.

    ``outer`` (for ``RECOMPUTE_OFFLOAD``) gives the offload hooks: entered around the
    checkpoint call, they receive exactly what checkpoint keeps, the segment's inputs, while
    checkpoint's own inner hooks drop everything else. ``save_ops`` (``SELECTIVE``): the ops
    whose outputs are saved, by name (Note [Who decides under compile]); ``None``: the
    compute-heavy ops.
    """
    if action is Action.SELECTIVE and create_selective_checkpoint_contexts is None:
        raise RuntimeError("Action.SELECTIVE needs torch.utils.checkpoint.create_selective_checkpoint_contexts (torch >= 2.4).")
    guard = _BufferGuard(module)
    policy = _selective_policy if save_ops is None else _measured_policy(frozenset(save_ops))
    extra = _respects_hooks_keyword() if action is Action.SELECTIVE else {}

    def context_fn():
        if action is Action.SELECTIVE:
            fwd, rec = create_selective_checkpoint_contexts(policy)
        else:
            fwd, rec = contextlib.nullcontext(), contextlib.nullcontext()
        # Entered lazily: checkpoint enters the first now and the second only in backward.
        return _Chain(fwd, guard.watch_forward), _Chain(lambda: timer.measure(name), guard.preserve, rec)

    @functools.wraps(forward, updated=())  # not a compiled forward's Dynamo attributes (compiled.py)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in inputs]
        with outer() if outer is not None else contextlib.nullcontext():
            out = checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn, **extra, **kwargs)
        if any(t._version != v for t, v in zip(inputs, versions)):
            raise RuntimeError(
                "A recomputed segment modified its input in place, so its recomputation would "
                "see different values; keep or offload this segment instead "
                "(Note [Checkpointed segments must not modify their input])."
            )
        return out

    return run
