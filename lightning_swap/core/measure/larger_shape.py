"""A profile for a batch shape larger than any measured, predicted from the shapes that were
(Note [A larger shape predicted]).

Note [A larger shape predicted]: under dynamic padding a batch longer than every batch so far
comes now and then, and ``auto`` would guard it (a step under the lowest-memory plan, the
slowest, and each segment measured alone after it). The shapes measured before tell how the
model grows: at one batch size, what a step saves is a polynomial of degree at most 2 in a
sample's elements ``x`` (the sequence's tokens, the image's pixels) with no negative term —
linear for every tensor of a token or a pixel, quadratic where attention materializes its
``L x L`` scores (eager attention; PyTorch's fused SDPA saves a linear amount). Every byte
count of the profile (each segment's, each region's, the windows', the peak) is predicted at
``x`` from the measured shapes' values:

- from three or more shapes, the quadratic through the three largest (the curvature taken
  as 0 where it fits negative: a linear model), which is exact for such a polynomial;
- from two, a bound: with ``a0`` the line's value at 0 and ``r = x / x_b`` (``x_b`` the
  larger), ``a0 + (v_b - a0) r^2`` is over every such polynomial through the two values (the
  difference is ``b x_b r (r - 1) + c x_a x_b (r^2 - 1) >= 0``), at the price of holding
  a linear model's growth as if quadratic.

A window's peak is the largest of several moments, so it is such a polynomial only piecewise;
the prediction is therefore planned with a margin (``PREDICTION_MARGIN`` of the budget), its
first step is measured and observed under its plan, and the shape is planned again from what
it measured (Note [A plan's first step refines its profile] in ``scale/auto.py``). Times are
taken as proportional to ``x`` (they rank plans; the measured step re-prices them). Which
shapes are used, and when a prediction is planned rather than guarded: Note [Plans per batch
shape] in ``scale/shapes.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .model_profile import ModelProfile

__all__ = ["PREDICTION_MARGIN", "predict_larger"]

#: The part of the budget a predicted profile's plan leaves unused (Note [A larger shape predicted]).
PREDICTION_MARGIN = 0.05


def _fit(points: Sequence[tuple[float, float]], x: float) -> int:
    """A byte count at ``x`` from ``(x, value)`` points, ascending in ``x`` (Note [A larger shape predicted])."""
    (xa, va), (xb, vb) = points[-2], points[-1]
    slope = (vb - va) / (xb - xa)
    if len(points) == 2:
        a0 = vb - slope * xb
        return max(0, round(a0 + (vb - a0) * (x / xb) ** 2))
    (x0, v0) = points[-3]
    curvature = ((vb - va) / (xb - xa) - (va - v0) / (xa - x0)) / (xb - x0)
    if curvature <= 0:
        return max(0, round(vb + slope * (x - xb)))
    return max(0, round(v0 + (va - v0) / (xa - x0) * (x - x0) + curvature * (x - x0) * (x - xa)))


def _predicted(elements: Sequence[Any], xs: Sequence[float], x: float) -> Any:
    """One dataclass (a segment's or the whole step's profile) at ``x``, from the same one measured
    at ``xs``: byte counts fitted, times proportional to ``x``, the rest the largest shape's."""
    largest, changes = elements[-1], {}
    for f in dataclasses.fields(largest):
        values = [getattr(e, f.name) for e in elements]
        if f.name.endswith("_bytes") and f.name != "min_offload_bytes" and all(isinstance(v, int) and v >= 0 for v in values):
            changes[f.name] = _fit(list(zip(xs, values)), x)
        elif f.name.endswith("_ms") and isinstance(values[-1], float):
            changes[f.name] = values[-1] * x / xs[-1]
    return dataclasses.replace(largest, **changes)


def predict_larger(measured: Sequence[tuple[float, ModelProfile]], x: float) -> ModelProfile:
    """The profile at ``x`` elements a sample, from two or more ``(elements, profile)`` of the same
    model at one batch size, at fewer elements (Note [A larger shape predicted])."""
    measured = sorted(measured, key=lambda m: m[0])
    xs, profiles = [m[0] for m in measured], [m[1] for m in measured]
    if len(measured) < 2 or len(set(xs)) != len(xs) or x <= xs[-1]:
        raise ValueError(f"predict_larger: two or more distinct sizes below {x} are needed; got {xs}.")
    if len({p.names for p in profiles}) != 1 or len({p.batch_size for p in profiles}) != 1:
        raise ValueError("predict_larger: the profiles must be of the same segments at one batch size.")
    segments = tuple(_predicted(column, xs, x) for column in zip(*(p.segments for p in profiles)))
    largest = profiles[-1]
    outside = []
    for region in largest.outside:
        column = [next((r for r in p.outside if r.name == region.name), None) for p in profiles]
        known = [(xi, r) for xi, r in zip(xs, column) if r is not None]
        outside.append(_predicted([r for _, r in known], [xi for xi, _ in known], x) if len(known) >= 2 else region)
    top = _predicted(profiles, xs, x)
    return dataclasses.replace(top, segments=segments, outside=tuple(outside), reference=None)
