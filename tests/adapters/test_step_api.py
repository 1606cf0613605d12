"""Note [One step API] (``core/scale/session.py``): every front end drives the core's step API and
holds no plan logging or failure handling of its own: a step that raised is the core's
``SwapSession.step_failed``."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning as L
import pytest

import accelerate_swap
import lightning_swap
from lightning_swap import CPUSwapStrategy

from ..helpers import QUIET_TRAINER
from ..lit import LitModel


class _Fails(LitModel):
    """Raises in its second ``training_step``, after the forward."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 1:
            raise RuntimeError("the user's error")
        return loss


def test_a_failed_step_is_dropped_and_raised_as_it_was_with_no_hook_left():
    """Note [Hooks never outlive the library] (``core/tensors.py``): a step that raised is the
    session's (``SwapSession.step_failed``): its window and its hooks are gone, the error
    reaches the user as it was, and a plain backward afterwards runs."""
    import torch

    strategy = CPUSwapStrategy(budget_bytes=1 << 40, min_offload_bytes=0)
    module = _Fails("gpt", batch_size=4, samples=12)
    with pytest.raises(RuntimeError, match="the user's error"):
        L.Trainer(strategy=strategy, accelerator="cpu", max_steps=3, **QUIET_TRAINER).fit(module)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not strategy.swap_session.step_open
    x = torch.randn(4, 8, requires_grad=True)
    (x * x).sum().backward()


#: What only the core's step API may do: plan after an out-of-memory error, read the
#: session's runtime, observation or planner, or make a plan's text.
_CORE_ONLY = {"runtime", "auto", "measured_plan", "plan_log"}


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
