"""What ``torch.compile`` did to a model, as the runtime needs to know it: which segments run
under a compiled region, with which settings, and how to keep the runtime's own machinery out
of every graph.

Note [Actions around compiled segments]: a non-``KEEP`` action runs Python around a segment's
forward (saved-tensor hooks, ``torch.utils.checkpoint``, timers, BatchNorm guards) that Dynamo
must not trace: it cannot trace ``saved_tensors_hooks`` (it graph-breaks at every segment), and
checkpoint's recomputation runs in backward, where no compiled region is active. So the
runtime's entry points (the segment ``forward`` it installs, its module hooks and tensor hooks)
are wrapped in ``torch.compiler.disable`` (recursive): Dynamo graph-breaks at a non-``KEEP``
segment's boundary and runs the action eagerly. Inside, the segment's own forward is called
through the *user's* Dynamo context (``ctx(forward)``, the context ``torch.compile`` made:
same backend, mode and options), so it is compiled as its own graph, in forward and again when
checkpoint recomputes it in backward; the tensors its AOTAutograd graph saves pass through
the offload hooks like any saved tensor (``tests/runtime/test_compile.py`` checks both).

Note [Recomputation inside the compiled graph]: a compiled segment the plan recomputes
(``RECOMPUTE``, ``SELECTIVE``) is not recomputed by an eager checkpoint around its compiled
forward, which ran the forward graph twice, had the recomputation's own graph save its
activations again for its backward, and could not let ``SELECTIVE`` cache Inductor's outputs
(Note [Selective under compile] in ``engine/recompute.py``: it recomputed everything). Instead
the user's Dynamo context compiles ``checkpoint(forward, policy)``: Dynamo traces the
checkpoint as a higher-order op, AOTAutograd's partitioner puts the tagged ops' recomputation in
the backward graph and Inductor fuses it with the backward's kernels. Who decides which tensors
are saved: the plan. ``RECOMPUTE`` tags every op for recomputation; ``SELECTIVE`` saves the
outputs the plan chose (``MUST_SAVE`` / ``MUST_RECOMPUTE``, Note [Who decides under compile]) or
the compute-heavy ops'; the partitioner decides only what the tags leave free, and
``activation_memory_budget`` is not touched (it stays the user's, for the graphs the plan keeps).
Measured (the 6-block GPT of ``benchmarks/compile_budget.py``, CPU, one thread, in one process):
all six blocks recomputed 1217 ms a step against 1267 for the eager checkpoint around compiled
blocks; ``tests/runtime/test_compile.py`` checks the saved bytes (846 KiB kept, 648 selective, 264
recomputed on its small net), one graph run per segment and step, and the weights.

The segment's first call still runs the eager checkpoint (its input check: Note [Checkpointed
segments must not modify their input]), and so do a segment that writes into its inputs, every
step under the ``force_eager`` stance (the CPU meter's steps), ``RECOMPUTE_OFFLOAD`` (its
offload hooks must see the inputs checkpoint keeps) and a module with buffers (a BatchNorm's
running statistics would be updated inside the traced checkpoint): :func:`recomputes_in_graph`.
Where a graph encloses the segment (the whole model compiled), the checkpoint is traced into
that graph (the runtime's ``_TracedForward``), with no graph break, from the step after the
segment's first call; a first call Dynamo traces (the runtime used without ``begin_step``'s
metered first step) breaks the graph there, and in a loop over blocks Dynamo then runs that
frame eagerly for good: the blocks still compile one by one, each recomputing inside its graph.
Torch logs a warning the first time (``context_fn`` under ``torch.compile``: in-place ops in the
region); ``tests/runtime/test_compile.py`` trains a block with ``relu_`` and ``+=`` to the same weights as
the compiled model without the library, under ``aot_eager`` and Inductor. The time of such a
recomputation is part of the compiled backward: the runtime's ``recompute_ms`` does not count it.

Why not ``torch.compiler.disable(recursive=False)`` on the wrapper alone (the wrapper frame
eager, frames it calls compiled by the active context): every Python frame the wrapper reaches
would then be compiled too, the runtime's own included (pack hooks, checkpoint's context
managers); a segment whose forward is torch's own code (``nn.Sequential``,
``nn.TransformerEncoderLayer``) would still run eagerly, since Dynamo skips torch's frames at
the top level; and checkpoint would recompute eagerly in backward, saving a different set of
tensors than the compiled forward did.

The context is found through the module tree (:func:`compile_context`): the innermost of an
``OptimizedModule`` wrapper (``torch.compile(module)``), ``module.compile()``
(``_compiled_call_impl``) or a compiled instance ``forward`` (Lightning's ``trainer.fit`` of a
compiled LightningModule) on the path from the model to the segment. A model compiled by a
reference the runtime never sees (``compiled = torch.compile(model)`` with the runtime given
``model``) cannot be found: give the runtime the compiled module, or compile in place
(``model.compile()``).

Note [Random numbers under Inductor]: on CPU Inductor runs ``bernoulli_`` (timm's and most
``drop_path``s) as a call of the eager op, which draws from torch's generator in program order,
so it draws the same numbers whichever graphs the program is cut into, and eagerly. A compiled
ViT with drop_path under ``offload`` still drew other masks (review ``r2_08``, 1.7e-3 relative
from step 3): the blocks' forwards, compiled one by one, differ only in the drop rate, a float
attribute; Dynamo traces it as a symbolic float, Inductor bakes the value into the code, and
AOTAutograd's cache keys on the Dynamo graph, the same for every rate (pytorch/pytorch#197889),
so the third block ran the second block's code with the second block's rate. A regional
compilation meets it without the library too. So the forwards the runtime compiles
(:func:`compile_with`) skip AOTAutograd's cache (``enable_autograd_cache``); Inductor's own
cache, keyed on the code with the value baked in, still serves them. Inductor's own random
kernels (``dropout``, ``rand``; on CUDA ``bernoulli`` too) draw differently: each graph takes
its seeds from the generator with one ``randint`` when it starts, so their numbers depend on
how the program is cut into graphs and differ from eager; a step the runtime runs eagerly (the
CPU meter's first step, a recomputed segment's first call) and the graph breaks of ``offload``
under whole-model compilation change them: the same distribution, other values. With
``torch._inductor.config.fallback_random = True`` (for the plain run as well) every random op
draws from the generator in program order and every policy matches compiled plain within float
rounding (``tests/runtime/test_compile_rng.py``).

Note [Nothing compiled under the runtime outlives it]: Dynamo caches compiled code on the code
objects it compiled, guarded by what it traced. What it compiled while the runtime was installed
is not what it compiles without it: a frame whose call reached a runtime entry point (a
segment's action, a module hook: dynamo-disabled) was cut there into a graph, a call and a
resume function, and its guards, taken before the cut, pass for the plain model too; a frame
that reached one inside a loop was marked to run eagerly for good; and the segments' forwards
were compiled by the runtime. A plain compiled model of the same classes after teardown reused
all three (review ``r2_07``: other losses from step 0, until ``torch._dynamo.reset()``).
:class:`DynamoLedger` finds them as they happen: a runtime entry point running eagerly looks,
once, at the frames between it and the compiled call above it (Dynamo's transformed code: the
code it compiled; the frame's own code: a frame it gave up), and the runtime names the forwards
it compiles; at ``remove()`` the entries Dynamo made for those codes (and their resume functions)
since ``install()`` are dropped, as Dynamo drops an entry whose guarded object died, and the
frames it gave up are tried again. Entries made before, and every other code's, stay.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from .segments import canonical_name

__all__ = [
    "DynamoLedger", "compile_context", "compile_with", "compiled_forward", "dynamo_context", "dynamo_disable", "eager_stance",
    "force_eager", "fullgraph", "is_compiled", "note_compiled_callers", "recomputes_in_graph",
]


def dynamo_disable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, never traced by Dynamo, nor anything it calls (except compiled callables, which
    enable their own context): Note [Actions around compiled segments]."""
    return torch.compiler.disable(fn, recursive=True)


def force_eager() -> Optional[Any]:
    """Make every compiled callable run eagerly until the returned handle's ``__exit__``
    restores the stance before (``torch.compiler.set_stance("force_eager")``); ``None`` when
    nothing can be compiled yet. For windows with a ``TorchDispatchMode`` open (the CPU meter):
    Dynamo would run eagerly anyway, but a ``fullgraph=True`` callable would raise instead
    (Note [No dispatch mode under compile] in ``runtime.py``)."""
    if _dynamo() is None:
        return None
    from torch._C._dynamo.eval_frame import get_eval_frame_callback

    if get_eval_frame_callback() not in (None, False):  # inside a region Dynamo traces: it cannot change
        return None
    return torch.compiler.set_stance("force_eager")


def eager_stance() -> bool:
    """Whether compiled callables run eagerly now (:func:`force_eager`'s stance is set)."""
    eval_frame = _dynamo()
    stance = getattr(eval_frame, "_stance", None) if eval_frame is not None else None
    return getattr(stance, "stance", "default") == "force_eager"


def recomputes_in_graph(module: nn.Module) -> bool:
    """Note [Recomputation inside the compiled graph]: whether a compiled segment ``module``
    recomputes (``RECOMPUTE``, ``SELECTIVE``) inside its own graph: a torch whose Dynamo traces
    ``torch.utils.checkpoint`` with a selective policy (``torch.compiler.set_stance`` marks it,
    torch >= 2.6) and a module with no buffers (a BatchNorm's running statistics would be
    updated inside the traced checkpoint)."""
    return hasattr(torch.compiler, "set_stance") and next(module.buffers(), None) is None


def compiled_forward(
    ctx: Any, forward: Callable[..., Any], module: nn.Module,
) -> tuple[Callable[..., Any], Optional[tuple[Any, Callable[..., Any]]]]:
    """Segment ``module``'s ``forward`` as the runtime runs it under the Dynamo context ``ctx``:
    compiled, and (``ctx``, ``forward``) where it recomputes inside its graph (Note
    [Recomputation inside the compiled graph]; ``None``: it recomputes eagerly). The runtime
    installs these."""
    return compile_with(ctx, forward), ((ctx, forward) if recomputes_in_graph(module) else None)


def compile_with(ctx: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled by the Dynamo context ``ctx``, without AOTAutograd's cache while Dynamo
    compiles it from an eager call (Note [Random numbers under Inductor]); traced inside a graph
    that encloses it, it is ``ctx(fn)``."""
    compiled = ctx(fn)
    config = getattr(torch._functorch, "config", None)
    if not hasattr(config, "enable_autograd_cache"):  # pragma: no cover - a torch without the cache
        return compiled

    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return compiled(*args, **kwargs)
        with config.patch(enable_autograd_cache=False):
            return compiled(*args, **kwargs)

    return run


def _dynamo() -> Any:
    # Nothing can be compiled before torch._dynamo is imported: do not import it here.
    return sys.modules.get("torch._dynamo.eval_frame")


def _usable(ctx: Any) -> bool:
    dynamo = _dynamo()
    if dynamo is None or not isinstance(ctx, dynamo._TorchDynamoContext):
        return False
    disable = getattr(dynamo, "DisableContext", ())
    run_only = getattr(dynamo, "RunOnlyContext", ())
    return not isinstance(ctx, (disable, run_only)) and callable(getattr(ctx, "callback", None))


def _context_of_wrapper(fn: Any) -> Optional[Any]:
    """The Dynamo context behind a function ``torch.compile`` returned: it holds the context in
    its closure (the wrapper ``_TorchDynamoContext.__call__`` builds)."""
    if getattr(fn, "_torchdynamo_orig_callable", None) is None or getattr(fn, "_torchdynamo_disable", False):
        return None
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if _usable(value):
            return value
    return None


def dynamo_context(module: nn.Module) -> Optional[Any]:
    """The Dynamo context compiling ``module``'s call, if ``module`` (not an ancestor) is
    compiled: an ``OptimizedModule``, ``module.compile()``, or a compiled instance ``forward``."""
    dynamo = _dynamo()
    if dynamo is None:
        return None
    if isinstance(module, dynamo.OptimizedModule):
        ctx = getattr(module, "dynamo_ctx", None)
        return ctx if _usable(ctx) else None
    impl = module.__dict__.get("_compiled_call_impl")
    if impl is not None:
        ctx = _context_of_wrapper(impl)
        if ctx is not None:
            return ctx
    forward = module.__dict__.get("forward")
    return _context_of_wrapper(forward) if forward is not None else None


def _contexts_along(model: nn.Module, name: str) -> list[tuple[str, Any]]:
    """Every Dynamo context on the path from ``model`` to the module ``name`` (canonical), outermost
    first, with the canonical name of the module it compiles."""
    dynamo = _dynamo()
    found: list[tuple[str, Any]] = []
    if dynamo is None:
        return found
    parts = [p for p in canonical_name(name).split(".") if p]
    module: Optional[nn.Module] = model
    prefix = ""
    for depth in range(len(parts) + 1):
        while True:  # through wrappers: torch.compile(m) of an m.compile()d module, or nested
            ctx = dynamo_context(module)
            if ctx is not None:
                found.append((prefix, ctx))
            if not isinstance(module, dynamo.OptimizedModule):
                break
            module = module._orig_mod
        if depth == len(parts):
            break
        module = module._modules.get(parts[depth])
        if module is None:
            break
        prefix = f"{prefix}.{parts[depth]}" if prefix else parts[depth]
    return found


def compile_context(model: nn.Module, name: str) -> Optional[tuple[str, Any]]:
    """The innermost compiled module on the path from ``model`` to segment ``name`` (canonical
    name, the segment's own name for regional compilation) and its Dynamo context; ``None``
    when the segment is not under ``torch.compile`` as far as the module tree shows."""
    found = _contexts_along(model, name)
    return found[-1] if found else None


def is_compiled(model: nn.Module) -> bool:
    """Whether any module of ``model`` (``model`` included) is compiled with ``torch.compile``."""
    if _dynamo() is None:
        return False
    stack = [model]
    seen: set[int] = set()
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if dynamo_context(module) is not None:
            return True
        stack.extend(c for c in module._modules.values() if c is not None)
    return False


def fullgraph(ctx: Any) -> bool:
    """Whether ``ctx`` was made with ``fullgraph=True`` (graph breaks are errors)."""
    return bool(getattr(ctx, "fullgraph", False))


#: Ledgers of the installed runtimes (Note [Nothing compiled under the runtime outlives it]).
_LEDGERS: list["DynamoLedger"] = []
_DYNAMO_DIR = os.path.join(os.path.dirname(torch.__file__), "_dynamo") + os.sep
_CALL_IMPL = torch.nn.Module._call_impl.__code__.co_filename


def note_compiled_callers(entry: object) -> None:
    """Called by a runtime entry point (``entry``: the wrapper or hook object) as it runs:
    Note [Nothing compiled under the runtime outlives it]."""
    for ledger in _LEDGERS:
        ledger.note(entry)


class DynamoLedger:
    """What Dynamo compiled under one installed runtime, dropped by :meth:`drop`: Note [Nothing
    compiled under the runtime outlives it]."""

    def __init__(self) -> None:
        frames = sys.modules.get("torch._dynamo.convert_frame")
        #: Compile attempts per Dynamo frame id so far: entries numbered from here are ours.
        self._start = dict(frames.FRAME_COMPILE_COUNTER) if frames is not None else {}
        self._compiled: set[Any] = set()  # codes compiled under the runtime
        self._eager: set[Any] = set()  # codes Dynamo gave up on under the runtime
        self._seen: set[int] = set()  # entry points already looked from
        _LEDGERS.append(self)  # until drop()

    def own(self, fn: Any) -> None:
        """``fn`` (a function or bound method) is compiled by the runtime."""
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is not None:
            self._compiled.add(code)

    def note(self, entry: object) -> None:
        if id(entry) in self._seen or eager_stance():
            return
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None:
            return
        self._seen.add(id(entry))
        compiled, gave_up = [], []
        frame = sys._getframe(3)  # (note, note_compiled_callers, the entry point) then its disable wrapper
        while frame is not None and frame.f_code.co_filename.startswith(_DYNAMO_DIR):
            frame = frame.f_back
        while frame is not None:
            code = frame.f_code
            if code.co_filename.startswith(_DYNAMO_DIR):  # the compiled call (or a disabled region): the end
                self._compiled.update(compiled)
                self._eager.update(gave_up)
                return
            if code in utils.orig_code_map:
                compiled.append(utils.orig_code_map[code])
            elif code.co_filename != _CALL_IMPL and not (frame.f_back and frame.f_back.f_code.co_name == "nonrecursive_disable_wrapper"):
                gave_up.append(code)  # (not one the user's torch.compiler.disable(recursive=False) runs eagerly)
            frame = frame.f_back
        # no compiled call above: nothing was compiled around this entry point

    def drop(self) -> None:
        """Drops what Dynamo compiled for the codes found since the ledger began; idempotent."""
        if self in _LEDGERS:
            _LEDGERS.remove(self)
        eval_frame = _dynamo()
        if eval_frame is None or not (self._compiled or self._eager):
            return
        from torch._C._dynamo.eval_frame import reset_code
        from torch._dynamo.guards import DeletedGuardManagerWrapper
        from torch._dynamo.resume_execution import ContinueExecutionCache

        for code in _with_resumes(self._compiled | self._eager, ContinueExecutionCache.cache):
            entries = eval_frame._debug_get_cache_entry_list(code)
            ours = [e for e in entries if e.compile_id.frame_compile_id >= self._start.get(e.compile_id.frame_id, 0)]
            if len(ours) == len(entries):
                reset_code(code)  # all of it (and a mark to run eagerly) came under the runtime
                continue
            if code in self._eager:  # given up under the runtime: tried again
                default = eval_frame.FrameAction.DEFAULT
                eval_frame.set_code_exec_strategy(code, eval_frame.FrameExecStrategy(default, default))
            for entry in ours:  # as Dynamo drops an entry whose guarded object died (CheckFunctionManager.invalidate)
                manager = entry.guard_manager
                manager.extra_state.invalidate(manager.cache_entry, DeletedGuardManagerWrapper("compiled under lightning-swap's runtime"))
        self._compiled.clear()
        self._eager.clear()


def _with_resumes(codes: Iterable[Any], resumes: Any) -> list[Any]:
    """``codes`` and the resume functions Dynamo generated from them, transitively."""
    found, todo = [], list(codes)
    while todo:
        code = todo.pop()
        if code not in found:
            found.append(code)
            todo.extend(resumes.get(code, {}).values())
    return found
