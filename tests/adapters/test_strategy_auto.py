"""``policy="auto"`` under the Lightning strategy: fits a simulated budget, equals plain
training, re-plans when the batch shape changes."""

from __future__ import annotations

import pytest

from lightning_swap import Action, CPUSwapStrategy

from ..helpers import QUIET_TRAINER, assert_same_state, peaks as _peaks
from ..lit import fit


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
    # Plain does not fit: no step is observed plainly (Note [Observe only what fits]); every
    # step fits, the first included, and the plan predicts the steady state within 5%.
    assert len(peaks) == 3
    assert max(peaks) <= budget
    assert abs(plan.predicted_peak_bytes - peaks[-1]) <= 0.05 * peaks[-1], (plan.predicted_peak_bytes, peaks)
    assert_same_state(module, plain)


def test_auto_without_a_budget_on_cpu_keeps_everything():
    _, trainer = fit("cnn", "cpu_swap")
    assert set(trainer.strategy.plan.actions.values()) == {Action.KEEP}
    assert trainer.strategy.swap_config.is_auto


def test_auto_plans_a_smaller_batch_at_once_and_traces_a_longer_shape_once():
    """Note [A shape scaled from another]: a smaller last batch is planned at once from the first
    step's profile; a batch of longer sequences is traced once (its own profile from then on)."""
    from unittest import mock

    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_swap.core.scale.auto import AutoPlanner

    from ..lit import LitModel
    from ..models import _tokens

    class Shapes(LitModel):
        def train_dataloader(self):
            batches = [_tokens(16, seq=16), _tokens(16, seq=16), _tokens(8, seq=16), _tokens(16, seq=32), _tokens(16, seq=32)]
            return DataLoader(batches, batch_size=None)

    L.seed_everything(0, verbose=False)
    module = Shapes("gpt")
    strategy = CPUSwapStrategy(budget_bytes=1 << 40, min_offload_bytes=0)
    with mock.patch.object(AutoPlanner, "traced", autospec=True, side_effect=AutoPlanner.traced) as traced:
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=5, **QUIET_TRAINER)
        trainer.fit(module)
    assert traced.call_count == 2  # the first step, and the first of the longer sequences
    assert strategy.swap_session.profile.batch_size == 16
    assert set(strategy.plan.actions.values()) == {Action.KEEP}, strategy.plan.summary()
    assert len(strategy.stats_history) == 5


def test_budget_below_any_plan_names_the_smallest_budget():
    from lightning_swap.core.errors import InfeasibleBudgetError

    with pytest.raises(InfeasibleBudgetError, match="smallest budget") as info:
        fit("cnn", CPUSwapStrategy(budget_bytes=1024, min_offload_bytes=0))
    assert info.value.min_budget_bytes > 1024


@pytest.mark.parametrize("fraction", [1.5, 0.8])
def test_report_draws_the_planned_step_beside_the_budget(tmp_path, fraction):
    """The memory picture is drawn from a step ``auto`` runs under its checked plan, with the budget
    line, whether plain fits the budget or not (it was skipped, silently, below plain's peak)."""
    plain, trainer = fit("gpt", CPUSwapStrategy(policy="keep", min_offload_bytes=0), batch_size=16, steps=3)
    budget = int(fraction * max(_peaks(trainer)[1:]))
    strategy = CPUSwapStrategy(budget_bytes=budget, min_offload_bytes=0, report=True)
    module, trainer = fit("gpt", strategy, batch_size=16, steps=6, default_root_dir=tmp_path)
    path = strategy.report_path
    assert path is not None and path.parent == tmp_path and path.stat().st_size > 10_000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert strategy._recorder is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in module.modules())
    plain, _ = fit("gpt", CPUSwapStrategy(policy="keep", min_offload_bytes=0), batch_size=16, steps=6)
    assert_same_state(module, plain)  # recording it changed nothing in training


def test_report_draws_a_forced_plans_steady_step_and_says_when_it_drew_none(tmp_path, caplog):
    """Issue 42, item 3: the picture is drawn from a step the run made (a forced plan's too), and
    a run too short for a steady step says so instead of writing nothing silently."""
    import logging

    strategy = CPUSwapStrategy(policy="offload", min_offload_bytes=0, report=True)
    fit("cnn", strategy, steps=3, default_root_dir=tmp_path / "forced")
    assert strategy.report_path is not None and strategy.report_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    caplog.set_level(logging.INFO)
    short = CPUSwapStrategy(policy="offload", min_offload_bytes=0, report=True)
    fit("cnn", short, steps=1, default_root_dir=tmp_path / "short")
    assert short.report_path is None and any("drew no memory picture" in r.getMessage() for r in caplog.records)


def test_timeline_marks_every_segment_forward_and_backward():
    from lightning_swap.core import SwapRuntime, find_segments
    from lightning_swap.core.measure.timeline import TimelineRecorder

    from ..models import MODELS

    build, data, loss_fn = MODELS["cnn"]
    model = build()
    x, y = data(8)
    names = find_segments(model)
    with SwapRuntime(model, {n: Action.OFFLOAD for n in names}, min_offload_bytes=0, device="cpu") as runtime:
        runtime.begin_step([x, y])
        with TimelineRecorder(model, names, runtime.meter, "offload") as recorder:
            loss_fn(model(x), y).backward()
        stats = runtime.end_step()
    timeline = recorder.timeline
    labels = [label for _, label in timeline.marks]
    assert labels == [f"F {n}" for n in names] + [f"B {n}" for n in reversed(names)]
    assert timeline.peak_bytes == stats.peak_device_bytes
    xs = [x for x, _ in timeline.samples]
    assert xs == sorted(xs) and len(xs) > 2 * len(names)


def test_gradient_accumulation_traces_once_and_equals_plain():
    """Micro-steps are steps: the first is traced, the next plan (with the accumulated gradients),
    and plans are made again only when the gradients or the optimizer state grow."""
    from unittest import mock

    from lightning_swap.core.scale.auto import AutoPlanner

    with mock.patch.object(AutoPlanner, "traced", autospec=True, side_effect=AutoPlanner.traced) as traced, \
            mock.patch.object(AutoPlanner, "plan", autospec=True, side_effect=AutoPlanner.plan) as planned:
        module, trainer = fit(
            "cnn", CPUSwapStrategy(budget_bytes=1 << 40, min_offload_bytes=0), steps=3, batch_size=4, samples=64,
            accumulate_grad_batches=2,
        )
    assert traced.call_count == 1
    assert planned.call_count <= 3  # the gradients appear, the momentum appears, both are alive
    plain, _ = fit("cnn", "auto", steps=3, batch_size=4, samples=64, accumulate_grad_batches=2)
    assert_same_state(module, plain)
