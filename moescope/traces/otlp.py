"""OTLP/HTTP export of moescope's per-request spans (one ``moescope.request`` span per kept request, with
queue / prefill / decode children; see ``TraceRecorder``), for an OpenTelemetry Collector or any OTLP
backend (collectors/otel/otel-collector.yml receives on 127.0.0.1:4318).

Spans are made on the trace writer's thread and handed to a ``BatchSpanProcessor``: a bounded queue (2048
spans) exported in the background, which drops rather than blocks when the backend is slow; the engine never
waits on it. The endpoint is checked once at start (a clear error, exit 2, when nothing listens there).
"""

from __future__ import annotations

import socket
import urllib.parse

from moescope.errors import BadInput

TRACES_PATH = "/v1/traces"


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL for ``endpoint`` (a base such as http://127.0.0.1:4318, or the full URL)."""
    url = urllib.parse.urlsplit(endpoint)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise BadInput(f"OTLP endpoint must be an http(s) URL such as http://127.0.0.1:4318, got {endpoint!r}")
    path = url.path.rstrip("/")
    return urllib.parse.urlunsplit((url.scheme, url.netloc, path if path.endswith(TRACES_PATH) else
                                    path + TRACES_PATH, "", ""))


def check_reachable(url: str, timeout_s: float = 2.0) -> None:
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        raise BadInput(f"cannot reach the OTLP endpoint {parts.hostname}:{port} ({exc.strerror or exc}); "
                       "start the collector or drop --otlp-endpoint") from None


def tracer_provider(endpoint: str, *, service: str = "moescope", attributes: dict | None = None,
                    timeout_s: float = 5.0):
    """A ``TracerProvider`` exporting to ``endpoint`` over OTLP/HTTP (call ``shutdown()`` to flush)."""
    url = traces_url(endpoint)
    try:
        # optional: opentelemetry (the otel extra)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise BadInput("OTLP export needs opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http: "
                       "pip install 'moescope[otel]'") from None
    check_reachable(url)
    provider = TracerProvider(resource=Resource.create({"service.name": service, **(attributes or {})}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=timeout_s),
                                                   max_queue_size=2048, schedule_delay_millis=1000))
    return provider
