"""Alert rules: one source of truth, generated to collectors/prometheus/moescope-rules.yml.

Each ``AlertSpec`` holds the expression (thresholds filled from ``Thresholds``), its ``for``, severity,
summary, templated description, the metrics it reads (checked against the catalogue by a test), and the
promtool unit-test series that must make it fire, stay silent when healthy, and stay silent at the boundary.
``runbook_url`` points to ``playbooks/<AlertName>.md``. Regenerate with ``moescope alerts build``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

RUNBOOK_BASE = "https://github.com/moescope/moescope/blob/main/playbooks"
L = 'model="m",rank="0",layer="1"'  # labels of the unit-test series


@dataclass(frozen=True)
class Thresholds:
    load_cv: float = 0.15  # seeds: healthy < 0.10
    # The 8-expert demo model serves 4 domains in a skewed mix: its healthy CV over a minute is 0.07-0.15.
    load_cv_by_model: dict = field(default_factory=lambda: {"tiny-demo": 0.25})
    collapse_top_share: float = 0.75  # share of tokens choosing one expert (k/E when balanced)
    activation_band: dict = field(default_factory=lambda: {"tiny-demo": (0.40, 0.50)})
    activation_default_band: tuple = (0.018, 0.022)  # seeds: a GPT-4-class model
    all_to_all_p99_s: float = 0.002  # seeds: healthy < 1 ms; raise on CPU deployments
    slow_rank_share: float = 0.5
    cache_hit_rate: float = 0.85
    # 8 experts at top-2: nearly every expert is needed every forward, so even 7 of 8 resident hits ~0.87.
    cache_hit_rate_by_model: dict = field(default_factory=lambda: {"tiny-demo": 0.6})
    fetch_p99_s: float = 0.05
    drop_ratio: float = 0.01
    flip_ratio: float = 0.05  # a deterministic router flips nothing; the seeds' jitter fault flips ~12%
    drift_jsd_bits: float = 0.1
    # The demo model's healthy traffic sits ~0.002 bits from its baseline; a 70/30 numbers/code mix 0.033-0.055.
    drift_jsd_bits_by_model: dict = field(default_factory=lambda: {"tiny-demo": 0.02})
    memory_capacity_bytes: int = 24 * 2**30
    memory_horizon_s: int = 4 * 3600
    # The trend's window; a process without samples a window ago is too young to judge (start-up growth).
    # present_over_time, not a plain offset: one failed scrape (a stale marker) must not reset the `for`.
    memory_window_s: int = 1800
    # End-to-end tests shrink every `for` by this factor (10m -> 10s at 1/60), keeping production's order.
    for_scale: float | None = None


@dataclass(frozen=True)
class AlertSpec:
    name: str
    expr: str
    severity: str
    summary: str
    description: str
    metrics: tuple[str, ...]
    for_: str | None = None
    bad: dict = field(default_factory=dict)  # series -> values, must fire
    healthy: dict = field(default_factory=dict)  # must stay silent
    boundary: dict = field(default_factory=dict)  # exactly at the threshold: must stay silent
    eval_time: str = "15m"
    interval: str = "1m"


def _per_model(metric, op: str, default: float, by_model: dict) -> str:
    """``metric op threshold`` with per-model thresholds and a default for every other model. ``metric`` is a
    metric name or a function of a label matcher (``'model="x"'``) returning an expression."""
    make = metric if callable(metric) else (lambda m: f"{metric}{{{m}}}" if m else metric)
    if not by_model:
        return f"{make('')} {op} {default}"
    known = "|".join(sorted(by_model))
    parts = [f'{make(f"model={chr(34)}{m}{chr(34)}")} {op} {v}' for m, v in sorted(by_model.items())]
    return " or ".join(parts + [f'{make(f"model!~{chr(34)}{known}{chr(34)}")} {op} {default}'])


def _band_expr(t: Thresholds) -> str:
    parts = []
    for model, (lo, hi) in sorted(t.activation_band.items()):
        parts.append(f'(moescope_activation_ratio{{model="{model}"}} < {lo} or '
                     f'moescope_activation_ratio{{model="{model}"}} > {hi})')
    known = "|".join(sorted(t.activation_band))
    lo, hi = t.activation_default_band
    parts.append(f'(moescope_activation_ratio{{model!~"{known}"}} < {lo} or '
                 f'moescope_activation_ratio{{model!~"{known}"}} > {hi})')
    return " or ".join(parts)


def specs(t: Thresholds = Thresholds()) -> list[AlertSpec]:
    def hit(m: str) -> str:
        return (f"(sum by (model, rank, layer) (rate(moescope_expert_cache_hits_total{{{m}}}[5m])) / "
                f"sum by (model, rank, layer) (rate(moescope_expert_cache_lookups_total{{{m}}}[5m])))")

    # Load that moved with the traffic away from the baseline is drift (its own alert), not imbalance.
    mem_w = _scaled(f"{t.memory_window_s}s", t.for_scale) if t.for_scale else f"{t.memory_window_s // 60}m"
    cv = _per_model("moescope_expert_load_cv_ratio", ">", t.load_cv, t.load_cv_by_model)
    drift = _per_model("moescope_routing_drift_jsd_bits", ">", t.drift_jsd_bits, t.drift_jsd_bits_by_model)
    return [
        AlertSpec("MoEExpertLoadImbalance", f"({cv}) unless on (model, rank, layer) ({drift})", "warning",
                  "Expert load is imbalanced.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} (rank {{ $labels.rank }}) has a load CV of "
                  "{{ $value | printf \"%.2f\" }} (healthy: under 0.10).",
                  ("moescope_expert_load_cv_ratio",), "10m",
                  bad={f"moescope_expert_load_cv_ratio{{{L}}}": "0.3x20"},
                  healthy={f"moescope_expert_load_cv_ratio{{{L}}}": "0.05x20"},
                  boundary={f"moescope_expert_load_cv_ratio{{{L}}}": f"{t.load_cv}x20"}),
        AlertSpec("MoEExpertCollapse", f"moescope_expert_load_top_share_ratio > {t.collapse_top_share}", "critical",
                  "Routing collapsed onto one expert.",
                  "{{ $value | humanizePercentage }} of layer {{ $labels.layer }}'s tokens choose one expert in "
                  "{{ $labels.model }} (rank {{ $labels.rank }}).",
                  ("moescope_expert_load_top_share_ratio",), "2m",
                  bad={f"moescope_expert_load_top_share_ratio{{{L}}}": "0.9x20"},
                  healthy={f"moescope_expert_load_top_share_ratio{{{L}}}": "0.3x20"},
                  boundary={f"moescope_expert_load_top_share_ratio{{{L}}}": f"{t.collapse_top_share}x20"}),
        AlertSpec("MoEDeadExperts",
                  "moescope_dead_experts > 0 and on (model, rank, layer) "
                  "rate(moescope_router_tokens_total[5m]) > 0", "warning",
                  "Experts receive no tokens.",
                  "{{ $value }} experts of layer {{ $labels.layer }} in {{ $labels.model }} got no slot in the "
                  "window while the layer routed traffic.",
                  ("moescope_dead_experts", "moescope_router_tokens_total"), "10m",
                  bad={f"moescope_dead_experts{{{L}}}": "2x20", f"moescope_router_tokens_total{{{L}}}": "0+600x20"},
                  healthy={f"moescope_dead_experts{{{L}}}": "0x20", f"moescope_router_tokens_total{{{L}}}": "0+600x20"},
                  boundary={f"moescope_dead_experts{{{L}}}": "2x20", f"moescope_router_tokens_total{{{L}}}": "5x20"}),
        AlertSpec("MoEActivationRatioOutOfBand", _band_expr(t), "warning",
                  "The activation ratio left the model's band.",
                  "{{ $labels.model }} (rank {{ $labels.rank }}) touches {{ $value | humanizePercentage }} of its "
                  "parameters per token.", ("moescope_activation_ratio",), "10m",
                  bad={'moescope_activation_ratio{model="tiny-demo",rank="0"}': "0.30x20"},
                  healthy={'moescope_activation_ratio{model="tiny-demo",rank="0"}': "0.45x20"},
                  boundary={'moescope_activation_ratio{model="tiny-demo",rank="0"}':
                            f"{t.activation_band['tiny-demo'][1]}x20"}),
        AlertSpec("MoEAllToAllLatencyHigh",
                  "histogram_quantile(0.99, sum by (le, model, rank, op) "
                  f"(rate(moescope_all_to_all_seconds_bucket[5m]))) > {t.all_to_all_p99_s}", "warning",
                  "All-to-all p99 latency is high.",
                  "p99 of the {{ $labels.op }} all-to-all on rank {{ $labels.rank }} of {{ $labels.model }} is "
                  "{{ $value | humanizeDuration }}.", ("moescope_all_to_all_seconds",), "10m",
                  bad={'moescope_all_to_all_seconds_bucket{model="m",rank="0",op="dispatch",le="0.001"}': "0x20",
                       'moescope_all_to_all_seconds_bucket{model="m",rank="0",op="dispatch",le="0.01"}': "0+60x20",
                       'moescope_all_to_all_seconds_bucket{model="m",rank="0",op="dispatch",le="+Inf"}': "0+60x20"},
                  healthy={'moescope_all_to_all_seconds_bucket{model="m",rank="0",op="dispatch",le="0.001"}':
                           "0+60x20",
                           'moescope_all_to_all_seconds_bucket{model="m",rank="0",op="dispatch",le="0.01"}': "0+60x20",
                           'moescope_all_to_all_seconds_bucket{model="m",rank="0",op="dispatch",le="+Inf"}': "0+60x20"},
                  boundary={'moescope_all_to_all_seconds_bucket{model="m",rank="0",op="dispatch",le="0.002"}':
                            "0+60x20",
                            'moescope_all_to_all_seconds_bucket{model="m",rank="0",op="dispatch",le="+Inf"}': "0+60x20"}),
        AlertSpec("MoESlowRank",
                  "sum by (model, peer) (rate(moescope_all_to_all_peer_wait_seconds_total[5m])) / ignoring (peer) "
                  "group_left sum by (model) (rate(moescope_all_to_all_peer_wait_seconds_total[5m])) > "
                  f"{t.slow_rank_share}", "warning",
                  "One rank makes the others wait in the all-to-all.",
                  "Rank {{ $labels.peer }} accounts for {{ $value | humanizePercentage }} of the time ranks of "
                  "{{ $labels.model }} wait on their peers.", ("moescope_all_to_all_peer_wait_seconds_total",), "5m",
                  bad={'moescope_all_to_all_peer_wait_seconds_total{model="m",rank="0",peer="2"}': "0+6x20",
                       'moescope_all_to_all_peer_wait_seconds_total{model="m",rank="0",peer="1"}': "0+0.1x20",
                       'moescope_all_to_all_peer_wait_seconds_total{model="m",rank="1",peer="2"}': "0+6x20"},
                  healthy={'moescope_all_to_all_peer_wait_seconds_total{model="m",rank="0",peer="2"}': "0+1x20",
                           'moescope_all_to_all_peer_wait_seconds_total{model="m",rank="0",peer="1"}': "0+1x20",
                           'moescope_all_to_all_peer_wait_seconds_total{model="m",rank="1",peer="2"}': "0+1x20",
                           'moescope_all_to_all_peer_wait_seconds_total{model="m",rank="1",peer="0"}': "0+1x20"},
                  boundary={'moescope_all_to_all_peer_wait_seconds_total{model="m",rank="0",peer="2"}': "0+1x20",
                            'moescope_all_to_all_peer_wait_seconds_total{model="m",rank="0",peer="1"}': "0+1x20"}),
        AlertSpec("MoEExpertCacheHitRateLow", _per_model(hit, "<", t.cache_hit_rate,
                                                         t.cache_hit_rate_by_model), "warning",
                  "The expert cache hit rate is low.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} (rank {{ $labels.rank }}) hits its expert "
                  "cache {{ $value | humanizePercentage }} of the time.",
                  ("moescope_expert_cache_hits_total", "moescope_expert_cache_lookups_total"), "10m",
                  bad={f"moescope_expert_cache_hits_total{{{L}}}": "0+30x20",
                       f"moescope_expert_cache_lookups_total{{{L}}}": "0+100x20"},
                  healthy={f"moescope_expert_cache_hits_total{{{L}}}": "0+98x20",
                           f"moescope_expert_cache_lookups_total{{{L}}}": "0+100x20"},
                  boundary={f"moescope_expert_cache_hits_total{{{L}}}": "0+85x20",
                            f"moescope_expert_cache_lookups_total{{{L}}}": "0+100x20"}),
        AlertSpec("MoEExpertSwitchJitter",
                  "histogram_quantile(0.99, sum by (le, model, rank) (rate(moescope_expert_fetch_seconds_bucket[5m])))"
                  f" > {t.fetch_p99_s}", "warning", "Expert fetches are slow.",
                  "p99 time to make an expert resident on {{ $labels.model }} rank {{ $labels.rank }} is "
                  "{{ $value | humanizeDuration }}.", ("moescope_expert_fetch_seconds",), "5m",
                  bad={f'moescope_expert_fetch_seconds_bucket{{{L},le="0.01"}}': "0x20",
                       f'moescope_expert_fetch_seconds_bucket{{{L},le="0.25"}}': "0+10x20",
                       f'moescope_expert_fetch_seconds_bucket{{{L},le="+Inf"}}': "0+10x20"},
                  healthy={f'moescope_expert_fetch_seconds_bucket{{{L},le="0.01"}}': "0+10x20",
                           f'moescope_expert_fetch_seconds_bucket{{{L},le="+Inf"}}': "0+10x20"},
                  boundary={f'moescope_expert_fetch_seconds_bucket{{{L},le="0.05"}}': "0+10x20",
                            f'moescope_expert_fetch_seconds_bucket{{{L},le="+Inf"}}': "0+10x20"}),
        AlertSpec("MoERouterNonFiniteLogits", "increase(moescope_router_nonfinite_logits_total[5m]) > 0", "critical",
                  "The router produced NaN or Inf logits.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} (rank {{ $labels.rank }}) produced "
                  "{{ $value | printf \"%.0f\" }} non-finite router logits in 5 minutes.",
                  ("moescope_router_nonfinite_logits_total",), None, eval_time="3m",
                  bad={f"moescope_router_nonfinite_logits_total{{{L}}}": "0 0 3 3 3 3"},
                  healthy={f"moescope_router_nonfinite_logits_total{{{L}}}": "0x20"},
                  boundary={f"moescope_router_nonfinite_logits_total{{{L}}}": "5x20"}),
        AlertSpec("MoERoutingFlips", f"moescope_routing_flip_ratio > {t.flip_ratio}", "warning",
                  "Routing is not deterministic: the canary batch routes differently.",
                  "{{ $value | humanizePercentage }} of the canary tokens changed experts in layer {{ $labels.layer }}"
                  " of {{ $labels.model }} (rank {{ $labels.rank }}).", ("moescope_routing_flip_ratio",), "5m",
                  bad={f"moescope_routing_flip_ratio{{{L}}}": "0.12x20"},
                  healthy={f"moescope_routing_flip_ratio{{{L}}}": "0x20"},
                  boundary={f"moescope_routing_flip_ratio{{{L}}}": f"{t.flip_ratio}x20"}),
        AlertSpec("MoERoutingDrift", drift, "warning",
                  "Routing drifted away from the baseline.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} routes with a JS divergence of "
                  "{{ $value | printf \"%.3f\" }} bits from its baseline.", ("moescope_routing_drift_jsd_bits",),
                  "10m", bad={f"moescope_routing_drift_jsd_bits{{{L}}}": "0.3x20"},
                  healthy={f"moescope_routing_drift_jsd_bits{{{L}}}": "0.01x20"},
                  boundary={f"moescope_routing_drift_jsd_bits{{{L}}}": f"{t.drift_jsd_bits}x20"}),
        AlertSpec("MoETokensDropped",
                  "sum by (model, rank, layer) (rate(moescope_tokens_dropped_total[5m])) / sum by (model, rank, layer) "
                  f"(rate(moescope_router_tokens_total[5m])) > {t.drop_ratio}", "warning",
                  "The capacity limit drops tokens.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} drops {{ $value | humanizePercentage }} slots "
                  "per routed token.", ("moescope_tokens_dropped_total", "moescope_router_tokens_total"), "5m",
                  bad={f"moescope_tokens_dropped_total{{{L}}}": "0+50x20",
                       f"moescope_router_tokens_total{{{L}}}": "0+1000x20"},
                  healthy={f"moescope_tokens_dropped_total{{{L}}}": "0x20",
                           f"moescope_router_tokens_total{{{L}}}": "0+1000x20"},
                  boundary={f"moescope_tokens_dropped_total{{{L}}}": "0+10x20",
                            f"moescope_router_tokens_total{{{L}}}": "0+1000x20"}),
        AlertSpec("MoEMemoryGrowth",
                  f"(predict_linear(moescope_process_resident_memory_bytes[{mem_w}], {t.memory_horizon_s}) > "
                  f"{t.memory_capacity_bytes} and on (model, rank) "
                  f"present_over_time(moescope_process_resident_memory_bytes[{mem_w}] offset {mem_w})) or "
                  f"(predict_linear(moescope_gpu_memory_used_bytes[{mem_w}], {t.memory_horizon_s}) > "
                  f"on (model, rank, gpu, UUID) moescope_gpu_memory_total_bytes and on (model, rank, gpu, UUID) "
                  f"present_over_time(moescope_gpu_memory_used_bytes[{mem_w}] offset {mem_w}))",
                  "warning", "Memory grows towards capacity.",
                  "At its current rate {{ $labels.model }} (rank {{ $labels.rank }}) reaches memory capacity within "
                  f"{t.memory_horizon_s // 3600}h (predicted {{{{ $value | humanize1024 }}}}B).",
                  ("moescope_process_resident_memory_bytes", "moescope_gpu_memory_used_bytes",
                   "moescope_gpu_memory_total_bytes"), "10m", eval_time="45m",
                  bad={'moescope_process_resident_memory_bytes{model="m",rank="0"}': "1e9+1e8x60"},
                  healthy={'moescope_process_resident_memory_bytes{model="m",rank="0"}': "1e9x60"},
                  boundary={'moescope_process_resident_memory_bytes{model="m",rank="0"}': "1e9+1e6x60"}),
        AlertSpec("MoEExporterDown", 'up{job=~"moescope.*"} == 0', "critical", "A moescope exporter is down.",
                  "Prometheus cannot scrape {{ $labels.instance }} (job {{ $labels.job }}).", ("up",), "1m",
                  bad={'up{job="moescope",instance="127.0.0.1:9400"}': "0x20"},
                  healthy={'up{job="moescope",instance="127.0.0.1:9400"}': "1x20"},
                  boundary={'up{job="moescope",instance="127.0.0.1:9400"}': "1x20"}),
        AlertSpec("MoEExporterAbsent", 'absent(up{job=~"moescope.*"})', "critical",
                  "No moescope exporter is scraped at all.",
                  "Prometheus has no moescope scrape target: check the scrape configuration.", ("up",), "5m",
                  bad={'up{job="other",instance="x"}': "1x20"},
                  healthy={'up{job="moescope",instance="127.0.0.1:9400"}': "1x20"},
                  boundary={'up{job="moescope",instance="127.0.0.1:9400"}': "0x20"}),
        AlertSpec("Watchdog", "vector(1)", "none", "Always firing: proves the alerting pipeline works.",
                  "This alert always fires. If it stops arriving, alerting itself is broken.", (), None,
                  eval_time="1m", bad={}, healthy={}, boundary={}),
    ]


def _scaled(duration: str, factor: float) -> str:
    seconds = int(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]
    return f"{max(1, round(seconds * factor))}s"


def rules_document(t: Thresholds = Thresholds()) -> dict:
    rules = []
    for s in specs(t):
        rule = {"alert": s.name, "expr": s.expr}
        if s.for_:
            rule["for"] = _scaled(s.for_, t.for_scale) if t.for_scale else s.for_
        rule["labels"] = {"severity": s.severity}
        rule["annotations"] = {"summary": s.summary, "description": s.description,
                               "runbook_url": f"{RUNBOOK_BASE}/{s.name}.md"}
        rules.append(rule)
    return {"groups": [{"name": "moescope", "rules": rules}]}


def tests_document(t: Thresholds = Thresholds()) -> dict:
    """promtool unit tests: each alert fires on its bad series, not on healthy or boundary series."""
    tests = []
    for s in specs(t):
        if s.name == "Watchdog":
            tests.append({"name": "Watchdog always fires", "interval": "1m", "input_series": [],
                          "alert_rule_test": [{"eval_time": "1m", "alertname": "Watchdog",
                                               "exp_alerts": [{"exp_labels": {"severity": "none"},
                                                               "exp_annotations": _annotations(s)}]}]})
            continue
        for case, series in (("fires", s.bad), ("healthy", s.healthy), ("boundary", s.boundary)):
            expected = []
            if case == "fires":
                expected = [{"exp_labels": {"severity": s.severity, **labels},
                             "exp_annotations": {**_annotations(s), "description": EXPECTED_DESCRIPTIONS[s.name]}}
                            for labels in _expected_labels(s)]
            tests.append({"name": f"{s.name} {case}", "interval": s.interval,
                          "input_series": [{"series": k, "values": v} for k, v in series.items()],
                          "alert_rule_test": [{"eval_time": s.eval_time, "alertname": s.name,
                                               "exp_alerts": expected}]})
    return {"rule_files": ["../moescope-rules.yml"], "evaluation_interval": "1m", "tests": tests}


def _annotations(s: AlertSpec) -> dict:
    return {"summary": s.summary, "description": s.description, "runbook_url": f"{RUNBOOK_BASE}/{s.name}.md"}


def _expected_labels(s: AlertSpec) -> list[dict]:
    """Label sets the bad series make the alert fire with (what the expression keeps)."""
    fixed = {
        "MoEExpertLoadImbalance": [{"model": "m", "rank": "0", "layer": "1"}],
        "MoEExpertCollapse": [{"model": "m", "rank": "0", "layer": "1"}],
        "MoEDeadExperts": [{"model": "m", "rank": "0", "layer": "1"}],
        "MoEActivationRatioOutOfBand": [{"model": "tiny-demo", "rank": "0"}],
        "MoEAllToAllLatencyHigh": [{"model": "m", "rank": "0", "op": "dispatch"}],
        "MoESlowRank": [{"model": "m", "peer": "2"}],
        "MoEExpertCacheHitRateLow": [{"model": "m", "rank": "0", "layer": "1"}],
        "MoEExpertSwitchJitter": [{"model": "m", "rank": "0"}],
        "MoERouterNonFiniteLogits": [{"model": "m", "rank": "0", "layer": "1"}],
        "MoETokensDropped": [{"model": "m", "rank": "0", "layer": "1"}],
        "MoERoutingFlips": [{"model": "m", "rank": "0", "layer": "1"}],
        "MoERoutingDrift": [{"model": "m", "rank": "0", "layer": "1"}],
        "MoEMemoryGrowth": [{"model": "m", "rank": "0"}],
        "MoEExporterDown": [{"job": "moescope", "instance": "127.0.0.1:9400"}],
        "MoEExporterAbsent": [{}],  # absent() of a regex matcher carries no labels
    }
    return fixed[s.name]


# What each alert's description renders to on its "fires" series (worked out by hand from the series, so
# the test checks the templates too: e.g. p99 of 60 obs/min all in (1 ms, 10 ms] = 1 + 9 * 0.99 = 9.91 ms).
EXPECTED_DESCRIPTIONS = {
    "MoEExpertLoadImbalance": "Layer 1 of m (rank 0) has a load CV of 0.30 (healthy: under 0.10).",
    "MoEExpertCollapse": "90% of layer 1's tokens choose one expert in m (rank 0).",
    "MoEDeadExperts": "2 experts of layer 1 in m got no slot in the window while the layer routed traffic.",
    "MoEActivationRatioOutOfBand": "tiny-demo (rank 0) touches 30% of its parameters per token.",
    "MoEAllToAllLatencyHigh": "p99 of the dispatch all-to-all on rank 0 of m is 9.91ms.",
    "MoESlowRank": "Rank 2 accounts for 99.17% of the time ranks of m wait on their peers.",  # 12 / 12.1
    "MoEExpertCacheHitRateLow": "Layer 1 of m (rank 0) hits its expert cache 30% of the time.",
    "MoEExpertSwitchJitter": "p99 time to make an expert resident on m rank 0 is 247.6ms.",  # 10 + 240 * .99
    "MoERouterNonFiniteLogits": "Layer 1 of m (rank 0) produced 3 non-finite router logits in 5 minutes.",
    "MoETokensDropped": "Layer 1 of m drops 5% slots per routed token.",
    "MoERoutingFlips": "12% of the canary tokens changed experts in layer 1 of m (rank 0).",
    "MoERoutingDrift": "Layer 1 of m routes with a JS divergence of 0.300 bits from its baseline.",
    # 5.5e9 B at 45 min, +1e8 B/min: 5.5e9 + 1e8 / 60 * 14400 = 2.95e10 B = 27.47 GiB
    "MoEMemoryGrowth": "At its current rate m (rank 0) reaches memory capacity within 4h (predicted 27.47GiB).",
    "MoEExporterDown": "Prometheus cannot scrape 127.0.0.1:9400 (job moescope).",
    "MoEExporterAbsent": "Prometheus has no moescope scrape target: check the scrape configuration.",
}


def write(root: Path, t: Thresholds = Thresholds()) -> list[Path]:
    import yaml

    out = root / "collectors" / "prometheus"
    (out / "tests").mkdir(parents=True, exist_ok=True)
    files = [(out / "moescope-rules.yml", rules_document(t)), (out / "tests" / "moescope-rules.test.yml",
                                                                tests_document(t))]
    header = "# Generated by `moescope alerts build` from moescope/alerts/rules.py: edit there, not here.\n"
    for path, doc in files:
        path.write_text(header + yaml.safe_dump(doc, sort_keys=False, width=120))
    return [p for p, _ in files]
