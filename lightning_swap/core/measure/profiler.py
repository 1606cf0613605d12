"""The profiler: one measured training step becomes a frozen :class:`ModelProfile`.

The step runs with every segment kept, instrumented as :mod:`.trace` describes. Memory can be
measured without running the model's arithmetic: with ``fake=True`` the parameters, buffers
and batch become ``FakeTensor``s (``torch._subclasses.fake_tensor.FakeTensorMode``), the meter
counts their (meta) storages, and a ResNet-50 step at batch 128 takes about a second on a CPU.

Note [Fake-mode times are estimates]: fake tensors do no arithmetic, so a fake profile's
times are a roofline guess per op (FLOPs of matmul/convolution at a measured matmul rate, plus
bytes touched at a measured copy rate; backward taken as twice the forward). They rank plans
sensibly but are not measurements; a real profile times one plain step per segment.

Note [Batch scaling]: every byte count is taken as piecewise linear in the batch size. The
profile is measured at the given batch and, in fake mode (cheap), at twice and at eight times
that batch; between two of these points a field is on the line through them, beyond the last
on the line through the last two (:meth:`ModelProfile.at_batch`). One line through the first
two is not enough: a window's peak is the largest of several moments, some fixed (parameter
gradients arriving) and some growing with the batch (activations), so it is convex in the
batch and bends where the growing one takes over. DenseNet-121's third dense block at 32 px
had its backward window at 89.4 / 104.3 MiB at batch 8 / 16, whose line gives 159.8 MiB at
batch 46, measured 176.1. Times are taken as proportional to the batch size.

The profile leaves the model as it found it: buffers (BatchNorm statistics), gradients and
the RNG state are restored.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
import time
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from ..engine.meter import host_allocation, mark_host
from ..engine.recompute import compute_heavy_ops
from ..config import DEFAULT_MIN_OFFLOAD_BYTES, check_min_offload_bytes
from ..segments import PREFIX_REGION, SegmentSpec, find_segments, region_after, resolve_modules, split_call
from ..sharded import is_sharded, like_shard, world_size
from ..tensors import infer_batch_size, local_tensor, loss_of, storage_bytes
from .model_profile import _SCALED_INT_FIELDS, _SCALED_MS_FIELDS, ModelProfile, SegmentProfile, refused_actions
from .trace import PREFIX, StepTrace, Window, WindowKind, after_region, is_segment, released_working, run_timing, run_trace

__all__ = ["DeviceAssumption", "ModelProfile", "SegmentProfile", "measure_bandwidth", "profile"]

log = logging.getLogger(__name__)

StepFn = Callable[[nn.Module, Any], Any]


# -- bandwidth -----------------------------------------------------------------------------
_BANDWIDTH: dict[str, tuple[float, float]] = {}


def measure_bandwidth(device: torch.device | str, *, nbytes: int = 32 << 20) -> tuple[float, float]:
    """Device-to-host and host-to-device bytes per millisecond (cached per device).

    On CUDA with pinned host memory, as the offload engine copies; on CPU a memcpy between two
    buffers, which is what offloading costs there.
    """
    device = torch.device(device)
    key = str(device)
    if key in _BANDWIDTH:
        return _BANDWIDTH[key]
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def rate(dst: torch.Tensor, src: torch.Tensor) -> float:
        dst.copy_(src, non_blocking=True)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # time the copies alone
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        return nbytes / max(best * 1e3, 1e-6)

    result = (rate(host, dev), rate(dev, host))
    _BANDWIDTH[key] = result
    return result


def _compute_rates(device: torch.device) -> tuple[float, float]:
    """A matmul's FLOPs and a copy's bytes per ms on ``device`` (for fake-mode estimates)."""
    key = f"rates:{device}"
    if key in _BANDWIDTH:
        return _BANDWIDTH[key]
    n = 256
    a = torch.full((n, n), 0.5, device=device)  # not randn: profiling must not move the RNG
    a @ a
    best = float("inf")
    for _ in range(5):  # the fastest of a few: a shared machine's other load is not the device's rate
        start = time.perf_counter()
        for _ in range(4):
            a @ a
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    flops_per_ms = 4 * 2 * n**3 / max(best * 1e3, 1e-6)
    _BANDWIDTH[key] = (flops_per_ms, measure_bandwidth(device)[0])
    return _BANDWIDTH[key]


# -- the step ------------------------------------------------------------------------------
def _default_step(model: nn.Module, batch: Any) -> Any:
    out = model(batch)
    return out


def _resize(batch: Any, old: int, new: int) -> Any:
    """The batch with every tensor whose first dimension is ``old`` repeated to ``new`` rows."""

    def grow(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == old:
            reps = -(-new // old)
            return t.repeat(reps, *([1] * (t.dim() - 1)))[:new]
        return t

    return tree_map(grow, batch)


@dataclass(frozen=True)
class _Element:
    """One element of the chain as the trace saw it: a segment (``key`` its index) or a region
    outside the segments (``PREFIX``, ``after_region(i)``), its windows and its boundaries."""

    key: Any
    name: str
    fwd_windows: tuple[Window, ...]
    bwd_windows: tuple[Window, ...]
    inp: tuple  # (storage key, bytes) of its input
    out: tuple


def _chain_elements(trace: StepTrace, names: list[str], order: list[int]) -> list[_Element]:
    """Note [Regions outside the segments]: the segments and, between them, the regions that
    saved something for backward; a region that saved nothing has its windows folded into its
    neighbours' (the segment before it in forward, the one after it in backward), and the
    prefix's and tail's into the profile's fixed windows."""

    def size(pair: Any) -> tuple:
        return pair if pair is not None else (None, 0)

    elements: list[_Element] = []
    tail_ok = trace.turnaround_bytes >= 0
    prefix = trace.saved.get(PREFIX)
    if prefix and order:
        windows = (Window(WindowKind.PREFIX_FORWARD),), (Window(WindowKind.PREFIX_BACKWARD),)
        elements.append(_Element(PREFIX, PREFIX_REGION, *windows, (None, 0), size(trace.input_key.get(order[0]))))
    for pos, i in enumerate(order):
        nxt = order[pos + 1] if pos + 1 < len(order) else None
        windows = (Window(WindowKind.FORWARD, i),), (Window(WindowKind.BACKWARD, i),)
        own = _Element(i, names[i], *windows, size(trace.input_key.get(i)), size(trace.output_key.get(i)))
        after = after_region(i)  # the region's key is its forward window
        planned = bool(trace.saved.get(after)) and (nxt is not None or tail_ok)
        if not planned and nxt is not None:  # folded: forward into this segment, backward into the next
            own = dataclasses.replace(own, fwd_windows=own.fwd_windows + (after,))
        elements.append(own)
        if planned:
            out = size(trace.input_key.get(nxt)) if nxt is not None else (None, 0)
            name = region_after([names[j] for j in order], names[i])
            elements.append(_Element(after, name, (after,), (Window(WindowKind.AFTER_BACKWARD, i),), size(trace.output_key.get(i)), out))
    planned_keys = {e.key for e in elements}
    for pos, i in enumerate(order[1:], start=1):  # a folded region's backward: into the next segment's window
        if after_region(order[pos - 1]) not in planned_keys:
            e = next(e for e in elements if e.key == i)
            folded = Window(WindowKind.AFTER_BACKWARD, order[pos - 1])
            elements[elements.index(e)] = dataclasses.replace(e, bwd_windows=e.bwd_windows + (folded,))
    return elements


def _window_peak(trace: StepTrace, windows: tuple[Window, ...]) -> tuple[int, int]:
    """The peak over ``windows`` (consecutive in time) and the bytes alive when the first began."""
    peak = max((trace.window_peak.get(w, 0) for w in windows), default=0)
    start = trace.window_start.get(windows[0], peak)
    # A window after a segment's forward counts only the levels after its opening (Note [The
    # tail opens holding the last input] in ``trace.py``): the opening is part of it too.
    return max(peak, start), start


def _offload_savings(trace: StepTrace, key: Any, bwd_peak: int) -> dict[str, int]:
    """Note [Offloaded backward fetches on demand] in ``trace.py``: the estimates of an
    offloaded element's backward peak, as savings below the first (the storages held from their
    first unpack to their last, the boundaries kept)."""
    held = min(bwd_peak, trace.offload_bwd_peak.get(key, bwd_peak))

    def below(estimates: dict) -> int:
        return max(0, held - min(bwd_peak, estimates.get(key, bwd_peak)))

    tensor = below(trace.tensor_bwd_peak)
    return dict(
        offload_input_saving_bytes=below(trace.offload_bwd_peak_in), tensor_saving_bytes=tensor,
        tensor_input_saving_bytes=max(0, below(trace.tensor_bwd_peak_in) - tensor),
        tensor_output_saving_bytes=max(0, below(trace.tensor_bwd_peak_out) - tensor),
        tensor_both_saving_bytes=max(0, below(trace.tensor_bwd_peak_both) - tensor),
    )


def _call_ms(ops: dict[str, list]) -> dict[str, float]:
    """Each call's milliseconds (Note [Selective saves per call]): an op's measured time, summed
    over its calls in the segment, shared among them as their estimates (FLOPs and bytes) are,
    where the trace has them: one call's own time, a fraction of a millisecond on a busy machine,
    is mostly noise, and two matmuls of equal cost per byte would otherwise be ranked by it."""
    kinds: dict[str, list[float]] = {}
    for call, (ms, _, *est) in ops.items():
        total = kinds.setdefault(split_call(call)[0], [0.0, 0.0, 1.0])
        total[0] += ms
        total[1] += est[0] if est else 0.0
        total[2] = total[2] if est and est[0] > 0 else 0.0
    out = {}
    for call, (ms, _, *est) in ops.items():
        measured, estimated, usable = kinds[split_call(call)[0]]
        out[call] = measured * est[0] / estimated if usable and estimated > 0 else ms
    return out


def selective_choice(
    ops: dict[str, list], boundary: set, mutated: frozenset = frozenset(), saved: Optional[Iterable[int]] = None,
    in_graph: bool = False,
) -> tuple[tuple[str, ...], dict[int, int], float]:
    """Note [Which ops selective recomputation saves]: ``SELECTIVE`` checkpoints a segment but
    saves the outputs of some of its ops, so that recomputing it costs less; which ops is decided
    from the segment's own measured forward (``ops``: per op, its milliseconds and the storages
    its outputs made; a fake profile's are estimates), as the min-cut partitioner of
    ``torch.compile`` decides from its cost estimates, and not by a fixed list of op kinds.
    Each op's outputs inside the segment (its boundaries are kept or recomputed with it anyway)
    cost their bytes kept and save its milliseconds of recomputation; an op is saved when it saves
    at least the segment's average milliseconds per byte (the greedy knapsack's better half: what
    is kept buys more recomputation than average, the rest is cheap per byte, as norms and
    activations are). An op whose output something later changes in place (``mutated``: a ReLU
    after a norm) is never saved: selective checkpointing refuses a saved tensor that changed.
    Returns the ops saved (sorted), the storages their outputs made, and their share of the
    forward's time.

    Note [Selective saves per call]: the trace names each call of an op apart (``op#k``, its
    ``k``-th call in the segment's forward), so two matmuls of one block are two choices, and
    the policy counts calls as the trace did. ``saved`` (the storages the segment saves for
    backward when kept) rules out the calls after the last one that made any of them: the
    recomputation stops there (checkpoint's early stop), so their outputs, cached, would be
    bytes held for nothing (a block's last projection, whose output only feeds the residual add:
    2 MiB a block on the GPT of ``examples/``).

    Note [Selective under compile chooses compute-heavy calls]: a segment recomputed inside its
    compiled graph (``in_graph``: Note [Recomputation inside the compiled graph] in
    ``compiled.py``) saves every compute-heavy call's output (matmuls, convolutions, attention)
    and nothing else. Inductor fuses the recomputation of pointwise ops and norms into the
    backward's kernels, so their eager milliseconds, measured here, are not what recomputing
    them costs there (every block of the GPT of ``benchmarks/compile_budget.py`` on selective
    adds 0-6 ms compiled, its eager pricing 24), and eager timings of one step are noisy enough
    to make a GELU look worth saving in one process and not in the next. That is the
    partitioner's own default, which saves what it cannot fuse cheaply: the plan and the
    compiler then agree on what a selective block saves, and the lighter choices (Note [Lighter
    selective]) drop heavy calls from there, priced by their measured times."""
    call_ms = _call_ms(ops)
    total_ms = sum(call_ms.values())
    candidates = _selective_candidates(ops, call_ms, boundary, mutated, saved)
    if in_graph:
        heavy_names = {str(op) for op in compute_heavy_ops()}
        candidates = {call: c for call, c in candidates.items() if split_call(call)[0] in heavy_names}
    if not candidates:
        return (), {}, 0.0
    density = 0.0 if in_graph else sum(ms for ms, _ in candidates.values()) / sum(b for _, b in candidates.values())
    chosen = tuple(sorted(op for op, (ms, nbytes) in candidates.items() if ms >= density * nbytes))
    heavy = {k: b for op in chosen for k, b in ops[op][1].items()}
    return chosen, heavy, (sum(call_ms[op] for op in chosen) / total_ms if total_ms > 0 else 0.0)


def _selective_candidates(
    ops: dict[str, list], call_ms: dict[str, float], boundary: set, mutated: frozenset, saved: Optional[Iterable[int]],
) -> dict[str, tuple[float, int]]:
    """The calls selective may save (Note [Which ops selective recomputation saves]): (ms, bytes)."""
    order = list(ops)
    if saved is not None:
        saved = set(saved)  # the output too, where an op of the segment saves it: recomputed then
        last = max((i for i, op in enumerate(order) if saved & ops[op][1].keys()), default=-1)
        order = order[: last + 1]
    candidates = {}
    for op in order:
        outputs = ops[op][1]
        nbytes = _own_bytes(outputs, boundary)
        if nbytes > 0 and not mutated & outputs.keys():
            candidates[op] = (call_ms[op], nbytes)
    return candidates


def _own_bytes(outputs: dict[int, int], boundary: set) -> int:
    """Bytes of the storages a call made inside its segment (its boundaries are kept or
    recomputed with it anyway)."""
    return sum(b for k, b in outputs.items() if k not in boundary)


#: At most this many lighter choices per segment (Note [Lighter selective]).
MAX_LIGHTER_CHOICES = 6


def lighter_choices(
    ops: dict[str, list], chosen: tuple[str, ...], boundary: set, saved: Iterable[int],
) -> tuple[tuple[tuple[str, ...], float, float, float], ...]:
    """Note [Lighter selective]: between ``SELECTIVE`` (the calls :func:`selective_choice` keeps)
    and ``RECOMPUTE`` (none kept) lie the plans that keep some of them; the min-cut partitioner
    walks that line op by op. Here the candidates are the chosen calls less one of them (the
    finest steps in bytes) and less the cheapest per byte, cumulatively (what is cheapest to
    recompute for the bytes it frees, down to one call kept), the fastest first (most forward
    time still saved), at most :data:`MAX_LIGHTER_CHOICES`; each the ops it keeps and its bytes
    kept, bytes not otherwise saved, and forward milliseconds saved, as fractions of the full
    choice's (so they scale with the batch as the full choice does: Note [Batch scaling]). The
    planner takes one where it fits and whole recomputation would be slower (``solver.py``)."""
    saved = set(saved)
    call_ms = _call_ms(ops)

    def fields(kept: tuple[str, ...]) -> tuple[int, int, float]:
        heavy = {k: b for op in kept for k, b in ops[op][1].items() if k not in boundary}
        return sum(heavy.values()), sum(b for k, b in heavy.items() if k not in saved), sum(call_ms[op] for op in kept)

    full = fields(chosen)
    if len(chosen) < 2 or full[0] <= 0:
        return ()
    density = {op: call_ms[op] / max(_own_bytes(ops[op][1], boundary), 1) for op in chosen}
    order = sorted(chosen, key=lambda op: (density[op], op))
    kept_sets = {tuple(sorted(order[drop:])) for drop in range(1, len(chosen))}
    kept_sets |= {tuple(op for op in chosen if op != dropped) for dropped in chosen}
    choices = []
    for kept in kept_sets:
        nbytes, unsaved, ms = fields(kept)
        if nbytes < full[0]:
            choices.append((kept, nbytes / full[0], unsaved / full[1] if full[1] else 0.0, ms / full[2] if full[2] else 0.0))
    choices.sort(key=lambda v: (-v[3], v[1], v[0]))
    if len(choices) > MAX_LIGHTER_CHOICES:  # the lightest stays: the planner's first test (solver.py)
        lightest = min(choices, key=lambda v: (v[1], v[0]))
        choices = [v for v in choices[:MAX_LIGHTER_CHOICES - 1] if v != lightest] + [lightest]
    return tuple(choices)


def _element_profile(
    trace: StepTrace, e: _Element, prev: Optional[_Element], nxt: Optional[_Element], *, fwd_ms: float, bwd_ms: float, heavy_ms: float,
    min_offload_bytes: int,
) -> SegmentProfile:
    saved = trace.saved.get(e.key, {})
    heavy = trace.heavy.get(e.key, {}) if is_segment(e.key) else {}
    (in_key, in_bytes), (out_key, out_bytes) = e.inp, e.out
    if out_key == in_key:  # the segment returned (a view of) its input: no new storage
        out_bytes = 0
    boundary = {in_key, out_key}
    save_ops, lighter = None, ()
    if is_segment(e.key) and trace.ops.get(e.key):  # Note [Which ops selective recomputation saves]
        save_ops, heavy, share = selective_choice(trace.ops[e.key], boundary, frozenset(trace.mutated), saved,
                                                  in_graph=e.key in trace.in_graph)
        lighter = lighter_choices(trace.ops[e.key], save_ops, boundary, saved)
        heavy_ms = fwd_ms * share
    internal = {k: b for k, b in saved.items() if k not in boundary}
    heavy_internal = {k: b for k, b in heavy.items() if k not in boundary}
    input_from_previous = prev is not None and in_key is not None and prev.out[0] == in_key
    output_to_next = nxt is not None and out_key is not None and nxt.inp[0] == out_key

    def held_elsewhere(key: Any, mine: set) -> bool:
        return key is not None and any(key in s for region, s in trace.saved.items() if region not in mine)

    fwd_peak, fwd_start = _window_peak(trace, e.fwd_windows)
    bwd_peak, bwd_start = _window_peak(trace, e.bwd_windows)
    small = max(min_offload_bytes, 1)
    return SegmentProfile(
        name=e.name,
        forward_ms=fwd_ms,
        backward_ms=bwd_ms,
        heavy_forward_ms=min(heavy_ms, fwd_ms),
        input_bytes=in_bytes,
        output_bytes=out_bytes,
        saved_bytes=sum(saved.values()),
        internal_saved_bytes=sum(internal.values()),
        internal_small_bytes=sum(b for b in internal.values() if b < small),
        heavy_bytes=sum(heavy_internal.values()),
        heavy_unsaved_bytes=sum(b for k, b in heavy_internal.items() if k not in saved),
        offload_bytes=sum(b for b in saved.values() if b >= small),
        largest_offload_bytes=max((b for b in saved.values() if b >= small), default=0),
        gradient_bytes=trace.grad_bytes.get(e.key, 0) if is_segment(e.key) else 0,
        forward_working_bytes=max(0, fwd_peak - fwd_start),
        backward_working_bytes=max(0, bwd_peak - bwd_start),
        forward_peak_bytes=fwd_peak,
        backward_peak_bytes=bwd_peak,
        offload_backward_peak_bytes=min(bwd_peak, trace.offload_bwd_peak.get(e.key, bwd_peak)),
        **_offload_savings(trace, e.key, bwd_peak),
        selective_ops=save_ops,
        selective_variants=lighter,
        input_saved=in_key in saved,
        input_small=in_bytes < small,
        input_from_previous=input_from_previous,
        input_held_elsewhere=held_elsewhere(in_key, {e.key, prev.key} if input_from_previous else {e.key}),
        output_saved=out_key is not None and out_key in saved and out_bytes > 0,
        output_small=out_bytes < small,
        output_heavy=out_key is not None and out_key in heavy and out_bytes > 0,
        output_held_elsewhere=out_bytes > 0 and held_elsewhere(out_key, {e.key, nxt.key} if output_to_next else {e.key}),
        gathered_parameter_bytes=trace.gathered_bytes.get(e.key, 0),
    )


class _Snapshot:
    """Restores buffers, gradients and RNG after profiling steps.

    Note [The snapshot must not keep gradients alive]: a training loop's ``zero_grad`` between
    forward and backward frees the last step's gradients, and the profiled step must see that
    drop as the real one does. So the gradients are copied to host memory (which the meter
    does not count) instead of being referenced, and rebuilt on the device afterwards.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device

    def __enter__(self) -> "_Snapshot":
        with torch.no_grad(), host_allocation():
            self.buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
            self.grads = []
            for p in self.model.parameters():
                saved = None
                if p.grad is not None:  # a shard's local tensor (Note [Sharded state is local])
                    saved = local_tensor(p.grad).detach().to("cpu", copy=True)
                    mark_host(saved)
                    saved = (saved, like_shard(p.grad))
                self.grads.append((p, saved))
        self.rng = torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else [])
        self.rng.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.rng.__exit__(*exc)
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
            for p, saved in self.grads:
                p.grad = None if saved is None else saved[1](saved[0].to(local_tensor(p).device, copy=True))


def _trace_step(model, names, batch, step_fn, device, track, fake, rates, min_offload_bytes) -> StepTrace:
    params = list(model.parameters())
    if not fake:
        static = [*params, *model.buffers(), *(p.grad for p in params if p.grad is not None), *track]
        static += [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
        return run_trace(
            model, names, lambda: loss_of(step_fn(model, batch)), device=device, static=static, params=params,
            fake=False, min_offload_bytes=min_offload_bytes,
        )
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        mapping = {n: mode.from_tensor(p).requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
        mapping.update({n: mode.from_tensor(b) for n, b in model.named_buffers()})
        fake_params = [mapping[n] for n, _ in model.named_parameters()]
        for fp, (_, p) in zip(fake_params, model.named_parameters()):
            if p.grad is not None:
                fp.grad = mode.from_tensor(p.grad)
        fake_batch = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)
        fake_track = [mode.from_tensor(t) for t in track]
        static = [*mapping.values(), *(p.grad for p in fake_params if p.grad is not None), *fake_track]
        static += [t for t in tree_leaves(fake_batch) if isinstance(t, torch.Tensor)]
        with _reparametrize_module(model, mapping, tie_weights=True):
            return run_trace(
                model, names, lambda: loss_of(step_fn(model, fake_batch)), device=device, static=static,
                params=fake_params, fake=True, min_offload_bytes=min_offload_bytes, flops_per_ms=rates[0], bytes_per_ms=rates[1],
            )


def _build(model, names, batch, batch_size, step_fn, device, track, fake, min_offload_bytes, rates) -> ModelProfile:
    with _Snapshot(model, device):
        trace = _trace_step(model, names, batch, step_fn, device, track, fake, rates, min_offload_bytes)
        names = trace.names  # one per call of a module run several times (Note [A segment per call])
        if not fake:
            fwd, bwd, step_ms, regions = run_timing(model, names, lambda: loss_of(step_fn(model, batch)), device)
            fwd = {**fwd, **{k: v[0] for k, v in regions.items()}}
            bwd = {**bwd, **{k: v[1] for k, v in regions.items()}}
    n = len(names)
    if fake:
        fwd = {i: trace.est_all_ms.get(i, 0.0) for i in range(n)}
        outside = sum(v for k, v in trace.est_all_ms.items() if not is_segment(k))
        step_ms = 3 * (sum(fwd.values()) + outside)
        fwd.update({k: v for k, v in trace.est_all_ms.items() if not is_segment(k)})
        bwd = {k: 2 * v for k, v in fwd.items()}
        heavy = {i: trace.est_heavy_ms.get(i, 0.0) for i in range(n)}
    else:
        heavy = {i: fwd[i] * trace.heavy_op_ms.get(i, 0.0) / max(trace.all_op_ms.get(i, 0.0), 1e-9) for i in range(n)}
    measured = {i: (None, None, released_working(trace, i), "", True) for i in range(n)}
    return assemble(trace, model, names, batch_size=batch_size, device=device, fake=fake, min_offload_bytes=min_offload_bytes,
                    fwd=fwd, bwd=bwd, heavy=heavy, step_ms=step_ms, measured=measured)


def _chain_profiles(
    trace: StepTrace, elements: list[_Element], *, fwd: dict[Any, float], bwd: dict[Any, float], heavy: dict[int, float],
    min_offload_bytes: int, measured: dict[int, tuple[Optional[float], Optional[float], int, str, bool]],
) -> list[tuple[_Element, SegmentProfile]]:
    """Each element of the chain with its profile (Note [Regions outside the segments]); a
    segment's with what was measured of its actions and refused (Note [Refused actions])."""
    profiles = []
    for pos, e in enumerate(elements):
        prev = elements[pos - 1] if pos else None
        nxt = elements[pos + 1] if pos + 1 < len(elements) else None
        p = _element_profile(
            trace, e, prev, nxt, fwd_ms=fwd.get(e.key, 0.0), bwd_ms=bwd.get(e.key, 0.0), heavy_ms=heavy.get(e.key, 0.0),
            min_offload_bytes=min_offload_bytes,
        )
        if is_segment(e.key):
            m = measured.get(e.key, (None, None, -1, "", True))
            p = dataclasses.replace(
                p, recompute_ms=m[0], selective_ms=m[1], released_forward_working_bytes=m[2],
                refused=refused_actions(m[3]) if m[3] else (), refusal=m[3], selective_floor=m[4],
            )
        profiles.append((e, p))
    return profiles


def _saved_bytes(trace: StepTrace, regions: Callable[[Any], bool]) -> int:
    """Bytes of the storages saved for backward in the ``regions`` chosen, each storage once."""
    return sum({key: nbytes for region, saved in trace.saved.items() if regions(region) for key, nbytes in saved.items()}.values())


def assemble(
    trace: StepTrace, model: nn.Module, names: list[str], *, batch_size: int, device: torch.device, fake: bool, min_offload_bytes: int,
    fwd: dict[Any, float], bwd: dict[Any, float], heavy: dict[int, float], step_ms: float,
    measured: Optional[dict[int, tuple[Optional[float], Optional[float], int, str, bool]]] = None,
) -> ModelProfile:
    """A :class:`ModelProfile` from a step's trace and its times (``fwd`` / ``bwd``: per segment
    index, and per region outside the segments, ``PREFIX`` or ``after_region(i)``, where known;
    ``measured``: per segment index the recompute and selective costs, the released forward's
    working bytes, the refusal and whether selective's time is floored, where measured)."""
    order = [names.index(name) for name in trace.order]
    elements = _chain_elements(trace, names, order)
    profiles = _chain_profiles(trace, elements, fwd=fwd, bwd=bwd, heavy=heavy, min_offload_bytes=min_offload_bytes, measured=measured or {})
    segments = tuple(p for e, p in profiles if is_segment(e.key))
    outside, outside_after, seen = [], [], -1
    for e, p in profiles:
        if is_segment(e.key):
            seen += 1
        else:
            outside.append(p)
            outside_after.append(seen)
    # What no element's forward or backward accounts for (launches, the optimizer), half each side.
    elements_ms = sum(p.forward_ms + p.backward_ms for _, p in profiles)
    outside_ms = max(step_ms - elements_ms, 0.0)
    d2h, h2d = measure_bandwidth(device)
    last = after_region(order[-1]) if order else None
    planned_tail = any(e.key == last for e in elements)
    tail_windows = (WindowKind.AFTER, WindowKind.AFTER_BACKWARD)
    tail_rest = max([0] + [trace.window_peak.get(Window(kind, order[-1]), 0) for kind in tail_windows if order])
    tail_peak = trace.turnaround_bytes if planned_tail else max(tail_rest, trace.window_start.get(last, 0))
    # Note [The tail opens holding the last input] in ``trace.py``: the opening level apart (CPU);
    # planned, the rest is its region's forward window's.
    tail_start = trace.window_start.get(last, -1) if last is not None and device.type != "cuda" else -1
    tail_rest = -1 if tail_start < 0 else trace.window_peak.get(last, 0) if planned_tail else tail_rest
    return ModelProfile(
        segments=segments,
        batch_size=batch_size,
        device_type=device.type,
        fake=fake,
        min_offload_bytes=min_offload_bytes,
        static_bytes=trace.static_bytes,
        parameter_bytes=storage_bytes(model.parameters()),  # distinct storages: tied and shared weights once
        gradient_bytes=sum(trace.grad_bytes.values()),
        prefix_forward_peak_bytes=trace.window_peak.get(Window(WindowKind.PREFIX_FORWARD), 0),
        prefix_backward_peak_bytes=trace.window_peak.get(Window(WindowKind.PREFIX_BACKWARD), 0),
        tail_peak_bytes=tail_peak,
        tail_start_bytes=tail_start,
        tail_rest_bytes=tail_rest,
        peak_bytes=trace.peak_bytes,
        prefix_ms=outside_ms / 2,
        tail_ms=outside_ms / 2,
        step_ms=step_ms,
        d2h_bytes_per_ms=d2h,
        h2d_bytes_per_ms=h2d,
        optimizer_peak_bytes=trace.window_peak.get(Window(WindowKind.OPTIMIZER), 0),
        outside=tuple(outside),
        outside_after=tuple(outside_after),
        world_size=world_size(model),
        total_saved_bytes=_saved_bytes(trace, lambda region: True),
        segment_saved_bytes=_saved_bytes(trace, is_segment),
    )


def profile(
    model: nn.Module,
    batch: Any,
    *,
    step_fn: Optional[StepFn] = None,
    batch_size: Optional[int] = None,
    segments: SegmentSpec = None,
    track: Iterable[torch.Tensor] = (),
    fake: bool = False,
    scale: bool = True,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    device: Optional[torch.device | str] = None,
    assume: Optional["DeviceAssumption"] = None,
) -> ModelProfile:
    """Measure one training step of ``model`` on ``batch`` with every segment kept.

    ``step_fn(model, batch)`` returns the loss (a tensor, or a dict with ``"loss"``); by
    default ``model(batch)`` is summed. ``track`` are tensors alive during the step that the
    model does not own (optimizer state), counted as the runtime's ``begin_step(track=)`` does.
    ``fake=True`` measures memory without arithmetic (Note [Fake-mode times are estimates]);
    ``scale=True`` also fake-measures twice the batch so :meth:`ModelProfile.at_batch` works.
    ``min_offload_bytes`` must match the runtime's. ``assume`` (with ``fake=True``): the times
    estimated for another device's rates (:class:`DeviceAssumption`), a prediction for a device
    that is not here. A sharded (FSDP) model is profiled for real only, on every process at once
    (each runs the same collectives): Note [Observe every rank] in ``observe.py``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"`model` must be an nn.Module; got {type(model).__name__}.")
    min_offload_bytes = check_min_offload_bytes(min_offload_bytes)
    if batch_size is None:
        batch_size = infer_batch_size(batch)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"`batch_size` must be an int > 0; got {batch_size!r}.")
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    names = find_segments(model, segments)
    _check_fake(model, fake)
    step_fn = step_fn or _default_step
    track = [t for t in tree_leaves(list(track)) if isinstance(t, torch.Tensor)]
    rates = _compute_rates(device) if fake or scale else (1.0, 1.0)
    if assume is not None:
        if not fake:
            raise ValueError("`assume` estimates another device's times: it needs fake=True.")
        rates = (assume.flops_per_ms, assume.memory_bytes_per_ms)
    start = time.perf_counter()

    def build(b: Any, size: int, fake_mode: bool) -> ModelProfile:
        return _build(model, names, b, size, step_fn, device, track, fake_mode, min_offload_bytes, rates)

    result = _try_fake(lambda: build(batch, batch_size, True), lambda: build(batch, batch_size, False)) if fake else build(batch, batch_size, False)
    if scale:
        result = dataclasses.replace(result, reference=_references(result, batch, batch_size, build, sharded=is_sharded(model)))
    if assume is not None:
        result = assume.applied(result)
    log.debug("profiled %d segments at batch %d in %.2f s (fake=%s)", len(names), batch_size, time.perf_counter() - start, fake)
    return result


@dataclass(frozen=True)
class DeviceAssumption:
    """The rates of a device that is not here, for a fake profile's time estimates (Note
    [Fake-mode times are estimates]): a prediction, never a measurement."""

    device_type: str
    flops_per_ms: float
    memory_bytes_per_ms: float
    d2h_bytes_per_ms: float
    h2d_bytes_per_ms: float

    def applied(self, profile: ModelProfile) -> ModelProfile:
        reference = self.applied(profile.reference) if profile.reference is not None else None
        return dataclasses.replace(
            profile, device_type=self.device_type, d2h_bytes_per_ms=self.d2h_bytes_per_ms, h2d_bytes_per_ms=self.h2d_bytes_per_ms,
            reference=reference,
        )


def _references(
    result: ModelProfile, batch: Any, batch_size: int, build: Callable[[Any, int, bool], ModelProfile], *, sharded: bool = False,
) -> ModelProfile:
    """The profile at twice the batch, itself referring to the profile at eight times it, where
    fake mode can measure them (Note [Batch scaling]); fake slopes are anchored at a real
    profile; without fake mode (or ``sharded``: never fake), one real point at twice the batch."""
    big = 2 * batch_size
    bigger = _resize(batch, batch_size, big)
    fake_big = None if sharded else _try_fake(lambda: build(bigger, big, True), lambda: None)
    if fake_big is None:  # Note [Fake mode is an optimisation]
        return build(bigger, big, False)
    far = 8 * batch_size
    fake_far = _try_fake(lambda: build(_resize(batch, batch_size, far), far, True), lambda: None)
    if result.fake:
        return dataclasses.replace(fake_big, reference=fake_far)
    fake_here = _try_fake(lambda: build(batch, batch_size, True), lambda: None)
    if fake_here is None:
        return build(bigger, big, False)
    ref_far = _anchor(result, fake_far, fake_here=fake_here) if fake_far is not None else None
    return dataclasses.replace(_anchor(result, fake_big, fake_here=fake_here), reference=ref_far)


def _check_fake(model: nn.Module, fake: bool) -> None:
    if fake and is_sharded(model):
        raise ValueError(
            "`fake`: a sharded (FSDP) model cannot be profiled on fake tensors (its forward gathers parameters from the "
            "other processes); profile it with fake=False, on every process at once."
        )


def _fake_unsupported(exc: BaseException) -> bool:
    """Whether a step could not run on fake tensors: it reads a value (``.item()``, a branch on
    a tensor), makes a shape from data (``nonzero``), or uses an op fake tensors do not know."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {
        "DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException",
        "GuardOnDataDependentSymNode", "UnsupportedFakeTensorException", "MetadataMismatchError",
    })


def _try_fake(fake: Callable[[], Any], real: Callable[[], Any]) -> Any:
    """Note [Fake mode is an optimisation]: fake tensors measure memory without arithmetic, but a
    step that reads a value (``.item()``, common in training steps) cannot run on them. Then the
    same measurement is made for real — at the batch sizes needed, with one debug line — rather
    than failing."""
    try:
        return fake()
    except Exception as exc:  # noqa: BLE001 - only what fake tensors cannot do falls back
        if not _fake_unsupported(exc):
            raise
        log.debug("the step cannot run on fake tensors (%s: %s); measuring it for real", type(exc).__name__, exc)
        return real()


def _anchor(real: ModelProfile, fake_big: ModelProfile, *, fake_here: ModelProfile) -> ModelProfile:
    """The real profile moved by the fake one's change from this batch to the other."""

    def moved(r: Any, big: Any, here: Any, names: Iterable[str]) -> dict[str, int]:
        return {f: max(0, getattr(r, f) + getattr(big, f) - getattr(here, f)) for f in names}

    k = fake_big.batch_size / real.batch_size

    def element(r: SegmentProfile, b: Optional[SegmentProfile], h: Optional[SegmentProfile]) -> SegmentProfile:
        if b is None or h is None:  # a region the fake steps did not have: not moved
            b = h = r
        return dataclasses.replace(r, **moved(r, b, h, _SCALED_INT_FIELDS), **{f: getattr(r, f) * k for f in _SCALED_MS_FIELDS})

    segments = tuple(element(r, b, h) for r, b, h in zip(real.segments, fake_big.segments, fake_here.segments))
    big, here = {e.name: e for e in fake_big.outside}, {e.name: e for e in fake_here.outside}
    outside = tuple(element(r, big.get(r.name), here.get(r.name)) for r in real.outside)
    top = ("static_bytes", "prefix_forward_peak_bytes", "prefix_backward_peak_bytes", "tail_peak_bytes", "peak_bytes")
    return dataclasses.replace(
        real, segments=segments, outside=outside, batch_size=fake_big.batch_size, prefix_ms=real.prefix_ms * k, tail_ms=real.tail_ms * k,
        step_ms=real.step_ms * k, reference=None, **moved(real, fake_big, fake_here, top),
    )
