"""End to end: demo scenario -> exporter -> real Prometheus (rules) -> real Alertmanager -> webhook."""

import json

import pytest

import pipeline
from helpers import run_cli
from conftest import ROOT

pytestmark = pytest.mark.integration


def test_collapse_reaches_the_webhook_with_its_runbook(tmp_path):
    traces = tmp_path / "traces.sqlite"

    def diagnose(prom):  # `moescope diagnose --prometheus` reads the same alert back from the real server
        run = run_cli("diagnose", "--traces", str(traces), "--prometheus", prom.url, "--json", timeout=120)
        return run.returncode, json.loads(run.stdout)

    result = pipeline.run(tmp_path, "collapse", 90, demo_args=["--traces", str(traces)], during=diagnose,
                          stop_when=lambda alerts: any(a["labels"]["alertname"] == "MoEExpertCollapse"
                                                       for _, a in alerts))
    got = result.alerts
    code, report = result.during
    causes = [f["cause"] for f in report["findings"] if f["severity"] == "critical"]
    assert code == 1 and "collapse" in causes and "alert:MoEExpertCollapse" in causes, report["findings"]
    collapse = [(path, a) for path, a in got if a["labels"]["alertname"] == "MoEExpertCollapse"]
    assert collapse, [a["labels"]["alertname"] for _, a in got]
    path, alert = collapse[0]
    assert path == "/critical" and alert["labels"]["severity"] == "critical"
    assert alert["annotations"]["runbook_url"].endswith("/playbooks/MoEExpertCollapse.md")
    assert alert["labels"]["model"] == "tiny-demo" and alert["status"] == "firing"
    assert (ROOT / "playbooks" / "MoEExpertCollapse.md").exists()
    # the Watchdog goes to its own receiver
    assert all(path == "/watchdog" for path, a in got if a["labels"]["alertname"] == "Watchdog")
