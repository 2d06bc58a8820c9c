"""The metrics' observer: the engine's thread hands records over, one evaluator folds, judges, learns and publishes.

Three parts, one thread each:

- **The engine's thread** (the observer hooks): a constant amount of work per step, whatever the layers, experts or
  batch. ``on_routing`` keeps a reference (the routing probe's list; one append per MoE layer: the engine's
  ``RoutingDecision`` is immutable), ``on_step`` and ``on_request`` append the record to an inbox, ``on_idle``
  wakes the evaluator. Nothing is counted, summarised, judged or observed into a histogram here (prometheus_client's
  ``Histogram.observe`` cost ~3 us a call: once per step and per output token before).
- **The evaluator** (``evaluate``, run by ``metrics.evaluator.Evaluator`` once per interval on its own thread, and
  when the engine goes idle): takes the inbox, has the probe summarise the routing of the finished steps
  (``RoutingProbe.flush``), folds it all into ``metrics.counting.Counts`` (counters, histograms, the routing window,
  the per-request draws), judges the window (``judge.judge_window``), updates the learned reference on its own clock
  (so an idle engine still learns and clears, and no reader changes when it does), and publishes one immutable
  ``metrics.snapshot.Snapshot``. Evaluations are serialised (``_eval``).
- **Readers** (the exporter's scrapes, ``top``, the TUI, the demo's summary): read ``snapshot``, never compute.
  Only an instrumented HF model, which has no engine to say when its forwards stop, asks for an evaluation when a read
  finds forwards newer than the snapshot (``reads_flush``): the same evaluation every reader then sees. And a read
  that comes while an evaluation the engine asked for (it went idle) is under way waits for that one (at most
  ``READ_WAIT_S``), so a run's last steps are in what is read right after it.

The inbox is bounded (``MAX_INBOX`` records; past it records are dropped and counted in
``moescope_capture_dropped_total{queue="metrics"}``), and so is the probe (``RoutingProbe.hard_limit``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from moescope import efficiency, stats, thresholds
from moescope.capture.engine_contract import ModelInfo  # what an engine hands moescope (re-exported here)
from moescope.capture.observer import RuntimeObserver
from moescope.capture.routing_probe import RoutingProbe, StepStats
from moescope.capture.sources import Reading, Sources
from moescope.errors import BadInput
from moescope.metrics.counting import HELD_EXPERTS, Counts, RankWindow
from moescope.metrics.snapshot import Snapshot
from moescope.metrics.window import LayerGauges
from moescope.metrics import catalogue  # [eplb] wiring
from moescope.parallel.step_balance import InUse, StepBalance  # [eplb] wiring

if TYPE_CHECKING:  # typing only: the payloads the engine hands over
    from moescope.capture.decision import RoutingDecision
    from moescope.capture.records import RequestRecord, StepRecord
    from moescope.metrics.evaluator import Evaluator
    from moescope.parallel.eplb import Rebalance
    from moescope.parallel.expert_parallel import AllToAllRecord
    from moescope.parallel.placement import Placement
    from moescope.runtime.expert_cache import CacheDelta

log = logging.getLogger("moescope.metrics")

# Per-(layer, expert) counters up to 64 MoE layers x 256 experts per replica: DeepSeek-V3's shape and a little
# beyond (docs/metrics.md, "Cardinality", has the arithmetic).
EXPERT_SERIES_BUDGET = 64 * 256
EXTREMES_K = 8  # the hottest and coldest experts per layer every tier exports
# Records (steps, requests, cache deltas, exchanges) waiting for the next evaluation, at most: at 1 s evaluations
# a thousand-step-a-second engine holds a thousand; past this the evaluator has stalled, and records are dropped
# (counted), never waited for.
MAX_INBOX = 65536
# A read waits at most this long for an evaluation the engine asked for (it went idle); then it serves the last one.
READ_WAIT_S = 5.0


class MetricsObserver(RuntimeObserver):
    """Accumulates everything the exporter shows. Attach it to the model (``moescope.instrument`` does).

    Args:
        info: model facts (experts, params) for the ratios.
        rank: the ``rank`` label.
        window_s: length of the sliding window the ratio gauges use.
        expert_series_budget: export the full tier (per-(layer, expert) counters) while layers x experts <= this;
            beyond it the reduced tier only (every layer's hottest and coldest experts, its load distribution).
        export_routing: False on a rank that routes the same tokens as another exporting rank.
        flush_interval_s: how often the evaluator runs (``metrics.evaluator``); reads serve its last snapshot.
        max_inflight: in-flight requests whose per-(layer, expert) counts are held (None: ``metrics.counting``).
        clock: monotonic seconds (tests inject a fake one).
        hot_reference: without a baseline, "learned" (``metrics.window.LearnedReference``) or "fair".
    Attributes:
        sources: the ``capture.sources.Sources`` its components register on (``moescope.instrument`` passes it to
            each: the fan-out's observer errors, the trace recorder's drops and errors, the engine adapter's
            placement and cache capacity, the vLLM worker's cost and errors), read once per evaluation on the
            evaluator's thread, never at scrape time.
        baseline: the loaded baseline (set by ``moescope.instrument``), or None.
    """

    def __init__(self, info: ModelInfo, *, rank: int = 0, window_s: float = 60.0,
                 expert_series_budget: int = EXPERT_SERIES_BUDGET, export_routing: bool = True,
                 flush_interval_s: float = 1.0, max_inflight: int | None = None,
                 clock: Callable[[], float] = time.monotonic, hot_reference: str = "learned") -> None:
        self.info, self.rank, self.window_s, self.clock = info, rank, window_s, clock
        self.flush_interval_s = flush_interval_s
        self.per_expert = len(info.moe_layers) * info.n_experts <= expert_series_budget
        self.export_routing = export_routing
        self.reads_flush = False  # an engine that never says it is idle (a HF model): a stale read evaluates
        # The engine's side: the probe's list of decisions and the inbox; each list swapped under its lock by the
        # evaluator (microseconds), never held while anything is computed.
        self.probe = RoutingProbe(self._fold_stats, interval_s=math.inf)
        self.probe.on_due = self.wake
        # per layer per forward: straight to the probe, one Python call less (FanOut binds the instance's attribute)
        self.on_routing = self.probe.on_routing  # type: ignore[method-assign]
        self.on_layer_time = self.probe.on_layer_time  # type: ignore[method-assign]  # (as on_routing)
        self._inbox_lock = threading.Lock()
        self._inbox: list[tuple[str, Any]] = []
        self._inbox_dropped = 0
        self._steps_seen = 0  # steps reported (the engine's thread); the snapshot's ``steps_in`` says which it saw
        # The evaluator's side: only evaluate() touches counts, under _eval
        self._eval = threading.Lock()
        self.lock = self._eval  # (the state's lock: held by an evaluation; readers need none)
        self.counts = Counts(info, window_s=window_s, per_expert=self.per_expert, max_inflight=max_inflight,
                             hot_reference=hot_reference)
        self._baseline = None  # analysis.baseline.Profile: the hot/dead/drift reference and the baseline series
        self.sources = Sources()
        self._reading = Reading()  # the sources as of the current (or last) evaluation
        self.peak: efficiency.Peak | None = efficiency.resolve_peak(info.device)
        self.components: list = []  # extra per-evaluation components: observe(StepStats), snapshot() (e.g. [eplb])
        # [eplb] wiring: each step's busiest / mean rank predicted per EP size and placement (parallel.step_balance)
        self.step_balance = StepBalance(info.moe_layers, info.n_experts, buckets=catalogue.STEP_BALANCE_BUCKETS,
                                        in_use_source=InUse(self.placement, info.n_experts))
        self.components.append(self.step_balance)
        self.capture_enabled = True  # set by the capture switch (moescope.capture.switch)
        self.capture_switches = 0
        self.evaluations_failed = 0
        self._seq = 0
        self._evaluated_steps = 0  # steps reported before the last evaluation began
        self._asked = 0  # the evaluation a read waits for (``wake``: one that begins after it)
        self._begun = 0  # evaluations begun
        self._published = threading.Condition()
        self.evaluator: Evaluator | None = None  # once started
        self.snapshot = Snapshot(seq=0, at=clock(), gauges=self.counts.routing_window.gauges(None),
                                 window_layers=tuple(info.moe_layers))  # (an empty window's gauges)

    # -- configuration -------------------------------------------------------------------------------------------
    @property
    def baseline(self):
        """The loaded baseline (``analysis.baseline.Profile``) or None."""
        return self._baseline

    @baseline.setter
    def baseline(self, profile) -> None:
        if profile is not None and profile.n_experts != self.info.n_experts:
            raise BadInput(f"the baseline has {profile.n_experts} experts per layer; {self.info.name} has "
                           f"{self.info.n_experts}")
        with self._eval:
            self._baseline = profile
        self.wake()  # judged against it from the next evaluation, which readers wait for

    # -- observer hooks: the engine's thread, O(1) each ------------------------------------------------------------
    def _put(self, kind: str, payload) -> None:
        with self._inbox_lock:
            if len(self._inbox) >= MAX_INBOX:
                self._inbox_dropped += 1
                return
            self._inbox.append((kind, payload))

    def on_routing(self, layer: int, decision: "RoutingDecision") -> None:  # (the instance's attribute runs)
        self.probe.on_routing(layer, decision)

    def on_layer_time(self, layer: int, router_s: float, experts_s: float) -> None:  # (as on_routing)
        self.probe.on_layer_time(layer, router_s, experts_s)

    def on_step(self, step: "StepRecord") -> None:
        if self.probe.end_step(step):
            self._steps_seen += 1
            self._put("step", step)

    def on_request(self, request: "RequestRecord") -> None:
        self.probe.on_request(request.request_id)  # its draw is folded once its last step is summarised
        self._put("request", request)

    def on_cache(self, layer: int, delta: "CacheDelta") -> None:
        self._put("cache", (layer, delta))

    def on_all_to_all(self, record: "AllToAllRecord") -> None:
        self._put("a2a", record)

    def on_rebalance(self, event: "Rebalance") -> None:
        self._put("rebalance", event)

    def on_canary(self, flips: dict[int, float]) -> None:
        self._put("canary", dict(flips))

    def on_stats(self, stats: StepStats) -> None:
        """Routing summarised elsewhere (a CUDA-graph decode's in-graph counters, ``runtime.graph_decode``)."""
        self._put("stats", stats)

    def on_idle(self) -> None:
        """The engine ran out of work: evaluate soon (its last steps would otherwise wait for the interval)."""
        self.wake()

    def wake(self) -> None:
        """Ask the evaluator for an evaluation now: the engine went idle, or much routing waits. Until one has
        covered every step reported so far, a read waits for it (``current``)."""
        self._asked = self._begun + 1  # an evaluation that begins after now
        if self.evaluator is not None:
            self.evaluator.wake()

    def resync(self) -> None:
        """Capture was turned back on (``moescope.capture.switch``): what the probe holds may be part of a forward
        that began while it was off, so the next step's routing and the step itself are not counted."""
        self.probe.resync()

    def shutdown(self) -> None:
        if self.evaluator is not None:
            self.evaluator.stop()
        self.evaluate(final=True)

    # -- the evaluator's side ------------------------------------------------------------------------------------
    def _fold_stats(self, st: StepStats) -> None:
        """The probe's listener: runs inside ``evaluate`` (its ``flush``), on the evaluator's thread."""
        self.counts.stats(st, int(self.clock()))
        for c in self.components:
            c.observe(st)

    def flush(self) -> Snapshot:
        """Evaluate now, on the caller's thread (the demo's summary, SGLang's recorder, tests): one evaluation like
        the evaluator's, serialised with it. Returns the snapshot it published."""
        return self.evaluate()

    def evaluate(self, final: bool = False) -> Snapshot:
        """One evaluation: fold what the engine handed over, judge the window, learn, publish a ``Snapshot``.
        ``final``: also the routing of a forward no step closed (the engine is gone)."""
        with self._eval:
            try:
                self.snapshot = snap = self._evaluate(final)
                with self._published:
                    self._published.notify_all()
            except Exception:  # counted, logged once; the last snapshot stays (readers never see a half one)
                self.evaluations_failed += 1
                if self.evaluations_failed == 1:
                    log.exception("moescope: an evaluation failed (counted; further errors at debug)")
                else:
                    log.debug("moescope: an evaluation failed", exc_info=True)
                snap = self.snapshot
            return snap

    def _evaluate(self, final: bool) -> Snapshot:
        self._begun += 1
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
            seen = self._steps_seen
        now = self.clock()
        c = self.counts
        second = int(now)
        # What the components count of themselves, once (the placement the step balance and the rank loads use)
        self._reading = reading = self.sources.read()
        # Records in the order they came; the probe's summary of the steps' routing first (a request finishing in
        # a step is folded as a draw by the summary that holds its last step)
        self.probe.flush(final=final, settled=not final)
        self._fold_inbox(inbox, now, second)
        time.sleep(0)  # the engine's thread may want the GIL between the fold and the judgement
        g, win = self._judge(now)
        capacity = dict(reading.cache_capacity)
        self._evaluated_steps = seen
        self._seq = self._begun
        return Snapshot(
            seq=self._seq, at=now, gauges=g, counters=dict(c.counters),
            layer_counters={name: dict(v) for name, v in c.layer_counters.items()},
            router_tokens_by_mode=dict(c.router_tokens_by_mode),
            expert_tokens={layer: v.copy() for layer, v in c.expert_tokens.items()},
            histograms=c.histograms.data(), drift=_finite(g.layers, g.drift_jsd),
            drift_noise=_finite(g.layers, g.drift_noise), flips=dict(c.flips), rank_loads=self._rank_loads(g, now),
            eplb=c.eplb_gauges(), capacity=capacity, activation=_activation(self.info, g),
            bars=self._bars(g, win.layers, capacity),
            errors={**reading.errors, **({"evaluator": self.evaluations_failed} if self.evaluations_failed else {})},
            dropped={**reading.dropped, "draws": c.draws_dropped, "metrics": self._inbox_dropped,
                     "routing": self.probe.dropped_steps},
            cost_s=reading.cost_s, baseline=self._baseline,
            window_layers=tuple(win.layers), window_draws=g.window_draws, capture_enabled=self.capture_enabled,
            capture_switches=self.capture_switches, evaluations_failed=self.evaluations_failed,
            extra={type(x).__name__: x.snapshot() for x in self.components})

    def _fold_inbox(self, inbox: list, now: float, second: int) -> None:
        c = self.counts
        steps = [p for kind, p in inbox if kind == "step"]
        requests = [p for kind, p in inbox if kind == "request"]
        c.steps(steps, time.time())
        c.requests(requests, time.time())
        for kind, p in inbox:
            if kind == "cache":
                c.cache(*p)
            elif kind == "a2a":
                c.all_to_all(p, now)
            elif kind == "rebalance":
                c.rebalance(p)
            elif kind == "canary":
                c.flips = p
            elif kind == "stats":
                self._fold_stats(p)

    def _judge(self, now: float) -> tuple[LayerGauges, Any]:
        """The window's gauges, judged against the baseline or the learned reference, which is updated here, by
        the evaluator alone, on its clock."""
        c = self.counts
        win = c.routing_window
        win.prune(int(now))
        baseline = self._baseline
        learned = c.learned if baseline is None else None
        g = win.gauges(baseline, learned=learned)
        if learned is not None:
            learned.update(now, win, g, thresholds.DEFAULT.hot_factor)
        return g, win

    def _bars(self, g: LayerGauges, layers, capacity: dict) -> tuple:
        """Every judgement's bar and clear bar (``Thresholds.bars``), per layer of the model (a layer the window
        judged, against its reference's kind) and per model: what the rules, the dashboards and the views read."""
        at = {layer: j for j, layer in enumerate(g.layers)}
        routing = self.export_routing

        def per_layer(values) -> list[float]:  # the window's judged layers, at every layer of the model (NaN: none)
            return [float(values[at[x]]) if values is not None and x in at else math.nan for x in layers]

        kinds = [g.hot_reference[at[x]] if routing and x in at and g.hot_reference else "" for x in layers]
        return tuple(layers), thresholds.DEFAULT.bars(kinds, per_layer(g.reference_cv), per_layer(g.reference_top),
                                                      per_layer(g.drift_noise), [capacity.get(x, math.nan)
                                                                                 for x in layers],
                                                      self.info.expected_activation if routing else None)

    def placement(self) -> "Placement | None":
        """The expert-parallel placement over more than one rank this process routes for, or None, as the sources
        read at the current (or last) evaluation report it."""
        p = self._reading.placement
        return p if p is not None and p.world_size > 1 else None

    def _rank_loads(self, g: LayerGauges, now: float):
        """Per-rank load over the window: measured from the expert-parallel exchanges where this process makes
        them, else modelled from this process's routing and the placement."""
        measured = self.counts.rank_window.loads(now)
        if measured:
            mom = {layer: float(v) for layer, v in zip(measured, stats.max_over_mean_rows(
                np.array(list(measured.values()), dtype=np.float64)).tolist()) if np.isfinite(v)}
            total = np.sum(list(measured.values()), axis=0)
            return mom, {r: float(v) for r, v in enumerate(total.tolist())}
        return modelled_rank_loads(self.placement(), g)

    @property
    def routing_window(self):
        """The routing window (its ``layers``: every layer known); the evaluator's to change, a reader's to read."""
        return self.counts.routing_window

    # -- reads: the last snapshot ---------------------------------------------------------------------------------
    def current(self) -> Snapshot:
        """The snapshot readers serve. Where no engine says when it is idle (``reads_flush``: a HF model) and
        forwards came after the snapshot, an evaluation first (the same one for every reader)."""
        if self.reads_flush and self._steps_seen != self._evaluated_steps:
            return self.evaluate()
        if self.evaluator is not None and self._seq < self._asked:
            # an evaluation was asked for (the engine just went idle): the one every reader is about to see
            with self._published:
                self._published.wait_for(lambda: self._seq >= self._asked, timeout=READ_WAIT_S)
        return self.snapshot

    def layer_gauges(self) -> LayerGauges:
        return self.current().gauges

    def drift(self, g: LayerGauges | None = None) -> dict[int, float]:
        return dict(self.current().drift)

    def drift_noise(self, g: LayerGauges | None = None) -> dict[int, float]:
        return dict(self.current().drift_noise)

    def rank_loads(self, g: LayerGauges | None = None):
        return self.current().rank_loads

    def eplb_gauges(self):
        return self.current().eplb

    def cache_capacity(self) -> dict[int, float]:
        return dict(self.current().capacity)

    def activation_ratio(self, g: LayerGauges | None = None) -> float | None:
        return self.current().activation

    @property
    def expert_tokens(self) -> dict[int, np.ndarray]:
        return self.current().expert_tokens

    @property
    def layer_counters(self) -> dict:
        return self.current().layer_counters

    @property
    def counters(self) -> dict:
        return self.current().counters

    @property
    def flips(self) -> dict[int, float]:
        return self.current().flips

    def run_draws_of(self, layers):
        """The run's draws for ``layers`` (rows in that order), or None before any draw finished (as of now: an
        evaluation runs first)."""
        with self._eval:
            return self.counts.run_draws_of(layers)

    def learned_rows(self, layers):
        """The learned reference's rows for ``layers`` (``LearnedRows``), or None without one."""
        with self._eval:
            learned = self.counts.learned
            if learned is None:
                return None
            row = self.counts.routing_window.row
            return learned.rows(np.array([row[layer] for layer in layers]), len(self.counts.routing_window.layers))

    def utilisation(self, phase: str = "decode") -> tuple[float | None, float | None]:
        """(S-MBU, S-MFU) of the phase's steps since start (moescope.efficiency), as of the snapshot."""
        snap = self.current()
        c = snap.counters
        read = c.get(("moescope_step_read_bytes_total", (phase, "weights")), 0.0) + \
            c.get(("moescope_step_read_bytes_total", (phase, "kv")), 0.0)
        flops = c.get(("moescope_step_flops_total", (phase,)), 0.0)
        h = snap.hist("moescope_step_seconds", phase)
        seconds = h.total if h is not None else 0.0
        peak = self.peak or efficiency.Peak()
        return efficiency.utilisation(read, seconds, peak.bandwidth), efficiency.utilisation(flops, seconds, peak.flops)

    def window(self) -> dict[int, dict[str, Any]]:
        """Per layer over the window (as of the snapshot): slots per expert, tokens, entropy and margin sums."""
        g = self.current().gauges
        return {layer: {"slots": g.slots[j].astype(np.int64), "tokens": int(g.tokens[j]),
                        "entropy": float(g.entropy[j] * g.tokens[j]), "margin": float(g.margin[j] * g.tokens[j])}
                for j, layer in enumerate(g.layers) if g.tokens[j]}

    def window_gauges(self) -> dict[str, Any]:
        """The ratio gauges by catalogue name, per layer, and the model's activation ratio (None without
        traffic)."""
        snap = self.current()
        g = snap.gauges
        hot = g.hot_experts(EXTREMES_K)
        per_layer: dict[int, dict[str, Any]] = {}
        for j, layer in enumerate(g.layers):
            per_layer[layer] = {name: float(getattr(g, attr)[j]) for name, attr in LAYER_GAUGES}
            if layer in snap.drift:
                per_layer[layer]["moescope_routing_drift_jsd_bits"] = snap.drift[layer]
            if layer in snap.drift_noise:
                per_layer[layer]["moescope_routing_drift_noise_bits"] = snap.drift_noise[layer]
            per_layer[layer]["moescope_expert_hot_factor_ratio"] = dict(hot[j])
        return {"layers": per_layer, "activation_ratio": snap.activation, "window_draws": g.window_draws}


def _finite(layers, values) -> dict[int, float]:
    if values is None:
        return {}
    return {layer: float(v) for layer, v in zip(layers, np.asarray(values).tolist()) if np.isfinite(v)}


def _activation(info: ModelInfo, g: LayerGauges) -> float | None:
    """Parameters touched per token / total over the window, ``k_eff`` = computed slots / routed tokens per layer
    (None without traffic)."""
    if not len(g.layers):
        return None
    k_eff_sum = float((g.slots.sum(1) / g.tokens).sum())
    return (info.dense_params + k_eff_sum * info.expert_params) / info.total_params


def modelled_rank_loads(p, g: LayerGauges):
    """Over the window, with an expert-parallel placement over > 1 rank: ({layer: busiest rank's slots / the mean
    rank's} for the judged layers, {rank: slots summed over layers}); None without a placement. A replicated expert's
    slots are split as the dispatch deals them: 1/R to each of its R replicas (this rank's routing only)."""
    if p is None or not len(g.layers):
        return None
    known = [j for j, layer in enumerate(g.layers) if layer in p.layers]
    if not known:
        return None
    slots = g.slots[known]
    loads = np.stack([stats.rank_loads(slots[i], p.layers[g.layers[j]]) for i, j in enumerate(known)])
    mom = stats.max_over_mean_rows(loads)
    judged = {g.layers[j]: float(v) for j, v in zip(known, mom.tolist())
              if np.isfinite(v) and np.isfinite(g.noise_cv[j])}
    return judged, {r: float(v) for r, v in enumerate(loads.sum(0).tolist())}


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

__all__ = ["MetricsObserver", "ModelInfo", "EXPERT_SERIES_BUDGET", "EXTREMES_K", "HELD_EXPERTS", "LAYER_GAUGES",
           "RankWindow"]
