"""The core under FSDP in one process (issue 21 items 3 and 4): the CPU meter follows FSDP's
storage resizes and counts shards by their local tensor, gathered parameters are never
offloaded nor counted as saved activations, segments are named through FSDP1 and checkpoint
wrappers, profiles from several ranks merge by their largest values. What needs two ranks (the
predictions per rank, the gathers counted) runs in ``tests/adapters/test_fsdp.py``'s job.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_swap import Action, DeviceMemoryMeter, Plan, SwapRuntime, find_segments, profile
from lightning_swap.core.measure.model_profile import max_profile
from lightning_swap.core.segments import resolve_modules
from lightning_swap.core.sharded import gathered_parameters, is_sharded, world_size

from ..helpers import free_port
from ..models import MODELS, TinyGPT


@pytest.fixture(scope="module")
def one_process_group():
    """A gloo group of one process: FSDP shards over it (everything gathered is a copy)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_gpt() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


# -- the meter -------------------------------------------------------------------------------
def test_meter_follows_storages_resized_in_place():
    """Note [Storages resized in place]: a tracked storage's bytes follow ``resize_``; one grown
    from nothing inside the window is counted; the method is torch's own again afterwards."""
    original = torch.UntypedStorage.resize_
    a = torch.zeros(1 << 16)  # 256 KiB, alive before the window
    b = torch.empty(0)
    with DeviceMemoryMeter("cpu") as outer:
        outer.track([a])
        with DeviceMemoryMeter("cpu") as inner:
            assert outer.current_bytes == 1 << 18 and inner.current_bytes == 0
            a.untyped_storage().resize_(0)
            assert outer.current_bytes == 0
            b.untyped_storage().resize_(1 << 10)  # an allocation the dispatcher never saw
            a.untyped_storage().resize_(1 << 18)
            assert inner.current_bytes == outer.current_bytes == (1 << 18) + (1 << 10)
        assert torch.UntypedStorage.resize_ is not original  # the outer meter still listens
        assert outer.peak_bytes == (1 << 18) + (1 << 10)
    assert torch.UntypedStorage.resize_ is original


def test_meter_counts_a_dtensor_by_its_local_shard(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    shard = distribute_tensor(torch.zeros(256, 4), mesh, [Shard(0)])
    with DeviceMemoryMeter("cpu") as meter:
        meter.track([shard])
        assert meter.current_bytes == 256 * 4 * 4


# -- segments and the runtime under FSDP ----------------------------------------------------
def test_segments_are_named_through_fsdp1_and_checkpoint_wrappers(one_process_group):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from ..models import ConvBlock, cnn_bn_dropout

    cnn = cnn_bn_dropout()
    wrapped = FullyShardedDataParallel(cnn, auto_wrap_policy=ModuleWrapPolicy({ConvBlock}), device_id=torch.device("cpu"))
    names = find_segments(wrapped)
    assert names == [f"blocks.{i}" for i in range(4)]
    assert all(type(m) is ConvBlock for m in resolve_modules(wrapped, names).values())
    assert is_sharded(wrapped) and world_size(wrapped) == 1
    gpt = TinyGPT()
    gpt.blocks[1] = checkpoint_wrapper(gpt.blocks[1])
    assert find_segments(gpt) == [f"blocks.{i}" for i in range(4)]
    assert not is_sharded(gpt)


def _offloaded_plan(names):
    return {n: Action.OFFLOAD for n in names}


@pytest.mark.parametrize("plan_for", [_offloaded_plan, Plan.lowest_memory], ids=["offload", "lowest-memory"])
def test_gathered_parameters_are_never_offloaded(one_process_group, plan_for):
    """Note [What is never offloaded]: under FSDP2 the parameters autograd saves are the gathered
    copies, which FSDP frees and gathers again itself: offloading moves exactly the activations
    the unsharded model's offload moves, and training gives the same weights. With the regions
    outside the segments offloaded too (the lowest-memory plan), the root unit's parameters the
    embedding and the head save are neither offloaded nor counted as saved (Note [Regions
    outside the segments under FSDP] in ``engine/offload.py``)."""
    x, y = MODELS["gpt"][1](4)
    results = {}
    for sharded in (False, True):
        model = sharded_gpt() if sharded else (torch.manual_seed(0), TinyGPT())[1]
        runtime = SwapRuntime(model, plan_for(find_segments(model)), min_offload_bytes=0, device="cpu").install()
        runtime.begin_step([x, y])
        torch.manual_seed(1)
        MODELS["gpt"][2](model(x), y).backward()
        stats = runtime.end_step()
        runtime.remove()
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
        results[sharded] = (stats.offloaded_bytes, stats.saved_bytes, stats.unplanned_bytes, grads)
    assert results[True][:3] == results[False][:3] and results[True][0] > 0
    assert all(torch.equal(a, b) for a, b in zip(results[True][3], results[False][3]))


def test_a_sharded_model_is_profiled_for_real_only(one_process_group):
    model = sharded_gpt()
    with pytest.raises(ValueError, match="`fake`"):
        profile(model, MODELS["gpt"][1](2), step_fn=lambda m, b: MODELS["gpt"][2](m(b[0]), b[1]), fake=True, device="cpu")


def test_the_profile_leaves_gathered_parameters_out_of_saved_bytes(one_process_group):
    """The trace counts a sharded block's saved activations as the unsharded model's, and its
    gathered parameters on their own (0 for the unsharded model)."""
    batch = MODELS["gpt"][1](2)
    step = lambda m, b: MODELS["gpt"][2](m(b[0]), b[1])  # noqa: E731
    plain = profile((torch.manual_seed(0), TinyGPT())[1], batch, step_fn=step, scale=False, min_offload_bytes=0, device="cpu")
    sharded = profile(sharded_gpt(), batch, step_fn=step, scale=False, min_offload_bytes=0, device="cpu")
    block_bytes = sum(p.numel() * 4 for p in TinyGPT().blocks[0].parameters())
    assert [s.saved_bytes for s in sharded.segments] == [s.saved_bytes for s in plain.segments]
    assert [s.gathered_parameter_bytes for s in sharded.segments] == [block_bytes] * 4
    assert [s.gathered_parameter_bytes for s in plain.segments] == [0] * 4
    assert (sharded.world_size, plain.world_size) == (1, 1)


# -- merging ranks ---------------------------------------------------------------------------
def test_max_profile_takes_every_largest_value():
    from ..decide.test_solver import random_chain

    a = dataclasses.replace(random_chain(1, 4), step_ms=5.0)
    b = dataclasses.replace(a, segments=tuple(dataclasses.replace(s, saved_bytes=s.saved_bytes + 1, forward_ms=0.0) for s in a.segments),
                            static_bytes=a.static_bytes + 7, step_ms=4.0)
    merged = max_profile([a, b])
    assert merged.static_bytes == b.static_bytes and merged.step_ms == 5.0
    assert [s.saved_bytes for s in merged.segments] == [s.saved_bytes for s in b.segments]
    assert [s.forward_ms for s in merged.segments] == [s.forward_ms for s in a.segments]
    assert max_profile([a]) is a
    renamed = dataclasses.replace(b, segments=tuple(dataclasses.replace(s, name="x" + s.name) for s in b.segments))
    with pytest.raises(ValueError, match="disagree"):
        max_profile([a, renamed])


def test_max_profile_merges_the_regions_outside_the_segments_and_the_selective_choice():
    """Every process's regions outside the segments (Note [Regions outside the segments]) are
    merged by name, each the largest any process measured, in their place in the chain; a region
    one process alone planned is planned. ``SELECTIVE`` saves only the ops every process chose:
    one plan runs everywhere, and no process then saves more than it priced."""
    torch.manual_seed(0)
    build, data, loss_fn = MODELS["cnn"]
    a = profile(build(), data(4), step_fn=lambda m, b: loss_fn(m(b[0]), b[1]), scale=False, min_offload_bytes=0, device="cpu")
    assert a.outside and any(s.selective_ops for s in a.segments)
    b = dataclasses.replace(
        a, outside=tuple(dataclasses.replace(r, saved_bytes=r.saved_bytes + 5) for r in a.outside[1:]), outside_after=a.outside_after[1:],
        segments=tuple(dataclasses.replace(s, selective_ops=s.selective_ops and s.selective_ops[1:] + ("aten.x.default",)) for s in a.segments),
    )
    merged = max_profile([a, b])
    assert merged.outside_names == a.outside_names and merged.outside_after == a.outside_after
    assert [r.saved_bytes for r in merged.outside] == [a.outside[0].saved_bytes] + [r.saved_bytes + 5 for r in a.outside[1:]]
    assert [s.selective_ops for s in merged.segments] == [s.selective_ops and s.selective_ops[1:] for s in a.segments]


def test_selective_is_not_used_on_a_segment_holding_fsdp_units(one_process_group):
    """Note [Selective around FSDP hooks]: a forced selective plan is refused on a segment with
    an FSDP unit inside it (naming both), auto and the search plan without selective there;
    a segment that is one unit keeps every action."""
    from torch.distributed.fsdp import fully_shard

    from lightning_swap import SwapConfig, SwapSession

    nested = TinyGPT()
    fully_shard(nested.blocks[2].fc)  # a unit inside a block
    for block in nested.blocks:
        fully_shard(block)
    fully_shard(nested)
    with pytest.raises(ValueError, match="segment 'blocks.2' is selective but holds FSDP units of its own \\(\\['fc'\\]\\)"):
        SwapRuntime(nested, {n: Action.SELECTIVE for n in find_segments(nested)}, device="cpu")
    session = SwapSession(nested, SwapConfig(policy="auto", budget_bytes=1 << 30), "cpu")
    assert Action.SELECTIVE not in session.allowed_actions() and Action.RECOMPUTE in session.allowed_actions()
    assert Action.SELECTIVE not in session.auto.actions
    per_block = sharded_gpt()
    SwapRuntime(per_block, {n: Action.SELECTIVE for n in find_segments(per_block)}, device="cpu")
    assert SwapSession(per_block, SwapConfig(policy="auto"), "cpu").allowed_actions() is None
