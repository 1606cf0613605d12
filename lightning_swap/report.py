"""Pictures of what a plan does: memory timelines of plain and planned steps on one PNG.

Needs matplotlib (a dependency of the package); drawing is kept out of the core.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

from .core import format_bytes
from .core import Timeline

__all__ = ["plot_timelines"]

_MIB = 2**20


def plot_timelines(
    timelines: Sequence[Timeline],
    path: Union[str, Path],
    *,
    budget_bytes: Optional[int] = None,
    title: Optional[str] = None,
) -> Path:
    """Draw device bytes over one step for each timeline, on a shared axis where 0 is the
    step's start and 1 its end (runs differ in how many memory events they have); forward and
    backward are split at the first backward mark; the budget, if given, is a dashed line."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if not timelines:
        raise ValueError("`timelines` must not be empty.")
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    colours = ["#7f7f7f", "#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for i, tl in enumerate(timelines):
        n = max(len(tl.samples) - 1, 1)
        xs = [x / n for x, _ in tl.samples]
        ys = [b / _MIB for _, b in tl.samples]
        colour = colours[i % len(colours)]
        ax.step(xs, ys, where="post", color=colour, linewidth=1.6, label=f"{tl.label} (peak {format_bytes(tl.peak_bytes)})")
        backward = [x for x, label in tl.marks if label.startswith("B ")]
        if backward:
            ax.axvline(min(backward) / n, color=colour, linestyle=":", linewidth=1)
        for x, label in tl.marks:
            ax.plot([x / n], [tl.samples[min(x, len(tl.samples) - 1)][1] / _MIB], marker="|", color=colour, markersize=8)
    if budget_bytes is not None:
        ax.axhline(budget_bytes / _MIB, color="black", linestyle="--", linewidth=1, label=f"budget {format_bytes(budget_bytes)}")
    unit = "memory events" if timelines[0].device_type == "cpu" else "segment boundaries"
    ax.set_xlabel(f"one training step: forward, then backward (dotted line), x = fraction of {unit}")
    ax.set_ylabel("device MiB alive")
    ax.set_title(title or "lightning-swap: device memory over one step (ticks: segment boundaries)")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
