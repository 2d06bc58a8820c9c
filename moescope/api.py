"""The one assembly point: a ``Config`` in, an instrumented model (and its engine) out.

``Instrumentation`` picks the model's engine adapter once (``as_engine``: the engine contract,
``moescope.capture.engine_contract``) and then talks to the contract only. It wires, in this order: the observers
(routing log, yours, the trace recorder with OTLP spans), the metrics and their exporter, the engine's attach, the
drift baseline, then what the engine's ``setup`` applies (the reference runtime: fault scenarios, router choices,
the expert cache, the canary). ``close()`` undoes it in reverse, so the trace store is flushed before the OTLP
exporter stops and the routing log is written last. Front ends (``moescope demo``, ``moescope serve``) map flags
onto a ``Config`` and call ``moescope.instrument``."""

from __future__ import annotations

from contextlib import ExitStack

from moescope import efficiency
from moescope.analysis import baseline as bl
from moescope.capture.engine_contract import EngineContract, missing_features
from moescope.capture.observer import FanOut, Observer
from moescope.capture.switch import CaptureSwitch
from moescope.config import Config, Metrics
from moescope.errors import BadInput
from moescope.traces import otlp
from moescope.traces.recorder import TraceRecorder


def _name(observer) -> str:
    return getattr(observer, "name", type(observer).__name__)


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
        metrics: the ``MetricsObserver`` (its snapshot is what the exporter serves).
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
        self.notices: list[str] = []
        self.exporter = self.recorder = self.routing_log = self.cache = self.canary = self.adapter = None
        self.capture = None
        self._stack = ExitStack()
        try:
            self._wire(model, config)
        except BaseException:
            self._stack.close()
            raise

    def _wire(self, model, config: Config) -> None:
        # start-up: torch (metrics.state), only when _wire() runs
        from moescope.metrics.evaluator import Evaluator
        from moescope.metrics.state import MetricsObserver

        self.adapter = engine = as_engine(model)
        wants = missing_features(engine, config)
        if wants:
            raise BadInput(f"{', '.join(wants)} need the moescope reference runtime; this is a {type(model).__name__}")
        m = config.metrics
        info = engine.model_info(m.model_name)
        if config.routing_log is not None:
            # start-up: torch (capture.routing_log), only when _wire() runs
            from moescope.capture.routing_log import RoutingLog

            self.routing_log = RoutingLog()
            path = config.routing_log
            self._stack.callback(lambda: self.routing_log.save(path))  # last out: after every forward was seen
        observers: list[Observer] = [*([self.routing_log] if self.routing_log else []), *config.observers]
        if config.traces is not None:
            observers.append(self._recorder(m.model_name or info.name, config))
        extra = {} if m.expert_series_budget is None else {"expert_series_budget": m.expert_series_budget}
        self.metrics = MetricsObserver(info, rank=m.rank, window_s=m.window_s, export_routing=m.export_routing,
                                       hot_reference=m.hot_reference, flush_interval_s=m.interval_s, **extra)
        self.metrics.reads_flush = not engine.flushes_when_idle  # no engine says when it is idle: reads flush
        if m.peak_bandwidth is not None or m.peak_flops is not None:  # settings over the environment and table
            self.metrics.peak = efficiency.resolve_peak(info.device, bandwidth=m.peak_bandwidth, flops=m.peak_flops)
        self.observer = FanOut([self.metrics, *observers])
        self._stack.callback(self.observer.shutdown)  # flushes the recorder: before OTLP stops (pushed earlier)
        # Observers with their own queue (QueuedObserver, TraceRecorder) report drops and errors.
        queued = [o for o in observers if isinstance(getattr(o, "dropped", None), int)]
        self.metrics.errors_source = lambda: {**self.observer.errors,
                                              **{_name(q): q.errors for q in queued if getattr(q, "errors", 0)}}
        self.metrics.dropped_source = lambda: {_name(q): q.dropped for q in queued}
        if m.port is not None:  # before attaching: a port that cannot be bound leaves the model untouched
            from moescope.metrics.exporter import Exporter  # start-up: torch (metrics.exporter), only when _wire() runs

            self.exporter = Exporter(self.metrics, port=m.port, addr=m.addr).start()
            self._stack.callback(self.exporter.stop)
        # The kill switch: read once now (a process started with capture off never captures), then by the evaluator
        self.capture = CaptureSwitch(getattr(engine, "pause", engine.detach), self._resume, control=m.capture_control)
        self.capture.listeners.append(self._switched)
        engine.attach(self.observer)
        self._stack.callback(engine.detach)
        self.capture.poll()
        if m.baseline is not None:
            self.metrics.baseline = bl.coerce(m.baseline)  # a file, a Profile or {layer: load}
        # read at scrape time: a placement or cache set up after instrument() counts too
        self.metrics.placement_source = engine.placement
        self.metrics.cache_capacity_source = engine.cache_capacity
        # the one evaluator: folds, judges, learns and publishes once per interval, off the engine's thread; stopped
        # and run a last time by the observer's shutdown
        self.metrics.evaluator = Evaluator(self.metrics, m.interval_s, self.capture).start()
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
        self.metrics.capture_switches = self.capture.switches
        self.metrics.wake()  # the gauge moves at the next evaluation, now

    def _recorder(self, name: str, config: Config):
        t, tracer = config.traces, None
        if t.otlp_endpoint:
            provider = otlp.tracer_provider(t.otlp_endpoint, attributes={"moescope.model": name})
            self._stack.callback(provider.shutdown)  # after the recorder's last spans (the stack unwinds LIFO)
            tracer = provider.get_tracer("moescope")
        self.recorder = TraceRecorder(t.path, sample=t.sample, model=name, rank=config.metrics.rank, seed=t.seed,
                                      tracer=tracer)
        return self.recorder

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
    (``HFAdapter``, which refuses a model it finds no MoE layer in)."""
    if isinstance(model, EngineContract):
        return model
    from moescope.runtime.model import MoETransformer  # start-up: torch (runtime.model), only when as_engine() runs

    if isinstance(model, MoETransformer):
        # start-up: torch (runtime.engine_adapter), only when as_engine() runs
        from moescope.runtime.engine_adapter import RuntimeEngine

        return RuntimeEngine(model)
    from moescope.hf.hf_adapter import HFAdapter  # start-up: torch (hf.hf_adapter), only when as_engine() runs

    return HFAdapter(model)


__all__ = ["Instrumentation", "as_engine", "instrument"]
