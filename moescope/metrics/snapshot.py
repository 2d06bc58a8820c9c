"""What one evaluation publishes: an immutable ``Snapshot`` of everything the exporter, ``moescope top`` and the
terminal views read. Readers never compute, fold or learn: any number of them (an HA Prometheus pair, ``top``, a
test) read the same snapshot, and when learning happens depends on the evaluator's clock alone, never on who reads.

Arrays and dicts in a snapshot are the evaluation's own copies: read them, never write them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moescope.metrics.window import LayerGauges


@dataclass(frozen=True)
class Snapshot:
    """The metrics as of one evaluation (``seq`` counts evaluations; ``at`` is the evaluator's clock)."""

    seq: int
    at: float
    gauges: LayerGauges
    counters: dict = field(default_factory=dict)  # (name, label values) -> value
    layer_counters: dict = field(default_factory=dict)  # name -> {layer: value}
    router_tokens_by_mode: dict = field(default_factory=dict)  # (layer, mode) -> tokens
    expert_tokens: dict = field(default_factory=dict)  # layer -> [E] cumulative slots
    histograms: dict = field(default_factory=dict)  # (name, label values) -> histograms.HistogramData
    drift: dict = field(default_factory=dict)  # layer -> JS divergence from the baseline (bits)
    drift_noise: dict = field(default_factory=dict)  # layer -> what sampling noise gives against it
    flips: dict = field(default_factory=dict)  # layer -> the last canary run's flip ratio
    rank_loads: tuple | None = None  # ({layer: busiest / mean rank}, {rank: slots}) with a placement
    eplb: tuple = ({}, {}, {})  # (before, predicted, measured) max/mean of the last rearrangement
    capacity: dict = field(default_factory=dict)  # layer -> resident experts / E
    activation: float | None = None
    errors: dict = field(default_factory=dict)  # observer -> errors raised
    dropped: dict = field(default_factory=dict)  # queue -> events dropped
    cost_s: float | None = None  # an engine adapter's own count of its step-path seconds
    baseline: Any = None  # the analysis.baseline.Profile the gauges were judged against, or None
    window_layers: tuple[int, ...] = ()  # the routing window's rows (every layer known, routed or not)
    window_draws: int = 0
    capture_enabled: bool = True
    capture_switches: int = 0
    evaluations_failed: int = 0
    # every judgement's bar and clear bar (``Thresholds.bars``): (the model's layers, the bars)
    bars: tuple | None = None
    extra: dict = field(default_factory=dict)  # components' own snapshots (step balance, ...), by name

    def hist(self, name: str, *labels: str):
        """The ``HistogramData`` of one child, or None before its first observation."""
        return self.histograms.get((name, labels))


__all__ = ["Snapshot"]
