"""Run a slow sink off the engine thread: host-side events go through a bounded queue to a worker thread.

When the queue is full the event is dropped and counted (never a blocking put): the engine never waits on
observability. ``on_routing`` carries device tensors for in-thread accumulation and is not queued; wrap a
probe's output (``StepStats``), not the probe.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from moescope.capture.observer import Observer

log = logging.getLogger("moescope.capture")
_STOP = object()


class QueuedObserver(Observer):
    """Forwards ``on_step``, ``on_request`` and ``on_cache`` to ``inner`` on a worker thread.

    Attributes:
        dropped: events dropped because the queue was full.
        errors: exceptions the inner observer raised (logged, never re-raised).
    """

    def __init__(self, inner: Observer, *, maxsize: int = 1024, name: str | None = None) -> None:
        self.inner = inner
        self.name = name or type(inner).__name__
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.dropped = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._loop, name=f"moescope-{self.name}", daemon=True)
        self._thread.start()

    def _put(self, item: tuple[str, tuple[Any, ...]]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1

    def on_step(self, step: Any) -> None:
        self._put(("on_step", (step,)))

    def on_request(self, request: Any) -> None:
        self._put(("on_request", (request,)))

    def on_cache(self, layer: int, delta: Any) -> None:
        self._put(("on_cache", (layer, delta)))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            hook, args = item
            try:
                getattr(self.inner, hook)(*args)
            except Exception:
                self.errors += 1
                if self.errors == 1:
                    log.exception("queued observer %s raised (counted; later errors not logged)", self.name)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Drain what is queued (up to ``timeout``), then shut the inner observer down."""
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            log.warning("queued observer %s did not drain in %.1fs", self.name, timeout)
            return
        self._thread.join(timeout)
        try:
            self.inner.shutdown()
        except Exception:
            self.errors += 1
            log.exception("queued observer %s raised in shutdown", self.name)
