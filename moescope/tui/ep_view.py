"""`moescope top`'s expert-parallel line (issue [eplb]): would EP and EPLB help, from the exported step-level series.

Reads the scrape's ``moescope_ep_*`` families (``parallel.step_balance`` in the exporter): per EP size and placement
the per-step busiest / mean rank histogram (worst layer, since start), the straggler factor with its standard error
and the average-load figure; the verdict is ``moescope.ep_verdict``'s (``thresholds.Thresholds.eplb_worth``), the
same words `plan-placement` and `diagnose` print. Several ranks each export their own routing's prediction: the line
shows the lowest rank's.
"""

from __future__ import annotations

import math
from collections import defaultdict

from moescope import ep_verdict

Samples = dict  # {(name, frozenset(labels)): value}, as moescope.tui.top_data parses them
H = "moescope_ep_step_max_over_mean_ratio_bucket"


def figures(cur: Samples, quantile) -> tuple[list[ep_verdict.Figures], dict]:
    """(the placements' figures of the lowest rank exporting them, {"window", "interval", "step_s"});
    ``quantile(buckets, q)``: Prometheus' histogram_quantile over cumulative {le: count} (``top_data``'s)."""
    ranks = sorted({dict(k).get("rank", "") for n, k in cur if n == "moescope_ep_straggler_ratio"})
    if not ranks:
        return [], {}
    rank = ranks[0]
    gauges: dict = defaultdict(dict)
    buckets: dict = defaultdict(dict)
    other: dict = {}
    for (name, labels), v in cur.items():
        d = dict(labels)
        if d.get("rank") != rank:
            continue
        key = (d.get("placement"), d.get("ep"), d.get("redundant"))
        if name == H and d.get("layer") == "worst":
            buckets[key][float(d["le"])] = v
        elif name in ("moescope_ep_straggler_ratio", "moescope_ep_straggler_stderr_ratio",
                      "moescope_ep_average_max_over_mean_ratio"):
            gauges[key][name] = v
        elif name == "moescope_ep_eplb_schedule_steps":
            other[d.get("which")] = int(v)
        elif name in ("moescope_step_seconds_sum", "moescope_step_seconds_count") and d.get("phase") == "decode":
            other[name] = v
    out = []
    for key, g in gauges.items():
        placement, ep, redundant = key
        b = buckets.get(key, {})
        # (at least 1: a ratio to the mean; histogram_quantile interpolates the lowest bucket, le 1, from 0)
        p50, p99 = (math.nan if v is None else max(1.0, v) for v in (quantile(b, q) for q in (0.5, 0.99)))
        out.append(ep_verdict.Figures(placement, int(ep), int(redundant), p50, p99,
                                      g.get("moescope_ep_straggler_ratio", math.nan),
                                      g.get("moescope_ep_straggler_stderr_ratio", math.nan),
                                      g.get("moescope_ep_average_max_over_mean_ratio", math.nan),
                                      int(max(b.values(), default=0))))
    n = other.get("moescope_step_seconds_count")
    step_s = other["moescope_step_seconds_sum"] / n if n else None
    return out, {"window": other.get("window", 1000), "interval": other.get("interval", 3000), "step_s": step_s}


def ep_line(cur: Samples, quantile) -> str:
    """One line ('' before the exporter has step-level figures): the verdict at the default EP size."""
    figs, sched = figures(cur, quantile)
    ep = ep_verdict.default_ep(f.ep for f in figs)
    v = ep_verdict.verdict(figs, ep, sched["window"], sched["interval"], sched["step_s"]) if ep else None
    return v.short() if v is not None else ""
