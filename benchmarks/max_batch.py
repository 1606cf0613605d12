"""Largest batch under one memory budget, and samples/s there, method by method.

For ResNet-50, DenseNet-121, Inception-v3 and a GPT-2-small-like transformer, the budget is the
plain-training peak at the model's base batch (so plain training's answer is about that batch),
and each method's largest batch is found and measured:

- baselines (plain, ``torch.utils.checkpoint`` on every block, ``save_on_cpu``): peak measured
  at two batch sizes, ``peak = a + b * batch`` fitted, the predicted largest batch confirmed by
  one measured step (memory is linear in the batch);
- ours (each forced policy, and the ``auto`` plan in ``mode="max"`` and ``mode="throughput"``):
  the planner's search, ``search_batch_size`` on one profile, confirmed by real trial steps.

The search stops at ``--cap`` times the base batch (marked "(cap)": the true limit is higher).

    python benchmarks/max_batch.py --quick     # CPU, small images / sequences, simulated budget
    python benchmarks/max_batch.py             # full sizes on a GPU
    python benchmarks/max_batch.py --smoke     # tiny, seconds (the smoke test)

Reference: a thesis measured ResNet-50's largest batch in TensorFlow as 87 plain, 111 swap,
212 recompute, 214 combined (x1.28 / x2.44 / x2.46).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from common import (
    AUTO_MODES,
    BASELINES,
    FORCED,
    MiB,
    Bench,
    common_args,
    fitted_max_batch,
    fmt,
    method_name,
    model_specs,
    planned_max_batch,
    print_table,
    setup,
)

HEADER = ("method", "max batch", "x plain", "step ms", "samples/s", "peak MiB", "found by")


def run_model(spec, device, args) -> None:
    start = time.perf_counter()
    bench = Bench(spec, device)
    cap = args.cap * spec.base_batch
    budget = bench.measure("plain", spec.base_batch, repeats=0).peak_bytes
    print(f"\n== {spec.name} ({spec.kind} {spec.size}, {len(bench.segments)} segments): budget {budget / MiB:.1f} MiB "
          f"= plain peak at batch {spec.base_batch}; search capped at batch {cap}")
    results = [fitted_max_batch(bench, name, budget, cap=cap, repeats=args.repeats) for name in BASELINES]
    prof = bench.profile(spec.base_batch)
    for action in FORCED:
        found, _ = planned_max_batch(bench, prof, method_name(action), budget, mode="max", actions=(action,), cap=cap, repeats=args.repeats)
        results.append(found)
    for mode in AUTO_MODES:
        found, result = planned_max_batch(bench, prof, f"ours: auto {mode}", budget, mode=mode, actions=None, cap=cap, repeats=args.repeats)
        if result is not None:
            found = type(found)(found.method, found.at, f"{found.how}; {result.plan.summary()}")
        results.append(found)
    plain = results[0].at.batch_size if results[0].at is not None else None
    rows = []
    for r in results:
        m = r.at
        rows.append((
            r.method,
            fmt(m.batch_size if m else None, "d"),
            fmt(m.batch_size / plain if m and plain else None, ".2f"),
            fmt(m.step_ms if m else None),
            fmt(m.samples_per_s if m else None, ".1f"),
            fmt(m.peak_bytes / MiB if m else None, ".1f") + (" OVER" if m and m.peak_bytes > budget else ""),
            r.how,
        ))
    print_table(HEADER, rows)
    print(f"   ({time.perf_counter() - start:.0f} s)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(parser)
    parser.add_argument("--cap", type=int, default=None, help="largest batch searched, as a multiple of the base batch")
    args = parser.parse_args(argv)
    size, device = setup(args)
    if args.cap is None:
        args.cap = {"smoke": 4, "quick": 6, "full": 16}[size]
    names = args.models or (["gpt2-small-like"] if size == "smoke" else None)
    specs = model_specs(size, names) if names else model_specs(size)
    for spec in specs:
        run_model(spec, device, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
