"""Routing at any shape, for `moescope top`: per layer what a person must see at a glance (hot, dead,
collapsed), from whichever tier the exporter serves. Pure functions over numbers; no UI, no I/O.

Tiers (docs/metrics.md): ``per-expert`` (``moescope_expert_tokens_total`` for every layer and expert: top
keeps the per-poll differences and sums the recent ones) and ``reduced`` (past the cardinality budget). Every
tier carries, per layer, the judged series the alerts read (excess load CV and the baseline's CV, hot factors,
unexpected dead experts, drift and its noise, the rank max/mean) and the window gauges (top share, max/mean,
slots per expert), the window slots of the K hottest and coldest experts by id, and a histogram of experts by
relative load; so every tier gets a verdict, named experts and a load profile, and the per-expert tier adds
every expert by id. Verdicts are the rules' own (``layer_routing``: ``Thresholds`` methods, no bar here).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from moescope import judge
from moescope.thresholds import DEFAULT, Thresholds
from moescope.tui import levels

NAMED = 3  # hottest / coldest experts named per layer (the demo summary names as many)


@dataclass(frozen=True)
class LayerRouting:
    layer: int
    cv: float | None  # the exporter's window gauges
    excess_cv: float | None  # the CV beyond sampling noise (what the imbalance rule judges; NaN: not judged)
    top_share: float | None
    max_over_mean: float | None
    dead: int | None  # experts with no slot (shown, not judged)
    counts: np.ndarray | None  # [E] slots per expert over the frame's window (per-expert tier), by expert id
    profile: np.ndarray | None  # [E] load / mean load, ascending, from the exporter's histogram (any tier)
    hot: tuple[tuple[int, float], ...]  # (expert, load / mean load), hottest first
    cold: tuple[tuple[int, float], ...]  # coldest first
    level: str  # ok | warn | bad | none
    verdict: str  # what is wrong, in words ("" when nothing is)
    baseline_cv: float | None = None  # moescope_baseline_load_cv_ratio (None: no baseline)
    bar: float | None = None  # the imbalance bar (Thresholds.imbalance_bar)
    dead_unexpected: float | None = None  # the dead experts the rule judges (NaN: not judged)
    hot_factors: tuple[tuple[int, float, str], ...] = ()  # (expert, factor, reference) over the hot bar
    drift_over_noise: float | None = None  # drift JSD minus its noise (bits)
    rank_max_over_mean: float | None = None
    fires: tuple[str, ...] = ()  # the alert rules this layer's series meet (before Alertmanager's inhibitions)
    eplb: tuple[float, float] | None = None  # EPLB's last rearrangement: (predicted, measured since) max/mean
    reference: str = "fair"  # what imbalance, collapse and dead are judged against (judge.Verdict.reference)
    uneven: str = ""  # "uneven by design/traffic: ..." (its reference itself uneven: information, not paged)
    collapse_bar: float | None = None  # Thresholds.collapse_bar of the layer's reference

    @property
    def judged(self) -> bool:
        """Whether the window had enough draws (requests) to judge (the excess CV is finite)."""
        return self.excess_cv is not None and math.isfinite(self.excess_cv)

    @property
    def severity(self) -> float:
        """How far past its bars the layer is (sorting): excess CV / bar, a hot factor / the hot bar."""
        x = self.excess_cv / self.bar if self.judged and self.bar else 0.0
        return max([x] + [f / levels.HOT for _, f, _ in self.hot_factors])


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


def layer_routing(layer: int, gauges: dict[str, float], n_experts: int | None, *,
                  counts: np.ndarray | None = None, reported: dict[int, float] | None = None,
                  buckets: dict[float, float] | None = None,
                  hot_factors: dict[int, tuple[float, str]] | None = None, reference: str | None = None,
                  t: Thresholds = DEFAULT) -> LayerRouting:
    """One layer's routing, judged as the alert rules judge it (``Thresholds`` methods over the exporter's
    judged series). ``gauges``: the window gauges by short name (``GAUGES``); ``counts``: per-expert slots
    (per-expert tier); ``reported``: {expert: window slots} of the hottest and coldest experts the exporter names
    (every tier); ``buckets``: its histogram of experts by relative load {le: cumulative experts};
    ``hot_factors``: {expert: (factor, reference)} of moescope_expert_hot_factor_ratio; ``reference``: the
    ``reference`` label of the layer's reference series (None: none exported: the layer is still learning its
    reference, or a baseline's older exporter)."""
    g = gauges.get
    cv, excess, top, mom = g("cv"), g("excess_cv"), g("top_share"), g("max_over_mean")
    per_expert = g("slots_per_expert")
    dead = None if not levels.finite(g("dead")) else int(g("dead"))
    if counts is not None and counts.sum() > 0:
        hot, cold = named(counts)
    elif reported and per_expert:
        rel = {e: s / per_expert for e, s in reported.items()}
        hot = tuple(sorted(rel.items(), key=lambda x: (-x[1], x[0]))[:NAMED])
        cold = tuple(sorted(rel.items(), key=lambda x: (x[1], x[0]))[:NAMED])
    else:
        hot, cold = (), ()
    base = g("baseline_cv")
    ref_cv, ref_top = g("reference_cv"), g("reference_top")
    hot_kind = next((ref for _, ref in (hot_factors or {}).values()), None)
    kind = reference or ("baseline" if levels.finite(base) else hot_kind if hot_kind == "fair" else "learning")
    bar = t.imbalance_bar_of(kind, ref_cv if levels.finite(ref_cv) else base if kind == "baseline" else None)
    jsd, noise = g("drift_jsd"), g("drift_noise")
    over_noise = jsd - noise if levels.finite(jsd) and levels.finite(noise) else None
    unexpected = g("dead_unexpected")
    rank = g("rank_max_over_mean")
    predicted, measured = g("eplb_predicted"), g("eplb_measured")
    eplb = (predicted, measured) if levels.finite(predicted) and levels.finite(measured) else None
    v = judge.verdict(excess_cv=excess, baseline_cv=base, top_share=top, drift_jsd=jsd, drift_noise=noise,
                      hot_factors={e: f for e, (f, _) in (hot_factors or {}).items()}, dead_unexpected=unexpected,
                      rank_max_over_mean=rank, t=t, hot_reference=hot_kind or kind, reference=kind,
                      reference_cv=ref_cv, reference_top=ref_top)
    collapse_bar = t.collapse_bar(kind, ref_top)
    hots = tuple((e, hot_factors[e][0], hot_factors[e][1]) for e in v.over_hot)
    cv_level = levels.level(excess, bar)  # bad exactly where the verdict's bar is passed
    if cv_level == "bad" and not v.imbalanced:  # as the rule: a drifted layer's imbalance is the drift's
        cv_level = "warn"
    top_level = levels.level(top, collapse_bar)
    dead_level = "warn" if v.dead else "none" if dead is None else "ok"
    words = []
    if v.collapsed:
        words.append(f"collapsed{f' onto e{hot[0][0]}' if hot else ''} ({top:.0%} of tokens)")
    elif v.imbalanced:
        against = {"baseline": "baseline", "learned": "learned", "fair": "fair share"}.get(kind, kind)
        words.append(f"imbalanced (excess cv {excess:.2f}>{bar:.2f} {against})")
    if v.hot_shown:  # collapse inhibits the hot alert (Alertmanager), as it does here
        # "learning": against 1/E while the exporter learns the layer's reference (named here, not paged)
        words.append("hot " + " ".join(f"L{layer} E{e} {f:.1f}x {'fair' if ref == 'learning' else ref}"
                                       for e, f, ref in hots[:2]) + ("" if v.hot else " (learning: not paged)"))
    if v.drifted:
        words.append(f"drifted ({over_noise:.3f} bits over noise)")
    if v.rank_overloaded:
        words.append(f"rank max/mean {rank:.2f}")
    if v.dead:
        words.append(f"{int(unexpected)} dead")
    uneven = v.uneven_words(ref_cv, ref_top)
    if uneven and not words:
        words.append(uneven)
    lvl = levels.worst(cv_level, top_level, dead_level, "bad" if v.hot else "warn" if hots else "none",
                       "bad" if v.drifted or v.rank_overloaded else "none")
    fires = tuple(v.fires())
    return LayerRouting(layer, cv, excess, top, mom, dead, counts, profile(buckets or {}, mom), hot, cold, lvl,
                        ", ".join(words), base if levels.finite(base) else None, bar, unexpected, hots, over_noise,
                        rank, fires, eplb, kind, uneven, collapse_bar)


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
