"""Statistics as pure functions over host-side numbers (the formulas of docs/metrics.md).

Each load statistic is defined once, here, row-wise: a load is an array ``[..., E]`` (slots per expert, any
leading axes: layers, windows), and the statistic is computed for every row at once. Every caller (the exporter's
window through ``judge``, ``top``, ``diagnose`` and ``report`` through ``judge``, the placement planner, EPLB in
the loop, the per-rank gauges) calls these; the tests compare them with the naive loops of tests/reference.py.

An empty load (a row without a slot; for the top share, without a routed token) has no busiest expert and no
mean: its max/mean and top share are NaN, "not defined". Not 1.0: that reads as "perfectly balanced" and would
pass a bar as healthy evidence (EPLB would call a layer with no traffic balanced); not 0: no real load has a
ratio under 1 (max/mean) or its tokens' share under 1/E. NaN is what the exporter already exports for "not
judged", every verdict treats it as under its bar (``judge.verdict``), and a caller that must act on a number says
what it does with NaN where it calls (EPLB keeps such a layer's placement). The load CV is a spread, 0 for a row
without load (as before: its judged form, the excess CV, is NaN there anyway, for want of draws).
"""

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
    """``load_cv_rows`` of one load [E], as a float."""
    return float(load_cv_rows(load))


def load_cv_rows(load) -> np.ndarray:
    """Coefficient of variation std/mean of each row of ``load`` [..., E] over all experts, zeros included
    (population std); 0 for a row without load."""
    load = np.asarray(load, dtype=np.float64)
    mean = load.mean(-1)
    safe = np.where(mean > 0, mean, 1.0)
    return np.where(mean > 0, load.std(-1) / safe, 0.0)


def max_over_mean_rows(load) -> np.ndarray:
    """The busiest expert's (or rank's) load over the mean of each row of ``load`` [..., E] (1.0 = perfectly
    balanced; the straggler factor of an expert-parallel layer when the row is per rank); NaN for an empty row
    (module docstring)."""
    load = np.asarray(load, dtype=np.float64)
    if load.shape[-1] == 0:
        return np.full(load.shape[:-1], np.nan)
    mean = load.mean(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, load.max(-1) / np.where(mean > 0, mean, 1.0), np.nan)


def relative_load_rows(load) -> np.ndarray:
    """Each expert's load over its row's mean load, ``load`` [..., E] (1 = its fair share of the row); NaN for a
    row without load (module docstring: no mean to be relative to)."""
    load = np.asarray(load, dtype=np.float64)
    mean = load.mean(-1, keepdims=True) if load.shape[-1] else np.zeros((*load.shape[:-1], 1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, load / np.where(mean > 0, mean, 1.0), np.nan)


def top_share_rows(load, tokens) -> np.ndarray:
    """Share of the routed tokens that the busiest expert took, per row of ``load`` [..., E] with ``tokens`` [...]
    routed: k/E when balanced, 1.0 when every token chose it (a collapse). Per token, not per slot: with top-k one
    expert can hold at most 1/k of the slots, but all of the tokens. NaN for a row without tokens."""
    load = np.asarray(load, dtype=np.float64)
    tokens = np.broadcast_to(np.asarray(tokens, dtype=np.float64), load.shape[:-1])
    mx = load.max(-1) if load.shape[-1] else np.zeros(load.shape[:-1])
    return np.where(tokens > 0, mx / np.where(tokens > 0, tokens, 1.0), np.nan)


def rank_loads(load, per_rank) -> np.ndarray:
    """[..., N] slots each of N ranks computes, from ``load`` [..., E] and the experts each rank holds
    (``per_rank``: N lists of expert ids; an expert on several ranks is replicated). The runtime's dispatch rule
    (``ExpertParallel._destinations``): a replicated expert's slots are dealt evenly over its R replicas, 1/R to
    each, whichever rank routed them; an expert no rank holds computes nowhere."""
    load = np.asarray(load, dtype=np.float64)
    n_exp = load.shape[-1]
    deal = np.zeros((n_exp, len(per_rank)))  # [E, N]: the share of an expert's slots each rank computes
    for r, experts in enumerate(per_rank):
        held = [e for e in set(experts) if 0 <= e < n_exp]
        deal[held, r] = 1.0
    deal /= np.maximum(deal.sum(1, keepdims=True), 1.0)
    return load @ deal


def jensen_shannon(p: Sequence[float], q: Sequence[float]) -> float:
    """``jensen_shannon_rows`` of two loads [E], as a float."""
    return float(jensen_shannon_rows(np.asarray(p, dtype=np.float64)[None], np.asarray(q, dtype=np.float64)[None])[0])


def jensen_shannon_rows(load: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Jensen-Shannon divergence in bits between each row of ``load`` [L, E] and of ``ref`` [L, E] (both
    normalised: 0 = same, 1 = disjoint)."""
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
