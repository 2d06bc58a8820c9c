"""The routing probe: per-step statistics of every MoE layer, from device tensors, with one host copy.

``on_routing`` only keeps a reference to the decision (no device work on the hot path). ``on_step`` does the
whole step's accounting in a fixed number of batched ops, independent of the number of layers: one
``scatter_add_`` for the slot counts of all layers, one stacked sum each for entropy and margin, then a single
concatenated device->host copy. It hands a ``StepStats`` to its listener (the metrics state, the trace
writer, tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from moescope.capture.observer import Observer

if TYPE_CHECKING:
    from moescope.runtime.router import RoutingDecision


@dataclass(frozen=True)
class LayerStats:
    """One MoE layer in one step."""

    layer: int
    tokens: int  # tokens routed
    slots: tuple[int, ...]  # computed slots per expert (dropped slots excluded)
    dropped: int
    nonfinite: int
    entropy_sum: float
    margin_sum: float
    router_s: float | None = None
    experts_s: float | None = None


@dataclass(frozen=True)
class StepStats:
    step: Any  # the engine's StepRecord (or the HF adapter's)
    layers: tuple[LayerStats, ...]
    n_experts: int
    top_k: int


class RoutingProbe(Observer):
    """Turns a step's routing decisions into ``StepStats`` (one device->host copy per step)."""

    def __init__(self, listener: Callable[[StepStats], None]) -> None:
        self._listener = listener
        self._pending: list[tuple[int, "RoutingDecision"]] = []
        self._times: dict[int, tuple[float, float]] = {}
        self._offsets: dict[tuple[int, int, str], torch.Tensor] = {}

    def on_routing(self, layer: int, decision: "RoutingDecision") -> None:
        self._pending.append((layer, decision))

    def on_layer_time(self, layer: int, router_s: float, experts_s: float) -> None:
        self._times[layer] = (router_s, experts_s)

    def on_step(self, step: Any) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        times, self._times = self._times, {}
        self._listener(self.summarise(pending, times, step))

    def summarise(self, pending, times, step) -> StepStats:
        n_exp = pending[0][1].n_experts
        k = pending[0][1].ids.shape[1]
        if len({d.ids.shape for _, d in pending}) == 1 and all(d.n_experts == n_exp for _, d in pending):
            rows = self._batched(pending, n_exp)
        else:  # forwards of different sizes in one step (e.g. an HF adapter user's own loop): per decision
            rows = torch.cat([self._batched([p], n_exp) for p in pending])
        layers = []
        for (layer, d), row in zip(pending, rows.tolist()):
            r_s, e_s = times.get(layer, (None, None))
            ent, mar, nonf, drop = row[n_exp + 1:]
            layers.append(LayerStats(layer=layer, tokens=d.ids.shape[0], slots=tuple(int(x) for x in row[:n_exp]),
                                     dropped=int(drop), nonfinite=int(nonf), entropy_sum=ent, margin_sum=mar,
                                     router_s=r_s, experts_s=e_s))
        return StepStats(step=step, layers=tuple(layers), n_experts=n_exp, top_k=k)

    def _batched(self, pending, n_exp: int) -> torch.Tensor:
        """Host float64 [L, E + 5]: slot counts per expert (+ the dropped bucket), entropy sum, margin sum,
        non-finite count, dropped count."""
        decs = [d for _, d in pending]
        n_layers, width = len(decs), n_exp + 1
        ids = torch.stack([d.active_ids for d in decs])  # [L, T, k]
        key = (n_layers, width, str(ids.device))
        offsets = self._offsets.get(key)
        if offsets is None:
            offsets = self._offsets[key] = (torch.arange(n_layers, device=ids.device) * width).view(-1, 1, 1)
        flat = (ids + offsets).reshape(-1)
        counts = torch.zeros(n_layers * width, dtype=torch.float64, device=ids.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
        scalars = torch.stack([torch.stack([d.entropy.sum() for d in decs]).double(),
                               torch.stack([d.margin.sum() for d in decs]).double(),
                               torch.stack([d.nonfinite for d in decs]).double(),
                               torch.stack([d.dropped for d in decs]).double()], dim=1)  # [L, 4]
        # The one device->host copy of the step (a no-op on CPU).
        return torch.cat([counts.view(n_layers, width), scalars], dim=1).cpu()
