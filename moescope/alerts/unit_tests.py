"""promtool unit tests of the rules: every alert fires on its bad series and stays silent on healthy and
boundary series and on its extra cases (``moescope.alerts.cases``); the recording rules sum over ranks; the
PromQL excess CV equals ``moescope.thresholds.excess_cv``. Written to
collectors/prometheus/tests/moescope-rules.test.yml by ``moescope alerts build``."""

from __future__ import annotations

from moescope.alerts.rules import RUNBOOK_BASE, AlertSpec, excess_cv, specs
from moescope.thresholds import Thresholds, noise_cv
from moescope.thresholds import excess_cv as excess_cv_py


def _annotations(s: AlertSpec, description: str | None = None) -> dict:
    return {"summary": s.summary, "description": description or s.description,
            "runbook_url": f"{RUNBOOK_BASE}/{s.name}.md"}


def _test(name: str, s: AlertSpec, series: dict, expected: list) -> dict:
    return {"name": name, "interval": s.interval,
            "input_series": [{"series": k, "values": v} for k, v in series.items()],
            "alert_rule_test": [{"eval_time": s.eval_time, "alertname": s.name, "exp_alerts": expected}]}


def tests_document(t: Thresholds = Thresholds()) -> dict:
    tests = []
    for s in specs(t):
        if s.name == "Watchdog":
            tests.append({"name": "Watchdog always fires", "interval": "1m", "input_series": [],
                          "alert_rule_test": [{"eval_time": "1m", "alertname": "Watchdog",
                                               "exp_alerts": [{"exp_labels": {"severity": "none"},
                                                               "exp_annotations": _annotations(s)}]}]})
            continue
        fires = [{"exp_labels": {"severity": s.severity, **labels},
                  "exp_annotations": _annotations(s, EXPECTED_DESCRIPTIONS[s.name])} for labels in EXPECTED[s.name]]
        tests += [_test(f"{s.name} fires", s, s.bad, fires), _test(f"{s.name} healthy", s, s.healthy, []),
                  _test(f"{s.name} boundary", s, s.boundary, [])]
        for c in s.cases:
            expected = [] if c.fires is None else [{"exp_labels": {"severity": s.severity, **c.fires},
                                                    "exp_annotations": _annotations(s, c.description)}]
            tests.append(_test(f"{s.name} {c.name}", s, c.series, expected))
    tests += [_recording_test(), _excess_cv_test()]
    return {"rule_files": ["../moescope-rules.yml"], "evaluation_interval": "1m", "tests": tests}


def _recording_test() -> dict:
    """Two ranks serving different tokens (data-parallel attention): the recorded rates add them up."""
    def s(rank, expert, values):
        return {"series": f'moescope_expert_tokens_total{{model="m",rank="{rank}",layer="3",expert="{expert}"}}',
                "values": values}

    return {"name": "recording rules sum over ranks", "interval": "1m",
            "input_series": [s(0, 0, "0+60x10"), s(1, 0, "0+120x10"), s(0, 1, "0+60x10")],
            "promql_expr_test": [
                {"expr": "model_layer_expert:moescope_expert_tokens:rate1m", "eval_time": "5m",
                 "exp_samples": [{"labels": 'model_layer_expert:moescope_expert_tokens:rate1m{model="m",layer="3",'
                                            'expert="0"}', "value": 3},
                                 {"labels": 'model_layer_expert:moescope_expert_tokens:rate1m{model="m",layer="3",'
                                            'expert="1"}', "value": 1}]},
                {"expr": "model_layer_expert:moescope_expert_load_share:ratio1m", "eval_time": "5m",
                 "exp_samples": [{"labels": 'model_layer_expert:moescope_expert_load_share:ratio1m{model="m",'
                                            'layer="3",expert="0"}', "value": 0.75},
                                 {"labels": 'model_layer_expert:moescope_expert_load_share:ratio1m{model="m",'
                                            'layer="3",expert="1"}', "value": 0.25}]}]}


# (experts, slots, raw CV): uniform at low traffic, a skew, DeepSeek-V3's shape healthy and skewed
EXCESS_POINTS = ((256, 1000, 0.45), (256, 1000, 0.9), (256, 14000, 0.36), (256, 7900, 1.1), (8, 7000, 0.2))


def _excess_cv_test() -> dict:
    """The rules' PromQL excess CV and Python's (diagnose, top) agree, to 1e-9."""
    series, samples = [], []
    for i, (e, n, cv) in enumerate(EXCESS_POINTS):
        lab = f'model="m",rank="0",layer="{i}"'
        series += [{"series": f"moescope_expert_load_cv_ratio{{{lab}}}", "values": f"{cv!r}x5"},
                   {"series": f"moescope_expert_load_cv_noise_ratio{{{lab}}}", "values": f"{noise_cv(e, n)!r}x5"},
                   {"series": f"python_excess_cv{{{lab}}}", "values": f"{excess_cv_py(cv, e, n)!r}x5"}]
        samples.append({"labels": f"{{{lab}}}", "value": 1})
    return {"name": "excess CV in PromQL equals moescope.thresholds.excess_cv", "interval": "1m",
            "input_series": series,
            "promql_expr_test": [{"expr": f"abs({excess_cv('')} - python_excess_cv) < bool 1e-9", "eval_time": "2m",
                                  "exp_samples": samples}]}


# The label sets each alert's bad series fire with (what the expression keeps).
EXPECTED = {
    "MoEExpertLoadImbalance": [{"model": "m", "rank": "0", "layer": "1"}],
    "MoEExpertCollapse": [{"model": "m", "rank": "0", "layer": "1"}],
    "MoEDeadExperts": [{"model": "m", "rank": "0", "layer": "1"}],
    "MoEActivationRatioOutOfBand": [{"model": "tiny-demo", "rank": "0"}],
    "MoEAllToAllLatencyHigh": [{"model": "m", "rank": "0", "op": "dispatch"}],
    "MoESlowRank": [{"model": "m", "peer": "2"}],
    "MoEExpertCacheHitRateLow": [{"model": "m", "rank": "0", "layer": "1"}],
    "MoEExpertSwitchJitter": [{"model": "m", "rank": "0"}],
    "MoERouterNonFiniteLogits": [{"model": "m", "rank": "0", "layer": "1"}],
    "MoETokensDropped": [{"model": "m", "rank": "0", "layer": "1"}],
    "MoERoutingFlips": [{"model": "m", "rank": "0", "layer": "1"}],
    "MoERoutingDrift": [{"model": "m", "rank": "0", "layer": "1"}],
    "MoEMemoryGrowth": [{"model": "m", "rank": "0"}],
    "MoEExporterDown": [{"job": "moescope", "instance": "127.0.0.1:9400"}],
    "MoEExporterAbsent": [{}],  # absent() of a regex matcher carries no labels
}

# What each alert's description renders to on its "fires" series (worked out by hand from the series, so the
# test checks the templates too: e.g. p99 of 60 obs/min all in (1 ms, 10 ms] = 1 + 9 * 0.99 = 9.91 ms).
EXPECTED_DESCRIPTIONS = {
    # sqrt(0.3^2 - 0.1^2) = 0.283; m has the default bar
    "MoEExpertLoadImbalance": "Layer 1 of m (rank 0) has a load CV of 0.28 beyond sampling noise (this model's bar: "
                              "0.15).",
    "MoEExpertCollapse": "90% of layer 1's tokens choose one expert in m (rank 0).",
    "MoEDeadExperts": "2 experts of layer 1 in m got no slot in the window, where uniform routing would have sent "
                      "each at least 20.",
    # 0.30 / 0.45
    "MoEActivationRatioOutOfBand": "tiny-demo (rank 0) touches 66.67% of the parameters its config says a token "
                                   "touches (band: 90%-110%).",
    "MoEAllToAllLatencyHigh": "p99 of the dispatch all-to-all on rank 0 of m is 9.91ms.",
    "MoESlowRank": "Rank 2 accounts for 99.17% of the time ranks of m wait on their peers (a slow peer: over 50% of "
                   "the wait and over 5 ms per dispatch).",  # 12 / 12.1
    "MoEExpertCacheHitRateLow": "Layer 1 of m (rank 0) hits its expert cache 30% of the time (this model's floor: "
                                "85%).",
    "MoEExpertSwitchJitter": "p99 time to make an expert resident on m rank 0 is 247.6ms.",  # 10 + 240 * .99
    "MoERouterNonFiniteLogits": "Layer 1 of m (rank 0) produced 3 non-finite router logits in 5 minutes.",
    "MoETokensDropped": "Layer 1 of m drops 5% slots per routed token.",
    "MoERoutingFlips": "12% of the canary tokens changed experts in layer 1 of m (rank 0).",
    "MoERoutingDrift": "Layer 1 of m routes with a JS divergence of 0.300 bits from its baseline (this model's bar: "
                       "0.1).",
    # 5.5e9 B at 45 min, +1e8 B/min: 5.5e9 + 1e8 / 60 * 14400 = 2.95e10 B = 27.47 GiB
    "MoEMemoryGrowth": "At its current rate m (rank 0) reaches memory capacity within 4h (predicted 27.47GiB).",
    "MoEExporterDown": "Prometheus cannot scrape 127.0.0.1:9400 (job moescope).",
    "MoEExporterAbsent": "Prometheus has no moescope scrape target: check the scrape configuration.",
}
