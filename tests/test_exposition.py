"""The exporter's fast writer against prometheus_client itself (the reference rendering of the same families,
values recomputed with moescope.stats), both exposition formats, and the cardinality tiers."""

import numpy as np
import pytest

from metrics_util import by_label, parse
from moescope import stats, thresholds
from moescope.capture.routing_probe import LayerStats, StepStats
from moescope.metrics import catalogue
from moescope.metrics.exporter import Exporter
from moescope.metrics.state import EXTREMES_K, MetricsObserver, ModelInfo

E, LAYERS = 20, (1, 2, 4)


def _state(seed=0, budget=10**6, export_routing=True,
           model='m"odd\\name'):
    info = ModelInfo(model, E, 2, LAYERS, dense_params=1000, expert_params=50)
    clock = [100.0]
    st = MetricsObserver(info, rank=3, expert_series_budget=budget, export_routing=export_routing,
                         clock=lambda: clock[0])
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(E) * 0.7)
    for sec in range(5):
        clock[0] = 100.0 + sec
        layers = tuple(LayerStats(layer, 40, rng.multinomial(80 - 2 * i, p).astype(np.int64), 2 * i, i % 2,
                                  20.0, 7.5, 1e-4, 2e-3, {"load": 3} if layer == 2 else None)
                       for i, layer in enumerate(LAYERS))
        st._on_stats(StepStats(1, layers, E, 2))
    st.flips = {1: 0.25, 2: 0.0}
    st.baseline = {1: [1.0] * E}
    return st


def _reference_text(st, openmetrics):
    """The routing families rendered by prometheus_client from values recomputed with moescope.stats."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily

    spec = catalogue.BY_NAME
    base = [st.info.name, str(st.rank)]
    win = st.window()

    def fam(name):
        m = spec[name]
        cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}[m.kind]
        return cls(m.family, m.help, labels=list(m.all_labels))

    class Reference:
        def collect(self):
            f = fam("moescope_expert_tokens_total")
            for layer, counts in st.expert_tokens.items():
                for e, n in enumerate(counts.tolist()):
                    f.add_metric([*base, str(layer), str(e)], n)
            yield f
            for name in ("moescope_router_tokens_total",):
                f = fam(name)
                for layer in LAYERS:
                    f.add_metric([*base, str(layer)], st.layer_counters[name][layer])
                yield f
            gauges = {
                "moescope_expert_load_cv_ratio": lambda w: stats.load_cv(w["slots"].tolist()),
                "moescope_expert_load_cv_noise_ratio": lambda w: thresholds.noise_cv(E, w["slots"].sum()),
                "moescope_expert_load_top_share_ratio": lambda w: stats.top_share(w["slots"].tolist(), w["tokens"]),
                "moescope_expert_load_max_over_mean_ratio": lambda w: stats.max_over_mean(w["slots"].tolist()),
                "moescope_dead_experts": lambda w: stats.dead_experts(w["slots"].tolist()),
                "moescope_window_slots_per_expert": lambda w: w["slots"].sum() / E,
                "moescope_router_entropy_ratio": lambda w: w["entropy"] / w["tokens"],
            }
            for name, fn in gauges.items():
                f = fam(name)
                for layer, w in win.items():
                    f.add_metric([*base, str(layer)], float(fn(w)))
                yield f
            f = fam("moescope_routing_drift_jsd_bits")
            f.add_metric([*base, "1"], stats.jensen_shannon(win[1]["slots"].tolist(), [1.0] * E))
            yield f
            m = spec["moescope_expert_load_relative"]
            f = GaugeHistogramMetricFamily(m.family, m.help, labels=list(m.all_labels))
            for layer, w in win.items():
                rel = w["slots"] / w["slots"].mean()
                counts = [(repr(float(b)), int((rel <= b).sum())) for b in m.buckets] + [("+Inf", E)]
                f.add_metric([*base, str(layer)], counts, gsum_value=float(E))
            yield f

    r = CollectorRegistry(auto_describe=False)
    r.register(Reference())
    if openmetrics:
        from prometheus_client.openmetrics.exposition import generate_latest
    else:
        from prometheus_client import generate_latest
    return generate_latest(r).decode()


def _families(text, openmetrics):
    if openmetrics:
        from prometheus_client.openmetrics.parser import text_string_to_metric_families
    else:
        from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.mark.parametrize("openmetrics", [False, True])
def test_fast_writer_writes_what_prometheus_client_writes(openmetrics):
    st = _state()
    got = _families(Exporter(st, port=0).exposition(openmetrics).decode(), openmetrics)  # OM parser is strict
    want = _families(_reference_text(st, openmetrics), openmetrics)
    for name, ref in want.items():
        f = got[name]
        assert (f.type, f.documentation) == (ref.type, ref.documentation), name
        values = {(s.name, frozenset(s.labels.items())): s.value for s in f.samples}
        for s in ref.samples:
            assert values[(s.name, frozenset(s.labels.items()))] == pytest.approx(s.value, rel=1e-12), s


def test_every_exported_name_is_in_the_catalogue_in_both_formats():
    st = _state()
    st.hist("moescope_step_seconds", "decode").observe(0.01, {"request_id": "r1"})
    for om in (False, True):
        text = Exporter(st, port=0).exposition(om).decode()
        names = {s.name for f in _families(text, om).values() for s in f.samples}
        assert names <= catalogue.exposed_sample_names(), names - catalogue.exposed_sample_names()
    assert text.endswith("# EOF\n") and text.count("# EOF") == 1
    assert '# {request_id="r1"}' in text  # prometheus_client's Histogram keeps the exemplar


def test_reduced_tier_keeps_the_hottest_and_coldest_experts_and_the_distribution():
    full = parse(Exporter(_state(seed=1), port=0).exposition().decode())
    st = _state(seed=1, budget=len(LAYERS) * E - 1)
    reduced = parse(Exporter(st, port=0).exposition().decode())
    assert by_label(full, "moescope_expert_series_per_expert", "model")[st.info.name] == 1
    assert by_label(reduced, "moescope_expert_series_per_expert", "model")[st.info.name] == 0
    assert by_label(full, "moescope_expert_tokens_total", "layer", "expert")
    assert not by_label(reduced, "moescope_expert_tokens_total", "layer", "expert")
    win = st.window()
    got = by_label(reduced, "moescope_expert_window_slots", "layer", "expert")
    for layer, w in win.items():
        slots = w["slots"].tolist()
        order = sorted(range(E), key=lambda e: (-slots[e], e))  # hottest first, ties to the lower id
        want = set(order[:EXTREMES_K]) | set(sorted(range(E), key=lambda e: (slots[e], e))[:EXTREMES_K])
        assert {int(e): v for (lay, e), v in got.items() if lay == str(layer)} == {e: slots[e] for e in want}
        buckets = by_label(reduced, "moescope_expert_load_relative_bucket", "le", layer=str(layer))
        assert buckets["0.0"] == stats.dead_experts(slots) and buckets["+Inf"] == E
    # the aggregates every consumer falls back on are there in both tiers
    cv = "moescope_expert_load_cv_ratio"
    assert by_label(reduced, cv, "layer") == by_label(full, cv, "layer")


def test_a_rank_that_routes_the_same_tokens_exports_no_routing():
    st = _state(export_routing=False)
    st.hist("moescope_all_to_all_seconds", "dispatch").observe(0.001)
    parsed = parse(Exporter(st, port=0).exposition().decode())
    names = {n for n, _ in parsed}
    routing = {m.name for m in catalogue.CATALOGUE if m.routing}
    assert not names & routing
    assert "moescope_all_to_all_seconds_count" in names and "moescope_build_info" in names


def test_noise_bound_is_what_uniform_routing_stays_under():
    rng = np.random.default_rng(5)
    for n_experts, slots in ((256, 1000), (256, 14000), (8, 500)):
        cvs = [stats.load_cv(rng.multinomial(slots, np.ones(n_experts) / n_experts).tolist()) for _ in range(400)]
        bound = thresholds.noise_cv(n_experts, slots)
        assert np.mean(np.array(cvs) > bound) < 0.02  # 3 deviations of chi-square: rarely crossed
        assert np.mean(np.square(cvs)) == pytest.approx((n_experts - 1) / slots, rel=0.05)  # the mean floor
        bar = thresholds.for_model(None).load_cv  # uniform routing at any traffic rarely reads as imbalance
        assert np.mean([thresholds.excess_cv(cv, n_experts, slots) > bar for cv in cvs]) < 0.02
