"""The whole alerting path for one scenario: demo -> exporter -> real Prometheus (the repo's rules) -> real
Alertmanager (the repo's routing and inhibitions) -> a webhook. Shared by the end-to-end alerting tests."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field

import yaml

from helpers import popen_cli
from conftest import ROOT
from moescope.alerts import rules
from servers import Alertmanager, Prometheus, Webhook, free_port, wait_http

WARMUP_S = 12
# A hot expert at the shapes (48 x 128, 58 x 256 experts) on two shared cores: the engine finishes a request every
# few seconds, and one expert's share is judged against its small-sample bound (sampling.var_upper: inf under 5
# finished requests, 3.4x the variance at 20), so a 60 s window holds too few requests to single out one expert
# among thousands at the family's 0.1%. Hot runs at the shapes use a 240 s exporter window (~20 requests here) and
# watch 300 s; production traffic fills a 60 s window many times over. (The detection matrix and
# benchmarks/detection.py both read these.)
SHAPE_HOT_WINDOW_S, SHAPE_HOT_WATCH_S = 240, 300


@dataclass
class Delivered:
    alerts: list  # (receiver path, alert) as the webhook got them
    first: dict  # alertname -> seconds from the first scrape to its first firing delivery
    scraped_at: float  # time.monotonic() of Prometheus' start
    during: object = None  # what the ``during`` callback returned
    timeline: list = field(default_factory=list)  # (seconds from the first scrape, alert) per delivered alert


def run(tmp_path, scenario: str, watch_s: float, *, stop_when=None, demo_args=(), settle_s: float = 0.0,
        thresholds: rules.Thresholds | None = None, during=None, model: str = "tiny-demo", rate: float = 8,
        traces: str = "none", scrape_interval: str = "1s", start_timeout_s: float = 90) -> Delivered:
    """Run the demo of ``model`` under ``scenario`` and watch for ``watch_s``; stop early once
    ``stop_when(alerts)`` holds and ``settle_s`` more seconds passed (so an alert that comes with the expected one
    is seen too). ``during(prometheus)`` runs then, while everything is still up. ``traces``: the demo's trace
    store (``none``: no store). ``scrape_interval``: Prometheus' (and so its scrape timeout). ``start_timeout_s``:
    how long the demo may take to serve metrics (several large models starting at once on two cores take long)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    rule_file = tmp_path / "rules.yml"
    # The repo's rules with every `for` shrunk 30-fold (10m -> 20s, 5m -> 10s), so a test window of seconds can
    # see them fire, in production's order (a cause with a shorter `for` still fires before its symptoms).
    t = thresholds or rules.Thresholds(for_scale=1 / 30)
    rule_file.write_text(yaml.safe_dump(rules.rules_document(t), sort_keys=False))
    hook = Webhook()
    am = Alertmanager(tmp_path, ROOT / "collectors" / "alertmanager" / "alertmanager.yml", hook.port)
    port = free_port(2 if "slow-rank" in scenario else 1)  # 2 ranks: rank r serves metrics on port + r
    log = open(tmp_path / "demo.log", "wb")
    demo = popen_cli("demo", "--no-tui", "--model", model, "--scenario", scenario, "--duration", str(watch_s + 60),
                     "--rate", str(rate), "--metrics-port", str(port), "--traces", str(traces), *demo_args, stdout=log,
                     stderr=subprocess.STDOUT)
    prom = None
    try:
        targets = [f"127.0.0.1:{port}"]
        if "slow-rank" in scenario:  # 2 ranks: rank r serves metrics on port + r
            targets.append(f"127.0.0.1:{port + 1}")
        for target in targets:
            wait_http(f"http://{target}/metrics", timeout=start_timeout_s)  # scrape only live exporters
        # Warm-up: the exporter's ratio gauges cover a 60 s window; in its first seconds a handful of tokens
        # make a noisy CV or a "dead" expert, which production's 10-minute `for` would never see.
        time.sleep(WARMUP_S)
        # resend-delay: alerts that fired before Prometheus discovered the Alertmanager are resent within 2 s
        # (the default waits a minute)
        prom = Prometheus(tmp_path, targets, rule_files=[str(rule_file)], alertmanager=am.address,
                          extra_args=["--rules.alert.resend-delay=2s"], scrape_interval=scrape_interval)
        start = time.monotonic()
        deadline, met = start + watch_s, None
        while time.monotonic() < deadline:
            if met is None and stop_when is not None and stop_when(hook.alerts()):
                met = time.monotonic()
            if met is not None and time.monotonic() - met >= settle_s:
                break
            time.sleep(0.5)
        assert demo.poll() is None, "the demo ended inside the watch window: " + \
            (tmp_path / "demo.log").read_text()[-2000:]
        extra = during(prom) if during is not None else None
        got = hook.alerts()
        first = {}
        for name in {a["labels"]["alertname"] for _, a in got}:
            at = hook.first_arrival(name)
            if at is not None:
                first[name] = round(at - start, 1)
        timeline = [(round(t - start, 1), a) for t, a in hook.timeline()]
        return Delivered(got, first, start, extra, timeline)
    finally:
        if prom is not None:
            prom.stop()
        demo.kill()
        demo.wait()
        log.close()
        am.stop()
        hook.stop()


def firing(delivered: Delivered) -> set[str]:
    return {a["labels"]["alertname"] for _, a in delivered.alerts if a["status"] == "firing"}
