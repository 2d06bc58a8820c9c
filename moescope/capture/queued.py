"""Run a slow sink off the engine thread: host-side events go through a bounded queue to a worker thread.

When the queue is full the event is dropped and counted (never a blocking put): the engine never waits on
observability. ``on_routing`` carries device tensors for in-thread accumulation and is not queued; wrap a
probe's output (``StepStats``) or a capture's (``StepTrace``), not the probe.

The worker takes events in batches: it drains whatever is queued, hands each to the inner observer, then
(with ``batch_s``) sleeps before looking again. On a machine whose cores the engine keeps busy, one wake-up
per batch instead of one per step is what keeps the sink's share of the GIL and of the cores small. With
``tick_s``, the inner observer's ``tick()`` runs at that interval on the worker (a writer's commit).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from moescope.capture.observer import Observer, RuntimeObserver
from moescope.capture.sources import Reading, Sources

if TYPE_CHECKING:  # typing only: the seam imports no engine
    from moescope.capture.records import RequestRecord, StepRecord
    from moescope.capture.token_trace import StepTrace
    from moescope.runtime.expert_cache import CacheDelta

log = logging.getLogger("moescope.capture")
_STOP = object()


class QueuedObserver(RuntimeObserver):
    """Forwards ``on_step``, ``on_request`` and ``on_cache`` to ``inner`` on a worker thread.

    Args:
        inner: the sink; may define ``tick()`` (periodic work on the worker) besides the hooks.
        maxsize: queue bound; events beyond it are dropped and counted.
        name: the ``queue`` label of ``moescope_capture_dropped_total``.
        tick_s: call ``inner.tick()`` at least this often (None: never).
        batch_s: pause after each batch, so that events arrive in batches (0: wake for every event).
        sources: where it reports its drops and errors (a ``capture.sources.Source``; ``moescope.instrument``
            registers a queued observer given in ``observers`` itself).
    Attributes:
        dropped: events dropped because the queue was full.
        errors: exceptions the inner observer raised (logged once, never re-raised).
    """

    def __init__(self, inner: Observer, *, maxsize: int = 1024, name: str | None = None,
                 tick_s: float | None = None, batch_s: float = 0.0, sources: Sources | None = None) -> None:
        self.inner = inner
        self.name = name or type(inner).__name__
        self.tick_s, self.batch_s = tick_s, batch_s
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.dropped = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._loop, name=f"moescope-{self.name}", daemon=True)
        self._thread.start()
        if sources is not None:
            sources.register(self)

    def read(self) -> Reading:
        """Events dropped and sink errors, under the queue's name."""
        return Reading(dropped={self.name: self.dropped}, errors={self.name: self.errors} if self.errors else {})

    def _put(self, item: tuple[str, tuple[Any, ...]]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1

    def on_step(self, step: "StepRecord | StepTrace") -> None:  # (the trace capture hands on its StepTrace)
        self._put(("on_step", (step,)))

    def on_request(self, request: "RequestRecord") -> None:
        self._put(("on_request", (request,)))

    def on_cache(self, layer: int, delta: "CacheDelta") -> None:
        self._put(("on_cache", (layer, delta)))

    def _call(self, hook: str, *args: Any) -> None:
        try:
            getattr(self.inner, hook)(*args)
        except Exception:
            self.errors += 1
            if self.errors == 1:
                log.exception("queued observer %s raised in %s (counted; later errors not logged)", self.name, hook)

    def _loop(self) -> None:
        tick_s = self.tick_s or 0.0
        tick = getattr(self.inner, "tick", None) if tick_s else None
        last_tick = time.monotonic()
        while True:
            wait = None if tick is None else max(0.0, tick_s - (time.monotonic() - last_tick))
            try:
                batch = [self._queue.get(timeout=wait)]
            except queue.Empty:
                batch = []
            while True:  # everything queued meanwhile: one wake-up for the lot
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = False
            for item in batch:
                if item is _STOP:
                    stop = True
                    continue
                self._call(item[0], *item[1])
            if tick is not None and (stop or time.monotonic() - last_tick >= tick_s):
                self._call("tick")
                last_tick = time.monotonic()
            if stop:
                self._call("shutdown")
                return
            if self.batch_s and batch:
                time.sleep(self.batch_s)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Drain what is queued (up to ``timeout``), then shut the inner observer down on the worker."""
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            log.warning("queued observer %s did not drain in %.1fs", self.name, timeout)
            return
        self._thread.join(timeout)
