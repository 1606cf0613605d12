"""Issue 34's property test: small models assembled at random from a vocabulary of what
recomputation must get right (in-place ops, dropout, views, BatchNorm (torch's and one with its own forward), spectral norm,
FakeQuantize, a call counter, a ``.data`` write; steps with an ``eval()`` pass, a second backward,
a gradient penalty), trained a few steps under every policy and a random mix of actions, under the
strict stream model, and compared with plain training: gradients of every step, weights and
buffers ``torch.equal`` (Notes [Recompute leaves buffers alone] and [A second backward through
selective] in ``core/engine/recompute.py``).

The suite runs the models of :data:`SEEDS` (a few seconds). The long run, ``LSWAP_LONG=1``,
compares :data:`LONG_MODELS` models (seeds from 0, skipping those plain training itself refuses):
4 min 46 s on one CPU thread of a busy 2-core machine (140 s of CPU time; torch 2.14.1)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_swap.core import Action, SwapRuntime

from ..helpers import run_steps
from ..stream_double import DoubleFactory
from .test_recompute_state import _retain  # a second backward through a retained graph

torch.set_num_threads(1)

W = 8
STEPS = 3
SEEDS = [3, 6, 9, 10, 11, 25]  # every component and step kind (test_the_suite_seeds_cover_the_vocabulary)
LONG_MODELS = 200
POLICIES = [Action.KEEP, Action.OFFLOAD, Action.RECOMPUTE, Action.SELECTIVE, Action.RECOMPUTE_OFFLOAD, "mix"]


class Residual(nn.Module):
    """``h += x`` into a matmul's output: what selective cached, then written."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x):
        h = self.lin(x)
        h += x
        return h


class Halve(nn.Module):
    """An in-place op whose rerun on its own output would not give the same (``relu_`` would)."""

    def forward(self, x):
        return x.mul_(0.5)


class Shuffle(nn.Module):
    """Views: the features regrouped through ``view``, ``transpose`` and ``reshape``."""

    def forward(self, x):
        return x.view(x.shape[0], 2, W // 2).transpose(1, 2).reshape(x.shape[0], W)


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return x * (1.0 / self.calls)


class DataEMA(nn.Module):
    """An EMA written through ``.data`` (no version counter moves) and read by the same forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(W))

    def forward(self, x):
        if self.training:
            self.mean.data.mul_(0.8).add_(0.2 * x.detach().mean(0))
        return x - self.mean


class OwnNorm(nn.BatchNorm1d):
    """A BatchNorm with its own forward (its statistics' version counters do not move)."""

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.2, self.eps)


def _fake_quant():
    from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver

    return FakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255)


VOCABULARY = {
    "linear": lambda: nn.Linear(W, W),
    "tanh": nn.Tanh,
    "gelu": nn.GELU,
    "relu_": lambda: nn.ReLU(inplace=True),
    "mul_": Halve,
    "residual+=": Residual,
    "dropout": lambda: nn.Dropout(0.25),
    "views": Shuffle,
    "batchnorm": lambda: nn.BatchNorm1d(W),
    "own_batchnorm": lambda: OwnNorm(W),
    "layernorm": lambda: nn.LayerNorm(W),
    "spectral_norm": lambda: nn.utils.parametrizations.spectral_norm(nn.Linear(W, W)),
    "fake_quantize": _fake_quant,
    "counter": Counter,
    "data_ema": DataEMA,
}


def _plain_step(model, x, y):
    F.mse_loss(model(x), y).backward()


def _eval_then_train(model, x, y):
    model.eval()
    a = model(x)
    model.train()
    (F.mse_loss(model(x), y) + 0.5 * F.mse_loss(a, y)).backward()


def _penalty(model, x, y):
    x = x.clone().requires_grad_(True)
    out = model(x)
    g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    (F.mse_loss(out, y) + 0.1 * g.pow(2).sum()).backward()


STEP_KINDS = {"plain": _plain_step, "eval_then_train": _eval_then_train, "retain_graph": _retain, "gradient_penalty": _penalty}


#: Components whose output may be their input itself (``Dropout`` in ``eval()`` returns it).
ALIASING = {"relu_", "mul_", "views", "dropout"}


def recipe(seed: int) -> dict:
    """The model, step and mixed plan of ``seed``: 2-4 segments of 1-4 components each. A segment
    of aliasing components only ends with a linear layer: its input is then not the next segment's,
    which may write into it (an input changed after its segment ran is what no recomputation can
    rerun: autograd refuses it in backward)."""
    rng = random.Random(seed)
    blocks = [[rng.choice(sorted(VOCABULARY)) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(2, 4))]
    blocks = [b + ["linear"] if set(b) <= ALIASING else b for b in blocks]
    mix = [rng.choice([Action.KEEP, Action.OFFLOAD, Action.RECOMPUTE, Action.SELECTIVE, Action.RECOMPUTE_OFFLOAD]) for _ in blocks]
    return {"blocks": blocks, "step": rng.choice(sorted(STEP_KINDS)), "mix": mix}


def _build(blocks) -> nn.Module:
    """A stem, the segments ``"1"``.., a head. The stem keeps the caller's batch out of the
    segments: a segment writing into it would change the next pass's input (see :func:`recipe`)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(W, W), *[nn.Sequential(*[VOCABULARY[c]() for c in block]) for block in blocks], nn.Linear(W, W))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(6, W, generator=g), torch.randn(6, W, generator=g)


def train(r: dict, policy) -> tuple[dict, list]:
    """Weights and buffers after :data:`STEPS` SGD steps of recipe ``r``, and each step's
    gradients; ``policy`` None: plain training."""
    model = _build(r["blocks"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    actions = r["mix"] if policy == "mix" else [policy] * len(r["blocks"])
    plan = {str(i + 1): a for i, a in enumerate(actions)}
    with DoubleFactory("late") as factory:
        rt = SwapRuntime(model, plan, device="cpu", min_offload_bytes=0).install() if policy is not None else None
        torch.manual_seed(1)
        grads, _ = run_steps(model, opt, rt, (_batch(i) for i in range(STEPS)), STEP_KINDS[r["step"]])
    factory.drain()
    if factory.violations:
        raise AssertionError(f"the strict stream model saw: {factory.violations[:2]}")
    return model.state_dict(), grads


def differences(seed: int) -> list[str] | None:
    """What differs from plain training under each policy (empty: nothing); ``None`` where plain
    training itself raises (an in-place write into a tensor autograd saved, no double backward)."""
    r = recipe(seed)
    try:
        plain_state, plain_grads = train(r, None)
    except RuntimeError:
        return None
    found = []
    for policy in POLICIES:
        name = policy if isinstance(policy, str) else policy.value
        try:
            state, grads = train(r, policy)
        except Exception as e:  # noqa: BLE001 - reported with the seed and recipe
            found.append(f"{name}: {type(e).__name__}: {str(e)[:160]}")
            continue
        bad = [k for k in plain_state if not torch.equal(state[k], plain_state[k])]
        bad += [f"step {i} grad {k}" for i, (a, b) in enumerate(zip(grads, plain_grads)) for k in b if k not in a or not torch.equal(a[k], b[k])]
        if bad:
            found.append(f"{name}: {bad[:3]}")
    return [f"seed {seed} {r}: {f}" for f in found]


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_random_model_trains_as_plain_under_every_policy(seed):
    assert differences(seed) == []


def test_the_suite_seeds_cover_the_vocabulary():
    recipes = [recipe(s) for s in SEEDS]
    assert {r["step"] for r in recipes} == set(STEP_KINDS)
    assert {c for r in recipes for b in r["blocks"] for c in b} == set(VOCABULARY)


@pytest.mark.long(f"{LONG_MODELS} random models, ~5 min")
def test_long_run_of_random_models():
    compared, failures, seed = 0, [], 0
    while compared < LONG_MODELS:
        found = differences(seed)
        seed += 1
        if found is None:
            continue
        compared += 1
        failures += found
    assert failures == []
