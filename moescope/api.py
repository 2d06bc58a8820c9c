"""The one assembly point: a ``Config`` in, an instrumented model (and its engine) out.

``Instrumentation`` picks the model's engine adapter once (``as_engine``: the engine contract,
``moescope.capture.engine_contract``) and then talks to the contract only. It wires, in this order: the metrics, the
observers (routing log, yours, the trace recorder with OTLP spans), the exporter, the engine's attach, the drift
baseline, then what the engine's ``setup`` applies (the reference runtime: fault scenarios, router choices, the
expert cache, the canary). ``close()`` undoes it in reverse, so the trace store is flushed before the OTLP exporter
stops and the routing log is written last. Front ends (``moescope demo``, ``moescope serve``) map flags onto a
``Config`` and call ``moescope.instrument``.

Nothing is set on the metrics from outside: each component that counts something of its own (the fan-out: its
observers' errors; a queued sink and the trace recorder: their drops and errors; the engine adapter: its placement,
cache capacity or drops) registers a source on the metrics' ``Sources`` (``moescope.capture.sources``), read once per
evaluation; the exporter's collectors register on the prometheus_client ``CollectorRegistry`` it is given."""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from moescope import efficiency
from moescope.analysis import baseline as bl
from moescope.capture.engine_contract import EngineContract, missing_features, partial_engine
from moescope.capture.observer import FanOut, Observer
from moescope.capture.sources import Source, Sources
from moescope.capture.switch import CaptureSwitch
from moescope.config import Config, Metrics, Traces
from moescope.errors import BadInput
from moescope.traces import otlp
from moescope.traces.recorder import TraceRecorder

if TYPE_CHECKING:  # typing only: the metrics and the exporter load torch, imported when _wire() runs
    from prometheus_client import CollectorRegistry

    from moescope.capture.routing_log import RoutingLog
    from moescope.metrics.exporter import Exporter


class Instrumentation:
    """Attach moescope to a model as ``config`` says; a context manager.

    Args:
        model: a ``moescope.runtime`` ``MoETransformer``, a HuggingFace transformers MoE model, or an adapter
            implementing the engine contract (``moescope.capture.engine_contract.EngineContract``: the vLLM plugin's);
            ``as_engine`` picks the adapter. Every engine takes metrics, traces, your own observers and the routing
            log; the cache, canary, faults and mitigations need an engine that names them in its ``features``
            (the reference runtime).
        config: what to wire (``moescope.Config``); its scenarios' settings are folded in (``resolved()``).
        **metrics: shorthand for a config of metrics only: ``port``, ``addr``, ``model_name``, ``rank``,
            ``window_s``, ``expert_series_budget``, ``export_routing`` (``moescope.config.Metrics``) and
            ``observers``. Not together with ``config``.
    Attributes:
        metrics: the ``MetricsObserver`` (its snapshot is what the exporter serves; its ``sources``, what each
            component registered).
        registry: the prometheus_client ``CollectorRegistry`` the exporter serves (its collectors are registered on
            it; register your own there and the same endpoint serves them), or None without an exporter.
        capture: the ``CaptureSwitch`` (``capture.set(False)``: no moescope work per step until it is set again).
        adapter: the model's ``EngineContract`` adapter (``as_engine``).
        exporter: the metrics HTTP server, or None. recorder: the ``TraceRecorder``, or None.
        routing_log: the ``RoutingLog``, or None. cache: the ``ExpertCache``, or None. canary: the
        ``Canary``, or None. notices: one-line notes for the user (e.g. a router path that cannot run).
    Raises:
        BadInput: a port that cannot be bound, a store that cannot be opened, a part the model cannot take.
            Whatever was already set up is undone first.
    """

    def __init__(self, model, config: Config | None = None, **metrics) -> None:
        if config is not None and metrics:
            raise TypeError("give a Config or metrics keyword arguments, not both")
        if config is None:
            observers = tuple(metrics.pop("observers", ()))
            if metrics.get("expert_series_budget", 0) is None:
                metrics.pop("expert_series_budget")
            config = Config(metrics=Metrics(**metrics), observers=observers)
        self.config = config = config.resolved()
        self.model = model
        self.adapter: EngineContract = as_engine(model)  # the one place that knows the engines; nothing set up yet
        self.notices: list[str] = []
        self.exporter: Exporter | None = None
        self.registry: CollectorRegistry | None = None
        self.recorder: TraceRecorder | None = None
        self.routing_log: RoutingLog | None = None
        self.capture: CaptureSwitch | None = None
        self.cache: Any = None
        self.canary: Any = None
        self._stack = ExitStack()
        try:
            self._wire(model, config)
        except BaseException:
            self._stack.close()
            raise

    def _wire(self, model, config: Config) -> None:
        # start-up: torch (metrics.state), only when _wire() runs
        from moescope.metrics.evaluator import Evaluator
        from moescope.metrics.state import EXPERT_SERIES_BUDGET, MetricsObserver

        engine = self.adapter
        wants = missing_features(engine, config)
        if wants:
            raise BadInput(f"{', '.join(wants)} need the moescope reference runtime; this is a {type(model).__name__}")
        m = config.metrics
        info = engine.model_info(m.model_name)
        budget = EXPERT_SERIES_BUDGET if m.expert_series_budget is None else m.expert_series_budget
        self.metrics = MetricsObserver(info, rank=m.rank, window_s=m.window_s, export_routing=m.export_routing,
                                       hot_reference=m.hot_reference, flush_interval_s=m.interval_s,
                                       expert_series_budget=budget)
        self.metrics.reads_flush = not engine.flushes_when_idle  # no engine says when it is idle: reads flush
        if m.peak_bandwidth is not None or m.peak_flops is not None:  # settings over the environment and table
            self.metrics.peak = efficiency.resolve_peak(info.device, bandwidth=m.peak_bandwidth, flops=m.peak_flops)
        sources = self.metrics.sources  # what each component counts of itself, read once per evaluation
        if config.routing_log is not None:
            # start-up: torch (capture.routing_log), only when _wire() runs
            from moescope.capture.routing_log import RoutingLog

            self.routing_log = routing_log = RoutingLog()
            path = config.routing_log
            self._stack.callback(lambda: routing_log.save(path))  # last out: after every forward was seen
        observers: list[Observer] = [*([self.routing_log] if self.routing_log else []), *config.observers]
        for o in config.observers:  # a queued sink the caller built (QueuedObserver) reports its drops and errors
            if isinstance(o, Source):
                sources.register(o)
        if config.traces is not None:
            observers.append(self._recorder(m.model_name or info.name, config.traces, m.rank, sources))
        self.observer = FanOut([self.metrics, *observers], sources=sources)  # it reports its observers' errors
        self._stack.callback(self.observer.shutdown)  # flushes the recorder: before OTLP stops (pushed earlier)
        if m.port is not None:  # before attaching: a port that cannot be bound leaves the model untouched
            from prometheus_client import CollectorRegistry  # optional: prometheus_client (the metrics extra)

            from moescope.metrics.exporter import Exporter  # start-up: torch (metrics.exporter), only when _wire() runs

            self.registry = CollectorRegistry(auto_describe=False)
            self.exporter = exporter = Exporter(self.metrics, port=m.port, addr=m.addr, registry=self.registry).start()
            self._stack.callback(exporter.stop)
        # The kill switch: read once now (a process started with capture off never captures), then by the evaluator
        self.capture = capture = CaptureSwitch(getattr(engine, "pause", engine.detach), self._resume,
                                               control=m.capture_control)
        capture.listeners.append(self._switched)
        engine.attach(self.observer)
        self._stack.callback(engine.detach)
        # its placement, cache capacity or drops, read per evaluation: a placement or cache set up later counts too
        engine.register_sources(sources)
        capture.poll()
        if m.baseline is not None:
            self.metrics.baseline = bl.coerce(m.baseline)  # a file, a Profile or {layer: load}
        # the one evaluator: folds, judges, learns and publishes once per interval, off the engine's thread; stopped
        # and run a last time by the observer's shutdown
        self.metrics.evaluator = Evaluator(self.metrics, m.interval_s, capture).start()
        parts = engine.setup(config, self._stack)  # faults, router path, mitigations, cache, canary
        self.cache, self.canary = parts.cache, parts.canary
        self.notices += parts.notices

    def _resume(self) -> None:
        """Capture back on: the observers drop the first step (it may have begun while off), then the engine reports
        again."""
        self.observer.resync()
        getattr(self.adapter, "resume", self.adapter.attach)(self.observer)

    def _switched(self, on: bool) -> None:
        self.metrics.capture_enabled = on
        self.metrics.capture_switches = self.capture.switches if self.capture is not None else 0
        # (the gauge moves at the next evaluation, within the interval: a flip asks for none, so that flipping often,
        # as benchmarks/overhead.py's interleaved rounds do, adds no evaluations)

    def _recorder(self, name: str, t: Traces, rank: int, sources: Sources) -> TraceRecorder:
        tracer = None
        if t.otlp_endpoint:
            provider = otlp.tracer_provider(t.otlp_endpoint, attributes={"moescope.model": name})
            self._stack.callback(provider.shutdown)  # after the recorder's last spans (the stack unwinds LIFO)
            tracer = provider.get_tracer("moescope")
        self.recorder = recorder = TraceRecorder(t.path, sample=t.sample, model=name, rank=rank, seed=t.seed,
                                                 tracer=tracer, sources=sources)
        return recorder

    def engine(self, *, max_batch: int = 16, seed: int = 0, decode: str = "eager", **kwargs):
        """An ``Engine`` serving the instrumented model, with the canary and the scenarios' engine faults
        (``leak``). ``kwargs`` go to ``Engine`` (``clock``)."""
        # start-up: torch (runtime.engine), only when engine() runs
        from moescope.runtime import engine as runtime_engine

        engine = runtime_engine.Engine(self.model, max_batch=max_batch, seed=seed, canary=self.canary, decode=decode,
                                       **kwargs)
        leak = self.config.engine_settings().get("leak_bytes")
        if leak:
            engine.leak, engine.leak_bytes = [], leak
        if decode != "eager" and self.recorder is not None:
            self.notices.append(f"note: decode {decode} runs no per-layer hook in decode steps: the trace store "
                                "keeps each request's timings and spans, not its per-token routing")
        return engine

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "Instrumentation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def instrument(model, config: Config | None = None, **metrics) -> Instrumentation:
    """Instrument ``model`` as ``config`` says (see ``Instrumentation``)."""
    return Instrumentation(model, config, **metrics)


def as_engine(model) -> EngineContract:
    """The engine contract's adapter for ``model``, picked once (``moescope.capture.engine_contract``): an
    ``EngineContract`` already (the vLLM plugin's ``VLLMAdapter``, a new engine's adapter) is itself, a
    reference-runtime ``MoETransformer`` gets ``RuntimeEngine``, anything else is taken for a HF transformers MoE model
    (``HFAdapter``, which refuses a model it finds no MoE layer in).

    Raises:
        BadInput: ``model`` means to be an engine (it has ``model_info``, ``attach`` or ``detach``) but lacks some of
            the contract's members: they are named (not handed to the HF adapter, whose error would mislead).
    """
    if isinstance(model, EngineContract):
        return model
    missing = partial_engine(model)
    if missing:
        raise BadInput(f"{type(model).__name__} matches the engine contract only in part: it lacks "
                       f"{', '.join(missing)} (moescope.capture.engine_contract.EngineContract; subclass it for the "
                       "defaults of everything but model_info, attach and detach)")
    from moescope.runtime.model import MoETransformer  # start-up: torch (runtime.model), only when as_engine() runs

    if isinstance(model, MoETransformer):
        # start-up: torch (runtime.engine_adapter), only when as_engine() runs
        from moescope.runtime.engine_adapter import RuntimeEngine

        return RuntimeEngine(model)
    from moescope.hf.hf_adapter import HFAdapter  # start-up: torch (hf.hf_adapter), only when as_engine() runs

    return HFAdapter(model)


__all__ = ["Instrumentation", "as_engine", "instrument"]
