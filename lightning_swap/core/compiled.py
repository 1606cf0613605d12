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
the offload hooks like any saved tensor (``tests/test_compile.py`` checks both).

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
    "compile_context", "dynamo_context", "dynamo_disable", "force_eager", "fullgraph", "is_compiled",
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
