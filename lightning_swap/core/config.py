"""The options every front end shares, in one table: :class:`SwapConfig`, its defaults and validators.

Note [One option table]: the Lightning strategies' signatures, the Accelerate plugin's fields, its
environment variables and YAML keys, and the CLI flags are all derived from (or checked against)
``SwapConfig``'s fields, so an option cannot be missing from one entry point. Constructing a config
has no side effect: installing unified memory is the adapters' business
(:func:`~lightning_swap.core.engine.unified.memory.install_unified_memory`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from .actions import AUTO, Action, PolicyLike
from .segments import SegmentSpec
from .units import ByteSize, parse_bytes

__all__ = [
    "DEFAULT_MIN_OFFLOAD_BYTES", "SwapConfig", "UMMode", "check_inflight_segments", "check_min_offload_bytes",
    "check_um_max_bytes", "check_window_bytes",
]


#: Tensors smaller than this stay on the device: copying them costs more than it frees.
DEFAULT_MIN_OFFLOAD_BYTES = 1 << 14


def check_inflight_segments(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"`inflight_segments` must be an int >= 0 (segments whose copies to the host may still run "
            f"while later segments compute); got {value!r}."
        )
    return value


def check_window_bytes(value: Any, field: str) -> Optional[int]:
    """A copy window in bytes (Note [Copy windows in bytes] in ``engine/offload.py``), or ``None``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{field}` must be an int >= 0 (bytes) or None; got {value!r}.")
    return value


def check_min_offload_bytes(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`min_offload_bytes` must be an int >= 0 (bytes); got {value!r}.")
    return value


class UMMode(str, enum.Enum):
    OFF = "off"
    OFFLOAD = "offload"
    ALL = "all"

    @classmethod
    def parse(cls, value: Any, field: str = "um") -> "UMMode":
        if isinstance(value, UMMode):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"`{field}` got {value!r}; allowed: {allowed}.")


def check_um_max_bytes(value: Any, field: str = "um_max_bytes") -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"`{field}` must be a positive int (bytes of managed memory) or None (the device's free "
            f"memory when unified memory is installed); got {value!r}."
        )
    return value


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
    #: Bytes backward fetches ahead of need (``0``: each saved tensor when it is needed, as
    #: ``save_on_cpu`` does), instead of whole segments; e.g. ``"64MiB"``. ``None``: chosen by the
    #: planner from the measured bandwidth under ``policy="auto"`` (unless ``prefetch_segments``
    #: is set), else ``prefetch_segments`` (Note [Copy windows in bytes] in ``engine/offload.py``).
    prefetch_bytes: Optional[ByteSize] = None
    #: Bytes of copies to the host that may still run while the forward goes on (``0``: each is
    #: waited for when issued), instead of whole segments; ``None`` as for ``prefetch_bytes``.
    inflight_bytes: Optional[ByteSize] = None
    #: Log the plan table when a plan is applied.
    log_plan: bool = field(default=True)
    #: CUDA unified memory: ``"off"``, ``"offload"`` (offloaded activations in managed host
    #: buffers, prefetched before their backward) or ``"all"`` (every CUDA allocation managed);
    #: a name (case-insensitive) or a :class:`UMMode`, stored as the ``UMMode`` (a ``str`` enum:
    #: ``config.um == "all"`` holds).
    um: UMMode | str = UMMode.OFF
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
        for name, allow_none, minimum in (
            ("min_offload_bytes", False, 0), ("budget_bytes", True, 1), ("um_max_bytes", True, 1), ("prefetch_bytes", True, 0),
            ("inflight_bytes", True, 0),
        ):
            object.__setattr__(self, name, parse_bytes(getattr(self, name), field=name, allow_none=allow_none, minimum=minimum))
        check_inflight_segments(self.inflight_segments)
        p = self.prefetch_segments
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 0):
            raise ValueError(f"`prefetch_segments` must be an int >= 0 or None; got {p!r}.")
        um = UMMode.parse(self.um)
        object.__setattr__(self, "um", um)
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
