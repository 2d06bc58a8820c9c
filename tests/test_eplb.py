"""EPLB's figures measure what they say: the whole run, and the same steps in a static run and an EPLB run.

The demo summary's per-rank load (``ranks[].rank_max_over_mean_*``, ``rank_rows_*``) once held only the rows since
the last rearrangement: a static run's whole run beside an EPLB run's last few steps (its drain), and
benchmarks/eplb.py published them side by side as if alike."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import run_cli
from moescope.cli import main
from moescope.errors import BadInput
from moescope.parallel import placement
from moescope.parallel.eplb import Rebalancer
from moescope.parallel.planner import plan_layer
from reference import naive_max_over_mean, naive_rank_loads

K = 6  # the rearrangement period, and the step the span both runs measure starts at
RUN = ("demo", "--no-tui", "--world-size", "2", "--requests", "12", "--rate", "0", "--scenario", "imbalance",
       "--traces", "none", "--metrics-port", "-1", "--canary-interval", "0", "--json")


def ratios(rows: dict) -> dict:
    return {layer: round(max(r) / (sum(r) / len(r)), 4) for layer, r in rows.items() if sum(r)}


@pytest.fixture(scope="module")
def runs():
    out = {}
    for name, extra in (("static", ("--measure-from-step", str(K))),
                        ("eplb", ("--rebalance-steps", str(K), "--rebalance-slots", "5"))):
        proc = run_cli(*RUN, *extra, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[name] = json.loads(proc.stdout)
    return out


@pytest.mark.integration
def test_whole_run_rows_are_every_served_slot_and_static_recomputes_from_the_counts(runs):
    """Canary off, no drops: per layer the ranks' rows over the whole run add up to the fleet's routed slots, in
    both runs (a rearrangement resets nothing); on the static round-robin placement each rank's rows are exactly
    the slots routed to the experts it holds; every published max/mean is its rows' max/mean."""
    start = placement.build("round-robin", n_experts=8, world_size=2, moe_layers=(1, 2, 3))
    for name, s in runs.items():
        for r in s["ranks"]:
            assert r["rank_rows_run"] == s["ranks"][0]["rank_rows_run"], name  # every rank measures the same
            assert r["rank_max_over_mean_run"] == ratios(r["rank_rows_run"])
            assert r["rank_max_over_mean_from"] == ratios(r["rank_rows_from"])
        rows = s["ranks"][0]["rank_rows_run"]
        assert set(rows) == set(s["expert_load"])
        for layer, load in s["expert_load"].items():
            assert sum(rows[layer]) == sum(load), (name, layer)
            if name == "static":
                assert rows[layer] == [sum(load[e] for e in held) for held in start.layers[int(layer)]]


@pytest.mark.integration
def test_static_and_eplb_are_measured_on_the_same_steps(runs):
    """Greedy decoding: both runs make the same steps and route the same tokens, so the span from step K to the end
    holds the same slots per layer in both; in the EPLB run it is exactly the windows after its first rearrangement
    (their steps and slots add up to it), the last of them the run's drain."""
    st, ep = runs["static"]["ranks"][0], runs["eplb"]["ranks"][0]
    assert st["steps"] == ep["steps"] and st["measure_from_step"] == ep["measure_from_step"] == K
    assert st["rebalances"] is None and ep["rebalances"][0]["step"] == K
    assert {k: sum(v) for k, v in st["rank_rows_from"].items()} == {k: sum(v) for k, v in ep["rank_rows_from"].items()}
    assert 0 < sum(map(sum, ep["rank_rows_from"].values())) < sum(map(sum, ep["rank_rows_run"].values()))
    events = ep["rebalances"]
    assert sum(e["measured_steps"] for e in events) == ep["steps"] - K + 1
    n_layers = len(ep["rank_rows_from"])
    from_slots = sum(map(sum, ep["rank_rows_from"].values())) / n_layers
    assert sum(e["measured_slots_per_layer"] for e in events) == pytest.approx(from_slots, abs=0.1 * len(events))
    for e in events:  # a layer that kept its placement moved nothing
        assert 0 <= e["kept_layers"] <= n_layers
        if e["kept_layers"] == n_layers:
            assert e["moved_experts"] == 0
    # the skewed routing: EPLB ends (the same steps) better balanced than the placement it started from
    assert max(ep["rank_max_over_mean_from"].values()) < max(st["rank_max_over_mean_from"].values())


def test_measure_from_step_needs_ranks(capsys):
    assert main(["demo", "--measure-from-step", "5"]) == 2
    assert "needs --world-size > 1" in capsys.readouterr().err


def test_rebalancer_bounds():
    with pytest.raises(BadInput, match="horizon"):
        Rebalancer(5, horizon=0)
    with pytest.raises(BadInput, match="min_gain"):
        Rebalancer(5, min_gain=-0.1)


def rebalance_on(windows, monkeypatch, **rebalancer):
    """Rank 0 of 2 rearranging one MoE layer of 8 experts after each window of routed counts (its own counts
    standing for the fleet's: the all-reduce and the weight moves stubbed); returns the events."""
    import torch

    from moescope.parallel import expert_parallel
    from moescope.parallel.expert_parallel import ExpertParallel

    monkeypatch.setattr(ExpertParallel, "_collective", lambda self, fn, *args: None)
    monkeypatch.setattr(expert_parallel.dist, "P2POp", lambda *a, **k: a)
    monkeypatch.setattr(expert_parallel.dist, "batch_isend_irecv", lambda ops: [])
    layers = [SimpleNamespace(layer_index=1, experts=SimpleNamespace(gate_up_proj=torch.zeros(8, 2, 2),
                                                                     down_proj=torch.zeros(8, 2, 2)))]
    ep = ExpertParallel(placement.build("round-robin", n_experts=8, world_size=2, moe_layers=(1,)), 0, 2)
    ep.rebalancer = Rebalancer(1, slots=5, **rebalancer)
    for counts in windows:
        ep._routed = {1: torch.tensor(counts)}
        ep.rebalance(layers)
    return list(ep.events)


A = [80, 10, 10, 10, 10, 10, 10, 10]  # expert 0 hot
B = [5, 10, 10, 10, 10, 10, 10, 80]  # then expert 7


def test_the_rebalancer_plans_on_the_last_windows_together(monkeypatch):
    """After window A (expert 0 hot) and window B (expert 7 hot) a plan on B alone (horizon 1: what the ranks did
    before) drops expert 0's replica although A's traffic was a window ago; on both windows it replicates both,
    and its prediction is for their counts together."""
    def replicated(event):
        per = event.layers[1]
        return sorted(set(per[0]) & set(per[1]))

    one = rebalance_on([A, B], monkeypatch, horizon=1, min_gain=0)
    two = rebalance_on([A, B], monkeypatch, horizon=2, min_gain=0)
    assert replicated(one[0]) == replicated(two[0]) == [0, 1]
    assert replicated(one[1]) == [1, 7] and replicated(two[1]) == [0, 7]
    both = np.array(A, float) + np.array(B, float)
    assert two[1].predicted[1] == pytest.approx(naive_max_over_mean(naive_rank_loads(both, plan_layer(both, 2, 5))))


def test_a_layer_keeps_its_placement_unless_the_plan_gains_more_than_min_gain(monkeypatch):
    """The same window again: the current placement is already the plan's on those counts, so nothing moves and
    the prediction is the current placement's; a first window far from round-robin's balance moves experts."""
    events = rebalance_on([A, A], monkeypatch)
    assert events[0].moved > 0 and events[0].kept == 0
    assert events[1].moved == 0 and events[1].kept == 1 and events[1].layers == events[0].layers
    a = np.array(A, float)
    assert events[1].predicted[1] == pytest.approx(naive_max_over_mean(naive_rank_loads(a, events[0].layers[1])))
    # round-robin on a nearly even window is within min_gain of the plan: kept from the start
    flat = rebalance_on([[10, 10, 10, 10, 10, 10, 10, 11]], monkeypatch, min_gain=0.05)
    assert flat[0].moved == 0 and flat[0].kept == 1
