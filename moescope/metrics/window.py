"""The routing window: per-layer routing over the last ``window_s`` seconds, and the gauges computed from it.

Routing arrives in 1-second bins; the window keeps running sums (a bin is added when it opens and subtracted
when it leaves), so a scrape costs one pass over layers x experts, never over bins x layers x experts. The
gauges of every layer are computed at once with numpy (58 x 256 at DeepSeek-V3's shape) and follow the
formulas of docs/metrics.md (``moescope.stats`` holds the reference implementations the tests compare with).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

from moescope import thresholds
from moescope.metrics.catalogue import RELATIVE_LOAD_BUCKETS


@dataclass
class _Bin:
    second: int
    slots: np.ndarray  # [L, E] int64
    tokens: np.ndarray  # [L] int64
    entropy: np.ndarray  # [L] float64 (sums over tokens)
    margin: np.ndarray  # [L]


@dataclass(frozen=True)
class LayerGauges:
    """Every routed layer's window gauges, as arrays aligned with ``layers`` (layers without tokens in the
    window are left out)."""

    layers: tuple[int, ...]
    slots: np.ndarray  # [L, E] slots per expert over the window
    tokens: np.ndarray  # [L]
    cv: np.ndarray
    noise_cv: np.ndarray
    excess_cv: np.ndarray
    max_over_mean: np.ndarray
    top_share: np.ndarray
    dead: np.ndarray
    slots_per_expert: np.ndarray
    entropy: np.ndarray
    margin: np.ndarray
    relative: np.ndarray  # [L, buckets] experts with load / mean <= each RELATIVE_LOAD_BUCKETS bound (cumulative)

    def extremes(self, k: int) -> list[list[int]]:
        """Per layer, the ids of the ``k`` hottest then the ``k`` coldest experts (ties: lower id first;
        an expert in both is listed once)."""
        out = []
        for row in self.slots:
            hot = np.argsort(-row, kind="stable")[:k]
            cold = np.argsort(row, kind="stable")[:k]
            out.append(list(dict.fromkeys([*hot.tolist(), *cold.tolist()])))
        return out


class RoutingWindow:
    """Running sums of the last ``window_s`` seconds of routing, per MoE layer."""

    def __init__(self, layers: tuple[int, ...], n_experts: int, window_s: float) -> None:
        self.layers, self.n_experts, self.window_s = tuple(layers), n_experts, window_s
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        n = len(self.layers)
        self.slots = np.zeros((n, n_experts), dtype=np.int64)
        self.tokens = np.zeros(n, dtype=np.int64)
        self.entropy = np.zeros(n)
        self.margin = np.zeros(n)
        self._bins: collections.deque[_Bin] = collections.deque()

    def _bin(self, second: int) -> _Bin:
        if not self._bins or self._bins[-1].second != second:
            n, e = len(self.layers), self.n_experts
            self._bins.append(_Bin(second, np.zeros((n, e), np.int64), np.zeros(n, np.int64), np.zeros(n),
                                   np.zeros(n)))
            self.prune(second)
        return self._bins[-1]

    def add(self, second: int, layer: int, slots: np.ndarray, tokens: int, entropy: float, margin: float) -> None:
        """One layer's routing summary, counted in the bin of ``second`` (callers hold the state's lock)."""
        if layer not in self.row:
            self._grow(layer)
        b, i = self._bin(second), self.row[layer]
        slots = slots[: self.n_experts]
        b.slots[i] += slots
        self.slots[i] += slots
        b.tokens[i] += tokens
        self.tokens[i] += tokens
        b.entropy[i] += entropy
        self.entropy[i] += entropy
        b.margin[i] += margin
        self.margin[i] += margin

    def _grow(self, layer: int) -> None:
        """A layer the model info did not list (an adapter that found one more MoE block): add its row."""
        self.row[layer] = len(self.layers)
        self.layers += (layer,)
        e = self.n_experts
        self.slots = np.vstack([self.slots, np.zeros((1, e), np.int64)])
        self.tokens, self.entropy, self.margin = (np.append(a, 0) for a in (self.tokens, self.entropy, self.margin))
        for b in self._bins:
            b.slots = np.vstack([b.slots, np.zeros((1, e), np.int64)])
            b.tokens, b.entropy, b.margin = (np.append(a, 0) for a in (b.tokens, b.entropy, b.margin))

    def prune(self, now_second: int) -> None:
        while self._bins and self._bins[0].second <= now_second - self.window_s:
            b = self._bins.popleft()
            self.slots -= b.slots
            self.tokens -= b.tokens
            self.entropy -= b.entropy
            self.margin -= b.margin
        if not self._bins:  # no float residue from add/subtract
            self.entropy[:] = 0.0
            self.margin[:] = 0.0

    def gauges(self) -> LayerGauges:
        """The window gauges of every layer that routed tokens in the window (callers hold the lock)."""
        keep = np.nonzero(self.tokens > 0)[0]
        slots = self.slots[keep].astype(np.float64)  # [L, E]
        tokens = self.tokens[keep].astype(np.float64)
        e = self.n_experts
        n = slots.sum(1)
        mean = n / e
        safe_mean = np.where(mean > 0, mean, 1.0)
        cv = np.where(mean > 0, slots.std(1) / safe_mean, 0.0)
        mx = slots.max(1) if e else np.zeros(len(keep))
        noise = np.array([thresholds.noise_cv(e, x) for x in n.tolist()])
        excess = np.array([thresholds.excess_cv(c, e, x) for c, x in zip(cv.tolist(), n.tolist())])
        rel = slots / safe_mean[:, None]
        relative = np.stack([(rel <= le).sum(1) for le in RELATIVE_LOAD_BUCKETS], axis=1) if len(keep) else \
            np.zeros((0, len(RELATIVE_LOAD_BUCKETS)))
        return LayerGauges(
            layers=tuple(self.layers[i] for i in keep.tolist()), slots=slots, tokens=tokens, cv=cv,
            noise_cv=np.where(np.isinf(noise), np.nan, noise), excess_cv=excess,
            max_over_mean=np.where(mean > 0, mx / safe_mean, 0.0), top_share=mx / tokens,
            dead=(slots == 0).sum(1).astype(np.float64), slots_per_expert=mean,
            entropy=self.entropy[keep] / tokens, margin=self.margin[keep] / tokens, relative=relative)


def jensen_shannon_rows(load: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Jensen-Shannon divergence in bits between each row of ``load`` and of ``ref`` (as ``stats.jensen_shannon``,
    row-wise: both normalised, 0 = same, 1 = disjoint)."""
    def norm(a):
        s = a.sum(1, keepdims=True)
        return np.divide(a, s, out=np.zeros_like(a), where=s > 0)

    p, q = norm(load.astype(np.float64)), norm(ref.astype(np.float64))
    m = (p + q) / 2

    def kl(a, b):
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(a > 0, a * np.log2(np.where(a > 0, a, 1.0) / np.where(b > 0, b, 1.0)), 0.0)
        return t.sum(1)

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)
