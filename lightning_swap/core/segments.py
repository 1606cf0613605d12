"""Cutting a model into segments: the units one :class:`~lightning_swap.Action` applies to.

By default the repeated blocks are found automatically (Note [Finding the blocks]); users may
instead name module classes or qualified module names.

Note [Finding the blocks]: a *block* is a module with submodules of its own whose class occurs
at least twice in the model (ResNet's ``BasicBlock``, a transformer layer, GoogLeNet's
``Inception``, DenseNet's ``_DenseBlock`` and ``_Transition``), the only element of a
``ModuleList`` (ALBERT's one layer, run in a loop), or a plain ``nn.Sequential`` of leaf layers
beside others like it (an MLP chain's blocks). The blocks taken are the outermost, wherever
they are: attributes of the model (GoogLeNet, Inception-v3), a list, nested stages. Plain
containers (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict`` exactly) are walked through,
never taken, so a stage of blocks (ConvNeXt's ``features.5``, nine ``CNBlock``) is cut into its
blocks; so is a block class that holds a list of layers (T5's two ``T5Stack``). Where blocks
are found, their siblings with submodules are segments too (Inception-v3's ``Mixed_6a``, a
stem, ConvNeXt's downsampling layers between stages), and in a plain container the leaf layers
with parameters between them (an MLP chain's head); a leaf without parameters never is, nor an
in-place activation (DenseNet's ``relu0``: as a segment of its own it writes into its input,
which recomputation cannot rerun: Note [Checkpointed segments must not modify their input] in
``engine/recompute.py``). A module registered under two names (tied) is one segment. With no
blocks, the children of the outermost ``nn.Sequential`` are the segments (in-place activations
left out); with none, the model is followed down through the part that holds two thirds of its
parameters to the first module with two or more composite parts, which are the segments; with
none of those, there are no segments and the model trains as it would without the library.
What is left outside the segments (a stem made of leaf layers, the head, the loss) is planned
too, keep or offload, as regions of its own (Note [Regions outside the segments] in
``measure/model_profile.py``); the segments' coverage (``ModelProfile.coverage``) is the part
of a step's saved bytes that can also be recomputed.

Note [A segment per call]: a module may run several times in one step (ALBERT's one layer,
twelve times; a weight-tied or looped block). Each call is its own segment in a profile and a
plan: call 0 keeps the module's name, call ``k`` is ``name#k`` (:func:`call_name`,
:func:`split_call`). The profiler numbers the calls as they run (``measure/trace.py``); the
runtime counts them and runs each call's action (``runtime/calls.py``); a plan or a policy that
names the module alone applies to every call. ``find_segments`` returns module names: how many
times each runs is only known once a step has run.

Note [Canonical segment names]: ``torch.compile(module)`` returns an ``OptimizedModule`` that
holds the module as its child ``_orig_mod``, so after ``self.model = torch.compile(model)`` the
model's ``named_modules()`` calls a block ``model._orig_mod.blocks.0``; compiling one block in a
``ModuleList`` (regional compilation) gives ``blocks.0._orig_mod``. A segment is named as if
nothing were compiled (``model.blocks.0``): the walk looks through every ``OptimizedModule`` to
the module it wraps, names never contain ``_orig_mod``, and :func:`resolve_modules` maps a name
to the live module (the wrapped one, whose ``forward`` the runtime replaces). Names therefore
stay the same whether the user compiles before, after, or not at all, and a policy written for
the eager model applies to the compiled one. ``module.compile()`` changes no name.
FSDP1's ``FullyShardedDataParallel`` (its child ``_fsdp_wrapped_module``) and torch's
``checkpoint_wrapper`` (``_checkpoint_wrapped_module``) are looked through the same way: a
block Lightning's ``FSDPStrategy`` wrapped is still ``model.blocks.0``, and the segment is the
user's module inside, whose forward runs once its unit's parameters are gathered. FSDP2's
``fully_shard`` wraps nothing (it changes the module's class in place), so names never move.

Note [A model that checkpoints itself]: a model may recompute its own blocks (Hugging Face's
``gradient_checkpointing_enable()``, torch's ``checkpoint_wrapper``, ``torch.utils.checkpoint``
called around a block). The plan decides the same blocks' activations: a segment inside the
model's checkpoint has its offload do nothing (the checkpoint saves only its inputs), and its
recomputation nests inside the model's, so ``selective`` caches what the checkpoint dropped
(review ``r2_02``: 1.47x plain's peak, silently). Two owners are not composed: every front end's
session refuses the model at setup (:func:`refuse_own_checkpointing`, from what its modules show),
and a checkpoint the modules do not show (a ``torch.utils.checkpoint`` call in a parent's forward)
is refused by the runtime at the segment's first forward inside it (Note [A user's checkpoint
inside a segment] in ``runtime/runtime.py``), with the same error. A checkpoint *inside* a
segment's forward, around part of it, is the segment's own code: the plan measures and prices
the segment with it, and its action applies around it.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional, Union

from torch import nn

__all__ = [
    "CALL_SEPARATOR", "PREFIX_REGION", "TAIL_REGION", "SegmentSpec", "call_name", "canonical_name", "describe_segments",
    "find_segments", "for_segment", "named_modules", "outside_region_names", "own_checkpointing_error", "refuse_own_checkpointing",
    "region_after", "resolve_modules", "split_call", "unwrap_compiled",
]

SegmentSpec = Union[None, Sequence[Union[str, type]]]

_CONTAINERS = (nn.Sequential, nn.ModuleList)


_WRAPPED = "_orig_mod"
#: (module defining the wrapper class, its name, the child holding the wrapped module).
_WRAPPERS = (
    ("torch._dynamo.eval_frame", "OptimizedModule", _WRAPPED),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel", "_fsdp_wrapped_module"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper", "_checkpoint_wrapped_module"),
)
_WRAPPED_PARTS = frozenset(child for _, _, child in _WRAPPERS)


def _wrapper_child(module: nn.Module) -> str | None:
    # No wrapper can exist before its module is imported: do not import it here.
    for where, cls_name, child in _WRAPPERS:
        cls = getattr(sys.modules.get(where), cls_name, None)
        if cls is not None and isinstance(module, cls):
            return child
    return None


def unwrap_compiled(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``), an FSDP1 wrapper or a
    ``checkpoint_wrapper`` holds; ``module`` itself if it is none (Note [Canonical segment names])."""
    while (child := _wrapper_child(module)) is not None:
        module = getattr(module, child)
    return module


def _checkpoints_itself(model: nn.Module) -> Optional[str]:
    """How ``model`` checkpoints its own activations, as its modules show; ``None`` when they do not."""
    wrapper = getattr(sys.modules.get("torch.distributed.algorithms._checkpoint.checkpoint_wrapper"), "CheckpointWrapper", ())
    for module in model.modules():
        for flag in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # Hugging Face (transformers 5 / 4)
            if isinstance(getattr(type(module), flag, None), property):
                if getattr(module, flag):
                    return f"{type(module).__name__} has its own activation checkpointing on (gradient_checkpointing_enable())"
                break
        if isinstance(module, wrapper):
            return f"{type(module).__name__} wraps {type(module._checkpoint_wrapped_module).__name__} in torch's checkpoint_wrapper"
    return None


def own_checkpointing_error(how: str, *, library_off: str = "train without lightning-swap") -> ValueError:
    """Note [A model that checkpoints itself]: the error naming both owners and the two ways out."""
    return ValueError(
        f"{how}, and lightning-swap's policy would decide each block's activations again (inside the model's checkpoint "
        "the plan's offload does nothing and its recomputation runs nested in the model's, above plain training's peak). "
        "Use one of them: switch the model's checkpointing off (model.gradient_checkpointing_disable(), or no "
        "checkpoint_wrapper / torch.utils.checkpoint around the blocks) and let the policy decide (policy='recompute' "
        f"checkpoints every block, policy='auto' chooses per block), or {library_off}."
    )


def refuse_own_checkpointing(model: nn.Module, *, library_off: str = "train without lightning-swap") -> None:
    """Note [A model that checkpoints itself]: every front end's session calls this at setup."""
    how = _checkpoints_itself(model)
    if how is not None:
        raise own_checkpointing_error(how, library_off=library_off)


#: Note [A segment per call]: call ``k`` (from 0) of a module run several times in one step.
CALL_SEPARATOR = "#"


def call_name(name: str, call: int) -> str:
    """The segment of call ``call`` of module ``name``: ``name`` itself for the first call,
    ``name#k`` for the others (Note [A segment per call])."""
    return name if call == 0 else f"{name}{CALL_SEPARATOR}{call}"


def split_call(name: str) -> tuple[str, int]:
    """``(module name, call)`` of a segment name (Note [A segment per call])."""
    module, sep, call = name.rpartition(CALL_SEPARATOR)
    if sep and call.isdigit():
        return module, int(call)
    return name, 0


def for_segment(mapping: Mapping[str, Any], name: str) -> Any:
    """``mapping``'s entry for segment ``name``, else its module's (a plan may name a module run
    several times once, for every call: Note [A segment per call]); ``None`` where neither."""
    return mapping.get(name, mapping.get(split_call(name)[0]))


def canonical_name(name: str) -> str:
    """``name`` without the parts wrappers add (``_orig_mod``, ``_fsdp_wrapped_module``,
    ``_checkpoint_wrapped_module``)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPED_PARTS)


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

    ``names`` are canonical (an ``_orig_mod`` part is looked through as well), a call's segment
    (``name#k``) is its module's; a name the model does not have is a ``ValueError`` naming ``field``.
    """
    modules = dict(named_modules(model))
    found: dict[str, nn.Module] = {}
    unknown = []
    for name in names:
        module = modules.get(canonical_name(split_call(name)[0])) if name else None
        if module is None:
            unknown.append(name)
        else:
            found[name] = module
    if unknown:
        raise ValueError(f"`{field}` names modules the model does not have: {unknown}.")
    return found


def _is_leaf(module: nn.Module) -> bool:
    return next(iter(unwrap_compiled(module).children()), None) is None


_GENERIC = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Module)


def _generic(module: nn.Module) -> bool:
    """A plain container (these exact classes; a bare ``nn.Module`` is a namespace, it has no
    forward): a list of layers or a stage, never a block by itself. Subclasses with a forward of
    their own (``_DenseBlock``, ``Conv2dNormActivation``) are blocks."""
    return type(module) in _GENERIC


def _kids(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, unwrap_compiled(c)) for n, c in module._modules.items() if c is not None]


def _composite(module: nn.Module) -> bool:
    return any(not _is_leaf(c) for _, c in _kids(module))


def _in_place(module: nn.Module) -> bool:
    return getattr(module, "inplace", False) is True


class _Finder:
    """Note [Finding the blocks]."""

    def __init__(self, model: nn.Module) -> None:
        self.root = unwrap_compiled(model)
        modules = [m for _, m in named_modules(model)]
        counts = Counter(type(m) for m in modules[1:] if not _is_leaf(m) and not _generic(m))
        self.repeated = {cls for cls, n in counts.items() if n >= 2}
        self._has: dict[int, bool] = {}
        self._seen: set[int] = set()

    def layer_list(self, container: nn.Module) -> bool:
        """A list of layers: a plain container of composite modules of one class, two or more (one
        in a ``ModuleList``: ALBERT's layer group of one layer, run in a loop)."""
        kids = [c for _, c in _kids(container)]
        if not kids or not _generic(container) or len({type(c) for c in kids}) != 1 or not all(map(_composite, kids)):
            return False
        return len(kids) >= 2 or type(container) is nn.ModuleList

    def stage(self, module: nn.Module) -> bool:
        """A module that holds a list of layers (T5's ``T5Stack``, a custom stage class): cut into them."""
        pending = [c for _, c in _kids(module) if _generic(c)]
        while pending:
            container = pending.pop()
            if self.layer_list(container):
                return True
            pending.extend(c for _, c in _kids(container) if _generic(c))
        return False

    def block(self, module: nn.Module, parent: nn.Module) -> bool:
        if _is_leaf(module):
            return False
        if _generic(module):  # a plain group of layers, repeated beside others (an MLP chain's blocks)
            groups = [c for _, c in _kids(parent) if _generic(c) and not _composite(c) and type(c) is type(module)]
            return not _composite(module) and len(groups) >= 2
        if self.stage(module):
            return False
        return type(module) in self.repeated or (type(parent) is nn.ModuleList and len(parent) == 1)

    def has_blocks(self, module: nn.Module) -> bool:
        key = id(module)
        if key not in self._has:
            self._has[key] = any(self.block(c, module) or self.has_blocks(c) for _, c in _kids(module))
        return self._has[key]

    def visit(self, prefix: str, module: nn.Module) -> list[str]:
        kids = [(f"{prefix}.{n}" if prefix else n, c) for n, c in _kids(module)]
        out: list[str] = []
        level = any(self.block(c, module) for _, c in kids)
        stages = _generic(module) and any(_generic(c) and self.has_blocks(c) for _, c in kids)
        for name, child in kids:
            if id(child) in self._seen:
                continue  # a module registered twice (tied): one name, its first
            if level and self.block(child, module):
                self._take(out, name, child)
            elif (level or stages) and not _is_leaf(child):
                if (_generic(child) or self.stage(child)) and self.has_blocks(child):
                    out += self.visit(name, child)
                else:  # beside the blocks: Inception-v3's Mixed_6a, a stem, a downsampling layer
                    self._take(out, name, child)
            elif level and _generic(module) and _is_leaf(child):
                if not _in_place(child) and next(child.parameters(), None) is not None:
                    self._take(out, name, child)  # a layer between blocks in a chain (a head, a norm)
            elif not _is_leaf(child) and self.has_blocks(child):
                out += self.visit(name, child)
        return out

    def _take(self, out: list[str], name: str, module: nn.Module) -> None:
        self._seen.add(id(module))
        out.append(name)


def _repeated_blocks(model: nn.Module) -> list[str]:
    return _Finder(model).visit("", unwrap_compiled(model))


def _flat_chain(model: nn.Module) -> list[str]:
    for name, module in named_modules(model):
        if isinstance(module, nn.Sequential):
            prefix = f"{name}." if name else ""
            return [prefix + child_name for child_name, child in module.named_children() if not _in_place(unwrap_compiled(child))]
    return []


def _parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _largest_modules(model: nn.Module) -> list[str]:
    """The fallback when nothing repeats: from the model down, through a child that holds most of
    its parent's parameters, to the first module with two or more composite parts: those parts."""
    prefix, module = "", unwrap_compiled(model)
    while True:
        kids = [(f"{prefix}.{n}" if prefix else n, c) for n, c in _kids(module) if not _is_leaf(c)]
        total = max(_parameter_bytes(module), 1)
        dominant = [(n, c) for n, c in kids if _composite(c) and _parameter_bytes(c) * 3 >= total * 2]
        if len(kids) == 1 or dominant:
            prefix, module = (dominant or kids)[0]
            continue
        return [n for n, _ in kids] if len(kids) >= 2 else []


def describe_segments(names: Sequence[str], *, shown: int = 4) -> str:
    """A list of segments for a log line: all names, or the first and last few of a long list."""
    if len(names) <= 2 * shown:
        return ", ".join(names)
    return ", ".join(names[:shown]) + f", … ({len(names) - 2 * shown} more), " + ", ".join(names[-shown:])


def _check_disjoint(names: Sequence[str]) -> None:
    ordered = sorted(names)
    for a, b in zip(ordered, ordered[1:]):
        if a == b:
            raise ValueError(f"`segments` names {a!r} twice.")
        if b.startswith(a + "."):
            raise ValueError(f"`segments` must not nest: {b!r} is inside {a!r}.")


def find_segments(model: nn.Module, segments: SegmentSpec = None) -> list[str]:
    """Qualified names of the model's segments, in registration order (Note [Finding the blocks]
    for ``segments=None``); possibly none, never an error for ``None``: a model with nothing to
    cut trains as it would without the library.

    Registration order is the execution order for the chains this library targets; the
    profiler records the order actually executed. Names are canonical: the same for a compiled
    model as for the eager one (Note [Canonical segment names]).
    """
    if segments is None:
        return _repeated_blocks(model) or _flat_chain(model) or _largest_modules(model)
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
#: offloaded) names the regions a profile would. A module run several times is a segment per
#: call (Note [A segment per call]): the region after call ``k`` is ``<after name#k>``; in a plan
#: that names the module alone, every call's region is the one after the module.
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
