"""Note [One step API] (``core/scale/session.py``): every front end drives the core's step API and
holds no out-of-memory retry or plan logging of its own. An observed step out of memory inside a
Lightning ``training_step`` (in its forward or its backward) is judged by the core's
``SwapSession.step_failed`` — the only place that plans after it — and the step, run again
under that plan, trains as plain training does."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning as L
import pytest

import accelerate_swap
import lightning_swap
from lightning_swap import CPUSwapStrategy
from lightning_swap.core import SwapSession

from ..helpers import QUIET_TRAINER, assert_same_state
from ..lit import LitModel
from ..scale.test_auto_real_steps import RunsOutOnce


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_lightning_out_of_memory_is_the_core_step_apis(where, monkeypatch):
    L.seed_everything(0, verbose=False)
    plain = LitModel("gpt", batch_size=4, samples=12)
    L.Trainer(strategy="auto", accelerator="cpu", max_steps=3, **QUIET_TRAINER).fit(plain)
    judged = []
    step_failed = SwapSession.step_failed

    def spy(self, exc):
        verdict = step_failed(self, exc)
        judged.append((type(exc).__name__, verdict))
        return verdict

    monkeypatch.setattr(SwapSession, "step_failed", spy)
    L.seed_everything(0, verbose=False)
    module = RunsOutOnce("gpt", where, batch_size=4, samples=12)  # no batch norm: a failed forward updates no buffer
    strategy = CPUSwapStrategy(budget_bytes=1 << 40, min_offload_bytes=0)
    with pytest.warns(UserWarning, match="out of memory without a plan; .* runs again under the plan"):
        L.Trainer(strategy=strategy, accelerator="cpu", max_steps=3, **QUIET_TRAINER).fit(module)
    # the core judged the injected error (a failed backward is asked about again by the strategy
    # around it: the same verdict, planned once) and planned from a fake-mode profile
    assert judged and set(judged) == {("OutOfMemoryError", True)}, judged
    assert strategy.swap_session.profile.fake and strategy.plan is not None
    assert module.calls == 3 + 2  # the failed attempt and the fake one: no retry of the strategy's own
    assert_same_state(module, plain)


#: What only the core's step API may do: plan after an out-of-memory error, read the
#: session's runtime, observation or planner, or make a plan's text.
_CORE_ONLY = {"plan_after_out_of_memory", "runtime", "observation", "auto", "measured_plan", "plan_log"}


def _adapter_modules() -> list[Path]:
    packages = [Path(lightning_swap.__file__).parent, Path(accelerate_swap.__file__).parent]
    return sorted(p for package in packages for p in package.glob("*.py"))


def _session_attributes(path: Path) -> set[str]:
    """Attributes read from anything named ``session``/``_session``/``swap_session`` in ``path``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            owner_name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if owner_name in ("session", "_session", "swap_session", "_swap_session"):
                names.add(node.attr)
    return names


@pytest.mark.parametrize("path", _adapter_modules(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_adapters_use_only_the_step_api(path):
    """Note [One step API]: no adapter judges a step's failure, plans after one, or reads the
    session's internals (the Lightning strategy once did all three, with its own retry and log)."""
    assert _session_attributes(path) & _CORE_ONLY == set()
    source = path.read_text()
    assert "plan_after_out_of_memory" not in source and "lightning-swap plan (" not in source
