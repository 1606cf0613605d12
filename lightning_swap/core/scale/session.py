"""What every adapter needs, in one place: options, the model's segments, the plan, the
runtime, and the one step API every front end drives.

Note [One step API]: a step is everything from a training batch's start to its end — every
forward, backward, closure call and optimizer step of that batch. Every front end (the Lightning
strategies, Lightning Fabric, Accelerate, the Hugging Face Trainer through Accelerate) drives it
with the same calls and nothing else: :meth:`SwapSession.open_step` at the batch's start (``auto``
guards, observes or plans first), :meth:`SwapSession.backward` around each backward pass,
:meth:`SwapSession.close_step` at its end, :meth:`SwapSession.step_failed` when it raised, and
:meth:`SwapSession.end_training`. The session owns the step's memory window, the observed step's
out-of-memory fallback (Note [The observed step does not fit] in ``fallback.py``: one
implementation, here) and the plan's log (Note [The plan's log] in ``plan_log.py``); an adapter
says only where its step begins and ends, how its processes agree (:class:`~.collectives.Collectives`),
what its training step is for the fallback, whether it runs a failed step again itself, and where
a plan's text goes. No adapter reads the runtime, the observation or the planner.
:class:`~.hooked.HookedSwapSession` finds the same calls in hooks, for loops that have no step hook.

Parameters flow one way: the session is given what it needs when it is made — the options, the
device, how the processes agree, whether the loop frees gradients before the backward — and
resolves the budget once; it never calls its adapter back but through what it was given. Under
``policy="auto"`` it hands :class:`~.auto.AutoPlanner` values and carries out the decisions it
returns (Note [Auto decides from values]).
"""

from __future__ import annotations

import logging
import warnings
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..actions import Action, allowed_actions, resolve_policy
from ..config import SwapConfig
from ..decide.plan import Plan
from ..units import format_bytes
from ..engine.streams import SyncOps, Timing
from ..engine.unified.memory import UnifiedMemory
from ..errors import is_out_of_memory
from ..measure.model_profile import ModelProfile, max_profile
from ..measure.observe import ObservedStep
from ..measure.profiler import measure_bandwidth, profile as profile_step
from ..measure.timeline import Timeline
from ..runtime.runtime import SwapRuntime
from ..runtime.stats import StatsHistory, StepRecord, StepStats
from ..segments import describe_segments, find_segments, refuse_own_checkpointing, resolve_modules, split_call
from ..sharded import is_sharded, runs_alone, units_inside
from ..tensors import device_budget_bytes, normalize_device, tensors_in
from .auto import REVISIT_AFTER_STEPS, AutoPlanner, BatchKey, StepInputs, StepKind
from .collectives import Collectives
from .fallback import WeakBatch, fake_profile_on_main, planned_after_out_of_memory, restore_rng_state, rng_state
from .plan_log import PlanLog, PlanSink
from .shapes import fits_in
from .steady_state import StateSizes, steady_plain_timeline

__all__ = ["SessionViews", "SwapSession"]


log = logging.getLogger(__name__)


def _largest_rows(gathered: list[Any]) -> Optional[tuple[Any, ...]]:
    """Every process's measured rows (``None`` where one measured none) as one: per segment the
    largest bytes kept, offloaded and recomputed (Note [Decide from the largest measurement])."""
    if any(rows is None for rows in gathered) or not gathered:
        return None
    largest = []
    for column in zip(*gathered):
        largest.append(replace(
            column[0], kept_bytes=max(r.kept_bytes for r in column), offloaded_bytes=max(r.offloaded_bytes for r in column),
            recomputed_bytes=max(r.recomputed_bytes for r in column), added_ms=max(r.added_ms for r in column),
        ))
    return tuple(largest)


def _log_segments(names: list[str], *, found: bool) -> None:
    """What the model was cut into, once per session (Note [Finding the blocks])."""
    how = "found automatically" if found else "as named by `segments`"
    if not names:
        log.warning(
            "lightning-swap: no segments %s: the model trains as it would without the library. Name its blocks "
            "with `segments=[BlockClass]` or `segments=['qualified.name', ...]` to plan for them.", how,
        )
        return
    log.info("lightning-swap: %d segments %s: %s", len(names), how, describe_segments(names))


def _observed_record(profile: Any) -> StepRecord:
    """The observed step as a step of the history: its peak and time, nothing moved."""
    step = Timing(SyncOps())
    step.add_ms(profile.step_ms)
    stats = StepStats(
        peak_device_bytes=profile.peak_bytes, offloaded_bytes=0, fetched_bytes=0, prefetched_bytes=0, offloaded_tensors=0,
        deduplicated_tensors=0, host_pool_bytes=0, recompute_ms=None, exposed_transfer_ms=None, step_ms=None,
    )
    return StepRecord(stats, step, Timing(SyncOps()), None, 0.0)


class SessionViews:
    """What a front end's users read of its session (``self._session``: ``None`` before setup),
    the same under Lightning's strategies and Fabric's."""

    _session: Optional["SwapSession"]

    @property
    def swap_session(self) -> Optional["SwapSession"]:
        """The session of the module set up for training (``None`` before; kept after teardown)."""
        return self._session

    @property
    def plan(self) -> Optional[Plan]:
        """The plan applied to the model (``None`` before one was made)."""
        return self._session.plan if self._session is not None else None

    @property
    def step_stats(self) -> Optional[StepStats]:
        """The newest training step whose statistics are complete. Reading it never waits for
        the device: on CUDA, during training, that is usually the step before the last one
        (Note [Stream protocol]); after training it is the last step."""
        return self._session.stats() if self._session is not None else None

    @property
    def stats_history(self) -> list[StepStats]:
        """The last (up to 64) steps' statistics, oldest first, as known now; after teardown too."""
        return self._session.records.all() if self._session is not None else []


class SwapSession:
    """The segments, plan and runtime of one model on one device, and the step API
    (Note [One step API]).

    ``unified``: unified memory the adapter installed before the model reached the device
    (``config.um``); ``collectives``: how the processes agree (plans and verdicts are decided
    on the main process and broadcast); ``grads_freed_before_backward``: the loop frees the
    gradients between forward and backward (Note [Steady-state shift]). The out-of-memory
    fallback (Note [The observed step does not fit]): ``step_fn``, the adapter's training step
    as the fallback profiles it on fake tensors (none: no fallback); ``advice``, what its error
    says to do when that fails too; ``runs_failed_step_again``, the adapter runs the failed step
    again itself (Lightning), else the error reaches the user's loop. ``plan_sink``: where a
    plan's text goes (Note [The plan's log]). The budget is resolved once, here:
    ``config.budget_bytes``, else what the CUDA device offers now (less
    :data:`~lightning_swap.core.tensors.CUDA_BUDGET_MARGIN`), else none."""

    def __init__(
        self, model: nn.Module, config: SwapConfig, device: torch.device | str, *, unified: Optional[UnifiedMemory] = None,
        collectives: Collectives = Collectives(), grads_freed_before_backward: bool = False,
        step_fn: Optional[Callable[[nn.Module, Any], Any]] = None, advice: str = "Choose a policy for it instead, or a smaller batch.",
        runs_failed_step_again: bool = False, plan_sink: Optional[PlanSink] = None,
    ) -> None:
        self.model = model
        self.config = config
        self.device = normalize_device(device)
        self.unified = unified
        self.collectives = collectives
        refuse_own_checkpointing(model)  # Note [A model that checkpoints itself]: every front end, at setup
        self.segments = find_segments(model, None if config.segments is None else list(config.segments))
        _log_segments(self.segments, found=config.segments is None)
        #: Segment name -> why its recomputation cannot run as planned, from every runtime of
        #: this session (Note [Refused actions] in ``model_profile.py``): what ``auto`` leaves out.
        self.refusals: dict[str, str] = {}
        self._coverage_logged = False
        self._budget_bytes = config.budget_bytes if config.budget_bytes is not None else device_budget_bytes(self.device)
        self._grads_freed = grads_freed_before_backward
        self.plan: Optional[Plan] = None
        self.runtime: Optional[SwapRuntime] = None
        self.last_stats: Optional[StepStats] = None
        #: Every measured step of this session, across plans (device times filled in lazily).
        self.records = StatsHistory()
        self._measured: Optional[ModelProfile] = None
        self._pinned, self._pinned_steps = False, 0
        self._backwards = 0  # backward passes of the running step
        self._warned_no_budget = False
        self._state: Optional[StateSizes] = None
        self._guard_states: Any = None
        #: The step being observed (every process), and (batch by weak references, its key, states,
        #: RNG state) of the step observed last (every process: Note [The observed step does not
        #: fit]; Note [An observed step holds no batch] in ``observe.py``).
        self.observation: Optional[ObservedStep] = None
        self._observed_call: Optional[tuple[WeakBatch, BatchKey, Any, tuple]] = None
        #: A step being observed under its plan (the main process): a guard step (Note [Observe
        #: only what fits]) or the first step of a plan made from a guard's profile (Note [A plan's
        #: first step refines its profile]), with its batch's key; and the segments' measured costs
        #: on the batch they were measured on (by name).
        self._under: Optional[ObservedStep] = None
        self._under_batch: Optional[BatchKey] = None
        self._guard_costs: Optional[tuple[BatchKey, dict]] = None
        #: ``policy="auto"``'s decisions (Note [Auto: observe, plan, check]); ``None`` for a forced policy.
        self.auto = self._new_planner() if config.is_auto else None
        #: Note [The plan's log]: on the main process only.
        self.plan_log = PlanLog(plan_sink, enabled=config.log_plan and collectives.is_main)
        #: Note [The observed step does not fit]: the adapter's step, its advice, who runs it again.
        self._fallback = (step_fn, advice, runs_failed_step_again)
        self._planning_suspended = False
        #: The step API's state (Note [One step API]): a step is open; a backward pass is running,
        #: and began without gradients; (id, verdict) of the last failure :meth:`step_failed` judged.
        self._step_open = self._in_backward = self._backward_fresh = False
        self._failure: Optional[tuple[int, bool]] = None
        if self.auto is not None and self._budget_bytes is None and self.segments and collectives.is_main:
            self.warn_no_budget()  # now, before training starts: not in the middle of a progress bar
        if self.auto is not None and self.segments:
            # The copy rates the profiles price offloads with, probed now (two 32 MiB buffers,
            # cached per process), not inside a training step where a meter of the user's sees them.
            measure_bandwidth(self.device)

    def _new_planner(self) -> AutoPlanner:
        planner = AutoPlanner(
            budget_bytes=self._budget_bytes, segments=self.segments, config=self.config,
            grads_freed_before_backward=self._grads_freed, device_type=self.device.type, actions=self.allowed_actions(),
            on_main=self.collectives.on_main,
        )
        planner.refusals = self.refusals  # the session's, as its steps find them (Note [Refused actions])
        return planner

    def note_refusals(self, profile: Optional[ModelProfile]) -> None:
        """What a profile's segments refused when their actions were tried (Note [Refused
        actions]) joins what the runtimes heard: a guard step that recomputes nothing (``OFFLOAD``
        on CPU) hears nothing, and the next guard plan offloads what was refused."""
        for segment in profile.segments if profile is not None else ():
            if segment.refusal:
                self.refusals.setdefault(segment.name, segment.refusal)

    def note_profile(self, profile: Optional[ModelProfile]) -> None:
        """Log once how much of a step's saved bytes the segments cover (Note [Finding the blocks])."""
        coverage = profile.coverage() if profile is not None else None
        if self._coverage_logged or coverage is None:
            return
        self._coverage_logged = True
        # Note [Regions outside the segments] (model_profile.py): the rest is planned, keep or offload.
        rest = f"planned as {len(profile.outside)} region(s) of its own, kept or offloaded" if profile.outside else "kept"
        log.info(
            "lightning-swap: the %d segments hold %s of the %s a step saves for backward (%.0f%%); the rest "
            "(what runs outside them: stem, head, loss) is %s", len(profile.segments), format_bytes(profile.segment_saved_bytes),
            format_bytes(profile.total_saved_bytes), 100 * coverage, rest,
        )

    @property
    def profile(self) -> Optional[ModelProfile]:
        """The :class:`~lightning_swap.core.measure.model_profile.ModelProfile` behind the plan
        (``None`` before one was made): the observed step's for ``"auto"``, else the last
        :meth:`measure` (or a batch-size search's)."""
        if self.auto is not None and self.auto.profile is not None:
            return self.auto.profile
        return self._measured

    @profile.setter
    def profile(self, value: Optional[ModelProfile]) -> None:
        self._measured = value

    @property
    def measured_profile(self) -> Optional[ModelProfile]:
        """The last :meth:`measure` (or batch-size search's) profile, even under ``"auto"``."""
        return self._measured

    @property
    def modules(self) -> dict[str, nn.Module]:
        """The segments' modules by name."""
        return resolve_modules(self.model, self.segments)  # canonical names, compiled or not

    @property
    def observing(self) -> bool:
        """Whether this step is being observed for ``"auto"``'s profile (Note [Observe, do not re-run])."""
        return self.observation is not None

    @property
    def check_pending(self) -> bool:
        """Under ``"auto"``: the plan applied last is in its first step, which checks it."""
        return self.auto is not None and self.auto.check_pending

    def budget_bytes(self) -> Optional[int]:
        """The budget the planner works to, resolved when the session was made."""
        return self._budget_bytes

    # -- the step API (Note [One step API]) ------------------------------------------------
    @property
    def step_open(self) -> bool:
        """A step was opened (:meth:`open_step`) and has not ended or failed."""
        return self._step_open

    @property
    def measuring(self) -> bool:
        """The open step runs under a plan and is measured."""
        return self.runtime is not None and self.runtime.measuring

    @property
    def step_meter(self) -> Any:
        """The meter of the open step's window (the observer's in an observed step), else ``None``:
        for a timeline recorded over the step."""
        if self.observation is not None:
            return self.observation.meter
        return self.runtime.meter if self.measuring else None

    def open_step(self, batch: Any, track: Any, states: Any, *, measure: bool = False) -> StepKind:
        """A training batch starts: ``auto`` guards, observes or plans (a plan made is logged:
        Note [The plan's log]), and the step's window opens. ``batch``: what the step's batch
        is to the fallback's ``step_fn``; ``track``, ``states``, ``measure``: as
        :meth:`before_step`'s."""
        self._failure = None
        self._in_backward = False
        kind = self.before_step(batch, track, states, measure=measure)
        if kind is StepKind.PLAN:
            self.plan_log.made(self.plan)
        self._step_open = True
        return kind

    @contextmanager
    def backward(self) -> Iterator[None]:
        """Around one backward pass of the step (a step may have several: Note [A step of
        several passes]). A failed one is :meth:`step_failed`'s, its error raised as it was."""
        self.backward_begins()
        try:
            yield
        except BaseException as exc:
            self.step_failed(exc)
            raise
        self.backward_done()

    def step_failed(self, exc: BaseException) -> bool:
        """The open step raised ``exc``: nothing of it is kept (its window and observation are
        dropped). When it is the observed step, out of memory in a forward or in a backward that
        began without gradients (those it accumulated are discarded), the fallback plans it
        (Note [The observed step does not fit]) and this returns ``True``: the step, run again,
        runs under the plan. Asked again about the same ``exc`` (a failed backward seen again by
        the code around it), the same answer, nothing done twice."""
        if self._failure is not None and self._failure[0] == id(exc):
            return self._failure[1]
        in_backward, fresh = self._in_backward, self._backward_fresh
        recoverable = (
            self.observing and self._fallback[0] is not None and is_out_of_memory(exc) and (fresh or not in_backward)
        )
        self.abort_step()
        self._failure = (id(exc), recoverable)
        if recoverable:
            if in_backward:
                for p in self.model.parameters():
                    p.grad = None  # what the failed backward accumulated
            self.plan_after_out_of_memory(exc)
        return recoverable

    def close_step(self) -> Optional[StepStats]:
        """The step is over (its optimizer steps included): the window closes (a plan made without
        numbers gets the ones its first step measured: Note [The plan's log]), an observed step
        becomes the profile. Its statistics: the window's, or an observed step's own record."""
        self._step_open = False
        stats = self.end_step()
        self.step_done()
        return stats if stats is not None else self.records.newest()

    def end_training(self) -> Optional[StepStats]:
        """Training is over: a step still open never finished (it is dropped), the host waits for
        the device's times (the one wait allowed: no step runs now), the plan's measured table is
        logged if it was not yet, and :meth:`close` removes everything. Returns the last step's
        statistics; :attr:`records` keeps every step's."""
        self.abort_step()
        self.records.resolve(wait=True)
        self._note_measured_plan(wait=True)
        stats = self.stats(wait=True)
        self.close()
        return stats

    @contextmanager
    def planning_suspended(self) -> Iterator[None]:
        """No planning inside (the batch-size search, the fallback's fake step): a hooked
        session's windows still open whenever a runtime is installed."""
        previous, self._planning_suspended = self._planning_suspended, True
        try:
            yield
        finally:
            self._planning_suspended = previous

    def _note_measured_plan(self, *, wait: bool) -> None:
        """Note [Measured rows]: a plan made without numbers becomes the plan its first step
        measured, which is logged (Note [The plan's log])."""
        runtime = self.runtime
        measured = runtime.measured_plan(wait=wait) if runtime is not None and runtime.measure_rows else None
        if measured is None:  # no rows to measure, or not yet: the device has not finished the step
            return
        if self.plan is not None and not self.plan.rows:
            self.plan = measured
        self.plan_log.measured(measured)

    # -- the parts of a step ------------------------------------------------------------
    def before_step(self, batch: Any, track: Any, states: Any, *, measure: bool = False) -> StepKind:
        """Before a training step's forward: guard it, observe it, (re-)plan, or open the
        installed plan's window. ``track``: what is alive besides the model (the batch,
        ``states``); ``states``: the optimizer states; ``measure``: as :meth:`begin_step`'s.
        Every process calls it for every step (decisions are broadcast from the main process).
        Returns what the step does (Note [Auto: observe, plan, check])."""
        self._observed_call = None
        self._backwards = 0
        if self.auto is None or self._pinned:
            self.begin_step(track, measure=measure)
            return StepKind.RUN
        step = StepInputs(self._agreed(BatchKey.of(batch)), self._state_sizes(states))
        kind = self._next_step(step)
        if kind is StepKind.GUARD:
            self._begin_guard(batch, track, states, step)
        elif kind is StepKind.OBSERVE:  # every process observes (Note [Decide from the largest measurement])
            self._begin_observe(batch, track, states, step)
        else:
            if kind is StepKind.PLAN:
                self._plan(step)
            self.begin_step(track, measure=measure)
            if kind is StepKind.PLAN and self.auto.refine_due:
                self._observe_under(batch, track)
        return kind

    def _agreed(self, key: BatchKey) -> BatchKey:
        """The batch key every process decides from (Note [Auto decides from values]): the same
        shape everywhere and the largest batch size. Two reductions of one number each: a 32-bit
        hash of the shape above the size (exact in float64). Where the processes' shapes differ
        (each pads its batch to its own longest sequence) every key is gathered: the largest
        shape, where one process holds it and every other's fits in it (a plan made for it bounds
        theirs: Note [A smaller shape runs a larger one's plan]); else a shape no profile has
        (every process guards)."""
        shape_hash = zlib.crc32(repr(key.shape).encode())
        packed = shape_hash * (1 << 20) + min(key.size, (1 << 20) - 1)
        most, least = int(self.collectives.reduce_max(packed)), int(self.collectives.reduce_min(packed))
        if most >> 20 == least >> 20:
            return BatchKey(key.shape, most & ((1 << 20) - 1))
        keys = self.collectives.gather(key)
        size = max(k.size for k in keys)
        largest = next((k.shape for k in keys if all(fits_in(other.shape, k.shape) for other in keys)), None)
        return BatchKey(largest or (("shapes differ across processes", most >> 20, least >> 20),), size)

    def _begin_guard(self, batch: Any, track: Any, states: Any, step: StepInputs) -> None:
        """Note [Observe only what fits]: the lowest-memory plan, measured, and observed under it
        (after the runtime's window opened: the observer's modes are closed first)."""
        self.apply(self.auto.begin_guard(step))
        self._guard_states = states
        self.begin_step(track, measure=True)
        self._observe_under(batch, track)

    def _observe_under(self, batch: Any, track: Any) -> None:
        """Every process observes this step under the installed plan (after the runtime's window
        opened: the observer's modes are closed first, in :meth:`end_step`); not a sharded model
        whose segments cannot run alone (FSDP1, a segment that is no FSDP2 unit of its own: Note
        [Sharded segments timed in lockstep] in ``sharded.py``): no profile is made from its guard
        steps, plain's peak is bounded instead (Note [Observe only what fits])."""
        if not runs_alone(self.model, self.modules.values()):
            return
        self._under_batch = BatchKey.of(batch)  # the key, not the batch (Note [An observed step holds no batch])
        self._under = ObservedStep(
            self.model, list(self.segments), device=self.device, batch=batch, track=track,
            min_offload_bytes=self.config.min_offload_bytes, modules=self.modules, under=self.plan.actions,
            costs=self._costs_for(self._under_batch),
        ).begin()

    def _costs_for(self, key: BatchKey) -> Optional[dict]:
        """The segments' costs this process measured already on a batch of this shape and size;
        under FSDP only where every process has them, so that all measure again or none does (Note
        [Sharded segments timed in lockstep]: a process's batch size may differ from another's)."""
        measured = self._guard_costs
        costs = measured[1] if measured is not None and measured[0] == key else None
        if is_sharded(self.model) and self.collectives.reduce_min(int(costs is not None)) == 0:
            return None
        return costs

    def _state_sizes(self, states: Any) -> StateSizes:
        self._state = StateSizes.of(self.model, states, self._state)
        return self._state

    def _next_step(self, step: StepInputs) -> StepKind:
        """The planner's answer (a verdict due first is decided on the main process and taken by
        every process inside it: Note [Observe only what fits])."""
        kind = self.auto.next_step(step)
        if kind is StepKind.RUN and self.auto.keeps_least and self.plan is not None:  # its peak is measured
            least, batch_size = self.auto.guard_measured
            if (self.plan.predicted_peak_bytes, self.plan.batch_size) != (least, batch_size):
                self.plan = replace(self.plan, predicted_peak_bytes=least, budget_bytes=self._budget_bytes, batch_size=batch_size)
        return kind

    def _begin_observe(self, batch: Any, track: Any, states: Any, step: StepInputs) -> None:
        self.remove()
        self.plan = None
        self.auto.begin_observe(step)  # the agreed batch: the largest, as the merged profile's
        self.observation = ObservedStep(
            self.model, list(self.segments), device=self.device, batch=batch, track=track,
            min_offload_bytes=self.config.min_offload_bytes, modules=self.modules, costs=self._costs_for(BatchKey.of(batch)),
        ).begin()
        # by weak references: Note [An observed step holds no batch]
        self._observed_call = (WeakBatch(batch), BatchKey.of(batch), states, rng_state(self.device))

    def _plan(self, step: StepInputs) -> None:
        """A plan solved on the main process, applied on every process."""

        newest = self.records.newest()
        # The check reads the fullest process's peak (Note [Decide from the largest measurement]).
        peak = self.collectives.largest(newest.peak_device_bytes if newest is not None else None)

        def solve() -> Plan:
            if self._budget_bytes is None:
                self.warn_no_budget()
            times = ()
            if self.auto.revisit_due:  # Note [Re-plan from the steady state]: the one wait for the device
                steps = self.records.since(self.records.count - REVISIT_AFTER_STEPS, wait=True)
                times = [(s.step_ms, s.recompute_ms, s.exposed_transfer_ms) for s in steps]
            return self.auto.plan(step.state, peak, times)

        plan = self._received(self.collectives.on_main(solve))
        if plan != self.plan:  # by value: other processes get a new object each time
            self.apply(plan)
        self.auto.applied(plan, step.state)

    def _received(self, plan: Plan) -> Plan:
        """``plan`` from the main process, checked against this process's segments."""
        # the planner lists segments in execution order, the forced plan in the model's order; a
        # module run several times is a segment per call (Note [A segment per call])
        if sorted({split_call(name)[0] for name in plan.segments}) != sorted(self.segments):
            raise ValueError(
                f"this process cut the model into segments {list(self.segments)}, but the main process "
                f"planned {list(plan.segments)}; every process must build the same model."
            )
        return plan

    def apply_forced_plan(self) -> Plan:
        """Install the forced policy's plan, the main process's on every process (logged once
        its first step measured it: Note [The plan's log])."""
        return self.apply(self._received(self.collectives.on_main(self.forced_plan)))

    def backward_begins(self) -> None:
        """The loss exists and its backward is about to run (once per backward pass of the step)."""
        self._backwards += 1
        self._in_backward = True
        # Only a backward that starts without gradients can have a failed attempt's discarded.
        self._backward_fresh = self.observing and all(p.grad is None for p in self.model.parameters())
        if self.auto is not None and self.auto.guarding and self.runtime is not None and self.runtime.measuring:
            self.auto.guard_forward_done(self.runtime.meter.peak_bytes)
        for observation in (self.observation, self._under):
            if observation is not None:
                observation.backward_begins()

    def step_done(self) -> None:
        """The whole step (optimizer step included) is over: an observed step becomes the profile,
        a guard step's measurements bound plain's peak (Note [Observe only what fits])."""
        if self.auto is not None and self.auto.guarding and self.runtime is not None:
            self.auto.guard_passes(self.collectives.largest(self._backwards) or 1)  # Note [A step of several passes]
            self._end_guard()
        elif self._under is not None:
            self.auto.refine(self._profile_under())
        if self.observation is not None:
            observed, self.observation = self.observation, None
            profile = max_profile(self.collectives.gather(observed.finish()))
            self.note_refusals(profile)
            self.auto.finish_observe(profile)
            self.records.add(_observed_record(profile))
            self.note_profile(profile)
        self._observed_call = None

    def _end_guard(self) -> None:
        """A guard step is over: its peak and rows (the largest of every process's: the verdict
        must hold for all of them), and once the guard was steady, its profile (Note [Observe
        only what fits])."""
        stats = self.records.newest()
        measured = self.runtime.measured_plan(wait=True)
        rows = _largest_rows(self.collectives.gather(measured.rows if measured else None))
        self.auto.end_guard(
            self.collectives.largest(stats.peak_device_bytes if stats is not None else None), rows,
            self._state_sizes(self._guard_states),
            offloaded_bytes=self.collectives.largest(stats.offloaded_bytes if stats is not None else None),
        )
        self._guard_states = None
        if measured is not None:
            self.plan = measured
        if self._under is None:
            return
        if not self.auto.guard_steady:
            self._under.abort()
            self._under = None
            return
        self.auto.guard_observed(self._profile_under())

    def _profile_under(self) -> Optional[ModelProfile]:
        """The profile of the step observed under its plan (its windows the plan's: Note [A step
        measured under a plan]), the largest of every process's (``None`` where one made none);
        each process keeps its segments' costs for its next steps on that batch."""
        observation, self._under = self._under, None
        self.runtime.remove()  # each segment is measured alone as plain code (Note [A segment measured alone])
        try:
            profile = observation.finish()
        finally:
            self.runtime.install()
        if observation.costs:
            self._guard_costs = (self._under_batch, observation.costs)
        profiles = self.collectives.gather(profile)
        profile = None if any(p is None for p in profiles) else max_profile(profiles)
        self.note_refusals(profile)
        return profile

    def abort_step(self) -> None:
        """The step failed (out of memory, an exception): nothing observed is kept, no step is open."""
        self._step_open = self._in_backward = False
        for name in ("observation", "_under"):
            observation = getattr(self, name)
            if observation is not None:
                observation.abort()
                setattr(self, name, None)
        if self.runtime is not None and self.runtime.measuring:
            self.runtime.abort_step()

    def plan_after_out_of_memory(self, exc: BaseException) -> None:
        """The observed step ran out of memory (``exc``; :meth:`step_failed` aborted it): it is
        profiled on fake tensors with the adapter's ``step_fn`` (no step: planning suspended),
        the next step plans from that profile, the RNG is back at the state the failed step
        started with, and the main process warns (Note [The observed step does not fit])."""
        if self._observed_call is None:
            raise RuntimeError("plan_after_out_of_memory: no observed step to plan for") from exc
        batch, key, states, rng = self._observed_call
        step_fn, advice, runs_again = self._fallback
        with self.planning_suspended():
            profile = fake_profile_on_main(
                self.model, batch, step_fn, segments=self.segments, states=states, config=self.config, device=self.device,
                collectives=self.collectives, advice=advice, cause=exc,
            )
        self.use_profile(profile, key)
        restore_rng_state(self.device, rng)
        if self.collectives.is_main:
            warnings.warn(planned_after_out_of_memory(runs_again), UserWarning, stacklevel=3)

    def use_profile(self, profile: ModelProfile, batch: Optional[BatchKey], *, steady: bool = False) -> None:
        """``"auto"`` plans the next step from ``profile`` (:meth:`AutoPlanner.set_profile`)."""
        self.auto.set_profile(profile, batch, steady=steady)
        self.plan = None

    def steady_plain_timeline(self, plain: Timeline, states: Any) -> Timeline:
        """The observed step's timeline shifted to the state alive now (Note [Steady-state shift])."""
        return steady_plain_timeline(plain, *self.auto.steady_shift(self._state_sizes(states)))

    @property
    def pinned(self) -> bool:
        """Whether the installed plan was applied with ``pinned=True`` (kept whatever the batch)."""
        return self._pinned

    def forced_plan(self) -> Plan:
        if self.config.is_auto:
            raise RuntimeError("policy='auto' has no forced plan: its plans come from before_step()")
        return Plan(actions=resolve_policy(self.config.policy, self.segments), budget_bytes=self.config.budget_bytes)

    def measure(self, batch: Any, step_fn: Callable[[nn.Module, Any], Any], track: Iterable[Any] = ()) -> ModelProfile:
        """Profile one plain step on ``batch`` (the runtime is removed first); scalable in batch size.

        On CUDA a step that does not fit is profiled in fake mode instead (memory exact, times
        estimated: Note [Fake-mode times are estimates])."""
        self.remove()
        kwargs = dict(
            step_fn=step_fn,
            segments=list(self.segments),
            track=tensors_in(list(track)),
            min_offload_bytes=self.config.min_offload_bytes,
            device=self.device,
            scale=True,
        )
        try:
            measured = profile_step(self.model, batch, **kwargs)
        except Exception as exc:  # noqa: BLE001
            if not is_out_of_memory(exc):
                raise
            log.info("plain step does not fit on %s; profiling in fake mode", self.device)
            torch.cuda.empty_cache()
            measured = profile_step(self.model, batch, fake=True, **kwargs)
        self._measured = measured
        return measured

    def warn_no_budget(self) -> None:
        """Say once, as a warning (the user sees it without configuring logging), that
        ``policy="auto"`` has nothing to plan against and how to give it a budget."""
        if self._warned_no_budget:
            return
        self._warned_no_budget = True
        log.warning(
            "lightning-swap: policy='auto' has no memory budget on %s (only CUDA reports one by itself), "
            "so there is nothing to plan against and every segment is kept. Set budget_bytes to plan: "
            "CPUSwapStrategy(budget_bytes='8GiB'), SwapPlugin(budget_bytes='8GiB') or "
            "ACCELERATE_CPU_SWAP_BUDGET_BYTES=8GiB (on CPU it is the simulated device capacity).",
            self.device.type,
        )

    def allowed_actions(self) -> Optional[tuple[Action, ...]]:
        """The actions the planner may use: all for ``"auto"`` (but ``SELECTIVE`` when a segment
        holds FSDP units of its own: Note [Selective around FSDP hooks]), the one for a single
        forced action.

        A per-segment mapping cannot be re-planned at another batch size: ``ValueError``
        (:func:`~lightning_swap.core.actions.allowed_actions`)."""
        allowed = allowed_actions(self.config.policy)
        if allowed is None and any(units_inside(m) for m in self.modules.values()):
            return tuple(a for a in Action if a is not Action.SELECTIVE)
        return allowed

    def reset(self) -> None:
        """Remove the runtime and forget the plan and the steps measured so far (a batch-size
        search's trials): the next step plans afresh."""
        self.remove()
        self.records.clear()
        self.plan = None
        if self.auto is not None:
            self.abort_step()
            self._guard_costs = None
            self.auto = self._new_planner()
        self._pinned, self._pinned_steps = False, 0

    def apply(self, plan: Plan, *, pinned: bool = False) -> Plan:
        """Install ``plan`` (replacing any installed one). A ``pinned`` plan stays whatever the
        batch (the batch-size finder's trials); :meth:`reset` unpins."""
        self.remove()
        self._pinned, self._pinned_steps = pinned, 0
        runtime = SwapRuntime(
            self.model,
            plan,
            device=self.device,
            min_offload_bytes=self.config.min_offload_bytes,
            prefetch_segments=self.config.prefetch_segments,
            inflight_segments=self.config.inflight_segments,
            unified=self.unified,
            prefetch_bytes=self.config.prefetch_bytes,
            inflight_bytes=self.config.inflight_bytes,
        )
        runtime.install()
        self.runtime, self.plan = runtime, plan
        return plan

    def begin_step(self, track: Iterable[Any] = (), *, measure: bool = False) -> None:
        """Open the step window. ``measure=True`` measures device memory even for a compiled model
        on CPU (running that step eagerly: Note [No dispatch mode under compile] in runtime.py);
        a pinned plan's first step (a batch-size finder's trial) is always measured, its later
        ones only timed (unmetered on CPU: Note [The CPU meter's cost] in runtime.py), and a new
        plan's first step is measured (its check: Note [Auto: observe, plan, check])."""
        if self.runtime is None:
            if self.config.is_auto:
                raise RuntimeError("policy='auto': call before_step() (or apply() a plan) before the first step")
            self.apply(self.forced_plan())
        assert self.runtime is not None
        timed_only = self._pinned and self._pinned_steps > 0
        self._pinned_steps += self._pinned
        self.runtime.begin_step(
            tensors_in(list(track)), measure=measure or (self._pinned and not timed_only) or self.check_pending, timed_only=timed_only
        )

    def backward_done(self) -> None:
        """The loss's backward is over (what follows, the optimizer step, is its own window in
        an observed step)."""
        self._in_backward = False
        if self.auto is not None and self.auto.guarding and self.runtime is not None and self.runtime.measuring:
            self.auto.guard_backward_done(self.collectives.largest(self.runtime.meter.peak_bytes))
        for observation in (self.observation, self._under):
            if observation is not None and observation.open and not observation.backward_over:
                observation.backward_done()

    def end_step(self) -> Optional[StepStats]:
        """The step is over (adapters call it after the optimizer step when they can, else
        after the backward): its statistics (``None`` when no window was open)."""
        if self.observing:
            self.backward_done()
            return None
        if self._under is not None:
            self._under.close()  # its modes opened inside the runtime's window: closed first
        if self.runtime is None or not self.runtime.measuring:
            return None
        self.last_stats = self.runtime.end_step()
        self.records.add(self.runtime.records.newest_record())
        for name, why in self.runtime.refusals.items():
            self.refusals.setdefault(name, why)
        self._note_measured_plan(wait=False)
        return self.last_stats

    def stats(self, *, wait: bool = False) -> Optional[StepStats]:
        """The newest step whose device times are known; ``wait=True`` (outside a step) waits
        for the last one."""
        return self.records.latest(wait=wait)

    def remove(self) -> None:
        """Remove the installed runtime (to install another plan, or to profile); the session
        goes on."""
        if self.runtime is not None:
            self.runtime.remove()
            self.runtime = None

    def close(self) -> None:
        """The session is over: everything it installed on the model is removed (the runtime;
        an adapter's session removes its own hooks too), and the model is the user's again."""
        self.remove()
