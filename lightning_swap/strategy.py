"""Lightning adapters: the ``"cpu_swap"`` and ``"ddp_cpu_swap"`` strategies and their stats logger.

Thin by design: every decision lives in :mod:`lightning_swap.core`; these classes only call
it from Lightning's hooks. The same mixin serves ``lightning.pytorch`` and, when installed,
the standalone ``pytorch_lightning`` package (a separate class for each, since a strategy
must subclass that package's own ``Strategy``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from .core.actions import PolicyLike
from .core.plan import Plan
from .core.runtime import DEFAULT_MIN_OFFLOAD_BYTES, StepStats
from .core.segments import SegmentSpec
from .core.session import SwapConfig, SwapSession
from .core.timeline import Timeline, TimelineRecorder
from .core.units import ByteSize
from .core.unified import UnifiedMemory
from .report import plot_timelines

log = logging.getLogger(__name__)


class _SwapStrategyMixin:
    """Wires a :class:`SwapSession` into a Lightning strategy's hooks."""

    _stats_callback_class: type = None  # set per Lightning package

    def _init_swap(
        self,
        *,
        policy: PolicyLike,
        segments: SegmentSpec,
        min_offload_bytes: ByteSize,
        budget_bytes: Optional[ByteSize],
        prefetch_segments: Optional[int],
        inflight_segments: int,
        log_stats: bool,
        device_given: bool,
        report: bool = False,
        um: str = "off",
        um_max_bytes: Optional[ByteSize] = None,
    ) -> None:
        self.swap_config = SwapConfig(
            log_plan=False,  # logged here, on rank zero only
            policy=policy,
            segments=segments,
            min_offload_bytes=min_offload_bytes,
            budget_bytes=budget_bytes,
            prefetch_segments=prefetch_segments,
            inflight_segments=inflight_segments,
            um=um,
            um_max_bytes=um_max_bytes,
        )
        self.unified_memory: Optional[UnifiedMemory] = None
        if not isinstance(log_stats, bool):
            raise ValueError(f"`log_stats` must be True or False; got {log_stats!r}.")
        if not isinstance(report, bool):
            raise ValueError(f"`report` must be True or False; got {report!r}.")
        self.log_stats = log_stats
        self.report = report
        self.report_path: Optional[Path] = None
        self._recorder: Optional[TimelineRecorder] = None
        self._plain_timeline: Optional[Timeline] = None
        self._device_given = device_given
        self._session: Optional[SwapSession] = None
        self._stats_callback = None

    # -- what users read ----------------------------------------------------------------
    @property
    def plan(self) -> Optional[Plan]:
        """The plan applied to the model (``None`` before setup)."""
        return self._session.plan if self._session is not None else None

    @property
    def swap_session(self) -> Optional[SwapSession]:
        return self._session

    @property
    def step_stats(self) -> Optional[StepStats]:
        """The newest training step whose statistics are complete. Reading it never waits for
        the device: on CUDA, during training, that is usually the step before the last one
        (Note [Stream protocol]); after ``fit`` it is the last step."""
        return self._session.stats() if self._session is not None else None

    @property
    def stats_history(self) -> list[StepStats]:
        """The last (up to 64) steps' statistics, oldest first, as known now."""
        return self._session.records.all() if self._session is not None else []

    # -- device -------------------------------------------------------------------------
    def _pick_device(self, trainer: Any) -> None:
        """Lightning builds a registered strategy without a device; follow the accelerator."""
        if self._device_given or self.accelerator is None:
            return
        if type(self.accelerator).__name__ == "CUDAAccelerator":
            devices = getattr(getattr(trainer, "_accelerator_connector", None), "_parallel_devices", None)
            if devices:
                self._root_device = torch.device(devices[0])
            else:
                self._root_device = torch.device("cuda", torch.cuda.current_device())

    # -- hooks --------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Unified memory is installed here: after the device is chosen and set, before
        ``setup`` moves the model to it (``um="all"`` must precede every CUDA allocation)."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if trainer is not None:
            self._pick_device(trainer)
        super().setup_environment()
        if self.unified_memory is None:
            self.unified_memory = self.swap_config.install_unified_memory(self.root_device)
            if self.unified_memory is not None:
                rank_zero_info(
                    f"lightning-swap unified memory: um={self.swap_config.um!r} on {self.root_device}, "
                    f"at most {self.unified_memory.memory.max_bytes} bytes managed"
                )

    def setup(self, trainer: Any) -> None:
        self._pick_device(trainer)
        super().setup(trainer)
        module = self.lightning_module
        self._session = SwapSession(module, self.swap_config, self.root_device, unified=self.unified_memory)
        if not self.swap_config.is_auto:
            # Every rank runs rank 0's plan (identity on one device).
            self._log_plan(self._session.apply(self.broadcast(self._session.forced_plan(), src=0)))
        if self.log_stats and self._stats_callback_class is not None:
            self._stats_callback = self._stats_callback_class(self)
            trainer.callbacks.append(self._stats_callback)

    def replan(self, batch: Any, track: Any = ()) -> Plan:
        """Plan for ``batch`` on rank 0 (profiling one plain step for ``"auto"``), broadcast it
        and apply it on every rank."""
        session = self._session
        plan = session.plan_for_batch(batch, self.profile_step_fn(), track) if self.is_global_zero else None
        plan = self.broadcast(plan, src=0)
        session.apply(plan)
        session.mark_planned(batch, _optimizer_states(self.optimizers))
        self._log_plan(plan)
        return plan

    def profile_step_fn(self) -> Any:
        """One training step as the profiler runs it, in Lightning's closure order: forward,
        zero_grad (last step's gradients are freed), backward. The profiler restores gradients."""
        module = self.lightning_module
        optimizers = list(self.optimizers)

        def step_fn(model: Any, batch: Any) -> Any:
            loss = module.training_step(batch, 0)
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            return loss

        return step_fn

    def _log_plan(self, plan: Plan) -> None:
        rank_zero_info(f"lightning-swap plan ({plan.summary()}):\n{plan.render()}")

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._session is not None:
            track = [args, kwargs]
            for optimizer in self.optimizers:
                track.append(optimizer.state)
            batch = args[0] if args else kwargs.get("batch")
            states = _optimizer_states(self.optimizers)
            if self._session.needs_plan(batch) or (not self._session._pinned and self._session.state_changed(states)):
                self.replan(batch, states)
            record = self._report_due()
            if record:
                self._plain_timeline = self._session.record_plain_timeline(batch, self.profile_step_fn(), states)
            self._session.begin_step(track, measure=record)  # the timeline needs the meter
            if record:
                plan = self._session.plan
                self._recorder = TimelineRecorder(
                    self.lightning_module, self._session.segments, self._session.runtime.meter, f"planned ({plan.summary()})"
                ).__enter__()
        return super().training_step(*args, **kwargs)

    def _report_due(self) -> bool:
        """Record once, in the steady state: after the first optimizer step made its state."""
        return (
            self.report
            and self.report_path is None
            and self._recorder is None
            and not self._session._pinned
            and any(len(o.state) for o in self.optimizers)
        )

    def _finish_report(self) -> None:
        recorder, self._recorder = self._recorder, None
        recorder.__exit__(None, None, None)
        timelines = [t for t in (self._plain_timeline, recorder.timeline) if t is not None]
        trainer = self.lightning_module.trainer
        path = Path(trainer.log_dir or trainer.default_root_dir) / "swap_memory_timeline.png"
        if self.is_global_zero:
            plot_timelines(timelines, path, budget_bytes=self._session.budget_bytes())
            rank_zero_info(f"lightning-swap memory timeline written to {path}")
        self.report_path = path

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self._recorder is not None:
            self._finish_report()
        if self._session is not None:
            self._session.end_step()
        return out

    def teardown(self) -> None:
        if self._recorder is not None:  # a step that never reached backward
            self._recorder.__exit__(None, None, None)
            self._recorder = None
        if self._session is not None:
            self._session.records.resolve(wait=True)  # training is over: the host may wait now
            self._session.close()
        if self.unified_memory is not None:
            # New allocations go back to torch's allocator; managed ones stay valid
            # (Note [Managed memory outlives the session]).
            self.unified_memory.close()
            self.unified_memory = None
        if self._stats_callback is not None and self.lightning_module is not None:
            trainer = self.lightning_module._trainer
            if trainer is not None and self._stats_callback in trainer.callbacks:
                trainer.callbacks.remove(self._stats_callback)
        self._stats_callback = None
        super().teardown()


def _optimizer_states(optimizers: Any) -> list:
    return [optimizer.state for optimizer in optimizers]


def _stats_callback_for(callback_base: type) -> type:
    class _SwapStatsLogger(callback_base):
        """Sends the newest complete ``step_stats`` to the loggers as ``swap/...`` plain floats,
        at Lightning's ``log_every_n_steps``: no per-step device tensor, nothing that waits for
        the device (Note [Stream protocol])."""

        def __init__(self, strategy: Any) -> None:
            self._strategy = strategy

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            connector = trainer._logger_connector
            if not trainer.loggers or not connector.should_update_logs:
                return
            stats = self._strategy.step_stats
            if stats is not None:
                connector.log_metrics(stats.as_metrics())

    return _SwapStatsLogger


_SWAP_ARGS_DOC = """
            policy: ``"auto"`` (default: profile the first batch and let the planner choose
                the fastest plan within ``budget_bytes``), one action for every segment
                (``"keep"``, ``"offload"``, ``"recompute"``, ``"selective"``,
                ``"recompute_offload"``, case-insensitive, or an ``Action``), or a dict from
                segment name to action.
            segments: ``None`` to find the model's repeated blocks, or module classes /
                qualified module names.
            min_offload_bytes: saved tensors smaller than this stay on the device.
            budget_bytes: the device memory budget for the planner; on CPU the simulated device
                capacity (without it, ``"auto"`` keeps everything on CPU); on CUDA by default
                the free device memory less 10%. Bytes, as an ``int`` or a size string
                (``"12GiB"``, ``"500MB"``; as ``min_offload_bytes`` and ``um_max_bytes``), never
                a fraction: for 80% of a GPU pass
                ``int(0.8 * torch.cuda.get_device_properties(0).total_memory)``.
            prefetch_segments: segments prefetched ahead in backward (default 1 on CUDA, 0 on CPU).
            inflight_segments: segments whose copies to the host may still run while later
                segments compute (default 1); their device memory is released after that.
            log_stats: send ``swap/...`` metrics (plain floats) to the loggers every
                ``log_every_n_steps``.
            report: once training is in its steady state, draw one plain and one planned
                step's device memory on ``swap_memory_timeline.png`` in the trainer's log
                directory (``strategy.report_path``).
            um: CUDA unified memory: ``"off"`` (default), ``"offload"`` (offloaded
                activations live in managed host buffers, prefetched to the GPU before their
                backward, instead of pinned copies) or ``"all"`` (every CUDA allocation is
                managed, so training that does not fit is slow instead of failing; installed
                before the model reaches the GPU). Refused on CPU.
            um_max_bytes: cap on managed memory, only with ``um`` on; default the device's
                free memory (no oversubscription unless asked for)."""


def _build_single(base: type, callback_base: type, name: str) -> type:
    class CPUSwapStrategy(_SwapStrategyMixin, base):
        strategy_name = "cpu_swap"

        def __init__(
            self,
            policy: PolicyLike = "auto",
            segments: SegmentSpec = None,
            min_offload_bytes: ByteSize = DEFAULT_MIN_OFFLOAD_BYTES,
            budget_bytes: Optional[ByteSize] = None,
            prefetch_segments: Optional[int] = None,
            log_stats: bool = True,
            report: bool = False,
            um: str = "off",
            um_max_bytes: Optional[ByteSize] = None,
            inflight_segments: int = 1,
            device: Any = None,
            accelerator: Any = None,
            checkpoint_io: Any = None,
            precision_plugin: Any = None,
        ) -> None:
            super().__init__(
                device=device if device is not None else "cpu",
                accelerator=accelerator,
                checkpoint_io=checkpoint_io,
                precision_plugin=precision_plugin,
            )
            self._init_swap(
                policy=policy,
                segments=segments,
                min_offload_bytes=min_offload_bytes,
                budget_bytes=budget_bytes,
                prefetch_segments=prefetch_segments,
                inflight_segments=inflight_segments,
                log_stats=log_stats,
                device_given=device is not None,
                report=report,
                um=um,
                um_max_bytes=um_max_bytes,
            )

    CPUSwapStrategy.__doc__ = (
        "Single-device training with activations kept, offloaded to CPU RAM or recomputed.\n\n"
        "        Args:" + _SWAP_ARGS_DOC + "\n"
        "            device: by default ``cuda:<first device>`` with a CUDA accelerator, else CPU.\n"
    )
    return _finish(CPUSwapStrategy, callback_base, name)


def _build_ddp(base: type, callback_base: type, name: str) -> type:
    class DDPCPUSwapStrategy(_SwapStrategyMixin, base):
        strategy_name = "ddp_cpu_swap"

        def __init__(
            self,
            policy: PolicyLike = "auto",
            segments: SegmentSpec = None,
            min_offload_bytes: ByteSize = DEFAULT_MIN_OFFLOAD_BYTES,
            budget_bytes: Optional[ByteSize] = None,
            prefetch_segments: Optional[int] = None,
            log_stats: bool = True,
            report: bool = False,
            um: str = "off",
            um_max_bytes: Optional[ByteSize] = None,
            inflight_segments: int = 1,
            **ddp_kwargs: Any,
        ) -> None:
            super().__init__(**ddp_kwargs)
            self._init_swap(
                policy=policy,
                segments=segments,
                min_offload_bytes=min_offload_bytes,
                budget_bytes=budget_bytes,
                prefetch_segments=prefetch_segments,
                inflight_segments=inflight_segments,
                log_stats=log_stats,
                device_given=True,  # DDP places each rank on its own device already
                report=report,
                um=um,
                um_max_bytes=um_max_bytes,
            )

    DDPCPUSwapStrategy.__doc__ = (
        "Lightning's DDP with the same runtime on every rank; the plan is solved on rank 0 and broadcast.\n\n"
        "        Args:" + _SWAP_ARGS_DOC + "\n"
        "            **ddp_kwargs: passed to Lightning's ``DDPStrategy``.\n"
    )
    return _finish(DDPCPUSwapStrategy, callback_base, name)


def _finish(cls: type, callback_base: type, name: str) -> type:
    @classmethod
    def register_strategies(klass, strategy_registry: Any) -> None:
        strategy_registry.register(klass.strategy_name, klass, description=klass.__doc__.splitlines()[0], override=True)

    cls.register_strategies = register_strategies
    cls._stats_callback_class = _stats_callback_for(callback_base)
    cls.__qualname__ = cls.__name__ = name
    cls.__module__ = __name__
    return cls


def _classes_for(package: Any, prefix: str) -> tuple[type, type]:
    """Build and register both strategies for one Lightning package."""
    strategies = package.strategies
    single = _build_single(strategies.SingleDeviceStrategy, package.callbacks.Callback, f"{prefix}CPUSwapStrategy")
    ddp = _build_ddp(strategies.DDPStrategy, package.callbacks.Callback, f"{prefix}DDPCPUSwapStrategy")
    for cls in (single, ddp):
        cls.register_strategies(strategies.StrategyRegistry)
    return single, ddp


def _pytorch_lightning() -> Any:
    try:
        import pytorch_lightning
    except ImportError:
        return None
    return pytorch_lightning


import lightning.pytorch as _lightning_pytorch  # noqa: E402

CPUSwapStrategy, DDPCPUSwapStrategy = _classes_for(_lightning_pytorch, "")
_pl = _pytorch_lightning()
PLCPUSwapStrategy, PLDDPCPUSwapStrategy = _classes_for(_pl, "PL") if _pl is not None else (None, None)
