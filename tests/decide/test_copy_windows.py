"""The plan is made for the runtime's copy windows (Note [Copy windows] in decide/costmodel.py):
``prefetch_segments`` and ``inflight_segments`` are inputs of ``simulate`` / ``solve`` /
``min_budget_bytes``, and ``auto``'s plan measured on CPU stays within its budget for each."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn import functional as F

from lightning_swap.core import Action, SwapRuntime, min_budget_bytes, profile, simulate, solve
from lightning_swap.core.decide.costmodel import copied_bytes
from lightning_swap.core.decide.solver import brute_force

from ..helpers import sweep
from ..models import _tokens, _vectors, lm_loss, mlp_chain, tiny_gpt
from .test_solver import random_chain

WINDOWS = list(itertools.product(range(4), range(1, 4)))  # (prefetch_segments, inflight_segments)


# -- the cost model ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_cuda_peak_grows_by_exactly_the_segments_each_window_adds(seed: int) -> None:
    """On CUDA, one more segment of prefetch adds segment ``i-k-1``'s copied bytes to segment
    ``i``'s backward window, one more in flight adds segment ``i-m-1``'s to its forward window."""
    prof = random_chain(seed, 6, device_type="cuda")
    acts = [Action.OFFLOAD] * 6
    copies = [copied_bytes(s, a) for s, a in zip(prof.segments, acts)]
    peaks = {}
    for k, m in itertools.product(range(4), range(4)):
        pred = simulate(prof, acts, prefetch_segments=k, inflight_segments=m)
        peaks[k, m] = pred.peak_bytes
        if k:
            fewer = simulate(prof, acts, prefetch_segments=k - 1, inflight_segments=m)
            added = [b - a for a, b in zip(fewer.backward_peak_bytes, pred.backward_peak_bytes)]
            assert added == [copies[i - k] if i >= k else 0 for i in range(6)], (k, m)
        if m:
            fewer = simulate(prof, acts, prefetch_segments=k, inflight_segments=m - 1)
            added = [b - a for a, b in zip(fewer.forward_peak_bytes, pred.forward_peak_bytes)]
            assert added == [copies[i - m] if i >= m else 0 for i in range(6)], (k, m)
            assert pred.tail_peak_bytes - fewer.tail_peak_bytes == copies[6 - m]
    for k, m in peaks:
        assert peaks[k, m] <= peaks[min(k + 1, 3), m] and peaks[k, m] <= peaks[k, min(m + 1, 3)]
    assert peaks[3, 3] > peaks[1, 1]
    assert simulate(prof, acts).peak_bytes == peaks[1, 1]  # the runtime's CUDA defaults


def test_cpu_copies_hold_nothing_in_flight_and_prefetch_brings_a_segment_back_at_once() -> None:
    prof = random_chain(3, 6, device_type="cpu")
    acts = [Action.OFFLOAD] * 6
    base = simulate(prof, acts)
    assert base == simulate(prof, acts, prefetch_segments=0)  # the CPU default
    for m in range(4):
        assert simulate(prof, acts, prefetch_segments=0, inflight_segments=m) == base
    deeper = [simulate(prof, acts, prefetch_segments=k).peak_bytes for k in range(4)]
    assert deeper == sorted(deeper) and deeper[3] > deeper[0]


def _one_device_per_window(window: tuple[int, int], device_type: str) -> bool:
    """Every window once by default, on the CPU and on CUDA in turn: each device meets every
    prefetch and every in-flight depth, exact windows and inexact ones (on CUDA)."""
    return (WINDOWS.index(window) + ["cpu", "cuda"].index(device_type)) % 2 == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "window,device_type",
    sweep([(w, d) for w in WINDOWS for d in ("cpu", "cuda")], _one_device_per_window, "every window on both devices; by default each on one"),
    ids=lambda value: f"prefetch{value[0]}-inflight{value[1]}" if isinstance(value, tuple) else None,
)
def test_solve_fits_its_window_and_is_optimal_where_the_dp_is_exact(device_type: str, window: tuple[int, int]) -> None:
    """Note [Deep copy windows]: the plan fits as simulated under the same window; optimal
    (against brute force) when the window is at most one segment deep; and the least budget
    ``min_budget_bytes`` names is one ``solve`` meets."""
    k, m = window
    keywords = {"prefetch_segments": k, "inflight_segments": m}
    exact = k <= 1 and (m <= 1 or device_type == "cpu")
    for seed in range(3):
        prof = random_chain(40 + seed, 4, device_type=device_type)
        lo = min_budget_bytes(prof, **keywords)
        truth = min(simulate(prof, c, **keywords).peak_bytes for c in itertools.product(list(Action), repeat=4))
        assert lo == truth if exact else lo >= truth
        plain = simulate(prof, [Action.KEEP] * 4, **keywords).peak_bytes
        for frac in (0.0, 0.4, 1.2):
            budget = int(lo + frac * max(plain - lo, 1))
            plan = solve(prof, budget_bytes=budget, **keywords)
            pred = simulate(prof, plan.actions, **keywords)
            assert (pred.peak_bytes, pred.step_ms) == (plan.predicted_peak_bytes, plan.predicted_step_ms)
            assert plan.predicted_peak_bytes <= budget
            best = brute_force(prof, budget_bytes=budget, **keywords)
            if exact:
                assert plan.predicted_step_ms == pytest.approx(best[1], rel=1e-9, abs=1e-9)
            else:
                assert plan.predicted_step_ms >= best[1] - 1e-9


@pytest.mark.parametrize("keywords, field", [
    ({"prefetch_segments": -1}, "prefetch_segments"), ({"prefetch_segments": 1.5}, "prefetch_segments"),
    ({"inflight_segments": -1}, "inflight_segments"), ({"inflight_segments": True}, "inflight_segments"),
])
def test_bad_window_is_a_value_error_naming_it(keywords: dict, field: str) -> None:
    prof = random_chain(1, 3)
    for call in (lambda: simulate(prof, [Action.KEEP] * 3, **keywords), lambda: solve(prof, budget_bytes=1 << 40, **keywords),
                 lambda: min_budget_bytes(prof, **keywords)):
        with pytest.raises(ValueError, match=field):
            call()


# -- measured on CPU ---------------------------------------------------------------------------
CASES = {
    "gpt": (lambda: tiny_gpt(layers=6), lambda b: _tokens(b), lm_loss, 16),
    "mlp": (lambda: mlp_chain(width=128, depth=6), lambda b: _vectors(b, 128), F.cross_entropy, 512),
}


class Case:
    def __init__(self, name: str) -> None:
        build, data, self.loss_fn, batch_size = CASES[name]
        torch.manual_seed(0)
        self.model = build()
        self.x, self.y = data(batch_size)
        self.profile = profile(self.model, (self.x, self.y), step_fn=self.step, device="cpu")

    def step(self, model, batch):
        return self.loss_fn(model(batch[0]), batch[1])

    def peaks(self, plan, prefetch: int, inflight: int, steps: int = 3) -> list[int]:
        """Peak device bytes of ``steps`` real steps under ``plan`` and the copy window."""
        runtime = SwapRuntime(self.model, plan, device="cpu", prefetch_segments=prefetch, inflight_segments=inflight).install()
        out = []
        try:
            for _ in range(steps):
                runtime.begin_step([self.x, self.y])
                self.step(self.model, (self.x, self.y)).backward()
                out.append(runtime.end_step().peak_device_bytes)
                self.model.zero_grad(set_to_none=True)
        finally:
            runtime.remove()
        return out


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request) -> Case:
    return Case(request.param)


@pytest.mark.slow
def test_auto_measured_peak_stays_within_budget_for_every_window(case: Case) -> None:
    """The issue's criterion: ``prefetch_segments`` in 0..3, ``inflight_segments`` in 1..3, a
    tight budget (a quarter of the way from the least budget to plain's peak, for that window),
    three real steps: every measured peak within the budget and within 5% of the prediction
    (DESIGN's CPU target). Measured: within 3%, never over the prediction."""
    offloaded = 0
    for prefetch, inflight in WINDOWS:
        lo = min_budget_bytes(case.profile, prefetch_segments=prefetch, inflight_segments=inflight)
        budget = lo + (case.profile.peak_bytes - lo) // 4
        plan = solve(case.profile, budget_bytes=budget, prefetch_segments=prefetch, inflight_segments=inflight)
        offloaded += any(a.offloads for a in plan.actions.values())
        for measured in case.peaks(plan, prefetch, inflight):
            where = (prefetch, inflight, measured, plan.predicted_peak_bytes, budget, plan.summary())
            assert measured <= budget, where
            assert abs(plan.predicted_peak_bytes - measured) <= 0.05 * measured, where
    assert offloaded, "no plan offloaded: the windows were never exercised"


@pytest.mark.slow
def test_a_plan_made_for_no_prefetch_can_exceed_its_budget_under_a_deep_one() -> None:
    """Why the window is an input: the all-offload plan's peak on CPU with three segments of
    prefetch is far above what the same plan is predicted at without prefetch (measured)."""
    case = Case("gpt")
    acts = dict.fromkeys(case.profile.names, Action.OFFLOAD)
    shallow = simulate(case.profile, acts, prefetch_segments=0).peak_bytes
    deep = simulate(case.profile, acts, prefetch_segments=3).peak_bytes
    measured = max(case.peaks(acts, 3, 1, steps=2))
    assert measured > 1.5 * shallow
    assert measured <= deep <= 1.05 * measured


# -- through the Lightning strategy ------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_plain():
    from lightning_swap import CPUSwapStrategy

    from ..lit import fit

    plain, trainer = fit("gpt", CPUSwapStrategy(policy="keep", min_offload_bytes=0), batch_size=16, steps=3)
    return plain, max(s.peak_device_bytes for s in trainer.strategy.stats_history[1:])


@pytest.mark.slow
@pytest.mark.parametrize("prefetch, inflight", [(0, 1), (1, 2), (2, 3), (3, 1)])
def test_strategy_auto_plans_for_its_window_and_stays_within_budget(gpt_plain, prefetch: int, inflight: int) -> None:
    """``CPUSwapStrategy(policy="auto", prefetch_segments=p, inflight_segments=i)``: the session
    hands its window to the planner, so every planned step fits (the first is observed)."""
    from lightning_swap import CPUSwapStrategy

    from ..helpers import assert_same_state
    from ..lit import fit

    plain, plain_peak = gpt_plain
    budget = int(0.6 * plain_peak)
    strategy = CPUSwapStrategy(
        policy="auto", budget_bytes=budget, min_offload_bytes=0, prefetch_segments=prefetch, inflight_segments=inflight,
    )
    module, trainer = fit("gpt", strategy, batch_size=16, steps=3)
    plan = trainer.strategy.plan
    peaks = [s.peak_device_bytes for s in trainer.strategy.stats_history]
    assert plan.predicted_peak_bytes <= budget and set(plan.actions.values()) != {Action.KEEP}
    assert max(peaks[1:]) <= budget, (peaks, budget, plan.summary())
    assert abs(plan.predicted_peak_bytes - peaks[-1]) <= 0.05 * peaks[-1], (plan.predicted_peak_bytes, peaks)
    assert_same_state(module, plain)
