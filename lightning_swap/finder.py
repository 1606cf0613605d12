"""``SwapBatchSizeFinder``: Lightning's batch-size finder, driven by the planner.

It behaves like :class:`~lightning.pytorch.callbacks.BatchSizeFinder` — finds the
``batch_size`` attribute on the model, its hparams or the datamodule, sets it, exposes
``optimal_batch_size``, restores model and optimizer state from a temporary checkpoint it
deletes afterwards — but the search is :func:`lightning_swap.core.scale.batch_search.search_batch_size`:
predictions first, a few confirming trial runs second. Thin: trials run Lightning's own fit
loop; every decision is in the core.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from typing import Any, Optional

from lightning.pytorch.callbacks import BatchSizeFinder
from lightning.pytorch.tuner import batch_size_scaling as _bss
from lightning.pytorch.utilities.exceptions import MisconfigurationException, _TunerExitException
from lightning.pytorch.utilities.memory import garbage_collection_cuda
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from .core import adopt_search_profile, search_for_loop
from .core import ScaleConfig, ScaleResult, build_options, describe_options
from .core import ByteSize, parse_bytes
from .strategy_base import _SwapStrategyMixin

__all__ = ["SwapBatchSizeFinder"]

log = logging.getLogger(__name__)

# Lightning's own helpers for running trial loops (module-private names).
_dump_params = getattr(_bss, "__scale_batch_dump_params")
_reset_params = getattr(_bss, "__scale_batch_reset_params")
_restore_params = getattr(_bss, "__scale_batch_restore_params")


class SwapBatchSizeFinder(BatchSizeFinder):
    """Find the largest (``mode="max"``) or fastest (``mode="throughput"``) batch size that
    trains within the memory budget with a plan, in a few trial runs.

    In ``mode="throughput"`` one trial is plain training at the model's current ``batch_size``
    (clipped to the searched range) when it is predicted to fit, and the answer's measured
    samples/s is at least plain's; ``result.render()`` says by how much, or why plain was not
    the reference (Note [A throughput search that can only win] in ``core/scale/batch_search.py``). Trials
    are short: ``steps_per_trial`` of 4 or more gives a steadier median step time.

    Args:
        budget_bytes: the device budget, bytes as an ``int`` or a size string (``"12GiB"``); not
            a fraction of device memory (for 80% of a GPU pass
            ``int(0.8 * torch.cuda.get_device_properties(0).total_memory)``). Default: the
            strategy's ``budget_bytes``, else the free CUDA memory less 10%. Required on CPU,
            where it is the simulated capacity.
        batch_arg_name: the attribute holding the batch size, as for ``BatchSizeFinder``.
        **search_options: the search's options, ``ScaleConfig``'s fields (Note [One option table]):
{search_options}

    Needs ``strategy="cpu_swap"`` or ``"ddp_cpu_swap"``. Under DDP every rank runs the same
    search (every rank profiles, the profiles merged by their largest values, measurements reduced
    by max) and the smallest answer wins; the same under FSDP (``"fsdp_cpu_swap"``,
    ``"model_parallel_cpu_swap"``).
    """

    SUPPORTED_MODES = ("max", "throughput")

    def __init__(
        self, mode: str = "max", *, budget_bytes: Optional[ByteSize] = None, batch_arg_name: str = "batch_size", **search_options: Any,
    ) -> None:
        config = build_options(ScaleConfig, {"mode": mode, **search_options}, owner="SwapBatchSizeFinder")
        self.scale_config = config
        super().__init__(
            mode=config.mode,
            steps_per_trial=config.steps_per_trial,
            init_val=config.min_batch_size,
            max_trials=config.max_trials,
            batch_arg_name=batch_arg_name,
            margin=config.margin,
            max_val=config.max_batch_size,
        )
        self.budget_bytes = parse_bytes(budget_bytes, field="budget_bytes", allow_none=True)
        self.result: Optional[ScaleResult] = None
        self.optimal_batch_size: Optional[int] = None

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: Optional[str] = None) -> None:
        if not isinstance(trainer.strategy, _SwapStrategyMixin):
            raise MisconfigurationException(
                "SwapBatchSizeFinder plans memory with lightning-swap's runtime, so it needs "
                "Trainer(strategy='cpu_swap') or strategy='ddp_cpu_swap' (or CPUSwapStrategy / "
                f"DDPCPUSwapStrategy); got {type(trainer.strategy).__name__}. For other strategies "
                "use Lightning's BatchSizeFinder."
            )
        if not trainer.fit_loop._data_source.is_module():
            raise MisconfigurationException(
                "SwapBatchSizeFinder cannot be used with dataloaders passed directly to `.fit()`: "
                "define them in the LightningModule or a LightningDataModule."
            )
        if not lightning_hasattr(pl_module, self._batch_arg_name):
            raise MisconfigurationException(
                f"Field {self._batch_arg_name} not found in `model`, `datamodule`, nor their `hparams` attributes."
            )

    @override
    def scale_batch_size(self, trainer: Any, pl_module: Any) -> None:
        self.result = _search(trainer, self)
        self.optimal_batch_size = self.result.batch_size
        if self._early_exit:
            raise _TunerExitException()

    # The search measures training memory; evaluation loops are left alone.
    @override
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        return None

    @override
    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        return None

    @override
    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        return None


SwapBatchSizeFinder.__doc__ = SwapBatchSizeFinder.__doc__.replace("{search_options}", describe_options(ScaleConfig, "            "))


def _search(trainer: Any, finder: SwapBatchSizeFinder) -> ScaleResult:
    strategy = trainer.strategy
    session = strategy.swap_session
    config = finder.scale_config
    budget = finder.budget_bytes or session.budget_bytes()
    if budget is None:
        raise MisconfigurationException(
            "SwapBatchSizeFinder needs a memory budget on CPU: pass `budget_bytes` to the finder or the strategy."
        )
    start_batch = lightning_getattr(trainer.lightning_module, finder._batch_arg_name)

    # One path for every rank: rank 0 writes it, all ranks restore from it.
    ckpt_path = strategy.broadcast(os.path.join(trainer.default_root_dir, f".scale_batch_size_{uuid.uuid4()}.ckpt"), src=0)
    trainer.save_checkpoint(ckpt_path)
    params = _dump_params(trainer)
    _reset_params(trainer, config.steps_per_trial)
    if trainer.progress_bar_callback:
        trainer.progress_bar_callback.disable()
    make_batch, run_steps = _loop(trainer, finder, params)
    # The user's batch, clipped to the searched range: profiled there, and in mode="throughput"
    # the batch plain training is measured at, the reference the answer must match or beat.
    base_batch = min(max(start_batch, config.min_batch_size), config.max_batch_size)
    result: Optional[ScaleResult] = None
    try:
        result = search_for_loop(
            session,
            budget,
            run_steps,
            strategy.profile_step_fn(),
            make_batch=make_batch,
            profile_batch_size=base_batch,
            config=config,
            track=lambda: [o.state for o in strategy.optimizers],
            collectives=session.collectives,
            base_batch_size=base_batch,
        )
        lightning_setattr(trainer.lightning_module, finder._batch_arg_name, result.batch_size)
        rank_zero_info(f"SwapBatchSizeFinder:\n{result.render()}")
    finally:
        _restore_params(trainer, params)
        if trainer.progress_bar_callback:
            trainer.progress_bar_callback.enable()
        trainer._checkpoint_connector.restore(ckpt_path)
        strategy.barrier("SwapBatchSizeFinder.restore")  # every rank has read it before rank 0 deletes it
        strategy.remove_checkpoint(ckpt_path)
        # Training plans from the search's steady-state profile at the batch found: it never
        # traces a first step of that size (Note [Auto learns from the steps it runs]).
        found = result
        adopt_search_profile(session, lambda: make_batch(found.batch_size), found=found is not None)
    return result


def _loop(trainer: Any, finder: SwapBatchSizeFinder, params: dict) -> tuple[Callable[[int], Any], Callable[[int, int], list]]:
    """``make_batch`` and ``run_steps`` for :func:`search_for_loop`, through Lightning's own fit loop."""
    strategy = trainer.strategy
    session = strategy.swap_session
    config = finder.scale_config

    def use_batch_size(batch_size: int) -> None:
        lightning_setattr(trainer.lightning_module, finder._batch_arg_name, batch_size)
        _bss._reset_dataloaders(trainer)

    def make_batch(batch_size: int) -> Any:
        use_batch_size(batch_size)
        return strategy.batch_to_device(next(iter(trainer.train_dataloader)))

    def run_steps(batch_size: int, steps: int) -> list:
        """Lightning's own fit loop for ``steps`` steps at ``batch_size``."""
        use_batch_size(batch_size)
        _bss._reset_progress(trainer)
        trainer.fit_loop.epoch_loop.max_steps = steps
        mark = session.records.count
        garbage_collection_cuda()
        try:
            _bss._try_loop_run(trainer, params)
        finally:
            trainer.fit_loop.epoch_loop.max_steps = config.steps_per_trial
            garbage_collection_cuda()
        return session.records.since(mark, wait=True)  # between trials the host may wait

    return make_batch, run_steps
