"""Fault scenarios change what the engine does (never a metric); each shows up where it should."""

import json

import pytest
import torch

import moescope
from metrics_util import by_label, parse
from moescope.cli import main
from moescope.runtime import faults, loader
from moescope.runtime.engine import Engine


def _demo(capsys, *args):
    assert main(["demo", "--rate", "0", "--metrics-port", "-1", "--traces", "none", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_nan_scenario_makes_emoji_tokens_non_finite_only():
    model = loader.build_model("tiny-demo")
    faults.apply(model, ["nan"])
    with moescope.instrument(model, port=0) as inst:
        engine = Engine(model, max_batch=2)
        engine.submit("plain ascii text only", max_new_tokens=2)
        engine.run([], realtime=False)
        clean = sum(by_label(parse(inst.exporter.exposition().decode()),
                             "moescope_router_nonfinite_logits_total", "layer").values())
        engine.submit("rocket \U0001F680 and party \U0001F389", max_new_tokens=2)
        engine.run([], realtime=False)
        dirty = sum(by_label(parse(inst.exporter.exposition().decode()),
                             "moescope_router_nonfinite_logits_total", "layer").values())
    assert clean == 0 and dirty > 0


def test_cache_drop_drift_and_leak_scenarios(capsys):
    thrash = _demo(capsys, "--requests", "6", "--scenario", "thrash")
    assert all(v["hit_rate"] < 0.1 for v in thrash["expert_cache"]["layers"].values())
    healthy = _demo(capsys, "--requests", "6", "--cache-size", "8")
    assert all(v["hit_rate"] > 0.9 for v in healthy["expert_cache"]["layers"].values())
    slow = _demo(capsys, "--requests", "4", "--scenario", "switch-jitter")
    assert all(v["load_p50_s"] >= 0.02 for v in slow["expert_cache"]["layers"].values())
    drop = _demo(capsys, "--requests", "6", "--scenario", "drop")
    assert all(n > 0 for n in drop["tokens_dropped"].values())
    drift = _demo(capsys, "--requests", "12", "--scenario", "drift")
    domains = [r["domain"] for r in sorted(drift["requests_detail"], key=lambda r: r["request_id"])]
    assert {r["domain"] for r in drift["requests_detail"]} >= {"numbers"}
    assert sum(d == "numbers" for d in domains) >= 6  # the second half is numbers only


def test_leak_retains_memory_per_step():
    model = loader.build_model("tiny-demo")
    engine = Engine(model, max_batch=2)
    engine.leak, engine.leak_bytes = [], faults.DEMO_SETTINGS["leak"]["leak_bytes"]
    engine.submit("hello", max_new_tokens=5)
    engine.run([], realtime=False)
    assert len(engine.leak) == 5 and sum(t.numel() * 4 for t in engine.leak) == 5 * 256 * 1024


def test_unknown_scenario_is_bad_input(capsys):
    assert main(["demo", "--scenario", "collapse,nope"]) == 2
    assert "unknown scenario(s) nope" in capsys.readouterr().err


def _routers(model):
    return {m.layer_index: m.router for m in model.moe_layers()}


def test_hot_fault_changes_only_its_layers_routing():
    from moescope.runtime import balance

    model = loader.build_model("tiny-demo")
    layers = sorted(_routers(model))
    hot, expert = layers[1], 3
    tokens, segments = balance.calibration_batch(1, 8)
    x = balance.router_inputs(model, tokens, segments)  # each layer's router input, healthy model
    before = {L: r(x[L])[0].ids for L, r in _routers(model).items()}
    full_before = model(tokens, segments).decisions
    items = faults.apply(model, [f"hot={hot}:{expert}:1.5"])
    assert items[0].layer == hot and items[0].expert == expert and items[0].value == 1.5
    assert [L for L, r in _routers(model).items() if r.fault is not None] == [hot]
    after = {L: r(x[L])[0].ids for L, r in _routers(model).items()}
    for L in layers:  # the same inputs: only the hot layer's router decides differently
        assert torch.equal(before[L], after[L]) == (L != hot), L
    assert (after[hot] == expert).sum() > (before[hot] == expert).sum()
    full_after = model(tokens, segments).decisions  # end to end: the layers before it route as before
    assert all(torch.equal(full_before[L].ids, full_after[L].ids) for L in layers if L < hot)


def test_hot_share_rises_with_the_bias_and_a_factor_is_calibrated(capsys):
    model = loader.build_model("tiny-demo")
    layers = sorted(_routers(model))
    hot, expert = layers[-1], 5

    def share(load):  # the served run's own count of the expert's slots at the hot layer
        counts = load[str(hot)]
        return counts[expert] / sum(counts)

    shares = [share(_demo(capsys, "--requests", "6", "--scenario", s)["expert_load"])
              for s in ("healthy", f"hot={hot}:{expert}:0.5", f"hot={hot}:{expert}:1.5", f"hot={hot}:{expert}:3")]
    assert shares == sorted(shares) and shares[-1] > shares[0] + 0.2, shares
    # A factor: the bias hot_bias finds gives the expert that share of the calibration slots, counted here by a
    # naive softmax top-k over the router's own logits (tiny-demo routes plain softmax top-k).
    bias = faults.hot_bias(model, hot, expert, 2.5)
    router = _routers(model)[hot]
    xs = faults.router_input(model, hot)
    logits = xs @ router.weight.detach().float().t()
    logits[:, expert] += bias
    ids = torch.topk(logits, model.cfg.top_k, dim=-1).indices
    factor = float((ids == expert).sum()) / ids.numel() * model.cfg.n_experts
    assert abs(factor - 2.5) <= 0.05 * 2.5, factor


def test_fault_magnitudes_reach_the_engine(capsys):
    assert moescope.Config(scenarios=("drop=0.8",)).model_overrides() == {"capacity_factor": 0.8}
    assert moescope.Config(scenarios=("leak=512",)).engine_settings() == {"leak_bytes": 512 * 1024}
    assert moescope.Config(scenarios=("leak",)).engine_settings() == {"leak_bytes": 256 * 1024}
    mild = sum(_demo(capsys, "--requests", "6", "--scenario", "drop=2")["tokens_dropped"].values())
    harsh = sum(_demo(capsys, "--requests", "6", "--scenario", "drop=0.5")["tokens_dropped"].values())
    assert harsh > mild
    model = loader.build_model("tiny-demo")
    faults.apply(model, ["imbalance=2.5", "collapse=3"])
    bias = model.moe_layers()[0].router.fault.bias
    n = model.cfg.n_experts
    assert bias == pytest.approx([3 * (e == 0) + 2.5 * 0.8 * (n - 1 - e) / (n - 1) for e in range(n)])


@pytest.mark.parametrize("spec, says", [
    ("hot=0:1:2x", "layer 0 is not a MoE layer"),
    ("hot=1:8:2x", "expert 8 does not exist"),
    ("hot=1:0:9x", "out of reach"),
    ("hot=1:0", None),
    ("hot=a:0:2", "integers"),
    ("drop=abc", "not a number"),
    ("drop=0", "must be > 0"),
    ("leak=-1", "must be > 0"),
    ("nan=3", "takes no magnitude"),
])
def test_bad_fault_sizes_are_bad_input(capsys, spec, says):
    if says is None:  # a valid item: the default factor
        assert faults.spec(spec) == faults.Fault("hot", layer=1, expert=0)
        return
    assert main(["demo", "--requests", "1", "--rate", "0", "--metrics-port", "-1", "--traces", "none",
                 "--scenario", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
