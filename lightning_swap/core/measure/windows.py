"""The keys of a measured step: windows, regions and marks (Note [Keys of a measured step]),
defined once for the tracer (``trace.py``) and its readers (``profiler.py``, ``observe.py``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = ["BACKWARD_KINDS", "Mark", "MarkKind", "PREFIX", "SEGMENT_MARKS", "Window", "WindowKind", "after_region", "is_segment"]

# -- the keys of a measured step ----------------------------------------------------------
# Note [Keys of a measured step]: a *window* is a span of one training step whose peak bytes, and
# bytes alive at its start, the tracer records (``StepTrace.window_peak`` / ``window_start``):
# each segment's forward and backward, and those of the code outside the segments (Note
# [Windows outside the segments]). A *region* is what saves tensors for backward
# (``StepTrace.saved``): a segment, keyed by its index, or a region outside the segments, keyed
# by ``PREFIX`` or by its forward window (``after_region``). A *mark* is an instant of the step
# (a segment's forward starting, the loss's backward beginning...), timed on the compute stream;
# the milliseconds between two marks are a window's time. Each kind of key is defined here once,
# for the tracer (``trace.py``) and its readers (``profiler.py``, ``observe.py``).

#: The region before the first segment (embeddings, a stem), as a region key.
PREFIX = -1


class WindowKind(enum.Enum):
    """Which span of the step a :class:`Window` is (Note [Windows outside the segments])."""

    #: From the step's start to the first segment's forward.
    PREFIX_FORWARD = "prefix_forward"
    #: From the end of the first segment's backward to the end of the step's backward.
    PREFIX_BACKWARD = "prefix_backward"
    #: Segment ``i``'s forward.
    FORWARD = "forward"
    #: Segment ``i``'s backward: from its output's gradient to its input's.
    BACKWARD = "backward"
    #: The code after segment ``i``'s forward up to the next segment's (after the last: the head
    #: and loss, up to the loss's backward).
    AFTER = "after"
    #: That code's backward: from the end of the next segment's backward (after the last: from
    #: the loss's backward) to the start of segment ``i``'s.
    AFTER_BACKWARD = "after_backward"
    #: After the step's backward: the optimizer step.
    OPTIMIZER = "optimizer"
    #: After the step; opened when the trace closes, never measured.
    END = "end"


BACKWARD_KINDS = frozenset({WindowKind.PREFIX_BACKWARD, WindowKind.BACKWARD, WindowKind.AFTER_BACKWARD})


@dataclass(frozen=True)
class Window:
    """A window of the step: its kind and, for the kinds of one segment (``FORWARD``,
    ``BACKWARD``) or of the code after one (``AFTER``, ``AFTER_BACKWARD``), that segment's index
    (``-1`` for the others)."""

    kind: WindowKind
    segment: int = -1

    @property
    def is_backward(self) -> bool:
        """Whether the window is part of the step's backward (a region's saved storages may be let
        go as it opens: Note [Regions held as kept])."""
        return self.kind in BACKWARD_KINDS

    def __repr__(self) -> str:
        return self.kind.value if self.segment < 0 else f"{self.kind.value}[{self.segment}]"


def after_region(segment: int) -> Window:
    """The region key of the code after ``segment`` (up to the next segment, or the head and loss
    after the last): its forward window, under which the tracer records what it saves."""
    return Window(WindowKind.AFTER, segment)


def is_segment(region: Any) -> bool:
    """Whether a region key is a segment's (its index) rather than a region outside the segments."""
    return isinstance(region, int) and region >= 0


class MarkKind(enum.Enum):
    """Which instant of the step a :class:`Mark` is."""

    #: The step's start (the tracer's ``begin``).
    START = "start"
    #: Segment ``i``'s forward begins (its forward pre-hook) and ends (its forward hook).
    FORWARD_START = "forward_start"
    FORWARD_END = "forward_end"
    #: Segment ``i``'s backward begins (its output's gradient is ready) and ends (its input's is).
    BACKWARD_START = "backward_start"
    BACKWARD_END = "backward_end"
    #: The loss's backward begins (``StepTracer.backward_begins``).
    LOSS_BACKWARD = "loss_backward"
    #: The step's backward is over (``backward_done``; else the trace's ``finish``).
    END = "end"
    #: The whole step is over, its optimizer step included (an observed step's end).
    STOP = "stop"


@dataclass(frozen=True)
class Mark:
    """An instant of the step: its kind and, for a segment's bounds, the segment's index (``-1``
    for the others, and for a call of a segment the trace did not see)."""

    kind: MarkKind
    segment: int = -1

    def __repr__(self) -> str:
        return self.kind.value if self.segment < 0 and self.kind not in SEGMENT_MARKS else f"{self.kind.value}[{self.segment}]"


SEGMENT_MARKS = frozenset({MarkKind.FORWARD_START, MarkKind.FORWARD_END, MarkKind.BACKWARD_START, MarkKind.BACKWARD_END})
