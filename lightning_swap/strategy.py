"""The Lightning Trainer's strategies (``lightning.pytorch``): ``"cpu_swap"``, ``"ddp_cpu_swap"``,
``"fsdp_cpu_swap"`` and ``"model_parallel_cpu_swap"``, registered in Lightning's
``StrategyRegistry`` when this module is imported (Note [Strategies registered on import] in
``lightning_swap/__init__.py``); and :func:`with_cpu_swap` for a strategy the user built.

Each class is a kind (``strategy_base.py``, ``fsdp.py``: how a ``SwapSession`` is wired into the
hooks) and Lightning's own strategy; ``pl.py`` has the same four for ``pytorch_lightning``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy, StrategyRegistry

from .fsdp import FSDPSwap, ModelParallelSwap, refuse_activation_checkpointing
from .strategy_base import OPTIONS_DOC, DDPSwap, SingleDeviceSwap, StatsLogging, _SwapStrategyMixin, swap_options

__all__ = ["CPUSwapStrategy", "DDPCPUSwapStrategy", "FSDPCPUSwapStrategy", "ModelParallelCPUSwapStrategy", "with_cpu_swap"]


class _SwapStatsLogger(StatsLogging, Callback):
    pass


class CPUSwapStrategy(SingleDeviceSwap, SingleDeviceStrategy):
    __doc__ = f"""Single-device training with activations kept, offloaded to CPU RAM or recomputed.

        Args:
{OPTIONS_DOC}
            **strategy_kwargs: passed to Lightning's ``SingleDeviceStrategy``: ``device`` (by default
                ``cuda:<first device>`` with a CUDA accelerator, else CPU), ``accelerator``,
                ``checkpoint_io``, ``precision_plugin``.
"""
    _stats_callback_class = _SwapStatsLogger


class DDPCPUSwapStrategy(DDPSwap, DDPStrategy):
    __doc__ = f"""Lightning's DDP with the same runtime on every rank; the plan is solved on rank 0 and broadcast.

        Args:
{OPTIONS_DOC}
            **strategy_kwargs: passed to Lightning's ``DDPStrategy``.
"""
    _stats_callback_class = _SwapStatsLogger


class FSDPCPUSwapStrategy(FSDPSwap, FSDPStrategy):
    __doc__ = f"""Lightning's FSDP (FSDP1) with the same runtime on every rank; the plan is agreed by every rank.

        Runs on CUDA and, unlike Lightning's ``FSDPStrategy``, on the CPU (gloo). Refuses
        ``activation_checkpointing_policy`` (Note [One activation policy] in ``lightning_swap/fsdp.py``).

        Args:
{OPTIONS_DOC}
            **strategy_kwargs: passed to Lightning's ``FSDPStrategy`` (``auto_wrap_policy``,
                ``sharding_strategy``, ``state_dict_type``, ...).
"""
    _stats_callback_class = _SwapStatsLogger


class ModelParallelCPUSwapStrategy(ModelParallelSwap, ModelParallelStrategy):
    __doc__ = f"""Lightning's ModelParallelStrategy (FSDP2: ``fully_shard`` in ``configure_model``) with the same runtime on every rank.

        Defaults to FSDP2 over every process (``data_parallel_size`` = all processes,
        ``tensor_parallel_size=1``); tensor parallelism is refused.

        Args:
{OPTIONS_DOC}
            **strategy_kwargs: passed to Lightning's ``ModelParallelStrategy``
                (``data_parallel_size``, ``save_distributed_checkpoint``, ...).
"""
    _stats_callback_class = _SwapStatsLogger


def with_cpu_swap(strategy: Any, **options: Any) -> Any:
    """``strategy`` (a Lightning ``FSDPStrategy``, ``ModelParallelStrategy``, ``DDPStrategy`` or
    ``SingleDeviceStrategy`` the user built, not yet given to a ``Trainer``) with cpu_swap: an
    object of the matching cpu_swap class carrying every setting ``strategy`` was built with,
    plus ``options`` (the cpu_swap strategies' keyword arguments: ``policy``, ``budget_bytes``,
    ...). ``strategy`` itself is left as it was::

        strategy = with_cpu_swap(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                                 policy="auto", budget_bytes="20GiB")

    A ``pytorch_lightning`` strategy gets its class from ``lightning_swap.pl`` (imported by then:
    Note [Strategies registered on import])."""
    classes = {cls.lightning_base(): cls for cls in _concrete(_SwapStrategyMixin)}
    cls = classes.get(type(strategy))
    if cls is None:
        allowed = sorted({f"{c.__module__.split('.')[0]}.{c.__name__}" for c in classes})
        raise ValueError(f"`strategy` must be one of {allowed} (exactly, not a subclass); got {type(strategy).__name__}.")
    if getattr(strategy, "_lightning_module", None) is not None:
        raise ValueError("`strategy` is already in use by a Trainer; pass the strategy before Trainer(strategy=...) sees it.")
    if getattr(strategy, "_activation_checkpointing_kwargs", None):
        refuse_activation_checkpointing({"activation_checkpointing_policy": True})
    swap = swap_options(options)
    swapped = cls.__new__(cls)
    swapped.__dict__.update(strategy.__dict__)
    if "_tensor_parallel_size" in swapped.__dict__ and swapped._tensor_parallel_size == "auto":
        swapped._tensor_parallel_size = 1  # as ModelParallelCPUSwapStrategy's default
    swapped._init_swap(swap, device_given=True)
    return swapped


def _concrete(kind: type) -> list[type]:
    """Every class under ``kind`` built on a Lightning strategy (those of each package imported)."""
    found = []
    for sub in kind.__subclasses__():
        found += [sub] if sub.lightning_base() in sub.__bases__ else _concrete(sub)
    return found


for _cls in (CPUSwapStrategy, DDPCPUSwapStrategy, FSDPCPUSwapStrategy, ModelParallelCPUSwapStrategy):
    _cls.register_strategies(StrategyRegistry)
