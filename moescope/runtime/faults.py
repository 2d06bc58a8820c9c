"""Real, switchable faults in the reference runtime: they change what the engine computes, and the metrics
then report it honestly (nothing here touches a metric).

Router faults act on the router's logits before the softmax:
- ``collapse``: a large bias toward one expert in every MoE layer (a broken router bias / bad fine-tune);
- ``imbalance``: a milder graded bias across the experts (skewed routing);
- ``jitter``: Gaussian noise on the logits from an unseeded generator, so the same input routes differently
  from run to run (non-deterministic routing).
Model faults:
- ``nan``: the embedding rows of the UTF-8 lead bytes of 4-byte characters (emoji) overflow to inf (a
  precision fault on unusual inputs): those tokens' router logits become non-finite.
Faults of the other subsystems are settings of the demo (``DEMO_SETTINGS``): ``thrash`` (a cache far too
small), ``switch-jitter`` (a slow disk tier: every load waits 20-60 ms more), ``slow-rank`` (2 ranks, rank 1
late by 20 ms in every dispatch), ``drop`` (capacity factor 0.5), ``drift`` (the traffic switches to
70% numbers, 30% code halfway, measured against a baseline of the normal mix), ``leak`` (the engine retains 256 KiB
per step: at the demo's ~20 steps/s, 5 MB/s, a process that outgrows a 24 GiB host within the alert's 4 h).
Scenarios compose: ``--scenario collapse,jitter``.
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
        return RouterFault(bias=tuple(0.8 * (n_experts - 1 - e) / max(1, n_experts - 1) for e in range(n_experts)))
    if name == "jitter":
        return RouterFault(noise_std=0.04)
    raise AssertionError(name)


ROUTER_SCENARIOS = ("collapse", "imbalance", "jitter")
# Demo settings each scenario changes (real engine behaviour, through the same flags a user has).
DEMO_SETTINGS = {
    "thrash": {"cache_size": 1, "cache_policy": "lru"},
    # 7 of 8 pinned: a healthy hit rate (~0.85), but every miss waits on the slow tier
    "switch-jitter": {"cache_size": 7, "cache_policy": "static", "cache_tier": "disk", "disk_delay_s": (0.02, 0.06)},
    "slow-rank": {"world_size": 2, "slow_rank": 1, "delay_ms": 20.0},
    "drop": {"capacity_factor": 0.5},
    "drift": {"traffic_shift": {"numbers": 0.7, "code": 0.3}},
    "leak": {"leak_bytes": 256 * 1024},
}
SCENARIOS = ("healthy", *ROUTER_SCENARIOS, "nan", *DEMO_SETTINGS)


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
    """Install the model faults of ``names`` (router faults on every MoE layer; ``nan`` in the embedding)."""
    fault = combine([_router_fault(n, model.cfg.n_experts) for n in names if n in ROUTER_SCENARIOS])
    for layer in model.moe_layers():
        layer.router.fault = fault
    if "nan" in names:
        with torch.no_grad():  # 4-byte UTF-8 lead bytes: emoji and other astral-plane characters
            model.embed.weight[0xF0:0xF5] = float("inf")  # as if cast to fp16 and overflowed


def demo_settings(names: list[str]) -> dict:
    """The demo settings the scenarios ask for, merged (later scenarios win on conflicts)."""
    out: dict = {}
    for n in names:
        out.update(DEMO_SETTINGS.get(n, {}))
    return out
