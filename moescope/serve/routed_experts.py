"""Routing through the API, as SGLang serves it (docs/serve.md, "Routing through the API").

- ``RoutedExperts``: ``"return_routed_experts": true`` in a body returns the request's expert ids per routed
  position and MoE layer, SGLang's layout: base64 of int32 ``[seqlen - 1, layers, top_k]`` (the prompt, then
  every generated token fed back: the trace store's rows, ``n_experts`` marking a dropped slot) in the
  choice's ``sgl_ext.routed_experts``; ``routed_experts_start_len`` returns rows from there on. An observer
  that, only while some request asked, keeps references to each step's routing decisions (decisions are
  immutable after their forward) and, per asking request, which rows are its: the engine thread copies
  nothing. The event loop packs them (the device->host copy happens there) when the request ends.
- ``DistributionRecorder``: ``/start_expert_distribution_record``, ``/stop_expert_distribution_record``,
  ``/dump_expert_distribution_record``. It reads the exporter's own cumulative per-(layer, expert) slot
  counters (``MetricsObserver.expert_tokens``, what ``moescope_expert_tokens_total`` serves) at start and at
  stop, after flushing the routing probe's finished steps, and dumps the difference as SGLang's recorder does
  in ``stat`` mode: ``torch.save({"rank": 0, "logical_count": int64 [layers, experts]})`` to
  ``expert_distribution_recorder_<unix time>.pt`` in ``$SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR`` (default
  /tmp), a row per model layer (dense layers zero), which ``plan-placement --import`` and ``cache-sim
  --import`` read.
"""

from __future__ import annotations

import base64
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from moescope.capture.observer import FanOut, Observer
from moescope.serve.openai_errors import APIError

DUMP_DIR_ENV = "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"


def wanted(body: dict) -> int | None:
    """``routed_experts_start_len`` when the body asks for routed experts (0 by default), else None.
    Raises APIError on a wrong type."""
    want = body.get("return_routed_experts")
    if want is None or want is False:
        return None
    if want is not True:
        raise APIError(400, "return_routed_experts must be a boolean", param="return_routed_experts",
                       code="invalid_type")
    start = body.get("routed_experts_start_len", 0)
    if type(start) is not int or start < 0:
        raise APIError(400, "routed_experts_start_len must be a non-negative integer",
                       param="routed_experts_start_len", code="invalid_value")
    return start


class RoutedExperts(Observer):
    """Per-request routing for the requests that asked (``watch``), handed over at their end (``take``)."""

    def __init__(self) -> None:
        self._watch: set[str] = set()
        self._lock = threading.Lock()  # watch/forget (event loop) against a request's end (engine thread)
        self._pending: list[tuple[int, Any]] = []
        self._rows: dict[str, list[tuple[tuple, int, int]]] = {}  # rid -> [(step's decisions, first row, n)]
        self._done: dict[str, list[tuple[tuple, int, int]]] = {}

    @classmethod
    def attach(cls, engine) -> "RoutedExperts":
        """Add a recorder to ``engine``'s observers (before its thread starts)."""
        rec = cls()
        engine.observer = engine.model.observer = FanOut([engine.observer, rec])
        return rec

    # -- event loop ----------------------------------------------------------------------------------------
    def watch(self, rid: str) -> None:
        with self._lock:
            self._watch.add(rid)

    def forget(self, rid: str) -> None:
        with self._lock:
            self._watch.discard(rid)
            self._done.pop(rid, None)
        self._rows.pop(rid, None)  # a request that never ended in the engine (a failed step)

    def take(self, rid: str, start: int = 0) -> dict | None:
        """The ended request's ``sgl_ext`` (None if it was not watched or made no step)."""
        with self._lock:
            rows = self._done.pop(rid, None)
            self._watch.discard(rid)
        if not rows:
            return None
        ids = pack(rows)[start:]
        return {"routed_experts": base64.b64encode(ids.astype("<i4").tobytes()).decode(),
                "routed_experts_shape": list(ids.shape), "routed_experts_start_len": start,
                "routed_experts_layers": [layer for layer, _ in rows[0][0]]}

    # -- engine thread --------------------------------------------------------------------------------------
    def on_routing(self, layer: int, decision) -> None:
        if self._watch:
            self._pending.append((layer, decision))

    def on_step(self, step) -> None:
        if not self._pending:
            return
        decisions, self._pending = tuple(self._pending), []
        row = 0
        for rid, _, n in getattr(step, "segments", ()) or ():
            if rid in self._watch:
                self._rows.setdefault(rid, []).append((decisions, row, n))
            row += n

    def on_request(self, record) -> None:
        rows = self._rows.pop(record.request_id, None)
        if rows is not None:
            with self._lock:
                if record.request_id in self._watch:
                    self._done[record.request_id] = rows


def pack(rows: list[tuple[tuple, int, int]]) -> np.ndarray:
    """[positions, layers, k] expert ids (the decisions' ``active_ids``: dropped slots hold ``n_experts``)."""
    import torch  # start-up: torch, only when pack() runs

    per_step = [torch.stack([d.active_ids[first:first + n] for _, d in decisions], 1)
                for decisions, first, n in rows]
    return torch.cat(per_step).cpu().numpy()


class DistributionRecorder:
    """SGLang's expert-distribution recording over a window, from the exporter's counters."""

    def __init__(self, state, n_layers: int) -> None:
        self.state, self.n_layers = state, n_layers  # state: the MetricsObserver
        self._start: dict[int, np.ndarray] | None = None
        self._window: tuple[dict[int, np.ndarray], float, float] | None = None
        self._started_at = 0.0
        self.lock = threading.Lock()  # start, stop and dump, each whole (they run on worker threads)

    def _counts(self) -> dict[int, np.ndarray]:
        self.state.flush()  # the probe's finished steps: the same counts the next scrape would serve
        with self.state.lock:
            return {layer: c.copy() for layer, c in self.state.expert_tokens.items()}

    def start(self) -> None:
        with self.lock:
            self._start, self._started_at, self._window = self._counts(), time.time(), None

    def _diff(self) -> dict[int, np.ndarray]:
        end, n_exp = self._counts(), self.state.info.n_experts
        return {layer: c - self._start.get(layer, np.zeros(n_exp, c.dtype)) for layer, c in end.items()}

    def stop(self) -> None:
        with self.lock:
            self._stop()

    def _stop(self) -> None:
        if self._start is None:
            raise APIError(400, "no expert distribution record is running (POST /start_expert_distribution_record)",
                           code="not_recording")
        self._window, self._start = (self._diff(), self._started_at, time.time()), None

    def dump(self) -> dict:
        with self.lock:
            return self._dump()

    def _dump(self) -> dict:
        import torch  # start-up: torch, only when _dump() runs

        if self._start is not None:  # still recording: SGLang dumps what was recorded so far
            self._window = (self._diff(), self._started_at, time.time())
        if self._window is None:
            raise APIError(400, "nothing recorded: POST /start_expert_distribution_record, then "
                           "/stop_expert_distribution_record", code="not_recorded")
        diff, started, stopped = self._window
        counts = np.zeros((self.n_layers, self.state.info.n_experts), np.int64)
        for layer, c in diff.items():
            counts[layer] = c
        out = Path(os.environ.get(DUMP_DIR_ENV, "/tmp"))
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"expert_distribution_recorder_{time.time()}.pt"
        torch.save({"rank": 0, "logical_count": torch.from_numpy(counts)}, path)
        return {"message": "Expert distribution record dumped", "path": str(path), "started": started,
                "stopped": stopped, "layers": sorted(diff), "slots": int(counts.sum())}


def metrics_state(engine):
    """The engine's ``MetricsObserver`` (the exporter's state), or None."""
    # start-up: torch (metrics.state), only when metrics_state() runs
    from moescope.metrics.state import MetricsObserver

    stack = [engine.observer]
    while stack:
        o = stack.pop()
        if isinstance(o, MetricsObserver):
            return o
        stack += list(getattr(o, "observers", ()))
    return None
