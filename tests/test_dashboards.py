"""Dashboards as code: stable generation, offline validation, and every panel query answered by a real
Prometheus that scraped a demo run (2 expert-parallel ranks, expert cache, capacity limit)."""

import json
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from moescope import thresholds
from moescope.alerts import rules
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
        for _, expr in build.queries(doc):
            assert set(re.findall(r"\b(moescope_[a-z_]+|ALERTS)\b", expr)) <= known, expr


def test_colour_steps_equal_the_alert_bars_for_every_model():
    """Each coloured stat's red step is its alert's bar: the default for every model, an override named by the
    model (the stat's legend) for each model with its own bar; and the rules hold the same number."""
    t = thresholds.DEFAULT
    stats = {p["title"]: p for p in build.build_all()["moescope-overview"]["panels"] if p["type"] == "stat"}
    alert_of = {"load_cv": "MoEExpertLoadImbalance", "collapse_top_share": "MoEExpertCollapse",
                "cache_hit_rate": "MoEExpertCacheHitRateLow", "activation_band": "MoEActivationRatioOutOfBand"}
    exprs = {s.name: s.expr for s in rules.specs(t)}

    def check(steps, bar, kind):
        values = [s["value"] for s in steps]
        colours = [s["color"] for s in steps]
        if kind == "above":  # red from the bar up (the alert: value > bar)
            assert colours[-1] == "red" and values[-1] == bar and values[1] < bar
        elif kind == "floor":  # red under the bar (the alert: value < bar)
            assert colours[:2] == ["red", "yellow"] and values[1] == bar
        elif kind == "band":  # green inside the band
            assert colours == ["red", "green", "red"] and values[1:] == list(bar)
        else:
            assert colours == ["green", "red"] and values[1] == 1

    assert {title for title, _, _ in build.COLOURED} <= set(stats)
    for title, bar, kind in build.COLOURED:
        panel = stats[title]
        assert panel["targets"][0]["legendFormat"] == "{{model}}"  # the field name the overrides match
        check(panel["fieldConfig"]["defaults"]["thresholds"]["steps"], getattr(t.default, bar) if bar else None, kind)
        overrides = {o["matcher"]["options"]: o["properties"][0]["value"]["steps"]
                     for o in panel["fieldConfig"].get("overrides", [])}
        own = {m: getattr(t.for_model(m), bar) for m in t.by_model} if bar else {}
        own = {m: v for m, v in own.items() if v != getattr(t.default, bar)}
        assert set(overrides) == set(own), title
        for model, value in own.items():
            check(overrides[model], value, kind)
            if bar in alert_of and kind != "band":  # the rule judges that model by the same number
                assert re.search(rf'model="{model}"[^)]*\)*[^<>]*[<>] {value}\b', exprs[alert_of[bar]]), (model, bar)
    # the bars a healthy demo sits under are not the old fixed 0.10/0.15 CV steps
    assert thresholds.for_model("tiny-demo").load_cv == 0.25


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
        failures = check_panels(prom, "tiny-demo", "1")
        assert not failures, "\n".join(failures)
        views = expert_views(prom, "tiny-demo", "1")
        assert views == {"heatmap_rows": 8, "hottest": 8, "coldest": 8, "layers": 3,
                         "distribution_buckets": len(catalogue.RELATIVE_LOAD_BUCKETS) + 1}, views
    finally:
        for p in (proc, single):
            if p.poll() is None:
                p.kill()
        prom.stop()


def check_panels(prom, model: str, layer: str, at: float | None = None) -> list[str]:
    """Every query of every panel, variables filled in, that returns nothing from ``prom`` (GPU series
    excepted on hosts without one). Shared with the detection matrix, which runs it at deepseek-v3-shape."""
    at = at or time.time()
    failures = []
    for name, doc in build.build_all().items():
        for title, expr in build.queries(doc):
            q = (expr.replace("$model", model).replace("$rank", ".*").replace("$layer", layer)
                 .replace("$__rate_interval", "20s"))
            if not prom.query(q, at=at) and NO_GPU_OK not in q:
                failures.append(f"{name} / {title}: {q}")
    return failures


def expert_views(prom, model: str, layer: str) -> dict:
    """What the expert panels show for one layer: rows of the heatmap, hottest / coldest, distribution."""
    panels = {p["title"]: p["targets"][0]["expr"] for p in build.build_all()["moescope-experts"]["panels"]}

    def run(prefix):
        expr = next(e for t, e in panels.items() if t.startswith(prefix))
        q = (expr.replace("$model", model).replace("$rank", ".*").replace("$layer", layer)
             .replace("$__rate_interval", "20s"))
        return prom.query(q)

    return {"heatmap_rows": len(run("Expert x time")), "hottest": len(run("Hottest 8")),
            "coldest": len(run("Coldest 8")), "distribution_buckets": len(run("Experts by load")),
            "layers": len(run("Load CV beyond sampling noise, by layer"))}
