"""``core/measure/action_costs.py``: each segment timed kept, recomputed and selectively recomputed on the real
device, leaving no trace (Note [Timing a segment leaves no trace])."""

from __future__ import annotations

import torch
from torch import nn

from lightning_swap.core.measure.action_costs import measure_action_costs
from lightning_swap.core.engine.streams import default_ops
from lightning_swap.core.measure.trace import CapturedCall


class Block(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(torch.relu(self.bn(self.conv(x))))


def test_every_segment_is_timed_recompute_costs_a_forward_and_nothing_changes():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    modules = {"0": model[0], "1": model[1]}
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    calls = {name: CapturedCall.of((x,), {}) for name in modules}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()

    costs = measure_action_costs(model, modules, calls, default_ops(torch.device("cpu")), device=torch.device("cpu"))

    assert set(costs) == {"0", "1"}
    for c in costs.values():
        assert c.forward_ms > 0 and c.backward_ms > 0
        # recomputation reruns the forward: never predicted cheaper than one, however noisy the machine
        assert c.recompute_ms is not None and c.recompute_ms >= c.forward_ms
        assert c.selective_ms is not None and c.selective_ms >= 0
        assert c.released_working_bytes > 0
    # buffers (BatchNorm statistics, num_batches_tracked), gradients and the RNG are as before
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
