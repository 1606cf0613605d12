"""The runtime: applies one action per segment to a model, counts what it did, and removes
itself completely (Note [Runtime leaves no trace]).

Note [Runtime leaves no trace]: the only change to the model is an instance attribute
``forward`` on each non-``KEEP`` segment, shadowing the class's method; no wrapper module is
inserted, so ``state_dict`` keys are untouched. ``remove()`` deletes the attribute (or
restores one the user had set), closes the offload engine (streams drained, host pool freed)
and is idempotent. Saved-tensor hooks are only ever entered for the duration of a segment's
forward, so none outlive a step. Under ``torch.compile`` (Note [Actions around compiled segments]
in ``compiled.py``) a segment may also get a ``forward`` while ``KEEP`` (its compiled forward),
and a segment compiled on its own has its module-level compilation set aside
(Note [Regional compilation is taken over]); ``remove()`` restores both.

Note [Regional compilation is taken over]: a segment compiled on its own (``block.compile()``,
or ``torch.compile(block)`` in its parent's place) compiles its whole call, hooks included.
What Dynamo makes of that depends on how it treats ``Module._call_impl``: torch 2.14 skips
that frame (torch's own code) and compiles the frames it calls, so the runtime's hooks and
action wrapper (dynamo-disabled) run eagerly and nothing breaks (measured: the same graphs and
no break without the takeover); a Dynamo that traced ``_call_impl`` would break the graph at
every hook and refuse under ``fullgraph=True``. The runtime does not depend on either: it sets
the module-level compilation aside while installed (``_compiled_call_impl`` to ``None``; the
wrapper's ``forward`` to the module's own ``__call__``) and compiles the segment's forward
itself, with the same Dynamo context: hooks and actions run eagerly around one graph per
segment, with no graph break (``tests/runtime/test_compile.py`` checks the set-aside, the graphs and
the breaks).

Note [No dispatch mode under compile]: on CPU the device meter is a ``TorchDispatchMode``, and
Dynamo runs everything eagerly while one is active (a ``fullgraph=True`` callable raises
instead, so the meter sets Dynamo's stance to ``force_eager`` while open: ``compiled.force_eager``).
When any module of the model is compiled, an ordinary step therefore runs without the meter
and reports ``peak_device_bytes=None`` (logged once); ``begin_step(measure=True)`` measures a
step anyway, running it eagerly (logged), and so do the steps that need the meter: the first of
a plan without rows (Note [Measured rows]), ``auto``'s observed step and its budget check, the
batch-size finder's trials and the report's timelines. On CUDA the allocator's statistics need
no mode: every step is measured, compiled.

Note [The CPU meter's cost]: the CPU meter sees every allocation and free through its dispatch
mode, a fixed cost per op: a DenseNet-121 step at batch 8 (many small ops) ran ~1.5-2x its
unmetered time, at batch 32 ~1.5x. A time read from metered steps therefore charges a small
batch more per sample than a large one, and a throughput comparison between batch sizes leans
to the larger. So a step read only for its time (the batch-size finder's trial steps after each
trial's first, which measures the peak) opens with ``timed_only=True`` and runs unmetered on
CPU. Ordinary training steps on CPU stay metered: their peaks are what a simulated budget is
checked against.

Note [Direct forward calls]: the offload engine learns where a segment's forward starts and
ends from the module's forward (pre-)hooks; ``block.forward(x)`` (some codebases, some
Hugging Face paths) skips them, and every source would then stay on the device until
backward. The forward an offloading segment is given therefore checks whether its module's
hooks are running for this call (``_in_call``) and, when not, does their work itself.

Note [A user's checkpoint inside a segment]: a model that checkpoints its own blocks
(``torch.utils.checkpoint`` around a block, in its parent's forward) already recomputes them:
two owners of one block's activations (Note [A model that checkpoints itself] in
``segments.py``). Where the model's modules do not show it to the session at setup, a segment's
forward does: one starting under checkpoint's saved-tensor hooks (``use_reentrant=False``), or
running while autograd runs a backward (a reentrant checkpoint recomputing it: its forward ran
without grad), raises the session's error; nothing is offloaded or counted as a forward while
autograd runs a backward.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
from torch import nn

from ..actions import Action
from ..compiled import DynamoLedger, compile_context, compiled_forward, dynamo_disable, fullgraph, is_compiled, note_compiled_callers
from ..engine.meter import DeviceMemoryMeter
from ..engine.offload import OffloadEngine
from ..decide.plan import Plan
from ..engine.recompute import RecomputeTimer, checkpointed
from ..segments import own_checkpointing_error, region_after, resolve_modules, split_call, unwrap_compiled
from ..sharded import gathered_parameters, is_sharded, units_inside
from ..engine.streams import Timing, default_ops
from ..config import DEFAULT_MIN_OFFLOAD_BYTES, UMMode, check_min_offload_bytes, check_window_bytes
from ..tensors import ModuleHook, normalize_device, on_backward_start, pop_saved_tensors_hooks, tensors_in
from .calls import SegmentCalls
from .measured_rows import RowMeasure
from .online import OnlineBudget
from .stats import StatsHistory, StepRecord, StepStats

__all__ = [
    "DEFAULT_MIN_OFFLOAD_BYTES", "StatsHistory", "StepStats", "SwapRuntime", "check_min_offload_bytes", "tensors_in",
]

log = logging.getLogger(__name__)


def _plain_forward(module: nn.Module) -> Any:
    return types.MethodType(type(module).forward, module)


class _SegmentForward:
    """The ``forward`` a runtime puts on a segment.

    Note [Copies of a planned model]: ``copy.deepcopy`` (EMA and SWA callbacks do it) and
    ``pickle`` / ``torch.save(model)`` copy a module's instance attributes. A closure would
    be shared by reference, so a deep copy would run the *original* module's weights, and
    pickling would fail. Copied, this forward becomes the copy's plain class ``forward``: the
    runtime belongs to the original model only.
    """

    __slots__ = ("module", "fn")

    def __init__(self, module: nn.Module, fn: Any) -> None:
        self.module = module
        self.fn = fn

    @dynamo_disable  # a graph break: the action runs eagerly (Note [Actions around compiled segments])
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        note_compiled_callers(self)  # Note [Nothing compiled under the runtime outlives it] in compiled.py
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if torch._C._current_graph_task_id() != -1 or (top is not None and getattr(top[0], "__module__", None) == "torch.utils.checkpoint"):
            # Note [A user's checkpoint inside a segment]: inside backward, a reentrant one recomputing
            raise own_checkpointing_error(f"{type(self.module).__name__}, a segment, runs inside the model's own torch.utils.checkpoint")
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        return (_plain_forward, (self.module,))


class _TracedForward(_SegmentForward):
    """The ``forward`` of a segment recomputed inside a compiled graph (Note [Recomputation inside
    the compiled graph] in ``compiled.py``): where Dynamo traces a graph that encloses the segment
    (the whole model compiled) and the segment's first, eager call found it fit (``fn.inline()``),
    the checkpoint is traced into that graph, with no graph break; every other call runs the
    action as :class:`_SegmentForward` does, the graph breaking there."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            traced = self.fn.inline()
            if traced is not None:
                return traced(*args, **kwargs)
        return _SegmentForward.__call__(self, *args, **kwargs)


class _CompiledForward(_SegmentForward):
    """The ``forward`` of a ``KEEP`` segment under compile: its forward compiled with the user's
    context, with no graph break. Inside a region Dynamo traces it is inlined (the segment stays
    in the enclosing graph); where Dynamo gave the enclosing frame up (a graph break inside a
    loop over blocks runs that frame eagerly) it is still compiled, as its own graph."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _checked_actions(plan: Plan) -> Mapping[str, Action]:
    for name, action in plan.actions.items():
        if not isinstance(action, Action):
            raise ValueError(f"`plan` action for {name!r} must be an Action; got {action!r}.")
    return plan.actions


def _check_selective(plan: Plan, modules: Mapping[str, nn.Module]) -> None:
    """Note [Selective around FSDP hooks]: no ``SELECTIVE`` on a segment holding an FSDP unit."""
    for name, action in plan.actions.items():
        units = units_inside(modules[name]) if action is Action.SELECTIVE else []
        if units:
            raise ValueError(
                f"`plan`: segment {name!r} is selective but holds FSDP units of its own ({units}); their hooks run inside "
                "the selective region, which torch's selective checkpointing cannot replay (Note [Selective around FSDP "
                "hooks]). Use 'recompute' for it, or shard the block as one unit."
            )


class SwapRuntime:
    """Applies ``plan`` (or a mapping from segment name to action) to ``model``.

    Use as a context manager, or call :meth:`install` / :meth:`remove`. Around each training
    step call :meth:`begin_step` and :meth:`end_step` to measure it.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan | Mapping[str, Action],
        *,
        device: Optional[torch.device | str] = None,
        min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
        unified: Optional[Any] = None,
        prefetch_bytes: Optional[int] = None,
        inflight_bytes: Optional[int] = None,
        switchable: bool = False,
    ) -> None:
        self.model = model
        #: Note [The budget held online] (``online.py``): each segment's action may change between
        #: its forwards (the runtime of a ``policy="auto"`` plan), and the budget this step holds.
        self.switchable, self._online = switchable, None
        #: A ``UnifiedMemory`` (``engine/unified/memory.py``): managed host buffers, parameter prefetch.
        self.unified = unified
        self.plan = plan if isinstance(plan, Plan) else Plan(actions=plan)
        self.min_offload_bytes = check_min_offload_bytes(min_offload_bytes)
        first = next(model.parameters(), None) if device is None else None
        self.device = normalize_device(device if device is not None else first.device if first is not None else "cpu")
        self._given_windows = (prefetch_bytes, inflight_bytes)
        self._set_windows(*self._given_windows)
        # Canonical names (Note [Canonical segment names]); a call's segment is its module's.
        self._calls = SegmentCalls(_checked_actions(self.plan))
        self._calls.new_pass, self._backward_seen = self._pass_over, False
        self._modules = resolve_modules(model, [*self.plan.actions, *self._calls.groups], field="plan")
        _check_selective(self.plan, self._modules)
        self._names = list(self.plan.actions)
        #: The actions in force this step, of the segments and of the regions outside them.
        self.now, self.outside_now = dict(self.plan.actions), dict(self.plan.outside)
        #: Note [Measured rows]: a plan without predicted rows gets rows measured in its first step.
        self.measure_rows, self._row_measure, self.measured_plan_result = not self.plan.rows, None, None
        self._saved_forward: dict[str, tuple[bool, Any]] = {}
        #: Module name -> (compiled module's name, its Dynamo context) as installed.
        self._contexts: dict[str, Optional[tuple[str, Any]]] = {}
        #: Compilations set aside (Note [Regional compilation is taken over]): (object,
        #: attribute, had it in __dict__, previous value, value set).
        self._set_aside: list[tuple[Any, str, bool, Any, Any]] = []
        self._active = self._compiled = self._step_open = self._metered = self._logged_unmetered = False
        self._handles: list[Any] = []
        #: Segments whose module call is running (hooks fired): Note [Direct forward calls].
        self._in_call: set[int] = set()
        #: Note [Regions outside the segments are hooked for the whole step] (engine/offload.py):
        #: segment forwards running now, the last that ended, the whole-step hooks in a step.
        #: Under FSDP, whether the parameters gathered now must be named to the engine before an
        #: outside region saves anything (Note [Regions outside the segments under FSDP]).
        self._depth, self._last_ran, self._outside_hooks, self._sharded, self._outside_params_stale = 0, None, None, is_sharded(model), True
        #: Segment -> why its recomputation cannot run as planned (Note [Refused actions]).
        self.refusals: dict[str, str] = {}
        self.engine, self._ledger = None, None  # the ledger: Note [Nothing compiled under the runtime outlives it]
        #: The stream layer every timing and copy of this runtime goes through (Note [Stream protocol]).
        self.ops = default_ops(self.device)
        self.timer, self.meter = RecomputeTimer(self.ops), DeviceMemoryMeter(self.device)
        self._step_timing, self._step_start, self._um_start = None, None, None
        #: Finished steps, newest last, some with device times still running.
        self.records = StatsHistory()

    def _set_windows(self, prefetch_bytes: Optional[int], inflight_bytes: Optional[int]) -> None:
        """The copy windows: given here, else those the plan was priced for, else the engine's
        default (Notes [Copy windows] and [Default copy windows] in engine/offload.py)."""
        self.prefetch_bytes = check_window_bytes(prefetch_bytes if prefetch_bytes is not None else self.plan.prefetch_bytes, "prefetch_bytes")
        self.inflight_bytes = check_window_bytes(inflight_bytes if inflight_bytes is not None else self.plan.inflight_bytes, "inflight_bytes")

    # -- install / remove ---------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return self._active

    def install(self) -> "SwapRuntime":
        if self.installed:
            return self
        self._active = True
        self._ledger = DynamoLedger()
        if self.switchable or any(a.offloads for a in self.plan.actions.values()) or self.plan.offloads_outside:
            self.engine = OffloadEngine(
                self.device,
                min_offload_bytes=self.min_offload_bytes,
                pool=self.unified.host_pool() if self.unified is not None else None,
                ops=self.ops,
                prefetch_bytes=self.prefetch_bytes,
                inflight_bytes=self.inflight_bytes,
            )
        try:
            for module_name in self._calls.groups:  # first: the other hooks read the call it counts
                if self._calls.per_call(module_name):
                    self._handles.append(self._modules[module_name].register_forward_pre_hook(self._calls.counter(module_name)))
            self._install_forwards()
            if self.engine is not None:
                for module_name, entries in self._calls.groups.items():
                    module = self._modules[module_name]
                    index: Any = entries[0][2]
                    if self._calls.per_call(module_name):
                        index = functools.partial(self._calls.index_now, module_name)
                    self._handles.append(module.register_forward_pre_hook(self._forward_trigger(index)))
                    self._handles.append(module.register_forward_hook(self._backward_trigger(index)))
            if self.unified is not None and self.unified.mode is UMMode.ALL:
                self._install_parameter_prefetch()
        except BaseException:
            self.remove()
            raise
        log.debug("SwapRuntime installed: %s", self.plan.summary())
        return self

    # -- forwards, compiled or not (Note [Actions around compiled segments]) -----------------
    def _find_contexts(self) -> dict[str, Optional[tuple[str, Any]]]:
        found = {name: compile_context(self.model, name) for name in self._calls.groups}
        for name, before in self._contexts.items():
            now = found.get(name)
            if before is not None and before[0] == name and (now is None or now[0] != name) and self._is_set_aside(name):
                found[name] = before  # hidden by us, not gone (Note [Regional compilation is taken over])
        return found

    def _is_set_aside(self, name: str) -> bool:
        module = self._modules[name]
        return any(obj is module or getattr(obj, "_orig_mod", None) is module for obj, *_ in self._set_aside)

    def _install_forwards(self) -> None:
        """Contexts and forwards are per module (``self._calls.groups``): one module, one forward,
        whatever calls of it the plan names (Note [A segment per call] in ``calls.py``)."""
        contexts = self._find_contexts()
        self._compiled = is_compiled(self.model) or any(c is not None for c in contexts.values())
        acting = any(a is not Action.KEEP for a in self.plan.actions.values())
        hooked = self.engine is not None or (self.unified is not None and self.unified.mode is UMMode.ALL)
        for name, action in self.plan.actions.items():
            module_name = split_call(name)[0]
            found = contexts[module_name]
            if found is None or found[0] == module_name or not fullgraph(found[1]) or (action is Action.KEEP and not hooked):
                continue
            where = repr(found[0]) if found[0] else "the model"
            what = f"action {action.value!r}" if action is not Action.KEEP else "hooks (the offload engine's)"
            raise ValueError(
                f"`plan`: segment {name!r} is inside {where}, compiled with fullgraph=True, and its {what} must "
                "run outside the compiled graph, so Dynamo would have to break the graph there. Compile without "
                "fullgraph=True, or compile each block on its own (regional compilation: `block.compile(fullgraph=True)` "
                "for each segment), which the runtime supports with no graph break."
            )
        for module_name, entries in self._calls.groups.items():
            self._install_forward(module_name, entries, contexts[module_name], acting=acting, hooked=hooked)
        self._contexts = contexts

    def _install_forward(self, module_name: str, entries: list, found: Any, *, acting: bool, hooked: bool) -> None:
        module = self._modules[module_name]
        regional = found is not None and found[0] == module_name
        actions = [self.plan.actions[name] for _, name, _ in entries]
        switched = self.switchable and not self._compiled
        if not switched and all(a is Action.KEEP for a in actions) and (found is None or not (acting or hooked) or (regional and not hooked)):
            return  # nothing runs around it: leave it as the user compiled it (or not)
        had_attr = "forward" in module.__dict__
        self._saved_forward[module_name] = (had_attr, module.__dict__.get("forward"))
        forward = module.forward
        graph = None
        if found is not None:
            if regional:
                self._set_aside_compilation(module_name)
            forward, graph = compiled_forward(found[1], forward, module)
            self._ledger.own(module.forward)
        compiled = found is not None or is_compiled(module)
        forwards = {}
        for (call, name, index), action in zip(entries, actions):
            if self.switchable and not self._compiled:
                forwards[call] = _SegmentForward(module, self._switch(module, forward, name, index))
            elif action is Action.KEEP:
                forwards[call] = _CompiledForward(module, forward) if found is not None else forward
            else:
                forwards[call] = self._wrap(module, forward, action, index, compiled=compiled, graph=graph, inline=not hooked)
        if self._calls.per_call(module_name):
            module.forward = _SegmentForward(module, self._calls.dispatch(module_name, forwards, forward))
        else:
            module.forward = forwards[0]

    def _set_aside_compilation(self, name: str) -> None:
        """Note [Regional compilation is taken over]."""
        module = self._modules[name]
        if module.__dict__.get("_compiled_call_impl") is not None:
            self._set_aside.append((module, "_compiled_call_impl", True, module._compiled_call_impl, None))
            module._compiled_call_impl = None
        for wrapper in self._wrappers_of(name):
            call = wrapper._orig_mod.__call__  # one bound method: restored only if still ours
            had = "forward" in wrapper.__dict__
            self._set_aside.append((wrapper, "forward", had, wrapper.__dict__.get("forward"), call))
            wrapper.forward = call
            if wrapper.__dict__.get("_compiled_call_impl") is not None:
                self._set_aside.append((wrapper, "_compiled_call_impl", True, wrapper._compiled_call_impl, None))
                wrapper._compiled_call_impl = None

    def _wrappers_of(self, name: str) -> list[Any]:
        """The ``OptimizedModule`` wrappers in the segment's place in its parent, outermost first."""
        parent_name, _, leaf = name.rpartition(".")
        parent = resolve_modules(self.model, [parent_name])[parent_name] if parent_name else unwrap_compiled(self.model)
        slot = parent._modules.get(leaf)
        wrappers = []
        while slot is not None and slot is not self._modules[name] and hasattr(slot, "_orig_mod"):
            wrappers.append(slot)
            slot = slot._orig_mod
        return wrappers

    def _remove_forwards(self) -> None:
        for name, (had_attr, previous) in self._saved_forward.items():
            module = self._modules[name]
            if had_attr:
                module.forward = previous
            else:
                module.__dict__.pop("forward", None)
        self._saved_forward.clear()
        for obj, attr, had, previous, ours in reversed(self._set_aside):
            if obj.__dict__.get(attr) is not ours:
                continue  # the user changed it since (compiled again): theirs stands
            if had:
                setattr(obj, attr, previous)
            else:
                obj.__dict__.pop(attr, None)
        self._set_aside.clear()

    def _refresh_compiled(self) -> None:
        """A model compiled (or compiled again) after :meth:`install` gets its forwards rebuilt."""
        contexts = self._find_contexts()
        same = contexts.keys() == self._contexts.keys() and all(
            (a is None) == (b is None) and (a is None or (a[0] == b[0] and a[1] is b[1]))
            for a, b in ((contexts[n], self._contexts[n]) for n in contexts)
        )
        if not same:
            log.info("lightning-swap: the model was compiled since the plan was applied; re-wrapping its segments")
            self._remove_forwards()
            self._install_forwards()
        else:
            self._compiled = is_compiled(self.model) or any(c is not None for c in contexts.values())

    def _refused(self, name: str, reason: str) -> None:
        """A segment cannot run its recomputation as planned (``checkpointed``'s ``on_refuse``)."""
        self.refusals.setdefault(name, reason)

    def _wrap(
        self, module: nn.Module, forward: Any, action: Action, index: int, *, compiled: bool = False, graph: Any = None, inline: bool = False
    ) -> Any:
        engine = self.engine
        if action is Action.OFFLOAD:
            assert engine is not None

            def offloaded(*args: Any, **kwargs: Any) -> Any:
                with engine.hooks(index):
                    return forward(*args, **kwargs)

            return _SegmentForward(module, self._also_direct(offloaded, index, module))
        outer = (lambda: engine.hooks(index)) if action is Action.RECOMPUTE_OFFLOAD else None
        save_ops = self.plan.selective_ops.get(self._names[index]) if action is Action.SELECTIVE else None
        fn = checkpointed(
            module, forward, action, self.timer, outer=outer, name=self._names[index], compiled=compiled, on_refuse=self._refused,
            save_ops=save_ops, graph=graph,
        )
        if outer is None:
            return (_TracedForward if inline and graph is not None else _SegmentForward)(module, fn)
        return _SegmentForward(module, self._also_direct(fn, index, module))

    def _switch(self, module: nn.Module, forward: Any, name: str, index: int) -> Any:
        """Note [The budget held online]: the ``forward`` of a segment whose action may change
        between steps and within one; the budget is checked as its forward starts, and each
        action's forward is built once, when first run."""
        built: dict[tuple, Any] = {(Action.KEEP, None): forward}

        def switched(*args: Any, **kwargs: Any) -> Any:
            if self._online is not None and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
                self._hold(name)
            action = self.now.get(name, Action.KEEP)
            key = (action, self.plan.selective_ops.get(name) if action is Action.SELECTIVE else None)
            fn = built.get(key)
            if fn is None:
                fn = built[key] = self._wrap(module, forward, action, index)
            return fn(*args, **kwargs)

        return switched

    @property
    def contexts(self) -> dict[str, Any]:
        """Each segment's module -> its compiled context as installed (Note [Regional compilation is
        taken over]: one set aside still counts)."""
        return dict(self._contexts)

    def new_pass(self) -> None:
        """A backward pass of the step begins: the segments' calls are counted from 0 again, so that
        the next pass's forward (a closure optimizer's: LBFGS, SAM; an input-gradient pass's, seen
        by a hook on the segments' outputs) runs the same segments' actions and is held within the
        budget as the first was (Note [A segment per call] in ``calls.py``)."""
        self._calls.reset()
        self._backward_seen = False

    def _saw_backward(self) -> None:
        self._backward_seen = True

    def _pass_over(self) -> bool:
        seen, self._backward_seen = self._backward_seen, False
        return seen

    def retarget(self, plan: Plan) -> bool:
        """A switchable runtime takes ``plan`` (of the same segments, in the same order) in place of
        its own from the next step, without being installed again: its actions, regions, selective
        choices and copy windows (the host pool and the forwards built so far are kept). ``False``
        where it cannot: not switchable, compiled, other segments, or inside a step."""
        if not self.switchable or self._compiled or self._step_open or list(plan.actions) != self._names or not self.installed:
            return False
        self.plan = plan
        self._set_windows(*self._given_windows)
        if self.engine is not None:
            self.engine.prefetch_bytes, self.engine.inflight_bytes = self.prefetch_bytes, self.inflight_bytes
        self.measure_rows, self._row_measure, self.measured_plan_result = not plan.rows, None, None
        self.now, self.outside_now = dict(plan.actions), dict(plan.outside)
        return True

    def _hold(self, name: Optional[str]) -> None:
        """Note [The budget held online]: the check before element ``name`` (``None``: the step's
        start), and its moves put in force."""
        for element, action in self._online.check(name, self.meter.current_bytes).items():
            if element in self.now:
                self.now[element] = action
            else:
                self.outside_now[element] = action
                self._enter_outside_hooks()

    def _room(self) -> int:
        """Note [Backward fetches within the budget]: the device bytes the budget leaves now."""
        return self._online.budget_bytes - self.meter.current_bytes

    def _also_direct(self, fn: Any, index: int, module: nn.Module) -> Any:
        """Note [Direct forward calls]: ``block.forward(x)`` skips the module's forward hooks,
        which mark where the segment's forward begins and ends; the segment's own forward then
        does what they would have done."""

        def forward(*args: Any, **kwargs: Any) -> Any:
            if index in self._in_call or torch._C._current_graph_task_id() != -1:
                return fn(*args, **kwargs)
            self._segment_started(module)
            output = fn(*args, **kwargs)
            self._segment_ended(output, index)
            return output

        return forward

    def _segment_started(self, module: nn.Module) -> None:
        self._depth += 1
        self._outside_params_stale = True
        if torch.is_grad_enabled():
            self.engine.segment_started()
            if self._sharded:  # FSDP gathered this segment's parameters just now (its hooks run first): never offloaded
                self.engine.segment_parameters(gathered_parameters(module))

    def _segment_ended(self, output: Any, index: int) -> None:
        engine = self.engine
        self._depth = max(self._depth - 1, 0)
        if index is not None:  # a call beyond the plan's is kept: its region is the last planned one's
            self._last_ran = index
        if torch.is_grad_enabled():
            engine.segment_ended()
            if self.switchable:
                on_backward_start(output, self._saw_backward)

    def _forward_trigger(self, index: Any) -> Any:
        """A forward pre-hook on every segment: a new element of the step begins (the regions
        outside the segments, Note [Default copy windows] in ``offload.py``). ``index``: the
        segment's, or a function giving the running call's (Note [A segment per call] in ``calls.py``)."""

        def hook(module: nn.Module, args: Any) -> None:
            if torch._C._current_graph_task_id() != -1:
                return  # recomputed in backward by a reentrant checkpoint: not a forward
            i = index() if callable(index) else index
            if i is not None:
                self._in_call.add(i)
            self._segment_started(module)

        return ModuleHook(hook)

    def _backward_trigger(self, index: Any) -> Any:
        """A forward hook: the segment's element ends, and under ``auto`` its outputs mark when its
        backward starts. ``index`` as :meth:`_forward_trigger`'s."""

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if torch._C._current_graph_task_id() != -1:
                return
            index_now = index() if callable(index) else index
            self._in_call.discard(index_now)
            self._segment_ended(output, index_now)

        return ModuleHook(hook)

    def _outside_region(self) -> Optional[str]:
        """The region outside the segments running now, if the plan offloads it (Note [Regions
        outside the segments are hooked for the whole step] in engine/offload.py); ``None``
        inside a segment's forward or in a region the plan keeps."""
        if self._depth:
            return None
        if self.engine._backward:  # a backward ran since (accumulation): a new forward's prefix
            self._last_ran = None
        last = self._names[self._last_ran] if self._last_ran is not None else None
        name = region_after(self._names, last)
        if self.outside_now.get(name) is not Action.OFFLOAD:
            return None
        if self._sharded and self._outside_params_stale:
            # Note [Regions outside the segments under FSDP]: the root unit's parameters (the
            # embedding's, the head's), gathered by FSDP for the code outside the blocks, are
            # never offloaded, as a segment's own gathered parameters are not.
            self.engine.segment_parameters(gathered_parameters(self.model))
            self._outside_params_stale = False
        return name

    def _enter_outside_hooks(self) -> None:
        """The whole-step hooks, entered where a region outside the segments is offloaded now (at the
        step's start; or when the budget held online moves one: Note [The budget held online])."""
        if self.engine is not None and self._outside_hooks is None and any(a is Action.OFFLOAD for a in self.outside_now.values()):
            hooks = self.engine.outside_hooks(self._outside_region)
            hooks.__enter__()
            self._outside_hooks = hooks

    def _exit_outside_hooks(self) -> None:
        """Takes the whole-step hooks off torch's stack, wherever they are (a context the step
        entered and left open may sit above them: Note [Hooks never outlive the library] in
        ``tensors.py``)."""
        hooks, self._outside_hooks = self._outside_hooks, None
        if hooks is not None:
            pop_saved_tensors_hooks(hooks.pack_hook)

    def _install_parameter_prefetch(self) -> None:
        """Under ``um="all"``: segment ``i+1``'s parameters are prefetched when segment ``i``'s
        forward starts, and segment ``i-1``'s when segment ``i``'s backward starts, once the
        managed memory outgrows the device (Note [Prefetch only when oversubscribed])."""
        unified = self.unified
        modules = list(self._calls.groups)  # one per module, however many calls it runs
        params = [list(self._modules[name].parameters()) for name in modules]
        last = len(params) - 1

        def prefetch(index: int) -> None:
            if 0 <= index <= last and unified.should_prefetch_parameters():
                unified.prefetch_tensors(params[index])

        def before_forward(index: int) -> Any:
            def hook(module: nn.Module, args: Any) -> None:
                if index == 0:
                    prefetch(0)
                prefetch(index + 1)

            return ModuleHook(hook)

        def after_forward(index: int) -> Any:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                if torch.is_grad_enabled():
                    on_backward_start(output, lambda: prefetch(index - 1))

            return ModuleHook(hook)

        for index, name in enumerate(modules):
            module = self._modules[name]
            self._handles.append(module.register_forward_pre_hook(before_forward(index)))
            self._handles.append(module.register_forward_hook(after_forward(index)))

    def remove(self) -> None:
        if self.meter._open:
            self.meter.__exit__(None, None, None)
        if self._outside_hooks is not None:
            self._exit_outside_hooks()
        self._step_open = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._remove_forwards()
        if self._ledger is not None:
            self._ledger.drop()
        self._contexts = {}
        self._active = False
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def __enter__(self) -> "SwapRuntime":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    # -- steps --------------------------------------------------------------------------
    @property
    def measuring(self) -> bool:
        """Whether a step window is open (between :meth:`begin_step` and :meth:`end_step`)."""
        return self._step_open

    @property
    def compiled(self) -> bool:
        """Whether the model (any module of it) is compiled, as of the last install or step."""
        return self._compiled

    def begin_step(
        self, track: Iterable[Any] = (), *, measure: bool = False, timed_only: bool = False, online: Optional[OnlineBudget] = None,
    ) -> None:
        """Open the step window; ``track`` holds tensors alive before it (batch, optimizer
        state), nested in lists, tuples, dicts or dataclasses.

        On CPU a compiled model's step is not measured (``peak_device_bytes=None``) unless
        ``measure=True``, which runs that step eagerly (Note [No dispatch mode under compile]).
        ``timed_only=True``: a step read for its time alone is not metered on CPU either (Note
        [The CPU meter's cost]); on CUDA the allocator's peak is read anyway. ``online``: the
        budget held as the step runs (Note [The budget held online]; a switchable runtime, metered)."""
        if self.meter._open:
            self.meter.__exit__(None, None, None)
        if self.installed:
            self._refresh_compiled()
        # The first step of a plan without rows measures them with the meter (Note [Measured rows]).
        rows = self.measure_rows and self._row_measure is None
        self._metered = self.meter.is_cuda or rows or (not timed_only and (measure or not self._compiled))
        if not self._metered and not self._logged_unmetered:
            self._logged_unmetered = True
            log.info(
                "lightning-swap: the model is compiled, so per-step device memory is not measured on CPU "
                "(the CPU meter is a TorchDispatchMode, which makes torch.compile run eagerly); "
                "peak_device_bytes is None"
            )
        elif self._metered and self._compiled and not self.meter.is_cuda:
            log.info("lightning-swap: measuring this step's device memory on CPU; the compiled model runs eagerly for it")
        self._step_open = True
        self._calls.reset()
        self._in_call.clear()  # a forward that raised last step left its segment there
        if self._metered:
            self.meter.__enter__()
        counted = self._metered and not self.meter.is_cuda  # the CUDA allocator sees everything by itself
        if counted or self.engine is not None:
            tracked = tensors_in(list(track))
            params = list(self.model.parameters())
            if counted:
                self.meter.track([*params, *self.model.buffers(), *(p.grad for p in params if p.grad is not None), *tracked])
            if self.engine is not None:
                self.engine.begin_step([*params, *self.model.buffers(), *tracked])
        if self._outside_hooks is not None:  # a step that neither ended nor aborted
            self._exit_outside_hooks()
        self.now, self.outside_now = dict(self.plan.actions), dict(self.plan.outside)
        self._depth, self._last_ran, self._outside_params_stale = 0, None, True
        self._enter_outside_hooks()
        self._um_start = self.unified.stats() if self.unified is not None else None
        if self.measure_rows and self._row_measure is None:
            self._row_measure = RowMeasure(self).start()
        self._online = online if self.switchable and self._metered and not self._compiled else None
        if self.engine is not None:
            self.engine.room = self._room if self._online is not None and self.device.type == "cuda" else None
        if self._online is not None:
            self._online.begin_step()
            self._hold(None)
        self._step_timing = Timing(self.ops)
        self._step_start = self.ops.record(self.ops.compute_stream(), timing=True)

    def _unified_step_stats(self) -> dict[str, int]:
        if self.unified is None or self._um_start is None:
            return {}
        start, now = self._um_start, self.unified.stats()
        return dict(
            managed_bytes=now.managed_bytes,
            um_prefetched_bytes=(now.prefetched_to_device_bytes - start.prefetched_to_device_bytes)
            + (now.prefetched_to_host_bytes - start.prefetched_to_host_bytes),
            um_refused_allocations=now.refused_allocations - start.refused_allocations,
        )

    def abort_step(self) -> None:
        """Close the window of a step that failed, with no statistics; the offload engine lets go
        of everything the step held (copies in flight, prefetches, device copies)."""
        if self._outside_hooks is not None:
            self._exit_outside_hooks()
        if self.engine is not None:
            self.engine.abort_step()
        if self.meter._open:
            self.meter.__exit__(None, None, None)
        self._step_open = False

    def end_step(self) -> StepStats:
        """Close the window and return the step's statistics, without waiting for the device:
        on CUDA the times are ``None`` until :meth:`stats` finds the step finished."""
        if not self._step_open:
            raise RuntimeError("end_step() called without begin_step()")
        self._exit_outside_hooks()
        counters, exposed = self.engine.end_step() if self.engine is not None else (None, None)
        if self._row_measure is not None and self._row_measure.open:
            self._row_measure.stop(counters)
        step = self._step_timing
        step.add(self._step_start, self.ops.record(self.ops.compute_stream(), timing=True))
        if self.meter._open:
            self.meter.__exit__(None, None, None)
        self._step_open = False
        stats = StepStats(
            peak_device_bytes=self.meter.peak_bytes if self._metered else None,
            offloaded_bytes=counters.offloaded_bytes if counters else 0,
            fetched_bytes=counters.fetched_bytes if counters else 0,
            prefetched_bytes=counters.prefetched_bytes if counters else 0,
            reused_bytes=counters.reused_bytes if counters else 0,
            refetched_bytes=counters.refetched_bytes if counters else 0,
            offloaded_tensors=counters.offloaded_tensors if counters else 0,
            deduplicated_tensors=counters.deduplicated_tensors if counters else 0,
            host_pool_bytes=self.engine.pool.reserved_bytes if self.engine is not None else 0,
            saved_bytes=counters.saved_bytes if counters else None,
            unplanned_bytes=counters.unplanned_bytes if counters else None,
            recompute_ms=None,
            exposed_transfer_ms=None,
            step_ms=None,
            moved=tuple(self._online.moved) if self._online is not None else (),
            **self._unified_step_stats(),
        )
        self.records.add(StepRecord(stats, step, self.timer.take(), exposed, counters.copy_ms if counters else 0.0))
        self.records.resolve()
        return self.records.newest()

    def stats(self, *, wait: bool = False) -> Optional[StepStats]:
        """The newest step whose device times are known (``None`` before any): never waits for
        the device unless ``wait=True``, which returns the last step, resolved (outside a step)."""
        return self.records.latest(wait=wait)

    @property
    def last_stats(self) -> Optional[StepStats]:
        """The last step's statistics as known now (times may still be ``None`` on CUDA)."""
        return self.records.newest()

    def measured_plan(self, *, wait: bool = False) -> Optional[Plan]:
        """Note [Measured rows]: the plan with the rows measured in its first step (bytes kept,
        offloaded and recomputed, milliseconds recomputing, per segment), once known."""
        if self.measured_plan_result is None and self._row_measure is not None and not self._row_measure.open:
            self.measured_plan_result = self._row_measure.plan(wait=wait)
        return self.measured_plan_result
