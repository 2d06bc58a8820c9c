"""What components count about themselves, registered where the metrics read it: prometheus_client's collector
pattern, one level below the exposition.

A component that counts something of its own (the fan-out: the exceptions its observers raised; a bounded queue or
the trace recorder: the events it dropped and the errors its sink raised; the vLLM worker: the seconds moescope cost
vLLM's step path; an engine adapter: the expert-parallel placement and the expert cache's capacity) is a ``Source``:
one ``read()`` that returns a ``Reading``. It registers itself on the ``Sources`` passed to it (``FanOut(...,
sources=)``, ``TraceRecorder(..., sources=)``, ``EngineContract.register(sources)``), the way a prometheus_client
instrument takes ``registry=``: no caller sets callbacks on the metrics from outside.

``MetricsObserver`` owns one ``Sources`` and reads it once per evaluation, on the evaluator's thread: every source is
read there, never on the engine's thread and never at scrape time (a scrape serves the snapshot that reading went
into). A ``read()`` takes no lock the engine holds and must be cheap (a few attribute reads; the runtime's placement
walks its MoE layers once); a source that raises is counted (``errors["sources"]``), never raised.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Protocol, runtime_checkable

if TYPE_CHECKING:  # typing only: the seam imports no engine
    from moescope.parallel.placement import Placement

log = logging.getLogger("moescope.capture")


@dataclass(frozen=True)
class Reading:
    """What one source reports, as of the read. Every field optional: a source fills what it counts."""

    errors: Mapping[str, int] = field(default_factory=dict)  # component -> exceptions it counted and swallowed
    dropped: Mapping[str, int] = field(default_factory=dict)  # queue -> events dropped because it was full
    cost_s: float | None = None  # seconds moescope spent on the engine's step path (an adapter's own count)
    placement: "Placement | None" = None  # the expert-parallel placement the engine's MoE layers dispatch by
    cache_capacity: Mapping[int, float] = field(default_factory=dict)  # MoE layer -> resident experts / experts


@runtime_checkable
class Source(Protocol):
    """A component that reports counts of its own (``Sources.register``)."""

    def read(self) -> Reading:
        """The component's counts now (cumulative). Cheap, lock-free for the engine, never raises on purpose."""
        ...


class Sources:
    """The registry of sources one ``MetricsObserver`` reads once per evaluation (``read``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: tuple[Source, ...] = ()
        self.failed = 0  # reads that raised

    def register(self, source: Source) -> None:
        """Add ``source`` (once: registering it again changes nothing)."""
        if not callable(getattr(source, "read", None)):
            raise TypeError(f"{type(source).__name__} has no read(): not a moescope.capture.sources.Source")
        with self._lock:
            if not any(s is source for s in self._sources):
                self._sources = (*self._sources, source)

    def unregister(self, source: Source) -> None:
        with self._lock:
            self._sources = tuple(s for s in self._sources if s is not source)

    @property
    def sources(self) -> tuple[Source, ...]:
        return self._sources

    def read(self) -> Reading:
        """Every source's reading, merged: errors and drops summed by name, costs summed (None: no source counts
        one), the first placement any source reports, the cache capacities of every source."""
        errors: dict[str, int] = {}
        dropped: dict[str, int] = {}
        capacity: dict[int, float] = {}
        cost: float | None = None
        placement = None
        for source in self._sources:  # the tuple is replaced, never changed: no lock needed to read it
            try:
                r = source.read()
            except Exception:  # a component's count that cannot be read is counted, never raised
                self.failed += 1
                if self.failed == 1:
                    log.exception("moescope: source %s raised (counted; further errors at debug)",
                                  type(source).__name__)
                else:
                    log.debug("moescope: source %s raised", type(source).__name__, exc_info=True)
                continue
            for into, values in ((errors, r.errors), (dropped, r.dropped)):
                for name, n in values.items():
                    into[name] = into.get(name, 0) + int(n)
            if r.cost_s is not None:
                cost = (cost or 0.0) + float(r.cost_s)
            if placement is None:
                placement = r.placement
            capacity.update(r.cache_capacity)
        if self.failed:
            errors["sources"] = errors.get("sources", 0) + self.failed
        return Reading(errors=errors, dropped=dropped, cost_s=cost, placement=placement, cache_capacity=capacity)


__all__ = ["Reading", "Source", "Sources"]
