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

``gpt2-small-like+chunked`` is the same GPT with its loss computed by the library's chunked
cross-entropy (the logits never whole); its budget is the plain-loss model's, so the two tables
compare at one budget, and a last table sets their largest batches side by side.

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

from lightning_swap.core import Action, InfeasibleBudgetError, simulate, solve
from lightning_swap.core.decide.solver import least_peak_plan
from lightning_swap.core.measure.profiler import DeviceAssumption


from common import AUTO_WINDOW
from common import (
    AUTO_MODES,
    BASELINES,
    FORCED,
    MiB,
    Bench,
    common_args,
    denormals_flushed,
    fitted_max_batch,
    fmt,
    method_name,
    model_specs,
    planned_max_batch,
    print_table,
    setup,
    standalone,
)

HEADER = ("method", "max batch", "x plain", "step ms", "samples/s", "peak MiB", "unplanned", "found by")

#: The GPU the prediction assumes (issue 23): an H100's fp32 training rate as achieved, its HBM, and
#: the pinned copy rate one measured on 2026-11-22 (53-54 GB/s each way; ``shared/gpu-2026-11-22``).
GPU = DeviceAssumption(device_type="cuda", flops_per_ms=60e9, memory_bytes_per_ms=2.5e9, d2h_bytes_per_ms=50e6, h2d_bytes_per_ms=50e6)


def unplanned(m) -> str:
    """Note [Unplanned bytes]: what stayed on the device because no action can move it, and its
    share of the saved bytes the engine saw ("-": nothing offloaded, nothing counted)."""
    if m is None or m.unplanned_bytes is None or not m.saved_bytes:
        return "-"
    return f"{m.unplanned_bytes / MiB:.2f} MiB ({100 * m.unplanned_bytes / m.saved_bytes:.1f}%)"


def run_model(spec, device, args, budgets: dict) -> list:
    """Prints the model's table; returns its rows' ``MaxBatch``. ``budgets``: name -> bytes, shared
    so a chunked-loss model is held to its plain-loss twin's budget."""
    start = time.perf_counter()
    budget_of = spec.plain_loss_name or spec.name
    if budget_of not in budgets:  # the twin has not run: measure its plain peak here
        twin = next(s for s in model_specs(args.size, [budget_of]))
        budgets[budget_of] = Bench(twin, device).measure("plain", twin.base_batch, repeats=0).peak_bytes
    bench = Bench(spec, device, steady=args.steady)
    cap = args.cap * spec.base_batch
    budget = budgets[budget_of]
    print(f"\n== {spec.name} ({spec.kind} {spec.size}, {len(bench.segments)} segments): budget {budget / MiB:.1f} MiB "
          f"= plain peak of {budget_of} (plain loss) at batch {spec.base_batch}; search capped at batch {cap}")
    results = [fitted_max_batch(bench, name, budget, cap=cap, repeats=args.repeats) for name in BASELINES]
    prof = bench.profile(spec.base_batch)
    for action in FORCED:
        found, _ = planned_max_batch(bench, prof, method_name(action), budget, mode="max", actions=(action,), cap=cap, repeats=args.repeats)
        results.append(found)
    searched = {}
    for mode in AUTO_MODES:
        found, searched[mode] = planned_max_batch(
            bench, prof, f"ours: auto {mode}", budget, mode=mode, actions=None, cap=cap, repeats=args.repeats,
        )
        if searched[mode] is not None:
            found = type(found)(found.method, found.at, f"{found.how}; {searched[mode].plan.summary()}")
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
            unplanned(m),
            r.how,
        ))
    print_table(HEADER, rows)
    print_warmups(bench, results)
    if results[0].at is not None and not args.no_check:
        check_against_alone(bench, spec, device, args, results, searched["throughput"])
    ours = results[-2].at  # auto max
    if ours is not None:
        gpu_prediction(bench, spec, budget, ours.batch_size)
    print(f"   ({time.perf_counter() - start:.0f} s)")
    return results


def print_warmups(bench, results) -> None:
    """How the reference state and each row's timed steps were warmed up (Note [Every method at
    the same steady state] in common.py)."""
    ref = bench.reference_warmup
    timings = [(r.method, r.at.timing) for r in results if r.at is not None and r.at.timing is not None]
    capped = [name for name, t in timings if not t.steady]
    steps = [t.warmup_steps for _, t in timings]
    line = f"   warm-up: the reference (plain at batch {max(2, bench.spec.base_batch)}) {ref.warmup_steps} steps" if ref else "   warm-up:"
    if steps:
        line += f"; each row {min(steps)}-{max(steps)} steps"
    print(line + (f"; not steady at the cap: {', '.join(capped)}" if capped else "; every one steady"))


#: Note [Every method at the same steady state]: plain's time here and alone agree within this.
CHECK_TOLERANCE = 0.10


def check_against_alone(bench, spec, device, args, results, searched) -> None:
    """Plain's step time in this run beside the same configuration timed alone in a fresh process
    (warmed up from its first step by the same rule), and ``auto throughput``'s samples/s ratio
    over plain at the base batch (as its search reports it) beside the same two timed in turn in
    that process: each within :data:`CHECK_TOLERANCE`, or says not. Plain is timed here again just
    before and after the fresh process (the machine's load drifts: the table's figure is minutes old)."""
    plain, chosen = results[0].at, searched.chosen_trial if searched is not None else None
    base = searched.plain_trial if searched is not None else None
    pair = ((base.batch_size, None), (chosen.batch_size, chosen.plan)) if chosen is not None and base is not None else None
    before = _plain_again(bench, plain.batch_size, args.repeats)
    alone = standalone(spec, args.size, device, args, plain.batch_size, pair)
    after = _plain_again(bench, plain.batch_size, args.repeats)
    here, fastest = (before.step_ms + after.step_ms) / 2, min(before.min_ms, after.min_ms)
    spread = abs(before.step_ms - after.step_ms) / min(before.step_ms, after.step_ms)
    print(f"   check: plain at batch {plain.batch_size}: {here:.0f} ms here ({before.step_ms:.0f} before and {after.step_ms:.0f} after "
          f"the fresh process, {100 * spread:.0f}% apart: this machine's noise; {plain.step_ms:.0f} in the table), "
          f"{alone.plain.step_ms:.0f} ms alone in a fresh process (warm-up {alone.plain.warmup_steps} steps"
          f"{'' if alone.plain.steady else ', not steady at the cap'}): {_verdict(here / alone.plain.step_ms)}; "
          f"fastest step {fastest:.0f} vs {alone.plain.min_ms:.0f} ms: {_verdict(fastest / alone.plain.min_ms)}")
    if pair is None or searched.speedup is None:
        return
    plain_ms, chosen_ms = alone.in_turn_ms
    ratio = (chosen.batch_size / chosen_ms) / (base.batch_size / plain_ms)
    print(f"   check: auto throughput {searched.speedup:.2f}x plain's samples/s at batch {base.batch_size} (its search's trials); "
          f"alone in a fresh process, the two timed in turn: {ratio:.2f}x ({chosen_ms:.0f} ms at batch {chosen.batch_size}, "
          f"{plain_ms:.0f} ms at batch {base.batch_size}): {_verdict(searched.speedup / ratio)}")


def _plain_again(bench, batch_size: int, repeats: int):
    bench._cache.pop(("plain", batch_size, None), None)
    return bench.measure("plain", batch_size, repeats=repeats).timing


def _verdict(ratio: float) -> str:
    return f"{100 * (ratio - 1):+.1f}%, {'within' if abs(ratio - 1) <= CHECK_TOLERANCE else 'NOT within'} {CHECK_TOLERANCE:.0%}"


def gpu_prediction(bench, spec, budget: int, batch: int) -> None:
    """The cost model's samples/s on the assumed GPU (:data:`GPU`) at ``batch`` (ours' largest):
    ours (the plan the planner makes there for the GPU), ``save_on_cpu`` (every saved tensor and
    every parameter copied to the host as it is saved and back when unpacked, nothing overlapped)
    and ``torch.utils.checkpoint`` on every segment. A prediction from fake-mode estimates."""
    prof = bench.profile(spec.base_batch, fake=True, assume=GPU).at_batch(batch)
    auto = {"prefetch_bytes": AUTO_WINDOW, "inflight_bytes": AUTO_WINDOW}
    try:
        plan = solve(prof, budget_bytes=budget, **auto)
    except InfeasibleBudgetError:
        plan = least_peak_plan(prof, **auto)
    moved = sum(e.saved_bytes for e, _ in prof.chain) + prof.parameter_bytes
    save_on_cpu_ms = prof.step_ms + moved / GPU.d2h_bytes_per_ms + moved / GPU.h2d_bytes_per_ms
    checkpoint_ms = simulate(prof, {n: Action.RECOMPUTE for n in prof.names}).step_ms
    print(f"   GPU PREDICTION (the cost model, not measured) at batch {batch}: assumed {GPU.flops_per_ms / 1e9:.0f} TFLOP/s, "
          f"HBM {GPU.memory_bytes_per_ms / 1e9:.1f} TB/s, pinned {GPU.d2h_bytes_per_ms / 1e6:.0f} GB/s each way")
    rows = [
        ("ours: auto max", f"{plan.predicted_step_ms:.1f}", f"{batch / plan.predicted_step_ms * 1e3:.0f}",
         f"{plan.summary()}; windows {fmt_bytes(plan.prefetch_bytes)} ahead, {fmt_bytes(plan.inflight_bytes)} in flight"),
        ("save_on_cpu", f"{save_on_cpu_ms:.1f}", f"{batch / save_on_cpu_ms * 1e3:.0f}", f"{moved / MiB:.0f} MiB each way, synchronous"),
        ("torch checkpoint", f"{checkpoint_ms:.1f}", f"{batch / checkpoint_ms * 1e3:.0f}", "every segment recomputed"),
    ]
    print_table(("method", "pred step ms", "pred samples/s", "how"), rows, indent="     ")


def fmt_bytes(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / MiB:.1f} MiB"


def compare_losses(found: dict) -> None:
    """Each chunked-loss model's largest batches beside its plain-loss twin's, same budget."""
    for name, results in found.items():
        twin = name.removesuffix("+chunked")
        if name == twin or twin not in found:
            continue
        print(f"\n== the loss: {twin} with the plain loss vs the chunked loss, same budget")
        rows = []
        for plain, chunked in zip(found[twin], results):
            a, b = plain.at, chunked.at
            capped = " (cap)" if "(cap)" in chunked.how else ""
            rows.append((plain.method, fmt(a.batch_size if a else None, "d"), fmt(b.batch_size if b else None, "d") + capped,
                         fmt(b.batch_size / a.batch_size if a and b else None, ".2f")))
        print_table(("method", "max batch, plain loss", "max batch, chunked loss", "x"), rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(parser)
    parser.add_argument("--cap", type=int, default=None, help="largest batch searched, as a multiple of the base batch")
    parser.add_argument("--no-check", action="store_true", help="skip timing plain alone in a fresh process")
    args = parser.parse_args(argv)
    size, device = setup(args)
    args.size = size
    if args.cap is None:
        args.cap = {"smoke": 4, "quick": 6, "full": 16}[size]
    names = args.models or (["gpt2-small-like", "gpt2-small-like+chunked"] if size == "smoke" else None)
    specs = model_specs(size, names) if names else model_specs(size)
    budgets: dict = {}
    with denormals_flushed(args.flush):
        found = {spec.name: run_model(spec, device, args, budgets) for spec in specs}
    compare_losses(found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
