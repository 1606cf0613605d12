"""Note [A segment per call], as the runtime applies it: which call of a module is running.

A module run several times in one step (ALBERT's one layer, a weight-tied or looped block) is one
segment per call in a profile and in a plan (``name``, ``name#1``, ``name#2``...; see
``segments.py``). A plan that names a module's calls one by one gets, on that module, a forward
pre-hook that counts the calls of the step (with autograd recording, not a recomputation in
backward) and a ``forward`` that runs the current call's action; calls beyond the plan's (a loop
that runs longer than the profiled step) are kept. A plan that names the module alone applies
its action to every call. The counts start again at each ``begin_step`` and at each backward
pass of the step (``SwapRuntime.new_pass``): a closure optimizer's next pass (LBFGS, SAM) runs the
model again from its first call, while two forwards before one backward (two views of a batch)
are two calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

from ..actions import Action
from ..segments import split_call
from ..tensors import ModuleHook

__all__ = ["SegmentCalls"]


class SegmentCalls:
    """The plan's segments grouped by module: ``groups[module] = [(call, name, index), ...]``."""

    def __init__(self, actions: Mapping[str, Action]) -> None:
        self.groups: dict[str, list[tuple[int, str, int]]] = {}
        for index, name in enumerate(actions):
            module_name, call = split_call(name)
            self.groups.setdefault(module_name, []).append((call, name, index))
        for entries in self.groups.values():
            entries.sort()
        self._count: dict[str, int] = {}
        self._current: dict[str, int] = {}
        #: Whether a backward ran since the calls were last counted from 0 (asked, and forgotten,
        #: as a call is counted): the runtime's.
        self.new_pass: Callable[[], bool] = lambda: False

    def per_call(self, module_name: str) -> bool:
        """Whether the plan names this module's calls one by one (else one action for all)."""
        entries = self.groups[module_name]
        return len(entries) > 1 or entries[0][0] != 0

    def reset(self) -> None:
        """A new step: calls are counted from 0 again."""
        self._count.clear()
        self._current.clear()

    def counter(self, module_name: str) -> ModuleHook:
        """The forward pre-hook counting ``module_name``'s calls (registered before the others)."""

        def hook(module: Any, args: Any) -> None:
            if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
                if self.new_pass():
                    self.reset()
                call = self._count.get(module_name, 0)
                self._count[module_name] = call + 1
                self._current[module_name] = call

        return ModuleHook(hook)

    def entry_now(self, module_name: str) -> Optional[tuple[int, str, int]]:
        """The plan's (call, name, index) for the call running now; ``None`` beyond the plan."""
        call = self._current.get(module_name, 0)
        for entry in self.groups[module_name]:
            if entry[0] == call:
                return entry
        return None

    def index_now(self, module_name: str) -> Optional[int]:
        entry = self.entry_now(module_name)
        return entry[2] if entry is not None else None

    def dispatch(self, module_name: str, forwards: dict[int, Callable[..., Any]], keep: Callable[..., Any]) -> Callable[..., Any]:
        """A ``forward`` running the current call's own (``forwards``, by call; ``keep`` for calls
        beyond the plan)."""

        def forward(*args: Any, **kwargs: Any) -> Any:
            entry = self.entry_now(module_name)
            fn = forwards.get(entry[0], keep) if entry is not None else keep
            return fn(*args, **kwargs)

        return forward
