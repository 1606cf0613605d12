"""One byte-size parser for every option that takes bytes from a user: the forms it accepts,
what it refuses (naming the option), and every front end taking ``"12GiB"`` and planning with
``12 * 2**30``: the Lightning strategy and finder, the Accelerate plugin (code and environment)
and ``find_batch_size``."""

from __future__ import annotations

import pytest
import torch
from accelerate.utils.modeling import convert_file_size_to_int
from torch.nn import functional as F

from accelerate_swap import SwapAccelerator, SwapPlugin, find_batch_size
from lightning_swap import CPUSwapStrategy, SwapBatchSizeFinder
from lightning_swap.core.scale.batch_search import ScaleConfig, predict_batch_size
from lightning_swap.core.config import SwapConfig
from lightning_swap.core.units import parse_bytes

from ..helpers import QUIET_TRAINER
from ..lit import LitModel, fit
from ..models import CNN, MODELS
from ..adapters.test_accelerate import fresh_state  # noqa: F401 - a fixture

GiB = 2**30


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (1, 1),
        (123456, 123456),
        (12 * GiB, 12 * GiB),
        (12e9, 12 * 10**9),  # a float holding whole bytes
        ("123456", 123456),
        ("1_000", 1000),
        ("7B", 7),
        (" 7 b ", 7),
        ("1KiB", 1024),
        ("64KiB", 65536),
        ("1MiB", 2**20),
        ("12GiB", 12 * GiB),
        ("12gib", 12 * GiB),
        ("12 GiB", 12 * GiB),
        ("1TiB", 2**40),
        ("1.5GiB", 3 * 2**29),
        ("1.5 MiB", 3 * 2**19),
        (".5KiB", 512),
        ("1.2GiB", 1288490188),  # a decimal amount with a unit: rounded down, as Accelerate does
        ("2KB", 2000),
        ("500MB", 500 * 10**6),
        ("2GB", 2 * 10**9),
        ("2gb", 2 * 10**9),
        ("5Gb", 5 * 10**9),  # not gigabits: units are case-insensitive
        ("1TB", 10**12),
        ("+3MiB", 3 * 2**20),
    ],
)
def test_forms_accepted(value, expected):
    assert parse_bytes(value, field="x", minimum=0) == expected
    assert type(parse_bytes(value, field="x", minimum=0)) is int


@pytest.mark.parametrize("value", ["12GiB", "1.5GiB", "500MB", "3KiB", "2KB", "1.2GiB", 4096])
def test_same_bytes_as_accelerate(value):
    """Where both read a form, they read it as ``accelerate.utils.convert_file_size_to_int``."""
    assert parse_bytes(value, field="x") == convert_file_size_to_int(value)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("lots", "not a size"),
        ("12G", "not a size"),
        ("12 parsecs", "not a size"),
        ("1e9", "not a size"),
        ("", "not a size"),
        ("GiB", "not a size"),
        ("1.5.0GiB", "not a size"),
        ("12GiB ram", "not a size"),
        ("-1GiB", "negative"),
        (-5, "negative"),
        (0, "below the minimum of 1"),
        ("0GiB", "below the minimum of 1"),
        ("1.5", "not a whole number of bytes"),
        (1.5, "not a whole number of bytes"),
        (float("inf"), "not a whole number of bytes"),
        (True, "a bool is not a size"),
        (False, "a bool is not a size"),
        ([12], "a list is not a size"),
        (None, "a number of bytes is required"),
    ],
)
def test_bad_values_name_the_field_and_the_forms(value, reason):
    with pytest.raises(ValueError) as err:
        parse_bytes(value, field="budget_bytes")
    message = str(err.value)
    assert message.startswith(f"`budget_bytes` got {value!r}: {reason}; allowed: ")
    assert "KiB/MiB/GiB/TiB" in message and "KB/MB/GB/TB" in message and "'12GiB'" in message


def test_minimum_and_none():
    assert parse_bytes(None, field="x", allow_none=True) is None
    assert parse_bytes(0, field="min_offload_bytes", minimum=0) == 0
    with pytest.raises(ValueError, match="got -1: negative;.*at least 0 bytes.$"):
        parse_bytes(-1, field="min_offload_bytes", minimum=0)
    with pytest.raises(ValueError, match=r"at least 1 byte, or None\.$"):
        parse_bytes("x", field="budget_bytes", allow_none=True)


@pytest.mark.parametrize("value", [0.8, "0.8", 0.5])
def test_a_fraction_of_device_memory_is_refused_with_the_one_line_instead(value):
    """Note [No fraction of device memory]."""
    with pytest.raises(ValueError, match=r"for 80% of a GPU pass int\(0\.8 \* torch\.cuda\.get_device_properties\(0\)\.total_memory\)"):
        parse_bytes(value, field="budget_bytes")
    with pytest.raises(ValueError, match="`budget_bytes` got"):
        SwapConfig(budget_bytes=value)


# -- where users give bytes ------------------------------------------------------------------
def test_swap_config_stores_ints():
    config = SwapConfig(budget_bytes="12GiB", min_offload_bytes="16KiB", um="offload", um_max_bytes="1.5 GiB")
    assert (config.budget_bytes, config.min_offload_bytes, config.um_max_bytes) == (12 * GiB, 16384, 3 * 2**29)
    assert config.with_options(budget_bytes="500MB").budget_bytes == 500 * 10**6
    assert SwapConfig(min_offload_bytes="0").min_offload_bytes == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"budget_bytes": "12G"}, "budget_bytes"),
        ({"budget_bytes": 0}, "budget_bytes"),
        ({"min_offload_bytes": "-1KiB"}, "min_offload_bytes"),
        ({"min_offload_bytes": None}, "min_offload_bytes"),
        ({"um": "offload", "um_max_bytes": "lots"}, "um_max_bytes"),
    ],
)
def test_swap_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^`{field}` got .*allowed: an int number of bytes"):
        SwapConfig(**kwargs)
    with pytest.raises(ValueError, match=f"`{field}` got"):
        CPUSwapStrategy(**kwargs)


def test_strategy_takes_12gib_and_plans_with_it():
    strategy = CPUSwapStrategy(budget_bytes="12GiB", min_offload_bytes="0B")
    assert strategy.swap_config.budget_bytes == 12 * GiB and strategy.swap_config.min_offload_bytes == 0
    _, trainer = fit("gpt", strategy, steps=3)  # guard, observe, plan (Note [Observe only what fits])
    assert trainer.strategy.swap_session.budget_bytes() == 12 * GiB
    assert trainer.strategy.plan.budget_bytes == 12 * GiB  # the planner's budget


@pytest.mark.slow
def test_lightning_finder_takes_12gib_and_searches_with_it(tmp_path):
    import lightning as L

    finder = SwapBatchSizeFinder(budget_bytes="12GiB", max_batch_size=16, steps_per_trial=1)
    assert finder.budget_bytes == 12 * GiB
    L.seed_everything(0, verbose=False)
    module = LitModel("mlp", batch_size=4, samples=64)
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=CPUSwapStrategy(min_offload_bytes=0),
        max_steps=1,
        **QUIET_TRAINER,
        callbacks=[finder],
        default_root_dir=tmp_path,
    )
    trainer.fit(module)
    assert finder.result.budget_bytes == 12 * GiB and finder.optimal_batch_size == 16
    with pytest.raises(ValueError, match="`budget_bytes` got '12 gigs': not a size"):
        SwapBatchSizeFinder(budget_bytes="12 gigs")


def test_plugin_in_code_takes_12gib():
    plugin = SwapPlugin(budget_bytes="12GiB", min_offload_bytes="64KiB")
    assert plugin.budget_bytes == 12 * GiB and plugin.min_offload_bytes == 65536  # stored as ints
    assert plugin.to_env()["ACCELERATE_CPU_SWAP_BUDGET_BYTES"] == str(12 * GiB)


def test_plugin_from_env_takes_12gib_and_plans_with_it(fresh_state, monkeypatch):  # noqa: F811
    monkeypatch.setenv("ACCELERATE_CPU_SWAP", "true")
    monkeypatch.setenv("ACCELERATE_CPU_SWAP_BUDGET_BYTES", "12GiB")
    monkeypatch.setenv("ACCELERATE_CPU_SWAP_MIN_OFFLOAD_BYTES", "0")
    accelerator = SwapAccelerator(cpu=True)
    assert accelerator.swap_plugin.budget_bytes == 12 * GiB
    torch.manual_seed(0)
    model = accelerator.prepare(CNN())
    x, y = MODELS["cnn"][1](4)
    for _ in range(3):  # guard, observe, plan (Notes [Observe only what fits], [Auto: observe, plan, check])
        accelerator.backward(F.cross_entropy(model(x), y))
    assert accelerator.swap_session.budget_bytes() == 12 * GiB
    assert accelerator.swap_plan.budget_bytes == 12 * GiB
    accelerator.end_training()


def test_plugin_env_error_names_the_variable(fresh_state, monkeypatch):  # noqa: F811
    monkeypatch.setenv("ACCELERATE_CPU_SWAP", "true")
    monkeypatch.setenv("ACCELERATE_CPU_SWAP_BUDGET_BYTES", "12G")
    with pytest.raises(ValueError, match="^`ACCELERATE_CPU_SWAP_BUDGET_BYTES` got '12G': not a size; allowed"):
        SwapAccelerator(cpu=True)


@pytest.mark.slow
def test_accelerate_find_batch_size_takes_12gib(fresh_state):  # noqa: F811
    build, data, loss = MODELS["mlp"]
    accelerator = SwapAccelerator(cpu=True, swap_plugin=SwapPlugin(min_offload_bytes=0))
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    search = dict(accelerator=accelerator, model=model, optimizer=optimizer, make_batch=data, step_fn=lambda m, b: loss(m(b[0]), b[1]))
    train = find_batch_size(lambda batch_size: batch_size, **search, budget_bytes="12GiB", max_batch_size=16, steps_per_trial=1)
    assert train() == 16 and train.result.budget_bytes == 12 * GiB
    with pytest.raises(ValueError, match="`budget_bytes` got 0.8: not a whole number of bytes"):
        find_batch_size(lambda batch_size: batch_size, **search, budget_bytes=0.8)
    accelerator.free_memory()


def test_core_search_takes_a_size_string():
    from lightning_swap.core.measure.profiler import profile

    build, data, loss = MODELS["mlp"]
    torch.manual_seed(0)
    prof = profile(build(), data(8), step_fn=lambda m, b: loss(m(b[0]), b[1]), scale=True, fake=True, device="cpu")
    plan = predict_batch_size(prof, "12GiB", ScaleConfig(max_batch_size=32))
    assert plan.budget_bytes == int(12 * GiB * 0.95) and plan.batch_size == 32
