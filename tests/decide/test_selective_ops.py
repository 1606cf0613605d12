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
from lightning_swap.core.measure.profiler import DeviceAssumption, selective_choice

from ..models import MODELS
from ..measure.test_outside_regions import _assert_plain, _train

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
    # Fake mode at fixed rates: the ops' times are estimates (FLOPs and bytes at 10 GFLOP/s and
    # 5 GB/s, not the rates measured now), so the decision does not move with a shared machine's
    # timing noise; the bytes are the real step's.
    rates = DeviceAssumption("cpu", flops_per_ms=1e7, memory_bytes_per_ms=5e6, d2h_bytes_per_ms=5e6, h2d_bytes_per_ms=5e6)
    prof = profile(
        model, (x, y), step_fn=lambda m, b: loss_fn(m(b[0]), b[1]), device="cpu", scale=False, min_offload_bytes=0, fake=True,
        assume=rates,
    )
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
        calls = Counter()

        def watched(ctx, op, *args, **kwargs):
            out = policy(ctx, op, *args, **kwargs)
            key = (ctx.is_recompute, str(op))  # Note [Selective saves per call]: ``op#k``
            mine[1 if out is CheckpointPolicy.MUST_SAVE else 2].add(recompute.op_call(str(op), calls[key]))
            calls[key] += 1
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


# -- per call, and lighter choices (Notes [Selective saves per call] and [Lighter selective]) --
def test_calls_of_one_op_are_choices_of_their_own_and_calls_past_the_last_saved_tensor_are_none():
    """Two matmuls of one segment: the dearer per byte is saved, the other not; a third after the
    last storage the segment saves for backward (a last projection feeding the residual add) is
    never saved: the recomputation stops before it (checkpoint's early stop)."""
    ops = {
        "mm#0": [30.0, {1: MiB}],  # 30 ms a MiB
        "gelu#0": [1.0, {2: 4 * MiB}],
        "mm#1": [8.0, {3: 4 * MiB}],  # 2 ms a MiB
        "mm#2": [50.0, {4: MiB}],  # the dearest per byte, but after the last saved storage (3)
    }
    chosen, heavy, share = selective_choice(ops, set(), frozenset(), saved={1, 2, 3})
    assert chosen == ("mm#0",) and heavy == {1: MiB} and share == pytest.approx(30 / 89)
    # without what the segment saves (a caller that does not know), every call is a candidate
    assert selective_choice(ops, set())[0] == ("mm#0", "mm#2")


def test_in_a_compiled_graph_selective_saves_every_compute_heavy_call_and_nothing_else():
    """Note [Selective under compile chooses compute-heavy calls]: inside a compiled graph the
    recomputation of pointwise ops and norms is fused into the backward's kernels, so their eager
    times do not decide: every matmul and attention call is saved (a cheap-per-byte one too, and
    whatever a GELU measured), none of the rest; the early-stop cut still applies."""
    mm, sdpa = "aten.mm.default", "aten._scaled_dot_product_flash_attention_for_cpu.default"
    ops = {
        f"{mm}#0": [30.0, {1: MiB}],
        "aten.gelu.default#0": [90.0, {2: MiB}],  # a noisy eager time: dearer than any matmul
        f"{mm}#1": [2.0, {3: 4 * MiB}],  # cheap per byte: eager selective would not save it
        f"{sdpa}#0": [20.0, {4: MiB}],
        "aten.native_layer_norm.default#0": [5.0, {5: MiB}],
        f"{mm}#2": [50.0, {6: MiB}],  # after the last storage saved for backward
    }
    saved = {1, 2, 3, 4, 5}
    assert selective_choice(ops, set(), frozenset(), saved)[0] == (f"{sdpa}#0", "aten.gelu.default#0", f"{mm}#0")
    chosen, heavy, share = selective_choice(ops, set(), frozenset(), saved, in_graph=True)
    assert chosen == (f"{sdpa}#0", f"{mm}#0", f"{mm}#1")
    assert heavy == {1: MiB, 3: 4 * MiB, 4: MiB} and share == pytest.approx(52 / 197)


def test_an_ops_measured_time_is_shared_among_its_calls_by_their_estimates():
    """Note [Selective saves per call]: one call's own time is noise on a busy machine; the op's
    total is measured, and its calls get it in proportion to their estimates."""
    from lightning_swap.core.measure.profiler import _call_ms

    ops = {"mm#0": [9.0, {}, 1.0], "mm#1": [1.0, {}, 3.0], "relu#0": [2.0, {}, 0.5], "old": [4.0, {}]}
    assert _call_ms(ops) == {"mm#0": 2.5, "mm#1": 7.5, "relu#0": 2.0, "old": 4.0}


def test_lighter_choices_are_one_call_less_or_the_cheapest_per_byte_dropped_the_fastest_first():
    from lightning_swap.core.measure.profiler import lighter_choices

    ops = {"a#0": [10.0, {1: MiB}], "b#0": [12.0, {2: 4 * MiB}], "c#0": [30.0, {3: MiB}]}
    choices = lighter_choices(ops, ("a#0", "b#0", "c#0"), boundary=set(), saved={1, 3})
    # one call less: (b, c), (a, c), (a, b); the cheapest per byte dropped (b at 3 ms/MiB, then a
    # at 10): (a, c), (c,). As (ops, bytes, bytes not saved when kept, forward ms), of the full
    # choice's 6 MiB, 4 MiB not saved when kept (b's), 52 ms; the most ms first.
    expected = [
        (("b#0", "c#0"), 5 / 6, 1.0, 42 / 52), (("a#0", "c#0"), 2 / 6, 0.0, 40 / 52), (("c#0",), 1 / 6, 0.0, 30 / 52),
        (("a#0", "b#0"), 5 / 6, 1.0, 22 / 52),
    ]
    assert [v[0] for v in choices] == [e[0] for e in expected]
    assert [v[1:] for v in choices] == [pytest.approx(e[1:]) for e in expected]
    assert lighter_choices(ops, ("c#0",), set(), set()) == ()  # nothing lighter but recomputation


def test_a_lighter_choice_prices_fewer_bytes_and_more_recomputation():
    *_, prof = _profile("gpt")
    s = next(s for s in prof.segments if s.selective_variants)
    light = s.lighter(0)
    assert light.selective_ops == s.selective_variants[0][0] and set(light.selective_ops) < set(s.selective_ops)
    assert light.heavy_bytes < s.heavy_bytes and light.heavy_forward_ms < s.heavy_forward_ms
    assert s.with_selective_ops(light.selective_ops) == light
    assert s.with_selective_ops(s.selective_ops) is s and s.with_selective_ops(("not.an.op#0",)) is s
    plan = {x.name: Action.SELECTIVE for x in prof.segments}
    full = simulate(prof, plan)
    lighter = simulate(prof, plan, selective_ops={s.name: light.selective_ops})
    assert lighter.peak_bytes < full.peak_bytes and lighter.step_ms > full.step_ms


def _lighter_plan(prof, index=-1):
    """Every segment selective, each on its ``index``-th lighter choice where it has one."""
    ops = {s.name: (s.selective_variants[index][0] if s.selective_variants else s.selective_ops) for s in prof.segments}
    return Plan(actions={s.name: Action.SELECTIVE for s in prof.segments}, selective_ops=ops)


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_a_lighter_choice_trains_as_plain_and_keeps_the_bytes_predicted(name):
    model, x, y, loss_fn, prof = _profile(name)
    assert any(s.selective_variants for s in prof.segments)
    grads, state, _ = _train(name, lambda segments: _lighter_plan(prof))
    _assert_plain(name, grads, state)
    peaks = {}
    for label, plan in (("full", _selective(prof)), ("lighter", _lighter_plan(prof))):
        with SwapRuntime(model, plan, device="cpu", min_offload_bytes=0) as runtime:
            runtime.begin_step([x, y])
            loss_fn(model(x), y).backward()
            peaks[label] = runtime.end_step().peak_device_bytes
        model.zero_grad(set_to_none=True)
        predicted = simulate(prof, plan.actions, selective_ops=plan.selective_ops).peak_bytes
        assert abs(predicted - peaks[label]) <= 0.05 * peaks[label], (label, predicted, peaks[label])
    assert peaks["lighter"] < peaks["full"]


def test_the_planner_takes_a_lighter_choice_where_whole_recomputation_is_slower():
    """Note [Lighter selective]: across budgets from the least to plain's peak, the plan with the
    lighter choices is never slower than the DP's alone, and somewhere it takes one in place of a
    whole recomputation, faster; each plan within its budget, its prediction what ``simulate``
    gives it with its choices."""
    import dataclasses

    from lightning_swap.core import solve
    from lightning_swap.core.decide.solver import min_budget_bytes

    *_, prof = _profile("gpt", batch=16)
    acts = (Action.KEEP, Action.RECOMPUTE, Action.SELECTIVE)
    bare = dataclasses.replace(prof, segments=tuple(dataclasses.replace(s, selective_variants=()) for s in prof.segments))
    least = min_budget_bytes(prof, actions=acts)
    own = {s.name: s.selective_ops for s in prof.segments}
    faster = []
    for budget in range(least, prof.peak_bytes, max((prof.peak_bytes - least) // 40, 1)):
        plan, without = solve(prof, budget_bytes=budget, actions=acts), solve(bare, budget_bytes=budget, actions=acts)
        assert plan.predicted_peak_bytes <= budget and plan.predicted_step_ms <= without.predicted_step_ms + 1e-9
        again = simulate(prof, plan.actions, outside=plan.outside, selective_ops=plan.selective_ops)
        assert (again.peak_bytes, again.step_ms) == (plan.predicted_peak_bytes, pytest.approx(plan.predicted_step_ms))
        if any(ops != own[n] for n, ops in plan.selective_ops.items()) and plan.predicted_step_ms < without.predicted_step_ms:
            faster.append(budget)
    assert faster


# -- found by the second reader (2026-11-24, night) ----------------------------------------------
class _WritesItsInput(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        x.add_(1)  # into its input: the first call's watch copies x first
        a = y.clone()
        b = (y * 3).clone()
        return a.sin() + b.cos()


@pytest.mark.parametrize("ops", [("aten.clone.default#1",), ("aten.clone.default",)])
def test_the_watchs_copy_of_an_input_is_no_call_of_the_segment(ops):
    """Note [Selective saves per call]: the copy the first call's watch takes before the segment
    writes into its input is not counted as one of the segment's ``clone`` calls (the
    recomputation never runs it): ``clone#1`` is ``b``, saved and replayed as ``b``. Before, it
    shifted the counts: ``a`` was replayed as ``b`` (gradients off by 9, silently), and saving
    every ``clone`` failed in backward."""
    def grads(plan):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), _WritesItsInput(), torch.nn.Linear(8, 1))
        x = torch.randn(4, 8)
        runtime = SwapRuntime(model, plan, device="cpu", min_offload_bytes=0).install() if plan else None
        try:
            if runtime:
                runtime.begin_step([x])
            model(x).sum().backward()
            if runtime:
                runtime.end_step()
        finally:
            if runtime:
                runtime.remove()
        return [p.grad for p in model.parameters()]

    plain = grads(None)
    got = grads(Plan(actions={"1": Action.SELECTIVE}, selective_ops={"1": ops}))
    assert all(torch.equal(a, b) for a, b in zip(plain, got))


def test_plain_windows_from_a_step_on_a_lighter_choice_are_the_choices():
    """``as_plain`` of a step run with a lighter choice equals ``as_plain`` of a profile whose own
    choice is that one (before, the backward windows used the full choice's bytes: too low)."""
    import dataclasses

    from lightning_swap.core.decide.under_plan import as_plain

    *_, prof = _profile("gpt")
    i, s = next((i, s) for i, s in enumerate(prof.segments) if s.selective_variants)
    light = s.lighter(len(s.selective_variants) - 1)
    actions = {x.name: Action.SELECTIVE for x in prof.segments}
    via_plan = as_plain(prof, actions, selective_ops={s.name: light.selective_ops})
    own = as_plain(dataclasses.replace(prof, segments=tuple(light if j == i else x for j, x in enumerate(prof.segments))), actions)
    assert [x.backward_peak_bytes for x in via_plan.segments] == [x.backward_peak_bytes for x in own.segments]
    assert via_plan.peak_bytes == own.peak_bytes


def test_processes_agree_on_lighter_choices_listed_in_another_order():
    import dataclasses

    from lightning_swap.core.measure.model_profile import max_profile

    *_, prof = _profile("gpt")
    i, s = next((i, s) for i, s in enumerate(prof.segments) if len(s.selective_variants) >= 2)
    v = s.selective_variants
    other = dataclasses.replace(s, selective_variants=(v[1], v[0], *v[2:]))
    merged = max_profile([prof, dataclasses.replace(prof, segments=tuple(other if j == i else x for j, x in enumerate(prof.segments)))])
    assert merged.segments[i].selective_variants == v


@pytest.mark.parametrize("fused", [False, True])
def test_the_descent_spreads_lighter_choices_over_segments_where_that_is_faster(fused, monkeypatch):
    """Note [Lighter selective, as a descent] (``decide/solver.py``): across budgets from the least
    to plain's peak, the plan is never slower than the one without the descent (the DP, then one
    segment's lighter choice at a time), and somewhere faster, by moving several segments down
    their choices; each plan within its budget, its prediction what ``simulate`` gives it.
    ``fused``: selective priced as measured inside a compiled graph (``selective_floor`` off:
    near nothing, no eager floor), where the descent matters most."""
    import dataclasses

    from lightning_swap.core import solve
    from lightning_swap.core.decide import solver
    from lightning_swap.core.decide.solver import min_budget_bytes

    *_, prof = _profile("gpt", batch=16)
    if fused:
        prof = dataclasses.replace(prof, segments=tuple(
            dataclasses.replace(s, selective_ms=0.2, selective_floor=False) for s in prof.segments
        ))
    acts = (Action.KEEP, Action.RECOMPUTE, Action.SELECTIVE)
    least = min_budget_bytes(prof, actions=acts)
    plans = {}
    for budget in range(least, prof.peak_bytes, max((prof.peak_bytes - least) // 40, 1)):
        plans[budget] = solve(prof, budget_bytes=budget, actions=acts)
    monkeypatch.setattr(solver, "_selective_descent", lambda *args: None)
    faster = []
    for budget, plan in plans.items():
        without = solve(prof, budget_bytes=budget, actions=acts)
        assert plan.predicted_peak_bytes <= budget and plan.predicted_step_ms <= without.predicted_step_ms + 1e-9
        again = simulate(prof, plan.actions, outside=plan.outside, selective_ops=plan.selective_ops)
        assert (again.peak_bytes, again.step_ms) == (plan.predicted_peak_bytes, pytest.approx(plan.predicted_step_ms))
        if plan.predicted_step_ms < without.predicted_step_ms - 1e-9:
            faster.append(budget)
    assert faster
