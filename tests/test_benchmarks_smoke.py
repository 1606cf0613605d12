"""The benchmark scripts still run: each in its tiny ``--smoke`` mode (seconds, one tiny GPT).

Only that they exit 0 and print their table; no timing is asserted (benchmarks are scripts,
run by hand, see benchmarks/RESULTS.md). ``plan_quality.py`` has no tiny mode (its ``--quick``
takes minutes), so it is not run here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=BENCHMARKS.parent,
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _header(out: str, first: str) -> list[str]:
    """The columns of the first table whose header starts with ``first``."""
    line = next(line for line in out.splitlines() if line.strip().startswith(first + " "))
    return [c.strip() for c in line.split("|")]


@pytest.mark.parametrize(
    ("script", "columns"),
    [
        ("max_batch.py", ["method", "max batch", "x plain", "step ms", "samples/s", "peak MiB", "found by"]),
        ("batch_search.py", ["searcher", "batch found", "trial runs", "OOM crashes", "search wall s", "samples/s at batch", "x Lightning power"]),
    ],
)
def test_benchmark_runs_in_smoke_mode(script, columns):
    out = _run(script)
    assert _header(out, columns[0]) == columns
    assert "simulated budget" in out
    if script == "max_batch.py":  # the GPT with the chunked loss, held to the plain-loss budget
        assert "== gpt2-small-like+chunked" in out and "plain peak of gpt2-small-like (plain loss)" in out
        assert "max batch, chunked loss" in out


def test_overhead_runs_in_smoke_mode_and_plots(tmp_path):
    png = tmp_path / "curve.png"
    out = _run("overhead.py", "--out", str(png))
    assert "overhead per budget" in out and "| ours: auto |" in out
    assert "== gpt2-small-like+chunked" in out and "chunked loss" in out
    assert png.stat().st_size > 10_000


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the no-GPU path")
def test_unified_memory_benchmark_says_it_needs_a_gpu():
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "unified_memory.py")], capture_output=True, text=True, timeout=120, cwd=BENCHMARKS.parent
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "needs a CUDA GPU" in proc.stdout and "nothing measured" in proc.stdout
