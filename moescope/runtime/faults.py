"""Real, switchable faults in the reference runtime: they change what the engine computes, and the metrics
then report it honestly (nothing here touches a metric).

Router faults act on the router's logits before the softmax:
- ``collapse``: a large bias toward one expert in every MoE layer (a broken router bias / bad fine-tune);
- ``imbalance``: a milder graded bias across the experts (skewed routing);
- ``jitter``: Gaussian noise on the logits from an unseeded generator, so the same input routes differently
  from run to run (non-deterministic routing).
Scenarios compose: ``--scenario collapse,jitter``. Faults of the other subsystems (cache, ranks, traffic)
are demo flags; see ``moescope demo --help``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moescope.errors import BadInput


@dataclass(frozen=True)
class RouterFault:
    bias: tuple[float, ...] | None = None  # added to the logits, per expert
    noise_std: float = 0.0

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            logits = logits + torch.tensor(self.bias, dtype=logits.dtype, device=logits.device)
        if self.noise_std:
            logits = logits + torch.randn_like(logits) * self.noise_std  # unseeded on purpose
        return logits


def _router_fault(name: str, n_experts: int) -> RouterFault:
    if name == "collapse":
        return RouterFault(bias=(8.0,) + (0.0,) * (n_experts - 1))
    if name == "imbalance":
        return RouterFault(bias=tuple(1.5 * (n_experts - 1 - e) / max(1, n_experts - 1) for e in range(n_experts)))
    if name == "jitter":
        return RouterFault(noise_std=0.5)
    raise AssertionError(name)


ROUTER_SCENARIOS = ("collapse", "imbalance", "jitter")
SCENARIOS = ("healthy", *ROUTER_SCENARIOS)


def combine(faults: list[RouterFault]) -> RouterFault | None:
    if not faults:
        return None
    bias = None
    for f in faults:
        if f.bias is not None:
            bias = f.bias if bias is None else tuple(a + b for a, b in zip(bias, f.bias))
    return RouterFault(bias=bias, noise_std=sum(f.noise_std for f in faults))


def parse(spec: str) -> list[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise BadInput(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    return names


def apply(model, names: list[str]) -> None:
    """Install the router faults of ``names`` on every MoE layer of ``model`` (healthy: none)."""
    fault = combine([_router_fault(n, model.cfg.n_experts) for n in names if n in ROUTER_SCENARIOS])
    for layer in model.moe_layers():
        layer.router.fault = fault
