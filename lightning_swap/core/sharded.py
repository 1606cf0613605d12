"""Sharded models (FSDP2's ``fully_shard``, FSDP1's ``FullyShardedDataParallel``): what the
runtime, the meter and the profiler need to know about them.

Note [Sharded state is local]: under FSDP2 a module's parameters are ``DTensor`` shards
between steps, and so are their gradients and optimizer state; the bytes this process holds
are each one's local tensor (:func:`~lightning_swap.core.tensors.local_tensor`), which is what
the meter counts and the profile's static bytes hold: 1/world of the model's state, as
measured on the rank, never assumed. During a unit's forward and backward FSDP gathers its
full parameters into buffers that it frees again afterwards (``reshard_after_forward``) by
resizing their storage (Note [Storages resized in place] in ``engine/meter.py``); autograd
saves those gathered parameters, and they are not activations: the profiler does not count
them as saved bytes and the offload engine never copies them (FSDP frees and gathers them
itself). They, the next unit's prefetched parameters and the reduce-scatter buffers of the
backward are inside every measured window of the step, the same under every plan.

Note [Recompute under FSDP gathers nothing more]: recomputing a segment happens inside its
backward, after FSDP's pre-backward hook gathered its unit's parameters for that backward, and
the recomputed forward calls the segment's ``forward`` (not the module, so no FSDP forward hook
runs). Units nested inside a recomputed segment are called as modules, and FSDP2 gathers such a
unit there instead of in its own pre-backward (its backward finds it gathered). Counted on CPU
(torch 2.15, gloo, 2 ranks; per-block units, and two units inside each segment): a step gathers
as often under ``recompute`` as under ``keep`` (``tests/runtime/test_fsdp_core.py`` counts them), so
the plan adds no communication for recomputation, only the compute the cost model already
prices; the gathered bytes are in the backward window's measured base.

Note [Selective around FSDP hooks]: selective checkpointing (torch's SAC) replays the ops of a
segment's forward by their order, and treats the profiler annotations FSDP's hooks make
(``record_function``) as effects that must recur identically in the recomputation. A unit
nested inside a segment runs its hooks inside that region, and they need not: FSDP1 units
wrapped inside a block (its BatchNorms, wrapped one by one when a mixed-precision policy is set,
as Lightning does) under ``SHARD_GRAD_OP`` make torch raise "profiler._record_function_enter_new
... encountered during backward but not found in storage" (reproduced on CPU; ``FULL_SHARD``
happened to match). So ``SELECTIVE`` is not used on a segment that holds an FSDP unit of its
own: a forced plan is refused naming the segment and its units, and ``auto`` and the batch-size
search plan without it (:func:`units_inside`). A segment that is one unit (its hooks run
around the region, not in it) and an unsharded model keep every action.

Note [Sharded steps are traced on every rank]: ``auto`` learns from the steps the user runs
(Note [Auto learns from the steps it runs] in ``scale/auto.py``): under FSDP every rank traces
the same step, each its own part of it, and the plan is made from the largest of every rank's
measurements (Note [Decide from the largest measurement] in ``scale/collectives.py``). No segment
is run alone: a unit's forward run outside the step is a collective the other ranks would have to
join, and changes FSDP's records of the step. The budget held online never moves a segment to a
recomputing action under FSDP (Note [The budget held online] in ``runtime/online.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .tensors import local_tensor

__all__ = [
    "gathered_bytes", "gathered_parameters", "is_sharded", "like_shard", "units_inside", "world_size",
]

_FSDP2 = ("torch.distributed.fsdp", "FSDPModule")
_FSDP1 = ("torch.distributed.fsdp", "FullyShardedDataParallel")


def _class(where: tuple[str, str]) -> type | None:
    # A sharded module cannot exist before its module is imported: do not import it here.
    return getattr(sys.modules.get(where[0]), where[1], None)


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 or FSDP1 shards any part of ``model`` (or the wrapper holding it)."""
    classes = tuple(c for c in (_class(_FSDP2), _class(_FSDP1)) if c is not None)
    if not classes:
        return False
    return any(isinstance(m, classes) for m in model.modules()) or any(_is_dtensor(p) for p in model.parameters())


def units_inside(module: nn.Module) -> list[str]:
    """Names (relative to ``module``) of the FSDP units strictly inside ``module``: FSDP1
    wrappers, and FSDP2 modules below ``module`` itself (Note [Selective around FSDP hooks])."""
    classes = tuple(c for c in (_class(_FSDP2), _class(_FSDP1)) if c is not None)
    if not classes:
        return []
    return [name for name, m in module.named_modules() if name and isinstance(m, classes)]


def _is_dtensor(t: torch.Tensor) -> bool:
    return local_tensor(t) is not t


def world_size(model: nn.Module) -> int:
    """How many processes the model's parameters are sharded over (1 when it is not sharded)."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return int(mesh.size())
    if is_sharded(model) and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def gathered_parameters(module: nn.Module) -> list[torch.Tensor]:
    """The tensors holding ``module``'s parameters now: inside an FSDP2 unit's forward the
    gathered ones (FSDP registers them in the shards' place; FSDP1 points the user's parameters
    into its gathered flat parameter), else the parameters themselves (a shard's local tensor)."""
    return [local_tensor(p) for p in module.parameters()]


def gathered_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (one gathered flat parameter once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


def like_shard(shard: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function making a copy of ``shard``'s local tensor into a tensor like ``shard``: a
    ``DTensor`` on the same mesh and placements, or the copy itself. Keeps ``shard``'s metadata,
    never ``shard`` (a profiler's snapshot must not keep the gradients it copied alive)."""
    if not _is_dtensor(shard):
        return lambda local: local
    cls, mesh, placements, shape, stride = type(shard), shard.device_mesh, shard.placements, shard.shape, shard.stride()
    return lambda local: cls.from_local(local, mesh, placements, shape=shape, stride=stride, run_check=False)
