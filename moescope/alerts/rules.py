"""Alert and recording rules: one source of truth, generated to collectors/prometheus/moescope-rules.yml.

Every bar comes from the thresholds object (``moescope.thresholds``): a model with its own bar gets its own
selector (``model="deepseek-v3-shape"``), every other model the default (``model!~"..."``), and descriptions
name the bar of the model that fired. Each ``AlertSpec`` holds the expression, its ``for``, severity, summary,
templated description, the metrics it reads (checked against the catalogue by a test), and the promtool cases
that must make it fire or keep it silent (``moescope.alerts.unit_tests`` writes them). ``runbook_url`` points
to ``playbooks/<AlertName>.md``. Regenerate with ``moescope alerts build``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from moescope.thresholds import Thresholds

__all__ = ["Thresholds", "AlertSpec", "Case", "specs", "rules_document", "write", "RUNBOOK_BASE"]

RUNBOOK_BASE = "https://github.com/moescope/moescope/blob/main/playbooks"
L = 'model="m",rank="0",layer="1"'  # labels of the unit-test series


@dataclass(frozen=True)
class Case:
    """A promtool case beyond fires/healthy/boundary: ``series`` -> values; ``fires`` with these labels and
    this rendered description, or silent (``fires=None``)."""

    name: str
    series: dict
    fires: dict | None = None
    description: str | None = None


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
    cases: tuple[Case, ...] = ()
    eval_time: str = "15m"
    interval: str = "1m"


def sel(metric: str, matcher: str) -> str:
    return f"{metric}{{{matcher}}}" if matcher else metric


def per_model(t: Thresholds, name: str, make: Callable[[str, object], str]) -> str:
    """``make(matcher, bar)`` for each model with its own bar ``name`` and for every other model (the default),
    joined with ``or``: one expression, each model judged by its own bar."""
    own = t.overrides(name)
    default = getattr(t.default, name)
    if not own:
        return make("", default)
    known = "|".join(own)
    parts = [make(f'model="{m}"', v) for m, v in own.items()]
    return " or ".join(f"({p})" for p in [*parts, make(f'model!~"{known}"', default)])


def bar_text(t: Thresholds, name: str, fmt: Callable[[object], str] = str) -> str:
    """A description's template text naming the bar of the model that fired."""
    own = t.overrides(name)
    default = fmt(getattr(t.default, name))
    if not own:
        return default
    out = ""
    for i, (m, v) in enumerate(own.items()):
        out += ("{{ if" if i == 0 else "{{ else if") + f' eq $labels.model "{m}" }}}}' + fmt(v)
    return out + "{{ else }}" + default + "{{ end }}"


def excess_cv(m: str) -> str:
    """The load CV beyond sampling noise, in PromQL (``moescope.thresholds.excess_cv`` in Python)."""
    return (f"sqrt(clamp_min({sel('moescope_expert_load_cv_ratio', m)} ^ 2 - "
            f"{sel('moescope_expert_load_cv_noise_ratio', m)} ^ 2, 0))")


def activation_vs_expected(m: str) -> str:
    """Observed / expected activation ratio (the expected one: the model config's, exported as a gauge)."""
    return f"{sel('moescope_activation_ratio', m)} / {sel('moescope_activation_expected_ratio', m)}"


def _hit(m: str) -> str:
    return (f"(sum by (model, rank, layer) (rate({sel('moescope_expert_cache_hits_total', m)}[5m])) / "
            f"sum by (model, rank, layer) (rate({sel('moescope_expert_cache_lookups_total', m)}[5m])))")


def _pct(v) -> str:
    return f"{v:.0%}"


def specs(t: Thresholds = Thresholds()) -> list[AlertSpec]:
    from moescope.alerts import cases

    d = t.default
    mem_w = _scaled(f"{d.memory_window_s}s", t.for_scale) if t.for_scale else f"{d.memory_window_s // 60}m"
    drift = per_model(t, "drift_jsd_bits", lambda m, b: f"{sel('moescope_routing_drift_jsd_bits', m)} > {b}")
    # Load that moved with the traffic away from the baseline is drift (its own alert), not imbalance.
    imbalance = f"({per_model(t, 'load_cv', lambda m, b: f'{excess_cv(m)} > {b}')}) " \
        f"unless on (model, rank, layer) ({drift})"
    # Models that judge imbalance only from a minimum of slots per expert (thin windows are samples of requests)
    for m, b in t.overrides("imbalance_min_slots_per_expert").items():
        imbalance = f"({imbalance}) unless on (model, rank, layer) " \
            f"({sel('moescope_window_slots_per_expert', f'model={chr(34)}{m}{chr(34)}')} < {b})"
    band = per_model(t, "activation_band", lambda m, b: f"{activation_vs_expected(m)} < {b[0]} or "
                                                        f"{activation_vs_expected(m)} > {b[1]}")
    lo, hi = d.activation_band
    def waits(m: str) -> str:
        return f"rate({sel('moescope_all_to_all_peer_wait_seconds_total', m)}[5m])"

    def dispatches(m: str) -> str:
        matcher = ",".join(x for x in (m, 'op="dispatch"') if x)
        return f"rate(moescope_all_to_all_seconds_count{{{matcher}}}[5m])"

    # A slow peer takes most of the time ranks wait on peers AND makes them wait long per dispatch (with two
    # ranks one peer always holds over half of a tiny total: the share alone would page on healthy pairs).
    slow = per_model(t, "slow_rank_share", lambda m, b: (
        f"sum by (model, peer) ({waits(m)}) / ignoring (peer) group_left sum by (model) ({waits(m)}) > {b}"))
    slow_wait = per_model(t, "slow_rank_wait_s", lambda m, b: (
        f"max by (model, peer) ({waits(m)} / ignoring (peer, op) group_left {dispatches(m)}) > {b}"))
    return [
        AlertSpec("MoEExpertLoadImbalance", imbalance, "warning", "Expert load is imbalanced.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} (rank {{ $labels.rank }}) has a load CV of "
                  "{{ $value | printf \"%.2f\" }} beyond sampling noise (this model's bar: "
                  + bar_text(t, "load_cv") + ").",
                  ("moescope_expert_load_cv_ratio", "moescope_expert_load_cv_noise_ratio",
                   "moescope_window_slots_per_expert"), "10m",
                  bad={f"moescope_expert_load_cv_ratio{{{L}}}": "0.3x20",
                       f"moescope_expert_load_cv_noise_ratio{{{L}}}": "0.1x20"},
                  healthy={f"moescope_expert_load_cv_ratio{{{L}}}": "0.05x20",
                           f"moescope_expert_load_cv_noise_ratio{{{L}}}": "0.03x20"},
                  boundary={f"moescope_expert_load_cv_ratio{{{L}}}": f"{d.load_cv}x20",
                            f"moescope_expert_load_cv_noise_ratio{{{L}}}": "0x20"},
                  cases=cases.imbalance(t)),
        AlertSpec("MoEExpertCollapse", per_model(t, "collapse_top_share", lambda m, b: (
                      f"{sel('moescope_expert_load_top_share_ratio', m)} > {b}")), "critical",
                  "Routing collapsed onto one expert.",
                  "{{ $value | humanizePercentage }} of layer {{ $labels.layer }}'s tokens choose one expert in "
                  "{{ $labels.model }} (rank {{ $labels.rank }}).",
                  ("moescope_expert_load_top_share_ratio",), "2m",
                  bad={f"moescope_expert_load_top_share_ratio{{{L}}}": "0.9x20"},
                  healthy={f"moescope_expert_load_top_share_ratio{{{L}}}": "0.3x20"},
                  boundary={f"moescope_expert_load_top_share_ratio{{{L}}}": f"{d.collapse_top_share}x20"}),
        AlertSpec("MoEDeadExperts", per_model(t, "dead_min_expected_slots", lambda m, b: (
                      f"{sel('moescope_dead_experts', m)} > 0 and "
                      f"{sel('moescope_window_slots_per_expert', m)} >= {b}")), "warning",
                  "Experts receive no tokens.",
                  "{{ $value }} experts of layer {{ $labels.layer }} in {{ $labels.model }} got no slot in the "
                  "window, where uniform routing would have sent each at least "
                  + bar_text(t, "dead_min_expected_slots", lambda v: f"{v:g}") + ".",
                  ("moescope_dead_experts", "moescope_window_slots_per_expert"), "10m",
                  bad={f"moescope_dead_experts{{{L}}}": "2x20", f"moescope_window_slots_per_expert{{{L}}}": "75x20"},
                  healthy={f"moescope_dead_experts{{{L}}}": "0x20",
                           f"moescope_window_slots_per_expert{{{L}}}": "75x20"},
                  boundary={f"moescope_dead_experts{{{L}}}": "2x20",
                            f"moescope_window_slots_per_expert{{{L}}}": f"{d.dead_min_expected_slots * 0.99}x20"},
                  cases=cases.dead(t)),
        AlertSpec("MoEActivationRatioOutOfBand", band, "warning",
                  "The activation ratio left the model's band.",
                  "{{ $labels.model }} (rank {{ $labels.rank }}) touches {{ $value | humanizePercentage }} of the "
                  "parameters its config says a token touches (band: " + bar_text(
                      t, "activation_band", lambda b: f"{b[0]:.0%}-{b[1]:.0%}") + ").",
                  ("moescope_activation_ratio", "moescope_activation_expected_ratio"), "10m",
                  bad={'moescope_activation_ratio{model="tiny-demo",rank="0"}': "0.30x20",
                       'moescope_activation_expected_ratio{model="tiny-demo",rank="0"}': "0.45x20"},
                  healthy={'moescope_activation_ratio{model="tiny-demo",rank="0"}': "0.45x20",
                           'moescope_activation_expected_ratio{model="tiny-demo",rank="0"}': "0.45x20"},
                  boundary={'moescope_activation_ratio{model="tiny-demo",rank="0"}': f"{0.5 * hi}x20",
                            'moescope_activation_expected_ratio{model="tiny-demo",rank="0"}': "0.5x20"},
                  cases=cases.activation(t)),
        AlertSpec("MoEAllToAllLatencyHigh", per_model(t, "all_to_all_p99_s", lambda m, b: (
                      "histogram_quantile(0.99, sum by (le, model, rank, op) "
                      f"(rate({sel('moescope_all_to_all_seconds_bucket', m)}[5m]))) > {b}")), "warning",
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
                  boundary={'moescope_all_to_all_seconds_bucket{model="m",rank="0",op="dispatch",'
                            f'le="{d.all_to_all_p99_s}"}}': "0+60x20",
                            'moescope_all_to_all_seconds_bucket{model="m",rank="0",op="dispatch",le="+Inf"}':
                                "0+60x20"}),
        AlertSpec("MoESlowRank", f"({slow}) and on (model, peer) ({slow_wait})", "warning",
                  "One rank makes the others wait in the all-to-all.",
                  "Rank {{ $labels.peer }} accounts for {{ $value | humanizePercentage }} of the time ranks of "
                  "{{ $labels.model }} wait on their peers (a slow peer: over "
                  + bar_text(t, "slow_rank_share", _pct) + " of the wait and over "
                  + bar_text(t, "slow_rank_wait_s", lambda v: f"{v * 1e3:g} ms") + " per dispatch).",
                  ("moescope_all_to_all_peer_wait_seconds_total", "moescope_all_to_all_seconds"), "5m",
                  bad=cases.slow_rank_bad(), healthy=cases.slow_rank_healthy(), boundary=cases.slow_rank_boundary(t),
                  cases=cases.slow_rank(t)),
        AlertSpec("MoEExpertCacheHitRateLow", per_model(t, "cache_hit_rate", lambda m, b: f"{_hit(m)} < {b}"),
                  "warning", "The expert cache hit rate is low.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} (rank {{ $labels.rank }}) hits its expert "
                  "cache {{ $value | humanizePercentage }} of the time (this model's floor: "
                  + bar_text(t, "cache_hit_rate", _pct) + ").",
                  ("moescope_expert_cache_hits_total", "moescope_expert_cache_lookups_total"), "10m",
                  bad={f"moescope_expert_cache_hits_total{{{L}}}": "0+30x20",
                       f"moescope_expert_cache_lookups_total{{{L}}}": "0+100x20"},
                  healthy={f"moescope_expert_cache_hits_total{{{L}}}": "0+98x20",
                           f"moescope_expert_cache_lookups_total{{{L}}}": "0+100x20"},
                  boundary={f"moescope_expert_cache_hits_total{{{L}}}": f"0+{d.cache_hit_rate * 100:g}x20",
                            f"moescope_expert_cache_lookups_total{{{L}}}": "0+100x20"}),
        AlertSpec("MoEExpertSwitchJitter", per_model(t, "fetch_p99_s", lambda m, b: (
                      "histogram_quantile(0.99, sum by (le, model, rank) "
                      f"(rate({sel('moescope_expert_fetch_seconds_bucket', m)}[5m]))) > {b}")), "warning",
                  "Expert fetches are slow.",
                  "p99 time to make an expert resident on {{ $labels.model }} rank {{ $labels.rank }} is "
                  "{{ $value | humanizeDuration }}.", ("moescope_expert_fetch_seconds",), "5m",
                  bad={f'moescope_expert_fetch_seconds_bucket{{{L},le="0.01"}}': "0x20",
                       f'moescope_expert_fetch_seconds_bucket{{{L},le="0.25"}}': "0+10x20",
                       f'moescope_expert_fetch_seconds_bucket{{{L},le="+Inf"}}': "0+10x20"},
                  healthy={f'moescope_expert_fetch_seconds_bucket{{{L},le="0.01"}}': "0+10x20",
                           f'moescope_expert_fetch_seconds_bucket{{{L},le="+Inf"}}': "0+10x20"},
                  boundary={f'moescope_expert_fetch_seconds_bucket{{{L},le="{d.fetch_p99_s}"}}': "0+10x20",
                            f'moescope_expert_fetch_seconds_bucket{{{L},le="+Inf"}}': "0+10x20"}),
        AlertSpec("MoERouterNonFiniteLogits", "increase(moescope_router_nonfinite_logits_total[5m]) > 0", "critical",
                  "The router produced NaN or Inf logits.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} (rank {{ $labels.rank }}) produced "
                  "{{ $value | printf \"%.0f\" }} non-finite router logits in 5 minutes.",
                  ("moescope_router_nonfinite_logits_total",), None, eval_time="3m",
                  bad={f"moescope_router_nonfinite_logits_total{{{L}}}": "0 0 3 3 3 3"},
                  healthy={f"moescope_router_nonfinite_logits_total{{{L}}}": "0x20"},
                  boundary={f"moescope_router_nonfinite_logits_total{{{L}}}": "5x20"}),
        AlertSpec("MoERoutingFlips", per_model(t, "flip_ratio", lambda m, b: (
                      f"{sel('moescope_routing_flip_ratio', m)} > {b}")), "warning",
                  "Routing is not deterministic: the canary batch routes differently.",
                  "{{ $value | humanizePercentage }} of the canary tokens changed experts in layer {{ $labels.layer }}"
                  " of {{ $labels.model }} (rank {{ $labels.rank }}).", ("moescope_routing_flip_ratio",), "5m",
                  bad={f"moescope_routing_flip_ratio{{{L}}}": "0.12x20"},
                  healthy={f"moescope_routing_flip_ratio{{{L}}}": "0x20"},
                  boundary={f"moescope_routing_flip_ratio{{{L}}}": f"{d.flip_ratio}x20"}),
        AlertSpec("MoERoutingDrift", drift, "warning",
                  "Routing drifted away from the baseline.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} routes with a JS divergence of "
                  "{{ $value | printf \"%.3f\" }} bits from its baseline (this model's bar: "
                  + bar_text(t, "drift_jsd_bits") + ").", ("moescope_routing_drift_jsd_bits",),
                  "10m", bad={f"moescope_routing_drift_jsd_bits{{{L}}}": "0.3x20"},
                  healthy={f"moescope_routing_drift_jsd_bits{{{L}}}": "0.01x20"},
                  boundary={f"moescope_routing_drift_jsd_bits{{{L}}}": f"{d.drift_jsd_bits}x20"}),
        AlertSpec("MoETokensDropped", per_model(t, "drop_ratio", lambda m, b: (
                      f"sum by (model, rank, layer) (rate({sel('moescope_tokens_dropped_total', m)}[5m])) / "
                      f"sum by (model, rank, layer) (rate({sel('moescope_router_tokens_total', m)}[5m])) > {b}")),
                  "warning", "The capacity limit drops tokens.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} drops {{ $value | humanizePercentage }} slots "
                  "per routed token.", ("moescope_tokens_dropped_total", "moescope_router_tokens_total"), "5m",
                  bad={f"moescope_tokens_dropped_total{{{L}}}": "0+50x20",
                       f"moescope_router_tokens_total{{{L}}}": "0+1000x20"},
                  healthy={f"moescope_tokens_dropped_total{{{L}}}": "0x20",
                           f"moescope_router_tokens_total{{{L}}}": "0+1000x20"},
                  boundary={f"moescope_tokens_dropped_total{{{L}}}": f"0+{d.drop_ratio * 1000:g}x20",
                            f"moescope_router_tokens_total{{{L}}}": "0+1000x20"}),
        AlertSpec("MoEMemoryGrowth",
                  f"(predict_linear(moescope_process_resident_memory_bytes[{mem_w}], {d.memory_horizon_s}) > "
                  f"{d.memory_capacity_bytes} and on (model, rank) "
                  f"present_over_time(moescope_process_resident_memory_bytes[{mem_w}] offset {mem_w})) or "
                  f"(predict_linear(moescope_gpu_memory_used_bytes[{mem_w}], {d.memory_horizon_s}) > "
                  f"moescope_gpu_memory_total_bytes and on (model, rank, gpu, UUID) "
                  f"present_over_time(moescope_gpu_memory_used_bytes[{mem_w}] offset {mem_w}))",
                  "warning", "Memory grows towards capacity.",
                  "At its current rate {{ $labels.model }} (rank {{ $labels.rank }}) reaches memory capacity within "
                  f"{d.memory_horizon_s // 3600}h (predicted {{{{ $value | humanize1024 }}}}B).",
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


# Recording rules: rates summed over ranks (ranks serving different tokens add up; lock-step ranks export routing
# once, so the sum counts every token once either way), and the per-expert share the heatmaps and `top` read.
RECORDING = (
    ("model_layer_expert:moescope_expert_tokens:rate1m",
     "sum without (instance, rank) (rate(moescope_expert_tokens_total[1m]))"),
    ("model_layer:moescope_router_tokens:rate1m",
     "sum without (instance, rank) (rate(moescope_router_tokens_total[1m]))"),
    ("model_layer_expert:moescope_expert_load_share:ratio1m",
     "model_layer_expert:moescope_expert_tokens:rate1m / ignoring (expert) group_left "
     "sum without (expert) (model_layer_expert:moescope_expert_tokens:rate1m)"),
)


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
    recording = [{"record": name, "expr": expr} for name, expr in RECORDING]
    return {"groups": [{"name": "moescope-recording", "rules": recording}, {"name": "moescope", "rules": rules}]}


def write(root: Path, t: Thresholds = Thresholds()) -> list[Path]:
    import yaml

    from moescope.alerts.unit_tests import tests_document

    out = root / "collectors" / "prometheus"
    (out / "tests").mkdir(parents=True, exist_ok=True)
    files = [(out / "moescope-rules.yml", rules_document(t)), (out / "tests" / "moescope-rules.test.yml",
                                                                tests_document(t))]
    header = "# Generated by `moescope alerts build` from moescope/alerts/rules.py: edit there, not here.\n"
    for path, doc in files:
        path.write_text(header + yaml.safe_dump(doc, sort_keys=False, width=120))
    return [p for p, _ in files]
