"""What the metrics count, folded once per evaluation on the evaluator's thread (``metrics.state``): routing
summaries (the probe's ``StepStats``) into counters, the routing window and the per-request draws; the engine's step
and request records into counters and histograms; cache deltas, expert-parallel exchanges, rearrangements and canary
runs. Only the evaluator's thread touches a ``Counts`` (under the observer's evaluation lock), so nothing here
locks, and the engine's thread never waits for any of it.

Sampling noise takes the request as the independent draw (``moescope.sampling``): the routing probe counts each
request's slots per (layer, expert); ``Counts`` sums them per in-flight request (at most ``max_inflight`` requests,
the oldest evicted first and folded as they are, counted in ``moescope_capture_dropped_total{queue="draws"}``) and
folds a request into the window's draws when the probe reports it finished. A forward the probe could not map to
requests is one draw, folded at once.
"""

from __future__ import annotations

import collections
import numpy as np

from moescope import efficiency, sampling, stats, thresholds
from moescope.capture.engine_contract import ModelInfo
from moescope.capture.routing_probe import UNKNOWN_MODE, DrawCounts, StepExperts, StepStats
from moescope.metrics.histograms import Histograms
from moescope.metrics.window import LearnedReference, RoutingWindow

HELD_EXPERTS = "held"  # moescope_expert_physical_slots_total's expert label in the reduced tier: all held together
# In-flight requests' [L, E] counts are held up to this many bytes (int32): ~540 requests at 58 x 256, the
# engine's batch is far fewer; never fewer than MIN_INFLIGHT requests.
INFLIGHT_BYTES = 32 * 2**20
MIN_INFLIGHT = 64
MAX_INFLIGHT = 4096


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


class Counts:
    """Every cumulative counter, histogram and window the exporter serves, as of the last evaluation.

    Args:
        info: the model's shape. window_s: the routing window. per_expert: the full tier (per-(layer, expert)
        physical-slot counters) or the reduced one. max_inflight: in-flight requests whose counts are held (None:
        from ``INFLIGHT_BYTES``). hot_reference: "learned" (the learned reference) or "fair".
    """

    def __init__(self, info: ModelInfo, *, window_s: float, per_expert: bool, max_inflight: int | None = None,
                 hot_reference: str = "learned") -> None:
        self.info, self.per_expert = info, per_expert
        self.expert_tokens: dict[int, np.ndarray] = {}  # layer -> cumulative slots per expert
        self.layer_counters: dict[str, dict[int, float]] = collections.defaultdict(
            lambda: collections.defaultdict(float))
        # (layer, forward mode) -> tokens routed: moescope_router_tokens_total's series
        self.router_tokens_by_mode: dict[tuple[int, str], float] = collections.defaultdict(float)
        self.counters: dict[tuple[str, tuple[str, ...]], float] = collections.defaultdict(float)
        self.histograms = Histograms()
        self.routing_window = RoutingWindow(info.moe_layers, info.n_experts, window_s)
        self.learned = LearnedReference(len(info.moe_layers), info.n_experts, window_s,
                                        thresholds.DEFAULT.learn_half_life_windows) \
            if hot_reference == "learned" else None
        self.rank_window = RankWindow(window_s)  # measured per-rank load (expert-parallel exchanges)
        # EPLB in the loop: the last rearrangement's figures and the rows per rank measured since (layer -> [W])
        self.eplb_before: dict[int, float] = {}
        self.eplb_predicted: dict[int, float] = {}
        self.eplb_rows: dict[int, np.ndarray] = {}
        self.flips: dict[int, float] = {}  # last canary run's flip ratio per layer
        per_request = 4 * max(1, len(info.moe_layers) * info.n_experts)
        self.max_inflight = max_inflight or min(MAX_INFLIGHT, max(MIN_INFLIGHT, INFLIGHT_BYTES // per_request))
        self.inflight: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()  # id -> [L, E]
        self.draws_dropped = 0  # in-flight requests evicted before they finished (folded as they were)
        # Every finished draw of the run, never pruned (six [L, E] sums: the demo's summary judges the whole run
        # with the same functions the window uses)
        self.run_draws: sampling.Draws | None = None

    # -- the engine's records, a batch per evaluation ------------------------------------------------------------
    def steps(self, steps: list, now: float) -> None:
        """Step records: ``moescope_steps_total``, ``moescope_tokens_total`` and ``moescope_step_seconds`` (each
        bucket's exemplar: the latest step's first request)."""
        by_phase: dict[str, tuple[list, list]] = {}
        counters = self.counters
        for s in steps:
            seconds, ids = by_phase.setdefault(s.phase, ([], []))
            seconds.append(s.seconds)
            ids.append(s.segments[0][0] if s.segments else None)
            counters[("moescope_tokens_total", (s.phase,))] += s.n_tokens
        for phase, (seconds, ids) in by_phase.items():
            counters[("moescope_steps_total", (phase,))] += len(seconds)
            self.histograms.add("moescope_step_seconds", (phase,), seconds, ids, now)

    def requests(self, records: list, now: float) -> None:
        """Finished requests' records: per-token latencies and queue time (exemplar: the request's id), and
        ``moescope_requests_total`` by finish reason."""
        if not records:
            return
        lat, lat_ids = [], []
        for r in records:
            lat += r.token_latencies_s
            lat_ids += [r.request_id] * len(r.token_latencies_s)
            self.counters[("moescope_requests_total", (r.finish_reason,))] += 1
        self.histograms.add("moescope_token_latency_seconds", (), lat, lat_ids, now)
        self.histograms.add("moescope_request_queue_seconds", (), [r.queue_s for r in records],
                            [r.request_id for r in records], now)

    def cache(self, layer: int, delta) -> None:
        lc = self.layer_counters
        lc["moescope_expert_cache_lookups_total"][layer] += delta.lookups
        lc["moescope_expert_cache_hits_total"][layer] += delta.hits
        lc["moescope_expert_cache_misses_total"][layer] += delta.misses
        lc["moescope_expert_cache_evictions_total"][layer] += delta.evictions
        lc["moescope_expert_cache_prefetch_hits_total"][layer] += delta.prefetch_hits
        lc["moescope_expert_cache_prefetch_wasted_total"][layer] += delta.prefetch_wasted
        lc["moescope_expert_cache_prefetch_dropped_total"][layer] += delta.prefetch_dropped
        lc["moescope_expert_cache_loaded_bytes_total"][layer] += delta.bytes_loaded
        if delta.load_seconds:
            self.histograms.add("moescope_expert_fetch_seconds", (str(layer),), list(delta.load_seconds))

    def all_to_all(self, record, now: float) -> None:
        self.histograms.add("moescope_all_to_all_seconds", (record.op,), [record.seconds])
        counters = self.counters
        for peer, (sent, recv, wait) in enumerate(zip(record.sent_bytes, record.recv_bytes, record.peer_wait_s)):
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
            self.rank_window.add(record.layer, record.rank_rows, now)
            since = self.eplb_rows.get(record.layer)
            self.eplb_rows[record.layer] = np.asarray(record.rank_rows, dtype=np.float64) + (
                0.0 if since is None else since)

    def rebalance(self, event) -> None:
        self.counters[("moescope_eplb_rebalances_total", ())] += 1
        self.counters[("moescope_eplb_moved_experts_total", ())] += event.moved
        self.histograms.add("moescope_eplb_rebalance_seconds", (), [event.seconds])
        self.eplb_before, self.eplb_predicted = dict(event.before), dict(event.predicted)
        self.eplb_rows = {}

    # -- the routing probe's summaries ---------------------------------------------------------------------------
    def stats(self, st: StepStats, second: int) -> None:
        """One routing summary: per-layer counters, the window, the draws and the per-step efficiency figures."""
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
        timed = [ls for ls in st.layers if ls.router_s is not None]
        if timed:
            self.histograms.add("moescope_router_seconds", (), [ls.router_s for ls in timed])
            self.histograms.add("moescope_expert_compute_seconds", (), [ls.experts_s for ls in timed])
        if st.draws is not None:
            self._fold(st, st.draws, second)
        if st.experts is not None:
            self._experts(st, st.experts)

    def _experts(self, st: StepStats, x: StepExperts) -> None:
        """The distinct experts each step touched (``x``, ``st``'s), and the bytes and FLOPs that implies
        (moescope.efficiency)."""
        info = self.info
        lc = self.layer_counters
        routed = x.distinct >= 0  # [S, L]
        for j, ls in enumerate(st.layers):
            lc["moescope_expert_distinct_total"][ls.layer] += float(x.distinct[routed[:, j], j].sum())
            lc["moescope_expert_distinct_steps_total"][ls.layer] += float(routed[:, j].sum())
        n_moe, e = max(1, len(info.moe_layers)), info.n_experts
        counters = self.counters
        d_all = np.where(routed, x.distinct, 0).sum(1)  # [S] distinct experts over the routed layers
        for phase in sorted(set(x.phases)):
            mask = np.array([p == phase for p in x.phases])
            d = d_all[mask]
            self.histograms.add("moescope_step_experts_touched_ratio", (phase,), d / (n_moe * e))
            self.histograms.add("moescope_step_activation_ratio", (phase,), [
                efficiency.step_activation(info.dense_params, info.expert_params, int(v), info.total_params)
                for v in d.tolist()])
            if info.dtype_bytes:
                counters[("moescope_step_read_bytes_total", (phase, "weights"))] += sum(
                    efficiency.weight_bytes(info.dtype_bytes, info.dense_params, info.expert_params, int(v))
                    for v in d.tolist())
                if x.context is not None and info.kv_bytes_per_token:
                    counters[("moescope_step_read_bytes_total", (phase, "kv"))] += \
                        float(info.kv_bytes_per_token * x.context[mask].sum())
            if x.attended is not None:
                counters[("moescope_step_flops_total", (phase,))] += sum(
                    efficiency.step_flops(int(r), int(a), info.dense_params, info.expert_params,
                                          len(info.moe_layers), info.top_k, info.attn_flops_per_context)
                    for r, a in zip(x.rows[mask].tolist(), x.attended[mask].tolist()))

    def _fold(self, st: StepStats, d: DrawCounts, second: int) -> None:
        """Per-request counts (``d``, ``st``'s) into the in-flight requests; finished requests and unmapped forwards
        into the window's draws."""
        win = self.routing_window
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
                    done.append(_rows(old, n_layers))
                acc = inflight[key] = np.zeros((n_layers, e), np.int32)
            elif len(acc) < n_layers:
                acc = inflight[key] = _rows(acc, n_layers).astype(np.int32)
            acc[rows] += counts[:, :e].astype(np.int32)
        for rid in d.finished:
            acc = inflight.pop(rid, None)
            if acc is not None:
                done.append(_rows(acc, n_layers))
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

    def forget_inflight(self) -> int:
        """Drop the in-flight requests' partial counts (capture turned back on: their first tokens were not seen,
        so they are no whole draw); returns how many."""
        n = len(self.inflight)
        self.inflight.clear()
        return n

    def run_draws_of(self, layers) -> "sampling.Draws | None":
        """The run's draws for ``layers`` (rows in that order), or None before any draw finished."""
        run = self.run_draws
        if run is None:
            return None
        row = self.routing_window.row
        return run.padded(len(self.routing_window.layers)).rows(np.array([row[layer] for layer in layers]))

    def eplb_gauges(self) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
        """(before, predicted, measured since) max/mean per layer of the last rearrangement; empty without one."""
        if not self.eplb_predicted:
            return {}, {}, {}
        rows = self.eplb_rows
        measured = {layer: float(stats.max_over_mean_rows(rows[layer])) if layer in rows else float("nan")
                    for layer in sorted(self.eplb_predicted)}
        return dict(self.eplb_before), dict(self.eplb_predicted), measured


def _rows(a: np.ndarray, n_layers: int) -> np.ndarray:
    """``a`` padded with zero rows to ``n_layers`` (a layer the window grew after the request began)."""
    if len(a) >= n_layers:
        return a
    return np.vstack([a, np.zeros((n_layers - len(a), a.shape[1]), a.dtype)])


__all__ = ["Counts", "RankWindow", "HELD_EXPERTS"]
