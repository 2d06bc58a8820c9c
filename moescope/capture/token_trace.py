"""Per-token routing capture, the engine-thread half of the trace pipeline (capture -> bounded queue -> writer).

Hot path: the hooks keep references (routing decisions, layer times, cache misses, all-to-all times); at
``on_step`` the step's references go to the listener as one ``StepTrace``: O(layers) appends and one call
on the engine thread, no copy, no packing. The listener is a bounded queue (``capture.queued``) whose
worker packs steps into compact host arrays (``pack()``, many steps at once) off the engine thread. Routing
decisions are immutable after their forward, so reading them later is safe.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from moescope.capture.observer import RuntimeObserver

if TYPE_CHECKING:  # typing only: the seam imports no engine
    from moescope.capture.decision import RoutingDecision
    from moescope.capture.records import StepRecord
    from moescope.parallel.expert_parallel import AllToAllRecord
    from moescope.runtime.expert_cache import CacheDelta


def row_dtype(top_k: int, n_experts: int) -> np.dtype:
    """One (token, layer)'s routing as one record: the trace store's columns, interleaved, so that slicing a
    request's tokens out of a step is one slice, not one per column."""
    return np.dtype([("ids", np.int16 if n_experts < 2**15 else np.int32, (top_k,)),  # dropped slots hold E
                     ("weights", np.float16, (top_k,)), ("entropy", np.float16), ("margin", np.float16),
                     ("miss", np.uint8)])  # bitmask over the k slots: expert-cache misses (the writer fills it)


@dataclass(frozen=True)
class TraceArrays:
    """One step's routing, token-major (the trace store's layout): ``raw[t, l]`` holds the bytes of one
    ``row_dtype`` record, and ``records()`` reads them as records."""

    layers: tuple[int, ...]
    raw: np.ndarray  # [T, L, itemsize] uint8, a view into the batch's buffer (concatenates at C speed)
    dtype: np.dtype  # row_dtype(k, n_experts)
    n_experts: int
    scored: bool = True  # entropy and margin come from the router's scores (False: NaN meaning unknown)

    def records(self, raw: np.ndarray | None = None) -> np.ndarray:
        """``raw`` (this step's, or a concatenation of such slices) as [T, L] records (a copy when strided)."""
        raw = self.raw if raw is None else raw
        return np.ascontiguousarray(raw).reshape(raw.shape[0], -1).view(self.dtype)


@dataclass(frozen=True)
class StepTrace:
    """Everything one engine step routed, by reference (``pack()`` packs steps)."""

    step: "StepRecord"  # phase, timings, and segments mapping tokens to requests
    decisions: tuple[tuple[int, "RoutingDecision"], ...]
    layer_seconds: dict[int, tuple[float, float]]  # layer -> (router_s, experts_s)
    missed: dict[int, tuple[int, ...]]  # layer -> experts that missed the expert cache in this step
    a2a_seconds: dict[int, float]  # layer -> all-to-all seconds (expert parallelism)
    peer_wait: dict[int, list[float]]  # layer -> seconds this rank waited on each peer
    t: float  # unix time at the step's end


def pack(traces: Sequence[StepTrace]) -> list[TraceArrays | None]:
    """Pack many steps' routing into host arrays at once (``None`` for a step whose layers disagree in shape).

    Per quantity, one ``torch.cat`` over every (step, layer) tensor of the steps that share a shape (top-k and
    expert count) into one record array, and each step is a view ``[T, L]`` of it: a few copies per batch of
    steps, however many steps and layers, which is what keeps the writer's share of the cores small. The
    device->host copy happens here, on the caller's thread (the writer's), never the engine's."""
    import torch  # start-up: torch, only when pack() runs

    out: list[TraceArrays | None] = [None] * len(traces)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, tr in enumerate(traces):
        shapes = {tuple(d.ids.shape) for _, d in tr.decisions}
        if len(shapes) == 1:
            k = next(iter(shapes))[1]
            groups.setdefault((k, tr.decisions[0][1].n_experts), []).append(i)
    for (k, n_exp), idx in groups.items():
        decs = [d for i in idx for _, d in traces[i].decisions]

        dtype = row_dtype(k, n_exp)
        rows = np.zeros(sum(d.ids.shape[0] for d in decs), dtype=dtype)  # [sum L*T], step- then layer-major
        for name in ("ids", "weights", "entropy", "margin"):
            src = "active_ids" if name == "ids" else name
            # The one device->host copy per quantity for a whole batch of steps, on the writer's thread (its
            # tick): never on the engine's, never per token or per step.
            rows[name] = torch.cat([getattr(d, src) for d in decs]).detach().cpu().numpy()
        raw = rows.view(np.uint8).reshape(len(rows), dtype.itemsize)
        off = 0
        for i in idx:
            tr = traces[i]
            n_layers, n_tok = len(tr.decisions), tr.decisions[0][1].ids.shape[0]
            out[i] = TraceArrays(layers=tuple(layer for layer, _ in tr.decisions), dtype=dtype, n_experts=n_exp,
                                 raw=raw[off:off + n_layers * n_tok].reshape(n_layers, n_tok, -1).transpose(1, 0, 2),
                                 scored=all(d.scored for _, d in tr.decisions))
            off += n_layers * n_tok
    return out


class TokenTraceCapture(RuntimeObserver):
    """Collects each step's routing by reference and hands it on as a ``StepTrace``; ``listener`` must not
    block (a ``QueuedObserver.on_step``)."""

    def __init__(self, listener: Callable[[StepTrace], None]) -> None:
        self._listener = listener
        self._pending: list[tuple[int, "RoutingDecision"]] = []
        self._times: dict[int, tuple[float, float]] = {}
        self._missed: dict[int, tuple[int, ...]] = {}
        self._a2a: dict[int, float] = {}
        self._peer_wait: dict[int, list[float]] = {}
        self._resync = False
        self._layers_per_step = 0  # decisions of the fullest step seen (a forward's MoE layers)

    def on_routing(self, layer: int, decision: "RoutingDecision") -> None:
        self._pending.append((layer, decision))

    def on_layer_time(self, layer: int, router_s: float, experts_s: float) -> None:
        self._times[layer] = (router_s, experts_s)

    def on_cache(self, layer: int, delta: "CacheDelta") -> None:
        if delta.missed:
            self._missed[layer] = self._missed.get(layer, ()) + tuple(delta.missed)

    def on_all_to_all(self, record: "AllToAllRecord") -> None:
        self._a2a[record.layer] = self._a2a.get(record.layer, 0.0) + record.seconds
        if any(record.peer_wait_s):
            waits = self._peer_wait.setdefault(record.layer, [0.0] * len(record.peer_wait_s))
            for i, w in enumerate(record.peer_wait_s):
                waits[i] += w

    def resync(self) -> None:
        """Capture turned back on: the next step may have begun while it was off; if so, it is not traced."""
        self._resync = True

    def on_step(self, step: "StepRecord") -> None:
        if self._resync:  # capture turned back on: a step with fewer layers than a whole forward began while off
            self._resync = False
            if len(self._pending) < self._layers_per_step:
                self._pending, self._times, self._missed, self._a2a, self._peer_wait = [], {}, {}, {}, {}
                return
        self._layers_per_step = max(self._layers_per_step, len(self._pending))
        if not self._pending:  # a step no hook saw (static/graph decode): nothing to trace
            return
        trace = StepTrace(step, tuple(self._pending), self._times, self._missed, self._a2a, self._peer_wait,
                          time.time())
        self._pending, self._times, self._missed, self._a2a, self._peer_wait = [], {}, {}, {}, {}
        self._listener(trace)
