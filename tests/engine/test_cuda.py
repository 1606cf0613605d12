"""GPU-only behaviour: copy streams, events, pinned buffers. Marked ``cuda``: skipped without
a GPU, run on the GPU machine (``pytest -m cuda``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_swap import Action, SwapRuntime, find_segments
from lightning_swap.core import resolve_policy

pytestmark = pytest.mark.cuda


class Thin(nn.Module):
    """Almost no arithmetic per byte: copies dominate, so a missing wait shows up as garbage."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.shift = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        y = torch.sin(x * self.scale + self.shift)
        return y * y + x


def thin_chain(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[Thin(width) for _ in range(depth)])
    for block in model:
        nn.init.normal_(block.scale, 1.0, 0.1)
        nn.init.normal_(block.shift, 0.0, 0.1)
    return model


def _grads(model, x, runtime=None):
    model.zero_grad(set_to_none=True)
    if runtime is not None:
        runtime.begin_step([x])
    model(x).square().mean().backward()
    stats = runtime.end_step() if runtime is not None else None
    return [p.grad.clone() for p in model.parameters()], stats


@pytest.mark.parametrize("prefetch", [0, None, 256 << 20])  # bytes: per saved tensor, one segment's worth, four tensors
@pytest.mark.parametrize("policy", ["offload", "recompute_offload"])
def test_streams_do_not_corrupt_gradients(policy, prefetch):
    device = torch.device("cuda")
    model = thin_chain(4096, 12).to(device)
    x = torch.randn(4096, 4096, device=device)  # 64 MiB per saved tensor
    expected, _ = _grads(model, x)
    actions = resolve_policy(policy, find_segments(model))
    with SwapRuntime(model, actions, prefetch_bytes=prefetch) as runtime:
        for _ in range(3):  # reused pinned buffers must not carry stale bytes
            got, stats = _grads(model, x, runtime)
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert stats.offloaded_bytes > 0
        if prefetch:
            assert stats.prefetched_bytes > 0
        pool = runtime.engine.pool
        assert pool.pin_memory
        allocations = pool.allocations
        _grads(model, x, runtime)
        assert pool.allocations == allocations  # no cudaHostAlloc per tensor after the first step


def test_offload_lowers_the_allocator_peak():
    device = torch.device("cuda")
    model = thin_chain(4096, 12).to(device)
    x = torch.randn(4096, 4096, device=device)
    peaks = {}
    for policy in ("keep", "offload", "recompute", "recompute_offload"):
        with SwapRuntime(model, resolve_policy(policy, find_segments(model))) as runtime:
            _, stats = _grads(model, x, runtime)
        peaks[policy] = stats.peak_device_bytes
    saved = 4096 * 4096 * 4
    # Each Thin block saves about three 64 MiB tensors under keep.
    assert peaks["keep"] - peaks["offload"] > 12 * saved
    assert peaks["keep"] - peaks["recompute"] > 12 * saved
    assert peaks["recompute_offload"] <= peaks["recompute"]


def test_resnet_equal_on_cuda():
    import torchvision

    device = torch.device("cuda")
    torch.backends.cudnn.deterministic = True
    results = {}
    for policy in (None, "offload", "recompute", "selective", "recompute_offload"):
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10).to(device)
        x = torch.randn(16, 3, 64, 64, device=device)
        runtime = SwapRuntime(model, resolve_policy(policy, find_segments(model)), min_offload_bytes=0).install() if policy else None
        grads, _ = _grads(model, x, runtime)
        if runtime:
            runtime.remove()
        results[policy] = (grads, {k: v.clone() for k, v in model.state_dict().items()})
    base_grads, base_state = results.pop(None)
    for policy, (grads, state) in results.items():
        for a, b in zip(grads, base_grads):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=policy)
        assert all(torch.equal(state[k], base_state[k]) for k in state), policy


def test_streams_and_pool_released_after_remove():
    device = torch.device("cuda")
    model = thin_chain(1024, 4).to(device)
    x = torch.randn(1024, 1024, device=device)
    runtime = SwapRuntime(model, {n: Action.OFFLOAD for n in find_segments(model)}).install()
    _grads(model, x, runtime)
    engine = runtime.engine
    runtime.remove()
    assert runtime.engine is None
    assert engine.pool.reserved_bytes == 0
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_cpu_swap_strategy_runs_on_the_gpu_and_equals_plain():
    """Lightning builds a registered strategy without a device; it must follow the CUDA accelerator."""
    from lightning_swap import CPUSwapStrategy

    from ..helpers import assert_same_state
    from ..lit import fit

    torch.backends.cudnn.deterministic = True
    plain, _ = fit("cnn", "auto", accelerator="gpu")
    module, trainer = fit("cnn", "cpu_swap", accelerator="gpu")
    assert trainer.strategy.root_device == torch.device("cuda", 0)
    module, trainer = fit("cnn", CPUSwapStrategy(policy="offload", min_offload_bytes=0), accelerator="gpu")
    assert trainer.strategy.step_stats.offloaded_bytes > 0
    assert_same_state(module.cpu(), plain.cpu())
