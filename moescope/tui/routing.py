"""Routing at any shape, for `moescope top`: per layer what a person must see at a glance (hot, dead,
collapsed), from whichever tier the exporter serves. Pure functions over numbers; no UI, no I/O.

Tiers (docs/metrics.md): ``per-expert`` (``moescope_expert_tokens_total`` for every layer and expert: top
keeps the per-poll differences and sums the recent ones) and ``reduced`` (past the cardinality budget). Every
tier carries, per layer, the window gauges the alerts judge (load CV and its excess over sampling noise, top
share, max/mean, dead experts, slots per expert), the window slots of the K hottest and coldest experts by id,
and a histogram of experts by relative load; so every tier gets a verdict, named experts and a load profile,
and the per-expert tier adds every expert by id.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from moescope.tui import levels

NAMED = 3  # hottest / coldest experts named per layer (the demo summary names as many)


@dataclass(frozen=True)
class LayerRouting:
    layer: int
    cv: float | None  # the exporter's window gauges
    excess_cv: float | None  # the CV beyond sampling noise (what the alert judges)
    top_share: float | None
    max_over_mean: float | None
    dead: int | None
    counts: np.ndarray | None  # [E] slots per expert over the frame's window (per-expert tier), by expert id
    profile: np.ndarray | None  # [E] load / mean load, ascending, from the exporter's histogram (any tier)
    hot: tuple[tuple[int, float], ...]  # (expert, load / mean load), hottest first
    cold: tuple[tuple[int, float], ...]  # coldest first
    level: str  # ok | warn | bad | none
    verdict: str  # what is wrong, in words ("" when nothing is)


@dataclass(frozen=True)
class Band:
    """Experts [lo, hi) folded into one cell."""

    lo: int
    hi: int
    rel_max: float  # the band's busiest expert's load / mean load (1 = fair share)
    rel_sum: float  # the band's load / its fair share
    hottest: int
    zeros: int  # experts with no slot

    @property
    def name(self) -> str:
        return f"e{self.lo}" if self.hi - self.lo == 1 else f"e{self.lo}-{self.hi - 1}"


def fold(counts: np.ndarray, n_bands: int) -> list[Band]:
    """Fold E experts into at most ``n_bands`` contiguous bands of equal width (the last may be narrower)."""
    n = len(counts)
    per = -(-n // max(1, min(n_bands, n)))
    mean = counts.sum() / n if n else 0.0
    out = []
    for lo in range(0, n, per):
        c = counts[lo:lo + per]
        hot = int(np.argmax(c))
        out.append(Band(lo, lo + len(c), float(c[hot] / mean) if mean else 0.0,
                        float(c.sum() / (mean * len(c))) if mean else 0.0, lo + hot, int((c == 0).sum())))
    return out


def named(counts: np.ndarray, n: int = NAMED) -> tuple[tuple, tuple]:
    """The ``n`` hottest and coldest experts as (expert, load / mean load); ties broken by expert id."""
    mean = counts.sum() / len(counts) if len(counts) else 0.0
    rel = counts / mean if mean else np.zeros(len(counts))
    ids = np.arange(len(counts))
    hot = tuple((int(e), float(rel[e])) for e in np.lexsort((ids, -counts))[:n])  # ties: lower id first
    cold = tuple((int(e), float(rel[e])) for e in np.lexsort((ids, counts))[:n])
    return hot, cold


def profile(buckets: dict[float, float], hottest: float | None) -> np.ndarray | None:
    """Every expert's load / mean load, ascending, from a cumulative histogram {le: experts}: each expert
    at its bucket's middle (le 0: dead; the last finite bucket's experts at their bound; past it the layer's
    busiest, ``hottest``). None without buckets."""
    if not buckets:
        return None
    out, prev_le, prev_c = [], 0.0, 0.0
    for le, c in sorted(buckets.items()):
        n = int(round(c - prev_c))
        value = 0.0 if le == 0 else (hottest or prev_le) if le == float("inf") else (prev_le + le) / 2
        out += [value] * max(0, n)
        prev_le, prev_c = le, c
    return np.array(out) if out else None


def layer_routing(layer: int, gauges: dict[str, float], bars: levels.Bars, n_experts: int | None, *,
                  counts: np.ndarray | None = None, reported: dict[int, float] | None = None,
                  buckets: dict[float, float] | None = None) -> LayerRouting:
    """One layer's routing. ``gauges``: the exporter's window gauges by short name (cv, excess_cv, top_share,
    max_over_mean, dead, slots_per_expert); ``counts``: per-expert slots (per-expert tier); ``reported``:
    {expert: window slots} of the hottest and coldest experts the exporter names (every tier); ``buckets``:
    its histogram of experts by relative load {le: cumulative experts}."""
    g = gauges.get
    cv, excess, top, mom = g("cv"), g("excess_cv"), g("top_share"), g("max_over_mean")
    per_expert = g("slots_per_expert")
    dead = None if g("dead") is None else int(g("dead"))
    if counts is not None and counts.sum() > 0:
        hot, cold = named(counts)
    elif reported and per_expert:
        rel = {e: s / per_expert for e, s in reported.items()}
        hot = tuple(sorted(rel.items(), key=lambda x: (-x[1], x[0]))[:NAMED])
        cold = tuple(sorted(rel.items(), key=lambda x: (x[1], x[0]))[:NAMED])
    else:
        hot, cold = (), ()
    slots = per_expert * n_experts if per_expert is not None and n_experts else None
    if excess is not None:  # what the alert judges: the CV beyond the window's sampling noise
        cv_level = levels.level(excess, bars.load_cv)
    elif slots is not None:
        cv_level = levels.level(cv, bars.load_cv_bar(n_experts, slots))
    else:  # an exporter that says nothing of its window's size: the raw CV against the bar
        cv_level = levels.level(cv, bars.load_cv)
    top_level = levels.level(top, bars.collapse_top_share)
    judged = slots is None or bars.judges_dead(n_experts, slots)
    dead_level = "none" if dead is None else "warn" if dead and judged else "ok"
    words = []
    if top_level == "bad":
        words.append(f"collapsed{f' onto e{hot[0][0]}' if hot else ''} ({top:.0%} of tokens)")
    elif cv_level == "bad":
        what = f"excess cv {excess:.2f}" if excess is not None else f"cv {cv:.2f}"
        words.append(f"imbalanced ({what}>{bars.load_cv:g})")
    if dead and judged:
        words.append(f"{dead} dead")
    return LayerRouting(layer, cv, excess, top, mom, dead, counts, profile(buckets or {}, mom), hot, cold,
                        levels.worst(cv_level, top_level, dead_level), ", ".join(words))


class History:
    """Per-poll slot differences per layer (per-expert tier): the last ``maxlen`` polls, for the time heatmap
    and the recent window. Fed by one poller thread; readers get tuples (frozen views)."""

    def __init__(self, maxlen: int = 64) -> None:
        self.maxlen = maxlen
        self._cols: dict[int, deque] = {}
        self._dts: deque = deque(maxlen=maxlen)

    def push(self, deltas: dict[int, np.ndarray], dt: float) -> None:
        self._dts.append(dt)
        for layer, d in deltas.items():
            self._cols.setdefault(layer, deque(maxlen=self.maxlen)).append(d)

    def columns(self, layer: int) -> tuple[np.ndarray, ...]:
        return tuple(self._cols.get(layer, ()))

    def window(self, layer: int) -> np.ndarray | None:
        cols = self._cols.get(layer)
        return np.sum(cols, axis=0) if cols else None

    @property
    def span_s(self) -> float:
        return float(sum(self._dts))
