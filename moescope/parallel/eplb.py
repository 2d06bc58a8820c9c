"""EPLB in the loop: expert-parallel ranks rearrange their experts while serving.

Every ``every_steps`` rank steps (the ranks make the same steps, so they all get here at the same one), each rank
adds up the slots it routed per (layer, logical expert) since the last time (a window); one all-reduce gives every
rank the fleet's counts, so every rank plans the same placement (``parallel.planner.plan_layer``: ``slots``
physical experts per rank, spare slots replicating the heaviest experts, replicas sharing their expert's slots
evenly) from the last ``horizon`` windows' counts together. One window alone is a sample that need not hold for the
next: where experts are many (deepseek-v3-shape: 256) a window of a few decode steps routes a few slots per expert,
and windows alternate with bigger batches (prefills, the canary's); placements fitted to each window alone ended a
run less balanced than round-robin (docs/runtime.md, "EPLB figures"). A layer keeps its placement unless the plan's
predicted max/mean on those counts is more than ``min_gain`` below the current placement's on the same counts: no
weights move for a gain the counts cannot tell from noise. With ``below`` set (SGLang's minimum-utilisation bar)
the ranks rearrange only when the balancedness they measured since the last time (mean rank / busiest rank, from
the exchanges' split sizes) is under it. Rearranging moves real weights: an expert placed on a rank that did not
hold it is sent by its lowest previous holder (``batch_isend_irecv``) and copied into the receiver's expert
tensors; then the dispatch tables switch. (The reference model keeps every expert's weights on every rank, so the
copy changes no number; its time is what a real move costs on this transport.)

Each rearrangement is a ``Rebalance`` event: the balancedness measured before, the one the planner predicts for
the new placement on the counts it planned from, its seconds, the experts moved. The balancedness measured after
is what the exchanges show from then on (``ExpertParallel.measured_since``); over the whole run and over the
steps from a given one to the end (``ExpertParallel.rows_run``, ``rows_from``: the same steps in a run that does
not rearrange) the exchanges' rows are kept too, whatever the rearrangements.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moescope.errors import BadInput


# A layer moves only when the plan's busiest / mean rank is more than this below its current placement's (same counts)
MIN_GAIN = 0.01


@dataclass(frozen=True)
class Rebalancer:
    """When to rearrange: every ``every_steps`` steps, only below ``below`` balancedness if set; ``slots``:
    physical experts per rank (default: the most the starting placement puts on one rank); ``horizon``: plan from
    the fleet's counts of the last this many windows of ``every_steps`` steps; ``min_gain``: a layer moves only
    when the plan's predicted busiest / mean rank is more than this below its current placement's (same counts)."""

    every_steps: int
    slots: int | None = None
    below: float | None = None
    horizon: int = 8
    min_gain: float = MIN_GAIN

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            raise BadInput(f"--rebalance-steps must be >= 1, got {self.every_steps}")
        if self.horizon < 1:
            raise BadInput(f"the rebalancer's horizon is a number of windows >= 1, got {self.horizon}")
        if self.min_gain < 0:
            raise BadInput(f"the rebalancer's min_gain is a max/mean difference >= 0, got {self.min_gain}")
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
    # per layer: the planner's busiest / mean for the new placement on the counts it planned from (a layer that
    # kept its placement: the current one's)
    predicted: dict[int, float]
    layers: dict[int, tuple[tuple[int, ...], ...]] = field(repr=False)  # the new placement
    # per layer: rows each rank computed since the last rearrangement (what ``before`` is measured on)
    before_rows: dict[int, list[int]] = field(default_factory=dict, repr=False)
    kept: int = 0  # layers that kept their placement (the plan's gain under ``Rebalancer.min_gain``)
