"""``policy="auto"`` in ``SwapAccelerator`` (one process, in this process) and
``accelerate_swap.find_batch_size``; under ``accelerate launch`` on 2 processes auto is
covered by tests/adapters/test_accelerate.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from accelerate import Accelerator
from torch.nn import functional as F

from accelerate_swap import Action, BatchSearchError, SwapAccelerator, SwapPlugin, find_batch_size

from ..helpers import assert_same_state
from ..models import CNN, MODELS, TinyGPT, _tokens, lm_loss
from .test_accelerate import _clean, fresh_state  # noqa: F401 - a fixture

_images = MODELS["cnn"][1]


def _train(accelerator, batches, *, build=CNN, data=_images, loss_fn=F.cross_entropy, with_profiles=False):
    """Train ``build()`` with SGD+momentum on batches of the given sizes (or given batches);
    returns the unwrapped model, each step's measured peak and plan (and profile)."""
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    torch.manual_seed(1)  # dropout masks
    peaks, plans, profiles = [], [], []
    for batch in batches:
        x, y = data(batch) if isinstance(batch, int) else batch
        accelerator.backward(loss_fn(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        stats = accelerator.swap_step_stats
        peaks.append(stats.peak_device_bytes if stats is not None else None)
        plans.append(accelerator.swap_plan)
        profiles.append(accelerator.swap_session.profile)
    if with_profiles:
        return accelerator.unwrap_model(model), peaks, plans, profiles
    return accelerator.unwrap_model(model), peaks, plans


# -- policy="auto" ------------------------------------------------------------------------
def test_auto_fits_a_simulated_budget_and_equals_plain(fresh_state):
    plain, peaks, _ = _train(SwapAccelerator(cpu=True, swap_plugin=SwapPlugin(policy="keep", min_offload_bytes=0)), [8] * 4)
    budget = int(0.6 * max(peaks))  # the steady-state plain peak, less 40%
    accelerator = SwapAccelerator(cpu=True, swap_plugin=SwapPlugin(budget_bytes=budget, min_offload_bytes=0))
    auto, peaks, plans = _train(accelerator, [8] * 4)
    # Note [Observe only what fits]: plain does not fit, so no step is observed plainly: every
    # step runs within the budget, the first included, under the lowest-memory plan.
    assert None not in peaks and max(peaks) <= budget, peaks
    steady = plans[-1]
    assert dict(plans[2].actions) == dict(steady.actions) == dict(plans[3].actions)
    assert set(steady.actions.values()) != {Action.KEEP}
    assert steady.predicted_peak_bytes <= budget and steady.batch_size == 8
    assert max(peaks[1:]) <= budget
    # the plan comes from the first step, traced under the lowest-memory plan (Note [A step measured
    # under a plan]), the user's loss included: plain's peak is predicted exactly from it, and a
    # plan that offloads errs on the safe side (this CNN's offloaded segments fetch a storage their
    # neighbour shares: ~31% over on CPU)
    error = (steady.predicted_peak_bytes - peaks[-1]) / peaks[-1]
    assert 0.0 <= error <= 0.35, (steady.predicted_peak_bytes, peaks)
    assert_same_state(auto, plain)  # torch.equal on every weight and buffer
    accelerator.free_memory()
    assert _clean(auto)


def test_auto_without_a_budget_on_cpu_keeps_everything(fresh_state, caplog):
    caplog.set_level(logging.WARNING, logger="lightning_swap")
    accelerator = SwapAccelerator(cpu=True, swap_plugin=SwapPlugin())  # switched on, no options
    torch.manual_seed(0)
    model = accelerator.prepare(CNN())
    assert accelerator.swap_plan is None  # auto plans on the first training forward
    model.eval()
    model(_images(4)[0])
    with torch.no_grad():
        model.train()
        model(_images(4)[0])
    assert accelerator.swap_plan is None  # neither an evaluation forward nor a no-grad one plans
    x, y = _images(4)
    accelerator.backward(F.cross_entropy(model(x), y))
    assert set(accelerator.swap_plan.actions.values()) == {Action.KEEP}
    assert accelerator.swap_session.profile is None  # nothing to plan for: no profile was run
    assert accelerator.swap_step_stats is None  # no optimizer step: the step is still open...
    accelerator.end_training()
    assert accelerator.swap_step_stats is not None  # ...until training ends
    accelerator = SwapAccelerator(cpu=True, swap_plugin=SwapPlugin())
    model = accelerator.prepare(CNN())
    for _ in range(3):
        accelerator.backward(F.cross_entropy(model(x), y))
    accelerator.end_training()
    warnings = [r for r in caplog.records if "no memory budget" in r.getMessage()]
    assert len(warnings) == 2, [r.getMessage() for r in caplog.records]  # once per accelerator
    assert warnings[0].levelno == logging.WARNING and "ACCELERATE_CPU_SWAP_BUDGET_BYTES" in warnings[0].getMessage()


def test_auto_plans_a_smaller_batch_at_once_and_traces_a_larger_shape_once(fresh_state):
    """Note [A shape scaled from another]: a smaller batch, and a smaller image, are covered by the
    first step's profile and planned at once from it scaled down; a larger image is traced once
    (under a plan of keep and offload) and planned from its own profile after."""
    from ..models import _images as images_of

    accelerator = SwapAccelerator(cpu=True, swap_plugin=SwapPlugin(budget_bytes=1 << 40, min_offload_bytes=0))
    small, large = (_images(6)[0][:, :, :12, :12].contiguous(), _images(6)[1]), images_of(6, 20)
    _, peaks, plans, profiles = _train(accelerator, [8, 8, 8, 8, 5, small, large, large, large], with_profiles=True)
    assert set(plans[0].actions.values()) == {Action.OFFLOAD}  # the first step: the lowest-memory plan, traced
    assert all(set(p.actions.values()) == {Action.KEEP} for p in plans[1:])  # plain fits 1 TiB
    assert profiles[0] is profiles[5] and profiles[0].batch_size == 8  # 5 x 16x16 and 6 x 12x12: no trace
    assert profiles[6] is not profiles[5] and profiles[6] is profiles[8] and profiles[8].batch_size == 6  # its own
    assert None not in peaks
    accelerator.free_memory()


_MLP_BUILD, _MLP_DATA, _MLP_LOSS = MODELS["mlp"]


def _mlp_step(model, batch):
    return _MLP_LOSS(model(batch[0]), batch[1])


def _prepared(plugin):
    accelerator = SwapAccelerator(cpu=True, swap_plugin=plugin)
    torch.manual_seed(0)
    model = _MLP_BUILD()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _state(accelerator, model, optimizer):
    return copy.deepcopy((accelerator.unwrap_model(model).state_dict(), optimizer.state_dict()))


def _assert_same(a, b):
    (wa, oa), (wb, ob) = a, b
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert oa["param_groups"] == ob["param_groups"] and oa["state"].keys() == ob["state"].keys()
    for k, state in oa["state"].items():
        assert all(torch.equal(v, ob["state"][k][n]) for n, v in state.items())


@pytest.mark.slow
def test_find_batch_size_at_least_doubles_the_plain_batch_within_the_budget(fresh_state):
    batch = 256  # activations, not weights, dominate the plain peak (tests/scale/test_scale.py)
    accelerator, model, optimizer = _prepared(SwapPlugin(policy="keep", min_offload_bytes=0))
    budget = max(_train_more_mlp(accelerator, model, optimizer, [batch] * 3))
    accelerator.free_memory()

    accelerator, model, optimizer = _prepared(SwapPlugin(budget_bytes=budget, min_offload_bytes=0))
    _train_more_mlp(accelerator, model, optimizer, [32])  # steady state: momentum exists
    before = _state(accelerator, model, optimizer)
    seen = {}

    @find_batch_size(accelerator=accelerator, model=model, optimizer=optimizer, make_batch=_MLP_DATA, step_fn=_mlp_step, max_batch_size=4096)
    def train(batch_size, tag):
        seen["state"] = _state(accelerator, model, optimizer)
        seen["plan"] = accelerator.swap_plan
        seen["peaks"] = _train_more_mlp(accelerator, model, optimizer, [batch_size] * 2)
        return tag, batch_size

    tag, found = train("run")  # called like Accelerate's: without the batch size
    assert tag == "run" and found == train.result.batch_size >= 2 * batch
    assert len(train.result.trials) <= 3 and "chosen" in train.result.render()
    _assert_same(seen["state"], before)  # the search left model and optimizer as they were
    assert seen["plan"] is None  # forgotten: the first forward at the found batch planned again
    assert max(seen["peaks"]) <= budget  # training at the found batch fits the budget
    assert set(accelerator.swap_plan.actions.values()) != {Action.KEEP}
    assert accelerator.swap_plan.batch_size == found
    accelerator.free_memory()
    # Issue 20 item 6: the batch found runs within the same budget from its first step in a fresh
    # accelerator too (guarded there: Note [Observe only what fits]).
    accelerator, model, optimizer = _prepared(SwapPlugin(budget_bytes=budget, min_offload_bytes=0))
    peaks = _train_more_mlp(accelerator, model, optimizer, [found] * 4)
    assert len(peaks) == 4 and max(peaks) <= budget, (found, budget, peaks)
    accelerator.free_memory()


@pytest.mark.slow
def test_find_batch_size_throughput_is_at_least_plain_at_the_profile_batch(fresh_state):
    accelerator, model, optimizer = _prepared(SwapPlugin(budget_bytes=1 << 30, min_offload_bytes=0))
    _train_more_mlp(accelerator, model, optimizer, [32])  # steady state: momentum exists
    search = dict(accelerator=accelerator, model=model, optimizer=optimizer, make_batch=_MLP_DATA, step_fn=_mlp_step)
    train = find_batch_size(lambda batch_size: batch_size, **search, mode="throughput", max_batch_size=256, profile_batch_size=48, steps_per_trial=3)
    found = train()
    result = train.result
    plain = result.plain_trial  # profile_batch_size is the base batch: plain training there is the reference
    assert result.base_batch_size == 48 and plain is not None and plain.batch_size == 48 and not plain.failed
    assert found == result.batch_size and result.chosen_trial.samples_per_s >= plain.samples_per_s
    assert f"plain at batch 48: {plain.samples_per_s:.1f} samples/s measured" in result.render()
    accelerator.free_memory()


def _train_more_mlp(accelerator, model, optimizer, batches):
    peaks = []
    for batch in batches:
        x, y = _MLP_DATA(batch)
        accelerator.backward(_MLP_LOSS(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        peaks.append(accelerator.swap_step_stats.peak_device_bytes)
    return peaks


@pytest.mark.slow
def test_find_batch_size_falls_back_on_out_of_memory_in_train(fresh_state):
    accelerator, model, optimizer = _prepared(SwapPlugin(budget_bytes=1 << 40, min_offload_bytes=0))
    calls = []

    def train(batch_size):
        calls.append(batch_size)
        if batch_size > 40:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return batch_size

    search = dict(accelerator=accelerator, model=model, optimizer=optimizer, make_batch=_MLP_DATA, step_fn=_mlp_step)
    found = find_batch_size(train, **search, max_batch_size=64, max_trials=8)()
    assert calls[0] == 64 and found == calls[-1] <= 40
    assert all(b > a for a, b in zip(calls[1:], calls))  # each retry lower (10% at a time, as Accelerate)
    assert calls == [64, 57, 51, 45, 40]

    calls.clear()

    def never(batch_size):
        calls.append(batch_size)
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    with pytest.raises(BatchSearchError, match="ran out of memory at every batch size") as err:
        find_batch_size(never, **search, max_batch_size=64, max_trials=3)()
    assert calls == [64, 57, 51] and isinstance(err.value.__cause__, torch.OutOfMemoryError)

    def broken(batch_size):
        raise KeyError("a bug in train")

    with pytest.raises(KeyError):  # anything but out-of-memory propagates at once
        find_batch_size(broken, **search, max_batch_size=64)()
    accelerator.free_memory()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"mode": "power"}, "mode"),
        ({"margin": 1.0}, "margin"),
        ({"min_batch_size": 64, "max_batch_size": 32}, "min_batch_size"),
        ({"steps_per_trial": 0}, "steps_per_trial"),
        ({"max_trials": 0}, "max_trials"),
        ({"budget_bytes": -1}, "budget_bytes"),
        ({"make_batch": 3}, "make_batch"),
        ({"step_fn": None}, "step_fn"),
        ({"model": "net"}, "model"),
        ({"optimizer": object()}, "optimizer"),
        ({"profile_batch_size": 0}, "profile_batch_size"),
        ({"profile_batch_size": 9000}, "profile_batch_size"),
    ],
)
@pytest.mark.slow
def test_find_batch_size_bad_arguments_name_the_argument(fresh_state, kwargs, name):
    accelerator, model, optimizer = _prepared(SwapPlugin(budget_bytes=1 << 30))
    args = dict(accelerator=accelerator, model=model, optimizer=optimizer, make_batch=_MLP_DATA, step_fn=_mlp_step)
    with pytest.raises(ValueError, match=f"`{name}`"):
        find_batch_size(**{**args, **kwargs})
    accelerator.free_memory()


def test_find_batch_size_checks_the_accelerator_and_model_when_called(fresh_state):
    plain = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="`accelerator`.*SwapAccelerator"):
        find_batch_size(accelerator=plain, model=torch.nn.Linear(2, 2), optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)]), make_batch=_MLP_DATA, step_fn=_mlp_step)
    accelerator, model, optimizer = _prepared(SwapPlugin())  # no budget on CPU
    args = dict(accelerator=accelerator, optimizer=optimizer, make_batch=_MLP_DATA, step_fn=_mlp_step)
    with pytest.raises(ValueError, match="`budget_bytes`"):
        find_batch_size(lambda b: b, model=model, **args)()
    with pytest.raises(ValueError, match="`model`"):
        find_batch_size(lambda b: b, model=_MLP_BUILD(), **args, budget_bytes=1 << 30)()
    accelerator.free_memory()
    per_segment, model, optimizer = _prepared(SwapPlugin(policy={"0": "offload"}, budget_bytes=1 << 30))
    with pytest.raises(ValueError, match="`policy`"):
        find_batch_size(lambda b: b, accelerator=per_segment, model=model, optimizer=optimizer, make_batch=_MLP_DATA, step_fn=_mlp_step)()
    per_segment.free_memory()
