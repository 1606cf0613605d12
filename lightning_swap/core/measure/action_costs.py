"""What each action costs each segment, measured on the real device.

The cost model needs, per segment, the time of its forward and backward and what recomputing
it adds. Guessing selective recomputation's cost from the forward's time misses what it really
runs: its policy's dispatch on every op (on the first H100 run ``selective`` was slower than
``recompute`` on both GPT-2 and ResNet-50 although the roofline said the opposite). So after the
profiled step each segment is run again on its own, on arguments shaped like the ones it got in
that step (:class:`~.replay.CapturedCall`), in the autocast state it ran in: plain (the median of
a few runs) and once under ``SELECTIVE`` — the runtime's own wrapper — forward and backward each
time, timed with events on the compute stream. ``RECOMPUTE`` reruns the forward: it is priced at
the kept forward's time (Note [An action is never free] in ``decide/costmodel.py``), and the
steady state's measurements re-price it (Note [Re-plan from the steady state] in
``scale/revisit.py``). Each run costs a segment's step, so the runs are few: Note [Planning costs
a few steps] in ``observe.py``. What the runs find a segment cannot do is refused for planning
(Note [Refused actions] in ``model_profile.py``): a write into its input, heard by the wrapper
(every recomputing action), or an action that fails (``SELECTIVE`` alone, or, when ``RECOMPUTE``
run once after it fails too, every recomputing action).

Note [Timing a segment leaves no trace]: the model's buffers (BatchNorm statistics) and the
RNG state are restored afterwards, gradients are taken with ``torch.autograd.grad`` so no
parameter's ``.grad`` changes (nor, under FSDP2, is any reduce-scattered: Note [Sharded segments
timed in lockstep] in ``sharded.py``), and the user's ``training_step`` is not involved: only the
segments' modules run (their forward hooks, if the user registered any, run too), on copies of
their arguments without the step's key/value cache, and every module's attributes are bound back
afterwards (Note [A replay has no side effects] in ``replay.py``).

Note [A segment measured alone]: a step run under a plan other than plain (``auto``'s guard
step) cannot see what a recomputed or offloaded segment would save if kept: the runtime's own
saved-tensor hooks sit inside the segment, above the tracer's. So each such segment is also run
once alone, kept, on its captured arguments, traced as a one-segment step (:class:`~.trace.
StepTracer`: the storages it saves, its heavy ops' outputs, its forward's and backward's
working bytes above their start, the on-demand offload estimate); the step's own trace supplies
the rest (the windows' levels, which storage is whose input and output, what the parts outside
the segments save), and ``decide/under_plan.py`` turns the windows measured under the plan into
plain's (Note [A step measured under a plan]). The run is under the same protections as the
timing runs (Note [Timing a segment leaves no trace]).

Note [Compiled segments are timed compiled]: a segment under ``torch.compile`` (the whole model
compiled, or the segment: :func:`~..compiled.compile_context`) is timed as the runtime will run
it, not as its eager forward: kept, its forward compiled in the user's context; under
``SELECTIVE``, where it recomputes inside its graph (Note [Recomputation inside the compiled
graph] in ``compiled.py``), the checkpoint compiled with the plan's policy, after two warm-up
calls (the eager first call that checks its input, the call that compiles), in turn with the
kept forward, the median of as many runs as kept. A compiled segment that recomputes eagerly
(buffers; its selective is refused) gets two warm-ups too, so that no timed run compiles.
Identical blocks share one timing only when compiled alike (one block compiled on its own among
eager ones is timed apart), and a call's segment (``name#k``) is its module's, compiled or not.
Eager timings priced a compiled plan wrongly: on the 6-block GPT of
``benchmarks/compile_budget.py`` (CPU, one thread) a block's selective was priced at 24 ms (the
eager forward of the ops it reruns: layer norms, GELU, adds) where the compiled one adds 0-6 ms
(Inductor fuses those ops into the backward's kernels), so the planner kept whole blocks and
recomputed matmuls elsewhere to pay for them. So a selective time measured in the graph is not
floored at the eager forward of the ops it reruns (``SegmentProfile.selective_floor``; Note [An
action is never free] in ``decide/costmodel.py``): only at ``MIN_ACTION_MS``, which keeps
``KEEP`` first among plans of equal time. Compiling costs the profile one graph per distinct
segment (identical blocks are timed once) and action timed. The difference of two timings is
noisy (a block's compiled selective measured 0 to 18 ms in separate processes, 3-6 ms timed
apart in one): where it comes out at 0 the planner counts ``MIN_ACTION_MS``.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..actions import Action
from ..engine.recompute import RecomputeTimer, checkpointed
from ..engine.streams import StreamOps, Timing
from ..compiled import compile_context, compiled_forward, is_compiled
from ..segments import split_call
from ..sharded import lone_forwards, unhooked, unsharded
from .model_profile import SELECTIVE_REFUSAL
from .replay import CapturedCall, module_state
from .trace import StepTrace, StepTracer

__all__ = ["ActionCosts", "measure_action_costs", "measure_released_working", "trace_alone"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActionCosts:
    """Milliseconds of one segment: its forward and backward kept, and what ``RECOMPUTE`` and
    ``SELECTIVE`` add to a step (``None`` where it could not be measured); the bytes its
    forward holds above its start when nothing is saved for backward (-1: not measured); and,
    when asked for, its step run alone, kept, traced (Note [A segment measured alone]; ``None``:
    not traced)."""

    forward_ms: float
    backward_ms: float
    recompute_ms: Optional[float]
    selective_ms: Optional[float]
    released_working_bytes: int = -1
    alone: Optional[StepTrace] = None
    #: Why an action cannot run on this segment as planned, "" if all ran (Note [Refused actions]
    #: in ``model_profile.py``): the first refusal seen.
    refusal: str = ""
    #: ``selective_ms`` was measured recomputing inside the compiled graph (Note [Compiled
    #: segments are timed compiled]): no eager floor applies to it.
    selective_in_graph: bool = False


def measure_released_working(module: nn.Module, call: CapturedCall, device: torch.device) -> int:
    """Note [A forward that does not keep] in ``costmodel.py``: the most bytes the segment's
    forward holds above its start (its arguments already made, an FSDP2 unit's parameters
    gathered: Note [A sharded segment's forward alone]) when autograd saves nothing."""
    from ..engine.meter import DeviceMemoryMeter

    args, kwargs = call.make()
    autocast = torch.autocast(call.autocast[0], dtype=call.autocast[1]) if call.autocast else contextlib.nullcontext()
    meter = DeviceMemoryMeter(device)
    with unsharded(module):
        start = torch.cuda.memory_allocated(device) if meter.is_cuda else 0
        with meter, autocast, torch.autograd.graph.saved_tensors_hooks(lambda t: None, lambda packed: packed):
            out = unhooked(module)(*args, **kwargs)
            del out
    return max(0, meter.peak_bytes - start)


def _grad_inputs(args: Any, module: nn.Module) -> list[torch.Tensor]:
    tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad]
    return tensors + [p for p in module.parameters() if p.requires_grad]


def _run(module: nn.Module, forward: Any, call: CapturedCall, ops: StreamOps) -> tuple[float, float]:
    """One forward and backward of the segment; (forward ms, backward ms) once the device is done."""
    args, kwargs = call.make()
    autocast = torch.autocast(call.autocast[0], dtype=call.autocast[1]) if call.autocast else contextlib.nullcontext()
    compute = ops.compute_stream()
    fwd, bwd = Timing(ops), Timing(ops)
    with fwd.measure(compute), autocast:
        out = forward(*args, **kwargs)
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if outs:
        with bwd.measure(compute):
            inputs = _grad_inputs((args, kwargs), module)
            torch.autograd.grad(outs, inputs, [torch.ones_like(t) for t in outs], allow_unused=True)
    del out, outs
    return fwd.resolve(wait=True) or 0.0, bwd.resolve(wait=True) or 0.0


class _Alone(nn.Module):
    """A one-segment model around ``segment`` for :class:`~.trace.StepTracer` (the user's module
    is only referenced: nothing of it changes); an FSDP2 unit called by its own ``forward``
    (Note [A sharded segment's forward alone] in ``sharded.py``)."""

    def __init__(self, segment: nn.Module) -> None:
        super().__init__()
        self.segment = segment if unhooked(segment) is segment else _Unhooked(segment)


class _Unhooked(nn.Module):
    """An FSDP2 unit run by its own ``forward``, under the tracer's hooks but none of FSDP's."""

    def __init__(self, unit: nn.Module) -> None:
        super().__init__()
        self.unit = unit

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.unit.forward(*args, **kwargs)


def trace_alone(module: nn.Module, call: CapturedCall, device: torch.device, *, min_offload_bytes: int = 1) -> StepTrace:
    """Note [A segment measured alone]: ``module``'s forward and backward on arguments made from
    ``call``, kept, traced as a one-segment step (its region is segment 0). The gradient its
    output receives is a full tensor made in the backward and freed once used, as in a step (a
    gradient handed to ``autograd.grad`` would stay alive through the whole backward), and
    parameter gradients are returned, not accumulated (Note [Timing a segment leaves no trace])."""
    args, kwargs = call.make()
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    autocast = torch.autocast(call.autocast[0], dtype=call.autocast[1]) if call.autocast else contextlib.nullcontext()
    holder = _Alone(module)
    static = [*module.parameters(), *module.buffers()]
    tracer = StepTracer(holder, ["segment"], device=device, static=static, params=[], min_offload_bytes=min_offload_bytes).begin()
    try:
        tracer.meter.track(leaves)  # alive, but not static: what the segment saves of its arguments counts
        with autocast:
            out = holder.segment(*args, **kwargs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs:
            loss = sum((t * torch.ones_like(t)).sum() for t in outs)  # d loss / d t: a new full tensor
            tracer.backward_begins()
            torch.autograd.grad(loss, _grad_inputs((args, kwargs), module), allow_unused=True)
        del out, outs
    except BaseException:
        tracer.abort()
        raise
    return tracer.finish()


def _timed(
    module: nn.Module, forward: Any, call: CapturedCall, ops: StreamOps, runs: int, warm: int, failed: Optional[list[str]] = None,
) -> Optional[tuple[float, float]]:
    """The median (forward ms, backward ms) of ``runs`` runs (after ``warm`` warm-up runs);
    ``None`` when the action cannot run here (why, appended to ``failed``)."""
    found = _timed_in_turn(module, (forward,), call, ops, runs, warm, failed)
    return None if found is None else found[0]


def _timed_in_turn(
    module: nn.Module, forwards: tuple[Any, ...], call: CapturedCall, ops: StreamOps, runs: int, warm: int,
    failed: Optional[list[str]] = None,
) -> Optional[list[tuple[float, float]]]:
    """:func:`_timed` of each of ``forwards``, run in turn (a drift of the machine's speed falls on
    all of them alike)."""
    try:
        for _ in range(warm):
            for forward in forwards:
                _run(module, forward, call, ops)
        timed = [[_run(module, forward, call, ops) for forward in forwards] for _ in range(runs)]
    except Exception as exc:  # noqa: BLE001 - an action that cannot run here is not timed, nor planned
        log.debug("timing %s failed: %s", getattr(module, "_get_name", lambda: "segment")(), exc)
        if failed is not None:
            failed.append(f"{type(exc).__name__}: {exc}")
        return None
    # Medians, not minima: a minimum of a shared machine's timings is its luckiest run, and a
    # lucky KEEP against an unlucky RECOMPUTE misprices both.
    return [(statistics.median(r[k][0] for r in timed), statistics.median(r[k][1] for r in timed)) for k in range(len(forwards))]


def _worst(refusals: list[str]) -> str:
    """The refusal that rules out most: one of every recomputing action over selective's alone."""
    broad = [r for r in refusals if not r.startswith(SELECTIVE_REFUSAL)]
    return (broad or refusals or [""])[0]


def _refusals(
    name: str, module: nn.Module, call: CapturedCall, ops: StreamOps, warm: bool, save_ops: Optional[tuple[str, ...]] = None,
    compiled: "_Compiled | None" = None, repeats: int = 1,
) -> tuple[Optional[tuple[float, float]], Optional[tuple[float, float]], list[str]]:
    """``SELECTIVE`` run once through the runtime's own wrapper, saving ``save_ops`` as the plan
    will run it (Note [Which ops selective recomputation saves] in ``profiler.py``): (its
    (forward ms, backward ms), ``None`` where it failed; the refusals heard). Note [Refused
    actions] in ``model_profile.py``: a write into the segment's input is heard by the wrapper
    (every recomputing action refused); where selective fails, ``RECOMPUTE`` is run once too, to
    tell a failure of selective alone from one of every recomputing action (their only run:
    recomputation is priced, not timed). ``compiled``: the segment's forward under compile, run
    as the runtime runs it (Note [Compiled segments are timed compiled]): recomputing inside its
    graph, timed ``repeats`` times in turn with the kept compiled forward, whose times come second
    (``None`` otherwise)."""
    timer, refusals, failed = RecomputeTimer(ops), [], []

    def refuse(segment: str, why: str) -> None:
        refusals.append(why)

    def wrapped(action: Action) -> Any:
        chosen = save_ops if action is Action.SELECTIVE else None
        if compiled is None:
            return checkpointed(module, module.forward, action, timer, name=name, on_refuse=refuse, save_ops=chosen)
        return checkpointed(
            module, compiled.forward, action, timer, name=name, on_refuse=refuse, save_ops=None if chosen is None else frozenset(chosen),
            compiled=True, graph=compiled.graph,
        )

    selective = kept = None
    if compiled is not None and compiled.graph is not None:
        # In its graph, a segment's first call runs the eager checkpoint (its input check) and its
        # second compiles: both are warm-up (Note [Recomputation inside the compiled graph]).
        found = _timed_in_turn(module, (wrapped(Action.SELECTIVE), compiled.forward), call, ops, repeats, 2, failed)
        if found is not None:
            selective, kept = found
    else:  # around compiled code, the first timed run would compile a graph: two warm-ups
        selective = _timed(module, wrapped(Action.SELECTIVE), call, ops, repeats, 2 if compiled is not None else int(warm), failed)
    if selective is None and failed:
        recomputed: list[str] = []
        if _timed(module, wrapped(Action.RECOMPUTE), call, ops, 1, 0, recomputed) is None and recomputed:
            refusals.append(f"recompute failed: {recomputed[0]}"[:300])
        refusals.append(f"{SELECTIVE_REFUSAL} selective failed: {failed[0]}"[:300])
    return selective, kept, refusals


def _segment_costs(
    name: str, module: nn.Module, call: CapturedCall, ops: StreamOps, device: torch.device, *, repeats: int, warm: bool,
    alone: bool, min_offload_bytes: int, save_ops: Optional[tuple[str, ...]] = None, compiled: "_Compiled | None" = None,
    failed: Optional[list[str]] = None,
) -> Optional[ActionCosts]:
    """One segment's :class:`ActionCosts` (Note [Planning costs a few steps] in ``observe.py``):
    kept, the median of ``repeats`` runs; ``SELECTIVE`` once, after them, saving ``save_ops``
    (and what it refused: :func:`_refusals`); ``RECOMPUTE`` priced from the kept forward (Note
    [An action is never free]); under compile, both compiled, and where selective recomputes
    inside the graph, the two in turn, ``repeats`` times (Note [Compiled segments are timed
    compiled]). ``None`` where the segment could not be replayed kept, or traced alone when asked
    (why, appended to ``failed``: Note [A segment that cannot be replayed] in ``observe.py``)."""
    failed = [] if failed is None else failed
    in_graph = compiled is not None and compiled.graph is not None
    kept_forward = module.forward if compiled is None else compiled.forward
    keep = None if in_graph else _timed(module, kept_forward, call, ops, repeats, int(warm), failed)
    if keep is None and not in_graph:
        return None
    selective, beside, refusals = _refusals(name, module, call, ops, warm, save_ops, compiled, repeats if in_graph else 1)
    if in_graph:  # timed in turn with selective, or, where that failed, on its own
        keep = beside if beside is not None else _timed(module, kept_forward, call, ops, repeats, int(warm), failed)
        if keep is None:
            return None
    try:
        working = measure_released_working(module, call, device)
    except Exception as exc:  # noqa: BLE001
        log.debug("measuring %s's forward without saving failed: %s", name, exc)
        working = -1
    traced = None
    if alone:
        try:
            traced = trace_alone(module, call, device, min_offload_bytes=min_offload_bytes)
        except Exception as exc:  # noqa: BLE001 - the caller plans without it (Note [A segment that cannot be replayed])
            log.debug("tracing %s alone failed: %s", name, exc)
            failed.append(f"{type(exc).__name__}: {exc}")
            return None
    return ActionCosts(
        keep[0], keep[1], recompute_ms=keep[0], selective_ms=None if selective is None else max(0.0, sum(selective) - sum(keep)),
        released_working_bytes=working, alone=traced, refusal=_worst(refusals), selective_in_graph=in_graph and selective is not None,
    )


def _shapes(module: nn.Module) -> tuple:
    return tuple((n, tuple(t.shape), t.dtype) for n, t in (*module.named_parameters(), *module.named_buffers()))


@dataclass(frozen=True)
class _Compiled:
    """A segment under ``torch.compile`` as the runtime runs it (Note [Compiled segments are timed
    compiled]): its forward compiled in the user's context, and (context, forward) where it
    recomputes inside its graph (``None``: it recomputes eagerly)."""

    forward: Any
    graph: Optional[tuple[Any, Any]]


def _compiled(model: nn.Module, name: str, module: nn.Module) -> Optional[_Compiled]:
    """Note [Compiled segments are timed compiled]: segment ``name`` of ``model`` as the runtime
    compiles it (:func:`~..compiled.compiled_forward`), ``None`` where it is not under ``torch.compile``."""
    found = compile_context(model, name)
    return None if found is None else _Compiled(*compiled_forward(found[1], module.forward, module))


def _measured_once(
    measured: dict[tuple, tuple[Optional[ActionCosts], list[str]]], model: nn.Module, name: str, module: nn.Module,
    call: CapturedCall, ops: StreamOps, device: torch.device, *, repeats: int, warm: bool, alone: bool, min_offload_bytes: int,
    save_ops: Optional[tuple[str, ...]],
) -> tuple[Optional[ActionCosts], list[str]]:
    """Segment ``name``'s costs and why they failed, measured unless ``measured`` holds those of a
    segment they are the same for (Note [Planning costs a few steps] in ``observe.py``: identical
    blocks, a transformer's, cost the same; one of each is run)."""
    compiled = _compiled(model, split_call(name)[0], module)  # a call's context is its module's
    how = None if compiled is None else compiled.graph is not None  # Note [Compiled segments are timed compiled]
    key = (type(module), repr(module), _shapes(module), call.signature(), alone, save_ops, how)
    if key not in measured:
        if call.dropped:
            log.debug("replaying %s without %s (Note [A replay has no side effects])", name, ", ".join(call.dropped))
        why: list[str] = []
        costs = _segment_costs(
            name, module, call, ops, device, repeats=repeats, warm=warm, alone=alone, min_offload_bytes=min_offload_bytes,
            save_ops=save_ops, compiled=compiled, failed=why,
        )
        measured[key] = (costs, why)
    return measured[key]


def measure_action_costs(
    model: nn.Module,
    modules: dict[str, nn.Module],
    calls: dict[str, CapturedCall],
    ops: StreamOps,
    *,
    device: torch.device,
    repeats: int = 3,
    alone: Collection[str] = (),
    min_offload_bytes: int = 1,
    save_ops: Optional[dict[str, tuple[str, ...]]] = None,
    failed: Optional[dict[str, str]] = None,
) -> dict[str, ActionCosts]:
    """Time every segment in ``calls`` kept (the median of ``repeats`` runs) and selectively
    recomputed (saving ``save_ops[name]`` where given: Note [Which ops selective recomputation
    saves] in ``profiler.py``), and trace the segments named in ``alone`` on their own (Note [A
    segment measured alone]). Note [Timing a segment leaves no trace], Note [A replay has no side
    effects] in ``replay.py``. A segment whose kept run fails, or whose trace was asked for and
    failed, is left out, and why is in ``failed`` (segment -> the first error: Note [A segment that
    cannot be replayed] in ``observe.py``)."""
    out: dict[str, ActionCosts] = {}
    measured: dict[tuple, tuple[Optional[ActionCosts], list[str]]] = {}  # by what the costs depend on
    warm = is_compiled(model)  # a compiled segment's first call under an action compiles a graph
    with torch.no_grad():
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
    rng = torch.random.fork_rng(devices=[torch.cuda.current_device()] if ops.asynchronous and torch.cuda.is_available() else [])
    rng.__enter__()
    try:
        # Note [A replay has no side effects] in ``replay.py``; FSDP2's records of the lone forwards
        # dropped afterwards (Note [A sharded segment's forward alone] in ``sharded.py``).
        with module_state(model), lone_forwards(model):
            for name, call in calls.items():
                module = modules[name]  # a call's segment (``name#1``) is its module's: Note [A segment per call]
                with unsharded(module):  # every rank gathers every segment: Note [Sharded segments timed in lockstep]
                    costs, why = _measured_once(
                        measured, model, name, module, call, ops, device, repeats=repeats, warm=warm, alone=name in alone,
                        min_offload_bytes=min_offload_bytes, save_ops=(save_ops or {}).get(name),
                    )
                if costs is not None:
                    out[name] = costs
                elif failed is not None:
                    failed[name] = (why or ["no reason given"])[0][:300]
    finally:
        rng.__exit__(None, None, None)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return out
