"""Tensors inside a step's objects, devices, and the hooks every layer uses.

Shared vocabulary: walks of nested batches and optimizer states (``torch.utils._pytree``),
storage-deduplicated byte counts, device names, the batch size of a batch, the loss of a step's
return value, the budget a CUDA device offers, and the hook that fires when a tensor's backward
starts. Imports torch only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .compiled import dynamo_disable, note_compiled_callers

__all__ = [
    "CUDA_BUDGET_MARGIN", "ModuleHook", "device_budget_bytes", "gradient_bytes", "infer_batch_size", "is_kv_cache",
    "local_tensor", "loss_of", "normalize_device", "on_backward_start", "pop_saved_tensors_hooks", "storage_bytes", "tensors_in",
]


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside a (nested) batch or optimizer state: torch's pytree walk, which also
    opens the containers pytree leaves whole (other mappings, sets, dataclasses)."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        for leaf in tree_leaves(stack.pop()):
            if isinstance(leaf, torch.Tensor):
                out.append(leaf)
            elif isinstance(leaf, Mapping):
                stack.extend(leaf.values())
            elif isinstance(leaf, (list, tuple, set, frozenset)):
                stack.extend(leaf)
            elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
                stack.extend(getattr(leaf, f.name) for f in dataclasses.fields(leaf))
    return out


def is_kv_cache(value: Any) -> bool:
    """A generation library's key/value cache (``transformers``' ``Cache``: ``DynamicCache``,
    ``EncoderDecoderCache``, ``StaticCache``, ...), known by its interface: a class named
    ``...Cache`` in its hierarchy with ``update`` and ``get_seq_length`` (the core imports torch
    only). A layer given one writes its keys into it (Note [A recomputed segment fills no cache]
    in ``engine/recompute.py``)."""
    if isinstance(value, (torch.Tensor, nn.Module, type)):
        return False
    named = any(c.__name__.endswith("Cache") for c in type(value).__mro__)
    return named and callable(getattr(value, "update", None)) and hasattr(value, "get_seq_length")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s bytes on this process: a ``DTensor``'s local shard
    (FSDP2's parameters, their gradients and optimizer state: Note [Sharded state is local]
    in ``sharded.py``), else ``t`` itself. A wrapper subclass has no storage of its own."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shared storages once; a
    ``DTensor``'s local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = local_tensor(t).untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the parameters' gradients alive now (distinct storages)."""
    return storage_bytes(p.grad for p in model.parameters() if p.grad is not None)


def on_backward_start(output: Any, callback: Any) -> None:
    """Call ``callback()`` once, when the first gradient of a tensor in ``output`` arrives:
    the moment the backward of whatever produced ``output`` starts."""
    fired = [False]

    @dynamo_disable  # never traced (compiled autograd): Note [Actions around compiled segments]
    def on_grad(grad: torch.Tensor) -> None:
        if not fired[0]:
            fired[0] = True
            callback()

    for t in tensors_in(output):
        if t.requires_grad:
            t.register_hook(on_grad)


def normalize_device(device: torch.device | str) -> torch.device:
    """``cuda`` gets its index; ``cpu:N`` (Accelerate's multi-CPU device) is plain ``cpu``,
    which is what CPU tensors report, so device comparisons hold."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        return torch.device("cpu")
    return device


def _inert_hook(*args: Any, **kwargs: Any) -> None:
    return None


class ModuleHook:
    """A module hook of a runtime. Copied with the model (``copy.deepcopy``, ``pickle``), it
    becomes a hook that does nothing: the runtime belongs to the original model only
    (Note [Copies of a planned model])."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    @dynamo_disable  # Note [Actions around compiled segments]
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        note_compiled_callers(self)  # Note [Nothing compiled under the runtime outlives it]
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        return (_inert_hook_factory, ())


def _inert_hook_factory() -> Any:
    return _inert_hook


#: Held back from the free device memory when no budget is given (allocator fragmentation,
#: CUDA context growth, what the model does not predict).
CUDA_BUDGET_MARGIN = 0.10


def device_budget_bytes(device: torch.device) -> Optional[int]:
    """What this process may use on a CUDA device: free memory plus what torch already holds,
    less :data:`CUDA_BUDGET_MARGIN`; ``None`` on other devices (a budget must be given)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int((free + torch.cuda.memory_reserved(device)) * (1 - CUDA_BUDGET_MARGIN))


def loss_of(value: Any) -> torch.Tensor:
    if isinstance(value, dict) and "loss" in value:
        value = value["loss"]
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"`step_fn` must return a tensor or a dict with 'loss'; got {type(value).__name__}.")
    return value if value.dim() == 0 else value.float().sum()


def infer_batch_size(batch: Any) -> int:
    t = next((t for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if t is None:
        raise ValueError("`batch_size` could not be inferred: the batch holds no tensor; pass batch_size=.")
    return int(t.shape[0])


def pop_saved_tensors_hooks(pack: Any) -> bool:
    """Take the saved-tensor hooks whose pack hook is ``pack`` off torch's global stack wherever
    they are, putting back those above them in their order (Note [Hooks never outlive the
    library]); ``False`` where they were not on it.

    Note [Hooks never outlive the library]: torch's saved-tensor hooks are one stack for the whole
    thread, and a ``saved_tensors_hooks`` context pops whatever is on top when it exits. A step
    that ends in an unexpected place (a second forward before the backward, a forward with no
    backward, an exception, a user's own hooks entered during the step and left open) can leave
    the library's hooks under someone else's; popping the top then removes the wrong pair, and
    leaving them makes every later backward in the process run the library's unpack on tensors it
    never packed. So the library takes exactly its own pair off, wherever it is, at the step's end,
    after an exception and at teardown."""
    autograd = torch._C._autograd
    above = []
    while True:
        top = autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            found = False
            break
        autograd._pop_saved_tensors_default_hooks()
        if top[0] is pack:
            found = True
            break
        above.append(top)
    for hooks in reversed(above):
        autograd._push_saved_tensors_default_hooks(*hooks)
    return found
