"""promtool unit tests of the rules: every alert fires on its ``fires`` series (labels and rendered description
checked) and stays silent on its healthy and boundary series, and each extra case of ``moescope.alerts.cases``
holds; the recording rules sum over ranks. Written to collectors/prometheus/tests/moescope-rules.test.yml by
``moescope alerts build``."""

from __future__ import annotations

from moescope.alerts.cases import Case, Suite, suites
from moescope.alerts.rules import RUNBOOK_BASE, AlertSpec, specs
from moescope.thresholds import DEFAULT, Thresholds


def _annotations(s: AlertSpec, description: str) -> dict:
    return {"summary": s.summary, "description": description, "runbook_url": f"{RUNBOOK_BASE}/{s.name}.md"}


def _test(s: AlertSpec, suite: Suite, c: Case) -> dict:
    expected = [{"exp_labels": {"severity": s.severity, **labels}, "exp_annotations": _annotations(s, description)}
                for labels, description in c.fires]
    return {"name": f"{s.name} {c.name}", "interval": suite.interval,
            "input_series": [{"series": k, "values": val} for k, val in c.series.items()],
            "alert_rule_test": [{"eval_time": c.eval_time or suite.eval_time, "alertname": s.name,
                                 "exp_alerts": expected}]}


def tests_document(t: Thresholds = DEFAULT, b: Thresholds | None = None) -> dict:
    """The promtool tests of every alert: the cases' quantities placed by ``t``, their bar series written by ``b``
    (default ``t``: the generated file)."""
    tests = []
    by_name = suites(t, b)
    for s in specs(t):
        if s.name == "Watchdog":
            tests.append({"name": "Watchdog always fires", "interval": "1m", "input_series": [],
                          "alert_rule_test": [{"eval_time": "1m", "alertname": "Watchdog",
                                               "exp_alerts": [{"exp_labels": {"severity": "none"},
                                                               "exp_annotations": _annotations(s, s.description)}]}]})
            continue
        suite = by_name[s.name]
        tests += [_test(s, suite, c) for c in suite.all()]
        if s.name in HYSTERESIS_CHECKED:
            tests += [_test(s, suite, c) for c in hysteresis_cases(suite.fires, s.for_)]
    tests.append(_recording_test())
    return {"rule_files": ["../moescope-rules.yml"], "evaluation_interval": "1m", "tests": tests}


# The gauge-judged alerts whose hysteresis (``keep_firing_for`` = ``for``) the unit tests check on series that
# vanish and come back (their ``fires`` cases are constant gauges).
HYSTERESIS_CHECKED = ("MoEExpertHot", "MoEExpertLoadImbalance", "MoEExpertCollapse", "MoERankLoadImbalance",
                      "MoERoutingDrift", "MoEDeadExperts", "MoERoutingFlips")
# The routing alerts whose clear bar (below the firing bar) the cases check: each has "firing, it holds between its
# bar and its clear bar", "firing, it clears under its clear bar" and "between the bars without having fired is
# silent" (tests/test_alerts.py).
CLEAR_BAR_CHECKED = ("MoEExpertHot", "MoEExpertLoadImbalance", "MoEExpertCollapse", "MoERankLoadImbalance",
                     "MoERoutingDrift", "MoEDeadExperts", "MoERoutingFlips")


def hysteresis_cases(fires: Case, for_: str) -> tuple[Case, Case]:
    """From an alert's ``fires`` case (constant gauges, 1-minute samples): its series vanish (staleness markers)
    for a minute less than the alert's ``for`` and come back, and the page is still firing a minute after they
    return (without hysteresis it would be pending again); gone for good, it resolves a minute after ``for`` has
    passed since the last evaluation that saw them."""
    minutes = int(for_[:-1]) * {"m": 1, "h": 60}[for_[-1]]
    assert for_[-1] in "mh" and minutes >= 2, for_
    up = minutes + 2  # fired (its for passed) and seen a minute more
    const = {}
    for name, values in fires.series.items():
        samples = {x.split("x")[0] if "x" in x and "+" not in x and "-" not in x else x for x in values.split()}
        assert len(samples) == 1, f"{name}: a hysteresis case needs a constant series, not {values!r}"
        const[name] = samples.pop()  # "0.9x20" (promtool: 0.9, 21 times) -> one sample of 0.9

    def series(gap: int, after: int) -> dict:
        return {name: " ".join([x] * up + ["stale"] * gap + [x] * after) for name, x in const.items()}

    flap = series(minutes - 1, 5)
    gone = series(2 * minutes + 5, 0)
    return (Case("gone for less than its for and back: still firing, never resolved", flap, fires.fires,
                 eval_time=f"{up + minutes - 1 + 1}m"),
            Case("gone for good: resolves once its for has passed", gone,
                 eval_time=f"{up - 1 + minutes + 1}m"))


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
