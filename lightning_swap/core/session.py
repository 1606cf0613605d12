"""What every adapter needs, in one place: options, the model's segments, the plan, the
runtime, and a measured window around each training step.

The Lightning strategies and the Accelerate plugin are thin: they hold a :class:`SwapSession`
and call :meth:`~SwapSession.begin_step` / :meth:`~SwapSession.end_step` from their hooks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
from torch import nn

from .actions import Action, PolicyLike, resolve_policy
from .plan import Plan
from .runtime import DEFAULT_MIN_OFFLOAD_BYTES, StepStats, SwapRuntime, check_min_offload_bytes
from .segments import SegmentSpec, find_segments

__all__ = ["SwapConfig", "SwapSession", "tensors_in"]

log = logging.getLogger(__name__)


def _check_budget(value: Any, field_name: str = "budget_bytes") -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{field_name}` must be a positive int (bytes) or None; got {value!r}.")
    return value


@dataclass(frozen=True, kw_only=True)
class SwapConfig:
    """Options shared by every front end (strategy, plugin)."""

    #: An action name (case-insensitive), an :class:`Action`, or a mapping from segment name
    #: to action (segments left out are kept).
    policy: PolicyLike = "keep"
    #: ``None`` finds repeated blocks; or module classes / qualified names.
    segments: SegmentSpec = None
    #: Saved tensors smaller than this are never offloaded.
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES
    #: The device memory budget for the planner (on CPU: the simulated capacity).
    budget_bytes: Optional[int] = None
    #: How many segments ahead backward prefetches; ``None``: 1 on CUDA, 0 on CPU.
    prefetch_segments: Optional[int] = None
    #: Log the plan table when a plan is applied.
    log_plan: bool = field(default=True)

    def __post_init__(self) -> None:
        policy = self.policy
        if isinstance(policy, Mapping):
            for name, value in policy.items():
                if not isinstance(name, str):
                    raise ValueError(f"`policy` keys must be segment names (str); got {name!r}.")
                Action.parse(value, field=f"policy[{name!r}]")
            object.__setattr__(self, "policy", dict(policy))
        else:
            object.__setattr__(self, "policy", Action.parse(policy, field="policy"))
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
        check_min_offload_bytes(self.min_offload_bytes)
        _check_budget(self.budget_bytes)
        p = self.prefetch_segments
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 0):
            raise ValueError(f"`prefetch_segments` must be an int >= 0 or None; got {p!r}.")

    def with_options(self, **changes: Any) -> "SwapConfig":
        """A copy with some options changed (validated again)."""
        return replace(self, **changes)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside a (nested) batch or optimizer state."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)
        elif hasattr(item, "__dataclass_fields__"):
            stack.extend(getattr(item, f) for f in item.__dataclass_fields__)
    return out


class SwapSession:
    """The segments, plan and runtime of one model on one device."""

    def __init__(self, model: nn.Module, config: SwapConfig, device: torch.device | str) -> None:
        self.model = model
        self.config = config
        self.device = torch.device(device)
        self.segments = find_segments(model, None if config.segments is None else list(config.segments))
        self.plan: Optional[Plan] = None
        self.runtime: Optional[SwapRuntime] = None
        self.last_stats: Optional[StepStats] = None

    def forced_plan(self) -> Plan:
        return Plan(actions=resolve_policy(self.config.policy, self.segments), budget_bytes=self.config.budget_bytes)

    def apply(self, plan: Plan) -> Plan:
        """Install ``plan`` (replacing any installed one)."""
        self.remove()
        runtime = SwapRuntime(
            self.model,
            plan,
            device=self.device,
            min_offload_bytes=self.config.min_offload_bytes,
            prefetch_segments=self.config.prefetch_segments,
        )
        runtime.install()
        self.runtime, self.plan = runtime, plan
        if self.config.log_plan:
            log.info("lightning-swap plan (%s):\n%s", plan.summary(), plan.render())
        return plan

    def begin_step(self, track: Iterable[Any] = ()) -> None:
        if self.runtime is None:
            self.apply(self.forced_plan())
        assert self.runtime is not None
        self.runtime.begin_step(tensors_in(list(track)))

    def end_step(self) -> Optional[StepStats]:
        if self.runtime is None or not self.runtime.measuring:
            return None
        self.last_stats = self.runtime.end_step()
        return self.last_stats

    def remove(self) -> None:
        if self.runtime is not None:
            self.runtime.remove()
            self.runtime = None

    close = remove
