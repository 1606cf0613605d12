"""Shared by the benchmark scripts: model builders, the methods compared, measuring one method's
peak memory and step time at a batch size, the baselines' largest batch, and table printing.

Every measurement is a plain PyTorch training step (zero_grad, forward, backward, SGD step).
Peak memory comes from one step metered by the library's ``DeviceMemoryMeter`` (through a
``SwapRuntime``, which tracks parameters, gradients, the batch and optimizer state the same way
for every method); on CPU that is the tracker of live storages, on CUDA the allocator's peak.
Step time is the median of ``repeats`` further, unmetered steps (the meter's dispatch mode slows
every op on CPU), timed as Note [Every method at the same steady state] says.

Note [Every method at the same steady state] (issue 36): a fresh model's first steps can be
several times slower than later ones (on a CPU, denormal floats: Note [Steady before timing] in
``lightning_swap/core/scale/warmup.py``), and a benchmark that timed each method at whatever
step it came to measured plain training (first) up to 5x slow. So every timed measurement here:

- runs on CPU with ``torch.set_flush_denormal(True)`` unless ``--keep-denormals``: the
  benchmarks measure the library, not the CPU's denormal path (the header says which);
- starts from one reference state of the weights and the optimizer: plain training at the base
  batch warmed up by :data:`STEADY`'s rule once, then saved (host copies); every method is reset
  to it before its warm-up and again before its timed steps, so all are timed on the same weights;
- warms up by the rule (:class:`~lightning_swap.core.scale.warmup.SteadyRule`: until the median
  of the last ``window`` step times is within ``tolerance`` of the median of the ``window`` that
  ended ``window`` steps earlier, at most ``max_steps``), then times ``repeats`` steps: their
  median (:func:`time_steps`).

``plan_quality.py``, ``compile_budget.py`` and ``fsdp.py`` run their own loops and use the same
rule, flag and :func:`time_steps`; ``max_batch.py`` checks plain's time against the same step
timed alone in a fresh process (:func:`standalone`).

The GPT-2-small-like model also runs as ``gpt2-small-like+chunked``: the same model, its loss
computed by the library's chunked cross-entropy from the final hidden states and the tied head
(the full logits never exist), so max batch and overhead compare with the plain loss. Its chunk
is about a third of a sequence's logits at every size: the default (64 MiB of fp32 logits, 333
tokens of 50257) at full size, 64 tokens in ``--quick``, 8 in ``--smoke``.

Note [Simulated save_on_cpu]: on CPU, ``torch.autograd.graph.save_on_cpu`` is a no-op (the
"device" already is the host), so it would measure as plain training. There it is emulated with
the same saved-tensor hooks it installs: pack copies every saved tensor (parameters included, as
the real one does) into host memory the meter does not count; unpack copies it back into new
device memory. On CUDA the real ``save_on_cpu(pin_memory=True)`` runs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from lightning_swap.core import Action, Plan, SwapRuntime, chunked_cross_entropy, profile
from lightning_swap.core import host_allocation, mark_host
from lightning_swap.core import ScaleConfig, ScaleResult, TrialMeasurement, search_batch_size
from lightning_swap.core.decide.costmodel import AUTO_WINDOW
from lightning_swap.core.scale.warmup import SteadyRule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # the repository root: examples/
from examples.models import GPT  # noqa: E402 - the one GPT of the repository

MiB = 2**20

BASELINES = ("plain", "torch checkpoint", "save_on_cpu")
#: Note [Every method at the same steady state]: the warm-up before every timed step, by size
#: (``--smoke`` times nothing worth reading: a token warm-up keeps it fast).
STEADY = {
    "full": SteadyRule(window=4, tolerance=0.05, max_steps=40),
    "quick": SteadyRule(window=4, tolerance=0.05, max_steps=40),
    "smoke": SteadyRule(window=1, tolerance=0.5, max_steps=3),
}
FORCED = (Action.OFFLOAD, Action.RECOMPUTE, Action.SELECTIVE, Action.RECOMPUTE_OFFLOAD)
AUTO_MODES = ("max", "throughput")


# -- models ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model at one size. ``base_batch`` is where the plain peak sets the budget."""

    name: str
    build: Callable[[], nn.Module]
    kind: str  # "image" or "tokens"
    size: int  # image side, or sequence length
    classes: int  # classes, or vocabulary
    base_batch: int
    segments: Optional[tuple] = None  # None: the library finds the repeated blocks
    chunked_loss: bool = False  # tokens only: the loss by chunked_cross_entropy on hidden_states
    chunk_size: Optional[int] = None  # tokens per chunk; None: the library's default
    plain_loss_name: Optional[str] = None  # the same model with the plain loss (its budget)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training loss of a batch: the plain one on the logits, or the chunked one."""
        if not self.chunked_loss:
            return loss_fn(model(x), y)
        return chunked_cross_entropy(model.hidden_states(x), model.lm_head.weight, y, bias=model.lm_head.bias, chunk_size=self.chunk_size)

    def make_batch(self, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(batch_size)
        if self.kind == "image":
            x = torch.randn(batch_size, 3, self.size, self.size, generator=g)
            y = torch.randint(0, self.classes, (batch_size,), generator=g)
        else:
            idx = torch.randint(0, self.classes, (batch_size, self.size + 1), generator=g)
            x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
        return x.to(device), y.to(device)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _inception(classes: int) -> nn.Module:
    return torchvision.models.inception_v3(weights=None, num_classes=classes, aux_logits=False, init_weights=False)


def _inception_blocks() -> tuple:
    # The stem's convolutions too: at full resolution they hold most of the activations. Inside the
    # Inception blocks the outermost match wins, so their own BasicConv2d are not segments.
    from torchvision.models.inception import BasicConv2d, InceptionA, InceptionB, InceptionC, InceptionD, InceptionE

    return (BasicConv2d, InceptionA, InceptionB, InceptionC, InceptionD, InceptionE)


def _densenet_blocks() -> tuple:
    # The dense blocks and transitions; the stem's leaf layers (an in-place ReLU among them) stay out.
    from torchvision.models.densenet import _DenseBlock, _Transition

    return (_DenseBlock, _Transition)


#: Sizes: "full" nominal (a GPU), "quick" small images / sequences for a CPU, "smoke" tiny.
#: ``chunk``: tokens per chunk of the chunked loss, about a third of a sequence's logits.
_SIZES = {
    "full": dict(image=224, inception=299, classes=1000, base=32, gpt=dict(), gpt_base=8, chunk=None),
    "quick": dict(image=32, inception=75, classes=10, base=8, gpt=dict(vocab=2048, dim=128, heads=4, layers=6, seq=128), gpt_base=8, chunk=64),
    "smoke": dict(image=32, inception=75, classes=10, base=2, gpt=dict(vocab=256, dim=32, heads=2, layers=3, seq=16), gpt_base=4, chunk=8),
}

MODEL_NAMES = ("resnet50", "densenet121", "inception_v3", "gpt2-small-like", "gpt2-small-like+chunked")


def model_specs(size: str, names: Sequence[str] = MODEL_NAMES, *, image: Optional[int] = None) -> list[ModelSpec]:
    """``image`` overrides the ResNet/DenseNet image side (at 32 px ResNet-50's weights, gradients
    and momentum are ~97% of its plain peak, leaving the methods little to act on)."""
    s = dict(_SIZES[size], **({"image": image} if image else {}))
    classes, gpt = s["classes"], s["gpt"]
    seq, vocab = gpt.get("seq", 1024), gpt.get("vocab", 50257)
    every = {
        "resnet50": ModelSpec("resnet50", lambda: torchvision.models.resnet50(weights=None, num_classes=classes), "image", s["image"], classes, s["base"]),
        "densenet121": ModelSpec(
            "densenet121", lambda: torchvision.models.densenet121(weights=None, num_classes=classes), "image", s["image"], classes, s["base"],
            segments=_densenet_blocks(),
        ),
        "inception_v3": ModelSpec(
            "inception_v3", lambda: _inception(classes), "image", s["inception"], classes, max(1, s["base"] // 2), segments=_inception_blocks(),
        ),
        "gpt2-small-like": ModelSpec("gpt2-small-like", lambda: GPT(**gpt), "tokens", seq, vocab, s["gpt_base"]),
        "gpt2-small-like+chunked": ModelSpec(
            "gpt2-small-like+chunked", lambda: GPT(**gpt), "tokens", seq, vocab, s["gpt_base"],
            chunked_loss=True, chunk_size=s["chunk"], plain_loss_name="gpt2-small-like",
        ),
    }
    unknown = [n for n in names if n not in every]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {list(every)}")
    return [every[n] for n in names]


# -- methods ---------------------------------------------------------------------------------
def forced_plan(segments: Sequence[str], action: Action) -> Plan:
    return Plan(actions={name: action for name in segments})


def method_name(action: Action) -> str:
    return f"ours: {action.value}"


@contextlib.contextmanager
def _checkpointed(modules: Sequence[nn.Module]) -> Iterator[None]:
    """``torch.utils.checkpoint`` around every segment (an instance ``forward``, removed after)."""
    saved = []
    try:
        for module in modules:
            had = "forward" in module.__dict__
            saved.append((module, had, module.__dict__.get("forward")))
            inner = module.forward

            def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

            module.forward = forward
        yield
    finally:
        for module, had, previous in saved:
            if had:
                module.forward = previous
            else:
                module.__dict__.pop("forward", None)


def _simulated_save_on_cpu() -> Any:
    """Note [Simulated save_on_cpu]."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        with host_allocation():
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout)
            host.copy_(t)
        mark_host(host)
        return host

    def unpack(host: torch.Tensor) -> torch.Tensor:
        return host.clone()  # the host-to-device copy: new device memory

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


# -- timing at the steady state (Note [Every method at the same steady state]) ------------------
@dataclass(frozen=True)
class Timing:
    step_ms: float  # the median of the timed steps
    warmup_steps: int  # steps run before them
    steady: bool  # the rule found the warm-up's times steady (else it stopped at its cap)
    min_ms: Optional[float] = None  # the fastest timed step (what a neighbour's load cannot inflate)


def time_step(step: Callable[[], Any], sync: Callable[[], Any] = lambda: None) -> float:
    """Milliseconds of one ``step()`` (``sync()``: wait for the device before and after)."""
    sync()
    start = time.perf_counter()
    step()
    sync()
    return (time.perf_counter() - start) * 1e3


def time_steps(
    step: Callable[[], Any], rule: SteadyRule, repeats: int, *, sync: Callable[[], Any] = lambda: None,
    reset: Callable[[], Any] = lambda: None,
) -> Timing:
    """Note [Every method at the same steady state]: ``reset()``, ``step()`` until ``rule`` finds
    the step times steady (or its cap), ``reset()`` again, then ``repeats`` timed steps."""
    reset()
    warm: list[float] = []
    while not rule.done(warm):
        warm.append(time_step(step, sync))
    reset()
    times = [time_step(step, sync) for _ in range(max(1, repeats))]
    return Timing(statistics.median(times), len(warm), rule.steady(warm), min(times))


@contextlib.contextmanager
def denormals_flushed(flush: bool) -> Iterator[None]:
    """``torch.set_flush_denormal(flush)`` while the benchmark measures, back to torch's default
    (off) afterwards (Note [Every method at the same steady state])."""
    torch.set_flush_denormal(flush)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _host_copy(obj: Any) -> Any:
    """A deep copy with every tensor in host memory (the meter never sees it; on CUDA the device
    does not hold it)."""
    return copy.deepcopy(obj) if not isinstance(obj, dict) else {
        k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else _host_copy(v)) for k, v in obj.items()
    }


# -- one model and its optimizer in the steady state -------------------------------------------
@dataclass(frozen=True)
class Measurement:
    batch_size: int
    peak_bytes: int
    step_ms: Optional[float]  # None when only the metered step ran
    #: Note [Unplanned bytes]: saved bytes the offload engine saw, and of those the bytes that
    #: stayed on the device because no action can move them (None: nothing offloaded).
    saved_bytes: Optional[int] = None
    unplanned_bytes: Optional[int] = None
    #: How the time was taken (None when only the metered step ran).
    timing: Optional[Timing] = None

    @property
    def samples_per_s(self) -> Optional[float]:
        return None if not self.step_ms else self.batch_size / self.step_ms * 1e3


class Bench:
    """A model, its SGD optimizer and its segments on one device, measured method by method."""

    def __init__(self, spec: ModelSpec, device: torch.device, *, unified: Any = None, steady: SteadyRule = STEADY["quick"]) -> None:
        from lightning_swap.core import find_segments

        self.spec, self.device = spec, device
        self.unified = unified  # a UnifiedMemory our plans' runtimes use (unified_memory.py)
        self.steady = steady  # Note [Every method at the same steady state]
        torch.manual_seed(0)
        self.model = spec.build().to(device).train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.segments = find_segments(self.model, list(spec.segments) if spec.segments else None)
        self._cache: dict[tuple, Measurement] = {}
        self._step(*spec.make_batch(2, device), contextlib.nullcontext)  # optimizer state exists from here on (batch 2: BatchNorm)
        self._reference: Optional[tuple[dict, dict]] = None  # the weights and optimizer state every timing starts from
        #: How plain training at the base batch was warmed up before the reference was saved.
        self.reference_warmup: Optional[Timing] = None

    def reset(self) -> None:
        """Weights, buffers and optimizer state back to the reference (Note [Every method at the
        same steady state]); the first call makes it: plain training at the base batch, warmed up
        by the rule past a fresh model's first steps, then saved."""
        if self._reference is None:
            x, y = self.spec.make_batch(max(2, self.spec.base_batch), self.device)
            self.reference_warmup = time_steps(lambda: self._step(x, y, contextlib.nullcontext), self.steady, 1, sync=self._sync)
            self._reference = (_host_copy(self.model.state_dict()), _host_copy(self.opt.state_dict()))
        weights, opt_state = self._reference
        with torch.no_grad():
            self.model.load_state_dict(weights)
        self.opt.load_state_dict(copy.deepcopy(opt_state))  # loading aliases the tensors it is given: a copy each time

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _step(self, x: torch.Tensor, y: torch.Tensor, forward_ctx: Callable[[], Any], runtime: Optional[SwapRuntime] = None):
        self.opt.zero_grad(set_to_none=True)
        if runtime is not None:
            runtime.begin_step([x, y, self.opt.state])
        with forward_ctx():
            loss = self.spec.loss(self.model, x, y)
        loss.backward()
        stats = runtime.end_step() if runtime is not None else None
        self.opt.step()
        return stats

    @contextlib.contextmanager
    def _applied(self, method: str, plan: Optional[Plan]) -> Iterator[tuple[SwapRuntime, Callable[[], Any]]]:
        """Installs ``method`` (a baseline name, or a plan of ours); yields the metering runtime
        (the plan's, or an all-kept one) and the context each forward runs in."""
        if plan is None:
            plan = forced_plan(self.segments, Action.KEEP)
        forward_ctx: Callable[[], Any] = contextlib.nullcontext
        with contextlib.ExitStack() as stack:
            if method == "torch checkpoint":
                modules = dict(self.model.named_modules())
                stack.enter_context(_checkpointed([modules[n] for n in self.segments]))
            elif method == "save_on_cpu":
                if self.device.type == "cuda":
                    forward_ctx = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)  # noqa: E731
                else:
                    forward_ctx = _simulated_save_on_cpu
            runtime = stack.enter_context(SwapRuntime(self.model, plan, unified=self.unified))
            yield runtime, forward_ctx

    def measure(self, method: str, batch_size: int, *, plan: Optional[Plan] = None, repeats: int = 2, fresh: bool = False) -> Measurement:
        """Peak of one metered step and, when ``repeats``, the median time of that many unmetered
        steps at the steady state (Note [Every method at the same steady state]; cached unless
        ``fresh``: measured again, the cache updated)."""
        key = (method, batch_size, (tuple(plan.actions.items()), tuple(plan.outside.items()), plan.prefetch_bytes, plan.inflight_bytes) if plan is not None else None)
        cached = self._cache.get(key)
        if cached is not None and not fresh and (repeats == 0 or cached.step_ms is not None):
            return cached
        if repeats:
            self.reset()  # the reference exists before this method's first step
        x, y = self.spec.make_batch(batch_size, self.device)
        with self._applied(method, plan) as (runtime, forward_ctx):
            stats = self._step(x, y, forward_ctx, runtime)
            peak = stats.peak_device_bytes
            timing = None
            if repeats:
                step = functools.partial(self._step, x, y, forward_ctx)
                timing = time_steps(step, self.steady, repeats, sync=self._sync, reset=self.reset)
                del step
        del x, y
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        result = Measurement(batch_size, peak, timing.step_ms if timing else None, stats.saved_bytes, stats.unplanned_bytes, timing)
        self._cache[key] = result
        return result

    def profile(self, batch_size: int, **kwargs: Any):
        """The planner's input: one plain step at ``batch_size`` profiled, scalable in batch size
        (``kwargs`` go to ``profile``: ``fake``, ``assume``)."""
        self.reset()  # profiled on the weights every method is timed on
        x, y = self.spec.make_batch(batch_size, self.device)
        self.opt.zero_grad(set_to_none=True)
        return profile(
            self.model, (x, y), step_fn=lambda m, b: self.spec.loss(m, b[0], b[1]), segments=list(self.segments), track=[self.opt.state],
            **kwargs,
        )


# -- the largest batch ----------------------------------------------------------------------------
@dataclass(frozen=True)
class MaxBatch:
    method: str
    at: Optional[Measurement]  # measured at the batch found (None: not even batch 1 fits)
    how: str


def fitted_max_batch(bench: Bench, method: str, budget_bytes: int, *, cap: int, repeats: int) -> MaxBatch:
    """Baselines: peak = a + b * batch fitted through two measured batches; the predicted largest
    batch is confirmed by a measured step. A confirmation over the budget refits the line through
    it and the base batch (at most twice more), then falls back to the largest measured batch
    that fit."""
    b2 = bench.spec.base_batch
    b1 = max(1, b2 // 2) if b2 > 1 else 2
    points = sorted({b: bench.measure(method, b, repeats=0) for b in (b1, b2)}.items())
    (lo, m_lo), (hi, m_hi) = points[0], points[-1]
    how = ""
    for attempt in range(3):
        slope = (m_hi.peak_bytes - m_lo.peak_bytes) / (hi - lo)
        intercept = m_lo.peak_bytes - slope * lo
        predicted = cap if slope <= 0 else min(cap, math.floor((budget_bytes - intercept) / slope))
        if attempt == 0:
            if predicted < 1:
                return MaxBatch(method, None, f"fit: {intercept / MiB:.1f} MiB at batch 0 > budget")
            how = f"fit {intercept / MiB:.1f}+{slope / MiB:.3f}*B MiB -> {predicted}"
        else:
            how += f", refit -> {predicted}"
        m = bench.measure(method, max(1, predicted), repeats=0)
        if m.peak_bytes <= budget_bytes:
            break
        how += " (over)"
        lo, m_lo, hi, m_hi = (lo, m_lo, m.batch_size, m) if m.batch_size > lo else (m.batch_size, m, lo, m_lo)
    if m.peak_bytes > budget_bytes:  # the largest measured batch that fit
        fitting = [k for k, v in bench._cache.items() if k[0] == method and k[2] is None and v.peak_bytes <= budget_bytes]
        if not fitting:
            return MaxBatch(method, None, how + ", nothing measured fits")
        m = max((bench._cache[k] for k in fitting), key=lambda x: x.batch_size)
        how += f" -> largest measured that fit: {m.batch_size}"
    else:
        how += ", confirmed"
    m = bench.measure(method, m.batch_size, repeats=repeats)
    if m.batch_size == cap:
        how += " (cap)"
    return MaxBatch(method, m, how)


def planned_max_batch(
    bench: Bench, prof: Any, name: str, budget_bytes: int, *, mode: str, actions: Optional[tuple[Action, ...]], cap: int, repeats: int, candidates: int = 2
) -> tuple[MaxBatch, Optional[ScaleResult]]:
    """Ours: the planner's search (predictions, then real trial steps) under the budget; the
    base batch is the model's, where ``mode="throughput"`` measures plain training first.

    A plan that keeps every segment is measured as "plain" (the same runtime with every
    segment kept, so the same program): the throughput search's plain trial and the plain row
    share one measurement, and "at least plain's samples/s" holds in the table as in the search.
    """

    def measure(batch_size: int, plan: Plan, fresh: bool = False) -> Measurement:
        if set(plan.actions.values()) == {Action.KEEP} and not plan.offloads_outside:
            return bench.measure("plain", batch_size, repeats=repeats, fresh=fresh)
        return bench.measure(name, batch_size, plan=plan, repeats=repeats, fresh=fresh)

    tried: list[tuple[int, Plan]] = []

    def run_trial(batch_size: int, plan: Plan) -> TrialMeasurement:
        # Tried before in this search: timed again (Note [Confirm the winner in the same window]).
        m = measure(batch_size, plan, fresh=(batch_size, plan) in tried)
        tried.append((batch_size, plan))
        return TrialMeasurement(peak_bytes=m.peak_bytes, step_ms=m.step_ms)

    config = ScaleConfig(mode=mode, margin=0.0, max_batch_size=cap, max_trials=4, candidates=candidates, steps_per_trial=1 + repeats)
    from lightning_swap.core import BatchSearchError

    try:
        result = search_batch_size(
            prof, budget_bytes, run_trial, config, actions=actions, base_batch_size=bench.spec.base_batch,
            prefetch_bytes=AUTO_WINDOW, inflight_bytes=AUTO_WINDOW,  # the planner's windows, as a session's
        )
    except BatchSearchError as err:
        return MaxBatch(name, None, f"no batch fits ({len(err.trials)} trial(s))"), None
    m = measure(result.batch_size, result.plan)
    how = f"planner + {len(result.trials)} trial(s), {result.failed_trials} failed"
    if mode == "max" and result.batch_size == cap:
        how += " (cap)"
    if mode == "throughput":
        plain = result.plain_trial
        if result.speedup is not None:
            how += f", {result.speedup:.2f}x plain's samples/s at batch {plain.batch_size}"
        elif plain is not None:
            how += f", plain at batch {plain.batch_size} {plain.reason}"
        else:
            how += ", plain not measured"
    return MaxBatch(name, m, how), result


# -- output ------------------------------------------------------------------------------------
def print_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, indent: str = "   ") -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    print(indent + " | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print(indent + "-|-".join("-" * w for w in widths))
    for row in rows:
        print(indent + " | ".join(v.ljust(w) for v, w in zip(row, widths)))


def fmt(value: Optional[float], spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes for a CPU (< 5 minutes on 2 loaded cores)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (the smoke test)")
    parser.add_argument("--models", nargs="+", default=None, help=f"subset of {list(MODEL_NAMES)}")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per measurement (median)")
    parser.add_argument(
        "--threads", type=int, default=None,
        help="CPU threads (default 1 on CPU: on 2 shared cores one thread ran ResNet-50 about 5x faster than two)",
    )
    keep_denormals_arg(parser)


def keep_denormals_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--keep-denormals", action="store_true",
        help="CPU: do not flush denormal floats (default: flushed, Note [Every method at the same steady state] in common.py)",
    )


def denormals_line(device: torch.device, keep: bool) -> str:
    """What the header says about denormals (``setup`` sets ``args.flush`` the same way)."""
    if device.type != "cpu":
        return "denormals as the device computes them"
    return "denormals kept (--keep-denormals)" if keep else "denormals flushed (torch.set_flush_denormal(True))"


def setup(args: argparse.Namespace) -> tuple[str, torch.device]:
    """The size, the device (CUDA for full runs when there is one), threads, the warm-up rule
    (``args.steady``) and whether denormals are flushed (``args.flush``: :func:`denormals_flushed`
    applies it); prints the machine line and how steps are timed."""
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    device = torch.device("cuda" if torch.cuda.is_available() and size == "full" else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    if args.repeats is None:
        args.repeats = 1 if size == "smoke" else 4 if size == "quick" else 5
    args.steady, args.flush = STEADY[size], device.type == "cpu" and not args.keep_denormals
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    budget_kind = "simulated budget (CPU live-storage meter)" if device.type == "cpu" else "budget on the CUDA allocator's peak"
    print(f"device {device} ({where}), torch {torch.__version__}, size {size}, {budget_kind}, "
          f"{denormals_line(device, args.keep_denormals)}, {time.strftime('%Y-%m-%d')}")
    print(f"timing: every method from the same weights and optimizer state (plain training warmed up, saved, restored before each "
          f"method's warm-up and timed steps); {args.steady.describe()}; then the median of {args.repeats} timed step(s)")
    return size, device


# -- plain training timed alone in a fresh process (max_batch.py's check) ------------------------
@dataclass(frozen=True)
class Standalone:
    """What :func:`standalone` measured in a fresh process."""

    plain: Timing  # plain training alone, warmed up from the model's first step
    #: With ``turns``: the median ms of each configuration's steps, the two timed in turn.
    in_turn_ms: tuple[float, ...] = ()


def standalone(spec: ModelSpec, size: str, device: torch.device, args: argparse.Namespace, batch_size: int,
               turns: Optional[tuple[tuple[int, Optional[Plan]], tuple[int, Optional[Plan]]]] = None) -> Standalone:
    """In a fresh process, with this process's threads and denormal setting: a seeded model and
    SGD, plain training at ``batch_size`` warmed up from its first step by the same rule and
    timed as :func:`time_steps` does (no runtime, no reset): ``plain``. With ``turns`` (two
    configurations, each a batch and a plan of ours or ``None`` for plain), a seeded model for
    each (a plan's runtime installed once, as in training), both warmed up, then timed in turn,
    one step each per round, ``2 * args.repeats`` rounds: their ratio is free of the machine's drift."""
    import pickle
    import tempfile

    config = dict(model=spec.name, size=size, device=str(device), batch=batch_size, repeats=args.repeats, flush=args.flush,
                  threads=torch.get_num_threads())
    env = dict(os.environ, OMP_NUM_THREADS=str(config["threads"]), PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    with tempfile.NamedTemporaryFile(suffix=".pkl") as f:
        pickle.dump(turns, f)
        f.flush()
        config["turns"] = f.name
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--standalone", json.dumps(config)], capture_output=True,
                              text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the standalone run failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return Standalone(Timing(**out["plain"]), tuple(out["turns"] or ()))


def _standalone(config: dict) -> dict:
    import pickle

    torch.set_num_threads(config["threads"])
    spec, device = model_specs(config["size"], [config["model"]])[0], torch.device(config["device"])
    with open(config["turns"], "rb") as f:
        turns = pickle.load(f)

    def trainer(batch_size: int) -> tuple[nn.Module, Callable[[], None]]:
        """A seeded model, its SGD and a batch: the model and one plain training step of it."""
        torch.manual_seed(0)
        model = spec.build().to(device).train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        x, y = spec.make_batch(batch_size, device)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            spec.loss(model, x, y).backward()
            opt.step()

        return model, step

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rule, repeats = STEADY[config["size"]], config["repeats"]
    with denormals_flushed(config["flush"]), contextlib.ExitStack() as stack:
        _, plain = trainer(config["batch"])
        out = dict(plain=dataclasses.asdict(time_steps(plain, rule, repeats, sync=sync)), turns=None)
        steps = []
        for batch_size, plan in turns or ():  # a model each, its plan's runtime installed once (as in training)
            model, step = trainer(batch_size)
            if plan is not None:
                stack.enter_context(SwapRuntime(model, plan))
            time_steps(step, rule, 1, sync=sync)  # its warm-up
            steps.append(step)
        if steps:
            times = [[time_step(step, sync) for step in steps] for _ in range(2 * repeats)]
            out["turns"] = [statistics.median(t[i] for t in times) for i in range(len(steps))]
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["--standalone"]:
    print(json.dumps(_standalone(json.loads(sys.argv[2]))))
