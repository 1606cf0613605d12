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
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch
from torch import nn

from .segments import canonical_name

__all__ = [
    "compile_context", "compiled_forward", "dynamo_context", "dynamo_disable", "eager_stance", "force_eager", "fullgraph",
    "is_compiled", "recomputes_in_graph",
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
    return ctx(forward), ((ctx, forward) if recomputes_in_graph(module) else None)


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
