"""``SwapAccelerator``: ``accelerate.Accelerator`` with planned offload and recompute.

Thin by design: every decision lives in :mod:`lightning_swap.core`; this module only calls
it from the places an Accelerate training loop already goes through. ``prepare_model``
builds a :class:`~lightning_swap.core.scale.session.SwapSession` on the user's (unwrapped) model
and applies the plan; a forward pre-hook on that model opens each step's window and
``backward`` closes it.

Note [Accelerate step window]: the core measures one training step between
``begin_step`` (before the forward) and ``end_step`` (after the optimizer step). An Accelerate
loop has no step hook, so the window opens in a forward pre-hook on the unwrapped model, only
when autograd is recording and the model is in training mode (an evaluation forward never
opens it), and closes after the step of any prepared optimizer (a step post-hook on the
user's optimizer) that follows :meth:`SwapAccelerator.backward`, or, when none follows
(gradient accumulation), at the next forward. The batch (the forward's arguments) and every
prepared optimizer's state are tracked as alive before the step, as the Lightning strategy
does. A loop that calls ``loss.backward()`` itself leaves the window open; the next training
forward restarts it, so only that step's statistics are lost. A failed backward (for instance
out of memory) also leaves it open, for the same reason: closing it would report a step that
did not happen.

Note [Auto policy in Accelerate]: a forced policy needs no batch, so its plan is made in
``prepare``. ``policy="auto"`` plans from the training steps themselves, as the Lightning
strategy does (Note [Auto: observe, plan, check] in ``lightning_swap/core/auto.py``): the
forward pre-hook asks the session what the step does; the first training step runs with every
segment kept and is observed on the main process, from its forward to the next training
forward (the user's loss, ``accelerator.backward`` and the optimizer step included: the real
step, not a stand-in for it); the next step plans from that profile for the steady state, and
the one after checks the plan against its measured peak. The decisions depend only on what
every process sees alike, so all of them enter the plan's broadcast in
:meth:`SwapAccelerator._plan_on_main` together, and nothing is reduced across processes per
step. Nothing runs the model or the user's code an extra time.

Note [Accelerate leaves no trace]: the runtime is applied to ``unwrap_model(model)``, never
to the DDP wrapper, so segment names are the user's and ``state_dict`` keys do not change.
The session owns its forward pre-hook handle; ``swap_session.close()``,
``free_memory()``/``clear()`` and ``end_training()`` remove the hook and the runtime
(wrappers, host pool), after which the model is exactly the user's again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, DynamoBackend, broadcast_object_list
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_swap.core import Plan
from lightning_swap.core import StepStats
from lightning_swap.core import split_call, tensors_in
from lightning_swap.core import SwapConfig
from lightning_swap.core import SwapSession
from lightning_swap.core import UnifiedMemory, unified_memory_for

from .plugin import SwapPlugin

__all__ = ["AcceleratedSwapSession", "SwapAccelerator"]

log = logging.getLogger(__name__)

#: One process, or plain data parallel (DDP): the runtime acts on each process's own copy of
#: the model. Tested on CPU (one process and MULTI_CPU); MULTI_GPU is the same code on CUDA.
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class AcceleratedSwapSession(SwapSession):
    """A :class:`SwapSession` that also owns the forward pre-hook opening each step's window
    (Note [Accelerate step window]); :meth:`close` removes both.

    ``states()`` gives the prepared optimizers' states; ``plan_on_main(solve)`` runs ``solve``
    on the main process and hands every process its result (Note [Auto policy in Accelerate]).
    """

    def __init__(
        self,
        model: nn.Module,
        config: SwapConfig,
        device: torch.device | str,
        *,
        states: Callable[[], list] = list,
        is_main: bool = True,
        plan_on_main: Optional[Callable[[Callable[[], Plan]], Plan]] = None,
        unified: Optional[UnifiedMemory] = None,
    ) -> None:
        super().__init__(model, config, device, unified=unified)
        self._states = states
        self._is_main = is_main
        self._plan_on_main = plan_on_main or (lambda solve: solve())
        self._planning_suspended = False
        self._pre_hook: Optional[RemovableHandle] = None
        self._optimizer_hooks: dict[int, RemovableHandle] = {}
        #: A step's backward is over; the step ends after the optimizer step (a post-hook on each
        #: prepared optimizer) or, without one (accumulation), at the next forward.
        self.step_pending = False
        #: Called with each finished step's statistics (``None`` for an observed step's).
        self.on_step_end: Callable[[Optional[StepStats]], None] = lambda stats: None

    @property
    def hooked(self) -> bool:
        return self._pre_hook is not None

    def install_hook(self) -> None:
        if self._pre_hook is None:
            self._pre_hook = self.model.register_forward_pre_hook(self._on_forward, with_kwargs=True)

    @contextmanager
    def planning_suspended(self) -> Iterator[None]:
        """No planning from the hook inside (the batch-size search); windows still open whenever
        a runtime is installed."""
        previous, self._planning_suspended = self._planning_suspended, True
        try:
            yield
        finally:
            self._planning_suspended = previous

    def hook_optimizer(self, optimizer: Any) -> None:
        """End each step after ``optimizer``'s step (the user's torch optimizer, inside
        Accelerate's wrapper)."""
        inner = getattr(optimizer, "optimizer", optimizer)
        if id(inner) not in self._optimizer_hooks and hasattr(inner, "register_step_post_hook"):
            self._optimizer_hooks[id(inner)] = inner.register_step_post_hook(lambda *_: self.finish_pending_step())

    def finish_pending_step(self) -> None:
        """The step is over: its window closes (the optimizer step inside it), an observed step
        becomes the profile."""
        if self.step_pending:
            self.step_pending = False
            stats = self.end_step()
            self.step_done()
            self.on_step_end(stats)

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.finish_pending_step()
        if not (module.training and torch.is_grad_enabled()):
            return None
        states = self._states()
        track = [args, kwargs, states]
        if self.auto is not None and not self._planning_suspended:
            self.before_step((args, kwargs), track, states, is_main=self._is_main, plan_on_main=self._plan_on_main)
        elif self.runtime is not None:
            self.begin_step(track)
        return None

    def close(self) -> None:
        """Remove the hook and the runtime. (:meth:`remove`, which the core calls to swap one
        plan for another or to profile, removes the runtime only.)"""
        self.abort_step()
        self.step_pending = False
        if self._pre_hook is not None:
            self._pre_hook.remove()
            self._pre_hook = None
        for handle in self._optimizer_hooks.values():
            handle.remove()
        self._optimizer_hooks.clear()
        self.remove()


def _optimizer_states(optimizers: Iterable[Any]) -> list[Any]:
    # AcceleratedOptimizer wraps the user's optimizer; its state is the wrapped one's.
    return [getattr(opt, "optimizer", opt).state for opt in optimizers]


def model_output_loss(output: Any) -> torch.Tensor:
    """A scalar standing for the user's loss when only the model's output is known
    (Note [Auto policy in Accelerate]): ``output["loss"]`` (or ``.loss``) when it is a tensor,
    else the sum of every floating-point tensor in the output that requires grad."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss if loss.dim() == 0 else loss.float().sum()
    parts = [t.float().sum() for t in tensors_in(output) if t.is_floating_point() and t.requires_grad]
    if not parts:
        raise ValueError(
            "policy='auto' profiles the model's forward and needs its output to hold a floating-point "
            f"tensor that requires grad; got {type(output).__name__}."
        )
    return torch.stack(parts).sum() if len(parts) > 1 else parts[0]


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

    # -- prepare ------------------------------------------------------------------------
    @override
    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None, evaluation_mode: bool = False):
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
        session = AcceleratedSwapSession(
            module,
            self.swap_plugin.to_config(),
            self.device,
            states=lambda: _optimizer_states(self._optimizers),
            is_main=self.is_main_process,
            plan_on_main=lambda solve: self._plan_on_main(self._swap_session, solve),
            unified=self.swap_unified_memory,
        )
        session.on_step_end = self._after_swap_step
        try:
            if not session.config.is_auto:  # Note [Auto policy in Accelerate]
                session.apply(self._plan_on_main(session, session.forced_plan))
            session.install_hook()
            for optimizer in self._optimizers:
                session.hook_optimizer(optimizer)
        except BaseException:
            session.close()
            raise
        self._swap_session = session

    def _plan_on_main(self, session: AcceleratedSwapSession, solve: Callable[[], Plan]) -> Plan:
        """``solve()`` on the main process, broadcast, so every process applies the same plan.

        Every process reaches this collective (``prepare``, or the same training forward); a
        failure on the main process is broadcast too, so the others raise instead of waiting
        forever.
        """
        payload: list[Any] = [None]
        error: Optional[BaseException] = None
        if self.is_main_process:
            try:
                payload[0] = ("plan", solve())
            except Exception as err:  # re-raised below, after the others have been told
                error = err
                payload[0] = ("error", f"{type(err).__name__}: {err}")
        broadcast_object_list(payload, from_process=0)
        kind, body = payload[0]
        if kind == "error":
            if error is not None:
                raise error
            raise RuntimeError(f"the main process could not plan the model: {body}")
        if not isinstance(body, Plan):
            return body  # another decision taken on the main process (Note [Observe only what fits])
        plan: Plan = body
        # the planner lists segments in execution order, the forced plan in the model's order; a
        # module run several times is a segment per call (Note [A segment per call])
        if sorted({split_call(name)[0] for name in plan.segments}) != sorted(session.segments):
            raise ValueError(
                f"process {self.process_index} cut the model into segments {list(session.segments)}, "
                f"but the main process planned {list(plan.segments)}; every process must build the same model."
            )
        return plan

    # -- steps --------------------------------------------------------------------------
    @override
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        session = self.swap_session
        if session is not None:
            session.backward_begins()
        try:
            super().backward(loss, **kwargs)
        except BaseException:
            if session is not None:
                session.abort_step()
            raise
        if session is None:
            return
        session.backward_done()  # Note [Accelerate step window]: the step ends after the optimizer's
        session.step_pending = True

    @override
    def prepare_optimizer(self, optimizer: Any, device_placement: Optional[bool] = None) -> Any:
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if self._swap_session is not None:
            self._swap_session.hook_optimizer(prepared)
        return prepared

    def _after_swap_step(self, stats: Optional[StepStats]) -> None:
        session = self._swap_session
        if stats is None and session is not None:
            stats = session.records.newest()  # an observed step's own record
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
            self._swap_session.finish_pending_step()
            if self.swap_step_stats is not None:  # training is over: the host may wait now
                self.swap_step_stats = self._swap_session.stats(wait=True)
            self._swap_session.close()
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
