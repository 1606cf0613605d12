"""Note [The budget held online] (``core/runtime/online.py``): a step held within its budget as it
runs, from the bytes alive at each segment's start; the segments still to come moved to
lower-memory actions, said in ``StepStats.moved``; results equal plain; no wait for the device."""

from __future__ import annotations

import torch

from lightning_swap.core import Action, Plan, SwapConfig, SwapRuntime, SwapSession, find_segments, profile, simulate
from lightning_swap.core.runtime.online import OnlineBudget

from ..decide.test_solver import random_chain
from ..models import MODELS
from ..stream_double import DoubleFactory

MiB = 1 << 20


def _keep(names) -> Plan:
    return Plan(actions={n: Action.KEEP for n in names})


def test_a_check_that_fits_moves_nothing_and_one_over_moves_only_what_is_still_to_come():
    chain = random_chain(1, 4)
    keep = _keep(chain.names)
    peak = simulate(chain, keep.actions).peak_bytes
    fits = OnlineBudget(chain, keep.actions, {}, budget_bytes=peak)
    start = fits._prediction.forward_start_bytes
    assert fits.check(None, start[0]) == {} and fits.check("s1", start[1]) == {} and not fits.moved
    over = OnlineBudget(chain, keep.actions, {}, budget_bytes=peak)
    moves = over.check("s2", start[2] + 30 * MiB)  # 30 MiB more alive than predicted before s2
    assert moves and set(moves) <= {"s2", "s3"} and all(a is not Action.KEEP for a in moves.values())
    assert over._expected(over._prediction, 2, start[2] + 30 * MiB, 1.0) <= peak or set(over.acts[2:]) == {Action.RECOMPUTE_OFFLOAD}
    assert len(over.moved) >= len(moves) and all("over the prediction" in m for m in over.moved)


def test_under_fsdp_a_move_never_recomputes():
    chain = random_chain(2, 4)
    keep = _keep(chain.names)
    budget = simulate(chain, keep.actions).peak_bytes
    online = OnlineBudget(chain, keep.actions, {}, budget_bytes=budget, recompute=False)
    moves = online.check("s0", online._prediction.forward_start_bytes[0] + 500 * MiB)
    assert moves and set(moves.values()) == {Action.OFFLOAD}


def _step(model, runtime, x, y, loss_fn, online=None):
    runtime.begin_step([x, y], online=online)
    loss_fn(model(x), y).backward()
    return runtime.end_step()


def test_a_step_held_online_stays_within_the_budget_equals_plain_and_says_what_moved():
    """A plan that keeps every segment, made for a budget plain does not fit: the runtime moves the
    segments still to come as the step runs, the step's peak stays within the budget, and the
    gradients are plain's, bit for bit."""
    build, data, loss_fn = MODELS["gpt"]
    torch.manual_seed(0)
    model = build()
    x, y = data(8)
    names = find_segments(model)
    prof = profile(model, (x, y), step_fn=lambda m, b: loss_fn(m(b[0]), b[1]), device="cpu", scale=False, min_offload_bytes=0)
    torch.manual_seed(1)  # dropout: the same masks in both steps
    with SwapRuntime(model, _keep(names), device="cpu", min_offload_bytes=0) as plain:
        plain_peak = _step(model, plain, x, y, loss_fn).peak_device_bytes
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    budget = int(0.8 * plain_peak)
    online = OnlineBudget(prof, _keep(names).actions, {}, budget_bytes=budget)
    torch.manual_seed(1)
    with SwapRuntime(model, _keep(names), device="cpu", min_offload_bytes=0, switchable=True) as runtime:
        stats = _step(model, runtime, x, y, loss_fn, online=online)
    assert stats.moved and stats.peak_device_bytes <= budget, (stats.moved, stats.peak_device_bytes, budget)
    assert all(torch.equal(p.grad, expected[n]) for n, p in model.named_parameters())


def test_a_second_forward_before_the_backward_is_held_by_the_first_ones_bytes():
    """Two forwards, one backward (two views of a batch): the second forward's checks see what the
    first left alive, and move what the second would keep: the step peaks lower than the same
    step with nothing moved (how much lower is what moving the second forward's segments can
    save: the first forward's kept bytes are the plan's, which ``auto`` re-plans from the step)."""
    build, data, loss_fn = MODELS["mlp"]
    torch.manual_seed(0)
    model = build()
    x, y = data(64)
    names = find_segments(model)

    def two_views(online=None, switchable=False):
        with SwapRuntime(model, _keep(names), device="cpu", min_offload_bytes=0, switchable=switchable) as runtime:
            runtime.begin_step([x, y], online=online)
            (loss_fn(model(x), y) + loss_fn(model(x.flip(0)), y.flip(0))).backward()
            return runtime.end_step()

    prof = profile(model, (x, y), step_fn=lambda m, b: loss_fn(m(b[0]), b[1]), device="cpu", scale=False, min_offload_bytes=0)
    one, both = simulate(prof, _keep(names).actions).peak_bytes, two_views().peak_device_bytes
    budget = (one + both) // 2
    stats = two_views(OnlineBudget(prof, _keep(names).actions, {}, budget_bytes=budget), switchable=True)
    assert stats.moved and stats.peak_device_bytes < both, (stats.moved, stats.peak_device_bytes, both)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_auto_steps_held_online_never_wait_for_the_device():
    """Rule 5 of Note [Stream protocol] under ``auto``: once its plan runs, a step's checks read the
    allocator's counter (on CPU the meter's), and the host never waits (the strict double counts
    every synchronize)."""
    build, data, loss_fn = MODELS["gpt"]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = data(8)
    with SwapRuntime(build(), _keep(find_segments(model)), device="cpu", min_offload_bytes=0) as plain:
        plain_peak = _step(plain.model, plain, x, y, loss_fn).peak_device_bytes
    factory = DoubleFactory("late")
    with factory:
        session = SwapSession(model, SwapConfig(budget_bytes=int(0.9 * plain_peak), min_offload_bytes=0, log_plan=False), "cpu")
        kinds = []
        for step in range(6):
            if step == 4:
                syncs = factory.host_syncs
            kinds.append(session.open_step((x, y), [x, y, opt.state], [opt.state]).value)
            loss = loss_fn(model(x), y)
            with session.backward():
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            session.close_step()
        assert kinds[-2:] == ["run", "run"] and session.runtime._online is not None, kinds
        assert factory.host_syncs == syncs
        session.close()
        factory.drain()
