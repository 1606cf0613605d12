"""Lightning adapters for sharded training: ``"fsdp_cpu_swap"`` (Lightning's ``FSDPStrategy``,
FSDP1) and ``"model_parallel_cpu_swap"`` (``ModelParallelStrategy``: FSDP2, ``fully_shard``
called in the user's ``configure_model``), and :func:`with_cpu_swap` for a strategy the user
constructed.

Thin, as :mod:`.strategy` is: the same mixin wires the same :class:`SwapSession` into these
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

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as _lightning_pytorch
import torch
from typing_extensions import override

from .strategy import _SwapStrategyMixin, _finish, _pytorch_lightning, swap_options

__all__ = ["FSDPCPUSwapStrategy", "ModelParallelCPUSwapStrategy", "with_cpu_swap"]

_CHECKPOINTING = ("activation_checkpointing", "activation_checkpointing_policy")


def _refuse_activation_checkpointing(given: dict[str, Any]) -> None:
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
def _empty_optimizer_states_loaded(optimizers: list) -> Iterator[None]:
    """Note [An optimizer state saved before the first step]: Lightning (2.6) loads a full FSDP
    checkpoint's optimizer states by reading the first entry of each, and one saved before any
    optimizer step has none (the batch-size finder saves such a checkpoint and restores it after
    its trials): ``IndexError``. Inside, such a state is loaded as what it is — the optimizers
    emptied — and every other checkpoint as Lightning loads it (its loader is wrapped, and put
    back on the way out)."""
    import lightning.pytorch.strategies.fsdp as lightning_fsdp

    original = lightning_fsdp._lazy_load

    def lazy_load(path: Any) -> Any:
        checkpoint = original(path)
        states = checkpoint.get("optimizer_states")
        if states and len(states) == len(optimizers) and all(not state.get("state") for state in states):
            del checkpoint["optimizer_states"]
            for optimizer in optimizers:
                optimizer.state.clear()
        return checkpoint

    lightning_fsdp._lazy_load = lazy_load
    try:
        yield
    finally:
        lightning_fsdp._lazy_load = original


def _build_fsdp(base: type, callback_base: type, name: str) -> type:
    class FSDPCPUSwapStrategy(_SwapStrategyMixin, base):
        strategy_name = "fsdp_cpu_swap"

        @staticmethod
        def _strategy_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
            _refuse_activation_checkpointing(kwargs)
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
            with _empty_optimizer_states_loaded(list(self.optimizers)):  # Note [An optimizer state saved before the first step]
                return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

        @override
        def _profiled_training_step(self, module: Any, batch: Any) -> Any:
            # The root FSDP1 unit wraps the LightningModule: its parameters are gathered only when
            # the step runs through it, as Lightning's own training_step does.
            return self._forward_redirection(self.model, module, "training_step", batch, 0)

    FSDPCPUSwapStrategy.__doc__ = (
        "Lightning's FSDP (FSDP1) with the same runtime on every rank; the plan is agreed by every rank.\n\n"
        "        Runs on CUDA and, unlike Lightning's ``FSDPStrategy``, on the CPU (gloo). Refuses\n"
        "        ``activation_checkpointing_policy`` (Note [One activation policy] in ``lightning_swap/fsdp.py``).\n\n"
        "        Args:\n{swap_options}\n"
        "            **strategy_kwargs: passed to Lightning's ``FSDPStrategy`` (``auto_wrap_policy``,\n"
        "                ``sharding_strategy``, ``state_dict_type``, ...).\n"
    )
    return _finish(FSDPCPUSwapStrategy, callback_base, name)


def _build_model_parallel(base: type, callback_base: type, name: str) -> type:
    class ModelParallelCPUSwapStrategy(_SwapStrategyMixin, base):
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

    ModelParallelCPUSwapStrategy.__doc__ = (
        "Lightning's ModelParallelStrategy (FSDP2: ``fully_shard`` in ``configure_model``) with the same runtime on every rank.\n\n"
        "        Defaults to FSDP2 over every process (``data_parallel_size`` = all processes,\n"
        "        ``tensor_parallel_size=1``); tensor parallelism is refused.\n\n"
        "        Args:\n{swap_options}\n"
        "            **strategy_kwargs: passed to Lightning's ``ModelParallelStrategy``\n"
        "                (``data_parallel_size``, ``save_distributed_checkpoint``, ...).\n"
    )
    return _finish(ModelParallelCPUSwapStrategy, callback_base, name)


def _classes_for(package: Any, prefix: str) -> tuple[type, type]:
    strategies = package.strategies
    callback = package.callbacks.Callback
    fsdp = _build_fsdp(strategies.FSDPStrategy, callback, f"{prefix}FSDPCPUSwapStrategy")
    model_parallel = _build_model_parallel(strategies.ModelParallelStrategy, callback, f"{prefix}ModelParallelCPUSwapStrategy")
    for cls in (fsdp, model_parallel):
        cls.__module__ = __name__
        cls.register_strategies(strategies.StrategyRegistry)
    return fsdp, model_parallel


def _swap_classes() -> dict[type, type]:
    """Lightning's strategy class -> its cpu_swap class, for every Lightning package installed."""
    from . import strategy as single

    pairs = {}
    for package, prefix in ((_lightning_pytorch, ""), (_pl, "PL")):
        if package is None:
            continue
        s = package.strategies
        pairs.update({
            s.SingleDeviceStrategy: getattr(single, f"{prefix}CPUSwapStrategy"),
            s.DDPStrategy: getattr(single, f"{prefix}DDPCPUSwapStrategy"),
            s.FSDPStrategy: globals()[f"{prefix}FSDPCPUSwapStrategy"],
            s.ModelParallelStrategy: globals()[f"{prefix}ModelParallelCPUSwapStrategy"],
        })
    return pairs


def with_cpu_swap(strategy: Any, **options: Any) -> Any:
    """``strategy`` (a Lightning ``FSDPStrategy``, ``ModelParallelStrategy``, ``DDPStrategy`` or
    ``SingleDeviceStrategy`` the user built, not yet given to a ``Trainer``) with cpu_swap: an
    object of the matching cpu_swap class carrying every setting ``strategy`` was built with,
    plus ``options`` (the cpu_swap strategies' keyword arguments: ``policy``, ``budget_bytes``,
    ...). ``strategy`` itself is left as it was::

        strategy = with_cpu_swap(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                                 policy="auto", budget_bytes="20GiB")
    """
    classes = _swap_classes()
    cls = classes.get(type(strategy))
    if cls is None:
        allowed = sorted({c.__name__ for c in classes})
        raise ValueError(f"`strategy` must be one of Lightning's {allowed} (exactly, not a subclass); got {type(strategy).__name__}.")
    if getattr(strategy, "_lightning_module", None) is not None:
        raise ValueError("`strategy` is already in use by a Trainer; pass the strategy before Trainer(strategy=...) sees it.")
    if getattr(strategy, "_activation_checkpointing_kwargs", None):
        _refuse_activation_checkpointing({"activation_checkpointing_policy": True})
    swap = swap_options(options)
    swapped = cls.__new__(cls)
    swapped.__dict__.update(strategy.__dict__)
    if "_tensor_parallel_size" in swapped.__dict__ and swapped._tensor_parallel_size == "auto":
        swapped._tensor_parallel_size = 1  # as ModelParallelCPUSwapStrategy's default
    swapped._init_swap(swap, device_given=True)
    return swapped


FSDPCPUSwapStrategy, ModelParallelCPUSwapStrategy = _classes_for(_lightning_pytorch, "")
_pl = _pytorch_lightning()
PLFSDPCPUSwapStrategy, PLModelParallelCPUSwapStrategy = _classes_for(_pl, "PL") if _pl is not None else (None, None)
