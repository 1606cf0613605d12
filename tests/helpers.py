"""Training loops, cached plain baselines and small builders used by several test files."""

from __future__ import annotations

import functools
import socket
from typing import Callable, Iterable

import pytest
import torch

from lightning_swap.core import SwapRuntime, find_segments, resolve_policy

from .models import MODELS

POLICIES = ["keep", "offload", "recompute", "selective", "recompute_offload"]

#: ``L.Trainer`` keyword arguments that keep a test's output and disk quiet: no logger, no
#: checkpoint, no progress bar, no model summary.
QUIET_TRAINER = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def sweep(cases: Iterable[tuple], keep: Callable[..., bool], long_reason: str) -> list:
    """``cases`` as ``pytest.param``s: those ``keep(*case)`` accepts run in the default suite, the
    others carry the ``long`` marker (run with ``LSWAP_LONG=1``, tests/conftest.py). ``keep``
    chooses representatives: usually every pair of parameter values at least once (a pairwise
    cover), the full product being the long run."""
    return [pytest.param(*case, marks=() if keep(*case) else pytest.mark.long(long_reason)) for case in cases]


def swap_runtime(model: torch.nn.Module, policy, *, device, **kwargs) -> SwapRuntime:
    """A runtime (not installed) applying ``policy`` to ``model``'s automatic segments on
    ``device`` (required: Note [Tests say which device they mean]); ``kwargs`` go to
    :class:`SwapRuntime` (``min_offload_bytes``, ``prefetch_bytes``, ...)."""
    return SwapRuntime(model, resolve_policy(policy, find_segments(model)), device=device, **kwargs)


def train_core(
    name: str,
    policy,
    *,
    steps: int = 3,
    batch: int = 4,
    min_offload_bytes: int = 0,
    prefetch_bytes=None,
    seed: int = 0,
    unified=None,
    device: str = "cpu",
):
    """Train one of ``MODELS`` with SGD+momentum; ``policy=None`` is plain training.

    Returns the model (runtime removed), the list of StepStats, and the last gradients.
    """
    build, data, loss_fn = MODELS[name]
    torch.manual_seed(seed)
    model = build().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    runtime = None
    if policy is not None:
        runtime = swap_runtime(
            model, policy, device=device, min_offload_bytes=min_offload_bytes, prefetch_bytes=prefetch_bytes, unified=unified
        ).install()
    torch.manual_seed(seed + 1)  # dropout masks
    batches = ((x.to(device), y.to(device)) for x, y in (data(batch + step) for step in range(steps)))
    grads, stats = run_steps(model, opt, runtime, batches, lambda m, x, y: loss_fn(m(x), y).backward())
    return model, stats, grads[-1] if grads else {}


def run_steps(model: torch.nn.Module, optimizer, runtime, batches: Iterable, step: Callable) -> tuple[list[dict], list]:
    """One optimizer step per ``(x, y)`` of ``batches``, each read when its step begins (a batch
    drawn from torch's RNG is drawn where a written-out loop would draw it): ``step(model, x, y)``
    runs the forward and backward, under ``runtime`` (installed; ``None``: plain training), which
    is removed afterwards, after an error too. Returns each step's gradients by parameter name and
    the runtime's ``StepStats``."""
    grads, stats = [], []
    try:
        for x, y in batches:
            if runtime is not None:
                runtime.begin_step([x, y, optimizer.state])
            step(model, x, y)
            if runtime is not None:
                stats.append(runtime.end_step())
            grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        if runtime is not None:
            runtime.remove()
    return grads, stats


def grads_that_differ(grads: list[dict], expected: list[dict]) -> list[tuple[int, str]]:
    """(step, parameter) of each gradient of :func:`run_steps`' ``grads`` not bit-equal to ``expected``'s, or missing."""
    assert len(grads) == len(expected)
    return [
        (i, k) for i, (got, want) in enumerate(zip(grads, expected)) for k in sorted(got.keys() | want.keys())
        if k not in got or k not in want or not torch.equal(got[k], want[k])
    ]


def peaks(trainer) -> list[int]:
    """Each step's metered device peak under a Lightning strategy, oldest first."""
    return [s.peak_device_bytes for s in trainer.strategy.stats_history]


def free_port() -> int:
    """A TCP port free on this machine now (a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, f"differs from plain training: {different}"


@functools.cache
def plain_core(name: str) -> tuple:
    """``train_core(name, None)``, once per process: the baseline the runtime's results are
    compared with (callers only read it)."""
    return train_core(name, None)


@functools.cache
def plain_fit(name: str) -> torch.nn.Module:
    """The LightningModule after plain ``fit(name)``, once per process (callers only read it)."""
    from .lit import fit  # here: the core's tests need no Lightning

    return fit(name)[0]
