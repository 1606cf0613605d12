"""Cutting models into segments (Note [Finding the blocks] in ``core/segments.py``), one segment per
call of a module run several times (Note [A segment per call]), and actions a segment refused
(Note [Refused actions] in ``measure/model_profile.py``). Exact tables: the models are built on
the meta device (structure only, no weights)."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
import torchvision
from torch import nn
from torch.nn import functional as F

from accelerate_swap import SwapAccelerator, SwapPlugin
from lightning_swap import Action, SwapRuntime, find_segments, profile, solve
from lightning_swap.core.decide.solver import brute_force
from lightning_swap.core.segments import call_name, split_call

from ..adapters.test_accelerate import fresh_state  # noqa: F401 - a fixture
from ..zoo.test_zoo import ZOO


def _meta(build):
    with torch.device("meta"):
        return build()


# -- Note [Finding the blocks] --------------------------------------------------------------------
SMALL = {
    "resnet": ["layer1.0", "layer2.0", "layer3.0", "layer4.0"],
    "densenet": [
        "features.conv0", "features.norm0", "features.denseblock1", "features.transition1", "features.denseblock2",
        "features.transition2", "features.denseblock3", "features.transition3", "features.denseblock4", "features.norm5",
    ],
    "efficientnet": ["features.0", "features.1.0", "features.2.0", "features.2.1", "features.3.0", "features.3.1", "features.4"],
    "convnext": ["features.0", "features.1.0", "features.1.1", "features.2", "features.3.0", "features.3.1"],
    "vit": ["encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1"],
    "inception_v3": [
        "Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3", "Conv2d_3b_1x1", "Conv2d_4a_3x3", "Mixed_5b", "Mixed_5c", "Mixed_5d",
        "Mixed_6a", "Mixed_6b", "Mixed_6c", "Mixed_6d", "Mixed_6e", "Mixed_7a", "Mixed_7b", "Mixed_7c",
    ],
    "gpt2": ["transformer.h.0", "transformer.h.1"],
    "llama": ["model.layers.0", "model.layers.1"],
    "bert": ["bert.encoder.layer.0", "bert.encoder.layer.1"],
    "t5": ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"],
    "albert": ["albert.encoder.albert_layer_groups.0.albert_layers.0"],
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_the_zoos_blocks_are_found(name):
    """Stages cut into blocks (ConvNeXt, EfficientNet), blocks that are attributes (Inception-v3,
    with ``Mixed_6a``/``Mixed_7a`` beside them), a class holding the list of layers cut (T5's two
    stacks), ALBERT's one layer in a list of one, DenseNet's stem without its in-place ``relu0``."""
    assert find_segments(_meta(ZOO[name][0])) == SMALL[name]


#: The real configurations: (count, first, last).
FULL = {
    "densenet121": (lambda: torchvision.models.densenet121(), 10, "features.conv0", "features.norm5"),
    "efficientnet_b0": (lambda: torchvision.models.efficientnet_b0(), 18, "features.0", "features.8"),
    "convnext_tiny": (lambda: torchvision.models.convnext_tiny(), 22, "features.0", "features.7.2"),
    "swin_t": (lambda: torchvision.models.swin_t(), 16, "features.0", "features.7.1"),
    "googlenet": (lambda: torchvision.models.googlenet(aux_logits=False, init_weights=False), 12, "conv1", "inception5b"),
    "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(), 13, "features.0", "features.12"),
    "resnet50": (lambda: torchvision.models.resnet50(), 16, "layer1.0", "layer4.2"),
}


@pytest.mark.parametrize("name", sorted(FULL))
def test_real_configurations(name):
    build, count, first, last = FULL[name]
    names = find_segments(_meta(build))
    assert (len(names), names[0], names[-1]) == (count, first, last)
    assert not any(n.endswith(("relu0", "relu", "act")) for n in names)  # no lone activation
    if name == "convnext_tiny":  # a stage of nine blocks is nine segments
        assert [n for n in names if n.startswith("features.5.")] == [f"features.5.{i}" for i in range(9)]
    if name == "googlenet":  # the Inception blocks whole, not their branches
        assert not any("branch" in n for n in names)


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 64), nn.Linear(64, 64)


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(64, 64)


class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = _Encoder(), _Decoder()


class _Distinct(nn.Module):
    """Nothing repeats: an encoder and a decoder of different classes in a body, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _Body()
        self.head = nn.Linear(64, 2)


def test_fallbacks_never_refuse():
    # The children of the outermost Sequential, in-place activations left out.
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.Tanh())
    assert find_segments(flat) == ["0", "2", "3"]
    # Through the part holding most parameters to its composite parts.
    assert find_segments(_Distinct()) == ["body.encoder", "body.decoder"]
    # Nothing to cut: no segment, no error.
    assert find_segments(nn.Linear(4, 4)) == []


def test_a_tied_module_is_one_segment():
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    model = nn.Sequential(block, nn.Sequential(nn.Linear(8, 8), nn.Tanh()), block)
    assert find_segments(model) == ["0", "1"]


def test_a_model_without_segments_trains_plainly_under_every_policy(fresh_state, caplog):
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    plain = copy.deepcopy(model)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    F.mse_loss(plain(x), y).backward()
    for policy in ("keep", "recompute", "auto"):
        twin = copy.deepcopy(model)
        with caplog.at_level(logging.WARNING):
            accelerator = SwapAccelerator(cpu=True, swap_plugin=SwapPlugin(policy=policy, budget_bytes="1GiB", log_stats=False))
        twin = accelerator.prepare(twin)
        accelerator.backward(F.mse_loss(twin(x), y))
        assert torch.equal(twin.weight.grad, plain.weight.grad)
        accelerator.end_training()
    assert [r for r in caplog.records if "no segments found automatically" in r.getMessage()]


# -- Note [A segment per call] ----------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.ReLU(inplace=True), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Looped(nn.Module):
    """One block run four times per step (ALBERT's pattern)."""

    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.layers = nn.ModuleList([_Block(d)])
        self.n = n
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(self.n):
            h = self.layers[0](h)
        return self.out(h)


def _step(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def _plain_sgd(model, batches):
    """A copy of ``model`` trained plainly with SGD on ``batches``."""
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for b in batches:
        _step(plain, b).backward()
        opt.step()
        opt.zero_grad()
    return plain


class _LoopedGlue(Looped):
    """``Looped`` with code between the calls that saves a tensor for backward (``tanh``)."""

    def forward(self, x):
        h = self.inp(x)
        for _ in range(self.n):
            h = torch.tanh(self.layers[0](h))
        return self.out(h)


def test_the_regions_between_a_modules_calls_are_its_calls_and_run_exactly():
    """Note [Names of the regions outside the segments] under Note [A segment per call]: the code
    after call ``k`` is ``<after layers.0#k>`` in a profile; offloaded by a plan that names the
    calls, or by the lowest-memory plan that names the module alone, training equals plain
    training and the regions' bytes are moved."""
    from lightning_swap.core import Plan

    torch.manual_seed(0)
    model = _LoopedGlue()
    batch = (torch.randn(64, 8), torch.randn(64, 1))
    prof = profile(model, batch, step_fn=_step, scale=False, min_offload_bytes=0, device="cpu")
    assert {"<after layers.0>", "<after layers.0#1>", "<after layers.0#2>", "<tail>"} <= set(prof.outside_names)
    plain = copy.deepcopy(model)
    _step(plain, batch).backward()
    per_call = Plan(actions={n: Action.KEEP for n in prof.names}, outside={n: Action.OFFLOAD for n in prof.outside_names})
    for plan in (per_call, Plan.lowest_memory(find_segments(model))):
        twin = copy.deepcopy(model)
        with SwapRuntime(twin, plan, device="cpu", min_offload_bytes=0) as runtime:
            for _ in range(2):
                twin.zero_grad()
                runtime.begin_step(list(batch))
                _step(twin, batch).backward()
                stats = runtime.end_step()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(twin.parameters(), plain.parameters()))
        assert stats.offloaded_bytes >= 3 * 64 * 32 * 4  # at least the tanh outputs between the calls
        assert stats.unplanned_bytes == 0


def test_call_names():
    assert [call_name("a.0", k) for k in range(3)] == ["a.0", "a.0#1", "a.0#2"]
    assert [split_call(n) for n in ("a.0", "a.0#2", "a#b")] == [("a.0", 0), ("a.0", 2), ("a#b", 0)]


def test_each_call_is_a_segment_with_its_own_action():
    torch.manual_seed(0)
    model = Looped()
    batch = (torch.randn(64, 8), torch.randn(64, 1))
    assert find_segments(model) == ["layers.0"]
    prof = profile(model, batch, step_fn=_step, scale=False, min_offload_bytes=0, device="cpu")
    assert prof.names == ("layers.0", "layers.0#1", "layers.0#2", "layers.0#3")
    plain = copy.deepcopy(model)
    _step(plain, batch).backward()
    for actions in ((Action.OFFLOAD, Action.KEEP, Action.RECOMPUTE, Action.SELECTIVE), (Action.RECOMPUTE_OFFLOAD, Action.OFFLOAD, Action.KEEP, Action.KEEP)):
        twin = copy.deepcopy(model)
        with SwapRuntime(twin, dict(zip(prof.names, actions)), device="cpu", min_offload_bytes=0) as runtime:
            for _ in range(2):  # the call count starts again each step
                twin.zero_grad()
                runtime.begin_step(list(batch))
                _step(twin, batch).backward()
                stats = runtime.end_step()
            rows = {r.segment: r for r in runtime.measured_plan().rows}
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(twin.parameters(), plain.parameters()))
        for name, action in zip(prof.names, actions):  # each call did what its segment was given
            assert (rows[name].offloaded_bytes > 0) == action.offloads, (name, action)
            assert (rows[name].recomputed_bytes > 0) == action.recomputes, (name, action)
        assert stats.offloaded_bytes == sum(r.offloaded_bytes for r in rows.values())
    # The planner prices calls one by one: a plan that offloads two of four fits where keep does not.
    plan = solve(prof, budget_bytes=prof.peak_bytes - 1)
    assert set(plan.actions) == set(prof.names) and set(plan.actions.values()) != {Action.KEEP}


def test_auto_plans_a_shared_module_call_by_call(fresh_state):
    """``auto`` on a module run four times (the issue's ALBERT): no "ran twice" error, a plan per
    call. The budget lets plain's bound fit, so a step is observed (Note [Observe only what fits])."""
    torch.manual_seed(0)
    model = Looped()
    batches = [(torch.randn(64, 8), torch.randn(64, 1)) for _ in range(4)]
    plain = _plain_sgd(model, batches)
    peak = profile(copy.deepcopy(model), batches[0], step_fn=_step, scale=False, min_offload_bytes=0, device="cpu").peak_bytes
    accelerator = SwapAccelerator(cpu=True, swap_plugin=SwapPlugin(budget_bytes=3 * peak, min_offload_bytes=0, log_stats=False))
    twin = copy.deepcopy(model)
    twin, opt = accelerator.prepare(twin, torch.optim.SGD(twin.parameters(), lr=0.1))
    for b in batches:
        accelerator.backward(_step(twin, b))
        opt.step()
        opt.zero_grad()
    plan = accelerator.swap_plan
    assert set(plan.actions) == {"layers.0", "layers.0#1", "layers.0#2", "layers.0#3"}
    assert {n: p for n, p in accelerator.unwrap_model(twin).state_dict().items()}.keys() == plain.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(accelerator.unwrap_model(twin).state_dict().values(), plain.state_dict().values()))
    accelerator.end_training()


# -- Note [Refused actions] -------------------------------------------------------------------------
def test_a_refused_action_is_never_planned():
    from lightning_swap.core.decide.solver import min_budget_bytes

    from ..decide.test_solver import random_chain

    for seed in range(20):  # a chain whose fastest plan under the budget recomputes somewhere
        prof = random_chain(seed, 4)
        budget = (min_budget_bytes(prof) + prof.peak_bytes) // 2
        free = solve(prof, budget_bytes=budget)
        recomputing = [n for n, a in free.actions.items() if a.recomputes]
        if recomputing:
            break
    name = recomputing[0]
    i = list(prof.names).index(name)
    refused = prof.refusing({name: "writes into its input in place (aten.relu_)"})
    assert refused.segments[i].refused == (Action.RECOMPUTE, Action.SELECTIVE, Action.RECOMPUTE_OFFLOAD)
    best = brute_force(refused, budget_bytes=budget)
    if best is None:  # nothing fits without it: the planner says so too
        with pytest.raises(Exception, match="No plan fits"):
            solve(refused, budget_bytes=budget)
    else:
        plan = solve(refused, budget_bytes=budget)
        assert not plan.actions[name].recomputes and not best[0][i].recomputes
        assert plan.predicted_step_ms <= best[1] + 1e-6
    assert prof.refusing({name: "selective: compiled"}).segments[i].refused == (Action.SELECTIVE,)


class _WritesIntoInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(256, 256)

    def forward(self, x):
        return self.fc(self.act(x))


def test_auto_leaves_out_the_recomputation_a_segment_refused(fresh_state, caplog):
    """A segment that writes into its input (the issue's DenseNet ``relu0``): ``auto`` trains as
    plain, and the segment is never given a recomputing action once it was seen."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 256), _WritesIntoInput(), nn.Sequential(nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256)),
        _WritesIntoInput(), nn.Linear(256, 1),
    )
    batches = [(torch.randn(1024, 8), torch.randn(1024, 1)) for _ in range(5)]
    plain = _plain_sgd(model, batches)
    peak = profile(copy.deepcopy(model), batches[0], step_fn=_step, scale=False, min_offload_bytes=0, device="cpu").peak_bytes
    # Plain's predicted peak is over this budget: a mix is planned from the first step (Note [Refused
    # actions]: a refusal is heard where a step recomputes the segment).
    budget = int(0.9 * peak)
    accelerator = SwapAccelerator(cpu=True, swap_plugin=SwapPlugin(budget_bytes=budget, min_offload_bytes=0, log_stats=False))
    twin = copy.deepcopy(model)
    twin, opt = accelerator.prepare(twin, torch.optim.SGD(twin.parameters(), lr=0.1))
    plans, peaks = [], []
    with caplog.at_level(logging.WARNING):
        for b in batches:
            accelerator.backward(_step(twin, b))
            opt.step()
            opt.zero_grad()
            plans.append(dict(accelerator.swap_plan.actions) if accelerator.swap_plan is not None else {})
            peaks.append(accelerator.swap_step_stats.peak_device_bytes)
    session = accelerator.swap_session
    # No segment is run outside the step to find it out: a step that recomputes one finds it (its
    # input copied, the step exact), and no plan after that recomputes it.
    for n in ("1", "3"):
        first = next((k for k, plan in enumerate(plans) if plan and plan[n].recomputes), None)
        if first is not None:
            assert n in session.refusals and not any(plan[n].recomputes for plan in plans[first + 1:] if plan), plans
    assert any(a is not Action.KEEP for a in plans[-1].values()), plans  # the budget made it act
    assert max(peaks) <= budget, (peaks, budget)
    assert all(torch.equal(a, b) for a, b in zip(accelerator.unwrap_model(twin).state_dict().values(), plain.state_dict().values()))
    accelerator.end_training()


def test_coverage_of_saved_bytes_is_measured_and_logged_once(fresh_state, caplog):
    """Note [Finding the blocks]: what the segments hold of a step's saved bytes, each storage once."""
    from ..models import CNN, mlp_chain

    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    cnn = profile(CNN(), (x, y), step_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), scale=False, device="cpu")
    assert 0.5 < cnn.coverage() < 1  # the stem (conv, BatchNorm, ReLU) and the head are outside the blocks
    assert cnn.segment_saved_bytes <= sum(s.saved_bytes for s in cnn.segments)
    chain = mlp_chain(width=16, depth=3)
    mlp = profile(chain, (torch.randn(8, 16), y), step_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), scale=False, device="cpu")
    assert mlp.coverage() > 0.9  # every layer is in a segment; only the loss is not
    with caplog.at_level(logging.INFO, logger="lightning_swap"):
        accelerator = SwapAccelerator(cpu=True, swap_plugin=SwapPlugin(budget_bytes="1GiB", log_stats=False))
        cnn_model = CNN()
        model, opt = accelerator.prepare(cnn_model, torch.optim.SGD(cnn_model.parameters(), lr=0.1))
        for _ in range(3):
            accelerator.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        accelerator.end_training()
    found = [r.getMessage() for r in caplog.records if "segments found automatically" in r.getMessage()]
    held = [r.getMessage() for r in caplog.records if "a step saves for backward" in r.getMessage()]
    assert found == ["lightning-swap: 4 segments found automatically: blocks.0, blocks.1, blocks.2, blocks.3"]
    assert len(held) == 1 and re.search(r"the 4 segments hold .* \(\d+%\)", held[0]), held
