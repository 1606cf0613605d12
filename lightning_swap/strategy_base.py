"""What every Lightning strategy of lightning-swap shares: :class:`_SwapStrategyMixin`, which wires a
:class:`SwapSession` into a Lightning strategy's hooks, its options, its stats logger and its
log handler; and the single-device and DDP kinds (:class:`SingleDeviceSwap`, :class:`DDPSwap`).

Thin by design: every decision lives in :mod:`lightning_swap.core`; these classes only call
its step API from Lightning's hooks (Note [One step API] in ``core/scale/session.py``: the step's
window, the budget held online and the plan's log are the core's, one implementation for every
front end; this module has none of its own). Nothing here subclasses a Lightning strategy: the
classes a user builds are plain subclasses of a kind and of one package's own strategy
(``strategy.py`` for ``lightning.pytorch``, ``pl.py`` for the standalone ``pytorch_lightning``),
since a strategy must subclass that package's ``Strategy``.
"""

from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from .core import process_group_collectives
from .core import SwapConfig, build_options, check_bool, describe_options, option, split_options
from .core import SessionViews, StepKind, SwapSession
from .core import TimelineRecorder
from .core import UnifiedMemory, unified_memory_for
from .report import plot_timelines


class _ProgressBarLog(logging.Handler):
    """Note [Warnings above the progress bar]: the library logs warnings (a segment that writes
    into its input, ...) with :mod:`logging`; where nothing was configured Python writes them to
    stderr (``logging.lastResort``), in the middle of the line Lightning's progress bar is
    drawing. For the strategy's lifetime, and only when no handler would take them, this handler
    takes the ``lightning_swap`` warnings and prints them as ``LightningModule.print`` does,
    above the bar (``ProgressBar.print``), else to stderr as before."""

    def __init__(self, trainer: Any) -> None:
        super().__init__(logging.WARNING)
        self.trainer = trainer

    @classmethod
    def install(cls, trainer: Any) -> Optional["_ProgressBarLog"]:
        logger = logging.getLogger("lightning_swap")
        if logger.hasHandlers():
            return None  # the user's configuration decides where they go
        handler = cls(trainer)
        logger.addHandler(handler)
        return handler

    def remove(self) -> None:
        logging.getLogger("lightning_swap").removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        import sys

        text = self.format(record)
        bar = getattr(self.trainer, "progress_bar_callback", None)
        if bar is not None and bar.is_enabled and getattr(self.trainer, "training", False):
            bar.print(text)
        else:
            sys.stderr.write(text + "\n")


@dataclass(frozen=True, kw_only=True)
class _StrategyOptions(SwapConfig):
    """The strategies' swap options: ``SwapConfig``'s and the adapter's own (Note [One option table])."""

    log_stats: bool = option(
        True, "send ``swap/...`` metrics (plain floats) to the loggers every ``log_every_n_steps`` (default on).", check=check_bool,
    )
    report: bool = option(
        False, "once training is in its steady state, draw one step's device memory under the plan, with the budget, on "
        "``swap_memory_timeline.png`` in the trainer's log directory (``strategy.report_path``; default off).", check=check_bool,
    )


class _SwapStrategyMixin(SessionViews):
    """Wires a :class:`SwapSession` into a Lightning strategy's hooks.

    Note [Lightning's step]: a step is everything from a training batch's start to its end. Under
    automatic optimization Lightning runs ``optimizer_step(closure)``, and the optimizer calls the
    closure (``training_step`` then ``backward``) once, or several times (LBFGS; a SAM-style
    optimizer calls it twice): the step opens at the first ``training_step`` of the batch and
    closes when ``optimizer_step`` returns (a batch that only accumulates, at the next batch's
    start). Under manual optimization everything (each ``manual_backward``, each ``opt.step()``,
    two optimizers) happens inside the user's ``training_step``, which therefore is the step. A
    step of several backward passes is measured whole, each forward held within the budget (Note
    [The budget held online] in ``core/runtime/online.py``). The hooks only say where the step begins and ends; what happens then
    is the core's step API (Note [One step API] in ``core/scale/session.py``)."""

    #: The name Lightning's registry knows the strategy by (each kind says).
    strategy_name: str = ""
    #: The stats logger, a ``Callback`` of the strategy's own Lightning package (each class says).
    _stats_callback_class: Optional[type] = None
    #: Note [One option table]: the signature ``inspect`` shows (and an IDE), read from the fields.
    __signature__ = inspect.Signature([
        *(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default) for f in fields(_StrategyOptions)),
        inspect.Parameter("strategy_kwargs", inspect.Parameter.VAR_KEYWORD),
    ])

    def __init__(self, **options: Any) -> None:
        """Note [One option table]: the swap options are ``_StrategyOptions``' fields, given as
        keywords (the signature shown is read from them: ``__signature__``); every other
        keyword goes to Lightning's strategy (:meth:`_strategy_kwargs` says how)."""
        swap, strategy_kwargs = split_options(options, _StrategyOptions)
        swap = _StrategyOptions(**swap)  # checked before Lightning's strategy is built
        self._refuse_unknown(strategy_kwargs)
        base_kwargs, device_given = self._strategy_kwargs(strategy_kwargs)
        super().__init__(**base_kwargs)
        self._init_swap(swap, device_given=device_given)

    @classmethod
    def _refuse_unknown(cls, options: dict[str, Any]) -> None:
        """A name that is neither a swap option nor Lightning's strategy's is refused, naming both
        (unless that strategy passes unknown names on: DDP gives them to ``DistributedDataParallel``)."""
        params = inspect.signature(cls.lightning_base().__init__).parameters
        unknown = sorted(set(options) - set(params))
        if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            allowed = sorted({f.name for f in fields(_StrategyOptions)} | set(params) - {"self"})
            raise ValueError(f"{cls.__name__}: unknown options {unknown}; allowed: {allowed}.")

    @classmethod
    def lightning_base(cls) -> Optional[type]:
        """The Lightning strategy this class is built on (``lightning.pytorch``'s or ``pytorch_lightning``'s; a kind: ``None``)."""
        return next((c for c in cls.__mro__ if c.__module__.startswith(("lightning.", "pytorch_lightning."))), None)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Only this strategy's name: the inherited method would register Lightning's own names.
        strategy_registry.register(cls.strategy_name, cls, description=cls.__doc__.splitlines()[0], override=True)

    @staticmethod
    def _strategy_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Lightning's strategy's keyword arguments, and whether the user chose the device."""
        raise NotImplementedError  # each kind says

    def _init_swap(self, options: _StrategyOptions, *, device_given: bool) -> None:
        #: The session's options (its ``log_plan`` is the user's: the session logs the plan,
        #: through :meth:`_print_plan`, Note [The plan's log]).
        self.swap_config = options.to_config()
        self.log_plan = options.log_plan
        self.log_stats = options.log_stats
        self.report = options.report
        self.report_path: Optional[Path] = None
        self.unified_memory: Optional[UnifiedMemory] = None
        self._recorder: Optional[TimelineRecorder] = None
        self._device_given = device_given
        self._session: Optional[SwapSession] = None
        self._stats_callback = None
        self._bar_log: Optional[_ProgressBarLog] = None

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
    @override
    def setup_environment(self) -> None:
        """Unified memory is installed here: after the device is chosen and set, before
        ``setup`` moves the model to it (``um="all"`` must precede every CUDA allocation)."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if trainer is not None:
            self._pick_device(trainer)
        super().setup_environment()
        if self.unified_memory is None:
            self.unified_memory = unified_memory_for(self.swap_config, self.root_device)
            if self.unified_memory is not None:
                rank_zero_info(
                    f"lightning-swap unified memory: um={self.swap_config.um.value!r} on {self.root_device}, "
                    f"at most {self.unified_memory.memory.max_bytes} bytes managed"
                )

    @override
    def setup(self, trainer: Any) -> None:
        self._pick_device(trainer)
        super().setup(trainer)
        if getattr(trainer.state, "fn", "fit") != "fit":
            return  # validate / test / predict train nothing: the last fit's session and statistics stay
        module = self.lightning_module
        self._bar_log = _ProgressBarLog.install(trainer)
        self._session = SwapSession(
            module, self.swap_config, self.root_device, unified=self.unified_memory, collectives=process_group_collectives(self.root_device),
            # Lightning's closure runs forward, zero_grad, backward: without accumulation the last
            # step's gradients are gone before the backward (Note [Steady-state shift]).
            grads_freed_before_backward=bool(module.automatic_optimization and getattr(trainer, "accumulate_grad_batches", 1) == 1),
            advice=f"{type(self).__name__}(budget_bytes='8GiB')", plan_sink=self._print_plan,  # the class in use
        )
        if not self.swap_config.is_auto:
            self._session.apply_forced_plan()  # every rank runs rank 0's plan (identity on one device)
        if self.log_stats and self._stats_callback_class is not None:
            self._stats_callback = self._stats_callback_class(self)
            trainer.callbacks.append(self._stats_callback)

    def profile_step_fn(self) -> Any:
        """One training step as the batch-size finder's profiler runs it, in Lightning's closure
        order: forward, zero_grad (last step's gradients are freed), backward. The profiler
        restores gradients. (``policy="auto"`` never runs it: Note [Observe, do not re-run].)"""
        module = self.lightning_module
        optimizers = list(self.optimizers)
        precision = self.precision_plugin

        def step_fn(model: Any, batch: Any) -> Any:
            # As Lightning runs it (its precision context: autocast under "bf16-mixed"), with
            # ``self.log`` silenced: a profiled call is not a training step to report.
            with _silenced_logging(module), precision.train_step_context():
                loss = self._profiled_training_step(module, batch)
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            return loss

        return step_fn

    def _profiled_training_step(self, module: Any, batch: Any) -> Any:
        """The user's ``training_step`` as the profiler calls it (a strategy whose wrapper must
        run around it says how)."""
        return module.training_step(batch, 0)

    def _print_plan(self, text: str) -> None:
        """Where the session's plan log goes (Note [The plan's log]; it logs on rank zero only):
        through the progress bar when one is drawing (as ``LightningModule.print`` does, so the
        bar is not broken), else ``rank_zero_info``."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        bar = getattr(trainer, "progress_bar_callback", None) if trainer is not None else None
        if bar is not None and bar.is_enabled and trainer.training:
            bar.print(text)
        else:
            rank_zero_info(text)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Note [Lightning's step]: the first call of a batch opens the step; a closure called
        again inside its optimizer step (LBFGS, SAM) is part of it; under manual optimization the
        user's ``training_step`` is the whole step, so its end closes it. A failed step is dropped
        (its window, its hooks) and its error raised as it was."""
        session = self._session
        if session is None or session.step_open:
            return super().training_step(*args, **kwargs)
        self._open_step(session, args, kwargs)
        try:
            out = super().training_step(*args, **kwargs)
        except BaseException as exc:
            self._drop_recorder()
            session.step_failed(exc)
            raise
        if not self.lightning_module.automatic_optimization:
            self._end_swap_step()
        return out

    def _open_step(self, session: SwapSession, args: tuple, kwargs: dict) -> None:
        """The step's first ``training_step``: the core opens its window (``auto`` guards,
        observes or plans first); a timeline is recorded over it when one is due."""
        states = _optimizer_states(self.optimizers)
        # The planned timeline needs the meter open (Note [No dispatch mode under compile]).
        timeline_wanted = self.report and self.report_path is None
        kind = session.open_step(args[0] if args else kwargs.get("batch"), [args, kwargs, states], list(self.optimizers), measure=timeline_wanted)
        if kind is StepKind.RUN and self._report_due():
            label = f"planned ({session.plan.summary()})"
            self._recorder = TimelineRecorder(self.lightning_module, session.segments, session.step_meter, label).__enter__()

    def _report_due(self) -> bool:
        """The planned timeline is recorded once, in the steady state: a step ran before (its
        optimizer state exists) and ``auto``'s plan was checked."""
        session = self._session
        return (
            self.report
            and self.report_path is None
            and self._recorder is None
            and not session.pinned
            and session.measuring
            and bool(session.records.all())
            and not session.check_pending
        )

    def _finish_report(self) -> None:
        recorder, self._recorder = self._recorder, None
        recorder.__exit__(None, None, None)
        timelines = [recorder.timeline]  # the checked plan's own step, beside the budget
        trainer = self.lightning_module.trainer
        path = Path(trainer.log_dir or trainer.default_root_dir) / "swap_memory_timeline.png"
        if self.is_global_zero:
            plot_timelines(timelines, path, budget_bytes=self._session.budget_bytes())
            rank_zero_info(f"lightning-swap memory timeline written to {path}")
        self.report_path = path

    def _drop_recorder(self) -> None:
        """A step that never reached its backward's end: its timeline is not drawn."""
        if self._recorder is not None:
            self._recorder.__exit__(None, None, None)
            self._recorder = None

    @override
    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Inside the core's backward (Note [One step API]); a failed one is the session's
        (:meth:`SwapSession.step_failed`), its error raised as it was."""
        session = self._session
        if session is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        try:
            with session.backward():
                out = super().backward(closure_loss, optimizer, *args, **kwargs)
                if self._recorder is not None:  # a timeline covers the forward and the backward
                    self._finish_report()
        except BaseException:
            self._drop_recorder()
            raise
        return out

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().optimizer_step(*args, **kwargs)
        if self.lightning_module.automatic_optimization:
            self._end_swap_step()  # the closure (every call of it) and the optimizer step are over
        return out

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._end_swap_step()  # a step without an optimizer step (accumulation) ends here
        super().on_train_batch_start(batch, batch_idx)

    @override
    def on_train_end(self) -> None:
        self._end_swap_step()
        super().on_train_end()

    def _end_swap_step(self) -> None:
        """The whole training step is over (its optimizer step included, when it had one): the
        core closes it. Strategy hooks, not callbacks, call it: Lightning's batch-size finder
        runs its trial steps with the callbacks removed."""
        if self._session is not None and self._session.step_open:
            self._session.close_step()

    @override
    def teardown(self) -> None:
        self._drop_recorder()
        if self.report and self.report_path is None and self._session is not None and self.is_global_zero:  # never silently
            logging.getLogger(__name__).warning(
                "lightning-swap: report=True drew no memory picture: training ended before a steady step ran under a checked plan."
            )
        if self._session is not None:
            self._session.end_training()  # its statistics stay readable (`stats_history`)
        if getattr(self, "_bar_log", None) is not None:
            self._bar_log.remove()
            self._bar_log = None
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


@contextmanager
def _silenced_logging(module: Any):
    """``self.log`` / ``self.log_dict`` do nothing inside (a fake-tensor profile of the step)."""
    noop = lambda *args, **kwargs: None  # noqa: E731
    module.log, module.log_dict = noop, noop
    try:
        yield
    finally:
        del module.log, module.log_dict


class StatsLogging:
    """(``log_stats``) Sends the newest complete ``step_stats`` to the loggers as ``swap/...`` plain
    floats, at Lightning's ``log_every_n_steps``: no per-step device tensor, nothing that waits for
    the device (Note [Stream protocol]). A ``Callback`` of each Lightning package takes it
    (``_SwapStatsLogger`` in ``strategy.py`` and ``pl.py``)."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        connector = trainer._logger_connector
        if not trainer.loggers or not connector.should_update_logs:
            return
        stats = self._strategy.step_stats
        if stats is not None:
            connector.log_metrics(stats.as_metrics())


#: The swap options as a docstring's ``Args`` lines (Note [One option table]).
OPTIONS_DOC = describe_options(_StrategyOptions)


class SingleDeviceSwap(_SwapStrategyMixin):
    """The single-device kind: ``"cpu_swap"``."""

    strategy_name = "cpu_swap"

    @staticmethod
    def _strategy_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        # Lightning builds a registered strategy without a device: CPU until the accelerator is
        # known (``_pick_device``).
        device = kwargs.pop("device", None)
        return {"device": device if device is not None else "cpu", **kwargs}, device is not None


class DDPSwap(_SwapStrategyMixin):
    """The DDP kind: ``"ddp_cpu_swap"``."""

    strategy_name = "ddp_cpu_swap"

    @staticmethod
    def _strategy_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        return kwargs, True  # DDP places each rank on its own device already


def swap_options(options: dict[str, Any]) -> _StrategyOptions:
    """The strategies' swap options as given to ``with_cpu_swap`` (Note [One option table])."""
    return build_options(_StrategyOptions, options, owner="cpu_swap")
