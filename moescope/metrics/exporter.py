"""Prometheus exposition over ``MetricsObserver``, and an HTTP endpoint per rank.

Nothing is computed per token or per increment: everything is read from the observer's host-side state when
Prometheus scrapes. Two writers share one exposition:

- prometheus_client renders the few families it is built for: the histograms (its ``Histogram``, exemplars
  included), process metrics (its ``ProcessCollector``), build info, throughput and all-to-all counters;
- ``moescope.metrics.exposition`` renders the layer-labelled families (routing, window gauges, per-expert
  tiers, cache per layer), which at DeepSeek-V3's shape are ~17,000 series prometheus_client would take
  ~0.4 s to format (that module says why).

The endpoint binds 127.0.0.1 unless told otherwise and serves OpenMetrics (with exemplars) to clients that
ask for it (Prometheus does), the text format 0.0.4 otherwise, gzip-compressed when the client accepts it.
"""

from __future__ import annotations

import gzip
import http.server
import logging
import math
import os
import threading
from typing import Iterable

from moescope.version import __version__
from moescope.errors import BadInput
from moescope.metrics import catalogue, histograms, system
from moescope.metrics import step_balance_families  # [eplb] wiring
from moescope.metrics.exposition import FamilyWriter
from moescope.metrics.state import EXTREMES_K, LAYER_GAUGES, MetricsObserver

log = logging.getLogger("moescope.metrics")

TEXT = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
ROUTING_LAYER_COUNTERS = ("moescope_tokens_dropped_total", "moescope_router_nonfinite_logits_total",
                          "moescope_expert_distinct_total", "moescope_expert_distinct_steps_total")
CACHE_LAYER_COUNTERS = tuple(m.name for m in catalogue.CATALOGUE
                             if m.name.startswith("moescope_expert_cache_") and m.kind == "counter")


class MoescopeCollector:
    """prometheus-client ``Collector`` for the families prometheus_client renders (a few dozen series)."""

    def __init__(self, state: MetricsObserver, *, gpu: bool = True) -> None:
        from prometheus_client import ProcessCollector  # optional: prometheus_client (the metrics extra)

        self.state, self.gpu = state, gpu
        self.process = ProcessCollector(namespace="moescope", registry=None)
        # which launch of expert-parallel ranks this process belongs to (parallel/spawn.py sets it for its ranks)
        self.replica = os.environ.get("MOESCOPE_REPLICA", "")

    def describe(self) -> Iterable:
        return []  # families vary with data; skip registry-time collection

    def _family(self, name: str):
        # optional: prometheus_client (the metrics extra)
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = catalogue.BY_NAME[name]
        cls = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
        return cls(m.family, m.help, labels=list(m.all_labels))

    def collect(self) -> Iterable:
        st = self.state
        snap = st.current()  # the last evaluation's snapshot: read, never computed here
        base = (st.info.name, str(st.rank))
        f = self._family("moescope_build_info")
        f.add_metric([*base, __version__, st.info.device, self.replica], 1.0)
        yield f
        for name, value in (("moescope_expert_series_per_expert", 1.0 if st.per_expert else 0.0),
                            ("moescope_window_seconds", float(st.window_s)),
                            ("moescope_capture_enabled", 1.0 if snap.capture_enabled else 0.0)):
            f = self._family(name)
            f.add_metric(list(base), value)
            yield f
        peak = st.peak
        for name, value in (("moescope_peak_bandwidth_bytes_per_second", peak and peak.bandwidth),
                            ("moescope_peak_flops_per_second", peak and peak.flops)):
            if value:
                f = self._family(name)
                f.add_metric(list(base), float(value))
                yield f
        by_name: dict[str, list] = {}
        for (name, labels), v in sorted(snap.counters.items()):
            if not catalogue.BY_NAME[name].routing:  # routing counters: the fast writer's
                by_name.setdefault(name, []).append((labels, v))
        for name, items in by_name.items():
            f = self._family(name)
            for labels, v in items:
                f.add_metric([*base, *labels], v)
            yield f
        yield from histograms.families(snap.histograms, base)
        for name, values in (("moescope_capture_dropped_total", snap.dropped),
                             ("moescope_observer_errors_total", snap.errors),
                             ("moescope_capture_switches_total", {"": snap.capture_switches} if
                              snap.capture_switches else {})):
            if values:
                f = self._family(name)
                for key, n in sorted(values.items()):
                    f.add_metric([*base, key] if key else list(base), float(n))
                yield f
        if snap.cost_s is not None:
            f = self._family("moescope_capture_seconds_total")
            f.add_metric(list(base), float(snap.cost_s))
            yield f
        yield from self._process(base)
        if self.gpu:
            gpus = system.gpu_memory()
            if gpus:
                used = self._family("moescope_gpu_memory_used_bytes")
                total = self._family("moescope_gpu_memory_total_bytes")
                for g in gpus:
                    used.add_metric([*base, str(g.index), g.uuid], float(g.used))
                    total.add_metric([*base, str(g.index), g.uuid], float(g.total))
                yield used
                yield total

    def _process(self, base) -> Iterable:
        """prometheus_client's ProcessCollector (reads /proc; nothing elsewhere), with our model and rank
        labels so rules can join process memory to the rest."""
        wanted = {"moescope_process_resident_memory_bytes", "moescope_process_cpu_seconds_total"}
        for fam in self.process.collect():
            for s in fam.samples:
                if s.name in wanted:
                    f = self._family(s.name)
                    f.add_metric(list(base), s.value)
                    yield f


def routing_text(st: MetricsObserver, w: FamilyWriter, openmetrics: bool) -> str:
    """The layer-labelled families (and the model's activation gauges), written by the fast writer from the last
    evaluation's snapshot (read, never computed here)."""
    snap = st.current()
    out = []
    if st.export_routing:
        out += _routing_counters(st, snap, w, openmetrics)
        out += _window_gauges(st, snap, w, openmetrics)
        out += _rank_and_totals(st, snap, w, openmetrics)
        # [eplb] wiring: the step-level prediction's families from its snapshot (metrics.step_balance_families)
        out.append(step_balance_families.text(snap.extra.get("StepBalance"), w, openmetrics, st.per_expert))
    out += _cache_and_eplb(snap, w, openmetrics)
    out.append(_bars_text(st, snap, w, openmetrics))
    return "".join(out)


def _layer_rows(values: dict) -> list:
    return [((str(k),), v) for k, v in sorted(values.items())]


def _routing_counters(st: MetricsObserver, snap, w: FamilyWriter, om: bool) -> list[str]:
    spec = catalogue.BY_NAME
    out = []
    if snap.activation is not None:
        out.append(w.family(spec["moescope_activation_ratio"], [((), snap.activation)], om))
    out.append(w.family(spec["moescope_activation_expected_ratio"], [((), st.info.expected_activation)], om))
    by_mode = sorted(((str(layer), mode), v) for (layer, mode), v in snap.router_tokens_by_mode.items())
    out.append(w.family(spec["moescope_router_tokens_total"], by_mode, om))  # by forward_mode
    for name in ROUTING_LAYER_COUNTERS:
        out.append(w.family(spec[name], _layer_rows(snap.layer_counters.get(name, {})), om))
    rerouted = sorted((labels, v) for (name, labels), v in snap.counters.items()
                      if name == "moescope_rerouted_slots_total")
    out.append(w.family(spec["moescope_rerouted_slots_total"], rerouted, om))
    return out


def _window_gauges(st: MetricsObserver, snap, w: FamilyWriter, om: bool) -> list[str]:
    """The window's gauges per layer, the hot experts, the references and the baseline's series."""
    spec = catalogue.BY_NAME
    g = snap.gauges
    layers = [str(layer) for layer in g.layers]
    out = [w.family(spec[name], [((lay,), v) for lay, v in zip(layers, getattr(g, attr).tolist())], om)
           for name, attr in LAYER_GAUGES]
    out.append(w.family(spec["moescope_window_draws"], [((), g.window_draws)], om))
    out.append(w.family(spec["moescope_routing_drift_jsd_bits"], _layer_rows(snap.drift), om))
    out.append(w.family(spec["moescope_routing_drift_noise_bits"], _layer_rows(snap.drift_noise), om))
    out.append(w.family(spec["moescope_routing_flip_ratio"], _layer_rows(snap.flips), om))
    hot = g.hot_experts(EXTREMES_K)
    reference = list(g.hot_reference) or ["fair"] * len(layers)
    out.append(w.family(spec["moescope_expert_hot_factor_ratio"],
                        [((lay, str(e), reference[j]), f) for j, lay in enumerate(layers) for e, f in hot[j]], om))
    if g.dead_holding is not None:
        out.append(w.family(spec["moescope_dead_experts_holding"],
                            [((lay,), v) for lay, v in zip(layers, g.dead_holding.tolist())], om))
    for name, values in (("moescope_reference_load_cv_ratio", g.reference_cv),
                         ("moescope_reference_top_share_ratio", g.reference_top)):
        if values is not None:  # absent while a layer's reference is being learned
            out.append(w.family(spec[name], [((lay, reference[j]), v) for j, (lay, v) in
                                             enumerate(zip(layers, values.tolist())) if math.isfinite(v)], om))
    n_exp = st.info.n_experts
    out.append(w.gauge_histogram(spec["moescope_expert_load_relative"],
                                 [((lay,), [*rel, n_exp], float(n_exp)) for lay, rel in
                                  zip(layers, g.relative.astype(int).tolist())], om))
    extremes = g.extremes(EXTREMES_K)
    slots = g.slots.astype(int)
    out.append(w.family(spec["moescope_expert_window_slots"],
                        [((lay, str(e)), int(slots[j, e])) for j, lay in enumerate(layers) for e in extremes[j]], om))
    out.append(_baseline_text(st, g, snap.baseline, extremes, hot, w, om))
    return out


def _rank_and_totals(st: MetricsObserver, snap, w: FamilyWriter, om: bool) -> list[str]:
    spec = catalogue.BY_NAME
    out = []
    if snap.rank_loads is not None:
        per_layer, per_rank = snap.rank_loads
        out.append(w.family(spec["moescope_rank_load_max_over_mean_ratio"], _layer_rows(per_layer), om))
        out.append(w.family(spec["moescope_rank_window_slots"], _layer_rows(per_rank), om))
    if st.per_expert and snap.expert_tokens:
        big = spec["moescope_expert_tokens_total"]
        out.append(w.header(big, om) + "".join(w.expert_rows(big, layer, values.tolist())
                                               for layer, values in sorted(snap.expert_tokens.items())))
    return out


def _cache_and_eplb(snap, w: FamilyWriter, om: bool) -> list[str]:
    spec = catalogue.BY_NAME
    out = [w.family(spec[name], _layer_rows(snap.layer_counters.get(name, {})), om) for name in CACHE_LAYER_COUNTERS]
    out.append(w.family(spec["moescope_expert_cache_capacity_ratio"], _layer_rows(snap.capacity), om))
    for name, values in zip(("moescope_eplb_before_max_over_mean_ratio", "moescope_eplb_predicted_max_over_mean_ratio",
                             "moescope_eplb_measured_max_over_mean_ratio"), snap.eplb):
        out.append(w.family(spec[name], _layer_rows(values), om))
    return out


# The bars a rank that exports no routing still has a quantity for (its cache, all-to-all, fetches, memory)
_BARS_WITHOUT_ROUTING = ("cache", "all_to_all", "fetch", "slow_rank_share", "slow_rank_wait", "memory")


def _bars_text(st: MetricsObserver, snap, w: FamilyWriter, openmetrics: bool) -> str:
    """The bar and clear bar of every judgement (``Thresholds.bars``, computed by the evaluator: the series the alert
    rules compare with), for every layer of the model and for the model."""
    if snap.bars is None:
        return ""
    layers, bars = snap.bars
    routing = st.export_routing
    return "".join(w.family(catalogue.BY_NAME[name], [r for r in bars.rows(layers, clear)
                                                      if routing or r[0][0] in _BARS_WITHOUT_ROUTING], openmetrics)
                   for name, clear in (("moescope_judgement_bar", False), ("moescope_judgement_clear_bar", True)))


def _baseline_text(st: MetricsObserver, g, profile, extremes, hot, w: FamilyWriter, openmetrics: bool) -> str:
    """The loaded baseline's series: its structural CV per layer and each expert's share (full tier: every
    expert of every layer it has; reduced tier: the experts of moescope_expert_window_slots and the hot
    experts)."""
    if profile is None:
        return ""
    spec = catalogue.BY_NAME
    model_layers = set(st.current().window_layers)
    layers = sorted(layer for layer in profile.layers if layer in model_layers)
    out = [w.family(spec["moescope_baseline_load_cv_ratio"],
                    [((str(k),), float(profile.layers[k].structural_cv)) for k in layers], openmetrics)]
    share = spec["moescope_baseline_expert_share_ratio"]
    if st.per_expert:
        rows = [((str(k), str(e)), v) for k in layers for e, v in enumerate(profile.layers[k].share.tolist())]
    else:
        shown = {layer: sorted(set(extremes[j]) | {e for e, _ in hot[j]}) for j, layer in enumerate(g.layers)}
        rows = [((str(k), str(e)), float(profile.layers[k].share[e])) for k in layers for e in shown.get(k, ())]
    out.append(w.family(share, rows, openmetrics))
    return "".join(out)


class BindError(BadInput):
    """The exporter's address cannot be bound (a port in use, an address not on this host). The message names no
    flag: a command that took the port from one (``--metrics-port``) says so where it catches this."""

    def __init__(self, addr: str, port: int, reason: str) -> None:
        super().__init__(f"cannot serve metrics on {addr}:{port}: {reason}")
        self.addr, self.port, self.reason = addr, port, reason


class Exporter:
    """An HTTP endpoint serving one rank's metrics. ``port=0`` picks a free port (see ``.port``)."""

    def __init__(self, state: MetricsObserver, *, port: int, addr: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry  # optional: prometheus_client (the metrics extra)

        self.state = state
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = MoescopeCollector(state)
        self.registry.register(self.collector)
        self.writer = FamilyWriter(state.info.name, str(state.rank))
        self.addr, self.port = addr, port
        self._server: http.server.ThreadingHTTPServer | None = None
        if not state.per_expert:
            log.warning("layers x experts = %d exceeds the cardinality budget: exporting the reduced tier (the "
                        "%d hottest and coldest experts per layer, the load distribution); full resolution stays "
                        "in the trace store", len(state.info.moe_layers) * state.info.n_experts, EXTREMES_K)

    def exposition(self, openmetrics: bool = False) -> bytes:
        """The current exposition text, without HTTP (tests, ``promtool check metrics``)."""
        if openmetrics:
            # optional: prometheus_client (the metrics extra)
            from prometheus_client.openmetrics.exposition import generate_latest
        else:
            from prometheus_client import generate_latest  # optional: prometheus_client (the metrics extra)
        small = generate_latest(self.registry)
        fast = routing_text(self.state, self.writer, openmetrics).encode()
        if openmetrics:  # one "# EOF", at the very end
            return small[: -len(b"# EOF\n")] + fast + b"# EOF\n"
        return small + fast

    def start(self) -> "Exporter":
        exporter = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                om = "application/openmetrics-text" in self.headers.get("Accept", "")
                body = exporter.exposition(openmetrics=om)
                self.send_response(200)
                self.send_header("Content-Type", OPENMETRICS if om else TEXT)
                if "gzip" in self.headers.get("Accept-Encoding", ""):
                    body = gzip.compress(body, 1)  # level 1: a tenth of the bytes for ~10 ms at 1.4 MB
                    self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the scraper gave up (its timeout): not ours
                    pass

            def log_message(self, *args):
                pass

        try:
            self._server = http.server.ThreadingHTTPServer((self.addr, self.port), Handler)
        except OSError as exc:
            raise BindError(self.addr, self.port, exc.strerror or str(exc)) from None
        self._server.daemon_threads = True
        self.port = self._server.server_port
        threading.Thread(target=self._server.serve_forever, name="moescope-metrics", daemon=True).start()
        log.info("metrics on http://%s:%d/metrics", self.addr, self.port)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
