"""End to end: demo scenario -> exporter -> real Prometheus (rules) -> real Alertmanager -> webhook."""

import pytest

import pipeline
from conftest import ROOT

pytestmark = pytest.mark.integration


def test_collapse_reaches_the_webhook_with_its_runbook(tmp_path):
    got = pipeline.run(tmp_path, "collapse", 90, stop_when=lambda alerts: any(
        a["labels"]["alertname"] == "MoEExpertCollapse" for _, a in alerts)).alerts
    collapse = [(path, a) for path, a in got if a["labels"]["alertname"] == "MoEExpertCollapse"]
    assert collapse, [a["labels"]["alertname"] for _, a in got]
    path, alert = collapse[0]
    assert path == "/critical" and alert["labels"]["severity"] == "critical"
    assert alert["annotations"]["runbook_url"].endswith("/playbooks/MoEExpertCollapse.md")
    assert alert["labels"]["model"] == "tiny-demo" and alert["status"] == "firing"
    assert (ROOT / "playbooks" / "MoEExpertCollapse.md").exists()
    # the Watchdog goes to its own receiver
    assert all(path == "/watchdog" for path, a in got if a["labels"]["alertname"] == "Watchdog")
