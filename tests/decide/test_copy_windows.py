"""Copy windows, in bytes (Note [Copy windows] in ``lightning_swap/core/engine/offload.py``, priced
by Note [Copy windows, priced] in ``decide/costmodel.py``). What is in flight and what is fetched
ahead stay within their windows, a window of 0 fetches per saved tensor, a window not given is
one element's worth where copies overlap compute and 0 on CPU (Note [Default copy windows]); the
cost model prices each window (measured within 5% on CPU), the planner chooses one and plans for
it, and a plan made for no prefetch can exceed its budget under a deep one."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from lightning_swap.core import Action, SwapRuntime, profile, simulate, solve
from lightning_swap.core.decide.costmodel import AUTO_WINDOW, copied_bytes, window_candidates
from lightning_swap.core.decide.solver import brute_force, least_peak_plan, min_budget_bytes
from lightning_swap.core.engine.offload import OffloadEngine

from ..helpers import sweep
from ..models import MODELS
from ..stream_double import DoubleFactory
from ..measure.test_outside_regions import _assert_plain, _everything_offloaded, _train
from .test_solver import random_chain


# -- the engine stays within its windows ------------------------------------------------------
@pytest.mark.parametrize("limit", [0, 3000, 1 << 20])
def test_in_flight_never_exceeds_the_window(limit, monkeypatch):
    """After every copy to the host, the sources still in flight are within ``inflight_bytes``,
    under the double where copies land late."""
    seen = []
    original = OffloadEngine._copy_out

    def spy(self, *args):
        entry = original(self, *args)
        seen.append(self.copies.inflight_bytes)
        return entry

    monkeypatch.setattr(OffloadEngine, "_copy_out", spy)
    with DoubleFactory("late") as factory:
        grads, state, _ = _train("gpt", _everything_offloaded, inflight_bytes=limit, prefetch_bytes=0)
    factory.drain()
    assert seen and max(seen) <= limit, seen[:5]
    assert any(seen) == (limit > 0)  # a window of 0 leaves nothing in flight
    assert factory.violations == []
    _assert_plain("gpt", grads, state)


@pytest.mark.parametrize("limit", [3000, 1 << 20])
def test_fetched_ahead_never_exceeds_the_window(limit, monkeypatch):
    seen = []
    original = OffloadEngine._prefetch_window

    def spy(self, window):
        original(self, window)
        largest = max((r().nbytes for r in self._order if r() is not None), default=0)
        seen.append((self._ahead_bytes, largest))

    monkeypatch.setattr(OffloadEngine, "_prefetch_window", spy)
    with DoubleFactory("early") as factory:
        grads, state, stats = _train("cnn", _everything_offloaded, prefetch_bytes=limit, inflight_bytes=limit)
    factory.drain()
    assert seen and all(ahead <= max(limit, largest) for ahead, largest in seen)
    assert all(s.prefetched_bytes > 0 for s in stats)
    assert factory.violations == []
    _assert_plain("cnn", grads, state)


def test_a_window_of_zero_fetches_per_saved_tensor():
    """``prefetch_bytes=0``: a storage several ops saved may come back more than once (counted in
    ``refetched_bytes``), and the device holds only what the running op reads: a lower peak than
    holding each fetched storage until its last unpack (any window above 0)."""
    _, _, per_tensor = _train("cnn", _everything_offloaded, steps=1, batch=16, prefetch_bytes=0, inflight_bytes=0)
    _, _, held = _train("cnn", _everything_offloaded, steps=1, batch=16, prefetch_bytes=1, inflight_bytes=0)
    assert per_tensor[0].fetched_bytes == held[0].fetched_bytes == held[0].offloaded_bytes == per_tensor[0].offloaded_bytes
    assert per_tensor[0].refetched_bytes > held[0].refetched_bytes == 0
    assert per_tensor[0].peak_device_bytes <= held[0].peak_device_bytes


# -- priced ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_a_window_not_given_is_priced_as_the_largest_elements_copies(seed: int) -> None:
    """Note [Default copy windows]: on CUDA one element's worth, the most any element copies under
    the plan; on CPU 0 for both."""
    for device_type in ("cpu", "cuda"):
        prof = random_chain(seed, 6, device_type=device_type)
        for acts in ([Action.OFFLOAD] * 6, [Action.KEEP, Action.OFFLOAD, Action.RECOMPUTE_OFFLOAD] * 2):
            most = max(copied_bytes(s, a) for s, a in zip(prof.segments, acts)) if device_type == "cuda" else 0
            assert simulate(prof, acts) == simulate(prof, acts, prefetch_bytes=most, inflight_bytes=most)


def test_on_cpu_nothing_is_in_flight_and_fetching_ahead_only_raises_the_peak() -> None:
    prof = random_chain(3, 6, device_type="cpu")
    acts = [Action.OFFLOAD] * 6
    base = simulate(prof, acts, prefetch_bytes=0, inflight_bytes=0)
    assert all(simulate(prof, acts, prefetch_bytes=0, inflight_bytes=w) == base for w in (1 << 20, 1 << 30))
    deeper = [simulate(prof, acts, prefetch_bytes=w, inflight_bytes=0).peak_bytes for w in (0, 1 << 20, 1 << 26, 1 << 30)]
    assert deeper == sorted(deeper) and deeper[-1] > deeper[0]


def test_on_cuda_a_larger_window_never_costs_less_memory() -> None:
    prof = random_chain(4, 6, device_type="cuda")
    acts = [Action.OFFLOAD] * 6
    windows = (0, 1 << 20, 1 << 24, 1 << 28)
    for p, i in itertools.product(windows, windows):
        peak = simulate(prof, acts, prefetch_bytes=p, inflight_bytes=i).peak_bytes
        more = [simulate(prof, acts, prefetch_bytes=p2, inflight_bytes=i2).peak_bytes for p2, i2 in ((p << 4 or 1 << 20, i), (p, i << 4 or 1 << 20))]
        assert all(peak <= m for m in more), (p, i, peak, more)


@pytest.mark.parametrize("keywords, field", [
    ({"prefetch_bytes": -1}, "prefetch_bytes"), ({"prefetch_bytes": 1.5}, "prefetch_bytes"),
    ({"inflight_bytes": -1}, "inflight_bytes"), ({"inflight_bytes": True}, "inflight_bytes"),
])
def test_bad_window_is_a_value_error_naming_it(keywords: dict, field: str) -> None:
    prof = random_chain(1, 3)
    for call in (lambda: simulate(prof, [Action.KEEP] * 3, **keywords), lambda: solve(prof, budget_bytes=1 << 40, **keywords),
                 lambda: min_budget_bytes(prof, **keywords)):
        with pytest.raises(ValueError, match=field):
            call()


#: (prefetch_bytes, inflight_bytes): windows of 0 (the DP exact), one of each, both.
WINDOWS = [(0, 0), (1 << 24, 0), (0, 1 << 24), (1 << 26, 1 << 26)]


def _one_device_per_window(window: tuple[int, int], device_type: str) -> bool:
    """Every window once by default, on the CPU and on CUDA in turn."""
    return (WINDOWS.index(window) + ["cpu", "cuda"].index(device_type)) % 2 == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "window,device_type",
    sweep([(w, d) for w in WINDOWS for d in ("cpu", "cuda")], _one_device_per_window, "every window on both devices; by default each on one"),
    ids=lambda value: f"prefetch{value[0]}-inflight{value[1]}" if isinstance(value, tuple) else None,
)
def test_solve_fits_its_window_and_is_optimal_where_the_dp_is_exact(device_type: str, window: tuple[int, int]) -> None:
    """Note [Deep copy windows]: the plan fits as simulated under the same window and records it;
    optimal (against brute force) where nothing is held ahead or in flight; and the least budget
    ``min_budget_bytes`` names is one ``solve`` meets."""
    keywords = {"prefetch_bytes": window[0], "inflight_bytes": window[1]}
    exact = window == (0, 0) or device_type == "cpu"
    for seed in range(3):
        prof = random_chain(40 + seed, 4, device_type=device_type)
        lo = min_budget_bytes(prof, **keywords)
        truth = min(simulate(prof, c, **keywords).peak_bytes for c in itertools.product(list(Action), repeat=4))
        assert lo == truth if exact else lo >= truth
        plain = simulate(prof, [Action.KEEP] * 4, **keywords).peak_bytes
        for frac in (0.0, 0.4, 1.2):
            budget = int(lo + frac * max(plain - lo, 1))
            plan = solve(prof, budget_bytes=budget, **keywords)
            assert (plan.prefetch_bytes, plan.inflight_bytes) == window
            pred = simulate(prof, plan.actions, **keywords)
            assert (pred.peak_bytes, pred.step_ms) == (plan.predicted_peak_bytes, plan.predicted_step_ms)
            assert plan.predicted_peak_bytes <= budget
            best = brute_force(prof, budget_bytes=budget, **keywords)
            if exact:
                assert plan.predicted_step_ms == pytest.approx(best[1], rel=1e-9, abs=1e-9)
            else:
                assert plan.predicted_step_ms >= best[1] - 1e-9


# -- measured on CPU, and chosen by the planner ----------------------------------------------------
_GPT: dict = {}


def _gpt():
    if not _GPT:
        build, data, loss_fn = MODELS["gpt"]
        torch.manual_seed(0)
        model = build()
        x, y = data(16)
        _GPT.update(model=model, x=x, y=y, loss_fn=loss_fn,
                    prof=profile(model, (x, y), step_fn=lambda m, b: loss_fn(m(b[0]), b[1]), device="cpu", min_offload_bytes=0))
    return _GPT


def _measured(plan, steps: int = 2, **windows) -> int:
    """The last of ``steps`` real steps' peak device bytes of the GPT under ``plan``."""
    g = _gpt()
    with SwapRuntime(g["model"], plan, device="cpu", min_offload_bytes=0, **windows) as runtime:
        for _ in range(steps):
            runtime.begin_step([g["x"], g["y"]])
            g["loss_fn"](g["model"](g["x"]), g["y"]).backward()
            measured = runtime.end_step().peak_device_bytes
            g["model"].zero_grad(set_to_none=True)
    return measured


@pytest.mark.slow
@pytest.mark.parametrize("prefetch_bytes, inflight_bytes", [(0, 0), (1 << 16, 0), (1 << 22, 1 << 22)])
def test_byte_windows_are_predicted_on_cpu(prefetch_bytes, inflight_bytes):
    """A tight budget (a quarter of the way from the least to plain's peak) under each window:
    the plan's measured peak is within the budget, within 5% of its prediction per saved tensor,
    never above it with a window fetched ahead."""
    prof, windows = _gpt()["prof"], {"prefetch_bytes": prefetch_bytes, "inflight_bytes": inflight_bytes}
    lo = min_budget_bytes(prof, **windows)
    budget = lo + (prof.peak_bytes - lo) // 4
    plan = solve(prof, budget_bytes=budget, **windows)
    assert (plan.prefetch_bytes, plan.inflight_bytes) == (prefetch_bytes, inflight_bytes)  # recorded, and the runtime runs it
    measured = _measured(plan)
    assert measured <= budget, (measured, plan.render())
    if prefetch_bytes == 0:  # what the planner uses on CPU: within DESIGN's 5%
        assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * measured, (measured, plan.render())
    else:  # fetched ahead: conservative, by at most the window or one storage (its Note)
        largest = max(e.largest_offload_bytes for e, _ in prof.chain)
        assert measured <= plan.predicted_peak_bytes <= measured + max(prefetch_bytes, largest) + 0.05 * measured, (measured, plan.render())
    deeper = simulate(prof, plan.actions, outside=plan.outside, prefetch_bytes=prefetch_bytes + (1 << 22), inflight_bytes=inflight_bytes)
    assert deeper.peak_bytes >= plan.predicted_peak_bytes  # more fetched ahead never costs less memory


@pytest.mark.slow
def test_a_plan_made_for_no_prefetch_can_exceed_its_budget_under_a_deep_one() -> None:
    """Why the window is an input: the all-offload plan's peak on CPU with everything fetched
    ahead is far above what the same plan is predicted at without prefetch (measured 11.2 MB
    against 3.4 MB), and priced so, conservatively by at most one storage (12.3 MB)."""
    prof = _gpt()["prof"]
    acts = dict.fromkeys(prof.names, Action.OFFLOAD)
    shallow = simulate(prof, acts, prefetch_bytes=0, inflight_bytes=0).peak_bytes
    deep = simulate(prof, acts, prefetch_bytes=1 << 30, inflight_bytes=0).peak_bytes
    measured = _measured(acts, prefetch_bytes=1 << 30, inflight_bytes=0)
    assert measured > 1.5 * shallow
    largest = max(e.largest_offload_bytes for e, _ in prof.chain)
    assert measured <= deep <= measured + largest + 0.05 * measured, (measured, deep, largest)


def test_the_planner_chooses_the_windows():
    """Note [The planner chooses the copy windows]: on CPU, nothing overlaps: 0 and 0. Where
    copies overlap compute, windows sized from the bandwidths; the plan records the one it was
    priced with, the fastest that fits, and a tighter budget gets the smaller window. Not given
    (``None``) is the planner's choice too."""
    g = _gpt()
    assert window_candidates(g["prof"]) == [(0, 0)]
    plan = solve(g["prof"], budget_bytes=g["prof"].peak_bytes)
    assert (plan.prefetch_bytes, plan.inflight_bytes) == (0, 0)
    cuda = dataclasses.replace(g["prof"], device_type="cuda", d2h_bytes_per_ms=2e6, h2d_bytes_per_ms=2e6)
    candidates = window_candidates(cuda)
    assert candidates[0] == (0, 0) and len(candidates) == 3
    auto = {"prefetch_bytes": AUTO_WINDOW, "inflight_bytes": AUTO_WINDOW}
    lowest = least_peak_plan(cuda, **auto)
    roomy = solve(cuda, budget_bytes=2 * cuda.peak_bytes, actions=(Action.OFFLOAD,), **auto)
    tight = solve(cuda, budget_bytes=lowest.predicted_peak_bytes, actions=(Action.OFFLOAD,))
    assert (roomy.prefetch_bytes, roomy.inflight_bytes) in candidates[1:]  # copies hidden: faster than waiting for each
    assert roomy.predicted_step_ms < tight.predicted_step_ms
    for plan in (roomy, tight):
        for p, i in candidates:
            other = simulate(cuda, plan.actions, outside=plan.outside, prefetch_bytes=p, inflight_bytes=i)
            assert other.peak_bytes > plan.budget_bytes or other.step_ms >= plan.predicted_step_ms - 1e-9


# -- through the Lightning strategy ------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_plain():
    from lightning_swap import CPUSwapStrategy

    from ..lit import fit

    plain, trainer = fit("gpt", CPUSwapStrategy(policy="keep", min_offload_bytes=0), batch_size=16, steps=3)
    return plain, max(s.peak_device_bytes for s in trainer.strategy.stats_history[1:])


@pytest.mark.slow
@pytest.mark.parametrize("prefetch, inflight", [(0, 0), (1 << 16, 1 << 16), (1 << 18, 0)])
def test_strategy_auto_plans_for_its_window_and_stays_within_budget(gpt_plain, prefetch: int, inflight: int) -> None:
    """``CPUSwapStrategy(policy="auto", prefetch_bytes=p, inflight_bytes=i)``: the session hands
    its window to the planner, so every planned step fits (the first is observed)."""
    from lightning_swap import CPUSwapStrategy

    from ..helpers import assert_same_state
    from ..lit import fit

    plain, plain_peak = gpt_plain
    budget = int(0.6 * plain_peak)
    strategy = CPUSwapStrategy(policy="auto", budget_bytes=budget, min_offload_bytes=0, prefetch_bytes=prefetch, inflight_bytes=inflight)
    module, trainer = fit("gpt", strategy, batch_size=16, steps=3)
    plan = trainer.strategy.plan
    peaks = [s.peak_device_bytes for s in trainer.strategy.stats_history]
    assert (plan.prefetch_bytes, plan.inflight_bytes) == (prefetch, inflight)
    assert plan.predicted_peak_bytes <= budget and set(plan.actions.values()) != {Action.KEEP}
    assert max(peaks[1:]) <= budget, (peaks, budget, plan.summary())
    if prefetch:  # fetched ahead: conservative
        assert plan.predicted_peak_bytes >= peaks[-1], (plan.predicted_peak_bytes, peaks)
    else:
        assert abs(plan.predicted_peak_bytes - peaks[-1]) <= 0.05 * peaks[-1], (plan.predicted_peak_bytes, peaks)
    assert_same_state(module, plain)


@pytest.mark.parametrize("name", ["prefetch_segments", "inflight_segments"])
def test_the_windows_in_segments_are_gone(name):
    """One unit for copy windows: the options counted in segments are refused, naming them; the
    allowed options listed include their replacements in bytes."""
    from lightning_swap import CPUSwapStrategy

    with pytest.raises(ValueError, match=rf"unknown options \['{name}'\]; allowed: .*'{name.replace('segments', 'bytes')}'"):
        CPUSwapStrategy(**{name: 1})
