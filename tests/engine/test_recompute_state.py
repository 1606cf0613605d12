"""Issue 34: recomputation reruns each segment against the state its forward saw (Note [Recompute
leaves buffers alone] in ``core/engine/recompute.py``, Note [Buffers are kept from before they
change] in ``core/engine/forward_state.py``) and a second backward works through every action
(Note [A second backward through selective]). Each case is compared with plain training over a
few steps, weights, buffers and gradients ``torch.equal``, under the strict stream model."""

from __future__ import annotations

import contextlib
import logging
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_swap.core import Action, SwapRuntime

from ..helpers import grads_that_differ, run_steps
from ..stream_double import DoubleFactory

torch.set_num_threads(1)

RECOMPUTING = [Action.RECOMPUTE, Action.SELECTIVE, Action.RECOMPUTE_OFFLOAD]
ACTIONS = [Action.KEEP, Action.OFFLOAD, *RECOMPUTING]


class SpectralBlock(nn.Module):
    """A GAN discriminator's layer: the power iteration updates ``_u``/``_v`` in forward and reads them."""

    def __init__(self, width=16):
        super().__init__()
        self.lin = nn.utils.parametrizations.spectral_norm(nn.Linear(width, width))

    def forward(self, x):
        return torch.tanh(self.lin(x))


class CountBlock(nn.Module):
    """A buffer counting calls, read by the same forward (a warm-up scale)."""

    def __init__(self, width=16):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x)) * (1.0 / self.calls)


class QuantBlock(nn.Module):
    """Quantization-aware training: a moving-average observer, then fake quantization with its scale."""

    def __init__(self, width=16):
        super().__init__()
        from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver

        self.lin = nn.Linear(width, width)
        self.fq = FakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255)

    def forward(self, x):
        return torch.tanh(self.fq(self.lin(x)))


class EMABlock(nn.Module):
    """A VQ-VAE style codebook updated through ``.data`` (no version counter moves), read by the same forward."""

    def __init__(self, width=16):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("code", torch.zeros(width))

    def forward(self, x):
        h = self.lin(x)
        if self.training:
            self.code.data.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return torch.tanh(h - self.code)


class NormBlock(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.lin, self.bn, self.drop = nn.Linear(width, width), nn.BatchNorm1d(width), nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(torch.tanh(self.bn(self.lin(x))))


class OwnNorm(nn.BatchNorm1d):
    """A BatchNorm with a forward of its own: ``native_batch_norm`` updates its statistics
    without moving their version counters."""

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.2, self.eps)


class OwnNormBlock(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.lin, self.norm = nn.Linear(width, width), OwnNorm(width)

    def forward(self, x):
        return torch.tanh(self.norm(self.lin(x)))


BLOCKS = [SpectralBlock, CountBlock, QuantBlock, EMABlock, OwnNormBlock, NormBlock]


def _batch(step, width=16):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, width, generator=g), torch.randn(8, width, generator=g)


def _eval_then_train(model, x, y):
    """A loss that combines a pass in ``eval()`` (with grad) and one in ``train()``."""
    model.eval()
    a = model(x)
    model.train()
    F.mse_loss(model(x), y).add(0.5 * F.mse_loss(a, y)).backward()


def _eval_then_train_without_grad(model, x, y):
    """A pass in ``eval()`` (with grad), then one in ``train()`` without grad (a teacher's, say)
    that changes the buffers the first read, then the first one's backward."""
    model.eval()
    a = model(x)
    model.train()
    with torch.no_grad():
        model(x * 2)
    F.mse_loss(a, y).backward()


def _retain(model, x, y):
    out = model(x)
    F.mse_loss(out, y).backward(retain_graph=True)
    out.pow(2).mean().backward()


def _penalty(model, x, y):
    """A WGAN-GP style gradient penalty: a backward through the graph of a backward."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    (F.mse_loss(out, y) + 0.1 * (g.norm(dim=1) - 1).pow(2).mean()).backward()


def _plain_step(model, x, y):
    F.mse_loss(model(x), y).backward()


def train(build, action, step=_plain_step, steps=3):
    """Weights and buffers after ``steps`` SGD steps, and each step's gradients; ``action`` None:
    plain; a dict: the plan (its children's names -> actions)."""
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    plan = action if isinstance(action, dict) or action is None else {name: action for name, _ in model.named_children()}
    with DoubleFactory("late") as factory:
        rt = SwapRuntime(model, plan, device="cpu", min_offload_bytes=0).install() if plan else None
        torch.manual_seed(1)
        grads, _ = run_steps(model, opt, rt, (_batch(i) for i in range(steps)), step)
    factory.drain()
    assert factory.violations == []
    return model.state_dict(), grads


def assert_equal(a, b):
    (state_a, grads_a), (state_b, grads_b) = a, b
    assert state_a.keys() == state_b.keys()
    assert [k for k in state_a if not torch.equal(state_a[k], state_b[k])] == []
    assert grads_that_differ(grads_a, grads_b) == []


@pytest.mark.parametrize("action", RECOMPUTING, ids=lambda a: a.value)
@pytest.mark.parametrize("block", BLOCKS[:5], ids=lambda b: b.__name__)
def test_buffers_the_forward_updates_are_restored_for_the_recomputation(block, action):
    """Note [Recompute leaves buffers alone]: before, gradients differed (the counter's doubled,
    spectral norm's off by 4e-7, the observer's by 1e-4, selective failing on it) and the
    codebook was updated twice per step."""
    build = lambda: nn.Sequential(block(), block(), block())
    assert_equal(train(build, action), train(build, None))


@pytest.mark.slow
@pytest.mark.parametrize("step", [_eval_then_train, _eval_then_train_without_grad], ids=["with_grad", "without_grad"])
@pytest.mark.parametrize("action", RECOMPUTING, ids=lambda a: a.value)
@pytest.mark.parametrize("block", [NormBlock, OwnNormBlock, CountBlock, EMABlock, QuantBlock], ids=lambda b: b.__name__)
def test_a_pass_in_eval_recomputes_in_eval(block, action, step):
    """A pass in ``eval()`` whose backward runs after ``model.train()``: the recomputation runs in
    the mode its forward saw, against the buffers as they were before a later training pass
    changed them, with grad or without (before: CheckpointError, selective's storage error, or
    other gradients)."""
    build = lambda: nn.Sequential(block(), block())
    assert_equal(train(build, action, step), train(build, None, step))


@pytest.mark.parametrize("step", [_retain, _penalty], ids=["retain_graph", "gradient_penalty"])
@pytest.mark.parametrize("action", ACTIONS, ids=lambda a: a.value)
def test_a_second_backward_works_under_every_action(action, step):
    """Note [A second backward through selective]: before, selective raised "Trying to backward an
    extra time"; with buffers the forward updates, each recomputation restores them again."""
    build = lambda: nn.Sequential(NormBlock(), CountBlock(), nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)))
    assert_equal(train(build, action, step), train(build, None, step))


class _Clones(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.clone.default:
            self.numels.append(args[0].numel())
        return func(*args, **(kwargs or {}))


class _ConstantAndCounter(nn.Module):
    """A large buffer the forward only reads, and a small one it changes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("table", torch.randn(64, 16))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x) + self.table[:8] / self.calls)


def test_only_buffers_that_change_are_copied_after_the_first_call():
    """Note [Buffers are kept from before they change]: the first call copies every buffer and
    learns which change; later steps copy the counter only (in forward, and twice around the
    recomputation: its value then, put back after)."""
    model = nn.Sequential(_ConstantAndCounter(), nn.Linear(16, 16))
    with SwapRuntime(model, {"0": Action.RECOMPUTE}, device="cpu"):
        counts = []
        for step in range(3):
            x, y = _batch(step)
            with _Clones() as clones:
                F.mse_loss(model(x), y).backward()
            counts.append(sorted(clones.numels))
    assert counts[0][-1] == 64 * 16  # the first call copies the table too (held until its recomputation)
    assert counts[1:] == [[1, 1], [1, 1]]
    assert int(model[0].calls) == 3


class _SometimesWrites(nn.Module):
    """Shifts by its buffer, which it changes only from its third call: a change no call of its
    mode made before (it depends on a value)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("shift", torch.zeros(16))

    def forward(self, x):
        self.calls += 1
        if int(self.calls) >= 3:
            self.shift.add_(1.0)
        return torch.tanh(self.lin(x) - self.shift)


def test_a_change_not_seen_in_the_first_calls_is_logged_and_learned(caplog):
    """A change the calls of its mode did not make before cannot be undone for the recomputation
    of the call that makes it: it is logged, naming the segment and the buffer, and the segment is
    refused for recomputation; the buffer still ends as plain training leaves it, and later calls
    copy it first."""
    build = lambda: nn.Sequential(_SometimesWrites(), nn.Linear(16, 16))
    with caplog.at_level(logging.WARNING, logger="lightning_swap"):
        state, grads = train(build, Action.RECOMPUTE, steps=5)
    messages = [r.getMessage() for r in caplog.records if "'shift'" in r.getMessage()]
    assert len(messages) == 1 and "'0'" in messages[0]
    plain, plain_grads = train(build, None, steps=5)
    assert torch.equal(state["0.shift"], plain["0.shift"]) and torch.equal(state["0.calls"], plain["0.calls"])
    assert all(torch.equal(grads[i][k], plain_grads[i][k]) for i in (0, 1) for k in grads[i])  # before the change
    model = build()
    with SwapRuntime(model, {"0": Action.RECOMPUTE}, device="cpu") as rt:
        for step in range(3):
            _plain_step(model, *_batch(step))
    assert list(rt.refusals) == ["0"] and "'shift'" in rt.refusals["0"]  # Note [Refused actions]


class PyRandScale(nn.Module):
    """Scales by a draw from Python's ``random`` (Note [Python's and numpy's RNGs] in forward_state.py)."""

    def __init__(self, width=16):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.lin(x) * (0.5 + random.random()))


class PyRandBranch(PyRandScale):
    """Takes one of two branches at random."""

    def forward(self, x):
        h = self.lin(x)
        return x + (torch.tanh(h) if random.random() < 0.5 else h * h)


class NumpyScale(PyRandScale):
    def forward(self, x):
        return x + torch.tanh(self.lin(x) * float(np.random.uniform(0.5, 1.5)))


class NumpyBranch(PyRandScale):
    def forward(self, x):
        h = self.lin(x)
        return x + (torch.tanh(h) if np.random.rand() < 0.5 else h * h)


def _host_rng_states():
    return random.getstate(), np.random.get_state()


def _train_seeded(build, action):
    """``train`` with Python's and numpy's RNGs seeded first; their states after it too."""
    random.seed(0)
    np.random.seed(0)
    return train(build, action, steps=4), _host_rng_states()


@pytest.mark.parametrize("action", RECOMPUTING, ids=lambda a: a.value)
@pytest.mark.parametrize("block", [PyRandScale, PyRandBranch, NumpyScale, NumpyBranch], ids=lambda b: b.__name__)
def test_python_and_numpy_rngs_are_restored_for_the_recomputation(block, action):
    """Note [Python's and numpy's RNGs]: the recomputation draws what the forward drew (before: other
    weights for a scale, CheckpointError for a branch), and afterwards both RNGs are where plain
    training leaves them (advanced once per forward)."""
    build = lambda: nn.Sequential(block(), block(), block(), nn.Linear(16, 16))
    (result, (python, numpy)), (plain, (plain_python, plain_numpy)) = _train_seeded(build, action), _train_seeded(build, None)
    assert_equal(result, plain)
    assert python == plain_python
    assert numpy[2:] == plain_numpy[2:] and np.array_equal(numpy[1], plain_numpy[1])


class _SharedShift(nn.Module):
    """A module every block calls; only the last block's call updates its buffer, by putting a
    new tensor in its place (``in_place=False``) or writing into it."""

    def __init__(self, width=16, in_place=False):
        super().__init__()
        self.in_place = in_place
        self.register_buffer("shift", torch.ones(width))

    def forward(self, x, update):
        if update:
            ema = 0.5 * self.shift + 0.5 * x.detach().abs().mean(0)
            if self.in_place:
                self.shift.copy_(ema)
            else:
                self.shift = ema
        return x - self.shift  # saves nothing: autograd lets the last block write into it


class _SharedBlock(nn.Module):
    def __init__(self, shared, last, width=16):
        super().__init__()
        self.lin, self.shared, self.last = nn.Linear(width, width), shared, last

    def forward(self, x):
        return x + torch.tanh(self.shared(self.lin(x), update=self.last))


def _shared_model(in_place, blocks=3):
    shared = _SharedShift(in_place=in_place)
    return nn.Sequential(*[_SharedBlock(shared, i == blocks - 1) for i in range(blocks)], nn.Linear(16, 16))


@pytest.mark.parametrize("last", ["recomputed", "kept"])
@pytest.mark.parametrize("action", RECOMPUTING, ids=lambda a: a.value)
@pytest.mark.parametrize("in_place", [False, True], ids=["replaced", "in_place"])
def test_a_buffer_another_segment_changes_is_restored(in_place, action, last):
    """Note [Buffers are kept from before they change]: the earlier blocks' recomputations read the
    value their forward saw, not the one the last block left (before: other gradients)."""
    build = lambda: _shared_model(in_place)
    plan = {"0": action, "1": action, "2": action if last == "recomputed" else Action.KEEP}
    assert_equal(train(build, plan), train(build, None))


class _LateShared(_SharedShift):
    """Written into by the last block from its third call on only: a change no earlier call saw."""

    def forward(self, x, update):
        self.calls = getattr(self, "calls", 0) + update
        return super().forward(x, update and self.calls >= 3)


def _late_shared_grads(plan):
    torch.manual_seed(0)
    shared = _LateShared(in_place=True)
    model = nn.Sequential(*[_SharedBlock(shared, i == 1) for i in range(2)])
    grads = []
    with SwapRuntime(model, plan, device="cpu") if plan else contextlib.nullcontext() as rt:
        for step in range(4):
            x, y = _batch(step)
            F.mse_loss(model(x), y).backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            model.zero_grad(set_to_none=True)
    return grads, rt


def test_a_buffer_another_segment_changes_unforeseen_refuses_recomputation(caplog):
    """A buffer written in place by another segment, which the first calls did not see change,
    cannot be rewound for the call that missed it (the third step's): the segment is refused
    (Note [Refused actions]) and logged, naming the buffer; its later calls copy it first."""
    with caplog.at_level(logging.WARNING, logger="lightning_swap"):
        grads, rt = _late_shared_grads({"0": Action.RECOMPUTE})
    plain, _ = _late_shared_grads(None)
    assert [torch.equal(a, b) for a, b in zip(grads, plain)] == [True, True, False, True]
    assert list(rt.refusals) == ["0"] and "'shared.shift'" in rt.refusals["0"]
    assert [r.getMessage().count("'shared.shift'") for r in caplog.records] == [1]
