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
strategy does (Note [Auto: observe, plan, check] in ``lightning_swap/core/scale/auto.py``): the
forward pre-hook asks the session what the step does; the first steps run under the
lowest-memory plan and are observed under it on every process (the profiles merge by their
largest values: Note [Decide from the largest measurement]), from their forward to the next
training forward (the user's loss, ``accelerator.backward`` and the optimizer step included: the
real step, not a stand-in for it); from the steady one the processes predict plain's peak, and
either observe a plain step (when it fits) or plan a mix at once; each new plan's first step is
checked against its measured peak. The decisions depend only on what every process sees alike
(the batch key is agreed across processes: two reductions per step), so all of them enter the
plan's broadcast (the session's ``Collectives``, :meth:`SwapAccelerator._swap_collectives`)
together. Nothing runs the model or the user's code an extra time, but for one last resort:
Note [Out of memory in the observed step].

Note [Out of memory in the observed step]: the observed step runs without a plan, and only
once the guard steps bound its peak within the budget; when it is out of memory all the same,
in the model's forward (seen by a forward hook that runs when the forward raises) or in
:meth:`SwapAccelerator.backward`, the core's fallback profiles the step on fake tensors (the
model's forward once more, with :func:`model_output_loss` standing for the user's loss), plans
it, and sets the RNG back to the step's start (Note [The observed step does not fit] in
``lightning_swap/core/scale/fallback.py``); a failed backward's gradients are discarded when the
step began without any. The loop is the user's, so the library cannot run the step again as the
Lightning strategy does: the error is raised as it was, with a warning, and a loop that runs the
step again (catching ``torch.OutOfMemoryError``) runs it under the plan and trains as plain
training would have.

Note [Accelerate leaves no trace]: the runtime is applied to ``unwrap_model(model)``, never
to the DDP wrapper, so segment names are the user's and ``state_dict`` keys do not change.
The session owns its forward pre-hook handle; ``swap_session.close()``,
``free_memory()``/``clear()`` and ``end_training()`` remove the hook and the runtime
(wrappers, host pool), after which the model is exactly the user's again.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, DynamoBackend, broadcast_object_list, gather_object
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_swap.core import Collectives
from lightning_swap.core import is_out_of_memory
from lightning_swap.core import Plan
from lightning_swap.core import StepStats
from lightning_swap.core import tensors_in
from lightning_swap.core import SwapConfig
from lightning_swap.core import StepKind, SwapSession
from lightning_swap.core import UnifiedMemory, unified_memory_for

from .plugin import SwapPlugin

__all__ = ["AcceleratedSwapSession", "SwapAccelerator"]

log = logging.getLogger(__name__)

#: One process, plain data parallel (DDP), or FSDP (2 and 1): the runtime acts on each process's
#: own copy of the model (under FSDP, its shards). Tested on CPU (one process, MULTI_CPU, FSDP2
#: and FSDP1, which Accelerate selects only on accelerators: the test forces it); MULTI_GPU is
#: the same code on CUDA.
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.FSDP)


class AcceleratedSwapSession(SwapSession):
    """A :class:`SwapSession` that also owns the forward hooks opening each step's window
    (Note [Accelerate step window]) and watching the observed step's forward (Note [Out of
    memory in the observed step]); :meth:`close` removes them with the runtime.

    ``states()`` gives the prepared optimizers' states; ``collectives``: how the processes agree
    (Note [Auto policy in Accelerate]).
    """

    def __init__(
        self,
        model: nn.Module,
        config: SwapConfig,
        device: torch.device | str,
        *,
        states: Callable[[], list] = list,
        collectives: Collectives = Collectives(),
        unified: Optional[UnifiedMemory] = None,
    ) -> None:
        super().__init__(model, config, device, unified=unified, collectives=collectives)
        self._states = states
        self._planning_suspended = False
        self._pre_hook: Optional[RemovableHandle] = None
        self._post_hook: Optional[RemovableHandle] = None
        #: The running forward began an observed step (its failure is the fallback's business).
        self._observed_forward = False
        #: The fallback's own failure in the forward hook, where torch only warns: the next
        #: training forward raises it.
        self._fallback_error: Optional[BaseException] = None
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
            self._post_hook = self.model.register_forward_hook(self._after_forward, with_kwargs=True, always_call=True)

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
        if self._fallback_error is not None:
            error, self._fallback_error = self._fallback_error, None
            raise error
        states = self._states()
        track = [args, kwargs, states]
        if self.auto is not None and not self._planning_suspended:
            self._observed_forward = self.before_step((args, kwargs), track, states) is StepKind.OBSERVE
        elif self.runtime is not None:
            self.begin_step(track)
        return None

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """After every forward, also one that raised (``always_call``): torch calls this hook
        while handling the error, so ``sys.exc_info()`` holds it (Note [Out of memory in the
        observed step])."""
        observed, self._observed_forward = self._observed_forward, False
        error = sys.exc_info()[1]
        if observed and output is None and error is not None:
            self.abort_step()
            if is_out_of_memory(error):
                try:
                    self.plan_after_observed_out_of_memory(error)
                except RuntimeError as failed:  # fake mode failed too (its message says what to do)
                    self._fallback_error = failed
        return None

    def plan_after_observed_out_of_memory(self, exc: BaseException) -> None:
        """Note [Out of memory in the observed step]: plan from a fake-mode profile, warn; the
        caller raises ``exc`` as it was."""
        previous, self._planning_suspended = self._planning_suspended, True  # the fake forward is not a step
        try:
            self.plan_after_out_of_memory(
                exc, lambda model, call: model_output_loss(model(*call[0], **call[1])),
                advice="Choose a policy for it instead, e.g. SwapPlugin(policy='recompute_offload'), or a smaller batch.",
            )
        finally:
            self._planning_suspended = previous
        if self.collectives.is_main:
            warnings.warn(
                "lightning-swap: the observed training step is out of memory without a plan; it was profiled on fake "
                "tensors (the model's forward ran once more) and planned. The error is raised as it was: run the step "
                "again (catch torch.OutOfMemoryError) and it runs under the plan, from the RNG state it started with.",
                UserWarning, stacklevel=2,
            )

    @override
    def close(self) -> None:
        """Remove the hooks and the runtime. (:meth:`remove`, which the core calls to swap one
        plan for another or to profile, removes the runtime only.)"""
        self.abort_step()
        self.step_pending = False
        for handle in (self._pre_hook, self._post_hook, *self._optimizer_hooks.values()):
            if handle is not None:
                handle.remove()
        self._pre_hook = self._post_hook = None
        self._optimizer_hooks.clear()
        super().close()


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
        session = AcceleratedSwapSession(
            module,
            self.swap_plugin.to_config(),
            self.device,
            states=lambda: _optimizer_states(self._optimizers),
            collectives=self._swap_collectives(),
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

    def _swap_collectives(self) -> Collectives:
        """How the processes agree (plans, verdicts, the batch-size search): the main process's
        objects broadcast, numbers gathered; one process's identity when there is one."""
        if self.num_processes == 1:
            return Collectives()

        def broadcast(obj: Any) -> Any:
            payload = [obj]
            broadcast_object_list(payload, from_process=0)
            return payload[0]

        def gathered(value: float) -> torch.Tensor:
            return self.gather(torch.tensor([float(value)], dtype=torch.float64, device=self.device))

        return Collectives(
            is_main=self.is_main_process,
            broadcast=broadcast,
            reduce_max=lambda v: float(gathered(v).max().item()),
            reduce_min=lambda v: int(gathered(v).min().item()),
            gather=lambda obj: gather_object([obj]),
        )

    # -- steps --------------------------------------------------------------------------
    @override
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        session = self.swap_session
        observing = session is not None and session.observing
        # Only a backward that starts without gradients can have a failed attempt's discarded.
        fresh = observing and all(p.grad is None for p in session.model.parameters())
        if session is not None:
            session.backward_begins()
        try:
            super().backward(loss, **kwargs)
        except BaseException as exc:
            if session is not None:
                session.abort_step()
                if fresh and is_out_of_memory(exc):  # Note [Out of memory in the observed step]
                    for p in session.model.parameters():
                        p.grad = None  # what the failed backward accumulated
                    session.plan_after_observed_out_of_memory(exc)
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
