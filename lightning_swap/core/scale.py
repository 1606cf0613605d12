"""The auto-scaler: the largest (or fastest) batch size for which a plan fits the budget.

Lightning's ``BatchSizeFinder`` searches blind: it doubles the batch until a step crashes,
then bisects (about 2·log2(N) trial runs, several of them out-of-memory crashes), and
Accelerate's ``find_executable_batch_size`` shrinks by 10% per crash. Neither knows that
offload and recomputation change what fits. Here the profile predicts the peak of every plan
at every batch size (Note [Batch scaling] in ``profiler.py``), so the search is a bisection
over *predictions* — no model runs — and real steps only confirm the answer:

- ``mode="max"``: the largest batch with a feasible plan under ``budget·(1-margin)``;
- ``mode="throughput"``: the batch whose plan has the best predicted samples/s; the best
  ``candidates`` predictions are timed and the fastest measured wins.

Note [Recovering from a failed trial]: a trial fails when it raises an out-of-memory error
(``torch.OutOfMemoryError`` by type first, the message second) or when its measured peak
exceeds the budget (how a simulated budget "runs out" on CPU). The failed batch becomes an
upper bound. If the trial measured a peak, the effective budget shrinks by the ratio of
measured to predicted peak (the model under-predicted by that much) and the search re-plans;
the first trial that fits ends it. An out-of-memory error measures nothing, so from then on
the search bisects between the largest batch that fit and the smallest that failed, each
probe the largest feasible batch below the midpoint, until they meet or ``max_trials`` runs
out. The caller restores model and optimizer state after every trial.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from .actions import Action
from .errors import InfeasibleBudgetError, is_out_of_memory  # re-exported: its old home
from .plan import Plan, format_bytes
from .profiler import ModelProfile, StepFn
from .runtime import StepStats
from .solver import solve
from .units import ByteSize, parse_bytes

if TYPE_CHECKING:  # a type is all that is needed here; the session never imports this module
    from .session import SwapSession

__all__ = [
    "BatchSearchError",
    "Collectives",
    "ScaleConfig",
    "ScaleResult",
    "Trial",
    "TrialMeasurement",
    "is_out_of_memory",
    "predict_batch_size",
    "search_batch_size",
    "search_for_loop",
]

log = logging.getLogger(__name__)

_MODES = ("max", "throughput")


class BatchSearchError(RuntimeError):
    """The search found no batch size that fits; ``trials`` says what was tried."""

    def __init__(self, message: str, *, trials: tuple["Trial", ...] = ()) -> None:
        super().__init__(message)
        self.trials = trials


@dataclass(frozen=True, kw_only=True)
class ScaleConfig:
    """Options of the batch-size search."""

    mode: str = "max"
    #: Fraction of the budget held back for what the model does not predict.
    margin: float = 0.05
    min_batch_size: int = 1
    max_batch_size: int = 8192
    #: Real steps per trial run (the first includes warm-up; the peak is the max over them).
    steps_per_trial: int = 2
    #: Trial runs before giving up.
    max_trials: int = 6
    #: In ``mode="throughput"``, how many of the best predicted candidates are timed.
    candidates: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.mode, str):  # names are case-insensitive, as policies are
            object.__setattr__(self, "mode", self.mode.strip().lower())
        if self.mode not in _MODES:
            raise ValueError(f"`mode` must be one of {list(_MODES)}; got {self.mode!r}.")
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not 0 <= self.margin < 1:
            raise ValueError(f"`margin` must be a number in [0, 1); got {self.margin!r}.")
        for name in ("min_batch_size", "max_batch_size", "steps_per_trial", "max_trials", "candidates"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1; got {value!r}.")
        if self.min_batch_size > self.max_batch_size:
            raise ValueError(
                f"`min_batch_size` ({self.min_batch_size}) must not exceed `max_batch_size` ({self.max_batch_size})."
            )


@dataclass(frozen=True)
class TrialMeasurement:
    """What a trial run measured: the peak over its steps and the mean step time (warm)."""

    peak_bytes: int
    step_ms: float


@dataclass(frozen=True)
class Trial:
    batch_size: int
    plan: Plan
    measured_peak_bytes: Optional[int]
    measured_step_ms: Optional[float]
    failed: bool
    reason: str = ""

    @property
    def samples_per_s(self) -> Optional[float]:
        if self.failed or not self.measured_step_ms:
            return None
        return self.batch_size / self.measured_step_ms * 1e3


@dataclass(frozen=True)
class ScaleResult:
    batch_size: int
    plan: Plan
    mode: str
    budget_bytes: int
    trials: tuple[Trial, ...]
    search_s: float

    @property
    def failed_trials(self) -> int:
        return sum(t.failed for t in self.trials)

    def render(self) -> str:
        """The candidates tried: batch, plan summary, predicted/measured peak and step, samples/s."""
        header = ("batch", "plan", "pred peak", "meas peak", "pred ms", "meas ms", "samples/s", "result")
        rows = []
        for t in self.trials:
            rows.append(
                (
                    str(t.batch_size),
                    t.plan.summary() or "-",
                    format_bytes(t.plan.predicted_peak_bytes),
                    format_bytes(t.measured_peak_bytes),
                    f"{t.plan.predicted_step_ms:.1f}" if t.plan.predicted_step_ms is not None else "-",
                    f"{t.measured_step_ms:.1f}" if t.measured_step_ms is not None else "-",
                    f"{t.samples_per_s:.1f}" if t.samples_per_s is not None else "-",
                    t.reason if t.failed else ("chosen" if t.batch_size == self.batch_size and t.plan == self.plan else "ok"),
                )
            )
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
        lines.append(
            f"mode={self.mode}, budget {format_bytes(self.budget_bytes)}: batch {self.batch_size} "
            f"after {len(self.trials)} trial run(s), {self.failed_trials} failed, {self.search_s:.1f} s"
        )
        return "\n".join(lines)


RunTrial = Callable[[int, Plan], TrialMeasurement]


def _planner(profile: ModelProfile, actions: Optional[tuple[Action, ...]]) -> Callable[[int, int], Optional[Plan]]:
    def plan_at(batch_size: int, budget_bytes: int) -> Optional[Plan]:
        try:
            return solve(profile, budget_bytes=budget_bytes, batch_size=batch_size, actions=actions)
        except InfeasibleBudgetError:
            return None

    return plan_at


def _largest_feasible(plan_at: Callable[[int, int], Optional[Plan]], budget_bytes: int, lo: int, hi: int) -> Optional[int]:
    """Largest batch in [lo, hi] with a feasible plan (feasibility falls with the batch)."""
    if lo > hi or plan_at(lo, budget_bytes) is None:
        return None
    good, step = lo, 1
    bad = None
    while True:  # gallop up
        probe = min(good + step, hi)
        if probe == good:
            return good
        if plan_at(probe, budget_bytes) is not None:
            good, step = probe, step * 2
            if good == hi:
                return good
        else:
            bad = probe
            break
    while bad - good > 1:  # bisect
        mid = (good + bad) // 2
        if plan_at(mid, budget_bytes) is not None:
            good = mid
        else:
            bad = mid
    return good


def _attempt(run_trial: RunTrial, batch: int, plan: Plan, budget_bytes: int) -> Trial:
    try:
        m = run_trial(batch, plan)
    except Exception as exc:  # noqa: BLE001 - only out-of-memory is recoverable
        if not is_out_of_memory(exc):
            raise
        return Trial(batch, plan, None, None, True, "out of memory")
    if m.peak_bytes > budget_bytes:
        return Trial(batch, plan, m.peak_bytes, m.step_ms, True, "over budget")
    return Trial(batch, plan, m.peak_bytes, m.step_ms, False)


def _shrink(effective: int, trial: Trial) -> int:
    """Note [Recovering from a failed trial]: the model under-predicted by measured/predicted."""
    predicted = trial.plan.predicted_peak_bytes or effective
    ratio = max(trial.measured_peak_bytes / predicted, 1.0)
    return int(effective / ratio * 0.98)


def search_batch_size(
    profile: ModelProfile,
    budget_bytes: ByteSize,
    run_trial: RunTrial,
    config: ScaleConfig = ScaleConfig(),
    *,
    actions: Optional[tuple[Action, ...]] = None,
) -> ScaleResult:
    """Search the batch size (see the module docstring).

    ``profile`` must be scalable (profiled with ``scale=True``); ``run_trial(batch, plan)``
    applies the plan, runs ``config.steps_per_trial`` real steps at that batch, and returns a
    :class:`TrialMeasurement` (or raises out-of-memory); the caller restores model and
    optimizer state. ``actions`` restricts the planner (a forced single-action policy).
    """
    budget_bytes = parse_bytes(budget_bytes, field="budget_bytes")
    start = time.perf_counter()
    effective = int(budget_bytes * (1 - config.margin))
    trials: list[Trial] = []
    hi = config.max_batch_size
    plan_at = _planner(profile, actions)
    if config.mode == "max":
        best: Optional[Trial] = None
        bisecting = False  # an out-of-memory error without a measured peak: bisect like Lightning
        while len(trials) < config.max_trials:
            lo = best.batch_size + 1 if best is not None else config.min_batch_size
            cap = hi
            if bisecting:
                cap = min(hi, (lo - 1 + hi + 1) // 2) if best is not None else min(hi, max(lo, (lo + hi) // 2))
            batch = _largest_feasible(plan_at, effective, lo, cap)
            if batch is None:
                break
            plan = plan_at(batch, effective)
            assert plan is not None
            trial = _attempt(run_trial, batch, plan, budget_bytes)
            trials.append(trial)
            log.info("batch-size trial %d: %s", batch, trial.reason or "fits")
            if not trial.failed:
                best = trial
                if not bisecting:  # the prediction is confirmed: done
                    break
                continue
            hi = batch - 1
            if trial.measured_peak_bytes is None:
                bisecting = True
            else:
                effective = _shrink(effective, trial)
        if best is not None:
            return ScaleResult(best.batch_size, best.plan, config.mode, budget_bytes, tuple(trials), time.perf_counter() - start)
    else:
        top = _largest_feasible(plan_at, effective, config.min_batch_size, hi)
        if top is not None:
            sizes = {top, config.min_batch_size}
            b = config.min_batch_size
            while b < top:
                sizes.add(b)
                b *= 2
            scored = []
            for b in sorted(sizes):
                plan = plan_at(b, effective)
                if plan is not None and plan.predicted_step_ms:
                    scored.append((b / plan.predicted_step_ms, b, plan))
            scored.sort(key=lambda s: (-s[0], -s[1]))
            for _, b, plan in scored[: min(config.candidates, config.max_trials)]:
                trial = _attempt(run_trial, b, plan, budget_bytes)
                trials.append(trial)
            ok = [t for t in trials if not t.failed]
            if ok:
                best = max(ok, key=lambda t: (t.samples_per_s or 0.0, t.batch_size))
                return ScaleResult(best.batch_size, best.plan, config.mode, budget_bytes, tuple(trials), time.perf_counter() - start)
    need = ""
    try:
        solve(profile, budget_bytes=effective, batch_size=config.min_batch_size, actions=actions)
    except InfeasibleBudgetError as err:
        need = f" Batch {config.min_batch_size} needs a budget of at least {format_bytes(err.min_budget_bytes)}."
    raise BatchSearchError(
        f"No batch size in [{config.min_batch_size}, {config.max_batch_size}] trained within "
        f"{format_bytes(budget_bytes)} (margin {config.margin:.0%}) after {len(trials)} trial run(s).{need}",
        trials=tuple(trials),
    )


# -- predictions only --------------------------------------------------------------------------
def predict_batch_size(
    profile: ModelProfile,
    budget_bytes: ByteSize,
    config: ScaleConfig = ScaleConfig(),
    *,
    actions: Optional[tuple[Action, ...]] = None,
) -> Optional[Plan]:
    """The plan at the largest batch in ``[config.min_batch_size, config.max_batch_size]``
    predicted to fit ``budget_bytes·(1-config.margin)`` (its ``batch_size`` is that batch), or
    ``None`` when even the smallest does not fit.

    No model runs: the same bisection over predictions that :func:`search_batch_size` starts
    from, without the confirming trials (``accelerate-swap estimate`` uses it).
    """
    budget_bytes = parse_bytes(budget_bytes, field="budget_bytes")
    effective = int(budget_bytes * (1 - config.margin))
    plan_at = _planner(profile, actions)
    batch = _largest_feasible(plan_at, effective, config.min_batch_size, config.max_batch_size)
    return None if batch is None else plan_at(batch, effective)


# -- around a training loop ----------------------------------------------------------------------
def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True, kw_only=True)
class Collectives:
    """How the processes of a data-parallel job agree; the defaults are one process's identity."""

    #: Whether this process profiles (the others receive its profile).
    is_main: bool = True
    #: The main process's object, on every process.
    broadcast: Callable[[Any], Any] = _same
    #: The largest of every process's number (measured peaks and step times).
    reduce_max: Callable[[float], float] = _same
    #: The smallest of every process's number (the batch size all agree on).
    reduce_min: Callable[[int], int] = _same


#: ``run_steps(batch_size, steps)``: run ``steps`` training steps at ``batch_size`` with the
#: session's installed plan, each inside the session's step window, and return their statistics.
RunSteps = Callable[[int, int], Sequence[StepStats]]


def search_for_loop(
    session: "SwapSession",
    budget_bytes: int,
    run_steps: RunSteps,
    step_fn: StepFn,
    *,
    make_batch: Callable[[int], Any],
    profile_batch_size: int,
    config: ScaleConfig = ScaleConfig(),
    track: Callable[[], Any] = tuple,
    collectives: Collectives = Collectives(),
) -> ScaleResult:
    """The batch-size search around any training loop, the loop being ``run_steps``.

    1. Warm-up (Note [Profile in the steady state]): one step at ``profile_batch_size`` under
       the leanest plan (every segment ``RECOMPUTE_OFFLOAD``), so that gradients and optimizer
       state exist when the step is profiled, as they do in every step but the first.
    2. The main process profiles one plain step, ``step_fn(session.model, make_batch(n))``
       with ``track()`` (optimizer state) alive, at ``n = profile_batch_size`` and again near
       the largest batch that profile predicts (Note [Profile near the answer]), and
       broadcasts the profile.
    3. :func:`search_batch_size`, each trial applying its plan pinned and running
       ``config.steps_per_trial`` steps; peaks and step times are reduced by max over the
       processes, so all see the same measurement and take the same path.
    4. Every process agrees on the smallest answer.

    Note [Profile near the answer]: a profile's bytes are lines in the batch size fitted
    through two batches, and a window's peak is a max of terms that grow at different rates:
    at a small batch the weights decide it, at a large one the activations. A line fitted at
    batch 8 can predict a peak at batch 600 several times too small. So when the first
    profile's answer is more than twice its batch, the step is profiled again at that answer
    (a plain step that does not fit is profiled in fake mode: memory exact, times estimated).

    Note [Profile in the steady state]: the first step of a loop runs without gradients and
    optimizer state; every later one has them alive during the forward. A profile of the first
    step under-predicts every later one, so the search warms up first. It changes the model
    and the optimizer: the caller saves their state before and restores it afterwards, and
    calls ``session.reset()`` so the next training step plans for the batch found.
    """
    actions = session.allowed_actions()  # a per-segment policy cannot be searched: fail early
    session.apply(Plan(actions={name: Action.RECOMPUTE_OFFLOAD for name in session.segments}), pinned=True)
    try:
        run_steps(profile_batch_size, 1)
    finally:
        session.remove()
    # Every process makes the batches (a loader may synchronise the processes); the main
    # process alone profiles.
    batch = make_batch(profile_batch_size)
    prof = session.measure(batch, step_fn, track()) if collectives.is_main else None
    top = predict_batch_size(prof, budget_bytes, config, actions=actions) if collectives.is_main else None
    top_size = collectives.broadcast(top.batch_size if top is not None else 0)
    if top_size > 2 * profile_batch_size:  # Note [Profile near the answer]
        log.info("re-profiling at batch %d, near the predicted answer", top_size)
        batch = make_batch(top_size)
        prof = session.measure(batch, step_fn, track()) if collectives.is_main else None
    prof = collectives.broadcast(prof)

    def run_trial(batch_size: int, plan: Plan) -> TrialMeasurement:
        session.apply(plan, pinned=True)
        mark = session.records.count
        try:
            returned = list(run_steps(batch_size, config.steps_per_trial))
        finally:
            session.remove()
        # The trial is over: its device times may be waited for (Note [Stream protocol]).
        stats = session.records.since(mark, wait=True) or returned
        if not stats:
            raise RuntimeError("the trial run made no measured training step; `run_steps` returned no statistics.")
        warm = stats[1:] or stats  # the first step includes warm-up costs
        peaks = [s.peak_device_bytes for s in stats if s.peak_device_bytes is not None]
        if not peaks:  # a pinned plan's steps are measured (SwapSession.begin_step): a caller's bug
            raise RuntimeError("the trial's steps were not measured (peak_device_bytes is None); open them with measure=True.")
        peak = collectives.reduce_max(float(max(peaks)))
        step_ms = collectives.reduce_max(sum(s.step_ms for s in warm) / len(warm))
        return TrialMeasurement(peak_bytes=int(peak), step_ms=float(step_ms))

    result = search_batch_size(prof, budget_bytes, run_trial, config, actions=actions)
    agreed = int(collectives.reduce_min(result.batch_size))
    if agreed != result.batch_size:  # another process found less: its batch wins
        result = dataclasses.replace(result, batch_size=agreed)
    return result
