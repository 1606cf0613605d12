"""2-process DDP on CPU: "ddp_cpu_swap" gives exactly plain "ddp"'s weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


SCRIPT = Path(__file__).parents[1] / "scripts" / "train_ddp.py"


@pytest.mark.slow
def test_ddp_cpu_swap_equals_plain_ddp(tmp_path):
    out = tmp_path / "ddp.pt"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    policies = ["offload", "recompute", "recompute_offload"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--policies", *policies],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = torch.load(out, weights_only=False)
    plain = results["plain"]
    assert results["plain:world"] == 2
    for policy in policies:
        state = results[policy]
        different = [k for k in plain if not torch.equal(plain[k], state[k])]
        assert not different, f"{policy}: {different}"
        assert set(results[policy + ":plan"].values()) == {policy}
        assert results[policy + ":world"] == 2
    assert results["offload:offloaded"] > 0


@pytest.mark.slow
def test_batch_finder_agrees_across_ddp_ranks(tmp_path):
    """2 gloo ranks search under one simulated budget: same batch on both, training fits."""
    from ..scale.test_scale import Loop

    loop = Loop("gpt")
    keep = {n: "keep" for n in ("blocks.0", "blocks.1", "blocks.2", "blocks.3")}
    from lightning_swap.core import resolve_policy

    budget = loop.peak(16, resolve_policy("keep", list(keep)))
    out = tmp_path / "find.pt"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--model", "gpt", "--finder-budget", str(budget)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in (0, 1)]
    assert ranks[0]["batch"] == ranks[1]["batch"] == ranks[0]["module_batch"] == ranks[1]["module_batch"]
    assert ranks[0]["plan"] == ranks[1]["plan"]
    assert ranks[0]["batch"] >= 16
    assert all(r["peak"] <= budget for r in ranks)


def _auto_on_two_ranks(tmp_path, *flags: str) -> tuple[list[int], list[dict]]:
    """``policy="auto"`` on 2 gloo ranks at a budget plain does not fit (70% of its peak) and one
    it does: the budgets, and what each rank saved (``train_ddp.py --auto-budgets``)."""
    from lightning_swap import CPUSwapStrategy

    from ..lit import fit

    _, trainer = fit("cnn", CPUSwapStrategy(policy="keep", min_offload_bytes=0), batch_size=4, steps=3)
    plain = max(s.peak_device_bytes for s in trainer.strategy.stats_history)
    budgets = [int(0.7 * plain), 1 << 40]
    out = tmp_path / "auto.pt"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *flags, "--auto-budgets", *map(str, budgets)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return budgets, [torch.load(f"{out}.rank{r}", weights_only=False) for r in (0, 1)]


@pytest.mark.slow
def test_auto_ranks_agree_when_rank_1s_first_batch_is_larger(tmp_path):
    """Note [Observe only what fits] under DDP, at a budget plain does not fit and at one it does:
    rank 1's first batch has twice rank 0's rows (and its fifth, after a plan was made from rank
    0's). Every rank decides from the batch key agreed across ranks (the largest size, one
    shape), so both guard the same steps, take rank 0's verdict and run the same plan at every
    step; nothing hangs, and every step of every rank is within the budget, the first included
    (a larger batch is guarded, never planned from rank 0's smaller one). Deciding from each
    rank's own batch, rank 1 alone would guard its fifth step (measured: the run hangs)."""
    budgets, ranks = _auto_on_two_ranks(tmp_path, "--uneven")
    for budget in budgets:
        assert ranks[0][budget]["batches"][:5] == [4] * 5 and ranks[1][budget]["batches"][:5] == [8, 4, 4, 4, 8]
        assert ranks[0][budget]["plans"] == ranks[1][budget]["plans"] and len(ranks[0][budget]["plans"]) == 8
        for r in ranks:
            assert max(p for p in r[budget]["peaks"] if p is not None) <= budget, (budget, r[budget]["peaks"])
    assert set(ranks[0][budgets[1]]["plan"].values()) == {"keep"}
    assert set(ranks[0][budgets[0]]["plan"].values()) != {"keep"}
