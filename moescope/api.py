"""The public entry point: instrument a model, optionally serve its metrics, stop cleanly."""

from __future__ import annotations

from typing import Iterable

from moescope.capture.observer import FanOut, Observer
from moescope.metrics.state import EXPERT_SERIES_BUDGET, MetricsObserver, ModelInfo


def _name(observer) -> str:
    return getattr(observer, "name", type(observer).__name__)


class Instrumentation:
    """Attach moescope to a model; a context manager.

    Args:
        model: a ``moescope.runtime`` ``MoETransformer`` or a HuggingFace transformers MoE model.
        model_name: the ``model`` label (default: the config's name / HF model type).
        rank: the ``rank`` label (expert-parallel rank).
        port: serve Prometheus metrics on this port (0: any free port; None: no server).
        addr: bind address (loopback unless you say otherwise).
        window_s: window of the ratio gauges (load CV, dead experts, entropy, activation ratio).
        expert_series_budget: the full tier (per-(layer, expert) counters) while layers x experts fits
            (default 64 x 256); beyond it the reduced tier (docs/metrics.md, "Cardinality").
        export_routing: False on a rank routing the same tokens as another exporting rank (lock-step expert
            parallelism): routing series are exported once.
        observers: more observers to fan out to (trace writer, your own).
    Raises:
        BadInput: the port cannot be bound, or the model is not a supported MoE model.
    """

    def __init__(self, model, *, model_name: str | None = None, rank: int = 0, port: int | None = None,
                 addr: str = "127.0.0.1", window_s: float = 60.0, expert_series_budget: int = EXPERT_SERIES_BUDGET,
                 export_routing: bool = True, observers: Iterable[Observer] = ()) -> None:
        from moescope.runtime.model import MoETransformer

        self.model = model
        self._hf = None
        if isinstance(model, MoETransformer):
            info = ModelInfo.from_runtime(model, model_name)
        else:
            from moescope.hf import adapter

            self._hf = adapter.HFAdapter(model)
            info = self._hf.model_info(model_name)
        self.metrics = MetricsObserver(info, rank=rank, window_s=window_s,
                                       expert_series_budget=expert_series_budget, export_routing=export_routing)
        observers = list(observers)
        self.observer = FanOut([self.metrics, *observers])
        # Observers with their own queue (QueuedObserver, TraceRecorder) report drops and errors.
        queued = [o for o in observers if isinstance(getattr(o, "dropped", None), int)]
        self.metrics.errors_source = lambda: {**self.observer.errors,
                                              **{_name(q): q.errors for q in queued if getattr(q, "errors", 0)}}
        self.metrics.dropped_source = lambda: {_name(q): q.dropped for q in queued}
        self.exporter = None
        if port is not None:  # before attaching: a port that cannot be bound leaves the model untouched
            from moescope.metrics.exporter import Exporter

            self.exporter = Exporter(self.metrics, port=port, addr=addr).start()
        if self._hf is not None:
            self._hf.attach(self.observer)
        else:
            self._previous = model.observer
            model.observer = self.observer

    def close(self) -> None:
        if self._hf is not None:
            self._hf.detach()
        elif self.model.observer is self.observer:
            self.model.observer = self._previous
        if self.exporter is not None:
            self.exporter.stop()
        self.observer.shutdown()

    def __enter__(self) -> "Instrumentation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
