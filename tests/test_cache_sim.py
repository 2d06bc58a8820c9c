"""cache-sim on a routing log recorded by a real demo run reproduces the runtime cache's counts."""

import json

import pytest

from moescope.analysis import cache_sim
from moescope.cli import main


def test_demo_cache_counts_equal_cache_sim_replay(tmp_path, capsys):
    log = tmp_path / "routing.json"
    assert main(["demo", "--requests", "8", "--rate", "0", "--metrics-port", "-1", "--cache-size", "3",
                 "--cache-policy", "lfu", "--record-routing", str(log), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert main(["cache-sim", str(log), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    row = next(r for r in report["results"] if r["policy"] == "lfu" and r["size"] == 3)
    layers = summary["expert_cache"]["layers"].values()
    assert row["lookups"] == sum(s["lookups"] for s in layers)
    assert row["hits"] == sum(s["hits"] for s in layers)
    assert row["evictions"] == sum(s["evictions"] for s in layers)
    # Belady bounds every policy at every size; a full-size cache misses only cold starts.
    by = {(r["policy"], r["size"]): r for r in report["results"]}
    for (_, size), r in by.items():
        assert r["hit_rate"] <= by[("belady", size)]["hit_rate"] + 1e-12
        assert r["gap_to_optimal"] == pytest.approx(by[("belady", size)]["hit_rate"] - r["hit_rate"])
    n_experts = report["n_experts"]
    full = by[("lru", n_experts)]
    n_layers = len(report["layers"])
    assert full["lookups"] - full["hits"] <= n_layers * n_experts
    # The recommended size is the first that reaches the target.
    for policy, size in report["min_size_for_target"].items():
        if size is not None:
            assert by[(policy, size)]["hit_rate"] >= 0.9
            assert size == 1 or by[(policy, size - 1)]["hit_rate"] < 0.9


def test_cache_sim_table_and_bad_input(tmp_path, capsys):
    log = tmp_path / "r.json"
    log.write_text(json.dumps({"format": "moescope-routing-v1", "n_experts": 4,
                               "layers": {"1": [[0, 1], [0, 1], [2], [0, 1], [3]]}}))
    assert main(["cache-sim", str(log)]) == 0
    out = capsys.readouterr().out
    assert "belady" in out and "smallest cache size" in out
    n, seqs = cache_sim.load_lookups(log)
    assert n == 4 and seqs == {1: [0, 1, 0, 1, 2, 0, 1, 3]}
    for bad in ['{"format": "other"}', "not json", json.dumps({"format": "moescope-routing-v1", "n_experts": 2,
                                                                 "layers": {"1": [[5]]}})]:
        log.write_text(bad)
        assert main(["cache-sim", str(log)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("moescope: error: routing log") and err.count("\n") == 1
    assert main(["cache-sim", str(tmp_path / "missing.json")]) == 2


def test_cache_sim_from_the_trace_store_equals_the_routing_log(tmp_path, capsys):
    log, traces = tmp_path / "routing.json", tmp_path / "t.sqlite"
    assert main(["demo", "--requests", "6", "--rate", "0", "--metrics-port", "-1", "--record-routing", str(log),
                 "--traces", str(traces), "--canary-interval", "0"]) == 0
    capsys.readouterr()
    from moescope.traces import store

    assert cache_sim.load_lookups_from_store(store.open_store(traces)) == cache_sim.load_lookups(log)
    assert main(["cache-sim", "--traces", str(traces), "--json"]) == 0
    from_store = json.loads(capsys.readouterr().out)
    assert from_store.pop("corrupt_rows") == 0
    assert main(["cache-sim", str(log), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == from_store
    assert main(["cache-sim", "--traces", str(tmp_path / "missing.sqlite")]) == 2  # the store is the default source
    assert main(["cache-sim", str(log), "--import", str(log)]) == 2
