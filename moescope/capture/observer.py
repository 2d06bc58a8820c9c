"""The observer seam between the runtime and everything that watches it.

Shape borrowed from OpenTelemetry's SpanProcessor: the runtime calls these hooks synchronously; a hook
must not block and must not raise (``FanOut`` enforces the second for everyone it wraps). The runtime
imports this module and nothing else from moescope's sinks; sinks never call back into the runtime.

Hooks on the hot path (``on_routing``) receive device tensors and must not copy them to the host: they
keep references (or accumulate on the device) and copy later, never per layer: the routing probe once per
flush interval, the trace capture off the engine thread (its queue's worker), ``RoutingLog`` once per step.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:  # typing only: capture must not import torch at module import time
    from moescope.capture.decision import RoutingDecision

log = logging.getLogger("moescope.capture")


class Observer:
    """No-op base: override what you need. Every hook must return quickly and never raise."""

    def on_routing(self, layer: int, decision: "RoutingDecision") -> None:
        """One MoE layer routed the tokens of one forward (device tensors; no host copy here)."""

    def on_layer_time(self, layer: int, router_s: float, experts_s: float) -> None:
        """Time of one MoE layer's router and expert computation in one forward (``runtime.timing``): host
        clock on CPU; on CUDA, device time from CUDA events, delivered once they completed (a forward or two
        later, never waited for)."""

    def on_stats(self, stats: Any) -> None:
        """Routing statistics of steps that called no per-layer hook (a CUDA-graph decode step counts inside
        the graph; ``runtime.graph_decode.GraphCollector`` reads the counters): a ``StepStats``."""

    def on_cache(self, layer: int, delta: Any) -> None:
        """The expert cache's counter changes during one forward of one layer (a ``CacheDelta``)."""

    def on_canary(self, flips: dict[int, float]) -> None:
        """The canary batch was routed again: share of its tokens whose expert set flipped, per layer."""

    def on_all_to_all(self, record: Any) -> None:
        """One expert-parallel exchange (dispatch or combine) of one layer on this rank (``AllToAllRecord``)."""

    def on_rebalance(self, event: Any) -> None:
        """Expert-parallel ranks rearranged their experts (EPLB in the loop; a ``parallel.eplb.Rebalance``)."""

    def on_step(self, step: Any) -> None:
        """The engine finished a step (one prefill or decode forward); ``step`` is a ``StepRecord``."""

    def on_request(self, request: Any) -> None:
        """A request finished; ``request`` is a ``RequestRecord`` with its timings and output."""

    def on_idle(self) -> None:
        """The engine has no work now (waiting for requests, or its run ended), on its own thread: summarise
        what would otherwise wait for the next step. Once per idle period."""

    def resync(self) -> None:
        """Capture was turned back on (``moescope.capture.switch``), not a hook the engine calls: drop what a forward
        that began while capture was off left (the next step whole), so no step is counted in part."""

    def shutdown(self) -> None:
        """Flush and release resources; called once when the engine is closed."""


NOOP = Observer()


_HOOKS = ("on_routing", "on_layer_time", "on_stats", "on_cache", "on_all_to_all", "on_canary", "on_step", "on_request",
          "on_idle", "on_rebalance", "shutdown")


class FanOut(Observer):
    """Calls each observer in turn; an exception in one is counted and logged, never raised into the engine.

    Bound methods are resolved once at construction (hooks run per layer per forward: no getattr there), and
    observers that do not override a hook are skipped for it.
    """

    def __init__(self, observers: Iterable[Observer]) -> None:
        self._observers = tuple(observers)
        self._lock = threading.Lock()
        self.errors: dict[str, int] = {}
        self._bound = {hook: tuple((type(o).__name__, getattr(o, hook)) for o in self._observers
                                   if getattr(type(o), hook, None) is not getattr(Observer, hook))
                       for hook in _HOOKS}

    @property
    def observers(self) -> tuple[Observer, ...]:
        return self._observers

    def _failed(self, name: str, hook: str) -> None:
        with self._lock:
            first = name not in self.errors
            self.errors[name] = self.errors.get(name, 0) + 1
        if first:
            log.exception("observer %s raised in %s (counted; further errors logged at debug)", name, hook)
        else:
            log.debug("observer %s raised in %s", name, hook, exc_info=True)

    def _each(self, hook: str, *args: Any) -> None:
        for name, fn in self._bound[hook]:
            try:
                fn(*args)
            except Exception:  # isolation is the point: a broken sink must never stop the engine
                self._failed(name, hook)

    def on_routing(self, layer: int, decision: "RoutingDecision") -> None:
        for name, fn in self._bound["on_routing"]:
            try:
                fn(layer, decision)
            except Exception:
                self._failed(name, "on_routing")

    def on_layer_time(self, layer: int, router_s: float, experts_s: float) -> None:
        for name, fn in self._bound["on_layer_time"]:
            try:
                fn(layer, router_s, experts_s)
            except Exception:
                self._failed(name, "on_layer_time")

    def on_stats(self, stats: Any) -> None:
        self._each("on_stats", stats)

    def on_cache(self, layer: int, delta: Any) -> None:
        self._each("on_cache", layer, delta)

    def on_all_to_all(self, record: Any) -> None:
        self._each("on_all_to_all", record)

    def on_canary(self, flips: dict[int, float]) -> None:
        self._each("on_canary", flips)

    def on_step(self, step: Any) -> None:
        self._each("on_step", step)

    def on_rebalance(self, event: Any) -> None:
        self._each("on_rebalance", event)

    def on_request(self, request: Any) -> None:
        self._each("on_request", request)

    def on_idle(self) -> None:
        self._each("on_idle")

    def resync(self) -> None:
        for o in self._observers:
            try:
                o.resync()
            except Exception:
                self._failed(type(o).__name__, "resync")

    def shutdown(self) -> None:
        self._each("shutdown")
