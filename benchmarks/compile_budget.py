"""Ours beside ``torch.compile``'s activation memory budget, at matched memory (issue 23).

``torch._functorch.config.activation_memory_budget = f`` makes AOTAutograd's min-cut partitioner
recompute activations, op by op, until the saved bytes are a fraction ``f`` of what the compiled
graph would save. Our planner chooses per block (keep, recompute or selective; offload saves
nothing on a CPU, where host and device are one RAM). This script measures both on the same
model, in the same run:

- for each fraction ``f`` a fresh process compiles the model under that budget, warms up
  (compilation, AdamW's state), then runs ``--steps`` timed steps;
- right after it, another fresh process plans our ``auto`` (restricted to keep / recompute /
  selective) for the same memory: the budget is set so that our step's rise in memory matches
  the compiled step's, and runs the same number of timed steps eagerly;
- then the same plan with every block compiled on its own (``block.compile()``, regional
  compilation, which the runtime takes over: Note [Regional compilation is taken over]), at the
  compiler's default budget: ours deciding per block and per op (Note [Who decides under
  compile]), Inductor fusing what runs;
- the three alternate (compile f, ours f, ours compiled f, compile f', ...), ``--rounds`` times.

Memory is the rise of the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` after the warm-up) over its size at the start of the timed steps,
with glibc told to ``mmap`` every allocation over 64 KiB (``MALLOC_MMAP_THRESHOLD_``), so a
freed tensor leaves the resident set at once: the same yardstick for compiled and eager code
(the library's own meter is a dispatch mode, under which compiled code would run eagerly).
Time is the median of the timed steps. One thread (``--threads``).

    python benchmarks/compile_budget.py            # the setup of issue 23: 6 blocks, d=256, seq 256, batch 8
    python benchmarks/compile_budget.py --smoke    # tiny, a minute (the smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
FRACTIONS = (0.7, 0.5, 0.3, 0.1)
SIZES = {  # layers, dim, heads, seq, batch, vocab
    "default": dict(layers=6, dim=256, heads=4, seq=256, batch=8, vocab=4096),
    "smoke": dict(layers=2, dim=64, heads=2, seq=32, batch=2, vocab=256),
}


# -- the worker (one configuration, one fresh process) ---------------------------------------
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    """Reset ``VmHWM`` to the current resident set (Linux's clear_refs 5); returns that size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _worker(kind: str, fraction: float, size: dict, steps: int, target_rise: int) -> dict:
    import torch
    from torch.nn import functional as F

    sys.path.insert(0, str(ROOT))
    from examples.models import GPT
    from lightning_swap.core import Action, InfeasibleBudgetError, SwapRuntime, profile, solve

    torch.manual_seed(0)
    model = GPT(vocab=size["vocab"], dim=size["dim"], heads=size["heads"], layers=size["layers"], seq=size["seq"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, size["vocab"], (size["batch"], size["seq"]))

    def loss_of(net, batch):  # next-token prediction (the batch rolled by one as targets)
        return F.cross_entropy(net(batch).flatten(0, 1), batch.roll(-1, dims=1).flatten())

    def step(net):
        optimizer.zero_grad(set_to_none=True)
        loss_of(net, idx).backward()
        optimizer.step()

    net, runtime, info = model, None, {}
    if kind == "compile":
        torch._functorch.config.activation_memory_budget = fraction
        net = torch.compile(model)
    if kind == "ours_compiled":  # the same program as "compile", at the compiler's default budget
        net = torch.compile(model)
    for _ in range(2):  # compilation, AdamW's state
        step(net)
    if kind in ("ours", "ours_compiled"):
        # Our budget for the same rise in memory: the library's bytes of plain training less the
        # difference between plain's rise (eager, or compiled keeping every block) and the
        # compiled step's (the yardsticks differ by a constant).
        base = _reset_peak()
        step(net)
        plain_rise = _status("VmHWM") - base
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        prof = profile(model, idx, step_fn=loss_of, track=state, scale=False, device="cpu")
        budget = prof.peak_bytes - (plain_rise - target_rise)
        try:
            plan = solve(prof, budget_bytes=budget, actions=(Action.KEEP, Action.RECOMPUTE, Action.SELECTIVE))
        except InfeasibleBudgetError as err:
            return dict(kind=kind, fraction=fraction, infeasible=True, min_budget_bytes=err.min_budget_bytes, budget_bytes=budget)
        runtime = SwapRuntime(net, plan, device="cpu").install()
        info = dict(plan=plan.summary(), predicted_peak_bytes=plan.predicted_peak_bytes, budget_bytes=budget)
        for _ in range(2):  # the plan's first step (its segments' input checks), then compilation
            step(net)
    base = _reset_peak()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(net)
        times.append((time.perf_counter() - start) * 1e3)
    rise = _status("VmHWM") - base
    if runtime is not None:
        runtime.remove()
    return dict(kind=kind, fraction=fraction, step_ms=statistics.median(times), rise_bytes=rise, **info)


def _run_worker(kind: str, fraction: float, size_name: str, steps: int, threads: int, target_rise: int = 0) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, __file__, "--worker", kind, str(fraction), size_name, str(steps), str(threads), str(target_rise)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {kind} {fraction} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the comparison -----------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, about a minute")
    parser.add_argument("--fractions", type=float, nargs="+", default=None, help=f"activation memory budgets (default {FRACTIONS})")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration (median; default 7, smoke 2)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds (compile f, ours f, ...)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    size_name = "smoke" if args.smoke else "default"
    fractions = args.fractions or ((0.5,) if args.smoke else FRACTIONS)
    steps = args.steps or (2 if args.smoke else 7)
    import torch

    size = SIZES[size_name]
    print(f"torch {torch.__version__}, CPU, {args.threads} thread(s), {time.strftime('%Y-%m-%d')}; GPT {size}, "
          f"AdamW, median of {steps} warm steps, memory = rise of VmHWM over the timed steps")
    kinds = ("compile", "ours", "ours_compiled")
    rows: dict[float, dict[str, list[dict]]] = {f: {k: [] for k in kinds} for f in fractions}
    plain = _run_worker("eager", 1.0, size_name, steps, args.threads)
    for _ in range(args.rounds):
        for f in fractions:
            compiled = _run_worker("compile", f, size_name, steps, args.threads)
            rows[f]["compile"].append(compiled)
            for kind in kinds[1:]:
                rows[f][kind].append(_run_worker(kind, f, size_name, steps, args.threads, target_rise=compiled["rise_bytes"]))
    print(f"plain eager: {plain['step_ms']:.0f} ms, rise {plain['rise_bytes'] / MiB:.1f} MiB")
    print(" | ".join(("budget f", "compile ms", "compile MiB", "ours ms", "ours MiB", "ours / compile", "ours compiled ms",
                      "ours compiled MiB", "ours compiled / compile", "our plan")))
    for f in fractions:
        c = rows[f]["compile"]
        c_ms = statistics.median(r["step_ms"] for r in c)
        cells = [f"{f}", f"{c_ms:.0f}", f"{statistics.median(r['rise_bytes'] for r in c) / MiB:.1f}"]
        plan = "-"
        for kind in kinds[1:]:
            o = [r for r in rows[f][kind] if not r.get("infeasible")]
            if not o:
                low = rows[f][kind][0]
                cells += ["-", "-", f"infeasible (least {low['min_budget_bytes'] / MiB:.1f} MiB, asked {low['budget_bytes'] / MiB:.1f})"]
                continue
            o_ms = statistics.median(r["step_ms"] for r in o)
            cells += [f"{o_ms:.0f}", f"{statistics.median(r['rise_bytes'] for r in o) / MiB:.1f}", f"{o_ms / c_ms:.2f}x"]
            plan = o[0]["plan"]
        print(" | ".join(cells + [plan]))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        kind, fraction, size_name, steps, threads, target = sys.argv[2:8]
        import torch

        torch.set_num_threads(int(threads))
        print(json.dumps(_worker(kind, float(fraction), SIZES[size_name], int(steps), int(target))))
    else:
        main()
