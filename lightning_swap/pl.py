"""The four Trainer strategies of ``strategy.py`` for the standalone ``pytorch_lightning`` package
(a strategy must subclass its own package's ``Strategy``), registered in that package's
``StrategyRegistry`` when this module is imported (Note [Strategies registered on import] in
``lightning_swap/__init__.py``): ``lightning_swap.PLCPUSwapStrategy``, ...
"""

from __future__ import annotations

from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy, StrategyRegistry

from .fsdp import FSDPSwap, ModelParallelSwap
from .strategy_base import DDPSwap, SingleDeviceSwap, StatsLogging

__all__ = ["PLCPUSwapStrategy", "PLDDPCPUSwapStrategy", "PLFSDPCPUSwapStrategy", "PLModelParallelCPUSwapStrategy"]


class _SwapStatsLogger(StatsLogging, Callback):
    pass


class PLCPUSwapStrategy(SingleDeviceSwap, SingleDeviceStrategy):
    """``lightning_swap.CPUSwapStrategy`` for ``pytorch_lightning``: the same options."""

    _stats_callback_class = _SwapStatsLogger


class PLDDPCPUSwapStrategy(DDPSwap, DDPStrategy):
    """``lightning_swap.DDPCPUSwapStrategy`` for ``pytorch_lightning``: the same options."""

    _stats_callback_class = _SwapStatsLogger


class PLFSDPCPUSwapStrategy(FSDPSwap, FSDPStrategy):
    """``lightning_swap.FSDPCPUSwapStrategy`` for ``pytorch_lightning``: the same options."""

    _stats_callback_class = _SwapStatsLogger


class PLModelParallelCPUSwapStrategy(ModelParallelSwap, ModelParallelStrategy):
    """``lightning_swap.ModelParallelCPUSwapStrategy`` for ``pytorch_lightning``: the same options."""

    _stats_callback_class = _SwapStatsLogger


for _cls in (PLCPUSwapStrategy, PLDDPCPUSwapStrategy, PLFSDPCPUSwapStrategy, PLModelParallelCPUSwapStrategy):
    _cls.register_strategies(StrategyRegistry)
