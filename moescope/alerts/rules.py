"""Alert and recording rules: one source of truth, generated to collectors/prometheus/moescope-rules.yml.

Every number in an expression or a description comes from the thresholds object (``moescope.thresholds``),
the same object ``top``, ``diagnose``, ``report`` and the dashboards judge by; no expression names a model.
What depends on the deployment arrives as series: the exporter's judged quantities (the load CV beyond sampling
noise, the hot factor, the dead experts sampling cannot explain, the drift noise, the ranks' straggler factor,
the cache's capacity) and the user's own baseline (``moescope baseline save``: its structural CV per layer), so
one expression judges every model. Each ``AlertSpec`` holds the expression, its ``for``, severity, summary,
templated description and the metrics it reads (checked against the catalogue by a test); the promtool cases
that must make it fire or keep it silent live in ``moescope.alerts.cases`` (``moescope.alerts.unit_tests``
writes them). ``runbook_url`` points to ``playbooks/<AlertName>.md``. Regenerate with ``moescope alerts build``.
"""

from __future__ import annotations

from dataclasses import dataclass

from moescope.thresholds import DEFAULT, Thresholds

__all__ = ["Thresholds", "AlertSpec", "specs", "rules_document", "RUNBOOK_BASE", "markdown_table"]

RUNBOOK_BASE = "https://github.com/moescope/moescope/blob/main/playbooks"
# The labels that name one exporter's layer: a live series and the baseline, noise or capacity series it is judged
# against come from the same exporter. instance and job keep replicas of one model (several processes serving
# the same name, each rank 0) apart: matched on (model, rank, layer) alone their series collide and the whole
# rule fails to evaluate ("found duplicate series for the match group").
LAYER_LABELS = "instance, job, model, rank, layer"
ON = f"on ({LAYER_LABELS})"


@dataclass(frozen=True)
class AlertSpec:
    name: str
    expr: str
    severity: str
    summary: str
    description: str
    metrics: tuple[str, ...]
    for_: str | None = None
    judges: str = ""  # docs/alerts.md's table: what is judged against what


def num(v: float) -> str:
    """A bar as PromQL and the docs write it (0.1, 1.5, 4: no float noise)."""
    return f"{v:g}"


def held(name: str, series: str, bar: float, t: Thresholds, reference: float = 1.0) -> str:
    """``series > bar``, and once ``name`` fires for a series, ``series > t.clear_bar(bar, reference)``
    (hysteresis: the rule reads its own firing alerts back from ``ALERTS``, written at its previous evaluation)."""
    return held_by(name, f"{series} > {num(bar)}", f"{series} > {num(t.clear_bar(bar, reference))}")


def held_by(name: str, fire: str, hold: str, match: str = "") -> str:
    """``fire``, and once ``name`` fires for a series, ``hold`` (a looser condition: its clear bar). ``match``:
    the ``or``'s matching where ``hold`` reads another series than ``fire`` (its metric name differs: the alert's
    labels would otherwise hold both)."""
    return (f'{fire} or {match + " " if match else ""}({hold} and ignoring (alertname, alertstate, severity) '
            f'ALERTS{{alertname="{name}", alertstate="firing"}})')


def _query(expr: str, found: str, missing: str) -> str:
    """Description text: ``found`` with ``VALUE`` the value of ``expr`` (``{SEL}``: the firing alert's model, rank
    and layer), ``missing`` where it returns nothing."""
    q = expr.replace("{SEL}", "{instance=%q,job=%q,model=%q,rank=%q,layer=%q}")
    args = "$labels.instance $labels.job $labels.model $labels.rank $labels.layer"
    return (f'{{{{ with printf "{q}" {args} | query }}}}'
            f'{found.replace("VALUE", "(. | first | value)")}{{{{ else }}}}{missing}{{{{ end }}}}')


# -- the judged quantities in PromQL (each one a ``Thresholds`` method in Python) --------------------------------
def baseline_bar(t: Thresholds = DEFAULT, m: str = "") -> str:
    """The imbalance bar of a layer with a baseline (``Thresholds.imbalance_bar``)."""
    s = f"{{{m}}}" if m else ""
    return (f"({num(t.imbalance_baseline_factor)} * moescope_baseline_load_cv_ratio{s} + "
            f"{num(t.imbalance_baseline_margin)})")


def drift_beyond_noise(m: str = "") -> str:
    """The JS divergence from the baseline beyond what sampling noise gives (bits; the rules and dashboards)."""
    s = f"{{{m}}}" if m else ""
    return f"moescope_routing_drift_jsd_bits{s} - {ON} group_left moescope_routing_drift_noise_bits{s}"


def drifted(t: Thresholds = DEFAULT, clear: bool = False) -> str:
    """Layers whose routing left the baseline by more than sampling noise explains (``Thresholds.drifted``;
    ``clear``: over the firing page's clear bar); the value is the divergence beyond noise, in bits."""
    return f"{drift_beyond_noise()} > {num(t.clear_bar(t.drift_bits, 0.0) if clear else t.drift_bits)}"


REF_CV = "moescope_reference_load_cv_ratio"
REF_TOP = "moescope_reference_top_share_ratio"


def imbalance_bar(t: Thresholds = DEFAULT, m: str = "") -> str:
    """Each layer's imbalance bar from its reference (``Thresholds.imbalance_bar_of``): 1.5 x the structural CV +
    0.1 of its baseline or learned reference, the no-reference bar against the fair share (reference="fair",
    asked for); no series (no bar) while the reference is being learned."""
    sel = f"{m}," if m else ""
    return (f"({num(t.imbalance_baseline_factor)} * {REF_CV}{{{sel}reference!=\"fair\"}} + "
            f"{num(t.imbalance_baseline_margin)} or {REF_CV}{{{sel}reference=\"fair\"}} * 0 + {num(t.imbalance_cv)})")


def imbalance_clear(t: Thresholds = DEFAULT) -> str:
    """Where a firing imbalance page clears (``Thresholds.imbalance_clear``): a quarter of the way back from its
    bar to the reference's CV."""
    bar = imbalance_bar(t)
    return f"({bar} - {num(t.clear_fraction)} * ({bar} - {REF_CV}))"


def imbalanced(t: Thresholds = DEFAULT, bar: str | None = None) -> str:
    """Layers whose load CV beyond noise is over their reference's bar (``imbalance_bar``); NaN (too few draws to
    judge) compares false; a layer still learning its reference has no bar."""
    return f"moescope_expert_load_excess_cv_ratio > {ON} {bar or imbalance_bar(t)}"


def collapse_bar(t: Thresholds = DEFAULT) -> str:
    """Each layer's collapse bar (``Thresholds.collapse_bar``): half of the way from its reference's top share to
    1, at least ``collapse_top_share``; a learned reference counts as at most ``collapse_top_share``."""
    ref = (f"({REF_TOP}{{reference=\"baseline\"}} or clamp_max({REF_TOP}{{reference!=\"baseline\"}}, "
           f"{num(t.collapse_top_share)}))")
    return f"clamp_min({ref} + {num(t.collapse_rise)} * (1 - {ref}), {num(t.collapse_top_share)})"


def collapse_clear(t: Thresholds = DEFAULT) -> str:
    ref = (f"({REF_TOP}{{reference=\"baseline\"}} or clamp_max({REF_TOP}{{reference!=\"baseline\"}}, "
           f"{num(t.collapse_top_share)}))")
    bar = collapse_bar(t)
    return f"({bar} - {num(t.clear_fraction)} * ({bar} - {ref}))"


def collapsed(t: Thresholds = DEFAULT, clear: bool = False) -> str:
    """Layers whose top share is over their reference's collapse bar (``clear``: its clear bar), or, with no
    reference yet, over ``Thresholds.collapse_ceiling`` (the absolute limit)."""
    top = "moescope_expert_load_top_share_ratio"
    bar = collapse_clear(t) if clear else collapse_bar(t)
    ceiling = t.collapse_clear(t.collapse_ceiling, "learning", None) if clear else t.collapse_ceiling
    return f"({top} > {ON} {bar} or ({top} > {num(ceiling)} unless {ON} {REF_TOP}))"


def activation_vs_expected(m: str = "") -> str:
    """Observed / expected activation ratio (the expected one: the model config's, exported as a gauge)."""
    s = f"{{{m}}}" if m else ""
    return f"moescope_activation_ratio{s} / moescope_activation_expected_ratio{s}"


def hit_rate(m: str = "", window: str = "5m", by: str = LAYER_LABELS) -> str:
    """The expert cache's hit rate per ``by`` (the rules: per layer of each exporter; dashboards: per model)."""
    s = f"{{{m}}}" if m else ""
    return (f"(sum by ({by}) (rate(moescope_expert_cache_hits_total{s}[{window}])) / "
            f"sum by ({by}) (rate(moescope_expert_cache_lookups_total{s}[{window}])))")


def cache_floor(t: Thresholds = DEFAULT, m: str = "") -> str:
    """The hit rate below which a cache thrashes (``Thresholds.cache_floor``), from its exported capacity."""
    s = f"{{{m}}}" if m else ""
    return f"({num(t.cache_floor_of_capacity)} * moescope_expert_cache_capacity_ratio{s})"


def specs(t: Thresholds = DEFAULT) -> list[AlertSpec]:
    mem_w = _scaled(f"{t.memory_window_s}s", t.for_scale) if t.for_scale else f"{t.memory_window_s // 60}m"
    # Load that moved with the traffic away from the baseline is drift (its own alert), not imbalance.
    imbalance = (f"({held_by('MoEExpertLoadImbalance', imbalanced(t), imbalanced(t, imbalance_clear(t)))}) "
                 f"unless {ON} ({drifted(t)})")
    ref_word = ('{{ with printf "moescope_reference_load_cv_ratio{instance=%q,job=%q,model=%q,rank=%q,layer=%q}" '
                "$labels.instance $labels.job $labels.model $labels.rank $labels.layer | query }}{{ with . | first }}"
                '{{ if eq .Labels.reference "fair" }}' + num(t.imbalance_cv) + " (against the fair share, as "
                "asked){{ else }}" + num(t.imbalance_baseline_factor) + ' x the structural CV {{ .Value | printf '
                '"%.2f" }} of its {{ .Labels.reference }} reference + ' + num(t.imbalance_baseline_margin)
                + "{{ end }}{{ end }}{{ end }}")
    bar = ref_word
    floor = _query(cache_floor(t, "SEL").strip("()"), "{{ humanizePercentage VALUE }}", "unknown")
    waits = "rate(moescope_all_to_all_peer_wait_seconds_total[5m])"
    dispatches = 'rate(moescope_all_to_all_seconds_count{op="dispatch"}[5m])'
    # A slow peer takes most of the time ranks wait on peers AND makes them wait long per dispatch (with two
    # ranks one peer always holds over half of a tiny total: the share alone would page on healthy pairs).
    slow = (f"sum by (model, peer) ({waits}) / ignoring (peer) group_left sum by (model) ({waits}) > "
            f"{num(t.slow_rank_share)}")
    slow_wait = (f"max by (model, peer) ({waits} / ignoring (peer, op) group_left {dispatches}) > "
                 f"{num(t.slow_rank_wait_s)}")
    hot_ref = ('{{ if eq $labels.reference "baseline" }}its baseline share{{ else if eq $labels.reference '
               '"learned" }}the share this deployment\'s traffic gave it (learned; no baseline loaded){{ else }}its '
               "fair share 1/E (no baseline loaded){{ end }}")
    return [
        AlertSpec("MoEExpertLoadImbalance", imbalance, "warning", "Expert load is imbalanced.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} (rank {{ $labels.rank }}) has a load CV of "
                  '{{ $value | printf "%.2f" }} beyond sampling noise; its bar: ' + bar + ".",
                  ("moescope_expert_load_excess_cv_ratio", "moescope_reference_load_cv_ratio",
                   "moescope_routing_drift_jsd_bits", "moescope_routing_drift_noise_bits"), "10m",
                  f"load CV beyond sampling noise > {num(t.imbalance_baseline_factor)} x its reference's structural "
                  f"CV + {num(t.imbalance_baseline_margin)} (the baseline, else the deployment's first full window, "
                  f"learned), > {num(t.imbalance_cv)} against the fair share only with --hot-reference fair; not "
                  "where the layer drifted; firing, it clears a quarter of the way back to the reference's CV"),
        # "learning": the exporter has not yet learned the layer's reference (its first full window): views name
        # such experts against 1/E, pages wait (a model's popular experts are not a change).
        AlertSpec("MoEExpertHot", held("MoEExpertHot", 'moescope_expert_hot_factor_ratio{reference!="learning"}',
                                       t.hot_factor, t), "warning",
                  "One expert takes several times its share.",
                  "Expert {{ $labels.expert }} of layer {{ $labels.layer }} in {{ $labels.model }} (rank "
                  '{{ $labels.rank }}) gets {{ $value | printf "%.1f" }}x ' + hot_ref + ", beyond sampling noise "
                  f"(bar: {num(t.hot_factor)}x).", ("moescope_expert_hot_factor_ratio",), "5m",
                  f"an expert's window share / its baseline share (else the share learned from the deployment's "
                  f"own windows, or 1/E with --hot-reference fair) > {num(t.hot_factor)}, significant against "
                  f"sampling noise; firing, it clears under {num(t.clear_bar(t.hot_factor))}"),
        AlertSpec("MoERankLoadImbalance", held("MoERankLoadImbalance", "moescope_rank_load_max_over_mean_ratio",
                                               t.rank_max_over_mean, t),
                  "warning", "One expert-parallel rank computes far more than the others.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }}: the busiest expert-parallel rank computes "
                  '{{ $value | printf "%.2f" }}x the mean rank\'s slots (bar: ' + num(t.rank_max_over_mean)
                  + "x); every all-to-all of the layer waits for it.", ("moescope_rank_load_max_over_mean_ratio",),
                  "10m", f"busiest rank's slots / the mean rank's, per layer, > {num(t.rank_max_over_mean)}; firing, "
                  f"it clears under {num(t.clear_bar(t.rank_max_over_mean))}"),
        AlertSpec("MoEExpertCollapse", held_by("MoEExpertCollapse", collapsed(t), collapsed(t, clear=True)),
                  "critical", "Routing collapsed onto one expert.",
                  "{{ $value | humanizePercentage }} of layer {{ $labels.layer }}'s tokens choose one expert in "
                  "{{ $labels.model }} (rank {{ $labels.rank }}).",
                  ("moescope_expert_load_top_share_ratio", "moescope_reference_top_share_ratio"), "2m",
                  f"share of the routed tokens choosing the busiest expert > {num(t.collapse_rise)} of the way from "
                  f"its reference's top share to 1, and > {num(t.collapse_top_share)} (a learned reference counts "
                  f"as at most {num(t.collapse_top_share)}: over {num(t.collapse_ceiling)} always pages); firing, it "
                  "clears a quarter of the way back to the reference"),
        AlertSpec("MoEDeadExperts", held_by("MoEDeadExperts", "moescope_dead_experts_unexpected > 0",
                                            "moescope_dead_experts_holding > 0", ON), "warning",
                  "Experts receive no tokens where they should.",
                  "{{ $value }} experts of layer {{ $labels.layer }} in {{ $labels.model }} got no slot in the "
                  "window where their reference share (the baseline's, else the one learned from this deployment's "
                  f"traffic; {t.dead_floor_share:.0%} of the fair share with --hot-reference fair) predicts at least "
                  f"{num(t.dead_min_expected_slots)} effective slots (firing, it holds down to "
                  f"{num(t.dead_clear_expected_slots)}).",
                  ("moescope_dead_experts_unexpected", "moescope_dead_experts_holding"), "10m",
                  f"experts with no slot where their reference share predicts >= {num(t.dead_min_expected_slots)} "
                  f"effective slots (the baseline's share, else the learned one; {t.dead_floor_share:.0%} of 1/E "
                  f"with --hot-reference fair); firing, it holds while they predict >= "
                  f"{num(t.dead_clear_expected_slots)}"),
        AlertSpec("MoEActivationRatioLow", f"{activation_vs_expected()} < {num(t.activation_floor)}", "warning",
                  "Tokens touch fewer parameters than the model's config says.",
                  "{{ $labels.model }} (rank {{ $labels.rank }}) touches {{ $value | humanizePercentage }} of the "
                  f"parameters its config says a token touches (floor: {t.activation_floor:.0%}).",
                  ("moescope_activation_ratio", "moescope_activation_expected_ratio"), "10m",
                  f"observed / the config's expected activation ratio < {num(t.activation_floor)}"),
        AlertSpec("MoEAllToAllLatencyHigh", "histogram_quantile(0.99, sum by (le, model, rank, op) "
                  f"(rate(moescope_all_to_all_seconds_bucket[5m]))) > {num(t.all_to_all_p99_s)}", "warning",
                  "All-to-all p99 latency is high.",
                  "p99 of the {{ $labels.op }} all-to-all on rank {{ $labels.rank }} of {{ $labels.model }} is "
                  "{{ $value | humanizeDuration }}.", ("moescope_all_to_all_seconds",), "10m",
                  f"p99 all-to-all time > {t.all_to_all_p99_s * 1e3:g} ms"),
        AlertSpec("MoESlowRank", f"({slow}) and on (model, peer) ({slow_wait})", "warning",
                  "One rank makes the others wait in the all-to-all.",
                  "Rank {{ $labels.peer }} accounts for {{ $value | humanizePercentage }} of the time ranks of "
                  f"{{{{ $labels.model }}}} wait on their peers (a slow peer: over {t.slow_rank_share:.0%} of the "
                  f"wait and over {t.slow_rank_wait_s * 1e3:g} ms per dispatch).",
                  ("moescope_all_to_all_peer_wait_seconds_total", "moescope_all_to_all_seconds"), "5m",
                  f"one peer > {t.slow_rank_share:.0%} of the ranks' wait and > {t.slow_rank_wait_s * 1e3:g} ms "
                  "per dispatch"),
        AlertSpec("MoEExpertCacheHitRateLow", f"{hit_rate()} < {ON} {cache_floor(t)}",
                  "warning", "The expert cache hit rate is low.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} (rank {{ $labels.rank }}) hits its expert "
                  "cache {{ $value | humanizePercentage }} of the time, under its floor " + floor + " ("
                  f"{t.cache_floor_of_capacity:.0%} of what a random resident set of its capacity would hit).",
                  ("moescope_expert_cache_hits_total", "moescope_expert_cache_lookups_total",
                   "moescope_expert_cache_capacity_ratio"), "10m",
                  f"hit rate (5m) < {num(t.cache_floor_of_capacity)} x the share of experts the cache holds"),
        AlertSpec("MoEExpertSwitchJitter", f"histogram_quantile({num(t.fetch_quantile)}, sum by (le, model, rank) "
                  f"(rate(moescope_expert_fetch_seconds_bucket[5m]))) > {num(t.fetch_p99_s)}", "warning",
                  "Expert fetches are slow.",
                  "p99 time to make an expert resident on {{ $labels.model }} rank {{ $labels.rank }} is "
                  "{{ $value | humanizeDuration }}.", ("moescope_expert_fetch_seconds",), "5m",
                  f"p99 time to make an expert resident > {t.fetch_p99_s * 1e3:g} ms"),
        AlertSpec("MoERouterNonFiniteLogits", "increase(moescope_router_nonfinite_logits_total[5m]) > 0", "critical",
                  "The router produced NaN or Inf logits.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} (rank {{ $labels.rank }}) produced "
                  "{{ $value | printf \"%.0f\" }} non-finite router logits in 5 minutes.",
                  ("moescope_router_nonfinite_logits_total",), None, "any NaN or Inf router logit in 5 minutes"),
        AlertSpec("MoERoutingFlips", held("MoERoutingFlips", "moescope_routing_flip_ratio", t.flip_ratio, t, 0.0),
                  "warning",
                  "Routing is not deterministic: the canary batch routes differently.",
                  "{{ $value | humanizePercentage }} of the canary tokens changed experts in layer {{ $labels.layer }}"
                  " of {{ $labels.model }} (rank {{ $labels.rank }}).", ("moescope_routing_flip_ratio",), "5m",
                  f"canary tokens whose expert set changed > {t.flip_ratio:.0%}; firing, it clears under "
                  f"{t.clear_bar(t.flip_ratio, 0.0):.2%}"),
        AlertSpec("MoERoutingDrift", held_by("MoERoutingDrift", drifted(t), drifted(t, clear=True)), "warning",
                  "Routing drifted away from the baseline.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} (rank {{ $labels.rank }}) routes "
                  '{{ $value | printf "%.3f" }} bits (JS divergence) further from its baseline than sampling noise '
                  f"explains (bar: {num(t.drift_bits)} bits).",
                  ("moescope_routing_drift_jsd_bits", "moescope_routing_drift_noise_bits"), "10m",
                  f"JS divergence from the baseline - its sampling noise > {num(t.drift_bits)} bits; firing, it "
                  f"clears under {num(t.clear_bar(t.drift_bits, 0.0))}"),
        AlertSpec("MoETokensDropped",
                  "sum by (model, rank, layer) (rate(moescope_tokens_dropped_total[5m])) / "
                  f"sum by (model, rank, layer) (rate(moescope_router_tokens_total[5m])) > {num(t.drop_ratio)}",
                  "warning", "The capacity limit drops tokens.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} drops {{ $value | humanizePercentage }} slots "
                  "per routed token.", ("moescope_tokens_dropped_total", "moescope_router_tokens_total"), "5m",
                  f"dropped slots per routed token > {t.drop_ratio:.0%}"),
        AlertSpec("MoEMemoryGrowth",
                  f"(predict_linear(moescope_process_resident_memory_bytes[{mem_w}], {t.memory_horizon_s}) > "
                  f"{t.memory_capacity_bytes} and on (model, rank) "
                  f"present_over_time(moescope_process_resident_memory_bytes[{mem_w}] offset {mem_w})) or "
                  f"(predict_linear(moescope_gpu_memory_used_bytes[{mem_w}], {t.memory_horizon_s}) > "
                  f"moescope_gpu_memory_total_bytes and on (model, rank, gpu, UUID) "
                  f"present_over_time(moescope_gpu_memory_used_bytes[{mem_w}] offset {mem_w}))",
                  "warning", "Memory grows towards capacity.",
                  "At its current rate {{ $labels.model }} (rank {{ $labels.rank }}) reaches memory capacity within "
                  f"{t.memory_horizon_s // 3600}h (predicted {{{{ $value | humanize1024 }}}}B).",
                  ("moescope_process_resident_memory_bytes", "moescope_gpu_memory_used_bytes",
                   "moescope_gpu_memory_total_bytes"), "10m",
                  f"memory predicted over capacity ({t.memory_capacity_bytes / 2**30:g} GiB RSS, the GPU's total) "
                  f"within {t.memory_horizon_s // 3600}h, from a {t.memory_window_s // 60}-minute trend"),
        # A target that was up in the last day and stopped, not one nothing has ever served: a config that lists
        # more ranks' ports than run (the shipped prometheus.yml lists :9400-9403 for up to four ranks) never pages.
        AlertSpec("MoEExporterDown", 'up{job=~"moescope.*"} == 0 and max_over_time(up{job=~"moescope.*"}[1d]) == 1',
                  "critical", "A moescope exporter is down.",
                  "Prometheus cannot scrape {{ $labels.instance }} (job {{ $labels.job }}).", ("up",), "1m",
                  "a scrape target that was up within a day fails"),
        AlertSpec("MoEExporterAbsent", 'absent(up{job=~"moescope.*"})', "critical",
                  "No moescope exporter is scraped at all.",
                  "Prometheus has no moescope scrape target: check the scrape configuration.", ("up",), "5m",
                  "no scrape target at all"),
        AlertSpec("Watchdog", "vector(1)", "none", "Always firing: proves the alerting pipeline works.",
                  "This alert always fires. If it stops arriving, alerting itself is broken.", (), None,
                  "always fires"),
    ]


def markdown_table(t: Thresholds = DEFAULT) -> str:
    """docs/alerts.md's table of the rules (a test checks the doc holds it as generated)."""
    rows = ["| alert | severity | for (and keep firing for) | fires when |", "|---|---|---|---|"]
    for s in specs(t):
        rows.append(f"| `{s.name}` | {s.severity} | {s.for_ or '-'} | {s.judges} |")
    return "\n".join(rows)


# Each rank's physical rows per second, with its replica (joined from moescope_build_info, one series per instance).
_RANK_ROWS = ("sum by (model, layer, instance) (rate(moescope_expert_physical_slots_total[1m])) "
              "* on (instance) group_left (replica) max by (instance, replica) (moescope_build_info)")

# Recording rules: rates summed over ranks (each rank routes and exports its own tokens, so the sum counts every
# token once), and the per-expert share the heatmaps and `top` read.
RECORDING = (
    ("model_layer_expert:moescope_expert_tokens:rate1m",
     "sum without (instance, rank) (rate(moescope_expert_tokens_total[1m]))"),
    ("model_layer:moescope_router_tokens:rate1m",
     "sum without (instance, rank, forward_mode) (rate(moescope_router_tokens_total[1m]))"),
    # the fleet's per-rank load, measured (TensorRT-LLM's max/mean): each rank's physical rows (an instance is one
    # rank of one replica), the busiest over the mean within each replica (the ``replica`` label of each instance's
    # moescope_build_info: the launch that started its ranks), so two replicas of one model never mix
    ("model_layer:moescope_rank_load_max_over_mean:ratio1m",
     f"max by (model, layer, replica) ({_RANK_ROWS}) / avg by (model, layer, replica) ({_RANK_ROWS})"),
    ("model_layer_expert:moescope_expert_load_share:ratio1m",
     "model_layer_expert:moescope_expert_tokens:rate1m / ignoring (expert) group_left "
     "sum without (expert) (model_layer_expert:moescope_expert_tokens:rate1m)"),
)


def _scaled(duration: str, factor: float) -> str:
    seconds = int(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]
    return f"{max(1, round(seconds * factor))}s"


def rules_document(t: Thresholds = DEFAULT) -> dict:
    rules = []
    for s in specs(t):
        rule = {"alert": s.name, "expr": s.expr}
        if s.for_:
            rule["for"] = _scaled(s.for_, t.for_scale) if t.for_scale else s.for_
            # Hysteresis: a page clears only after its condition has been false as long as it had to be true to
            # fire. A value hovering at its bar (a window's sampling noise either side) keeps one alert firing
            # instead of firing, resolving and firing again; a series that vanishes for a scrape or two (a hot
            # expert's gauge is exported only while significant) does not resolve the page either.
            rule["keep_firing_for"] = rule["for"]
        rule["labels"] = {"severity": s.severity}
        rule["annotations"] = {"summary": s.summary, "description": s.description,
                               "runbook_url": f"{RUNBOOK_BASE}/{s.name}.md"}
        rules.append(rule)
    recording = [{"record": name, "expr": expr} for name, expr in RECORDING]
    return {"groups": [{"name": "moescope-recording", "rules": recording}, {"name": "moescope", "rules": rules}]}
