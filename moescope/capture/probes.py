"""Device-side accumulators fed by ``on_routing``; read once at the end (``snapshot``), never per token.

``scatter_add_`` into a fixed-size counter is used instead of ``torch.bincount``: on CUDA, bincount
without a known output size reads the max id back to the host, which would be a sync per layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moescope.capture.observer import Observer

if TYPE_CHECKING:
    from moescope.capture.decision import RoutingDecision


class ExpertLoadProbe(Observer):
    """Slots per expert per MoE layer, summed over every forward it sees.

    Dropped slots land in an extra bucket (index E, the sentinel of ``active_ids``) that ``snapshot`` leaves out.
    """

    def __init__(self) -> None:
        self._counts: dict[int, torch.Tensor] = {}  # layer -> [E + 1] int64 on the model's device

    def on_routing(self, layer: int, decision: "RoutingDecision") -> None:
        ids = decision.active_ids.reshape(-1)
        counts = self._counts.get(layer)
        if counts is None:
            counts = self._counts[layer] = torch.zeros(decision.n_experts + 1, dtype=torch.int64,
                                                       device=ids.device)
        counts.scatter_add_(0, ids, torch.ones_like(ids))

    def snapshot(self) -> dict[int, list[int]]:
        """Host copy: {layer: slots per expert (dropped slots excluded)}. One device->host copy."""
        if not self._counts:
            return {}
        layers = sorted(self._counts)
        stacked = torch.stack([self._counts[layer] for layer in layers]).cpu()  # one copy for all layers
        return {layer: row[:-1].tolist() for layer, row in zip(layers, stacked)}
