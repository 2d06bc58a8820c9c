"""Alert rules, their promtool unit tests, Alertmanager routing, playbooks: checked with the real tools."""

import re
import subprocess

import pytest
import yaml

from conftest import ROOT
from moescope import thresholds
from moescope.alerts import rules, unit_tests
from moescope.metrics import catalogue
from servers import require

PROM = ROOT / "collectors" / "prometheus"
AM = ROOT / "collectors" / "alertmanager" / "alertmanager.yml"


def test_generated_rules_are_stable():
    for path, doc in ((PROM / "moescope-rules.yml", rules.rules_document()),
                      (PROM / "tests" / "moescope-rules.test.yml", unit_tests.tests_document())):
        assert yaml.safe_load(path.read_text()) == doc, f"{path} is stale: run `moescope alerts build`"


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
    for s in rules.specs():
        cases = {"fires", "healthy", "boundary", *(c.name for c in s.cases)} if s.name != "Watchdog" else \
            {"always fires"}
        assert {n.split(" ", 1)[1] for n in names if n.split(" ", 1)[0] == s.name} == cases
    assert {"recording rules sum over ranks", "excess CV in PromQL equals moescope.thresholds.excess_cv"} <= set(names)


def test_production_shapes_and_thin_windows_are_tested():
    """The [at-scale] acceptance cases are among the promtool tests: healthy DeepSeek-V3-shaped and Mixtral-shaped
    activation and uniform routing at low traffic stay silent; a real skew fires (at low traffic and at shape)."""
    tests = {t["name"]: t for t in unit_tests.tests_document()["tests"]}

    def fired(name):
        return bool(tests[name]["alert_rule_test"][0]["exp_alerts"])

    silent = ["MoEActivationRatioOutOfBand healthy deepseek-v3-shape (7.7%)",
              "MoEActivationRatioOutOfBand healthy Mixtral-shaped (13B of 47B)",
              "MoEExpertLoadImbalance uniform routing at low traffic", "MoEDeadExperts uniform routing at low traffic",
              "MoEExpertLoadImbalance healthy deepseek-v3-shape (its worst layer)",
              "MoEDeadExperts healthy deepseek-v3-shape", "MoESlowRank two healthy ranks",
              "MoEExpertLoadImbalance healthy deepseek-v3-shape in a thin window (two requests)",
              "MoEExpertLoadImbalance a skew on deepseek-v3-shape in a thin window is not judged"]
    assert not any(fired(n) for n in silent)
    # the thin-window cases are silent by the slots-per-expert guard alone: their excess CV is over the bar
    bars = thresholds.for_model("deepseek-v3-shape")
    for name in silent[-2:]:
        v = {x["series"].split("{")[0]: float(x["values"].split("x")[0]) for x in tests[name]["input_series"]}
        slots = v["moescope_window_slots_per_expert"] * 256
        assert thresholds.excess_cv(v["moescope_expert_load_cv_ratio"], 256, slots) > bars.load_cv
        assert not bars.judges_imbalance(256, slots) and not bars.imbalanced(v["moescope_expert_load_cv_ratio"], 256,
                                                                            slots)
    assert fired("MoEExpertLoadImbalance a real skew at low traffic")
    assert fired("MoEExpertLoadImbalance a real skew on deepseek-v3-shape")
    # the old fixed band (1.8-2.2%) would have paged on both healthy production shapes
    for name in silent[:2]:
        series = tests[name]["input_series"]
        observed = next(float(x["values"].split("x")[0]) for x in series if "activation_ratio{" in x["series"])
        assert not 0.018 <= observed <= 0.022
    # the low-traffic series are what uniform routing of 1,000 slots over 256 experts gives
    series = tests["MoEExpertLoadImbalance uniform routing at low traffic"]["input_series"]
    noise = next(float(x["values"].split("x")[0]) for x in series if "noise" in x["series"])
    assert noise == pytest.approx(thresholds.noise_cv(256, 1000), rel=1e-5)


def test_every_rule_metric_is_in_the_catalogue_and_every_alert_is_complete():
    known = catalogue.names() | {"up"}
    for s in rules.specs():
        used = {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"\bmoescope_[a-z_]+", s.expr)}
        assert used <= known, (s.name, used - known)
        assert set(s.metrics) <= known
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


@pytest.mark.parametrize("labels,receiver", [
    (["alertname=MoEExpertCollapse", "severity=critical", "model=m", "layer=1"], "critical"),
    (["alertname=MoERouterNonFiniteLogits", "severity=critical"], "critical"),
    (["alertname=MoEExpertLoadImbalance", "severity=warning", "model=m", "layer=1"], "warning"),
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


def test_alertmanager_inhibits_warnings_by_criticals_of_the_same_layer():
    # (that inhibition works in a real Alertmanager is shown by tests/test_detection_matrix.py)
    cfg = yaml.safe_load(AM.read_text())
    first, *cause_rules = cfg["inhibit_rules"]
    assert first["source_matchers"] == ['severity="critical"'] and first["target_matchers"] == ['severity="warning"']
    assert set(first["equal"]) == {"model", "layer"}
    names = {s.name: s for s in rules.specs()}
    for rule in cause_rules:  # a cause mutes its symptom: both must be real alerts, sharing the equal labels
        (src,), (dst,) = rule["source_matchers"], rule["target_matchers"]
        src, dst = src.split('"')[1], dst.split('"')[1]
        assert src in names and dst in names and src != dst
    assert cfg["route"]["group_by"] == ["alertname", "model", "layer"]
