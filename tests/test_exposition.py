"""The exporter's fast writer against prometheus_client itself (the reference rendering of the same families,
values recomputed with moescope.stats), both exposition formats, and the cardinality tiers."""

import numpy as np
import pytest

from metrics_util import by_label, parse
from moescope import sampling, thresholds
from moescope.analysis import baseline as bl
from moescope.capture.records import StepRecord
from moescope.capture.routing_probe import LayerStats, StepStats
from moescope.metrics import catalogue
from moescope.metrics.exporter import Exporter
from moescope.metrics.state import EXTREMES_K, MetricsObserver, ModelInfo
from moescope.parallel.expert_parallel import AllToAllRecord
from reference import naive_dead_experts, naive_jensen_shannon, naive_load_cv, naive_max_over_mean, naive_top_share

E, LAYERS = 20, (1, 2, 4)


def _state(seed=0, budget=10**6, export_routing=True,
           model='m"odd\\name', baseline=True):
    """A state fed five seconds of routing as the probe delivers it: per-request counts, requests finishing
    over later flushes. ``st.recorded`` keeps every finished request's [L, E] counts (the reference)."""
    from moescope.capture.routing_probe import DrawCounts

    info = ModelInfo(model, E, 2, LAYERS, dense_params=1000, expert_params=50)
    clock = [100.0]
    st = MetricsObserver(info, rank=3, expert_series_budget=budget, export_routing=export_routing,
                         clock=lambda: clock[0])
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(E) * 0.7)
    recorded, live = [], {}
    for sec in range(5):
        clock[0] = 100.0 + sec
        rids = [f"r{sec}-{j}" for j in range(4)]
        counts = np.stack([np.stack([rng.multinomial(10 + 3 * j - i, rng.dirichlet(p * 30 + 0.05))
                                     for i, _ in enumerate(LAYERS)]) for j in range(4)]).astype(np.int64)
        for rid, c in zip(rids, counts):
            live[rid] = live.get(rid, 0) + c
        finished = tuple(r for r in live if r.endswith(("-0", "-1")) or not r.startswith(f"r{sec}-"))
        recorded += [live.pop(r) for r in finished]
        layers = tuple(LayerStats(layer, 40, counts[:, i].sum(0), 2 * i, i % 2, 20.0, 7.5, 1e-4, 2e-3,
                                  {"load": 3} if layer == 2 else None) for i, layer in enumerate(LAYERS))
        st.on_stats(StepStats(1, layers, E, 2, DrawCounts(tuple(rids), counts, finished)))
        st.flush()  # one evaluation per second of routing, as the evaluator runs
    st.on_canary({1: 0.25, 2: 0.0})
    if baseline:
        st.baseline = bl.coerce({1: [1.0] * E})
    st.flush()
    st.recorded = np.stack(recorded)  # [R, L, E] finished requests, layers in LAYERS order
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
            f = fam("moescope_router_tokens_total")
            for (layer, mode), n in sorted(st.snapshot.router_tokens_by_mode.items()):
                f.add_metric([*base, str(layer), mode], n)
            yield f
            judged = _judged(st, win)
            gauges = {
                "moescope_expert_load_cv_ratio": lambda w: naive_load_cv(w["slots"].tolist()),
                "moescope_expert_load_cv_noise_ratio": lambda w: judged[w["layer"]]["noise"],
                "moescope_expert_load_excess_cv_ratio": lambda w: judged[w["layer"]]["excess"],
                "moescope_dead_experts_unexpected": lambda w: judged[w["layer"]]["dead"],
                "moescope_expert_load_top_share_ratio": lambda w: naive_top_share(w["slots"].tolist(), w["tokens"]),
                "moescope_expert_load_max_over_mean_ratio": lambda w: naive_max_over_mean(w["slots"].tolist()),
                "moescope_dead_experts": lambda w: naive_dead_experts(w["slots"].tolist()),
                "moescope_window_slots_per_expert": lambda w: w["slots"].sum() / E,
                "moescope_router_entropy_ratio": lambda w: w["entropy"] / w["tokens"],
            }
            for name, fn in gauges.items():
                f = fam(name)
                for layer, w in win.items():
                    f.add_metric([*base, str(layer)], float(fn({**w, "layer": layer})))
                yield f
            f = fam("moescope_routing_drift_jsd_bits")
            f.add_metric([*base, "1"], naive_jensen_shannon(win[1]["slots"].tolist(), [1.0] * E))
            yield f
            f = fam("moescope_routing_drift_noise_bits")
            f.add_metric([*base, "1"], judged[1]["drift_noise"])
            yield f
            f = fam("moescope_window_draws")
            f.add_metric(base, float(len(st.recorded)))
            yield f
            f = fam("moescope_expert_hot_factor_ratio")
            for layer in win:
                for e, v in judged[layer]["hot"]:
                    f.add_metric([*base, str(layer), str(e), "baseline" if layer == 1 else "fair"], v)
            yield f
            f = fam("moescope_baseline_load_cv_ratio")
            f.add_metric([*base, "1"], 0.0)  # a uniform baseline: no structure
            yield f
            f = fam("moescope_baseline_expert_share_ratio")
            for e in range(E):
                f.add_metric([*base, "1", str(e)], 1 / E)
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


def _judged(st, win):
    """Noise, excess, dead, hot and drift noise per layer, recomputed with moescope.sampling from the recorded
    per-request counts of the finished requests (the window's draws)."""
    out = {}
    draws_all = sampling.Draws.of(st.recorded)
    L = len(LAYERS)
    for i, layer in enumerate(LAYERS):
        slots = win[layer]["slots"].astype(float)[None]
        d = draws_all.rows([i])
        noise = float(sampling.noise_cv(E, slots.sum(1), d, thresholds.DEFAULT.noise_z)[0])
        cv = naive_load_cv(slots[0].tolist())
        has_base = layer == 1
        ref = np.full((1, E), 1 / E)
        dead_ref = ref if has_base else np.full((1, E), thresholds.DEFAULT.dead_reference(E))
        hot = sampling.hot_factor(slots, d, ref, thresholds.DEFAULT.hot_z(L, E))[0]
        order = sorted((e for e in range(E) if np.isfinite(hot[e])), key=lambda e: (-hot[e], e))[:EXTREMES_K]
        out[layer] = {"noise": noise, "excess": float(np.sqrt(max(0.0, cv * cv - noise * noise))),
                      "dead": float(sampling.dead_unexpected(slots, d, dead_ref,
                                                             thresholds.DEFAULT.dead_min_expected_slots)[0]),
                      "hot": [(e, float(hot[e])) for e in order],
                      "drift_noise": float(sampling.drift_noise_bits(slots, d, ref, thresholds.DEFAULT.noise_z)[0])}
    return out


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
    st.on_step(StepRecord(0, "decode", 0.0, 0.01, 1, (("r1", 0, 1),)))
    st.flush()
    for om in (False, True):
        text = Exporter(st, port=0).exposition(om).decode()
        names = {s.name for f in _families(text, om).values() for s in f.samples}
        assert names <= catalogue.exposed_sample_names(), names - catalogue.exposed_sample_names()
    assert text.endswith("# EOF\n") and text.count("# EOF") == 1
    assert '# {request_id="r1"}' in text  # the step's exemplar: its first request


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
        assert buckets["0.0"] == naive_dead_experts(slots) and buckets["+Inf"] == E
    # the aggregates every consumer falls back on are there in both tiers
    cv = "moescope_expert_load_cv_ratio"
    assert by_label(reduced, cv, "layer") == by_label(full, cv, "layer")


def test_a_rank_that_routes_the_same_tokens_exports_no_routing():
    st = _state(export_routing=False)
    st.on_all_to_all(AllToAllRecord(layer=1, op="dispatch", seconds=0.001, sent_bytes=(0,), recv_bytes=(0,),
                                    peer_wait_s=(0.0,), expert_rows=(), rank_rows=()))
    st.flush()
    parsed = parse(Exporter(st, port=0).exposition().decode())
    names = {n for n, _ in parsed}
    routing = {m.name for m in catalogue.CATALOGUE if m.routing}
    assert not names & routing
    assert "moescope_all_to_all_seconds_count" in names and "moescope_build_info" in names


def test_noise_bound_is_what_uniform_routing_stays_under():
    rng = np.random.default_rng(5)
    for n_experts, slots in ((256, 1000), (256, 14000), (8, 500)):
        cvs = [naive_load_cv(rng.multinomial(slots, np.ones(n_experts) / n_experts).tolist()) for _ in range(400)]
        bound = sampling.multinomial_noise_cv(n_experts, slots, thresholds.DEFAULT.noise_z)
        assert np.mean(np.array(cvs) > bound) < 0.02  # the chi-square's 3-sigma quantile: rarely crossed
        assert np.mean(np.square(cvs)) == pytest.approx((n_experts - 1) / slots, rel=0.05)  # the mean floor
        # uniform routing at any traffic rarely reads as imbalance, even without a baseline's bar
        excess = sampling.excess_cv(np.array(cvs), bound)
        assert np.mean(excess > thresholds.DEFAULT.imbalance_bar(None)) < 0.02


def test_the_trace_writers_rss_reading_is_the_exporters():
    """``metrics.system.rss_bytes`` (read directly from /proc, every 100 ms by the trace writer) against
    prometheus_client's ProcessCollector, which the exporter serves as moescope_process_resident_memory_bytes."""
    from prometheus_client import ProcessCollector

    from moescope.metrics.system import rss_bytes

    def collector() -> float:
        return next(f for f in ProcessCollector(registry=None).collect()
                    if f.name == "process_resident_memory_bytes").samples[0].value

    before, ours, after = collector(), rss_bytes(), collector()
    # the same counter read three times in a row: equal unless the process grew or shrank in between (a page or two)
    assert min(before, after) - 2**20 <= ours <= max(before, after) + 2**20
    assert ours > 10 * 2**20  # a Python process with numpy and prometheus_client: tens of MB, not pages or KB


@pytest.mark.parametrize("openmetrics", [False, True])
def test_the_registry_is_one_prometheus_client_registry_any_reader_renders(openmetrics):
    """The exporter serves a ``CollectorRegistry`` passed in, on which its collectors registered: prometheus_client's
    own writer, given that registry, writes the same samples as the exporter (whose fast writer renders the
    layer-labelled families itself), and a collector of the user's own on the same registry is served with them."""
    from prometheus_client import CollectorRegistry, Counter

    from moescope.metrics.exposition import Rendered

    if openmetrics:
        from prometheus_client.openmetrics.exposition import generate_latest
    else:
        from prometheus_client import generate_latest
    registry = CollectorRegistry(auto_describe=False)
    mine = Counter("my_app_requests", "A user's own counter.", registry=registry)
    mine.inc(7)
    exporter = Exporter(_state(), port=0, registry=registry)
    assert exporter.registry is registry
    rendered = [m for m in registry.collect() if isinstance(m, Rendered)]
    assert {m.spec.name for m in rendered} >= {"moescope_expert_tokens_total", "moescope_expert_load_cv_ratio",
                                               "moescope_judgement_bar", "moescope_expert_load_relative"}
    ours = exporter.exposition(openmetrics).decode()
    theirs = generate_latest(registry).decode()  # prometheus_client alone: every sample through its own writer
    got, want = _families(ours, openmetrics), _families(theirs, openmetrics)
    assert set(got) == set(want)
    for name, ref in want.items():
        f = got[name]
        assert (f.type, f.documentation) == (ref.type, ref.documentation), name
        samples = sorted((s.name, sorted(s.labels.items())) for s in f.samples)
        assert samples == sorted((s.name, sorted(s.labels.items())) for s in ref.samples), name
        if name.startswith("moescope_process_"):
            continue  # the live process's memory and CPU time, read again by each writer
        values = {(s.name, frozenset(s.labels.items())): s.value for s in f.samples}
        for s in ref.samples:
            v = values[(s.name, frozenset(s.labels.items()))]
            assert v == s.value or (v != v and s.value != s.value), (name, s)
    assert parse(exporter.exposition().decode())[("my_app_requests_total", frozenset())] == 7.0


def test_sources_are_read_once_per_evaluation_never_by_a_scrape():
    """What a component counts of itself reaches the exposition through the metrics' sources, read by the evaluation
    (a later change shows only after the next one), summed by name across sources; a source that raises is counted,
    never raised."""
    from moescope.capture.sources import Reading

    class Queue:
        def __init__(self) -> None:
            self.reads, self.dropped = 0, 0

        def read(self) -> Reading:
            self.reads += 1
            return Reading(dropped={"q": self.dropped}, errors={"sink": 1}, cost_s=0.25)

    class Broken:
        def read(self) -> Reading:
            raise RuntimeError("a source that cannot be read")

    st = _state()
    q, other = Queue(), Queue()
    for s in (q, other, Broken()):
        st.sources.register(s)
    st.sources.register(q)  # registering again changes nothing
    q.dropped, other.dropped = 4, 1
    st.flush()
    exporter = Exporter(st, port=0)
    reads = q.reads
    q.dropped = 100
    first = parse(exporter.exposition().decode())
    assert q.reads == reads  # a scrape reads the snapshot, not the sources
    assert by_label(first, "moescope_capture_dropped_total", "queue")["q"] == 5.0
    errors = by_label(first, "moescope_observer_errors_total", "observer")
    assert errors["sink"] == 2.0 and errors["sources"] == 1.0
    assert by_label(first, "moescope_capture_seconds_total", "model") == {st.info.name: 0.5}
    st.flush()
    assert by_label(parse(exporter.exposition().decode()), "moescope_capture_dropped_total", "queue")["q"] == 101.0
