"""Lightning Fabric adapters (the loop under LitGPT): ``Fabric(strategy="cpu_swap")`` on one
device and ``"ddp_cpu_swap"`` (Fabric's DDP), or the classes with options, and
:class:`ModelParallelCPUSwapFabricStrategy` for FSDP2 (Fabric's ``ModelParallelStrategy``, data
parallel)::

    fabric = Fabric(strategy=CPUSwapFabricStrategy(policy="auto", budget_bytes="20GiB"))

(Fabric's FSDP1 ``FSDPStrategy`` has no swap variant yet: Fabric runs it on GPUs only, and the
CPU workaround the Lightning one has, ``lightning_swap/fsdp.py``, would be a second copy.)

Thin by design: a Fabric loop has no step hook, so the step is found as Accelerate's is, by the
core's :class:`~lightning_swap.core.HookedSwapSession` (Note [Hooked step window] in
``core/scale/hooked.py``, over the core's step API, Note [One step API] in
``core/scale/session.py``: one implementation of the window, the budget held online and the
plan's log; this module has none of its own). These classes only attach it to the module Fabric sets up,
hook the optimizers it sets up, and run :meth:`fabric.backward` inside the session's backward.

Note [Fabric options]: the swap options are ``SwapConfig``'s fields, read from its dataclass
fields, never listed here (Note [One option table]); every other keyword argument is Fabric's
strategy's. There is no ``log_stats`` or ``report``: a Fabric strategy never sees the Fabric
object, its loggers or its log directory; the loop reads ``strategy.step_stats`` /
``stats_history`` and logs them itself (``fabric.log_dict(stats.as_metrics())``).

Note [One model per Fabric strategy]: the plan goes on the first module set up for training
(the user's module, never the DDP wrapper: segment names and ``state_dict`` keys are the user's).
Another module set up beside it (a teacher, an EMA copy, a GAN's second network) is left as it
is, with a warning: a step is one model's forward to its optimizer step, and two models' windows
would overlap. ``strategy.teardown()`` (Fabric itself never calls it) or
``strategy.swap_session.close()`` removes every hook and wrapper; the statistics stay readable.

Note [One device follows the accelerator]: Fabric builds a registered strategy without arguments,
so ``"cpu_swap"`` does not know its device. Fabric's connector hands a strategy that has a
``parallel_devices`` attribute the accelerator's devices (``Fabric(accelerator=..., devices=...)``);
the single-device strategy takes its device from them unless one was given, and refuses more than
one (that is ``"ddp_cpu_swap"``).
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import fields
from typing import Any, Optional

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from typing_extensions import override

from .core import HookedSwapSession, SessionViews, SwapConfig
from .core import UnifiedMemory, unified_memory_for
from .core import process_group_collectives

__all__ = [
    "CPUSwapFabricStrategy", "DDPCPUSwapFabricStrategy", "ModelParallelCPUSwapFabricStrategy", "register_fabric_strategies",
]

#: Note [Fabric options]: the swap options, read from the one option table.
SWAP_OPTIONS = tuple(f.name for f in fields(SwapConfig))

class _FabricSwapMixin(SessionViews):
    """Wires a :class:`HookedSwapSession` into a Fabric strategy."""

    strategy_name: str = ""

    def __init__(self, **options: Any) -> None:
        swap = {name: options.pop(name) for name in SWAP_OPTIONS if name in options}
        self.swap_config = SwapConfig(**swap)  # checked before Fabric's strategy is built
        self._check_strategy_options(options)
        super().__init__(**options)
        self.unified_memory: Optional[UnifiedMemory] = None
        self._session: Optional[HookedSwapSession] = None

    @classmethod
    def _check_strategy_options(cls, options: dict[str, Any]) -> None:
        """A name that is neither a swap option nor one of Fabric's strategy's is refused, naming
        both lists (unless Fabric's strategy passes unknown names on: DDP gives them to
        ``DistributedDataParallel``)."""
        base = next(c for c in cls.__mro__ if c.__module__.startswith("lightning.fabric."))
        params = inspect.signature(base.__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return
        unknown = sorted(set(options) - set(params) - {"self"})
        if unknown:
            allowed = sorted({*SWAP_OPTIONS, *params} - {"self"})
            raise ValueError(f"{cls.__name__}: unknown options {unknown}; allowed: {allowed}.")

    # -- hooks --------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._install_unified_memory()

    @override
    def module_to_device(self, module: nn.Module) -> None:
        # A single-device Fabric may be used without launch(), so setup_environment may not run:
        # unified memory is installed before the model reaches the device in any case.
        self._install_unified_memory()
        super().module_to_device(module)

    def _install_unified_memory(self) -> None:
        if self.unified_memory is None:
            self.unified_memory = unified_memory_for(self.swap_config, self.root_device)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        wrapped = super().setup_module(module)
        # the user's module inside Fabric's wrapper (DDP, FSDP), unless the strategy made another
        self._attach(module if any(m is module for m in wrapped.modules()) else wrapped)
        return wrapped

    @override
    def setup_optimizer(self, optimizer: Any) -> Any:
        optimizer = super().setup_optimizer(optimizer)
        self._hook_optimizers([optimizer])
        return optimizer

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Any], scheduler: Any = None) -> Any:
        # Fabric's FSDP strategies set the optimizers up here without setup_optimizer.
        module, optimizers, scheduler = super().setup_module_and_optimizers(module, optimizers, scheduler)
        self._hook_optimizers(optimizers)
        return module, optimizers, scheduler

    def _hook_optimizers(self, optimizers: list[Any]) -> None:
        if self._session is not None and self._session.hooked:
            for optimizer in optimizers:
                self._session.hook_optimizer(optimizer)

    def _attach(self, module: nn.Module) -> None:
        """Note [One model per Fabric strategy]."""
        session = self._session
        if session is not None and session.hooked:
            if session.model is not module:
                rank_zero_warn(
                    f"lightning-swap: {type(self).__name__} plans the first module set up ({type(session.model).__name__}); "
                    f"{type(module).__name__} is set up without a plan. Call `fabric.strategy.teardown()` first to plan it instead."
                )
            return
        session = HookedSwapSession(  # the plan is logged on rank 0 only (Note [The plan's log])
            module, self.swap_config, self.root_device, advice=f"{type(self).__name__}(budget_bytes='8GiB')",
            collectives=process_group_collectives(self.root_device), unified=self.unified_memory,
        )
        try:
            if not session.config.is_auto:  # a forced plan needs no batch; "auto" plans in the first step
                session.apply_forced_plan()
            session.install_hook()
        except BaseException:
            session.close()
            raise
        self._session = session

    @override
    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        session = self._session if self._session is not None and self._session.hooked else None
        with session.backward() if session is not None else nullcontext():  # Note [Hooked step window]
            super().backward(tensor, module, *args, **kwargs)

    @override
    def teardown(self) -> None:
        if self._session is not None:
            self._session.end_training()  # the statistics stay readable (Note [One model per Fabric strategy])
        if self.unified_memory is not None:
            # New allocations go back to torch's allocator; managed ones stay valid
            # (Note [Managed memory outlives the session]).
            self.unified_memory.close()
            self.unified_memory = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Only this strategy's name: the inherited method would register Fabric's own names.
        strategy_registry.register(cls.strategy_name, cls, description=cls.__doc__.splitlines()[0], override=True)


_ARGS_DOC = f"""

    Args:
        **options: the swap options, ``SwapConfig``'s fields ({", ".join(SWAP_OPTIONS)}: see
            :class:`lightning_swap.SwapConfig`), and Fabric's strategy's own keyword arguments."""


class CPUSwapFabricStrategy(_FabricSwapMixin, SingleDeviceStrategy):
    strategy_name = "cpu_swap"

    __doc__ = "Fabric on one device with activations kept, offloaded to CPU RAM or recomputed." + _ARGS_DOC

    def __init__(self, **options: Any) -> None:
        self._device_given = options.get("device") is not None
        super().__init__(**options)

    @property
    def parallel_devices(self) -> Optional[list[torch.device]]:
        """Note [One device follows the accelerator]."""
        return None

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device]) -> None:
        if len(devices) > 1:
            raise ValueError(
                f"strategy='cpu_swap' trains on one device; got {len(devices)} devices. Allowed: devices=1, or "
                "strategy='ddp_cpu_swap' for several."
            )
        if devices and not self._device_given:
            self._root_device = torch.device(devices[0])


class DDPCPUSwapFabricStrategy(_FabricSwapMixin, DDPStrategy):
    strategy_name = "ddp_cpu_swap"

    __doc__ = (
        "Fabric's DDP with the same runtime on every process; the plan is decided on rank 0 and broadcast." + _ARGS_DOC
    )


class ModelParallelCPUSwapFabricStrategy(_FabricSwapMixin, ModelParallelStrategy):
    strategy_name = ""  # built with a ``parallelize_fn``, so never by name

    __doc__ = (
        "Fabric's ModelParallelStrategy (FSDP2: ``fully_shard`` in the ``parallelize_fn``) with the same runtime on every"
        " process.\n\n"
        "    Data parallel only: ``tensor_parallel_size`` is 1 (refused otherwise) and ``data_parallel_size`` defaults to\n"
        "    every process. Fabric's own ``ModelParallelStrategy.teardown()`` raises in Lightning 2.6 (it reads the\n"
        "    ``checkpoint_io`` it refuses to have), after this class removed its hooks; ``swap_session.close()`` alone\n"
        "    does not raise." + _ARGS_DOC
    )

    def __init__(self, parallelize_fn: Any, **options: Any) -> None:
        tensor_parallel = options.setdefault("tensor_parallel_size", 1)
        if tensor_parallel != 1:
            raise ValueError(
                f"ModelParallelCPUSwapFabricStrategy: tensor_parallel_size={tensor_parallel!r}; cpu_swap composes with "
                "FSDP2's data parallelism only: allowed tensor_parallel_size=1."
            )
        super().__init__(parallelize_fn=parallelize_fn, **options)

    @override
    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":  # FSDP2 over every process (Fabric's "auto" is one per node)
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        pass  # no name: Fabric's registry builds a strategy without arguments


def register_fabric_strategies() -> None:
    """Register ``"cpu_swap"`` and ``"ddp_cpu_swap"`` in Fabric's strategy registry (idempotent;
    importing this module does it: Note [Strategies registered on import] in ``lightning_swap/__init__.py``)."""
    for cls in (CPUSwapFabricStrategy, DDPCPUSwapFabricStrategy):
        cls.register_strategies(STRATEGY_REGISTRY)


register_fabric_strategies()
