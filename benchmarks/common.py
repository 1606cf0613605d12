"""Shared by the benchmark scripts: model builders, the methods compared, measuring one method's
peak memory and step time at a batch size, the baselines' largest batch, and table printing.

Every measurement is a plain PyTorch training step (zero_grad, forward, backward, SGD step).
Peak memory comes from one step metered by the library's ``DeviceMemoryMeter`` (through a
``SwapRuntime``, which tracks parameters, gradients, the batch and optimizer state the same way
for every method); on CPU that is the tracker of live storages, on CUDA the allocator's peak.
Step time is the median of ``repeats`` further, unmetered steps (the meter's dispatch mode slows
every op on CPU).

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
import math
import statistics
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
from plan_quality import GPT  # examples/models.py: the one GPT of the repository (plan_quality puts the root on the path)

MiB = 2**20

BASELINES = ("plain", "torch checkpoint", "save_on_cpu")
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

    @property
    def samples_per_s(self) -> Optional[float]:
        return None if not self.step_ms else self.batch_size / self.step_ms * 1e3


class Bench:
    """A model, its SGD optimizer and its segments on one device, measured method by method."""

    def __init__(self, spec: ModelSpec, device: torch.device, *, unified: Any = None) -> None:
        from lightning_swap.core import find_segments

        self.spec, self.device = spec, device
        self.unified = unified  # a UnifiedMemory our plans' runtimes use (unified_memory.py)
        torch.manual_seed(0)
        self.model = spec.build().to(device).train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.segments = find_segments(self.model, list(spec.segments) if spec.segments else None)
        self._cache: dict[tuple, Measurement] = {}
        self._step(*spec.make_batch(2, device), contextlib.nullcontext)  # optimizer state exists from here on (batch 2: BatchNorm)

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

    def measure(self, method: str, batch_size: int, *, plan: Optional[Plan] = None, repeats: int = 2) -> Measurement:
        """Peak of one metered step and the median time of ``repeats`` unmetered ones (cached)."""
        key = (method, batch_size, (tuple(plan.actions.items()), tuple(plan.outside.items()), plan.prefetch_bytes, plan.inflight_bytes) if plan is not None else None)
        cached = self._cache.get(key)
        if cached is not None and (repeats == 0 or cached.step_ms is not None):
            return cached
        x, y = self.spec.make_batch(batch_size, self.device)
        with self._applied(method, plan) as (runtime, forward_ctx):
            stats = self._step(x, y, forward_ctx, runtime)
            peak = stats.peak_device_bytes
            times = []
            for _ in range(repeats):
                self._sync()
                start = time.perf_counter()
                self._step(x, y, forward_ctx)
                self._sync()
                times.append((time.perf_counter() - start) * 1e3)
        del x, y
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        result = Measurement(batch_size, peak, statistics.median(times) if times else None, stats.saved_bytes, stats.unplanned_bytes)
        self._cache[key] = result
        return result

    def profile(self, batch_size: int, **kwargs: Any):
        """The planner's input: one plain step at ``batch_size`` profiled, scalable in batch size
        (``kwargs`` go to ``profile``: ``fake``, ``assume``)."""
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

    def measure(batch_size: int, plan: Plan) -> Measurement:
        if set(plan.actions.values()) == {Action.KEEP} and not plan.offloads_outside:
            return bench.measure("plain", batch_size, repeats=repeats)
        return bench.measure(name, batch_size, plan=plan, repeats=repeats)

    def run_trial(batch_size: int, plan: Plan) -> TrialMeasurement:
        m = measure(batch_size, plan)
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


def setup(args: argparse.Namespace) -> tuple[str, torch.device]:
    """The size, the device (CUDA for full runs when there is one), threads; prints the machine line."""
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    device = torch.device("cuda" if torch.cuda.is_available() and size == "full" else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    if args.repeats is None:
        args.repeats = 1 if size == "smoke" else 2 if size == "quick" else 5
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    budget_kind = "simulated budget (CPU live-storage meter)" if device.type == "cpu" else "budget on the CUDA allocator's peak"
    print(f"device {device} ({where}), torch {torch.__version__}, size {size}, {budget_kind}, {time.strftime('%Y-%m-%d')}")
    return size, device
