"""The runtime on CPU: results equal plain training, memory drops, nothing is left behind."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_swap import Action, SwapRuntime, find_segments
from lightning_swap.core.errors import InputMutatedError
from lightning_swap.core import DeviceMemoryMeter, resolve_policy

from ..helpers import POLICIES, assert_same_state, plain_core, swap_runtime, train_core
from ..models import MODELS, mlp_chain

@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_weights_buffers_and_grads_equalplain_core(name, policy):
    plain, _, plain_grads = plain_core(name)
    model, stats, grads = train_core(name, policy)
    assert_same_state(model, plain)
    assert grads.keys() == plain_grads.keys()
    assert all(torch.equal(grads[k], plain_grads[k]) for k in grads)
    if Action.parse(policy).offloads:
        assert stats[-1].offloaded_bytes > 0 and stats[-1].fetched_bytes > 0
    else:
        assert stats[-1].offloaded_bytes == 0
    if Action.parse(policy).recomputes:
        assert stats[-1].recompute_ms > 0


def test_prefetch_path_on_cpu_is_exact():
    plain, _, _ = plain_core("resnet18")
    model, stats, _ = train_core("resnet18", "offload", prefetch_bytes=1 << 20)
    assert_same_state(model, plain)
    assert stats[-1].prefetched_bytes > 0


def test_plain_checkpoint_updates_batchnorm_twice_and_ours_once():
    """Why Note [Recompute leaves buffers alone] exists."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    x = torch.randn(8, 4, requires_grad=True)
    checkpoint(bn, x, use_reentrant=False).sum().backward()
    assert bn.num_batches_tracked.item() == 2

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    ours = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    ours.load_state_dict(plain.state_dict())
    plain(x).sum().backward()
    with SwapRuntime(ours, {"0": Action.RECOMPUTE, "1": Action.SELECTIVE}, device="cpu"):
        ours(x).sum().backward()
    assert ours[0][1].num_batches_tracked.item() == 1
    assert_same_state(ours, plain)


def test_dropout_masks_repeat_in_recompute():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5), nn.Linear(32, 32)), nn.Linear(32, 1))
    x = torch.randn(16, 32)
    torch.manual_seed(3)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with SwapRuntime(model, {"0": Action.RECOMPUTE}, device="cpu"):
        torch.manual_seed(3)
        model(x).sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))


# -- memory ------------------------------------------------------------------------------


def _mlp_peak(policy, width=64, depth=6, batch=2048):
    torch.manual_seed(0)
    model = mlp_chain(width=width, depth=depth)
    x = torch.randn(batch, width)
    y = torch.randint(0, 10, (batch,))
    with swap_runtime(model, policy, min_offload_bytes=0, device="cpu") as runtime:
        runtime.begin_step([x, y])
        nn.functional.cross_entropy(model(x), y).backward()
        return runtime.end_step()


def test_memory_drops_by_the_activation_sizes():
    """Each MLP block (Linear W->4W, GELU, Linear 4W->W) saves 9*B*W floats and returns B*W.

    keep holds all of them at the start of backward. recompute keeps only each block's input
    (B*W) and rematerialises one block (9*B*W) at a time: it saves (depth-1)*8*B*W floats.
    offload keeps none of them on the device, except the one block brought back in
    backward: it saves (depth-1)*9*B*W floats. recompute_offload brings back a block's input
    (B*W) and rematerialises the block (9*B*W): it saves (depth*9-10)*B*W floats.
    """
    width, depth, batch = 64, 6, 2048
    unit = batch * width * 4  # bytes of one B x W float tensor
    keep = _mlp_peak("keep").peak_device_bytes
    recompute = _mlp_peak("recompute").peak_device_bytes
    offload = _mlp_peak("offload").peak_device_bytes
    recompute_offload = _mlp_peak("recompute_offload").peak_device_bytes
    assert keep - recompute >= 0.95 * (depth - 1) * 8 * unit
    assert keep - offload >= 0.95 * (depth - 1) * 9 * unit
    assert keep - recompute_offload >= 0.95 * (depth * 9 - 10) * unit


@pytest.mark.slow
def test_memory_drops_on_resnet():
    _, keep, _ = train_core("resnet18", "keep", steps=1, batch=16)
    for policy in ("offload", "recompute", "recompute_offload"):
        _, stats, _ = train_core("resnet18", policy, steps=1, batch=16)
        assert stats[0].peak_device_bytes < keep[0].peak_device_bytes, policy


def test_meter_counts_device_tensors_and_not_the_host_pool():
    from lightning_swap.core.engine.host_pool import HostPool

    pool = HostPool(pin_memory=False)
    with DeviceMemoryMeter("cpu") as meter:
        a = torch.empty(1000, dtype=torch.float32)
        buf, _ = pool.acquire(1 << 20)
        view = buf[:100]
        assert meter.current_bytes == 4000
        del a
        assert meter.current_bytes == 0
    assert meter.peak_bytes == 4000
    del view


# -- mechanism -----------------------------------------------------------------------------


class _SaveTwice(nn.Module):
    def forward(self, x):
        y = x.sin()
        return (y * y).sum(dim=1)  # mul saves ``y`` as both operands


def test_a_storage_saved_twice_moves_once():
    model = nn.Sequential(_SaveTwice(), nn.Identity())
    x = torch.randn(64, 256, requires_grad=True)
    with SwapRuntime(model, {"0": Action.OFFLOAD}, min_offload_bytes=0, device="cpu") as runtime:
        runtime.begin_step([x])
        model(x).sum().backward()
        stats = runtime.end_step()
    y_bytes = 64 * 256 * 4
    # sin saves x, which is the tracked batch (alive anyway: never offloaded); mul saves y
    # twice: one copy, one deduplicated, and one copy back.
    assert stats.offloaded_tensors == 1
    assert stats.deduplicated_tensors == 1
    assert stats.offloaded_bytes == stats.fetched_bytes + stats.reused_bytes == y_bytes
    expected = 2 * torch.cos(x) * torch.sin(x)
    torch.testing.assert_close(x.grad, expected)


def test_parameters_and_small_tensors_are_not_offloaded():
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 1))
    x = torch.randn(4, 256)  # 4 KiB input; weights are 256 KiB
    with SwapRuntime(model, {"0": Action.OFFLOAD, "1": Action.OFFLOAD}, min_offload_bytes=8192, device="cpu") as runtime:
        runtime.begin_step([x])
        model(x).sum().backward()
        stats = runtime.end_step()
    assert stats.offloaded_bytes == 0
    with SwapRuntime(model, {"0": Action.OFFLOAD, "1": Action.OFFLOAD}, min_offload_bytes=0, device="cpu") as runtime:
        runtime.begin_step([x])
        model(x).sum().backward()
        stats = runtime.end_step()
    # Only activations: the hidden layer's output (4x256); not the weights, and not the input,
    # which is the tracked batch (Note [What is never offloaded]).
    assert stats.offloaded_bytes == 4 * 256 * 4
    with SwapRuntime(model, {"0": Action.OFFLOAD, "1": Action.OFFLOAD}, min_offload_bytes=0, device="cpu") as runtime:
        runtime.begin_step([])  # the input not tracked: offloaded like any activation
        model(x).sum().backward()
        stats = runtime.end_step()
    assert stats.offloaded_bytes == 2 * 4 * 256 * 4


def test_retain_graph_backward_twice_with_offload():
    torch.manual_seed(0)
    model = mlp_chain(width=32, depth=3)
    x = torch.randn(64, 32)
    expected = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    with swap_runtime(model, "offload", min_offload_bytes=0, device="cpu"):
        loss = model(x).sum()
        first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        second = torch.autograd.grad(loss, list(model.parameters()))
    for e, a, b in zip(expected, first, second):
        assert torch.equal(e, a) and torch.equal(e, b)


@pytest.mark.parametrize("action", [Action.RECOMPUTE, Action.SELECTIVE, Action.RECOMPUTE_OFFLOAD])
def test_recompute_of_a_segment_that_writes_into_its_input_is_exact(action, caplog):
    """Note [Checkpointed segments must not modify their input]: the segment's first call sees the
    write coming (``relu_`` on its argument), copies the input first, warns naming the segment and
    the op, and reports it (``refusals``, what ``auto`` excludes); later calls copy the input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
    xs = [torch.randn(4, 8) for _ in range(2)]
    plain = []
    for x in xs:
        model(x).sum().backward()
        plain.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    with caplog.at_level("WARNING"), SwapRuntime(model, {"1": action}, device="cpu", min_offload_bytes=0) as runtime:
        for x, expected in zip(xs, plain):
            runtime.begin_step([x])
            model(x).sum().backward()
            runtime.end_step()
            assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))
            model.zero_grad()
    assert "writes into its input in place" in runtime.refusals["1"] and "relu_" in runtime.refusals["1"]
    warned = [r.getMessage() for r in caplog.records if "writes into its input" in r.getMessage()]
    assert len(warned) == 1 and "'1'" in warned[0] and "aten.relu_" in warned[0] and "offload" in warned[0]


class _OnCall(nn.Module):
    """A linear layer that runs ``effect(call, x)`` first, counting its calls with grad (a
    recomputation is one)."""

    def __init__(self, effect) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0
        self.effect = effect

    def forward(self, x):
        self.calls += 1
        self.effect(self.calls, x)
        return self.fc(x)


def _writes_later(call, x):
    """From the second call on: the first call's watch sees nothing."""
    if call > 1:
        x.mul_(2)


def test_a_write_into_the_input_the_watch_did_not_see_is_refused_by_name():
    model = nn.Sequential(nn.Linear(8, 8), _OnCall(_writes_later), nn.Linear(8, 1))
    with SwapRuntime(model, {"1": Action.RECOMPUTE}, device="cpu"):
        model(torch.randn(4, 8)).sum().backward()
        with pytest.raises(InputMutatedError, match=r"segment '1' modified its input in place \(MulBackward0\).*policy=\{'1': 'offload'\}"):
            model(torch.randn(4, 8)).sum().backward()


def test_no_grad_forward_runs_plainly():
    torch.manual_seed(0)
    model = mlp_chain(width=16, depth=2)
    x = torch.randn(4, 16)
    expected = model(x)
    for policy in ("offload", "recompute", "selective", "recompute_offload"):
        with swap_runtime(model, policy, device="cpu"), torch.no_grad():
            assert torch.equal(model(x), expected)


# -- cleanup -------------------------------------------------------------------------------


def _hook_counts(model):
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) + len(getattr(m, "_backward_pre_hooks", {}))
        for m in model.modules()
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_runtime_leaves_no_trace(policy):
    torch.manual_seed(0)
    model = MODELS["resnet18"][0]()
    keys = list(model.state_dict())
    hooks = _hook_counts(model)
    runtime = swap_runtime(model, policy, min_offload_bytes=0, device="cpu").install()
    assert list(model.state_dict()) == keys
    x, y = MODELS["resnet18"][1](2)
    runtime.begin_step([x])
    nn.functional.cross_entropy(model(x), y).backward()
    runtime.end_step()
    runtime.remove()
    runtime.remove()  # idempotent
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert _hook_counts(model) == hooks
    assert list(model.state_dict()) == keys
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert runtime.engine is None
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None


def test_remove_restores_a_forward_the_user_had_set():
    model = mlp_chain(width=8, depth=2)
    custom = model[0].forward
    model[0].forward = custom
    with SwapRuntime(model, {"0": Action.RECOMPUTE}, device="cpu"):
        assert model[0].forward is not custom
    assert model[0].__dict__["forward"] is custom


def test_host_pool_buffers_are_reused_across_steps():
    build, data, loss_fn = MODELS["resnet18"]
    model = build()
    x, y = data(4)
    allocations, reserved = [], []
    with swap_runtime(model, "offload", min_offload_bytes=0, device="cpu") as runtime:
        for _ in range(3):
            runtime.begin_step([x, y])
            loss_fn(model(x), y).backward()
            stats = runtime.end_step()
            allocations.append(runtime.engine.pool.allocations)
            reserved.append(stats.host_pool_bytes)
        assert runtime.engine.pool.in_use_bytes == 0  # every buffer went back after backward
    assert allocations[0] > 0 and allocations[1] == allocations[2] == allocations[0]
    assert reserved[0] == reserved[2] > 0


# -- bad input -----------------------------------------------------------------------------


def test_bad_input_names_the_argument():
    model = mlp_chain(width=8, depth=2)
    names = find_segments(model)
    with pytest.raises(ValueError, match="`policy`"):
        resolve_policy("swap_everything", names)
    with pytest.raises(ValueError, match="`policy`"):
        resolve_policy({"not.a.block": "keep"}, names)
    with pytest.raises(ValueError, match="`segments`.*nope"):
        find_segments(model, ["0", "nope"])
    with pytest.raises(ValueError, match="`segments`.*Conv2d"):
        find_segments(model, [nn.Conv2d])
    with pytest.raises(ValueError, match="`segments` must not nest"):
        find_segments(model, ["0", "0.1"])
    with pytest.raises(ValueError, match="`min_offload_bytes`"):
        SwapRuntime(model, {"0": Action.OFFLOAD}, min_offload_bytes=-1, device="cpu")
    with pytest.raises(ValueError, match="`plan`"):
        SwapRuntime(model, {"nope": Action.OFFLOAD}, device="cpu")


def test_segments_found_automatically():
    assert find_segments(mlp_chain(width=8, depth=3)) == ["0", "1", "2", "3"]
    gpt = MODELS["gpt"][0]()
    assert find_segments(gpt) == [f"blocks.{i}" for i in range(4)]
    resnet = MODELS["resnet18"][0]()
    assert find_segments(resnet) == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    from ..models import ConvBlock

    cnn = MODELS["cnn"][0]()
    assert find_segments(cnn, [ConvBlock]) == [f"blocks.{i}" for i in range(4)]
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert find_segments(flat) == ["0", "1", "2"]


def test_copies_of_a_planned_model_run_their_own_weights():
    """Note [Copies of a planned model]: deepcopy (EMA/SWA) and pickling while installed."""
    import copy
    import io

    torch.manual_seed(0)
    model = mlp_chain(width=16, depth=3)
    x = torch.randn(4, 16)
    # offloading: the runtime's module hooks (forward and backward triggers) are copied too
    with swap_runtime(model, "recompute_offload", min_offload_bytes=0, device="cpu"):
        twin = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(2)
        assert not torch.equal(twin(x), model(x))  # the copy runs its own (doubled) weights
        twin(x).sum().backward()  # and trains plainly, without the original's runtime
        assert all(p.grad is not None for p in twin.parameters())
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(x), model(x))
    assert list(loaded.state_dict()) == list(model.state_dict())


def _fails_in_recomputation(call, x):
    """Raises in the recomputation (the second call), not in the forward."""
    if call == 2:
        raise ValueError("a failure inside the segment")


def test_an_error_in_a_recomputation_names_the_segment():
    model = nn.Sequential(nn.Linear(8, 8), _OnCall(_fails_in_recomputation), nn.Linear(8, 1))
    with SwapRuntime(model, {"1": Action.RECOMPUTE}, device="cpu"):
        with pytest.raises(ValueError, match="a failure inside the segment") as raised:
            model(torch.randn(4, 8)).sum().backward()
    assert "lightning-swap: raised in the recomputation of segment '1'" in raised.value.__notes__
