"""Issue 23 item 1: every saved byte is plannable. The code outside the segments (the stem, the
glue between segments, the head and the loss) is profiled in windows of its own, planned kept or
offloaded like a segment, and offloaded by hooks over the whole step (Note [Regions outside the
segments are hooked for the whole step] in ``engine/offload.py``); what stays because no action
can move it is counted (Note [Unplanned bytes]).

The three kinds of test: results equal to plain training (``torch.equal``, fp32, under the strict
stream model too), memory against plain and the prediction, nothing left behind. About 15 s.
"""

from __future__ import annotations

import pytest
import torch

from lightning_swap.core import Action, Plan, SwapRuntime, find_segments, profile, simulate
from lightning_swap.core.segments import PREFIX_REGION, TAIL_REGION, outside_region_names

from ..helpers import grads_that_differ, run_steps
from ..models import MODELS
from ..stream_double import DoubleFactory


def _top_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _train(name: str, plan_for, *, steps: int = 2, batch: int = 4, **runtime_kwargs):
    """Per-step gradients, the final state and the step statistics of ``steps`` SGD steps of
    ``MODELS[name]`` under ``plan_for(segments)`` (``None``: plain training)."""
    build, data, loss_fn = MODELS[name]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    plan = plan_for(find_segments(model)) if plan_for is not None else None
    runtime = SwapRuntime(model, plan, device="cpu", min_offload_bytes=0, **runtime_kwargs).install() if plan is not None else None
    torch.manual_seed(1)  # dropout masks
    batches = (data(batch + step) for step in range(steps))
    grads, stats = run_steps(model, opt, runtime, batches, lambda m, x, y: loss_fn(m(x), y).backward())
    return grads, model.state_dict(), stats


def _everything_offloaded(segments):
    return Plan(actions={n: Action.OFFLOAD for n in segments}, outside={n: Action.OFFLOAD for n in outside_region_names(segments)})


_PLAIN: dict = {}


def _assert_plain(name, grads, state):
    if name not in _PLAIN:
        _PLAIN[name] = _train(name, None)
    plain_grads, plain_state, _ = _PLAIN[name]
    assert grads_that_differ(grads, plain_grads) == []
    assert [k for k in plain_state if not torch.equal(state[k], plain_state[k])] == []


# -- exact ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt", "cnn", "mlp"])
@pytest.mark.parametrize("plan_for", [_everything_offloaded, Plan.lowest_memory], ids=["offload", "lowest"])
def test_offloading_the_regions_outside_trains_as_plain(name, plan_for):
    grads, state, stats = _train(name, plan_for)
    _assert_plain(name, grads, state)
    assert all(s.offloaded_bytes > 0 for s in stats)


@pytest.mark.parametrize("name, mode, windows", [
    ("gpt", "late", {}), ("cnn", "early", {}),
    ("gpt", "early", {"prefetch_bytes": 0, "inflight_bytes": 0}), ("cnn", "late", {"prefetch_bytes": 1 << 14, "inflight_bytes": 1 << 14}),
])
def test_exact_under_the_strict_stream_model(name, mode, windows):
    """The whole-step hooks under Note [Strict stream model]: copies that land late or in the
    other order change nothing, and no ordering is missing."""
    with DoubleFactory(mode) as factory:
        grads, state, _ = _train(name, _everything_offloaded, **windows)
    factory.drain()
    assert factory.violations == []
    assert sum(d.copies_done for d in factory.doubles) > 0
    _assert_plain(name, grads, state)


# -- what is planned --------------------------------------------------------------------------
def test_the_profile_plans_the_regions_that_save():
    """The CNN's stem and head save for backward: both are regions of the chain, in order, with
    their own windows; the MLP has no stem (its input is the batch), only the head and loss."""
    build, data, loss_fn = MODELS["cnn"]
    torch.manual_seed(0)
    model = build()
    x, y = data(4)
    prof = profile(model, (x, y), step_fn=lambda m, b: loss_fn(m(b[0]), b[1]), device="cpu", scale=False)
    chain = [(e.name, o) for e, o in prof.chain]
    assert chain[0] == (PREFIX_REGION, True) and chain[-1] == (TAIL_REGION, True)
    assert [n for n, o in chain if not o] == list(prof.names)
    assert all(r.saved_bytes > 0 and r.backward_peak_bytes > 0 for r in prof.outside)
    # every window is still the measurement: plain training predicted to the byte
    assert simulate(prof, [Action.KEEP] * len(prof.segments)).peak_bytes == prof.peak_bytes
    build, data, loss_fn = MODELS["mlp"]
    model = build()
    x, y = data(4)
    prof = profile(model, (x, y), step_fn=lambda m, b: loss_fn(m(b[0]), b[1]), device="cpu", scale=False)
    assert prof.outside_names == (TAIL_REGION,)


def _measured(name, batch, plan, **kwargs):
    build, data, loss_fn = MODELS[name]
    torch.manual_seed(0)
    model = build()
    x, y = data(batch)
    prof = profile(model, (x, y), step_fn=lambda m, b: loss_fn(m(b[0]), b[1]), device="cpu", scale=False, min_offload_bytes=0)
    plan = plan(prof)
    with SwapRuntime(model, plan, device="cpu", **{"min_offload_bytes": 0, **kwargs}) as runtime:
        runtime.begin_step([x, y])
        loss_fn(model(x), y).backward()
        stats = runtime.end_step()
    return prof, plan, stats


def test_offloading_the_stem_and_head_lowers_the_peak_as_predicted():
    """The CNN at 32 px, every segment offloaded per saved tensor: offloading the stem and the head
    too lowers the measured peak, and each peak is within 5% of its prediction."""
    def plan(keep_outside):
        def make(prof):
            outside = {n: Action.KEEP if keep_outside else Action.OFFLOAD for n in prof.outside_names}
            return Plan(actions={n: Action.OFFLOAD for n in prof.names}, outside=outside, prefetch_bytes=0, inflight_bytes=0)
        return make

    peaks = {}
    for keep in (True, False):
        prof, p, stats = _measured("cnn", 16, plan(keep))
        predicted = simulate(prof, p.actions, outside=p.outside, prefetch_bytes=0, inflight_bytes=0).peak_bytes
        peaks[keep] = stats.peak_device_bytes
        assert abs(predicted - stats.peak_device_bytes) <= 0.05 * stats.peak_device_bytes, (keep, predicted, stats.peak_device_bytes)
    assert peaks[False] < peaks[True] < prof.peak_bytes


def test_unplanned_bytes_are_what_no_action_moves():
    """Note [Unplanned bytes]: with everything offloaded and no threshold nothing stays; with a
    threshold above every saved tensor everything the engine saw stays, and is counted so."""
    every = lambda prof: Plan(actions={n: Action.OFFLOAD for n in prof.names}, outside={n: Action.OFFLOAD for n in prof.outside_names})  # noqa: E731
    _, _, moved = _measured("gpt", 4, every)
    assert moved.saved_bytes > 0 and moved.unplanned_bytes == 0
    _, _, stuck = _measured("gpt", 4, every, min_offload_bytes=1 << 30)
    assert stuck.offloaded_bytes == 0 and stuck.unplanned_bytes == stuck.saved_bytes == moved.saved_bytes
    _, _, kept = _measured("gpt", 4, lambda prof: Plan(actions={n: Action.KEEP for n in prof.names}))
    assert kept.saved_bytes is None and kept.unplanned_bytes is None  # nothing offloads: not counted


# -- nothing left behind ----------------------------------------------------------------------
def test_whole_step_hooks_are_gone_after_each_step_and_after_errors():
    build, data, loss_fn = MODELS["gpt"]
    model = build()
    x, y = data(2)
    segments = find_segments(model)
    before = _top_hooks()
    with SwapRuntime(model, _everything_offloaded(segments), device="cpu") as runtime:
        runtime.begin_step([x, y])
        assert _top_hooks() is not before  # on for the whole step
        loss_fn(model(x), y).backward()
        runtime.end_step()
        assert _top_hooks() is before
        runtime.begin_step([x, y])
        with pytest.raises(ZeroDivisionError):
            model(x)
            1 / 0
        runtime.abort_step()
        assert _top_hooks() is before
        runtime.begin_step([x, y])  # a step left open is closed by remove()
    assert _top_hooks() is before and runtime.engine is None


def test_a_hooks_context_left_open_in_the_step_takes_only_the_runtimes_off():
    """Note [Hooks never outlive the library] (``core/tensors.py``): a user's context entered in the
    step and left open sits above the runtime's whole-step hooks; the step's end takes exactly the
    runtime's off and leaves the user's, which their own exit then pops."""
    build, data, loss_fn = MODELS["gpt"]
    model = build()
    x, y = data(2)
    mine = lambda t: t  # noqa: E731
    with SwapRuntime(model, _everything_offloaded(find_segments(model)), device="cpu") as runtime:
        runtime.begin_step([x, y])
        hooks = torch.autograd.graph.saved_tensors_hooks(mine, lambda t: t)
        hooks.__enter__()
        runtime.end_step()
        assert _top_hooks()[0] is mine
        hooks.__exit__(None, None, None)
    assert _top_hooks() is None


@pytest.mark.parametrize("kind", ["accumulate", "two_forwards", "retain_graph"])
def test_every_way_a_loop_uses_autograd(kind):
    """Accumulation (a forward after a backward: the prefix again), micro-batches summed into one
    loss, a backward twice over one graph: the regions offloaded, exact under the strict model."""

    def run(plan_for):
        build, data, loss_fn = MODELS["cnn"]
        torch.manual_seed(0)
        model = build()
        runtime = SwapRuntime(model, plan_for(find_segments(model)), device="cpu", min_offload_bytes=0).install() if plan_for else None
        torch.manual_seed(1)
        x, y = data(4)
        try:
            if runtime is not None:
                runtime.begin_step([x, y])
            if kind == "accumulate":
                loss_fn(model(x[:2]), y[:2]).backward()
                loss_fn(model(x[2:]), y[2:]).backward()
            elif kind == "two_forwards":
                (loss_fn(model(x[:2]), y[:2]) + loss_fn(model(x[2:]), y[2:])).backward()
            else:
                loss = loss_fn(model(x), y)
                loss.backward(retain_graph=True)
                loss.backward()
            if runtime is not None:
                runtime.end_step()
        finally:
            if runtime is not None:
                runtime.remove()
        return [p.grad for p in model.parameters()]

    plain = run(None)
    with DoubleFactory("late") as factory:
        grads = run(Plan.lowest_memory)
    factory.drain()
    assert factory.violations == [] and sum(d.copies_done for d in factory.doubles) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads, plain))


def _traced_under(name: str, plan_for, *, hold: bool):
    """One step of ``MODELS[name]`` traced (as ``auto`` observes a step under its plan) with the
    runtime running ``plan_for(segments)`` (``None``: plain); ``hold``: Note [Regions held as kept]."""
    from lightning_swap.core.measure.trace import StepTracer

    build, data, loss_fn = MODELS[name]
    torch.manual_seed(0)
    model = build()
    segments = find_segments(model)
    x, y = data(4)
    runtime = SwapRuntime(model, plan_for(segments), device="cpu", min_offload_bytes=0).install() if plan_for is not None else None
    params = list(model.parameters())
    try:
        if runtime is not None:
            runtime.begin_step([x, y])
        tracer = StepTracer(model, segments, device=torch.device("cpu"), static=[*params, x, y], params=params)
        tracer.rec.hold = hold
        if runtime is not None and runtime.engine is not None:
            runtime.engine.observer = tracer.rec  # Note [A traced step sees what the plan moves]
        tracer.begin()
        loss = loss_fn(model(x), y)
        tracer.backward_begins()
        loss.backward()
        trace = tracer.finish()
        if runtime is not None:
            runtime.end_step()
            assert _top_hooks() is None
    finally:
        if runtime is not None:
            runtime.remove()
    return trace


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_a_step_observed_under_offloaded_regions_is_measured_as_if_they_were_kept(name):
    """Note [Regions held as kept] (``measure/trace.py``): the tracer's pack hook runs over the
    runtime's whole-step hooks, so the regions are still offloaded (the loss's backward begins
    lower) and still recorded (what each saves, as plain); on CPU the tracer's meter holds what
    they saved until their backward, so every forward window is plain's."""
    regions = lambda segments: Plan(  # noqa: E731
        actions={n: Action.KEEP for n in segments}, outside={n: Action.OFFLOAD for n in outside_region_names(segments)},
    )
    plain = _traced_under(name, None, hold=False)
    held, offloaded = _traced_under(name, regions, hold=True), _traced_under(name, regions, hold=False)
    from lightning_swap.core.measure.trace import WindowKind, is_segment

    outside = [k for k in plain.saved if not is_segment(k)]
    assert outside and all(sum(held.saved[k].values()) == sum(plain.saved[k].values()) > 0 for k in outside)
    assert offloaded.turnaround_bytes < plain.turnaround_bytes == held.turnaround_bytes
    forward = [w for w in plain.window_peak if w.kind in (WindowKind.PREFIX_FORWARD, WindowKind.FORWARD, WindowKind.AFTER)]
    assert {w: held.window_peak[w] for w in forward} == {w: plain.window_peak[w] for w in forward}
    assert {w: held.window_start.get(w) for w in forward} == {w: plain.window_start.get(w) for w in forward}


def test_a_hold_is_let_go_by_its_token_even_where_python_reuses_the_id():
    """Note [Holds are tokens, not ids]: two storages held one after the other, the first freed
    before the second exists (so CPython may give the second storage object the first one's
    address, as it did in the guard steps of issue 20; the accounting must not depend on it):
    letting go of the second releases its bytes only, the first's stay counted until its own
    hold is let go; a storage held twice goes with the last hold."""
    from lightning_swap.core.engine.meter import DeviceMemoryMeter

    with DeviceMemoryMeter("cpu") as meter:
        first = torch.ones(1024)  # 4 KiB
        held_first = meter.hold(first.untyped_storage())
        del first
        second = torch.ones(2048)  # 8 KiB
        held_second = meter.hold(second.untyped_storage())
        del second
        assert meter.current_bytes == 12 * 1024  # both freed, both held
        meter.let_go([held_second])
        assert meter.current_bytes == 4 * 1024, "letting go of the second released the first"
        meter.let_go([held_first])
        assert meter.current_bytes == 0
        twice = torch.ones(1024)
        tokens = [meter.hold(twice.untyped_storage()), meter.hold(twice.untyped_storage())]
        del twice
        meter.let_go(tokens[1:])
        assert meter.current_bytes == 4 * 1024
        meter.let_go(tokens[:1])
        assert meter.current_bytes == 0
