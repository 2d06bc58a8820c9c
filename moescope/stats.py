"""Statistics as pure functions over host-side numbers (the formulas of docs/metrics.md)."""

from __future__ import annotations

import math
from typing import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); NaN for no values. ``q`` in [0, 100]."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def load_cv(load: Sequence[float]) -> float:
    """Coefficient of variation std/mean over all experts, zeros included (population std); 0 for no load."""
    n = len(load)
    mean = sum(load) / n if n else 0.0
    if mean == 0:
        return 0.0
    return math.sqrt(sum((x - mean) ** 2 for x in load) / n) / mean


def max_over_mean(load: Sequence[float]) -> float:
    """max/mean load (1.0 = perfectly balanced); 0 for no load."""
    mean = sum(load) / len(load) if load else 0.0
    return max(load) / mean if mean else 0.0


def shares(load: Sequence[float]) -> list[float]:
    total = sum(load)
    return [x / total if total else 0.0 for x in load]
