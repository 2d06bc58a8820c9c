"""The routing probe: statistics of every MoE layer, from the routing decisions, summarised per interval.

``on_routing`` only keeps a reference to the decision and ``on_step`` only checks the clock: no work on the
hot path. Every ``interval_s`` (and at ``flush()``) the pending decisions of all steps since the last flush
are summarised at once, per layer:
- on CUDA, in batched device ops (one ``scatter_add_`` for all slots), then one device->host copy;
- on CPU the tensors already live in host memory, so numpy reads them in place (no torch dispatch
  overhead).
The listener (the metrics state, tests) gets one ``StepStats`` per flush covering those steps.
Decisions are immutable after their forward, so holding references until the flush is safe; at most
``max_pending`` steps are held.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from moescope.capture.observer import Observer

if TYPE_CHECKING:
    from moescope.runtime.router import RoutingDecision


@dataclass(frozen=True)
class LayerStats:
    """One MoE layer in one step."""

    layer: int
    tokens: int  # tokens routed
    slots: np.ndarray  # [E] int64 computed slots per expert (dropped slots excluded)
    dropped: int
    nonfinite: int
    entropy_sum: float
    margin_sum: float
    router_s: float | None = None
    experts_s: float | None = None
    rerouted: dict | None = None  # mitigation ("load", "smoothing") -> slots it changed, when one is on


@dataclass(frozen=True)
class StepStats:
    """The routing of the steps since the previous flush, per layer (timings: the latest step's)."""

    steps: int
    layers: tuple[LayerStats, ...]
    n_experts: int
    top_k: int


REROUTE_REASONS = ("load", "smoothing")


def _rerouted(d) -> torch.Tensor:
    """[2] int64 on the decision's device: slots changed by each mitigation (zeros when off)."""
    r = d.rerouted or {}
    zero = torch.zeros((), dtype=torch.int64, device=d.ids.device)
    return torch.stack([r.get(name, zero) for name in REROUTE_REASONS])


class RoutingProbe(Observer):
    """Turns routing decisions into ``StepStats``, once per ``interval_s`` (0: every step)."""

    def __init__(self, listener: Callable[[StepStats], None], *, interval_s: float = 0.25,
                 max_pending: int = 512, clock: Callable[[], float] = time.monotonic) -> None:
        self._listener = listener
        self.interval_s, self.max_pending, self._clock = interval_s, max_pending, clock
        self._pending: list[tuple[int, "RoutingDecision"]] = []
        self._times: dict[int, tuple[float, float]] = {}
        self._steps = 0
        self._last_flush = clock()
        # flush() may run on a scrape thread: the lock guards only the list swap (microseconds), never the
        # summarising, so the engine thread waits on nothing but that swap.
        self._lock = threading.Lock()

    def on_routing(self, layer: int, decision: "RoutingDecision") -> None:
        with self._lock:
            self._pending.append((layer, decision))

    def on_layer_time(self, layer: int, router_s: float, experts_s: float) -> None:
        with self._lock:
            self._times[layer] = (router_s, experts_s)

    def on_step(self, step: Any) -> None:
        self._steps += 1
        if self._steps >= self.max_pending or self._clock() - self._last_flush >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            times, self._times = self._times, {}
            steps, self._steps = self._steps, 0
            self._last_flush = self._clock()
        if pending:
            self._listener(self.summarise(pending, times, steps))

    def summarise(self, pending, times, steps: int = 1) -> StepStats:
        first = pending[0][1]
        n_exp, k = first.n_experts, first.ids.shape[1]
        by_layer: dict[int, list["RoutingDecision"]] = {}
        for layer, d in pending:
            by_layer.setdefault(layer, []).append(d)
        rows = self._host(by_layer, n_exp) if first.ids.device.type == "cpu" else self._device(by_layer, n_exp)
        layers = []
        for (layer, decs), row in zip(by_layer.items(), rows):
            r_s, e_s = times.get(layer, (None, None))
            rerouted = None
            if decs[0].rerouted is not None:
                rerouted = {name: int(row[n_exp + 5 + i]) for i, name in enumerate(REROUTE_REASONS)
                            if name in decs[0].rerouted}
            layers.append(LayerStats(layer=layer, tokens=sum(d.ids.shape[0] for d in decs),
                                     slots=row[:n_exp].astype(np.int64), dropped=int(row[n_exp + 4]),
                                     nonfinite=int(row[n_exp + 3]), entropy_sum=float(row[n_exp + 1]),
                                     margin_sum=float(row[n_exp + 2]), router_s=r_s, experts_s=e_s,
                                     rerouted=rerouted))
        return StepStats(steps=steps, layers=tuple(layers), n_experts=n_exp, top_k=k)

    @staticmethod
    def _host(by_layer, n_exp: int) -> np.ndarray:
        """[L, E + 7] float64: slots per expert + dropped bucket, entropy sum, margin sum, non-finite, dropped,
        slots rerouted by load-aware routing, by smoothing.
        CPU tensors only: ``.numpy()`` views the same memory (no copy, no sync). One concatenation per layer
        and quantity (cheaper than a numpy view per decision when an interval holds many steps)."""
        rows = np.empty((len(by_layer), n_exp + 7))
        for i, decs in enumerate(by_layer.values()):
            rows[i, : n_exp + 1] = np.bincount(torch.cat([d.active_ids.reshape(-1) for d in decs]).numpy(),
                                               minlength=n_exp + 1)
            rows[i, n_exp + 1] = torch.cat([d.entropy for d in decs]).numpy().sum(dtype=np.float64)
            rows[i, n_exp + 2] = torch.cat([d.margin for d in decs]).numpy().sum(dtype=np.float64)
            rows[i, n_exp + 3] = torch.stack([d.nonfinite for d in decs]).numpy().sum()
            rows[i, n_exp + 4] = torch.stack([d.dropped for d in decs]).numpy().sum()
            # only while a mitigation is on; CPU tensors here (.numpy() is a view, not a device sync)
            if decs[0].rerouted is not None:
                rows[i, n_exp + 5:] = torch.stack([_rerouted(d) for d in decs]).numpy().sum(0)
            else:
                rows[i, n_exp + 5:] = 0
        return rows

    @staticmethod
    def _device(by_layer, n_exp: int) -> np.ndarray:
        """Same layout as ``_host``, computed with batched device ops and one device->host copy."""
        width = n_exp + 1
        ids, scalars = [], []
        for i, decs in enumerate(by_layer.values()):
            for d in decs:
                ids.append(d.active_ids.reshape(-1) + i * width)
            scalars.append(torch.stack([torch.cat([d.entropy for d in decs]).sum(dtype=torch.float64),
                                        torch.cat([d.margin for d in decs]).sum(dtype=torch.float64),
                                        torch.stack([d.nonfinite for d in decs]).sum().double(),
                                        torch.stack([d.dropped for d in decs]).sum().double(),
                                        *(torch.stack([_rerouted(d) for d in decs]).sum(0).double()
                                          if decs[0].rerouted is not None
                                          else torch.zeros(2, dtype=torch.float64, device=decs[0].ids.device))]))
        flat = torch.cat(ids)
        counts = torch.zeros(len(by_layer) * width, dtype=torch.float64, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
        # The interval's one device->host copy.
        return torch.cat([counts.view(len(by_layer), width), torch.stack(scalars)], dim=1).cpu().numpy()
