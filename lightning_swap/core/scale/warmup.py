"""Warm-up until the step time is steady, before a step time is read as a cost.

Note [Steady before timing]: the first steps of training can be several times slower than the
steps after them for reasons no plan causes. On a CPU, denormal floats: a GPT that starts with
wide logits has ~40% of its softmax gradient denormal at initialisation and none of it after
~15 SGD steps, and a core that traps on denormals pays for every one (plain steps of 616, 595,
583, 577, 562, 551, 532, 504, 448, 367, 288, 214, 156, 127, 115, 109 ms, then ~100: the series
the tests replay; none of that with ``torch.set_flush_denormal``). On any device, the
allocator's first growth and each kernel's first call. A step timed in those steps is charged
for them, and candidates timed one after another are charged unequally (the first one most): a
throughput search that times plain training first and its candidates later credits them with
the transient's decay (a GPT whose steady ratio is ~1x read as 5x).

So a step time is read only once the step time has settled: a series of step times is *steady*
when the median of its last ``window`` times is within ``tolerance`` of the median of the
``window`` times two windows before (the last ``3 * window`` steps: oldest window, a window
skipped, newest window). Medians, so one step slowed by a neighbour on a shared machine does not
hold the warm-up up; windows ``2 * window`` steps apart, so that a slow drift is seen: the series
above falls ~2% a step at its start, where the spread of one window (616-577 ms: 7%) would call
it steady, and adjacent windows of 4 can be 4% apart while the decay goes on. The warm-up ends
there or after ``max_steps``. On a GPU the denormal part does not arise (NVIDIA GPUs compute
fp32 denormals at full rate) and the rule ends after ``3 * window`` steps once the first calls
are over. ``benchmarks/common.py`` times every benchmark's methods by the same rule.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SteadyRule"]


@dataclass(frozen=True, kw_only=True)
class SteadyRule:
    """When a series of step times is steady (Note [Steady before timing])."""

    #: Steps per window: the last ``window`` steps are compared with those ``2 * window`` before.
    window: int = 4
    #: How far apart the two windows' medians may be, as a fraction of the smaller.
    tolerance: float = 0.05
    #: The warm-up ends here even if the times never settle (a machine shared with other work).
    max_steps: int = 24

    def __post_init__(self) -> None:
        for name in ("window", "max_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1; got {value!r}.")
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, (int, float)) or not 0 <= self.tolerance < 1:
            raise ValueError(f"`tolerance` must be a number in [0, 1); got {self.tolerance!r}.")

    def steady(self, times_ms: Sequence[float]) -> bool:
        """Whether the last ``window`` times' median is within ``tolerance`` of the median of the
        ``window`` times two windows before (``False`` while there are fewer than three windows)."""
        k = self.window
        if len(times_ms) < 3 * k:
            return False
        last, before = statistics.median(times_ms[-k:]), statistics.median(times_ms[-3 * k : -2 * k])
        return max(last, before) <= (1 + self.tolerance) * min(last, before)

    def done(self, times_ms: Sequence[float]) -> bool:
        """Whether a warm-up that ran steps of ``times_ms`` ends: steady, or ``max_steps`` run."""
        return len(times_ms) >= self.max_steps or self.steady(times_ms)

    def describe(self) -> str:
        return (
            f"warm-up until the median of the last {self.window} step times is within {self.tolerance:.0%} of the median of "
            f"the {self.window} ending {self.window} steps earlier (at most {self.max_steps} steps)"
        )
