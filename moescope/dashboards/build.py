"""Grafana dashboards as code (grafana-foundation-sdk, Grafana 11.6 line), written to dashboards/*.json.

Every panel query uses the template variables ``$datasource``, ``$model``, ``$rank`` (multi) and ``$layer``
(single), so one dashboard serves every model and rank. tests/test_dashboards.py runs every query of every
panel, variables filled in, against a real Prometheus that scraped a demo run.
"""

from __future__ import annotations

import json
from pathlib import Path

SEL = 'model="$model", rank=~"$rank"'
LSEL = f'{SEL}, layer="$layer"'


def _sdk():
    from grafana_foundation_sdk.builders import dashboard, heatmap, prometheus, stat, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    return dashboard, heatmap, prometheus, stat, timeseries, JSONEncoder


def _variables(dash, dashboard):
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    dash = dash.with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    dash = dash.with_variable(dashboard.QueryVariable("model").label("Model").datasource(ds)
                              .query("label_values(moescope_build_info, model)").refresh(2))
    dash = dash.with_variable(dashboard.QueryVariable("rank").label("Rank").datasource(ds).multi(True)
                              .include_all(True).all_value(".*")
                              .query('label_values(moescope_build_info{model="$model"}, rank)').refresh(2))
    dash = dash.with_variable(dashboard.QueryVariable("layer").label("Layer").datasource(ds)
                              .query('label_values(moescope_router_tokens_total{model="$model"}, layer)')
                              .refresh(2))
    return dash, ds


def _q(prometheus, expr: str, legend: str = "", exemplar: bool = False):
    q = prometheus.Dataquery().expr(expr).legend_format(legend or "__auto")
    return q.exemplar(True) if exemplar else q


def _stat(stat, prometheus, ds, title, expr, unit, steps, x, y, w=4):
    from grafana_foundation_sdk.builders.dashboard import ThresholdsConfig
    from grafana_foundation_sdk.models.dashboard import Threshold, ThresholdsMode

    thresholds = ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(
        [Threshold(value=v, color=c) for v, c in steps])
    return (stat.Panel().title(title).datasource(ds).unit(unit).thresholds(thresholds)
            .with_target(_q(prometheus, expr)).grid_pos(_pos(x, y, w, 4)))


def _pos(x, y, w, h):
    from grafana_foundation_sdk.models.dashboard import GridPos

    return GridPos(h=h, w=w, x=x, y=y)


def _ts(timeseries, prometheus, ds, title, targets, unit, x, y, w=12, h=8):
    p = timeseries.Panel().title(title).datasource(ds).unit(unit).grid_pos(_pos(x, y, w, h))
    for t in targets:
        p = p.with_target(t)
    return p


def overview():
    dashboard, heatmap, prometheus, stat, timeseries, _ = _sdk()
    dash = (dashboard.Dashboard("moescope / Overview").uid("moescope-overview").tags(["moescope", "moe"])
            .refresh("10s").time("now-30m", "now"))
    dash, ds = _variables(dash, dashboard)
    hit = (f"sum(rate(moescope_expert_cache_hits_total{{{SEL}}}[$__rate_interval])) / "
           f"sum(rate(moescope_expert_cache_lookups_total{{{SEL}}}[$__rate_interval]))")
    stats = [
        ("Max load CV", f"max(moescope_expert_load_cv_ratio{{{SEL}}})", "none", [(None, "green"), (0.10, "yellow"), (0.15, "red")]),
        ("Top expert share", f"max(moescope_expert_load_top_share_ratio{{{SEL}}})", "percentunit",
         [(None, "green"), (0.5, "yellow"), (0.75, "red")]),
        ("Dead experts", f"sum(moescope_dead_experts{{{SEL}}})", "none", [(None, "green"), (1, "red")]),
        ("Cache hit rate", hit, "percentunit", [(None, "red"), (0.85, "yellow"), (0.95, "green")]),
        ("Activation ratio", f"avg(moescope_activation_ratio{{{SEL}}})", "percentunit", [(None, "blue")]),
        ("Non-finite logits (5m)", f"sum(increase(moescope_router_nonfinite_logits_total{{{SEL}}}[5m]))", "none",
         [(None, "green"), (1, "red")]),
    ]
    for i, (title, expr, unit, steps) in enumerate(stats):
        dash = dash.with_panel(_stat(stat, prometheus, ds, title, expr, unit, steps, 4 * i, 0))
    dash = dash.with_panel(_stat(stat, prometheus, ds, "Firing alerts",
                                 'count(ALERTS{alertstate="firing", alertname!="Watchdog"}) or vector(0)', "none",
                                 [(None, "green"), (1, "red")], 0, 4, 6))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Tokens / s", [
        _q(prometheus, f"sum by (phase) (rate(moescope_tokens_total{{{SEL}}}[$__rate_interval]))", "{{phase}}")],
        "none", 6, 4, 18, 6))
    lat = "moescope_token_latency_seconds_bucket"
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Token latency (exemplars: request ids)", [
        _q(prometheus, f"histogram_quantile(0.5, sum by (le) (rate({lat}{{{SEL}}}[$__rate_interval])))", "p50", True),
        _q(prometheus, f"histogram_quantile(0.99, sum by (le) (rate({lat}{{{SEL}}}[$__rate_interval])))", "p99",
           True)], "s", 0, 10))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Step time p99 by phase", [
        _q(prometheus, "histogram_quantile(0.99, sum by (le, phase) (rate(moescope_step_seconds_bucket"
           f"{{{SEL}}}[$__rate_interval])))", "{{phase}}", True)], "s", 12, 10))
    return dash


def experts():
    dashboard, heatmap, prometheus, stat, timeseries, _ = _sdk()
    from grafana_foundation_sdk.models.common import HeatmapCellLayout

    dash = (dashboard.Dashboard("moescope / Experts").uid("moescope-experts").tags(["moescope", "moe"])
            .refresh("10s").time("now-30m", "now"))
    dash, ds = _variables(dash, dashboard)
    hm = (heatmap.Panel().title("Expert x time: slots/s, layer $layer").datasource(ds).grid_pos(_pos(0, 0, 24, 10))
          .calculate(False).rows_frame(heatmap.RowsHeatmapOptions().layout(HeatmapCellLayout.UNKNOWN))
          .with_target(_q(prometheus, f"sum by (expert) (rate(moescope_expert_tokens_total{{{LSEL}}}"
                                      "[$__rate_interval]))", "{{expert}}")))
    dash = dash.with_panel(hm)
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Share of slots per expert, layer $layer", [
        _q(prometheus, f"sum by (expert) (rate(moescope_expert_tokens_total{{{LSEL}}}[$__rate_interval])) / "
           f"ignoring (expert) group_left sum(rate(moescope_expert_tokens_total{{{LSEL}}}[$__rate_interval]))",
           "expert {{expert}}")], "percentunit", 0, 10))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Load CV and top share by layer", [
        _q(prometheus, f"max by (layer) (moescope_expert_load_cv_ratio{{{SEL}}})", "CV L{{layer}}"),
        _q(prometheus, f"max by (layer) (moescope_expert_load_top_share_ratio{{{SEL}}})", "top share L{{layer}}")],
        "none", 12, 10))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Dead experts by layer", [
        _q(prometheus, f"max by (layer) (moescope_dead_experts{{{SEL}}})", "L{{layer}}")], "none", 0, 18))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Canary flip ratio and drift from baseline", [
        _q(prometheus, f"max by (layer) (moescope_routing_flip_ratio{{{SEL}}})", "flips L{{layer}}"),
        _q(prometheus, f"max by (layer) (moescope_routing_drift_jsd_bits{{{SEL}}})", "drift L{{layer}} (bits)")],
        "none", 0, 26))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Router entropy and margin by layer", [
        _q(prometheus, f"avg by (layer) (moescope_router_entropy_ratio{{{SEL}}})", "entropy L{{layer}}"),
        _q(prometheus, f"avg by (layer) (moescope_router_margin_ratio{{{SEL}}})", "margin L{{layer}}")],
        "percentunit", 12, 18))
    return dash


def cache_all_to_all():
    dashboard, heatmap, prometheus, stat, timeseries, _ = _sdk()
    dash = (dashboard.Dashboard("moescope / Cache and all-to-all").uid("moescope-cache-a2a")
            .tags(["moescope", "moe"]).refresh("10s").time("now-30m", "now"))
    dash, ds = _variables(dash, dashboard)
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Expert cache hit rate by layer", [
        _q(prometheus, f"sum by (layer) (rate(moescope_expert_cache_hits_total{{{SEL}}}[$__rate_interval])) / "
           f"sum by (layer) (rate(moescope_expert_cache_lookups_total{{{SEL}}}[$__rate_interval]))", "L{{layer}}")],
        "percentunit", 0, 0))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Expert fetch (switch) latency", [
        _q(prometheus, "histogram_quantile(0.99, sum by (le) (rate(moescope_expert_fetch_seconds_bucket"
           f"{{{SEL}}}[$__rate_interval])))", "p99"),
        _q(prometheus, "histogram_quantile(0.5, sum by (le) (rate(moescope_expert_fetch_seconds_bucket"
           f"{{{SEL}}}[$__rate_interval])))", "p50")], "s", 12, 0))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "All-to-all p99 by rank and op", [
        _q(prometheus, "histogram_quantile(0.99, sum by (le, rank, op) (rate(moescope_all_to_all_seconds_bucket"
           f"{{{SEL}}}[$__rate_interval])))", "rank {{rank}} {{op}}")], "s", 0, 8))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Peer wait (rank waited on peer), s/s", [
        _q(prometheus, "sum by (rank, peer) (rate(moescope_all_to_all_peer_wait_seconds_total"
           f"{{{SEL}}}[$__rate_interval]))", "rank {{rank}} on {{peer}}")], "s", 12, 8))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Tokens dropped by capacity, per routed token", [
        _q(prometheus, f"sum by (layer) (rate(moescope_tokens_dropped_total{{{SEL}}}[$__rate_interval])) / "
           f"sum by (layer) (rate(moescope_router_tokens_total{{{SEL}}}[$__rate_interval]))", "L{{layer}}")],
        "percentunit", 0, 16))
    return dash


def memory():
    dashboard, heatmap, prometheus, stat, timeseries, _ = _sdk()
    dash = (dashboard.Dashboard("moescope / Memory").uid("moescope-memory").tags(["moescope", "moe"])
            .refresh("10s").time("now-6h", "now"))
    dash, ds = _variables(dash, dashboard)
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Process resident memory", [
        _q(prometheus, f"moescope_process_resident_memory_bytes{{{SEL}}}", "rank {{rank}}"),
        _q(prometheus, f"predict_linear(moescope_process_resident_memory_bytes{{{SEL}}}[30m], 4 * 3600)",
           "rank {{rank}} in 4h")], "bytes", 0, 0))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "GPU memory (NVML; no series without a GPU)", [
        _q(prometheus, f"moescope_gpu_memory_used_bytes{{{SEL}}}", "gpu {{gpu}} used"),
        _q(prometheus, f"moescope_gpu_memory_total_bytes{{{SEL}}}", "gpu {{gpu}} capacity")], "bytes", 12, 0))
    return dash


DASHBOARDS = {"moescope-overview": overview, "moescope-experts": experts, "moescope-cache-a2a": cache_all_to_all,
              "moescope-memory": memory}


def build_all() -> dict[str, dict]:
    *_, JSONEncoder = _sdk()
    out = {}
    for name, fn in DASHBOARDS.items():
        doc = json.loads(JSONEncoder(sort_keys=True).encode(fn().build()))
        for i, panel in enumerate(doc["panels"]):
            panel["id"] = i + 1
            for j, target in enumerate(panel.get("targets", [])):
                target["refId"] = "ABCDEFGH"[j]
                target["datasource"] = {"type": "prometheus", "uid": "${datasource}"}
                if panel["type"] == "heatmap":
                    target["format"] = "time_series"  # one series per expert: rows of the heatmap
        out[name] = doc
    return out


PROVISIONING = """# Grafana file provisioning: copy to /etc/grafana/provisioning/dashboards/moescope.yml
apiVersion: 1
providers:
  - name: moescope
    folder: moescope
    type: file
    disableDeletion: false
    updateIntervalSeconds: 30
    options:
      path: /var/lib/grafana/dashboards/moescope
"""


def write(root: Path) -> list[Path]:
    out = root / "dashboards"
    (out / "provisioning").mkdir(parents=True, exist_ok=True)
    paths = []
    for name, doc in build_all().items():
        path = out / f"{name}.json"
        path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        paths.append(path)
    (out / "provisioning" / "dashboards.yml").write_text(PROVISIONING)
    return paths


def queries(doc: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel."""
    return [(p.get("title", ""), t["expr"]) for p in doc.get("panels", []) for t in p.get("targets", [])
            if t.get("expr")]
