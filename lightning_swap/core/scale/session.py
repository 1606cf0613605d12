"""What every adapter needs, in one place: options, the model's segments, the plan, the
runtime, and a measured window around each training step.

The Lightning strategies and the Accelerate plugin are thin: they hold a :class:`SwapSession`
and call :meth:`~SwapSession.begin_step` / :meth:`~SwapSession.end_step` from their hooks.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..actions import Action, allowed_actions, resolve_policy
from ..errors import is_out_of_memory
from .auto import VERDICT, AutoPlanner
from ..decide.plan import Plan
from ..engine.streams import SyncOps, Timing
from ..runtime.stats import StatsHistory, StepStats, StepRecord
from ..runtime.runtime import SwapRuntime
from ..config import SwapConfig
from ..tensors import device_budget_bytes, normalize_device, tensors_in
from ..segments import find_segments, resolve_modules
from ..engine.unified.memory import UnifiedMemory

__all__ = ["SwapSession"]


log = logging.getLogger(__name__)


def _observed_record(profile: Any) -> StepRecord:
    """The observed step as a step of the history: its peak and time, nothing moved."""
    step = Timing(SyncOps())
    step.add_ms(profile.step_ms)
    stats = StepStats(
        peak_device_bytes=profile.peak_bytes, offloaded_bytes=0, fetched_bytes=0, prefetched_bytes=0, offloaded_tensors=0,
        deduplicated_tensors=0, host_pool_bytes=0, recompute_ms=None, exposed_transfer_ms=None, step_ms=None,
    )
    return StepRecord(stats, step, Timing(SyncOps()), None, 0.0)


class SwapSession:
    """The segments, plan and runtime of one model on one device."""

    def __init__(
        self, model: nn.Module, config: SwapConfig, device: torch.device | str, *, unified: Optional[UnifiedMemory] = None
    ) -> None:
        self.model = model
        self.config = config
        self.device = normalize_device(device)
        #: Installed by the adapter before the model reached the device (``config.um``).
        self.unified = unified
        self.segments = find_segments(model, None if config.segments is None else list(config.segments))
        self.plan: Optional[Plan] = None
        self.runtime: Optional[SwapRuntime] = None
        self.last_stats: Optional[StepStats] = None
        #: Every measured step of this session, across plans (device times filled in lazily).
        self.records = StatsHistory()
        self._profile = None
        self._pinned = False
        self._warned_no_budget = False
        #: ``policy="auto"``'s decisions (Note [Auto: observe, plan, check]); ``None`` for a forced policy.
        self.auto = AutoPlanner(self) if config.is_auto else None

    @property
    def profile(self):
        """The :class:`~lightning_swap.core.measure.profiler.ModelProfile` behind the plan (``None``
        before one was made): the observed step's for ``"auto"``, else the last :meth:`measure`."""
        if self.auto is not None and self.auto.profile is not None:
            return self.auto.profile
        return self._profile

    @profile.setter
    def profile(self, value) -> None:
        self._profile = value

    @property
    def modules(self) -> dict[str, nn.Module]:
        """The segments' modules by name."""
        return resolve_modules(self.model, self.segments)  # canonical names, compiled or not

    @property
    def observing(self) -> bool:
        """Whether this step is being observed for ``"auto"``'s profile (Note [Observe, do not re-run])."""
        return self.auto is not None and self.auto.observing is not None

    # -- one training step, as the adapters drive it ----------------------------------------
    def before_step(
        self, batch: Any, track: Any, states: Any, *, is_main: bool = True,
        plan_on_main: Callable[[Callable[[], Plan]], Plan] = lambda solve: solve(), measure: bool = False,
    ) -> str:
        """Before a training step's forward: observe it, (re-)plan, or open the installed plan's
        window. ``track``: what is alive besides the model (the batch, ``states``);
        ``states``: the optimizer states; ``plan_on_main(solve)`` runs ``solve`` on the main
        process and hands every process its result (or raises its error everywhere); ``measure``:
        as :meth:`begin_step`'s. Returns what the step does: ``"observe"``, ``"plan"`` or ``"run"``."""
        kind = "run"
        if self.auto is not None and not self._pinned:
            kind = self.auto.kind(batch, states)
            if kind == VERDICT:  # Note [Observe only what fits]: rank 0 decides for every rank
                self.auto.take_verdict(plan_on_main(lambda: self.auto.guard_verdict(states)))
                kind = self.auto.kind(batch, states)
                if kind == "run" and self.plan is not None:  # the lowest-memory plan stays: its peak is measured
                    least, batch_size = self.auto.guard_measured
                    self.plan = replace(self.plan, predicted_peak_bytes=least, budget_bytes=self.budget_bytes(), batch_size=batch_size)
            if kind == "guard":
                self.apply(self.auto.begin_guard(batch, states))
                self.begin_step(track, measure=True)
                return kind
            if kind == "observe":  # the other processes run the same step plainly
                self.auto.begin_observe(batch, track, states, is_main=is_main)
                return kind
            if kind == "plan":
                plan = plan_on_main(lambda: self.auto.plan(states))
                if plan != self.plan:  # by value: other processes get a new object each time
                    self.apply(plan)
                self.auto.applied(plan, states)
        self.begin_step(track, measure=measure)
        return kind

    def backward_begins(self) -> None:
        """The loss exists and its backward is about to run."""
        if self.observing:
            self.auto.observing.backward_begins()

    def step_done(self) -> None:
        """The whole step (optimizer step included) is over: an observed step becomes the profile,
        a guard step's measurements bound plain's peak (Note [Observe only what fits])."""
        if self.auto is not None and self.auto.guarding and self.runtime is not None:
            stats = self.records.newest()
            measured = self.runtime.measured_plan(wait=True)
            self.auto.end_guard(stats.peak_device_bytes if stats is not None else None, measured.rows if measured else None)
            if measured is not None:
                self.plan = measured
        if self.observing:
            try:
                profile = self.auto.finish_observe()
            finally:
                self.auto.abort_observe()
            self.records.add(_observed_record(profile))

    def abort_step(self) -> None:
        """The step failed (out of memory, an exception): nothing observed is kept."""
        if self.auto is not None:
            self.auto.abort_observe()
        if self.runtime is not None and self.runtime.measuring:
            self.runtime.abort_step()

    @property
    def pinned(self) -> bool:
        """Whether the installed plan was applied with ``pinned=True`` (kept whatever the batch)."""
        return self._pinned

    def forced_plan(self) -> Plan:
        if self.config.is_auto:
            raise RuntimeError("policy='auto' has no forced plan: its plans come from before_step()")
        return Plan(actions=resolve_policy(self.config.policy, self.segments), budget_bytes=self.config.budget_bytes)

    def budget_bytes(self) -> Optional[int]:
        """The budget the planner works to: the configured one, else what the CUDA device has."""
        return self.config.budget_bytes if self.config.budget_bytes is not None else device_budget_bytes(self.device)

    def measure(self, batch: Any, step_fn: Callable[[nn.Module, Any], Any], track: Iterable[Any] = ()):
        """Profile one plain step on ``batch`` (the runtime is removed first); scalable in batch size.

        On CUDA a step that does not fit is profiled in fake mode instead (memory exact, times
        estimated: Note [Fake-mode times are estimates])."""
        from ..measure.profiler import profile

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
            measured = profile(self.model, batch, **kwargs)
        except Exception as exc:  # noqa: BLE001
            if not is_out_of_memory(exc):
                raise
            log.info("plain step does not fit on %s; profiling in fake mode", self.device)
            torch.cuda.empty_cache()
            measured = profile(self.model, batch, fake=True, **kwargs)
        self._profile = measured
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
        """The actions the planner may use: all for ``"auto"``, the one for a single forced action.

        A per-segment mapping cannot be re-planned at another batch size: ``ValueError``
        (:func:`~lightning_swap.core.actions.allowed_actions`)."""
        return allowed_actions(self.config.policy)

    def reset(self) -> None:
        """Remove the runtime and forget the plan and the steps measured so far (a batch-size
        search's trials): the next step plans afresh."""
        self.remove()
        self.records.clear()
        self.plan = None
        if self.auto is not None:
            self.auto.abort_observe()
            self.auto = AutoPlanner(self, grads_freed_before_backward=self.auto.grads_freed_before_backward)
        self._pinned = False

    def apply(self, plan: Plan, *, pinned: bool = False) -> Plan:
        """Install ``plan`` (replacing any installed one). A ``pinned`` plan stays whatever the
        batch (the batch-size finder's trials); :meth:`reset` unpins."""
        self.remove()
        self._pinned = pinned
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
        if self.config.log_plan:
            log.info("lightning-swap plan (%s):\n%s", plan.summary(), plan.render())
        return plan

    def begin_step(self, track: Iterable[Any] = (), *, measure: bool = False) -> None:
        """Open the step window. ``measure=True`` measures device memory even for a compiled model
        on CPU (running that step eagerly: Note [No dispatch mode under compile] in runtime.py);
        a pinned plan's steps (the batch-size finder's trials) are always measured."""
        if self.runtime is None:
            if self.config.is_auto:
                raise RuntimeError("policy='auto': call before_step() (or apply() a plan) before the first step")
            self.apply(self.forced_plan())
        assert self.runtime is not None
        # The budget check reads the plan's first step's peak (AutoPlanner.plan): it is measured.
        checked = self.auto is not None and self.auto._check_pending
        self.runtime.begin_step(tensors_in(list(track)), measure=measure or self._pinned or checked)

    def backward_done(self) -> None:
        """The loss's backward is over (what follows, the optimizer step, is its own window in
        an observed step)."""
        if self.auto is not None and self.auto.guarding and self.runtime is not None and self.runtime.measuring:
            self.auto.guard_backward_done(self.runtime.meter.peak_bytes)
        if self.observing and not self.auto.observing.backward_over:
            self.auto.observing.backward_done()

    def end_step(self) -> Optional[StepStats]:
        """The step is over (adapters call it after the optimizer step when they can, else
        after the backward): its statistics (``None`` when no window was open)."""
        if self.observing:
            self.backward_done()
            return None
        if self.runtime is None or not self.runtime.measuring:
            return None
        self.last_stats = self.runtime.end_step()
        self.records.add(self.runtime.records.newest_record())
        return self.last_stats

    def stats(self, *, wait: bool = False) -> Optional[StepStats]:
        """The newest step whose device times are known; ``wait=True`` (outside a step) waits
        for the last one."""
        return self.records.latest(wait=wait)

    def remove(self) -> None:
        if self.runtime is not None:
            self.runtime.remove()
            self.runtime = None

    close = remove
