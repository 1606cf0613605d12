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
views, which breaks in-place ops on them (ResNet's ``relu_`` after the residual add). The time
between one segment's end and the next one's start (accumulating parameter gradients) belongs
to the earlier segment's window; a segment whose input does not require grad has no end event
and its window runs to the end of the step.
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

from .meter import DeviceMemoryMeter
from .recompute import compute_heavy_ops
from .segments import resolve_modules

__all__ = ["StepTrace", "run_trace", "run_timing"]

PREFIX = -1  # region before the first segment


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor):
            return t
    return None


def _storage(t: torch.Tensor) -> Optional[torch.UntypedStorage]:
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
    window_peak: dict[Any, int] = field(default_factory=dict)
    fwd_start_bytes: dict[int, int] = field(default_factory=dict)
    bwd_start_bytes: dict[int, int] = field(default_factory=dict)
    saved: dict[Any, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    heavy: dict[Any, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    input_key: dict[int, tuple[int, int]] = field(default_factory=dict)
    output_key: dict[int, tuple[int, int]] = field(default_factory=dict)
    grad_bytes: dict[Any, int] = field(default_factory=lambda: defaultdict(int))
    offload_bwd_peak: dict[int, int] = field(default_factory=dict)
    heavy_op_ms: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    all_op_ms: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    est_heavy_ms: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    est_all_ms: dict[Any, float] = field(default_factory=lambda: defaultdict(float))
    static_bytes: int = 0
    peak_bytes: int = 0


class _OpRecorder(TorchDispatchMode):
    def __init__(self, rec: "_Recorder", *, flops_per_ms: float, bytes_per_ms: float) -> None:
        super().__init__()
        self.rec = rec
        self.heavy = compute_heavy_ops()
        self.flops_per_ms = flops_per_ms
        self.bytes_per_ms = bytes_per_ms

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        start = time.perf_counter()
        out = func(*args, **kwargs)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        region = rec.region
        if rec.phase_is_forward and isinstance(region, int) and region >= 0:
            is_heavy = func in self.heavy
            rec.trace.all_op_ms[region] += elapsed_ms
            if is_heavy:
                rec.trace.heavy_op_ms[region] += elapsed_ms
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and (s := _storage(t)) is not None:
                        rec.trace.heavy[region][rec.keys.key(s)] = s.nbytes()
            if rec.fake:
                est = self._estimate_ms(func, args, kwargs, out)
                rec.trace.est_all_ms[region] += est
                if is_heavy:
                    rec.trace.est_heavy_ms[region] += est
        elif rec.fake and rec.phase_is_forward:
            rec.trace.est_all_ms[region] += self._estimate_ms(func, args, kwargs, out)
        elif isinstance(region, tuple) and region[0] == "bwd":
            rec.offload_candidate(region[1], args, kwargs)
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
        self.names = names
        self.index = {name: i for i, name in enumerate(names)}
        self.modules = resolve_modules(model, names)  # canonical names, compiled or not
        self.meter = meter
        self.param_storages = param_storages
        self.fake = fake
        self.min_offload_bytes = 1
        self.trace = StepTrace()
        self.keys = _Storages()
        self.region: Any = PREFIX
        self.window: Any = "prefix_fwd"
        self.phase_is_forward = True
        self.handles: list[Any] = []
        self._exec: list[int] = []  # segment indices in execution order

    # -- windows ------------------------------------------------------------------------
    def switch(self, window: Any) -> None:
        peak = self.meter.peak_bytes
        self.trace.peak_bytes = max(self.trace.peak_bytes, peak)
        self.trace.window_peak[self.window] = max(self.trace.window_peak.get(self.window, 0), peak)
        self.meter.reset_peak()
        self.window = window

    # -- forward hooks ------------------------------------------------------------------
    def pre(self, i: int):
        def hook(module, args):
            if i in self._exec:
                raise ValueError(f"`segments`: segment {self.names[i]!r} ran twice in one step; segments must run once.")
            self._exec.append(i)
            self.switch(("fwd", i))
            self.trace.fwd_start_bytes[i] = self.meter.current_bytes
            self.region = i
            x = _first_tensor(args)
            if x is not None and (s := _storage(x)) is not None:
                self.trace.input_key[i] = (self.keys.key(s), s.nbytes())
                if x.requires_grad:
                    self.handles.append(x.register_hook(self._on_bwd_end(i)))

        return hook

    def post(self, i: int):
        def hook(module, args, output):
            y = _first_tensor(output)
            if y is not None and (s := _storage(y)) is not None:
                self.trace.output_key[i] = (self.keys.key(s), s.nbytes())
                if y.requires_grad:
                    self.handles.append(y.register_hook(self._on_bwd_start(i)))
            self.region = ("after", i)
            if i == len(self.names) - 1:
                self.switch("tail")

        return hook

    # -- backward hooks (Note [Backward windows from tensor hooks]) ---------------------
    def _on_bwd_start(self, i: int):
        def hook(grad):
            self.phase_is_forward = False
            self.switch(("bwd", i))
            self.trace.bwd_start_bytes[i] = self.meter.current_bytes
            self.region = ("bwd", i)

        return hook

    def _on_bwd_end(self, i: int):
        def hook(grad):
            if i == self._exec[0]:
                self.switch("prefix_bwd")
                self.region = "prefix_bwd"

        return hook

    def _on_grad(self, p: torch.Tensor) -> None:
        region = self.region if not self.phase_is_forward else "tail"
        if isinstance(region, tuple) and region[0] == "bwd":
            region = region[1]
        self.trace.grad_bytes[region if isinstance(region, int) else "outside"] += p.grad.untyped_storage().nbytes()

    def offload_candidate(self, i: int, args: Any, kwargs: Any) -> None:
        """Note [Offloaded backward fetches on demand]: with an offloaded segment and no
        prefetch, a saved tensor is on the device only while the op using it runs. So the
        bytes alive now, less this segment's offloadable saved storages this op does not use,
        estimate the offloaded segment's backward at this moment. Boundary storages (input,
        output) are left in: a neighbour may hold them."""
        needed = set()
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and (s := _storage(t)) is not None:
                needed.add(self.keys.key(s))
        boundary = {self.trace.input_key.get(i, (None,))[0], self.trace.output_key.get(i, (None,))[0]}
        drop = 0
        for key, nbytes in self.trace.saved.get(i, {}).items():
            if key in needed or key in boundary or nbytes < self.min_offload_bytes:
                continue
            ref = self.keys.by_key.get(key)
            if ref is not None and ref() is not None:
                drop += nbytes
        level = self.meter.current_bytes - drop
        if level > self.trace.offload_bwd_peak.get(i, 0):
            self.trace.offload_bwd_peak[i] = level

    # -- saved tensors ------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = _storage(t)
        if s is not None and id(s) not in self.param_storages and self.phase_is_forward:
            self.trace.saved[self.region][self.keys.key(s)] = s.nbytes()
        return t

    def install(self, params: list[torch.Tensor]) -> None:
        for name in self.names:
            module = self.modules[name]
            i = self.index[name]
            self.handles.append(module.register_forward_pre_hook(self.pre(i)))
            self.handles.append(module.register_forward_hook(self.post(i)))
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
    """Run ``step`` (forward, loss, backward) once with every window measured."""
    meter = _FakeMeter(device) if fake else DeviceMemoryMeter(device)
    param_storages = {id(_storage(t)) for t in static if _storage(t) is not None}
    rec = _Recorder(model, names, meter, param_storages, fake)
    rec.min_offload_bytes = max(min_offload_bytes, 1)
    rec.install(params)
    ops = _OpRecorder(rec, flops_per_ms=flops_per_ms, bytes_per_ms=bytes_per_ms)
    try:
        with meter:
            meter.track(static)
            # Hold no reference: the step may free some of these (``zero_grad`` frees the last
            # step's gradients), as Note [The snapshot must not keep gradients alive] explains.
            static.clear()
            rec.trace.static_bytes = meter.current_bytes
            meter.reset_peak()
            with ops, torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
                loss = step()
                rec.phase_is_forward = False
                rec.region = "tail_bwd"
                loss.backward()
            rec.switch("end")
    finally:
        rec.remove()
    trace = rec.trace
    missing = [names[i] for i in range(len(names)) if i not in rec._exec]
    if missing:
        raise ValueError(f"`segments` {missing} did not run in the profiled step.")
    trace.order = [names[i] for i in rec._exec]
    return trace


def run_timing(model: nn.Module, names: list[str], step: Callable[[], torch.Tensor], device: torch.device, *, repeats: int = 2) -> tuple[dict[int, float], dict[int, float], float]:
    """Forward and backward milliseconds per segment, and of the whole step, from one plain step."""
    cuda = device.type == "cuda"
    index = {name: i for i, name in enumerate(names)}
    modules = resolve_modules(model, names)  # canonical names, compiled or not
    marks: dict[Any, float] = {}
    handles: list[Any] = []

    def now() -> float:
        if cuda:
            torch.cuda.synchronize(device)  # per-segment times need the device idle at each mark
        return time.perf_counter() * 1e3

    def pre(i):
        def hook(module, args):
            marks[("fs", i)] = now()
            x = _first_tensor(args)
            if x is not None and x.requires_grad:
                handles.append(x.register_hook(lambda g: marks.__setitem__(("be", i), now())))

        return hook

    def post(i):
        def hook(module, args, output):
            marks[("fe", i)] = now()
            y = _first_tensor(output)
            if y is not None and y.requires_grad:
                handles.append(y.register_hook(lambda g: marks.__setitem__(("bs", i), now())))

        return hook

    for name in names:
        handles.append(modules[name].register_forward_pre_hook(pre(index[name])))
        handles.append(modules[name].register_forward_hook(post(index[name])))
    fwd: dict[int, float] = {}
    bwd: dict[int, float] = {}
    total = float("inf")
    try:
        for _ in range(repeats):  # the fastest of a few steps: the first pays for warm-up
            marks.clear()
            start = now()
            step().backward()
            end = now()
            total = min(total, end - start)
            for i in range(len(names)):
                fwd[i] = min(fwd.get(i, float("inf")), marks[("fe", i)] - marks[("fs", i)])
                finish = marks.get(("be", i), end)  # input without grad: the backward ends with the step
                bwd[i] = min(bwd.get(i, float("inf")), max(finish - marks.get(("bs", i), finish), 0.0))
    finally:
        for h in handles:
            h.remove()
    return fwd, bwd, total
