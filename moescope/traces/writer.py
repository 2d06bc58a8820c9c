"""The trace store's writer: the worker-thread half of the trace pipeline (capture -> bounded queue -> writer).

It receives each step's ``StepTrace`` and each finished ``RequestRecord`` from the queue's worker thread and
only notes them; at each ``tick()`` (the queue's tick interval) it packs every step noted since the last tick
in one go (``capture.token_trace.pack``: four copies for the lot), slices every finished request's tokens out
of the steps it took part in, decides whether to keep it (sampling by request, always keeping anomalies and the
requests whose id asks for it, ``store.keep_requested``; the latest ids not kept are remembered, bounded:
``store.note_sampled_out``), and inserts one row per request in a batch, then commits: a crash loses at most the
last interval.

Why at the tick: the writer shares the engine's cores and its GIL, and what it spends is what serving pays
for traces (benchmarks/overhead.py). Work done once per interval for hundreds of steps costs a fraction of
the same work done per step (measured: about 4x less writer CPU per step at tiny-demo, 16 concurrent).
A step's JSON record is still made once, and each request's ``steps`` column joins the records of its steps.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moescope.capture.observer import Observer
from moescope.capture.token_trace import StepTrace, TraceArrays, pack
from moescope.metrics.system import rss_bytes
from moescope.traces import lake, store as store_mod

log = logging.getLogger("moescope.traces")
ALWAYS_KEEP = ("nonfinite", "dropped", "cache_miss", "slow")


@dataclass
class _Step:
    arrays: TraceArrays | None  # [T, L] routing records (ids, weights, entropy, margin, miss) as bytes; None: not
    # packed (no request in it was sampled in, and nothing in it flags one)
    entry: dict  # the step's entry of a request's ``steps`` column (phase, timings, t, rss, peer waits)
    refs: int  # requests still to be sliced out of it
    _json: str | None = None

    @property
    def json(self) -> str:
        if self._json is None:  # made once, for the first request written with this step
            self._json = json.dumps(self.entry)
        return self._json


def _routing(slices) -> dict[str, np.ndarray]:
    """A request's routing, [T, L] per column, from its slices of packed steps, in order."""
    first = slices[0][0].arrays
    rows = first.records(np.concatenate([st.arrays.raw[o:o + n] for st, o, n in slices]))  # [T, L]
    return {name: np.ascontiguousarray(rows[name]) for name in ("ids", "weights", "entropy", "margin", "miss")}


def _routing_flags(slices, arrays) -> list[str]:
    """Flags from a request's routing: non-finite scores, dropped slots, expert-cache misses."""
    if not slices:
        return []
    flags = []
    if all(st.arrays.scored for st, _, _ in slices) and not np.isfinite(arrays["entropy"]).all():
        flags.append("nonfinite")
    if (arrays["ids"] == slices[0][0].arrays.n_experts).any():
        flags.append("dropped")
    if arrays["miss"].any():
        flags.append("cache_miss")
    return flags


def _compact(a: np.ndarray) -> np.ndarray:
    """uint16 when every value fits, else int32 (readers tell the two apart by the blob's length)."""
    return a.astype(np.uint16) if a.size == 0 or (a.min() >= 0 and a.max() < 2**16) else a.astype(np.int32)


class TraceWriter(Observer):
    """Writes requests' routing traces into the SQLite store (see the module docstring). Not thread-safe:
    every hook runs on one worker thread (``QueuedObserver``); the store is opened on the caller's thread so
    that a bad path fails at once."""

    def __init__(self, path: str | Path, *, sample: float = 1.0, max_bytes: int = 256 * 2**20, tracer=None,
                 model: str | None = None, rank: int = 0, seed: int = 0, clock_offset: float | None = None) -> None:
        self.path = Path(path)
        self.run_id = uuid.uuid4().hex[:12]  # step numbers restart per process: (run, index) is unique

        self.lake = None  # a Parquet trace lake (a directory path) instead of the SQLite file
        if lake.is_lake(path):
            self.conn = None
            self.lake = lake.LakeWriter(path, model=model, rank=rank, run_id=self.run_id, max_bytes=max_bytes)
        else:
            self.conn = store_mod.open_store(self.path, create=True)
        self.sample, self.max_bytes = sample, max_bytes
        self.tracer, self.model, self.rank = tracer, model, rank
        self.clock_offset = clock_offset if clock_offset is not None else time.time() - time.perf_counter()
        self.written = self.sampled_out = self.errors = 0
        self.unrouted = 0  # requests stored without routing: some of their forwards were not seen
        self._rng = random.Random(seed)
        self._sampled: dict[str, bool] = {}  # requests in flight: sampled in at their first step (bounded as _live)
        self._steps: dict[int, _Step] = {}
        self._live: dict[str, list[tuple[int, int, int]]] = {}
        self._recent_tpot: deque[float] = deque(maxlen=200)
        self._rows: list[dict[str, Any]] = []
        self._not_kept: list[tuple[str, float, float]] = []  # sampled out since the last tick: (id, end, sample)
        self._not_kept_max = store_mod.sampled_out_max(max_bytes)
        self._pending: list[tuple[StepTrace, int | None]] = []
        self._finished: list = []
        self._rss_value: int | None = None
        self._rss_at = float("-inf")

    # -- hooks (worker thread) -------------------------------------------------------------------------
    # The hooks only note what arrived (a few Python operations each); ``tick()`` does the work for everything
    # noted since the last one: packing the steps in one go (``pack``), then the finished requests' rows.
    def on_step(self, trace: StepTrace) -> None:
        self._pending.append((trace, self._rss(trace.t)))
        offset = 0
        for rid, _, n in trace.step.segments:
            parts = self._live.get(rid)
            if parts is None:  # first sight: sampled now, so that only kept requests' steps are packed
                parts = self._live[rid] = []
                self._sampled[rid] = store_mod.keep_requested(rid) or self._rng.random() < self.sample
            parts.append((trace.step.index, offset, n))
            offset += n

    def on_request(self, rec) -> None:
        self._finished.append(rec)

    def tick(self) -> None:
        """Pack the steps and build the rows of the requests that arrived since the last tick; insert, commit,
        enforce retention."""
        finished, self._finished = self._finished, []
        try:
            self._pack_pending()
        except Exception:  # their requests are stored without routing (counted as unrouted)
            self._failed("packing steps")
        base = statistics.median(self._recent_tpot) if len(self._recent_tpot) >= 20 else None
        for rec in finished:
            time.sleep(0)  # let the engine thread take the GIL between rows (else it can wait up to 5 ms)
            try:
                self._request(rec, base)
            except Exception:
                self._failed("the row of request %r", getattr(rec, "request_id", rec))
        rows, self._rows = self._rows, []
        not_kept, self._not_kept = self._not_kept, []
        if self.lake is not None:  # (a lake keeps no record of the requests it did not keep)
            try:
                self.lake.write(rows)
                self.written += len(rows)
            except Exception:
                self._failed("writing %d rows to the trace lake (lost)", len(rows))
            return
        try:
            by_cols: dict[tuple[str, ...], list] = {}
            for row in rows:
                by_cols.setdefault(tuple(row), []).append(tuple(row.values()))
            for cols, values in by_cols.items():
                self.conn.executemany(f"INSERT OR REPLACE INTO requests ({', '.join(cols)}) "
                                      f"VALUES ({', '.join('?' * len(cols))})", values)
            store_mod.note_sampled_out(self.conn, not_kept, self._not_kept_max)
            self.conn.commit()
            self.written += len(rows)
            store_mod.enforce_retention(self.conn, self.max_bytes)
        except Exception:
            self._failed("writing %d rows (lost)", len(rows))

    def _failed(self, what: str, *args) -> None:
        """Count an error; log the first few with their traceback (a broken sink must not flood the log)."""
        self.errors += 1
        if self.errors <= 3:
            log.exception("trace writer failed on " + what, *args)

    def _pack_pending(self) -> None:
        """Pack the routing of the steps a kept request may need: those with a request sampled in, and those whose
        routing flags a request whatever its sample (non-finite logits, dropped slots, cache misses: a step-level
        check, scalars only). The rest keep their timings only: a request none of whose steps were packed is
        stored, if something else keeps it (slow, truncated), without routing."""
        pending = self._pending
        self._pending = []
        needed = [tr for tr, _ in pending if self._needs_routing(tr)]
        packed = dict(zip((id(tr) for tr in needed), pack(needed)))
        for i, (trace, rss) in enumerate(pending):
            if i % 16 == 15:
                time.sleep(0)  # yield the GIL to the engine now and then (see tick)
            step = trace.step
            a = packed.get(id(trace))
            if a is not None and trace.missed:
                rows = a.records()  # a copy: write the misses back into the batch's bytes
                for j, layer in enumerate(a.layers):
                    if layer in trace.missed:
                        hit = np.isin(rows["ids"][:, j], np.array(trace.missed[layer]))  # [T, k]
                        rows["miss"][:, j] = (hit * (1 << np.arange(hit.shape[1]))).sum(-1).astype(np.uint8)
                a.raw[...] = rows.view(np.uint8).reshape(a.raw.shape)
            times, a2a = trace.layer_seconds, trace.a2a_seconds
            layers = a.layers if a is not None else tuple(layer for layer, _ in trace.decisions)
            entry = {"phase": step.phase, "seconds": step.seconds, "index": step.index, "run": self.run_id,
                     "layer_s": {str(layer): [*times.get(layer, (None, None)), a2a.get(layer)] for layer in layers},
                     "t": round(trace.t, 4), "rss": rss, "kv": getattr(step, "kv_tokens", None)}
            if a is not None and not a.scored:  # no router scores: NaN entropy/margin mean unknown, not non-finite
                entry["scored"] = False
            if trace.peer_wait:
                entry["peer_wait"] = {str(k): [round(w, 6) for w in v] for k, v in trace.peer_wait.items()}
            self._steps[step.index] = _Step(a, entry, len(step.segments))

    def _needs_routing(self, trace: StepTrace) -> bool:
        if any(self._sampled.get(rid, True) for rid, _, _ in trace.step.segments):
            return True
        if trace.missed:
            return True
        # host tensors on CPU (a 0-d read); on CUDA a copy on this (the writer's) thread, never the engine's
        return any(d.scored and int(d.nonfinite) or int(d.dropped) for _, d in trace.decisions)

    def _request(self, rec, base_tpot: float | None) -> None:
        """The row of one finished request (or nothing, when sampled out)."""
        parts = self._live.pop(rec.request_id, [])
        sampled = self._sampled.pop(rec.request_id, None)
        slices = [(self._steps[s], o, n) for s, o, n in parts if s in self._steps]
        for s, _, _ in parts:
            self._release(s)
        packed = [sl for sl in slices if sl[0].arrays is not None]
        whole = bool(slices) and len(packed) == len(slices)
        if whole and sum(n for _, _, n in slices) != store_mod.routed_rows(len(rec.prompt_tokens), rec.n_output,
                                                                          rec.finish_reason):
            # Some of its forwards reached no hook (a step event dropped by the full queue, or a static/CUDA-graph
            # decode step): store the request whole, without a routing that would not line up with its tokens.
            whole = False
            self.unrouted += 1
        arrays = _routing(packed) if packed else None  # (where it was not sampled in: the steps packed for others)
        flags = _routing_flags(packed, arrays) + self._host_flags(rec, base_tpot)
        if sampled is None:  # never seen in a step: sampled now
            sampled = store_mod.keep_requested(rec.request_id) or self._rng.random() < self.sample
        if not (sampled or any(f in ALWAYS_KEEP for f in flags)):
            self.sampled_out += 1
            self._not_kept.append((rec.request_id, rec.arrival + rec.total_s + self.clock_offset, self.sample))
            return
        if not whole:
            slices, arrays = [], None
        row: dict[str, Any] = {
            "request_id": rec.request_id, "started": rec.arrival + self.clock_offset, "model": self.model,
            "rank": self.rank, "domain": rec.domain, "tenant": rec.tenant, "prompt": rec.prompt,
            "output": rec.output, "n_prompt": len(rec.prompt_tokens), "n_output": rec.n_output,
            "queue_s": rec.queue_s, "prefill_s": rec.prefill_s, "ttft_s": rec.ttft_s, "total_s": rec.total_s,
            "finish_reason": rec.finish_reason, "flags": ",".join(flags),
            "trace_id": self._span(rec, flags) if self.tracer is not None else None,
            "tokens": _compact(np.array([*rec.prompt_tokens, *rec.output_tokens])).tobytes(),
            "latencies": np.array(rec.token_latencies_s, dtype=np.float32).tobytes(),
        }
        if arrays is not None:
            first = slices[0][0].arrays
            row.update({
                "n_layers": len(first.layers), "top_k": arrays["ids"].shape[2], "n_experts": first.n_experts,
                "layers": json.dumps(list(first.layers)), **{k: v.tobytes() for k, v in arrays.items()},
                "step": _compact(np.repeat(np.arange(len(slices)), [n for _, _, n in slices])).tobytes(),
                "steps": "[" + ",".join(st.json for st, _, _ in slices) + "]"})
        self._rows.append(row)

    def _host_flags(self, rec, base_tpot: float | None) -> list[str]:
        """Flags from the request's timings and prompt: slow (an output token over 3x the recent median time per
        output token), truncated."""
        flags = []
        tpot = rec.token_latencies_s[1:]
        if tpot and base_tpot is not None and max(tpot) > 3 * base_tpot:
            flags.append("slow")
        self._recent_tpot.extend(tpot)
        if rec.truncated_prompt:
            flags.append("truncated")
        return flags

    def shutdown(self) -> None:
        self.tick()
        if self.lake is not None:
            self.lake.close()
        else:
            self.conn.close()

    # -- helpers ---------------------------------------------------------------------------------------
    def _rss(self, now: float) -> int | None:
        """Resident memory, read at most every 100 ms; steps in between carry the latest reading."""
        if now - self._rss_at >= 0.1:
            self._rss_value, self._rss_at = rss_bytes(), now
        return self._rss_value

    def _release(self, step_index: int) -> None:
        st = self._steps.get(step_index)
        if st is not None:
            st.refs -= 1
            if st.refs <= 0:
                del self._steps[step_index]

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
        from opentelemetry import trace  # optional: opentelemetry (the otel extra)

        root = self.tracer.start_span("moescope.request", start_time=ns(rec.arrival), attributes=attrs)
        ctx = trace.set_span_in_context(root)
        for name, a, b in (("queue", rec.arrival, admitted), ("prefill", admitted, first), ("decode", first, end)):
            self.tracer.start_span(f"moescope.{name}", context=ctx, start_time=ns(a)).end(end_time=ns(b))
        root.end(end_time=ns(end))
        return format(root.get_span_context().trace_id, "032x")
