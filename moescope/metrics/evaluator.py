"""The one evaluator: a thread that runs ``MetricsObserver.evaluate`` once per interval, and soon after the engine
goes idle, whatever reads the metrics. Off the engine's thread: an engine step never carries a summary, a judgement
or the learned reference's update.

Between evaluations it sleeps on an event (``wake``: the engine went idle, or much routing waits), so an idle process
costs one wake-up per interval; a wake brings the next evaluation forward, never closer than ``MIN_GAP_S`` to the last
one. Each evaluation also polls the capture switch's control file
(``moescope.capture.switch``): the operator's kill switch takes effect within one interval.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("moescope.metrics")

# Evaluations a wake can bring forward come at most this often (the engine's idle signal comes once per idle period)
MIN_GAP_S = 0.25


class Evaluator:
    """Runs ``observer.evaluate()`` every ``interval_s`` seconds (and when woken) on a daemon thread.

    Args:
        observer: the ``MetricsObserver`` to evaluate.
        interval_s: the evaluation interval (the snapshot readers serve is at most this old).
        switch: a ``CaptureSwitch`` whose control file is polled once per evaluation, or None.
    """

    def __init__(self, observer, interval_s: float, switch=None) -> None:
        self.observer, self.interval_s, self.switch = observer, interval_s, switch
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.runs = 0

    def start(self) -> "Evaluator":
        self._thread = threading.Thread(target=self._loop, name="moescope-evaluator", daemon=True)
        self._thread.start()
        return self

    def wake(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            self._wake.wait(max(0.0, self.interval_s - (time.monotonic() - last)))
            self._wake.clear()
            # woken early (an engine going idle between requests, many times a second under real-time traffic):
            # at most one evaluation per MIN_GAP_S, so the evaluator's share of a core stays bounded
            gap = min(self.interval_s, MIN_GAP_S) - (time.monotonic() - last)
            if gap > 0:
                self._stop.wait(gap)
            if self._stop.is_set():
                return
            last = time.monotonic()
            if self.switch is not None:
                try:
                    self.switch.poll()
                except Exception:  # noqa: BLE001 (a control file that cannot be read changes nothing)
                    log.debug("moescope: the capture switch's control file could not be read", exc_info=True)
            self.observer.evaluate()  # never raises: a failed evaluation is counted there
            self.runs += 1

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread (after the evaluation it may be in); the caller runs the final evaluation."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None


__all__ = ["Evaluator"]
