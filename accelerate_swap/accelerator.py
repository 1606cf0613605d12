"""``SwapAccelerator``: ``accelerate.Accelerator`` with planned offload and recompute.

Thin by design: every decision lives in :mod:`lightning_swap.core`; this module only calls
it from the places an Accelerate training loop already goes through. ``prepare_model``
builds a :class:`~lightning_swap.core.HookedSwapSession` on the user's (unwrapped) model and
applies the plan; the session's hooks find each step (Note [Hooked step window] in
``lightning_swap/core/scale/hooked.py``: a forward pre-hook opens the window, a step post-hook on
every prepared optimizer closes it after :meth:`SwapAccelerator.backward`), and the budget held
online and the plan's log are the core's too (Note [One step API] in
``lightning_swap/core/scale/session.py``): one implementation, shared with Lightning and Fabric;
this module has none of its own.

Note [Auto policy in Accelerate]: a forced policy needs no batch, so its plan is made in
``prepare``. ``policy="auto"`` plans from the training steps themselves, as the Lightning
strategy does (Note [Auto learns from the steps it runs] in ``lightning_swap/core/scale/auto.py``), in
the session's forward pre-hook (Note [Hooked step window]); the processes agree through
``torch.distributed``'s default group, which Accelerate initialised (``process_group_collectives``).

Note [Accelerate leaves no trace]: the runtime is applied to ``unwrap_model(model)``, never
to the DDP wrapper, so segment names are the user's and ``state_dict`` keys do not change.
The session owns its forward pre-hook handle; ``swap_session.close()``,
``free_memory()``/``clear()`` and ``end_training()`` remove the hook and the runtime
(wrappers, host pool), after which the model is exactly the user's again.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, DynamoBackend
from torch import nn
from typing_extensions import override

from lightning_swap.core import process_group_collectives
from lightning_swap.core import HookedSwapSession
from lightning_swap.core import Plan
from lightning_swap.core import StepStats
from lightning_swap.core import UnifiedMemory, unified_memory_for

from .plugin import SwapPlugin

__all__ = ["AcceleratedSwapSession", "SwapAccelerator"]

log = logging.getLogger(__name__)

#: One process, plain data parallel (DDP), or FSDP (2 and 1): the runtime acts on each process's
#: own copy of the model (under FSDP, its shards). Tested on CPU (one process, MULTI_CPU, FSDP2
#: and FSDP1, which Accelerate selects only on accelerators: the test forces it); MULTI_GPU is
#: the same code on CUDA.
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.FSDP)


#: Note [Hooked step window]: the session that finds Accelerate's steps in hooks is the core's, shared
#: with Lightning Fabric (one implementation of the window and the budget held online); the
#: name stays for the users and tests that know it.
AcceleratedSwapSession = HookedSwapSession

#: How an Accelerate user gives ``auto`` a budget (the session's warning without one).
_ADVICE = "SwapPlugin(budget_bytes='8GiB') or ACCELERATE_CPU_SWAP_BUDGET_BYTES=8GiB"


class SwapAccelerator(Accelerator):
    """A drop-in :class:`accelerate.Accelerator` that keeps, offloads or recomputes each
    segment's activations.

    Switched on by ``swap_plugin=SwapPlugin(...)``, or, when that is not given, by the
    ``ACCELERATE_CPU_SWAP`` environment variable or the file in ``ACCELERATE_CPU_SWAP_CONFIG``
    (see :meth:`SwapPlugin.from_env`). Switched off, it is exactly ``Accelerator``.

    Switched on, ``prepare(model, ...)`` (or ``prepare_model``) cuts the model into segments;
    the plan is decided on the main process, broadcast, and applied to every process's copy:
    in ``prepare`` for a forced policy, in the first training forward for ``policy="auto"``
    (which profiles that step, and plans again for a batch of new shape and once optimizer
    state exists: Note [Auto policy in Accelerate]). Then:

    - ``swap_plan``: the applied :class:`~lightning_swap.Plan` (``None`` with ``"auto"``
      until the first training forward);
    - ``swap_step_stats``: the last step's :class:`~lightning_swap.StepStats` (on CUDA its
      times are filled in once the device has finished it, at the latest when the session
      closes; ``swap_session.stats()`` is the newest complete one), also sent to
      :meth:`log` as ``swap/...`` values at step ``swap_steps`` when trackers are set up;
    - ``swap_session.close()``: removes everything from the model (as do ``free_memory()``,
      ``clear()`` and ``end_training()``).

    One model per accelerator is trained with the plan; call ``free_memory()`` before
    preparing another. Models prepared with ``evaluation_mode=True`` are left alone.
    """

    def __init__(self, *args: Any, swap_plugin: Optional[SwapPlugin] = None, **kwargs: Any) -> None:
        if swap_plugin is not None and not isinstance(swap_plugin, SwapPlugin):
            raise ValueError(f"`swap_plugin` must be a SwapPlugin or None; got {swap_plugin!r}.")
        # Read (and validate) the environment before Accelerate starts any process group.
        self.swap_plugin: Optional[SwapPlugin] = swap_plugin if swap_plugin is not None else SwapPlugin.from_env()
        self._swap_session: Optional[AcceleratedSwapSession] = None
        #: The last measured step's statistics (``None`` before the first).
        self.swap_step_stats: Optional[StepStats] = None
        #: How many steps have been measured (the ``step`` their statistics are logged at).
        self.swap_steps = 0
        #: True while ``find_batch_size`` runs its trials (their steps are not counted or logged).
        self._swap_searching = False
        #: The installed unified memory (``um`` on), else ``None``.
        self.swap_unified_memory: Optional[UnifiedMemory] = None
        super().__init__(*args, **kwargs)
        if self.swap_plugin is not None:
            self._check_swap_supported()
            # Before any model is prepared: um="all" must precede the first CUDA allocation.
            self.swap_unified_memory = unified_memory_for(self.swap_plugin.to_config(), self.device)

    # -- what users read ----------------------------------------------------------------
    @property
    def swap_enabled(self) -> bool:
        return self.swap_plugin is not None

    @property
    def swap_session(self) -> Optional[AcceleratedSwapSession]:
        """The session of the prepared model (``None`` when off, before ``prepare`` or once closed)."""
        session = self._swap_session
        return session if session is not None and session.hooked else None

    @property
    def swap_plan(self) -> Optional[Plan]:
        """The plan applied to the prepared model (``None`` when off, before ``prepare`` or once closed)."""
        session = self.swap_session
        return session.plan if session is not None else None

    # -- checks -------------------------------------------------------------------------
    def _check_swap_supported(self) -> None:
        if self.distributed_type not in _SUPPORTED:
            allowed = ", ".join(d.value for d in _SUPPORTED)
            raise ValueError(
                f"The swap plugin (ACCELERATE_CPU_SWAP) does not support distributed_type={self.distributed_type.value}; "
                f"allowed: {allowed}. Switch the plugin off, or launch plain data parallel."
            )
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"The swap plugin supports devices cpu and cuda; this accelerator uses {self.device}.")
        dynamo = getattr(self.state, "dynamo_plugin", None)
        if dynamo is not None and dynamo.backend != DynamoBackend.NO:
            # The runtime shadows segments' forward after compilation; untested, so refused.
            raise ValueError(
                f"The swap plugin cannot be combined with torch.compile (dynamo_backend={dynamo.backend.value}); "
                "allowed: dynamo_backend='no' while ACCELERATE_CPU_SWAP is on."
            )

    def _check_fsdp(self) -> None:
        """Under Accelerate's FSDP plugin: not with the plugin's own activation checkpointing
        (Note [One activation policy] in ``lightning_swap/fsdp.py``); checked before the model is
        prepared, where Accelerate would apply it."""
        fsdp = getattr(self.state, "fsdp_plugin", None)
        if self.distributed_type != DistributedType.FSDP or fsdp is None:
            return
        if fsdp.activation_checkpointing:
            raise ValueError(
                "The FSDP plugin's activation_checkpointing and the swap plugin's policy would both decide what happens to "
                "each block's activations; pass one of them (policy='recompute' is activation checkpointing of every block)."
            )

    # -- prepare ------------------------------------------------------------------------
    @override
    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """Under FSDP2 Accelerate shards the model inside ``prepare`` (never through
        :meth:`prepare_model`): the plan is attached to the sharded model here."""
        if self.swap_plugin is not None:
            self._check_fsdp()
        result = super().prepare(*args, device_placement=device_placement)
        if self.swap_plugin is not None and self.state.is_fsdp2:
            for obj in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(obj, nn.Module):
                    self._attach(self.unwrap_model(obj, keep_torch_compile=False))
        return result

    @override
    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None, evaluation_mode: bool = False):
        if self.swap_plugin is not None and not evaluation_mode:
            self._check_fsdp()
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if self.swap_plugin is not None and not evaluation_mode:
            self._attach(self.unwrap_model(prepared, keep_torch_compile=False))
        return prepared

    def _attach(self, module: nn.Module) -> None:
        session = self.swap_session
        if session is not None:
            if session.model is module:
                return  # prepared twice: already in place
            raise ValueError(
                "SwapAccelerator trains one model with a plan, and one is already prepared; "
                "call `accelerator.free_memory()` before preparing another model, or prepare it "
                "with `evaluation_mode=True`."
            )
        session = HookedSwapSession(
            module, self.swap_plugin.to_config(), self.device, advice=_ADVICE, collectives=process_group_collectives(self.device),
            unified=self.swap_unified_memory,
        )
        session.on_step_end = self._after_swap_step
        try:
            if not session.config.is_auto:  # Note [Auto policy in Accelerate]
                session.apply_forced_plan()
            session.install_hook()
            for optimizer in self._optimizers:
                session.hook_optimizer(optimizer)
        except BaseException:
            session.close()
            raise
        self._swap_session = session

    # -- steps --------------------------------------------------------------------------
    @override
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        session = self.swap_session
        with session.backward() if session is not None else nullcontext():  # Note [Hooked step window]
            super().backward(loss, **kwargs)

    @override
    def prepare_optimizer(self, optimizer: Any, device_placement: Optional[bool] = None) -> Any:
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if self._swap_session is not None:
            self._swap_session.hook_optimizer(prepared)
        return prepared

    def _after_swap_step(self, stats: Optional[StepStats]) -> None:
        session = self._swap_session
        if stats is None or self._swap_searching:
            return
        self.swap_step_stats = stats
        self.swap_steps += 1
        if self.swap_plugin.log_stats and self.trackers:
            # Plain floats of the newest step the device has finished: nothing waits for it.
            resolved = session.stats()
            if resolved is not None:
                self.log(resolved.as_metrics(), step=self.swap_steps)

    # -- teardown -----------------------------------------------------------------------
    def _close_swap(self) -> None:
        if self._swap_session is not None:
            last = self._swap_session.end_training()  # training is over: the host may wait now
            if self.swap_step_stats is not None:
                self.swap_step_stats = last
            self._swap_session = None

    @override
    def free_memory(self, *objects: Any):
        self._close_swap()
        self.swap_step_stats = None
        self.swap_steps = 0
        return super().free_memory(*objects)

    @override
    def end_training(self) -> None:
        self._close_swap()
        if self.swap_unified_memory is not None:
            # New allocations go back to torch's allocator; managed ones stay valid
            # (Note [Managed memory outlives the session]).
            self.swap_unified_memory.close()
            self.swap_unified_memory = None
        super().end_training()
