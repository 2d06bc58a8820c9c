"""Fault scenarios change what the engine does (never a metric); each shows up where it should."""

import json


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
