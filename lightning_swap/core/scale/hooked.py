"""The step API of loops that have no step hook (Accelerate, Lightning Fabric, a plain PyTorch
loop): :class:`HookedSwapSession`, a :class:`~.session.SwapSession` that finds each training
step's start and end in hooks of its own, on the model and its optimizers.

The step API is the session's (Note [One step API] in ``session.py``: the window, the observed
step's out-of-memory fallback and the plan's log, one implementation for every front end); this
class only finds its calls in hooks, and an adapter only says where its backward runs
(:meth:`HookedSwapSession.backward`), which optimizers it prepared
(:meth:`HookedSwapSession.hook_optimizer`) and how its processes agree (``collectives``).

Note [Hooked step window]: the core measures one training step between ``begin_step`` (before
the forward) and ``end_step`` (after the optimizer step): a step is everything from a training
batch's start to its end. A loop without a step hook gives no call at either end, so the window
opens in a forward pre-hook on the user's (unwrapped) model, only when autograd is recording and
the model is in training mode (an evaluation forward never opens it), and closes after the step
of any hooked optimizer (a step post-hook on the user's torch optimizer) that follows the
adapter's backward (:meth:`HookedSwapSession.backward`), or, when none follows (gradient
accumulation), at the next forward. The batch (the forward's arguments) and every hooked
optimizer's state are tracked as alive before the step, as the Lightning strategy does. A loop
that calls ``loss.backward()`` itself, not the adapter's backward, leaves the window open; the
next training forward restarts it, so only that step's statistics are lost. A failed backward
(for instance out of memory) also leaves it open, for the same reason: closing it would report a
step that did not happen.

Under ``policy="auto"`` the pre-hook asks the session what the step does (Note [Auto: observe,
plan, check] in ``auto.py``): the first steps run under the lowest-memory plan and are observed
under it on every process, from their forward to the next training forward (the user's loss, the
backward and the optimizer step included: the real step, not a stand-in for it); the decisions
depend only on what every process sees alike, so all of them enter the plan's broadcast (the
adapter's :class:`~.collectives.Collectives`) together. Nothing runs the model or the user's code
an extra time, but for one last resort: Note [Out of memory in the observed step].

Note [Out of memory in the observed step]: the observed step runs without a plan, and only once
the guard steps bound its peak within the budget; when it is out of memory all the same, in the
model's forward (seen by a forward hook that runs when the forward raises) or in the backward, the
fallback profiles the step on fake tensors (the model's forward once more, inside the adapter's
``forward_context``, with :func:`model_output_loss` standing for the user's loss), plans it, and
sets the RNG back to the step's start (Note [The observed step does not fit] in ``fallback.py``);
a failed backward's gradients are discarded when the step began without any. The loop is the
user's, so the library cannot run the step again as the Lightning strategy does: the error is
raised as it was, with a warning, and a loop that runs the step again (catching
``torch.OutOfMemoryError``) runs it under the plan and trains as plain training would have.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override  # a dependency of torch's

from ..config import SwapConfig
from ..engine.unified.memory import UnifiedMemory
from ..runtime.stats import StepStats
from ..tensors import tensors_in
from .auto import StepKind
from .collectives import Collectives
from .session import SwapSession

__all__ = ["HookedSwapSession", "model_output_loss"]


class HookedSwapSession(SwapSession):
    """A :class:`SwapSession` that also owns the hooks opening and closing each step's window
    (Note [Hooked step window]) and watching the observed step's forward (Note [Out of memory in
    the observed step]); :meth:`close` removes them with the runtime.

    ``advice``: what the fallback's error tells the user to do when fake mode fails too (the
    adapter's spelling of a forced policy); ``forward_context``: what the adapter runs the model's
    forward inside (autocast), for the fallback's fake forward; ``collectives``: how the
    processes agree.
    """

    def __init__(
        self,
        model: nn.Module,
        config: SwapConfig,
        device: torch.device | str,
        *,
        advice: str,
        forward_context: Callable[[], AbstractContextManager] = contextlib.nullcontext,
        collectives: Collectives = Collectives(),
        unified: Optional[UnifiedMemory] = None,
    ) -> None:
        def step_fn(model: nn.Module, call: Any) -> torch.Tensor:
            """The fallback's step: the model's forward on the step's call, in the adapter's context."""
            with forward_context():
                return model_output_loss(model(*call[0], **call[1]))

        super().__init__(model, config, device, unified=unified, collectives=collectives, step_fn=step_fn, advice=advice)
        self._pre_hook: Optional[RemovableHandle] = None
        self._post_hook: Optional[RemovableHandle] = None
        #: The running forward began an observed step (its failure is the fallback's business).
        self._observed_forward = False
        #: The fallback's own failure in the forward hook, where torch only warns: the next
        #: training forward raises it.
        self._fallback_error: Optional[BaseException] = None
        #: id -> (the user's torch optimizer, its step post-hook).
        self._optimizers: dict[int, tuple[Any, RemovableHandle]] = {}
        #: A step's backward is over; the step ends after the optimizer step (a post-hook on each
        #: hooked optimizer) or, without one (accumulation), at the next forward.
        self.step_pending = False
        #: Called with each finished step's statistics (an observed step's own record).
        self.on_step_end: Callable[[Optional[StepStats]], None] = lambda stats: None

    @property
    def hooked(self) -> bool:
        return self._pre_hook is not None

    def install_hook(self) -> None:
        if self._pre_hook is None:
            self._pre_hook = self.model.register_forward_pre_hook(self._on_forward, with_kwargs=True)
            self._post_hook = self.model.register_forward_hook(self._after_forward, with_kwargs=True, always_call=True)

    def hook_optimizer(self, optimizer: Any) -> None:
        """End each step after ``optimizer``'s step: the user's torch optimizer, or a wrapper
        holding it as ``.optimizer`` (Accelerate's, Fabric's); its state is tracked as alive."""
        inner = getattr(optimizer, "optimizer", optimizer)
        if id(inner) not in self._optimizers and hasattr(inner, "register_step_post_hook"):
            handle = inner.register_step_post_hook(lambda *_: self.finish_pending_step())
            self._optimizers[id(inner)] = (inner, handle)

    def optimizer_states(self) -> list[Any]:
        """The hooked optimizers' states (what the step tracks as alive beside the batch)."""
        return [optimizer.state for optimizer, _ in self._optimizers.values()]

    @override
    @contextmanager
    def backward(self) -> Iterator[None]:
        """Around the adapter's backward of the loss: the step's forward is over inside, its
        backward after (Note [Hooked step window]); a failed one is :meth:`step_failed`'s (Note
        [Out of memory in the observed step]), its error raised as it was."""
        with super().backward():
            yield
        self.step_pending = True  # the step ends after the optimizer's (Note [Hooked step window])

    def finish_pending_step(self) -> None:
        """The step is over: its window closes (the optimizer step inside it), an observed step
        becomes the profile."""
        if self.step_pending:
            self.step_pending = False
            self.on_step_end(self.close_step())

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.finish_pending_step()
        if not (module.training and torch.is_grad_enabled()):
            return None
        if self._fallback_error is not None:
            error, self._fallback_error = self._fallback_error, None
            raise error
        states = self.optimizer_states()
        track = [args, kwargs, states]
        if self.auto is not None and not self._planning_suspended:
            self._observed_forward = self.open_step((args, kwargs), track, states) is StepKind.OBSERVE
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
            try:
                self.step_failed(error)
            except RuntimeError as failed:  # fake mode failed too (its message says what to do)
                self._fallback_error = failed
        return None

    @override
    def end_training(self) -> Optional[StepStats]:
        """Training is over: the pending step closes first (its backward is over), then as
        :meth:`SwapSession.end_training`."""
        self.finish_pending_step()
        return super().end_training()

    @override
    def close(self) -> None:
        """Remove the hooks and the runtime. (:meth:`remove`, which the core calls to swap one
        plan for another or to profile, removes the runtime only.)"""
        self.abort_step()
        self.step_pending = False
        for handle in (self._pre_hook, self._post_hook, *(h for _, h in self._optimizers.values())):
            if handle is not None:
                handle.remove()
        self._pre_hook = self._post_hook = None
        self._optimizers.clear()
        super().close()


def model_output_loss(output: Any) -> torch.Tensor:
    """A scalar standing for the user's loss when only the model's output is known
    (Note [Out of memory in the observed step]): ``output["loss"]`` (or ``.loss``) when it is a
    tensor, else the sum of every floating-point tensor in the output that requires grad."""
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
