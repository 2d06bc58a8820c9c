"""Prometheus exposition: a scrape-time collector over ``MetricsObserver`` and an HTTP server per rank.

Nothing is computed per token or per increment: the collector builds the families from the observer's
host-side state when Prometheus scrapes. Binds 127.0.0.1 unless told otherwise; serves OpenMetrics (with
exemplars) to clients that ask for it, the classic text format otherwise.
"""

from __future__ import annotations

import logging
from typing import Iterable

from moescope import __version__
from moescope.errors import BadInput
from moescope.metrics import catalogue, system
from moescope.metrics.state import MetricsObserver

log = logging.getLogger("moescope.metrics")


class MoescopeCollector:
    """prometheus-client ``Collector``: ``collect()`` yields every catalogue family that has data."""

    def __init__(self, state: MetricsObserver, *, gpu: bool = True) -> None:
        self.state = state
        self.gpu = gpu
        if not state.per_expert:
            log.warning("layers x experts = %d exceeds the cardinality budget: exporting per-layer aggregates "
                        "only (full resolution stays in the trace store)",
                        len(state.info.moe_layers) * state.info.n_experts)

    def describe(self) -> Iterable:
        return []  # families vary with data; skip registry-time collection

    def collect(self) -> Iterable:
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily)
        from prometheus_client.samples import Exemplar

        st = self.state
        base = (st.info.name, str(st.rank))
        spec = catalogue.BY_NAME

        def family(name: str):
            m = spec[name]
            cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
                   "histogram": HistogramMetricFamily}[m.kind]
            return cls(m.family, m.help, labels=list(m.all_labels))

        gauges = st.window_gauges()  # flushes pending routing, then takes the lock itself
        with st.lock:
            f = family("moescope_build_info")
            f.add_metric([*base, __version__, st.info.device], 1.0)
            yield f
            f = family("moescope_expert_series_per_expert")
            f.add_metric(list(base), 1.0 if st.per_expert else 0.0)
            yield f
            f = family("moescope_window_seconds")
            f.add_metric(list(base), float(st.window_s))
            yield f
            if st.per_expert and st.expert_tokens:
                f = family("moescope_expert_tokens_total")
                for layer, counts in sorted(st.expert_tokens.items()):
                    for e, n in enumerate(counts.tolist()):
                        f.add_metric([*base, str(layer), str(e)], float(n))
                yield f
            for name, per_layer in sorted(st.layer_counters.items()):
                f = family(name)
                for layer, v in sorted(per_layer.items()):
                    f.add_metric([*base, str(layer)], float(v))
                yield f
            by_name: dict[str, list] = {}
            for (name, labels), v in sorted(st.counters.items()):
                by_name.setdefault(name, []).append((labels, v))
            for name, items in by_name.items():
                f = family(name)
                for labels, v in items:
                    f.add_metric([*base, *labels], v)
                yield f
            hists: dict[str, list] = {}
            for (name, labels), h in sorted(st.hists.items()):
                hists.setdefault(name, []).append((labels, h))
            for name, items in hists.items():
                f = family(name)
                for labels, h in items:
                    buckets = []
                    for le, c, ex in h.cumulative():
                        if ex is None:
                            buckets.append((le, c))
                        else:
                            buckets.append((le, c, Exemplar(ex[0], ex[1], ex[2])))
                    f.add_metric([*base, *labels], buckets, h.sum)
                yield f
            errors = st.errors_source() if st.errors_source else {}
            dropped = st.dropped_source() if st.dropped_source else {}
        if dropped:
            f = family("moescope_capture_dropped_total")
            for q, n in sorted(dropped.items()):
                f.add_metric([*base, q], float(n))
            yield f
        if errors:
            f = family("moescope_observer_errors_total")
            for obs, n in sorted(errors.items()):
                f.add_metric([*base, obs], float(n))
            yield f
        for layer_name in ("moescope_expert_load_cv_ratio", "moescope_expert_load_max_over_mean_ratio",
                           "moescope_expert_load_top_share_ratio", "moescope_dead_experts",
                           "moescope_router_entropy_ratio", "moescope_router_margin_ratio",
                           "moescope_routing_drift_jsd_bits"):
            rows = [(layer, vals[layer_name]) for layer, vals in sorted(gauges["layers"].items()) if layer_name in vals]
            if rows:
                f = family(layer_name)
                for layer, value in rows:
                    f.add_metric([*base, str(layer)], value)
                yield f
        if st.flips:
            f = family("moescope_routing_flip_ratio")
            for layer, value in sorted(st.flips.items()):
                f.add_metric([*base, str(layer)], value)
            yield f
        if gauges["activation_ratio"] is not None:
            f = family("moescope_activation_ratio")
            f.add_metric(list(base), gauges["activation_ratio"])
            yield f
        rss = system.rss_bytes()
        if rss is not None:
            f = family("moescope_process_resident_memory_bytes")
            f.add_metric(list(base), float(rss))
            yield f
        if self.gpu:
            gpus = system.gpu_memory()
            if gpus:
                used, total = family("moescope_gpu_memory_used_bytes"), family("moescope_gpu_memory_total_bytes")
                for g in gpus:
                    used.add_metric([*base, str(g.index), g.uuid], float(g.used))
                    total.add_metric([*base, str(g.index), g.uuid], float(g.total))
                yield used
                yield total


class Exporter:
    """An HTTP endpoint serving one rank's metrics. ``port=0`` picks a free port (see ``.port``)."""

    def __init__(self, state: MetricsObserver, *, port: int, addr: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = MoescopeCollector(state)
        self.registry.register(self.collector)
        self.addr, self.port = addr, port
        self._server = self._thread = None

    def start(self) -> "Exporter":
        from prometheus_client import start_http_server

        try:
            self._server, self._thread = start_http_server(self.port, addr=self.addr, registry=self.registry)
        except OSError as exc:
            raise BadInput(f"cannot serve metrics on {self.addr}:{self.port}: {exc.strerror or exc}") from None
        self.port = self._server.server_port
        log.info("metrics on http://%s:%d/metrics", self.addr, self.port)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    def exposition(self, openmetrics: bool = False) -> bytes:
        """The current exposition text, without HTTP (tests, ``promtool check metrics``)."""
        if openmetrics:
            from prometheus_client.openmetrics.exposition import generate_latest
        else:
            from prometheus_client import generate_latest
        return generate_latest(self.registry)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
