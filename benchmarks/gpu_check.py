"""One command for the minutes a GPU is at hand (issue 42, item 7): the ``cuda``-marked tests and
the questions the CPU cannot answer, within 8 minutes on an H100 / H200, written as a RESULTS.md
section (device, torch, date, figures) to ``--out`` (default ``$OUT``, else ``./gpu_out``) and to
stdout; each part's output is logged there too (``<part>.log``).

    python benchmarks/gpu_check.py              # on the GPU machine
    python benchmarks/gpu_check.py --dry-run    # anywhere, in a second: what would run, the flags each
                                                # part passes checked against its script, the section
                                                # marked "dry run" (the suite runs this)

The parts, each the existing benchmark run as its own process with a time limit (a part that
fails, or whose limit comes, is reported as such with its log's last lines, and the others still
run; a part that would start with less than its least time left is skipped, saying so):

1. ``tests``: ``pytest -m cuda`` on the test files that mark tests ``cuda``;
2. ``offload``: ``engine_gpu.py`` (plain, offload) on GPT-2 small (bf16) and ResNet-50: offload's
   step over the copy-bound time, max(plain's step, offloaded bytes / pinned D2H bandwidth), target 1.15;
3. ``max_batch``: ``max_batch.py`` on ResNet-50 and the GPT-2-small-like model, one process each:
   the largest batch of plain, torch checkpoint, ``save_on_cpu``, each forced policy and ``auto``,
   under plain's peak at the base batch (the search capped at 4x it);
4. ``dynamic``: ``dynamic_shapes.py --device cuda --no-fsdp``: ``auto``'s time over the fastest
   uniform plan that fits, under dynamic padding, at 0.6 / 0.8 / 1.2 x plain's peak;
5. ``compile``: ``compile_budget.py --device cuda --fractions 0.7 0.3``: our plan on the compiled
   model beside ``torch.compile``'s activation memory budget, at the same memory.

Note [A GPU's free memory is the limit]: the machine may be shared, and a program that asks for
more CUDA managed memory than the card has free can hang the GPU, not only itself. No part asks
for managed memory but the unified-memory tests, which cap it at the free memory less a margin
(``_cap_bytes`` in ``tests/engine/test_unified.py``); the benchmarks run without unified memory.
This process reads the device in a child process (a CUDA context here would hold memory for the
whole run) and runs nothing when less than :data:`MIN_FREE_BYTES` is free.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
#: The whole check's limit (the issue's 8 minutes, less what starting and reading the device take).
TOTAL_S = 460
MIN_FREE_BYTES = 16 << 30
GiB = 2**30
PY = sys.executable


@dataclass(frozen=True, kw_only=True)
class Part:
    """One question: the processes that answer it (each ``(script or None, args)``; ``None`` runs
    ``python -m``), the seconds each may take, the least worth starting, and what to read from
    its output (:func:`figures` functions: text in, lines out)."""

    name: str
    question: str
    runs: tuple[tuple[Optional[str], tuple[str, ...]], ...]
    limit_s: int
    least_s: int
    read: Callable[[str, Path], list[str]]


# -- reading the outputs ----------------------------------------------------------------------------
def table(text: str, *first: str) -> list[dict[str, str]]:
    """The rows of the first table (``a | b | c``) whose header begins with the cells ``first``, as
    dicts by header (``[]`` when there is none)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        header = [c.strip() for c in line.split("|")]
        if len(header) < 2 or tuple(header[: len(first)]) != first:
            continue
        rows = []
        for row in lines[i + 1:]:
            cells = [c.strip() for c in row.split("|")]
            if row.strip() and set(row.strip()) <= set("-|"):
                continue  # the dashes under the header
            if len(cells) != len(header):
                break
            rows.append(dict(zip(header, cells)))
        return rows
    return []


def sections(text: str) -> dict[str, str]:
    """The text after each ``== name`` line, up to the next (``== gpt2`` -> its lines)."""
    parts = re.split(r"^\s*== (\S+).*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def tests_figures(text: str, logs: Path) -> list[str]:
    """Counts from pytest's JUnit XML, and each test that failed."""
    path = logs / "cuda_tests.xml"
    if not path.exists():
        return []
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    out = [f"{total - failed - skipped} passed, {failed} failed, {skipped} skipped (pytest -m cuda, {suite.get('time', '?')} s)"]
    for case in suite.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            out.append(f"FAILED {case.get('classname')}::{case.get('name')}")
    return out


def offload_figures(text: str, logs: Path) -> list[str]:
    """engine_gpu.py: per model, offload's step over the copy-bound time, and the rows measured."""
    out = [line.strip() for line in text.splitlines() if line.startswith("pinned device-to-host bandwidth")]
    for model, body in sections(text).items():
        rows = {r["method"]: r for r in table(body, "method", "ms")}
        measured = ", ".join(f"{m} {r['ms']} ms, peak {r['peak GiB']} GiB" for m, r in rows.items() if r.get("ms", "-") != "-")
        bound = [line.strip() for line in body.splitlines() if line.strip().startswith("offload / max(")]
        out.append(f"{model}: " + "; ".join(bound or ["offload / copy-bound: not measured"]) + (f" ({measured})" if measured else ""))
    return out


def max_batch_figures(text: str, logs: Path) -> list[str]:
    """max_batch.py: per model, each method's largest batch (and samples/s there)."""
    out = []
    for model, body in sections(text).items():
        rows = table(body, "method", "max batch")
        if rows:
            out.append(f"{model}: " + ", ".join(f"{r['method']} {r['max batch']} ({r['samples/s']}/s)" for r in rows))
    return out


def dynamic_figures(text: str, logs: Path) -> list[str]:
    """dynamic_shapes.py: per budget, auto over the fastest uniform plan that fits, and over plain."""
    out = []
    for r in table(text, "budget", "fastest uniform that fits"):
        uniform = next((v for k, v in r.items() if k.startswith("auto / uniform")), "-")
        plain = next((v for k, v in r.items() if k.startswith("auto / plain")), "-")
        out.append(f"{r['budget']}: auto / {r.get('fastest uniform that fits', '?')} = {uniform}; auto / plain {plain}; "
                   f"over budget: {next((v for k, v in r.items() if k.startswith('largest over budget')), '-')}")
    return out


def compile_figures(text: str, logs: Path) -> list[str]:
    """compile_budget.py: per fraction, the two rises in memory and ours / compile stepping in turn."""
    out = [line.strip() for line in text.splitlines() if line.startswith("plain eager:")]
    for r in table(text, "budget f", "compile MiB", "ours MiB"):
        if "ours / compile beside" in r:
            out.append(f"f={r['budget f']}: compile {r['compile MiB']} MiB, ours {r['ours MiB']} MiB; ours / compile beside "
                       f"{r['ours / compile beside']} ({r['compile ms beside']} vs {r['ours ms beside']} ms); plan {r['our plan']}")
    return out


def _cuda_test_files() -> tuple[str, ...]:
    """The test files that mark a test ``cuda`` (a decorator or ``pytestmark`` at a line's start)."""
    mark = re.compile(r"^\s*(@pytest\.mark\.cuda\b|pytestmark\s*=.*\bmark\.cuda\b)", re.M)
    return tuple(sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py") if mark.search(p.read_text())))


def parts(logs: Path) -> list[Part]:
    return [
        Part(name="tests", question="the cuda-marked tests", least_s=30, limit_s=100, read=tests_figures, runs=((None, (
            "pytest", "-q", "-m", "cuda", "-o", "addopts=", "-p", "no:cacheprovider", "--junitxml", str(logs / "cuda_tests.xml"),
            *_cuda_test_files())),)),
        Part(name="offload", question="offload's step over the copy-bound time (target <= 1.15)", least_s=40, limit_s=85,
             read=offload_figures, runs=(("engine_gpu.py", (
                 "--models", "gpt2", "resnet50", "--methods", "plain", "offload", "--steps", "8", "--warmup", "3", "--timeout", "38")),)),
        Part(name="max_batch", question="the largest batch: plain, torch checkpoint, save_on_cpu, ours", least_s=40, limit_s=60,
             read=max_batch_figures, runs=tuple(
                 ("max_batch.py", ("--models", model, "--cap", "4", "--repeats", "3", "--no-check"))
                 for model in ("resnet50", "gpt2-small-like"))),
        Part(name="dynamic", question="auto over the fastest uniform plan, dynamic padding", least_s=30, limit_s=60,
             read=dynamic_figures, runs=(("dynamic_shapes.py", ("--device", "cuda", "--no-fsdp")),)),
        Part(name="compile", question="ours beside torch.compile's memory budget at 0.7 / 0.3", least_s=40, limit_s=95,
             read=compile_figures, runs=(("compile_budget.py", ("--device", "cuda", "--fractions", "0.7", "0.3")),)),
    ]


# -- running ------------------------------------------------------------------------------------------
def _command(script: Optional[str], args: tuple[str, ...]) -> list[str]:
    return [PY, "-m", *args] if script is None else [PY, str(BENCHMARKS / script), *args]


def _run(cmd: list[str], log, limit_s: float) -> str:
    """``cmd`` with its output appended to ``log``; at ``limit_s`` its whole process group (workers
    included) is killed. Returns how it ended: ``done``, ``exit N`` or ``timed out after N s``."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # this process's own child and its workers, nothing else
        proc.wait()
        return f"timed out after {limit_s:.0f} s"
    return "done" if code == 0 else f"exit {code}"


def run_part(part: Part, logs: Path, left_s: float) -> dict:
    """The part's processes, each within its limit and what is left; its figures from the log."""
    path = logs / f"{part.name}.log"
    ended, start = [], time.monotonic()
    with open(path, "w") as log:
        for script, args in part.runs:
            left = left_s - (time.monotonic() - start)
            if left < part.least_s / len(part.runs):
                ended.append(f"skipped {script or ' '.join(args[:1]) or 'it'}: {left:.0f} s left, {part.least_s} s wanted")
                continue
            ended.append(_run(_command(script, args), log, min(part.limit_s, left)))
    text = path.read_text()
    try:
        found = part.read(text, logs)
    except Exception as exc:  # noqa: BLE001 - a part whose output cannot be read is reported, the others still run
        found = [f"its output could not be read: {type(exc).__name__}: {exc}"]
    if not found or any(e != "done" for e in ended):
        found += [f"log: {line}" for line in text.strip().splitlines()[-6:]]
    return dict(name=part.name, question=part.question, ended=ended, seconds=time.monotonic() - start, figures=found)


def device_info() -> dict:
    """The device as a child process sees it (no CUDA context in this one: the Note)."""
    code = (
        "import json, torch\n"
        "d = {'torch': torch.__version__, 'cuda': torch.version.cuda, 'available': torch.cuda.is_available()}\n"
        "if d['available']:\n"
        "    free, total = torch.cuda.mem_get_info()\n"
        "    d.update(name=torch.cuda.get_device_name(), free=free, total=total)\n"
        "print(json.dumps(d))"
    )
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {"error": done.stderr[-500:]}


def _commit() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown (no git here)"


# -- the dry run --------------------------------------------------------------------------------------
def _flags_of(script: str) -> set[str]:
    """Every ``--flag`` the script's argument parser declares, with ``common.py``'s shared ones
    (``common_args``) when it reads them (from the sources: nothing is run)."""
    sources = [(BENCHMARKS / script).read_text()]
    sources += [(BENCHMARKS / "common.py").read_text()] if "common_args(" in sources[0] else []
    return {
        a.value for text in sources for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
        for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")
    }


def dry_part(part: Part) -> dict:
    """What the part would run, and every flag it passes that its script does not declare."""
    missing, runs = [], []
    for script, args in part.runs:
        runs.append(f"`{' '.join([script or 'python -m', *args])}`".replace(str(ROOT) + "/", ""))
        if script is not None:
            missing += [f"{script} {flag}" for flag in args if flag.startswith("--") and flag not in _flags_of(script)]
    found = [f"dry run: would run {'; '.join(runs)} (limit {part.limit_s} s each)"]
    found += [f"MISSING FLAG {m}" for m in missing]
    return dict(name=part.name, question=part.question, ended=["dry run"], seconds=0.0, figures=found, missing=missing)


# -- the section --------------------------------------------------------------------------------------
def render(results: list[dict], device: dict, *, dry: bool, total_s: float) -> str:
    date = time.strftime("%Y-%m-%d %H:%M")
    if dry:
        where = f"dry run on {os.uname().nodename}: nothing ran, no device read"
    elif "name" in device:
        where = f"{device['name']}, {device['total'] / GiB:.1f} GiB ({device['free'] / GiB:.1f} GiB free at the start)"
    else:
        where = f"no CUDA device ({device.get('error', 'torch sees none')})"
    torch_version = device.get("torch") or importlib.metadata.version("torch")
    lines = [
        f"## {date[:10]}: GPU check{' (DRY RUN: no figures)' if dry else ''} (`benchmarks/gpu_check.py`)",
        "",
        f"**Where.** {where}; torch {torch_version}" + (f" (CUDA {device['cuda']})" if device.get("cuda") else "")
        + f", commit {_commit()}, {date}; {total_s:.0f} s in all (limit {TOTAL_S} s). Each part's output: `<part>.log`.",
        "",
        "| part | question | how it ended | s |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['name']} | {r['question']} | {'; '.join(r['ended'])} | {r['seconds']:.0f} |" for r in results]
    for r in results:
        lines += ["", f"**{r['name']}**", ""] + [f"- {f}" for f in r["figures"] or ["no figures"]]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_out"),
                        help="where the section and the logs go (default $OUT, else ./gpu_out)")
    parser.add_argument("--dry-run", action="store_true", help="run nothing: the plan, the flags checked, the section marked dry run")
    parser.add_argument("--only", nargs="+", default=None, choices=("tests", "offload", "max_batch", "dynamic", "compile"),
                        help="these parts only")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = [p for p in parts(args.out) if args.only is None or p.name in args.only]
    start = time.monotonic()
    if args.dry_run:
        results, device = [dry_part(p) for p in chosen], {}
    else:
        device = device_info()
        if not device.get("available") or device.get("free", 0) < MIN_FREE_BYTES:
            results = [dict(name="all", question="a CUDA device with enough free memory (the Note)", seconds=0.0,
                            ended=[f"nothing run: {device}"], figures=[])]
        else:
            results = []
            for part in chosen:
                result = run_part(part, args.out, TOTAL_S - (time.monotonic() - start))
                print(f"{part.name}: {'; '.join(result['ended'])} ({result['seconds']:.0f} s)", flush=True)
                results.append(result)
    text = render(results, device, dry=args.dry_run, total_s=time.monotonic() - start)
    (args.out / "gpu_check_section.md").write_text(text)
    print(text)
    return 1 if any(r.get("missing") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
