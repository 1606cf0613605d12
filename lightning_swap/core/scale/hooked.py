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
that calls ``loss.backward()`` itself, not the adapter's backward, is seen by a hook on the
model's output: its step closes at the next training forward.

A second training forward before the step's backward (two views of a batch, a siamese pair, DPO's
chosen and rejected passes) joins the open step: it is part of the same step, and the budget held
online sees the first forward's live bytes (Note [The budget held online] in
``runtime/online.py``). A forward with no backward (a loop that skips a non-finite loss) leaves the
step open, and the next training forward joins it too; the step closes after the next optimizer
step, or when training ends. Under ``policy="auto"`` the pre-hook asks the session what the step
runs (Note [Auto learns from the steps it runs] in ``auto.py``); nothing runs the model or the
user's code an extra time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override  # a dependency of torch's

from ..config import SwapConfig
from ..engine.unified.memory import UnifiedMemory
from ..runtime.stats import StepStats
from ..tensors import on_backward_start
from .collectives import Collectives
from .session import SwapSession

__all__ = ["HookedSwapSession"]


class HookedSwapSession(SwapSession):
    """A :class:`SwapSession` that also owns the hooks opening and closing each step's window
    (Note [Hooked step window]); :meth:`close` removes them with the runtime. ``advice``: how the
    front end's user sets a budget (the session's warning without one)."""

    def __init__(
        self, model: nn.Module, config: SwapConfig, device: torch.device | str, *, advice: str,
        collectives: Collectives = Collectives(), unified: Optional[UnifiedMemory] = None,
    ) -> None:
        super().__init__(model, config, device, unified=unified, collectives=collectives, advice=advice)
        self._pre_hook: Optional[RemovableHandle] = None
        self._post_hook: Optional[RemovableHandle] = None
        #: A backward through the open step's outputs has begun (the adapter's, or the user's own).
        self._backward_ran = False
        #: id -> (the user's torch optimizer, its step post-hook).
        self._optimizers: dict[int, tuple[Any, RemovableHandle]] = {}
        #: A step's backward is over; the step ends after the optimizer step (a post-hook on each
        #: hooked optimizer) or, without one (accumulation), at the next forward.
        self.step_pending = False
        #: Called with each finished step's statistics.
        self.on_step_end: Callable[[Optional[StepStats]], None] = lambda stats: None

    @property
    def hooked(self) -> bool:
        return self._pre_hook is not None

    def install_hook(self) -> None:
        if self._pre_hook is None:
            self._pre_hook = self.model.register_forward_pre_hook(self._on_forward, with_kwargs=True)
            self._post_hook = self.model.register_forward_hook(self._after_forward)

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
        backward after (Note [Hooked step window]); a failed one is :meth:`step_failed`'s, its
        error raised as it was."""
        with super().backward():
            yield
        self.step_pending = True  # the step ends after the optimizer's (Note [Hooked step window])

    def finish_pending_step(self) -> None:
        """The step is over: its window closes (the optimizer step inside it)."""
        if self.step_pending:
            self.step_pending = False
            self.on_step_end(self.close_step())

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.step_open and self._backward_ran:
            self.step_pending = True  # a backward ran since the step opened: the step is over
        self.finish_pending_step()
        if not (module.training and torch.is_grad_enabled()) or self.step_open:
            return None  # an evaluation forward; or a second forward of the open step, which joins it
        self._backward_ran = False
        states = self.optimizer_states()
        track = [args, kwargs, states]
        if self.auto is not None and not self._planning_suspended:
            self.open_step((args, kwargs), track, [optimizer for optimizer, _ in self._optimizers.values()])
        elif self.runtime is not None:
            self._begin_step(track)
            self._step_open = True
        return None

    def _after_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.step_open and module.training and torch.is_grad_enabled():
            on_backward_start(output, self._backward_seen)

    def _backward_seen(self) -> None:
        self._backward_ran = True

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
        self._abort_step()
        self.step_pending = False
        for handle in (self._pre_hook, self._post_hook, *(h for _, h in self._optimizers.values())):
            if handle is not None:
                handle.remove()
        self._pre_hook = self._post_hook = None
        self._optimizers.clear()
        super().close()
