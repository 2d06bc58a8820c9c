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


def test_colour_steps_are_the_alert_bars_and_panels_draw_the_bar_series():
    """Each coloured stat's red step is its alert's bar, the same for every model (no per-model overrides): the
    value ``Thresholds.bars`` gives the judgement where nothing moves it (a reference at the fair share, a cache
    holding every expert, a config's activation of 1, no drift noise), the bar series the rule compares with. No
    panel draws a line typed from a number: every judgement's bar is drawn from its series (and its clear bar where
    the rule holds against one)."""
    t = thresholds.DEFAULT
    docs = grafana.build_all()
    stats = {p["title"]: p for p in docs["moescope-overview"]["panels"] if p["type"] == "stat"}
    neutral = t.bars(["fair"], [0.0], [0.0], [0.0], [1.0], 1.0)
    judgement_of = {"collapse_top_share": "collapse", "cache_floor_of_capacity": "cache",
                    "activation_floor": "activation", "hot_factor": "hot", "rank_max_over_mean": "rank_load",
                    "drift_bits": "drift"}
    exprs = {s.name: s.expr for s in rules.specs(t)}
    alert_of = {"collapse": "MoEExpertCollapse", "cache": "MoEExpertCacheHitRateLow",
                "activation": "MoEActivationRatioLow", "hot": "MoEExpertHot", "rank_load": "MoERankLoadImbalance",
                "drift": "MoERoutingDrift"}

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
        if bar in judgement_of:  # the rule judges by the bar series, which holds the same number
            judgement = judgement_of[bar]
            series = neutral.model[judgement] if judgement in neutral.model else neutral.bar[judgement][0]
            assert series == pytest.approx(value), (bar, series)
            assert f'{rules.BAR}{{judgement="{judgement}"}}' in exprs[alert_of[judgement]], judgement
    panels = [p for d in docs.values() for p in d["panels"]]
    assert not [p["title"] for p in panels if p["fieldConfig"]["defaults"].get("custom", {}).get("thresholdsStyle")]
    drawn = {j: [p["title"] for p in panels if any(f'judgement="{j}"' in t["expr"] for t in p.get("targets", ()))]
             for j in (*thresholds.LAYER_JUDGEMENTS, *thresholds.MODEL_JUDGEMENTS)}
    assert all(drawn.values()), [j for j, titles in drawn.items() if not titles]
    for j in thresholds.CLEARED:  # held against its clear bar: drawn beside the bar
        assert any(f'{rules.CLEAR_BAR}{{' in t["expr"] and f'judgement="{j}"' in t["expr"] for p in panels
                   for t in p.get("targets", ())), j
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
    """Every panel query returns data from a real Prometheus scraping real exporters (the reference runtime
    instrumented), and the panel that draws each judgement's bar returns the bar the exporter exports: the value
    worked out from the other series (``_naive_bar``), for every judgement of ``Thresholds.bars``."""
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
        bars = judgement_bars(prom, "tiny-demo", "1")
        assert set(bars) == {*thresholds.LAYER_JUDGEMENTS, *thresholds.MODEL_JUDGEMENTS}, bars
        wrong = {j: got for j, got in bars.items() if not (got[0] is not None and got[0] == pytest.approx(got[1]))}
        assert not wrong, wrong
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


def _by_instance(prom, expr: str, at: float) -> dict[str, tuple[float, dict]]:
    return {r["metric"]["instance"]: (float(r["value"][1]), r["metric"]) for r in prom.query(expr, at=at)}


def _naive_bar(prom, judgement: str, model: str, layer: str, at: float) -> float | None:
    """The bar a panel must draw for ``judgement`` (the max over the model's exporters, as the panels aggregate),
    worked out from the other series Prometheus holds and docs/alerts.md's formulas, written out here: the
    reference's CV and top share, the drift noise, the cache's capacity, the config's activation ratio."""
    t = thresholds.DEFAULT
    constant = {"hot": t.hot_factor, "dead": 0.0, "rank_load": t.rank_max_over_mean, "flips": t.flip_ratio,
                "drops": t.drop_ratio, "all_to_all": t.all_to_all_p99_s, "fetch": t.fetch_p99_s,
                "slow_rank_share": t.slow_rank_share, "slow_rank_wait": t.slow_rank_wait_s,
                "memory": float(t.memory_capacity_bytes)}
    if judgement in constant:
        return constant[judgement]
    sel = f'model="{model}", layer="{layer}"'
    if judgement == "activation":
        return max(t.activation_floor * v for v, _ in _by_instance(
            prom, f'moescope_activation_expected_ratio{{model="{model}"}}', at).values())
    if judgement == "cache":  # (one layer of the worst five: the panel's floors, layer by layer)
        return max(t.cache_floor_of_capacity * v for v, _ in _by_instance(
            prom, f"moescope_expert_cache_capacity_ratio{{{sel}}}", at).values())
    if judgement == "drift":
        return max(v + t.drift_bits for v, _ in _by_instance(prom, f"moescope_routing_drift_noise_bits{{{sel}}}",
                                                              at).values())
    if judgement == "imbalance":  # none while a reference is being learned (no reference series)
        refs = _by_instance(prom, f"moescope_reference_load_cv_ratio{{{sel}}}", at).values()
        bars = [t.imbalance_cv if m["reference"] == "fair" else t.imbalance_baseline_factor * v
                + t.imbalance_baseline_margin for v, m in refs]
        return max(bars) if bars else None
    # collapse: half of the way from the reference's top share to 1, at least 0.75; a learned reference capped at
    # 0.75; an exporter routing the layer with no reference yet: 0.875, the ceiling
    refs = _by_instance(prom, f"moescope_reference_top_share_ratio{{{sel}}}", at)
    routed = _by_instance(prom, f"moescope_expert_load_top_share_ratio{{{sel}}}", at)
    bars = []
    for instance in routed:
        v, m = refs.get(instance, (None, {}))
        ref = t.collapse_top_share if v is None else v if m["reference"] == "baseline" else min(v, t.collapse_top_share)
        bars.append(max(t.collapse_top_share, ref + t.collapse_rise * (1 - ref)))
    return max(bars)


def judgement_bars(prom, model: str, layer: str) -> dict[str, tuple[float | None, float | None]]:
    """Per judgement: (the bar its panel query returns from ``prom``, the bar worked out from the other series,
    ``_naive_bar``), both at one instant. The panel: the first query of any dashboard that draws the judgement's
    bar series (the bar itself: its max over the exporters, or over each layer's)."""
    at = time.time()
    out = {}
    draws = re.compile(rf"^max( by \(layer\))? ?\({rules.BAR}\{{")
    for j in (*thresholds.LAYER_JUDGEMENTS, *thresholds.MODEL_JUDGEMENTS):
        expr = next(e for doc in grafana.build_all().values() for _, e in grafana.queries(doc)
                    if draws.match(e) and f'judgement="{j}"' in e)
        q = (expr.replace("$model", model).replace("$rank", ".*").replace("$layer", layer)
             .replace("$__rate_interval", "20s"))
        got = [r for r in prom.query(q, at=at) if r["metric"].get("layer", layer) == layer]  # (cache: by layer)
        out[j] = (max(float(r["value"][1]) for r in got) if got else None, _naive_bar(prom, j, model, layer, at))
    return out


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
