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

Note [A sharded segment's forward alone]: the profiler measures what a segment's forward holds
when autograd saves nothing (Note [A forward that does not keep] in ``decide/costmodel.py``) by
running the segment alone. Under FSDP2 that forward gathers the unit's parameters, a
collective, so it runs only where every process runs the same segments in the same order:
:func:`~.measure.profiler.profile` is called on every rank for the same model, and its
segments' calls are the model's, so they are. FSDP2 records each forward for the next
backward's prefetches (``post_forward_order``), which the last backward left empty; the lone
forwards' records are dropped again, so the next step prefetches what it runs. A unit's
parameters are gathered before its lone forward is measured (:func:`unsharded`): gathered
inside it, the all-gather's own buffers (about 130 KiB more on the tests' GPT) would count as
the forward's working set, which in the step they are not; the gathered parameters themselves
are added back from the step's trace. Unmeasured, an offloading segment's forward was priced
as kept: on the tests' GPT at batch 8 per rank 11% over the measured peak (torch 2.14.1).
FSDP1 units keep that price: their forward outside the root's checks the execution order and
is not run alone. A gathered unit runs alone by its own ``forward`` (:func:`unhooked`), as a
recomputation runs it (Note [Recompute under FSDP gathers nothing more]): called as a module,
FSDP's hooks would take the lone call for the root's forward (it would reshard the unit after
it, and, in a backward, gather it again and reduce what it finds in the unsharded gradients).

Note [Sharded segments timed in lockstep]: ``auto`` plans from each segment timed and traced
alone (Note [Timing a segment leaves no trace] and Note [A segment measured alone] in
``measure/action_costs.py``); under FSDP2 they run so on every rank, after the same step, in the
same order, and the only collectives among them are each unit's gather and reshard: every
segment is gathered in the step's order on every rank (:func:`unsharded`), whether or not this
rank runs it (identical blocks share one measurement, and which ones are identical can differ
between ranks: a block's selective choice comes from its own timed ops), and each runs by its
own ``forward`` (:func:`unhooked`), gradients returned by ``autograd.grad``, so no hook
gathers, reduce-scatters or writes a ``.grad``, and a run that fails on one rank only fails
there. That holds when every segment is a unit of its own with no unit inside
(:func:`runs_alone`: the per-block ``fully_shard`` of torchtitan and the tests' GPT); a segment
that is not (its parameters the root's, or units inside it, whose hooks are collectives) is
not run alone, nor is any segment of an FSDP1 model: ``auto`` then bounds plain's peak instead
of predicting it (Note [Observe only what fits] in ``scale/guard.py``). The ranks reuse costs
measured on an earlier step only where every rank has them (``SwapSession``), so all measure
again or none does; each rank measures its own, and the plan is made from the largest (Note
[Decide from the largest measurement] in ``scale/collectives.py``). The lone runs change no
weight, gradient, optimizer state or buffer: ``tests/adapters/test_fsdp.py`` trains ``auto``
on 2 ranks to plain FSDP's weights, bit for bit. A timed segment runs with its unit already
gathered, so its times leave the gather out, as its recomputation's does.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .tensors import local_tensor

__all__ = [
    "gathered_bytes", "gathered_parameters", "is_sharded", "like_shard", "lone_forwards", "runs_alone", "unhooked", "unsharded",
    "units_inside", "world_size",
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


@contextlib.contextmanager
def lone_forwards(model: nn.Module):
    """Whether ``model``'s segments may run their forward alone (Note [A sharded segment's forward
    alone]): unsharded, or FSDP2 only; FSDP2's records of the forwards run inside are dropped."""
    fsdp2 = _class(_FSDP2)
    if not is_sharded(model):
        yield True
        return
    if not _fsdp2_only(model):
        yield False
        return
    try:
        yield True
    finally:
        for m in model.modules():
            if isinstance(m, fsdp2):
                for group in _groups(m):
                    group._post_forward_indices.clear()
                    group.comm_ctx.post_forward_order.clear()


@contextlib.contextmanager
def unsharded(module: nn.Module):
    """An FSDP2 unit's parameters gathered for the body and resharded after (every rank in
    lockstep: Note [A sharded segment's forward alone]); anything else, or a unit gathered
    already, as it is."""
    if not _is_unit(module) or all(g.is_unsharded for g in _groups(module)):
        yield  # gathered already (an enclosing ``unsharded``): left as it is
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def _is_unit(module: nn.Module) -> bool:
    fsdp2 = _class(_FSDP2)
    return fsdp2 is not None and isinstance(module, fsdp2)


def _groups(module: nn.Module) -> list:
    state = module._get_fsdp_state()
    return getattr(state, "_fsdp_param_groups", None) or [g for g in [getattr(state, "_fsdp_param_group", None)] if g]


def _fsdp2_only(model: nn.Module) -> bool:
    fsdp1 = _class(_FSDP1)
    return _class(_FSDP2) is not None and not (fsdp1 is not None and any(isinstance(m, fsdp1) for m in model.modules()))


def runs_alone(model: nn.Module, segments: Iterable[nn.Module]) -> bool:
    """Whether ``model``'s ``segments`` may be timed and traced alone (Note [Sharded segments
    timed in lockstep]): unsharded, or under FSDP2 with every segment a unit of its own and no
    unit inside it."""
    if not is_sharded(model):
        return True
    return _fsdp2_only(model) and all(_is_unit(m) and not units_inside(m) for m in segments)


def unhooked(module: nn.Module) -> Callable[..., object]:
    """What runs ``module`` alone: an FSDP2 unit's own ``forward``, none of FSDP's hooks (its
    parameters gathered first by :func:`unsharded`: Note [A sharded segment's forward alone]);
    anything else the module itself (its hooks run)."""
    return module.forward if _is_unit(module) else module
