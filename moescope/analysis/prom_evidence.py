"""Evidence from a Prometheus server for ``moescope diagnose --prometheus URL``: the moescope alerts firing
there now, the judged series the exporter exports (excess CV, hot factors, unexpected dead experts, drift) each
compared with its bar series (``moescope_judgement_bar``: the values the rules compare with, ``Thresholds.bars``),
and the live values the trace store cannot hold (canary flip ratio)."""

from __future__ import annotations

import math

from moescope.prom_http import query
from moescope.thresholds import DEFAULT, Thresholds


def _by_layer(url: str, expr: str) -> dict[str, float]:
    return {r["metric"].get("layer", ""): float(r["value"][1]) for r in query(url, expr)}


def _bars(url: str, sel: str, judgement: str) -> dict[str, tuple[float, str]]:
    """layer -> (the bar, its reference) of ``judgement``: the exporter's bar series, the rules' own (the highest
    where several exporters export the layer)."""
    matchers = f'{sel + "," if sel else ""}judgement="{judgement}"'
    out: dict[str, tuple[float, str]] = {}
    for r in query(url, f"max by (layer, reference) (moescope_judgement_bar{{{matchers}}})"):
        layer, v = r["metric"].get("layer", ""), float(r["value"][1])
        if layer not in out or v > out[layer][0]:
            out[layer] = (v, r["metric"].get("reference", ""))
    return out


def judged_series(url: str, sel: str, t: Thresholds = DEFAULT) -> list[dict]:
    """Info findings from the exporter's judged series, each compared with the bar series the rules compare with
    (what the rules judge, as the rules judge it)."""
    out = []
    excess = _by_layer(url, f"max by (layer) (moescope_expert_load_excess_cv_ratio{{{sel}}})")
    # each layer's imbalance bar and its reference (baseline, learned or fair; none while learning)
    bars = _bars(url, sel, "imbalance")
    over = {layer: {"excess_cv": round(v, 3), "bar": round(bars[layer][0], 3), "reference": bars[layer][1]}
            for layer, v in excess.items() if layer in bars and v > bars[layer][0]}
    if over:
        out.append(dict(cause="prometheus:imbalance", severity="info",
                        title=f"Prometheus: excess load CV over its bar in {len(over)} layer(s)", score=1.0,
                        evidence={"layers": over, "bar_from": sorted({x["reference"] for x in over.values()})},
                        examples=[], playbook="MoEExpertLoadImbalance"))
    not_judged = sorted(layer for layer, v in excess.items() if math.isnan(v))
    if not_judged:
        out.append(dict(cause="prometheus:not-judged", severity="info",
                        title=f"Prometheus: too few requests in the window to judge {len(not_judged)} layer(s)",
                        score=0.0, evidence={"layers": not_judged}, examples=[], playbook=None))
    hot_bars = _bars(url, sel, "hot")
    hot = [dict(layer=r["metric"].get("layer"), expert=r["metric"].get("expert"),
                reference=r["metric"].get("reference"), factor=round(float(r["value"][1]), 2))
           for r in query(url, f"moescope_expert_hot_factor_ratio{{{sel}}}")
           if r["metric"].get("layer") in hot_bars and float(r["value"][1]) > hot_bars[r["metric"]["layer"]][0]]
    if hot:
        hot.sort(key=lambda h: -h["factor"])
        h = hot[0]
        out.append(dict(cause="prometheus:hot-expert", severity="info",
                        title=f"Prometheus: L{h['layer']} E{h['expert']} at {h['factor']:.1f}x its {h['reference']} "
                              "share", score=h["factor"] / hot_bars[h["layer"]][0], evidence={"experts": hot},
                        examples=[], playbook="MoEExpertHot"))
    dead_bars = _bars(url, sel, "dead")
    dead = {layer: int(v) for layer, v in
            _by_layer(url, f"max by (layer) (moescope_dead_experts_unexpected{{{sel}}})").items()
            if layer in dead_bars and v > dead_bars[layer][0]}
    if dead:
        out.append(dict(cause="prometheus:dead-experts", severity="info",
                        title=f"Prometheus: unexpected dead experts in {len(dead)} layer(s)", score=1.0,
                        evidence={"layers": dead}, examples=[], playbook="MoEDeadExperts"))
    jsd = _by_layer(url, f"max by (layer) (moescope_routing_drift_jsd_bits{{{sel}}})")
    drift_bars = _bars(url, sel, "drift")
    drifted = {layer: {"jsd_bits": round(v, 4), "bar_bits": round(drift_bars[layer][0], 4)}
               for layer, v in jsd.items() if layer in drift_bars and v > drift_bars[layer][0]}
    if drifted:
        out.append(dict(cause="prometheus:drift", severity="info",
                        title=f"Prometheus: routing drifted from the baseline in {len(drifted)} layer(s)", score=1.0,
                        evidence={"layers": drifted}, examples=[], playbook="MoERoutingDrift"))
    return out


def findings(url: str, model: str | None, t: Thresholds = DEFAULT) -> list[dict]:
    """The evidence as ``diagnose.Finding`` fields (diagnose builds the findings: no import back into it)."""
    sel = f'model="{model}"' if model else ""
    out = []
    for r in query(url, f'ALERTS{{alertstate="firing",alertname=~"MoE.*"{"," + sel if sel else ""}}}'):
        labels = r["metric"]
        name = labels["alertname"]
        where = {k: v for k, v in labels.items() if k not in ("__name__", "alertname", "alertstate", "severity")}
        sev = labels.get("severity", "warning")
        out.append(dict(cause=f"alert:{name}", severity=sev if sev in ("critical", "warning") else "warning",
                        title=f"Prometheus: {name} is firing", score=1.0,
                        evidence={"labels": where, "source": url}, examples=[], playbook=name))
    out += judged_series(url, sel, t)
    for r in query(url, f"max by (layer) (moescope_routing_flip_ratio{{{sel}}})"):
        v = float(r["value"][1])
        if v > 0:
            out.append(dict(cause="canary-flips", severity="info",
                            title=f"Canary routing flips {v:.1%} in layer {r['metric'].get('layer')}", score=v,
                            evidence={"flip_ratio": v, "source": url}, examples=[], playbook="MoERoutingFlips"))
    return out
