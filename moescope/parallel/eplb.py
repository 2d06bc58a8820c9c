"""EPLB in the loop: expert-parallel ranks rearrange their experts while serving.

Every ``every_steps`` rank steps (the ranks make the same steps, so they all get here at the same one), each
rank adds up the slots it routed per (layer, logical expert) since the last rearrangement; one all-reduce gives
every rank the fleet's counts, so every rank plans the same placement (``parallel.planner.plan_layer``:
``slots`` physical experts per rank, spare slots replicating the heaviest experts, replicas sharing their
expert's slots evenly). With ``below`` set (SGLang's minimum-utilisation bar) the ranks rearrange only when the
balancedness they measured since the last time (mean rank / busiest rank, from the exchanges' split sizes) is
under it. Rearranging moves real weights: an expert placed on a rank that did not hold it is sent by its lowest
previous holder (``batch_isend_irecv``) and copied into the receiver's expert tensors; then the dispatch tables
switch. (The reference model keeps every expert's weights on every rank, so the copy changes no number; its
time is what a real move costs on this transport.)

Each rearrangement is a ``Rebalance`` event: the balancedness measured before, the one the planner predicts for
the new placement on the same counts, its seconds, the experts moved. The balancedness measured after is what
the exchanges show from then on (``ExpertParallel.measured_since``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moescope.errors import BadInput


@dataclass(frozen=True)
class Rebalancer:
    """When to rearrange: every ``every_steps`` steps, only below ``below`` balancedness if set; ``slots``:
    physical experts per rank (default: the most the starting placement puts on one rank)."""

    every_steps: int
    slots: int | None = None
    below: float | None = None

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            raise BadInput(f"--rebalance-steps must be >= 1, got {self.every_steps}")
        if self.below is not None and not 0 < self.below <= 1:
            raise BadInput(f"--rebalance-below is a balancedness (mean / max) in (0, 1], got {self.below}")


@dataclass(frozen=True)
class Rebalance:
    """One rearrangement, as every rank saw it (``moved_bytes``: the weights this rank received)."""

    step: int
    seconds: float
    moved: int  # expert copies placed on a rank that did not hold them, over all layers
    moved_bytes: int
    before: dict[int, float]  # per layer: busiest rank / mean rank, measured since the last rearrangement
    predicted: dict[int, float]  # per layer: the planner's busiest / mean for the new placement, same counts
    layers: dict[int, tuple[tuple[int, ...], ...]] = field(repr=False)  # the new placement
