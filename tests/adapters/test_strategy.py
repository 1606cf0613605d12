"""``Trainer(strategy="cpu_swap")``: same weights as plain training, stats, cleanup, errors."""

from __future__ import annotations

import csv

import lightning as L
import pytest
import torch

import lightning_swap
from lightning_swap import Action, CPUSwapStrategy, Plan

from ..helpers import POLICIES, assert_same_state, plain_fit
from ..lit import LitModel, fit
from ..models import MODELS

@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_trainer_cpu_swap_equalsplain_fit(name, policy):
    module, trainer = fit(name, CPUSwapStrategy(policy=policy, min_offload_bytes=0))
    assert_same_state(module, plain_fit(name))
    strategy = trainer.strategy
    assert set(strategy.plan.actions.values()) == {Action.parse(policy)}
    stats = strategy.step_stats
    assert stats is not None and stats.peak_device_bytes > 0
    if Action.parse(policy).offloads:
        assert stats.offloaded_bytes > 0
    if Action.parse(policy).recomputes:
        assert stats.recompute_ms > 0


def test_registered_name_and_metrics_logged(tmp_path):
    assert "cpu_swap" in L.pytorch.strategies.StrategyRegistry
    logger = L.pytorch.loggers.CSVLogger(tmp_path)
    module, trainer = fit("cnn", "cpu_swap", logger=logger, log_every_n_steps=1)
    assert isinstance(trainer.strategy, CPUSwapStrategy)
    assert trainer.strategy.root_device == torch.device("cpu")
    assert list(trainer.strategy.plan.actions) == [f"model.blocks.{i}" for i in range(4)]
    for key in ("swap/peak_device_bytes", "swap/offloaded_bytes", "swap/recompute_ms", "swap/exposed_transfer_ms"):
        assert isinstance(trainer.logged_metrics[key], float)  # plain floats, never device tensors
    logger.save()
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert any(row.get("swap/peak_device_bytes") for row in rows)
    assert_same_state(module, plain_fit("cnn"))


def test_policy_dict_and_segment_names():
    policy = {"model.blocks.0": "offload", "model.blocks.2": Action.RECOMPUTE}
    module, trainer = fit("cnn", CPUSwapStrategy(policy=policy, min_offload_bytes=0))
    actions = trainer.strategy.plan.actions
    assert actions["model.blocks.0"] is Action.OFFLOAD
    assert actions["model.blocks.1"] is Action.KEEP
    assert actions["model.blocks.2"] is Action.RECOMPUTE
    assert_same_state(module, plain_fit("cnn"))
    strategy = CPUSwapStrategy(policy="OFFLOAD", segments=["model.blocks.1", "model.blocks.3"], min_offload_bytes=0)
    module, trainer = fit("cnn", strategy)
    assert dict(trainer.strategy.plan.actions) == {"model.blocks.1": Action.OFFLOAD, "model.blocks.3": Action.OFFLOAD}


def test_strategy_removes_itself_after_fit():
    plain_keys = list(LitModel("resnet18").state_dict())
    module, trainer = fit("resnet18", CPUSwapStrategy(policy="recompute_offload", min_offload_bytes=0))
    assert list(module.state_dict()) == plain_keys
    assert not any("forward" in m.__dict__ for m in module.modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks for m in module.modules())
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not any(type(cb).__name__ == "_SwapStatsLogger" for cb in trainer.callbacks)
    # the trained model still runs without the plugin
    x, _ = MODELS["resnet18"][1](2)
    module(x)


def test_memory_drops_under_the_trainer():
    """The step's window ends after its optimizer step; the test CNN's activations, not its
    weights and momentum (as ResNet-18's at this size would), decide its peak."""
    peaks = {}
    for policy in ("keep", "offload", "recompute", "recompute_offload"):
        _, trainer = fit("cnn", CPUSwapStrategy(policy=policy, min_offload_bytes=0), steps=1, batch_size=16)
        peaks[policy] = trainer.strategy.step_stats.peak_device_bytes
    assert peaks["offload"] < peaks["keep"]
    assert peaks["recompute"] < peaks["keep"]
    assert peaks["recompute_offload"] < peaks["keep"]


def test_checkpoint_keys_unchanged(tmp_path):
    module, trainer = fit("cnn", CPUSwapStrategy(policy="recompute", min_offload_bytes=0), default_root_dir=tmp_path)
    path = tmp_path / "ckpt.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=False)
    assert list(ckpt["state_dict"]) == list(LitModel("cnn").state_dict())


def test_pytorch_lightning_gets_its_own_class():
    """Its own classes, registered in its own registry once used (Note [Strategies registered on import])."""
    pl = pytest.importorskip("pytorch_lightning")
    cls = lightning_swap.PLCPUSwapStrategy
    assert {"cpu_swap", "ddp_cpu_swap", "fsdp_cpu_swap", "model_parallel_cpu_swap"} <= set(pl.strategies.StrategyRegistry)
    assert pl.strategies.StrategyRegistry["cpu_swap"]["strategy"] is cls
    assert issubclass(cls, pl.strategies.SingleDeviceStrategy)
    assert not issubclass(cls, L.pytorch.strategies.SingleDeviceStrategy)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"policy": "swap"}, "policy"),
        ({"policy": 3}, "policy"),
        ({"policy": {"model.blocks.0": "nope"}}, "policy"),
        ({"min_offload_bytes": -1}, "min_offload_bytes"),
        ({"min_offload_bytes": 1.5}, "min_offload_bytes"),
        ({"budget_bytes": 0}, "budget_bytes"),
        ({"segments": []}, "segments"),
        ({"prefetch_bytes": -2}, "prefetch_bytes"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}"):
        CPUSwapStrategy(**kwargs)


def test_unknown_names_fail_at_setup():
    with pytest.raises(ValueError, match="`segments`.*model.nope"):
        fit("cnn", CPUSwapStrategy(segments=["model.nope"]))
    with pytest.raises(ValueError, match="`policy`.*model.nope"):
        fit("cnn", CPUSwapStrategy(policy={"model.nope": "offload"}))


def test_cuda_device_is_chosen_before_the_accelerator_sets_it_up():
    """A registered strategy is built with device "cpu"; with Lightning's CUDA accelerator the
    device must follow it before ``setup_environment`` hands it to ``setup_device`` (which
    rejects a CPU device), and before unified memory is installed on it."""
    from types import SimpleNamespace

    seen = []

    class CUDAAccelerator:  # the name is what the strategy checks
        def setup_device(self, device):
            seen.append(device)

    strategy = CPUSwapStrategy()
    strategy.accelerator = CUDAAccelerator()
    trainer = SimpleNamespace(_accelerator_connector=SimpleNamespace(_parallel_devices=[torch.device("cuda", 1)]))
    strategy._lightning_module = SimpleNamespace(_trainer=trainer)
    strategy.setup_environment()
    assert seen == [torch.device("cuda", 1)] and strategy.root_device == torch.device("cuda", 1)
    assert strategy.unified_memory is None  # um="off"


def test_a_forced_plan_renders_numbers_measured_in_its_first_step():
    """Note [Measured rows]: a forced policy has nothing predicted; its table gets its bytes and
    times from its first step instead of columns of dashes."""
    policy = {"model.blocks.0": "offload", "model.blocks.1": "recompute", "model.blocks.2": "selective"}
    module, trainer = fit("cnn", CPUSwapStrategy(policy=policy, min_offload_bytes=0), steps=2)
    plan = trainer.strategy.plan
    assert plan.measured and len(plan.rows) == 4
    rows = {r.segment: r for r in plan.rows}
    assert rows["model.blocks.0"].offloaded_bytes > 0
    assert rows["model.blocks.1"].recomputed_bytes > 0 and rows["model.blocks.1"].added_ms > 0
    assert rows["model.blocks.2"].added_ms > 0
    assert rows["model.blocks.3"].kept_bytes > rows["model.blocks.0"].kept_bytes  # kept keeps more
    assert all(r.offloaded_bytes == 0 for r in plan.rows if r.action is not Action.OFFLOAD)
    text = plan.render()
    assert " - " not in text and "measured in the plan's first step" in text
    fresh = Plan(actions={"a": Action.KEEP, "b": Action.OFFLOAD})
    assert "not measured yet" in fresh.render() and fresh.render().splitlines()[0].split() == ["segment", "action"]


@pytest.mark.parametrize("cls", [CPUSwapStrategy, lightning_swap.DDPCPUSwapStrategy])
def test_every_overridden_lightning_hook_is_marked_override(cls):
    """STYLE 3: a method of the swap mixin that Lightning's strategy also defines carries ``@override``."""
    from lightning.pytorch.strategies import Strategy

    from lightning_swap.strategy_base import _SwapStrategyMixin

    mixin = vars(_SwapStrategyMixin)
    hooks = [name for name, fn in mixin.items() if callable(fn) and not name.startswith("__") and hasattr(Strategy, name)]
    assert len(hooks) >= 8, hooks
    assert [h for h in hooks if not getattr(mixin[h], "__override__", False)] == []
    assert getattr(cls._stats_callback_class.on_train_batch_end, "__override__", False)


@pytest.mark.parametrize("log_plan", [True, False])
def test_log_plan_switches_the_strategys_plan_log(log_plan, monkeypatch):
    """``log_plan`` (a SwapConfig field, Note [One option table]) gates the plan log, which the
    core writes through the strategy's sink on rank zero (Note [The plan's log]): a forced plan
    once its first step measured it; the plan is applied and measured either way."""
    said = []
    monkeypatch.setattr("lightning_swap.strategy_base.rank_zero_info", said.append)
    strategy = CPUSwapStrategy(policy="offload", min_offload_bytes=0, log_plan=log_plan)
    _, trainer = fit("cnn", strategy, steps=2)
    logged = [text for text in said if text.startswith("lightning-swap plan")]
    assert len(logged) == (1 if log_plan else 0), logged
    assert all("not measured yet" not in text for text in logged), logged
    assert trainer.strategy.plan.measured and trainer.strategy.swap_config.log_plan is log_plan


def test_the_no_budget_warning_names_the_class_in_use(caplog):
    """Issue 42: the library's own warnings name the front end's class in use (here a user's
    subclass), not one fixed class."""
    import logging

    class MyStrategy(CPUSwapStrategy):
        pass

    caplog.set_level(logging.WARNING, logger="lightning_swap")
    fit("cnn", MyStrategy(), steps=1)
    said = [r.getMessage() for r in caplog.records if "no memory budget" in r.getMessage()]
    assert len(said) == 1 and "MyStrategy(budget_bytes='8GiB')" in said[0], said
