"""What `moescope top` shows, computed from scrapes: pure functions over parsed samples, no UI.

Sources: metrics endpoints (each rank's exporter, scraped directly) or a Prometheus server (instant
queries); optionally an Alertmanager for the firing alerts. Each poll yields a ``Frame``; rates (tokens/s,
per-expert slots, cache hit rate) come from the difference between two polls of the same counters.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from dataclasses import dataclass

from moescope.alerts.rules import Thresholds

Samples = dict[tuple[str, frozenset], float]


def parse_exposition(text: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(url: str, timeout: float = 2.0) -> Samples:
    """One endpoint; raises OSError (unreachable) or ValueError (not an exposition)."""
    if not url.startswith("http"):
        url = "http://" + url
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return parse_exposition(r.read().decode("utf-8", "replace"))


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
    expert_rate: dict[int, list[float]]  # layer -> slots/s per expert since the previous poll
    hottest: dict[int, list[int]]
    dead: dict[int, int]  # layer -> experts with no slot in the exporter's window
    a2a_p99: dict[str, float]  # rank -> seconds
    alerts: list[str] | None = None  # None: no Alertmanager configured
    alert_error: str | None = None


def _level(value: float | None, bar: float, higher_is_bad: bool = True) -> str:
    if value is None:
        return "none"
    if higher_is_bad:
        return "bad" if value > bar else "warn" if value > 0.67 * bar else "ok"
    return "bad" if value < bar else "warn" if value < bar + (1 - bar) / 3 else "ok"


def _fmt(v: float | None, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "pct":
        return f"{v:.1%}"
    if kind == "ms":
        return f"{v * 1e3:.1f}ms"
    if kind == "bytes":
        return f"{v / 2**20:.0f}MiB"
    if kind == "int":
        return f"{v:.0f}"
    return f"{v:.3f}"


def frame(cur: Samples, prev: Samples | None, dt: float, endpoints: dict[str, str], t: Thresholds = Thresholds(),
          at: float | None = None) -> Frame:
    models = {dict(labels).get("model") for (n, labels) in cur if n == "moescope_router_tokens_total"}
    model = sorted(m for m in models if m)[0] if any(models) else None
    # Expert-parallel ranks route the same tokens in lock-step: routing and cache figures come from the lowest
    # rank (summing ranks would count every token once per rank); all-to-all and memory stay per rank.
    ranks = sorted({dict(labels).get("rank", "0") for (n, labels) in cur if n == "moescope_router_tokens_total"})
    full = cur
    if len(ranks) > 1:
        keep = ranks[0]
        cur = {k: v for k, v in cur.items() if dict(k[1]).get("rank", keep) == keep}
        prev = {k: v for k, v in prev.items() if dict(k[1]).get("rank", keep) == keep} if prev else prev

    def delta(name, by=()):
        now = _sum(cur, name, by)
        before = _sum(prev, name, by) if prev else {}
        return {k: max(0.0, v - before.get(k, 0.0)) for k, v in now.items()}

    rate = (lambda d: sum(d.values()) / dt) if prev and dt > 0 else (lambda d: None)
    tokens = _sum(cur, "moescope_router_tokens_total", ("layer",))
    first_layer = min(tokens, key=lambda k: int(k[0]))[0] if tokens else None
    tok_rate = rate({k: v for k, v in delta("moescope_router_tokens_total", ("layer",)).items()
                     if k[0] == first_layer})
    cv_bar = t.load_cv_by_model.get(model, t.load_cv)
    drift_bar = t.drift_jsd_bits_by_model.get(model, t.drift_jsd_bits)
    hit_bar = t.cache_hit_rate_by_model.get(model, t.cache_hit_rate)
    lookups = delta("moescope_expert_cache_lookups_total") if prev else _sum(cur, "moescope_expert_cache_lookups_total")
    hits = delta("moescope_expert_cache_hits_total") if prev else _sum(cur, "moescope_expert_cache_hits_total")
    n_look = sum(lookups.values())
    hit_rate = sum(hits.values()) / n_look if n_look else None
    routed = delta("moescope_router_tokens_total") if prev else _sum(cur, "moescope_router_tokens_total")
    dropped = delta("moescope_tokens_dropped_total") if prev else _sum(cur, "moescope_tokens_dropped_total")
    drop_ratio = sum(dropped.values()) / sum(routed.values()) if sum(routed.values()) else None
    nonfinite = sum((delta if prev else lambda n: _sum(cur, n))("moescope_router_nonfinite_logits_total").values())
    fetch = _hist_delta(cur, prev, "moescope_expert_fetch_seconds")
    fetch_p99 = _quantile(fetch.get((), {}), 0.99) if fetch else None
    rss = _max(full, "moescope_process_resident_memory_bytes")
    values = [
        ("tokens/s", tok_rate, "int", None),
        ("load CV", _max(cur, "moescope_expert_load_cv_ratio"), "num", cv_bar),
        ("top share", _max(cur, "moescope_expert_load_top_share_ratio"), "pct", t.collapse_top_share),
        ("flips", _max(cur, "moescope_routing_flip_ratio"), "pct", t.flip_ratio),
        ("drift bits", _max(cur, "moescope_routing_drift_jsd_bits"), "num", drift_bar),
        ("non-finite", float(nonfinite), "int", 0.0),
        ("dropped", drop_ratio, "pct", t.drop_ratio),
        ("cache hit", hit_rate, "pct", hit_bar),
        ("fetch p99", fetch_p99, "ms", t.fetch_p99_s),
        ("RSS", rss, "bytes", None),
    ]
    tiles = []
    for name, v, kind, bar in values:
        if bar is None:
            level = "none" if v is None else "ok"
        elif name == "cache hit":
            level = _level(v, bar, higher_is_bad=False)
        elif name == "non-finite":
            level = "bad" if v else "ok"
        else:
            level = _level(v, bar)
        tiles.append(Tile(name, v, _fmt(v, kind), level))
    per_expert = delta("moescope_expert_tokens_total", ("layer", "expert")) if prev else {}
    expert_rate: dict[int, list[float]] = {}
    totals = _sum(cur, "moescope_expert_tokens_total", ("layer", "expert"))
    for (layer, expert) in totals:
        expert_rate.setdefault(int(layer), [])
    for layer in expert_rate:
        n_exp = 1 + max(int(e) for (lay, e) in totals if int(lay) == layer)
        expert_rate[layer] = [per_expert.get((str(layer), str(e)), 0.0) / dt if prev and dt > 0 else 0.0
                              for e in range(n_exp)]
    hottest, dead = {}, {}
    for layer in expert_rate:
        tot = [totals.get((str(layer), str(e)), 0.0) for e in range(len(expert_rate[layer]))]
        hottest[layer] = sorted(range(len(tot)), key=lambda e: -tot[e])[:3]
        dead[layer] = int(_sum(cur, "moescope_dead_experts", ("layer",)).get((str(layer),), 0))
    a2a = _hist_delta(full, None, "moescope_all_to_all_seconds", ("rank",))
    a2a_p99 = {rank[0]: q for rank, b in sorted(a2a.items()) if (q := _quantile(b, 0.99)) is not None}
    return Frame(at or time.time(), model, endpoints, tiles, expert_rate, hottest, dead, a2a_p99)


def firing_alerts(alertmanager: str, timeout: float = 2.0) -> list[str]:
    url = alertmanager.rstrip("/") + "/api/v2/alerts?active=true&silenced=false&inhibited=false"
    with urllib.request.urlopen(url, timeout=timeout) as r:
        alerts = json.loads(r.read())
    out = []
    for a in alerts:
        labels = a.get("labels", {})
        if labels.get("alertname") == "Watchdog":
            continue
        where = " ".join(f"{k}={labels[k]}" for k in ("layer", "rank", "peer") if k in labels)
        out.append(f"{labels.get('severity', '?')}: {labels.get('alertname')} {where}".strip())
    return sorted(out)


class Poller:
    """Polls the sources; keeps the previous scrape for rates. Errors become statuses, never exceptions."""

    def __init__(self, endpoints: list[str], *, prometheus: str | None = None, alertmanager: str | None = None,
                 thresholds: Thresholds = Thresholds(), timeout: float = 2.0) -> None:
        self.endpoints, self.prometheus, self.alertmanager = endpoints, prometheus, alertmanager
        self.thresholds, self.timeout = thresholds, timeout
        self._prev: Samples | None = None
        self._prev_at = 0.0

    def _from_prometheus(self) -> Samples:
        """The same metric names, from a Prometheus server: the latest value of every moescope series."""
        url = f"{self.prometheus.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": '{__name__=~"moescope_.+"}'})
        with urllib.request.urlopen(url, timeout=self.timeout) as r:
            body = json.loads(r.read())
        out: Samples = {}
        for s in body["data"]["result"]:
            m = dict(s["metric"])
            name = m.pop("__name__")
            for k in ("job", "instance"):
                m.pop(k, None)
            key = (name, frozenset(m.items()))
            out[key] = out.get(key, 0.0) + float(s["value"][1])
        return out

    def poll(self) -> Frame:
        now = time.monotonic()
        merged: Samples = {}
        status: dict[str, str] = {}
        sources = [self.prometheus] if self.prometheus else self.endpoints
        for src in sources:
            try:
                got = self._from_prometheus() if self.prometheus else scrape(src, self.timeout)
                status[src] = "ok"
            except (OSError, ValueError, KeyError) as exc:
                status[src] = f"unreachable: {getattr(exc, 'reason', exc)}"
                continue
            for k, v in got.items():
                merged[k] = merged.get(k, 0.0) + v if "_total" in k[0] or "_bucket" in k[0] else max(
                    merged.get(k, v), v)
        ok = any(v == "ok" for v in status.values())
        prev = self._prev if ok else None
        f = frame(merged, prev, now - self._prev_at, status, self.thresholds)
        if ok:
            self._prev, self._prev_at = merged, now
        if self.alertmanager:
            try:
                f.alerts = firing_alerts(self.alertmanager, self.timeout)
            except (OSError, ValueError) as exc:
                f.alert_error = f"alertmanager unreachable: {getattr(exc, 'reason', exc)}"
        return f
