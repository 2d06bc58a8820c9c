"""The fixed-shape decode step (the one a CUDA graph captures) against the eager model, and its in-step
counters against a recomputation from the eager model's own routing decisions. CPU runs the step eagerly:
the same ops a graph records; tests/test_gpu.py replays it as a real CUDA graph."""

import numpy as np
import pytest
import torch

from moescope.errors import BadInput
from moescope.metrics.state import MetricsObserver
from moescope.runtime.engine_adapter import RuntimeEngine
from moescope.runtime.graph_decode import GraphCollector, StaticDecoder
from moescope.runtime.model import MoETransformer, Segment
from moescope.runtime.router import Mitigation

PROMPTS = ([5, 9, 77, 3, 120, 44, 8], [200, 1, 13], [60, 61, 62, 63, 64])


def _model(cfg):
    torch.manual_seed(0)
    model = MoETransformer(cfg).eval()
    with torch.no_grad():  # sharper routers than the init's near-uniform ones, so top-k has clear winners
        for m in model.moe_layers():
            m.router.weight.mul_(40)
    return model


def _prefill(model):
    caches = [model.new_cache() for _ in PROMPTS]
    with torch.no_grad():
        out = model(torch.tensor([t for p in PROMPTS for t in p]),
                    [Segment(len(p), c) for p, c in zip(PROMPTS, caches)], last_only=True)
    return caches, out.logits.argmax(-1)


@pytest.mark.parametrize("kind", ["tiny_cfg", "deepseek_cfg"])
@pytest.mark.parametrize("mode", ["grouped", "dense"])
def test_static_decode_equals_the_eager_model_and_counts_exactly(request, kind, mode):
    """deepseek_cfg: sigmoid group-limited routing with a correction bias and a shared expert."""
    tiny_cfg = request.getfixturevalue(kind)
    model = _model(tiny_cfg)
    caches, nxt = _prefill(model)
    batch = len(PROMPTS) + 1  # one free slot: it computes but must not be counted
    dec = StaticDecoder(model, batch, experts=mode)
    for slot, c in enumerate(caches):
        dec.load(slot, c)
    live = torch.tensor([True] * len(PROMPTS) + [False])
    tokens_e, tokens_s = nxt.clone(), torch.cat([nxt, torch.zeros(1, dtype=torch.int64)])
    want_slots = {layer: np.zeros(tiny_cfg.n_experts + 1, dtype=np.int64) for layer in dec.counters.layers}
    want_entropy = dict.fromkeys(dec.counters.layers, 0.0)
    steps = 6
    for _ in range(steps):
        positions = torch.tensor([c.length for c in caches] + [0])
        with torch.no_grad():
            ref = model(tokens_e, [Segment(1, c) for c in caches])
        got = dec.step(tokens_s, positions, live)
        torch.testing.assert_close(got[: len(PROMPTS)], ref.logits, atol=2e-5, rtol=1e-4)
        for layer, d in ref.decisions.items():
            want_slots[layer] += np.bincount(d.active_ids.reshape(-1).numpy(), minlength=tiny_cfg.n_experts + 1)
            want_entropy[layer] += float(d.entropy.double().sum())
        tokens_e = ref.logits.argmax(-1)  # greedy: both continue with the eager model's tokens
        tokens_s = torch.cat([tokens_e, torch.zeros(1, dtype=torch.int64)])
    c = dec.counters
    for layer in c.layers:
        row = c.row[layer]
        assert c.slots[row, : tiny_cfg.n_experts + 1].tolist() == want_slots[layer].tolist()
        assert c.slots[row, -1] == steps * tiny_cfg.top_k  # the free slot's, kept apart
        assert c.sums[row, 0] == steps and c.sums[row, 1] == steps * len(PROMPTS)
        assert c.sums[row, 2].item() == pytest.approx(want_entropy[layer], rel=1e-6)


def test_collector_feeds_the_metrics_the_difference_since_its_last_read(tiny_cfg):
    model = _model(tiny_cfg)
    caches, nxt = _prefill(model)
    dec = StaticDecoder(model, len(PROMPTS))
    for slot, c in enumerate(caches):
        dec.load(slot, c)
    metrics = MetricsObserver(RuntimeEngine(model).model_info("t"))
    col = GraphCollector(dec.counters, metrics.on_stats)
    assert col.collect() is None  # nothing ran yet
    positions = torch.tensor([c.length for c in caches])
    seen = []
    for i in range(5):
        dec.step(nxt, positions + i)
        if i in (1, 4):
            seen.append(col.collect())
    assert col.collect() is None  # no step since the last read
    assert [s.steps for s in seen] == [2, 3]
    metrics.flush()  # (the evaluator folds what on_stats handed over)
    total = dec.counters.slots[:, : tiny_cfg.n_experts].numpy()
    for row, layer in enumerate(dec.counters.layers):
        assert metrics.expert_tokens[layer].tolist() == total[row].tolist()
        assert sum(s.layers[row].tokens for s in seen) == 5 * len(PROMPTS)
    assert metrics.layer_counters["moescope_router_tokens_total"][dec.counters.layers[0]] == 5 * len(PROMPTS)


def test_what_a_graph_cannot_hold_is_refused_in_one_line(tiny_cfg):
    model = _model(tiny_cfg)
    with pytest.raises(BadInput, match="CUDA graphs need a CUDA device"):
        StaticDecoder(model, 2).capture()
    with pytest.raises(BadInput, match="experts mode"):
        StaticDecoder(model, 2, experts="fast")
    model.moe_layers()[0].router.mitigation = Mitigation(load_bound=0.85)
    with pytest.raises(BadInput, match="needs every expert resident"):
        StaticDecoder(model, 2)


def test_layer_times_reach_observers_once_per_moe_layer_and_forward(tiny_cfg):
    from moescope.capture.observer import Observer

    class Times(Observer):
        def __init__(self):
            self.seen = []

        def on_layer_time(self, layer, router_s, experts_s):
            self.seen.append((layer, router_s, experts_s))

    model = _model(tiny_cfg)
    model.observer = obs = Times()
    with torch.no_grad():
        for _ in range(3):
            model(torch.arange(20), [Segment(20)])
    layers = [b.index for b in model.blocks if b.is_moe]
    assert [layer for layer, _, _ in obs.seen] == layers * 3
    assert all(r > 0 and e > 0 for _, r, e in obs.seen)
    from moescope.capture.observer import NOOP

    model.observer = NOOP  # nobody watching: no clock readings at all
    with torch.no_grad():
        model(torch.arange(20), [Segment(20)])
    assert all(m.timer is None for m in model.moe_layers())


@pytest.mark.parametrize("max_batch", [3, 8])
def test_engine_with_the_static_decode_step_serves_and_counts_like_the_eager_one(max_batch):
    from moescope.runtime import loader
    from moescope.runtime.engine import Engine
    from moescope.runtime.traffic import TrafficRequest

    prompts = ["def add(a, b):", "The capital of France is", "12 + 30 =", "Once upon a time", "import numpy",
               "SELECT * FROM", "x" * 40]
    requests = [TrafficRequest(i, 0.0, p, 12, "code", "t") for i, p in enumerate(prompts)]
    seen = {}
    for mode in ("eager", "static"):
        model = loader.build_model("tiny-demo")
        metrics = MetricsObserver(RuntimeEngine(model).model_info("tiny-demo"))
        engine = Engine(model, max_batch=max_batch, observer=[metrics], decode=mode)
        records = engine.run(requests, realtime=False)
        engine.close()
        if mode == "static":  # the decode steps really ran in the fixed-shape step
            assert engine._decoder.counters.sums[0, 1] == sum(len(r.output_tokens) - 1 for r in records)
        seen[mode] = ({r.prompt: r.output_tokens for r in records}, metrics)
    (eager_out, eager_m), (static_out, static_m) = seen["eager"], seen["static"]
    assert static_out == eager_out
    for layer, want in eager_m.expert_tokens.items():  # prefill (probe) + decode (in-step counters)
        assert static_m.expert_tokens[layer].tolist() == want.tolist()
        for name in ("moescope_router_tokens_total", "moescope_tokens_dropped_total"):
            assert static_m.layer_counters[name][layer] == eager_m.layer_counters[name][layer]


def test_graph_decode_without_cuda_is_a_clear_error():
    from moescope.runtime import loader
    from moescope.runtime.engine import Engine

    with pytest.raises(BadInput, match="needs the model on a CUDA device"):
        Engine(loader.build_model("tiny-demo"), decode="graph")


def test_demo_decode_flag(tmp_path, capsys):
    import json

    from moescope.cli import main

    runs = {}
    for mode in ("eager", "static"):
        assert main(["demo", "--no-tui", "--requests", "6", "--rate", "0", "--metrics-port", "-1",
                     "--traces", "none", "--decode", mode, "--json"]) == 0
        runs[mode] = json.loads(capsys.readouterr().out)
    assert runs["static"]["completed"] == 6
    # the metrics' expert load: decode steps counted inside the fixed-shape step == the eager hooks' counts
    assert runs["static"]["expert_load"] == runs["eager"]["expert_load"]
    assert runs["static"]["tokens"] == runs["eager"]["tokens"]
    for args, msg in ((["--decode", "graph"], "needs the model on a CUDA device"),
                      (["--decode", "static", "--cache-size", "3"], "needs every expert resident"),
                      (["--decode", "static", "--world-size", "2"], "serves on one process"),
                      (["--decode", "static", "--record-routing", str(tmp_path / "r.json")], "use --decode eager")):
        assert main(["demo", "--no-tui", "--requests", "2", "--rate", "0", "--metrics-port", "-1",
                     "--traces", "none", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err


def test_the_decode_step_benchmark_runs_end_to_end_on_cpu(tmp_path):
    """The GPU figures come from benchmarks/decode_step.py on a lent device, in one short call: the script
    itself must not be what fails there. A CPU run with scaled-down shapes exercises every variant."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    out = tmp_path / "d.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_step.py"), "--quick", "--device", "cpu",
                    "--batch", "2", "--rounds", "1", "--steps", "1", "--out", str(out)], check=True, timeout=300,
                   capture_output=True)
    report = json.loads(out.read_text())
    assert [(r["shape"], r["batch"]) for r in report["rows"]] == [("mixtral-layer", 2), ("deepseek-v3-layer", 2)]
    for r in report["rows"]:
        for key in ("eager_bare_s", "eager_instrumented_s", "graph_bare_s", "graph_instrumented_s"):
            assert 0 < r[key] < 60
        assert r["eager_ratio"] == pytest.approx(r["eager_instrumented_s"] / r["eager_bare_s"])
