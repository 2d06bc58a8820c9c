"""What `moescope top` shows, computed from scrapes: pure functions over parsed samples, no UI.

Sources: metrics endpoints (each rank's exporter, scraped directly) or a Prometheus server (instant
queries); optionally an Alertmanager for the firing alerts. Each poll yields a ``Frame``; rates (tokens/s,
per-expert slots, cache hit rate) come from the difference between two polls of the same counters.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from moescope import judge, prom_http
from moescope.thresholds import DEFAULT, Thresholds
from moescope.tui import levels
from moescope.tui.efficiency_view import efficiency_line
from moescope.tui.ep_view import ep_line
from moescope.tui.routing_view import History, LayerRouting, layer_routing

Samples = dict[tuple[str, frozenset], float]


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(v: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], v) if "\\" in v else v


def parse_exposition(text: str) -> Samples:
    """Samples of a Prometheus text exposition (classic or OpenMetrics): {(name, labels): value}.

    Same result as prometheus_client's parser (a test compares them), many times faster: a 256-expert x
    58-layer exposition (15k series) parses in tens of milliseconds instead of seconds. Raises ValueError on a
    line that is not a sample."""
    out: Samples = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace, close = line.find("{"), line.rfind("}")  # name{labels} value [timestamp]
        if brace >= 0 and close > brace:
            name, labels, rest = line[:brace], line[brace + 1:close], line[close + 1:].split()
        else:
            name, *rest = line.split()
            labels = ""
        if not name or not rest or "{" in name:
            raise ValueError(f"not a sample line: {line[:80]!r}")
        if not labels:
            lab = frozenset()
        elif "\\" in labels:
            lab = frozenset((k, _unescape(v)) for k, v in _LABEL.findall(labels))
        else:  # no escapes: no value holds a quote, so '",' only ever ends a value (one may be empty: "")
            inner = labels.rstrip(",")
            lab = frozenset(tuple(kv.split('="', 1)) for kv in inner[:-1].split('",'))
        out[(name, lab)] = float(rest[0])
    return out


def scrape(url: str, timeout: float = 2.0) -> Samples:
    """One endpoint; raises ``prom_http.Unreachable`` or ValueError (not an exposition)."""
    return parse_exposition(prom_http.exposition(url, timeout))


def _sum(samples: Samples, name: str, by: tuple[str, ...] = ()) -> dict:
    out: dict = defaultdict(float)
    for (n, labels), v in samples.items():
        if n == name:
            d = dict(labels)
            out[tuple(d.get(k, "") for k in by)] += v
    return dict(out)


def _max(samples: Samples, name: str) -> float | None:
    vals = [v for (n, _), v in samples.items() if n == name]
    return max(vals) if vals else None


def _quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets {le: count}."""
    if not buckets:
        return None
    items = sorted(buckets.items())
    total = items[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in items:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c) if c > prev_c else le
        prev_le, prev_c = le, c
    return prev_le


def _hist_delta(cur: Samples, prev: Samples | None, name: str, by: tuple[str, ...] = ()) -> dict:
    """{group: {le: count increase}} of a histogram between two polls (the whole history without a previous)."""
    out: dict = defaultdict(lambda: defaultdict(float))
    for (n, labels), v in cur.items():
        if n != f"{name}_bucket":
            continue
        d = dict(labels)
        before = prev.get((n, labels), 0.0) if prev else 0.0
        out[tuple(d.get(k, "") for k in by)][float(d["le"])] += max(0.0, v - before)
    return out


@dataclass
class Tile:
    name: str
    value: float | None
    text: str
    level: str  # ok | warn | bad | none


@dataclass
class Frame:
    at: float
    model: str | None
    endpoints: dict[str, str]  # url -> "ok" or the error
    tiles: list[Tile]
    routing: dict[int, LayerRouting]  # layer -> what its routing looks like (every tier)
    tier: str  # per-expert | reduced | per-layer | none (no routing data yet)
    window: str  # what the per-expert counts cover: "last 12s" or "since start"
    n_experts: int | None
    columns: dict[int, tuple]  # layer -> per-poll slot differences, oldest first (per-expert tier)
    judged: str  # what is judged against what, and what waits ("imbalance: judged against baseline", ...)
    a2a_p99: dict[str, float]  # rank -> seconds
    cache_low: dict[int, tuple[float, float]] = field(default_factory=dict)  # layer -> (hit rate, its floor)
    alerts: list[str] | None = None  # None: no Alertmanager configured
    alert_error: str | None = None
    efficiency: str = ""  # experts touched per step, bytes per token, S-MBU (moescope.tui.efficiency_view)
    ep: str = ""  # would EP and EPLB help: the step-level verdict (moescope.tui.ep_view)


def _fmt(v: float | None, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "pct":
        return f"{v:.1%}" if v < 0.995 else f"{v:.0%}"  # "100%": a tile is 16 characters
    if kind == "ms":
        return f"{v * 1e3:.1f}ms"
    if kind == "bytes":
        return f"{v / 2**20:.0f}MiB"
    if kind == "int":
        return f"{v:.0f}"
    return f"{v:.3f}"


def expert_counts(samples: Samples | None) -> dict[int, np.ndarray]:
    """layer -> cumulative slots per expert from the per-expert tier (empty when the exporter serves none)."""
    got: dict[int, dict[int, float]] = defaultdict(dict)
    for (n, labels), v in (samples or {}).items():
        if n == "moescope_expert_tokens_total":
            d = dict(labels)
            got[int(d["layer"])][int(d["expert"])] = got[int(d["layer"])].get(int(d["expert"]), 0.0) + v
    out = {}
    for layer, per in got.items():
        a = np.zeros(1 + max(per), dtype=np.float64)
        a[list(per)] = list(per.values())
        out[layer] = a
    return out


def expert_deltas(now: dict[int, np.ndarray], before: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """layer -> slots per expert between two polls' ``expert_counts`` (a restarted exporter counts from zero)."""
    out = {}
    for layer, c in now.items():
        b = before.get(layer)
        out[layer] = c if b is None or len(b) != len(c) or (c < b).any() else c - b
    return out


GAUGES = {"cv": "moescope_expert_load_cv_ratio", "excess_cv": "moescope_expert_load_excess_cv_ratio",
          "baseline_cv": "moescope_baseline_load_cv_ratio",
          "top_share": "moescope_expert_load_top_share_ratio",
          "max_over_mean": "moescope_expert_load_max_over_mean_ratio", "dead": "moescope_dead_experts",
          "dead_unexpected": "moescope_dead_experts_unexpected",
          "drift_jsd": "moescope_routing_drift_jsd_bits", "drift_noise": "moescope_routing_drift_noise_bits",
          "rank_max_over_mean": "moescope_rank_load_max_over_mean_ratio",
          "eplb_predicted": "moescope_eplb_predicted_max_over_mean_ratio",
          "eplb_measured": "moescope_eplb_measured_max_over_mean_ratio",
          "slots_per_expert": "moescope_window_slots_per_expert",
          "reference_cv": "moescope_reference_load_cv_ratio", "reference_top": "moescope_reference_top_share_ratio",
          "flips": "moescope_routing_flip_ratio"}
HOT_SERIES = "moescope_expert_hot_factor_ratio"
BAR_SERIES = "moescope_judgement_bar"


def _merge(old: float | None, v: float) -> float:
    """The larger of two values of one gauge (ranks, duplicate series); NaN (not judged) only when all are."""
    if old is None or math.isnan(old):
        return v
    return old if math.isnan(v) else max(old, v)


def _per_layer(cur: Samples):
    """Per layer: the window gauges by short name, the named experts' window slots {expert: slots}, the
    relative-load histogram {le: cumulative experts}, the hot factors {expert: (factor, reference)}, the
    reference kind the layer is judged against (its bars' ``reference`` label) and its bars {judgement: value}
    (moescope_judgement_bar: what the rules compare with)."""
    names = {v: k for k, v in GAUGES.items()}
    gauges: dict[int, dict[str, float]] = defaultdict(dict)
    named: dict[int, dict[int, float]] = defaultdict(dict)
    buckets: dict[int, dict[float, float]] = defaultdict(dict)
    hot: dict[int, dict[int, tuple[float, str]]] = defaultdict(dict)
    kinds: dict[int, str] = {}
    bars: dict[int, dict[str, float]] = defaultdict(dict)
    for (n, labels), v in cur.items():
        if n == BAR_SERIES:
            d = dict(labels)
            if d.get("layer"):
                bars[int(d["layer"])][d["judgement"]] = _merge(bars[int(d["layer"])].get(d["judgement"]), v)
                if d.get("reference"):
                    kinds[int(d["layer"])] = d["reference"]
            continue
        short = names.get(n)
        if short is not None:
            layer = int(dict(labels)["layer"])
            gauges[layer][short] = _merge(gauges[layer].get(short), v)
        elif n == HOT_SERIES:
            d = dict(labels)
            e = int(d["expert"])
            layer = int(d["layer"])
            if math.isfinite(v) and v > hot[layer].get(e, (-1.0, ""))[0]:
                hot[layer][e] = (v, d.get("reference", "fair"))
        elif n == "moescope_expert_window_slots":
            d = dict(labels)
            named[int(d["layer"])][int(d["expert"])] = v
        elif n == "moescope_expert_load_relative_bucket":
            d = dict(labels)
            buckets[int(d["layer"])][float(d["le"])] = v
    return gauges, named, buckets, hot, kinds, bars


def model_bars(cur: Samples) -> dict[str, float]:
    """The model's bars (moescope_judgement_bar without a layer: activation, all-to-all and fetch p99, ...)."""
    out: dict[str, float] = {}
    for (n, labels), v in cur.items():
        d = dict(labels) if n == BAR_SERIES else {}
        if d and not d.get("layer"):
            out[d["judgement"]] = _merge(out.get(d["judgement"]), v)
    return out


def judged_note(routing: dict[int, LayerRouting], t: Thresholds = DEFAULT) -> str:
    """What top judges against what, and what waits, in words; then the per-rank load and EPLB, whenever
    exported (measured from the exchanges: no sampling judgement to wait for)."""
    if not routing:
        return "waiting for the exporter's judged series"
    return _judged_words(list(routing.values()), t) + _rank_words(list(routing.values()), t)


def _judged_words(rs: list[LayerRouting], t: Thresholds) -> str:
    with_excess = [r for r in rs if r.excess_cv is not None]
    if not with_excess:
        return "the exporter exports no excess CV: imbalance not judged (an older moescope?)"
    judged = [r for r in with_excess if r.judged]
    if not judged:
        return "too few requests in the window to judge (excess CV NaN): imbalance, hot and dead wait"
    kinds = Counter(r.reference for r in judged)
    if kinds.get("baseline") == len(judged):
        words = "imbalance: judged against baseline"
    elif kinds.get("learned") == len(judged):
        words = "no baseline: judged against the reference learned from this deployment's first window"
    elif kinds.get("fair") == len(judged):
        words = f"no baseline: against the fair share (as asked), imbalance above excess CV {judged[0].bar:g}"
    elif kinds.get("learning") == len(judged):
        words = (f"no baseline: learning the reference from the first full window (imbalance and dead wait, "
                 f"collapse only over {judged[0].collapse_bar or math.nan:g})")
    else:
        words = "imbalance against " + ", ".join(f"{k}: {n}/{len(judged)}" for k, n in sorted(kinds.items()))
    uneven = [r for r in judged if r.uneven]
    if uneven:
        words += f"; {len(uneven)} layers uneven by design/traffic (not paged)"
    if len(judged) < len(rs):
        words += f"; {len(rs) - len(judged)} layers: too few requests to judge"
    return words


def _rank_words(rs: list[LayerRouting], t: Thresholds) -> str:
    words = ""
    ranks = [(r.rank_max_over_mean, r.layer) for r in rs if levels.finite(r.rank_max_over_mean)]
    if ranks:
        v, layer = max(ranks)
        r = next(x for x in rs if x.layer == layer)
        over = ">" if "MoERankLoadImbalance" in r.fires else "<="
        words += f"; rank max/mean {v:.2f} (L{layer}{over}{r.bars.get('rank_load', math.nan):g})"
    eplb = [(r.eplb[1], r.eplb[0], r.layer) for r in rs if r.eplb is not None]
    if eplb:  # the worst layer since the last rearrangement: what it measures against what the planner predicted
        measured, predicted, layer = max(eplb)
        words += f"; EPLB L{layer}: measured {measured:.2f} vs predicted {predicted:.2f}"
    return words


def cache_judgement(hits: dict, lookups: dict, capacity: dict, t: Thresholds = DEFAULT
                    ) -> dict[int, tuple[float, float]]:
    """layer -> (hit rate, floor) of the layers whose cache thrashes (``judge.cache_thrash``; ``hits``/``lookups``:
    {(layer,): count} over the same interval, ``capacity``: {(layer,): resident experts / E})."""
    keys = [key for key, n in lookups.items() if n and capacity.get(key) is not None]
    rate, floor, low = judge.cache_thrash([hits.get(key, 0.0) for key in keys], [lookups[key] for key in keys],
                                          [capacity[key] for key in keys], t)
    return {int(key[0]): (float(r), float(f)) for key, r, f, bad in zip(keys, rate, floor, low) if bad}


def _per_layer_values(samples: Samples, name: str) -> dict:
    return {(dict(labels).get("layer", ""),): v for (n, labels), v in samples.items() if n == name}


def frame(cur: Samples, prev: Samples | None, dt: float, endpoints: dict[str, str], t: Thresholds = DEFAULT,
          at: float | None = None, history: History | None = None,
          totals: dict[int, np.ndarray] | None = None) -> Frame:
    """One frame from this poll's samples (``prev``: the previous poll's, for rates; ``history``: the
    per-expert differences of the recent polls, already holding this one's; ``totals``: this poll's
    ``expert_counts`` when the caller has them)."""
    models = {dict(labels).get("model") for (n, labels) in cur if n == "moescope_router_tokens_total"}
    model = sorted(m for m in models if m)[0] if any(models) else None
    c = _Counted(cur, prev, dt)
    capacity = _per_layer_values(cur, "moescope_expert_cache_capacity_ratio")
    cache_low = cache_judgement(c.hits, c.lookups, capacity, t)
    routing, tier, window, n_exp, columns = _routing(cur, t, history, expert_counts(cur) if totals is None else totals)
    a2a = _hist_delta(cur, None, "moescope_all_to_all_seconds", ("rank",))
    a2a_p99 = {rank[0]: q for rank, hb in sorted(a2a.items()) if (q := _quantile(hb, 0.99)) is not None}
    return Frame(at or time.time(), model, endpoints, _tiles(cur, c, routing, cache_low, model_bars(cur)), routing,
                 tier, window, n_exp, columns, judged_note(routing, t), a2a_p99, cache_low,
                 efficiency=efficiency_line(cur, prev, n_exp), ep=ep_line(cur, _quantile))


class _Counted:
    """The counters of one poll against the previous (``prev``; none: the whole history): the per-layer cache
    lookups and hits, routed and dropped slots, and the first layer's token rate (None without a previous)."""

    def __init__(self, cur: Samples, prev: Samples | None, dt: float) -> None:
        self.cur, self.prev = cur, prev
        tokens = _sum(cur, "moescope_router_tokens_total", ("layer",))
        first = min(tokens, key=lambda k: int(k[0]))[0] if tokens else None
        routed = self.delta("moescope_router_tokens_total", ("layer",))
        self.token_rate = sum(n for k, n in routed.items() if k[0] == first) / dt if prev and dt > 0 else None
        self.lookups = self.delta("moescope_expert_cache_lookups_total", ("layer",))
        self.hits = self.delta("moescope_expert_cache_hits_total", ("layer",))
        dropped = self.delta("moescope_tokens_dropped_total", ("layer",))
        # dropped slots per routed token, per layer (the rule's ratio)
        self.drop_ratio = {int(k[0]): dropped.get(k, 0.0) / n for k, n in routed.items() if n and k[0]}
        self.nonfinite = sum(self.delta("moescope_router_nonfinite_logits_total").values())

    def delta(self, name: str, by: tuple[str, ...] = ()) -> dict:
        now = _sum(self.cur, name, by)
        if not self.prev:
            return now
        before = _sum(self.prev, name, by)
        return {k: max(0.0, v - before.get(k, 0.0)) for k, v in now.items()}


def _worst(pairs, floor: bool = False) -> tuple[float | None, str]:
    """(value, level) of the worst of (value, bar) pairs by ``judge.level`` (the highest value over its bar; a
    ``floor``: the lowest under it); (None, "none") for none."""
    judged = [(v, bar) for v, bar in pairs if levels.finite(v)]
    if not judged:
        return None, "none"

    def how_far(x):
        v, bar = x
        if not (levels.finite(bar) and bar > 0):
            return -math.inf
        return bar / max(v, 1e-12) if floor else v / bar

    v, bar = max(judged, key=how_far)
    return v, levels.level(v, bar, floor=floor)


def _excess_tile(routing: dict[int, LayerRouting]) -> tuple[float | None, str | None, str]:
    """The worst judged layer's excess CV over its bar: (value, "excess/bar" or "excess/learning", level)."""
    worst = max((r for r in routing.values() if r.judged), key=lambda r: r.excess_cv / r.bar, default=None)
    if worst is None:
        return None, None, "none"
    text = f"{worst.excess_cv:.2f}/" + (f"{worst.bar:.2f}" if math.isfinite(worst.bar) else "learning")
    return worst.excess_cv, text, worst.level if worst.verdict.startswith("imbalanced") else \
        levels.level(worst.excess_cv, worst.bar)


def _tiles(cur: Samples, c: _Counted, routing: dict[int, LayerRouting], cache_low: dict,
           bars: dict[str, float]) -> list[Tile]:
    """The health tiles, each coloured by ``judge.level`` against the bar the rules compare with (the exporter's
    moescope_judgement_bar; ``bars``: the model's)."""
    rs = list(routing.values())

    def layer_bar(layer, judgement):
        return routing[layer].bars.get(judgement) if layer in routing else None

    top, top_level = _worst((r.top_share, r.collapse_bar) for r in rs)
    flips, flips_level = _worst((r.flips, r.bars.get("flips")) for r in rs)
    drift = [r.drift_over_noise for r in rs if r.drift_over_noise is not None]
    drops, drops_level = _worst((ratio, layer_bar(la, "drops")) for la, ratio in c.drop_ratio.items())
    n_look = sum(c.lookups.values())
    hit_rate = sum(c.hits.values()) / n_look if n_look else None
    _, cache_level = _worst(((c.hits.get(k, 0.0) / n, layer_bar(int(k[0]), "cache")) for k, n in c.lookups.items()
                             if n and k[0]), floor=True)
    fetch = _hist_delta(cur, c.prev, "moescope_expert_fetch_seconds")
    fetch_p99 = _quantile(fetch.get((), {}), 0.99) if fetch else None
    rss = _max(cur, "moescope_process_resident_memory_bytes")
    values = [  # (tile, value, text, level): every level a judgement of the rules' own, against their bars
        ("tokens/s", c.token_rate, None, levels.level(c.token_rate, None)),
        ("excess CV", *_excess_tile(routing)),
        ("top share", top if top is not None else _max(cur, "moescope_expert_load_top_share_ratio"), None, top_level),
        ("flips", flips, None, flips_level),
        ("drift", max(drift) if drift else None, None, _worst((r.drift_jsd, r.bars.get("drift")) for r in rs)[1]),
        ("non-finite", float(c.nonfinite), None, levels.level(float(c.nonfinite), 0.0)),
        ("dropped", drops, None, drops_level),
        ("cache hit", hit_rate, None, "bad" if cache_low else cache_level if hit_rate is not None else "none"),
        ("fetch p99", fetch_p99, None, levels.level(fetch_p99, bars.get("fetch"))),
        ("RSS", rss, None, levels.level(rss, None)),
    ]
    kinds = {"tokens/s": "int", "top share": "pct", "flips": "pct", "non-finite": "int", "dropped": "pct",
             "cache hit": "pct", "fetch p99": "ms", "RSS": "bytes"}
    return [Tile(name, v, text if text is not None else _fmt(v, kinds.get(name, "num")), lvl)
            for name, v, text, lvl in values]


def _routing(cur: Samples, t: Thresholds, history: History | None, totals: dict[int, np.ndarray]):
    """Per layer routing from what this tier serves, and what the per-expert window covers."""
    gauges, named, buckets, hot, kinds, bars = _per_layer(cur)
    n_exp = max((len(c) for c in totals.values()), default=None)
    if n_exp is None and buckets:  # the histogram counts every expert of a layer
        n_exp = int(round(max(max(bk.values()) for bk in buckets.values())))
    tier = "per-expert" if totals else "reduced" if named or buckets else "per-layer" if gauges else "none"
    window, counts = "since start", totals
    if totals and history is not None and history.span_s > 0:
        recent = {layer: history.window(layer) for layer in totals}
        if all(c is not None and c.sum() > 0 for c in recent.values()):  # else the run so far: nothing recent
            span = history.span_s
            window, counts = f"last {span:.0f}s" if span >= 10 else f"last {span:.1f}s", recent
    if not totals:
        window = "the exporter's window"
    routing = {layer: layer_routing(layer, gauges.get(layer, {}), n_exp, counts=counts.get(layer),
                                    reported=named.get(layer), buckets=buckets.get(layer),
                                    hot_factors=hot.get(layer), reference=kinds.get(layer),
                                    bars=bars.get(layer, {}), t=t)
               for layer in sorted(set(gauges) | set(totals) | set(named))}
    columns = {layer: history.columns(layer) for layer in totals} if history is not None else {}
    return routing, tier, window, n_exp, columns


def firing_alerts(alertmanager: str, timeout: float = 2.0) -> list[str]:
    alerts = prom_http.alerts(alertmanager, timeout)
    out = []
    for a in alerts:
        labels = a.get("labels", {})
        if labels.get("alertname") == "Watchdog":
            continue
        where = " ".join(f"{k}={labels[k]}" for k in ("layer", "rank", "peer") if k in labels)
        out.append(f"{labels.get('severity', '?')}: {labels.get('alertname')} {where}".strip())
    return sorted(out)


# `top --prometheus`: rates over this window of Prometheus' own samples (the rules' rate window is 1m; a minute at
# the usual 15 s scrape interval holds four samples).
PROMETHEUS_RATE_WINDOW_S = 60


def _key(metric: dict) -> tuple[str, frozenset]:
    """A Prometheus result's series as ``Samples`` keys it: its name and labels less job and instance (the
    exporters of one model merge, as when scraped directly)."""
    m = dict(metric)
    name = m.pop("__name__")
    for k in ("job", "instance"):
        m.pop(k, None)
    return name, frozenset(m.items())


class Poller:
    """Polls the sources; keeps the previous scrape for rates. Errors become statuses, never exceptions."""

    def __init__(self, endpoints: list[str], *, prometheus: str | None = None, alertmanager: str | None = None,
                 thresholds: Thresholds = DEFAULT, timeout: float = 2.0,
                 rate_window_s: int = PROMETHEUS_RATE_WINDOW_S) -> None:
        self.endpoints, self.prometheus, self.alertmanager = endpoints, prometheus, alertmanager
        self.rate_window_s = rate_window_s  # --prometheus: the window of its samples rates are taken over
        self.thresholds, self.timeout = thresholds, timeout
        self._prev: Samples | None = None
        self._prev_at = 0.0
        self.history = History()  # per-expert slot differences of the recent polls
        self._prev_counts: dict[int, np.ndarray] = {}

    def _from_prometheus(self) -> Samples:
        """The same metric names, from a Prometheus server: the latest value of every moescope series."""
        out: Samples = {}
        for s in prom_http.query(self.prometheus, '{__name__=~"moescope_.+"}', self.timeout):
            key = _key(s["metric"])
            out[key] = out.get(key, 0.0) + float(s["value"][1])
        return out

    def _prometheus_before(self, cur: Samples) -> Samples | None:
        """What the counters of ``cur`` held ``rate_window_s`` ago (None while the token counters have under two
        samples: rates unknown, not 0), from the samples Prometheus keeps:
        each series' increase over the window (resets counted as restarts from zero) per second of the span its
        samples cover, times the window. Counters only change in Prometheus at its scrapes, so the difference of
        two polls a second apart is zero most of the time (`top --prometheus` showed 0 tokens/s while the demo
        served ~540); the window's own samples give the live rate from a single poll. Gauges: as now."""
        w = self.rate_window_s
        counters = '{__name__=~"moescope_.+(_total|_bucket|_count|_sum)"}'
        per_s: dict = {}
        for s in prom_http.query(self.prometheus, f"{counters}[{w}s]", self.timeout):
            values = [(float(t), float(v)) for t, v in s.get("values", [])]
            if len(values) < 2 or values[-1][0] <= values[0][0]:
                continue
            increase = sum(b if b < a else b - a for (_, a), (_, b) in zip(values, values[1:]))
            key = _key(s["metric"])
            per_s[key] = per_s.get(key, 0.0) + increase / (values[-1][0] - values[0][0])
        if not any(k[0] == "moescope_router_tokens_total" for k in per_s):
            return None
        return {k: v - per_s[k] * w if k in per_s else v for k, v in cur.items()}

    def poll(self) -> Frame:
        now = time.monotonic()
        merged: Samples = {}
        status: dict[str, str] = {}
        sources = [self.prometheus] if self.prometheus else self.endpoints
        before: Samples | None = None  # Prometheus: its counters a window ago
        for src in sources:
            try:
                got = self._from_prometheus() if self.prometheus else scrape(src, self.timeout)
                if self.prometheus:
                    before = self._prometheus_before(got)
                status[src] = "ok"
            except (OSError, ValueError, KeyError) as exc:
                status[src] = f"unreachable: {getattr(exc, 'reason', exc)}"
                continue
            for k, v in got.items():
                merged[k] = merged.get(k, 0.0) + v if "_total" in k[0] or "_bucket" in k[0] else max(
                    merged.get(k, v), v)
        ok = any(v == "ok" for v in status.values())
        if self.prometheus:  # the rates of its own window, whatever the poll interval
            prev, prev_counts, dt = before, expert_counts(before or {}), float(self.rate_window_s)
        else:
            prev, prev_counts, dt = self._prev if ok else None, self._prev_counts, now - self._prev_at
        counts = expert_counts(merged) if ok else {}
        if prev is not None:
            self.history.push(expert_deltas(counts, prev_counts), dt)
        f = frame(merged, prev, dt, status, self.thresholds, history=self.history, totals=counts)
        if ok:
            self._prev, self._prev_at, self._prev_counts = merged, now, counts
        if self.alertmanager:
            try:
                f.alerts = firing_alerts(self.alertmanager, self.timeout)
            except (OSError, ValueError) as exc:
                f.alert_error = f"alertmanager unreachable: {getattr(exc, 'reason', exc)}"
        return f
