"""The batch-size search around a real training loop: warm up, profile near the answer, run
trials through the caller's loop, and agree between processes (:class:`~.collectives.Collectives`).

The search itself (pure, over predictions) is :mod:`.batch_search`.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

from ..decide.costmodel import copy_window_of
from ..decide.plan import Plan
from ..measure.model_profile import max_profile
from ..measure.profiler import StepFn
from ..runtime.stats import StepStats
from .auto import BatchKey
from .batch_search import ScaleConfig, ScaleResult, TrialMeasurement, predict_batch_size, search_batch_size
from .collectives import Collectives
from .warmup import SteadyRule

if TYPE_CHECKING:
    from .session import SwapSession

__all__ = ["RunSteps", "adopt_search_profile", "search_for_loop"]

log = logging.getLogger(__name__)

#: ``mode="throughput"``: how long the search warms up before it profiles and times anything
#: (Note [Steady before timing] in ``warmup.py``).
THROUGHPUT_WARMUP = SteadyRule()


# -- around a training loop ----------------------------------------------------------------------
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
    base_batch_size: Optional[int] = None,
) -> ScaleResult:
    """The batch-size search around any training loop, the loop being ``run_steps``.

    ``base_batch_size`` (default ``profile_batch_size``) is the batch the user configured: in
    ``mode="throughput"`` plain training at it is the reference the answer must match or beat
    (Note [A throughput search that can only win]).

    1. Warm-up (Note [Profile in the steady state]): one step at ``profile_batch_size`` under
       the leanest plan (every segment ``RECOMPUTE_OFFLOAD``), so that gradients and optimizer
       state exist when the step is profiled; in ``mode="throughput"`` until the step time is
       steady (Note [Steady before timing]: the search decides from measured times)
    2. Every process profiles one plain step, ``step_fn(session.model, make_batch(n))``
       with ``track()`` (optimizer state) alive, at ``n = profile_batch_size`` and again near
       the largest batch that profile predicts (Note [Profile near the answer]); the profiles
       are gathered and merged by their largest values.
    3. :func:`search_batch_size`, each trial applying its plan pinned and running
       ``config.steps_per_trial`` steps; a trial's peak is its first step's, its time the median
       of the later, unmetered ones (Note [The CPU meter's cost] in ``runtime.py``); peaks and step
       times are reduced by max over the processes, so all see the same measurement and take
       the same path.
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
    window = copy_window_of(session.config)  # the trials run under the session's runtime settings
    prof = _profile_for_search(
        session, run_steps, step_fn, make_batch=make_batch, profile_batch_size=profile_batch_size,
        track=track, collectives=collectives, predict=lambda p: predict_batch_size(p, budget_bytes, config, actions=actions, **window),
        warmup=THROUGHPUT_WARMUP if config.mode == "throughput" else None)
    base = profile_batch_size if base_batch_size is None else base_batch_size
    run_trial = _trial_runner(session, run_steps, config, collectives)
    result = search_batch_size(prof, budget_bytes, run_trial, config, actions=actions, base_batch_size=base, **window)
    agreed = int(collectives.reduce_min(result.batch_size))
    if agreed != result.batch_size:  # another process found less: its batch wins
        result = dataclasses.replace(result, batch_size=agreed)
    return result


def _profile_for_search(
    session: "SwapSession",
    run_steps: RunSteps,
    step_fn: StepFn,
    *,
    make_batch: Callable[[int], Any],
    profile_batch_size: int,
    track: Callable[[], Any],
    collectives: Collectives,
    predict: Callable[[Any], Any],
    warmup: Optional[SteadyRule] = None,
) -> Any:
    """Steps 1 and 2 of :func:`search_for_loop`: warm up (one step, or until ``warmup`` says the
    step time is steady), profile on every process (again near the answer ``predict`` gives),
    merge; every process's ``session.profile`` is the result."""
    session.apply(Plan.lowest_memory(session.segments), pinned=True)
    try:
        if warmup is None:
            run_steps(profile_batch_size, 1)
        else:
            _warm_up(run_steps, profile_batch_size, warmup, collectives)
    finally:
        session.remove()
    # Every process makes the batches (a loader may synchronise the processes) and profiles: a
    # sharded model's step runs every rank's collectives, and the search plans for the fullest
    # process (Note [Decide from the largest measurement] in ``collectives.py``).
    batch = make_batch(profile_batch_size)
    prof = max_profile(collectives.gather(session.measure(batch, step_fn, track())))
    top = predict(prof) if collectives.is_main else None
    top_size = collectives.broadcast(top.batch_size if top is not None else 0)
    if top_size > 2 * profile_batch_size:  # Note [Profile near the answer]
        log.info("re-profiling at batch %d, near the predicted answer", top_size)
        batch = make_batch(top_size)
        prof = max_profile(collectives.gather(session.measure(batch, step_fn, track())))
    session.profile = prof  # every process: the adapter may plan training from it afterwards
    return prof


def _warm_up(run_steps: RunSteps, batch_size: int, rule: SteadyRule, collectives: Collectives) -> int:
    """Steps at ``batch_size``, ``rule.window`` at a time, until ``rule`` finds their times steady
    on every process, or ``rule.max_steps`` ran (every process runs the same steps); returns how
    many ran."""
    times: list[float] = []
    ran = 0
    while ran < rule.max_steps:
        steps = min(rule.window, rule.max_steps - ran)
        times += [s.step_ms for s in run_steps(batch_size, steps)]
        ran += steps
        if collectives.reduce_min(int(rule.steady(times))):
            break
    log.info("warm-up: %d step(s), %s", ran, "steady" if rule.steady(times) else "not steady (the cap)")
    return ran


def _trial_runner(session: "SwapSession", run_steps: RunSteps, config: ScaleConfig, collectives: Collectives) -> Callable[[int, Plan], TrialMeasurement]:
    """Step 3 of :func:`search_for_loop`: one trial = the plan applied pinned, ``run_steps``."""

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
        if not peaks:  # a pinned plan's steps are measured (SwapSession.open_step): a caller's bug
            raise RuntimeError("the trial's steps were not measured (peak_device_bytes is None); open them with measure=True.")
        peak = collectives.reduce_max(float(max(peaks)))
        # The median, not the mean: Note [A throughput search that can only win].
        step_ms = collectives.reduce_max(statistics.median([s.step_ms for s in warm]))
        return TrialMeasurement(peak_bytes=int(peak), step_ms=float(step_ms))

    return run_trial


def adopt_search_profile(session: "SwapSession", batch: Optional[Callable[[], Any]] = None, *, found: bool = True) -> None:
    """After a batch-size search (found or not): the session starts afresh, and under
    ``policy="auto"``, when the search ``found`` a batch, training plans from the search's
    steady-state profile — at ``batch()``'s shape when given, else at the profile's own batch —
    instead of tracing a first step of the size found (Note [Auto learns from the steps it runs]).
    Both adapters' finders end with this."""
    searched = session.measured_profile  # the search's own, not auto's (SwapSession.profile prefers auto's)
    session.reset()
    if session.auto is not None and searched is not None and found:
        session.use_profile(searched, BatchKey.of(batch()) if batch is not None else None, steady=True)
