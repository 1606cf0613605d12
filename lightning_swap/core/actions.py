"""What the runtime can do with one segment of a model, and how a user names it.

An :class:`Action` is chosen per segment, by hand (a forced ``policy``) or by the planner.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

from .segments import canonical_name, split_call

__all__ = ["AUTO", "Action", "PolicyLike", "allowed_actions", "parse_policy", "policy_from_text", "resolve_policy"]

#: The policy that profiles the first batch and lets the planner choose.
AUTO = "auto"


class Action(enum.Enum):
    """One segment's treatment of the activations it saves for backward."""

    #: Saved tensors stay on the device (plain training).
    KEEP = "keep"
    #: Saved tensors are copied to host memory in forward and brought back for backward.
    OFFLOAD = "offload"
    #: The segment is checkpointed: only its input is kept, the rest is recomputed.
    RECOMPUTE = "recompute"
    #: Checkpointed, but outputs of compute-heavy ops (matmul, conv, attention) are kept.
    SELECTIVE = "selective"
    #: Checkpointed, and the kept input itself goes to host memory until its recompute.
    RECOMPUTE_OFFLOAD = "recompute_offload"

    @property
    def recomputes(self) -> bool:
        return self in (Action.RECOMPUTE, Action.SELECTIVE, Action.RECOMPUTE_OFFLOAD)

    @property
    def offloads(self) -> bool:
        return self in (Action.OFFLOAD, Action.RECOMPUTE_OFFLOAD)

    @classmethod
    def parse(cls, value: Union[str, "Action"], *, field: str = "policy") -> "Action":
        """An ``Action`` from itself or its name, case-insensitive; else ``ValueError`` naming ``field``."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for action in cls:
                if action.value == key:
                    return action
        allowed = ", ".join(repr(a.value) for a in cls)
        raise ValueError(f"`{field}` got {value!r}; allowed: an Action or one of {allowed}.")


PolicyLike = Union[str, Action, Mapping[str, Union[str, Action]]]


def _refuse_policy(value: Any, field: str) -> ValueError:
    actions = ", ".join(repr(a.value) for a in Action)
    return ValueError(
        f"`{field}` got {value!r}; allowed: 'auto' (the planner chooses), one action for every segment (an Action or "
        f"one of {actions}, case-insensitive), or a mapping from segment name to action (as text "
        "'segment.name=action,other.name=action')."
    )


def parse_policy(value: Any, *, field: str = "policy") -> PolicyLike:
    """A policy as every front end takes it, normalized: :data:`AUTO`, one :class:`Action`, or a
    ``dict`` from segment name to ``Action`` (segments left out are kept). The one place a
    policy is parsed; a ``ValueError`` names ``field`` and the forms allowed."""
    if isinstance(value, Mapping):
        for name in value:
            if not isinstance(name, str):
                raise ValueError(f"`{field}` keys must be segment names (str); got {name!r}.")
        return {name: Action.parse(action, field=f"{field}[{name!r}]") for name, action in value.items()}
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        return Action.parse(value, field=field)
    except ValueError:
        raise _refuse_policy(value, field) from None


def policy_from_text(value: Any, field: str = "policy") -> Any:
    """A per-segment policy written as text (an environment variable, a command-line flag):
    ``name=action,name=action`` as a mapping; any other value as it is, for :func:`parse_policy`."""
    if not isinstance(value, str) or "=" not in value:
        return value
    pairs = [item.partition("=") for item in value.split(",") if item.strip()]
    if not pairs or any(not name.strip() or not action.strip() for name, _, action in pairs):
        raise _refuse_policy(value, field)
    return {name.strip(): action.strip() for name, _, action in pairs}


def resolve_policy(policy: PolicyLike, segment_names: Sequence[str]) -> dict[str, Action]:
    """Expand a forced policy into one action per segment.

    A single action applies to every segment; a mapping names segments, and the ones it
    leaves out are kept. Names the model does not have are an error listing them.
    """
    if isinstance(policy, Mapping):
        # Keys copied from a compiled model's named_modules() carry ``_orig_mod``: segment
        # names never do (Note [Canonical segment names] in segments.py).
        canonical = {name: canonical_name(name) if isinstance(name, str) else name for name in policy}
        known = set(segment_names)  # and a call of one (``name#k``: Note [A segment per call] in segments.py)
        unknown = sorted(
            name for name in policy if canonical[name] not in known and split_call(str(canonical[name]))[0] not in known
        )
        if unknown:
            raise ValueError(
                f"`policy` names segments the model does not have: {unknown}; "
                f"segments are: {list(segment_names)}."
            )
        actions = {name: Action.KEEP for name in segment_names}
        for name, value in policy.items():
            actions[canonical[name]] = Action.parse(value, field=f"policy[{name!r}]")
        return actions
    action = Action.parse(policy, field="policy")
    return {name: action for name in segment_names}


def allowed_actions(policy: PolicyLike) -> Optional[tuple[Action, ...]]:
    """The actions the planner may use under ``policy``: all (``None``) for ``"auto"``, the one
    for a single forced action.

    A per-segment mapping fixes the plan, so it cannot be re-planned at another batch size:
    ``ValueError``. Any other value is parsed by :func:`parse_policy` (``ValueError`` naming ``policy``).
    """
    policy = parse_policy(policy)
    if isinstance(policy, Mapping):
        raise ValueError(
            "`policy`: a per-segment mapping fixes the plan, so the batch-size search cannot re-plan "
            "it; use policy='auto' or a single action."
        )
    return None if policy == AUTO else (policy,)
