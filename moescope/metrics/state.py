"""Host-side metric state: cumulative counters, classic histograms with exemplars (prometheus_client's
``Histogram``), and the routing window behind the ratio gauges. Fed by ``MetricsObserver``'s hooks: step and
request hooks as they come, routing through the probe's ``StepStats``, flushed on the engine's thread every
``flush_interval_s`` and when it goes idle (``on_idle``). The exporter reads it at scrape time and never writes:
a scrape serves the last flush (only an instrumented HF model, which has no engine, flushes on read:
``reads_flush``).

Sampling noise takes the request as the independent draw (``moescope.sampling``): the routing probe counts
each request's slots per (layer, expert); the state sums them per in-flight request (at most
``max_inflight`` requests, the oldest evicted first and folded as they are, counted in
``moescope_capture_dropped_total{queue="draws"}``) and folds a request into the window's draws when
``on_request`` reports it finished. A forward the probe could not map to requests is one draw, folded at once.

Updates happen on the engine thread, reads on the HTTP thread. ``lock`` guards the state both touch: the engine's
thread takes it on every step (its hooks add counts under it), a read only to copy what it needs (the routing
window's sums: ``RoutingWindow.snapshot``, a copy of a few [L, E] arrays). A scrape judges the copy after releasing
it (``judge.judge_window``, then the learned reference's update from that judgement), under ``judge_lock``, which the
engine never takes: a step never waits for a scrape's judgement, and two scrapes judge one after the other.
"""

from __future__ import annotations

import bisect
import collections
import math
import threading
import time
from typing import Any, Callable

import numpy as np

from moescope import efficiency, sampling, stats, thresholds
from moescope.capture.engine_contract import ModelInfo  # what an engine hands moescope (re-exported here)
from moescope.capture.observer import Observer
from moescope.capture.routing_probe import UNKNOWN_MODE, RoutingProbe, StepStats
from moescope.errors import BadInput
from moescope.metrics import catalogue
from moescope.metrics.window import LayerGauges, LearnedReference, RoutingWindow

# Per-(layer, expert) counters up to 64 MoE layers x 256 experts per replica: DeepSeek-V3's shape and a little
# beyond (docs/metrics.md, "Cardinality", has the arithmetic).
EXPERT_SERIES_BUDGET = 64 * 256
EXTREMES_K = 8  # the hottest and coldest experts per layer every tier exports
# In-flight requests' [L, E] counts are held up to this many bytes (int32): ~540 requests at 58 x 256, the
# engine's batch is far fewer; never fewer than MIN_INFLIGHT requests.
INFLIGHT_BYTES = 32 * 2**20
MIN_INFLIGHT = 64
MAX_INFLIGHT = 4096


def _histogram(spec: catalogue.MetricSpec):
    """An unregistered prometheus_client Histogram for a catalogue spec (the exporter's collector yields it)."""
    from prometheus_client import Histogram  # optional: prometheus_client (the metrics extra)

    return Histogram(spec.family, spec.help, labelnames=list(spec.all_labels), buckets=spec.buckets,
                     registry=None)


# A histogram bucket's request-id exemplar is replaced at most this often (MetricsObserver.observe)
EXEMPLAR_EVERY_S = 1.0

HELD_EXPERTS = "held"  # moescope_expert_physical_slots_total's expert label in the reduced tier: all held together


class MetricsObserver(Observer):
    """Accumulates everything the exporter shows. Attach it to the model (``moescope.instrument`` does).

    Args:
        info: model facts (experts, params) for the ratios.
        rank: the ``rank`` label.
        window_s: length of the sliding window the ratio gauges use.
        expert_series_budget: export the full tier (per-(layer, expert) counters) while layers x experts <= this;
            beyond it the reduced tier only (every layer's hottest and coldest experts, its load distribution).
        export_routing: False on a rank that routes the same tokens as another exporting rank (ranks given
            the same requests): its routing series would repeat that rank's, and sums over ranks would count
            every token twice. The rank still exports timings, all-to-all, cache and memory.
        flush_interval_s: how often the engine's thread summarises pending routing while it steps (and once
            when it goes idle); reads serve the last summary (``flush``).
        max_inflight: in-flight requests whose per-(layer, expert) counts are held (None: from
            ``INFLIGHT_BYTES``).
        clock: monotonic seconds (tests inject a fake one).
        hot_reference: without a baseline, what the hot-expert test judges against: "learned" (default: the
            reference this deployment's own first window gives, followed slowly: ``LearnedReference``; a page
            means an expert's share rose) or "fair" (1/E from the first window: pages a model's popular
            experts on narrow traffic; for a model balanced by design).
    Attributes set by ``moescope.instrument``: ``baseline`` (a ``analysis.baseline.Profile``; assigning a
    path or {layer: load} coerces it), ``placement_source`` (-> the expert-parallel ``Placement`` or None),
    ``cache_capacity_source`` (-> {layer: resident experts / E} of the expert cache, or {}).
    """

    def __init__(self, info: ModelInfo, *, rank: int = 0, window_s: float = 60.0,
                 expert_series_budget: int = EXPERT_SERIES_BUDGET, export_routing: bool = True,
                 flush_interval_s: float = 0.25, max_inflight: int | None = None,
                 clock: Callable[[], float] = time.monotonic, hot_reference: str = "learned") -> None:
        self.info, self.rank, self.window_s, self.clock = info, rank, window_s, clock
        self.per_expert = len(info.moe_layers) * info.n_experts <= expert_series_budget
        self.export_routing = export_routing
        # Reads serve the engine side's last flush; without an engine (a HF model: nothing says when the
        # forwards stop) a read flushes first, on the reader's thread (moescope.instrument sets it).
        self.reads_flush = False
        self.lock = threading.Lock()
        # The scrape side's judgement state (the learned reference): judged and updated outside ``lock``
        self.judge_lock = threading.Lock()
        self.probe = RoutingProbe(self._on_stats, interval_s=flush_interval_s)
        # The per-layer hot-path hooks go straight to the probe (one Python call less per layer).
        self.on_routing = self.probe.on_routing
        self.on_layer_time = self.probe.on_layer_time
        c = catalogue.BY_NAME
        self.expert_tokens: dict[int, np.ndarray] = {}  # layer -> cumulative slots per expert
        self.layer_counters: dict[str, dict[int, float]] = collections.defaultdict(
            lambda: collections.defaultdict(float))
        # (layer, forward mode) -> tokens routed: moescope_router_tokens_total's series (its sum over modes is
        # layer_counters' total, added from the same LayerStats)
        self.router_tokens_by_mode: dict[tuple[int, str], float] = collections.defaultdict(float)
        # prometheus_client Histograms (exemplars included), one per catalogue histogram; children per label set
        self.histograms = {m.name: _histogram(m) for m in c.values() if m.kind == "histogram"}
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._bounds = {m.name: tuple(m.buckets) for m in c.values() if m.kind == "histogram"}
        self._exemplar_at: dict[tuple[str, tuple[str, ...]], list[float]] = {}  # per child: each bucket's last
        self.counters: dict[tuple[str, tuple[str, ...]], float] = collections.defaultdict(float)
        self.routing_window = RoutingWindow(info.moe_layers, info.n_experts, window_s)
        # Without a baseline, the hot test's reference ("learned": from this window's own past; "fair": 1/E)
        self.learned = LearnedReference(len(info.moe_layers), info.n_experts, window_s,
                                        thresholds.DEFAULT.learn_half_life_windows) \
            if hot_reference == "learned" else None
        self.rank_window = RankWindow(window_s)  # measured per-rank load (expert-parallel exchanges)
        # EPLB in the loop: the last rearrangement's figures and the rows per rank measured since (layer -> [W])
        self.eplb_before: dict[int, float] = {}
        self.eplb_predicted: dict[int, float] = {}
        self.eplb_rows: dict[int, np.ndarray] = {}
        self.flips: dict[int, float] = {}  # last canary run's flip ratio per layer
        self._baseline = None  # analysis.baseline.Profile: the hot/dead/drift reference and the baseline series
        per_request = 4 * max(1, len(info.moe_layers) * info.n_experts)
        self.max_inflight = max_inflight or min(MAX_INFLIGHT, max(MIN_INFLIGHT, INFLIGHT_BYTES // per_request))
        self.inflight: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()  # id -> [L, E]
        self.draws_dropped = 0  # in-flight requests evicted before they finished (folded as they were)
        # Every finished draw of the run, never pruned (six [L, E] sums: the demo's summary judges the whole run
        # with the same functions the window uses)
        self.run_draws: sampling.Draws | None = None
        self.placement_source: Callable[[], Any] | None = None
        self.cache_capacity_source: Callable[[], dict[int, float]] | None = None
        self.errors_source: Callable[[], dict[str, int]] | None = None  # observer -> errors raised
        # seconds of host time moescope spent on the engine's step path (an engine adapter's own count)
        self.cost_source: Callable[[], float] | None = None
        self.dropped_source: Callable[[], dict[str, int]] | None = None  # queue -> events dropped
        # The device's peak bandwidth and FLOPs S-MBU and S-MFU divide by (moescope.efficiency; None: unknown):
        # MOESCOPE_PEAK_BANDWIDTH / MOESCOPE_PEAK_FLOPS, else the table by the CUDA device's name; an assembly
        # point with --peak-bandwidth / --peak-flops assigns its own
        self.peak: efficiency.Peak | None = efficiency.resolve_peak(info.device)

    @property
    def baseline(self):
        """The loaded baseline (``analysis.baseline.Profile``) or None."""
        return self._baseline

    @baseline.setter
    def baseline(self, profile) -> None:
        """A ``Profile`` (built or loaded by ``analysis.baseline``: ``coerce`` takes a file or {layer: load}), or
        None."""
        if profile is not None and profile.n_experts != self.info.n_experts:
            raise BadInput(f"the baseline has {profile.n_experts} experts per layer; {self.info.name} has "
                           f"{self.info.n_experts}")
        with self.lock:
            self._baseline = profile

    # -- helpers ---------------------------------------------------------------------------------------
    def hist(self, name: str, *label_values: str):
        """The prometheus_client Histogram child of ``name`` for these labels (besides model and rank)."""
        key = (name, label_values)
        h = self._children.get(key)
        if h is None:
            h = self._children[key] = self.histograms[name].labels(self.info.name, str(self.rank), *label_values)
        return h

    def observe(self, name: str, label_values: tuple[str, ...], value: float, request_id: str | None) -> None:
        """One observation of histogram ``name`` (caller holds ``lock``), with a ``request_id`` exemplar at most
        once per ``EXEMPLAR_EVERY_S`` per bucket. prometheus_client keeps only each bucket's latest exemplar, and
        validating one costs ~3x the observation itself: attaching it to every step and every output token was
        most of the exporter's per-step cost. Every bucket an observation reaches still gets an exemplar within
        that time, so a slow step or token still links to a request of its bucket."""
        h = self.hist(name, *label_values)
        if request_id is None:
            h.observe(value)
            return
        key = (name, label_values)
        last = self._exemplar_at.get(key)
        if last is None:
            last = self._exemplar_at[key] = [-math.inf] * (len(self._bounds[name]) + 1)
        b = bisect.bisect_left(self._bounds[name], value)  # the bucket whose le the value is within
        now = time.monotonic()
        if now - last[b] >= EXEMPLAR_EVERY_S:
            last[b] = now
            h.observe(value, {"request_id": request_id})
        else:
            h.observe(value)

    # -- observer hooks (engine thread) ----------------------------------------------------------------
    def on_routing(self, layer, decision) -> None:
        self.probe.on_routing(layer, decision)

    def on_layer_time(self, layer, router_s, experts_s) -> None:
        self.probe.on_layer_time(layer, router_s, experts_s)

    def flush(self) -> None:
        """Summarise routing still pending in the probe, on the caller's thread. The engine's own thread does
        it: every ``flush_interval_s`` while it steps and once when it goes idle (``on_idle``), so reads (a
        scrape) serve the last flush, at most one interval old, and never do device work themselves. A HF
        model has no engine to say when it is idle: there (``reads_flush``) a read flushes first."""
        self.probe.flush()

    on_idle = flush  # the engine went idle: summarise now, on its thread

    def on_stats(self, st: StepStats) -> None:
        """Routing statistics summarised elsewhere: a CUDA-graph decode step's in-graph counters
        (``runtime.graph_decode.GraphCollector``), where no Python hook runs per forward."""
        self._on_stats(st)

    def shutdown(self) -> None:
        self.probe.stop_background()
        self.probe.flush(final=True)

    def on_step(self, step) -> None:
        self.probe.on_step(step)  # -> _on_stats once per interval
        segments = step.segments
        phase = (step.phase,)
        with self.lock:
            self.observe("moescope_step_seconds", phase, step.seconds, segments[0][0] if segments else None)
            counters = self.counters
            counters[("moescope_steps_total", phase)] += 1
            # Prefill tokens are the prompts; a decode step's tokens are generated ones.
            counters[("moescope_tokens_total", phase)] += step.n_tokens

    def on_cache(self, layer, delta) -> None:
        with self.lock:
            lc = self.layer_counters
            lc["moescope_expert_cache_lookups_total"][layer] += delta.lookups
            lc["moescope_expert_cache_hits_total"][layer] += delta.hits
            lc["moescope_expert_cache_misses_total"][layer] += delta.misses
            lc["moescope_expert_cache_evictions_total"][layer] += delta.evictions
            lc["moescope_expert_cache_prefetch_hits_total"][layer] += delta.prefetch_hits
            lc["moescope_expert_cache_prefetch_wasted_total"][layer] += delta.prefetch_wasted
            lc["moescope_expert_cache_prefetch_dropped_total"][layer] += delta.prefetch_dropped
            lc["moescope_expert_cache_loaded_bytes_total"][layer] += delta.bytes_loaded
            h = self.hist("moescope_expert_fetch_seconds", str(layer))
            for s in delta.load_seconds:
                h.observe(s)

    def on_canary(self, flips) -> None:
        with self.lock:
            self.flips = dict(flips)

    def on_all_to_all(self, record) -> None:
        with self.lock:
            self.hist("moescope_all_to_all_seconds", record.op).observe(record.seconds)
            counters = self.counters
            for peer, (sent, recv, wait) in enumerate(zip(record.sent_bytes, record.recv_bytes,
                                                          record.peer_wait_s)):
                counters[("moescope_all_to_all_bytes_total", (str(peer), "sent"))] += sent
                counters[("moescope_all_to_all_bytes_total", (str(peer), "received"))] += recv
                if record.op == "dispatch":
                    counters[("moescope_all_to_all_peer_wait_seconds_total", (str(peer),))] += wait
            layer = str(record.layer)
            for e, n in enumerate(record.expert_rows):  # the experts held here (physical load), zeros included
                if n >= 0:  # (the reduced tier: the held experts together, one series per layer)
                    counters[("moescope_expert_physical_slots_total",
                              (layer, str(e) if self.per_expert else HELD_EXPERTS))] += n
            if record.rank_rows:
                self.rank_window.add(record.layer, record.rank_rows, self.clock())
                since = self.eplb_rows.get(record.layer)
                self.eplb_rows[record.layer] = np.asarray(record.rank_rows, dtype=np.float64) + (
                    0.0 if since is None else since)

    def on_rebalance(self, event) -> None:
        with self.lock:
            self.counters[("moescope_eplb_rebalances_total", ())] += 1
            self.counters[("moescope_eplb_moved_experts_total", ())] += event.moved
            self.hist("moescope_eplb_rebalance_seconds").observe(event.seconds)
            self.eplb_before, self.eplb_predicted = dict(event.before), dict(event.predicted)
            self.eplb_rows = {}

    def eplb_gauges(self) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
        """(before, predicted, measured since) max/mean per layer of the last rearrangement; empty without one
        (measured: NaN for a layer no row has reached since, as a gauge not judged yet)."""
        with self.lock:
            if not self.eplb_predicted:
                return {}, {}, {}
            rows = self.eplb_rows
            measured = {layer: float(stats.max_over_mean_rows(rows[layer])) if layer in rows else float("nan")
                        for layer in sorted(self.eplb_predicted)}
            return self.eplb_before, self.eplb_predicted, measured

    def on_request(self, record) -> None:
        self.probe.on_request(record.request_id)  # its draw is folded once its last step is summarised
        rid = record.request_id
        with self.lock:
            for lat in record.token_latencies_s:
                self.observe("moescope_token_latency_seconds", (), lat, rid)
            self.observe("moescope_request_queue_seconds", (), record.queue_s, rid)
            self.counters[("moescope_requests_total", (record.finish_reason,))] += 1

    def _on_stats(self, st: StepStats) -> None:
        second = int(self.clock())
        with self.lock:
            lc = self.layer_counters
            win = self.routing_window
            for ls in st.layers:
                layer = ls.layer
                tot = self.expert_tokens.get(layer)
                if tot is None:
                    self.expert_tokens[layer] = ls.slots.copy()
                else:
                    tot += ls.slots
                lc["moescope_router_tokens_total"][layer] += ls.tokens
                for mode, n in ls.modes or ((UNKNOWN_MODE, ls.tokens),):
                    self.router_tokens_by_mode[(layer, mode)] += n
                lc["moescope_tokens_dropped_total"][layer] += ls.dropped
                lc["moescope_router_nonfinite_logits_total"][layer] += ls.nonfinite
                for reason, n in (ls.rerouted or {}).items():
                    self.counters[("moescope_rerouted_slots_total", (str(layer), reason))] += n
                win.add(second, layer, ls.slots, ls.tokens, ls.entropy_sum, ls.margin_sum)
                if ls.router_s is not None:
                    self.hist("moescope_router_seconds").observe(ls.router_s)
                    self.hist("moescope_expert_compute_seconds").observe(ls.experts_s)
            if st.draws is not None:
                self._fold(st, second)
            if st.experts is not None:
                self._experts(st)

    def _experts(self, st: StepStats) -> None:
        """The distinct experts each step touched, and the bytes and FLOPs that implies (moescope.efficiency;
        the caller holds the lock)."""
        x, info = st.experts, self.info
        lc = self.layer_counters
        routed = x.distinct >= 0  # [S, L]
        for j, ls in enumerate(st.layers):
            lc["moescope_expert_distinct_total"][ls.layer] += float(x.distinct[routed[:, j], j].sum())
            lc["moescope_expert_distinct_steps_total"][ls.layer] += float(routed[:, j].sum())
        n_moe, e = max(1, len(info.moe_layers)), info.n_experts
        counters = self.counters
        total = info.total_params
        for s, phase in enumerate(x.phases):
            d = int(x.distinct[s][routed[s]].sum())
            self.hist("moescope_step_experts_touched_ratio", phase).observe(d / (n_moe * e))
            self.hist("moescope_step_activation_ratio", phase).observe(
                efficiency.step_activation(info.dense_params, info.expert_params, d, total))
            if info.dtype_bytes:
                counters[("moescope_step_read_bytes_total", (phase, "weights"))] += efficiency.weight_bytes(
                    info.dtype_bytes, info.dense_params, info.expert_params, d)
                if x.context is not None and info.kv_bytes_per_token:
                    counters[("moescope_step_read_bytes_total", (phase, "kv"))] += \
                        float(info.kv_bytes_per_token * x.context[s])
            if x.attended is not None:
                counters[("moescope_step_flops_total", (phase,))] += efficiency.step_flops(
                    int(x.rows[s]), int(x.attended[s]), info.dense_params, info.expert_params,
                    len(info.moe_layers), info.top_k, info.attn_flops_per_context)

    def _fold(self, st: StepStats, second: int) -> None:
        """Per-request counts into the in-flight requests; finished requests and unmapped forwards into the
        window's draws (the caller holds the lock)."""
        win = self.routing_window
        d = st.draws
        n_layers, e = len(win.layers), win.n_experts
        rows = np.array([win.row[ls.layer] for ls in st.layers], dtype=np.int64)
        done: list[np.ndarray] = []
        inflight = self.inflight
        for j, key in enumerate(d.keys):
            counts = d.counts[j]
            if key is None:  # a forward that could not be mapped to requests: a complete draw
                full = np.zeros((n_layers, e))
                full[rows] = counts[:, :e]
                done.append(full)
                continue
            acc = inflight.get(key)
            if acc is None:
                if len(inflight) >= self.max_inflight:
                    _, old = inflight.popitem(last=False)
                    self.draws_dropped += 1
                    done.append(self._rows(old, n_layers))
                acc = inflight[key] = np.zeros((n_layers, e), np.int32)
            elif len(acc) < n_layers:
                acc = inflight[key] = self._rows(acc, n_layers).astype(np.int32)
            acc[rows] += counts[:, :e].astype(np.int32)
        for rid in d.finished:
            acc = inflight.pop(rid, None)
            if acc is not None:
                done.append(self._rows(acc, n_layers))
        if done:
            per_draw = np.stack([a.astype(np.float64) for a in done])
            win.add_draws(second, per_draw)
            run = self.run_draws
            if run is None or len(run.draws) < n_layers:
                grown = sampling.Draws.zeros(n_layers, e)
                if run is not None:
                    grown.add(run.padded(n_layers))
                run = self.run_draws = grown
            run.add(sampling.Draws.of(per_draw))

    def run_draws_of(self, layers) -> "sampling.Draws | None":
        """The run's draws for ``layers`` (rows in that order), or None before any draw finished."""
        with self.lock:
            run = self.run_draws
            if run is None:
                return None
            row = self.routing_window.row
            return run.padded(len(self.routing_window.layers)).rows(np.array([row[layer] for layer in layers]))

    @staticmethod
    def _rows(a: np.ndarray, n_layers: int) -> np.ndarray:
        """``a`` padded with zero rows to ``n_layers`` (a layer the window grew after the request began)."""
        if len(a) >= n_layers:
            return a
        return np.vstack([a, np.zeros((n_layers - len(a), a.shape[1]), a.dtype)])

    # -- reads (scrape thread) -------------------------------------------------------------------------
    def layer_gauges(self) -> LayerGauges:
        """The window gauges of every routed layer, as of the engine side's last flush. The window is copied under
        ``lock`` and judged after it is released (module docstring), under ``judge_lock``: the learned reference is
        read, judged against and updated by one scrape at a time, each from its own copy."""
        if self.reads_flush:
            self.flush()
        with self.judge_lock:
            with self.lock:
                now = self.clock()
                self.routing_window.prune(int(now))
                window, baseline = self.routing_window.snapshot(), self._baseline
            learned = self.learned if baseline is None else None
            g = window.gauges(baseline, learned=learned)
            if learned is not None:
                learned.update(now, window, g, thresholds.DEFAULT.hot_factor)
            return g

    def drift(self, g: LayerGauges) -> dict[int, float]:
        """layer -> JS divergence (bits) of the window's load against the baseline's, where it has the layer."""
        if g.drift_jsd is None:
            return {}
        return {layer: float(v) for layer, v in zip(g.layers, g.drift_jsd.tolist()) if np.isfinite(v)}

    def drift_noise(self, g: LayerGauges) -> dict[int, float]:
        """layer -> the JS divergence sampling noise alone gives against the baseline (judged layers only)."""
        if g.drift_noise is None:
            return {}
        return {layer: float(v) for layer, v in zip(g.layers, g.drift_noise.tolist()) if np.isfinite(v)}

    def placement(self):
        """The expert-parallel placement over more than one rank this process routes for, or None."""
        p = self.placement_source() if self.placement_source is not None else None
        return p if p is not None and p.world_size > 1 else None

    def rank_loads(self, g: LayerGauges) -> tuple[dict[int, float], dict[int, float]] | None:
        """Per-rank load over the window: measured from the expert-parallel exchanges where this process makes
        them (every rank knows every rank's rows: the same numbers on every rank), else modelled from this
        process's routing and the placement (``_modelled_rank_loads``)."""
        with self.lock:
            measured = self.rank_window.loads(self.clock())
        if measured:
            mom = {layer: float(v) for layer, v in zip(measured, stats.max_over_mean_rows(
                np.array(list(measured.values()), dtype=np.float64)).tolist()) if np.isfinite(v)}
            total = np.sum(list(measured.values()), axis=0)
            return mom, {r: float(v) for r, v in enumerate(total.tolist())}
        return self._modelled_rank_loads(g)

    def _modelled_rank_loads(self, g: LayerGauges) -> tuple[dict[int, float], dict[int, float]] | None:
        """Over the window, with an expert-parallel placement over > 1 rank: ({layer: busiest rank's slots /
        the mean rank's} for the judged layers (a finite noise bound), {rank: slots summed over layers});
        None without a placement. A replicated expert's slots are split as the dispatch deals them: 1/R to each
        of its R replicas. (This rank's routing only: each rank routes its own tokens.)"""
        p = self.placement()
        if p is None or not len(g.layers):
            return None
        known = [j for j, layer in enumerate(g.layers) if layer in p.layers]
        if not known:
            return None
        slots = g.slots[known]
        # the dispatch's rule, as the planner predicts with it (a replicated expert's slots dealt over its replicas)
        loads = np.stack([stats.rank_loads(slots[i], p.layers[g.layers[j]]) for i, j in enumerate(known)])
        mom = stats.max_over_mean_rows(loads)
        judged = {g.layers[j]: float(v) for j, v in zip(known, mom.tolist())
                  if np.isfinite(v) and np.isfinite(g.noise_cv[j])}
        return judged, {r: float(v) for r, v in enumerate(loads.sum(0).tolist())}

    def utilisation(self, phase: str = "decode") -> tuple[float | None, float | None]:
        """(S-MBU, S-MFU) of the phase's steps since start (moescope.efficiency): bytes read and FLOPs summed over
        the steps whose routing was summarised, over their summed seconds; None where the peak is unknown."""
        with self.lock:
            c = self.counters
            read = c.get(("moescope_step_read_bytes_total", (phase, "weights")), 0.0) + \
                c.get(("moescope_step_read_bytes_total", (phase, "kv")), 0.0)
            flops = c.get(("moescope_step_flops_total", (phase,)), 0.0)
            child = self._children.get(("moescope_step_seconds", (phase,)))
            seconds = child._sum.get() if child is not None else 0.0  # prometheus_client keeps the sum here
        peak = self.peak or efficiency.Peak()
        return efficiency.utilisation(read, seconds, peak.bandwidth), efficiency.utilisation(flops, seconds, peak.flops)

    def cache_capacity(self) -> dict[int, float]:
        """{layer: experts the cache holds resident / experts} where an expert cache is on."""
        return dict(self.cache_capacity_source() or {}) if self.cache_capacity_source is not None else {}

    def activation_ratio(self, g: LayerGauges) -> float | None:
        """Parameters touched per token / total over the window, ``k_eff`` = computed slots / routed tokens
        per layer (None without traffic)."""
        if not len(g.layers):
            return None
        info = self.info
        k_eff_sum = float((g.slots.sum(1) / g.tokens).sum())
        return (info.dense_params + k_eff_sum * info.expert_params) / info.total_params

    def window(self) -> dict[int, dict[str, Any]]:
        """Per layer over the window: summed slots per expert, tokens, entropy and margin sums (as of the
        last flush)."""
        if self.reads_flush:
            self.flush()
        with self.lock:
            w = self.routing_window
            w.prune(int(self.clock()))
            return {layer: {"slots": w.slots[i].copy(), "tokens": int(w.tokens[i]), "entropy": float(w.entropy[i]),
                            "margin": float(w.margin[i])} for i, layer in enumerate(w.layers) if w.tokens[i]}

    def window_gauges(self) -> dict[str, Any]:
        """The ratio gauges by catalogue name, per layer, and the model's activation ratio (None without
        traffic)."""
        g = self.layer_gauges()
        drift, noise = self.drift(g), self.drift_noise(g)
        hot = g.hot_experts(EXTREMES_K)
        per_layer = {}
        for j, layer in enumerate(g.layers):
            per_layer[layer] = {name: float(getattr(g, attr)[j]) for name, attr in LAYER_GAUGES}
            if layer in drift:
                per_layer[layer]["moescope_routing_drift_jsd_bits"] = drift[layer]
            if layer in noise:
                per_layer[layer]["moescope_routing_drift_noise_bits"] = noise[layer]
            per_layer[layer]["moescope_expert_hot_factor_ratio"] = dict(hot[j])
        return {"layers": per_layer, "activation_ratio": self.activation_ratio(g), "window_draws": g.window_draws}


# (catalogue name, LayerGauges field) of the per-layer window gauges
LAYER_GAUGES = (
    ("moescope_expert_load_cv_ratio", "cv"),
    ("moescope_expert_load_cv_noise_ratio", "noise_cv"),
    ("moescope_expert_load_excess_cv_ratio", "excess_cv"),
    ("moescope_expert_load_max_over_mean_ratio", "max_over_mean"),
    ("moescope_expert_load_top_share_ratio", "top_share"),
    ("moescope_dead_experts", "dead"),
    ("moescope_dead_experts_unexpected", "dead_unexpected"),
    ("moescope_window_slots_per_expert", "slots_per_expert"),
    ("moescope_router_entropy_ratio", "entropy"),
    ("moescope_router_margin_ratio", "margin"),
)


class RankWindow:
    """Rows each rank computed per layer over the last ``window_s`` seconds, in one-second buckets (bounded:
    layers x window_s x world numbers), from the expert-parallel dispatch exchanges."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.buckets: dict[int, collections.deque] = {}  # layer -> deque of [second, np.ndarray[W]]

    def add(self, layer: int, rows, now: float) -> None:
        q = self.buckets.setdefault(layer, collections.deque())
        sec = int(now)
        if q and q[-1][0] == sec:
            q[-1][1] += rows
        else:
            q.append([sec, np.asarray(rows, dtype=np.float64)])
        while q and q[0][0] <= now - self.window_s:
            q.popleft()

    def loads(self, now: float) -> dict[int, np.ndarray]:
        """layer -> [W] rows over the window (layers with any)."""
        out = {}
        for layer, q in sorted(self.buckets.items()):
            rows = [r for sec, r in q if sec > now - self.window_s]
            if rows:
                total = np.sum(rows, axis=0)
                if total.sum() > 0:
                    out[layer] = total
        return out
