"""moescope.stats' percentile is numpy's (linear interpolation), checked against the textbook definition."""

import math

from hypothesis import given
from hypothesis import strategies as st

from moescope import stats


def naive_percentile(values, q):
    """Linear interpolation between the closest ranks (numpy's default 'linear' method), by hand."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=200), st.floats(0, 100))
def test_percentile_equals_linear_interpolation(values, q):
    assert math.isclose(stats.percentile(values, q), naive_percentile(values, q), rel_tol=1e-9, abs_tol=1e-6)


def test_percentile_of_nothing_is_nan_and_of_a_tuple_works():
    assert math.isnan(stats.percentile([], 50))
    assert stats.percentile((3.0, 1.0, 2.0), 50) == 2.0
    assert stats.percentile([0.0, 10.0], 99) == 9.9
