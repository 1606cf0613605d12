"""The sharded kinds of the Lightning strategies: ``"fsdp_cpu_swap"`` (Lightning's ``FSDPStrategy``,
FSDP1) and ``"model_parallel_cpu_swap"`` (``ModelParallelStrategy``: FSDP2, ``fully_shard``
called in the user's ``configure_model``); the classes are in ``strategy.py`` and ``pl.py``.

Thin, as ``strategy_base.py`` is: the same mixin wires the same :class:`SwapSession` into these
strategies' hooks; what sharding changes for the core (the parameters gathered per unit, the
shards as ``DTensor``, every rank running every collective) is the core's business
(``core/sharded.py``).

Note [One activation policy]: Lightning's ``FSDPStrategy(activation_checkpointing_policy=...)``
wraps blocks in ``checkpoint_wrapper``; ``cpu_swap`` decides per block whether to keep, offload
or recompute. Both at once would have two owners for the same activations (Note [A model that
checkpoints itself] in ``core/segments.py``, which every session refuses). So the combination is
refused when the strategy is built, before any block is wrapped, with an error naming both;
``policy="recompute"`` is what ``activation_checkpointing_policy`` did for every block.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from typing_extensions import override

from .strategy_base import _SwapStrategyMixin

_CHECKPOINTING = ("activation_checkpointing", "activation_checkpointing_policy")


def refuse_activation_checkpointing(given: dict[str, Any]) -> None:
    """Note [One activation policy]."""
    named = [k for k in _CHECKPOINTING if given.get(k)]
    if named:
        raise ValueError(
            f"FSDPCPUSwapStrategy: `{named[0]}` and cpu_swap's `policy` would both decide what happens to each block's "
            "activations; pass one of them. For every block recomputed (what activation checkpointing does) use "
            "policy='recompute' and leave `activation_checkpointing_policy` unset; for Lightning's checkpointing alone use "
            "FSDPStrategy without cpu_swap."
        )


@contextmanager
def _empty_optimizer_states_loaded(optimizers: list, fsdp_module: Any) -> Iterator[None]:
    """Note [An optimizer state saved before the first step]: Lightning (2.6) loads a full FSDP
    checkpoint's optimizer states by reading the first entry of each, and one saved before any
    optimizer step has none (the batch-size finder saves such a checkpoint and restores it after
    its trials): ``IndexError``. Inside, such a state is loaded as what it is — the optimizers
    emptied — and every other checkpoint as Lightning loads it (the loader of ``fsdp_module``,
    the Lightning package's ``strategies/fsdp.py``, is wrapped, and put back on the way out)."""
    original = fsdp_module._lazy_load

    def lazy_load(path: Any) -> Any:
        checkpoint = original(path)
        states = checkpoint.get("optimizer_states")
        if states and len(states) == len(optimizers) and all(not state.get("state") for state in states):
            del checkpoint["optimizer_states"]
            for optimizer in optimizers:
                optimizer.state.clear()
        return checkpoint

    fsdp_module._lazy_load = lazy_load
    try:
        yield
    finally:
        fsdp_module._lazy_load = original


class FSDPSwap(_SwapStrategyMixin):
    """The FSDP1 kind: ``"fsdp_cpu_swap"``."""

    strategy_name = "fsdp_cpu_swap"

    @staticmethod
    def _strategy_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        refuse_activation_checkpointing(kwargs)
        return kwargs, True  # each rank on its own device already

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """On the CPU, FSDP1 is told its device: left to choose, it looks for an accelerator and
        refuses the CPU, while told ``device_id=cpu`` it shards over gloo (Lightning passes
        ``root_device.index``, ``None`` on the CPU)."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self.root_device.type != "cpu" or any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            return super()._setup_model(model)
        model = FullyShardedDataParallel(
            module=model, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy, device_id=self.root_device, **self.kwargs,
        )
        policy = self.kwargs.pop("auto_wrap_policy", None)  # applied above: Lightning would warn it is ignored
        try:
            return super()._setup_model(model)
        finally:
            if policy is not None:
                self.kwargs["auto_wrap_policy"] = policy

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Any = None) -> Any:
        fsdp_module = sys.modules[self.lightning_base().__module__]  # this package's strategies/fsdp.py
        with _empty_optimizer_states_loaded(list(self.optimizers), fsdp_module):  # Note [An optimizer state saved before the first step]
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def _profiled_training_step(self, module: Any, batch: Any) -> Any:
        # The root FSDP1 unit wraps the LightningModule: its parameters are gathered only when
        # the step runs through it, as Lightning's own training_step does.
        return self._forward_redirection(self.model, module, "training_step", batch, 0)


class ModelParallelSwap(_SwapStrategyMixin):
    """The FSDP2 kind: ``"model_parallel_cpu_swap"``."""

    strategy_name = "model_parallel_cpu_swap"

    @staticmethod
    def _strategy_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        # FSDP2 over every process by default: Lightning's own default ("auto") puts the
        # processes of a node in the tensor-parallel dimension, which cpu_swap does not support.
        kwargs.setdefault("tensor_parallel_size", 1)
        return kwargs, True

    @override
    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto" and self._tensor_parallel_size == 1:
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
        tensor_parallel = self.device_mesh["tensor_parallel"].size()
        if tensor_parallel != 1:
            raise ValueError(
                f"ModelParallelCPUSwapStrategy: tensor_parallel_size={tensor_parallel}; cpu_swap composes with FSDP2's "
                "data parallelism only: allowed tensor_parallel_size=1."
            )

