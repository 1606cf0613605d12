"""A profile predicted for a larger batch shape from the shapes measured (Note [A larger shape
predicted] in ``measure/larger_shape.py``), on made-up profiles whose byte counts are known
polynomials of a sample's elements."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_swap.core.measure.larger_shape import predict_larger

from ..decide.test_solver import random_chain


def _grown(base, x: float, *, linear: float, quadratic: float):
    """``base`` (measured at 32 elements a sample) at ``x``: every byte count ``v`` becomes
    ``v * (linear * x / 32 + quadratic * (x / 32) ** 2)``, the static bytes left alone."""
    grow = linear * x / 32 + quadratic * (x / 32) ** 2

    def scaled(element, skip=()):
        return dataclasses.replace(element, **{
            f.name: round(getattr(element, f.name) * grow) for f in dataclasses.fields(element)
            if f.name.endswith("_bytes") and f.name not in skip and isinstance(getattr(element, f.name), int) and getattr(element, f.name) > 0
        })

    top = scaled(base, skip=("static_bytes", "parameter_bytes", "gradient_bytes", "min_offload_bytes"))
    return dataclasses.replace(top, segments=tuple(scaled(s) for s in base.segments))


def _byte_counts(profile) -> list[int]:
    return [getattr(s, f.name) for s in (profile, *profile.segments) for f in dataclasses.fields(s)
            if f.name.endswith("_bytes") and isinstance(getattr(s, f.name), int)]


@pytest.mark.parametrize(("linear", "quadratic"), [(1.0, 0.0), (0.5, 0.5), (0.0, 1.0)])
def test_three_shapes_predict_a_quadratic_exactly(linear, quadratic):
    base = random_chain(3, 4)
    measured = [(x, _grown(base, x, linear=linear, quadratic=quadratic)) for x in (16, 24, 32)]
    predicted = predict_larger(measured, 48)
    expected = _grown(base, 48, linear=linear, quadratic=quadratic)
    assert [abs(a - b) <= 4 for a, b in zip(_byte_counts(predicted), _byte_counts(expected))] == [True] * len(_byte_counts(expected))
    assert predicted.segments[0].forward_ms == pytest.approx(base.segments[0].forward_ms * 48 / 32)  # times proportional


@pytest.mark.parametrize(("linear", "quadratic"), [(1.0, 0.0), (0.5, 0.5), (0.0, 1.0)])
def test_two_shapes_bound_every_byte_count_from_above(linear, quadratic):
    base = random_chain(5, 3)
    measured = [(x, _grown(base, x, linear=linear, quadratic=quadratic)) for x in (24, 32)]
    predicted, expected = predict_larger(measured, 40), _grown(base, 40, linear=linear, quadratic=quadratic)
    assert all(p >= e - 2 for p, e in zip(_byte_counts(predicted), _byte_counts(expected)))
    assert predicted.static_bytes == base.static_bytes  # what does not grow stays


def test_a_prediction_needs_two_smaller_shapes_of_the_same_model():
    base = random_chain(3, 4)
    with pytest.raises(ValueError, match="two or more distinct sizes below 48"):
        predict_larger([(32, base)], 48)
    with pytest.raises(ValueError, match="same segments"):
        predict_larger([(16, random_chain(3, 2)), (32, base)], 48)
