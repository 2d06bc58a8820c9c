"""Records per-token traces into the trace store without ever blocking the engine.

Engine thread (``TraceRecorder`` hooks): keep references to the step's routing decisions, cache misses and
all-to-all times; at ``on_step`` put one item on a bounded queue (``put_nowait``: when full, the item is
dropped and counted in ``dropped``, exported as ``moescope_capture_dropped_total{queue="traces"}``).

Writer thread: packs each step into arrays, slices every request's tokens out of the steps it took part in,
and when the request finishes decides whether to keep it (sampling by request, always keeping anomalies),
writes one row, and commits every ``flush_interval_s``. A crash loses at most the last interval.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moescope.capture.observer import Observer
from moescope.metrics.system import rss_bytes
from moescope.traces import store as store_mod

log = logging.getLogger("moescope.traces")
_STOP = object()
ALWAYS_KEEP = ("nonfinite", "dropped", "cache_miss", "slow")


@dataclass
class _Step:
    index: int  # the engine's step number (with the recorder's run id: a global step id)
    phase: str
    seconds: float
    layers: tuple[int, ...]
    ids: np.ndarray  # [T, L, k] int16
    weights: np.ndarray  # [T, L, k] float16
    entropy: np.ndarray  # [T, L] float16
    margin: np.ndarray
    miss: np.ndarray  # [T, L] uint8 bitmask over k
    layer_s: dict[str, list]
    n_experts: int
    refs: int
    extra: dict  # t (unix time), rss (bytes), peer_wait ({layer: seconds per peer}) where known


def _compact(a: np.ndarray) -> np.ndarray:
    """uint16 when every value fits, else int32 (readers tell the two apart by the blob's length)."""
    return a.astype(np.uint16) if a.size == 0 or (a.min() >= 0 and a.max() < 2**16) else a.astype(np.int32)


class TraceRecorder(Observer):
    """Attach with ``moescope.instrument(model, observers=[TraceRecorder(path)])``.

    Args:
        path: SQLite file (created if missing).
        sample: share of ordinary requests kept (flagged ones are always kept).
        max_bytes: retention: the store is trimmed (oldest first) past this size.
        queue_size: bounded queue between the engine and the writer.
        flush_interval_s: commit interval (what a crash can lose).
        tracer: an OpenTelemetry tracer; when given, one span per request (phases as children) and the
            trace id stored with the request.
        model, rank: stored with each request.
    """

    def __init__(self, path: str | Path, *, sample: float = 1.0, max_bytes: int = 256 * 2**20,
                 queue_size: int = 4096, flush_interval_s: float = 0.5, tracer=None, model: str | None = None,
                 rank: int = 0, seed: int = 0, clock_offset: float | None = None) -> None:
        self.path = Path(path)
        self.name = "traces"
        self.run_id = uuid.uuid4().hex[:12]  # step numbers restart per process: (run, index) is unique
        self.conn = store_mod.open_store(self.path, create=True)  # fail fast, on the caller's thread
        self.sample, self.max_bytes, self.flush_interval_s = sample, max_bytes, flush_interval_s
        self.tracer, self.model, self.rank = tracer, model, rank
        self.clock_offset = clock_offset if clock_offset is not None else time.time() - time.perf_counter()
        self.dropped = self.written = self.sampled_out = self.errors = 0
        self.unrouted = 0  # requests stored without routing: some of their forwards were not seen
        self._rng = random.Random(seed)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._pending: list = []
        self._times: dict[int, tuple[float, float]] = {}
        self._missed: dict[int, tuple[int, ...]] = {}
        self._a2a: dict[int, float] = {}
        self._peer_wait: dict[int, list[float]] = {}
        self._rss_value: int | None = None
        self._rss_at = float("-inf")
        # writer-thread state
        self._steps: dict[int, _Step] = {}
        self._live: dict[str, list[tuple[int, int, int]]] = {}
        self._recent_tpot: deque[float] = deque(maxlen=200)
        self._thread = threading.Thread(target=self._loop, name="moescope-traces", daemon=True)
        self._thread.start()

    # -- engine thread ---------------------------------------------------------------------------------
    def on_routing(self, layer, decision) -> None:
        self._pending.append((layer, decision))

    def on_layer_time(self, layer, router_s, experts_s) -> None:
        self._times[layer] = (router_s, experts_s)

    def on_cache(self, layer, delta) -> None:
        if delta.missed:
            self._missed[layer] = self._missed.get(layer, ()) + tuple(delta.missed)

    def on_all_to_all(self, record) -> None:
        self._a2a[record.layer] = self._a2a.get(record.layer, 0.0) + record.seconds
        if any(record.peer_wait_s):
            waits = self._peer_wait.setdefault(record.layer, [0.0] * len(record.peer_wait_s))
            for i, w in enumerate(record.peer_wait_s):
                waits[i] += w

    def _put(self, item) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1

    def on_step(self, step) -> None:
        pending, self._pending = self._pending, []
        times, self._times = self._times, {}
        missed, self._missed = self._missed, {}
        a2a, self._a2a = self._a2a, {}
        waits, self._peer_wait = self._peer_wait, {}
        if pending:
            self._put(("step", step, pending, times, missed, a2a, waits, time.time()))

    def on_request(self, record) -> None:
        self._put(("request", record))

    def shutdown(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=30)

    # -- writer thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        last_commit = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=self.flush_interval_s)
            except queue.Empty:
                item = None
            if item is _STOP:
                self._commit()
                self.conn.close()
                return
            if item is not None:
                try:
                    if item[0] == "step":
                        self._on_step(*item[1:])
                    else:
                        self._on_request(item[1])
                except Exception:
                    self.errors += 1
                    if self.errors == 1:
                        log.exception("trace writer failed on an item (counted; later errors not logged)")
            if time.monotonic() - last_commit >= self.flush_interval_s:
                self._commit()
                last_commit = time.monotonic()

    def _commit(self) -> None:
        try:
            self.conn.commit()
            store_mod.enforce_retention(self.conn, self.max_bytes)
        except Exception:
            self.errors += 1
            log.exception("trace store commit failed")

    def _on_step(self, step, pending, times, missed, a2a, waits, t) -> None:
        decs = [d for _, d in pending]
        layers = tuple(layer for layer, _ in pending)
        if len({d.ids.shape for d in decs}) != 1:
            return
        n_exp = decs[0].n_experts
        ids = np.stack([d.active_ids.cpu().numpy() for d in decs], axis=1)  # [T, L, k]
        miss = np.zeros(ids.shape[:2], dtype=np.uint8)
        for j, layer in enumerate(layers):
            if layer in missed:
                hit = np.isin(ids[:, j], np.array(missed[layer]))  # [T, k]
                miss[:, j] = (hit * (1 << np.arange(ids.shape[2]))).sum(-1).astype(np.uint8)
        layer_s = {str(layer): [times.get(layer, (None, None))[0], times.get(layer, (None, None))[1],
                                a2a.get(layer)] for layer in layers}
        self._steps[step.index] = _Step(
            index=step.index, phase=step.phase, seconds=step.seconds, layers=layers, ids=ids.astype(np.int16),
            weights=np.stack([d.weights.detach().cpu().numpy() for d in decs], axis=1).astype(np.float16),
            entropy=np.stack([d.entropy.cpu().numpy() for d in decs], axis=1).astype(np.float16),
            margin=np.stack([d.margin.cpu().numpy() for d in decs], axis=1).astype(np.float16),
            miss=miss, layer_s=layer_s, n_experts=n_exp, refs=len(step.segments),
            extra={"t": round(t, 4), "rss": self._rss(t),
                   **({"peer_wait": {str(k): [round(w, 6) for w in v] for k, v in waits.items()}} if waits else {})})
        offset = 0
        for rid, _, n in step.segments:
            self._live.setdefault(rid, []).append((step.index, offset, n))
            offset += n

    def _rss(self, now: float) -> int | None:
        """Resident memory, read at most every 100 ms (a /proc read per step would take GIL time from the
        engine thread); steps in between carry the latest reading."""
        if now - self._rss_at >= 0.1:
            self._rss_value, self._rss_at = rss_bytes(), now
        return self._rss_value

    def _release(self, step_index: int) -> None:
        st = self._steps.get(step_index)
        if st is not None:
            st.refs -= 1
            if st.refs <= 0:
                del self._steps[step_index]

    def _on_request(self, rec) -> None:
        parts = self._live.pop(rec.request_id, [])
        slices = [(self._steps[s], o, n, s) for s, o, n in parts if s in self._steps]
        if slices and sum(n for _, _, n, _ in slices) != len(rec.prompt_tokens) + max(0, rec.n_output - 1):
            # Some of its forwards reached no hook (a step event dropped by the full queue, or a static/CUDA-graph
            # decode step): store the request whole, without a routing that would not line up with its tokens.
            for _, _, _, s in slices:
                self._release(s)
            slices = []
            self.unrouted += 1
        flags = []
        if slices:
            ids = np.concatenate([st.ids[o:o + n] for st, o, n, _ in slices])
            ent = np.concatenate([st.entropy[o:o + n] for st, o, n, _ in slices])
            miss = np.concatenate([st.miss[o:o + n] for st, o, n, _ in slices])
            n_exp = slices[0][0].n_experts
            if not np.isfinite(ent.astype(np.float32)).all():
                flags.append("nonfinite")
            if (ids == n_exp).any():
                flags.append("dropped")
            if miss.any():
                flags.append("cache_miss")
        tpot = rec.token_latencies_s[1:]
        if tpot and len(self._recent_tpot) >= 20:
            median = float(np.median(self._recent_tpot))
            if max(tpot) > 3 * median:
                flags.append("slow")
        self._recent_tpot.extend(tpot)
        if rec.truncated_prompt:
            flags.append("truncated")
        keep = any(f in ALWAYS_KEEP for f in flags) or self._rng.random() < self.sample
        for _, _, _, s in slices:
            self._release(s)
        if not keep:
            self.sampled_out += 1
            return
        trace_id = self._span(rec, flags) if self.tracer is not None else None
        started = rec.arrival + self.clock_offset
        row: dict[str, Any] = {
            "request_id": rec.request_id, "started": started, "model": self.model, "rank": self.rank,
            "domain": rec.domain, "tenant": rec.tenant, "prompt": rec.prompt, "output": rec.output,
            "n_prompt": len(rec.prompt_tokens), "n_output": rec.n_output, "queue_s": rec.queue_s,
            "prefill_s": rec.prefill_s, "ttft_s": rec.ttft_s, "total_s": rec.total_s,
            "finish_reason": rec.finish_reason, "flags": ",".join(flags), "trace_id": trace_id,
            "tokens": _compact(np.array([*rec.prompt_tokens, *rec.output_tokens])).tobytes(),
            "latencies": np.array(rec.token_latencies_s, dtype=np.float32).tobytes(),
        }
        if slices:
            first = slices[0][0]
            step_list = [{"phase": st.phase, "seconds": st.seconds, "layer_s": st.layer_s, "index": st.index,
                          "run": self.run_id, **st.extra} for st, *_ in slices]
            row.update({
                "n_layers": len(first.layers), "top_k": first.ids.shape[2], "n_experts": first.n_experts,
                "layers": json.dumps(list(first.layers)),
                "ids": ids.tobytes(),
                "weights": np.concatenate([st.weights[o:o + n] for st, o, n, _ in slices]).tobytes(),
                "entropy": ent.tobytes(),
                "margin": np.concatenate([st.margin[o:o + n] for st, o, n, _ in slices]).tobytes(),
                "miss": miss.tobytes(),
                "step": _compact(np.concatenate([np.full(n, i) for i, (_, _, n, _) in enumerate(slices)])
                                 ).tobytes(),
                "steps": json.dumps(step_list)})
        cols = ", ".join(row)
        self.conn.execute(f"INSERT OR REPLACE INTO requests ({cols}) VALUES ({', '.join('?' * len(row))})",
                          list(row.values()))
        self.written += 1

    def _span(self, rec, flags) -> str:
        """One span per request, phases as children, with the request's real timings (ns)."""
        off = self.clock_offset
        ns = lambda t: int((t + off) * 1e9)  # noqa: E731
        admitted = rec.arrival + rec.queue_s
        first = rec.arrival + rec.ttft_s
        end = rec.arrival + rec.total_s
        attrs = {"moescope.request_id": rec.request_id, "moescope.prompt_tokens": len(rec.prompt_tokens),
                 "moescope.output_tokens": rec.n_output, "moescope.ttft_s": rec.ttft_s,
                 "moescope.total_s": rec.total_s, "moescope.flags": ",".join(flags),
                 "moescope.finish_reason": rec.finish_reason, "moescope.model": self.model or "",
                 "moescope.rank": self.rank}
        from opentelemetry import trace

        root = self.tracer.start_span("moescope.request", start_time=ns(rec.arrival), attributes=attrs)
        ctx = trace.set_span_in_context(root)
        for name, a, b in (("queue", rec.arrival, admitted), ("prefill", admitted, first), ("decode", first, end)):
            self.tracer.start_span(f"moescope.{name}", context=ctx, start_time=ns(a)).end(end_time=ns(b))
        root.end(end_time=ns(end))
        return format(root.get_span_context().trace_id, "032x")
