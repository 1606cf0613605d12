"""Step-time overhead against plain training as the memory budget falls: the trade-off curve.

At a fixed batch (each model's base batch), every method of ``max_batch.py`` is measured once:
its peak memory and its step time. A fixed method (a baseline or one of our forced policies)
meets a budget when its measured peak is within it. Our ``auto`` plan is solved afresh for each
budget, from the plain peak (100%) down to the smallest budget the planner can meet, and
measured; a plan measured over its budget is solved again for the amount it missed by and
measured again, as the library's check after a plan's first step does. The table gives, per budget, each method's overhead ``step / plain step - 1`` where it
meets the budget ("-" where it does not); the plot draws overhead against peak memory.

Plain training is measured twice, first and last: the difference is the timing noise. Every
method is timed at the same steady state (Note [Every method at the same steady state] in
``common.py``: denormals flushed on CPU, the same weights, a warm-up until the step time settles).

``gpt2-small-like+chunked`` is the same GPT with the library's chunked cross-entropy as its loss
(its curve is relative to its own plain step); a last line sets its plain step's time and peak
beside the plain-loss model's: what chunking the loss costs and saves before any plan.

    python benchmarks/overhead.py --quick --out benchmarks/overhead_cpu.png   # CPU, small sizes
    python benchmarks/overhead.py --out overhead_gpu.png                      # full sizes, GPU
    python benchmarks/overhead.py --smoke                                     # tiny, seconds

On a GPU it also measures the physical limit: pinned host<->device bandwidth, and the share of it
our offload reaches in a transfer-bound step (every block offloaded, little compute per byte).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from common import (
    BASELINES, FORCED, MiB, Bench, common_args, denormals_flushed, fmt, forced_plan, method_name, model_specs, print_table, setup,
)
from lightning_swap.core import Action, InfeasibleBudgetError, SwapRuntime, measure_bandwidth, min_budget_bytes, solve


def run_model(spec, device, args, plains: dict):
    """Returns (model name, plain ms, points): points are (method, peak bytes, overhead, budget or None).
    ``plains[spec.name]`` gets the faster of the two plain measurements."""
    start = time.perf_counter()
    bench = Bench(spec, device, steady=args.steady)
    batch = spec.base_batch
    plain = bench.measure("plain", batch, repeats=args.repeats)
    fixed = {name: bench.measure(name, batch, repeats=args.repeats) for name in BASELINES[1:]}
    for action in FORCED:
        fixed[method_name(action)] = bench.measure(method_name(action), batch, plan=forced_plan(bench.segments, action), repeats=args.repeats)
    prof = bench.profile(batch)
    lowest = min_budget_bytes(prof)
    budgets = [int(plain.peak_bytes - k * (plain.peak_bytes - lowest) / max(args.budgets - 1, 1)) for k in range(args.budgets)]
    auto = []
    for budget in budgets:
        try:
            plan = solve(prof, budget_bytes=budget)
        except InfeasibleBudgetError:
            auto.append((budget, None, None))
            continue
        measured = bench.measure("ours: auto", batch, plan=plan, repeats=args.repeats)
        if measured.peak_bytes > budget:
            # What the library does after a step over its budget (Note [Auto learns from the steps it
            # runs]): learn how much the prediction missed and plan again for that much less.
            correction = measured.peak_bytes - plan.predicted_peak_bytes
            try:
                plan = solve(prof, budget_bytes=budget - correction)
            except InfeasibleBudgetError:
                auto.append((budget, None, None))
                continue
            measured = bench.measure("ours: auto", batch, plan=plan, repeats=args.repeats)
        auto.append((budget, plan, measured))
    plain_again = bench._cache.pop(("plain", batch, None))  # measure plain again, last
    plain_again = bench.measure("plain", batch, repeats=args.repeats)
    plains[spec.name] = min(plain, plain_again, key=lambda m: m.step_ms)  # the less disturbed one
    plain_ms = plain.step_ms
    noise = abs(plain_again.step_ms - plain_ms) / plain_ms

    def over(m):
        return m.step_ms / plain_ms - 1

    print(f"\n== {spec.name} ({spec.kind} {spec.size}), batch {batch}: plain peak {plain.peak_bytes / MiB:.1f} MiB, "
          f"plain step {plain_ms:.0f} ms (again at the end: {plain_again.step_ms:.0f} ms, {100 * noise:.0f}% apart: the noise), "
          f"smallest budget the planner can meet {lowest / MiB:.1f} MiB ({100 * lowest / plain.peak_bytes:.0f}%)")
    print("   each method once (peak and overhead at this batch):")
    print_table(
        ("method", "peak MiB", "peak % plain", "step ms", "overhead"),
        [(name, f"{m.peak_bytes / MiB:.1f}", f"{100 * m.peak_bytes / plain.peak_bytes:.0f}%", f"{m.step_ms:.0f}", f"{100 * over(m):+.0f}%")
         for name, m in [("plain", plain), *fixed.items()]],
    )
    print("   overhead per budget (\"-\": the method's measured peak exceeds the budget):")
    names = list(fixed)
    rows = []
    for budget, plan, m in auto:
        cells = [f"{100 * over(f):+.0f}%" if f.peak_bytes <= budget else "-" for f in fixed.values()]
        if m is None:
            ours = "infeasible"
        else:
            ours = f"{100 * over(m):+.0f}%" + (" OVER" if m.peak_bytes > budget else "")
        rows.append((f"{budget / MiB:.1f}", f"{100 * budget / plain.peak_bytes:.0f}%", *cells, ours,
                     fmt(m.peak_bytes / MiB if m else None, ".1f"), plan.summary() if plan else "-"))
    print_table(("budget MiB", "%", *names, "ours: auto", "auto peak MiB", "auto plan"), rows)
    print(f"   ({time.perf_counter() - start:.0f} s)")
    points = [("plain", plain.peak_bytes, 0.0, None)]
    points += [(name, m.peak_bytes, over(m), None) for name, m in fixed.items()]
    points += [("ours: auto", m.peak_bytes, over(m), budget) for budget, _, m in auto if m is not None]
    return spec.name, plain.peak_bytes, points


def compare_losses(plains: dict) -> None:
    """Each chunked-loss model's plain step beside its plain-loss twin's (same model, same batch)."""
    for name, chunked in plains.items():
        twin = name.removesuffix("+chunked")
        if name == twin or twin not in plains:
            continue
        plain = plains[twin]
        print(f"\n== the loss: {twin} at batch {plain.batch_size}, plain training (the faster of its two measurements): "
              f"chunked loss {chunked.step_ms:.0f} ms vs "
              f"{plain.step_ms:.0f} ms with the full logits ({100 * (chunked.step_ms / plain.step_ms - 1):+.0f}%), peak "
              f"{chunked.peak_bytes / MiB:.1f} vs {plain.peak_bytes / MiB:.1f} MiB ({100 * (chunked.peak_bytes / plain.peak_bytes - 1):+.0f}%)")


def plot(curves, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(5.0 * len(curves) + 2.6, 4.6), squeeze=False)
    markers = dict(zip(["plain", *BASELINES[1:], *(method_name(a) for a in FORCED)], "o^vDsPX*"))
    for ax, (name, plain_peak, points) in zip(axes[0], curves):
        fixed = [p for p in points if p[0] != "ours: auto"]
        for method, peak, overhead, _ in fixed:
            ax.scatter(100 * peak / plain_peak, 100 * overhead, marker=markers.get(method, "o"), s=55, label=method, zorder=3)
        auto = sorted((p for p in points if p[0] == "ours: auto"), key=lambda p: -p[1])
        if auto:
            ax.plot([100 * p[1] / plain_peak for p in auto], [100 * p[2] for p in auto], "k-", lw=2, marker=".", ms=9,
                    label="ours: auto (one plan per budget)", zorder=2)
        ax.axhline(0, color="grey", lw=0.8)
        ax.invert_xaxis()
        ax.set_title(name)
        ax.set_xlabel("measured peak memory, % of plain training")
        ax.set_ylabel("step-time overhead vs plain, %")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1 - 2.5 / (5.0 * len(curves) + 2.6), 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def transfer_bound(device: torch.device, repeats: int) -> None:
    """CUDA only: pinned bandwidth, and the rate our offload reaches with little compute per byte."""
    d2h, h2d = measure_bandwidth(device)  # bytes per ms
    print(f"\n== physical limit on {torch.cuda.get_device_name(device)}: pinned device->host {d2h / 1e6:.1f} GB/s, "
          f"host->device {h2d / 1e6:.1f} GB/s")
    # Wide elementwise blocks: each saves large activations and computes little on them.
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.LayerNorm(1024)) for _ in range(8)]).to(device)
    x = torch.randn(16384, 1024, device=device)
    names = [f"{i}" for i in range(8)]
    for label, plan in (("plain", forced_plan(names, Action.KEEP)), ("offload", forced_plan(names, Action.OFFLOAD))):
        with SwapRuntime(model, plan) as runtime:
            times, moved = [], 0
            for i in range(repeats + 1):
                runtime.begin_step([x])
                model(x).float().mean().backward()
                stats = runtime.end_step()
                model.zero_grad(set_to_none=True)
                if i:
                    times.append(stats.step_ms)
                    moved = stats.offloaded_bytes + stats.fetched_bytes
        ms = sorted(times)[len(times) // 2]
        if label == "plain":
            plain_ms = ms
            continue
        reached = moved / ms
        limit = min(d2h, h2d)
        print(f"   offload step {ms:.1f} ms vs plain {plain_ms:.1f} ms, {moved / MiB:.0f} MiB moved: "
              f"{reached / 1e6:.1f} GB/s = {100 * reached / limit:.0f}% of the slower pinned direction (target 85%)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(parser)
    parser.add_argument("--budgets", type=int, default=None, help="budgets from the plain peak down to the minimum")
    parser.add_argument("--out", default=None, help="write the curve as a PNG here")
    args = parser.parse_args(argv)
    size, device = setup(args)
    if args.budgets is None:
        args.budgets = 3 if size == "smoke" else 5 if size == "quick" else 8
    gpts = ["gpt2-small-like", "gpt2-small-like+chunked"]
    names = args.models or (gpts if size == "smoke" else ["resnet50", *gpts] if size == "quick" else None)
    image = 64 if size == "quick" else None  # activations, not weights, must dominate the curve
    specs = model_specs(size, names, image=image) if names else model_specs(size)
    plains: dict = {}
    with denormals_flushed(args.flush):
        curves = [run_model(spec, device, args, plains) for spec in specs]
    compare_losses(plains)
    if args.out:
        where = "CPU, simulated budget, noisy shared machine" if device.type == "cpu" else torch.cuda.get_device_name(device)
        plot(curves, args.out, f"Memory/time trade-off at a fixed batch ({size} sizes)\n{where}; torch {torch.__version__}")
        print(f"\nplot written to {args.out}")
    if device.type == "cuda":
        transfer_bound(device, args.repeats)
    else:
        print("\nphysical limit (pinned bandwidth, offload share): skipped, needs a CUDA device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
