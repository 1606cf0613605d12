"""Issue 23 item 3: which ops ``SELECTIVE`` saves is decided per op from the segment's measured
forward (Note [Which ops selective recomputation saves] in ``measure/profiler.py``), carried by
the plan to the runtime, and decided by the plan under ``torch.compile`` too (Note [Who decides
under compile] in ``engine/recompute.py``). Results equal plain training, the bytes kept are the
predicted ones, the decision follows the measurements. About 6 s."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from lightning_swap.core import Action, Plan, SwapRuntime, profile, simulate
from lightning_swap.core.engine import recompute
from lightning_swap.core.measure.profiler import selective_choice

from .models import MODELS
from .test_outside_regions import _assert_plain, _train

MiB = 1 << 20


@pytest.mark.parametrize("ops, boundary, expected", [
    # (ms, storages made): the average is 10 ms per MiB; conv and mm buy more, relu and add less
    ({"conv": [40.0, {1: 2 * MiB}], "relu": [1.0, {2: 2 * MiB}], "mm": [30.0, {3: MiB}], "add": [9.0, {4: MiB}]}, set(),
     (("conv", "mm"), {1: 2 * MiB, 3: MiB}, 70 / 80)),
    # the segment's output is kept or recomputed with it: it neither costs nor counts
    ({"conv": [40.0, {1: 2 * MiB}], "relu": [1.0, {2: 2 * MiB}]}, {1}, (("relu",), {2: 2 * MiB}, 1 / 41)),
    # an op that made no storage (a view, an in-place op) is no candidate, and costs its time
    ({"view": [5.0, {}], "norm": [2.0, {7: MiB}]}, set(), (("norm",), {7: MiB}, 2 / 7)),
    ({"view": [5.0, {}]}, set(), ((), {}, 0.0)),
])
def test_the_ops_saved_are_those_that_buy_more_than_average(ops, boundary, expected):
    assert selective_choice(ops, boundary) == expected


def test_the_plan_decides_even_where_the_partitioner_could():
    """Note [Who decides under compile]: ``MUST_`` both ways, never ``PREFER_``."""
    policy = recompute._measured_policy(frozenset({"aten.mm.default"}))
    assert policy(None, torch.ops.aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.aten.relu.default) is CheckpointPolicy.MUST_RECOMPUTE


def _profile(name, batch=8):
    build, data, loss_fn = MODELS[name]
    torch.manual_seed(0)
    model = build()
    x, y = data(batch)
    # Fake mode: the ops' times are estimates (FLOPs and bytes), so the decision does not move
    # with a shared machine's timing noise; the bytes are the real step's.
    prof = profile(model, (x, y), step_fn=lambda m, b: loss_fn(m(b[0]), b[1]), device="cpu", scale=False, min_offload_bytes=0, fake=True)
    return model, x, y, loss_fn, prof


def _selective(prof):
    return Plan(actions={s.name: Action.SELECTIVE for s in prof.segments}, selective_ops={s.name: s.selective_ops for s in prof.segments})


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_measured_selective_trains_as_plain(name):
    *_, prof = _profile(name)
    assert all(s.selective_ops is not None for s in prof.segments)
    grads, state, _ = _train(name, lambda segments: _selective(prof))
    _assert_plain(name, grads, state)


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_the_runtime_saves_exactly_the_planned_ops_and_the_predicted_bytes(name, monkeypatch):
    model, x, y, loss_fn, prof = _profile(name)
    plan = _selective(prof)
    decided: list[tuple[frozenset, set, set]] = []  # per segment: planned, saved, recomputed
    original = recompute._measured_policy

    def spy(save_ops):
        policy = original(save_ops)
        mine = (frozenset(save_ops), set(), set())
        decided.append(mine)

        def watched(ctx, op, *args, **kwargs):
            out = policy(ctx, op, *args, **kwargs)
            mine[1 if out is CheckpointPolicy.MUST_SAVE else 2].add(str(op))
            return out

        return watched

    monkeypatch.setattr(recompute, "_measured_policy", spy)
    with SwapRuntime(model, plan, device="cpu", min_offload_bytes=0) as runtime:
        runtime.begin_step([x, y])
        loss_fn(model(x), y).backward()
        measured = runtime.end_step().peak_device_bytes
    assert Counter(p for p, _, _ in decided) == Counter(frozenset(ops) for ops in plan.selective_ops.values())
    assert all(saved == planned and not recomputed & planned for planned, saved, recomputed in decided)
    predicted = simulate(prof, plan.actions).peak_bytes
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)


def test_where_copies_cannot_hide_recomputation_takes_over():
    """Issue 23 item 4: at one budget, a fast link lets the planner offload (the copies hide
    behind compute), a slow one makes it recompute instead, cheap ops first."""
    import dataclasses

    from lightning_swap.core import solve
    from lightning_swap.core.decide.costmodel import AUTO_WINDOW
    from lightning_swap.core.decide.solver import min_budget_bytes

    *_, prof = _profile("gpt", batch=16)
    plans = {}
    for link, bytes_per_ms in (("fast", 1e9), ("slow", 1e3)):
        cuda = dataclasses.replace(prof, device_type="cuda", d2h_bytes_per_ms=bytes_per_ms, h2d_bytes_per_ms=bytes_per_ms)
        least = min_budget_bytes(cuda, prefetch_bytes=AUTO_WINDOW, inflight_bytes=AUTO_WINDOW)
        budget = least + (cuda.peak_bytes - least) // 3
        plans[link] = solve(cuda, budget_bytes=budget, prefetch_bytes=AUTO_WINDOW, inflight_bytes=AUTO_WINDOW)
    fast, slow = (set(plans[k].actions.values()) | set(plans[k].outside.values()) for k in ("fast", "slow"))
    assert Action.OFFLOAD in fast and not {Action.OFFLOAD, Action.RECOMPUTE_OFFLOAD} & slow
    assert {Action.RECOMPUTE, Action.SELECTIVE} & slow, plans["slow"].summary()
