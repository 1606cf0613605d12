"""Which actions the planner may use under a policy (``lightning_swap.core.actions.allowed_actions``)."""

from __future__ import annotations

import pytest

from lightning_swap.core.actions import AUTO, Action, allowed_actions


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (AUTO, None),
        (" Auto ", None),
        ("offload", (Action.OFFLOAD,)),
        ("RECOMPUTE_OFFLOAD", (Action.RECOMPUTE_OFFLOAD,)),
        (Action.SELECTIVE, (Action.SELECTIVE,)),
    ],
)
def test_allowed_actions(policy, expected):
    assert allowed_actions(policy) == expected


def test_a_per_segment_mapping_cannot_be_searched():
    with pytest.raises(ValueError, match="`policy`: a per-segment mapping fixes the plan"):
        allowed_actions({"blocks.0": "offload"})


def test_a_bad_policy_names_the_field():
    with pytest.raises(ValueError, match="`policy` got 'swap'; allowed"):
        allowed_actions("swap")


def test_the_session_asks_the_same_function():
    from torch import nn

    from lightning_swap.core.config import SwapConfig
    from lightning_swap.core.scale.session import SwapSession

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for policy in (AUTO, "recompute"):
        assert SwapSession(model, SwapConfig(policy=policy), "cpu").allowed_actions() == allowed_actions(policy)
