"""Capture + exporter on the reference runtime: exported numbers against independent recomputation."""

import shutil
import subprocess

import pytest
import torch

import moescope
from conftest import in_ci
from helpers import Recording
from metrics_util import by_label, parse, sum_by_label
from moescope.analysis import baseline as bl
from moescope.capture.observer import Observer
from moescope.capture.queued import QueuedObserver
from moescope.capture.sources import Reading
from moescope.errors import BadInput
from moescope.metrics import catalogue
from moescope.runtime import traffic
from moescope.runtime.engine import Engine
from moescope.runtime.model import MoETransformer
from reference import naive_dead_experts, naive_jensen_shannon, naive_load_cv


class LogitsSpy:
    """Independent reference: forward hooks on each router keep its logits; ids recomputed in float64."""

    def __init__(self, model):
        self.logits = {i: [] for i in model.cfg.moe_layers}
        self.handles = [model.blocks[i].ffn.router.register_forward_hook(self._hook(i)) for i in model.cfg.moe_layers]

    def _hook(self, layer):
        def hook(module, args, out):
            self.logits[layer].append(module.logits(args[0]).detach().double())
        return hook

    def expected(self, k, n_experts, capacity_factor=None):
        from moescope.runtime.router import capacity_keep_mask, expert_capacity

        out = {}
        for layer, chunks in self.logits.items():
            counts = torch.zeros(n_experts, dtype=torch.long)
            tokens = nonfinite = dropped = 0
            for lg in chunks:
                ids = torch.topk(torch.softmax(lg, -1), k, dim=-1).indices
                tokens += lg.shape[0]
                nonfinite += int((~torch.isfinite(lg)).sum())
                if capacity_factor is not None:
                    keep = capacity_keep_mask(ids, n_experts, expert_capacity(lg.shape[0], k, n_experts,
                                                                              capacity_factor))
                    dropped += int((~keep).sum())
                    ids = ids[keep]
                counts += torch.bincount(ids.reshape(-1), minlength=n_experts)
            out[layer] = {"slots": counts.tolist(), "tokens": tokens, "nonfinite": nonfinite, "dropped": dropped}
        return out


@pytest.mark.parametrize("capacity_factor", [None, 0.8])
def test_exported_counts_equal_recomputation_from_router_logits(tiny_cfg, capacity_factor):
    model = MoETransformer(tiny_cfg.replace(capacity_factor=capacity_factor)).eval()
    spy = LogitsSpy(model)
    with moescope.instrument(model, port=0, model_name="t") as inst:
        records = Engine(model, max_batch=4).run(
            traffic.generate(traffic.TrafficConfig(seed=1, output_tokens_median=6), 7), realtime=False)
        parsed = parse(inst.exporter.exposition().decode())
    want = spy.expected(tiny_cfg.top_k, tiny_cfg.n_experts, capacity_factor)
    got = by_label(parsed, "moescope_expert_tokens_total", "layer", "expert", model="t", rank="0")
    for layer, w in want.items():
        assert [got[(str(layer), str(e))] for e in range(tiny_cfg.n_experts)] == w["slots"]
        assert sum_by_label(parsed, "moescope_router_tokens_total", "layer")[str(layer)] == w["tokens"]
        # by forward_mode: prefill routed the prompts, decode every output token fed back (all but the last)
        modes = by_label(parsed, "moescope_router_tokens_total", "forward_mode", layer=str(layer))
        assert modes == {"prefill": sum(len(r.prompt_tokens) for r in records),
                         "decode": sum(r.n_output - 1 for r in records)}
        assert by_label(parsed, "moescope_tokens_dropped_total", "layer")[str(layer)] == w["dropped"]
        assert by_label(parsed, "moescope_router_nonfinite_logits_total", "layer")[str(layer)] == w["nonfinite"]
        # The window gauges are the documented formulas over the same load.
        assert by_label(parsed, "moescope_expert_load_cv_ratio", "layer")[str(layer)] == \
            pytest.approx(naive_load_cv(w["slots"]))
        assert by_label(parsed, "moescope_dead_experts", "layer")[str(layer)] == naive_dead_experts(w["slots"])
    if capacity_factor is not None:
        assert sum(w["dropped"] for w in want.values()) > 0
    # Every exported sample name is in the catalogue.
    names = {n for n, _ in parsed}
    assert names <= catalogue.exposed_sample_names(), names - catalogue.exposed_sample_names()


def test_activation_ratio_and_entropy_against_recomputation(tiny_cfg):
    model = MoETransformer(tiny_cfg).eval()
    spy = LogitsSpy(model)
    with moescope.instrument(model) as inst:
        Engine(model, max_batch=4).run(traffic.generate(traffic.TrafficConfig(seed=2, output_tokens_median=5), 5),
                                       realtime=False)
        gauges = inst.metrics.window_gauges()
    total = sum(p.numel() for p in model.parameters())
    expert = 3 * tiny_cfg.hidden_size * tiny_cfg.ffn_size
    n_moe = len(tiny_cfg.moe_layers)
    dense = total - n_moe * tiny_cfg.n_experts * expert
    assert gauges["activation_ratio"] == pytest.approx((dense + n_moe * tiny_cfg.top_k * expert) / total)
    for layer, chunks in spy.logits.items():
        p = torch.softmax(torch.cat(chunks), -1)
        ent = (-(p * p.clamp_min(1e-300).log()).sum(-1) / torch.log(torch.tensor(float(tiny_cfg.n_experts))))
        assert gauges["layers"][layer]["moescope_router_entropy_ratio"] == pytest.approx(ent.mean().item(),
                                                                                         abs=1e-5)


def test_exemplars_carry_request_ids_in_openmetrics(tiny_cfg):
    model = MoETransformer(tiny_cfg).eval()
    with moescope.instrument(model, port=0) as inst:
        records = Engine(model, max_batch=4).run(traffic.generate(traffic.TrafficConfig(seed=3), 3), realtime=False)
        text = inst.exporter.exposition(openmetrics=True).decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("moescope_token_latency_seconds_bucket") and " # {" in ln]
    assert lines
    ids = {r.request_id for r in records}
    assert all(any(f'request_id="{i}"' in ln for i in ids) for ln in lines)


def test_promtool_check_metrics_passes_on_the_exposition(tiny_cfg):
    promtool = shutil.which("promtool")
    if promtool is None:
        if in_ci():
            pytest.fail("promtool missing in CI (install prometheus)")
        pytest.skip("promtool not installed")
    model = MoETransformer(tiny_cfg.replace(capacity_factor=1.0)).eval()
    from moescope.runtime.expert_cache import attach_cache
    cache = attach_cache(model, size=2)
    with moescope.instrument(model, port=0) as inst:
        Engine(model, max_batch=4).run(traffic.generate(traffic.TrafficConfig(seed=4), 4), realtime=False)
        text = inst.exporter.exposition()
    cache.close()
    assert b"moescope_expert_cache_hits_total" in text and b"moescope_expert_fetch_seconds_bucket" in text
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cache_metrics_equal_cache_counters(tiny_cfg):
    from moescope.runtime.expert_cache import attach_cache

    model = MoETransformer(tiny_cfg).eval()
    cache = attach_cache(model, size=2, policy="lru")
    with moescope.instrument(model, port=0) as inst:
        Engine(model, max_batch=4).run(traffic.generate(traffic.TrafficConfig(seed=5), 5), realtime=False)
        parsed = parse(inst.exporter.exposition().decode())
    cache.close()
    for layer, s in cache.stats().items():
        assert by_label(parsed, "moescope_expert_cache_lookups_total", "layer")[str(layer)] == s.lookups
        assert by_label(parsed, "moescope_expert_cache_hits_total", "layer")[str(layer)] == s.hits
        assert by_label(parsed, "moescope_expert_cache_evictions_total", "layer")[str(layer)] == s.evictions
        assert by_label(parsed, "moescope_expert_fetch_seconds_count", "layer")[str(layer)] == len(s.load_seconds)


def test_runtime_events_reach_only_the_observers_that_take_them(tiny_cfg):
    """The expert cache's events are the reference runtime's (``RuntimeObserver``), outside the engine-neutral
    ``Observer``: a runtime observer gets each forward's ``CacheDelta`` (they add up to the cache's own counters), an
    engine-neutral one beside it gets none, and one set as the model's observer itself (no fan-out) leaves the
    runtime serving what it serves without it."""
    from moescope.capture.observer import RuntimeObserver
    from moescope.runtime.expert_cache import attach_cache

    class Deltas(RuntimeObserver):
        def __init__(self) -> None:
            self.lookups: dict[int, int] = {}

        def on_cache(self, layer, delta) -> None:
            self.lookups[layer] = self.lookups.get(layer, 0) + delta.lookups

    class Steps(Observer):  # engine-neutral: it has no on_cache at all
        def __init__(self) -> None:
            self.steps = 0

        def on_step(self, step) -> None:
            self.steps += 1

    def serve(model, observer=None):
        return [r.output_tokens for r in Engine(model, max_batch=4, observer=observer).run(
            traffic.generate(traffic.TrafficConfig(seed=5), 4), realtime=False)]

    assert not hasattr(Steps(), "on_cache")
    reference = serve(MoETransformer(tiny_cfg).eval())
    model = MoETransformer(tiny_cfg).eval()
    cache = attach_cache(model, size=2, policy="lru")
    deltas, steps = Deltas(), Steps()
    with moescope.instrument(model, observers=[deltas, steps]):
        assert serve(model) == reference
    assert deltas.lookups == {layer: s.lookups for layer, s in cache.stats().items()} and steps.steps > 0
    alone = Steps()
    assert serve(model, alone) == reference and alone.steps == steps.steps  # the runtime's events went nowhere
    cache.close()


class Raising(Observer):
    def on_routing(self, layer, decision):
        raise RuntimeError("sink exploded")

    def on_step(self, step):
        raise RuntimeError("sink exploded")


class Blocking(Observer):
    def __init__(self):
        self.release = __import__("threading").Event()
        self.seen = 0

    def on_step(self, step):
        self.release.wait(300)  # held until the test releases it (a bound only so a broken test cannot hang)
        self.seen += 1


def test_a_sink_that_raises_or_blocks_never_stops_the_engine(tiny_cfg):
    model = MoETransformer(tiny_cfg).eval()
    reference = [r.output_tokens for r in Engine(MoETransformer(tiny_cfg), max_batch=4).run(
        traffic.generate(traffic.TrafficConfig(seed=6), 4), realtime=False)]
    blocking = Blocking()
    queued = QueuedObserver(blocking, maxsize=3, name="blocking")
    with moescope.instrument(model, port=0, observers=[Raising(), queued]) as inst:
        records = Engine(model, max_batch=4).run(traffic.generate(traffic.TrafficConfig(seed=6), 4), realtime=False)
        held = blocking.seen  # the sink is still inside its first on_step: none has returned yet
        parsed = parse(inst.exporter.exposition().decode())
        blocking.release.set()
    assert [r.output_tokens for r in records] == reference  # results unaffected
    assert held == 0  # the engine served every request while the sink was still blocked: it never waited on it
    n_steps = by_label(parsed, "moescope_steps_total", "phase")
    assert by_label(parsed, "moescope_observer_errors_total", "observer")["Raising"] > 0
    assert by_label(parsed, "moescope_capture_dropped_total", "queue")["blocking"] == queued.dropped > 0
    assert queued.dropped + blocking.seen <= sum(n_steps.values()) + len(records)
    # Metrics kept flowing despite the raising sink.
    assert sum(by_label(parsed, "moescope_expert_tokens_total", "layer", "expert").values()) > 0


def test_cardinality_budget_switches_to_per_layer_aggregates(tiny_cfg):
    model = MoETransformer(tiny_cfg).eval()
    with moescope.instrument(model, port=0, expert_series_budget=4) as inst:
        Engine(model, max_batch=2).run(traffic.generate(traffic.TrafficConfig(seed=7), 2), realtime=False)
        parsed = parse(inst.exporter.exposition().decode())
    assert not by_label(parsed, "moescope_expert_tokens_total", "layer", "expert")
    assert by_label(parsed, "moescope_expert_series_per_expert", "model")["test-tiny"] == 0
    assert by_label(parsed, "moescope_expert_load_cv_ratio", "layer")  # aggregates still there


def test_exporter_binds_loopback_and_reports_busy_port(tiny_cfg):
    model = MoETransformer(tiny_cfg)
    with moescope.instrument(model, port=0) as inst:
        assert inst.exporter.addr == "127.0.0.1"
        port = inst.exporter.port
        import urllib.request
        assert b"moescope_build_info" in urllib.request.urlopen(inst.exporter.url, timeout=5).read()
        with pytest.raises(BadInput, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            moescope.instrument(MoETransformer(tiny_cfg), port=port)


def test_canary_flips_only_under_router_noise_and_drift_against_a_baseline(tiny_cfg):
    from moescope.runtime import faults
    from moescope.runtime.canary import Canary

    model = MoETransformer(tiny_cfg).eval()
    canary = Canary(model, interval_s=0.0)
    with moescope.instrument(model, port=0) as inst:
        engine = Engine(model, max_batch=4, canary=canary)
        engine.run(traffic.generate(traffic.TrafficConfig(seed=8, output_tokens_median=4), 3), realtime=False)
        assert inst.metrics.flips and all(v == 0.0 for v in inst.metrics.flips.values())  # deterministic router
        faults.apply(model, ["jitter"])
        engine.run(traffic.generate(traffic.TrafficConfig(seed=9, output_tokens_median=4), 3), realtime=False)
        assert all(v > 0.0 for v in inst.metrics.flips.values())
        parsed = parse(inst.exporter.exposition().decode())
        assert by_label(parsed, "moescope_routing_flip_ratio", "layer") == {str(k): v for k, v in
                                                                           inst.metrics.flips.items()}
        # Drift: against the window's own load it is 0; against a one-hot baseline it is large.
        win = inst.metrics.window()
        inst.metrics.baseline = bl.coerce({layer: list(w["slots"]) for layer, w in win.items()})
        g = inst.metrics.window_gauges()["layers"]
        assert all(v["moescope_routing_drift_jsd_bits"] == pytest.approx(0.0, abs=1e-12) for v in g.values())
        one_hot = {layer: [1.0] + [0.0] * (tiny_cfg.n_experts - 1) for layer in win}
        inst.metrics.baseline = bl.coerce(one_hot)
        g = inst.metrics.window_gauges()["layers"]
        want = {layer: naive_jensen_shannon(list(w["slots"]), one_hot[layer]) for layer, w in win.items()}
        assert {k: v["moescope_routing_drift_jsd_bits"] for k, v in g.items()} == pytest.approx(want)
        assert all(v > 0.3 for v in want.values())


def test_a_router_that_changed_once_flips_the_canary_once_and_noise_keeps_flipping(tiny_cfg):
    """Determinism is judged within one model state: a bias added to one layer's router (deterministic) flips
    the canary on the next run (later layers may flip too: their inputs changed), and the run after comes at the
    next step; from that second identical run the new routing is the baseline (0 flips, one change counted).
    Router noise never routes the same twice: its flips stay on every run, at its interval."""
    from moescope.runtime import faults
    from moescope.runtime.canary import Canary

    model = MoETransformer(tiny_cfg).eval()
    canary = Canary(model, interval_s=3600.0)
    assert canary.due() and all(v == 0.0 for v in canary.run().values())
    assert not canary.due() and all(v == 0.0 for v in canary.run().values())  # (an hour's interval)
    layer = model.moe_layers()[0]
    bias = [0.0] * tiny_cfg.n_experts
    bias[3] = 4.0  # a real change of what layer 0 routes (as a bad deploy or an adapter would make)
    layer.router.fault = faults.RouterFault(bias=tuple(bias))
    changed = canary.run()
    assert changed[layer.layer_index] > 0.1, changed  # the first run after the change: flips against the old
    assert canary.due()  # a run that flipped is confirmed at the next step, not an interval later
    after = [canary.run() for _ in range(3)]  # the second identical run: the new baseline
    assert all(v == 0.0 for run in after for v in run.values()), after
    assert canary.changes == 1
    layer.router.fault = faults.RouterFault(noise_std=0.5)  # noise: the same input routes differently each time
    noisy = [canary.run()[layer.layer_index] for _ in range(4)]
    assert all(v > 0.0 for v in noisy) and not canary.due(), noisy  # noise keeps its interval
    assert canary.changes == 1


def test_device_summary_path_equals_the_host_path(tiny_cfg):
    """The CUDA path (batched device ops) computes exactly what the CPU path (numpy views) does, per draw too."""
    import numpy as np

    from moescope.capture.routing_probe import RoutingProbe
    from moescope.runtime.router import route

    gen = torch.Generator().manual_seed(3)
    by_layer = {layer: [route(torch.randn(n, 6, generator=gen), 2, capacity_factor=cf)
                        for n, cf in ((9, None), (17, 0.7), (1, None))] for layer in (1, 2)}
    by_layer[2][0].nonfinite.fill_(2)  # a made-up count, so the non-finite column is not all zeros
    draws = [np.array([0] * 4 + [2] * 5), 1, 2]  # rows of the first forward split over two draws
    items = {layer: list(zip(decs, draws)) for layer, decs in by_layer.items()}
    host, host_draws = RoutingProbe._host(items, 6, 3)[:2]
    dev, dev_draws = RoutingProbe._device(items, 6, 3)[:2]
    np.testing.assert_allclose(dev, host, rtol=1e-12, atol=1e-9)
    np.testing.assert_array_equal(dev_draws, host_draws)
    assert host[:, :6].sum() > 0 and host[:, 10].sum() > 0 and host[1, 9] == 2
    for i, decs in enumerate(by_layer.values()):  # per draw: counted row by row
        want = np.zeros((3, 7))
        for d, dr in zip(decs, draws):
            for row, ids in enumerate(d.active_ids.tolist()):
                for e in ids:
                    want[dr[row] if isinstance(dr, np.ndarray) else dr, e] += 1
        np.testing.assert_array_equal(host_draws[:, i], want[:, :6])  # dropped slots are no draw's load
        np.testing.assert_array_equal(host[i, :7], want.sum(0))
        assert host[i, 7] == pytest.approx(sum(float(v) for d in decs for v in d.entropy.tolist()), rel=1e-6)
        assert host[i, 8] == pytest.approx(sum(float(v) for d in decs for v in d.margin.tolist()), rel=1e-6)
    # Layers need not hold the same decisions (one routed in fewer forwards, one with an empty forward): each
    # layer's row is its own, as summarising it alone gives.
    uneven = {1: items[1][:1], 2: items[2], 3: [(route(torch.randn(0, 6), 2), 0), (by_layer[1][2], 1)]}
    together, together_draws = RoutingProbe._host(uneven, 6, 3)[:2]
    for i, (layer, its) in enumerate(uneven.items()):
        alone, alone_draws = RoutingProbe._host({layer: its}, 6, 3)[:2]
        np.testing.assert_allclose(together[i], alone[0], rtol=1e-12)
        np.testing.assert_array_equal(together_draws[:, i], alone_draws[:, 0])


def per_request(rec: Recording, layers) -> dict:
    """{request id: [L, E] slots} recounted row by row with plain Python from the recorded routing (dropped slots,
    the sentinel id E, excluded), layers in ``layers`` order."""
    import numpy as np

    out = {}
    for segments, decisions in rec.steps:
        for layer, ids, n_exp in decisions:
            ids, row = ids.tolist(), 0
            for rid, _, n in segments:
                acc = out.setdefault(rid, np.zeros((len(layers), n_exp)))
                for r in range(row, row + n):
                    for e in ids[r]:
                        if e < n_exp:
                            acc[layers.index(layer), e] += 1
                row += n
    return out


def test_per_request_counts_and_the_judged_series_equal_a_recomputation_from_recorded_routing(tiny_cfg):
    import numpy as np

    from moescope import sampling, thresholds

    model = MoETransformer(tiny_cfg.replace(capacity_factor=1.0)).eval()
    rec = Recording()
    seen = []
    with moescope.instrument(model, port=0, model_name="t", observers=[rec]) as inst:
        probe_listener = inst.metrics.probe._listener
        inst.metrics.probe._listener = lambda st: (seen.append(st), probe_listener(st))
        inst.metrics.probe.interval_s = 0.0  # a flush per step: many flushes, requests spanning them
        records = Engine(model, max_batch=3).run(
            traffic.generate(traffic.TrafficConfig(seed=11, output_tokens_median=6), 9), realtime=False)
        parsed = parse(inst.exporter.exposition().decode())
        window = inst.metrics.window()
    layers = list(tiny_cfg.moe_layers)
    want = per_request(rec, layers)
    assert set(want) == {r.request_id for r in records} == {r.request_id for r in rec.requests}
    # the probe's per-request counts, summed over its flushes, equal the row-by-row recount
    got: dict = {}
    for st in seen:
        if st.draws is None or not st.layers:
            continue
        assert None not in st.draws.keys  # every row mapped to a request
        idx = [layers.index(ls.layer) for ls in st.layers]
        for key, c in zip(st.draws.keys, st.draws.counts):
            got.setdefault(key, np.zeros((len(layers), tiny_cfg.n_experts)))[idx] += c
    assert set(got) == set(want)
    for rid in want:
        np.testing.assert_array_equal(got[rid], want[rid])
    # the exported judged series equal moescope.sampling over the recorded requests (all finished: the draws)
    d = sampling.Draws.of(np.stack([want[r.request_id] for r in records]))
    t = thresholds.DEFAULT
    slots = np.stack([window[layer]["slots"] for layer in layers]).astype(float)
    np.testing.assert_array_equal(slots, d.counts)  # every slot of the window is in some request
    n = slots.sum(1)
    noise = sampling.noise_cv(tiny_cfg.n_experts, n, d, t.noise_z)
    cv = np.array([naive_load_cv(row.tolist()) for row in slots])
    fair = np.full_like(slots, 1 / tiny_cfg.n_experts)
    hot = sampling.hot_factor(slots, d, fair, t.hot_z(len(layers), tiny_cfg.n_experts))
    dead = sampling.dead_unexpected(slots, d, np.full_like(slots, t.dead_reference(tiny_cfg.n_experts)),
                                    t.dead_min_expected_slots)
    assert by_label(parsed, "moescope_window_draws", "model")["t"] == len(records)
    for i, layer in enumerate(layers):
        lay = str(layer)
        assert by_label(parsed, "moescope_expert_load_cv_noise_ratio", "layer")[lay] == pytest.approx(noise[i])
        assert by_label(parsed, "moescope_expert_load_excess_cv_ratio", "layer")[lay] == \
            pytest.approx(np.sqrt(max(0.0, cv[i] ** 2 - noise[i] ** 2)), abs=1e-12)
        # unexpected dead experts are judged against a reference: NaN (not judged) while the exporter learns it
        # (its first full window; docs/alerts.md), never against 1/E by default
        assert np.isnan(by_label(parsed, "moescope_dead_experts_unexpected", "layer")[lay]), dead[i]
        # against 1/E while the exporter learns the layer's reference (its first full window)
        exported = by_label(parsed, "moescope_expert_hot_factor_ratio", "expert", layer=lay, reference="learning")
        assert exported == pytest.approx({str(e): hot[i, e] for e in np.nonzero(np.isfinite(hot[i]))[0]})
    assert by_label(parsed, "moescope_capture_dropped_total", "queue")["draws"] == 0


def test_in_flight_requests_stay_bounded_for_days_of_requests():
    """Many requests, most never reported finished: the in-flight dict stays at its cap (evictions counted and
    exported), the draw bins at a window's worth."""
    import numpy as np

    from moescope.capture.routing_probe import DrawCounts, LayerStats, StepStats
    from moescope.metrics.exporter import Exporter
    from moescope.metrics.state import MetricsObserver, ModelInfo
    from moescope.metrics.window import DRAW_BINS

    E, layers = 16, (1, 2)
    clock = [0.0]
    st = MetricsObserver(ModelInfo("m", E, 2, layers, 100, 10), window_s=60, max_inflight=50,
                         clock=lambda: clock[0])
    rng = np.random.default_rng(0)
    finished = 0
    for i in range(3000):  # 3000 flushes, 4 new requests each: 12,000 requests over 3 hours
        clock[0] = i * 3.6
        keys = tuple(f"r{i}-{j}" for j in range(4))
        counts = rng.poisson(3, (4, 2, E)).astype(np.int64)
        done = (f"r{i}-0",) if i % 2 else ()
        finished += len(done)
        stats_ = tuple(LayerStats(layer, 10, counts[:, j].sum(0), 0, 0, 1.0, 1.0) for j, layer in enumerate(layers))
        st.on_stats(StepStats(1, stats_, E, 2, DrawCounts(keys, counts, done)))
        st.flush()
        assert len(st.counts.inflight) <= 50
        assert len(st.routing_window._draw_bins) <= DRAW_BINS + 1
    assert st.counts.draws_dropped == 4 * 3000 - finished - len(st.counts.inflight)
    parsed = parse(Exporter(st, port=0).exposition().decode())
    assert by_label(parsed, "moescope_capture_dropped_total", "queue")["draws"] == st.counts.draws_dropped
    win = st.routing_window
    assert win.n_draws == sum(b.n for b in win._draw_bins) > 0


def test_forwards_that_cannot_be_mapped_to_requests_are_one_draw_each():
    """No segments (an instrumented HF model) or rows that do not match them: each forward is a draw of its
    own, complete at once; a model driven without steps is split into forwards where a layer repeats."""
    import numpy as np

    from moescope.capture.records import StepRecord
    from moescope.capture.routing_probe import RoutingProbe
    from moescope.runtime.router import route

    gen = torch.Generator().manual_seed(1)
    seen = []
    probe = RoutingProbe(seen.append, interval_s=1e9)
    decs = [route(torch.randn(5, 6, generator=gen), 2) for _ in range(6)]
    for i in range(3):  # three forwards of two layers each
        probe.on_routing(1, decs[2 * i])
        probe.on_routing(2, decs[2 * i + 1])
        segments = () if i == 0 else ((f"a{i}", 0, 2), (f"b{i}", 0, 3)) if i == 1 else (("c", 0, 4),)
        probe.on_step(StepRecord(i, "prefill", 0.0, 0.0, 5, segments))
    probe.flush()
    d = seen[-1].draws
    assert d.keys == (None, "a1", "b1", None)  # the third forward has 5 rows, its segment 4: unmapped
    for j, i in ((0, 0), (3, 2)):
        for lay in range(2):
            np.testing.assert_array_equal(d.counts[j, lay], np.bincount(decs[2 * i + lay].active_ids.ravel(),
                                                                        minlength=7)[:6])
    free = RoutingProbe(seen.append, interval_s=1e9)
    for dec, layer in zip(decs, (1, 2, 1, 2, 1, 2)):
        free.on_routing(layer, dec)
    free.flush()
    assert seen[-1].draws.keys == (None, None, None)


class _Placed:
    """A source reporting an expert-parallel placement (``capture.sources``), as the runtime's engine adapter reports
    the one its layers dispatch by."""

    def __init__(self, placement) -> None:
        self.placement = placement

    def read(self) -> Reading:
        return Reading(placement=self.placement)


def test_rank_load_and_cache_capacity_series_from_the_live_placement_and_cache(tiny_cfg):
    import numpy as np

    from moescope import thresholds
    from moescope.parallel.placement import build
    from moescope.runtime.expert_cache import attach_cache

    model = MoETransformer(tiny_cfg).eval()
    cache = attach_cache(model, size=2)
    placement = build("contiguous", n_experts=tiny_cfg.n_experts, world_size=2, moe_layers=tiny_cfg.moe_layers)
    with moescope.instrument(model, port=0, model_name="t") as inst:
        Engine(model, max_batch=4).run(traffic.generate(traffic.TrafficConfig(seed=12), 6), realtime=False)
        no_placement = parse(inst.exporter.exposition().decode())
        placed = _Placed(placement)  # what ExpertParallel on the layers would give
        inst.metrics.sources.register(placed)
        inst.metrics.flush()  # (read once per evaluation, as every source is)
        parsed = parse(inst.exporter.exposition().decode())
        window = inst.metrics.window()
    cache.close()
    assert not by_label(no_placement, "moescope_rank_load_max_over_mean_ratio", "layer")
    per_rank = [0.0, 0.0]
    for layer, w in window.items():
        loads = [sum(int(w["slots"][e]) for e in placement.layers[layer][r]) for r in range(2)]
        per_rank = [a + b for a, b in zip(per_rank, loads)]
        assert by_label(parsed, "moescope_rank_load_max_over_mean_ratio", "layer")[str(layer)] == \
            pytest.approx(max(loads) / (sum(loads) / 2))
    assert by_label(parsed, "moescope_rank_window_slots", "peer") == {"0": per_rank[0], "1": per_rank[1]}
    assert by_label(parsed, "moescope_expert_cache_capacity_ratio", "layer") == \
        {str(layer): 2 / tiny_cfg.n_experts for layer in tiny_cfg.moe_layers}
    assert thresholds.DEFAULT.cache_floor(2 / tiny_cfg.n_experts) == pytest.approx(1 / tiny_cfg.n_experts)
    # a replicated expert's slots dealt evenly over its replicas, as the dispatch deals them
    from moescope.parallel.placement import validate

    rep = validate({layer: ((0, 1, 2), (2, 3, 4, 5)) for layer in tiny_cfg.moe_layers}, tiny_cfg.n_experts, 2,
                   True, tiny_cfg.moe_layers)
    placed.placement = rep
    inst.metrics.flush()
    g = inst.metrics.layer_gauges()
    per_layer, _ = inst.metrics.rank_loads(g)
    for j, layer in enumerate(g.layers):
        s = g.slots[j]
        loads = np.array([s[0] + s[1] + s[2] / 2, s[2] / 2 + s[3:].sum()])
        assert per_layer[layer] == pytest.approx(loads.max() / loads.mean())


def test_baseline_series_and_the_hot_reference_come_from_the_loaded_profile(tiny_cfg):
    model = MoETransformer(tiny_cfg).eval()
    with moescope.instrument(model, port=0, model_name="t") as inst:
        Engine(model, max_batch=4).run(traffic.generate(traffic.TrafficConfig(seed=13), 6), realtime=False)
        win = inst.metrics.window()
        load = {layer: [float(x) for x in w["slots"]] for layer, w in win.items()}
        inst.metrics.baseline = bl.coerce(load)
        parsed = parse(inst.exporter.exposition().decode())
    profile = bl.coerce(load)
    for layer, lp in profile.layers.items():
        assert by_label(parsed, "moescope_baseline_load_cv_ratio", "layer")[str(layer)] == \
            pytest.approx(lp.structural_cv)
        shares = by_label(parsed, "moescope_baseline_expert_share_ratio", "expert", layer=str(layer))
        assert shares == pytest.approx({str(e): v for e, v in enumerate(lp.share.tolist())})
        assert by_label(parsed, "moescope_routing_drift_jsd_bits", "layer")[str(layer)] == pytest.approx(0.0, abs=1e-12)
    assert not by_label(parsed, "moescope_expert_hot_factor_ratio", "layer", "expert")  # the window is the baseline


def test_a_scrape_reads_the_evaluators_last_snapshot_and_never_summarises_routing_itself(tiny_cfg):
    """Scrapes read, never write: the routing summary (device work on CUDA) runs on the evaluator's thread alone
    (never the engine's, never the HTTP thread), once per interval and when the engine goes idle; a scrape serves
    the last snapshot. Reference: the exported counters against the slots the engine's steps routed, counted from
    the decisions themselves."""
    import threading
    import urllib.request

    from moescope.capture.routing_probe import RoutingProbe

    model = MoETransformer(tiny_cfg).eval()
    threads, summarise = set(), RoutingProbe.summarise

    def spy(self, *a, **k):
        threads.add(threading.get_ident())
        return summarise(self, *a, **k)

    routed = {}

    class Count(Observer):
        def on_routing(self, layer, decision):
            ids = decision.ids[decision.ids >= 0]
            routed[layer] = routed.get(layer, 0) + int(ids.numel())

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RoutingProbe, "summarise", spy)
        # a 60 s interval: no periodic evaluation within the test, only the one the engine's idleness asks for
        with moescope.instrument(model, moescope.Config(metrics=moescope.config.Metrics(port=0, interval_s=60),
                                                        observers=(Count(),))) as inst:
            engine = Engine(model, max_batch=4)
            for r in traffic.generate(traffic.TrafficConfig(seed=5, output_tokens_median=4), 3):
                engine.submit(r.prompt, max_new_tokens=r.max_new_tokens)
            while engine.has_work:
                engine.step()

            def scraped():
                with urllib.request.urlopen(inst.exporter.url, timeout=30) as resp:
                    parsed = parse(resp.read().decode())
                got = by_label(parsed, "moescope_expert_tokens_total", "layer", "expert")
                return {int(layer): sum(v for (la, _), v in got.items() if la == layer) for layer, _ in got}

            before = scraped()
            assert sum(before.values()) == 0 < sum(routed.values())  # a scrape summarised nothing
            evaluator = inst.metrics.evaluator._thread.ident
            engine.idle()  # the engine goes idle: the evaluator summarises, and the next read waits for it
            after = scraped()
    assert after == routed
    assert threads == {evaluator}  # the evaluator's thread only: never this (the engine's) nor the HTTP thread


def test_closing_ends_the_evaluator_and_keeps_every_count(tiny_cfg):
    """The evaluator's thread ends with the instrumentation (a process that instruments and closes many times keeps
    no thread behind), and what was pending is summarised at close. Reference: the slots the engine's forwards
    routed, counted from the decisions themselves."""
    import threading

    model = MoETransformer(tiny_cfg).eval()
    routed = {}

    class Count(Observer):
        def on_routing(self, layer, decision):
            routed[layer] = routed.get(layer, 0) + int((decision.ids >= 0).sum())

    before = {t for t in threading.enumerate() if t.name == "moescope-evaluator"}
    inst = moescope.instrument(model, moescope.Config(metrics=moescope.config.Metrics(interval_s=60),
                                                      observers=(Count(),)))
    engine = Engine(model, max_batch=4)
    for r in traffic.generate(traffic.TrafficConfig(seed=3, output_tokens_median=4), 3):
        engine.submit(r.prompt, max_new_tokens=r.max_new_tokens)
    while engine.has_work:  # never idle: nothing asks for an evaluation before close
        engine.step()
    worker = inst.metrics.evaluator._thread
    assert worker is not None and worker.is_alive()
    inst.close()
    assert not worker.is_alive()
    assert {t for t in threading.enumerate() if t.name == "moescope-evaluator"} == before
    got = {layer: int(c.sum()) for layer, c in inst.metrics.expert_tokens.items()}
    assert got == routed


def test_every_bucket_reached_carries_an_exemplar_of_a_request_that_reached_it(tiny_cfg):
    """Histograms are counted per evaluation from the records the engine handed over (metrics.histograms), each
    bucket keeping the latest observation's request id: every bucket an observation reached shows one, naming a
    request whose value fell in that bucket. Reference: the buckets and ids recomputed from the values given
    (``bisect``), against the OpenMetrics exposition."""
    import bisect

    from moescope.capture.records import RequestRecord
    from moescope.metrics.catalogue import BY_NAME

    model = MoETransformer(tiny_cfg).eval()
    bounds = list(BY_NAME["moescope_token_latency_seconds"].buckets)
    values = [0.0007, 0.0008, 0.003, 0.02, 0.021, 0.3, 7.0] * 20
    want: dict[str, set[str]] = {}
    with moescope.instrument(model, port=0) as inst:
        for i, v in enumerate(values):
            rid = f"r{i}"
            inst.metrics.on_request(RequestRecord(rid, "", "", (1,), (2,), 0.0, 0.0, 0.0, v, (v,), v, "length"))
            b = bisect.bisect_left(bounds, v)
            want.setdefault(str(bounds[b]) if b < len(bounds) else "+Inf", set()).add(rid)
        inst.metrics.flush()
        text = inst.exporter.exposition(openmetrics=True).decode()
    got = {}
    for ln in text.splitlines():
        if ln.startswith("moescope_token_latency_seconds_bucket") and " # {" in ln:
            le = ln.split('le="')[1].split('"')[0]
            got[le] = ln.split('request_id="')[1].split('"')[0]
    assert {float(le) for le in got} == {float(le) for le in want}  # one exemplar in every bucket reached
    assert all(got[le] in next(ids for w, ids in want.items() if float(w) == float(le)) for le in got)
    counts = [float(ln.split()[-1]) for ln in text.splitlines()
              if ln.startswith("moescope_token_latency_seconds_count")]
    assert counts == [len(values)]  # every observation counted, exemplar or not
    cum = {float(ln.split('le="')[1].split('"')[0]): float(ln.split()[1]) for ln in text.splitlines()
           if ln.startswith("moescope_token_latency_seconds_bucket")}
    assert all(cum[le] == sum(v <= le for v in values) for le in cum)  # prometheus_client's le: inclusive
