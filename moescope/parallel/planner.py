"""Placement planning from recorded load: which rank holds which experts (with replicas of hot ones).

Per MoE layer, EPLB's recipe on one node: (1) with ``slots`` physical slots per rank (N x S >= E), give the
spare slots one by one to the expert with the highest load per replica; (2) pack the replicas onto ranks,
heaviest first, each onto the least-loaded rank that has a free slot and no replica of that expert yet.

Predicted load per rank follows the runtime's dispatch rule (``parallel.expert_parallel``): a replicated
expert's slots are dealt over its replicas in turn, so each of its R replicas computes 1/R of its load,
whichever rank routed the tokens (``stats.rank_loads``).

Outputs: deepseek-ai/EPLB's tensors (``phy2log`` [layers, N*S], ``log2phy`` [layers, E, max replicas] padded
with -1, ``logcnt`` [layers, E]) as JSON, and the placement YAML `moescope demo --placement` accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moescope import stats
from moescope.errors import BadInput
from moescope.parallel.placement import _layout, to_yaml, validate


def cross_rank_share(load: np.ndarray, per_rank: list[list[int]]) -> float:
    """Share of slots computed on another rank than their sender's: each of N ranks routes 1/N of the tokens
    and a replicated expert's slots are dealt evenly over its R replicas, so a holder keeps 1/R of its own
    slots and the local share is 1/N whatever the placement (replicas buy balance, not locality)."""
    n = len(per_rank)
    return 0.0 if load.sum() == 0 else float(1 - 1 / n)


def _ratio(load: np.ndarray, per_rank: list[list[int]]) -> float | None:
    """The busiest rank's load over the mean rank's (``stats``), rounded for the plan's JSON; None for a layer with
    no load (not defined)."""
    v = float(stats.max_over_mean_rows(stats.rank_loads(load, per_rank)))
    return round(v, 4) if np.isfinite(v) else None


def plan_layer(load: np.ndarray, ranks: int, slots: int, coactivation: np.ndarray | None = None
               ) -> list[list[int]]:
    n_exp = len(load)
    if ranks * slots < n_exp:
        raise BadInput(f"{ranks} ranks x {slots} slots cannot hold {n_exp} experts (need slots >= "
                       f"{-(-n_exp // ranks)})")
    count = np.ones(n_exp, dtype=np.int64)
    load = np.asarray(load, dtype=float)
    for _ in range(ranks * slots - n_exp):  # spare slots: replicate the heaviest load per replica
        per_replica = np.where(count < ranks, load / count, -np.inf)
        e = int(np.argmax(per_replica))  # (the lowest expert among equals)
        if per_replica[e] == -np.inf:
            break
        count[e] += 1
    replicas = sorted(((load[e] / count[e], e) for e in range(n_exp) for _ in range(count[e])),
                      key=lambda t: (-t[0], t[1]))
    per_rank: list[list[int]] = [[] for _ in range(ranks)]
    held: list[set[int]] = [set() for _ in range(ranks)]
    weight = [0.0] * ranks
    for w, e in replicas:
        free = [r for r in range(ranks) if len(per_rank[r]) < slots and e not in held[r]]
        if coactivation is not None and w > 0:
            # among equally loaded ranks, prefer one holding the experts this one is chosen with most
            r = min(free, key=lambda r: (weight[r], -sum(coactivation[e, x] for x in per_rank[r]), r))
        else:
            r = min(free, key=lambda r: (weight[r], r))
        per_rank[r].append(e)
        held[r].add(e)
        weight[r] += w
    return [sorted(x) for x in per_rank]


def plan_or_keep(load: np.ndarray, ranks: int, slots: int, current, min_gain: float
                 ) -> tuple[list[list[int]], float, bool]:
    """EPLB in the loop's rule for one layer (``parallel.eplb``): (the placement, its busiest / mean rank on ``load``,
    kept). The plan replaces ``current`` (each rank's experts) only when its busiest / mean rank on the same counts
    is more than ``min_gain`` below the current one's; a layer with no load (NaN) keeps its placement."""
    per = plan_layer(load, ranks, slots)
    predicted = float(stats.max_over_mean_rows(stats.rank_loads(load, per)))
    now = float(stats.max_over_mean_rows(stats.rank_loads(load, current)))
    if not now > predicted + min_gain:  # a gain the counts cannot tell from noise: no moves
        return [sorted(x) for x in current], now, True
    return per, predicted, False


@dataclass
class Plan:
    ranks: int
    slots: int
    layers: dict[int, list[list[int]]]
    predicted: dict  # per layer: planned vs round-robin max/mean and cross-rank share

    def eplb(self) -> dict:
        phy2log, log2phy, logcnt = [], [], []
        n_exp = max(e for per in self.layers.values() for r in per for e in r) + 1
        max_rep = max(sum(e in r for r in per) for per in self.layers.values() for e in range(n_exp))
        for layer in sorted(self.layers):
            per = self.layers[layer]
            phys_padded = []
            for r in per:  # each rank's S slots; unused slots (fewer replicas than slots) are -1
                phys_padded += r + [-1] * (self.slots - len(r))
            phy2log.append(phys_padded)
            where = {e: [i for i, x in enumerate(phys_padded) if x == e] for e in range(n_exp)}
            log2phy.append([where[e] + [-1] * (max_rep - len(where[e])) for e in range(n_exp)])
            logcnt.append([len(where[e]) for e in range(n_exp)])
        return {"format": "deepseek-ai/EPLB", "layers": sorted(self.layers), "num_ranks": self.ranks,
                "slots_per_rank": self.slots, "phy2log": phy2log, "log2phy": log2phy, "logcnt": logcnt}

    def placement_yaml(self, n_experts: int) -> str:
        replicated = any(sum(len(r) for r in per) > n_experts for per in self.layers.values())
        return to_yaml(validate(self.layers, n_experts, self.ranks, replicated, sorted(self.layers),
                                "planned placement"))


def plan(profile, ranks: int, slots: int | None = None) -> Plan:
    if ranks < 1:
        raise BadInput(f"--ranks must be >= 1, got {ranks}")
    n_exp = profile.n_experts
    slots = slots if slots is not None else -(-n_exp // ranks)
    layers, predicted = {}, {}
    rr = [list(x) for x in _layout("round-robin", n_exp, ranks)]
    for layer, load in profile.load().items():
        load = load.astype(float)
        per = plan_layer(load, ranks, slots, profile.coactivation.get(layer))
        layers[layer] = per
        predicted[layer] = {
            "planned_max_over_mean": _ratio(load, per),
            "round_robin_max_over_mean": _ratio(load, rr),
            "planned_cross_rank_share": round(cross_rank_share(load, per), 4),
            "round_robin_cross_rank_share": round(cross_rank_share(load, rr), 4)}
    return Plan(ranks, slots, layers, predicted)
