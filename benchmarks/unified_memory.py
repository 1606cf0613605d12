"""Unified memory against the default allocator and against pinned offload (GPU only).

1. ``um="all"`` when everything fits: the step time of every-allocation-managed training against
   torch's default allocator, for plain training (all kept) and for an all-offload plan. Per model
   three processes: default allocator, ``um="all"``, default again (the noise). ``um="all"`` must
   be installed before the first CUDA allocation, which is one reason for a process each.
   Target: overhead under 3%.
2. ``um="offload"`` against pinned offload: the same all-offload plan with its host copies in
   managed buffers (prefetched before each backward) or in the pinned pool. Per model three
   processes: pinned (and plain, for "x plain"), ``um="offload"``, pinned again.

Sizes (``common.model_specs("full")``): ResNet-50 at 224 px, batch 32; GPT-2-small-like (12 layers,
768 wide, 1024 tokens), batch 8. Each measurement: one metered step, then ``--steps`` timed steps
(default 5, at most 20), median.

Run time, bounded by construction. The first version's section 2 had not finished after 200 s on
an H100 (gpu-2026-11-22/um.log). Read from its code, not measured: it ran in the parent process with
no limit of any kind, after section 1's eight worker processes; per model it built the full-size
model and measured plain, pinned offload, ``um="offload"`` and pinned again, each 1 + 10 steps,
printing nothing until everything was done; and a ``um="offload"`` step moves each offloaded byte
through the driver three times (prefetch to host after the copy, to the device before backward, to
the host again after), which at full size may take seconds per step. Which of these took the time
is what this version's per-row wall times will show. Now:

- each configuration runs in its own process, killed at ``--process-timeout-s`` (50 s) or at its
  section's deadline, whichever comes first;
- each section has ``--section-budget-s`` (80 s); a configuration is not started with less than
  15 s of it left, and is listed as skipped;
- every measurement is printed (and flushed) the moment its process reports it, so a timeout leaves
  what was measured, and the wall time of each says which configuration is slow.

With the defaults both sections end within 2 x 80 s of the first worker's start: under 3 minutes.

Safety rule: managed memory is capped at 80% of the card's free memory when the worker starts
(``um_max_bytes``), so nothing here oversubscribes the GPU; oversubscription is reasoned about in
``docs/unified-memory.md``, not run.

    python benchmarks/unified_memory.py
    python benchmarks/unified_memory.py --models resnet50 --steps 10 --section-budget-s 120

Without a GPU it says so and measures nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional

import torch

from common import MiB, Bench, forced_plan, model_specs, print_table
from lightning_swap.core import Action, install_unified_memory

_MODELS = ("resnet50", "gpt2-small-like")
_MAX_STEPS = 20
_MIN_START_S = 15.0  # less than this left in a section: a process would measure nothing

#: section -> (title, configurations in order, columns of the rows printed as they come)
_SECTIONS = {
    "all": (
        "1. um='all' vs the default allocator, everything fits (one process per row group)",
        ("default", "um=all", "default again"),
        ("model", "allocator", "plan", "step ms", "peak MiB", "wall s"),
    ),
    "offload": (
        "2. um='offload' vs pinned offload, all-offload plan (one process per row group)",
        ("pinned", "um=offload", "pinned again"),
        ("model", "method", "step ms", "peak MiB", "prefetched MiB/step", "wall s"),
    ),
}
_WIDTHS = (16, 22, 9, 9, 19, 6)


def _cap() -> int:
    free, _ = torch.cuda.mem_get_info()
    return int(free * 0.8)


# -- worker: one configuration, one process ---------------------------------------------------
def _emit(kind: str, payload: dict) -> None:
    print(kind + " " + json.dumps(payload), flush=True)


def _measure(bench: Bench, method: str, plan: Any, steps: int) -> tuple[Any, float]:
    start = time.perf_counter()
    m = bench.measure(method, bench.spec.base_batch, plan=plan, repeats=steps)
    return m, time.perf_counter() - start


def worker(section: str, config: str, name: str, steps: int) -> None:
    """Prints ``ROW {json}`` after each measurement and ``DONE {json}`` at the end."""
    spec = model_specs("full", [name])[0]
    cuda = torch.device("cuda")
    if section == "all":
        unified = install_unified_memory("all", "cuda", max_bytes=_cap()) if config == "um=all" else None
        bench = Bench(spec, cuda, unified=unified)
        for action in (Action.KEEP, Action.OFFLOAD):
            m, wall = _measure(bench, action.value, forced_plan(bench.segments, action), steps)
            _emit("ROW", dict(plan=action.value, ms=m.step_ms, peak=m.peak_bytes, wall_s=wall))
        done: dict = {}
        if unified is not None:
            s = unified.stats()
            done = dict(managed_peak=s.peak_managed_bytes, refused=s.refused_allocations, reclaims=s.reclaims)
        _emit("DONE", done)
        return
    bench = Bench(spec, cuda)
    plan = forced_plan(bench.segments, Action.OFFLOAD)
    if config == "pinned":
        m, wall = _measure(bench, "plain", None, steps)
        _emit("ROW", dict(method="plain", ms=m.step_ms, peak=m.peak_bytes, wall_s=wall))
    if config in ("pinned", "pinned again"):
        m, wall = _measure(bench, "offload (pinned)", plan, steps)
        _emit("ROW", dict(method=f"offload, {config}", ms=m.step_ms, peak=m.peak_bytes, wall_s=wall))
    else:
        bench.unified = install_unified_memory("offload", "cuda", max_bytes=_cap())
        try:
            before = bench.unified.stats()
            m, wall = _measure(bench, "offload (um)", plan, steps)
            after = bench.unified.stats()
        finally:
            bench.unified.close()
        moved = (after.prefetched_to_device_bytes + after.prefetched_to_host_bytes
                 - before.prefetched_to_device_bytes - before.prefetched_to_host_bytes)
        _emit("ROW", dict(method="offload, um='offload'", ms=m.step_ms, peak=m.peak_bytes, wall_s=wall,
                          prefetched_per_step=moved / (steps + 1), refused=after.refused_allocations))
    _emit("DONE", {})


# -- parent: processes under a deadline, rows as they come ------------------------------------
def _run_worker(cmd: list[str], timeout_s: float, on_row: Callable[[dict], None]) -> tuple[str, Optional[dict], str]:
    """Runs ``cmd``, calling ``on_row`` per ``ROW`` line as it arrives; kills its process group at
    ``timeout_s``. Returns the status ("done", "failed", "timed out"), the ``DONE`` payload and the
    tail of its stderr."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        lines: queue.Queue = queue.Queue()

        def read() -> None:
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        done, status = None, "failed"
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                status = "timed out"
                break
            if line is None:
                break
            kind, _, payload = line.strip().partition(" ")
            if kind == "ROW":
                on_row(json.loads(payload))
            elif kind == "DONE":
                done = json.loads(payload)
        if status == "timed out":
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session: only what we started
        rc = proc.wait()
        if status != "timed out":
            status = "done" if rc == 0 and done is not None else "failed"
        err.seek(0)
        return status, done, err.read()[-1500:]


def _worker_cmd(section: str, config: str, name: str, steps: int) -> list[str]:
    return [sys.executable, __file__, "--worker", f"{section}:{config}", "--models", name, "--steps", str(steps)]


def _line(cells: tuple, indent: str = "   ") -> None:
    print(indent + " | ".join(str(c).ljust(w) for c, w in zip(cells, _WIDTHS)).rstrip(), flush=True)


def _fmt_ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def run_section(section: str, models: list[str], steps: int, budget_s: float, process_timeout_s: float) -> dict:
    """Runs every configuration of ``section`` for ``models`` within ``budget_s``; prints each row
    as it comes. Returns {(model, config): {"rows": [...], "done": {...} or None, "status": str}}."""
    title, configs, columns = _SECTIONS[section]
    print(f"\n{title}; budget {budget_s:.0f} s, at most {process_timeout_s:.0f} s per process", flush=True)
    _line(columns)
    print("   " + "-|-".join("-" * w for w in _WIDTHS[: len(columns)]), flush=True)
    deadline = time.monotonic() + budget_s
    results: dict = {}
    for name in models:
        for config in configs:
            left = deadline - time.monotonic()
            if left < _MIN_START_S:
                print(f"   skipped {name} / {config}: the section's budget of {budget_s:.0f} s is spent", flush=True)
                continue
            rows: list = []

            def on_row(row: dict, name: str = name, config: str = config, rows: list = rows) -> None:
                rows.append(row)
                if section == "all":
                    _line((name, config, row["plan"], _fmt_ms(row["ms"]), f"{row['peak'] / MiB:.0f}", f"{row['wall_s']:.1f}"))
                else:
                    moved = row.get("prefetched_per_step")
                    _line((name, row["method"], _fmt_ms(row["ms"]), f"{row['peak'] / MiB:.0f}",
                           "-" if moved is None else f"{moved / MiB:.0f}", f"{row['wall_s']:.1f}"))

            cmd = _worker_cmd(section, config, name, steps)
            started = time.monotonic()
            status, done, err = _run_worker(cmd, min(process_timeout_s, left), on_row)
            if status != "done":
                print(f"   ! {name} / {config}: {status} after {time.monotonic() - started:.0f} s, "
                      f"{len(rows)} measurement(s) printed above", flush=True)
                if status == "failed":
                    print("     " + "\n     ".join(err.strip().splitlines()[-8:]), flush=True)
            results[(name, config)] = {"rows": rows, "done": done, "status": status}
    return results


def _ms(results: dict, name: str, config: str, key: str, value: str) -> Optional[float]:
    for row in results.get((name, config), {}).get("rows", []):
        if row.get(key) == value:
            return row["ms"]
    return None


def summarize_all(results: dict, models: list[str]) -> None:
    rows = []
    for name in models:
        done = (results.get((name, "um=all")) or {}).get("done") or {}
        for plan in ("keep", "offload"):
            d1, on, d2 = (_ms(results, name, c, "plan", plan) for c in ("default", "um=all", "default again"))
            defaults = [d for d in (d1, d2) if d]
            off = min(defaults) if defaults else None
            overhead = f"{100 * (on / off - 1):+.1f}%" if on and off else "-"
            noise = f"{100 * abs(d1 - d2) / off:.1f}%" if d1 and d2 else "-"
            managed = f"{done['managed_peak'] / MiB:.0f}" if "managed_peak" in done else "-"
            rows.append((name, plan, _fmt_ms(off), _fmt_ms(on), overhead, noise, managed,
                         str(done.get("refused", "-")), str(done.get("reclaims", "-"))))
    print("\n   summary 1 (default: the better of its two processes; '-': not measured)")
    print_table(("model", "plan", "default ms", "um=all ms", "overhead", "noise (default twice)",
                 "managed peak MiB", "refused allocs", "reclaims"), rows)


def summarize_offload(results: dict, models: list[str]) -> None:
    rows = []
    for name in models:
        plain = _ms(results, name, "pinned", "method", "plain")
        for config, method in (("pinned", "offload, pinned"), ("um=offload", "offload, um='offload'"),
                               ("pinned again", "offload, pinned again")):
            ms = _ms(results, name, config, "method", method)
            rows.append((name, method, _fmt_ms(ms), f"{ms / plain:.3f}" if ms and plain else "-"))
    print("\n   summary 2 ('x plain': against plain training measured in the first process)")
    print_table(("model", "method", "step ms", "x plain"), rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(_MODELS), help=f"subset of {list(_MODELS)}")
    parser.add_argument("--steps", type=int, default=5, help=f"timed steps per measurement, median (1 to {_MAX_STEPS})")
    parser.add_argument("--section-budget-s", type=float, default=80.0, help="wall-clock budget of each section")
    parser.add_argument("--process-timeout-s", type=float, default=50.0, help="wall-clock limit of each process")
    parser.add_argument("--sections", nargs="+", default=list(_SECTIONS), choices=list(_SECTIONS))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 1 <= args.steps <= _MAX_STEPS:
        parser.error(f"--steps must be between 1 and {_MAX_STEPS}; got {args.steps}")
    unknown = [m for m in args.models if m not in _MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {list(_MODELS)}")
    if not torch.cuda.is_available():
        print("unified_memory.py needs a CUDA GPU (managed memory); none here: nothing measured.")
        return 0
    if args.worker:
        section, config = args.worker.split(":", 1)
        worker(section, config, args.models[0], args.steps)
        return 0
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{time.strftime('%Y-%m-%d')}; ResNet-50 224 px batch 32, GPT-2-small-like 1024 tokens batch 8; "
          f"1 metered + {args.steps} timed steps (median); um_max_bytes = 80% of free memory", flush=True)
    started = time.monotonic()
    summaries = {"all": summarize_all, "offload": summarize_offload}
    for section in args.sections:
        results = run_section(section, args.models, args.steps, args.section_budget_s, args.process_timeout_s)
        summaries[section](results, args.models)
    print(f"\ntotal {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
