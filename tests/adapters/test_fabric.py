"""Lightning Fabric: ``Fabric(strategy="cpu_swap")`` / ``"ddp_cpu_swap"`` (``lightning_swap/fabric.py``).

The same Fabric loop (``fabric.setup``, ``fabric.backward``, the optimizer's step) with and without
the library: every forced policy trains to weights and buffers ``torch.equal`` to plain Fabric's;
``policy="auto"`` at a budget between the lowest-memory plan's peak and plain's keeps every whole
step (forward, loss, backward, optimizer step) within the budget, measured by a meter of the test's
own; nothing is left on the model afterwards. Under DDP on 2 gloo processes:
``tests/scripts/train_fabric_ddp.py``, launched (slow).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_swap import Action
from lightning_swap.core import DeviceMemoryMeter, measure_bandwidth
from lightning_swap.fabric import CPUSwapFabricStrategy, DDPCPUSwapFabricStrategy, register_fabric_strategies

from ..helpers import POLICIES, assert_same_state
from ..models import MODELS
from .test_accelerate import _clean

SCRIPT = Path(__file__).parents[1] / "scripts" / "train_fabric_ddp.py"
STEPS = 3
BATCH = {"cnn": 4, "gpt": 8}


def _fabric(strategy="auto") -> Fabric:
    return Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="32-true")


def train(name: str, strategy="auto", *, steps: int = STEPS, build=None):
    """``steps`` SGD+momentum steps of ``MODELS[name]`` in a Fabric loop; returns the user's model,
    the strategy, and each whole step's peak as the test's own meter saw it (the batch, weights,
    gradients and momentum alive before it tracked)."""
    make, data, loss_fn = MODELS[name]
    fabric = _fabric(strategy)
    torch.manual_seed(0)
    model = (build or make)()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    wrapped, optimizer = fabric.setup(model, optimizer)
    torch.manual_seed(1)  # dropout masks
    peaks = []
    for _ in range(steps):
        x, y = data(BATCH[name])
        with DeviceMemoryMeter("cpu") as meter:
            meter.track([x, y, *model.parameters(), *model.buffers(), *(t for s in optimizer.state.values() for t in s.values())])
            fabric.backward(loss_fn(wrapped(x), y))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peaks.append(meter.peak_bytes)
    return model, fabric.strategy, peaks


@functools.cache
def plain(name: str):
    return train(name)


@functools.cache
def forced(name: str, policy: str):
    model, strategy, peaks = train(name, CPUSwapFabricStrategy(policy=policy, min_offload_bytes=0, log_plan=False))
    strategy.teardown()
    return model, strategy, peaks


@pytest.mark.slow
def test_import_fabric_then_lightning_swap_resolves_the_names():
    """In a fresh interpreter (Note [Strategies registered on import] in
    ``lightning_swap/__init__.py``): Fabric first, then ``import lightning_swap``."""
    code = (
        "from lightning.fabric import Fabric\nimport lightning_swap\n"
        "print(type(Fabric(accelerator='cpu', strategy='cpu_swap').strategy).__name__,"
        " type(Fabric(accelerator='cpu', devices=2, strategy='ddp_cpu_swap').strategy).__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["CPUSwapFabricStrategy", "DDPCPUSwapFabricStrategy"]


def test_by_name_and_with_options():
    register_fabric_strategies()  # idempotent; importing lightning_swap.fabric registered them already
    assert STRATEGY_REGISTRY["cpu_swap"]["strategy"] is CPUSwapFabricStrategy
    assert STRATEGY_REGISTRY["ddp"]["strategy"] is not DDPCPUSwapFabricStrategy  # Fabric's own names untouched
    single = _fabric("cpu_swap").strategy
    assert type(single) is CPUSwapFabricStrategy and single.swap_config.is_auto and single.root_device == torch.device("cpu")
    ddp = Fabric(accelerator="cpu", devices=2, strategy="ddp_cpu_swap").strategy  # built, not launched
    assert type(ddp) is DDPCPUSwapFabricStrategy and ddp.num_processes == 2
    strategy = CPUSwapFabricStrategy(policy="offload", budget_bytes="1GiB", segments=["blocks.0"])
    assert strategy.swap_config.policy is Action.OFFLOAD and strategy.swap_config.budget_bytes == 1 << 30
    with pytest.raises(ValueError, match=r"unknown options \['polcy'\]; allowed: .*'budget_bytes'.*'device'.*'policy'"):
        CPUSwapFabricStrategy(polcy="offload")
    with pytest.raises(ValueError, match="`policy`"):
        CPUSwapFabricStrategy(policy="swap")
    with pytest.raises(ValueError, match="trains on one device; got 2 devices.*ddp_cpu_swap"):
        Fabric(accelerator="cpu", devices=2, strategy="cpu_swap")


def test_every_swapconfig_field_reaches_the_strategy():
    """Note [Fabric options]: the options are ``SwapConfig``'s fields, none listed by hand."""
    from ..vocabulary.test_option_table import VALUES

    for name, (value, _, held, needs) in VALUES.items():
        strategy = CPUSwapFabricStrategy(**{name: value, **{k: v for k, (v, _) in needs.items()}})
        assert getattr(strategy.swap_config, name) == held, name


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["cnn", "gpt"])
def test_every_forced_policy_equals_plain_fabric(name, policy):
    model, strategy, _ = forced(name, policy)
    assert_same_state(model, plain(name)[0])  # torch.equal on every weight and buffer
    assert set(strategy.plan.actions.values()) == {Action.parse(policy)}
    assert len(strategy.stats_history) == STEPS  # each step's window closed at its optimizer step
    if policy != "keep":
        assert max(s.peak_device_bytes for s in strategy.stats_history) < max(plain(name)[2])
    assert _clean(model)  # teardown removed the hooks, the wrappers and the saved-tensor hooks


def test_auto_between_the_lowest_memory_plan_and_plain_keeps_every_step_within_the_budget():
    # The bandwidth probe (64 MiB, once per process) outside every step, whichever layer probes it
    # (issue 32, item 3: the session's business, not the Fabric adapter's).
    measure_bandwidth("cpu")
    least = min(max(forced("gpt", p)[2]) for p in POLICIES if p != "keep")
    highest = max(plain("gpt")[2])
    budget = (least + highest) // 2
    model, strategy, peaks = train("gpt", CPUSwapFabricStrategy(budget_bytes=budget, min_offload_bytes=0, log_plan=False), steps=5)
    assert max(peaks) <= budget, (peaks, budget, least, highest)
    assert set(strategy.plan.actions.values()) != {Action.KEEP}
    assert_same_state(model, train("gpt", steps=5)[0])
    strategy.teardown()
    assert _clean(model) and len(strategy.stats_history) == 5  # the statistics survive teardown


def test_teardown_leaves_nothing_and_evaluation_opens_no_window():
    make, data, loss_fn = MODELS["cnn"]
    fabric = _fabric(CPUSwapFabricStrategy(policy="recompute", min_offload_bytes=0, log_plan=False))
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped, optimizer = fabric.setup(model, optimizer)
    wrapped.eval()
    with torch.no_grad():
        wrapped(data(2)[0])
    assert fabric.strategy.stats_history == []  # no training step ran
    wrapped.train()
    x, y = data(2)
    fabric.backward(loss_fn(wrapped(x), y))
    optimizer.step()
    assert len(fabric.strategy.stats_history) == 1 and fabric.strategy.step_stats.recompute_ms > 0
    fabric.strategy.teardown()
    assert _clean(model) and not optimizer.optimizer._optimizer_step_post_hooks
    assert model.state_dict().keys() == make().state_dict().keys()


def test_a_second_module_is_left_plain_with_a_warning():
    make = MODELS["mlp"][0]
    fabric = _fabric(CPUSwapFabricStrategy(policy="offload", log_plan=False))
    first, second = make(), make()
    fabric.setup(first)
    with pytest.warns(UserWarning, match="plans the first module set up"):
        fabric.setup(second)
    assert fabric.strategy.swap_session.model is first and _clean(second)
    fabric.strategy.teardown()


def test_the_litgpt_style_example_plans_within_its_budget(capsys):
    """``examples/fabric_gpt.py`` at a small size: ``auto`` at 70% of plain's predicted peak."""
    from examples.fabric_gpt import main

    strategy = main(["--steps", "4", "--seq", "64", "--layers", "2", "--batch-size", "8"])
    out = capsys.readouterr().out
    assert "step 3: loss" in out and "policy 'auto'" in out and "4 steps, highest peak" in out
    assert set(strategy.plan.actions.values()) != {Action.KEEP}
    assert max(s.peak_device_bytes for s in strategy.stats_history) <= strategy.swap_session.budget_bytes()
    assert not strategy.swap_session.hooked


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_on_two_gloo_processes_equals_plain(tmp_path, kind):
    """Fabric's DDP (the test CNN) and FSDP2 (``ModelParallelStrategy``, the test GPT's blocks
    sharded): every forced policy and ``auto`` (at a budget between the lowest-memory forced plan
    and plain, agreed by both ranks) train to plain's weights and buffers; every auto step's peak,
    as each rank's own meter saw it, within the budget; afterwards the model carries what plain's
    does (FSDP2's own hooks), nothing more."""
    out = tmp_path / "fabric"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--kind", kind], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in (0, 1)]
    for rank, results in enumerate(ranks):
        policies = results["policies"]
        assert results["world"] == 2 and len(policies) >= 4
        for run in (*policies, "auto"):
            different = [k for k, v in results["plain"].items() if not torch.equal(v, results[run][k])]
            assert not different, (rank, run, different)
        for policy in policies:
            assert set(results[policy + ":plan"]) == {policy}
        assert max(results["auto:peaks"]) <= results["auto:budget"], results["auto:peaks"]
        assert set(results["auto:plan"]) != {"keep"}
        assert results["auto:trace"] == results["plain:trace"] and results["plain:trace"][1:] == ([], True)
    assert ranks[0]["auto:plan"] == ranks[1]["auto:plan"] and ranks[0]["auto:budget"] == ranks[1]["auto:budget"]


def test_the_no_budget_warning_names_the_class_in_use(caplog):
    """Issue 42: under Fabric the warning recommends Fabric's class (the one in use), not the Trainer's."""
    import logging

    class MyFabricStrategy(CPUSwapFabricStrategy):
        pass

    caplog.set_level(logging.WARNING, logger="lightning_swap")
    _, strategy, _ = train("cnn", MyFabricStrategy(), steps=1)
    strategy.teardown()
    said = [r.getMessage() for r in caplog.records if "no memory budget" in r.getMessage()]
    assert len(said) == 1 and "MyFabricStrategy(budget_bytes='8GiB')" in said[0], said
