"""One instrumented training step: what the profiler measures, before any modelling.

The step runs with every segment kept (plain training). Around it:

- the CPU meter (:class:`DeviceMemoryMeter`, which also counts fake storages) gives the peak
  bytes alive in each *window* of the step: before the first segment, each segment's forward,
  the tail (after the last segment: head, loss and the head's backward), each segment's
  backward, and after the first segment's backward;
- a ``saved_tensors_hooks`` pack hook that returns its tensor unchanged records which storages
  each region saves for backward;
- a ``TorchDispatchMode`` records the storages produced by compute-heavy ops (what
  ``Action.SELECTIVE`` keeps) and, on real tensors, the time spent in them; under fake
  tensors it counts FLOPs and bytes instead, for an estimate.

Note [Backward windows from tensor hooks]: a segment's backward starts when the gradient of
its output is ready and ends when the gradient of its input is; both are plain tensor hooks.
Module full-backward hooks would wrap the segment's inputs and outputs in ``BackwardHookFunction``
views, which breaks in-place ops on them (ResNet's ``relu_`` after the residual add). A
segment whose input does not require grad has no end event and its window runs to the end of
the step.

Note [Windows outside the segments]: the code between segments is a region of its own, so that
every saved byte is plannable, with a forward and a backward window (Note [Keys of a measured
step]): the prefix (before the first segment: ``WindowKind.PREFIX_FORWARD`` / ``PREFIX_BACKWARD``),
after each segment ``i`` the code up to the next segment (``Window(AFTER, i)``, from the end of
``i``'s forward to the next one's start, and ``Window(AFTER_BACKWARD, i)``, from the end of the
next segment's backward to the start of ``i``'s), and after the last segment the head and loss,
whose forward window ends at ``backward_begins`` (the bytes alive then are ``turnaround_bytes``)
and whose backward window runs to the start of the last segment's backward. What each region
saves is recorded under its key (``PREFIX``, ``after_region(i)``: its forward window), as the
segments' under their index.

Note [Regions held as kept]: a step traced under a plan (``auto``'s first step, under the
lowest-memory plan; a step of a shape no profile covers: Note [Auto learns from the steps it
runs] in ``scale/auto.py``) runs with the regions outside the segments offloaded by the
runtime's whole-step saved-tensor hooks, and segments offloaded by hooks of their own. The
tracer's pack hook goes over the whole-step ones and calls them (only the innermost pair of hooks
runs), so it still records what each region saves, and the runtime still offloads it; what a
segment's hooks save reaches the tracer from the runtime itself (Note [A traced step sees what
the plan moves]). On CPU the tracer's meter counts each storage the plan moves off the device as
alive until its region's (or segment's) backward begins (``DeviceMemoryMeter.hold``), as keeping
it would: every forward window is measured as if everything were kept, while the step itself
(and the runtime's meter, which holds the budget) offloads them. From the backward on they are
let go: the backward windows are measured as the plan ran them, fetched back per saved tensor.
On CUDA the allocator's counts cannot be held: the windows are the plan's.

Note [A traced step sees what the plan moves]: a segment's saved-tensor hooks are entered as its
forward starts, above every hook entered before (the tracer's among them), and only the innermost
pair runs; so the runtime's offload engine hands every tensor it is asked to save to the tracer
first (``OffloadEngine.observer`` -> :meth:`_Recorder.moved`). A traced step therefore runs only
actions whose saved tensors pass through a hook, ``keep`` and ``offload`` (a recomputed segment's
are saved inside torch's checkpoint, seen by no hook): the profile is then the step's own, with no
segment run again outside it.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..engine.meter import DeviceMemoryMeter, in_host_allocation
from ..engine.offload import OffloadEngine
from ..engine.recompute import compute_heavy_ops, op_call, written_args
from ..segments import call_name, resolve_modules, split_call
from ..sharded import gathered_bytes, gathered_parameters, is_sharded
from ..tensors import local_tensor, pop_saved_tensors_hooks
from .windows import PREFIX, Mark, MarkKind, Window, WindowKind, after_region, is_segment

__all__ = [
    "Mark", "MarkKind", "PREFIX", "StepTrace", "StepTracer", "Window", "WindowKind", "after_region",
    "boundary_keys", "is_segment", "region_times", "released_working", "run_trace", "run_timing",
]

@dataclass(frozen=True)
class _Backward:
    """The tracer's region while a backward runs: the backward of ``region`` (a region key), or of
    nothing known (``None``: a step with no segment)."""

    region: Any


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor):
            return t
    return None


def _storage(t: torch.Tensor) -> Optional[torch.UntypedStorage]:
    t = local_tensor(t)  # a shard's bytes (Note [Sharded state is local])
    if t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None


class _Storages:
    """Storages seen in one step, identified safely across id reuse (weak references)."""

    def __init__(self) -> None:
        self._refs: dict[int, tuple[weakref.ref, int]] = {}
        self.by_key: dict[int, weakref.ref] = {}
        self._next = 0

    def alias(self, storage: torch.UntypedStorage, key: int) -> None:
        """``storage`` is known by ``key`` from now on (an offloaded storage's copy fetched back)."""
        self._refs[id(storage)] = (weakref.ref(storage), key)

    def key(self, storage: torch.UntypedStorage) -> int:
        entry = self._refs.get(id(storage))
        if entry is not None and entry[0]() is storage:
            return entry[1]
        self._next += 1
        ref = weakref.ref(storage)
        self._refs[id(storage)] = (ref, self._next)
        self.by_key[self._next] = ref
        return self._next


@dataclass
class StepTrace:
    """Raw measurements of one kept training step (mutable while recording)."""

    order: list[str] = field(default_factory=list)
    #: The peak bytes of each window (Note [Windows outside the segments]).
    window_peak: dict[Window, int] = field(default_factory=dict)
    #: Bytes alive when each window started.
    window_start: dict[Window, int] = field(default_factory=dict)
    #: The same two without the storages held as kept (Note [Regions held as kept]): what the
    #: step really held; and the regions and segments the step's plan offloaded.
    window_real_peak: dict[Window, int] = field(default_factory=dict)
    window_real_start: dict[Window, int] = field(default_factory=dict)
    offloaded: set = field(default_factory=set)
    #: Bytes alive when the loss's backward began (``backward_begins``); -1: not called.
    turnaround_bytes: int = -1
    saved: dict[Any, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    heavy: dict[Any, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    input_key: dict[int, tuple[int, int]] = field(default_factory=dict)
    output_key: dict[int, tuple[int, int]] = field(default_factory=dict)
    grad_bytes: dict[Any, int] = field(default_factory=lambda: defaultdict(int))
    offload_bwd_peak: dict[Any, int] = field(default_factory=dict)
    offload_bwd_peak_in: dict[Any, int] = field(default_factory=dict)
    tensor_bwd_peak: dict[Any, int] = field(default_factory=dict)
    tensor_bwd_peak_in: dict[Any, int] = field(default_factory=dict)
    tensor_bwd_peak_out: dict[Any, int] = field(default_factory=dict)
    tensor_bwd_peak_both: dict[Any, int] = field(default_factory=dict)
    heavy_op_ms: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    #: Per segment, per call of an op (``op#k``: the ``k``-th call of the overload ``op``, Note
    #: [Selective saves per call] in ``profiler.py``): the forward milliseconds (estimated in fake
    #: mode), the storages its outputs made, by key, and its estimated milliseconds.
    ops: dict[int, dict[str, list]] = field(default_factory=lambda: defaultdict(dict))
    #: The storages an op of the forward wrote in place (any region's: a later segment's or the
    #: write of a region outside them changes what an earlier segment would have saved).
    mutated: set = field(default_factory=set)
    #: The segments recomputed inside a compiled graph (Note [Selective under compile chooses
    #: compute-heavy calls] in ``profiler.py``); set by whoever knows the model is compiled.
    in_graph: set = field(default_factory=set)
    all_op_ms: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    est_heavy_ms: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    est_all_ms: dict[Any, float] = field(default_factory=lambda: defaultdict(float))
    static_bytes: int = 0
    peak_bytes: int = 0
    #: Bytes of the parameters FSDP gathered for each segment's forward (a sharded model only).
    gathered_bytes: dict[int, int] = field(default_factory=dict)
    #: Milliseconds from the step's start to each mark (``StepTracer`` with ``ops``).
    marks: dict[Mark, float] = field(default_factory=dict)
    #: Segments whose input is alive before the step (the batch): never saved by the step.
    static_inputs: set[int] = field(default_factory=set)
    #: Every segment by index, one per call of a module run several times (Note [A segment per call]).
    names: list[str] = field(default_factory=list)


def boundary_keys(trace: "StepTrace", order: list[int], key: Any) -> tuple[Any, Any]:
    """The storage keys of a region's input and output (``None``: none): a segment's own; the
    prefix's output is the first segment's input; the code after segment ``i`` takes ``i``'s
    output and gives the next segment its input (after the last, the loss: no storage).
    ``order``: segment indices in execution order."""
    if is_segment(key):
        return trace.input_key.get(key, (None,))[0], trace.output_key.get(key, (None,))[0]
    if key == PREFIX:
        return None, (trace.input_key.get(order[0], (None,))[0] if order else None)
    pos = order.index(key.segment)
    nxt = order[pos + 1] if pos + 1 < len(order) else None
    return trace.output_key.get(key.segment, (None,))[0], (trace.input_key.get(nxt, (None,))[0] if nxt is not None else None)


class _OpRecorder(TorchDispatchMode):
    def __init__(self, rec: "_Recorder", *, flops_per_ms: float, bytes_per_ms: float) -> None:
        super().__init__()
        self.rec = rec
        self.heavy = compute_heavy_ops()
        self.flops_per_ms = flops_per_ms
        self.bytes_per_ms = bytes_per_ms

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if in_host_allocation():  # the offload engine's own copies are no op of the model's
            return func(*args, **kwargs)
        rec = self.rec
        start = time.perf_counter()
        out = func(*args, **kwargs)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        region = rec.region
        if rec.phase_is_forward:  # what it writes in place, in any region (Note [Which ops selective recomputation saves])
            rec.trace.mutated.update(rec.keys.key(s) for t in written_args(func, args, kwargs) if (s := _storage(t)) is not None)
        if rec.phase_is_forward and is_segment(region):
            is_heavy = func in self.heavy
            rec.trace.all_op_ms[region] += elapsed_ms
            outputs = {
                rec.keys.key(s): s.nbytes() for t in tree_leaves(out)
                if isinstance(t, torch.Tensor) and (s := _storage(t)) is not None and id(s) not in rec.param_storages
            }
            if is_heavy:
                rec.trace.heavy_op_ms[region] += elapsed_ms
                rec.trace.heavy[region].update(outputs)
            est = self._estimate_ms(func, args, kwargs, out)
            if rec.fake:
                rec.trace.est_all_ms[region] += est
                if is_heavy:
                    rec.trace.est_heavy_ms[region] += est
            rec.record_op(region, str(func), est if rec.fake else elapsed_ms, outputs, cacheable=not func._schema.is_mutable, est=est)
        elif rec.fake and rec.phase_is_forward:
            rec.trace.est_all_ms[region] += self._estimate_ms(func, args, kwargs, out)
        elif isinstance(region, _Backward) and region.region is not None:
            rec.offload_candidate(region.region, args, kwargs)
        return out

    def _estimate_ms(self, func, args, kwargs, out) -> float:
        """Roofline-style guess for fake tensors: FLOPs of matmul/conv plus bytes touched."""
        from torch.utils.flop_counter import flop_registry

        nbytes = sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        flops = 0
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            try:
                flops = formula(*args, **kwargs, out_val=out)
            except Exception:  # a formula that does not accept this overload's arguments
                flops = 0
        return flops / self.flops_per_ms + nbytes / self.bytes_per_ms


class _Recorder:
    """Installs the hooks of one traced step and owns their handles."""

    def __init__(self, model: nn.Module, names: list[str], meter: DeviceMemoryMeter, param_storages: set, fake: bool) -> None:
        self.model = model
        #: Segment names by index: the given ones, then a call's segment for each call of a module
        #: beyond those named (Note [A segment per call] in segments.py), in the order first run.
        self.names = list(names)
        self.given = len(names)
        self.index = {name: i for i, name in enumerate(names)}
        self.modules = resolve_modules(model, names)  # canonical names, compiled or not
        #: Module name -> calls so far this step, and the indices of its calls still running.
        self.calls: dict[str, int] = {}
        self.running: dict[str, list[int]] = {}
        self.meter = meter
        self.param_storages = param_storages
        self.fake = fake
        self.min_offload_bytes = 1
        self.trace = StepTrace()
        self.keys = _Storages()
        #: The region running: a region key in forward, a :class:`_Backward` in backward.
        self.region: Any = PREFIX
        self.window = Window(WindowKind.PREFIX_FORWARD)
        #: Note [Regions held as kept]: whether what the plan moves off the device (the regions
        #: outside the segments, and the segments: Note [A traced step sees what the plan moves])
        #: is counted as kept whatever the plan does with it, and the storages held so, by region.
        self.hold = False
        self.held: dict[Any, set[int]] = {}
        self.phase_is_forward = True
        self.handles: list[Any] = []
        self._exec: list[int] = []  # segment indices in execution order
        #: Timing events at segment boundaries (``StepTracer`` with ``ops``); ``None``: none.
        self.ops: Any = None
        self.marks: dict[Mark, Any] = {}
        self._bwd_ops: dict[int, list[tuple[int, set]]] = {}
        self.sharded = is_sharded(model)
        #: Storage keys some op of the forward has made (Note [Which ops selective recomputation saves]).
        self._made: set[int] = set()
        #: (segment, op) -> its calls so far in that segment's forward (Note [Selective saves per call]).
        self._op_calls: dict[tuple[int, str], int] = {}

    def record_op(self, region: int, op: str, ms: float, outputs: dict[int, int], *, cacheable: bool = True, est: float = 0.0) -> None:
        """One op of segment ``region``'s forward: its time and the storages it made, not those
        its outputs share with what existed (views, in-place ops: Note [Which ops selective
        recomputation saves] in ``profiler.py``). An op that is not ``cacheable`` (an ``out=``
        overload: Note [Selective never replays a mutated tensor] in ``engine/recompute.py``)
        makes nothing selective could save. Each call is its own entry, ``op#k`` for the op's
        ``k``-th call in the segment's forward, with ``est``, its estimated milliseconds (FLOPs and
        bytes: how the op's measured time is shared among its calls, Note [Selective saves per call]
        in ``profiler.py``)."""
        k = self._op_calls.get((region, op), 0)
        self._op_calls[(region, op)] = k + 1
        costs = self.trace.ops[region].setdefault(op_call(op, k), [0.0, {}, 0.0])
        costs[0] += ms
        costs[2] += est
        if cacheable:
            costs[1].update({k: b for k, b in outputs.items() if k not in self._made})
        self._made.update(outputs)

    def mark(self, kind: MarkKind, segment: int = -1) -> None:
        if self.ops is not None:
            self.marks[Mark(kind, segment)] = self.ops.record(self.ops.compute_stream(), timing=True)

    def resolve_marks(self) -> dict[Mark, float]:
        """Milliseconds from the step's start to each mark (one wait for the last event)."""
        ops, marks = self.ops, self.marks
        # STOP: the whole step's end (the optimizer step's)
        last = marks.get(Mark(MarkKind.STOP), marks.get(Mark(MarkKind.END)))
        if last is not None:
            ops.synchronize(last)  # the profiling step's one wait: its times are needed now
        start = marks[Mark(MarkKind.START)]
        return {k: ops.elapsed_ms(start, e) for k, e in marks.items()}

    # -- windows ------------------------------------------------------------------------
    def switch(self, window: Window) -> None:
        """Note [The tail opens holding the last input]: the window after a segment's forward
        opens in its forward hook, while its caller still references the segment's input; kept,
        that input is saved and stays, but under a plan that moves it to the host it is freed a
        moment later. So such a window's opening level is its start (``window_start``) and, on
        CPU, its peak counts only the levels after it: a step measured under a plan
        (``decide/under_plan.py``) then tells what the window after the last segment (the tail:
        head and loss) holds from the forward's last instant, where plain's peak may be."""
        peak, trace = self.meter.peak_bytes, self.trace
        trace.peak_bytes = max(trace.peak_bytes, peak)
        trace.window_peak[self.window] = max(trace.window_peak.get(self.window, 0), peak)
        trace.window_real_peak[self.window] = max(trace.window_real_peak.get(self.window, 0), self.meter.real_peak_bytes)
        self._let_go(window)
        self.meter.reset_peak(after_next_change=window.kind is WindowKind.AFTER)
        self.window = window
        trace.window_start.setdefault(window, self.meter.current_bytes)
        trace.window_real_start.setdefault(window, self.meter.real_bytes)

    def _let_go(self, window: Window) -> None:
        """Note [Regions held as kept]: as a backward window opens, the regions and segments whose
        backward is over (those that ran after its element in forward) stop being held: kept,
        their storages would have been freed by then; all of them once the backward is over."""
        if not self.held or not (window.is_backward or window.kind in (WindowKind.OPTIMIZER, WindowKind.END)):
            return
        if window.kind is WindowKind.PREFIX_BACKWARD or not window.is_backward:
            now = -1 if window.is_backward else -2
        elif window.segment not in self._exec:
            return
        else:
            now = 2 * self._exec.index(window.segment) + (window.kind is WindowKind.AFTER_BACKWARD)
        for region in [r for r in self.held if self.ran_at(r) > now]:  # their backward is over
            self.meter.let_go(self.held.pop(region))

    def ran_at(self, region: Any) -> int:
        """A region's place in the forward: a segment, then the code after it."""
        if region == PREFIX:
            return -1
        return 2 * self._exec.index(region) if is_segment(region) else 2 * self._exec.index(region.segment) + 1

    def region_before(self, i: int) -> Any:
        """The outside region that runs just before segment ``i`` in this forward: the prefix, or
        the code after the segment that ran before it (Note [Windows outside the segments])."""
        pos = self._exec.index(i)
        return PREFIX if pos == 0 else after_region(self._exec[pos - 1])

    # -- forward hooks ------------------------------------------------------------------
    def _call_index(self, module_name: str) -> int:
        """The segment of this call of ``module_name`` (Note [A segment per call])."""
        call = self.calls.get(module_name, 0)
        self.calls[module_name] = call + 1
        name = call_name(module_name, call)
        if name not in self.index:
            self.index[name] = len(self.names)
            self.names.append(name)
        return self.index[name]

    def pre(self, module_name: str):
        def hook(module, args, kwargs):
            if not self.phase_is_forward:
                return  # a forward after the step's first backward (a closure's next pass): not traced
            i = self._call_index(module_name)
            self.running.setdefault(module_name, []).append(i)
            self._exec.append(i)
            self.mark(MarkKind.FORWARD_START, i)
            self.switch(Window(WindowKind.FORWARD, i))
            self.region = i
            if self.sharded:
                self._gathered(module, i)
            x = _first_tensor(args)
            if x is not None and (s := _storage(x)) is not None:
                self.trace.input_key[i] = (self.keys.key(s), s.nbytes())
                if id(s) in self.param_storages:
                    self.trace.static_inputs.add(i)
                if x.requires_grad:
                    self.handles.append(x.register_hook(self._on_bwd_end(i)))

        return hook

    def post(self, module_name: str):
        def hook(module, args, output):
            if not self.running.get(module_name):
                return
            i = self.running[module_name].pop()
            self.mark(MarkKind.FORWARD_END, i)
            y = _first_tensor(output)
            if y is not None and (s := _storage(y)) is not None:
                self.trace.output_key[i] = (self.keys.key(s), s.nbytes())
                if y.requires_grad:
                    self.handles.append(y.register_hook(self._on_bwd_start(i)))
            self.region = after_region(i)
            self.switch(Window(WindowKind.AFTER, i))

        return hook

    # -- backward hooks (Note [Backward windows from tensor hooks]) ---------------------
    def _on_bwd_start(self, i: int):
        def hook(grad):
            self.phase_is_forward = False
            self.mark(MarkKind.BACKWARD_START, i)
            self.switch(Window(WindowKind.BACKWARD, i))
            self.region = _Backward(i)

        return hook

    def _on_bwd_end(self, i: int):
        def hook(grad):
            self.mark(MarkKind.BACKWARD_END, i)
            before = self.region_before(i)  # its backward runs next
            if before == PREFIX:
                self.switch(Window(WindowKind.PREFIX_BACKWARD))
            elif self.window == Window(WindowKind.BACKWARD, i):
                # Not when the segment before already began its backward: with nothing in
                # between, its output is this input, and its hook ran first (hooks run in the
                # order they were registered).
                self.switch(Window(WindowKind.AFTER_BACKWARD, before.segment))
            else:
                return
            self.region = _Backward(before)

        return hook

    def _on_grad(self, p: torch.Tensor) -> None:
        region = None if self.phase_is_forward else self.region  # in the forward's phase: outside the segments
        if isinstance(region, _Backward):
            region = region.region
        self.trace.grad_bytes[region if isinstance(region, int) else "outside"] += p.grad.untyped_storage().nbytes()

    def offload_candidate(self, i: int, args: Any, kwargs: Any) -> None:
        """One op of segment ``i``'s backward: the bytes alive now and the storages it reads,
        for :meth:`offload_peaks`."""
        needed = set()
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and (s := _storage(t)) is not None:
                needed.add(self.keys.key(s))
        self._bwd_ops.setdefault(i, []).append((self.meter.current_bytes, needed))

    def offload_peaks(self) -> None:
        """Note [Offloaded backward fetches on demand]: with an offloaded segment and no
        prefetch, a saved storage comes back when the first op of the backward reads it and
        stays until the last one has (Note [One storage, one copy]); in plain training it was
        there all along, and after its last use it is freed in both. So at each op the bytes alive
        in plain training, less this segment's offloadable saved storages that no op has read
        yet, estimate the offloaded segment's backward. Boundary storages (input, output) are
        left in, since a neighbour may hold them (``offload_bwd_peak``); the input is also
        counted as fetched on demand (``offload_bwd_peak_in``), for when no neighbour holds it.
        Fetched per saved tensor (Note [Copy windows] in ``engine/offload.py``), a
        storage is there only while an op reads it: at each op, less every such storage alive in
        plain training that the op does not read (``tensor_bwd_peak``; ``_in``, ``_out``,
        ``_both``: the input, the output, both, also per tensor, for when no neighbour holds them)."""
        for i, ops in self._bwd_ops.items():
            inp, out = self.boundary_keys(i)
            every = {key: n for key, n in self.trace.saved.get(i, {}).items() if n >= self.min_offload_bytes}
            saved = {k: n for k, n in every.items() if k != out}
            held = {k: n for k, n in saved.items() if k != inp}
            last = {}
            for k, (_, needed) in enumerate(ops):
                for key in needed:
                    last[key] = k
            for peaks, pending in ((self.trace.offload_bwd_peak, held), (self.trace.offload_bwd_peak_in, saved)):
                pending = dict(pending)
                waiting = sum(pending.values())
                for level, needed in ops:
                    for key in needed & pending.keys():
                        waiting -= pending.pop(key)
                    peaks[i] = max(peaks.get(i, 0), level - waiting)
            estimates = (
                (self.trace.tensor_bwd_peak, held), (self.trace.tensor_bwd_peak_in, saved),
                (self.trace.tensor_bwd_peak_out, {k: n for k, n in every.items() if k != inp}), (self.trace.tensor_bwd_peak_both, every),
            )
            # A storage a region that ran before this one saved stays alive in plain training past
            # its last use here, until that region's backward; one only later regions also saved
            # is freed there (a block's output its last op and the next block's first op save).
            here = self.ran_at(i)
            elsewhere = {key for region, keys in self.trace.saved.items() if self.ran_at(region) < here for key in keys}
            for peaks, storages in estimates:
                for k, (level, needed) in enumerate(ops):
                    absent = sum(n for key, n in storages.items() if key not in needed and (last.get(key, k) >= k or key in elsewhere))
                    peaks[i] = max(peaks.get(i, 0), level - absent)

    def boundary_keys(self, key: Any) -> tuple[Any, Any]:
        return boundary_keys(self.trace, self._exec, key)

    def _gathered(self, module: nn.Module, i: Optional[int] = None) -> None:
        """FSDP gathered these parameters just now (its hook runs before ours): they are not
        saved activations, and their bytes are the segment's (Note [Sharded state is local])."""
        tensors = [t for t in gathered_parameters(module) if t.layout == torch.strided]
        self.param_storages.update(id(t.untyped_storage()) for t in tensors)
        if i is not None:
            self.trace.gathered_bytes[i] = gathered_bytes(tensors)

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        self._gathered(module)  # the root unit's parameters, saved by the head and the embedding

    # -- saved tensors ------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self._saved(t)
        return t

    def moved(self, t: torch.Tensor, offloaded: bool) -> Optional[int]:
        """Note [A traced step sees what the plan moves]: a tensor the runtime's saved-tensor hooks
        are asked to save (a segment's, innermost, which this recorder's hook never sees; the whole
        step's, below it); an offloaded one is held as kept (Note [Regions held as kept]) until
        :meth:`unpacked` is told with the token returned."""
        s = self._saved(t)
        if s is None or not offloaded:
            return None
        self.trace.offloaded.add(self.region)
        token = self.meter.hold(s) if self.hold else None
        if token is not None:
            self.held.setdefault(self.region, set()).add(token)
        return token, self.keys.key(s)

    def fetched(self, observed: list, copy: torch.Tensor) -> None:
        """An offloaded storage's first unpack in backward (what :meth:`moved` returned for it): its
        copy fetched back is known by the original's key (what the backward's ops read)."""
        observed = [o for o in observed if o is not None]
        if observed and (s := _storage(copy)) is not None:
            self.keys.alias(s, observed[0][1])

    def unpacked(self, observed: list) -> None:
        """Note [Regions held as kept]: an offloaded storage's first unpack in backward, before its
        copy is fetched back: its holds go, the copy is counted from then on as the original was
        until then. (Under a window of 0, a storage two ops saved, fetched again for the second
        after the first freed its copy, is not counted in between, where plain training holds it,
        and the second copy is not known by the original's key; :func:`run_trace` holds it.)"""
        tokens = [token for token, _ in (o for o in observed if o is not None) if token is not None]
        self.meter.let_go(tokens)
        for held in self.held.values():
            held.difference_update(tokens)

    def _saved(self, t: torch.Tensor) -> Optional[torch.UntypedStorage]:
        s = _storage(t)
        if s is None or id(s) in self.param_storages or not self.phase_is_forward:
            return None
        self.trace.saved[self.region][self.keys.key(s)] = s.nbytes()
        return s

    def install(self, params: list[torch.Tensor]) -> None:
        hooked: set[str] = set()
        for name in self.names:
            module_name = split_call(name)[0]
            if module_name in hooked:
                continue
            hooked.add(module_name)
            module = self.modules[name]
            self.handles.append(module.register_forward_pre_hook(self.pre(module_name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self.post(module_name)))
        if self.sharded:
            self.handles.append(self.model.register_forward_pre_hook(self._root_pre))
        for p in params:
            if p.requires_grad and p.grad is None:
                self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class _FakeMeter(DeviceMemoryMeter):
    """Counts (fake) storages like the CPU meter, whatever device the fake tensors claim:
    fake CUDA tensors never reach the CUDA allocator."""

    @property
    def is_cuda(self) -> bool:
        return False


class StepTracer:
    """One training step measured while the caller runs it (forward, loss, backward and, if the
    caller says when, the optimizer step): the profile of the step that runs anyway, without
    calling the user's code an extra time.

    ``begin()`` before the forward; ``backward_begins()`` once the loss exists, before its
    backward (the pack hooks are popped there: they are a stack the caller's code shares);
    ``backward_done()`` after it; ``finish()`` at the end of the step returns the
    :class:`StepTrace`; ``abort()`` cleans up instead. Segment times come from timing events
    at the segment boundaries (``ops``, read in ``finish``: the one wait of a profiling step).
    """

    def __init__(
        self,
        model: nn.Module,
        names: list[str],
        *,
        device: torch.device,
        static: list[torch.Tensor],
        params: list[torch.Tensor],
        fake: bool = False,
        min_offload_bytes: int = 1,
        flops_per_ms: float = 1e9,
        bytes_per_ms: float = 1e7,
        ops: Any = None,
    ) -> None:
        self.names = names
        self.meter = _FakeMeter(device) if fake else DeviceMemoryMeter(device)
        self._static = static
        param_storages = {id(_storage(t)) for t in static if _storage(t) is not None}
        self.rec = _Recorder(model, names, self.meter, param_storages, fake)
        self.rec.min_offload_bytes = max(min_offload_bytes, 1)
        self.rec.ops = ops
        self._params = params
        self._op_mode = _OpRecorder(self.rec, flops_per_ms=flops_per_ms, bytes_per_ms=bytes_per_ms)
        self._saved_hooks: Any = None
        self._entered: list[str] = []

    def _hooks_over(self) -> Any:
        """The pack hook that records what is saved, over the saved-tensor hooks active now (a
        runtime's for the regions outside the segments, under a plan: Note [Regions held as
        kept]): only the innermost pair of hooks runs, so theirs are called from ours."""
        below = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if below is None:
            return torch.autograd.graph.saved_tensors_hooks(self.rec.pack, lambda t: t)
        pack, unpack = below
        return torch.autograd.graph.saved_tensors_hooks(lambda t: pack(self.rec.pack(t)), unpack)

    def begin(self) -> "StepTracer":
        rec = self.rec
        rec.install(self._params)
        try:
            self.meter.__enter__()
            self._entered.append("meter")
            self.meter.track(self._static)
            # Hold no reference: the step may free some of these (``zero_grad`` frees the last
            # step's gradients), as Note [The snapshot must not keep gradients alive] explains.
            self._static.clear()
            rec.trace.static_bytes = self.meter.current_bytes
            self.meter.reset_peak()
            rec.mark(MarkKind.START)
            self._op_mode.__enter__()
            self._entered.append("ops")
            self._saved_hooks = self._hooks_over()
            self._saved_hooks.__enter__()
            self._entered.append("saved")
        except BaseException:
            self.abort()
            raise
        return self

    def backward_begins(self) -> None:
        if "saved" in self._entered:
            self._entered.remove("saved")
            pop_saved_tensors_hooks(self._saved_hooks.pack_hook)  # Note [Hooks never outlive the library]
        rec = self.rec
        rec.phase_is_forward = False
        rec.mark(MarkKind.LOSS_BACKWARD)
        rec.trace.turnaround_bytes = self.meter.current_bytes
        if rec._exec:  # Note [Windows outside the segments]: the head and loss's backward
            rec.switch(Window(WindowKind.AFTER_BACKWARD, rec._exec[-1]))
            rec.region = _Backward(after_region(rec._exec[-1]))
        else:
            rec.region = _Backward(None)

    def backward_done(self) -> None:
        """The step's backward is over: what follows (the optimizer step) is its own window."""
        self.rec.mark(MarkKind.END)
        self.rec.switch(Window(WindowKind.OPTIMIZER))

    def finish(self) -> StepTrace:
        rec = self.rec
        if Mark(MarkKind.END) not in rec.marks:
            rec.mark(MarkKind.END)
        rec.switch(Window(WindowKind.END))
        self._close()
        rec.offload_peaks()
        trace = rec.trace
        missing = [rec.names[i] for i in range(rec.given) if i not in rec._exec]
        if missing:
            raise ValueError(f"`segments` {missing} did not run in the profiled step.")
        trace.order = [rec.names[i] for i in rec._exec]
        trace.names = list(rec.names)
        if rec.ops is not None:
            trace.marks = rec.resolve_marks()
        return trace

    def abort(self) -> None:
        self._close()

    def _close(self) -> None:
        if "saved" in self._entered:
            pop_saved_tensors_hooks(self._saved_hooks.pack_hook)
        if "ops" in self._entered:
            self._op_mode.__exit__(None, None, None)
        if "meter" in self._entered:
            self.meter.__exit__(None, None, None)
        self._entered.clear()
        self.rec.remove()


def run_trace(
    model: nn.Module,
    names: list[str],
    step: Callable[[], torch.Tensor],
    *,
    device: torch.device,
    static: list[torch.Tensor],
    params: list[torch.Tensor],
    fake: bool,
    min_offload_bytes: int = 1,
    flops_per_ms: float = 1e9,
    bytes_per_ms: float = 1e7,
) -> StepTrace:
    """Run ``step`` (forward, loss, backward) once with every window measured. On CPU (real
    tensors) what the segments save is offloaded as it is saved and held as kept (Note [Regions
    held as kept]), and fetched back once, held to its last unpack (CPU's default window): the
    windows are plain training's, every op reads a storage by its original's key (a block's
    output, which the next block's first op and its own last op save: measured per saved tensor,
    its second copy went unseen, and a window of 0 was priced a storage under), and each
    segment's forward is also measured without its saved tensors (:func:`released_working`)."""
    tracer = StepTracer(
        model, names, device=device, static=static, params=params, fake=fake, min_offload_bytes=min_offload_bytes,
        flops_per_ms=flops_per_ms, bytes_per_ms=bytes_per_ms,
    )
    engine, hooks = None, None
    if not fake and device.type == "cpu":
        engine = OffloadEngine(device, min_offload_bytes=min_offload_bytes)
        engine.begin_step(static)
        engine.observer, tracer.rec.hold = tracer.rec, True
        rec = tracer.rec
        hooks = engine.outside_hooks(lambda: "segment" if rec.phase_is_forward and is_segment(rec.region) else None)
        hooks.__enter__()
    try:
        tracer.begin()
        loss = step()
        tracer.backward_begins()
        loss.backward()
        return tracer.finish()
    except BaseException:
        tracer.abort()
        raise
    finally:
        if engine is not None:
            pop_saved_tensors_hooks(hooks.pack_hook)
            engine.end_step()
            engine.close()


def released_working(trace: StepTrace, i: int) -> int:
    """Note [A forward that does not keep] in ``decide/costmodel.py``: segment ``i``'s forward
    rise with what it saved held only as the meter's holds (offloaded on CPU), what it holds when
    nothing is kept for backward; -1 where not measured so."""
    window = Window(WindowKind.FORWARD, i)
    if i not in trace.offloaded or window not in trace.window_real_start:
        return -1
    return max(0, trace.window_real_peak.get(window, 0) - trace.window_real_start[window])


def region_times(marks: dict[Mark, float], order: list[int], end: float) -> dict[Any, tuple[float, float]]:
    """Forward and backward milliseconds of each region outside the segments (Note [Windows
    outside the segments]), by region key, from the marks of one step (milliseconds from its
    start). A missing mark makes its span 0."""

    def span(a: Mark, b: Mark) -> float:
        return max(marks[b] - marks[a], 0.0) if a in marks and b in marks else 0.0

    fs, fe, bs, be = MarkKind.FORWARD_START, MarkKind.FORWARD_END, MarkKind.BACKWARD_START, MarkKind.BACKWARD_END
    start, stop, loss = Mark(MarkKind.START), Mark(MarkKind.END), Mark(MarkKind.LOSS_BACKWARD)
    marks = {start: 0.0, stop: end, **marks}
    out: dict[Any, tuple[float, float]] = {}
    if not order:
        return out
    out[PREFIX] = (span(start, Mark(fs, order[0])), span(Mark(be, order[0]), stop))
    for pos, i in enumerate(order):
        if pos + 1 < len(order):
            j = order[pos + 1]
            out[after_region(i)] = (span(Mark(fe, i), Mark(fs, j)), span(Mark(be, j), Mark(bs, i)))
        else:
            out[after_region(i)] = (span(Mark(fe, i), loss), span(loss, Mark(bs, i)))
    return out


def _timed_windows(marks: dict[Mark, float], n: int, end: float, fwd: dict[int, float], bwd: dict[int, float]) -> float:
    """Each segment's forward and backward ms from one step's marks, kept if faster; ``end``."""
    for i in range(n):
        fwd[i] = min(fwd.get(i, float("inf")), marks[Mark(MarkKind.FORWARD_END, i)] - marks[Mark(MarkKind.FORWARD_START, i)])
        finish = marks.get(Mark(MarkKind.BACKWARD_END, i), end)  # input without grad: the backward ends with the step
        bwd[i] = min(bwd.get(i, float("inf")), max(finish - marks.get(Mark(MarkKind.BACKWARD_START, i), finish), 0.0))
    return end


def run_timing(
    model: nn.Module, names: list[str], step: Callable[[], torch.Tensor], device: torch.device, *, repeats: int = 2
) -> tuple[dict[int, float], dict[int, float], float, dict[Any, tuple[float, float]]]:
    """Forward and backward milliseconds per segment, of the whole step, and of the regions
    outside the segments (:func:`region_times`), from the fastest of ``repeats`` plain steps
    (``names`` as the trace found them: one per call of a module run several times)."""
    marks: dict[Mark, float] = {}
    handles: list[Any] = []
    order: list[int] = []
    calls: dict[str, int] = {}
    now = _timing_hooks(model, names, device, marks, handles, order, calls)
    fwd: dict[int, float] = {}
    bwd: dict[int, float] = {}
    outside: dict[Any, tuple[float, float]] = {}
    total = float("inf")
    try:
        for _ in range(repeats):  # the fastest of a few steps: the first pays for warm-up
            marks.clear()
            order.clear()
            calls.clear()
            start = now()
            loss = step()
            marks[Mark(MarkKind.LOSS_BACKWARD)] = now()
            loss.backward()
            end = _timed_windows(marks, len(names), now(), fwd, bwd)
            total = min(total, end - start)
            times = region_times({k: v - start for k, v in marks.items()}, order, end - start)
            for key, (f, b) in times.items():
                old = outside.get(key, (float("inf"), float("inf")))
                outside[key] = (min(old[0], f), min(old[1], b))
    finally:
        for h in handles:
            h.remove()
    return fwd, bwd, total, outside


def _timing_hooks(
    model: nn.Module, names: list[str], device: torch.device, marks: dict, handles: list, order: list, calls: dict[str, int],
) -> Callable[[], float]:
    """Hooks that mark each segment's forward and backward bounds in ``marks`` (and its place in
    ``order``; ``calls``: each module's calls so far, Note [A segment per call]); returns the
    clock they read."""
    cuda = device.type == "cuda"
    index = {name: i for i, name in enumerate(names)}
    modules = resolve_modules(model, names)  # canonical names, compiled or not
    running: dict[str, list[int]] = {}

    def now() -> float:
        if cuda:
            torch.cuda.synchronize(device)  # per-segment times need the device idle at each mark
        return time.perf_counter() * 1e3

    def pre(module_name):
        def hook(module, args):
            call = calls.get(module_name, 0)
            calls[module_name] = call + 1
            i = index.get(call_name(module_name, call), -1)  # -1: a call the trace did not see
            running.setdefault(module_name, []).append(i)
            if i >= 0:
                order.append(i)
            marks[Mark(MarkKind.FORWARD_START, i)] = now()
            x = _first_tensor(args)
            if x is not None and x.requires_grad:
                handles.append(x.register_hook(lambda g: marks.__setitem__(Mark(MarkKind.BACKWARD_END, i), now())))

        return hook

    def post(module_name):
        def hook(module, args, output):
            i = running[module_name].pop()
            marks[Mark(MarkKind.FORWARD_END, i)] = now()
            y = _first_tensor(output)
            if y is not None and y.requires_grad:
                handles.append(y.register_hook(lambda g: marks.__setitem__(Mark(MarkKind.BACKWARD_START, i), now())))

        return hook

    for module_name in dict.fromkeys(split_call(name)[0] for name in names):
        handles.append(modules[module_name].register_forward_pre_hook(pre(module_name)))
        handles.append(modules[module_name].register_forward_hook(post(module_name)))
    return now
