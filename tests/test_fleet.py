"""A fleet of expert-parallel ranks in one real Prometheus: each rank exports the routing of its own tokens
(data-parallel attention), by logical expert, and the physical load of the experts it holds; summed over the
ranks, every routed slot is counted exactly once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from servers import Prometheus, free_port, wait_http

pytestmark = pytest.mark.integration

TOP_K = 2  # tiny-demo's


def _final(prom: Prometheus, metric: str, by: str) -> dict[str, float]:
    """Each series' last value (counters only grow: the max over the run), summed by ``by``."""
    return {r["metric"].get(by, ""): float(r["value"][1])
            for r in prom.query(f"sum by ({by}) (max_over_time({metric}[5m]))")}


def test_the_fleet_sum_in_prometheus_counts_every_token_once(tmp_path):
    port = free_port(2)  # rank r serves metrics on port + r
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"])
    try:
        demo = subprocess.run(
            [sys.executable, "-m", "moescope", "demo", "--no-tui", "--world-size", "2", "--requests", "9",
             "--rate", "0", "--metrics-port", str(port), "--traces", "none", "--linger", "4", "--json",
             "--placement", str(_replicated(tmp_path))], capture_output=True, text=True, timeout=300)
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
        # a replicated expert's slots split over its replicas; its logical label counts them once
        rows = {(r["metric"]["rank"], r["metric"]["expert"]): float(r["value"][1]) for r in prom.query(
            'max_over_time(moescope_expert_physical_slots_total{layer="1",expert=~"0|1"}[5m])')}
        per_rank = {e: {rk: v for (rk, x), v in rows.items() if x == e} for e in ("0", "1")}
        assert per_rank["1"].keys() == {"1"}  # expert 1 lives on rank 1 only
        assert per_rank["0"].keys() == {"0", "1"} and min(per_rank["0"].values()) > 0
        expert0 = _final(prom, 'moescope_expert_tokens_total{layer="1",expert="0"}', "layer")["1"]
        assert sum(per_rank["0"].values()) == expert0
    finally:
        prom.stop()


def _replicated(tmp_path):
    path = tmp_path / "placement.yaml"
    path.write_text("replicated: true\nrank_to_experts: {0: [0, 2, 4, 6], 1: [0, 1, 3, 5, 7]}\n")
    return path
