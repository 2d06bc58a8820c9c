"""End to end: demo scenario -> exporter -> real Prometheus (rules) -> real Alertmanager -> webhook."""

import subprocess
import sys
import time

import pytest
import yaml

from conftest import ROOT
from moescope.alerts import rules
from servers import Alertmanager, Prometheus, Webhook, free_port, wait_http

pytestmark = pytest.mark.integration
WARMUP_S = 12


def _pipeline(tmp_path, scenario: str, watch_s: float, stop_when=None):
    """Run the demo under ``scenario``; return the alerts delivered while its exporter was up."""
    rule_file = tmp_path / "rules.yml"
    # The repo's rules with every `for` shortened to 10 s, so a test window of seconds can see them fire.
    rule_file.write_text(yaml.safe_dump(rules.rules_document(rules.Thresholds(for_override="10s")), sort_keys=False))
    hook = Webhook()
    am = Alertmanager(tmp_path, ROOT / "collectors" / "alertmanager" / "alertmanager.yml", hook.port)
    port = free_port()
    demo = subprocess.Popen([sys.executable, "-m", "moescope", "demo", "--no-tui", "--scenario", scenario,
                             "--duration", str(watch_s + 45), "--rate", "8", "--metrics-port", str(port),
                             "--traces", "none"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prom = None
    try:
        wait_http(f"http://127.0.0.1:{port}/metrics", timeout=60)  # scrape only a live exporter
        # Warm-up: the exporter's ratio gauges cover a 60 s window; in its first seconds a handful of tokens
        # make a noisy CV or a "dead" expert, which production's 10-minute `for` would never see.
        time.sleep(WARMUP_S)
        # resend-delay: alerts that fired before Prometheus discovered the Alertmanager are resent within 2 s
        # (the default waits a minute)
        prom = Prometheus(tmp_path, [f"127.0.0.1:{port}"], rule_files=[str(rule_file)], alertmanager=am.address,
                          extra_args=["--rules.alert.resend-delay=2s"])
        deadline = time.monotonic() + watch_s
        while time.monotonic() < deadline:
            if stop_when is not None and stop_when(hook.alerts()):
                break
            time.sleep(0.5)
        assert demo.poll() is None, "the demo ended inside the watch window"
        return hook.alerts()
    finally:
        if prom is not None:
            prom.stop()
        demo.kill()
        am.stop()
        hook.stop()


def test_collapse_reaches_the_webhook_with_its_runbook(tmp_path):
    got = _pipeline(tmp_path, "collapse", 90,
                    stop_when=lambda alerts: any(a["labels"]["alertname"] == "MoEExpertCollapse" for _, a in alerts))
    collapse = [(path, a) for path, a in got if a["labels"]["alertname"] == "MoEExpertCollapse"]
    assert collapse, [a["labels"]["alertname"] for _, a in got]
    path, alert = collapse[0]
    assert path == "/critical" and alert["labels"]["severity"] == "critical"
    assert alert["annotations"]["runbook_url"].endswith("/playbooks/MoEExpertCollapse.md")
    assert alert["labels"]["model"] == "tiny-demo" and alert["status"] == "firing"
    assert (ROOT / "playbooks" / "MoEExpertCollapse.md").exists()


def test_a_healthy_run_fires_nothing_but_the_watchdog(tmp_path):
    got = _pipeline(tmp_path, "healthy", 35)
    names = {a["labels"]["alertname"] for _, a in got if a["status"] == "firing"}
    assert names == {"Watchdog"}, names
    assert all(path == "/watchdog" for path, a in got if a["labels"]["alertname"] == "Watchdog")
