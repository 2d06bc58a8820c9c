"""Placements as vLLM lays them out, and each rank's load in each step under one (issue [eplb]).

A ``Layout`` is a physical-to-logical map [L, P]: physical slot p on rank p // (P / N), -1 an empty slot; vLLM's
``linear`` and ``round_robin`` expert maps, its EPLB maps, the planner's per-rank lists and the runtime's
``Placement`` are all one. ``rank_loads`` gives [S, L, N] slots per rank per step from [S, L, E] per-expert counts,
a replicated expert's slots split evenly over its replicas (``parallel.step_balance`` says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moescope.errors import BadInput
from moescope.parallel import eplb_policy


@dataclass(frozen=True)
class Layout:
    """A placement: ``phy2log`` [L, P] the logical expert each physical slot holds (-1: empty), rank r holding
    slots r*P/N .. (r+1)*P/N - 1; ``kind`` "linear"/"round_robin" when it is that static layout of E % N == 0 (a
    reshape-sum computes it)."""

    placement: str
    ep: int
    redundant: int
    phy2log: np.ndarray
    kind: str | None = None

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.placement, self.ep, self.redundant)


def static_layout(placement: str, n_experts: int, ep: int, n_layers: int) -> Layout:
    """vLLM's ``linear`` or ``round_robin`` expert map over ``ep`` ranks (``determine_expert_map``)."""
    base, rem = divmod(n_experts, ep)
    per = base + (rem > 0)
    ranks = []
    for r in range(ep):
        if placement == "linear":
            start = r * base + min(r, rem)
            held = list(range(start, start + base + (r < rem)))
        elif placement == "round_robin":
            held = list(range(r, n_experts, ep))
        else:
            raise BadInput(f"unknown static placement {placement!r}; vLLM's are linear and round_robin")
        ranks.append(held + [-1] * (per - len(held)))
    phy = np.tile(np.array(ranks, dtype=np.int64).reshape(-1), (n_layers, 1))
    return Layout(placement, ep, 0, phy, placement if rem == 0 else None)


def from_ranks(placement: str, per_layer: list[list[list[int]]], n_experts: int) -> Layout:
    """A layout from per-layer lists of each rank's experts (the runtime's ``Placement``, the planner's plan);
    ranks with fewer experts are padded with empty slots."""
    n = len(per_layer[0])
    width = max(len(r) for per in per_layer for r in per)
    phy = np.full((len(per_layer), n * width), -1, dtype=np.int64)
    for i, per in enumerate(per_layer):
        for r, held in enumerate(per):
            phy[i, r * width: r * width + len(held)] = held
    physical = int((phy >= 0).sum(1).max())
    return Layout(placement, n, max(0, physical - n_experts), phy)


def deal(layout: Layout, n_experts: int) -> np.ndarray:
    """[L, E, N] float32: the share of each logical expert's slots each rank computes (1 / replicas per replica
    held; an expert no rank holds computes nowhere)."""
    phy = layout.phy2log
    n_layers, n_phy = phy.shape
    per = n_phy // layout.ep
    out = np.zeros((n_layers, n_experts + 1, layout.ep), dtype=np.float32)
    rank = np.broadcast_to(np.arange(n_phy) // per, phy.shape)
    rows = np.broadcast_to(np.arange(n_layers)[:, None], phy.shape)
    np.add.at(out, (rows, np.where(phy < 0, n_experts, phy), rank), 1.0)
    out = out[:, :n_experts]
    held = out.sum(-1, keepdims=True)
    return np.divide(out, held, out=np.zeros_like(out), where=held > 0)


class InUse:
    """``() -> Layout | None``: the placement ``source()`` returns now (a runtime ``parallel.placement.Placement``,
    a ``Layout`` as the vLLM reader gives, or None), as a ``Layout``; converted once per placement object."""

    def __init__(self, source, n_experts: int) -> None:
        self.source, self.n_experts = source, n_experts
        self._last: tuple = (None, None)

    def __call__(self) -> Layout | None:
        p = self.source()
        if p is None or isinstance(p, Layout):
            return p
        if p is not self._last[0]:
            per_layer = [[list(x) for x in p.layers[layer]] for layer in sorted(p.layers)]
            self._last = (p, from_ranks("in_use", per_layer, self.n_experts))
        return self._last[1]


def rank_loads(counts: np.ndarray, layout: Layout, dealt: np.ndarray | None = None) -> np.ndarray:
    """[S, L, N] slots each rank computes in each step, from ``counts`` [S, L, E] (a replicated expert's slots
    split evenly over its replicas); ``dealt``: ``deal(layout)`` where the caller keeps it."""
    s, n_layers, e = counts.shape
    n = layout.ep
    if layout.kind == "linear":
        return counts.reshape(s, n_layers, n, e // n).sum(-1)
    if layout.kind == "round_robin":
        return counts.reshape(s, n_layers, e // n, n).sum(-2)
    d = deal(layout, e) if dealt is None else dealt
    return np.matmul(np.asarray(counts, dtype=np.float32).transpose(1, 0, 2), d).transpose(1, 0, 2)


def _shares(phy2log: np.ndarray, n_experts: int) -> np.ndarray:
    """[L, P] the share of its logical expert's slots each physical slot computes (1 / replicas; 0 for empty)."""
    cnt = eplb_policy.replica_counts(phy2log, n_experts)
    per = cnt[np.arange(phy2log.shape[0])[:, None], np.where(phy2log < 0, 0, phy2log)]
    return np.where(phy2log < 0, 0.0, 1.0 / np.maximum(per, 1))


def _fold(loads: np.ndarray, kind: str, n: int) -> np.ndarray:
    """``kind``'s rank loads over ``n`` ranks from its loads over a multiple of ``n``: linear's rank r of n holds
    ranks r*m .. r*m + m - 1 of the finer, round-robin's ranks r, r + n, r + 2n, ..."""
    s, n_layers, fine = loads.shape
    m = fine // n
    if kind == "linear":
        return loads.reshape(s, n_layers, n, m).sum(-1)
    return loads.reshape(s, n_layers, m, n).sum(-2)


def per_rank(layout: Layout, row: int) -> list[list[int]]:
    """Each rank's experts in one layer (row) of ``layout`` (empty slots left out)."""
    phy = layout.phy2log[row]
    per = len(phy) // layout.ep
    return [[int(e) for e in phy[r * per:(r + 1) * per] if e >= 0] for r in range(layout.ep)]


def max_mean(loads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([..., L] busiest rank, [..., L] mean rank) of ``loads`` [..., L, N]."""
    return loads.max(-1), loads.mean(-1)
