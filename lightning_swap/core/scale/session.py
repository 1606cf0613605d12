"""What every adapter needs, in one place: options, the model's segments, the plan, the
runtime, and the one step API every front end drives.

Note [One step API]: a step is everything from a training batch's start to its end — every
forward, backward, closure call and optimizer step of that batch. Every front end (the Lightning
strategies, Lightning Fabric, Accelerate, the Hugging Face Trainer through Accelerate) drives it
with the same calls and nothing else: :meth:`SwapSession.open_step` at the batch's start (``auto``
decides the step's plan first), :meth:`SwapSession.backward` around each backward pass,
:meth:`SwapSession.close_step` at its end, :meth:`SwapSession.step_failed` when it raised, and
:meth:`SwapSession.end_training`. The session owns the step's memory window, the budget held as
it runs (Note [The budget held online] in ``runtime/online.py``) and the plan's log (Note [The
plan's log] in ``plan_log.py``); an adapter says only where its step begins and ends, how its
processes agree (:class:`~.collectives.Collectives`) and where a plan's text goes. No adapter
reads the runtime, the trace or the planner. :class:`~.hooked.HookedSwapSession` finds the same
calls in hooks, for loops that have no step hook.

Parameters flow one way: the session is given what it needs when it is made — the options, the
device, how the processes agree, whether the loop frees gradients before the backward — and
resolves the budget once; it never calls its adapter back but through what it was given. Under
``policy="auto"`` it hands :class:`~.auto.AutoPlanner` values and carries out the decisions it
returns (Note [Auto decides from values] in ``auto.py``).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..actions import Action, allowed_actions, resolve_policy
from ..config import SwapConfig
from ..decide.plan import Plan
from ..engine.unified.memory import UnifiedMemory
from ..errors import InfeasibleBudgetError, is_out_of_memory
from ..measure.model_profile import ModelProfile, max_profile
from ..measure.observe import ObservedStep
from ..measure.profiler import measure_bandwidth, profile as profile_step
from ..runtime.runtime import SwapRuntime
from ..runtime.stats import StatsHistory, StepStats
from ..segments import describe_segments, find_segments, refuse_own_checkpointing, resolve_modules, split_call
from ..sharded import is_sharded, units_inside
from ..tensors import device_budget_bytes, normalize_device, tensors_in
from ..units import format_bytes
from .auto import AutoPlanner, BatchKey, Decision, Outcome, StepInputs, StepKind, fits_in
from .collectives import Collectives
from .plan_log import PlanLog, PlanSink
from .steady_state import FirstStepWindows, StateSizes

__all__ = ["SessionViews", "SwapSession"]


log = logging.getLogger(__name__)

#: Note [The plan's log]: what each kind of ``auto`` step's plan is, in its title.
_WHY = {
    StepKind.FIRST: "the first step's lowest-memory plan, traced: auto plans from what it measures",
    StepKind.TRACE: "a batch no profile covers, traced under a plan of keep and offload",
    StepKind.PLAN: "planned",
}


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
    (``config.um``); ``collectives``: how the processes agree (plans are decided on the main
    process and broadcast); ``grads_freed_before_backward``: the loop frees the gradients between
    forward and backward (Note [Steady-state shift]); ``plan_sink``: where a plan's text goes
    (Note [The plan's log]); ``advice``: how the front end's user sets a budget (its class and
    option), for the warning without one. The budget is resolved once, here:
    ``config.budget_bytes``, else what the CUDA device offers now (less
    :data:`~lightning_swap.core.tensors.CUDA_BUDGET_MARGIN`), else none."""

    def __init__(
        self, model: nn.Module, config: SwapConfig, device: torch.device | str, *, unified: Optional[UnifiedMemory] = None,
        collectives: Collectives = Collectives(), grads_freed_before_backward: bool = False, plan_sink: Optional[PlanSink] = None,
        advice: str = "SwapConfig(budget_bytes='8GiB')",
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
        self._advice = advice
        self.plan: Optional[Plan] = None
        self.runtime: Optional[SwapRuntime] = None
        self.last_stats: Optional[StepStats] = None
        #: Every measured step of this session, across plans (device times filled in lazily).
        self.records = StatsHistory()
        self._measured: Optional[ModelProfile] = None
        self._pinned, self._pinned_steps = False, 0
        self._warned_no_budget = self._warned_over = False
        self._state: Optional[StateSizes] = None
        #: ``policy="auto"``'s decisions (Note [Auto learns from the steps it runs]); ``None`` for a forced policy.
        self.auto = self._new_planner() if config.is_auto else None
        #: Note [The plan's log]: on the main process only.
        self.plan_log = PlanLog(plan_sink, enabled=config.log_plan and collectives.is_main)
        self._planning_suspended = False
        #: The step API's state (Note [One step API]): a step is open; a backward pass is running;
        #: the backward passes of the step; the auto step running (its decision, inputs and
        #: optimizers), its trace; the first measured step's windows, and the least budget they gave
        #: (Note [The least budget from the first step]).
        self._step_open = self._in_backward = False
        self._backwards = 0
        self._step: Optional[tuple[Decision, StepInputs, Any]] = None
        self._trace: Optional[ObservedStep] = None
        self._first: Optional[FirstStepWindows] = None
        self._first_over: Optional[FirstStepWindows] = None
        self.least_bytes: Optional[int] = None
        #: Optimizer steps running now, seen by torch's global optimizer-step hooks until the first
        #: step is over (a closure's step begins before the training step it runs).
        self._updating, self._optimizer_hooks = 0, []
        if self._budget_bytes is not None:
            self._optimizer_hooks = [register_optimizer_step_pre_hook(self._update_begins), register_optimizer_step_post_hook(self._update_ends)]
        if self.auto is not None and self._budget_bytes is None and self.segments and collectives.is_main:
            self.warn_no_budget()  # now, before training starts: not in the middle of a progress bar
        if self.auto is not None and self.segments:
            # The copy rates the profiles price offloads with, probed now (two 32 MiB buffers,
            # cached per process), not inside a training step where a meter of the user's sees them.
            measure_bandwidth(self.device)

    def _new_planner(self) -> AutoPlanner:
        return AutoPlanner(
            budget_bytes=self._budget_bytes, segments=self.segments, config=self.config, grads_freed_before_backward=self._grads_freed,
            device_type=self.device.type, actions=self.allowed_actions(), sharded=is_sharded(self.model),
            refusals=self.refusals,  # the session's, as its steps find them (Note [Refused actions])
        )

    def note_refusals(self, profile: Optional[ModelProfile]) -> None:
        """What a profile's segments refused (Note [Refused actions]) joins what the runtimes heard."""
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
        (``None`` before one was made): ``auto``'s newest, else the last :meth:`measure` (or a
        batch-size search's)."""
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
    def check_pending(self) -> bool:
        """Under ``"auto"``: the plan in force has not been checked by a step yet."""
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
        """The meter of the open step's window, else ``None``: for a timeline recorded over the step."""
        return self.runtime.meter if self.measuring else None

    def open_step(self, batch: Any, track: Any, optimizers: Any, *, measure: bool = False) -> StepKind:
        """A training batch starts: ``auto`` decides its plan (a plan made is logged: Note [The
        plan's log]), and the step's window opens. ``track``: what is alive besides the model (the
        batch, the optimizers' states); ``optimizers``: the step's optimizers; ``measure``: as
        :meth:`_begin_step`'s."""
        self._in_backward = False
        kind = self._before_step(batch, track, optimizers, measure=measure)
        if kind is not StepKind.RUN:
            self.plan_log.made(self.plan, _WHY[kind])
        self._step_open = True
        return kind

    @contextmanager
    def backward(self) -> Iterator[None]:
        """Around one backward pass of the step (a step may have several). A failed one is
        :meth:`step_failed`'s, its error raised as it was."""
        self._backward_begins()
        try:
            yield
        except BaseException as exc:
            self.step_failed(exc)
            raise
        self._backward_done()

    def step_failed(self, exc: BaseException) -> bool:
        """The open step raised ``exc``: nothing of it is kept (its window and trace are dropped,
        the library's hooks taken off: Note [Hooks never outlive the library] in ``tensors.py``).
        Returns whether the adapter should run the step again (never: nothing is replayed)."""
        self._abort_step()
        if is_out_of_memory(exc) and self.auto is not None:
            log.warning(
                "lightning-swap: a step under policy='auto' ran out of device memory within a budget of %s: the device "
                "has less free than the budget says; set budget_bytes lower.", format_bytes(self._budget_bytes or 0),
            )
        return False

    def close_step(self) -> Optional[StepStats]:
        """The step is over (its optimizer steps included): the window closes (a plan made without
        numbers gets the ones its first step measured: Note [The plan's log]), and ``auto`` learns
        from it. Its statistics."""
        self._step_open = False
        stats = self._end_step()
        self._step_done()
        return stats

    def end_training(self) -> Optional[StepStats]:
        """Training is over: a step still open never finished (it is dropped), the host waits for
        the device's times (the one wait allowed: no step runs now), the plan's measured table is
        logged if it was not yet, and :meth:`close` removes everything. Returns the last step's
        statistics; :attr:`records` keeps every step's."""
        self._abort_step()
        self.records.resolve(wait=True)
        self._note_measured_plan(wait=True)
        stats = self.stats(wait=True)
        self.close()
        return stats

    @contextmanager
    def planning_suspended(self) -> Iterator[None]:
        """No planning inside (the batch-size search): a hooked session's windows still open
        whenever a runtime is installed."""
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
    def _before_step(self, batch: Any, track: Any, optimizers: Any, *, measure: bool = False) -> StepKind:
        """Before a training step's forward: ``auto`` decides the step's plan, which is installed,
        and the window opens. ``track``: what is alive besides the model (the batch, the
        optimizers' states); ``optimizers``: the step's optimizers (or their states); ``measure``:
        as :meth:`_begin_step`'s. Every process calls it for every step (plans are broadcast from
        the main process)."""
        self._backwards, self._step = 0, None
        first = self.least_bytes is None and self._first is None and self._first_over is None and self._budget_bytes is not None and not self._pinned
        if self._first_over is not None:  # the second step: the first step's least budget is known now
            windows, self._first_over = self._first_over, None
            self.least_bytes = self.collectives.largest(windows.least_bytes(StateSizes.of(self.model, optimizers)))
            if self.auto is None:
                self._warn_forced_over(self.least_bytes)
            else:
                self._refuse_over(self.least_bytes)
                self.auto.least_bytes = self.least_bytes
        if self.auto is None or self._pinned:
            self._begin_step(track, measure=measure or first)
            self._first_windows(first, optimizers)
            return StepKind.RUN
        step = StepInputs(self._agreed(BatchKey.of(batch)), self._state_sizes(optimizers))
        decision = self.auto.next_step(step)
        if decision.plan is None and self._budget_bytes is None:
            self.warn_no_budget()
        plan = decision.plan if decision.plan is not None else self._received(self.collectives.on_main(lambda: self.auto.plan(decision)))
        self.auto.applied(decision, plan)
        if plan != self.plan or self.runtime is None:  # by value: other processes get a new object each time
            self.apply(plan)
        self._step = (decision, step, optimizers)
        self._begin_step(track, measure=measure or decision.trace or self.auto.check_pending, online=self.auto.online)
        self._first_windows(first and decision.kind is StepKind.FIRST, optimizers)
        if decision.trace:
            self._trace = ObservedStep(
                self.model, list(self.segments), device=self.device, batch=batch, track=track,
                min_offload_bytes=self.config.min_offload_bytes, modules=self.modules, under=plan.actions,
                contexts=self.runtime.contexts,
            ).begin()
            self.runtime.engine.observer = self._trace.observer  # Note [A traced step sees what the plan moves]
        return decision.kind

    def _first_windows(self, first: bool, optimizers: Any) -> None:
        """The first measured step with a budget is cut into windows (Note [The least budget from
        the first step])."""
        if first and self.measuring:
            check = (lambda least: self._refuse_over(self.collectives.largest(least), lower_bound=True)) if self.auto is not None else (lambda least: None)
            self._first = FirstStepWindows(
                self.runtime.meter, self.model, optimizers, self.device.type, grads_in_forward=self._grads_freed, check=check,
                in_update=self._updating > 0,
            )

    def _update_begins(self, *_: Any) -> None:
        self._updating += 1
        if self._first is not None:
            self._first.update_begins()

    def _update_ends(self, *_: Any) -> None:
        self._updating = max(0, self._updating - 1)
        if self._first is not None:
            self._first.update_ends()

    def _remove_optimizer_hooks(self) -> None:
        for handle in self._optimizer_hooks:
            handle.remove()
        self._optimizer_hooks = []

    def _agreed(self, key: BatchKey) -> BatchKey:
        """The batch key every process decides from (Note [Auto decides from values]): the same
        shape everywhere and the largest batch size. Two reductions of one number each: a 32-bit
        hash of the shape above the size (exact in float64). Where the processes' shapes differ
        (each pads its batch to its own longest sequence) every key is gathered: the largest
        shape, where one process holds it and every other's fits in it; else the largest by
        elements."""
        shape_hash = zlib.crc32(repr(key.shape).encode())
        packed = shape_hash * (1 << 20) + min(key.size, (1 << 20) - 1)
        most, least = int(self.collectives.reduce_max(packed)), int(self.collectives.reduce_min(packed))
        if most >> 20 == least >> 20:
            return BatchKey(key.shape, most & ((1 << 20) - 1))
        keys = self.collectives.gather(key)
        size = max(k.size for k in keys)
        largest = next((k.shape for k in keys if all(fits_in(other.shape, k.shape) for other in keys)), None)
        return BatchKey(largest if largest is not None else max(keys, key=lambda k: k.elements).shape, size)

    def _state_sizes(self, optimizers: Any) -> StateSizes:
        self._state = StateSizes.of(self.model, optimizers, self._state)
        return self._state

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

    def _backward_begins(self) -> None:
        """The loss exists and its backward is about to run (once per backward pass of the step)."""
        self._backwards += 1
        self._in_backward = True
        if self.runtime is not None:
            self.runtime.new_pass()
        if self._first is not None:
            self._first.cut(backward=False)
        if self._trace is not None:
            if self._backwards == 1:
                self._trace.backward_begins()
            elif self._trace.open:  # a second pass: the trace is of the first (Note [Auto learns from the steps it runs])
                self._trace.close()

    def _backward_done(self) -> None:
        """The loss's backward is over (what follows, the optimizer step, is its own window in a
        traced step)."""
        self._in_backward = False
        if self._first is not None:
            self._first.cut(backward=True)  # Note [The least budget from the first step]: the bound so far checked
        if self._trace is not None and self._trace.open and not self._trace.backward_over:
            self._trace.backward_done()

    def _end_step(self) -> Optional[StepStats]:
        """The step is over (adapters call it after the optimizer step when they can, else after
        the backward): its statistics (``None`` when no window was open)."""
        if self._trace is not None:
            try:
                self._trace.close()  # its modes opened inside the runtime's window: closed first
            except ValueError:  # a segment did not run (a step that returned early): no trace
                self._trace.abort()
                self._trace = None
        if self.runtime is None or not self.runtime.measuring:
            return None
        if self.runtime.engine is not None:
            self.runtime.engine.observer = None
        if self._first is not None:
            self._first.close()
            self._first_over, self._first = self._first, None
            self._remove_optimizer_hooks()
        self.last_stats = self.runtime.end_step()
        self.records.add(self.runtime.records.newest_record())
        if self._first_over is None:  # the first step's peak is not the plan's steady one
            self._warn_forced_over(self.last_stats.peak_device_bytes)
        for name, why in self.runtime.refusals.items():
            self.refusals.setdefault(name, why)
        self._note_measured_plan(wait=False)
        return self.last_stats

    def _step_done(self) -> None:
        """The whole step (optimizer step included) is over: ``auto`` learns from it (Note [Auto
        learns from the steps it runs]); every process, with the largest of every process's
        measurements."""
        step, trace = self._step, self._trace
        self._step, self._trace = None, None
        if step is None or self.auto is None:
            return
        decision, inputs, states = step
        collectives, stats = self.collectives, self.last_stats
        if decision.trace:
            # A move to a recomputing action hid what that segment saves (Note [A traced step sees
            # what the plan moves]): no profile from such a step.
            recomputed = self.runtime is not None and any(a.recomputes for a in self.runtime.now.values())
            profile = trace.finish() if trace is not None and not trace.open and not recomputed and self._backwards else None
            profiles = collectives.gather(profile)
            profile = None if any(p is None for p in profiles) else max_profile(profiles)
            self.note_refusals(profile)
            self.note_profile(profile)
            self.auto.traced(profile, inputs.batch, inputs.state, self.plan)
        ran = collectives.largest(self._backwards)  # a step that ran no backward (skipped) tells nothing
        outcome = Outcome(
            peak_bytes=collectives.largest(stats.peak_device_bytes if stats is not None and ran else None),
            moved=bool(collectives.largest(int(bool(stats is not None and stats.moved)))),
            shift_bytes=collectives.largest(max(0, self.auto.online.shift_bytes or 0) if self.auto.online is not None else None),
        )
        self.auto.finished(outcome, first=decision.kind is StepKind.FIRST)

    def _refuse_over(self, least: Optional[int], *, lower_bound: bool = False) -> None:
        """Note [The least budget from the first step]: a budget below the least is refused now,
        the open step dropped."""
        if least is not None and self._budget_bytes is not None and least > self._budget_bytes:
            self._abort_step()
            raise InfeasibleBudgetError(budget_bytes=self._budget_bytes, min_budget_bytes=least, lower_bound=lower_bound)

    def _abort_step(self) -> None:
        """The step failed (out of memory, an exception) or is dropped: nothing of it is kept, no
        step is open, and the library's hooks are off torch's stack (Note [Hooks never outlive the
        library])."""
        self._step_open = self._in_backward = False
        self._step = None
        if self._trace is not None:
            self._trace.abort()
            self._trace = None
        self._first = None
        if self.runtime is not None and self.runtime.measuring:
            self.runtime.abort_step()

    def use_profile(self, profile: ModelProfile, batch: Optional[BatchKey], *, steady: bool = False) -> None:
        """``"auto"`` plans the next steps from ``profile`` (:meth:`AutoPlanner.adopt`)."""
        self.auto.adopt(profile, batch, steady=steady)
        self.plan = None

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
            step_fn=step_fn, segments=list(self.segments), track=tensors_in(list(track)), min_offload_bytes=self.config.min_offload_bytes,
            device=self.device, scale=True,
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

    def _warn_forced_over(self, peak: Optional[int]) -> None:
        """A forced policy with a budget it cannot meet: said once (WARNING), with the least budget
        that plan needs (its steady peak: Note [The least budget from the first step]), never silently."""
        budget, peak = self._budget_bytes, max(peak or 0, self.least_bytes or 0)
        if self.auto is not None or budget is None or not peak or peak <= budget or self._warned_over:
            return
        self._warned_over = True
        log.warning(
            "lightning-swap: policy=%r needs a budget of at least %s (%d bytes), over the budget of %s. "
            "Choose a policy that keeps less, or policy='auto', which holds the budget.", getattr(self.config.policy, "value", self.config.policy),
            format_bytes(peak), peak, format_bytes(budget),
        )

    def warn_no_budget(self) -> None:
        """Say once, as a warning (the user sees it without configuring logging), that
        ``policy="auto"`` has nothing to plan against and how to give it a budget."""
        if self._warned_no_budget:
            return
        self._warned_no_budget = True
        log.warning(
            "lightning-swap: policy='auto' has no memory budget on %s (only CUDA reports one by itself), "
            "so there is nothing to plan against and every segment is kept. Set budget_bytes to plan: "
            "%s (on CPU it is the simulated device capacity).", self.device.type, self._advice,
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
            self._abort_step()
            self.auto = self._new_planner()
        self._pinned, self._pinned_steps = False, 0

    def apply(self, plan: Plan, *, pinned: bool = False) -> Plan:
        """Install ``plan`` (replacing any installed one). A ``pinned`` plan stays whatever the
        batch (the batch-size finder's trials); :meth:`reset` unpins. A runtime of ``auto``'s takes
        a new plan in place (:meth:`SwapRuntime.retarget`)."""
        if not pinned and not self._pinned and self.runtime is not None and self.runtime.retarget(plan):
            self.plan = plan
            return plan
        self.remove()
        self._pinned, self._pinned_steps = pinned, 0
        runtime = SwapRuntime(
            self.model, plan, device=self.device, min_offload_bytes=self.config.min_offload_bytes,
            unified=self.unified, prefetch_bytes=self.config.prefetch_bytes, inflight_bytes=self.config.inflight_bytes,
            switchable=self.auto is not None and not pinned and self._budget_bytes is not None,
        )
        runtime.install()
        self.runtime, self.plan = runtime, plan
        return plan

    def _begin_step(self, track: Iterable[Any] = (), *, measure: bool = False, online: Any = None) -> None:
        """Open the step window. ``measure=True`` measures device memory even for a compiled model
        on CPU (running that step eagerly: Note [No dispatch mode under compile] in runtime.py);
        a pinned plan's first step (a batch-size finder's trial) is always measured, its later
        ones only timed (unmetered on CPU: Note [The CPU meter's cost] in runtime.py); ``online``:
        the budget held as the step runs (Note [The budget held online])."""
        if self.runtime is None:
            if self.config.is_auto:
                raise RuntimeError("policy='auto': call before_step() (or apply() a plan) before the first step")
            self.apply(self.forced_plan())
        assert self.runtime is not None
        timed_only = self._pinned and self._pinned_steps > 0
        self._pinned_steps += self._pinned
        self.runtime.begin_step(
            tensors_in(list(track)), measure=measure or (self._pinned and not timed_only), timed_only=timed_only, online=online,
        )

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
        self._abort_step()
        self._remove_optimizer_hooks()
        self.remove()
