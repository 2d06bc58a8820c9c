"""Evidence from a Prometheus server for ``moescope diagnose --prometheus URL``: the moescope alerts firing
there now, and the live values the trace store cannot hold (canary flip ratio, drift vs baseline)."""

from __future__ import annotations

from moescope.prom_http import query


def findings(url: str, model: str | None) -> list[dict]:
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
    for r in query(url, f"max by (layer) (moescope_routing_flip_ratio{{{sel}}})"):
        v = float(r["value"][1])
        if v > 0:
            out.append(dict(cause="canary-flips", severity="info",
                            title=f"Canary routing flips {v:.1%} in layer {r['metric'].get('layer')}", score=v,
                            evidence={"flip_ratio": v, "source": url}, examples=[], playbook="MoERoutingFlips"))
    return out
