"""What is on the device at the peak of a step: bytes by kind, for the lowest-memory plan of
ours and for ``save_on_cpu`` (issue 23's diagnosis).

One metered step per method at one batch (by default ``save_on_cpu``'s largest batch from
RESULTS.md); at the moment the meter reaches the step's peak, every live storage is put in one
class:

- ``static``: parameters, buffers, the batch, optimizer state and gradients alive before the step;
- ``grads``: parameter gradients made during the step;
- ``saved: inside kept``: saved for backward by a segment and left on the device by its action;
- ``saved: small``: saved inside an offloading segment but under ``min_offload_bytes``;
- ``saved: outside``: saved by code outside every segment (stem, head, loss, glue) and kept;
- ``in flight``: sources of copies to the host not yet retired (CUDA only);
- ``fetched``: device copies brought back in backward (prefetched or on demand);
- ``working``: everything else (the op running, gradients flowing, unsaved intermediates).

    python benchmarks/peak_attribution.py --quick [--models resnet50] [--batch 34]

The classes are a diagnosis made here with hooks the library does not have (a tool, not a test).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import weakref
from collections import defaultdict

import torch
from torch.utils._pytree import tree_leaves

from common import Bench, MiB, common_args, model_specs, print_table, setup, _simulated_save_on_cpu
from lightning_swap.core import SwapRuntime, min_budget_bytes, solve

try:  # the lowest-memory plan, in the planner's windows; before issue 23, the least budget's plan
    from lightning_swap.core.decide.costmodel import AUTO_WINDOW
    from lightning_swap.core.decide.solver import least_peak_plan
except ImportError:
    least_peak_plan = None

#: save_on_cpu's largest batch per model (benchmarks/RESULTS.md, 2026-11-22 --quick).
SAVE_ON_CPU_BATCH = {"resnet50": 34, "densenet121": 46, "inception_v3": 9, "gpt2-small-like": 24, "gpt2-small-like+chunked": 48}

CLASSES = ("static", "grads", "saved: inside kept", "saved: small", "saved: outside", "in flight", "fetched", "working")


def _sid(t: torch.Tensor) -> int | None:
    try:
        return id(t.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


class Attributor:
    """Hooks that label storages, and the meter snapshot at the peak."""

    def __init__(self, bench: Bench, runtime: SwapRuntime) -> None:
        self.bench, self.runtime = bench, runtime
        self.labels: dict[int, tuple[weakref.ref, str]] = {}
        self.current_segment: list[int] = []
        self.snapshot: dict[int, int] = {}
        self.best = -1
        self.handles = []
        self.static_ids: set = set()
        self.now = "before"
        self.where = ""

    def label(self, t: torch.Tensor, what: str) -> None:
        if isinstance(t, torch.Tensor) and (sid := _sid(t)) is not None and sid not in self.labels:
            self.labels[sid] = (weakref.ref(t.untyped_storage()), what)

    def install(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        modules = dict(self.bench.model.named_modules())
        def pre(mod, a, i):
            self.current_segment.append(i)
            self.now = f"forward {self.bench.segments[i]}"
            x = next((t for t in a if isinstance(t, torch.Tensor)), None)
            if x is not None and x.requires_grad:
                self.handles.append(x.register_hook(lambda g: setattr(self, "now", f"after backward of {self.bench.segments[i]}")))

        def post(mod, a, o, i):
            self.current_segment.pop()
            self.now = f"after forward {self.bench.segments[i]}"
            if isinstance(o, torch.Tensor) and o.requires_grad:
                self.handles.append(o.register_hook(lambda g: setattr(self, "now", f"backward {self.bench.segments[i]}")))

        for i, name in enumerate(self.bench.segments):
            m = modules[name]
            self.handles.append(m.register_forward_pre_hook(lambda mod, a, i=i: pre(mod, a, i)))
            self.handles.append(m.register_forward_hook(lambda mod, a, o, i=i: post(mod, a, o, i)))
        engine = self.runtime.engine
        if engine is not None:
            pack, fetch = engine._pack, engine._fetch

            def _pack(segment, t, **kw):
                out = pack(segment, t, **kw)
                kept = "saved: small" if segment is not None else "saved: outside"
                self.label(t, kept if type(out).__name__ == "_Kept" else "offloaded")
                return out

            def _fetch(entry):
                dst, event = fetch(entry)
                self.label(dst, "fetched")
                return dst, event

            engine._pack, engine._fetch = _pack, _fetch
            use = engine._use_in_place

            def _use_in_place(entry, storage):
                out = use(entry, storage)
                return out

            engine._use_in_place = _use_in_place

        def outer_pack(t):
            if torch._C._current_graph_task_id() == -1:
                self.label(t, "saved: inside kept" if self.current_segment else "saved: outside")
            return t

        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(outer_pack, lambda t: t))
        meter = self.runtime.meter

        params = list(self.bench.model.parameters())

        def listener(current):
            if current > self.best:
                self.best = current
                grads = {_sid(p.grad) for p in params if p.grad is not None}
                self.snapshot = {
                    k: (nbytes, "grads" if k in grads else self.label_of(k, ref())) for k, (ref, nbytes) in meter._storages.items()
                    if ref() is not None
                }
                self.where = self.now

        meter.listeners.append(listener)
        stack.callback(meter.listeners.remove, listener)
        stack.callback(lambda: [h.remove() for h in self.handles])
        return stack

    def label_of(self, sid: int, storage) -> str:
        if sid in self.static_ids:
            return "static"
        label = self.labels.get(sid)
        if label is None or label[0]() is not storage:
            return "working"
        return "working" if label[1] == "offloaded" else label[1]  # an offloaded source the running op holds

    def classify(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for nbytes, what in self.snapshot.values():
            out[what] += nbytes
        return out


def attribute(bench: Bench, method: str, batch: int, plan=None) -> tuple[int, dict[str, int]]:
    x, y = bench.spec.make_batch(batch, bench.device)
    with bench._applied(method, plan) as (runtime, forward_ctx):
        att = Attributor(bench, runtime)
        params = list(bench.model.parameters())
        static = [*params, *bench.model.buffers(), x, y, *tree_leaves(bench.opt.state)]
        att.static_ids = {_sid(t) for t in static if isinstance(t, torch.Tensor)}
        with att.install():
            bench.opt.zero_grad(set_to_none=True)
            runtime.begin_step([x, y, bench.opt.state])
            with forward_ctx():
                loss = bench.spec.loss(bench.model, x, y)
            loss.backward()
            stats = runtime.end_step()
        bench.opt.step()
    classes = att.classify()
    classes["where"] = att.where
    big = sorted(((n, w) for n, w in att.snapshot.values() if w not in ("static", "grads")), reverse=True)[:8]
    classes["largest"] = ", ".join(f"{n / MiB:.2f} {w}" for n, w in big)
    return stats.peak_device_bytes, classes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(parser)
    parser.add_argument("--batch", type=int, default=None, help="the batch (default: save_on_cpu's largest, RESULTS.md)")
    args = parser.parse_args(argv)
    size, device = setup(args)
    for spec in model_specs(size, args.models or ["resnet50", "densenet121", "inception_v3", "gpt2-small-like"]):
        bench = Bench(spec, device)
        batch = args.batch or SAVE_ON_CPU_BATCH[spec.name]
        prof = bench.profile(spec.base_batch)
        if least_peak_plan is not None:
            plan = least_peak_plan(prof, batch_size=batch, prefetch_bytes=AUTO_WINDOW, inflight_bytes=AUTO_WINDOW)
        else:
            plan = solve(prof, budget_bytes=min_budget_bytes(prof.at_batch(batch)), batch_size=batch)
        rows = []
        results = {}
        for method, p in (("save_on_cpu", None), ("ours: lowest-memory plan", plan)):
            peak, classes = attribute(bench, method, batch, p)
            results[method] = (peak, classes)
        header = ("class", *[f"{m} MiB" for m in results])
        for c in CLASSES:
            rows.append((c, *[f"{results[m][1].get(c, 0) / MiB:.2f}" for m in results]))
        rows.append(("peak", *[f"{results[m][0] / MiB:.2f}" for m in results]))
        rows.append(("where", *[results[m][1]["where"] for m in results]))
        print(f"\n== {spec.name} at batch {batch}: ours {plan.summary()}, predicted peak {plan.predicted_peak_bytes / MiB:.1f} MiB")
        print_table(header, rows)
        for m in results:
            print(f"   largest non-static storages at the peak, {m}: {results[m][1]['largest']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
