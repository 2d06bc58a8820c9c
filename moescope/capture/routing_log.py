"""Records which experts each forward of each MoE layer used, for ``moescope cache-sim`` and offline analysis.

Device-side: each ``on_routing`` marks the used experts in a small [E + 1] mask on the device; ``on_step``
stacks the step's masks and copies them to the host once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moescope.capture.observer import Observer

if TYPE_CHECKING:
    from moescope.capture.decision import RoutingDecision

FORMAT = "moescope-routing-v1"


class RoutingLog(Observer):
    def __init__(self) -> None:
        self._pending: list[tuple[int, torch.Tensor]] = []
        self.n_experts: int | None = None
        self.forwards: dict[int, list[list[int]]] = {}  # layer -> per forward: experts used, ascending

    def on_routing(self, layer: int, decision: "RoutingDecision") -> None:
        ids = decision.active_ids.reshape(-1)
        used = torch.zeros(decision.n_experts + 1, dtype=torch.bool, device=ids.device)
        used[ids] = True
        self._pending.append((layer, used))
        self.n_experts = decision.n_experts

    def on_step(self, step: Any) -> None:
        if not self._pending:
            return
        masks = torch.stack([m for _, m in self._pending]).cpu()  # one copy per step
        for (layer, _), row in zip(self._pending, masks):
            self.forwards.setdefault(layer, []).append(row[:-1].nonzero().flatten().tolist())
        self._pending.clear()

    def to_dict(self) -> dict:
        return {"format": FORMAT, "n_experts": self.n_experts,
                "layers": {str(layer): f for layer, f in sorted(self.forwards.items())}}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), separators=(",", ":")) + "\n")
        return path
