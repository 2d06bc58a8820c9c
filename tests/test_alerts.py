"""Alert rules, their promtool unit tests, Alertmanager routing and inhibitions, playbooks: checked with the real
tools (promtool, amtool, a real Alertmanager)."""

import dataclasses
import json
import re
import subprocess
import urllib.request

import pytest
import yaml

from conftest import ROOT
from moescope import thresholds
from moescope.alerts import cases, rules, unit_tests
from moescope.cli import main
from moescope.metrics import catalogue
from helpers import wait_until
from servers import Alertmanager, require

PROM = ROOT / "collectors" / "prometheus"
AM = ROOT / "collectors" / "alertmanager" / "alertmanager.yml"


def test_generated_rules_are_stable():
    for path, doc in ((PROM / "moescope-rules.yml", rules.rules_document()),
                      (PROM / "tests" / "moescope-rules.test.yml", unit_tests.tests_document())):
        assert yaml.safe_load(path.read_text()) == doc, f"{path} is stale: run `moescope alerts build`"


def test_alerts_build_writes_the_generated_files_and_fails_in_one_line(tmp_path, capsys):
    assert main(["alerts", "build", "--root", str(tmp_path)]) == 0
    assert yaml.safe_load((tmp_path / "collectors" / "prometheus" / "moescope-rules.yml").read_text()) == \
        rules.rules_document()
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "collectors").write_text("a file where the directory goes")
    capsys.readouterr()
    assert main(["alerts", "build", "--root", str(blocked)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moescope: error: cannot write the rules under ") and err.count("\n") == 1, err


def _promtool_test(rules_doc: dict, tests_doc: dict, tmp_path) -> subprocess.CompletedProcess:
    promtool = require("promtool", "prometheus")
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / "moescope-rules.yml").write_text(yaml.safe_dump(rules_doc, sort_keys=False))
    (tmp_path / "tests" / "t.yml").write_text(yaml.safe_dump(tests_doc, sort_keys=False))
    return subprocess.run([promtool, "test", "rules", "tests/t.yml"], cwd=tmp_path, capture_output=True, text=True)


def test_promtool_check_and_unit_tests_pass():
    promtool = require("promtool", "prometheus")
    check = subprocess.run([promtool, "check", "rules", str(PROM / "moescope-rules.yml")], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run([promtool, "test", "rules", "tests/moescope-rules.test.yml"], cwd=PROM,
                          capture_output=True, text=True)
    assert test.returncode == 0, test.stdout + test.stderr
    # Every alert is tested: firing, healthy, at the boundary and its extra cases (the Watchdog just fires).
    names = [t["name"] for t in unit_tests.tests_document()["tests"]]
    suites = cases.suites()
    for s in rules.specs():
        expected = {"always fires"} if s.name == "Watchdog" else {c.name for c in suites[s.name].all()}
        if s.name in unit_tests.HYSTERESIS_CHECKED:
            expected |= {c.name for c in unit_tests.hysteresis_cases(suites[s.name].fires, s.for_)}
        assert {n.split(" ", 1)[1] for n in names if n.split(" ", 1)[0] == s.name} == expected
        if s.name != "Watchdog":
            suite = suites[s.name]
            assert suite.fires.fires and not suite.healthy.fires and not suite.boundary.fires, s.name
    assert "recording rules sum over ranks" in names


def test_hysteresis_cases_fail_on_rules_without_it(tmp_path):
    """The cases that check hysteresis are not vacuous: on the same rules with ``keep_firing_for`` removed,
    promtool fails exactly the "gone for less than its for and back" case of every checked alert."""
    import yaml

    promtool = require("promtool", "prometheus")
    doc = rules.rules_document()
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("keep_firing_for", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    tests = unit_tests.tests_document()
    tests["rule_files"] = [str(tmp_path / "rules.yml")]
    (tmp_path / "t.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    run = subprocess.run([promtool, "test", "rules", str(tmp_path / "t.yml")], capture_output=True, text=True)
    assert run.returncode != 0
    failed = set(re.findall(r"name: (.+?),\n", run.stdout + run.stderr))
    assert failed == {f"{a} gone for less than its for and back: still firing, never resolved"
                      for a in unit_tests.HYSTERESIS_CHECKED}, run.stdout[-3000:]


# (Thresholds field, the promtool case that sits exactly on it)
BARS = (("imbalance_cv", "MoEExpertLoadImbalance boundary"),
        ("imbalance_baseline_factor", "MoEExpertLoadImbalance with a baseline: exactly at its bar is silent"),
        ("hot_factor", "MoEExpertHot boundary"), ("rank_max_over_mean", "MoERankLoadImbalance boundary"),
        ("collapse_top_share", "MoEExpertCollapse boundary"), ("drift_bits", "MoERoutingDrift boundary"),
        ("cache_floor_of_capacity", "MoEExpertCacheHitRateLow boundary"),
        ("activation_floor", "MoEActivationRatioLow boundary"), ("flip_ratio", "MoERoutingFlips boundary"),
        ("drop_ratio", "MoETokensDropped boundary"), ("slow_rank_share", "MoESlowRank boundary"))
# (the latency boundaries sit at the top of their bucket, p99 interpolated to 0.99 of it: just under the bar)
FLOORS = {"cache_floor_of_capacity", "activation_floor"}  # alerts below the bar


def test_boundary_cases_sit_exactly_on_the_bar(tmp_path):
    """The rules judge by the bar series alone: the same rules, with every case's bar series written from a
    thresholds object whose bars moved by 1% across their boundary series (down for a ceiling, up for a floor)
    and the quantities left where they were, fail every case on a bar, and no case fails whose input and
    expectations did not change; cases generated wholly from the moved object pass again."""
    t = thresholds.DEFAULT
    moved = dataclasses.replace(t, **{f: getattr(t, f) * (1.01 if f in FLOORS else 0.99) for f, _ in BARS})
    before = {x["name"]: x for x in unit_tests.tests_document(t)["tests"]}
    after = {x["name"]: x for x in unit_tests.tests_document(t, moved)["tests"]}
    changed = {name for name in before if before[name] != after[name]}
    run = _promtool_test(rules.rules_document(t), unit_tests.tests_document(t, moved), tmp_path)
    assert run.returncode == 1, run.stdout[-2000:]
    failed = set(re.findall(r"name: (.+?),\n", run.stdout + run.stderr))
    assert {case for _, case in BARS} <= failed, sorted({case for _, case in BARS} - failed)
    assert failed <= changed, sorted(failed - changed)
    # (a ratio of two extrapolated rates lands exactly on a round bar only: 9.9 / 1000 per minute is not 0.0099;
    # the slow-rank cases' waits are typed, even splits: at the share bar, over the moved one)
    again = _promtool_test(rules.rules_document(t), unit_tests.tests_document(moved), tmp_path)
    assert set(re.findall(r"name: (.+?),\n", again.stdout + again.stderr)) <= {
        "MoETokensDropped boundary", "MoESlowRank healthy", "MoESlowRank boundary"}


def test_imbalance_rule_is_the_thresholds_judgement(tmp_path):
    """One judgement: over a grid of (excess CV or NaN, the reference: none yet (learning), the fair share, a
    learned or a baseline structural CV, drift beyond noise or within it), the rule fires exactly where
    ``Thresholds.imbalance_bar_of`` and not ``Thresholds.drifted`` say so, with the description naming the bar it
    was judged against."""
    t = thresholds.DEFAULT
    refs = [("learning", None), ("fair", 0.0), ("learned", 0.3), ("learned", 2.5), ("baseline", 0.0),
            ("baseline", 0.3), ("baseline", 0.8)]
    grid = [(excess, kind, ref, jsd, noise)
            for excess in (float("nan"), 0.2, 0.5, 0.6, 0.9, 1.05, 1.4, 2.0, 4.0)
            for kind, ref in refs
            for jsd, noise in ((None, None), (0.3, 0.01), (0.3, 0.29))]
    series, expected = {}, []
    for i, (excess, kind, ref, jsd, noise) in enumerate(grid):
        series.update(cases._load(excess, ref, layer=str(i), jsd=jsd, noise=noise, kind=kind))
        if excess > t.imbalance_bar_of(kind, ref) and not t.drifted(jsd, noise):
            labels = cases.LAYER | {"layer": str(i)}
            expected.append((labels, cases.imbalance_description(excess, ref, t, labels, kind)))
    assert 0 < len(expected) < len(grid)
    suite = cases.imbalance(t)
    spec = next(s for s in rules.specs(t) if s.name == "MoEExpertLoadImbalance")
    doc = {"rule_files": ["../moescope-rules.yml"], "evaluation_interval": "1m",
           "tests": [unit_tests._test(spec, suite, cases.Case("grid", series, tuple(expected)))]}
    run = _promtool_test(rules.rules_document(t), doc, tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr


# A number an expression may hold besides 0 and 1: a quantity's own parameter, never a bar it is compared with
QUANTITY_PARAMETERS = {"histogram_quantile": 0, "predict_linear": 1}  # which quantile; how far ahead (seconds)
COMPARISONS = {">", "<", ">=", "<=", "==", "!="}


def rule_violations(expr: str) -> list[str]:
    """Where ``expr`` (PromQL, parsed by promql-parser: Prometheus' own grammar) carries a bar of its own: a number
    other than 0 and 1 (``QUANTITY_PARAMETERS`` excepted), or a bar series (moescope_judgement_bar /
    _clear_bar) that is not itself an operand of a comparison (through parentheses, or the max / min of one
    model's exporters' bars): arithmetic, a function or an aggregation over a bar is a bar formula."""
    import promql_parser

    out: list[str] = []

    def visit(node, ctx: str) -> None:
        kind = type(node).__name__
        if kind == "NumberLiteral":
            if node.val not in (0.0, 1.0) and ctx != "parameter":
                out.append(f"the number {node.val:g} ({ctx})")
        elif kind == "VectorSelector":
            if node.name in (rules.BAR, rules.CLEAR_BAR) and ctx != "compared":
                out.append(f"{node.name} under {ctx}")
        elif kind == "BinaryExpr":
            op = str(node.op)
            child = "compared" if op in COMPARISONS else "a set operation" if op in ("and", "or", "unless") \
                else f"arithmetic ({op})"
            visit(node.lhs, child)
            visit(node.rhs, child)
        elif kind == "ParenExpr":
            visit(node.expr, ctx)
        elif kind == "AggregateExpr":
            op = str(node.op)
            if node.param is not None:
                visit(node.param, f"the parameter of {op}")
            visit(node.expr, "compared" if ctx == "compared" and op in ("max", "min") else f"aggregation {op}")
        elif kind == "Call":
            name = node.func.name
            for i, arg in enumerate(node.args):
                visit(arg, "parameter" if QUANTITY_PARAMETERS.get(name) == i else f"function {name}")
        elif kind == "UnaryExpr":
            visit(node.expr, "arithmetic (-)")
        elif kind == "MatrixSelector":
            visit(node.vector_selector, ctx)
        elif kind == "SubqueryExpr":
            visit(node.expr, ctx)
        elif kind != "StringLiteral":
            out.append(f"unknown node {kind}")

    visit(promql_parser.parse(expr), "top")
    return out


def test_no_threshold_or_bar_formula_in_the_rules():
    """Every alert rule compares its quantity with the bar series the exporter exports (Thresholds.bars), and holds
    against its clear bar series: no expression holds a number of its own (other than 0 and 1, and a quantity's own
    parameter: which quantile, how far ahead) or any arithmetic on a bar; every routing alert reads its bar series
    and no expression names a model."""
    doc = rules.rules_document()
    for group in doc["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule["record"]
            assert not rule_violations(rule["expr"]), (name, rule_violations(rule["expr"]))
    for s in rules.specs():
        assert "model=" not in s.expr and "model!" not in s.expr, s.name
    reads = {s.name: s.expr for s in rules.specs()}
    for name in unit_tests.CLEAR_BAR_CHECKED:  # each compares with its bar and holds against its clear bar
        assert f"group_left {rules.BAR}" in reads[name] and f"group_left {rules.CLEAR_BAR}" in reads[name], name
    for name in ("MoETokensDropped", "MoEActivationRatioLow", "MoEExpertCacheHitRateLow", "MoEAllToAllLatencyHigh",
                 "MoEExpertSwitchJitter", "MoESlowRank", "MoEMemoryGrowth"):
        assert rules.BAR in reads[name], name


@pytest.mark.parametrize("planted, found", [
    # a threshold typed into a rule, as the rules were written before the bars were series
    ("moescope_expert_hot_factor_ratio > 4", "the number 4"),
    ("moescope_expert_load_excess_cv_ratio > on (layer) (1.5 * moescope_baseline_load_cv_ratio + 0.1)",
     "the number 1.5"),
    # a bar formula over the bar series
    ('moescope_expert_load_top_share_ratio > on (layer) group_left clamp_min(moescope_judgement_bar{judgement='
     '"collapse"}, 0)', "moescope_judgement_bar under function clamp_min"),
    ('moescope_routing_drift_jsd_bits > on (layer) group_left moescope_judgement_bar{judgement="drift"} - ignoring '
     '(judgement, reference) moescope_routing_drift_noise_bits', "moescope_judgement_bar under arithmetic (-)"),
    ('moescope_expert_hot_factor_ratio > on (layer) group_left moescope_judgement_clear_bar{judgement="hot"} * 1',
     "moescope_judgement_clear_bar under arithmetic (*)"),
    ('moescope_rank_load_max_over_mean_ratio > on (model) group_left avg by (model) (moescope_judgement_bar)',
     "moescope_judgement_bar under aggregation avg"),
])
def test_the_rules_check_catches_a_planted_threshold_or_bar_formula(planted, found):
    """The check is not vacuous: each planted expression, put into a copy of the rules in place of a real one's
    condition (and in the real rule's own context: or'ed with its hold), is reported, naming what it found."""
    spec = next(s for s in rules.specs() if s.name == "MoEExpertHot")
    assert not rule_violations(spec.expr)
    planted_rule = rules.held_by("MoEExpertHot", planted, rules.over("moescope_expert_hot_factor_ratio", "hot",
                                                                        clear=True))
    got = rule_violations(planted_rule)
    assert any(found in g for g in got), got


def test_alerts_doc_holds_the_generated_table_and_the_bars():
    doc = (ROOT / "docs" / "alerts.md").read_text()
    assert rules.markdown_table() in doc, "docs/alerts.md's rules table is stale: paste rules.markdown_table()"
    t = thresholds.DEFAULT
    for quoted in (f"{t.imbalance_cv:g}", f"{t.imbalance_baseline_factor:g} x", f"{t.hot_factor:g}x",
                   f"{t.rank_max_over_mean:g}", f"{t.drift_bits:g} bits", f"{t.activation_floor:g}"):
        assert quoted in doc, quoted


def test_every_rule_metric_is_in_the_catalogue_and_every_alert_is_complete():
    known = catalogue.names() | {"up"}
    for s in rules.specs():
        used = {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"\bmoescope_[a-z_]+", s.expr)}
        assert used <= known, (s.name, used - known)
        assert set(s.metrics) <= known
        assert used <= {re.sub(r"_(bucket|sum|count)$", "", m) for m in s.metrics}, s.name
    doc = rules.rules_document()
    recording, alerting = doc["groups"]
    for rule in recording["rules"]:  # recording rules read catalogue series and follow level:metric:operations
        level, metric, _ = rule["record"].split(":")
        assert metric.startswith("moescope_") and set(re.findall(r"(?<![:\w])moescope_[a-z_]+", rule["expr"])) <= known
    for rule in alerting["rules"]:
        assert rule["labels"]["severity"] in ("critical", "warning", "info", "none")
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"])
        assert rule["annotations"]["runbook_url"].endswith(f"/{rule['alert']}.md")
    nonfinite = next(r for r in alerting["rules"] if r["alert"] == "MoERouterNonFiniteLogits")
    assert "for" not in nonfinite and nonfinite["labels"]["severity"] == "critical"
    fors = {r["alert"]: r.get("for") for r in alerting["rules"]}
    assert fors["MoEExpertHot"] == "5m" and fors["MoERankLoadImbalance"] == "10m"
    # for_scale shrinks every `for`, keeping their order
    scaled = {r["alert"]: r.get("for") for r in rules.rules_document(thresholds.Thresholds(for_scale=1 / 30))[
        "groups"][1]["rules"]}
    assert scaled["MoEExpertHot"] == "10s" and scaled["MoEExpertLoadImbalance"] == "20s"
    assert {a for a, f in scaled.items() if f} == {a for a, f in fors.items() if f}


def test_every_alert_has_a_playbook_and_every_playbook_an_alert():
    alerts = {s.name for s in rules.specs()}
    books = {p.stem for p in (ROOT / "playbooks").glob("*.md")} - {"README"}
    assert books == alerts
    index = (ROOT / "playbooks" / "README.md").read_text()
    for name in alerts:
        text = (ROOT / "playbooks" / f"{name}.md").read_text()
        assert text.startswith(f"# {name}\n")
        for section in ("## Meaning", "## Impact", "## Diagnosis", "## Mitigation"):
            assert section in text, (name, section)
        assert f"({name}.md)" in index
    # the playbooks of the judged alerts quote the bars the rules use
    t = thresholds.DEFAULT
    quotes = {"MoEExpertHot": f"{t.hot_factor:g}x", "MoERankLoadImbalance": f"{t.rank_max_over_mean:g}x",
              "MoEExpertLoadImbalance": f"{t.imbalance_baseline_factor:g} x the baseline's structural CV + "
                                        f"{t.imbalance_baseline_margin:g}",
              "MoERoutingDrift": f"{t.drift_bits:g} bits", "MoEActivationRatioLow": f"< {t.activation_floor:g}",
              "MoEExpertCacheHitRateLow": f"{t.cache_floor_of_capacity:g} x",
              "MoEDeadExperts": f"at least {t.dead_min_expected_slots:g} effective slots",
              "MoEExpertCollapse": f"{t.collapse_top_share:g}"}
    for name, quoted in quotes.items():
        assert quoted in " ".join((ROOT / "playbooks" / f"{name}.md").read_text().split()), (name, quoted)


@pytest.mark.parametrize("labels,receiver", [
    (["alertname=MoEExpertCollapse", "severity=critical", "model=m", "layer=1"], "critical"),
    (["alertname=MoERouterNonFiniteLogits", "severity=critical"], "critical"),
    (["alertname=MoEExpertLoadImbalance", "severity=warning", "model=m", "layer=1"], "warning"),
    (["alertname=MoEExpertHot", "severity=warning", "model=m", "layer=1", "expert=5"], "warning"),
    (["alertname=MoEExpertCacheHitRateLow", "severity=warning"], "warning"),
    (["alertname=Watchdog", "severity=none"], "watchdog"),
    (["alertname=SomethingElse"], "default"),
])
def test_alertmanager_routes(labels, receiver):
    amtool = require("amtool", "prometheus-alertmanager")
    assert subprocess.run([amtool, "check-config", str(AM)], capture_output=True).returncode == 0
    ok = subprocess.run([amtool, "config", "routes", "test", f"--config.file={AM}", f"--verify.receivers={receiver}",
                         *labels], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    wrong = "default" if receiver != "default" else "critical"
    bad = subprocess.run([amtool, "config", "routes", "test", f"--config.file={AM}", f"--verify.receivers={wrong}",
                          *labels], capture_output=True, text=True)
    assert bad.returncode == 1  # amtool really checks


def test_alertmanager_inhibit_rules_are_the_judges():
    """alertmanager.yml's inhibit_rules are judge.INHIBITIONS, rule for rule (one source for the combining rules
    Alertmanager applies and the views apply)."""
    from moescope import judge

    cfg = yaml.safe_load(AM.read_text())
    assert cfg["inhibit_rules"] == [{"source_matchers": r.matchers("source"), "target_matchers": r.matchers("target"),
                                     "equal": list(r.equal)} for r in judge.INHIBITIONS]


def test_alertmanager_inhibition_rules_name_real_alerts():
    cfg = yaml.safe_load(AM.read_text())
    first, *cause_rules = cfg["inhibit_rules"]
    assert first["source_matchers"] == ['severity="critical"'] and first["target_matchers"] == ['severity="warning"']
    assert set(first["equal"]) == {"model", "layer"}
    names = {s.name for s in rules.specs()}
    for rule in cause_rules:  # a cause mutes its symptoms: all must be real alerts
        (src,), (dst,) = rule["source_matchers"], rule["target_matchers"]
        src, dst = src.split('"')[1], set(dst.split('"')[1].split("|"))
        assert src in names and dst <= names and src not in dst, (src, dst)
    assert cfg["route"]["group_by"] == ["alertname", "model", "layer"]


def _alert(name: str, severity: str = "warning", **labels) -> dict:
    return {"labels": {"alertname": name, "severity": severity, "rank": "0", **labels},
            "annotations": {"summary": name}}


@pytest.mark.integration
def test_a_real_alertmanager_mutes_the_symptoms_of_a_cause(tmp_path):
    """Alerts posted to a real Alertmanager with the repository's config: a collapse mutes imbalance and hot
    experts of its model (any layer); a hot expert mutes imbalance and rank load of its own layer only; an
    unrelated model keeps its alerts."""
    am = Alertmanager(tmp_path, AM, webhook_port=9)
    try:
        posted = [
            _alert("MoEExpertCollapse", "critical", model="a", layer="1"),
            _alert("MoEExpertHot", model="a", layer="2", expert="5", reference="fair"),
            _alert("MoEExpertLoadImbalance", model="a", layer="3"),
            _alert("MoEExpertHot", model="b", layer="2", expert="5", reference="baseline"),
            _alert("MoEExpertLoadImbalance", model="b", layer="2"),
            _alert("MoERankLoadImbalance", model="b", layer="2"),
            _alert("MoEExpertLoadImbalance", model="b", layer="3"),
            _alert("MoEExpertHot", model="c", layer="1", expert="0", reference="fair"),
        ]
        req = urllib.request.Request(f"http://{am.address}/api/v2/alerts", json.dumps(posted).encode(),
                                     {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).read()
        muted = {("a", "MoEExpertHot", "2"), ("a", "MoEExpertLoadImbalance", "3"),
                 ("b", "MoEExpertLoadImbalance", "2"), ("b", "MoERankLoadImbalance", "2")}
        def state():
            got = json.loads(urllib.request.urlopen(f"http://{am.address}/api/v2/alerts", timeout=10).read())
            return {(a["labels"]["model"], a["labels"]["alertname"], a["labels"]["layer"]):
                    bool(a["status"]["inhibitedBy"]) for a in got}

        wait_until(state, until=lambda s: len(s) == len(posted) and {k for k, v in s.items() if v} == muted,
                   timeout=20, what="Alertmanager's inhibitions", interval=0.5)
        # the views' reading of the same rules (judge.delivered) mutes exactly what the real Alertmanager muted
        from moescope import judge

        labels = [a["labels"] for a in posted]
        kept = judge.delivered(labels)
        assert {(la["model"], la["alertname"], la["layer"]) for la in labels
                if not any(k is la for k in kept)} == muted
    finally:
        am.stop()
