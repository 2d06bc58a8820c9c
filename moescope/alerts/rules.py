"""Alert and recording rules: one source of truth, generated to collectors/prometheus/moescope-rules.yml.

Every rule compares a quantity the exporter exports with its bar, itself a series the exporter exports:
``moescope_judgement_bar{judgement, layer, reference}`` (``quantity > on (...) group_left bar``), and a firing page
holds while its quantity is over ``moescope_judgement_clear_bar`` (hysteresis: ``held_by``). The bars are computed
once, by ``Thresholds.bars`` (``moescope.thresholds``: from the model's config, the traffic's sampling noise, the
layer's reference), the values ``top``, ``diagnose``, ``report`` and the dashboards judge by; no expression carries
a threshold or arithmetic on one (tests/test_alerts.py parses every expression to check), and no expression names
a model, so one rule judges every model. Each ``AlertSpec`` holds the expression, its ``for``, severity, summary,
templated description (a bar it quotes is read from its series) and the metrics it reads (checked against the
catalogue by a test); the promtool cases that must make it fire or keep it silent live in
``moescope.alerts.cases`` (``moescope.alerts.unit_tests`` writes them), with the bar series as their input.
``runbook_url`` points to ``playbooks/<AlertName>.md``. Regenerate with ``moescope alerts build``.
"""

from __future__ import annotations

from dataclasses import dataclass

from moescope.thresholds import DEFAULT, Thresholds

__all__ = ["Thresholds", "AlertSpec", "specs", "rules_document", "RUNBOOK_BASE", "markdown_table"]

RUNBOOK_BASE = "https://github.com/moescope/moescope/blob/main/playbooks"
# The labels that name one exporter's layer: a live series and the bar series it is judged against come from the
# same exporter. instance and job keep replicas of one model (several processes serving the same name, each rank
# 0) apart: matched on (model, rank, layer) alone their series collide and the whole rule fails to evaluate
# ("found duplicate series for the match group").
LAYER_LABELS = "instance, job, model, rank, layer"
ON = f"on ({LAYER_LABELS})"
MODEL_LABELS = "instance, job, model, rank"  # one exporter: its model-level bars (no layer label)
ON_MODEL = f"on ({MODEL_LABELS})"
BAR = "moescope_judgement_bar"
CLEAR_BAR = "moescope_judgement_clear_bar"


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
    """A number as PromQL and the docs write it (0.1, 1.5, 4: no float noise)."""
    return f"{v:g}"


def bar(judgement: str, m: str = "", clear: bool = False) -> str:
    """The bar series of ``judgement`` (``Thresholds.bars``: what the exporter exports); ``clear``: its clear bar;
    ``m``: more matchers (the dashboards' template variables)."""
    return f'{CLEAR_BAR if clear else BAR}{{{m + ", " if m else ""}judgement="{judgement}"}}'


def over(quantity: str, judgement: str, clear: bool = False, on: str = ON, op: str = ">") -> str:
    """``quantity`` over its bar series (``op``: "<" for a floor), matched on the exporter's layer (``on``)."""
    return f"{quantity} {op} {on} group_left {bar(judgement, clear=clear)}"


def held_by(name: str, fire: str, hold: str, match: str = "") -> str:
    """``fire``, and once ``name`` fires for a series, ``hold`` (a looser condition: its clear bar; the rule reads
    its own firing alerts back from ``ALERTS``, written at its previous evaluation). ``match``: the ``or``'s
    matching where ``hold`` reads another series than ``fire`` (its metric name differs: the alert's labels would
    otherwise hold both)."""
    return (f'{fire} or {match + " " if match else ""}({hold} and ignoring (alertname, alertstate, severity) '
            f'ALERTS{{alertname="{name}", alertstate="firing"}})')


def held(name: str, quantity: str, judgement: str, hold_quantity: str | None = None) -> str:
    """``quantity`` over its bar, and once ``name`` fires, ``hold_quantity`` (default: ``quantity``) over its
    clear bar."""
    return held_by(name, over(quantity, judgement), over(hold_quantity or quantity, judgement, clear=True),
                   ON if hold_quantity else "")


def _labels_query(series: str, labels: str, body: str, missing: str, args: tuple[str, ...] = ()) -> str:
    """Description text: ``body`` with ``.`` the first sample of ``series`` (``SEL``: matchers of the firing
    alert's ``labels``; ``args``: printf arguments after them), ``missing`` where it returns nothing."""
    names = [x.strip() for x in labels.split(",")]
    q = series.replace("SEL", ",".join(f"{k}=%q" for k in names))
    printf_args = " ".join([*(f"$labels.{k}" for k in names), *(f'"{a}"' for a in args)])
    return (f'{{{{ with printf "{q}" {printf_args} | query }}}}{{{{ with . | first }}}}{body}{{{{ end }}}}'
            f'{{{{ else }}}}{missing}{{{{ end }}}}')


def bar_text(judgement: str, fmt: str, labels: str = LAYER_LABELS, after: str = "", missing: str = "unknown") -> str:
    """Description text: the firing alert's bar of ``judgement``, read from its series and formatted by ``fmt``
    (a template pipeline over the value: ``printf "%.2f"``, ``humanizePercentage``), then ``after`` (a template
    that may read the bar's labels: ``.Labels.reference``)."""
    return _labels_query(f"{BAR}{{SEL,judgement=%q}}", labels, f"{{{{ .Value | {fmt} }}}}{after}", missing,
                         (judgement,))


def reference_words() -> str:
    """Description text inside ``bar_text``'s sample: what the layer's bar is from (its ``reference`` label)."""
    return ('{{ if eq .Labels.reference "fair" }}against the fair share, as asked{{ else }}from its '
            "{{ .Labels.reference }} reference{{ end }}")


# -- the judged quantities in PromQL (each bar a series) ----------------------------------------------------------
EXCESS_CV = "moescope_expert_load_excess_cv_ratio"
TOP_SHARE = "moescope_expert_load_top_share_ratio"
JSD = "moescope_routing_drift_jsd_bits"


def drift_beyond_noise(m: str = "") -> str:
    """The JS divergence from the baseline beyond what sampling noise gives (bits: what the dashboards show; the
    drift rule compares the divergence itself with its bar, noise included)."""
    s = f"{{{m}}}" if m else ""
    return f"moescope_routing_drift_jsd_bits{s} - {ON} group_left moescope_routing_drift_noise_bits{s}"


def hit_rate(m: str = "", window: str = "5m", by: str = LAYER_LABELS) -> str:
    """The expert cache's hit rate per ``by`` (the rules: per layer of each exporter; dashboards: per model)."""
    s = f"{{{m}}}" if m else ""
    return (f"(sum by ({by}) (rate(moescope_expert_cache_hits_total{s}[{window}])) / "
            f"sum by ({by}) (rate(moescope_expert_cache_lookups_total{s}[{window}])))")


def drop_ratio(m: str = "", window: str = "5m", by: str = LAYER_LABELS) -> str:
    """Dropped slots per routed token per ``by``."""
    s = f"{{{m}}}" if m else ""
    return (f"sum by ({by}) (rate(moescope_tokens_dropped_total{s}[{window}])) / "
            f"sum by ({by}) (rate(moescope_router_tokens_total{s}[{window}]))")


def _routing_specs(t: Thresholds) -> list[AlertSpec]:
    # Load that moved with the traffic away from the baseline is drift (its own alert), not imbalance.
    imbalance = f"({held('MoEExpertLoadImbalance', EXCESS_CV, 'imbalance')}) unless {ON} ({over(JSD, 'drift')})"
    hot_ref = ('{{ if eq $labels.reference "baseline" }}its baseline share{{ else if eq $labels.reference '
               '"learned" }}the share this deployment\'s traffic gave it (learned; no baseline loaded){{ else }}its '
               "fair share 1/E (no baseline loaded){{ end }}")
    return [
        AlertSpec("MoEExpertLoadImbalance", imbalance, "warning", "Expert load is imbalanced.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} (rank {{ $labels.rank }}) has a load CV of "
                  '{{ $value | printf "%.2f" }} beyond sampling noise, over its bar '
                  + bar_text("imbalance", 'printf "%.2f"', after=f" ({reference_words()})") + ".",
                  (EXCESS_CV, JSD, BAR, CLEAR_BAR), "10m",
                  f"load CV beyond sampling noise > its bar: {num(t.imbalance_baseline_factor)} x its reference's "
                  f"structural CV + {num(t.imbalance_baseline_margin)} (the baseline, else the deployment's first "
                  f"full window, learned), {num(t.imbalance_cv)} against the fair share only with --hot-reference "
                  "fair; not where the layer drifted; firing, it clears a quarter of the way back to the "
                  "reference's CV"),
        # "learning": the exporter has not yet learned the layer's reference (its first full window): views name
        # such experts against 1/E, pages wait (a model's popular experts are not a change).
        AlertSpec("MoEExpertHot", held("MoEExpertHot", 'moescope_expert_hot_factor_ratio{reference!="learning"}',
                                       "hot"), "warning",
                  "One expert takes several times its share.",
                  "Expert {{ $labels.expert }} of layer {{ $labels.layer }} in {{ $labels.model }} (rank "
                  '{{ $labels.rank }}) gets {{ $value | printf "%.1f" }}x ' + hot_ref + ", beyond sampling noise "
                  "(bar: " + bar_text("hot", 'printf "%.3g"') + "x).",
                  ("moescope_expert_hot_factor_ratio", BAR, CLEAR_BAR), "5m",
                  f"an expert's window share / its baseline share (else the share learned from the deployment's "
                  f"own windows, or 1/E with --hot-reference fair) > {num(t.hot_factor)}, significant against "
                  f"sampling noise; firing, it clears under {num(t.clear_bar(t.hot_factor))}"),
        AlertSpec("MoERankLoadImbalance", held("MoERankLoadImbalance", "moescope_rank_load_max_over_mean_ratio",
                                               "rank_load"),
                  "warning", "One expert-parallel rank computes far more than the others.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }}: the busiest expert-parallel rank computes "
                  '{{ $value | printf "%.2f" }}x the mean rank\'s slots (bar: ' + bar_text("rank_load", 'printf "%.3g"')
                  + "x); every all-to-all of the layer waits for it.",
                  ("moescope_rank_load_max_over_mean_ratio", BAR, CLEAR_BAR),
                  "10m", f"busiest rank's slots / the mean rank's, per layer, > {num(t.rank_max_over_mean)}; firing, "
                  f"it clears under {num(t.clear_bar(t.rank_max_over_mean))}"),
        AlertSpec("MoEExpertCollapse", held("MoEExpertCollapse", TOP_SHARE, "collapse"),
                  "critical", "Routing collapsed onto one expert.",
                  "{{ $value | humanizePercentage }} of layer {{ $labels.layer }}'s tokens choose one expert in "
                  "{{ $labels.model }} (rank {{ $labels.rank }}), over its bar "
                  + bar_text("collapse", "humanizePercentage") + ".",
                  (TOP_SHARE, BAR, CLEAR_BAR), "2m",
                  f"share of the routed tokens choosing the busiest expert > {num(t.collapse_rise)} of the way from "
                  f"its reference's top share to 1, and > {num(t.collapse_top_share)} (a learned reference counts "
                  f"as at most {num(t.collapse_top_share)}: over {num(t.collapse_ceiling)} always pages); firing, it "
                  "clears a quarter of the way back to the reference"),
        AlertSpec("MoEDeadExperts", held("MoEDeadExperts", "moescope_dead_experts_unexpected", "dead",
                                         "moescope_dead_experts_holding"), "warning",
                  "Experts receive no tokens where they should.",
                  "{{ $value }} experts of layer {{ $labels.layer }} in {{ $labels.model }} got no slot in the "
                  "window where their reference share (the baseline's, else the one learned from this deployment's "
                  f"traffic; {t.dead_floor_share:.0%} of the fair share with --hot-reference fair) predicts at least "
                  f"{num(t.dead_min_expected_slots)} effective slots (firing, it holds down to "
                  f"{num(t.dead_clear_expected_slots)}).",
                  ("moescope_dead_experts_unexpected", "moescope_dead_experts_holding", BAR, CLEAR_BAR), "10m",
                  f"experts with no slot where their reference share predicts >= {num(t.dead_min_expected_slots)} "
                  f"effective slots (the baseline's share, else the learned one; {t.dead_floor_share:.0%} of 1/E "
                  f"with --hot-reference fair); firing, it holds while they predict >= "
                  f"{num(t.dead_clear_expected_slots)}"),
        AlertSpec("MoERoutingFlips", held("MoERoutingFlips", "moescope_routing_flip_ratio", "flips"),
                  "warning",
                  "Routing is not deterministic: the canary batch routes differently.",
                  "{{ $value | humanizePercentage }} of the canary tokens changed experts in layer {{ $labels.layer }}"
                  " of {{ $labels.model }} (rank {{ $labels.rank }}), over its bar "
                  + bar_text("flips", "humanizePercentage") + ".", ("moescope_routing_flip_ratio", BAR, CLEAR_BAR),
                  "5m", f"canary tokens whose expert set changed > {t.flip_ratio:.0%}; firing, it clears under "
                  f"{t.clear_bar(t.flip_ratio, 0.0):.2%}"),
        AlertSpec("MoERoutingDrift", held("MoERoutingDrift", JSD, "drift"), "warning",
                  "Routing drifted away from the baseline.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} (rank {{ $labels.rank }}) routes "
                  '{{ $value | printf "%.3f" }} bits (JS divergence) from its baseline, over its bar '
                  + bar_text("drift", 'printf "%.3f"') + " bits (what sampling noise gives, plus the drift bar).",
                  (JSD, BAR, CLEAR_BAR), "10m",
                  f"JS divergence from the baseline > its sampling noise + {num(t.drift_bits)} bits; firing, it "
                  f"clears under its noise + {num(t.clear_bar(t.drift_bits, 0.0))}"),
        AlertSpec("MoETokensDropped", over(drop_ratio(), "drops"),
                  "warning", "The capacity limit drops tokens.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} drops {{ $value | humanizePercentage }} slots "
                  "per routed token (bar: " + bar_text("drops", "humanizePercentage") + ").",
                  ("moescope_tokens_dropped_total", "moescope_router_tokens_total", BAR), "5m",
                  f"dropped slots per routed token > {t.drop_ratio:.0%}"),
        AlertSpec("MoEActivationRatioLow", over("moescope_activation_ratio", "activation", on=ON_MODEL, op="<"),
                  "warning", "Tokens touch fewer parameters than the model's config says.",
                  "{{ $labels.model }} (rank {{ $labels.rank }}) touches {{ $value | humanizePercentage }} of its "
                  "parameters per token, under its floor " + bar_text("activation", "humanizePercentage",
                                                                      MODEL_LABELS)
                  + " (from the share its config says a token touches).",
                  ("moescope_activation_ratio", BAR), "10m",
                  f"observed activation ratio < {num(t.activation_floor)} x the config's expected one"),
    ]


def specs(t: Thresholds = DEFAULT) -> list[AlertSpec]:
    mem_w = _scaled(f"{t.memory_window_s}s", t.for_scale) if t.for_scale else f"{t.memory_window_s // 60}m"
    waits = "rate(moescope_all_to_all_peer_wait_seconds_total[5m])"
    dispatches = 'rate(moescope_all_to_all_seconds_count{op="dispatch"}[5m])'
    # A slow peer takes most of the time ranks wait on peers AND makes them wait long per dispatch (with two
    # ranks one peer always holds over half of a tiny total: the share alone would page on healthy pairs). The
    # ranks' waits are summed over their exporters: the bar is the model's (every rank exports the same one).
    slow = (f"sum by (model, peer) ({waits}) / ignoring (peer) group_left sum by (model) ({waits}) > on (model) "
            f"group_left max by (model) ({bar('slow_rank_share')})")
    slow_wait = (f"max by (model, peer) ({waits} / ignoring (peer, op) group_left {dispatches}) > on (model) "
                 f"group_left max by (model) ({bar('slow_rank_wait')})")
    slow_bar = ('{{ with printf "max(moescope_judgement_bar{judgement=%q,model=%q})" "SLOW" $labels.model | query }}'
                "{{ . | first | value | FMT }}{{ else }}unknown{{ end }}")
    rss = f"predict_linear(moescope_process_resident_memory_bytes[{mem_w}], {t.memory_horizon_s})"
    out = [
        *_routing_specs(t),
        AlertSpec("MoEAllToAllLatencyHigh", over("histogram_quantile(0.99, sum by (le, instance, job, model, rank, op) "
                                                 "(rate(moescope_all_to_all_seconds_bucket[5m])))", "all_to_all",
                                                 on=ON_MODEL), "warning",
                  "All-to-all p99 latency is high.",
                  "p99 of the {{ $labels.op }} all-to-all on rank {{ $labels.rank }} of {{ $labels.model }} is "
                  "{{ $value | humanizeDuration }} (bar: " + bar_text("all_to_all", "humanizeDuration", MODEL_LABELS)
                  + ").", ("moescope_all_to_all_seconds", BAR), "10m",
                  f"p99 all-to-all time > {t.all_to_all_p99_s * 1e3:g} ms"),
        AlertSpec("MoESlowRank", f"({slow}) and on (model, peer) ({slow_wait})", "warning",
                  "One rank makes the others wait in the all-to-all.",
                  "Rank {{ $labels.peer }} accounts for {{ $value | humanizePercentage }} of the time ranks of "
                  "{{ $labels.model }} wait on their peers (a slow peer: over "
                  + slow_bar.replace("SLOW", "slow_rank_share").replace("FMT", "humanizePercentage")
                  + " of the wait and over " + slow_bar.replace("SLOW", "slow_rank_wait").replace(
                      "FMT", "humanizeDuration") + " per dispatch).",
                  ("moescope_all_to_all_peer_wait_seconds_total", "moescope_all_to_all_seconds", BAR), "5m",
                  f"one peer > {t.slow_rank_share:.0%} of the ranks' wait and > {t.slow_rank_wait_s * 1e3:g} ms "
                  "per dispatch"),
        AlertSpec("MoEExpertCacheHitRateLow", over(hit_rate(), "cache", op="<"),
                  "warning", "The expert cache hit rate is low.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} (rank {{ $labels.rank }}) hits its expert "
                  "cache {{ $value | humanizePercentage }} of the time, under its floor "
                  + bar_text("cache", "humanizePercentage") + " (from the share of its experts it holds resident: "
                  "what a random resident set would hit).",
                  ("moescope_expert_cache_hits_total", "moescope_expert_cache_lookups_total", BAR), "10m",
                  f"hit rate (5m) < {num(t.cache_floor_of_capacity)} x the share of experts the cache holds"),
        AlertSpec("MoEExpertSwitchJitter", over(f"histogram_quantile({num(t.fetch_quantile)}, sum by (le, instance, "
                                                "job, model, rank) (rate(moescope_expert_fetch_seconds_bucket[5m])))",
                                                "fetch", on=ON_MODEL), "warning",
                  "Expert fetches are slow.",
                  "p99 time to make an expert resident on {{ $labels.model }} rank {{ $labels.rank }} is "
                  "{{ $value | humanizeDuration }} (bar: " + bar_text("fetch", "humanizeDuration", MODEL_LABELS)
                  + ").", ("moescope_expert_fetch_seconds", BAR), "5m",
                  f"p99 time to make an expert resident > {t.fetch_p99_s * 1e3:g} ms"),
        AlertSpec("MoERouterNonFiniteLogits", "increase(moescope_router_nonfinite_logits_total[5m]) > 0", "critical",
                  "The router produced NaN or Inf logits.",
                  "Layer {{ $labels.layer }} of {{ $labels.model }} (rank {{ $labels.rank }}) produced "
                  "{{ $value | printf \"%.0f\" }} non-finite router logits in 5 minutes.",
                  ("moescope_router_nonfinite_logits_total",), None, "any NaN or Inf router logit in 5 minutes"),
        AlertSpec("MoEMemoryGrowth",
                  f"({over(rss, 'memory', on=ON_MODEL)} and on (model, rank) "
                  f"present_over_time(moescope_process_resident_memory_bytes[{mem_w}] offset {mem_w})) or "
                  f"(predict_linear(moescope_gpu_memory_used_bytes[{mem_w}], {t.memory_horizon_s}) > "
                  f"moescope_gpu_memory_total_bytes and on (model, rank, gpu, UUID) "
                  f"present_over_time(moescope_gpu_memory_used_bytes[{mem_w}] offset {mem_w}))",
                  "warning", "Memory grows towards capacity.",
                  "At its current rate {{ $labels.model }} (rank {{ $labels.rank }}) reaches memory capacity within "
                  f"{t.memory_horizon_s // 3600}h (predicted {{{{ $value | humanize1024 }}}}B).",
                  ("moescope_process_resident_memory_bytes", "moescope_gpu_memory_used_bytes",
                   "moescope_gpu_memory_total_bytes", BAR), "10m",
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
    by_name = {s.name: s for s in out}
    return [by_name[name] for name in ORDER]


# The rules file's and docs/alerts.md's order: by concern (routing, expert parallelism, cache, health, memory)
ORDER = ("MoEExpertLoadImbalance", "MoEExpertHot", "MoERankLoadImbalance", "MoEExpertCollapse", "MoEDeadExperts",
         "MoEActivationRatioLow", "MoEAllToAllLatencyHigh", "MoESlowRank", "MoEExpertCacheHitRateLow",
         "MoEExpertSwitchJitter", "MoERouterNonFiniteLogits", "MoERoutingFlips", "MoERoutingDrift",
         "MoETokensDropped", "MoEMemoryGrowth", "MoEExporterDown", "MoEExporterAbsent", "Watchdog")


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
