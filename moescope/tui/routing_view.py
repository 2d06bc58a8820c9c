"""Routing at any shape, for `moescope top`: per layer what a person must see at a glance (hot, dead,
collapsed), from whichever tier the exporter serves. Pure functions over numbers; no UI, no I/O.

Tiers (docs/metrics.md): ``per-expert`` (``moescope_expert_tokens_total`` for every layer and expert: top
keeps the per-poll differences and sums the recent ones) and ``reduced`` (past the cardinality budget). Every
tier carries, per layer, the judged series the alerts read (excess load CV and the baseline's CV, hot factors,
unexpected dead experts, drift and its noise, the rank max/mean) and the window gauges (top share, max/mean,
slots per expert), the window slots of the K hottest and coldest experts by id, and a histogram of experts by
relative load; so every tier gets a verdict, named experts and a load profile, and the per-expert tier adds
every expert by id. Verdicts, words and levels are the rules' own (``layer_routing``: ``judge`` over the bars the
exporter exports, ``moescope_judgement_bar``; no bar and no judgement here).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from moescope import judge, stats
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
    bar: float | None = None  # the imbalance bar (inf: none, the reference is still being learned)
    dead_unexpected: float | None = None  # the dead experts the rule judges (NaN: not judged)
    hot_factors: tuple[tuple[int, float, str], ...] = ()  # (expert, factor, reference) over the hot bar
    drift_over_noise: float | None = None  # drift JSD minus its noise (bits)
    rank_max_over_mean: float | None = None
    fires: tuple[str, ...] = ()  # the alert rules this layer's series meet (before Alertmanager's inhibitions)
    eplb: tuple[float, float] | None = None  # EPLB's last rearrangement: (predicted, measured since) max/mean
    reference: str = "fair"  # what imbalance, collapse and dead are judged against (judge.Verdict.reference)
    uneven: str = ""  # "uneven by design/traffic: ..." (its reference itself uneven: information, not paged)
    collapse_bar: float | None = None  # the collapse bar of the layer's reference (moescope_judgement_bar)
    bars: dict[str, float] = field(default_factory=dict)  # every bar the layer was judged by, by judgement
    drift_jsd: float | None = None  # JS divergence from the baseline (bits; its bar: bars["drift"])
    flips: float | None = None  # the canary's flip ratio (its bar: bars["flips"])

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
    """Fold E experts into at most ``n_bands`` contiguous bands of equal width (the last may be narrower). A band's
    loads are against the layer's mean load (``stats.relative_load_rows``): NaN for a layer without load."""
    n = len(counts)
    per = -(-n // max(1, min(n_bands, n)))
    rel = stats.relative_load_rows(counts)
    out = []
    for lo in range(0, n, per):
        c, r = counts[lo:lo + per], rel[lo:lo + per]
        hot = int(np.argmax(c))
        out.append(Band(lo, lo + len(c), float(r[hot]), float(r.mean()), lo + hot, int((c == 0).sum())))
    return out


def named(counts: np.ndarray, n: int = NAMED) -> tuple[tuple, tuple]:
    """The ``n`` hottest and coldest experts as (expert, load / mean load: NaN without load); ties broken by
    expert id."""
    rel = stats.relative_load_rows(counts)
    ids = np.arange(len(counts))
    hot = tuple((int(e), float(rel[e])) for e in np.lexsort((ids, -counts))[:n])  # ties: lower id first
    cold = tuple((int(e), float(rel[e])) for e in np.lexsort((ids, counts))[:n])
    return hot, cold


def _named_from(counts: np.ndarray | None, reported: dict[int, float] | None, per_expert: float | None):
    """(hottest, coldest) of a layer: from its per-expert counts (per-expert tier), else from the window slots of
    the experts the exporter names over its slots per expert (every tier)."""
    if counts is not None and counts.sum() > 0:
        return named(counts)
    if reported and per_expert:
        rel = {e: s / per_expert for e, s in reported.items()}
        return (tuple(sorted(rel.items(), key=lambda x: (-x[1], x[0]))[:NAMED]),
                tuple(sorted(rel.items(), key=lambda x: (x[1], x[0]))[:NAMED]))
    return (), ()


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


def _opt(v: float | None) -> float | None:
    return v if levels.finite(v) else None


def layer_routing(layer: int, gauges: dict[str, float], n_experts: int | None, *,
                  counts: np.ndarray | None = None, reported: dict[int, float] | None = None,
                  buckets: dict[float, float] | None = None,
                  hot_factors: dict[int, tuple[float, str]] | None = None, reference: str | None = None,
                  bars: dict[str, float] | None = None, t: Thresholds = DEFAULT) -> LayerRouting:
    """One layer's routing as the alert rules judge it: ``judge.verdict`` over the exporter's judged series and
    the bars it exports (``bars``: judgement -> moescope_judgement_bar; a judgement without one is not judged;
    None: ``Thresholds.bars`` of the layer's reference), its words and level ``judge.layer_words`` /
    ``judge.layer_level``. ``gauges``: the window gauges by short name (``GAUGES``); ``counts``: per-expert slots
    (per-expert tier); ``reported``: {expert: window slots} of the hottest and coldest experts the exporter names
    (every tier); ``buckets``: its histogram of experts by relative load {le: cumulative experts};
    ``hot_factors``: {expert: (factor, reference)} of moescope_expert_hot_factor_ratio; ``reference``: the
    ``reference`` label of the layer's bars (None: none exported: its reference kind is its hot factors')."""
    g = gauges.get
    excess, top, jsd, rank = g("excess_cv"), g("top_share"), g("drift_jsd"), g("rank_max_over_mean")
    hot, cold = _named_from(counts, reported, g("slots_per_expert"))
    kind = reference or next((ref for _, ref in (hot_factors or {}).values()), None) or "learning"
    if bars is None:
        bars = t.bars([kind], [g("reference_cv", math.nan)], [g("reference_top", math.nan)],
                      [g("drift_noise", math.nan)]).layer(0)
    v = judge.verdict(excess_cv=excess, baseline_cv=g("baseline_cv"), top_share=top, drift_jsd=jsd,
                      drift_noise=g("drift_noise"), hot_factors={e: f for e, (f, _) in (hot_factors or {}).items()},
                      dead_unexpected=g("dead_unexpected"), rank_max_over_mean=rank, hot_reference=kind,
                      reference=kind, reference_cv=g("reference_cv"), reference_top=g("reference_top"), bars=bars,
                      t=t)
    hots = tuple((e, hot_factors[e][0], hot_factors[e][1]) for e in v.over_hot)
    dead = None if not levels.finite(g("dead")) else int(g("dead"))
    uneven = v.uneven_words(g("reference_cv"), g("reference_top"))
    words = judge.layer_words(v, layer=layer, excess_cv=excess, top_share=top, bars=bars, drift_jsd=jsd,
                              rank_max_over_mean=rank, dead_unexpected=g("dead_unexpected"), hot=hots,
                              busiest=hot[0][0] if hot else None, uneven=uneven)
    lvl = judge.layer_level(v, excess_cv=excess, top_share=top, bars=bars, dead_counted=dead is not None)
    jsd_noise = (jsd, g("drift_noise"))
    imbalance = bars.get("imbalance", math.nan)
    eplb = (g("eplb_predicted"), g("eplb_measured"))
    return LayerRouting(
        layer, g("cv"), excess, top, g("max_over_mean"), dead, counts, profile(buckets or {}, g("max_over_mean")),
        hot, cold, lvl, words, _opt(g("baseline_cv")), imbalance if math.isfinite(imbalance) else math.inf,
        g("dead_unexpected"), hots, jsd_noise[0] - jsd_noise[1] if all(map(levels.finite, jsd_noise)) else None,
        rank, tuple(v.fires()), eplb if all(map(levels.finite, eplb)) else None, kind, uneven,
        _opt(bars.get("collapse")), dict(bars), _opt(jsd), _opt(g("flips")))


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
