"""Cutting a model into segments: the units one :class:`~lightning_swap.Action` applies to.

By default the repeated blocks are found automatically: the children of ``nn.Sequential`` /
``nn.ModuleList`` containers that hold at least two non-leaf modules of one class (ResNet
bottlenecks, transformer layers). A model with no such container (a flat ``nn.Sequential``
of layers) falls back to every child of its outermost ``nn.Sequential``: each layer is then
its own segment, which offload serves well and recompute hardly at all (a one-op segment
keeps its input, which is as big as what it would have saved).
Users may instead name module classes or qualified module names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Union

from torch import nn

__all__ = ["SegmentSpec", "find_segments"]

SegmentSpec = Union[None, Sequence[Union[str, type]]]

_CONTAINERS = (nn.Sequential, nn.ModuleList)


def _is_leaf(module: nn.Module) -> bool:
    return next(iter(module.children()), None) is None


def _repeated_blocks(model: nn.Module) -> list[str]:
    names: list[str] = []
    taken: list[str] = []  # prefixes already inside a chosen segment

    for name, module in model.named_modules():
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        if not isinstance(module, _CONTAINERS):
            continue
        children = list(module.named_children())
        counts = Counter(type(c) for _, c in children if not _is_leaf(c))
        if not counts or max(counts.values()) < 2:
            continue
        for child_name, _ in children:
            full = f"{name}.{child_name}" if name else child_name
            names.append(full)
            taken.append(full)
    return names


def _flat_chain(model: nn.Module) -> list[str]:
    for name, module in model.named_modules():
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
    profiler records the order actually executed.
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
    modules = dict(model.named_modules())
    bad = [s for s in segments if not isinstance(s, (str, type))]
    if bad:
        raise ValueError(f"`segments` entries must be module classes or names; got {bad!r}.")
    unknown = [s for s in segments if isinstance(s, str) and (s not in modules or s == "")]
    if unknown:
        raise ValueError(f"`segments` names modules the model does not have: {unknown}.")
    classes = tuple(s for s in segments if isinstance(s, type))
    wanted = [s for s in segments if isinstance(s, str)]
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
