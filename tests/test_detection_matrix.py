"""The detection matrix: every fault scenario, run through the real alerting path (demo -> Prometheus with the
repo's rules -> Alertmanager with the repo's routing and inhibitions -> webhook), delivers its expected alert
and no other (the Watchdog aside); the healthy run delivers nothing else over its window.

Scenarios run a few at a time (each has its own demo, Prometheus, Alertmanager and webhook). Time to detect is
counted from Prometheus' first scrape, with every `for` shrunk 30-fold (production waits 2-10 minutes).
Set MOESCOPE_MATRIX_OUT=FILE to keep the measured matrix (the README's table comes from it).
"""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

import pipeline

pytestmark = pytest.mark.integration

EXPECTED = {
    "healthy": None,
    "collapse": "MoEExpertCollapse",
    "imbalance": "MoEExpertLoadImbalance",
    "jitter": "MoERoutingFlips",
    "nan": "MoERouterNonFiniteLogits",
    "thrash": "MoEExpertCacheHitRateLow",
    "switch-jitter": "MoEExpertSwitchJitter",
    "slow-rank": "MoESlowRank",
    "drop": "MoETokensDropped",
    "drift": "MoERoutingDrift",
    "leak": "MoEMemoryGrowth",
}
# Drift: the mix has already shifted when monitoring starts (in a gradual shift the load CV crosses its bar
# before the divergence does, so MoEExpertLoadImbalance may page first, until the drift alert takes over).
DEMO_ARGS = {"drift": ["--drift-after", "0"]}
WATCH_S, HEALTHY_WATCH_S, SETTLE_S = 75, 45, 12
# The memory trend judges only processes older than its window (30 min, 60 s here): detection takes longer.
WATCH = {"leak": 150}
ALONE = ("leak",)
PARALLEL = int(os.environ.get("MOESCOPE_MATRIX_PARALLEL", "4"))


def _one(base, scenario):
    expected = EXPECTED[scenario]

    def stop(alerts):
        return any(a["labels"]["alertname"] == expected and a["status"] == "firing" for _, a in alerts)
    def state(prom):  # what Prometheus itself saw, for the failure message
        return sorted(f"{a['metric']['alertname']}:{a['metric']['alertstate']}" for a in prom.query("ALERTS")) + \
            [f"up={prom.scalar('min(up)')}"]

    got = pipeline.run(base / scenario, scenario, WATCH.get(scenario, WATCH_S if expected else HEALTHY_WATCH_S),
                       stop_when=stop if expected else None, settle_s=SETTLE_S, demo_args=DEMO_ARGS.get(scenario, ()),
                       during=state)
    return scenario, got


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    # The leak grows memory per engine step: on 2 shared cores its step rate (and so its slope) drops ~15x,
    # so it runs alone, after the others (which run a few at a time, the 3-process one first).
    order = sorted((s for s in EXPECTED if s not in ALONE), key=lambda s: s != "slow-rank")
    base = tmp_path_factory.mktemp("matrix")
    with ThreadPoolExecutor(PARALLEL) as pool:
        results = dict(pool.map(lambda s: _one(base, s), order))
    results.update(_one(base, s) for s in ALONE)
    table = {s: {"expected": EXPECTED[s], "delivered": sorted(pipeline.firing(d) - {"Watchdog"}),
                 "seconds_to_detect": d.first.get(EXPECTED[s]) if EXPECTED[s] else None,
                 "watchdog": "Watchdog" in pipeline.firing(d), "prometheus_saw": d.during}
             for s, d in results.items()}
    out = os.environ.get("MOESCOPE_MATRIX_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"for": "production / 30", "scrape_and_eval_interval": "1s", "warmup_s": pipeline.WARMUP_S,
                       "matrix": table}, f, indent=1)
    return table


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_scenario_delivers_its_alert_and_no_other(matrix, scenario):
    row = matrix[scenario]
    assert row["watchdog"], "the Watchdog never arrived: the pipeline itself is broken"
    want = [row["expected"]] if row["expected"] else []
    assert row["delivered"] == want, row
