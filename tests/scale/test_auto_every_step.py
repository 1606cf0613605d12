"""Issue 20: ``policy="auto"`` within the budget on every step, the first included (Note [The
budget held online]), and the minimum it names is the lowest-memory plan's measured peak."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch

from accelerate_swap import SwapPlugin
from lightning_swap import Action, CPUSwapStrategy, InfeasibleBudgetError

from ..lit import LitModel, fit
from ..models import MODELS
from ..adapters.test_accelerate import fresh_state  # noqa: F401 - a fixture


class _AdamW(LitModel):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


_BATCH = {"mlp": 64, "gpt": 16, "cnn": 16}


def _fit(name, strategy, steps=4, batch_size=None, **kwargs):
    from tests import lit

    original, lit.LitModel = lit.LitModel, _AdamW
    try:
        return fit(name, strategy, batch_size=batch_size or _BATCH[name], steps=steps, **kwargs)
    finally:
        lit.LitModel = original


def _peaks(trainer):
    return [s.peak_device_bytes for s in trainer.strategy.stats_history]


@functools.cache
def _forced(name, policy, accumulate=1):
    _, trainer = _fit(name, CPUSwapStrategy(policy=policy, min_offload_bytes=0), accumulate_grad_batches=accumulate)
    return max(_peaks(trainer))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_every_step_within_the_budget_from_the_smallest_to_above_plain(name):
    plain, least = _forced(name, "keep"), _least_forced(name)
    for budget in (int(1.03 * least), int(0.5 * (least + plain)), plain, int(1.2 * plain)):
        _, trainer = _fit(name, CPUSwapStrategy(budget_bytes=budget, min_offload_bytes=0), steps=5)
        peaks = _peaks(trainer)
        assert len(peaks) == 5 and max(peaks) <= budget, (name, budget, peaks)
        for row in trainer.strategy.plan.rows:
            if row.action not in (Action.KEEP, Action.OFFLOAD) and row.recomputed_bytes > 0:
                assert row.added_ms > 0, row  # a segment that recomputes never costs 0 ms


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_plains_peak_is_predicted_from_the_first_step(name):
    """Note [A step measured under a plan]: plain's steady peak, predicted from the first step
    (every segment and region offloaded, traced with what it moved held as kept) shifted to the
    steady state, is plain's measured one within 0.5%."""
    from lightning_swap.core import simulate

    plain = _forced(name, "keep")
    _, trainer = _fit(name, CPUSwapStrategy(budget_bytes=int(0.9 * plain), min_offload_bytes=0, log_plan=False), steps=3)
    auto = trainer.strategy.swap_session.auto
    profile = auto._profile(auto._current)
    predicted = simulate(profile, {n: Action.KEEP for n in profile.names}).peak_bytes
    assert abs(predicted - plain) <= 0.005 * plain, (predicted, plain)


def _accelerate_peaks(plugin, steps=4):
    """AdamW steps of the MLP chain through ``SwapAccelerator``, each batch a temporary the loop
    drops after the forward (the autograd graph frees it in the backward); each step's peak."""
    from accelerate_swap import SwapAccelerator

    build, data, loss_fn = MODELS["mlp"]
    torch.manual_seed(0)
    model = build()
    accelerator = SwapAccelerator(cpu=True, swap_plugin=plugin)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    peaks = []
    for _ in range(steps):
        accelerator.backward(loss_fn(model(data(8)[0]), data(8)[1]))
        optimizer.step()
        optimizer.zero_grad()
        peaks.append(accelerator.swap_step_stats.peak_device_bytes)
    accelerator.end_training()
    return peaks


@pytest.mark.parametrize("adapter", ["accelerate", "lightning"])
def test_at_plains_peak_every_step_peaks_at_plains_whether_or_not_the_loop_keeps_its_batch(adapter, fresh_state):
    """Note [An observed step holds no batch]: AdamW on the MLP chain at batch 8 peaks in the
    optimizer step, where no plan changes what is alive, so at a budget of plain's measured
    peak every step of ``auto`` (guard, observed or planned) peaks exactly at plain's.
    Accelerate's loop here drops each batch after the forward, Lightning's holds it through the
    step: an observation that kept the batch made every guard step one batch over plain (the
    zoo's ResNet and Inception-v3) and the budget infeasible."""
    if adapter == "accelerate":
        plain = _accelerate_peaks(SwapPlugin(policy="keep", min_offload_bytes=0))
        peaks = _accelerate_peaks(SwapPlugin(budget_bytes=max(plain), min_offload_bytes=0))
    else:
        plain = _peaks(_fit("mlp", CPUSwapStrategy(policy="keep", min_offload_bytes=0, log_plan=False), batch_size=8)[1])
        peaks = _peaks(_fit("mlp", CPUSwapStrategy(budget_bytes=max(plain), min_offload_bytes=0, log_plan=False), batch_size=8)[1])
    assert len(peaks) == 4 and peaks == plain, (peaks, plain)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_a_budget_well_above_plain_keeps_everything(name):
    budget = int(1.2 * _forced(name, "keep"))
    _, trainer = _fit(name, CPUSwapStrategy(budget_bytes=budget, min_offload_bytes=0), steps=5)
    assert set(trainer.strategy.plan.actions.values()) == {Action.KEEP}
    assert max(_peaks(trainer)) <= budget


def _least_forced(name):
    """The least any forced policy is measured to run in (on CPU ``offload``'s for the GPT and the
    CNN, below ``recompute_offload``'s)."""
    return min(_forced(name, policy) for policy in ("offload", "recompute", "selective", "recompute_offload"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_the_minimum_is_the_lowest_memory_plans_peak_and_raised_before_a_step_is_over(name):
    """The lowest-memory plan (``Plan.lowest_memory``: every segment offloaded on CPU without a
    prefetch, the regions outside them offloaded too, issue 23) needs at most what any forced
    policy does (they keep the regions), and a budget just above its measured peak trains."""
    least = _least_forced(name)
    budget = least // 2
    with pytest.raises(InfeasibleBudgetError) as info:
        _fit(name, CPUSwapStrategy(budget_bytes=budget, min_offload_bytes=0))
    # above the budget that failed, and not above any forced policy's measured peak
    assert budget < info.value.min_budget_bytes <= least, (info.value.min_budget_bytes, least)
    least = info.value.min_budget_bytes
    _, trainer = _fit(name, CPUSwapStrategy(budget_bytes=int(1.03 * least), min_offload_bytes=0))
    peaks = _peaks(trainer)
    assert max(peaks) <= int(1.03 * least)
    # Issue 20: the stated minimum is what the lowest-memory plan measures, within 5%: the steady
    # steps run it (or a plan using the 3% above it); step 1 is lower (AdamW's state not yet made)
    assert abs(max(peaks[1:]) - least) <= 0.05 * least, (peaks, least)


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [2, 4])
def test_accumulation_minimum_is_at_most_plains_peak(accumulate):
    """The minimum is at most plain's peak, and a budget between them is kept on every step.
    (This failed in ~1 run in 10 before Note [Holds are tokens, not ids]: a guard step's profile
    came out 256 KiB low in every backward window, and the first plan made from it was over.)"""
    plain = _forced("cnn", "keep", accumulate)
    with pytest.raises(InfeasibleBudgetError) as info:
        _fit("cnn", CPUSwapStrategy(budget_bytes=1 << 16, min_offload_bytes=0), accumulate_grad_batches=accumulate)
    least = info.value.min_budget_bytes
    assert least <= plain
    budget = (least + plain) // 2
    _, trainer = _fit("cnn", CPUSwapStrategy(budget_bytes=budget, min_offload_bytes=0), steps=8, accumulate_grad_batches=accumulate)
    assert max(_peaks(trainer)) <= budget, (_peaks(trainer), budget)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("seed", range(4))
def test_no_action_is_free_and_ties_go_to_keep(seed, device_type):
    """Note [An action is never free]: measured costs of 0 (noise) and a forward made only of
    heavy ops still price recomputation at its forward; a budget everything fits keeps all."""
    import dataclasses

    from lightning_swap.core import simulate, solve

    from ..decide.test_solver import random_chain

    chain = random_chain(seed, 6, device_type=device_type)
    zeroed = tuple(
        dataclasses.replace(s, recompute_ms=0.0, selective_ms=-0.5, heavy_forward_ms=s.forward_ms) for s in chain.segments
    )
    profile = dataclasses.replace(chain, segments=zeroed)
    plan = solve(profile, budget_bytes=10 * profile.peak_bytes)
    assert set(plan.actions.values()) == {Action.KEEP}
    for action in (Action.RECOMPUTE, Action.SELECTIVE, Action.RECOMPUTE_OFFLOAD, Action.OFFLOAD):
        prediction = simulate(profile, [action] * len(zeroed))
        for row, s in zip(prediction.rows, zeroed):
            assert f"{row.added_ms:.2f}" != "0.00", (action, row)
            if action is not Action.OFFLOAD and action is not Action.SELECTIVE:
                assert row.added_ms >= s.forward_ms, (action, row)
        assert prediction.step_ms > simulate(profile, [Action.KEEP] * len(zeroed)).step_ms


@pytest.fixture
def busy_cpu():
    """Another process loading the CPU for the test's duration (a Python busy loop)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


_BUSY = ["mlp", "gpt", "cnn"]


@pytest.mark.slow
@pytest.mark.parametrize("runs", [
    pytest.param((_BUSY * 4)[:10], id="ten-runs"),
    pytest.param([name for name in _BUSY for _ in range(10)], id="ten-per-model", marks=pytest.mark.long("ten runs per model, ~50 s")),
])
def test_at_plains_peak_every_segment_is_kept_while_another_process_loads_the_cpu(busy_cpu, runs):
    """Issue 20's Done-when: at a budget of plain's measured peak (and above) the plan is all
    keep, run after run, while the machine is loaded: plain's peak is predicted exactly from the
    first step (Note [A step measured under a plan]), and timing noise cannot make an action free (Note [An action is never free]).
    Ten runs over the three models (``LSWAP_LONG=1``: ten per model too); every step within budget."""
    for i, name in enumerate(runs):
        budget = int(_forced(name, "keep") * (1.0, 1.1)[i % 2])
        _, trainer = _fit(name, CPUSwapStrategy(budget_bytes=budget, min_offload_bytes=0, log_plan=False), steps=5)
        assert set(trainer.strategy.plan.actions.values()) == {Action.KEEP}, (i, name, trainer.strategy.plan.summary())
        assert max(_peaks(trainer)) <= budget, (i, name, _peaks(trainer))


@pytest.mark.slow
def test_the_finders_batch_trains_within_the_budget_from_its_first_step():
    """Item 6: the batch ``SwapBatchSizeFinder`` returns runs within the same budget from its
    first step in a new Trainer (Note [The budget held online])."""
    from lightning_swap import SwapBatchSizeFinder

    budget = int(1.5 * _forced("mlp", "keep"))
    finder = SwapBatchSizeFinder(mode="max", max_batch_size=2048, max_trials=3)
    module, trainer = _fit(
        "mlp", CPUSwapStrategy(budget_bytes=budget, min_offload_bytes=0, log_plan=False), steps=2, samples=4096,
        callbacks=[finder],
    )
    found = finder.optimal_batch_size
    assert found > _BATCH["mlp"] and module.batch_size == found
    assert max(_peaks(trainer)) <= budget
    _, fresh = _fit("mlp", CPUSwapStrategy(budget_bytes=budget, min_offload_bytes=0, log_plan=False), steps=4, batch_size=found)
    peaks = _peaks(fresh)
    assert len(peaks) == 4 and peaks[0] <= budget and max(peaks) <= budget, (found, budget, peaks)
