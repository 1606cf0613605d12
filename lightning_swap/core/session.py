"""What every adapter needs, in one place: options, the model's segments, the plan, the
runtime, and a measured window around each training step.

The Lightning strategies and the Accelerate plugin are thin: they hold a :class:`SwapSession`
and call :meth:`~SwapSession.begin_step` / :meth:`~SwapSession.end_step` from their hooks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
from torch import nn

from .actions import AUTO, Action, PolicyLike, allowed_actions, resolve_policy
from .errors import is_out_of_memory
from .auto import AutoPlanner
from .plan import Plan
from .streams import SyncOps, Timing
from .runtime import (
    DEFAULT_MIN_OFFLOAD_BYTES, StatsHistory, StepStats, SwapRuntime, _StepRecord, _normalize_device, check_inflight_segments, tensors_in,
)
from .segments import SegmentSpec, find_segments, resolve_modules
from .unified import UMMode, UnifiedMemory, install_unified_memory
from .units import ByteSize, parse_bytes

__all__ = ["AUTO", "SwapConfig", "SwapSession", "device_budget_bytes", "tensors_in"]

#: Held back from the free device memory when no budget is given (allocator fragmentation,
#: CUDA context growth, what the model does not predict).
CUDA_BUDGET_MARGIN = 0.10


def device_budget_bytes(device: torch.device) -> Optional[int]:
    """What this process may use on a CUDA device: free memory plus what torch already holds,
    less :data:`CUDA_BUDGET_MARGIN`; ``None`` on other devices (a budget must be given)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int((free + torch.cuda.memory_reserved(device)) * (1 - CUDA_BUDGET_MARGIN))


def _batch_key(batch: Any) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tensors_in(batch))


def _state_bytes(model: nn.Module, track: Any) -> int:
    """Bytes of what a step starts with besides the batch: gradients and optimizer state.

    Note [Re-plan when the optimizer state appears]: the first step runs before the optimizer
    has state (momentum, Adam moments) and before gradients exist; from the second step on
    both are alive during the forward. An auto plan is re-made when this total grows.
    """
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    return grads + sum(t.untyped_storage().nbytes() for t in tensors_in(track))

log = logging.getLogger(__name__)


def _observed_record(profile: Any) -> _StepRecord:
    """The observed step as a step of the history: its peak and time, nothing moved."""
    step = Timing(SyncOps())
    step.add_ms(profile.step_ms)
    stats = StepStats(
        peak_device_bytes=profile.peak_bytes, offloaded_bytes=0, fetched_bytes=0, prefetched_bytes=0, offloaded_tensors=0,
        deduplicated_tensors=0, host_pool_bytes=0, recompute_ms=None, exposed_transfer_ms=None, step_ms=None,
    )
    return _StepRecord(stats, step, Timing(SyncOps()), None, 0.0)


def _check_budget(value: Any, field_name: str = "budget_bytes") -> Optional[int]:
    """Kept for old imports: :func:`~lightning_swap.core.units.parse_bytes` for a budget."""
    return parse_bytes(value, field=field_name, allow_none=True)


@dataclass(frozen=True, kw_only=True)
class SwapConfig:
    """Options shared by every front end (strategy, plugin).

    Byte options take an ``int`` or a size string (``"12GiB"``, ``"500MB"``; the forms of
    :func:`~lightning_swap.core.units.parse_bytes`) and are stored as ``int``. None takes a
    fraction of device memory (Note [No fraction of device memory] in ``core/units.py``): for
    80% of a GPU pass ``budget_bytes=int(0.8 * torch.cuda.get_device_properties(0).total_memory)``.
    """

    #: ``"auto"`` (profile the first batch, let the planner choose under ``budget_bytes``), an
    #: action name (case-insensitive), an :class:`Action`, or a mapping from segment name to
    #: action (segments left out are kept).
    policy: PolicyLike = AUTO
    #: ``None`` finds repeated blocks; or module classes / qualified names.
    segments: SegmentSpec = None
    #: Saved tensors smaller than this are never offloaded (bytes, >= 0; e.g. ``"16KiB"``).
    min_offload_bytes: ByteSize = DEFAULT_MIN_OFFLOAD_BYTES
    #: The device memory budget for the planner (on CPU: the simulated capacity); bytes, e.g.
    #: ``12 << 30`` or ``"12GiB"``. ``None``: on CUDA the free memory less a margin.
    budget_bytes: Optional[ByteSize] = None
    #: How many segments ahead backward prefetches; ``None``: 1 on CUDA, 0 on CPU.
    prefetch_segments: Optional[int] = None
    #: How many segments' copies to the host may still run while later segments compute
    #: (Note [Stream protocol], rule 2); 0 waits for each segment's copies before the next.
    inflight_segments: int = 1
    #: Log the plan table when a plan is applied.
    log_plan: bool = field(default=True)
    #: CUDA unified memory: ``"off"``, ``"offload"`` (offloaded activations in managed host
    #: buffers, prefetched before their backward) or ``"all"`` (every CUDA allocation managed).
    um: str = "off"
    #: Cap on managed memory in bytes (only with ``um`` on); ``None``: the device's free memory.
    um_max_bytes: Optional[ByteSize] = None

    def __post_init__(self) -> None:
        policy = self.policy
        if isinstance(policy, Mapping):
            for name, value in policy.items():
                if not isinstance(name, str):
                    raise ValueError(f"`policy` keys must be segment names (str); got {name!r}.")
                Action.parse(value, field=f"policy[{name!r}]")
            object.__setattr__(self, "policy", dict(policy))
        elif isinstance(policy, str) and policy.strip().lower() == AUTO:
            object.__setattr__(self, "policy", AUTO)
        else:
            try:
                object.__setattr__(self, "policy", Action.parse(policy, field="policy"))
            except ValueError as err:
                raise ValueError(f"{err} Or 'auto' to let the planner choose.") from None
        segments = self.segments
        if segments is not None:
            if isinstance(segments, (str, type)):
                segments = [segments]
            if not isinstance(segments, Iterable) or not list(segments):
                raise ValueError(
                    f"`segments` got {self.segments!r}; allowed: None (automatic) or a non-empty list "
                    "of module classes or qualified module names."
                )
            object.__setattr__(self, "segments", tuple(segments))
        for name, allow_none, minimum in (("min_offload_bytes", False, 0), ("budget_bytes", True, 1), ("um_max_bytes", True, 1)):
            object.__setattr__(self, name, parse_bytes(getattr(self, name), field=name, allow_none=allow_none, minimum=minimum))
        check_inflight_segments(self.inflight_segments)
        p = self.prefetch_segments
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 0):
            raise ValueError(f"`prefetch_segments` must be an int >= 0 or None; got {p!r}.")
        um = UMMode.parse(self.um)
        object.__setattr__(self, "um", um.value)
        if um is UMMode.OFF and self.um_max_bytes is not None:
            raise ValueError(
                f"`um_max_bytes` caps unified memory and applies only with um='offload' or um='all'; got "
                f"um_max_bytes={self.um_max_bytes!r} with um='off'."
            )

    def with_options(self, **changes: Any) -> "SwapConfig":
        """A copy with some options changed (validated again)."""
        return replace(self, **changes)

    @property
    def is_auto(self) -> bool:
        return self.policy == AUTO

    def install_unified_memory(self, device: torch.device | str) -> Optional[UnifiedMemory]:
        """Install ``um`` on ``device`` (``None`` when off). Adapters call it before the model
        reaches the device: ``um="all"`` must precede the first CUDA allocation."""
        return install_unified_memory(self.um, device, max_bytes=self.um_max_bytes)


class SwapSession:
    """The segments, plan and runtime of one model on one device."""

    def __init__(
        self, model: nn.Module, config: SwapConfig, device: torch.device | str, *, unified: Optional[UnifiedMemory] = None
    ) -> None:
        self.model = model
        self.config = config
        self.device = _normalize_device(device)
        #: Installed by the adapter before the model reached the device (``config.um``).
        self.unified = unified
        self.segments = find_segments(model, None if config.segments is None else list(config.segments))
        self.plan: Optional[Plan] = None
        self.runtime: Optional[SwapRuntime] = None
        self.last_stats: Optional[StepStats] = None
        #: Every measured step of this session, across plans (device times filled in lazily).
        self.records = StatsHistory()
        self._profile = None
        self._planned_for: Optional[tuple] = None
        self._planned_state: Optional[int] = None
        self._pinned = False
        self._warned_no_budget = False
        #: ``policy="auto"``'s decisions (Note [Auto: observe, plan, check]); ``None`` for a forced policy.
        self.auto = AutoPlanner(self) if config.is_auto else None

    @property
    def profile(self):
        """The :class:`~lightning_swap.core.profiler.ModelProfile` behind the plan (``None``
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
            if kind == "observe":  # the other processes run the same step plainly
                self.auto.begin_observe(batch, track, states, is_main=is_main)
                return kind
            if kind == "plan":
                plan = plan_on_main(lambda: self.auto.plan(states))
                if plan is not self.plan:
                    self.apply(plan)
                self.auto.applied(plan, states)
        self.begin_step(track, measure=measure)
        return kind

    def backward_begins(self) -> None:
        """The loss exists and its backward is about to run."""
        if self.observing:
            self.auto.observing.backward_begins()

    def step_done(self) -> None:
        """The whole step (optimizer step included) is over: an observed step becomes the profile."""
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
            raise RuntimeError("policy='auto' has no forced plan; use plan_for_batch()")
        return Plan(actions=resolve_policy(self.config.policy, self.segments), budget_bytes=self.config.budget_bytes)

    def budget_bytes(self) -> Optional[int]:
        """The budget the planner works to: the configured one, else what the CUDA device has."""
        return self.config.budget_bytes if self.config.budget_bytes is not None else device_budget_bytes(self.device)

    def needs_plan(self, batch: Any) -> bool:
        """Whether :meth:`plan_for_batch` must run before this batch (none yet, or, for an auto
        policy, a batch of another shape than the plan was made for)."""
        if self.plan is None:
            return True
        if self._pinned:
            return False
        return self.config.is_auto and _batch_key(batch) != self._planned_for

    def state_changed(self, track: Any) -> bool:
        """Note [Re-plan when the optimizer state appears]: only growth counts, so gradient
        accumulation (gradients present in some micro-steps, not others) does not re-profile."""
        if not self.config.is_auto or self.budget_bytes() is None or self._planned_state is None:
            return False
        return _state_bytes(self.model, track) > self._planned_state

    def measure(self, batch: Any, step_fn: Callable[[nn.Module, Any], Any], track: Iterable[Any] = ()):
        """Profile one plain step on ``batch`` (the runtime is removed first); scalable in batch size.

        On CUDA a step that does not fit is profiled in fake mode instead (memory exact, times
        estimated: Note [Fake-mode times are estimates])."""
        from .profiler import profile

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

    def plan_for_batch(self, batch: Any, step_fn: Callable[[nn.Module, Any], Any], track: Iterable[Any] = ()) -> Plan:
        """The plan for this batch: the forced one, or for ``"auto"`` the planner's under the
        budget (all segments kept when no budget is known: CPU without ``budget_bytes``).

        Only a batch of new shape is profiled again; a new batch size alone rescales the profile.
        """
        from .solver import solve
        from .profiler import _infer_batch_size

        if not self.config.is_auto:
            return self.forced_plan()
        budget = self.budget_bytes()
        if budget is None:
            self.warn_no_budget()
            return Plan(actions={name: Action.KEEP for name in self.segments})
        key = _batch_key(batch)
        previous = self._planned_for
        same_but_batch = (
            self.profile is not None
            and previous is not None
            and len(previous) == len(key)
            and all(a[0][1:] == b[0][1:] and a[1] == b[1] for a, b in zip(previous, key))
        )
        if not same_but_batch or _state_bytes(self.model, track) > (self._planned_state or 0):
            self.measure(batch, step_fn, track)
        plan = solve(self.profile, budget_bytes=budget, batch_size=_infer_batch_size(batch))
        return plan

    def mark_planned(self, batch: Any, track: Any = ()) -> None:
        self._planned_for = _batch_key(batch)
        self._planned_state = _state_bytes(self.model, track)

    def allowed_actions(self) -> Optional[tuple[Action, ...]]:
        """The actions the planner may use: all for ``"auto"``, the one for a single forced action.

        A per-segment mapping cannot be re-planned at another batch size: ``ValueError``
        (:func:`~lightning_swap.core.actions.allowed_actions`)."""
        return allowed_actions(self.config.policy)

    def record_plain_timeline(self, batch: Any, step_fn: Callable[[nn.Module, Any], Any], track: Iterable[Any] = ()):
        """A :class:`~lightning_swap.core.timeline.Timeline` of one plain step (every segment
        kept) on ``batch``; the model's gradients, buffers and RNG are restored afterwards and
        the current plan is applied again. ``None`` if the plain step does not fit (CUDA)."""
        from .meter import DeviceMemoryMeter
        from .profiler import _loss_of, _Snapshot
        from .timeline import TimelineRecorder

        plan = self.plan
        pinned = self._pinned
        self.remove()
        try:
            with _Snapshot(self.model, self.device):
                meter = DeviceMemoryMeter(self.device)
                with meter:
                    static = [*self.model.parameters(), *self.model.buffers()]
                    static += [p.grad for p in self.model.parameters() if p.grad is not None]
                    meter.track([*static, *tensors_in([batch, list(track)])])
                    del static
                    recorder = TimelineRecorder(self.model, self.segments, meter, "plain (all kept)")
                    with recorder:
                        _loss_of(step_fn(self.model, batch)).backward()
                return recorder.timeline
        except Exception as exc:  # noqa: BLE001
            if not is_out_of_memory(exc):
                raise
            log.info("the plain step does not fit on %s: no plain timeline", self.device)
            return None
        finally:
            if plan is not None:
                self.apply(plan, pinned=pinned)

    def reset(self) -> None:
        """Remove the runtime and forget the plan and the steps measured so far (a batch-size
        search's trials): the next step plans afresh."""
        self.remove()
        self.records.clear()
        self.plan = None
        if self.auto is not None:
            self.auto.abort_observe()
            self.auto = AutoPlanner(self, grads_freed_before_backward=self.auto.grads_freed_before_backward)
        self._planned_for = None
        self._planned_state = None
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
                raise RuntimeError("policy='auto': call before_step() (or plan_for_batch() and apply()) before the first step")
            self.apply(self.forced_plan())
        assert self.runtime is not None
        # The budget check reads the plan's first step's peak (AutoPlanner.plan): it is measured.
        checked = self.auto is not None and self.auto._check_pending
        self.runtime.begin_step(tensors_in(list(track)), measure=measure or self._pinned or checked)

    def backward_done(self) -> None:
        """The loss's backward is over (what follows, the optimizer step, is its own window in
        an observed step)."""
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
