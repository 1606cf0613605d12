"""``policy="auto"`` plans from the training steps that run anyway (Note [Observe, do not
re-run]): the user's ``training_step`` runs as often as in plain training, its side effects
(counters, metrics, ``self.log``, ``.item()``) are those of plain training, and the budget
advice of ``InfeasibleBudgetError`` works as given."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
import torchmetrics

from lightning_swap import Action, CPUSwapStrategy, InfeasibleBudgetError

from ..helpers import QUIET_TRAINER, assert_same_state
from ..lit import LitModel, fit


class Busy(LitModel):
    """A training step as users write them: a call counter, a metric update, ``.item()`` into a
    list, and ``self.log``."""

    def __init__(self, name: str, **kwargs) -> None:
        super().__init__(name, **kwargs)
        self.calls = 0
        self.losses: list[float] = []
        self.mean_loss = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        self.calls += 1
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        self.mean_loss.update(loss.detach())
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss


def _fit_busy(strategy, steps: int = 5, batch_size: int = 16):
    L.seed_everything(0, verbose=False)
    module = Busy("gpt", batch_size=batch_size, samples=batch_size * steps)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, **QUIET_TRAINER)
    trainer.fit(module)
    return module, trainer


def _steady_peak() -> int:
    _, trainer = fit("gpt", CPUSwapStrategy(policy="keep", min_offload_bytes=0), batch_size=16, steps=3)
    return max(s.peak_device_bytes for s in trainer.strategy.stats_history[1:])


def test_training_step_runs_as_often_as_in_plain_training_and_its_side_effects_match():
    plain, _ = _fit_busy("auto")
    budget = int(0.7 * _steady_peak())
    ours, trainer = _fit_busy(CPUSwapStrategy(budget_bytes=budget, min_offload_bytes=0))
    assert set(trainer.strategy.plan.actions.values()) != {Action.KEEP}  # the plan was made, despite .item()
    assert ours.calls == plain.calls == 5
    assert ours.losses == plain.losses
    assert ours.mean_loss._update_count == plain.mean_loss._update_count == 5
    assert torch.equal(ours.mean_loss.compute(), plain.mean_loss.compute())
    assert torch.equal(trainer.callback_metrics["train_loss_epoch"], plain.trainer.callback_metrics["train_loss_epoch"])
    assert_same_state(ours, plain)


def test_the_smallest_budget_the_error_names_is_enough():
    """InfeasibleBudgetError is raised for the steady state (gradients and optimizer state
    included), so the budget it names trains."""
    with pytest.raises(InfeasibleBudgetError) as info:
        _fit_busy(CPUSwapStrategy(budget_bytes=1 << 20, min_offload_bytes=0), steps=3)
    least = info.value.min_budget_bytes
    assert least > 1 << 20
    module, trainer = _fit_busy(CPUSwapStrategy(budget_bytes=least, min_offload_bytes=0), steps=3)
    assert module.calls == 3
    assert all(s.peak_device_bytes <= least for s in trainer.strategy.stats_history[1:])


@pytest.mark.slow
def test_the_batch_size_finder_works_with_item_in_training_step():
    """The finder profiles with fake tensors where it can; ``.item()`` makes it measure for real."""
    from lightning_swap import SwapBatchSizeFinder

    budget = int(1.5 * _steady_peak())
    L.seed_everything(0, verbose=False)
    module = Busy("gpt", batch_size=16, samples=512)
    finder = SwapBatchSizeFinder(mode="max", max_batch_size=64, max_trials=3)
    trainer = L.Trainer(
        strategy=CPUSwapStrategy(budget_bytes=budget, min_offload_bytes=0), accelerator="cpu", max_steps=2, **QUIET_TRAINER,
        callbacks=[finder],
    )
    trainer.fit(module)
    assert finder.optimal_batch_size >= 16 and module.batch_size == finder.optimal_batch_size
    assert all(s.peak_device_bytes <= budget for s in trainer.strategy.stats_history)


def test_auto_without_a_budget_on_cpu_says_so_once_and_how_to_set_one(caplog):
    caplog.set_level(logging.WARNING, logger="lightning_swap")
    plain, _ = _fit_busy("auto", steps=3)
    ours, trainer = _fit_busy(CPUSwapStrategy(), steps=3)
    assert set(trainer.strategy.plan.actions.values()) == {Action.KEEP}
    assert ours.losses == plain.losses
    warnings = [r for r in caplog.records if "no memory budget" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
    assert "budget_bytes='8GiB'" in warnings[0].getMessage()
