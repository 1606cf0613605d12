"""The auto-scaler: the largest (or fastest) batch size for which a plan fits the budget.

Lightning's ``BatchSizeFinder`` searches blind: it doubles the batch until a step crashes,
then bisects (about 2·log2(N) trial runs, several of them out-of-memory crashes), and
Accelerate's ``find_executable_batch_size`` shrinks by 10% per crash. Neither knows that
offload and recomputation change what fits. Here the profile predicts the peak of every plan
at every batch size (Note [Batch scaling] in ``profiler.py``), so the search is a bisection
over *predictions* — no model runs — and real steps only confirm the answer:

- ``mode="max"``: the largest batch with a feasible plan under ``budget·(1-margin)``;
- ``mode="throughput"``: the batch whose plan has the best *measured* samples/s among plain
  training at the base batch and the ``candidates`` best predictions (Note [A throughput
  search that can only win]).

Note [Recovering from a failed trial]: a trial fails when it raises an out-of-memory error
(``torch.OutOfMemoryError`` by type first, the message second) or when its measured peak
exceeds the budget (how a simulated budget "runs out" on CPU). The failed batch becomes an
upper bound. If the trial measured a peak, the effective budget shrinks by the bytes the model
under-predicted (measured less predicted peak: what the model misses is an amount of memory, not
a share of the budget — on CPU, ResNet-50's parameters and state are 97% of a budget whose 2%
shrink left no room for activations: batch 6 after a trial at 35 measured 0.1% over)
and the search re-plans;
the first trial that fits ends it. An out-of-memory error measures nothing, so from then on
the search bisects between the largest batch that fit and the smallest that failed, each
probe the largest feasible batch below the midpoint, until they meet or ``max_trials`` runs
out. The caller restores model and optimizer state after every trial.

Note [A throughput search that can only win]: predictions of step time are off by several
percent (more on a GPU), enough to rank a smaller batch above the user's own: an H100 chose
batch 4 at 46.2 samples/s where plain training at batch 8 fitted and ran 49.5. So the answer is
decided by measurement against the one alternative the user already has. When the search
knows the base batch (the batch the user configured) and the policy may keep every segment,
the first trial is *plain*: the all-``KEEP`` plan at the base batch (the runtime with every
segment kept is plain training), run when its predicted peak fits the budget itself (not the
budget less the margin: the measurement decides, and the session plans at a batch with the
whole budget). Then the best ``candidates`` predictions are timed, those above the base batch
first: the cost model scales a step's time in proportion to the batch, so it ranks the
all-``KEEP`` plan at a smaller batch about level with plain, while a real step has a fixed
part (launches, the optimizer) that a smaller batch pays more often per sample (likely how
the H100 came to time batch 4). The trial with the best measured samples/s that fitted is
returned, plain on a tie; a trial that ran out of memory or measured over the budget never
is. Hence the result's measured samples/s is at least plain's whenever plain fitted;
:meth:`ScaleResult.render` states the comparison, or why there is none (no base batch, a
forced policy, plain predicted or measured over the budget). Noise: every trial runs ``steps_per_trial`` steps, the first discarded as warm-up,
and its time is the *median* of the rest: robust to one slow step (garbage collection, a
neighbour's burst) without crediting a candidate for one lucky step as the minimum would
(an offload plan's copy overlap varies from step to step; its best step is not what training
sustains). With ``steps_per_trial=2`` that is one step; use 4 or more for a steadier answer.
Order: plain runs first, so before any trial the search around a training loop warms up until
the step time is steady (Note [Steady before timing] in ``warmup.py``): in a fresh model's
first steps plain is charged for a transient whose decay the later candidates are credited
with (a GPT measured ~1x at the steady state read as 5x).

Note [Confirm the winner in the same window]: the answer is the best of several noisy
measurements, so its own measurement overstates it (the largest of noisy values is biased up),
and plain, timed first, was timed in another window than the candidates after it (on a shared
CPU a GPT's search read 1.26x plain's samples/s for a plan that ran 0.94x when the two were
timed in turn). So a candidate that measured faster than plain is timed again right
after plain is timed again (two more trial runs, beyond ``max_trials``), and is returned only if
it is faster in that pair too; :attr:`ScaleResult.speedup` is that pair's ratio (the result's
``plain_trial`` and ``chosen_trial`` are the last of each).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from ..actions import Action
from ..config import OptionTable, option
from ..decide.costmodel import simulate
from ..errors import BatchSearchError, InfeasibleBudgetError, is_out_of_memory
from ..decide.plan import Plan
from ..measure.model_profile import ModelProfile
from ..decide.solver import solve
from ..units import ByteSize, format_bytes, parse_bytes

__all__ = [
    "ScaleConfig",
    "ScaleResult",
    "Trial",
    "TrialMeasurement",
    "predict_batch_size",
    "search_batch_size",
]

log = logging.getLogger(__name__)

_MODES = ("max", "throughput")


def _check_mode(value: object, field: str) -> str:
    mode = value.strip().lower() if isinstance(value, str) else value  # case-insensitive, as policies are
    if mode not in _MODES:
        raise ValueError(f"`{field}` must be one of {list(_MODES)}; got {value!r}.")
    return mode


def _check_margin(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"`{field}` must be a number in [0, 1); got {value!r}.")
    return value


def _check_positive(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{field}` must be an int >= 1; got {value!r}.")
    return value


@dataclass(frozen=True, kw_only=True)
class ScaleConfig(OptionTable):
    """Options of the batch-size search; both finders take them as keywords (Note [One option
    table] in ``core/config.py``)."""

    mode: str = option("max", '``"max"`` (the largest batch that fits with a plan) or ``"throughput"`` (the fastest).', check=_check_mode)
    margin: float = option(0.05, "fraction of the budget held back for what the model does not predict, in [0, 1).", check=_check_margin)
    min_batch_size: int = option(1, "the smallest batch searched.", check=_check_positive)
    max_batch_size: int = option(8192, "the largest batch searched.", check=_check_positive)
    steps_per_trial: int = option(
        2, "real steps per trial run (the first includes warm-up; the peak is the max over them).", check=_check_positive,
    )
    max_trials: int = option(6, "trial runs before giving up.", check=_check_positive)
    candidates: int = option(3, 'in ``mode="throughput"``, how many of the best predicted candidates are timed.', check=_check_positive)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_batch_size > self.max_batch_size:
            raise ValueError(
                f"`min_batch_size` ({self.min_batch_size}) must not exceed `max_batch_size` ({self.max_batch_size})."
            )


@dataclass(frozen=True)
class TrialMeasurement:
    """What a trial run measured: the peak over its steps and the step time of its warm steps
    (the median of the steps after the first in :func:`search_for_loop`: Note [A throughput
    search that can only win])."""

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
    #: Whether this is plain training at the base batch, the reference of ``mode="throughput"``.
    plain: bool = False
    #: Timed a second time, right after plain (Note [Confirm the winner in the same window]).
    again: bool = False

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
    #: The batch the user configured (the search's reference), if the search was told it.
    base_batch_size: Optional[int] = None
    #: ``mode="throughput"``: why plain training at the base batch was not run ("" if it was).
    plain_note: str = ""

    @property
    def failed_trials(self) -> int:
        return sum(t.failed for t in self.trials)

    @property
    def plain_trial(self) -> Optional[Trial]:
        """The trial of plain training at the base batch (``mode="throughput"``), if it ran; the last
        one (Note [Confirm the winner in the same window])."""
        return next((t for t in reversed(self.trials) if t.plain), None)

    @property
    def chosen_trial(self) -> Optional[Trial]:
        """The trial whose batch and plan were returned (``None`` if none matches: under DDP
        another process may have agreed on a smaller batch); the last one."""
        return next((t for t in reversed(self.trials) if not t.failed and t.batch_size == self.batch_size and t.plan == self.plan), None)

    @property
    def speedup(self) -> Optional[float]:
        """Measured samples/s of the answer over plain's at the base batch (``None`` unless
        both were measured and plain fitted); >= 1 by Note [A throughput search that can only win]."""
        plain, chosen = self.plain_trial, self.chosen_trial
        if plain is None or chosen is None or plain.samples_per_s is None or chosen.samples_per_s is None:
            return None
        return chosen.samples_per_s / plain.samples_per_s

    def comparison(self) -> str:
        """``mode="throughput"``: one line comparing the answer with plain training at the base
        batch, or saying why there is no comparison ("" in ``mode="max"``)."""
        if self.mode != "throughput":
            return ""
        chosen, plain = self.chosen_trial, self.plain_trial
        if chosen is None:
            answer = f"batch {self.batch_size} ({self.plan.summary() or '-'}): agreed with the other processes, not measured here"
        elif chosen.plain:
            answer = f"batch {chosen.batch_size} (plain)"
        else:
            answer = f"batch {chosen.batch_size} (plan {chosen.plan.summary() or '-'}): {_rate(chosen)} samples/s"
        if plain is None:
            return f"plain not measured: {self.plain_note}; chosen {answer}"
        where = f"plain at batch {plain.batch_size}"
        if plain.failed:
            if plain.measured_peak_bytes is not None:
                why = f"measured peak {format_bytes(plain.measured_peak_bytes)} > budget {format_bytes(self.budget_bytes)}"
            else:
                why = plain.reason
            return f"{where} does not fit the budget ({why}); chosen {answer}"
        measured = f"{where}: {_rate(plain)} samples/s measured"
        if chosen is not None and chosen.plain:
            others = [t for t in self.trials if not t.plain and not t.failed and t.samples_per_s is not None]
            again = [t for t in others if t.again]
            if again:  # Note [Confirm the winner in the same window]
                ratio = f", {again[-1].samples_per_s / plain.samples_per_s:.2f}x" if plain.samples_per_s else ""
                why = (
                    f"the fastest candidate (batch {again[-1].batch_size}, plan {again[-1].plan.summary() or '-'}), timed again "
                    f"right after plain, ran {again[-1].samples_per_s:.1f} samples/s{ratio}"
                )
            elif others:
                best = max(others, key=lambda t: t.samples_per_s)
                ratio = f", {best.samples_per_s / plain.samples_per_s:.2f}x" if plain.samples_per_s else ""
                why = (
                    f"no candidate beat it (best: batch {best.batch_size}, plan {best.plan.summary() or '-'}, "
                    f"{best.samples_per_s:.1f} samples/s{ratio})"
                )
            else:
                why = "no other candidate fitted" if any(not t.plain for t in self.trials) else "no other candidate was timed"
            return f"{measured}; {why}: plain training at batch {plain.batch_size} is returned"
        speedup = f", {self.speedup:.2f}x" if self.speedup is not None else ""
        return f"{measured}; chosen {answer}{speedup}"

    def render(self) -> str:
        """The candidates tried: batch, plan summary, predicted/measured peak and step, samples/s;
        in ``mode="throughput"`` a last line comparing the answer with plain (:meth:`comparison`)."""
        header = ("batch", "plan", "pred peak", "meas peak", "pred ms", "meas ms", "samples/s", "result")
        rows, chosen = [], self.chosen_trial
        for t in self.trials:
            rows.append(
                (
                    str(t.batch_size),
                    f"plain ({t.plan.summary()})" if t.plain else (t.plan.summary() or "-"),
                    format_bytes(t.plan.predicted_peak_bytes),
                    format_bytes(t.measured_peak_bytes),
                    f"{t.plan.predicted_step_ms:.1f}" if t.plan.predicted_step_ms is not None else "-",
                    f"{t.measured_step_ms:.1f}" if t.measured_step_ms is not None else "-",
                    f"{t.samples_per_s:.1f}" if t.samples_per_s is not None else "-",
                    (t.reason if t.failed else "chosen" if t is chosen else "ok") + (" (again)" if t.again else ""),
                )
            )
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
        lines.append(
            f"mode={self.mode}, budget {format_bytes(self.budget_bytes)}: batch {self.batch_size} "
            f"after {len(self.trials)} trial run(s), {self.failed_trials} failed, {self.search_s:.1f} s"
        )
        if self.mode == "throughput":
            lines.append(self.comparison())
        return "\n".join(lines)


def _rate(trial: Trial) -> str:
    return "-" if trial.samples_per_s is None else f"{trial.samples_per_s:.1f}"


RunTrial = Callable[[int, Plan], TrialMeasurement]


def _planner(profile: ModelProfile, actions: Optional[tuple[Action, ...]], window: dict) -> Callable[[int, int], Optional[Plan]]:
    """``window``: the copy windows the plans will run under (Note [Copy windows, priced] in
    decide/costmodel.py)."""

    def plan_at(batch_size: int, budget_bytes: int) -> Optional[Plan]:
        try:
            return solve(profile, budget_bytes=budget_bytes, batch_size=batch_size, actions=actions, **window)
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


def _attempt(run_trial: RunTrial, batch: int, plan: Plan, budget_bytes: int, *, plain: bool = False, again: bool = False) -> Trial:
    try:
        m = run_trial(batch, plan)
    except Exception as exc:  # noqa: BLE001 - only out-of-memory is recoverable
        if not is_out_of_memory(exc):
            raise
        return Trial(batch, plan, None, None, True, "out of memory", plain, again)
    if m.peak_bytes > budget_bytes:
        return Trial(batch, plan, m.peak_bytes, m.step_ms, True, "over budget", plain, again)
    return Trial(batch, plan, m.peak_bytes, m.step_ms, False, "", plain, again)


def _plain_plan(
    profile: ModelProfile, base_batch_size: Optional[int], budget_bytes: int, actions: Optional[tuple[Action, ...]]
) -> tuple[Optional[Plan], str]:
    """Plain training at the base batch as a plan (every segment ``KEEP``), with the cost
    model's prediction, or ``None`` and why it is not a candidate
    (Note [A throughput search that can only win])."""
    if base_batch_size is None:
        return None, "the search was not told the base batch (base_batch_size)"
    if actions is not None and Action.KEEP not in actions:
        allowed = ", ".join(a.value for a in actions)
        return None, f"the policy allows only {allowed}, so plain training is not a plan it may return"
    keep = {name: Action.KEEP for name in profile.names}
    prediction = simulate(profile.at_batch(base_batch_size), keep)
    if prediction.peak_bytes > budget_bytes:
        return None, (
            f"plain at batch {base_batch_size} is predicted to need {format_bytes(prediction.peak_bytes)}, "
            f"over the budget {format_bytes(budget_bytes)}"
        )
    plan = Plan(
        actions=keep,
        predicted_peak_bytes=prediction.peak_bytes,
        predicted_step_ms=prediction.step_ms,
        budget_bytes=budget_bytes,
        batch_size=base_batch_size,
        rows=prediction.rows,
    )
    return plan, ""


def _shrink(effective: int, trial: Trial) -> int:
    """Note [Recovering from a failed trial]: the model under-predicted by measured - predicted."""
    predicted = trial.plan.predicted_peak_bytes or effective
    return effective - max(trial.measured_peak_bytes - predicted, 0) - 1


@dataclass
class _Search:
    """What both search algorithms share: the trial runner, the planner and the trials so far."""

    profile: ModelProfile
    budget_bytes: int
    run_trial: RunTrial
    config: ScaleConfig
    actions: Optional[tuple[Action, ...]]
    base_batch_size: Optional[int]
    plan_at: Callable[[int, int], Optional[Plan]]
    effective: int
    start: float
    trials: list[Trial]

    def result(self, best: Trial, note: str = "") -> ScaleResult:
        return ScaleResult(
            best.batch_size, best.plan, self.config.mode, self.budget_bytes, tuple(self.trials), time.perf_counter() - self.start,
            self.base_batch_size, note,
        )


def _check_base_batch_size(base_batch_size: Optional[int], config: ScaleConfig) -> None:
    if base_batch_size is not None and (
        isinstance(base_batch_size, bool)
        or not isinstance(base_batch_size, int)
        or not config.min_batch_size <= base_batch_size <= config.max_batch_size
    ):
        raise ValueError(
            f"`base_batch_size` must be None or an int in [min_batch_size, max_batch_size] = "
            f"[{config.min_batch_size}, {config.max_batch_size}]; got {base_batch_size!r}."
        )


def search_batch_size(
    profile: ModelProfile,
    budget_bytes: ByteSize,
    run_trial: RunTrial,
    config: ScaleConfig = ScaleConfig(),
    *,
    actions: Optional[tuple[Action, ...]] = None,
    base_batch_size: Optional[int] = None,
    prefetch_bytes: Optional[int | str] = None,
    inflight_bytes: Optional[int | str] = None,
) -> ScaleResult:
    """Search the batch size (see the module docstring).

    ``profile`` must be scalable (profiled with ``scale=True``); ``run_trial(batch, plan)``
    applies the plan, runs ``config.steps_per_trial`` real steps at that batch, and returns a
    :class:`TrialMeasurement` (or raises out-of-memory); the caller restores model and
    optimizer state. ``actions`` restricts the planner (a forced single-action policy);
    ``prefetch_bytes`` / ``inflight_bytes`` (``None`` or ``"auto"``: the planner's choice, recorded
    in each plan) are the copy windows the trials run under (Note [Copy windows, priced] in
    decide/costmodel.py).

    ``base_batch_size``: the batch the user configured, in ``[min_batch_size,
    max_batch_size]``. In ``mode="throughput"`` plain training at it is measured and the answer
    is never slower (Note [A throughput search that can only win]); without it the answer is the
    fastest measured candidate, with no reference. ``mode="max"`` only records it.
    """
    budget_bytes = parse_bytes(budget_bytes, field="budget_bytes")
    _check_base_batch_size(base_batch_size, config)
    window = {"prefetch_bytes": prefetch_bytes, "inflight_bytes": inflight_bytes}
    search = _Search(
        profile=profile, budget_bytes=budget_bytes, run_trial=run_trial, config=config, actions=actions,
        base_batch_size=base_batch_size, plan_at=_planner(profile, actions, window),
        effective=int(budget_bytes * (1 - config.margin)), start=time.perf_counter(), trials=[],
    )
    found = _search_max(search) if config.mode == "max" else _search_throughput(search)
    if found is not None:
        return found
    need = ""
    try:
        solve(profile, budget_bytes=search.effective, batch_size=config.min_batch_size, actions=actions, **window)
    except InfeasibleBudgetError as err:
        need = f" Batch {config.min_batch_size} needs a budget of at least {format_bytes(err.min_budget_bytes)}."
    raise BatchSearchError(
        f"No batch size in [{config.min_batch_size}, {config.max_batch_size}] trained within "
        f"{format_bytes(budget_bytes)} (margin {config.margin:.0%}) after {len(search.trials)} trial run(s).{need}",
        trials=tuple(search.trials),
    )


def _search_max(search: _Search) -> Optional[ScaleResult]:
    """``mode="max"``: the largest batch predicted to fit, confirmed by a trial; a failed trial
    lowers the ceiling and the estimate (Note [Recovering from a failed trial])."""
    config, trials = search.config, search.trials
    hi = config.max_batch_size
    best: Optional[Trial] = None
    bisecting = False  # an out-of-memory error without a measured peak: bisect like Lightning
    while len(trials) < config.max_trials:
        lo = best.batch_size + 1 if best is not None else config.min_batch_size
        cap = hi
        if bisecting:
            cap = min(hi, (lo - 1 + hi + 1) // 2) if best is not None else min(hi, max(lo, (lo + hi) // 2))
        batch = _largest_feasible(search.plan_at, search.effective, lo, cap)
        if batch is None:
            break
        plan = search.plan_at(batch, search.effective)
        assert plan is not None
        trial = _attempt(search.run_trial, batch, plan, search.budget_bytes)
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
            search.effective = _shrink(search.effective, trial)
    return search.result(best) if best is not None else None


def _throughput_candidates(search: _Search, top: int, plain: Optional[Plan]) -> list[tuple[float, int, Plan]]:
    """(predicted samples/s, batch, plan) at powers of two up to ``top``, ``top`` and the base."""
    config, base = search.config, search.base_batch_size
    sizes = {top, config.min_batch_size}
    if base is not None and base <= top:
        sizes.add(base)
    b = config.min_batch_size
    while b < top:
        sizes.add(b)
        b *= 2
    scored = []
    for b in sorted(sizes):
        plan = search.plan_at(b, search.effective)
        if plan is None or not plan.predicted_step_ms:
            continue
        if plain is not None and b == base and plan.actions == plain.actions:
            continue  # plain itself, measured already: a second run would only add noise
        scored.append((b / plan.predicted_step_ms, b, plan))
    # With plain measured, batches above the base are timed first (the Note says why).
    above = plain is not None and base is not None
    scored.sort(key=lambda s: (above and s[1] <= base, -s[0], -s[1]))
    return scored


def _search_throughput(search: _Search) -> Optional[ScaleResult]:
    """``mode="throughput"``: Note [A throughput search that can only win]."""
    config, trials, base = search.config, search.trials, search.base_batch_size
    plain, plain_note = _plain_plan(search.profile, base, search.budget_bytes, search.actions)
    if plain is not None:
        trials.append(_attempt(search.run_trial, base, plain, search.budget_bytes, plain=True))
        log.info("throughput search: plain at batch %d: %s", base, trials[-1].reason or "fits")
    top = _largest_feasible(search.plan_at, search.effective, config.min_batch_size, config.max_batch_size)
    if top is not None:
        scored = _throughput_candidates(search, top, plain)
        for _, b, plan in scored[: max(0, min(config.candidates, config.max_trials - len(trials)))]:
            trials.append(_attempt(search.run_trial, b, plan, search.budget_bytes))
    ok = [t for t in trials if not t.failed]
    if not ok:
        return None
    # The best measured samples/s; plain on a tie, then the larger batch.
    best = max(ok, key=lambda t: (t.samples_per_s or 0.0, t.plain, t.batch_size))
    result = search.result(_confirmed(search, best), plain_note)
    log.info("throughput search: %s", result.comparison())
    return result


def _confirmed(search: _Search, best: Trial) -> Trial:
    """Note [Confirm the winner in the same window]: a candidate that measured faster than plain,
    timed again right after plain is; the faster of that pair (plain on a tie)."""
    plain = next((t for t in search.trials if t.plain and not t.failed), None)
    if plain is None or best.plain:
        return best
    again = [_attempt(search.run_trial, t.batch_size, t.plan, search.budget_bytes, plain=t.plain, again=True) for t in (plain, best)]
    search.trials.extend(again)
    fitting = [t for t in again if not t.failed]
    if not fitting:
        return plain
    return max(fitting, key=lambda t: (t.samples_per_s or 0.0, t.plain))


# -- predictions only --------------------------------------------------------------------------
def predict_batch_size(
    profile: ModelProfile,
    budget_bytes: ByteSize,
    config: ScaleConfig = ScaleConfig(),
    *,
    actions: Optional[tuple[Action, ...]] = None,
    prefetch_bytes: Optional[int | str] = None,
    inflight_bytes: Optional[int | str] = None,
) -> Optional[Plan]:
    """The plan at the largest batch in ``[config.min_batch_size, config.max_batch_size]``
    predicted to fit ``budget_bytes·(1-config.margin)`` (its ``batch_size`` is that batch), or
    ``None`` when even the smallest does not fit.

    No model runs: the same bisection over predictions that :func:`search_batch_size` starts
    from, without the confirming trials (``accelerate-swap estimate`` uses it).
    """
    budget_bytes = parse_bytes(budget_bytes, field="budget_bytes")
    effective = int(budget_bytes * (1 - config.margin))
    plan_at = _planner(profile, actions, {"prefetch_bytes": prefetch_bytes, "inflight_bytes": inflight_bytes})
    batch = _largest_feasible(plan_at, effective, config.min_batch_size, config.max_batch_size)
    return None if batch is None else plan_at(batch, effective)


