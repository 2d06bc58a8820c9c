"""Grafana dashboards as code (grafana-foundation-sdk, Grafana 11.6 line), written to dashboards/*.json.

Every panel query uses the template variables ``$datasource``, ``$model``, ``$rank`` (multi) and ``$layer``
(single), so one dashboard serves every model and rank. Colour steps and threshold lines come from the
thresholds object (``moescope.thresholds``), one set for every model: a healthy deployment is green and a stat
turns red where its alert fires. The judged quantities are the ones the exporter exports and the rules read
(``moescope.alerts.rules``: the load CV beyond sampling noise, the top share, the hot factor, the dead experts
sampling cannot explain, the drift, the ranks' busiest / mean load, the flips, the drops, the cache's hit rate,
activation, the all-to-all and fetch p99, a slow peer's share of the wait, memory), and every panel that shows one
draws its bar and clear bar beside it: the exporter's ``moescope_judgement_bar`` / ``_clear_bar`` series, the
values the rules compare with (``Thresholds.bars``), never a line typed here.

At 256 experts a per-expert line chart is unreadable: the Experts dashboard shows the expert x time heatmap
(one row per expert), the hottest and coldest 8 experts, the distribution of expert load relative to the fair
share (a heatmap that reads the same at 8 or 256 experts) and per-layer heatmaps for 58 layers. Where the
exporter serves the reduced tier (layers x experts over its budget) the expert panels fall back to its window
gauges. tests/test_dashboards.py runs every query of every panel, variables filled in, against a real
Prometheus that scraped a demo run (tiny-demo; the detection matrix does the same at deepseek-v3-shape).
"""

from __future__ import annotations

import json
from pathlib import Path

from moescope.alerts import rules
from moescope.efficiency import per_step, smbu, smfu
from moescope.thresholds import DEFAULT, WARN_FRACTION, Thresholds

SEL = 'model="$model", rank=~"$rank"'
LSEL = f'{SEL}, layer="$layer"'


def _sdk():
    # optional: grafana_foundation_sdk (the dashboards extra)
    from grafana_foundation_sdk.builders import dashboard, heatmap, prometheus, stat, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    return dashboard, heatmap, prometheus, stat, timeseries, JSONEncoder


def _variables(dash, dashboard):
    # optional: grafana_foundation_sdk (the dashboards extra)
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableSort

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    dash = dash.with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    dash = dash.with_variable(dashboard.QueryVariable("model").label("Model").datasource(ds)
                              .query("label_values(moescope_build_info, model)").refresh(2))
    dash = dash.with_variable(dashboard.QueryVariable("rank").label("Rank").datasource(ds).multi(True)
                              .include_all(True).all_value(".*")
                              .query('label_values(moescope_build_info{model="$model"}, rank)').refresh(2))
    dash = dash.with_variable(dashboard.QueryVariable("layer").label("Layer").datasource(ds)
                              .query('label_values(moescope_router_tokens_total{model="$model"}, layer)')
                              .sort(VariableSort.NUMERICAL_ASC).refresh(2))
    return dash, ds


def _q(prometheus, expr: str, legend: str = "", exemplar: bool = False):
    q = prometheus.Dataquery().expr(expr).legend_format(legend or "__auto")
    return q.exemplar(True) if exemplar else q


# -- colour steps from the thresholds object --------------------------------------------------------------
def steps(kind: str, bar) -> list[tuple[float | None, str]]:
    """Colour steps of a bar: ``above`` (red from the bar, yellow from WARN_FRACTION of it), ``floor`` (red
    below the bar, yellow up to a third of the way to 1), ``any`` (red from 1: a count that should be 0).
    A value over its own bar (``ratio``) is ``above`` with the bar 1."""
    if kind == "ratio":
        return steps("above", 1)
    if kind == "above":
        return [(None, "green"), (round(WARN_FRACTION * bar, 6), "yellow"), (bar, "red")]
    if kind == "floor":
        return [(None, "red"), (bar, "yellow"), (round(bar + (1 - bar) * (1 - WARN_FRACTION), 6), "green")]
    return [(None, "green"), (1, "red")]


def _thresholds_config(pairs):
    # optional: grafana_foundation_sdk (the dashboards extra)
    from grafana_foundation_sdk.builders.dashboard import ThresholdsConfig
    from grafana_foundation_sdk.models.dashboard import Threshold, ThresholdsMode

    return ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps([Threshold(value=v, color=c) for v, c in pairs])


def _pos(x, y, w, h):
    # optional: grafana_foundation_sdk (the dashboards extra)
    from grafana_foundation_sdk.models.dashboard import GridPos

    return GridPos(h=h, w=w, x=x, y=y)


def _stat(stat, prometheus, ds, t: Thresholds, title, expr, unit, bar, kind, x, y, w=4):
    """A stat of one series per model (legend ``{{model}}``), coloured by the bar ``bar`` (a Thresholds field;
    None: the kind's own bar)."""
    return (stat.Panel().title(title).datasource(ds).unit(unit)
            .thresholds(_thresholds_config(steps(kind, getattr(t, bar) if bar else None)))
            .with_target(_q(prometheus, expr, "{{model}}")).grid_pos(_pos(x, y, w, 4)))


def _ts(timeseries, prometheus, ds, title, targets, unit, x, y, w=12, h=8):
    """A time series panel."""
    p = timeseries.Panel().title(title).datasource(ds).unit(unit).grid_pos(_pos(x, y, w, h))
    for target in targets:
        p = p.with_target(target)
    return p


def _bars(prometheus, judgement: str, matcher: str = LSEL, clear: bool = True, agg: str = "max") -> list:
    """The targets of ``judgement``'s bar (and clear bar) series, as the rules compare with them."""
    out = [_q(prometheus, f"{agg}({rules.bar(judgement, matcher)})", "bar")]
    if clear:
        out.append(_q(prometheus, f"{agg}({rules.bar(judgement, matcher, clear=True)})", "clear bar"))
    return out


def _heatmap(heatmap, prometheus, ds, title, expr, legend, x, y, w=24, h=10, layout=None, unit="none"):
    # optional: grafana_foundation_sdk (the dashboards extra)
    from grafana_foundation_sdk.models.common import HeatmapCellLayout

    return (heatmap.Panel().title(title).datasource(ds).grid_pos(_pos(x, y, w, h)).unit(unit).calculate(False)
            .rows_frame(heatmap.RowsHeatmapOptions().layout(layout or HeatmapCellLayout.UNKNOWN))
            .with_target(_q(prometheus, expr, legend)))


# -- the judged quantities, as the exporter exports them and the rules read them ---------------------------------
ON = rules.ON


def excess_cv(matcher: str) -> str:
    return f"moescope_expert_load_excess_cv_ratio{{{matcher}}}"


def excess_over_bar(matcher: str) -> str:
    """The load CV beyond noise over the layer's own bar series (the MoEExpertLoadImbalance judgement: > 1
    fires)."""
    return f"({excess_cv(matcher)} / {ON} group_left {rules.bar('imbalance', matcher)})"


def activation_vs_expected(m: str) -> str:
    """Observed / expected activation ratio (the expected one: the model config's, exported as a gauge)."""
    return f"moescope_activation_ratio{{{m}}} / moescope_activation_expected_ratio{{{m}}}"


def judged_dead(matcher: str) -> str:
    """Dead experts that sampling does not explain (the MoEDeadExperts series)."""
    return f"moescope_dead_experts_unexpected{{{matcher}}}"


drift_beyond_noise = rules.drift_beyond_noise


def hits_over_capacity(matcher: str) -> str:
    """Each layer's hit rate over the share of experts its cache holds (MoEExpertCacheHitRateLow: < 0.5)."""
    return (f"{rules.hit_rate(matcher, '$__rate_interval')} / {ON} "
            f"moescope_expert_cache_capacity_ratio{{{matcher}}}")


def hit_rate(matcher: str, by: str = "model") -> str:
    return rules.hit_rate(matcher, "$__rate_interval", by)


def expert_rate(matcher: str) -> str:
    """Slots/s per expert of one layer: the full tier's counters, or the reduced tier's window gauges."""
    return (f"sum by (expert) (rate(moescope_expert_tokens_total{{{matcher}}}[$__rate_interval])) or "
            f"sum by (expert) (moescope_expert_window_slots{{{matcher}}}) / scalar(max(moescope_window_seconds"
            f"{{{SEL}}}))")


# (stat title, Thresholds field or None, colour kind): what a test checks against the thresholds object
COLOURED = (
    ("Load CV beyond noise / its bar (worst layer)", None, "ratio"),
    ("Top expert share", "collapse_top_share", "above"),
    ("Dead experts (judged)", None, "any"),
    ("Cache hits / resident share (worst layer)", "cache_floor_of_capacity", "floor"),
    ("Activation vs config", "activation_floor", "floor"),
    ("Non-finite logits (5m)", None, "any"),
    ("Hottest expert / its reference share", "hot_factor", "above"),
    ("Busiest rank / mean rank (worst layer)", "rank_max_over_mean", "above"),
    ("Drift beyond noise, bits (worst layer)", "drift_bits", "above"),
)


def overview(t: Thresholds = DEFAULT):
    dashboard, heatmap, prometheus, stat, timeseries, _ = _sdk()
    dash = (dashboard.Dashboard("moescope / Overview").uid("moescope-overview").tags(["moescope", "moe"])
            .refresh("10s").time("now-30m", "now"))
    dash, ds = _variables(dash, dashboard)
    exprs = {
        "Load CV beyond noise / its bar (worst layer)": (f"max by (model) ({excess_over_bar(SEL)})", "none"),
        "Top expert share": (f"max by (model) (moescope_expert_load_top_share_ratio{{{SEL}}})", "percentunit"),
        "Dead experts (judged)": (f"sum by (model) ({judged_dead(SEL)}) or on () vector(0)", "none"),
        "Cache hits / resident share (worst layer)": (f"min by (model) ({hits_over_capacity(SEL)})", "none"),
        "Activation vs config": (f"avg by (model) ({activation_vs_expected(SEL)})", "percentunit"),
        "Non-finite logits (5m)": (f"sum by (model) (increase(moescope_router_nonfinite_logits_total{{{SEL}}}"
                                   "[5m]))", "none"),
        "Hottest expert / its reference share": (f"max by (model) (moescope_expert_hot_factor_ratio{{{SEL}}})",
                                                 "none"),
        "Busiest rank / mean rank (worst layer)": (
            f"max by (model) (moescope_rank_load_max_over_mean_ratio{{{SEL}}})", "none"),
        "Drift beyond noise, bits (worst layer)": (f"max by (model) ({drift_beyond_noise(SEL)})", "none"),
    }
    for i, (title, bar, kind) in enumerate(COLOURED):
        expr, unit = exprs[title]
        dash = dash.with_panel(_stat(stat, prometheus, ds, t, title, expr, unit, bar, kind, 4 * (i % 6), 4 * (i // 6)))
    dash = dash.with_panel(_stat(stat, prometheus, ds, t, "Firing alerts",
                                 'count(ALERTS{alertstate="firing", alertname!="Watchdog"}) or vector(0)', "none",
                                 None, "any", 12, 4, 12))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Tokens / s", [
        _q(prometheus, f"sum by (phase) (rate(moescope_tokens_total{{{SEL}}}[$__rate_interval]))", "{{phase}}")],
        "none", 0, 8, 24, 6))
    lat = "moescope_token_latency_seconds_bucket"
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Token latency (exemplars: request ids)", [
        _q(prometheus, f"histogram_quantile(0.5, sum by (le) (rate({lat}{{{SEL}}}[$__rate_interval])))", "p50", True),
        _q(prometheus, f"histogram_quantile(0.99, sum by (le) (rate({lat}{{{SEL}}}[$__rate_interval])))", "p99",
           True)], "s", 0, 14))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Step time p99 by phase", [
        _q(prometheus, "histogram_quantile(0.99, sum by (le, phase) (rate(moescope_step_seconds_bucket"
           f"{{{SEL}}}[$__rate_interval])))", "{{phase}}", True)], "s", 12, 14))
    dash = efficiency(serving(dash, prometheus, timeseries, ds, 22), prometheus, timeseries, ds, 46)
    return dash.with_panel(_ts(timeseries, prometheus, ds, "Activation ratio and its floor (from the config's "
                               "expected ratio)", [
        _q(prometheus, f"min by (rank) (moescope_activation_ratio{{{SEL}}})", "activation, rank {{rank}}"),
        _q(prometheus, f"max(moescope_activation_expected_ratio{{{SEL}}})", "the config's"),
        *_bars(prometheus, "activation", SEL, clear=False)], "percentunit", 0, 54))


def efficiency(dash, prometheus, timeseries, ds, y: int):
    """The efficiency row (issue 44): what the steps read. Experts touched per step against the decode batch,
    bytes read per output token, S-MBU and S-MFU (docs/metrics.md, "Efficiency")."""
    dec = f'{SEL}, phase="decode"'
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Experts touched per step and layer vs decode batch", [
        _q(prometheus, f"{per_step('moescope_expert_distinct_total', SEL)} / "
           f"{per_step('moescope_expert_distinct_steps_total', SEL)}", "experts / step / layer, rank {{rank}}"),
        _q(prometheus, f"{per_step('moescope_tokens_total', dec)} / {per_step('moescope_steps_total', dec)}",
           "decode batch, rank {{rank}}")], "none", 0, y, 8))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Bytes read per output token (decode)", [
        _q(prometheus, f"{per_step('moescope_step_read_bytes_total', dec, 'model, rank, kind')} / on (model, rank) "
           f"group_left {per_step('moescope_tokens_total', dec)}", "{{kind}}, rank {{rank}}")], "bytes", 8, y, 8))
    return dash.with_panel(_ts(timeseries, prometheus, ds, "S-MBU and S-MFU (decode; none without a known peak)", [
        _q(prometheus, smbu(SEL), "S-MBU, rank {{rank}}"), _q(prometheus, smfu(SEL), "S-MFU, rank {{rank}}")],
        "percentunit", 16, y, 8))


def _quantiles(prometheus, name: str, label: str = "", qs=(0.5, 0.99)):
    return [_q(prometheus, f"histogram_quantile({q}, sum by (le) (rate({name}_bucket{{{SEL}}}[$__rate_interval])))",
               f"{label}p{round(q * 100)}", True) for q in qs]


def serving(dash, prometheus, timeseries, ds, y: int):
    """The serving row: ``moescope serve``'s API-port series (vLLM's serving panels, with moescope's labels)."""
    p = "moescope_serve_"
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Serving: time to first token (exemplars: request ids)",
                               _quantiles(prometheus, p + "time_to_first_token_seconds"), "s", 0, y))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Serving: inter-token latency",
                               _quantiles(prometheus, p + "inter_token_latency_seconds"), "s", 12, y))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Serving: end-to-end latency and queue time", [
        *_quantiles(prometheus, p + "e2e_request_latency_seconds", "e2e ", (0.99,)),
        *_quantiles(prometheus, p + "request_queue_time_seconds", "queue ", (0.99,))], "s", 0, y + 8))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Serving: requests running and waiting", [
        _q(prometheus, f"sum by (model) ({p}num_requests_running{{{SEL}}})", "running"),
        _q(prometheus, f"sum by (model) ({p}num_requests_waiting{{{SEL}}})", "waiting")], "none", 12, y + 8))
    return dash.with_panel(_ts(timeseries, prometheus, ds, "Serving: requests / s by finish reason; refusals by "
                               "cause", [
        _q(prometheus, f"sum by (finished_reason) (rate({p}request_success_total{{{SEL}}}[$__rate_interval]))",
           "{{finished_reason}}"),
        _q(prometheus, f"sum by (cause) (rate({p}request_rejected_total{{{SEL}}}[$__rate_interval]))",
           "refused: {{cause}}"),
        _q(prometheus, f"sum by (model) (rate({p}generation_tokens_total{{{SEL}}}[$__rate_interval]))",
           "tokens generated")], "reqps", 0, y + 16, 24))


def experts(t: Thresholds = DEFAULT):
    dashboard, heatmap, prometheus, stat, timeseries, _ = _sdk()
    # optional: grafana_foundation_sdk (the dashboards extra)
    from grafana_foundation_sdk.models.common import HeatmapCellLayout

    dash = (dashboard.Dashboard("moescope / Experts").uid("moescope-experts").tags(["moescope", "moe"])
            .refresh("10s").time("now-30m", "now"))
    dash, ds = _variables(dash, dashboard)
    dash = dash.with_panel(_heatmap(heatmap, prometheus, ds, "Expert x time: slots/s, layer $layer (one row per "
                                    "expert)", expert_rate(LSEL), "{{expert}}", 0, 0, h=16))
    dist = _heatmap(heatmap, prometheus, ds, "Experts by load / fair share, layer $layer (le=0: no slot)",
                    f"sum by (le) (moescope_expert_load_relative_bucket{{{LSEL}}})", "{{le}}", 0, 16, 12, 10,
                    HeatmapCellLayout.LE)
    dash = dash.with_panel(dist)
    dash = dash.with_panel(_heatmap(heatmap, prometheus, ds, "Load CV beyond sampling noise, by layer",
                                    f"max by (layer) ({excess_cv(SEL)})", "{{layer}}", 12, 16, 12, 10))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Hottest 8 experts, layer $layer (slots/s)", [
        _q(prometheus, f"topk(8, {expert_rate(LSEL)})", "expert {{expert}}")], "none", 0, 26))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Coldest 8 experts, layer $layer (slots/s)", [
        _q(prometheus, f"bottomk(8, {expert_rate(LSEL)})", "expert {{expert}}")], "none", 12, 26))
    live = f"({expert_rate(LSEL)}) / scalar(sum({expert_rate(LSEL)}))"
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Layer $layer: live vs baseline share (hottest 8; "
                               "baseline only where one is loaded)", [
        _q(prometheus, f"topk(8, {live})", "live e{{expert}}"),
        _q(prometheus, f"max by (expert) (moescope_baseline_expert_share_ratio{{{LSEL}}}) and on (expert) "
           f"topk(8, {live})", "baseline e{{expert}}")], "percentunit", 0, 34))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Hot experts: share / reference share, all layers, and "
                               "the hot bar (absent where none is significant)", [
        _q(prometheus, f"moescope_expert_hot_factor_ratio{{{SEL}}}", "L{{layer}} e{{expert}} vs {{reference}}"),
        *_bars(prometheus, "hot", SEL)], "none", 12, 34))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Layer $layer: load CV beyond noise and its bar "
                               "(from its reference: baseline, learned or fair)", [
        _q(prometheus, f"max(moescope_expert_load_cv_ratio{{{LSEL}}})", "CV"),
        _q(prometheus, f"max(moescope_expert_load_cv_noise_ratio{{{LSEL}}})", "noise bound"),
        _q(prometheus, f"max({excess_cv(LSEL)})", "beyond noise"), *_bars(prometheus, "imbalance")], "none", 0, 42))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Layer $layer: top share and its collapse bar", [
        _q(prometheus, f"max(moescope_expert_load_top_share_ratio{{{LSEL}}})", "top share"),
        *_bars(prometheus, "collapse")], "percentunit", 12, 42))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Layer $layer: judged dead experts (firing: holding) and "
                               "the bar", [
        _q(prometheus, f"max({judged_dead(LSEL)})", "dead"),
        _q(prometheus, f"max(moescope_dead_experts_holding{{{LSEL}}})", "holding"), *_bars(prometheus, "dead")],
        "none", 0, 50))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Layer $layer: JS divergence from the baseline and its bar "
                               "(its sampling noise + the drift bar; only with a baseline)", [
        _q(prometheus, f"max(moescope_routing_drift_jsd_bits{{{LSEL}}})", "divergence"),
        _q(prometheus, f"max(moescope_routing_drift_noise_bits{{{LSEL}}})", "noise"), *_bars(prometheus, "drift")],
        "none", 12, 50))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Layer $layer: canary flip ratio and its bar", [
        _q(prometheus, f"max(moescope_routing_flip_ratio{{{LSEL}}})", "flips"), *_bars(prometheus, "flips")],
        "percentunit", 0, 58))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Router entropy and margin (mean over layers)", [
        _q(prometheus, f"avg(moescope_router_entropy_ratio{{{SEL}}})", "entropy"),
        _q(prometheus, f"avg(moescope_router_margin_ratio{{{SEL}}})", "margin")], "percentunit", 12, 58))
    return dash


def cache_all_to_all(t: Thresholds = DEFAULT):
    dashboard, heatmap, prometheus, stat, timeseries, _ = _sdk()
    dash = (dashboard.Dashboard("moescope / Cache and all-to-all").uid("moescope-cache-a2a")
            .tags(["moescope", "moe"]).refresh("10s").time("now-30m", "now"))
    dash, ds = _variables(dash, dashboard)
    worst = f"bottomk(5, {hit_rate(SEL, 'layer')})"
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Expert cache hit rate, worst 5 layers, and their floors "
                               "(from the share of experts each holds)", [
        _q(prometheus, worst, "L{{layer}}"),
        _q(prometheus, f"max by (layer) ({rules.bar('cache', SEL)}) and on (layer) {worst}", "floor L{{layer}}")],
        "percentunit", 0, 0))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Expert fetch (switch) latency", [
        _q(prometheus, "histogram_quantile(0.99, sum by (le) (rate(moescope_expert_fetch_seconds_bucket"
           f"{{{SEL}}}[$__rate_interval])))", "p99"),
        _q(prometheus, "histogram_quantile(0.5, sum by (le) (rate(moescope_expert_fetch_seconds_bucket"
           f"{{{SEL}}}[$__rate_interval])))", "p50"), *_bars(prometheus, "fetch", SEL, clear=False)], "s", 12, 0))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "All-to-all p99 by rank and op, and its bar", [
        _q(prometheus, "histogram_quantile(0.99, sum by (le, rank, op) (rate(moescope_all_to_all_seconds_bucket"
           f"{{{SEL}}}[$__rate_interval])))", "rank {{rank}} {{op}}"),
        *_bars(prometheus, "all_to_all", SEL, clear=False)], "s", 0, 8))
    waits = f"rate(moescope_all_to_all_peer_wait_seconds_total{{{SEL}}}[$__rate_interval])"
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Peer wait: each peer's share of the ranks' wait on peers, "
                               "and the slow-rank bar", [
        _q(prometheus, f"sum by (peer) ({waits}) / ignoring (peer) group_left sum({waits})", "peer {{peer}}"),
        *_bars(prometheus, "slow_rank_share", SEL, clear=False)], "percentunit", 12, 8))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Tokens dropped by capacity, per routed token (worst 5 "
                               "layers), and the bar", [
        _q(prometheus, f"topk(5, {rules.drop_ratio(SEL, '$__rate_interval', 'layer')})", "L{{layer}}"),
        *_bars(prometheus, "drops", SEL, clear=False)], "percentunit", 0, 16))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Expert-parallel ranks: busiest / mean load (worst 5 "
                               "layers), and the bar", [
        _q(prometheus, f"topk(5, max by (layer) (moescope_rank_load_max_over_mean_ratio{{{SEL}}}))", "L{{layer}}"),
        *_bars(prometheus, "rank_load", SEL)], "none", 12, 16))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Expert-parallel ranks: slots each rank computed over "
                               "the window", [
        _q(prometheus, f"sum by (peer) (moescope_rank_window_slots{{{SEL}}})", "rank {{peer}}")], "none", 0, 24))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "EPLB in the loop: busiest / mean rank, predicted at the "
                               "last rearrangement vs measured since (worst layer)", [
        _q(prometheus, f"max(moescope_eplb_predicted_max_over_mean_ratio{{{SEL}}})", "predicted"),
        _q(prometheus, f"max(moescope_eplb_measured_max_over_mean_ratio{{{SEL}}})", "measured since"),
        _q(prometheus, f"max(moescope_eplb_before_max_over_mean_ratio{{{SEL}}})", "measured before")], "none", 12, 24))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "EPLB rearrangements: seconds each (p99 by rank) and "
                               "experts moved per minute", [
        _q(prometheus, "histogram_quantile(0.99, sum by (le, rank) (rate(moescope_eplb_rebalance_seconds_bucket"
           f"{{{SEL}}}[$__rate_interval])))", "rank {{rank}} s"),
        _q(prometheus, f"sum by (rank) (increase(moescope_eplb_moved_experts_total{{{SEL}}}[1m]))",
           "rank {{rank}} moved/min")], "none", 0, 32))
    dispatches = f'rate(moescope_all_to_all_seconds_count{{{SEL}, op="dispatch"}}[$__rate_interval])'
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Peer wait per dispatch exchange (the slowest rank per "
                               "peer), and the slow-rank bar", [
        _q(prometheus, f"max by (peer) ({waits} / ignoring (peer, op) group_left {dispatches})", "peer {{peer}}"),
        *_bars(prometheus, "slow_rank_wait", SEL, clear=False)], "s", 12, 32))
    return expert_parallel(dash, prometheus, timeseries, ds, 40)


def step_quantile(q: float, sel: str = SEL, layer: str = "worst") -> str:
    """The q quantile of the per-step busiest / mean rank (``moescope_ep_step_max_over_mean_ratio``) by EP size and
    placement, over the panel's range step; at least 1 (a ratio to the mean: histogram_quantile interpolates the
    lowest bucket, le 1, from 0)."""
    return (f"clamp_min(histogram_quantile({q}, sum by (le, ep, placement, redundant) (rate("
            f'moescope_ep_step_max_over_mean_ratio_bucket{{{sel}, layer="{layer}"}}[$__rate_interval]))), 1)')


def expert_parallel(dash, prometheus, timeseries, ds, y: int):
    """The "would EP and EPLB help?" row (issue [eplb]; docs/metrics.md, "Step-level rank load"): per EP size and
    placement, the busiest / mean rank per step predicted from the steps' routing (worst layer, p50 and p99), the
    straggler factor against the average-load figure that hides it, and the placement in use (the runtime's or
    vLLM's EPLB): its straggler, its rearrangements' before / after and the slots each rank computes."""
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Would EP help? Busiest / mean rank per step, worst "
                               "layer, p99 and p50, by EP size and placement", [
        _q(prometheus, step_quantile(0.99), "EP {{ep}} {{placement}} R={{redundant}} p99"),
        _q(prometheus, step_quantile(0.5), "EP {{ep}} {{placement}} R={{redundant}} p50")], "none", 0, y))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Straggler factor (sum of busiest / sum of mean rank over "
                               "steps) vs the average-load figure", [
        _q(prometheus, f"max by (ep, placement, redundant) (moescope_ep_straggler_ratio{{{SEL}}})",
           "EP {{ep}} {{placement}} R={{redundant}} straggler"),
        _q(prometheus, f"max by (ep, placement, redundant) (moescope_ep_average_max_over_mean_ratio{{{SEL}}})",
           "EP {{ep}} {{placement}} R={{redundant}} average")], "none", 12, y))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Placement in use: straggler factor, and at its last "
                               "rearrangement (before / predicted / after)", [
        _q(prometheus, f'max by (ep, redundant) (moescope_ep_straggler_ratio{{{SEL}, placement="in_use"}})',
           "in use, EP {{ep}} R={{redundant}}"),
        _q(prometheus, f"max by (when) (moescope_ep_rearrangement_straggler_ratio{{{SEL}}})", "{{when}}")],
        "none", 0, y + 8))
    return dash.with_panel(_ts(timeseries, prometheus, ds, "Placement in use: slots each rank computes per second "
                               "(the routing's, every step)", [
        _q(prometheus, f"sum by (peer) (rate(moescope_ep_rank_slots_total{{{SEL}}}[$__rate_interval]))",
           "rank {{peer}}")], "none", 12, y + 8))


def memory(t: Thresholds = DEFAULT):
    dashboard, heatmap, prometheus, stat, timeseries, _ = _sdk()
    dash = (dashboard.Dashboard("moescope / Memory").uid("moescope-memory").tags(["moescope", "moe"])
            .refresh("10s").time("now-6h", "now"))
    dash, ds = _variables(dash, dashboard)
    d = t
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "Process resident memory", [
        _q(prometheus, f"moescope_process_resident_memory_bytes{{{SEL}}}", "rank {{rank}}"),
        _q(prometheus, f"predict_linear(moescope_process_resident_memory_bytes{{{SEL}}}[{d.memory_window_s}s], "
           f"{d.memory_horizon_s})", f"rank {{{{rank}}}} in {d.memory_horizon_s // 3600}h"),
        *_bars(prometheus, "memory", SEL, clear=False)], "bytes", 0, 0))
    dash = dash.with_panel(_ts(timeseries, prometheus, ds, "GPU memory (NVML; no series without a GPU)", [
        _q(prometheus, f"moescope_gpu_memory_used_bytes{{{SEL}}}", "gpu {{gpu}} used"),
        _q(prometheus, f"moescope_gpu_memory_total_bytes{{{SEL}}}", "gpu {{gpu}} capacity")], "bytes", 12, 0))
    return dash


DASHBOARDS = {"moescope-overview": overview, "moescope-experts": experts, "moescope-cache-a2a": cache_all_to_all,
              "moescope-memory": memory}


def build_all(t: Thresholds = DEFAULT) -> dict[str, dict]:
    *_, JSONEncoder = _sdk()
    out = {}
    for name, fn in DASHBOARDS.items():
        doc = json.loads(JSONEncoder(sort_keys=True).encode(fn(t).build()))
        for i, panel in enumerate(doc["panels"]):
            panel["id"] = i + 1
            for j, target in enumerate(panel.get("targets", [])):
                target["refId"] = "ABCDEFGH"[j]
                target["datasource"] = {"type": "prometheus", "uid": "${datasource}"}
                if panel["type"] == "heatmap":  # rows: one series per expert / layer, or cumulative buckets
                    layout = panel["options"]["rowsFrame"]["layout"]
                    target["format"] = "heatmap" if layout == "le" else "time_series"
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
