"""The metric catalogue: the single list of every series moescope exports.

The exporter emits only names listed here (a test checks the exposition against it), and alert rules,
dashboards and playbooks are checked against it too. Every series also carries the labels ``model`` and
``rank``. Names follow Prometheus conventions: ``moescope_`` prefix, base units, counters end in ``_total``,
classic histograms. Formulas: docs/metrics.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from moescope.thresholds import DEFAULT, Thresholds

COMMON_LABELS = ("model", "rank")

# Histogram buckets (seconds). Fine at the low end: a CPU decode step is milliseconds, a GPU one is less.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FAST_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                0.1, 0.25)


# Serving latencies (``moescope serve``'s API port): vLLM's buckets reach minutes; these start at the runtime's
# milliseconds and end past the default request timeout (600 s).
SERVE_BUCKETS = (*LATENCY_BUCKETS, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)  # vLLM's 1-2-5

# Shares of a whole (experts touched / experts, parameters read / total): finer at the low end, where a decode
# step of a sparse model sits (DeepSeek-V3's per-token activation is ~5.5%).
RATIO_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

# Experts by load relative to the layer's mean (1 = fair share; le="0": dead), a gauge histogram per layer.
RELATIVE_LOAD_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0)

# Busiest / mean rank per step (1 = balanced, the EP size = one rank does everything): the step-level prediction's
# buckets (``parallel.step_balance.StepBalance`` is built with them).
STEP_BALANCE_BUCKETS = (1.0, 1.02, 1.05, 1.1, 1.15, 1.2, 1.3, 1.4, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 16.0,
                        32.0, 64.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # full exposed name (counters with _total)
    kind: str  # counter | gauge | histogram | gaugehistogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    # A function of the routed tokens: each expert-parallel rank exports its own (data-parallel attention: each
    # routes its own tokens), and a rank given the same tokens as another would not (``export_routing``).
    routing: bool = False

    @property
    def family(self) -> str:
        """Name without the counter suffix, as prometheus-client's metric families take it."""
        return self.name[: -len("_total")] if self.kind == "counter" else self.name

    @property
    def all_labels(self) -> tuple[str, ...]:
        return COMMON_LABELS + self.labels


def _c(name, help_, *labels):
    return MetricSpec(name, "counter", help_, tuple(labels))


def _g(name, help_, *labels):
    return MetricSpec(name, "gauge", help_, tuple(labels))


def _routing(spec: MetricSpec) -> MetricSpec:
    return MetricSpec(spec.name, spec.kind, spec.help, spec.labels, spec.buckets, routing=True)


def _h(name, help_, buckets, *labels):
    return MetricSpec(name, "histogram", help_, tuple(labels), buckets)


def _bar_help(t: Thresholds) -> str:
    """moescope_judgement_bar's help: each judgement's bar and its derivation, with the thresholds' numbers."""
    return (
        "The bar each judged quantity is compared with (thresholds.Thresholds.bars; the alert rules read this "
        "series, never a number of their own), per layer (never per expert) and, with no layer, per model. "
        f"imbalance: the excess load CV's bar, {t.imbalance_baseline_factor:g} x the structural CV of the layer's "
        f"reference (baseline or learned) + {t.imbalance_baseline_margin:g}, {t.imbalance_cv:g} against the fair "
        "share, absent while the reference is learned; collapse: the top share's, half of the way from the "
        f"reference's top share to 1 and at least {t.collapse_top_share:g} (a learned reference counts as at most "
        f"{t.collapse_top_share:g}; {t.collapse_ceiling:g} while learning); hot: the hot factor's, {t.hot_factor:g}; "
        f"dead: 0 zero-slot experts whose reference predicts at least {t.dead_min_expected_slots:g} effective slots; "
        f"drift: the JS divergence sampling noise gives against the baseline + {t.drift_bits:g} bits; rank_load: "
        f"the busiest / mean rank's, {t.rank_max_over_mean:g}; flips: the canary flip ratio's, {t.flip_ratio:g}; "
        f"drops: dropped slots per routed token, {t.drop_ratio:g}; cache: the hit rate's floor, "
        f"{t.cache_floor_of_capacity:g} x the share of experts the cache holds. Per model: activation: the "
        f"activation ratio's floor, {t.activation_floor:g} x the config's; all_to_all and fetch: the p99 seconds, "
        f"{t.all_to_all_p99_s:g} and {t.fetch_p99_s:g}; slow_rank_share: {t.slow_rank_share:g} of the ranks' "
        f"wait; slow_rank_wait: {t.slow_rank_wait_s:g} s per dispatch; memory: the capacity in bytes. The "
        "reference label: the reference kind the layer is judged against (baseline, learned, fair, learning).")


_BAR_HELP = _bar_help(DEFAULT)
_CLEAR_HELP = (
    "Where a firing page of the judgement clears (thresholds.Thresholds.bars): a quarter of the way back from its "
    "bar to the value with nothing changed (the reference's CV or top share; 1 for hot and rank_load; the noise "
    "for drift; 0 for flips); dead: 0 zero-slot experts predicted at least "
    f"{DEFAULT.dead_clear_expected_slots:g} effective slots (moescope_dead_experts_holding).")


CATALOGUE: tuple[MetricSpec, ...] = (
    # routing (counters; rates and shares are derived in PromQL). The per-(layer, expert) counter is the full
    # tier: exported while layers x experts fits the cardinality budget (docs/metrics.md, "Cardinality").
    *map(_routing, (
        _c("moescope_expert_tokens_total", "Slots (token, expert pairs) computed by each expert (full tier).",
           "layer", "expert"),
        _c("moescope_router_tokens_total", "Tokens routed by the layer's router, by the step's forward_mode (prefill: "
           "prompt tokens; decode: generated ones; unknown: a forward no engine step reported).", "layer",
           "forward_mode"),
        _c("moescope_tokens_dropped_total", "Slots dropped by the capacity limit.", "layer"),
        _c("moescope_rerouted_slots_total", "Slots a routing mitigation gave to another expert than the router's "
           "top-k (reason: load = load-aware routing, smoothing = hysteresis); only while one is on.", "layer",
           "reason"),
        _c("moescope_router_nonfinite_logits_total", "NaN or Inf router logits.", "layer"),
        # routing health over the recent window (gauges)
        _g("moescope_activation_ratio", "Parameters touched per token / total parameters, over the window."),
        _g("moescope_activation_expected_ratio", "Parameters a token touches / total parameters when every layer "
           "computes its top-k: the model config's own activation ratio."),
        _g("moescope_expert_load_cv_ratio", "Coefficient of variation of expert load over the window.", "layer"),
        _g("moescope_expert_load_cv_noise_ratio", "The load CV that sampling noise alone stays under (3 "
           "standard deviations) for the window's draws, requests as the independent draws (never below the "
           "multinomial bound of independent slots). NaN: too few draws to judge.", "layer"),
        _g("moescope_expert_load_max_over_mean_ratio", "Busiest expert's load / mean load over the window.",
           "layer"),
        _g("moescope_expert_load_top_share_ratio", "Share of the routed tokens that chose the busiest expert, over "
           "the window (k/E balanced, 1 = collapsed).", "layer"),
        _g("moescope_dead_experts", "Experts with no slot over the window.", "layer"),
        _g("moescope_dead_experts_unexpected", "Experts with no slot over the window where their reference share "
           "(the baseline's, else 1% of the fair share) predicts at least 5 effective slots (expected slots / "
           "design effect; Poisson P(0) < 1%): the dead experts the rule judges. NaN: too few draws to judge.",
           "layer"),
        _g("moescope_dead_experts_holding", "Experts with no slot over the window where their reference share "
           "predicts at least 3.75 effective slots (the dead page's clear level: a firing MoEDeadExperts holds "
           "while this is over 0). NaN: too few draws, or no reference yet.", "layer"),
        _g("moescope_reference_load_cv_ratio", "The structural load CV (beyond sampling noise) of the reference the "
           "layer is judged against: reference=baseline (the saved one), learned (the deployment's own first full "
           "window, followed slowly) or fair (uniform: 0); absent while the reference is being learned.", "layer",
           "reference"),
        _g("moescope_reference_top_share_ratio", "The top share (busiest expert's share of the routed tokens) of the "
           "reference the layer is judged against (baseline, learned, or fair: k/E); absent while learning.",
           "layer", "reference"),
        _g("moescope_expert_load_excess_cv_ratio", "The load CV beyond sampling noise, sqrt(max(0, cv^2 - "
           "noise^2)): the quantity the imbalance rule judges. NaN: too few draws (requests) to judge.", "layer"),
        _g("moescope_window_draws", "Independent draws the window's noise estimates rest on: requests that "
           "finished in the window (forward passes where requests are unknown)."),
        _g("moescope_expert_hot_factor_ratio", "Window share / reference share (the baseline's, else the fair "
           "share 1/E) of the hottest experts whose share is significantly above their reference (Bonferroni z "
           "over L x E experts); absent where none is.", "layer", "expert", "reference"),
        _g("moescope_routing_drift_noise_bits", "The JS divergence against the baseline that sampling noise "
           "alone stays under (3 standard deviations), for the window's draws.", "layer"),
        _g("moescope_baseline_load_cv_ratio", "The loaded baseline's structural load CV (beyond its sampling "
           "noise), per layer; absent without a baseline.", "layer"),
        _g("moescope_baseline_expert_share_ratio", "The loaded baseline's share of each expert (full tier; the "
           "reduced tier exports the experts of moescope_expert_window_slots).", "layer", "expert"),
        _g("moescope_rank_load_max_over_mean_ratio", "Expert-parallel placement: the busiest rank's slots over "
           "the mean rank's, over the window, per layer (the straggler factor EPLB minimises).", "layer"),
        _g("moescope_rank_window_slots", "Expert-parallel placement: slots each rank computed over the window, "
           "summed over layers (peer = the rank holding the experts).", "peer"),
        _g("moescope_window_slots_per_expert", "Slots computed over the window / experts: what uniform routing "
           "would have sent each expert.", "layer"),
        MetricSpec("moescope_expert_load_relative", "gaugehistogram", "Experts by their load over the window "
                   "relative to the layer's mean load (1 = fair share; le=0: no slot).", ("layer",),
                   RELATIVE_LOAD_BUCKETS),
        _g("moescope_expert_window_slots", "Slots over the window of the K hottest and K coldest experts of each "
           "layer (every tier; ties go to the lower id).", "layer", "expert"),
        _g("moescope_router_entropy_ratio", "Mean normalised router entropy over the window (1 = uniform).",
           "layer"),
        _g("moescope_router_margin_ratio", "Mean top-1 minus top-2 router probability over the window.", "layer"),
        _g("moescope_routing_flip_ratio", "Share of the canary batch's tokens whose expert set differs from its "
           "baseline routing (last canary run).", "layer"),
        _g("moescope_routing_drift_jsd_bits", "Jensen-Shannon divergence (bits) of the window's load distribution "
           "against the saved baseline.", "layer"),
    )),
    _g("moescope_window_seconds", "Length of the window the ratio gauges are computed over."),
    # every bar as a series (thresholds.Thresholds.bars): what the alert rules compare their quantities with
    _g("moescope_judgement_bar", _BAR_HELP, "judgement", "layer", "reference"),
    _g("moescope_judgement_clear_bar", _CLEAR_HELP, "judgement", "layer", "reference"),
    _g("moescope_expert_series_per_expert", "1 when the full tier (per-(layer, expert) counters) is exported, 0 "
       "when the cardinality budget left the reduced tier (hottest/coldest experts, load distribution)."),
    # expert cache
    _c("moescope_expert_cache_lookups_total", "Expert lookups (one per expert per forward).", "layer"),
    _c("moescope_expert_cache_hits_total", "Lookups that found the expert resident.", "layer"),
    _c("moescope_expert_cache_misses_total", "Lookups that had to make the expert resident.", "layer"),
    _c("moescope_expert_cache_evictions_total", "Experts evicted to make room.", "layer"),
    _g("moescope_expert_cache_capacity_ratio", "Experts the cache holds resident / experts (a random resident set "
       "would hit this often).", "layer"),
    _c("moescope_expert_cache_prefetch_hits_total", "Misses served by a prefetched copy.", "layer"),
    _c("moescope_expert_cache_prefetch_wasted_total", "Prefetched copies never used.", "layer"),
    _c("moescope_expert_cache_prefetch_dropped_total", "Prefetches not queued: the prefetcher's bounded queue was "
       "full (it drops rather than block the engine).", "layer"),
    _c("moescope_expert_cache_loaded_bytes_total", "Bytes of expert weights loaded on misses.", "layer"),
    _h("moescope_expert_fetch_seconds", "Time to make an expert resident on a miss (the switch latency).",
       FAST_BUCKETS, "layer"),
    # timings
    _h("moescope_router_seconds", "Router time per layer per forward.", FAST_BUCKETS),
    _h("moescope_expert_compute_seconds", "Expert computation time per layer per forward (incl. fetches).",
       FAST_BUCKETS),
    _h("moescope_all_to_all_seconds", "Time of one all-to-all exchange per layer per forward.", FAST_BUCKETS,
       "op"),
    _c("moescope_all_to_all_bytes_total", "Bytes exchanged with each peer rank in expert-parallel all-to-alls.",
       "peer", "direction"),
    _c("moescope_expert_physical_slots_total", "Expert parallelism: slots this rank's copy of each expert computed "
       "(physical load: every rank's tokens routed to it, a replicated expert's share of them); the routing "
       "counters count each token once, by the rank that routed it, under its logical expert. Reduced tier: one "
       "series per layer, expert=\"held\" (the rank's held experts together).", "layer", "expert"),
    _c("moescope_eplb_rebalances_total", "EPLB in the loop: rearrangements of the expert placement while serving."),
    _c("moescope_eplb_moved_experts_total", "EPLB in the loop: expert copies placed on a rank that did not hold them "
       "(weights moved), over all layers."),
    _h("moescope_eplb_rebalance_seconds", "EPLB in the loop: one rearrangement (fleet counts, plan, weight moves, "
       "table switch), as this rank spent it.", LATENCY_BUCKETS),
    _g("moescope_eplb_before_max_over_mean_ratio", "EPLB: the busiest rank's rows over the mean rank's, measured "
       "from the exchanges between the last two rearrangements (before the last).", "layer"),
    _g("moescope_eplb_predicted_max_over_mean_ratio", "EPLB: the busiest / mean rank the planner predicted for the "
       "placement of the last rearrangement, on the counts it planned from.", "layer"),
    _g("moescope_eplb_measured_max_over_mean_ratio", "EPLB: the busiest / mean rank measured from the exchanges "
       "since the last rearrangement (compare with the predicted ratio).", "layer"),
    # Would expert parallelism and EPLB help? (issue [eplb]; parallel/step_balance.py, docs/metrics.md "Step-level
    # rank load"): each layer's busiest rank / mean rank per engine step, predicted from the steps' routing for each
    # EP size and placement (placement: linear, round_robin = vLLM's expert_placement_strategy; eplb = vLLM's EPLB
    # with `redundant` experts, its default policy every interval on the window's load; plan = moescope's planner on
    # the same schedule; in_use = the engine's own placement)
    *map(_routing, (
        _h("moescope_ep_step_max_over_mean_ratio", "Per sampled engine step: a layer's busiest rank's slots / the "
           "mean rank's under the placement, the step's own counts (a replicated expert's slots split 1/R over its "
           "replicas); layer=worst: the step's worst layer, layer=mean: the mean over its layers, a layer id where "
           "asked for.", STEP_BALANCE_BUCKETS, "ep", "placement", "redundant", "layer"),
        _g("moescope_ep_straggler_ratio", "Sum over the sampled steps and layers of the busiest rank's slots / the "
           "sum of the mean rank's: a step's MoE time over a balanced one's, each layer waiting on its busiest "
           "rank (the run so far).", "ep", "placement", "redundant"),
        _g("moescope_ep_straggler_stderr_ratio", "Standard error of moescope_ep_straggler_ratio from the sample of "
           "steps (ratio estimator, steps as independent draws).", "ep", "placement", "redundant"),
        _g("moescope_ep_average_max_over_mean_ratio", "The average-load figure: busiest / mean rank of the same "
           "sampled steps' counts added up, summed over layers (what whole-run counts show: it hides the "
           "per-step straggler).", "ep", "placement", "redundant"),
        _c("moescope_ep_sampled_steps_total", "Engine steps whose per-expert counts the step-level prediction "
           "judged (an even sample of the steps)."),
        _c("moescope_ep_steps_total", "Engine steps the judged steps were sampled from."),
        _g("moescope_ep_eplb_schedule_steps", "The EPLB schedule the prediction simulates (vLLM's EPLBConfig): "
           "which=window (window_size, steps of load it plans from), interval (step_interval).", "which"),
        _c("moescope_ep_rearrangements_total", "Changes of the placement the engine runs (the runtime's or vLLM's "
           "EPLB rearrangements)."),
        _g("moescope_ep_rearrangement_straggler_ratio", "The last rearrangement of the placement in use, straggler "
           "factors summed over layers: when=before (old placement, the steps since the previous change), "
           "predicted_old / predicted_new (both on the window's counts), after (new placement, the steps since).",
           "when"),
        _c("moescope_ep_rank_slots_total", "The placement in use: slots each rank computes, every step (the "
           "summary's counts, a replicated expert's split 1/R), summed over layers.", "peer"),
        _c("moescope_ep_physical_slots_total", "The placement in use: slots each physical expert slot computes "
           "(full tier only: layers x physical experts within the series budget).", "layer", "physical"),
    )),
    _c("moescope_all_to_all_peer_wait_seconds_total", "Time this rank waited for each peer to join the dispatch "
       "exchange (the N x N wait matrix is this series by rank and peer).", "peer"),
    _h("moescope_step_seconds", "Engine step (one forward) time, with a request id exemplar.", LATENCY_BUCKETS,
       "phase"),
    _h("moescope_token_latency_seconds", "Per output token latency (first token: time to first token), with "
       "request id exemplars.", LATENCY_BUCKETS),
    _h("moescope_request_queue_seconds", "Time a request waited before its prefill.", LATENCY_BUCKETS),
    # throughput
    _c("moescope_tokens_total", "Tokens processed, by phase (prefill: prompt tokens; decode: generated).",
       "phase"),
    _c("moescope_requests_total", "Finished requests.", "finish_reason"),
    _c("moescope_steps_total", "Engine steps.", "phase"),
    # what routing costs the hardware (moescope.efficiency; docs/metrics.md, "Efficiency")
    *map(_routing, (
        _c("moescope_expert_distinct_total", "Distinct experts each engine step touched in the layer, summed over "
           "steps (its rate over moescope_expert_distinct_steps_total's: experts touched per step).", "layer"),
        _c("moescope_expert_distinct_steps_total", "Engine steps that routed tokens in the layer.", "layer"),
    )),
    _h("moescope_step_experts_touched_ratio", "Distinct experts an engine step touched / experts, over all its "
       "MoE layers (1 = every expert read).", RATIO_BUCKETS, "phase"),
    _h("moescope_step_activation_ratio", "Parameters an engine step reads (its dense part and every distinct "
       "expert it touched) / total parameters: the activation rate per step.", RATIO_BUCKETS, "phase"),
    _c("moescope_step_read_bytes_total", "Bytes engine steps read: kind=weights (dense part and the distinct "
       "experts touched, at the served dtype), kv (the KV cache of every request in the step).", "phase", "kind"),
    _c("moescope_step_flops_total", "FLOPs of engine steps (2 per parameter a token touches, and attention over "
       "its context).", "phase"),
    _g("moescope_peak_bandwidth_bytes_per_second", "The device's peak memory bandwidth S-MBU divides by (the "
       "table by NVML's name, or a setting); absent when unknown."),
    _g("moescope_peak_flops_per_second", "The device's peak dense FLOP/s S-MFU divides by; absent when unknown."),
    # memory
    _g("moescope_process_resident_memory_bytes", "Resident set size of the serving process."),
    _c("moescope_process_cpu_seconds_total", "User and system CPU time of the serving process."),
    _g("moescope_gpu_memory_used_bytes", "GPU memory used (NVML), labelled like DCGM's exporter.", "gpu", "UUID"),
    _g("moescope_gpu_memory_total_bytes", "GPU memory capacity (NVML).", "gpu", "UUID"),
    # moescope's own health
    _c("moescope_observer_errors_total", "Exceptions raised by an observer/sink (isolated, never raised into "
       "the engine).", "observer"),
    _c("moescope_capture_seconds_total", "Host time moescope spent on the engine's step path (an engine adapter's "
       "work around each forward: on vLLM the step's routing read and request bookkeeping); its rate over "
       "rate(moescope_step_seconds_sum) is moescope's share of step time."),
    _c("moescope_capture_dropped_total", "Capture records dropped because a bounded queue was full.", "queue"),
    _g("moescope_capture_enabled", "1 while capture is on, 0 while the capture switch has it off (moescope capture "
       "off: the engine reports to no moescope observer; the counters keep their last values)."),
    _c("moescope_capture_switches_total", "Times the capture switch turned capture off or on in this process."),
    _g("moescope_build_info", "Always 1; labels carry the version, the device and the replica (the launch of an "
       "expert-parallel run: MOESCOPE_REPLICA, else the launcher's run id; empty for one process).", "version",
       "device", "replica"),
    # serving (``moescope serve``'s own registry, on its API port: GET /metrics). Named as vLLM names them after
    # the prefix: metric_relabel_configs rename moescope_serve_(.*) to vllm:$1 (docs/serve.md, "Serving metrics").
    _h("moescope_serve_time_to_first_token_seconds", "Time from the request's arrival to its first token, "
       "observed when the token is made; request id exemplars.", SERVE_BUCKETS),
    _h("moescope_serve_inter_token_latency_seconds", "Time between a request's consecutive tokens, observed per "
       "token; request id exemplars.", SERVE_BUCKETS),
    _h("moescope_serve_e2e_request_latency_seconds", "Time from a request's arrival to its end (any finish "
       "reason); request id exemplars.", SERVE_BUCKETS),
    _h("moescope_serve_request_queue_time_seconds", "Time a request waited (admission queue and engine queue) "
       "before its prefill; request id exemplars.", SERVE_BUCKETS),
    _h("moescope_serve_request_prefill_time_seconds", "Time of a request's prefill step.", SERVE_BUCKETS),
    _h("moescope_serve_request_decode_time_seconds", "Time from a request's first token to its last.",
       SERVE_BUCKETS),
    _h("moescope_serve_request_prompt_tokens", "Prompt tokens per request (BOS included).", TOKEN_BUCKETS),
    _h("moescope_serve_request_generation_tokens", "Tokens generated per request.", TOKEN_BUCKETS),
    _h("moescope_serve_request_max_num_generation_tokens", "The max_tokens each request asked for.",
       TOKEN_BUCKETS),
    _g("moescope_serve_num_requests_running", "Requests in the engine's batch."),
    _g("moescope_serve_num_requests_waiting", "Requests in the admission queue, waiting for a batch slot."),
    _c("moescope_serve_request_success_total", "Requests that ended, by vLLM's finished_reason (stop: EOS or a "
       "stop string; length: max_tokens or the context; abort: cancelled or timed out).", "finished_reason"),
    _c("moescope_serve_request_rejected_total", "Requests refused before they ran, by cause (queue_full: 429; "
       "invalid: another 4xx; unavailable: 503 draining or unhealthy).", "cause"),
    _c("moescope_serve_prompt_tokens_total", "Prompt tokens of the requests that ended (BOS included)."),
    _c("moescope_serve_generation_tokens_total", "Tokens generated, counted as they are made."),
    # the front end of `serve --world-size N` (its own /metrics: these, then every rank's serving series, each with
    # its rank label): per rank behind it
    _c("moescope_fleet_requests_dealt_total", "Requests the front end forwarded to this rank."),
    _g("moescope_fleet_requests_outstanding", "Requests forwarded to this rank and not yet answered in full."),
    _g("moescope_fleet_rank_in_rotation", "1 while the front end deals to this rank; 0 after it refused a request "
       "as unhealthy or refused the connection, until its /health answers 200."),
    _g("moescope_fleet_rank_metrics_up", "1 when this scrape of the front end read the rank's own /metrics; 0 when "
       "it could not (its serving series are then missing from this scrape)."),
)

BY_NAME = {m.name: m for m in CATALOGUE}


def names() -> set[str]:
    return set(BY_NAME)


def exposed_sample_names() -> set[str]:
    """Every sample name that may appear in an exposition (histogram _bucket/_sum/_count/_created included)."""
    out = set()
    for m in CATALOGUE:
        if m.kind == "histogram":
            out |= {m.name + "_bucket", m.name + "_sum", m.name + "_count", m.name + "_created"}
        elif m.kind == "gaugehistogram":
            out |= {m.name + "_bucket", m.name + "_gsum", m.name + "_gcount"}
        else:
            out.add(m.name)
    return out
