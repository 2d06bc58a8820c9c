"""Serving metrics on the API port (``GET /metrics``): what vLLM's server exports, recorded as it happens.

Names and help come from the catalogue (``moescope_serve_*``: vLLM's names after the prefix, so one
``metric_relabel_configs`` rule turns them into ``vllm:*``; docs/serve.md). Their own registry: the engine's
exporter (``--metrics-port``) is unchanged.

Nothing here runs on the engine thread but one clock read per step: the engine loop's ``wake`` (built here)
stamps the step's end and hands the streams that got a token to the event loop, where each token is observed
(time to first token at a request's first, inter-token latency at every later one) before the handlers are
woken. End-to-end and queue time come from the request's record when it ends; running and waiting are read
at scrape time. Per-request state lives only while the request is in flight.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from moescope.metrics import catalogue
from moescope.serve.loop import EngineLoop, Job, TokenStream, now
from moescope.serve.text import FINISH_REASONS

TEXT = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
FINISHED = ("stop", "length", "abort")  # vLLM's finished_reason values; abort: cancelled, timed out, failed
CAUSES = ("queue_full", "invalid", "unavailable")
P = "moescope_serve_"
# Prometheus metric_relabel_configs that make vLLM's published Grafana dashboard
# (examples/online_serving/prometheus_grafana/grafana.json) read these series: inter-token latency under the name
# that dashboard reads (vLLM's older time_per_output_token_seconds; drop the first rule for a dashboard that reads
# vllm:inter_token_latency_seconds), every other series as vllm:<name>, and the model as model_name.
VLLM_RELABEL = (
    {"source_labels": ["__name__"], "regex": P + "inter_token_latency_seconds(.*)", "target_label": "__name__",
     "replacement": "vllm:time_per_output_token_seconds$1"},
    {"source_labels": ["__name__"], "regex": P + "(.+)", "target_label": "__name__", "replacement": "vllm:$1"},
    {"source_labels": ["model"], "target_label": "model_name"},
)


def cause(status: int) -> str:
    """A refusal's cause label from its HTTP status."""
    return "queue_full" if status == 429 else "unavailable" if status >= 500 else "invalid"


class ServeMetrics:
    """The API port's metrics for one served model (labels ``model`` and ``rank``, as every moescope series)."""

    def __init__(self, model: str, loop: EngineLoop, rank: int = 0) -> None:
        # optional: prometheus_client (the metrics extra)
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.loop = loop
        self.base = (model, str(rank))
        self.registry = CollectorRegistry(auto_describe=False)
        spec = catalogue.BY_NAME

        def hist(name):
            m = spec[P + name]
            return Histogram(m.family, m.help, labelnames=list(m.all_labels), buckets=m.buckets,
                             registry=self.registry).labels(*self.base)

        def counter(name):
            m = spec[P + name]
            return Counter(m.family, m.help, labelnames=list(m.all_labels), registry=self.registry)

        self.ttft, self.itl = hist("time_to_first_token_seconds"), hist("inter_token_latency_seconds")
        self.e2e, self.queue = hist("e2e_request_latency_seconds"), hist("request_queue_time_seconds")
        self.prefill, self.decode = hist("request_prefill_time_seconds"), hist("request_decode_time_seconds")
        self.prompt_hist, self.generation_hist = hist("request_prompt_tokens"), hist("request_generation_tokens")
        self.max_tokens_hist = hist("request_max_num_generation_tokens")
        success, rejected = counter("request_success_total"), counter("request_rejected_total")
        self.success = {r: success.labels(*self.base, r) for r in FINISHED}
        self.rejected_by = {c: rejected.labels(*self.base, c) for c in CAUSES}
        self.prompt_tokens = counter("prompt_tokens_total").labels(*self.base)
        self.generation_tokens = counter("generation_tokens_total").labels(*self.base)
        self.registry.register(_Gauges(self))
        # stream -> [request id, arrival, last token time, tokens seen, max_tokens]; event-loop thread only
        self._live: dict[TokenStream, list] = {}

    # -- event-loop thread -------------------------------------------------------------------------------
    def admitted(self, job: Job) -> None:
        """The job was queued (call before the handler awaits anything: no token can be observed earlier)."""
        self._live[job.stream] = [job.request_id, job.arrival, job.arrival, 0, job.params.max_tokens]

    def rejected(self, status: int) -> None:
        self.rejected_by[cause(status)].inc()

    def waker(self, aloop: asyncio.AbstractEventLoop) -> Callable[[list[TokenStream]], None]:
        """The engine loop's ``wake``: one clock read, a snapshot of each stream's (tokens pushed, ended) and one
        ``call_soon_threadsafe`` per step on the engine thread; the observing and the handlers' wake-up run on
        ``aloop``. The snapshot, not the stream read later, says what this step made: on a loaded event loop
        several steps' wake-ups wait in its queue, and by the first one's turn the stream may hold the last
        step's tokens and record."""
        return lambda streams: aloop.call_soon_threadsafe(
            self._tick, [(s, s.pushed, s.record is not None or s.failed) for s in streams], now())

    def _tick(self, streams: list[tuple[TokenStream, int, bool]], t: float) -> None:
        for s, pushed, ended in streams:
            entry = self._live.get(s)
            if entry is not None:
                self._observe(s, entry, t, pushed, ended)
            s.wake()

    def _observe(self, s: TokenStream, entry: list, t: float, pushed: int, ended: bool) -> None:
        rid, arrival, last, seen, max_tokens = entry
        # One sink call per request per step: at most one new token per wake-up (a cancelled or timed-out
        # request ends with none).
        for _ in range(pushed - seen):
            ex = {"request_id": rid}
            if seen == 0:
                self.ttft.observe(t - arrival, ex)
            else:
                self.itl.observe(t - last, ex)
            self.generation_tokens.inc()
            last, seen = t, seen + 1
        entry[2], entry[3] = last, seen
        if not ended:
            return
        record = s.record
        del self._live[s]
        ex = {"request_id": rid}
        self.max_tokens_hist.observe(max_tokens)
        if record is None:  # lost in a failed step
            self.e2e.observe(t - arrival, ex)
            self.success["abort"].inc()
            return
        self.e2e.observe(record.total_s, ex)
        self.queue.observe(record.queue_s, ex)
        self.prompt_tokens.inc(len(record.prompt_tokens))
        self.prompt_hist.observe(len(record.prompt_tokens))
        self.generation_hist.observe(record.n_output)
        if record.n_output:  # it was prefilled
            self.prefill.observe(record.prefill_s, ex)
            self.decode.observe(sum(record.token_latencies_s[1:]), ex)
        self.success[FINISH_REASONS.get(record.finish_reason, "abort")].inc()

    def exposition(self, accept: str) -> tuple[bytes, str]:
        """(body, content type): OpenMetrics (with the request-id exemplars) when ``accept`` asks for it."""
        if "application/openmetrics-text" in accept:
            # optional: prometheus_client (the metrics extra)
            from prometheus_client.openmetrics.exposition import generate_latest

            return generate_latest(self.registry), OPENMETRICS
        from prometheus_client import generate_latest  # optional: prometheus_client (the metrics extra)

        return generate_latest(self.registry), TEXT


class _Gauges:
    """Running and waiting, read when scraped."""

    def __init__(self, m: ServeMetrics) -> None:
        self.m = m

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily  # optional: prometheus_client (the metrics extra)

        for name, value in (("num_requests_running", self.m.loop.running),
                            ("num_requests_waiting", len(self.m.loop.admission))):
            spec = catalogue.BY_NAME[P + name]
            f = GaugeMetricFamily(spec.name, spec.help, labels=list(spec.all_labels))
            f.add_metric(list(self.m.base), float(value))
            yield f
