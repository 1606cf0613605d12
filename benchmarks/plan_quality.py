"""Plan quality: predicted vs measured peak memory and step time across budgets.

For ResNet-50 and a GPT-2-small-like model, profile one step, sweep the budget from the plain
peak down to the smallest feasible one, solve a plan per budget, run it with the runtime, and
print per budget: predicted vs measured peak, predicted vs measured step time, the actions.

    python benchmarks/plan_quality.py --quick      # small sizes, CPU, a few minutes on 2 cores
    python benchmarks/plan_quality.py              # full sizes (use a GPU)

Targets (DESIGN.md): memory within 5% on the CPU meter (10% on a GPU), time within 15% on a GPU.
On CPU the measured time is a memcpy/recompute-heavy wall clock on a shared machine; treat the
time columns there as indicative only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision
from torch.nn import functional as F

from lightning_swap.core import InfeasibleBudgetError, SwapRuntime, min_budget_bytes, profile, solve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: examples/
from examples.models import GPT  # noqa: E402 - the repository's one GPT (GPT-2 small by default)

MiB = 2**20


def configs(quick: bool, device: torch.device):
    if quick:
        gpt = dict(vocab=2048, dim=128, heads=4, layers=6, seq=128)
        yield "resnet50", lambda: torchvision.models.resnet50(num_classes=10), 8, 96, None
        yield "gpt2-small-like", lambda: GPT(**gpt), 8, gpt["seq"], gpt["vocab"]
    else:
        yield "resnet50", lambda: torchvision.models.resnet50(), 64, 224, None
        yield "gpt2-small-like", lambda: GPT(), 8, 1024, 50257


def make_batch(name: str, batch: int, size: int, vocab, device):
    g = torch.Generator().manual_seed(0)
    if vocab is None:
        x = torch.randn(batch, 3, size, size, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
    else:
        idx = torch.randint(0, vocab, (batch, size + 1), generator=g)
        x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    return x.to(device), y.to(device)


def step_fn(model, batch):
    logits = model(batch[0])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


def measure(model, plan, batch, device, repeats: int):
    """Peak from one metered step; time from ``repeats`` unmetered steps (on CPU the meter's
    dispatch mode slows every op, and the profile's times are taken without it)."""
    runtime = SwapRuntime(model, plan).install()
    times = []
    try:
        runtime.begin_step(list(batch))
        step_fn(model, batch).backward()
        peak = runtime.end_step().peak_device_bytes
        model.zero_grad(set_to_none=True)
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            step_fn(model, batch).backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
            model.zero_grad(set_to_none=True)
    finally:
        runtime.remove()
    return peak, statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes for a CPU (a few minutes on 2 cores)")
    parser.add_argument("--budgets", type=int, default=5, help="budgets from the plain peak down to the minimum")
    parser.add_argument("--repeats", type=int, default=2, help="measured steps per budget (after one warm-up)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    print(f"device {device}, torch {torch.__version__}")
    for name, build, batch_size, size, vocab in configs(args.quick, device):
        torch.manual_seed(0)
        model = build().to(device)
        batch = make_batch(name, batch_size, size, vocab, device)
        start = time.perf_counter()
        fake = profile(model, batch, step_fn=step_fn, fake=True, scale=False)
        fake_s = time.perf_counter() - start
        start = time.perf_counter()
        prof = profile(model, batch, step_fn=step_fn)
        real_s = time.perf_counter() - start
        lo = min_budget_bytes(prof)
        plain = prof.peak_bytes
        print(f"\n== {name}: batch {batch_size}, {len(prof.segments)} segments, profile {real_s:.1f} s "
              f"(fake-only {fake_s:.1f} s, fake peak {fake.peak_bytes / MiB:.1f} MiB vs real {plain / MiB:.1f} MiB)")
        print(f"   plain peak {plain / MiB:.1f} MiB, smallest feasible budget {lo / MiB:.1f} MiB ({100 * lo / plain:.0f}%)")
        print(f"   {'budget':>8} {'pred MiB':>9} {'meas MiB':>9} {'err':>7} {'pred ms':>8} {'meas ms':>8} {'err':>7}  actions")
        worst_mem = 0.0
        for k in range(args.budgets):
            budget = int(plain - k * (plain - lo) / max(args.budgets - 1, 1))
            try:
                plan = solve(prof, budget_bytes=budget)
            except InfeasibleBudgetError as err:
                print(f"   {budget / MiB:8.1f} infeasible: {err}")
                continue
            peak, ms = measure(model, plan, batch, device, args.repeats)
            mem_err = (plan.predicted_peak_bytes - peak) / peak
            worst_mem = max(worst_mem, abs(mem_err))
            time_err = (plan.predicted_step_ms - ms) / ms
            print(f"   {budget / MiB:8.1f} {plan.predicted_peak_bytes / MiB:9.1f} {peak / MiB:9.1f} {100 * mem_err:+6.1f}% "
                  f"{plan.predicted_step_ms:8.0f} {ms:8.0f} {100 * time_err:+6.1f}%  {plan.summary()}"
                  f"{'  OVER BUDGET' if peak > budget else ''}")
        print(f"   worst memory prediction error {100 * worst_mem:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
