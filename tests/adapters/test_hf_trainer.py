"""Hugging Face ``transformers.Trainer`` through ``accelerate_swap.hf.SwapTrainer`` (issue 32), and
the switch that is never silently ignored (Note [A switch never silently ignored] in
``accelerate_swap/guard.py``).

A tiny GPT-2 built from a config (no download), trained a few AdamW steps on the CPU by the
Trainer's own loop, plain and through the switch. Each step's peak is measured by a meter of the
test's own, opened by a callback around the whole optimizer step (``on_step_begin`` to
``on_step_end``: forward, loss, backward, gradient clipping, optimizer step), independently of
the library's step window. The Trainer names its device in ``TrainingArguments(use_cpu=True)``;
it is built through a class held in a variable, since the suite's device checker reads a call
named ``Trainer`` as Lightning's.
"""

from __future__ import annotations

import functools
import inspect
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the Hugging Face Trainer front end needs transformers (the `test` extra)")

import lightning as L  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402

from accelerate_swap import Action, SwapAccelerator, SwapPlugin  # noqa: E402
from accelerate_swap.guard import GUARD, PlainAcceleratorGuard  # noqa: E402
from accelerate_swap.hf import SwapTrainer  # noqa: E402
from lightning_swap import CPUSwapStrategy  # noqa: E402
from lightning_swap.core import DeviceMemoryMeter  # noqa: E402
from lightning_swap.fabric import CPUSwapFabricStrategy  # noqa: E402

from ..helpers import POLICIES, QUIET_TRAINER  # noqa: E402
from .test_accelerate import _clean, fresh_state  # noqa: E402,F401 - a fixture

STEPS = 5
BATCH = 4
SEQ = 16


def _gpt2() -> GPT2LMHeadModel:
    """Three blocks, width 32, a vocabulary of 100; dropout on (recompute must replay it)."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=100, n_positions=SEQ, n_embd=32, n_layer=3, n_head=2, bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        self.ids = torch.randint(0, 100, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepPeaks(TrainerCallback):
    """Each optimizer step's peak, from a meter the test owns: opened before the step's first
    forward with the weights, buffers and optimizer state tracked (the batch when the Trainer hands
    it to ``training_step``: :func:`_train`), closed after the optimizer step."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self.meter: DeviceMemoryMeter | None = None

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.meter = DeviceMemoryMeter("cpu").__enter__()
        states = getattr(optimizer, "optimizer", optimizer).state.values()
        self.meter.track([*model.parameters(), *model.buffers(), *(t for s in states for t in s.values())])

    def on_step_end(self, args, state, control, **kwargs):
        self.meter.__exit__(None, None, None)
        self.peaks.append(self.meter.peak_bytes)
        self.meter = None


def _args(tmp_dir, **overrides) -> TrainingArguments:
    return TrainingArguments(**{
        "output_dir": str(tmp_dir), "per_device_train_batch_size": BATCH, "max_steps": STEPS, "learning_rate": 1e-3,
        "use_cpu": True, "dataloader_num_workers": 0, "report_to": [], "save_strategy": "no", "logging_strategy": "no",
        "disable_tqdm": True, **overrides,
    })


def _trainer(trainer_cls, tmp_dir, *, args=None, model=None, **kwargs):
    return trainer_cls(model=model or _gpt2(), args=args or _args(tmp_dir), train_dataset=_Tokens(), **kwargs)


def _train(trainer_cls, tmp_dir, **kwargs):
    """Train the tiny GPT-2 with ``trainer_cls``; the trainer and each step's independent peak."""
    meter = StepPeaks()
    trainer = _trainer(trainer_cls, tmp_dir, callbacks=[meter], **kwargs)
    step = trainer.training_step

    def training_step(model, inputs, *rest, **kw):
        meter.meter.track(inputs.values())  # the batch, alive through the step
        return step(model, inputs, *rest, **kw)

    trainer.training_step = training_step
    trainer.train()
    assert len(meter.peaks) == STEPS
    return trainer, meter.peaks


def _state(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _assert_equal_to(model, plain) -> None:
    a, b = _state(model), _state(plain)
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"differs from the plain Trainer: {different}"


@functools.cache
def _plain(tmp_dir) -> tuple:
    trainer, peaks = _train(transformers.Trainer, tmp_dir)
    assert type(trainer.accelerator) is Accelerator
    assert not torch.equal(trainer.model.transformer.h[0].mlp.c_fc.weight, _gpt2().transformer.h[0].mlp.c_fc.weight)  # it trained
    return trainer.model, peaks


@functools.cache
def _forced(policy, tmp_dir) -> tuple:
    trainer, peaks = _train(SwapTrainer, tmp_dir, swap_plugin=SwapPlugin(policy=policy, min_offload_bytes=0, log_plan=False))
    assert isinstance(trainer.accelerator, SwapAccelerator)
    assert {a.value for a in trainer.accelerator.swap_plan.actions.values()} == {policy}
    assert len(trainer.accelerator.swap_plan.actions) == 3  # the three blocks
    trainer.accelerator.end_training()
    assert _clean(trainer.model)  # hooks and wrappers gone
    return trainer.model, peaks


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    """One output directory (nothing is saved in it) for the cached runs."""
    return tmp_path_factory.mktemp("hf_trainer")


# -- every forced policy trains as the plain Trainer does ------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_every_forced_policy_equals_the_plain_trainer(policy, out_dir, fresh_state):
    plain, _ = _plain(out_dir)
    model, _ = _forced(policy, out_dir)
    _assert_equal_to(model, plain)


def _auto(out_dir) -> tuple:
    """``policy="auto"`` at a budget halfway between the lowest-memory forced plan's measured peak
    and the plain Trainer's: the trainer, each step's peak, the budget."""
    plain = max(_plain(out_dir)[1])
    least = min(max(_forced(policy, out_dir)[1]) for policy in POLICIES if policy != "keep")
    assert least < plain, (least, plain)
    budget = (least + plain) // 2
    trainer, peaks = _train(SwapTrainer, out_dir, swap_plugin=SwapPlugin(budget_bytes=budget, min_offload_bytes=0, log_plan=False))
    return trainer, peaks, budget


@pytest.mark.slow
def test_auto_keeps_every_step_within_a_budget_between_the_lowest_memory_plan_and_plain(out_dir, fresh_state, caplog):
    caplog.set_level(logging.WARNING)
    trainer, peaks, budget = _auto(out_dir)
    assert max(peaks) <= budget, (peaks, budget)
    plan = trainer.accelerator.swap_plan
    assert plan is not None and plan.predicted_peak_bytes <= budget
    assert set(plan.actions.values()) != {Action.KEEP}  # plain does not fit
    _assert_equal_to(trainer.model, _plain(out_dir)[0])
    assert not [r for r in caplog.records if r.name.startswith("accelerate_swap.guard")]
    trainer.accelerator.end_training()
    assert _clean(trainer.model)


@pytest.mark.slow
def test_auto_within_the_budget_in_a_fresh_process(out_dir, fresh_state, monkeypatch):
    """Issue 32 item 3: the bandwidth probe runs when the session is made, outside every step."""
    from lightning_swap.core.measure import profiler

    monkeypatch.setattr(profiler, "_BANDWIDTH", {})  # as in a fresh process
    _, peaks, budget = _auto(out_dir)
    assert max(peaks) <= budget, (peaks, budget)


# -- switched by the environment, as Accelerate is -------------------------------------------------
def test_the_environment_and_the_config_file_switch_the_trainer(tmp_path, monkeypatch, fresh_state, caplog):
    caplog.set_level(logging.WARNING)
    monkeypatch.setattr(GUARD, "warned", False)
    monkeypatch.setenv("ACCELERATE_CPU_SWAP", "true")
    monkeypatch.setenv("ACCELERATE_CPU_SWAP_POLICY", "offload")
    trainer = _trainer(SwapTrainer, tmp_path)
    assert trainer.accelerator.swap_plugin == SwapPlugin(policy="offload")
    monkeypatch.delenv("ACCELERATE_CPU_SWAP")
    monkeypatch.delenv("ACCELERATE_CPU_SWAP_POLICY")
    config = tmp_path / "accelerate_swap.yaml"
    config.write_text("enabled: true\npolicy: recompute\n")
    monkeypatch.setenv("ACCELERATE_CPU_SWAP_CONFIG", str(config))
    trainer = _trainer(SwapTrainer, tmp_path)
    assert trainer.accelerator.swap_plugin == SwapPlugin(policy="recompute")
    # A plugin given in code wins over the environment.
    trainer = _trainer(SwapTrainer, tmp_path, swap_plugin=SwapPlugin(policy="keep"))
    assert trainer.accelerator.swap_plugin == SwapPlugin(policy="keep")
    assert not GUARD.warned and not _guard_warnings(caplog)  # a SwapAccelerator each time: nothing to warn of


def test_switched_off_the_swap_trainer_is_the_plain_trainer(tmp_path, fresh_state):
    trainer = _trainer(SwapTrainer, tmp_path)
    assert isinstance(trainer.accelerator, SwapAccelerator) and not trainer.accelerator.swap_enabled
    assert transformers.trainer.Accelerator is Accelerator  # the name is back after the call
    with pytest.raises(ValueError, match="`swap_plugin` must be a SwapPlugin or None"):
        _trainer(SwapTrainer, tmp_path, swap_plugin={"policy": "offload"})


def test_a_model_the_trainer_does_not_prepare_is_refused_not_trained_plain(tmp_path, fresh_state):
    """The Trainer trains ``DataParallel(model)`` unprepared when one process sees several GPUs
    (``_wrap_model``); simulated here on the CPU."""
    trainer = _trainer(SwapTrainer, tmp_path, swap_plugin=SwapPlugin(policy="offload"))
    trainer._wrap_model = lambda model, training=True, dataloader=None: torch.nn.DataParallel(model)
    with pytest.raises(RuntimeError, match="trains a model it did not prepare through its accelerator"):
        trainer.train()


# -- one activation policy (Note [One activation policy in the Trainer]) ----------------------------
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # transformers 5's alias
@pytest.mark.parametrize("name", ["gradient_checkpointing", "activation_checkpointing"])
def test_the_trainers_checkpointing_beside_a_swap_policy_is_refused(name, tmp_path, monkeypatch, fresh_state):
    args = _args(tmp_path, **{name: True})
    with pytest.raises(ValueError, match=rf"TrainingArguments\(.*{name}=True.*swap plugin's policy"):
        _trainer(SwapTrainer, tmp_path, args=args, swap_plugin=SwapPlugin(policy="offload"))
    monkeypatch.setenv("ACCELERATE_CPU_SWAP", "true")  # switched on by the environment: the same
    with pytest.raises(ValueError, match="gradient_checkpointing=True"):
        _trainer(SwapTrainer, tmp_path, args=args)
    monkeypatch.setenv("ACCELERATE_CPU_SWAP", "false")  # switched off: the Trainer's checkpointing alone
    assert not _trainer(SwapTrainer, tmp_path, args=args).accelerator.swap_enabled


def test_a_model_checkpointing_itself_beside_a_swap_policy_is_refused(tmp_path, fresh_state):
    model = _gpt2()
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()  # transformers 5 / 4
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has its own activation checkpointing on.*gradient_checkpointing_disable"):
        _trainer(SwapTrainer, tmp_path, model=model, swap_plugin=SwapPlugin(policy="recompute"))


class _LitGPT2(L.LightningModule):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def training_step(self, ids, i):
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([torch.zeros(SEQ, dtype=torch.long)] * 2, batch_size=None)


_REFUSED = r"GPT2LMHeadModel has its own activation checkpointing on.*gradient_checkpointing_disable.*policy='recompute'.*or "


@pytest.mark.parametrize("front_end", ["lightning", "fabric", "accelerate"])
@pytest.mark.parametrize("policy", ["selective", "offload"])
def test_a_model_checkpointing_itself_is_refused_by_every_front_end_at_setup(front_end, policy, fresh_state):
    """Note [A model that checkpoints itself] in ``core/segments.py``: as ``SwapTrainer`` refuses
    it, so do the Lightning strategy (inside a LightningModule, review ``r2_02``: ``selective``
    ran at 1.47x plain's peak, silently), Fabric and Accelerate, when the session is made."""
    model = _gpt2()
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()  # transformers 5 / 4
    with pytest.raises(ValueError, match=_REFUSED):
        if front_end == "lightning":
            L.Trainer(strategy=CPUSwapStrategy(policy=policy), accelerator="cpu", devices=1, max_steps=1, **QUIET_TRAINER).fit(_LitGPT2(model))
        elif front_end == "fabric":
            Fabric(accelerator="cpu", devices=1, strategy=CPUSwapFabricStrategy(policy=policy)).setup(model)
        else:
            SwapAccelerator(cpu=True, swap_plugin=SwapPlugin(policy=policy)).prepare(model)


# -- a plain Accelerator under the switch says so, once ---------------------------------------------
def _guard_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "accelerate_swap.guard" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("switch", ["flag", "config"])
def test_a_plain_accelerator_under_the_switch_warns_once(switch, tmp_path, monkeypatch, fresh_state, caplog):
    caplog.set_level(logging.WARNING, logger="accelerate_swap")
    monkeypatch.setattr(GUARD, "warned", False)
    Accelerator(cpu=True)
    assert not _guard_warnings(caplog)  # switch off: nothing to say
    if switch == "flag":
        monkeypatch.setenv("ACCELERATE_CPU_SWAP", "true")
    else:
        (tmp_path / "swap.yaml").write_text("enabled: true\n")
        monkeypatch.setenv("ACCELERATE_CPU_SWAP_CONFIG", str(tmp_path / "swap.yaml"))
    SwapAccelerator(cpu=True)
    assert not _guard_warnings(caplog)  # the switch reached a SwapAccelerator
    Accelerator(cpu=True)
    Accelerator(cpu=True)
    warnings = _guard_warnings(caplog)
    assert len(warnings) == 1, warnings
    source = "ACCELERATE_CPU_SWAP=true" if switch == "flag" else "ACCELERATE_CPU_SWAP_CONFIG="
    assert source in warnings[0] and "SwapAccelerator" in warnings[0] and "accelerate_swap.hf.SwapTrainer" in warnings[0]


def test_the_plain_hf_trainer_under_the_switch_warns(tmp_path, monkeypatch, fresh_state, caplog):
    """Issue 32's case: ``ACCELERATE_CPU_SWAP=true`` and ``transformers.Trainer``, which builds a
    plain ``Accelerator``; a broken setting is a request too."""
    caplog.set_level(logging.WARNING, logger="accelerate_swap")
    monkeypatch.setattr(GUARD, "warned", False)
    monkeypatch.setenv("ACCELERATE_CPU_SWAP", "true")
    monkeypatch.setenv("ACCELERATE_CPU_SWAP_POLICY", "ofload")
    trainer = _trainer(transformers.Trainer, tmp_path)
    assert type(trainer.accelerator) is Accelerator
    warnings = _guard_warnings(caplog)
    assert len(warnings) == 1 and "invalid" in warnings[0] and "ACCELERATE_CPU_SWAP_POLICY" in warnings[0], warnings


def test_the_guard_is_removable_and_keeps_accelerates_signature(monkeypatch, fresh_state, caplog):
    caplog.set_level(logging.WARNING, logger="accelerate_swap")
    assert GUARD.installed  # by `import accelerate_swap`
    before = Accelerator.__init__
    with PlainAcceleratorGuard() as guard:
        assert Accelerator.__init__ is not before and guard.installed
        assert inspect.signature(Accelerator.__init__) == inspect.signature(before)
    assert Accelerator.__init__ is before and not guard.installed
    monkeypatch.setattr(GUARD, "warned", False)
    monkeypatch.setenv("ACCELERATE_CPU_SWAP", "on")
    GUARD.remove()
    try:
        assert getattr(Accelerator.__init__, "__wrapped__", None) is None  # Accelerate's own
        Accelerator(cpu=True)
        assert not _guard_warnings(caplog)
    finally:
        GUARD.install()
    Accelerator(cpu=True)
    assert len(_guard_warnings(caplog)) == 1
