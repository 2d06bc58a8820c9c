"""`moescope top`'s efficiency line: what the decode steps read (issue 44), from the scrape's counters.

Experts touched per step and layer, the decode batch, bytes read per output token, and S-MBU / S-MFU where the
exporter knows the device's peak. The formulas are moescope.efficiency's; this only takes the counters'
differences between two polls (or their totals on the first) and formats them.
"""

from __future__ import annotations

from moescope import efficiency

Samples = dict  # {(name, frozenset(labels)): value}, as moescope.tui.top_data parses them


def _total(samples: Samples | None, name: str, **match: str) -> float:
    if not samples:
        return 0.0
    return sum(v for (n, labels), v in samples.items()
               if n == name and all(dict(labels).get(k) == want for k, want in match.items()))


def _peak(samples: Samples, name: str) -> float | None:
    vals = [v for (n, _), v in samples.items() if n == name]
    return max(vals) if vals else None


def efficiency_line(cur: Samples, prev: Samples | None, n_experts: int | None, phase: str = "decode") -> str:
    """One line ('' before any step's routing was summarised): the phase's steps since the previous poll, or
    since start when none stepped in between (an idle server still shows what its steps read)."""
    if not (_total(cur, "moescope_expert_distinct_steps_total") - _total(prev, "moescope_expert_distinct_steps_total")):
        prev = None

    def d(name, **match):
        return max(0.0, _total(cur, name, **match) - _total(prev, name, **match))

    steps = d("moescope_expert_distinct_steps_total")
    if not steps:
        return ""
    touched = d("moescope_expert_distinct_total") / steps
    of = f"/{n_experts} ({touched / n_experts:.0%})" if n_experts else ""
    parts = [f"experts/step/layer {touched:.1f}{of}"]
    n_steps, tokens = d("moescope_steps_total", phase=phase), d("moescope_tokens_total", phase=phase)
    read = d("moescope_step_read_bytes_total", phase=phase)
    flops = d("moescope_step_flops_total", phase=phase)
    seconds = d("moescope_step_seconds_sum", phase=phase)
    if n_steps:
        parts.append(f"{phase} batch {tokens / n_steps:.1f}")
    if tokens and read:
        parts.append(f"{read / tokens / 1e6:.2f} MB/token")
    smbu = efficiency.utilisation(read, seconds, _peak(cur, "moescope_peak_bandwidth_bytes_per_second"))
    smfu = efficiency.utilisation(flops, seconds, _peak(cur, "moescope_peak_flops_per_second"))
    parts.append("S-MBU " + ("-" if smbu is None else f"{smbu:.1%}"))
    parts.append("S-MFU " + ("-" if smfu is None else f"{smfu:.1%}"))
    return "  ".join(parts)
