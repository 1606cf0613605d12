"""The auto-scaler: predictions first, a few confirming trials, recovery from out-of-memory."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch._subclasses.fake_tensor import FakeTensor

from lightning_swap import Action, CPUSwapStrategy, SwapBatchSizeFinder, SwapRuntime
from lightning_swap.core import profile
from lightning_swap.core.decide.costmodel import simulate
from lightning_swap.core.scale.batch_search import ScaleConfig, TrialMeasurement, search_batch_size

from ..helpers import QUIET_TRAINER
from ..lit import LitModel
from ..models import MODELS


class Loop:
    """A plain PyTorch loop (zero_grad, forward, backward, step) around a test model."""

    def __init__(self, name: str) -> None:
        build, self.data, self.loss_fn = MODELS[name]
        torch.manual_seed(0)
        self.model = build()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.trials = 0
        self.step(4)  # steady state: optimizer state exists

    def step(self, batch: int, runtime: SwapRuntime | None = None):
        x, y = self.data(batch)
        self.opt.zero_grad(set_to_none=True)
        if runtime is not None:
            runtime.begin_step([x, y, self.opt.state])
        self.loss_fn(self.model(x), y).backward()
        stats = runtime.end_step() if runtime is not None else None
        self.opt.step()
        return stats

    def peak(self, batch: int, actions) -> int:
        with SwapRuntime(self.model, actions, min_offload_bytes=0, device="cpu") as runtime:
            return max(self.step(batch, runtime).peak_device_bytes for _ in range(2))

    def profile(self, batch: int):
        self.opt.zero_grad(set_to_none=True)
        return profile(self.model, self.data(batch), step_fn=lambda m, b: self.loss_fn(m(b[0]), b[1]), track=[self.opt.state], min_offload_bytes=0, device="cpu")

    def run_trial(self, batch: int, plan) -> TrialMeasurement:
        self.trials += 1
        saved = copy.deepcopy((self.model.state_dict(), self.opt.state_dict()))
        try:
            with SwapRuntime(self.model, plan, min_offload_bytes=0, device="cpu") as runtime:
                stats = [self.step(batch, runtime) for _ in range(2)]
        finally:
            self.model.load_state_dict(saved[0])
            self.opt.load_state_dict(saved[1])
        return TrialMeasurement(max(s.peak_device_bytes for s in stats), stats[-1].step_ms)


# Batch sizes where activations, not weights, dominate the plain peak.
_BATCH = {"mlp": 256, "gpt": 16}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_max_mode_finds_at_least_twice_the_plain_batch(name):
    loop = Loop(name)
    batch = _BATCH[name]
    keep = {n: Action.KEEP for n in loop.profile(batch).names}
    budget = loop.peak(batch, keep)  # the plain peak at batch 16 is the whole (simulated) device
    result = search_batch_size(loop.profile(batch), budget, loop.run_trial, ScaleConfig(mode="max", max_batch_size=4096))
    # Trial runs made: one per confirmed candidate; with no out-of-memory, at most 3.
    assert result.failed_trials == 0
    assert loop.trials == len(result.trials) <= 3
    assert result.batch_size >= 2 * batch
    assert loop.peak(result.batch_size, result.plan.actions) <= budget
    assert "chosen" in result.render()


def test_throughput_mode_times_the_best_predictions():
    loop = Loop("mlp")
    keep = {n: Action.KEEP for n in loop.profile(64).names}
    budget = loop.peak(64, keep)
    result = search_batch_size(loop.profile(64), budget, loop.run_trial, ScaleConfig(mode="throughput", max_batch_size=1024, candidates=3))
    assert 1 <= len(result.trials) <= 3 == loop.trials or len(result.trials) == loop.trials
    best = max((t for t in result.trials if not t.failed), key=lambda t: t.samples_per_s)
    assert result.batch_size == best.batch_size
    assert result.plain_trial is None and "plain not measured: the search was not told the base batch" in result.render()


# -- mode="throughput" against plain: Note [A throughput search that can only win] -------------
_BASE = 64


def _is_plain(batch, plan):
    return batch == _BASE and set(plan.actions.values()) == {Action.KEEP}


class FakeTrials:
    """A ``run_trial`` that runs nothing: the peak is the plan's prediction (or ``over`` bytes
    for the calls listed in ``over_budget``), the step time gives ``rate(call, batch, plan)``
    samples/s. ``calls`` records (batch, plan) in order."""

    def __init__(self, rate, *, over_budget=(), over=0, oom=()):
        self.rate, self.over_budget, self.over, self.oom = rate, set(over_budget), over, set(oom)
        self.calls = []

    def __call__(self, batch, plan):
        call = len(self.calls)
        self.calls.append((batch, plan))
        if call in self.oom:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        peak = self.over if call in self.over_budget else plan.predicted_peak_bytes
        return TrialMeasurement(peak_bytes=peak, step_ms=batch / self.rate(call, batch, plan) * 1e3)


@pytest.fixture(scope="module")
def mlp_profile():
    """The MLP profiled at the base batch, and a budget 1.5x plain's predicted peak there."""
    prof = Loop("mlp").profile(_BASE)
    plain_peak = simulate(prof, {n: Action.KEEP for n in prof.names}).peak_bytes
    return prof, int(plain_peak * 1.5)


def _throughput(prof, budget, run_trial, **kwargs):
    config = ScaleConfig(mode="throughput", max_batch_size=1024, candidates=3)
    return search_batch_size(prof, budget, run_trial, config, base_batch_size=_BASE, **kwargs)


def test_throughput_returns_plain_when_every_candidate_measures_slower(mlp_profile):
    prof, budget = mlp_profile
    trials = FakeTrials(lambda call, batch, plan: 100.0 if _is_plain(batch, plan) else 90.0)
    result = _throughput(prof, budget, trials)
    assert _is_plain(*trials.calls[0])  # plain runs first
    assert len(trials.calls) == 4 and not any(_is_plain(*c) for c in trials.calls[1:])  # plus 3 candidates, none plain again
    assert all(batch > _BASE for batch, _ in trials.calls[1:])  # above the base batch first (three fit here)
    assert result.batch_size == _BASE and set(result.plan.actions.values()) == {Action.KEEP}
    assert result.chosen_trial is result.plain_trial and result.speedup == pytest.approx(1.0)
    text = result.render()
    assert "plain at batch 64: 100.0 samples/s measured; no candidate beat it" in text
    assert "0.90x" in text and "plain training at batch 64 is returned" in text


def test_throughput_prefers_plain_on_a_tie(mlp_profile):
    prof, budget = mlp_profile
    result = _throughput(prof, budget, FakeTrials(lambda call, batch, plan: 100.0))
    assert result.chosen_trial.plain and result.batch_size == _BASE


def test_throughput_returns_a_faster_candidate_and_the_ratio(mlp_profile):
    prof, budget = mlp_profile
    trials = FakeTrials(
        lambda call, batch, plan: 150.0 if call >= 2 and (batch, plan) == trials.calls[2] else 100.0 if _is_plain(batch, plan) else 80.0,
    )
    result = _throughput(prof, budget, trials)
    batch, plan = trials.calls[2]
    assert (result.batch_size, result.plan) == (batch, plan)
    assert trials.calls[4:] == [trials.calls[0], trials.calls[2]]  # plain, then the winner, timed again
    assert result.chosen_trial is result.trials[-1] and result.plain_trial is result.trials[-2]
    assert result.chosen_trial.samples_per_s == pytest.approx(150.0)
    assert result.plain_trial.samples_per_s == pytest.approx(100.0) and result.speedup == pytest.approx(1.5)
    line = result.render().splitlines()[-1]
    assert line == f"plain at batch 64: 100.0 samples/s measured; chosen batch {batch} (plan {plan.summary()}): 150.0 samples/s, 1.50x"


def test_throughput_never_returns_a_measurement_over_the_budget(mlp_profile):
    prof, budget = mlp_profile
    # The fastest candidate measures over the budget; so does, in the second search, plain.
    trials = FakeTrials(lambda call, batch, plan: 500.0 if call == 1 else 120.0 if call >= 2 and (batch, plan) == trials.calls[2] else 100.0,
                        over_budget={1}, over=budget + 1)
    result = _throughput(prof, budget, trials)
    assert result.trials[1].failed and result.trials[1].reason == "over budget"
    assert (result.batch_size, result.plan) == trials.calls[2] and result.speedup == pytest.approx(1.2)

    trials = FakeTrials(lambda call, batch, plan: 1000.0 if call == 0 else 100.0 + call, over_budget={0}, over=budget + 1)
    result = _throughput(prof, budget, trials)
    assert result.plain_trial.failed and not result.chosen_trial.plain and result.speedup is None
    assert (result.batch_size, result.plan) == trials.calls[3]  # the fastest of those that fit
    assert "plain at batch 64 does not fit the budget (measured peak" in result.render()

    trials = FakeTrials(lambda call, batch, plan: 100.0, oom={0})
    result = _throughput(prof, budget, trials)
    assert "plain at batch 64 does not fit the budget (out of memory)" in result.render()


def test_a_candidate_faster_only_when_first_timed_is_not_returned(mlp_profile):
    """Note [Confirm the winner in the same window]: the candidate that measured fastest is timed
    again right after plain; slower than plain there, plain is returned, and the line says why."""
    prof, budget = mlp_profile
    trials = FakeTrials(lambda call, batch, plan: 150.0 if call == 2 else 100.0 if _is_plain(batch, plan) else 90.0)
    result = _throughput(prof, budget, trials)
    assert trials.calls[4:] == [trials.calls[0], trials.calls[2]]
    assert result.chosen_trial.plain and result.batch_size == _BASE and result.speedup == pytest.approx(1.0)
    assert [t.again for t in result.trials] == [False] * 4 + [True] * 2
    line = result.render().splitlines()[-1]
    assert "timed again right after plain, ran" in line and "0.90x" in line and "plain training at batch 64 is returned" in line
    assert result.render().splitlines()[-4].rstrip().endswith("chosen (again)")


def test_throughput_says_why_plain_is_not_the_reference(mlp_profile):
    prof, budget = mlp_profile
    rate = lambda call, batch, plan: 100.0  # noqa: E731
    forced = _throughput(prof, budget, FakeTrials(rate), actions=(Action.RECOMPUTE,))
    assert forced.plain_trial is None
    assert "plain not measured: the policy allows only recompute" in forced.render()
    keep = {n: Action.KEEP for n in prof.names}
    tight = simulate(prof, keep).peak_bytes - 1  # plain predicted one byte over: not run
    trials = FakeTrials(rate)
    result = _throughput(prof, tight, trials)
    assert result.plain_trial is None and not any(_is_plain(*c) for c in trials.calls)
    assert "plain not measured: plain at batch 64 is predicted to need" in result.render()
    only = search_batch_size(prof, budget, FakeTrials(rate), ScaleConfig(mode="throughput", max_trials=1), base_batch_size=_BASE)
    assert len(only.trials) == 1 and only.chosen_trial.plain
    assert "no other candidate was timed" in only.render()
    with pytest.raises(ValueError, match="`base_batch_size`"):
        search_batch_size(prof, budget, FakeTrials(rate), ScaleConfig(mode="throughput", max_batch_size=32), base_batch_size=_BASE)


def test_throughput_search_warms_up_until_the_step_time_is_steady():
    """Note [Steady before timing]: ``mode="throughput"`` runs steps (``window`` at a time) until
    their times settle before it profiles or times a trial; every process runs as many (the
    steadiness is agreed by ``reduce_min``); the cap ends a series that never settles."""
    from types import SimpleNamespace as StepStats  # a step's statistics: the warm-up reads its step_ms

    from lightning_swap.core.scale import loop_search
    from lightning_swap.core.scale.collectives import Collectives
    from lightning_swap.core.scale.warmup import SteadyRule

    falling = iter([616, 595, 583, 577, 562, 551, 532, 504, 448, 367, 288, 214, 156, 127, 115, 109, 114, 95, 94, 104, 99, 101, 97, 103,
                    98, 102, 100, 96, 101, 99, 104, 100])
    calls = []

    def run_steps(batch_size, steps):
        calls.append((batch_size, steps))
        return [StepStats(step_ms=float(next(falling))) for _ in range(steps)]

    rule = SteadyRule(window=4, tolerance=0.05, max_steps=40)
    assert loop_search._warm_up(run_steps, 8, rule, Collectives()) == 28  # steady once 27 ran: checked per chunk of 4
    assert calls == [(8, 4)] * 7
    other_not_yet = Collectives(reduce_min=lambda value: 0)  # another process is not steady: go on, to the cap
    calls.clear()
    flat = lambda b, n: calls.append(n) or [StepStats(step_ms=1.0)] * n  # noqa: E731
    assert loop_search._warm_up(flat, 8, SteadyRule(max_steps=10), other_not_yet) == 10
    assert calls == [4, 4, 2]
    assert loop_search.THROUGHPUT_WARMUP == SteadyRule()


@pytest.mark.slow
def test_failed_trials_lower_the_estimate():
    loop = Loop("mlp")
    prof = loop.profile(16)
    limit = 40
    real = loop.run_trial

    def run_trial(batch, plan):
        if batch > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(batch, plan)

    result = search_batch_size(prof, 1 << 40, run_trial, ScaleConfig(mode="max", max_batch_size=1024, max_trials=12))
    assert result.batch_size <= limit
    assert result.failed_trials >= 1
    assert all(t.reason == "out of memory" for t in result.trials if t.failed)


def test_other_errors_are_not_swallowed():
    loop = Loop("mlp")

    def run_trial(batch, plan):
        raise ValueError("a bug in the user's code")

    with pytest.raises(ValueError, match="a bug"):
        search_batch_size(loop.profile(8), 1 << 40, run_trial, ScaleConfig(max_batch_size=64))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mode": "power"}, "mode"),
        ({"margin": 1.0}, "margin"),
        ({"margin": -0.1}, "margin"),
        ({"min_batch_size": 64, "max_batch_size": 32}, "min_batch_size"),
        ({"steps_per_trial": 0}, "steps_per_trial"),
    ],
)
def test_bad_options_name_the_argument(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        ScaleConfig(**kwargs)
    with pytest.raises(ValueError, match=f"`{field}`"):
        SwapBatchSizeFinder(**kwargs)


# -- Lightning ---------------------------------------------------------------------------------


def _trainer(strategy, finder, **kwargs):
    options = dict(
        accelerator="cpu",
        strategy=strategy,
        max_steps=2,
        callbacks=[finder],
        **QUIET_TRAINER,
    )
    options.update(kwargs)
    return L.Trainer(**options)


def _plain_peak(name, batch_size):
    L.seed_everything(0, verbose=False)
    module = LitModel(name, batch_size=batch_size, samples=4 * batch_size)
    trainer = _trainer(CPUSwapStrategy(policy="keep", min_offload_bytes=0), L.Callback(), max_steps=3)
    trainer.fit(module)
    return trainer.strategy.step_stats.peak_device_bytes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_finder_callback_doubles_the_batch_within_the_budget(name, tmp_path):
    batch = _BATCH[name]
    budget = _plain_peak(name, batch)
    L.seed_everything(0, verbose=False)
    module = LitModel(name, batch_size=batch, samples=4096)
    finder = SwapBatchSizeFinder(mode="max", max_batch_size=1024)
    trainer = _trainer(CPUSwapStrategy(budget_bytes=budget, min_offload_bytes=0), finder, default_root_dir=tmp_path)
    trainer.fit(module)
    assert finder.optimal_batch_size == module.batch_size >= 2 * batch
    assert finder.result.failed_trials == 0 and len(finder.result.trials) <= 3
    assert trainer.strategy.step_stats.peak_device_bytes <= budget  # training at the found batch fits
    assert not list(tmp_path.glob(".scale_batch_size_*.ckpt"))


@pytest.mark.slow
def test_finder_throughput_is_at_least_plain_at_the_base_batch(tmp_path):
    batch = _BATCH["mlp"]
    budget = int(1.5 * _plain_peak("mlp", batch))
    L.seed_everything(0, verbose=False)
    module = LitModel("mlp", batch_size=batch, samples=4096)
    finder = SwapBatchSizeFinder(mode="throughput", max_batch_size=1024, steps_per_trial=3)
    trainer = _trainer(CPUSwapStrategy(budget_bytes=budget, min_offload_bytes=0), finder, default_root_dir=tmp_path)
    trainer.fit(module)
    result = finder.result
    plain, chosen = result.plain_trial, result.chosen_trial
    assert result.base_batch_size == batch  # the model's batch_size attribute
    assert plain is not None and not plain.failed and plain.batch_size == batch
    assert set(plain.plan.actions.values()) == {Action.KEEP}
    assert chosen is not None and not chosen.failed and chosen.measured_peak_bytes <= budget
    assert chosen.samples_per_s >= plain.samples_per_s and result.speedup >= 1.0  # measured in this run
    assert f"plain at batch {batch}: {plain.samples_per_s:.1f} samples/s measured" in result.render()
    assert finder.optimal_batch_size == module.batch_size == result.batch_size
    assert trainer.strategy.step_stats.peak_device_bytes <= budget


class OOMAbove(LitModel):
    """Raises CUDA's out-of-memory error for real batches larger than ``limit`` (fake tensors,
    which the profiler uses to predict larger batches, allocate nothing)."""

    limit = 24

    def training_step(self, batch, batch_idx):
        if batch[0].shape[0] > self.limit and not isinstance(batch[0], FakeTensor):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate (injected)")
        return super().training_step(batch, batch_idx)


class RecordingFinder(SwapBatchSizeFinder):
    def scale_batch_size(self, trainer, pl_module):
        self.before = (copy.deepcopy(pl_module.state_dict()), copy.deepcopy(trainer.optimizers[0].state_dict()))
        super().scale_batch_size(trainer, pl_module)
        self.after = (copy.deepcopy(pl_module.state_dict()), copy.deepcopy(trainer.optimizers[0].state_dict()))


@pytest.mark.slow
def test_injected_out_of_memory_converges_below_and_restores_state(tmp_path):
    L.seed_everything(0, verbose=False)
    module = OOMAbove("cnn", batch_size=4, samples=512)
    finder = RecordingFinder(mode="max", max_batch_size=256, max_trials=10)
    trainer = _trainer(CPUSwapStrategy(budget_bytes=1 << 40, min_offload_bytes=0), finder, default_root_dir=tmp_path)
    trainer.fit(module)
    assert finder.optimal_batch_size <= OOMAbove.limit
    assert finder.result.failed_trials >= 1
    weights_before, opt_before = finder.before
    weights_after, opt_after = finder.after
    assert all(torch.equal(weights_before[k], weights_after[k]) for k in weights_before)
    assert opt_before["param_groups"] == opt_after["param_groups"]
    assert opt_before["state"].keys() == opt_after["state"].keys()
    for k, state in opt_before["state"].items():
        assert all(torch.equal(v, opt_after["state"][k][n]) for n, v in state.items())


def test_finder_explains_which_strategies_it_needs():
    module = LitModel("mlp", batch_size=8)
    trainer = _trainer("auto", SwapBatchSizeFinder(budget_bytes=1 << 30))
    with pytest.raises(MisconfigurationException, match="cpu_swap"):
        trainer.fit(module)


def test_a_trial_meters_its_first_step_and_only_times_the_rest():
    """Note [The CPU meter's cost]: on CPU the meter costs a fixed time per op, so a throughput
    comparison between batch sizes read from metered steps leans to the larger batch. A pinned
    plan's first step (a trial's) measures the peak; its later steps run unmetered, and the
    trial's time is theirs. Counted here by the meter's dispatch calls, not by timing."""
    from lightning_swap.core import Plan, SwapConfig, SwapSession
    from lightning_swap.core.engine.meter import DeviceMemoryMeter

    torch.manual_seed(0)
    build, make_batch, _ = MODELS["mlp"]
    model = build()
    session = SwapSession(model, SwapConfig(policy="keep", min_offload_bytes=0, log_plan=False), "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, _ = make_batch(4)
    entered = []
    enter = DeviceMemoryMeter.__enter__
    original = enter

    def counting(self):
        entered.append(True)
        return original(self)

    DeviceMemoryMeter.__enter__ = counting
    try:
        session.apply(Plan(actions={s: Action.KEEP for s in session.segments}), pinned=True)
        stats = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            session.open_step(x, [x, opt.state], [opt], measure=True)
            model(x).square().mean().backward()
            stats.append(session.close_step())
            opt.step()
        session.apply(session.plan, pinned=True)  # the next trial: its first step is metered again
        opt.zero_grad(set_to_none=True)
        session.open_step(x, [x, opt.state], [opt])
        model(x).square().mean().backward()
        stats.append(session.close_step())
    finally:
        DeviceMemoryMeter.__enter__ = enter
        session.close()
    assert [s.peak_device_bytes is not None for s in stats] == [True, False, False, True]
    assert len(entered) == 2 and stats[0].peak_device_bytes == stats[3].peak_device_bytes
