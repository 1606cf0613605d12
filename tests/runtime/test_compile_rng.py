"""Random ops under Inductor, and what the runtime leaves in Dynamo's caches (Notes [Random
numbers under Inductor] and [Nothing compiled under the runtime outlives it] in
``core/compiled.py``; reviews ``r2_08`` and ``r2_07``).

The blocks are timm's stochastic depth, one drop rate per block (a float attribute, as timm's
``DropPath``), plus ``nn.Dropout``. On CPU Inductor runs ``bernoulli_`` as the eager op, drawing
from torch's generator in program order; ``dropout`` draws from per-graph seeds unless
``fallback_random`` is on, which the dropout test sets for both runs. Every policy, with the
model compiled whole and block by block, must train within float rounding of the same model
compiled whole without the library (weights: 1e-5 of each tensor's largest value; measured up
to 2e-7). Regional compilation without the library is no reference: it meets pytorch#197889.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn
from torch._dynamo import register_backend
from torch._dynamo.backends.debugging import aot_eager

from ..helpers import POLICIES, swap_runtime

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="Inductor on CPU needs a C compiler")


class DropPath(nn.Module):
    """timm's ``DropPath``: the rate is a float attribute, read by a free function."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        if self.p == 0.0 or not self.training:
            return x
        keep = 1 - self.p
        return x * x.new_empty((x.shape[0], 1)).bernoulli_(keep).div_(keep)


class Block(nn.Module):
    def __init__(self, d: int, p: float, dropout: float) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop, self.path = nn.Dropout(dropout), DropPath(p)

    def forward(self, x):
        return x + self.path(self.fc2(self.drop(torch.relu(self.fc1(x)))))


class Net(nn.Module):
    def __init__(self, dropout: float = 0.0, d: int = 8, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, 0.1 * (i + 1), dropout) for i in range(n))  # a rate per block, as timm's
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _train(how: str, policy, dropout: float, steps: int = 3):
    """Losses and weights of ``steps`` SGD steps, ``policy`` None: without the library. Each run
    starts from an empty Dynamo cache (Inductor's on-disk caches stay: they are what carried the
    stale code)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net(dropout)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if how == "whole":
        compiled = torch.compile(model)
    else:
        compiled = model
        for block in model.blocks:
            block.compile()
    runtime = swap_runtime(compiled, policy, device="cpu", min_offload_bytes=0).install() if policy else None
    g = torch.Generator().manual_seed(1)
    losses = []
    try:
        for _ in range(steps):
            x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
            if runtime is not None:
                runtime.begin_step([x, y, opt.state])
            loss = nn.functional.mse_loss(compiled(x), y)
            loss.backward()
            if runtime is not None:
                runtime.end_step()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        if runtime is not None:
            runtime.remove()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worst(ours, plain) -> tuple[float, float]:
    loss = max(abs(a - b) / abs(b) for a, b in zip(ours[0], plain[0]))
    weight = max(float((ours[1][k] - plain[1][k]).abs().max() / plain[1][k].abs().max()) for k in plain[1])
    return loss, weight


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["drop_path", "drop_path+dropout"])
@pytest.mark.parametrize("how", ["regional", "whole"])
def test_every_policy_draws_what_compiled_plain_draws(how, dropout):
    """A random op in every segment, under every policy, recomputed or not. Before the fix the
    blocks the runtime compiled one by one (regional; whole under offload) ran one another's drop
    rate (pytorch#197889): 1e-2 off from the first compiled step. ``keep`` leaves regionally
    compiled blocks as the user compiled them, and torch's bug with them (docs/compile.md)."""
    policies = [p for p in POLICIES if not (how == "regional" and p == "keep")]
    with torch._inductor.config.patch(fallback_random=dropout > 0):
        plain = _train("whole", None, dropout)
        worst = {policy: _worst(_train(how, policy, dropout), plain) for policy in policies}
    assert all(loss < 1e-5 and weight < 1e-5 for loss, weight in worst.values()), worst


# -- nothing compiled under the runtime outlives it ----------------------------------------------------
RUNS: list[int] = []


@register_backend
def _ledger_counting(gm, example_inputs):
    """``aot_eager``, recording each graph run's size: one name, one backend object, as a string
    backend is (Dynamo reuses a cache entry only for the same backend)."""
    compiled = aot_eager(gm, example_inputs)
    ops = sum(node.op == "call_function" for node in gm.graph.nodes)

    def run(*args):
        RUNS.append(ops)
        return compiled(*args)

    return run


class Features(Net):
    """The blocks in an ``nn.Sequential`` behind a method, as timm's ViT: Dynamo cuts ``forward``
    and ``features`` at the call that reaches an offloaded block and resumes after it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*self.blocks)

    def features(self, x):
        return self.blocks(x)

    def forward(self, x):
        return self.out(self.features(x))


def _graphs_per_step(cls, policy=None, regional=False) -> tuple[list[int], list[float]]:
    """The sizes of the graphs the last of three steps ran, and the losses."""
    torch.manual_seed(0)
    model = cls()
    if regional:
        compiled = model
        for block in model.blocks:
            block.compile(backend="_ledger_counting")
    else:
        compiled = torch.compile(model, backend="_ledger_counting")
    runtime = swap_runtime(compiled, policy, device="cpu", min_offload_bytes=0).install() if policy else None
    losses = []
    for step in range(3):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        if runtime is not None:
            runtime.begin_step([x])
        RUNS.clear()
        loss = compiled(x).square().mean()
        loss.backward()
        losses.append(loss.item())
        if runtime is not None:
            runtime.end_step()
    if runtime is not None:
        runtime.remove()
    return list(RUNS), losses


@pytest.mark.parametrize(
    "policy, cls, regional",
    [("offload", Net, False), ("offload", Features, False), ("recompute_offload", Features, False), ("recompute", Net, False),
     ("offload", Features, True)],
)
def test_plain_compiled_training_after_the_runtime_is_as_before(policy, cls, regional):
    """Plain compiled training of a fresh model after a runtime was removed runs the graphs it ran
    before (whole: one graph a step; before the fix, the blocks' graphs one by one, ``forward``
    run eagerly or cut where the runtime's wrapper was), with no ``torch._dynamo.reset()``; what the
    user compiled before stays compiled (no new graph is compiled for it)."""
    torch._dynamo.reset()
    compiled_before = torch.compile(lambda x: x.sin() + 1, backend="_ledger_counting")  # the user's own, unrelated
    compiled_before(torch.ones(3))
    own_graph = RUNS[-1]
    before, plain_losses = _graphs_per_step(cls, regional=regional)
    ours, losses = _graphs_per_step(cls, policy, regional=regional)
    assert losses == plain_losses
    assert regional or ours != before  # the runtime's own structure (what must not outlive it)
    after, after_losses = _graphs_per_step(cls, regional=regional)
    assert (after, after_losses) == (before, plain_losses)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled_before(torch.ones(3))  # still compiled: no new graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames and RUNS[-1] == own_graph
