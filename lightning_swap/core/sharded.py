"""Sharded models (FSDP2's ``fully_shard``, FSDP1's ``FullyShardedDataParallel``): what the
runtime and the meter need to know about them.

Note [Sharded state is local]: under FSDP2 a module's parameters are ``DTensor`` shards
between steps (their gradients and optimizer state too); the bytes this process holds are
each one's local tensor (:func:`~lightning_swap.core.tensors.local_tensor`). During a unit's
forward and backward FSDP gathers the full parameters into buffers it frees again afterwards
(``reshard_after_forward``); those are the parameters autograd saves, and they are not
activations.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .tensors import local_tensor

__all__ = ["gathered_parameters"]


def gathered_parameters(module: nn.Module) -> list[torch.Tensor]:
    """The tensors holding ``module``'s parameters now: inside an FSDP2 unit's forward the
    gathered ones (FSDP registers them in the shards' place), else the parameters themselves."""
    return [local_tensor(p) for p in module.parameters()]
