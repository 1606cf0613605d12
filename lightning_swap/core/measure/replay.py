"""A segment's call, captured in the step that ran it, to be run again on its own.

:mod:`.action_costs` times each segment alone after an observed step (Note [Timing a segment
leaves no trace] there) and traces it alone under a plan (Note [A segment measured alone]); what
it runs is the call captured here, in the segment's forward pre-hook (:class:`~.trace.StepTracer`).

Note [A replay has no side effects]: a replay runs what the step ran, and nothing it does may
reach an object of the user's. A layer's arguments are not all tensors: Hugging Face layers get
the step's key/value cache (``transformers``' ``DynamicCache``, passed as ``cache`` or
``past_key_values``, positionally by GPT-2's blocks), into which they write their keys and values
in place, and the model's config makes one in training too (``use_cache=True`` is the default of
GPT-2's and Llama's configs). Kept by reference, the cache was the step's, filled by the time the
segments ran again: each replay concatenated its keys onto the step's (a longer attention than
the step's), its backward reached into the step's freed graph ("Trying to backward through the
graph a second time"), every segment's timing failed, and ``auto`` stayed on its lowest-memory
plan for as long as the shape lasted (GPT-2, 3 blocks: 23.1 MiB used of a 40.75 MiB budget,
where with ``use_cache=False`` it planned a mix). Holding it also kept every layer's keys alive
past the step. So, when the call is captured:

- a key/value cache (:func:`~..tensors.is_kv_cache`, by its interface) becomes ``None``, and a
  ``use_cache=True`` keyword becomes ``False``: the layer runs as under transformers' own
  gradient checkpointing (Note [A recomputed segment fills no cache] in ``engine/recompute.py``,
  which the runtime applies to a recomputed segment). What the replay leaves out is the cache's
  copy of the layer's keys and values (one ``torch.cat`` each): the step's own windows count it
  (the cache holds it, whatever the plan), and a segment's saved bytes measured alone do not;
- tensors are copies (small ones by value, large ones re-made from their shape), as before;
- any other object that is neither immutable nor callable (a config, a counter the layer bumps)
  is deep-copied for each replay, so the replay writes into its own copy; one that cannot be copied
  (it holds a tensor of the autograd graph) is passed as it is, and is the only thing a replay can
  still write into. The copy is made when the replay runs, not in the step: an object holding
  device tensors copied in the step's forward would raise the step's measured peak on CUDA;

and around the replays (:func:`module_state`), every module's attributes and buffers bound again
to what they were (a layer that counts its calls in ``self.calls``, or swaps a buffer for a new
tensor), besides the buffers' values and the RNG (Note [Timing a segment leaves no trace]).
``tests/measure/test_replays.py`` checks that the cache, the batch and the parameters are
bit-identical after profiling, on GPT-2 and Llama at their default settings.

A segment whose replay still fails is planned without it (Note [A segment that cannot be
replayed] in ``observe.py``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

from ..tensors import is_kv_cache

__all__ = ["CapturedCall", "module_state"]

#: Tensors up to this size are kept by value for re-running a segment; larger ones by shape only.
_CAPTURE_BY_VALUE_BYTES = 1 << 20

#: Immutable values, passed to a replay as they are.
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor):
            return t
    return None


class _Copied:
    """An argument that is neither a tensor, immutable, nor callable (Note [A replay has no side
    effects]): each :meth:`fresh` is a new deep copy of it (it itself where it cannot be copied)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def fresh(self) -> Any:
        try:
            with torch.no_grad():
                return copy.deepcopy(self.value)
        except Exception:  # noqa: BLE001 - e.g. a tensor of the autograd graph inside: passed as it is
            return self.value


def _is_marker(v: Any) -> bool:
    return isinstance(v, tuple) and bool(v) and v[0] in ("value", "shape")


def _is_capture_leaf(v: Any) -> bool:
    """What the capture stops at: a cache (some register theirs as pytree nodes, for export) and a
    module are taken whole."""
    return is_kv_cache(v) or isinstance(v, nn.Module)


class CapturedCall:
    """How a segment was called, enough to call it again for timing: non-tensor arguments as they
    were, copied (Note [A replay has no side effects]: a key/value cache left out), small tensors
    (masks, positions, indices) copied, large ones as shape and dtype (re-made at random: their
    values do not change how long a block takes, and keeping them would change the memory the
    trace measures). ``dropped``: what was left out (for the log)."""

    __slots__ = ("args", "kwargs", "autocast", "dropped")

    def __init__(self, args: tuple, kwargs: dict, autocast: Optional[tuple], dropped: tuple[str, ...] = ()) -> None:
        self.args = args
        self.kwargs = kwargs
        self.autocast = autocast
        self.dropped = dropped

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> "CapturedCall":
        from ..engine.meter import host_allocation

        dropped: list[str] = []

        def keep(t: Any) -> Any:
            if is_kv_cache(t):
                dropped.append(type(t).__name__)
                return None  # Note [A replay has no side effects]
            if isinstance(t, torch.Tensor):
                if t.numel() * t.element_size() <= _CAPTURE_BY_VALUE_BYTES or not t.is_floating_point():
                    with torch.no_grad(), host_allocation():
                        return ("value", t.detach().clone(), t.requires_grad)
                return ("shape", tuple(t.shape), t.dtype, t.device, t.requires_grad)
            return t if isinstance(t, _ATOMS) or callable(t) else _Copied(t)  # a module, a function: as they are

        first = _first_tensor(args) if args else _first_tensor(kwargs)
        autocast = None
        if first is not None and torch.is_autocast_enabled(first.device.type):
            autocast = (first.device.type, torch.get_autocast_dtype(first.device.type))
        captured_args = tree_map(keep, args, is_leaf=_is_capture_leaf)
        captured_kwargs = tree_map(keep, kwargs, is_leaf=_is_capture_leaf)
        if captured_kwargs.get("use_cache") is True:
            captured_kwargs["use_cache"] = False  # Note [A replay has no side effects]
            dropped.append("use_cache=True")
        return cls(captured_args, captured_kwargs, autocast, tuple(dropped))

    def signature(self) -> tuple:
        """What the call's cost depends on: each argument's kind, shape and dtype (values left
        out), the non-tensor arguments, and the autocast state."""

        def part(v: Any) -> Any:
            if _is_marker(v):
                return ("value", tuple(v[1].shape), v[1].dtype, v[2]) if v[0] == "value" else v
            if isinstance(v, _Copied):
                return type(v.value).__name__
            return v if isinstance(v, (int, float, bool, str, type(None))) else type(v).__name__

        leaves, spec = tree_flatten((self.args, self.kwargs), is_leaf=_is_marker)
        return (str(spec), tuple(part(v) for v in leaves), self.autocast)

    def make(self) -> tuple[tuple, dict]:
        """Fresh arguments: tensors that required grad require it again (outputs of a copy, not
        leaves, as in the step: a segment may write into its input); every other mutable object a
        new copy (Note [A replay has no side effects])."""

        def fresh(v: Any) -> Any:
            if isinstance(v, _Copied):
                return v.fresh()
            if _is_marker(v) and v[0] == "value":
                t, rg = v[1].clone(), v[2]
            elif _is_marker(v):
                _, shape, dtype, device, rg = v
                t = torch.randn(shape, dtype=dtype, device=device)
            else:
                return v
            # Not a leaf, as it was not in the step: a segment may write into its input in place.
            return t.requires_grad_(True).clone() if rg else t

        return tree_map(fresh, self.args, is_leaf=_is_marker), tree_map(fresh, self.kwargs, is_leaf=_is_marker)


_MISSING = object()


@contextlib.contextmanager
def module_state(model: nn.Module) -> Iterator[None]:
    """Note [A replay has no side effects]: every module's attributes and its buffers' bindings as
    they were on entry, once the block exits: an attribute a replay set is removed, one it bound
    anew bound back (the buffers' values are restored by the caller, Note [Timing a segment leaves
    no trace])."""
    saved = [(m, dict(m.__dict__), dict(m._buffers), dict(m._parameters)) for m in model.modules()]
    try:
        yield
    finally:
        for m, attrs, buffers, params in saved:
            for table, before in ((m.__dict__, attrs), (m._buffers, buffers), (m._parameters, params)):
                for key in [k for k in table if k not in before]:
                    del table[key]
                for key, value in before.items():
                    if table.get(key, _MISSING) is not value:
                        table[key] = value
