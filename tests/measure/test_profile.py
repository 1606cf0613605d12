"""The profiler and the memory model against the runtime's own CPU meter.

Two models whose activations dominate their memory, so budgets at a fraction of the plain
peak can be met: a GPT-style decoder and a ResNet-style CNN (BasicBlock-like residual blocks
with BatchNorm, in-place ReLU, dropout and an in-place residual add; torchvision's ResNet-18 is
dominated by its 45 MB of parameters and gradients at any size that runs quickly on CPU).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from lightning_swap.core import Action, InfeasibleBudgetError, Plan, SwapRuntime, min_budget_bytes, profile, simulate, solve

from ..models import _images, _tokens, cnn_bn_dropout, lm_loss, tiny_gpt

CASES = {
    "gpt": (lambda: tiny_gpt(layers=6), lambda b: _tokens(b), lm_loss, 16),
    "resnet": (lambda: cnn_bn_dropout(channels=16, blocks=6), lambda b: _images(b, 32), F.cross_entropy, 8),
}


class Case:
    def __init__(self, name: str) -> None:
        build, data, self.loss_fn, self.batch_size = CASES[name]
        torch.manual_seed(0)
        self.model = build()
        self.data = data
        self.x, self.y = data(self.batch_size)
        self.profile = profile(self.model, (self.x, self.y), step_fn=self.step, device="cpu")

    def step(self, model, batch):
        return self.loss_fn(model(batch[0]), batch[1])

    def measure(self, actions, outside=None, window=None) -> int:
        """Peak device bytes of one real step under ``actions`` (and ``outside`` for the regions
        outside the segments), on the runtime's meter; ``window``: both copy windows, in bytes."""
        selective = {s.name: s.selective_ops for s, a in zip(self.profile.segments, actions) if a is Action.SELECTIVE and s.selective_ops}
        plan = Plan(
            actions=dict(zip(self.profile.names, actions)), outside=outside or {}, selective_ops=selective,
            prefetch_bytes=window, inflight_bytes=window,
        )
        runtime = SwapRuntime(self.model, plan, device="cpu").install()
        try:
            runtime.begin_step([self.x, self.y])
            self.step(self.model, (self.x, self.y)).backward()
            stats = runtime.end_step()
        finally:
            runtime.remove()
            self.model.zero_grad(set_to_none=True)
        return stats.peak_device_bytes


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request) -> Case:
    return Case(request.param)


@pytest.mark.slow
def test_plain_step_is_predicted_exactly(case: Case) -> None:
    measured = case.measure([Action.KEEP] * len(case.profile.segments))
    assert simulate(case.profile, [Action.KEEP] * len(case.profile.segments)).peak_bytes == measured == case.profile.peak_bytes


@pytest.mark.parametrize("fraction", [1.2, 0.7, 0.5])
def test_plan_fits_budget_and_prediction_matches_measurement(case: Case, fraction: float) -> None:
    budget = int(fraction * case.profile.peak_bytes)
    plan = solve(case.profile, budget_bytes=budget)
    measured = case.measure(list(plan.actions.values()), plan.outside)
    assert measured <= budget, plan.render()
    assert abs(plan.predicted_peak_bytes - measured) <= 0.05 * measured, (plan.predicted_peak_bytes, measured, plan.render())
    if fraction >= 1.0:
        assert set(plan.actions.values()) == {Action.KEEP}
    else:
        assert set(plan.actions.values()) != {Action.KEEP}


@pytest.mark.parametrize("action", [a for a in Action if a is not Action.OFFLOAD])
def test_uniform_actions_predicted_within_5_percent(case: Case, action: Action) -> None:
    acts = [action] * len(case.profile.segments)
    measured = case.measure(acts)
    predicted = simulate(case.profile, acts).peak_bytes
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)


@pytest.mark.parametrize("window", [None, 0], ids=["default-window", "window-0"])
def test_offload_everything_is_predicted_conservatively(case: Case, window) -> None:
    """On CPU an offloaded tensor comes back only when its op runs; the profiler's estimate of
    that keeps the segment's boundary tensors alive, so it may over-predict, never under. Both
    under CPU's default window (a storage held from its first unpack to its last) and under the
    window of 0 the planner chooses there (fetched per saved tensor: a block's output, which its
    own last op and the next block's first op both save, fetched twice; priced a storage under
    before the trace read every copy by its original's key)."""
    acts = [Action.OFFLOAD] * len(case.profile.segments)
    measured = case.measure(acts, window=window)
    predicted = simulate(case.profile, acts, prefetch_bytes=window, inflight_bytes=window).peak_bytes
    assert measured <= predicted <= 1.15 * measured, (predicted, measured)


def test_infeasible_budget_min_budget_fits_when_measured(case: Case) -> None:
    lo = min_budget_bytes(case.profile)
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(case.profile, budget_bytes=lo - 1)
    assert info.value.min_budget_bytes == lo
    plan = solve(case.profile, budget_bytes=lo)
    assert case.measure(list(plan.actions.values()), plan.outside) <= lo * 1.05


def test_fake_profile_agrees_with_real(case: Case) -> None:
    fake = profile(case.model, (case.x, case.y), step_fn=case.step, fake=True, scale=False, device="cpu")
    assert fake.fake and not case.profile.fake
    assert fake.names == case.profile.names
    for real_seg, fake_seg in zip(case.profile.segments, fake.segments):
        assert abs(fake_seg.saved_bytes - real_seg.saved_bytes) <= 0.02 * real_seg.saved_bytes, real_seg.name
        assert abs(fake_seg.backward_peak_bytes - real_seg.backward_peak_bytes) <= 0.02 * real_seg.backward_peak_bytes
    assert abs(fake.peak_bytes - case.profile.peak_bytes) <= 0.02 * case.profile.peak_bytes


def test_batch_scaling_predicts_a_real_profile_at_another_batch(case: Case) -> None:
    big = 3 * case.batch_size // 2
    x, y = case.data(big)
    real = profile(case.model, (x, y), step_fn=case.step, scale=False, device="cpu")
    scaled = case.profile.at_batch(big)
    assert scaled.batch_size == big
    assert abs(scaled.peak_bytes - real.peak_bytes) <= 0.05 * real.peak_bytes
    for a, b in zip(scaled.segments, real.segments):
        assert abs(a.saved_bytes - b.saved_bytes) <= 0.05 * b.saved_bytes
    plan = solve(case.profile, budget_bytes=int(0.6 * real.peak_bytes), batch_size=big)
    assert plan.batch_size == big and plan.predicted_peak_bytes <= int(0.6 * real.peak_bytes)


def test_profile_leaves_the_model_as_it_was() -> None:
    case_model = cnn_bn_dropout(channels=8, blocks=2)
    x, y = _images(4, 16)
    before = {k: v.clone() for k, v in case_model.state_dict().items()}
    rng = torch.get_rng_state()
    prof = profile(case_model, (x, y), step_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), device="cpu")
    assert len(prof.segments) == 2
    assert all(torch.equal(before[k], v) for k, v in case_model.state_dict().items())
    assert all(p.grad is None for p in case_model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert not case_model._forward_hooks and not case_model._forward_pre_hooks
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in case_model.modules())


@pytest.mark.parametrize("batch_size", [0, -2, 1.5, True])
def test_bad_batch_size_is_a_value_error_naming_it(batch_size) -> None:
    model = cnn_bn_dropout(channels=4, blocks=2)
    x, y = _images(2, 8)
    with pytest.raises(ValueError, match="batch_size"):
        profile(model, (x, y), step_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), batch_size=batch_size, device="cpu")


def test_at_batch_rejects_bad_sizes_and_unscaled_profiles() -> None:
    model = cnn_bn_dropout(channels=4, blocks=2)
    x, y = _images(2, 8)
    prof = profile(model, (x, y), step_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), scale=False, device="cpu")
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="batch_size"):
            prof.at_batch(bad)
    with pytest.raises(ValueError, match="batch_size"):
        prof.at_batch(4)
    assert prof.at_batch(2) is prof


def test_profiling_leaves_rng_weights_and_gradients_as_they_were():
    """Profiling runs real steps; training afterwards must not notice (Note [The snapshot
    must not keep gradients alive], and dropout masks drawn from the same RNG stream)."""
    from lightning_swap.core import profile as run_profile

    from ..models import MODELS

    build, data, loss_fn = MODELS["gpt"]
    torch.manual_seed(0)
    model = build()
    x, y = data(4)
    loss_fn(model(x), y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    torch.manual_seed(1)
    expected = torch.rand(4)
    torch.manual_seed(1)
    run_profile(model, (x, y), step_fn=lambda m, b: loss_fn(m(b[0]), b[1]), min_offload_bytes=0, device="cpu")
    assert torch.equal(torch.rand(4), expected)
    assert model.lm_head.weight is model.wte.weight
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())


def test_a_step_that_reads_a_value_is_profiled_for_real_when_fake_tensors_cannot_run_it(caplog) -> None:
    """Note [Fake mode is an optimisation]: ``.item()`` in the step breaks fake tensors; the
    profile (and its batch scaling) is measured for real instead, with one debug line."""
    import logging

    torch.manual_seed(0)
    model = tiny_gpt(layers=2)
    x, y = _tokens(8)
    seen = []

    def step(m, b):
        loss = lm_loss(m(b[0]), b[1])
        seen.append(loss.item())
        return loss

    with caplog.at_level(logging.DEBUG, logger="lightning_swap.core.measure.profiler"):
        prof = profile(model, (x, y), step_fn=step, device="cpu", scale=True)
        fake = profile(model, (x, y), step_fn=step, device="cpu", scale=False, fake=True)
    assert not prof.fake and not prof.reference.fake and prof.reference.batch_size == 16
    assert not fake.fake  # asked for fake, measured for real
    assert prof.at_batch(32).peak_bytes > prof.peak_bytes
    assert sum("cannot run on fake tensors" in r.message for r in caplog.records) >= 2
