"""Statistics as pure functions over host-side numbers (the formulas of docs/metrics.md)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float:
    """``numpy.percentile`` (linear interpolation) as a float; NaN for no values. ``q`` in [0, 100]."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def load_cv(load: Sequence[float]) -> float:
    """Coefficient of variation std/mean over all experts, zeros included (population std); 0 for no load."""
    n = len(load)
    mean = sum(load) / n if n else 0.0
    if mean == 0:
        return 0.0
    return math.sqrt(sum((x - mean) ** 2 for x in load) / n) / mean


def load_cv_rows(load) -> np.ndarray:
    """``load_cv`` of each row of ``load`` [..., E] at once (numpy; 0 for a row without load)."""
    load = np.asarray(load, dtype=np.float64)
    mean = load.mean(-1)
    safe = np.where(mean > 0, mean, 1.0)
    return np.where(mean > 0, load.std(-1) / safe, 0.0)


def max_over_mean(load: Sequence[float]) -> float:
    """max/mean load (1.0 = perfectly balanced); 0 for no load."""
    mean = sum(load) / len(load) if load else 0.0
    return max(load) / mean if mean else 0.0


def shares(load: Sequence[float]) -> list[float]:
    total = sum(load)
    return [x / total if total else 0.0 for x in load]


def top_share(load: Sequence[float], tokens: float) -> float:
    """Share of the routed tokens that the busiest expert took: k/E when balanced, 1.0 when every token
    chose it (a collapse). Per token, not per slot: with top-k one expert can hold at most 1/k of the slots,
    but all of the tokens. 0 for no tokens."""
    return max(load) / tokens if tokens else 0.0


def dead_experts(load: Sequence[float]) -> int:
    """Experts with no slot at all."""
    return sum(1 for x in load if x == 0)


def jensen_shannon(p: Sequence[float], q: Sequence[float]) -> float:
    """Jensen-Shannon divergence in bits between two load vectors (normalised here; 0 = same, 1 = disjoint)."""
    ps, qs = shares(p), shares(q)
    m = [(a + b) / 2 for a, b in zip(ps, qs)]

    def kl(a, b):
        return sum(x * math.log2(x / y) for x, y in zip(a, b) if x > 0)

    return 0.5 * kl(ps, m) + 0.5 * kl(qs, m)


def jensen_shannon_rows(load: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Jensen-Shannon divergence in bits between each row of ``load`` and of ``ref`` (as ``jensen_shannon``,
    row-wise: both normalised, 0 = same, 1 = disjoint)."""
    def norm(a):
        s = a.sum(1, keepdims=True)
        return np.divide(a, s, out=np.zeros_like(a), where=s > 0)

    p, q = norm(load.astype(np.float64)), norm(ref.astype(np.float64))
    m = (p + q) / 2

    def kl(a, b):
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(a > 0, a * np.log2(np.where(a > 0, a, 1.0) / np.where(b > 0, b, 1.0)), 0.0)
        return t.sum(1)

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)
