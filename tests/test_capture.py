"""Capture + exporter on the reference runtime: exported numbers against independent recomputation."""

import shutil
import subprocess
import time

import pytest
import torch

import moescope
from conftest import in_ci
from metrics_util import by_label, parse
from moescope import stats
from moescope.capture.observer import Observer
from moescope.capture.queued import QueuedObserver
from moescope.errors import BadInput
from moescope.metrics import catalogue
from moescope.runtime import traffic
from moescope.runtime.engine import Engine
from moescope.runtime.model import MoETransformer


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
        Engine(model, max_batch=4).run(traffic.generate(traffic.TrafficConfig(seed=1, output_tokens_median=6), 7),
                                       realtime=False)
        parsed = parse(inst.exporter.exposition().decode())
    want = spy.expected(tiny_cfg.top_k, tiny_cfg.n_experts, capacity_factor)
    got = by_label(parsed, "moescope_expert_tokens_total", "layer", "expert", model="t", rank="0")
    for layer, w in want.items():
        assert [got[(str(layer), str(e))] for e in range(tiny_cfg.n_experts)] == w["slots"]
        assert by_label(parsed, "moescope_router_tokens_total", "layer")[str(layer)] == w["tokens"]
        assert by_label(parsed, "moescope_tokens_dropped_total", "layer")[str(layer)] == w["dropped"]
        assert by_label(parsed, "moescope_router_nonfinite_logits_total", "layer")[str(layer)] == w["nonfinite"]
        # The window gauges are the documented formulas over the same load.
        assert by_label(parsed, "moescope_expert_load_cv_ratio", "layer")[str(layer)] == \
            pytest.approx(stats.load_cv(w["slots"]))
        assert by_label(parsed, "moescope_dead_experts", "layer")[str(layer)] == stats.dead_experts(w["slots"])
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
    from moescope.runtime.cache import attach_cache
    cache = attach_cache(model, size=2)
    with moescope.instrument(model, port=0) as inst:
        Engine(model, max_batch=4).run(traffic.generate(traffic.TrafficConfig(seed=4), 4), realtime=False)
        text = inst.exporter.exposition()
    cache.close()
    assert b"moescope_expert_cache_hits_total" in text and b"moescope_expert_fetch_seconds_bucket" in text
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cache_metrics_equal_cache_counters(tiny_cfg):
    from moescope.runtime.cache import attach_cache

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
        self.release.wait(30)
        self.seen += 1


def test_a_sink_that_raises_or_blocks_never_stops_the_engine(tiny_cfg):
    model = MoETransformer(tiny_cfg).eval()
    reference = [r.output_tokens for r in Engine(MoETransformer(tiny_cfg), max_batch=4).run(
        traffic.generate(traffic.TrafficConfig(seed=6), 4), realtime=False)]
    blocking = Blocking()
    queued = QueuedObserver(blocking, maxsize=3, name="blocking")
    with moescope.instrument(model, port=0, observers=[Raising(), queued]) as inst:
        t0 = time.perf_counter()
        records = Engine(model, max_batch=4).run(traffic.generate(traffic.TrafficConfig(seed=6), 4), realtime=False)
        elapsed = time.perf_counter() - t0
        parsed = parse(inst.exporter.exposition().decode())
        blocking.release.set()
    assert [r.output_tokens for r in records] == reference  # results unaffected
    assert elapsed < 20  # the blocking sink (30 s wait) did not hold the engine
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
        inst.metrics.baseline = {layer: list(w["slots"]) for layer, w in win.items()}
        g = inst.metrics.window_gauges()["layers"]
        assert all(v["moescope_routing_drift_jsd_bits"] == pytest.approx(0.0, abs=1e-12) for v in g.values())
        inst.metrics.baseline = {layer: [1.0] + [0.0] * (tiny_cfg.n_experts - 1) for layer in win}
        g = inst.metrics.window_gauges()["layers"]
        want = {layer: stats.jensen_shannon(list(w["slots"]), inst.metrics.baseline[layer]) for layer, w in win.items()}
        assert {k: v["moescope_routing_drift_jsd_bits"] for k, v in g.items()} == pytest.approx(want)
        assert all(v > 0.3 for v in want.values())


def test_device_summary_path_equals_the_host_path(tiny_cfg):
    """The CUDA path (batched device ops) computes exactly what the CPU path (numpy views) does."""
    from moescope.capture.routing_probe import RoutingProbe
    from moescope.runtime.router import route

    gen = torch.Generator().manual_seed(3)
    by_layer = {layer: [route(torch.randn(n, 6, generator=gen), 2, capacity_factor=cf)
                        for n, cf in ((9, None), (17, 0.7), (1, None))] for layer in (1, 2)}
    by_layer[2][0].nonfinite.fill_(2)  # a made-up count, so the non-finite column is not all zeros
    host = RoutingProbe._host(by_layer, 6)
    dev = RoutingProbe._device(by_layer, 6)
    import numpy as np

    np.testing.assert_allclose(dev, host, rtol=1e-12, atol=1e-9)
    assert host[:, :6].sum() > 0 and host[:, 10].sum() > 0 and host[1, 9] == 2
