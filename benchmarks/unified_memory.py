"""Unified memory against the default allocator and against pinned offload (GPU only).

1. ``um="all"`` when everything fits: the step time of every-allocation-managed training
   against torch's default allocator, for plain training (all kept) and for an all-offload
   plan. ``um="all"`` must be installed before the first CUDA allocation, so each run is its
   own process; the default runs twice (first and last), and their difference is the noise.
   Target: overhead under 3%.
2. ``um="offload"`` against pinned offload: the same all-offload plan with its host copies in
   managed buffers (prefetched before each backward) or in the pinned pool, in one process.

Safety rule: managed memory is capped at 80% of the card's free memory when the worker
starts (``um_max_bytes``), so nothing here oversubscribes the GPU; oversubscription itself is
reasoned about in README, not run.

    python benchmarks/unified_memory.py                       # ResNet-50 (224 px) and GPT-2-small-like
    python benchmarks/unified_memory.py --models resnet50 --repeats 20

Without a GPU it says so and measures nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from common import MiB, Bench, fmt, forced_plan, model_specs, print_table
from lightning_swap.core import Action, install_unified_memory

_MODELS = ("resnet50", "gpt2-small-like")


def _cap() -> int:
    free, _ = torch.cuda.mem_get_info()
    return int(free * 0.8)


def worker(mode: str, name: str, repeats: int) -> dict:
    """One process: ``mode`` is "off" or "all"; measures keep and offload plans."""
    unified = install_unified_memory("all", "cuda", max_bytes=_cap()) if mode == "all" else None
    spec = model_specs("full", [name])[0]
    bench = Bench(spec, torch.device("cuda"), unified=unified)
    out = {}
    for action in (Action.KEEP, Action.OFFLOAD):
        m = bench.measure(action.value, spec.base_batch, plan=forced_plan(bench.segments, action), repeats=repeats)
        out[action.value] = {"ms": m.step_ms, "peak": m.peak_bytes}
    if unified is not None:
        s = unified.stats()
        out["managed_peak"] = s.peak_managed_bytes
        out["refused"] = s.refused_allocations
    return out


def offload_compare(name: str, repeats: int) -> list:
    spec = model_specs("full", [name])[0]
    bench = Bench(spec, torch.device("cuda"))
    plan = forced_plan(bench.segments, Action.OFFLOAD)
    plain = bench.measure("plain", spec.base_batch, repeats=repeats)
    pinned = bench.measure("offload (pinned)", spec.base_batch, plan=plan, repeats=repeats)
    bench.unified = install_unified_memory("offload", "cuda", max_bytes=_cap())
    try:
        before = bench.unified.stats()
        managed = bench.measure("offload (um)", spec.base_batch, plan=plan, repeats=repeats)
        after = bench.unified.stats()
    finally:
        bench.unified.close()
        bench.unified = None
    steps = repeats + 1
    prefetched = (after.prefetched_to_device_bytes + after.prefetched_to_host_bytes
                  - before.prefetched_to_device_bytes - before.prefetched_to_host_bytes) / steps
    pinned_again = bench.measure("offload (pinned) again", spec.base_batch, plan=plan, repeats=repeats)
    return [
        (name, "plain", f"{plain.peak_bytes / MiB:.0f}", fmt(plain.step_ms, ".1f"), "-", "-"),
        (name, "offload, pinned", f"{pinned.peak_bytes / MiB:.0f}", fmt(pinned.step_ms, ".1f"), f"{pinned.step_ms / plain.step_ms:.3f}", "-"),
        (name, "offload, um='offload'", f"{managed.peak_bytes / MiB:.0f}", fmt(managed.step_ms, ".1f"),
         f"{managed.step_ms / plain.step_ms:.3f}", f"{prefetched / MiB:.0f}"),
        (name, "offload, pinned again", f"{pinned_again.peak_bytes / MiB:.0f}", fmt(pinned_again.step_ms, ".1f"),
         f"{pinned_again.step_ms / plain.step_ms:.3f}", "-"),
    ]


def _spawn(mode: str, name: str, repeats: int) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", mode, "--models", name, "--repeats", str(repeats)],
        capture_output=True, text=True, timeout=600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"worker {mode} {name} failed:\n{proc.stderr[-4000:]}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(_MODELS), help=f"subset of {list(_MODELS)}")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per measurement (median)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("unified_memory.py needs a CUDA GPU (managed memory); none here: nothing measured.")
        return 0
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.models[0], args.repeats)))
        return 0
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{time.strftime('%Y-%m-%d')}, median of {args.repeats} steps, um_max_bytes = 80% of free memory")
    rows = []
    for name in args.models:
        off1, on1, off2, on2 = (_spawn(mode, name, args.repeats) for mode in ("off", "all", "off", "all"))
        for action in ("keep", "offload"):
            off = min(off1[action]["ms"], off2[action]["ms"])
            on = min(on1[action]["ms"], on2[action]["ms"])
            noise = abs(off1[action]["ms"] - off2[action]["ms"]) / off
            rows.append((name, action, f"{off:.1f}", f"{on:.1f}", f"{100 * (on / off - 1):+.1f}%", f"{100 * noise:.1f}%",
                         f"{on1[action]['peak'] / MiB:.0f}", f"{on1['managed_peak'] / MiB:.0f}", str(on1["refused"])))
    print("\n1. um='all' vs the default allocator, everything fits (best of two processes each)")
    print_table(("model", "plan", "default ms", "um=all ms", "overhead", "noise (default twice)",
                 "peak MiB", "managed peak MiB", "refused allocs"), rows)
    rows = []
    for name in args.models:
        rows += offload_compare(name, args.repeats)
    print("\n2. um='offload' vs pinned offload (one process)")
    print_table(("model", "method", "peak MiB", "step ms", "x plain", "prefetched MiB/step"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
