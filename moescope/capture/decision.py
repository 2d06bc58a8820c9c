"""What every engine hands the observer seam: one ``RoutingDecision`` per MoE layer per forward, and the score
statistics (entropy, top-1 margin) an engine adapter computes for it.

Engine-neutral: the reference runtime (``runtime/router.py``), the HF adapter and any other engine adapter build
decisions from this module and import nothing of each other. Definitions: docs/metrics.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingDecision:
    """What the router decided for one forward of one MoE layer (all tensors on the model's device).

    Attributes:
        ids: [T, k] int64 chosen experts, best first.
        weights: [T, k] float32 gate weights, renormalised over the k choices; 0 where the slot was dropped.
        kept: [T, k] bool, False where the capacity limit dropped the slot.
        entropy: [T] router entropy normalised by log(E) (0 = certain, 1 = uniform).
        margin: [T] top-1 minus top-2 probability.
        nonfinite: [] int64 count of NaN/Inf router logits.
        dropped: [] int64 count of dropped slots.
        n_experts: E.
        active_ids: [T, k] ``ids`` with dropped slots replaced by the sentinel E (computed by no expert);
            the same tensor as ``ids`` when nothing can be dropped.
        scored: whether entropy, margin and nonfinite come from the router's scores (False: unknown, NaN).
    """

    ids: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    entropy: torch.Tensor
    margin: torch.Tensor
    nonfinite: torch.Tensor
    dropped: torch.Tensor
    n_experts: int
    # None only as the constructor's default: __post_init__ computes it, so every reader gets a tensor
    active_ids: torch.Tensor = None  # type: ignore[assignment]
    rerouted: dict | None = None  # mitigation -> [] int64 slots it changed ("load", "smoothing")
    # False where the engine does not hand over the router's scores (vLLM's capture function gives the ids only):
    # entropy and margin are NaN there meaning "unknown", not non-finite logits
    scored: bool = True

    def __post_init__(self) -> None:
        if self.active_ids is None:  # computed once here, read by the experts and every probe
            object.__setattr__(self, "active_ids", torch.where(self.kept, self.ids,
                                                               torch.full_like(self.ids, self.n_experts)))

    @property
    def n_tokens(self) -> int:
        return self.ids.shape[0]


def entropy_margin(scores: torch.Tensor, scoring: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised entropy [T] of the router's score distribution [T, E] and the top-1 minus top-2 score [T].

    ``scoring``: ``softmax`` (``scores`` are probabilities, a distribution already) or ``sigmoid`` (independent
    affinities, normalised to sum 1 for the entropy: the share of affinity each expert holds; any scoring other
    than ``softmax`` is treated so). The margin is in
    the scores' own units (a probability, or an affinity in [0, 1]); both ignore the correction bias and the
    group limit (the router's own confidence).
    """
    n_tokens, n_experts = scores.shape
    if n_experts == 1:
        return torch.zeros(n_tokens, device=scores.device), scores[:, 0]
    p = scores if scoring == "softmax" else scores / scores.sum(-1, keepdim=True)
    # xlogy gives 0*log(0) = 0 for experts with zero probability.
    entropy = -torch.special.xlogy(p, p).sum(-1) / math.log(n_experts)
    top2 = torch.topk(scores, 2, dim=-1).values
    return entropy, top2[:, 0] - top2[:, 1]
