"""Cutting a model into segments: the units one :class:`~lightning_swap.Action` applies to.

By default the repeated blocks are found automatically: the children of ``nn.Sequential`` /
``nn.ModuleList`` containers that hold at least two non-leaf modules of one class (ResNet
bottlenecks, transformer layers). A model with no such container (a flat ``nn.Sequential``
of layers) falls back to every child of its outermost ``nn.Sequential``: each layer is then
its own segment, which offload serves well and recompute hardly at all (a one-op segment
keeps its input, which is as big as what it would have saved).
Users may instead name module classes or qualified module names.

Note [Canonical segment names]: ``torch.compile(module)`` returns an ``OptimizedModule`` that
holds the module as its child ``_orig_mod``, so after ``self.model = torch.compile(model)`` the
model's ``named_modules()`` calls a block ``model._orig_mod.blocks.0``; compiling one block in a
``ModuleList`` (regional compilation) gives ``blocks.0._orig_mod``. A segment is named as if
nothing were compiled (``model.blocks.0``): the walk looks through every ``OptimizedModule`` to
the module it wraps, names never contain ``_orig_mod``, and :func:`resolve_modules` maps a name
to the live module (the wrapped one, whose ``forward`` the runtime replaces). Names therefore
stay the same whether the user compiles before, after, or not at all, and a policy written for
the eager model applies to the compiled one. ``module.compile()`` changes no name.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Optional, Union

from torch import nn

__all__ = [
    "PREFIX_REGION", "TAIL_REGION", "SegmentSpec", "canonical_name", "find_segments", "named_modules", "outside_region_names",
    "region_after", "resolve_modules", "unwrap_compiled",
]

SegmentSpec = Union[None, Sequence[Union[str, type]]]

_CONTAINERS = (nn.Sequential, nn.ModuleList)


_WRAPPED = "_orig_mod"


def unwrap_compiled(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) holds; ``module`` itself if
    it is not one (Note [Canonical segment names])."""
    # No OptimizedModule can exist before torch._dynamo is imported: do not import it here.
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(dynamo, "OptimizedModule", None)
    while optimized is not None and isinstance(module, optimized):
        module = module._orig_mod
    return module


def canonical_name(name: str) -> str:
    """``name`` without the ``_orig_mod`` parts ``torch.compile`` wrappers add."""
    return ".".join(part for part in name.split(".") if part != _WRAPPED)


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Like ``model.named_modules()``, but through ``torch.compile`` wrappers: canonical names,
    and each wrapped module in place of its wrapper (Note [Canonical segment names])."""
    seen: set[int] = set()
    stack = [("", model)]
    while stack:
        prefix, module = stack.pop()
        module = unwrap_compiled(module)
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield prefix, module
        children = [(f"{prefix}.{n}" if prefix else n, c) for n, c in module._modules.items() if c is not None]
        stack.extend(reversed(children))  # registration order, depth first, as named_modules


def resolve_modules(model: nn.Module, names: Sequence[str], *, field: str = "segments") -> dict[str, nn.Module]:
    """The live module behind each name, compiled or not (Note [Canonical segment names]).

    ``names`` are canonical (an ``_orig_mod`` part is looked through as well); a name the
    model does not have is a ``ValueError`` naming ``field``.
    """
    modules = dict(named_modules(model))
    found: dict[str, nn.Module] = {}
    unknown = []
    for name in names:
        module = modules.get(canonical_name(name)) if name else None
        if module is None:
            unknown.append(name)
        else:
            found[name] = module
    if unknown:
        raise ValueError(f"`{field}` names modules the model does not have: {unknown}.")
    return found


def _is_leaf(module: nn.Module) -> bool:
    return next(iter(unwrap_compiled(module).children()), None) is None


def _repeated_blocks(model: nn.Module) -> list[str]:
    names: list[str] = []
    taken: list[str] = []  # prefixes already inside a chosen segment

    for name, module in named_modules(model):
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        if not isinstance(module, _CONTAINERS):
            continue
        children = list(module.named_children())
        counts = Counter(type(unwrap_compiled(c)) for _, c in children if not _is_leaf(c))
        if not counts or max(counts.values()) < 2:
            continue
        for child_name, _ in children:
            full = f"{name}.{child_name}" if name else child_name
            names.append(full)
            taken.append(full)
    return names


def _flat_chain(model: nn.Module) -> list[str]:
    for name, module in named_modules(model):
        if isinstance(module, nn.Sequential):
            prefix = f"{name}." if name else ""
            return [prefix + child_name for child_name, _ in module.named_children()]
    return []


def _check_disjoint(names: Sequence[str]) -> None:
    ordered = sorted(names)
    for a, b in zip(ordered, ordered[1:]):
        if a == b:
            raise ValueError(f"`segments` names {a!r} twice.")
        if b.startswith(a + "."):
            raise ValueError(f"`segments` must not nest: {b!r} is inside {a!r}.")


def find_segments(model: nn.Module, segments: SegmentSpec = None) -> list[str]:
    """Qualified names of the model's segments, in registration order.

    Registration order is the execution order for the chains this library targets; the
    profiler records the order actually executed. Names are canonical: the same for a compiled
    model as for the eager one (Note [Canonical segment names]).
    """
    if segments is None:
        names = _repeated_blocks(model) or _flat_chain(model)
        if not names:
            raise ValueError(
                "`segments` could not be found automatically: the model has no nn.Sequential "
                "or nn.ModuleList of repeated blocks. Pass `segments=[BlockClass]` or "
                "`segments=['qualified.module.name', ...]`."
            )
        return names
    if isinstance(segments, (str, type)):
        segments = [segments]
    if not isinstance(segments, Sequence) or not segments:
        raise ValueError(
            f"`segments` got {segments!r}; allowed: None (automatic) or a non-empty list of "
            "module classes or qualified module names."
        )
    modules = dict(named_modules(model))
    bad = [s for s in segments if not isinstance(s, (str, type))]
    if bad:
        raise ValueError(f"`segments` entries must be module classes or names; got {bad!r}.")
    unknown = [s for s in segments if isinstance(s, str) and (canonical_name(s) not in modules or not canonical_name(s))]
    if unknown:
        raise ValueError(f"`segments` names modules the model does not have: {unknown}.")
    classes = tuple(s for s in segments if isinstance(s, type))
    wanted = [canonical_name(s) for s in segments if isinstance(s, str)]
    _check_disjoint(wanted)
    names: list[str] = []
    taken: list[str] = []
    for name, module in modules.items():
        if any(name.startswith(t + ".") for t in taken):
            continue
        if name in wanted or (classes and name and isinstance(module, classes)):
            names.append(name)
            taken.append(name)
    missing_classes = [c.__name__ for c in classes if not any(isinstance(modules[n], c) for n in names)]
    if missing_classes:
        raise ValueError(f"`segments` names module classes the model does not contain: {missing_classes}.")
    return names


#: Note [Names of the regions outside the segments]: the code before the first segment, after
#: each segment (up to the next) and after the last one (the head and the loss) are named from
#: the segments' names in execution order, so that a plan made without a profile (every region
#: offloaded) names the regions a profile would.
PREFIX_REGION = "<prefix>"
TAIL_REGION = "<tail>"


def region_after(segments: "tuple[str, ...] | list[str]", last: Optional[str]) -> str:
    """The region that runs after segment ``last`` (``None``: before any) in a forward over
    ``segments`` (Note [Names of the regions outside the segments])."""
    if last is None:
        return PREFIX_REGION
    if segments and last == segments[-1]:
        return TAIL_REGION
    return f"<after {last}>"


def outside_region_names(segments: "tuple[str, ...] | list[str]") -> tuple[str, ...]:
    """Every region name a forward over ``segments`` can have, in execution order."""
    return (PREFIX_REGION, *(region_after(segments, s) for s in segments))
