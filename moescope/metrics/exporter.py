"""Prometheus exposition over ``MetricsObserver``, and an HTTP endpoint per rank.

Nothing is computed per token or per increment, nor at scrape time: everything is read from the snapshot the
evaluator published last. The exporter serves one prometheus_client ``CollectorRegistry`` (``registry=``: its own
when none is passed), on which two collectors register, each rendered by the writer built for it:

- ``MoescopeCollector``: the few families prometheus_client renders (the histograms, exemplars included, process
  metrics from its ``ProcessCollector``, build info, throughput and all-to-all counters, drops and errors);
- ``metrics.layer_families.LayerFamilies``: the layer-labelled families (routing, window gauges, per-expert tiers,
  cache per layer, the bars), which at DeepSeek-V3's shape are ~17,000 series prometheus_client would take ~0.4 s
  to format: the fast writer renders them (``metrics.exposition``, which says why and how both share the registry).

Anything else registered on the registry (a user's own prometheus_client metrics) is served with them.

The endpoint binds 127.0.0.1 unless told otherwise and serves OpenMetrics (with exemplars) to clients that
ask for it (Prometheus does), the text format 0.0.4 otherwise, gzip-compressed when the client accepts it.
"""

from __future__ import annotations

import gzip
import http.server
import logging
import os
import threading
from typing import Iterable

from moescope.version import __version__
from moescope.errors import BadInput
from moescope.metrics import catalogue, histograms, system
from moescope.metrics.exposition import exposition
from moescope.metrics.layer_families import LayerFamilies
from moescope.metrics.state import EXTREMES_K, MetricsObserver

log = logging.getLogger("moescope.metrics")

TEXT = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


class MoescopeCollector:
    """prometheus-client ``Collector`` for the families prometheus_client renders (a few dozen series). With
    ``registry``, it registers itself there (prometheus_client's ``registry=``)."""

    def __init__(self, state: MetricsObserver, *, gpu: bool = True, registry=None) -> None:
        from prometheus_client import ProcessCollector  # optional: prometheus_client (the metrics extra)

        self.state, self.gpu = state, gpu
        self.process = ProcessCollector(namespace="moescope", registry=None)
        # which launch of expert-parallel ranks this process belongs to (parallel/spawn.py sets it for its ranks)
        self.replica = os.environ.get("MOESCOPE_REPLICA", "")
        if registry is not None:
            registry.register(self)

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
        for name, rate in (("moescope_peak_bandwidth_bytes_per_second", peak and peak.bandwidth),
                           ("moescope_peak_flops_per_second", peak and peak.flops)):
            if rate:
                f = self._family(name)
                f.add_metric(list(base), float(rate))
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


class BindError(BadInput):
    """The exporter's address cannot be bound (a port in use, an address not on this host). The message names no
    flag: a command that took the port from one (``--metrics-port``) says so where it catches this."""

    def __init__(self, addr: str, port: int, reason: str) -> None:
        super().__init__(f"cannot serve metrics on {addr}:{port}: {reason}")
        self.addr, self.port, self.reason = addr, port, reason


class Exporter:
    """An HTTP endpoint serving one rank's metrics. ``port=0`` picks a free port (see ``.port``).

    Args:
        state: the ``MetricsObserver`` whose snapshot is served: its two collectors (``MoescopeCollector``,
            ``LayerFamilies``) register on ``registry``.
        registry: the prometheus_client ``CollectorRegistry`` served (None: a new one); whatever else is registered
            on it is served too.
    """

    def __init__(self, state: MetricsObserver, *, port: int, addr: str = "127.0.0.1", registry=None) -> None:
        from prometheus_client import CollectorRegistry  # optional: prometheus_client (the metrics extra)

        self.state = state
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self.collector = MoescopeCollector(state, registry=self.registry)
        self.layers = LayerFamilies(state, registry=self.registry)
        self.addr, self.port = addr, port
        self._server: http.server.ThreadingHTTPServer | None = None
        if not state.per_expert:
            log.warning("layers x experts = %d exceeds the cardinality budget: exporting the reduced tier (the "
                        "%d hottest and coldest experts per layer, the load distribution); full resolution stays "
                        "in the trace store", len(state.info.moe_layers) * state.info.n_experts, EXTREMES_K)

    def exposition(self, openmetrics: bool = False) -> bytes:
        """The registry's exposition text now, without HTTP (tests, ``promtool check metrics``)."""
        return exposition(self.registry, openmetrics)

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
