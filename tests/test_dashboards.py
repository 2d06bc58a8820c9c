"""Dashboards as code: stable generation, offline validation, and every panel query answered by a real
Prometheus that scraped a demo run (2 expert-parallel ranks, expert cache, capacity limit)."""

import json
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from moescope.cli import main
from moescope.dashboards import build
from moescope.metrics import catalogue
from servers import Prometheus, free_port

DASH = ROOT / "dashboards"
NO_GPU_OK = "moescope_gpu_memory"  # NVML series exist only on GPU hosts


def test_generated_dashboards_are_stable_and_valid():
    docs = build.build_all()
    assert set(docs) == {p.stem for p in DASH.glob("*.json")}
    for name, doc in docs.items():
        assert json.loads((DASH / f"{name}.json").read_text()) == doc, f"{name} stale: moescope dashboards build"
        assert {v["name"] for v in doc["templating"]["list"]} == {"datasource", "model", "rank", "layer"}
        assert doc["uid"] == name and doc["title"].startswith("moescope / ")
        for panel in doc["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
            assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
    heat = docs["moescope-experts"]["panels"][0]
    assert heat["type"] == "heatmap" and heat["options"]["calculate"] is False
    assert heat["options"]["rowsFrame"]["layout"] == "unknown" and heat["targets"][0]["legendFormat"] == "{{expert}}"
    known = catalogue.exposed_sample_names() | {"ALERTS"}
    for doc in docs.values():
        for _, expr in build.queries(doc):
            assert set(re.findall(r"\b(moescope_[a-z_]+|ALERTS)\b", expr)) <= known, expr


def test_push_to_an_unreachable_grafana_is_a_clear_error(capsys):
    port = free_port()
    assert main(["dashboards", "push", "--url", f"http://127.0.0.1:{port}", "--token", "t"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moescope: error: cannot push moescope-") and f"127.0.0.1:{port}" in err
    assert err.count("\n") == 1


@pytest.mark.integration
def test_every_panel_query_returns_data_from_prometheus(tmp_path):
    port = free_port(3)  # rank 0, rank 1, and a third process on port + 2
    baseline = tmp_path / "baseline.json"  # a uniform baseline: drift is measured against it
    baseline.write_text(json.dumps({"format": "moescope-baseline-v1", "model": "tiny-demo",
                                    "layers": {str(i): [1.0] * 8 for i in (1, 2, 3)}}))
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}", f"127.0.0.1:{port + 2}"])
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moescope", "demo", "--no-tui", "--requests", "16", "--rate", "0",
             "--world-size", "2", "--cache-size", "4", "--capacity-factor", "1.0", "--metrics-port", str(port),
             "--linger", "30", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # A single-process demo beside it: the canary (flip ratio) and drift series (expert parallel runs
        # have no canary yet).
        single = subprocess.Popen(
            [sys.executable, "-m", "moescope", "demo", "--no-tui", "--requests", "12", "--rate", "0",
             "--metrics-port", str(port + 2), "--baseline", str(baseline), "--canary-interval", "0.2",
             "--linger", "30", "--traces", "none"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # wait until Prometheus has the run's final counters from both ranks
            n = prom.scalar('count(moescope_build_info{model="tiny-demo"})') - 1 \
                if prom.scalar('count(moescope_build_info{model="tiny-demo"})') else None
            steps = prom.scalar('sum(moescope_steps_total{model="tiny-demo"})')
            if n == 2 and steps and proc.poll() is None and time.monotonic() > 0:
                time.sleep(6)  # a few more scrapes: rates need several samples
                break
            time.sleep(1)
        at = time.time()
        failures = []
        for name, doc in build.build_all().items():
            for title, expr in build.queries(doc):
                q = (expr.replace("$model", "tiny-demo").replace("$rank", ".*").replace("$layer", "1")
                     .replace("$__rate_interval", "20s"))
                if not prom.query(q, at=at) and NO_GPU_OK not in q:
                    failures.append(f"{name} / {title}: {q}")
        assert not failures, "\n".join(failures)
    finally:
        for p in (proc, single):
            if p.poll() is None:
                p.kill()
        prom.stop()
