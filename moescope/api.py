"""The one assembly point: a ``Config`` in, an instrumented model (and its engine) out.

``Instrumentation`` wires, in this order: the fault scenarios and router choices (real changes to the
model), the observers (routing log, yours, the trace recorder with OTLP spans), the metrics and their
exporter, the drift baseline, the expert cache and the canary. ``close()`` undoes it in reverse, so the trace
store is flushed before the OTLP exporter stops and the routing log is written last. Front ends
(``moescope demo``, ``moescope serve``) map flags onto a ``Config`` and call ``moescope.instrument``.
"""

from __future__ import annotations

from contextlib import ExitStack

from moescope.capture.observer import FanOut, Observer
from moescope.config import Cache, Config, Metrics
from moescope.errors import BadInput


def _name(observer) -> str:
    return getattr(observer, "name", type(observer).__name__)


class Instrumentation:
    """Attach moescope to a model as ``config`` says; a context manager.

    Args:
        model: a ``moescope.runtime`` ``MoETransformer``, a HuggingFace transformers MoE model, or an engine
            adapter (``model_info``, ``attach``, ``detach``: the vLLM plugin's) (metrics, traces, your own
            observers, routing log; the cache, canary, faults and mitigations need the reference runtime).
        config: what to wire (``moescope.Config``); its scenarios' settings are folded in (``resolved()``).
        **metrics: shorthand for a config of metrics only: ``port``, ``addr``, ``model_name``, ``rank``,
            ``window_s``, ``expert_series_budget``, ``export_routing`` (``moescope.config.Metrics``) and
            ``observers``. Not together with ``config``.
    Attributes:
        metrics: the ``MetricsObserver`` (its counters are what the exporter serves).
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
        self.exporter = self.recorder = self.routing_log = self.cache = self.canary = None
        self._stack = ExitStack()
        try:
            self._wire(model, config)
        except BaseException:
            self._stack.close()
            raise

    def _wire(self, model, config: Config) -> None:
        from moescope.metrics.state import MetricsObserver, ModelInfo
        from moescope.runtime.model import MoETransformer

        runtime = isinstance(model, MoETransformer)
        if not runtime:
            wants = [name for name, on in (("cache", config.cache), ("canary", config.canary),
                                           ("scenarios", config.scenarios), ("mitigations", config.mitigations))
                     if on]
            if wants:
                raise BadInput(f"{', '.join(wants)} need the moescope reference runtime; this is a "
                               f"{type(model).__name__}")
        if config.routing_log is not None:
            from moescope.capture.routing_log import RoutingLog

            self.routing_log = RoutingLog()
            path = config.routing_log
            self._stack.callback(lambda: self.routing_log.save(path))  # last out: after every forward was seen
        if runtime:
            self._change_model(model, config)
        observers: list[Observer] = [*([self.routing_log] if self.routing_log else []), *config.observers]
        if config.traces is not None:
            observers.append(self._recorder(model, config))
        m = config.metrics
        if runtime:
            info = ModelInfo.from_runtime(model, m.model_name)
        else:  # an engine adapter (the vLLM worker's), or a HF model to hook
            if not _is_adapter(model):
                from moescope.hf import hf_adapter

                model = hf_adapter.HFAdapter(model)
            hf = model
            info = hf.model_info(m.model_name)
        extra = {} if m.expert_series_budget is None else {"expert_series_budget": m.expert_series_budget}
        self.metrics = MetricsObserver(info, rank=m.rank, window_s=m.window_s, export_routing=m.export_routing,
                                       hot_reference=m.hot_reference, **extra)
        self.metrics.reads_flush = not runtime  # the engine flushes when idle; a HF model has no engine
        if m.peak_bandwidth is not None or m.peak_flops is not None:  # settings over the environment and table
            from moescope import efficiency

            self.metrics.peak = efficiency.resolve_peak(info.device, bandwidth=m.peak_bandwidth, flops=m.peak_flops)
        self.observer = FanOut([self.metrics, *observers])
        self._stack.callback(self.observer.shutdown)  # flushes the recorder: before OTLP stops (pushed earlier)
        # Observers with their own queue (QueuedObserver, TraceRecorder) report drops and errors.
        queued = [o for o in observers if isinstance(getattr(o, "dropped", None), int)]
        self.metrics.errors_source = lambda: {**self.observer.errors,
                                              **{_name(q): q.errors for q in queued if getattr(q, "errors", 0)}}
        self.metrics.dropped_source = lambda: {_name(q): q.dropped for q in queued}
        if m.port is not None:  # before attaching: a port that cannot be bound leaves the model untouched
            from moescope.metrics.exporter import Exporter

            self.exporter = Exporter(self.metrics, port=m.port, addr=m.addr).start()
            self._stack.callback(self.exporter.stop)
        if runtime:
            previous = model.observer
            model.observer = self.observer
            self._stack.callback(self._detach, previous)
        else:
            hf.attach(self.observer)
            self._stack.callback(hf.detach)
        if m.baseline is not None:
            from moescope.analysis import baseline as bl  # numpy-heavy: only when a baseline is configured

            self.metrics.baseline = bl.coerce(m.baseline)  # a file, a Profile or {layer: load}
        if runtime:  # read at scrape time: a placement or cache set up after instrument() counts too
            self.metrics.placement_source = lambda: _placement(model)
            self.metrics.cache_capacity_source = lambda: _cache_capacity(model)
        if config.cache is not None:
            self.cache = self._stack.enter_context(_expert_cache(model, config.cache))
        if config.canary is not None:
            from moescope.runtime.canary import Canary

            self.canary = Canary(model, interval_s=config.canary.interval_s, every_steps=config.canary.every_steps)

    def _change_model(self, model, config: Config) -> None:
        """Faults, router path and mitigations: real changes to what the model computes. A part the config
        leaves unset leaves the model as its caller set it up."""
        from moescope.runtime import faults

        if config.scenarios:
            faults.apply(model, list(config.scenarios))
            if config.fault_after_s:
                self._stack.callback(faults.defer(model, config.fault_after_s).cancel)
        if config.router_impl is not None:
            notice = model.set_router_impl(config.router_impl)
            if notice:
                self.notices.append(notice)
        mit = config.mitigations
        if mit is not None and (mit.load_bound is not None or mit.smoothing_margin is not None):
            from moescope.runtime.router import Mitigation

            for layer in model.moe_layers():
                layer.router.mitigation = Mitigation(load_bound=mit.load_bound, smoothing_margin=mit.smoothing_margin)

    def _recorder(self, model, config: Config):
        from moescope.traces.recorder import TraceRecorder

        t, tracer = config.traces, None
        name = config.metrics.model_name or getattr(getattr(model, "cfg", None), "name", None)
        if t.otlp_endpoint:
            from moescope.traces import otlp

            provider = otlp.tracer_provider(t.otlp_endpoint, attributes={"moescope.model": name})
            self._stack.callback(provider.shutdown)  # after the recorder's last spans (the stack unwinds LIFO)
            tracer = provider.get_tracer("moescope")
        self.recorder = TraceRecorder(t.path, sample=t.sample, model=name, rank=config.metrics.rank, seed=t.seed,
                                      tracer=tracer)
        return self.recorder

    def _detach(self, previous) -> None:
        if self.model.observer is self.observer:
            self.model.observer = previous

    def engine(self, *, max_batch: int = 16, seed: int = 0, decode: str = "eager", **kwargs):
        """An ``Engine`` serving the instrumented model, with the canary and the scenarios' engine faults
        (``leak``). ``kwargs`` go to ``Engine`` (``clock``)."""
        from moescope.runtime.engine import Engine

        engine = Engine(self.model, max_batch=max_batch, seed=seed, canary=self.canary, decode=decode, **kwargs)
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


def _is_adapter(model) -> bool:
    """An engine adapter reporting through the observer seam (``moescope.vllm.vllm_adapter.VLLMAdapter``, the HF
    adapter): it says what the model is (``model_info``) and attaches to an observer itself."""
    return all(callable(getattr(model, name, None)) for name in ("model_info", "attach", "detach"))


def _placement(model):
    """The expert-parallel placement the model's MoE layers dispatch by (``moescope.parallel``), or None."""
    for layer in model.moe_layers():
        ep = getattr(layer, "parallel", None)
        if ep is not None:
            return getattr(ep, "placement", None)
    return None


def _cache_capacity(model) -> dict[int, float]:
    """{MoE layer: experts its expert cache holds resident / experts} where a cache is attached."""
    out = {}
    for layer in model.moe_layers():
        lc = getattr(layer.experts, "weight_source", None)
        capacity = getattr(getattr(lc, "policy", None), "capacity", None)
        if capacity is not None:
            out[layer.layer_index] = min(1.0, capacity / layer.experts.n_experts)
    return out


def _expert_cache(model, c: Cache):
    """The expert cache as a context manager; ``static`` pins the most used experts of a calibration pass
    over held-out traffic; a disk tier without a file gets a temporary one, removed at close."""
    import os
    import tempfile
    from contextlib import contextmanager

    from moescope.runtime.expert_cache import attach_cache
    from moescope.runtime.calibration import calibration_load

    @contextmanager
    def cm():
        pinned = None
        if c.policy == "static":
            pinned = {layer: sorted(range(len(n)), key=lambda e: (-n[e], e))
                      for layer, n in calibration_load(model, c.calibration_seed, 8).items()}
        with tempfile.TemporaryDirectory(prefix="moescope-experts-") as tmp:
            path = c.file or os.path.join(tmp, "experts.safetensors")
            cache = attach_cache(model, size=c.size if c.size is not None else model.cfg.n_experts, policy=c.policy,
                                 tier=c.tier, path=path if c.tier == "disk" else None, prefetch=c.prefetch,
                                 pinned=pinned, disk_delay_s=c.disk_delay_s)
            try:
                yield cache
            finally:
                cache.close()

    return cm()


__all__ = ["Instrumentation", "instrument"]
