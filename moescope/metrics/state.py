"""Host-side metric state: cumulative counters, classic histograms with exemplars, and a sliding window for
the ratio gauges. Fed by ``MetricsObserver`` once per step; read by the exporter at scrape time.

Updates happen on the engine thread, reads on the HTTP thread: one lock, held for microseconds.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from moescope import stats
from moescope.capture.observer import Observer
from moescope.capture.routing_probe import RoutingProbe, StepStats
from moescope.metrics import catalogue


class Histogram:
    """A classic histogram: per-bucket counts, sum, and the last exemplar seen in each bucket."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last = +Inf
        self.sum = 0.0
        self.exemplars: dict[int, tuple[dict[str, str], float, float]] = {}

    def observe(self, value: float, exemplar: dict[str, str] | None = None) -> None:
        i = bisect.bisect_left(self.bounds, value)
        self.counts[i] += 1
        self.sum += value
        if exemplar:
            self.exemplars[i] = (exemplar, value, time.time())

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int, Any]]:
        """[(le, cumulative count, exemplar or None)] including +Inf."""
        out, acc = [], 0
        les = [repr(float(b)) for b in self.bounds] + ["+Inf"]
        for i, (le, c) in enumerate(zip(les, self.counts)):
            acc += c
            out.append((le, acc, self.exemplars.get(i)))
        return out


@dataclass(frozen=True)
class ModelInfo:
    """What the statistics need to know about the model."""

    name: str
    n_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    dense_params: int  # everything that every token touches: attention, embeddings, norms, routers, dense FFNs
    expert_params: int  # one expert
    device: str = "cpu"

    @property
    def total_params(self) -> int:
        return self.dense_params + len(self.moe_layers) * self.n_experts * self.expert_params

    @classmethod
    def from_runtime(cls, model, name: str | None = None) -> "ModelInfo":
        cfg = model.cfg
        total = sum(p.numel() for p in model.parameters())
        expert = cfg.expert_params
        return cls(name=name or cfg.name, n_experts=cfg.n_experts, top_k=cfg.top_k, moe_layers=cfg.moe_layers,
                   dense_params=total - len(cfg.moe_layers) * cfg.n_experts * expert, expert_params=expert,
                   device=str(model.device))


@dataclass
class _Bin:
    second: int
    slots: dict[int, np.ndarray] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    entropy: dict[int, float] = field(default_factory=dict)
    margin: dict[int, float] = field(default_factory=dict)


class MetricsObserver(Observer):
    """Accumulates everything the exporter shows. Attach it to the model (``moescope.instrument`` does).

    Args:
        info: model facts (experts, params) for the ratios.
        rank: the ``rank`` label.
        window_s: length of the sliding window the ratio gauges use.
        expert_series_budget: export per-(layer, expert) series only while layers x experts <= this.
        flush_interval_s: how often the routing probe summarises pending decisions (reads call ``flush()``
            first, so a scrape always sees everything routed so far).
        clock: monotonic seconds (tests inject a fake one).
    """

    def __init__(self, info: ModelInfo, *, rank: int = 0, window_s: float = 60.0,
                 expert_series_budget: int = 4096, flush_interval_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.info, self.rank, self.window_s, self.clock = info, rank, window_s, clock
        self.per_expert = len(info.moe_layers) * info.n_experts <= expert_series_budget
        self.lock = threading.Lock()
        self.probe = RoutingProbe(self._on_stats, interval_s=flush_interval_s)
        # The per-layer hot-path hooks go straight to the probe (one Python call less per layer).
        self.on_routing = self.probe.on_routing
        self.on_layer_time = self.probe.on_layer_time
        c = catalogue.BY_NAME
        self.expert_tokens: dict[int, np.ndarray] = {}  # layer -> cumulative slots per expert
        self.layer_counters: dict[str, dict[int, float]] = collections.defaultdict(
            lambda: collections.defaultdict(float))
        self.hists: dict[tuple[str, tuple[str, ...]], Histogram] = {}
        self._bounds = {m.name: m.buckets for m in c.values() if m.kind == "histogram"}
        self.counters: dict[tuple[str, tuple[str, ...]], float] = collections.defaultdict(float)
        self._bins: collections.deque[_Bin] = collections.deque()
        self.flips: dict[int, float] = {}  # last canary run's flip ratio per layer
        self.baseline: dict[int, list[float]] | None = None  # layer -> baseline load (drift reference)
        self.errors_source: Callable[[], dict[str, int]] | None = None  # observer -> errors raised
        self.dropped_source: Callable[[], dict[str, int]] | None = None  # queue -> events dropped

    # -- helpers ---------------------------------------------------------------------------------------
    def hist(self, name: str, *label_values: str) -> Histogram:
        key = (name, label_values)
        h = self.hists.get(key)
        if h is None:
            h = self.hists[key] = Histogram(self._bounds[name])
        return h

    # -- observer hooks (engine thread) ----------------------------------------------------------------
    def on_routing(self, layer, decision) -> None:
        self.probe.on_routing(layer, decision)

    def on_layer_time(self, layer, router_s, experts_s) -> None:
        self.probe.on_layer_time(layer, router_s, experts_s)

    def flush(self) -> None:
        """Summarise routing still pending in the probe (called before reads, and at shutdown)."""
        self.probe.flush()

    def on_stats(self, st: StepStats) -> None:
        """Routing statistics summarised elsewhere: a CUDA-graph decode step's in-graph counters
        (``runtime.graph_decode.GraphCollector``), where no Python hook runs per forward."""
        self._on_stats(st)

    def shutdown(self) -> None:
        self.flush()

    def on_step(self, step) -> None:
        self.probe.on_step(step)  # -> _on_stats once per interval
        segments = step.segments
        phase = (step.phase,)
        with self.lock:
            self.hist("moescope_step_seconds", step.phase).observe(
                step.seconds, {"request_id": segments[0][0]} if segments else None)
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

    def on_request(self, record) -> None:
        ex = {"request_id": record.request_id}
        with self.lock:
            h = self.hist("moescope_token_latency_seconds")
            for lat in record.token_latencies_s:
                h.observe(lat, ex)
            self.hist("moescope_request_queue_seconds").observe(record.queue_s, ex)
            self.counters[("moescope_requests_total", (record.finish_reason,))] += 1

    def _on_stats(self, st: StepStats) -> None:
        second = int(self.clock())
        with self.lock:
            if not self._bins or self._bins[-1].second != second:
                self._bins.append(_Bin(second))
                self._prune(second)
            b = self._bins[-1]
            lc = self.layer_counters
            for ls in st.layers:
                layer = ls.layer
                tot = self.expert_tokens.get(layer)
                if tot is None:
                    self.expert_tokens[layer] = ls.slots.copy()
                else:
                    tot += ls.slots
                lc["moescope_router_tokens_total"][layer] += ls.tokens
                lc["moescope_tokens_dropped_total"][layer] += ls.dropped
                lc["moescope_router_nonfinite_logits_total"][layer] += ls.nonfinite
                for reason, n in (ls.rerouted or {}).items():
                    self.counters[("moescope_rerouted_slots_total", (str(layer), reason))] += n
                win = b.slots.get(layer)
                if win is None:
                    b.slots[layer] = ls.slots.copy()
                    b.tokens[layer], b.entropy[layer], b.margin[layer] = ls.tokens, ls.entropy_sum, ls.margin_sum
                else:
                    win += ls.slots
                    b.tokens[layer] += ls.tokens
                    b.entropy[layer] += ls.entropy_sum
                    b.margin[layer] += ls.margin_sum
                if ls.router_s is not None:
                    self.hist("moescope_router_seconds").observe(ls.router_s)
                    self.hist("moescope_expert_compute_seconds").observe(ls.experts_s)

    def _prune(self, now_second: int) -> None:
        while self._bins and self._bins[0].second <= now_second - self.window_s:
            self._bins.popleft()

    # -- reads (scrape thread) -------------------------------------------------------------------------
    def window(self) -> dict[int, dict[str, Any]]:
        """Per layer over the window: summed slots per expert, tokens, entropy and margin sums."""
        self.flush()
        with self.lock:
            self._prune(int(self.clock()))
            out: dict[int, dict[str, Any]] = {}
            for b in self._bins:
                for layer, slots in b.slots.items():
                    w = out.setdefault(layer, {"slots": np.zeros_like(slots), "tokens": 0, "entropy": 0.0,
                                               "margin": 0.0})
                    w["slots"] = w["slots"] + slots
                    w["tokens"] += b.tokens[layer]
                    w["entropy"] += b.entropy[layer]
                    w["margin"] += b.margin[layer]
            return out

    def window_gauges(self) -> dict[str, Any]:
        """The ratio gauges: per layer, and the model's activation ratio (None without traffic)."""
        win = self.window()
        per_layer = {}
        k_eff_sum, any_tokens = 0.0, False
        for layer, w in win.items():
            if not w["tokens"]:
                continue
            any_tokens = True
            load = w["slots"].tolist()
            k_eff_sum += sum(load) / w["tokens"]
            per_layer[layer] = {
                "moescope_expert_load_cv_ratio": stats.load_cv(load),
                "moescope_expert_load_max_over_mean_ratio": stats.max_over_mean(load),
                "moescope_expert_load_top_share_ratio": stats.top_share(load, w["tokens"]),
                "moescope_dead_experts": float(stats.dead_experts(load)),
                "moescope_router_entropy_ratio": w["entropy"] / w["tokens"],
                "moescope_router_margin_ratio": w["margin"] / w["tokens"],
            }
            if self.baseline and layer in self.baseline:
                per_layer[layer]["moescope_routing_drift_jsd_bits"] = stats.jensen_shannon(load, self.baseline[layer])
        info = self.info
        ratio = stats.activation_ratio(info.dense_params, info.expert_params, info.total_params,
                                       k_eff_sum) if any_tokens else None
        return {"layers": per_layer, "activation_ratio": ratio}
