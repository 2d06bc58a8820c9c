"""Evidence from a Prometheus server for ``moescope diagnose --prometheus URL``: the moescope alerts firing
there now, and the live values the trace store cannot hold (canary flip ratio, drift vs baseline)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

from moescope.errors import BadInput


def query(url: str, promql: str, timeout: float = 5.0) -> list[dict]:
    full = f"{url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        body = json.loads(urllib.request.urlopen(full, timeout=timeout).read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise BadInput(f"Prometheus at {url} is unreachable or not Prometheus: {reason}") from None
    if body.get("status") != "success":
        raise BadInput(f"Prometheus at {url} refused the query {promql!r}: {body.get('error')}")
    return body["data"]["result"]


def findings(url: str, model: str | None) -> list:
    from moescope.analysis.diagnose import Finding

    sel = f'model="{model}"' if model else ""
    out = []
    for r in query(url, f'ALERTS{{alertstate="firing",alertname=~"MoE.*"{"," + sel if sel else ""}}}'):
        labels = r["metric"]
        name = labels["alertname"]
        where = {k: v for k, v in labels.items() if k not in ("__name__", "alertname", "alertstate", "severity")}
        sev = labels.get("severity", "warning")
        out.append(Finding(f"alert:{name}", sev if sev in ("critical", "warning") else "warning",
                           f"Prometheus: {name} is firing", 1.0, {"labels": where, "source": url}, [], name))
    for r in query(url, f"max by (layer) (moescope_routing_flip_ratio{{{sel}}})"):
        v = float(r["value"][1])
        if v > 0:
            out.append(Finding("canary-flips", "info", f"Canary routing flips {v:.1%} in layer "
                               f"{r['metric'].get('layer')}", v, {"flip_ratio": v, "source": url}, [],
                               "MoERoutingFlips"))
    return out
