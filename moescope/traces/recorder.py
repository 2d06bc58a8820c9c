"""Records per-token traces into the trace store without ever blocking the engine: the one trace pipeline,
capture -> bounded queue -> writer.

- capture (engine thread, ``capture.token_trace.TokenTraceCapture``): the hooks keep references to the step's
  routing decisions, layer times, cache misses and all-to-all times; ``on_step`` hands them on as one
  ``StepTrace``.
- queue (``capture.queued.QueuedObserver``, the same bounded queue every queued sink uses): ``put_nowait``;
  when full, the item is dropped and counted (``dropped``, exported as
  ``moescope_capture_dropped_total{queue="traces"}``); its worker thread takes items in batches.
- writer (``traces.writer.TraceWriter``, on the worker): packs each step once, slices every request's tokens
  out of the steps it took part in, samples, writes one row per request, commits every ``flush_interval_s``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moescope.capture.observer import RuntimeObserver
from moescope.capture.queued import QueuedObserver
from moescope.capture.sources import Reading, Sources
from moescope.capture.token_trace import TokenTraceCapture
from moescope.traces.writer import TraceWriter

if TYPE_CHECKING:  # typing only: the payloads the engine hands over
    from moescope.capture.decision import RoutingDecision
    from moescope.capture.records import RequestRecord, StepRecord
    from moescope.parallel.expert_parallel import AllToAllRecord
    from moescope.runtime.expert_cache import CacheDelta


class TraceRecorder(RuntimeObserver):
    """Attach with ``moescope.instrument(model, observers=[TraceRecorder(path)])``.

    Args:
        path: SQLite file (created if missing; a path that cannot be opened raises here, not later).
        sample: share of ordinary requests kept (flagged ones are always kept).
        max_bytes: retention: the store is trimmed (oldest first) past this size.
        queue_size: bounded queue between the engine and the writer.
        flush_interval_s: commit interval (what a crash can lose).
        batch_s: the writer's pause between batches (fewer wake-ups on a busy machine).
        tracer: an OpenTelemetry tracer; when given, one span per request (phases as children) and the
            trace id stored with the request.
        model, rank: stored with each request.
        sources: where it reports its queue's drops and the writer's errors (``capture.sources.Sources``: the
            metrics' registry, which ``moescope.instrument`` passes), as ``traces``.
    """

    def __init__(self, path: str | Path, *, sample: float = 1.0, max_bytes: int = 256 * 2**20,
                 queue_size: int = 4096, flush_interval_s: float = 0.5, batch_s: float = 0.05, tracer=None,
                 model: str | None = None, rank: int = 0, seed: int = 0, clock_offset: float | None = None,
                 sources: Sources | None = None) -> None:
        self.name = "traces"
        self.writer = TraceWriter(path, sample=sample, max_bytes=max_bytes, tracer=tracer, model=model, rank=rank,
                                  seed=seed, clock_offset=clock_offset)
        self.queue = QueuedObserver(self.writer, maxsize=queue_size, name=self.name, tick_s=flush_interval_s,
                                    batch_s=batch_s)
        self.capture = TokenTraceCapture(self.queue.on_step)
        # the engine-thread hooks, bound once: no extra Python frame per layer
        self.on_routing = self.capture.on_routing
        self.on_layer_time = self.capture.on_layer_time
        self.on_cache = self.capture.on_cache
        self.on_all_to_all = self.capture.on_all_to_all
        self.on_step = self.capture.on_step
        self.on_request = self.queue.on_request
        if sources is not None:
            sources.register(self)

    # (class-level hooks, so FanOut sees them overridden; the instance attributes above are what runs)
    def on_routing(self, layer: int, decision: "RoutingDecision") -> None:  # noqa: F811
        self.capture.on_routing(layer, decision)

    def on_layer_time(self, layer: int, router_s: float, experts_s: float) -> None:  # noqa: F811
        self.capture.on_layer_time(layer, router_s, experts_s)

    def on_cache(self, layer: int, delta: "CacheDelta") -> None:  # noqa: F811
        self.capture.on_cache(layer, delta)

    def on_all_to_all(self, record: "AllToAllRecord") -> None:  # noqa: F811
        self.capture.on_all_to_all(record)

    def on_step(self, step: "StepRecord") -> None:  # noqa: F811
        self.capture.on_step(step)

    def on_request(self, request: "RequestRecord") -> None:  # noqa: F811
        self.queue.on_request(request)

    def read(self) -> Reading:
        """Steps and requests its queue dropped, and the writer's errors, as ``traces`` (a
        ``capture.sources.Source``)."""
        errors = self.errors
        return Reading(dropped={self.name: self.dropped}, errors={self.name: errors} if errors else {})

    def resync(self) -> None:
        self.capture.resync()

    def shutdown(self) -> None:
        """Drain the queue, write and commit what is left, close the store."""
        self.queue.shutdown()

    @property
    def path(self) -> Path:
        return self.writer.path

    @property
    def run_id(self) -> str:
        return self.writer.run_id

    @property
    def dropped(self) -> int:
        """Steps and requests dropped because the queue was full."""
        return self.queue.dropped

    @property
    def errors(self) -> int:
        """Exceptions in the writer (per item) and failed writes."""
        return self.queue.errors + self.writer.errors

    @property
    def written(self) -> int:
        return self.writer.written

    @property
    def sampled_out(self) -> int:
        return self.writer.sampled_out

    @property
    def unrouted(self) -> int:
        return self.writer.unrouted
