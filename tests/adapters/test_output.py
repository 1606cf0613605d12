"""What users read (issue 22, item 6): a plan table logged before its numbers existed is logged
again once its first step measured them (Lightning's default ``"cpu_swap"``, Accelerate with
``log_plan``: one implementation, Note [The plan's log]); the no-budget warning comes before
training starts; and the library's warnings go above Lightning's progress bar, not into its line
(Note [Warnings above the progress bar])."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.nn import functional as F

import lightning_swap  # noqa: F401 - registers "cpu_swap"
from accelerate_swap import SwapAccelerator, SwapPlugin
from lightning_swap.strategy_base import _ProgressBarLog

from ..helpers import QUIET_TRAINER
from ..lit import LitModel
from ..models import mlp_chain
from .test_accelerate import fresh_state  # noqa: F401 - a fixture


class _Order(L.Callback):
    """How many records were logged when training started."""

    def __init__(self, caplog) -> None:
        self.caplog = caplog
        self.at_start = None

    def on_train_start(self, trainer, pl_module):
        self.at_start = len(self.caplog.records)


def test_default_cpu_swap_logs_its_keep_table_again_with_numbers(caplog, monkeypatch):
    said = []
    monkeypatch.setattr("lightning_swap.strategy_base.rank_zero_info", said.append)  # the strategy's plan log
    caplog.set_level(logging.INFO)
    order = _Order(caplog)
    trainer = L.Trainer(strategy="cpu_swap", accelerator="cpu", devices=1, max_steps=2, callbacks=[order], **QUIET_TRAINER)
    trainer.fit(LitModel("cnn"))
    messages = [r.getMessage() for r in caplog.records]
    tables = [m for m in said if m.startswith("lightning-swap plan")]
    assert len(tables) == 2, tables
    assert "not measured yet" in tables[0]
    assert "measured in its first step" in tables[1] and "keep" in tables[1] and "not measured yet" not in tables[1]
    warned = [i for i, m in enumerate(messages) if "has no memory budget" in m]
    assert len(warned) == 1 and warned[0] < order.at_start  # before the first step (and any progress bar)


@pytest.mark.parametrize("policy", ["offload", "auto"])
def test_accelerate_log_plan_logs_the_measured_table(policy, fresh_state, caplog):
    """The same plan log as Lightning's (Note [The plan's log], one implementation): a forced
    plan's table once, measured; ``auto`` without a budget's keep table, then again measured."""
    caplog.set_level(logging.INFO, logger="lightning_swap")
    accelerator = SwapAccelerator(cpu=True, swap_plugin=SwapPlugin(policy=policy, min_offload_bytes=0, log_plan=True))
    model = mlp_chain(width=16, depth=3)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(2):
        accelerator.backward(F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 10, (8,))))
        optimizer.step()
        optimizer.zero_grad()
    tables = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lightning-swap plan")]
    if policy == "auto":
        assert len(tables) == 2 and "not measured yet" in tables[0] and "measured in its first step" in tables[1], tables
    else:
        assert len(tables) == 1 and "not measured yet" not in tables[0] and "offload" in tables[0], tables
    assert accelerator.swap_plan.measured and accelerator.swap_plan.rows
    accelerator.end_training()


def test_warnings_go_above_the_progress_bar(monkeypatch):
    printed, written = [], []
    bar = SimpleNamespace(is_enabled=True, print=printed.append)
    trainer = SimpleNamespace(progress_bar_callback=bar, training=True)
    logger = logging.getLogger("lightning_swap")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # nothing configured: Python's last resort
    handler = _ProgressBarLog.install(trainer)
    assert handler is not None and handler in logger.handlers
    monkeypatch.setattr("sys.stderr", SimpleNamespace(write=written.append))
    try:
        logging.getLogger("lightning_swap.core.engine.recompute").warning("lightning-swap: a warning during a step")
        logging.getLogger("lightning_swap.core.scale.session").info("not a warning: not printed")
        trainer.training = False
        logging.getLogger("lightning_swap").warning("after training")
    finally:
        handler.remove()
    assert printed == ["lightning-swap: a warning during a step"]
    assert written == ["after training\n"]
    assert handler not in logger.handlers
    # Configured logging decides by itself: nothing is installed.
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    assert _ProgressBarLog.install(trainer) is None


def test_a_shapes_plan_installed_again_is_not_logged_again():
    """Note [The plan's log]: batch shapes alternating, each with its remembered plan installed
    again (the same object, Note [A shape scaled from another]), log each plan once; a new plan is
    logged even with actions seen before, unless they are the last logged plan's."""
    from lightning_swap.core import Action, Plan
    from lightning_swap.core.scale.plan_log import PlanLog

    texts = []
    log = PlanLog(texts.append, enabled=True)
    short, long = Plan(actions={"a": Action.KEEP, "b": Action.KEEP}), Plan(actions={"a": Action.OFFLOAD, "b": Action.KEEP})
    for plan in (short, long, short, long, short):
        log.made(plan)
    assert len(texts) == 2 and "keep=2" in texts[0] and "offload=1" in texts[1]
    log.made(Plan(actions=dict(short.actions)))  # a new plan: its actions are not the last logged
    log.made(Plan(actions=dict(short.actions)))  # ... and now they are
    assert len(texts) == 3
