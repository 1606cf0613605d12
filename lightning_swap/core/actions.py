"""What the runtime can do with one segment of a model, and how a user names it.

An :class:`Action` is chosen per segment, by hand (a forced ``policy``) or by the planner.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Optional, Union

from .segments import canonical_name, split_call

__all__ = ["AUTO", "Action", "PolicyLike", "allowed_actions", "resolve_policy"]

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
    ``ValueError``. Any other value is parsed as an action (``ValueError`` naming ``policy``).
    """
    if isinstance(policy, str) and policy.strip().lower() == AUTO:
        return None
    if isinstance(policy, Mapping):
        raise ValueError(
            "`policy`: a per-segment mapping fixes the plan, so the batch-size search cannot re-plan "
            "it; use policy='auto' or a single action."
        )
    return (Action.parse(policy, field="policy"),)
