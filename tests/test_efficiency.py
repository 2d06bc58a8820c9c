"""What routing costs the hardware (issue 44): distinct experts per step against a recomputation from the trace
store, and S-MBU / S-MFU against a hand computation from the model's config and the recorded steps."""

import collections

import numpy as np
import pytest

import moescope
from moescope import efficiency
from moescope.capture.routing_probe import RoutingProbe
from moescope.errors import BadInput
from moescope.runtime import traffic
from moescope.runtime.model_config import MoEConfig
from moescope.runtime.engine import Engine
from moescope.runtime.model import MoETransformer
from moescope.traces import store
from moescope.traces.recorder import TraceRecorder

# A shape no preset names: 5 blocks, the first dense, 10 experts top-3, one shared expert, capacity-limited (so
# dropped slots, which no expert computes, must stay out of the count).
SHAPE = MoEConfig(name="eff-odd", hidden_size=24, n_layers=5, n_heads=3, n_experts=10, top_k=3, ffn_size=20,
                  dense_layers=(0,), n_shared_experts=1, capacity_factor=0.8, max_seq_len=96, seed=11)


def _run(path, peak_env=None, n=7):
    model = MoETransformer(SHAPE).eval()
    seen = []
    probe = RoutingProbe(seen.append, interval_s=0.0)
    with moescope.instrument(model, observers=[TraceRecorder(path), probe]) as handle:
        engine = Engine(model, max_batch=4)
        for r in traffic.generate(traffic.TrafficConfig(seed=5, output_tokens_median=5), n):
            engine.submit(r.prompt, max_new_tokens=r.max_new_tokens)
        while engine.has_work:
            engine.step()
        handle.metrics.flush()
    probe.flush(final=True)
    return model, handle.metrics, seen


def _recomputed(path):
    """{(step index, layer): distinct experts} from every stored token's experts, and {step index: (phase,
    seconds, {request: its positions after the step})}: grouped by the engine step that routed each row."""
    conn = store.open_store(path)
    touched: dict[tuple[int, int], set] = collections.defaultdict(set)
    steps: dict[int, dict] = {}
    for r in store.iter_routed(conn):
        for row in range(r.n_routed):
            st = r.steps[r.step_of[row]]
            steps.setdefault(st["index"], {"phase": st["phase"], "seconds": st["seconds"], "rows": 0})
            steps[st["index"]]["rows"] += 1
            for j, layer in enumerate(r.layers):
                touched[(st["index"], layer)] |= {int(e) for e in r.ids[row, j] if e != r.n_experts}
    return {key: len(v) for key, v in touched.items()}, steps


def test_distinct_experts_per_step_equal_a_recomputation_from_the_trace_store(tmp_path):
    path = tmp_path / "t.sqlite"
    _, metrics, seen = _run(path)
    want, steps = _recomputed(path)
    got = {}
    for st in seen:
        x = st.experts
        if x is None:  # a flush that only reported finished requests
            assert not st.layers
            continue
        for s, idx in enumerate(x.index):
            assert idx >= 0  # every forward came from an engine step
            for j, ls in enumerate(st.layers):
                if x.distinct[s, j] >= 0:
                    got[(idx, ls.layer)] = int(x.distinct[s, j])
    assert got == want  # step by step, layer by layer
    assert len({i for i, _ in want}) == len(steps) >= 5
    assert any(steps[i]["rows"] > 1 and steps[i]["phase"] == "decode" for i in steps)  # batched decodes
    # the exported per-layer summary: distinct experts summed over steps, and the steps counted
    lc = metrics.layer_counters
    for layer in SHAPE.moe_layers:
        assert lc["moescope_expert_distinct_total"][layer] == sum(v for (_, lay), v in want.items() if lay == layer)
        assert lc["moescope_expert_distinct_steps_total"][layer] == len(steps)


def _params_by_hand(model):
    """(dense params, one routed expert's params, total) read off the module tree, not from ModelInfo: a
    routed expert's weights are every tensor of the MoE layers' routed-expert stacks divided by E."""
    total = sum(p.numel() for p in model.parameters())
    # the routed experts are stacked [E, ...] tensors; every other weight is 1-D or 2-D
    routed = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 3 and "shared" not in name)
    per_expert = routed // (len(SHAPE.moe_layers) * SHAPE.n_experts)
    assert per_expert * len(SHAPE.moe_layers) * SHAPE.n_experts == routed
    return total - routed, per_expert, total


def _by_hand(path, model) -> dict:
    """Per phase, from the trace store and the config alone: [weight bytes, KV bytes, FLOPs, step seconds] of
    every recorded step (fp32 weights; K and V of hidden_size per block and position; causal attention)."""
    want, steps = _recomputed(path)
    dense, expert, _ = _params_by_hand(model)
    # fp32 weights: 4 bytes; K and V: hidden_size each per block per position
    b, kv_per_pos = 4, 2 * SHAPE.n_layers * SHAPE.hidden_size * 4
    conn = store.open_store(path)
    positions = collections.Counter()  # step index -> the positions its requests hold after it
    attended = collections.Counter()  # step index -> positions its rows attend to (causal)
    for r in store.iter_routed(conn):
        for row in range(r.n_routed):
            idx = r.steps[r.step_of[row]]["index"]
            attended[idx] += row + 1  # row i of the request attends to positions 0..i
            last_of_step = row + 1 == r.n_routed or r.steps[r.step_of[row + 1]]["index"] != idx
            if last_of_step:
                positions[idx] += row + 1
    by_phase = collections.defaultdict(lambda: np.zeros(4))  # bytes weights, bytes kv, flops, seconds
    for idx, st in steps.items():
        d = sum(v for (i, _), v in want.items() if i == idx)
        acc = by_phase[st["phase"]]
        acc[0] += b * (dense + d * expert)
        acc[1] += kv_per_pos * positions[idx]
        acc[2] += 2 * st["rows"] * (dense + len(SHAPE.moe_layers) * SHAPE.top_k * expert) \
            + 4 * SHAPE.n_layers * SHAPE.hidden_size * attended[idx]
        acc[3] += st["seconds"]
    return dict(by_phase)


def test_smbu_and_smfu_equal_a_hand_computation_from_the_config_and_the_recorded_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESCOPE_PEAK_BANDWIDTH", "2e9")
    monkeypatch.setenv("MOESCOPE_PEAK_FLOPS", "5e10")
    path = tmp_path / "t.sqlite"
    model, metrics, _ = _run(path)
    for phase, (w_bytes, kv_bytes, flops, seconds) in _by_hand(path, model).items():
        c = metrics.counters
        assert c[("moescope_step_read_bytes_total", (phase, "weights"))] == pytest.approx(w_bytes, rel=1e-12)
        assert c[("moescope_step_read_bytes_total", (phase, "kv"))] == pytest.approx(kv_bytes, rel=1e-12)
        assert c[("moescope_step_flops_total", (phase,))] == pytest.approx(flops, rel=1e-12)
        smbu, smfu = metrics.utilisation(phase)
        assert smbu == pytest.approx((w_bytes + kv_bytes) / (seconds * 2e9), rel=1e-6)
        assert smfu == pytest.approx(flops / (seconds * 5e10), rel=1e-6)


def test_the_peak_comes_from_settings_or_the_device_table_and_never_guessed_on_cpu():
    assert efficiency.resolve_peak("cpu", env={}) is None
    assert efficiency.resolve_peak("cpu", bandwidth=1e9, env={}).bandwidth == 1e9
    h100 = efficiency.resolve_peak("cuda:0", device_name="NVIDIA H100 80GB HBM3", env={})
    assert (h100.bandwidth, h100.flops) == (3.35e12, 989e12)
    assert efficiency.resolve_peak("cuda:0", device_name="NVIDIA H100 PCIe", env={}).bandwidth == 2.0e12
    assert efficiency.resolve_peak("cuda:0", device_name="NVIDIA A100-SXM4-80GB", env={}).bandwidth == 2.039e12
    assert efficiency.resolve_peak("cuda:0", device_name="Some Future GPU", env={}) is None
    with pytest.raises(BadInput, match="MOESCOPE_PEAK_BANDWIDTH"):
        efficiency.resolve_peak("cpu", env={"MOESCOPE_PEAK_BANDWIDTH": "fast"})


def test_device_distinct_path_equals_a_naive_count_and_the_host_path():
    """The CUDA path's distinct-expert table (one indexed write, summed on the device) equals the numpy path and
    a naive set count, dropped slots excluded (run here on CPU tensors: the same torch ops)."""
    import torch

    from moescope.runtime.router import route

    gen = torch.Generator().manual_seed(7)
    decs = {layer: [route(torch.randn(n, 9, generator=gen), 3, capacity_factor=cf)
                    for n, cf in ((5, None), (11, 0.6), (2, None))] for layer in (1, 3)}
    items = {layer: [(d, 0) for d in ds] for layer, ds in decs.items()}
    steps = {1: [0, 1, 2], 3: [0, 2, 2]}  # layer 3 routed nothing in step 1; two of its forwards in step 2
    host = RoutingProbe._host(items, 9, 1, steps, 3)[2]
    dev = RoutingProbe._device(items, 9, 1, steps, 3)[2]
    sets: dict = {}
    for i, layer in enumerate(decs):
        for d, s in zip(decs[layer], steps[layer]):
            sets.setdefault((i, s), set()).update(int(e) for e in d.active_ids.reshape(-1) if int(e) != 9)
    naive = np.full((2, 3), -1)
    for (i, s), v in sets.items():
        naive[i, s] = len(v)
    np.testing.assert_array_equal(host, naive)
    np.testing.assert_array_equal(dev, naive)
    assert naive[1, 1] == -1 and (naive[naive >= 0] > 0).all()


def test_top_once_shows_experts_touched_bytes_per_token_and_smbu(tmp_path, monkeypatch, capsys):
    """`top --once` against a real exporter: the line's experts per step and layer, batch, and S-MBU equal the
    trace store's recomputation and the hand formula."""
    from servers import free_port

    from moescope.cli import main
    from moescope.metrics.exporter import Exporter

    monkeypatch.setenv("MOESCOPE_PEAK_BANDWIDTH", "2e9")
    path = tmp_path / "t.sqlite"
    model, metrics, _ = _run(path)
    want, steps = _recomputed(path)
    n_moe = len(SHAPE.moe_layers)
    touched = sum(want.values()) / (len(steps) * n_moe)
    dense, expert, _ = _params_by_hand(model)
    decode = [i for i, st in steps.items() if st["phase"] == "decode"]
    rows = sum(steps[i]["rows"] for i in decode)
    exp = Exporter(metrics, port=free_port()).start()
    try:
        assert main(["top", exp.url, "--once", "--interval", "0.1"]) == 0
    finally:
        exp.stop()
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("experts/step/layer"))
    assert f"experts/step/layer {touched:.1f}/{SHAPE.n_experts} " in line, line
    assert f"decode batch {rows / len(decode):.1f}" in line, line
    # S-MBU by hand from the store and the config (nothing stepped between top's polls: the whole run's), never
    # from the metrics object under test
    w_bytes, kv_bytes, _, seconds = _by_hand(path, model)["decode"]
    smbu = (w_bytes + kv_bytes) / (seconds * 2e9)
    assert f"S-MBU {smbu:.1%}" in line and "S-MFU -" in line, line  # no FLOPs peak given: not computed


@pytest.mark.integration
def test_the_efficiency_row_returns_data_from_a_real_prometheus(tmp_path, monkeypatch):
    """Every query of the overview's efficiency row, variables filled in, returns finite data from a real
    Prometheus scraping a live run (with a peak set: the S-MBU/S-MFU panel has no series without one)."""
    import math
    import threading

    from helpers import wait_until
    from servers import Prometheus, free_port

    from moescope.dashboards import grafana
    from moescope.metrics.exporter import Exporter

    monkeypatch.setenv("MOESCOPE_PEAK_BANDWIDTH", "2e9")
    monkeypatch.setenv("MOESCOPE_PEAK_FLOPS", "5e10")
    model = MoETransformer(SHAPE).eval()
    stop = threading.Event()
    port = free_port()
    ready = threading.Event()
    box = {}

    def serve():
        with moescope.instrument(model) as handle:
            box["exp"] = Exporter(handle.metrics, port=port).start()
            ready.set()
            engine = Engine(model, max_batch=4)
            reqs = iter(traffic.generate(traffic.TrafficConfig(seed=5, output_tokens_median=8), 10_000))
            while not stop.is_set():
                if not engine.has_work:  # a batch of 6 at a time: decode steps batch up to 4
                    for _ in range(6):
                        r = next(reqs)
                        engine.submit(r.prompt, max_new_tokens=r.max_new_tokens)
                engine.step()
            box["exp"].stop()

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    prom = None
    try:
        assert ready.wait(120)
        prom = Prometheus(tmp_path, [f"127.0.0.1:{port}"])
        doc = grafana.build_all()["moescope-overview"]
        row = [(t, e) for t, e in grafana.queries(doc) if t.startswith(("Experts touched", "Bytes read", "S-MBU"))]
        assert len(row) == 5

        def values():
            out = {}
            for _, expr in row:
                q = (expr.replace("$model", SHAPE.name).replace("$rank", ".*").replace("$layer", "1")
                     .replace("$__rate_interval", "10s"))
                out[expr] = [float(r["value"][1]) for r in prom.query(q)]
            return out

        got = wait_until(values, timeout=180, what="every efficiency panel's series in Prometheus", interval=1,
                         until=lambda v: all(x and all(math.isfinite(y) for y in x) for x in v.values()))
        touched = next(v for e, v in got.items() if "moescope_expert_distinct_total" in e)
        assert all(1 <= x <= SHAPE.n_experts for x in touched)
        util = [v for e, v in got.items() if "moescope_peak_" in e]
        assert all(0 < x for v in util for x in v)
    finally:
        stop.set()
        worker.join(60)
        if prom is not None:
            prom.stop()


def test_the_spread_band_equals_a_simulation_of_independent_uniform_routing():
    """The band's mean and variance (closed form) against a plain simulation of uniform top-k routing."""
    from moescope.analysis import step_experts

    rng = np.random.default_rng(0)
    for e, k, b in ((10, 3, 4), (64, 6, 8), (256, 8, 32)):
        sims = np.array([len({int(x) for _ in range(b) for x in rng.choice(e, k, replace=False)})
                         for _ in range(4000)])
        mean, var = step_experts.uniform_distinct(e, k, [b])
        assert mean[0] == pytest.approx(sims.mean(), abs=4 * sims.std() / np.sqrt(len(sims)))
        assert var[0] == pytest.approx(sims.var(), rel=0.12)


def _window(pick, n_steps=40, batch=6, e=16, k=2, layers=3, seed=1):
    """(routing per request, step keys per request): ``batch`` one-row requests per step, experts from ``pick``."""
    rng = np.random.default_rng(seed)
    routing, step_of = [], []
    for s in range(n_steps):
        rows = pick(rng, batch, e, k, layers)  # [batch, layers, k]
        for r in rows:
            routing.append(r[None].astype(np.int16))
            step_of.append(np.array([s]))
    return routing, step_of


def test_diagnose_names_steps_that_spread_above_the_band_and_only_those():
    from moescope.analysis import step_experts

    def uniform(rng, b, e, k, n_l):
        return np.array([[rng.choice(e, k, replace=False) for _ in range(n_l)] for _ in range(b)])

    def apart(rng, b, e, k, n_l):  # the batch's tokens never share an expert: b x k distinct per layer
        off = rng.integers(e)
        return np.array([[(np.arange(k) + i * k + off) % e for _ in range(n_l)] for i in range(b)])

    def popular(rng, b, e, k, n_l):  # a trained router's favourites: the batch shares its experts
        return np.array([[rng.choice(4, k, replace=False) for _ in range(n_l)] for _ in range(b)])

    for pick in (uniform, popular):
        assert step_experts.finding(*_window(pick), 16, 2) is None, pick.__name__
    f = step_experts.finding(*_window(apart), 16, 2)
    assert f["cause"] == "expert-spread" and f["severity"] == "info"  # no bandwidth evidence: info
    assert f["evidence"]["distinct_per_step_layer"] == 12.0  # 6 tokens x 2 experts, never shared
    assert step_experts.finding(*_window(apart), 16, 2, (0.8, 0.1))["severity"] == "warning"  # memory-bound
    assert step_experts.finding(*_window(apart), 16, 2, (0.1, 0.8))["severity"] == "info"  # compute-bound


def test_peak_settings_reach_the_exporter_through_the_config_and_the_cli(tmp_path, monkeypatch, capsys):
    """Config(metrics=Metrics(peak_bandwidth=...)) over the environment; the exporter shows the peak; the CLI
    flags map to it (`--peak-bandwidth`), a bad value is one line and exit 2."""
    from moescope.cli import main
    from moescope.config import Config, Metrics
    from moescope.metrics.exporter import Exporter

    monkeypatch.setenv("MOESCOPE_PEAK_FLOPS", "3e10")
    model = MoETransformer(SHAPE).eval()
    with moescope.instrument(model, Config(metrics=Metrics(peak_bandwidth=7e9))) as handle:
        text = Exporter(handle.metrics, port=0).exposition().decode()
    assert "moescope_peak_bandwidth_bytes_per_second{" in text and " 7e+09" in text
    assert "moescope_peak_flops_per_second{" in text and " 3e+10" in text  # the environment fills the other
    with pytest.raises(Exception, match="peak bandwidth must be a positive number"):
        Metrics(peak_bandwidth=-1.0)
    assert main(["demo", "--no-tui", "--requests", "1", "--peak-flops", "fast"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_an_instrumented_hf_model_counts_distinct_experts_per_forward():
    """A HF model (each forward a step of its own, as the adapter reports it) exports the distinct experts each forward
    touched per layer, equal to a count from an independent observer's recorded routing, and the weight bytes."""
    import torch
    from helpers import Recording
    from hf_models import build

    model = build("mixtral")
    spy = Recording()
    with moescope.instrument(model, observers=[spy], model_name="mixtral") as handle:
        with torch.no_grad():
            for n in (5, 9):
                model(torch.randint(3, 100, (1, n)))
        handle.metrics.flush()
    lc = handle.metrics.layer_counters
    by_layer = collections.defaultdict(list)
    for layer, ids, n_experts in spy.decisions:
        by_layer[layer].append(len({int(e) for e in ids.reshape(-1)} - {n_experts}))
    assert set(by_layer) == set(lc["moescope_expert_distinct_total"])
    for layer, per_forward in by_layer.items():
        assert len(per_forward) == 2
        assert lc["moescope_expert_distinct_total"][layer] == sum(per_forward)
        assert lc["moescope_expert_distinct_steps_total"][layer] == 2
    info = handle.metrics.info
    want = sum(4 * (info.dense_params + sum(v[i] for v in by_layer.values()) * info.expert_params) for i in (0, 1))
    got = {k: v for k, v in handle.metrics.counters.items() if k[0] == "moescope_step_read_bytes_total"}
    # (the adapter reports each forward as a prefill step; no KV or attention figures without an engine)
    assert got == {("moescope_step_read_bytes_total", ("prefill", "weights")): want}, got


def _spread_store(path, pick, n_req=6, n_out=30, e=16, k=2, layers=(1, 2, 3), seed=3):
    """A trace store written through the real TraceRecorder as an engine would report: ``n_req`` requests of a
    one-token prompt decoding together (every step one row per request), experts from ``pick``."""
    import time as _time

    import torch

    from moescope.capture.decision import RoutingDecision
    from moescope.capture.records import RequestRecord, StepRecord

    rng = np.random.default_rng(seed)
    zero = torch.zeros((), dtype=torch.int64)
    rec = TraceRecorder(str(path), model="spread-odd")
    t0 = _time.perf_counter()
    for s in range(n_out):
        rows = pick(rng, n_req, e, k, len(layers))  # [n_req, L, k]
        for j, layer in enumerate(layers):
            ids = torch.as_tensor(rows[:, j], dtype=torch.int64)
            n = ids.shape[0]
            rec.on_routing(layer, RoutingDecision(
                ids=ids, weights=torch.full(ids.shape, 1.0 / k), kept=torch.ones(ids.shape, dtype=torch.bool),
                entropy=torch.full((n,), 0.5), margin=torch.full((n,), 0.1), nonfinite=zero, dropped=zero,
                n_experts=e, active_ids=ids))
        rec.on_step(StepRecord(index=s, phase="prefill" if s == 0 else "decode", started=t0 + s * 0.01, seconds=0.01,
                               n_tokens=n_req, segments=tuple((f"r{i}", s, 1) for i in range(n_req))))
    for i in range(n_req):
        rec.on_request(RequestRecord(request_id=f"r{i}", prompt="x", output="y" * n_out, prompt_tokens=(5,),
                                     output_tokens=tuple(range(7, 7 + n_out)), arrival=t0, queue_s=0.0, prefill_s=0.01,
                                     ttft_s=0.01, token_latencies_s=(0.01,) * n_out, total_s=0.01 * n_out,
                                     finish_reason="length"))
    rec.shutdown()


def test_report_names_the_spread_diagnose_names_and_only_where_steps_spread(tmp_path, capsys):
    """`moescope report`'s expert-spread finding is diagnose's (the one judgement, step_experts.finding) on the
    same store: named where every step's 6 tokens x 2 experts never share an expert (12 distinct per step and
    layer, counted here by hand), not where the batch shares its router's favourites."""
    import json

    from moescope.analysis.diagnose import diagnose
    from moescope.cli import main

    def apart(rng, b, e, k, n_l):
        off = rng.integers(e)
        return np.array([[(np.arange(k) + i * k + off) % e for _ in range(n_l)] for i in range(b)])

    def popular(rng, b, e, k, n_l):
        return np.array([[rng.choice(4, k, replace=False) for _ in range(n_l)] for _ in range(b)])

    for pick, named in ((apart, True), (popular, False)):
        path = tmp_path / f"{pick.__name__}.sqlite"
        _spread_store(path, pick)
        out = tmp_path / pick.__name__
        assert main(["report", "--traces", str(path), "--out", str(out), "--json"]) == 0
        got = json.loads(capsys.readouterr().out)["expert_spread"]
        conn = store.open_store(path)
        theirs = [f for f in diagnose(conn)["findings"] if f["cause"] == "expert-spread"]
        conn.close()
        summary = (out / "summary.md").read_text()
        if not named:
            assert got is None and theirs == [] and "experts than independent routing" not in summary
            continue
        assert len(theirs) == 1 and got["severity"] == theirs[0]["severity"] == "info"  # no Prometheus: no bandwidth
        assert got["evidence"] == theirs[0]["evidence"] and got["title"] == theirs[0]["title"]
        # by hand: 6 one-row requests per step, 2 experts each, never shared -> 12 per step and layer, 30 steps
        want, _ = _recomputed(path)
        assert set(want.values()) == {12} and len({i for i, _ in want}) == 30
        assert got["evidence"]["distinct_per_step_layer"] == 12.0 and got["evidence"]["steps"] == 30
        assert f"## Info: {got['title']}" in summary and "touched 12 experts per step and layer" in summary
