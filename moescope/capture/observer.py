"""The observer seam between an engine and everything that watches it.

Shape borrowed from OpenTelemetry's SpanProcessor: the engine calls these hooks synchronously; a hook must not block
and must not raise (``FanOut`` enforces the second for everyone it wraps). An engine imports this module and nothing
else from moescope's sinks; sinks never call back into the engine.

Two interfaces, each with typed payloads:

- ``Observer``: the engine-neutral hooks every engine calls (the reference runtime, the HF adapter, the vLLM adapter;
  the engine contract, ``capture.engine_contract``, says which and when): per MoE layer per forward ``on_routing``
  (a ``RoutingDecision``) and optionally ``on_layer_time``; per forward ``on_step`` (a ``StepRecord``) or, for
  routing counted outside the forward, ``on_stats`` (a ``StepStats``); per finished request ``on_request`` (a
  ``RequestRecord``); ``on_idle``; ``shutdown``.
- ``RuntimeObserver``: optional, the events only the reference runtime has (its expert cache ``on_cache``, its canary
  ``on_canary``, its expert-parallel exchanges ``on_all_to_all`` and rearrangements ``on_rebalance``). An observer
  that wants them subclasses it (the metrics and the trace capture do); the runtime sends them to the observer it
  is attached to where that observer defines them, and ``FanOut`` passes each on to the observers that define it.

Hooks on the hot path (``on_routing``) receive device tensors and must not copy them to the host: they keep
references (or accumulate on the device) and copy later, never per layer: the routing probe once per evaluation, the
trace capture off the engine thread (its queue's worker), ``RoutingLog`` once per step.

The payload types are imported for typing only: this module imports no engine at run time (the import-linter
contract "the observer seam needs no engine").
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable

from moescope.capture.sources import Reading, Sources

if TYPE_CHECKING:  # typing only: capture imports no engine and no torch at module import time
    from moescope.capture.decision import RoutingDecision
    from moescope.capture.records import RequestRecord, StepRecord
    from moescope.capture.routing_probe import StepStats
    from moescope.parallel.eplb import Rebalance
    from moescope.parallel.expert_parallel import AllToAllRecord
    from moescope.runtime.expert_cache import CacheDelta

log = logging.getLogger("moescope.capture")


class Observer:
    """The engine-neutral hooks, each a no-op: override what you need. Every hook must return quickly and never
    raise."""

    def on_routing(self, layer: int, decision: "RoutingDecision") -> None:
        """One MoE layer routed the tokens of one forward (device tensors; no host copy here)."""

    def on_layer_time(self, layer: int, router_s: float, experts_s: float) -> None:
        """Time of one MoE layer's router and expert computation in one forward (``runtime.timing``): host
        clock on CPU; on CUDA, device time from CUDA events, delivered once they completed (a forward or two
        later, never waited for)."""

    def on_stats(self, stats: "StepStats") -> None:
        """Routing statistics of steps that called no per-layer hook (a CUDA-graph decode step counts inside
        the graph; ``runtime.graph_decode.GraphCollector`` reads the counters)."""

    def on_step(self, step: "StepRecord") -> None:
        """The engine finished a step (one prefill or decode forward)."""

    def on_request(self, request: "RequestRecord") -> None:
        """A request finished: its timings and output."""

    def on_idle(self) -> None:
        """The engine has no work now (waiting for requests, or its run ended), on its own thread: summarise
        what would otherwise wait for the next step. Once per idle period."""

    def resync(self) -> None:
        """Capture was turned back on (``moescope.capture.switch``), not a hook the engine calls: drop what a forward
        that began while capture was off left (the next step whole), so no step is counted in part."""

    def shutdown(self) -> None:
        """Flush and release resources; called once when the engine is closed."""


class RuntimeObserver(Observer):
    """The reference runtime's own events (optional: no other engine has them), each a no-op. The runtime calls them
    on its observer where that observer defines them; ``FanOut`` passes them on to the observers that define them."""

    def on_cache(self, layer: int, delta: "CacheDelta") -> None:
        """The expert cache's counter changes during one forward of one layer."""

    def on_canary(self, flips: dict[int, float]) -> None:
        """The canary batch was routed again: share of its tokens whose expert set flipped, per layer."""

    def on_all_to_all(self, record: "AllToAllRecord") -> None:
        """One expert-parallel exchange (dispatch or combine) of one layer on this rank."""

    def on_rebalance(self, event: "Rebalance") -> None:
        """Expert-parallel ranks rearranged their experts (EPLB in the loop)."""


NOOP = RuntimeObserver()

HOOKS = ("on_routing", "on_layer_time", "on_stats", "on_step", "on_request", "on_idle", "shutdown")
RUNTIME_HOOKS = ("on_cache", "on_canary", "on_all_to_all", "on_rebalance")


def _overrides(observer: object, hook: str) -> bool:
    """Whether ``observer``'s class defines ``hook`` beyond the no-op (an engine-neutral observer lacks the runtime's
    hooks altogether)."""
    fn = getattr(type(observer), hook, None)
    return fn is not None and fn is not getattr(RuntimeObserver, hook)


class FanOut(RuntimeObserver):
    """Calls each observer in turn; an exception in one is counted and logged, never raised into the engine.

    Bound methods are resolved once at construction (hooks run per layer per forward: no getattr there), and
    observers that do not define a hook (``RuntimeObserver``'s events on an engine-neutral ``Observer``) or leave it
    the no-op are skipped for it. With ``sources``, the errors it counted are reported there (``read``).
    """

    def __init__(self, observers: Iterable[Observer], *, sources: Sources | None = None) -> None:
        self._observers = tuple(observers)
        self._lock = threading.Lock()
        self.errors: dict[str, int] = {}
        self._bound: dict[str, tuple[tuple[str, Callable[..., None]], ...]] = {
            hook: tuple((type(o).__name__, getattr(o, hook)) for o in self._observers if _overrides(o, hook))
            for hook in HOOKS + RUNTIME_HOOKS}
        if sources is not None:
            sources.register(self)

    @property
    def observers(self) -> tuple[Observer, ...]:
        return self._observers

    def read(self) -> Reading:
        """The exceptions each observer raised, by class name (a ``capture.sources.Source``). A copy made under the
        GIL alone: the evaluator never waits on the lock an observer's error takes on the engine's thread."""
        return Reading(errors=dict(self.errors))

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
        for name, fn in self._bound["on_routing"]:  # per layer per forward: no *args packing
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

    def on_stats(self, stats: "StepStats") -> None:
        self._each("on_stats", stats)

    def on_step(self, step: "StepRecord") -> None:
        self._each("on_step", step)

    def on_request(self, request: "RequestRecord") -> None:
        self._each("on_request", request)

    def on_idle(self) -> None:
        self._each("on_idle")

    def on_cache(self, layer: int, delta: "CacheDelta") -> None:
        self._each("on_cache", layer, delta)

    def on_canary(self, flips: dict[int, float]) -> None:
        self._each("on_canary", flips)

    def on_all_to_all(self, record: "AllToAllRecord") -> None:
        self._each("on_all_to_all", record)

    def on_rebalance(self, event: "Rebalance") -> None:
        self._each("on_rebalance", event)

    def resync(self) -> None:
        for o in self._observers:
            try:
                o.resync()
            except Exception:
                self._failed(type(o).__name__, "resync")

    def shutdown(self) -> None:
        self._each("shutdown")


__all__ = ["FanOut", "HOOKS", "NOOP", "Observer", "RUNTIME_HOOKS", "RuntimeObserver"]
