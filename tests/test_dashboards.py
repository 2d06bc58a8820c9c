"""Dashboards as code: stable generation, offline validation, and every panel query answered by a real
Prometheus that scraped demo runs (2 expert-parallel ranks, expert cache, capacity limit; one process with a
baseline and a hot expert)."""

import json
import re
import subprocess
import threading
import time

import pytest

from conftest import ROOT
from moescope import thresholds
from moescope.alerts import rules
from moescope.cli import main
from moescope.dashboards import grafana
from moescope.metrics import catalogue
from helpers import popen_cli, wait_until
from servers import Prometheus, free_port

DASH = ROOT / "dashboards"
# Series a healthy demo may lack, with why (a panel over only these may return nothing):
# (the hot-expert series is absent where no expert is significantly above its reference: the single demo below
# runs a hot expert so that its panels are checked too)
OPTIONAL = {"moescope_gpu_memory": "NVML series exist only on GPU hosts",
            # S-MBU/S-MFU divide by the device's peak: none on a CPU without MOESCOPE_PEAK_* (the demos here);
            # tests/test_efficiency.py queries that panel from a real Prometheus with a peak set
            "moescope_peak_": "the peak is known only on a GPU in moescope.efficiency's table, or when set"}


def test_generated_dashboards_are_stable_and_valid():
    docs = grafana.build_all()
    assert set(docs) == {p.stem for p in DASH.glob("*.json")}
    for name, doc in docs.items():
        assert json.loads((DASH / f"{name}.json").read_text()) == doc, f"{name} stale: moescope dashboards build"
        assert {v["name"] for v in doc["templating"]["list"]} == {"datasource", "model", "rank", "layer"}
        assert doc["uid"] == name and doc["title"].startswith("moescope / ")
        for panel in doc["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
            assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
    layer = next(v for v in docs["moescope-experts"]["templating"]["list"] if v["name"] == "layer")
    assert layer["sort"] == 3  # numerically: 3, 4, ... 60, not 10, 11, ... 3
    heat = docs["moescope-experts"]["panels"][0]
    assert heat["type"] == "heatmap" and heat["options"]["calculate"] is False
    assert heat["options"]["rowsFrame"]["layout"] == "unknown" and heat["targets"][0]["legendFormat"] == "{{expert}}"
    assert heat["gridPos"]["h"] >= 16  # 256 rows need the height
    dist = docs["moescope-experts"]["panels"][1]
    assert dist["options"]["rowsFrame"]["layout"] == "le" and dist["targets"][0]["format"] == "heatmap"
    known = catalogue.exposed_sample_names() | {"ALERTS"}
    for doc in docs.values():
        for _, expr in grafana.queries(doc):
            assert set(re.findall(r"\b(moescope_[a-z_]+|ALERTS)\b", expr)) <= known, expr


def test_colour_steps_and_lines_are_the_alert_bars():
    """Each coloured stat's red step is its alert's bar, the same for every model (no per-model overrides), and
    the rule holds the same number; the hot-expert and rank panels draw their line at the alert's bar."""
    t = thresholds.DEFAULT
    docs = grafana.build_all()
    stats = {p["title"]: p for p in docs["moescope-overview"]["panels"] if p["type"] == "stat"}
    alert_of = {"collapse_top_share": "MoEExpertCollapse", "cache_floor_of_capacity": "MoEExpertCacheHitRateLow",
                "activation_floor": "MoEActivationRatioLow", "hot_factor": "MoEExpertHot",
                "rank_max_over_mean": "MoERankLoadImbalance", "drift_bits": "MoERoutingDrift"}
    exprs = {s.name: s.expr for s in rules.specs(t)}

    def check(steps, bar, kind):
        values = [s["value"] for s in steps]
        colours = [s["color"] for s in steps]
        if kind in ("above", "ratio"):  # red from the bar up (the alert: value > bar)
            assert colours[-1] == "red" and values[-1] == (1 if kind == "ratio" else bar) and values[1] < values[-1]
        elif kind == "floor":  # red under the bar (the alert: value < bar)
            assert colours[:2] == ["red", "yellow"] and values[1] == bar
        else:
            assert colours == ["green", "red"] and values[1] == 1

    assert {title for title, _, _ in grafana.COLOURED} <= set(stats)
    for title, bar, kind in grafana.COLOURED:
        panel = stats[title]
        assert panel["targets"][0]["legendFormat"] == "{{model}}"
        assert not panel["fieldConfig"].get("overrides")
        value = getattr(t, bar) if bar else None
        check(panel["fieldConfig"]["defaults"]["thresholds"]["steps"], value, kind)
        if bar in alert_of:  # the rule judges by the same number
            # (the collapse bar is the floor of a reference's bar: clamp_min(..., 0.75))
            bar_re = rf"([<>] (on \([a-z, ]+\) )?\(?|, ){re.escape(rules.num(value))}\b"
            assert re.search(bar_re, exprs[alert_of[bar]]), (bar, title)
    lines = {p["title"]: p["fieldConfig"]["defaults"] for d in docs.values() for p in d["panels"]
             if p["type"] == "timeseries" and p["fieldConfig"]["defaults"].get("custom", {}).get("thresholdsStyle")}
    bars = sorted(d["thresholds"]["steps"][-1]["value"] for d in lines.values())
    assert bars == sorted([t.hot_factor, t.rank_max_over_mean]), lines.keys()
    # no model name in any query
    for doc in docs.values():
        for _, expr in grafana.queries(doc):
            assert "model=\"$model\"" in expr or "ALERTS" in expr, expr
            assert not re.search(r'model=~?"(?!\$model)', expr), expr


def test_push_to_an_unreachable_grafana_is_a_clear_error(capsys):
    port = free_port()
    assert main(["dashboards", "push", "--url", f"http://127.0.0.1:{port}", "--token", "t"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moescope: error: cannot push moescope-") and f"127.0.0.1:{port}" in err
    assert err.count("\n") == 1


@pytest.mark.integration
def test_every_panel_query_returns_data_from_prometheus(tmp_path):
    port = free_port(4)  # rank 0, rank 1, a third process on port + 2, `moescope serve`'s API port on port + 3
    baseline = tmp_path / "baseline.json"  # a uniform baseline: drift is measured against it
    baseline.write_text(json.dumps({"format": "moescope-baseline-v1", "model": "tiny-demo",
                                    "layers": {str(i): [1.0] * 8 for i in (1, 2, 3)}}))
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port + i}" for i in range(4)])
    serve = None
    try:
        proc = popen_cli("demo", "--no-tui", "--requests", "16", "--rate", "0", "--world-size", "2", "--cache-size",
                         "4", "--capacity-factor", "1.0", "--metrics-port", str(port), "--rebalance-steps", "10",
                         "--linger", "600", "--json", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # (Both linger far beyond the test, killed at its end: a run that ended would go stale in Prometheus
        # between the wait below and the last query on a loaded machine.)
        # A single-process demo beside it: the canary (flip ratio) and drift series (expert parallel runs
        # have no canary yet), and a hot expert (expert 3 of layer 1) for the hot-expert panels. It serves a
        # steady 2 requests/s until killed: the hot-expert series exists only while the 60 s window holds requests
        # (12 requests at once, then lingering, left an empty window when the wait below took over a minute on a
        # loaded machine, and the hot-expert panels came back empty: a fresh-clone run of 2026-12-05).
        single = popen_cli("demo", "--no-tui", "--rate", "2", "--duration", "600", "--metrics-port", str(port + 2),
                           "--baseline", str(baseline), "--canary-interval", "0.2", "--scenario", "hot=1:3:4",
                           "--traces", "none", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # The serving row: a real `moescope serve` (its API port's /metrics), answering streamed requests.
        serve = popen_cli("serve", "--port", str(port + 3), "--metrics-port", "-1", "--traces", "none",
                          "--canary-interval", "0", "--max-batch", "2", stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
        clients = threading.Thread(target=_serve_traffic, args=(f"http://127.0.0.1:{port + 3}", 120), daemon=True)
        clients.start()

        def readings():  # live: both ranks and the single run (the server exports serving series only)
            return {"targets": prom.scalar('count(moescope_build_info{model="tiny-demo"})'),
                    "steps": prom.scalar('sum(moescope_steps_total{model="tiny-demo"})'),
                    "served": prom.scalar('sum(moescope_serve_e2e_request_latency_seconds_count{model="tiny-demo"})'),
                    # the hot expert is exported once the window holds enough finished requests to call it
                    # significant: on a loaded machine that takes longer than the other series
                    "hot": prom.scalar('count(moescope_expert_hot_factor_ratio{model="tiny-demo"})'),
                    "2-rank run": "running" if proc.poll() is None else proc.returncode}

        wait_until(readings, timeout=240, what="every target's series in Prometheus while the runs linger",
                   until=lambda r: r["targets"] == 3 and r["steps"] and r["served"] and r["hot"]
                   and r["2-rank run"] == "running", interval=1)
        time.sleep(6)  # a few more scrapes: rates need several samples
        failures = check_panels(prom, "tiny-demo", "1")
        assert not failures, "\n".join(failures)
        hot = prom.query('moescope_expert_hot_factor_ratio{model="tiny-demo"}')
        assert ("1", "3") in {(h["metric"]["layer"], h["metric"]["expert"]) for h in hot}, hot
        views = expert_views(prom, "tiny-demo", "1")
        assert views == {"heatmap_rows": 8, "hottest": 8, "coldest": 8, "layers": 3,
                         "distribution_buckets": len(catalogue.RELATIVE_LOAD_BUCKETS) + 1}, views
    finally:
        for p in (proc, single, serve):
            if p is not None and p.poll() is None:
                p.kill()
        prom.stop()


def _serve_traffic(url: str, seconds: float) -> None:
    """Streamed completions against ``url`` until ``seconds`` passed (the server may still be starting)."""
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
                    "model": "tiny-demo", "prompt": "def f(x):", "max_tokens": 8, "stream": True}) as r:
                for _ in r.iter_lines():
                    pass
            httpx.post(url + "/v1/completions", json={"model": "tiny-demo"}, timeout=30)  # a refusal (400)
        except httpx.HTTPError:
            time.sleep(0.5)


def check_panels(prom, model: str, layer: str, at: float | None = None) -> list[str]:
    """Every query of every panel, variables filled in, that returns nothing from ``prom`` (``OPTIONAL``
    series excepted)."""
    at = at or time.time()
    failures = []
    for name, doc in grafana.build_all().items():
        for title, expr in grafana.queries(doc):
            q = (expr.replace("$model", model).replace("$rank", ".*").replace("$layer", layer)
                 .replace("$__rate_interval", "20s"))
            if not prom.query(q, at=at) and not any(series in q for series in OPTIONAL):
                failures.append(f"{name} / {title}: {q}")
    return failures


def expert_views(prom, model: str, layer: str) -> dict:
    """What the expert panels show for one layer: rows of the heatmap, hottest / coldest, distribution."""
    panels = {p["title"]: p["targets"][0]["expr"] for p in grafana.build_all()["moescope-experts"]["panels"]}

    def run(prefix):
        expr = next(e for t, e in panels.items() if t.startswith(prefix))
        q = (expr.replace("$model", model).replace("$rank", ".*").replace("$layer", layer)
             .replace("$__rate_interval", "20s"))
        return prom.query(q)

    return {"heatmap_rows": len(run("Expert x time")), "hottest": len(run("Hottest 8")),
            "coldest": len(run("Coldest 8")), "distribution_buckets": len(run("Experts by load")),
            "layers": len(run("Load CV beyond sampling noise, by layer"))}
