"""The layer-labelled families (routing counters, window gauges, the hot experts and the references, per-expert
tiers, rank loads, the expert cache and EPLB per layer, every judgement's bar): a prometheus_client collector
(``collect()``) registered on the exporter's ``CollectorRegistry``, whose families the fast writer renders
(``metrics.exposition``: prometheus_client would take ~0.4 s a scrape to format the ~17,000 series of DeepSeek-V3's
shape; that module says why and how the two share one registry).

Everything comes from the last evaluation's snapshot (``MetricsObserver.current``): read, never computed here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator

from moescope.metrics import catalogue
from moescope.metrics import step_balance_families  # [eplb] wiring
from moescope.metrics.exposition import Families, FamilyWriter, Rendered
from moescope.metrics.state import EXTREMES_K, LAYER_GAUGES

if TYPE_CHECKING:
    from moescope.metrics.snapshot import Snapshot
    from moescope.metrics.state import MetricsObserver

ROUTING_LAYER_COUNTERS = ("moescope_tokens_dropped_total", "moescope_router_nonfinite_logits_total",
                          "moescope_expert_distinct_total", "moescope_expert_distinct_steps_total")
CACHE_LAYER_COUNTERS = tuple(m.name for m in catalogue.CATALOGUE
                             if m.name.startswith("moescope_expert_cache_") and m.kind == "counter")
# The bars a rank that exports no routing still has a quantity for (its cache, all-to-all, fetches, memory)
_BARS_WITHOUT_ROUTING = ("cache", "all_to_all", "fetch", "slow_rank_share", "slow_rank_wait", "memory")


class LayerFamilies:
    """The layer-labelled families of one ``MetricsObserver`` as a prometheus_client collector: ``collect()`` yields
    ``exposition.Rendered`` families (their rows taken from the snapshot now, their text written when the exposition
    asks). With ``registry``, it registers itself there (prometheus_client's ``registry=``)."""

    def __init__(self, state: "MetricsObserver", *, registry=None) -> None:
        self.state = state
        self.writer = FamilyWriter(state.info.name, str(state.rank))
        if registry is not None:
            registry.register(self)

    def describe(self) -> list:
        return []  # families vary with data; skip registry-time collection

    def collect(self) -> Iterator[Rendered]:
        st = self.state
        snap = st.current()  # the last evaluation's snapshot
        out = Families(self.writer)
        if st.export_routing:
            _routing_counters(st, snap, out)
            _window_gauges(st, snap, out)
            _rank_and_totals(st, snap, out)
            # [eplb] wiring: the step-level prediction's families from its snapshot (metrics.step_balance_families)
            out += step_balance_families.families(snap.extra.get("StepBalance"), self.writer, st.per_expert)
        _cache_and_eplb(snap, out)
        _bars(st, snap, out)
        return iter(out)

    def text(self, openmetrics: bool) -> str:
        """Every family's text, now (benchmarks and tests; the exporter writes them through the registry)."""
        return "".join(f.text(openmetrics) for f in self.collect())


def _layer_rows(values: dict) -> list:
    return [((str(k),), v) for k, v in sorted(values.items())]


def _routing_counters(st: "MetricsObserver", snap: "Snapshot", out: Families) -> None:
    spec = catalogue.BY_NAME
    if snap.activation is not None:
        out.family(spec["moescope_activation_ratio"], [((), snap.activation)])
    out.family(spec["moescope_activation_expected_ratio"], [((), st.info.expected_activation)])
    by_mode = sorted(((str(layer), mode), v) for (layer, mode), v in snap.router_tokens_by_mode.items())
    out.family(spec["moescope_router_tokens_total"], by_mode)  # by forward_mode
    for name in ROUTING_LAYER_COUNTERS:
        out.family(spec[name], _layer_rows(snap.layer_counters.get(name, {})))
    rerouted = sorted((labels, v) for (name, labels), v in snap.counters.items()
                      if name == "moescope_rerouted_slots_total")
    out.family(spec["moescope_rerouted_slots_total"], rerouted)


def _window_gauges(st: "MetricsObserver", snap: "Snapshot", out: Families) -> None:
    """The window's gauges per layer, the hot experts, the references and the baseline's series."""
    spec = catalogue.BY_NAME
    g = snap.gauges
    layers = [str(layer) for layer in g.layers]
    for name, attr in LAYER_GAUGES:
        out.family(spec[name], [((lay,), v) for lay, v in zip(layers, getattr(g, attr).tolist())])
    out.family(spec["moescope_window_draws"], [((), g.window_draws)])
    out.family(spec["moescope_routing_drift_jsd_bits"], _layer_rows(snap.drift))
    out.family(spec["moescope_routing_drift_noise_bits"], _layer_rows(snap.drift_noise))
    out.family(spec["moescope_routing_flip_ratio"], _layer_rows(snap.flips))
    hot = g.hot_experts(EXTREMES_K)
    reference = list(g.hot_reference) or ["fair"] * len(layers)
    out.family(spec["moescope_expert_hot_factor_ratio"],
               [((lay, str(e), reference[j]), f) for j, lay in enumerate(layers) for e, f in hot[j]])
    if g.dead_holding is not None:
        out.family(spec["moescope_dead_experts_holding"],
                   [((lay,), v) for lay, v in zip(layers, g.dead_holding.tolist())])
    for name, values in (("moescope_reference_load_cv_ratio", g.reference_cv),
                         ("moescope_reference_top_share_ratio", g.reference_top)):
        if values is not None:  # absent while a layer's reference is being learned
            out.family(spec[name], [((lay, reference[j]), v) for j, (lay, v) in enumerate(zip(layers, values.tolist()))
                                    if math.isfinite(v)])
    n_exp = st.info.n_experts
    out.gauge_histogram(spec["moescope_expert_load_relative"],
                        [((lay,), [*rel, n_exp], float(n_exp))
                         for lay, rel in zip(layers, g.relative.astype(int).tolist())])
    extremes = g.extremes(EXTREMES_K)
    slots = g.slots.astype(int)
    out.family(spec["moescope_expert_window_slots"],
               [((lay, str(e)), int(slots[j, e])) for j, lay in enumerate(layers) for e in extremes[j]])
    _baseline(st, snap, extremes, hot, out)


def _rank_and_totals(st: "MetricsObserver", snap: "Snapshot", out: Families) -> None:
    spec = catalogue.BY_NAME
    if snap.rank_loads is not None:
        per_layer, per_rank = snap.rank_loads
        out.family(spec["moescope_rank_load_max_over_mean_ratio"], _layer_rows(per_layer))
        out.family(spec["moescope_rank_window_slots"], _layer_rows(per_rank))
    if st.per_expert and snap.expert_tokens:
        out.experts(spec["moescope_expert_tokens_total"], snap.expert_tokens)


def _cache_and_eplb(snap: "Snapshot", out: Families) -> None:
    spec = catalogue.BY_NAME
    for name in CACHE_LAYER_COUNTERS:
        out.family(spec[name], _layer_rows(snap.layer_counters.get(name, {})))
    out.family(spec["moescope_expert_cache_capacity_ratio"], _layer_rows(snap.capacity))
    for name, values in zip(("moescope_eplb_before_max_over_mean_ratio", "moescope_eplb_predicted_max_over_mean_ratio",
                             "moescope_eplb_measured_max_over_mean_ratio"), snap.eplb):
        out.family(spec[name], _layer_rows(values))


def _bars(st: "MetricsObserver", snap: "Snapshot", out: Families) -> None:
    """The bar and clear bar of every judgement (``Thresholds.bars``, computed by the evaluator: the series the alert
    rules compare with), for every layer of the model and for the model."""
    if snap.bars is None:
        return
    layers, bars = snap.bars
    routing = st.export_routing
    for name, clear in (("moescope_judgement_bar", False), ("moescope_judgement_clear_bar", True)):
        out.family(catalogue.BY_NAME[name], [r for r in bars.rows(layers, clear)
                                             if routing or r[0][0] in _BARS_WITHOUT_ROUTING])


def _baseline(st: "MetricsObserver", snap: "Snapshot", extremes, hot, out: Families) -> None:
    """The loaded baseline's series: its structural CV per layer and each expert's share (full tier: every
    expert of every layer it has; reduced tier: the experts of moescope_expert_window_slots and the hot
    experts)."""
    profile = snap.baseline
    if profile is None:
        return
    spec = catalogue.BY_NAME
    g = snap.gauges
    model_layers = set(snap.window_layers)
    layers = sorted(layer for layer in profile.layers if layer in model_layers)
    out.family(spec["moescope_baseline_load_cv_ratio"],
               [((str(k),), float(profile.layers[k].structural_cv)) for k in layers])
    share = spec["moescope_baseline_expert_share_ratio"]
    if st.per_expert:
        rows = [((str(k), str(e)), v) for k in layers for e, v in enumerate(profile.layers[k].share.tolist())]
    else:
        shown = {layer: sorted(set(extremes[j]) | {e for e, _ in hot[j]}) for j, layer in enumerate(g.layers)}
        rows = [((str(k), str(e)), float(profile.layers[k].share[e])) for k in layers for e in shown.get(k, ())]
    out.family(share, rows)


__all__ = ["CACHE_LAYER_COUNTERS", "LayerFamilies", "ROUTING_LAYER_COUNTERS"]
