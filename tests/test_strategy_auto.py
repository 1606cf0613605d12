"""``policy="auto"`` under the Lightning strategy: fits a simulated budget, equals plain
training, re-plans when the batch shape changes."""

from __future__ import annotations

import pytest
import torch

from lightning_swap import Action, CPUSwapStrategy

from .helpers import assert_same_state
from .lit import fit


def _peaks(trainer):
    return [s.peak_device_bytes for s in trainer.strategy.stats_history]


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_auto_fits_the_budget_and_equals_plain(name):
    batch = 16
    plain, trainer = fit(name, CPUSwapStrategy(policy="keep", min_offload_bytes=0), batch_size=batch, steps=3)
    plain_peak = max(_peaks(trainer)[1:])  # steady state: optimizer state exists
    budget = int(0.7 * plain_peak)
    module, trainer = fit(name, CPUSwapStrategy(budget_bytes=budget, min_offload_bytes=0), batch_size=batch, steps=3)
    plan = trainer.strategy.plan
    assert plan.predicted_peak_bytes <= budget
    assert set(plan.actions.values()) != {Action.KEEP}
    peaks = _peaks(trainer)
    assert max(peaks) <= budget
    # the plan made after the optimizer state appeared predicts the steady state within 5%
    assert abs(plan.predicted_peak_bytes - peaks[-1]) <= 0.05 * peaks[-1]
    assert_same_state(module, plain)


def test_auto_without_a_budget_on_cpu_keeps_everything():
    _, trainer = fit("cnn", "cpu_swap")
    assert set(trainer.strategy.plan.actions.values()) == {Action.KEEP}
    assert trainer.strategy.swap_config.is_auto


def test_auto_replans_when_the_batch_shape_changes():
    # 40 samples in batches of 16: the third batch has 8 samples.
    _, trainer = fit("gpt", CPUSwapStrategy(budget_bytes=1 << 40, min_offload_bytes=0), batch_size=16, steps=3, samples=40)
    assert trainer.strategy.plan.batch_size == 8
    profile = trainer.strategy.swap_session.profile
    assert profile.batch_size == 16  # rescaled, not profiled again: only the batch size changed


def test_budget_below_any_plan_names_the_smallest_budget():
    from lightning_swap.core.errors import InfeasibleBudgetError

    with pytest.raises(InfeasibleBudgetError, match="smallest budget") as info:
        fit("cnn", CPUSwapStrategy(budget_bytes=1024, min_offload_bytes=0))
    assert info.value.min_budget_bytes > 1024
