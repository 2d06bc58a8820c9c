"""A fleet of expert-parallel ranks in one real Prometheus: each rank exports the routing of its own tokens
(data-parallel attention), by logical expert, and the physical load of the experts it holds; summed over the
ranks, every routed slot is counted exactly once."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from helpers import popen_cli, run_cli, wait_until
import moescope
from metrics_util import by_label, parse
from moescope.alerts import rules
from moescope.parallel.eplb import Rebalance
from moescope.parallel.expert_parallel import AllToAllRecord
from moescope.runtime.model import MoETransformer
from moescope.tui.top_data import frame, parse_exposition
from servers import Prometheus, free_port, wait_http
from reference import naive_load_cv

TOP_K = 2  # tiny-demo's


def _final(prom: Prometheus, metric: str, by: str) -> dict[str, float]:
    """Each series' last value (counters only grow: the max over the run), summed by ``by``."""
    return {r["metric"].get(by, ""): float(r["value"][1])
            for r in prom.query(f"sum by ({by}) (max_over_time({metric}[5m]))")}


@pytest.mark.integration
def test_the_fleet_sum_in_prometheus_counts_every_token_once(tmp_path):
    port = free_port(2)  # rank r serves metrics on port + r
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(rules.rules_document(), sort_keys=False))
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"], rule_files=[str(rules_file)])
    try:
        demo = run_cli("demo", "--no-tui", "--world-size", "2", "--requests", "9", "--rate", "0", "--metrics-port",
                       str(port), "--traces", "none", "--linger", "4", "--json", "--metrics-window", "3600",
                       "--placement", str(_replicated(tmp_path)), timeout=300)
        assert demo.returncode == 0, demo.stderr[-2000:]
        s = json.loads(demo.stdout)
        wait_http(prom.url + "/-/ready")
        # the forwards' tokens: every prompt token and every output token but each request's last (never fed back)
        fed = [r["tokens"]["prompt"] + r["tokens"]["output"] - r["completed"] for r in s["ranks"]]
        assert fed[0] != fed[1] and [r["completed"] for r in s["ranks"]] == [5, 4]
        by_rank = _final(prom, 'moescope_router_tokens_total{layer="1"}', "rank")
        assert by_rank == {"0": fed[0], "1": fed[1]}  # each rank its own tokens: different counts
        routed = _final(prom, "moescope_router_tokens_total", "layer")
        logical = _final(prom, "moescope_expert_tokens_total", "layer")
        physical = _final(prom, "moescope_expert_physical_slots_total", "layer")
        layers = {str(x) for x in (1, 2, 3)}
        assert set(routed) == set(logical) == set(physical) == layers
        for layer in layers:  # the fleet's sum: tokens served x k, exactly, logical and physical alike
            assert routed[layer] == sum(fed)
            assert logical[layer] == physical[layer] == sum(fed) * TOP_K, layer
        # by forward_mode: prefill routed the prompts, decode the output tokens fed back; summed over the modes
        # (above) the old per-layer total, exactly
        modes = _final(prom, 'moescope_router_tokens_total{layer="2"}', "forward_mode")
        assert modes == {"prefill": sum(r["tokens"]["prompt"] for r in s["ranks"]),
                         "decode": sum(r["tokens"]["output"] - r["completed"] for r in s["ranks"])}
        # the recording rule sums over forward_mode too: one series per layer, the modes' rates added
        recorded = wait_until(lambda: prom.query("model_layer:moescope_router_tokens:rate1m"),
                              until=lambda r: {x["metric"]["layer"] for x in r} == layers, timeout=30,
                              what="the routed-token recording rule", interval=0.5)
        assert all("forward_mode" not in r["metric"] for r in recorded) and len(recorded) == len(layers)
        time.sleep(3)  # every scrape stamped before `at` is in (the rule, evaluated at `at`, may have missed one)
        at = float(recorded[0]["value"][0])
        direct = {r["metric"]["layer"]: float(r["value"][1]) for r in prom.query(
            "sum by (layer) (rate(moescope_router_tokens_total[1m]))", at=at)}
        rule = dict(rules.RECORDING)["model_layer:moescope_router_tokens:rate1m"]
        for r in prom.query(rule, at=at):
            assert set(r["metric"]) == {"job", "model", "layer"}
            assert float(r["value"][1]) == pytest.approx(direct[r["metric"]["layer"]], rel=1e-9)
        # a replicated expert's slots split over its replicas; its logical label counts them once
        rows = {(r["metric"]["rank"], r["metric"]["expert"]): float(r["value"][1]) for r in prom.query(
            'max_over_time(moescope_expert_physical_slots_total{layer="1",expert=~"0|1"}[5m])')}
        per_rank = {e: {rk: v for (rk, x), v in rows.items() if x == e} for e in ("0", "1")}
        assert per_rank["1"].keys() == {"1"}  # expert 1 lives on rank 1 only
        assert per_rank["0"].keys() == {"0", "1"} and min(per_rank["0"].values()) > 0
        # dealt in turn across forwards (a decode step routes one slot per expert per rank): each routing rank's
        # slots of the expert split over the two replicas to within one, so the replicas' totals within two
        assert abs(per_rank["0"]["0"] - per_rank["0"]["1"]) <= 2, per_rank["0"]
        expert0 = _final(prom, 'moescope_expert_tokens_total{layer="1",expert="0"}', "layer")["1"]
        assert sum(per_rank["0"].values()) == expert0
        # per-rank load max/mean, measured from the exchanges' split sizes: every rank exports the same value,
        # the busiest rank's physical rows over the mean rank's (the run fits the window)
        rows = {(r["metric"]["layer"], r["metric"]["rank"]): float(r["value"][1]) for r in prom.query(
            "sum by (layer, rank) (max_over_time(moescope_expert_physical_slots_total[5m]))")}
        gauge = {(r["metric"]["layer"], r["metric"]["rank"]): float(r["value"][1]) for r in prom.query(
            "last_over_time(moescope_rank_load_max_over_mean_ratio[5m])")}
        for layer in layers:
            loads = [rows[(layer, "0")], rows[(layer, "1")]]
            want = max(loads) / (sum(loads) / 2)
            assert gauge[(layer, "0")] == pytest.approx(want, rel=1e-9) == gauge[(layer, "1")], layer
        recorded = prom.query("last_over_time(model_layer:moescope_rank_load_max_over_mean:ratio1m[5m])")
        assert {r["metric"]["layer"] for r in recorded} == layers  # the recording rule's fleet view evaluates
    finally:
        prom.stop()


def _replicated(tmp_path):
    path = tmp_path / "placement.yaml"
    path.write_text("replicated: true\nrank_to_experts: {0: [0, 2, 4, 6], 1: [0, 1, 3, 5, 7]}\n")
    return path


def test_rank_load_and_eplb_gauges_are_the_exchanges_rows(tiny_cfg):
    """The per-rank load a rank exports is what the dispatch exchanges measured (rows per rank, the same numbers on
    every rank), over the window; after a rearrangement, the EPLB gauges hold its before and predicted figures and
    the max/mean measured since it."""
    model = MoETransformer(tiny_cfg).eval()
    with moescope.instrument(model, port=0, model_name="t") as inst:
        def exchange(layer, rows):
            inst.metrics.on_all_to_all(AllToAllRecord(layer, "dispatch", 0.001, (0, 0), (0, 0), (0.0, 0.0),
                                                      (5, -1, 0, -1, 0, -1, 0, -1), rows))

        before = [[30, 10], [20, 20]]
        after = [[11, 9], [10, 10]]
        for rows in before:
            exchange(1, rows)
        exchange(2, [0, 4])
        inst.metrics.flush()  # (records handed over are folded by the next evaluation)
        assert not by_label(parse(inst.exporter.exposition().decode()), "moescope_eplb_predicted_max_over_mean_ratio",
                            "layer")  # no rearrangement yet: no EPLB series
        inst.metrics.on_rebalance(Rebalance(step=5, seconds=0.02, moved=3, moved_bytes=100, before={1: 1.25},
                                            predicted={1: 1.01}, layers={}))
        for rows in after:
            exchange(1, rows)
        inst.metrics.flush()
        text = inst.exporter.exposition().decode()
        parsed = parse(text)

    def ratio(rows):
        total = [sum(col) for col in zip(*rows)]
        return max(total) / (sum(total) / len(total))

    assert by_label(parsed, "moescope_rank_load_max_over_mean_ratio", "layer") == \
        pytest.approx({"1": ratio(before + after), "2": ratio([[0, 4]])})
    assert by_label(parsed, "moescope_rank_window_slots", "peer") == {"0": 71 + 0, "1": 49 + 4}
    assert by_label(parsed, "moescope_eplb_measured_max_over_mean_ratio", "layer") == pytest.approx(
        {"1": ratio(after)})
    assert by_label(parsed, "moescope_eplb_predicted_max_over_mean_ratio", "layer") == {"1": 1.01}
    assert by_label(parsed, "moescope_eplb_before_max_over_mean_ratio", "layer") == {"1": 1.25}
    assert parsed[("moescope_eplb_rebalances_total", frozenset({("model", "t"), ("rank", "0")}))] == 1
    assert parsed[("moescope_eplb_moved_experts_total", frozenset({("model", "t"), ("rank", "0")}))] == 3
    # physical load: the experts held here (-1: not held), zeros included
    assert by_label(parsed, "moescope_expert_physical_slots_total", "expert", layer="1") == \
        {"0": 5 * 4, "2": 0, "4": 0, "6": 0}
    # `top` says it in its routing line, from the same series (the worst layer; L2's ranks: 0 and 4 rows)
    note = frame(parse_exposition(text), None, 1.0, {}).judged
    assert f"rank max/mean {ratio([[0, 4]]):.2f} (L2>" in note, note
    assert f"EPLB L1: measured {ratio(after):.2f} vs predicted 1.01" in note, note


def test_the_reduced_tier_exports_a_ranks_held_experts_as_one_series_per_layer(tiny_cfg):
    """Beyond the per-expert budget the physical load is the rank's held experts together (expert="held"): L series
    per rank, not L x E / W (which would cost L x E per replica, the full tier's price); the sum is the same."""
    model = MoETransformer(tiny_cfg).eval()
    with moescope.instrument(model, port=0, model_name="t", expert_series_budget=0) as inst:
        for layer, rows in ((1, (5, -1, 3, -1, 0, -1, 7, -1)), (1, (2, -1, 0, -1, 1, -1, 0, -1)),
                            (2, (0, -1, 4, -1, 0, -1, 0, -1))):
            inst.metrics.on_all_to_all(AllToAllRecord(layer, "dispatch", 0.001, (0, 0), (0, 0), (0.0, 0.0), rows,
                                                      (1, 1)))
        inst.metrics.flush()
        parsed = parse(inst.exporter.exposition().decode())
    assert by_label(parsed, "moescope_expert_physical_slots_total", "layer", "expert") == \
        {("1", "held"): 5 + 3 + 7 + 2 + 1, ("2", "held"): 4}


@pytest.mark.integration
def test_the_merged_summary_has_every_ranks_latency_and_the_final_placement(tmp_path):
    """`demo --world-size 2` with EPLB: the summary's latency percentiles are over both ranks' requests (not rank
    0's), and its placement is the one serving at the end (the rearranged one), the starting one beside it;
    `--save-baseline` writes every rank's counts (not rank 0's share)."""
    from moescope import stats
    from moescope.analysis import baseline
    from moescope.parallel import placement

    demo = run_cli("demo", "--no-tui", "--world-size", "2", "--requests", "12", "--rate", "0", "--scenario",
                   "imbalance", "--rebalance-steps", "6", "--rebalance-slots", "5", "--traces", "none",
                   "--metrics-port", "-1", "--save-baseline", str(tmp_path / "b.json"), "--json", timeout=300)
    assert demo.returncode == 0, demo.stderr[-2000:]
    s = json.loads(demo.stdout)
    saved = baseline.load(tmp_path / "b.json")
    for layer, counts in s["expert_load"].items():  # both ranks' slots: the fleet's tokens x k
        assert saved.layers[int(layer)].load.tolist() == counts
        assert sum(counts) == sum(r["tokens"]["prompt"] + r["tokens"]["output"] - r["completed"]
                                  for r in s["ranks"]) * TOP_K
        # the --json holds the judgement the human summary prints, of the fleet's sums (it held none before)
        per = s["expert_load_summary"][layer]
        assert per["slots"] == sum(counts) and per["cv"] == pytest.approx(naive_load_cv(counts), abs=1e-4)
        assert per["hottest"][0]["expert"] == max(range(len(counts)), key=lambda e: (counts[e], -e))
        assert s["judged"]["layers"][layer]["bar"] > 0 and s["judged"]["requests"] == 12
    ttft = [d["ttft_s"] for d in s["requests_detail"]]  # both ranks' requests (rounded to 10 us)
    assert len(ttft) == 12 and {d["request_id"] for d in s["requests_detail"]} == set(s["request_ids"])
    for q in (50, 99):
        assert s["latency_s"][f"ttft_p{q}"] == pytest.approx(stats.percentile(ttft, q), abs=2e-5)
    assert all("raw_latency_s" not in r for r in s["ranks"])
    moved = sum(ev["moved_experts"] for r in s["ranks"][:1] for ev in r["rebalances"])
    assert moved > 0  # the skewed load made EPLB move experts: the final placement differs from the start
    assert s["placement"] == s["ranks"][0]["placement"] == s["ranks"][1]["placement"] != s["placement_start"]
    start = placement.build("round-robin", n_experts=8, world_size=2, moe_layers=(1, 2, 3))
    assert s["placement_start"] == {str(layer): [list(x) for x in v] for layer, v in start.layers.items()}


def test_the_fleet_series_formula_recomputes_the_measured_count():
    """docs/metrics.md's fleet rows: the formula (benchmarks/fleet_series.py), with the coefficients measured at 2
    replicas x 2 ranks, gives the measured count back, class by class, and the larger fleets' rows."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from fleet_series import CLASSES, coefficients, predict
    from moescope.metrics.state import EXPERT_SERIES_BUDGET

    d = json.loads((ROOT / "benchmarks" / "results" / "fleet_series.json").read_text())
    m = d["measured"]
    assert sum(m["by_class"].values()) == m["total"] == sum(m["per_rank"].values()) == sum(
        f["series"] for f in m["families"].values())
    assert m["ranks"] == d["replicas"] * d["world_size"] == len(m["per_rank"])
    for f in m["families"].values():  # every family's series split by class, whole
        assert sum(f["by_class"].values()) == f["series"] and set(f["by_class"]) <= set(CLASSES)
    for c in CLASSES:  # and the classes' totals are the families' series of that class
        assert sum(f["by_class"].get(c, 0) for f in m["families"].values()) == m["by_class"][c]
    L, E, W = d["moe_layers"], d["experts"], d["world_size"]
    coef = coefficients(m, W, L, E)
    assert coef == pytest.approx(d["coefficients"])
    # the held experts' counters: per rank, one per layer beyond the budget (58 x 256 over 2 ranks), else a rank's
    # share of the layer's experts (round-robin: E / W each)
    held = L if L * E > EXPERT_SERIES_BUDGET // W else L * E // W
    assert m["families"]["moescope_expert_physical_slots_total"]["series"] == m["ranks"] * held
    at = predict(coef, d["replicas"], W, L, E)
    assert at["total"] == m["total"] and at["by_class"] == m["by_class"]
    for label, p in d["deployments"].items():
        again = predict(coef, p["replicas"], p["world_size"], p["moe_layers"], p["experts"])
        assert {k: p[k] for k in again} == again, label


def test_the_fleet_series_formula_predicts_a_fleet_it_was_not_fitted_on():
    """The coefficients fitted on 2 replicas x 2 ranks predict what a real Prometheus counted on one replica of 4
    ranks (benchmarks/fleet_series.py's ``held_out`` run), class by class; the per-layer class within the range
    the hot factors span (0-8 per layer and rank: they depend on the traffic)."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from fleet_series import CLASSES, predict

    from moescope.metrics.state import EXTREMES_K

    d = json.loads((ROOT / "benchmarks" / "results" / "fleet_series.json").read_text())
    h = d["held_out"]
    assert (h["replicas"], h["world_size"]) != (d["replicas"], d["world_size"])
    formula = predict(d["coefficients"], h["replicas"], h["world_size"], d["moe_layers"], d["experts"])
    assert formula == h["formula"]
    m = h["measured"]
    assert m["ranks"] == h["replicas"] * h["world_size"] == len(m["per_rank"])
    for c in CLASSES:
        slack = m["ranks"] * d["moe_layers"] * EXTREMES_K if c == "layer" else 0
        assert abs(formula["by_class"][c] - m["by_class"][c]) <= slack, (c, formula["by_class"][c], m["by_class"][c])


@pytest.mark.integration
def test_demo_world_size_honours_the_arrival_rate_and_rests_between_arrivals():
    """`demo --world-size 2 --rate 1`: the fleet's arrivals are the single-process demo's (rank r serves every
    2nd one); the run lasts until the last arrival at least, and the ranks rest together while no rank has work
    (one small all-reduce per poll) instead of stepping idle forwards: every fleet step runs some rank's tokens,
    so the steps are at most the tokens the fleet forwarded."""
    from moescope.runtime import traffic

    n, rate, seed = 4, 1.0, 3
    demo = run_cli("demo", "--no-tui", "--world-size", "2", "--requests", str(n), "--rate", str(rate), "--seed",
                   str(seed), "--traces", "none", "--metrics-port", "-1", "--json", timeout=300)
    assert demo.returncode == 0, demo.stderr[-2000:]
    s = json.loads(demo.stdout)
    arrivals = traffic.generate(traffic.TrafficConfig(rate=rate, seed=seed), n)
    assert s["completed"] == n and [r["completed"] for r in s["ranks"]] == [n // 2, n // 2]
    assert s["wall_s"] >= arrivals[-1].arrival_s - 0.05 > 1.0  # served by the clock, not all at once
    fed = sum(r["tokens"]["prompt"] + r["tokens"]["output"] - r["completed"] for r in s["ranks"])
    steps = s["ranks"][0]["steps"]
    assert steps == s["ranks"][1]["steps"] and 0 < steps <= fed


@pytest.mark.integration
def test_two_replicas_of_one_model_keep_their_own_rank_load_in_the_recording_rule(tmp_path):
    """Two `demo --world-size 2` launches of tiny-demo (one named by MOESCOPE_REPLICA, one by its launch id) in one
    Prometheus: the fleet's max/mean recording rule has one series per replica and layer, each equal to the
    same formula over that replica's two instances alone."""
    import os
    import subprocess

    ports = [free_port(2), free_port(2)]
    targets = [[f"127.0.0.1:{p}", f"127.0.0.1:{p + 1}"] for p in ports]
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(rules.rules_document(), sort_keys=False))
    prom = Prometheus(tmp_path, targets[0] + targets[1], rule_files=[str(rules_file)])
    env = {k: v for k, v in os.environ.items() if k != "MOESCOPE_REPLICA"}
    layers = {"1", "2", "3"}
    procs = []
    try:
        for i, p in enumerate(ports):  # replica 1 skewed: the two replicas' max/mean differ
            procs.append(popen_cli("demo", "--no-tui", "--world-size", "2", "--requests", "8", "--rate", "0",
                                   "--seed", str(i), "--metrics-port", str(p), "--traces", "none", "--linger", "8",
                                   *(("--scenario", "imbalance") if i else ()), stderr=subprocess.PIPE, text=True,
                                   env={**env, "MOESCOPE_REPLICA": "blue"} if i == 0 else env))
        recorded = wait_until(
            lambda: prom.query("model_layer:moescope_rank_load_max_over_mean:ratio1m"),
            until=lambda r: len({(x["metric"]["layer"], x["metric"].get("replica")) for x in r}) == 2 * len(layers),
            timeout=120, what="the rank-load recording rule for both replicas", interval=0.5)
        # The rule's own expression and the per-replica formula, both at one time whose scrapes are all in (a rule
        # evaluated at T may not have seen a scrape stamped just before T: its recorded value can differ from a
        # later query at T, so the recorded series is checked for its labels, the expression for its values).
        time.sleep(3)
        at = float(recorded[0]["value"][0])
        replica_of = {r["metric"]["instance"]: r["metric"]["replica"] for r in prom.query("moescope_build_info", at=at)}
        direct = {}
        for insts in targets:
            assert len({replica_of[x] for x in insts}) == 1  # a launch's ranks share their replica label
            sel = f'{{instance=~"{"|".join(insts)}"}}'
            rows = f"sum by (layer, instance) (rate(moescope_expert_physical_slots_total{sel}[1m]))"
            for r in prom.query(f"max by (layer) ({rows}) / avg by (layer) ({rows})", at=at):
                direct[(r["metric"]["layer"], replica_of[insts[0]])] = float(r["value"][1])
        rule = dict(rules.RECORDING)["model_layer:moescope_rank_load_max_over_mean:ratio1m"]
        evaluated = prom.query(rule, at=at)
        for proc in procs:
            assert proc.wait(timeout=120) == 0, proc.stderr.read()[-2000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        prom.stop()
    assert {(r["metric"]["layer"], r["metric"]["replica"]) for r in recorded} == direct.keys()
    got = {(r["metric"]["layer"], r["metric"]["replica"]): float(r["value"][1]) for r in evaluated}
    assert {rep for _, rep in got} == set(replica_of.values()) and "blue" in replica_of.values()
    assert len(set(replica_of.values())) == 2
    assert got.keys() == direct.keys() and len(got) == 2 * len(layers)
    for key, value in got.items():
        assert value == pytest.approx(direct[key], rel=1e-9), key


@pytest.mark.integration
def test_fewer_requests_than_ranks_leave_a_rank_idle_and_the_summary_whole():
    """`demo --world-size 2 --requests 1`: rank 1 serves nothing (it routed no token, its load has no layers); the
    merged summary still holds every layer, each the one request's forwarded tokens x k (it used to fail on the
    idle rank's missing layers)."""
    demo = run_cli("demo", "--no-tui", "--world-size", "2", "--requests", "1", "--rate", "0", "--traces", "none",
                   "--metrics-port", "-1", "--json", timeout=300)
    assert demo.returncode == 0, demo.stderr[-2000:]
    s = json.loads(demo.stdout)
    assert s["completed"] == 1 and [r["completed"] for r in s["ranks"]] == [1, 0]
    fed = s["ranks"][0]["tokens"]["prompt"] + s["ranks"][0]["tokens"]["output"] - 1
    assert set(s["expert_load"]) == set(s["tokens_dropped"]) == {"1", "2", "3"}
    assert all(sum(counts) == fed * TOP_K for counts in s["expert_load"].values()), s["expert_load"]
