"""Per-token routing capture: every token's experts, gate weights, entropy and margin in every MoE layer.

Hot path: ``on_routing`` keeps references; ``on_step`` hands the step's references to the listener as a
``StepTrace`` (O(1) work on the engine thread). The listener is expected to be a queued consumer (the trace
store's writer thread): it calls ``StepTrace.arrays()``, which packs the step into compact host arrays
([L, T, k] int16 ids, float16 weights, [L, T] float16 entropy and margin) there, off the engine thread.
Routing decisions are immutable after their forward, so reading them later is safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from moescope.capture.observer import Observer

if TYPE_CHECKING:
    from moescope.runtime.router import RoutingDecision


@dataclass(frozen=True)
class TraceArrays:
    layers: tuple[int, ...]
    ids: np.ndarray  # [L, T, k] int16 (int32 from 32768 experts); dropped slots hold E
    weights: np.ndarray  # [L, T, k] float16
    entropy: np.ndarray  # [L, T] float16
    margin: np.ndarray  # [L, T] float16
    n_experts: int


@dataclass(frozen=True)
class StepTrace:
    step: Any  # StepRecord: phase, timings, and segments mapping tokens to requests
    decisions: tuple[tuple[int, "RoutingDecision"], ...]
    layer_seconds: dict[int, tuple[float, float]]  # layer -> (router_s, experts_s)

    def arrays(self) -> TraceArrays:
        """Pack to host arrays (the device->host copy happens here, on the caller's thread)."""
        decs = [d for _, d in self.decisions]
        n_exp = decs[0].n_experts
        idtype = np.int16 if n_exp < 2**15 else np.int32
        return TraceArrays(
            layers=tuple(layer for layer, _ in self.decisions),
            ids=np.stack([d.active_ids.cpu().numpy() for d in decs]).astype(idtype),
            weights=np.stack([d.weights.detach().cpu().numpy() for d in decs]).astype(np.float16),
            entropy=np.stack([d.entropy.cpu().numpy() for d in decs]).astype(np.float16),
            margin=np.stack([d.margin.cpu().numpy() for d in decs]).astype(np.float16),
            n_experts=n_exp)


class TokenTraceCapture(Observer):
    """Collects each step's decisions and passes them on; the listener must not block (queue it)."""

    def __init__(self, listener: Callable[[StepTrace], None]) -> None:
        self._listener = listener
        self._pending: list[tuple[int, "RoutingDecision"]] = []
        self._times: dict[int, tuple[float, float]] = {}

    def on_routing(self, layer: int, decision: "RoutingDecision") -> None:
        self._pending.append((layer, decision))

    def on_layer_time(self, layer: int, router_s: float, experts_s: float) -> None:
        self._times[layer] = (router_s, experts_s)

    def on_step(self, step: Any) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        times, self._times = self._times, {}
        self._listener(StepTrace(step=step, decisions=tuple(pending), layer_seconds=times))
