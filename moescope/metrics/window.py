"""The routing window: per-layer routing over the last ``window_s`` seconds, and the gauges computed from it.

Routing arrives in 1-second bins; the window keeps running sums (a bin is added when it opens and subtracted
when it leaves), so a scrape costs one pass over layers x experts, never over bins x layers x experts. The
window's *draws* (finished requests, moescope.sampling's independent unit) arrive as ``sampling.Draws`` running
sums in coarser bins (``window_s / 12``: 13 bins of 58 x 256 x 3 sums at DeepSeek-V3's shape, ~5 MB), added
when a request finishes and subtracted when its bin leaves the window. The gauges of every layer are computed
at once with numpy and follow the formulas of docs/metrics.md (``moescope.sampling`` for the noise,
``moescope.stats`` holds the reference implementations the tests compare with).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from moescope import judge, sampling, thresholds
from moescope.metrics.catalogue import RELATIVE_LOAD_BUCKETS

DRAW_BINS = 12  # the draws' bins per window


@dataclass
class _Bin:
    second: int
    slots: np.ndarray  # [L, E] int64
    tokens: np.ndarray  # [L] int64
    entropy: np.ndarray  # [L] float64 (sums over tokens)
    margin: np.ndarray  # [L]


@dataclass
class _DrawBin:
    index: int  # int(second // draw_bin_s)
    draws: sampling.Draws
    n: int  # draws folded (requests, or forwards)


@dataclass(frozen=True)
class LayerGauges:
    """Every routed layer's window gauges, as arrays aligned with ``layers`` (layers without tokens in the
    window are left out). NaN in a judged quantity: not judged (too few draws, or no baseline)."""

    layers: tuple[int, ...]
    slots: np.ndarray  # [L, E] slots per expert over the window
    tokens: np.ndarray  # [L]
    cv: np.ndarray
    noise_cv: np.ndarray  # the cluster-robust noise bound (sampling.noise_cv); NaN: not judged
    excess_cv: np.ndarray  # sqrt(max(0, cv^2 - noise^2)); NaN: not judged
    max_over_mean: np.ndarray
    top_share: np.ndarray
    dead: np.ndarray
    slots_per_expert: np.ndarray
    entropy: np.ndarray
    margin: np.ndarray
    relative: np.ndarray  # [L, buckets] experts with load / mean <= each RELATIVE_LOAD_BUCKETS bound (cumulative)
    draws: np.ndarray | None = None  # [L] draws of each layer in the window
    window_draws: int = 0  # draws (requests, or forwards) folded into the window
    dead_unexpected: np.ndarray | None = None  # [L] zero-slot experts their reference says should have slots
    hot: np.ndarray | None = None  # [L, E] share / reference share where significantly above it, else NaN
    baseline: np.ndarray | None = None  # [L] bool: the reference is the loaded baseline (else the fair share)
    baseline_cv: np.ndarray | None = None  # [L] the baseline's structural CV (NaN: no baseline for the layer)
    drift_jsd: np.ndarray | None = None  # [L] JS divergence (bits) from the baseline's load (NaN: none)
    drift_noise: np.ndarray | None = None  # [L] what sampling noise gives against the baseline (NaN: none)
    hot_reference: tuple[str, ...] = ()  # [L] what ``hot`` is against: baseline, learned, learning or fair
    # (and imbalance, collapse and dead: the layer's reference kind)
    reference_cv: np.ndarray | None = None  # [L] the reference's structural CV (NaN: none yet)
    reference_top: np.ndarray | None = None  # [L] the reference's top share (NaN: none yet)
    dead_holding: np.ndarray | None = None  # [L] zero-slot experts at the dead page's clear level

    def extremes(self, k: int) -> list[list[int]]:
        """Per layer, the ids of the ``k`` hottest then the ``k`` coldest experts (ties: lower id first;
        an expert in both is listed once)."""
        out = []
        for row in self.slots:
            hot = np.argsort(-row, kind="stable")[:k]
            cold = np.argsort(row, kind="stable")[:k]
            out.append(list(dict.fromkeys([*hot.tolist(), *cold.tolist()])))
        return out

    def hot_experts(self, k: int) -> list[list[tuple[int, float]]]:
        """Per layer, up to ``k`` (expert, hot factor) with a finite factor, highest first (ties: lower id)."""
        return [[] for _ in self.layers] if self.hot is None else judge.top_factors(self.hot, k)


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
        self.draw_bin_s = max(1.0, window_s / DRAW_BINS)
        self.draws = sampling.Draws.zeros(n, n_experts)
        self.n_draws = 0
        self._draw_bins: collections.deque[_DrawBin] = collections.deque()
        # Bins leave the window as new ones open: their arrays are zeroed and reused, and the window's worth is
        # allocated here, so the exporter's memory is flat from its first second (a window filling up over its
        # first minute, ~16 MB at 58 x 256, read as a young process' memory trend).
        self._spare_bins: list[_Bin] = [self._new_bin() for _ in range(int(math.ceil(window_s)) + 2)]
        self._spare_draws: list[sampling.Draws] = [sampling.Draws.zeros(n, n_experts) for _ in range(DRAW_BINS + 2)]
        for d in self._spare_draws:  # written once: calloc'd pages count in RSS only when first touched
            for name in ("draws", "slots", "slots_sq", "counts", "counts_sq", "cross"):
                getattr(d, name).fill(0)

    def _new_bin(self) -> _Bin:
        n, e = len(self.layers), self.n_experts
        b = _Bin(-1, np.empty((n, e), np.int64), np.empty(n, np.int64), np.empty(n), np.empty(n))
        for a in (b.slots, b.tokens, b.entropy, b.margin):
            a.fill(0)  # touched now: the window's memory is resident from the start
        return b

    def _bin(self, second: int) -> _Bin:
        if not self._bins or self._bins[-1].second != second:
            self.prune(second)
            b = self._spare_bins.pop() if self._spare_bins else self._new_bin()
            b.second = second
            self._bins.append(b)
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

    def add_draws(self, second: float, per_draw: np.ndarray) -> None:
        """Finished draws' slots [R, L, E] (rows in ``self.layers`` order), counted in the draw bin of
        ``second`` (callers hold the state's lock)."""
        if not len(per_draw):
            return
        index = int(second // self.draw_bin_s)
        if not self._draw_bins or self._draw_bins[-1].index != index:
            self.prune(int(second))
            spare = self._spare_draws.pop() if self._spare_draws else sampling.Draws.zeros(len(self.layers),
                                                                                          self.n_experts)
            self._draw_bins.append(_DrawBin(index, spare, 0))
        d = sampling.Draws.of(per_draw)
        b = self._draw_bins[-1]
        b.draws.add(d)
        b.n += len(per_draw)
        self.draws.add(d)
        self.n_draws += len(per_draw)

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
        self._spare_bins, self._spare_draws = [], []  # rare: spares are allocated anew at the new size
        for d in [self.draws, *(b.draws for b in self._draw_bins)]:
            for name in ("draws", "slots", "slots_sq"):
                setattr(d, name, np.append(getattr(d, name), 0.0))
            for name in ("counts", "counts_sq", "cross"):
                setattr(d, name, np.vstack([getattr(d, name), np.zeros((1, e))]))

    def prune(self, now_second: int) -> None:
        while self._bins and self._bins[0].second <= now_second - self.window_s:
            b = self._bins.popleft()
            self.slots -= b.slots
            self.tokens -= b.tokens
            self.entropy -= b.entropy
            self.margin -= b.margin
            if len(b.slots) == len(self.layers):
                for a in (b.slots, b.tokens, b.entropy, b.margin):
                    a[...] = 0
                self._spare_bins.append(b)
        if not self._bins:  # no float residue from add/subtract
            self.entropy[:] = 0.0
            self.margin[:] = 0.0
        while self._draw_bins and self._draw_bins[0].index * self.draw_bin_s <= now_second - self.window_s:
            db = self._draw_bins.popleft()
            self.draws.add(db.draws, -1.0)
            self.n_draws -= db.n
            if len(db.draws.draws) == len(self.layers):
                for name in ("draws", "slots", "slots_sq", "counts", "counts_sq", "cross"):
                    getattr(db.draws, name)[...] = 0
                self._spare_draws.append(db.draws)
        if not self._draw_bins:
            self.draws = sampling.Draws.zeros(len(self.layers), self.n_experts)

    def snapshot(self) -> "RoutingWindow":
        """A copy of the window's running sums, taken under the state's lock (one [L, E] array, the draws' six
        sums and a few [L] ones: a copy, no arithmetic) so that ``gauges`` and ``LearnedReference.update`` read it
        after the lock is released: a scrape's judgement never holds the lock the engine's thread takes on every
        step. The copy has no bins: read it, never add to or prune it."""
        snap = RoutingWindow.__new__(RoutingWindow)
        snap.layers, snap.n_experts, snap.window_s = self.layers, self.n_experts, self.window_s
        snap.row = dict(self.row)
        snap.slots, snap.tokens = self.slots.copy(), self.tokens.copy()
        snap.entropy, snap.margin = self.entropy.copy(), self.margin.copy()
        snap.draw_bin_s = self.draw_bin_s
        snap.draws = self.draws.rows(np.arange(len(self.draws.draws)))  # (fancy indexing: copies)
        snap.n_draws = self.n_draws
        snap._bins, snap._draw_bins = collections.deque(), collections.deque()
        snap._spare_bins, snap._spare_draws = [], []
        return snap

    def gauges(self, profile: Any = None, t: thresholds.Thresholds = thresholds.DEFAULT,
               learned: "LearnedReference | None" = None) -> LayerGauges:
        """The window gauges of every layer that routed tokens in the window (callers hold the lock, or read a
        ``snapshot``): the judged
        ones are ``moescope.judge``'s (every view judges through it). ``profile``: the loaded baseline
        (``analysis.baseline.Profile``), the reference of the hot, dead and drift judgements where it has the
        layer; else the fair share (hot) and ``t.dead_reference`` (dead). ``learned``: without a baseline, the hot
        test's reference learned from this window's own past (``LearnedReference``; None: the fair share)."""
        keep = np.nonzero(self.tokens > 0)[0]
        slots = self.slots[keep].astype(np.float64)  # [L, E]
        tokens = self.tokens[keep].astype(np.float64)
        e = self.n_experts
        layers = tuple(self.layers[i] for i in keep.tolist())
        draws = self.draws.rows(keep)
        j = judge.judge_window(slots, draws, layers, baseline=profile, t=t, tokens=tokens,
                               family_layers=len(self.layers),
                               learned=None if learned is None else learned.rows(keep, len(self.layers)))
        mean = slots.sum(1) / max(1, e)
        rel = slots / np.where(mean > 0, mean, 1.0)[:, None]
        relative = np.stack([(rel <= le).sum(1) for le in RELATIVE_LOAD_BUCKETS], axis=1) if len(keep) else \
            np.zeros((0, len(RELATIVE_LOAD_BUCKETS)))
        base_cv = j.baseline_cv if j.baseline_cv is not None else np.full(len(keep), np.nan)
        drift = j.jsd if j.jsd is not None else np.full(len(keep), np.nan)
        drift_noise = j.drift_noise if j.drift_noise is not None else np.full(len(keep), np.nan)
        return LayerGauges(
            layers=layers, slots=slots, tokens=tokens, cv=j.cv, noise_cv=j.noise_cv, excess_cv=j.excess_cv,
            max_over_mean=j.max_over_mean, top_share=j.top_share,
            dead=(slots == 0).sum(1).astype(np.float64), slots_per_expert=mean,
            entropy=self.entropy[keep] / tokens, margin=self.margin[keep] / tokens, relative=relative,
            draws=j.draws, window_draws=int(self.n_draws), dead_unexpected=j.dead, hot=j.hot_factor,
            baseline=j.has_baseline, baseline_cv=base_cv, drift_jsd=drift, drift_noise=drift_noise,
            hot_reference=tuple(j.hot_reference), reference_cv=j.reference_cv, reference_top=j.reference_top,
            dead_holding=j.dead_holding)


@dataclass(frozen=True)
class LearnedRows:
    share: np.ndarray  # [L, E] learned draw shares (rows of the judged layers)
    has: np.ndarray  # [L] bool: learned from at least one full window
    cv: np.ndarray  # [L] learned excess CV (the layer's structure: the imbalance rule's reference)
    top: np.ndarray  # [L] learned top share (the collapse rule's reference)


class LearnedReference:
    """The routing judgements' reference where no baseline was saved (hot, and issue [learned]: imbalance, collapse
    and dead experts): the routing this deployment's own traffic
    showed (issue [judge]: a fixed multiple of 1/E pages a model's popular experts on narrow traffic, 4-5x
    theirs is common at 384 experts). A page then means an expert's share rose beyond ``hot_factor`` times what
    it was, never that the model has popular experts.

    - Learning: a layer's reference is the draw shares (``sampling.draw_shares``, the shares the hot test
      judges) of the first full window (``window_s`` after the first scrape that saw routing) with at least
      ``sampling.MIN_DRAWS`` draws; until then the layer's hot factors are against the fair share and labelled
      "learning": views name them, the alert does not page them.
    - Updating: once per window, an exponential average of each expert's window share with a half-life of
      ``Thresholds.learn_half_life_windows`` windows, so gradual changes of the traffic mix are absorbed while a
      change that pages is not: an expert over the hot bar keeps its reference (it would otherwise absorb its
      own fault and resolve while it persists). ``moescope baseline save`` replaces all of it with the user's.
    - The layer's structure: its excess CV and top share, learned from the same window and followed the same way,
      except while the layer is over the imbalance or collapse bar they set (``Thresholds.imbalance_bar_of``,
      ``collapse_bar``): the imbalance and collapse rules' reference, so an uneven layer that was uneven from the
      start is information ("uneven by design/traffic"), and a change pages.
    - Memory: one [L, E] float array (the window's own size), flat for days.
    """

    def __init__(self, n_layers: int, n_experts: int, window_s: float, half_life_windows: float) -> None:
        self.share = np.zeros((n_layers, n_experts))
        self.has = np.zeros(n_layers, dtype=bool)
        self.cv = np.zeros(n_layers)
        self.top = np.zeros(n_layers)
        self.window_s = window_s
        self.alpha = 1.0 - 2.0 ** (-1.0 / half_life_windows)
        self.started: float | None = None
        self.next_at: float | None = None
        self.updates = 0  # windows folded in (the first one included)

    def _fit(self, n_layers: int) -> None:
        if len(self.share) < n_layers:  # the window grew a layer
            extra = n_layers - len(self.share)
            self.share = np.vstack([self.share, np.zeros((extra, self.share.shape[1]))])
            self.has = np.append(self.has, np.zeros(extra, dtype=bool))
            self.cv, self.top = np.append(self.cv, np.zeros(extra)), np.append(self.top, np.zeros(extra))

    def rows(self, keep: np.ndarray, n_layers: int) -> LearnedRows:
        self._fit(n_layers)
        return LearnedRows(self.share[keep], self.has[keep], self.cv[keep], self.top[keep])

    def update(self, now: float, window: RoutingWindow, g: LayerGauges, hot_factor: float,
               t: thresholds.Thresholds = thresholds.DEFAULT) -> None:
        """Fold the window in if a window has passed since the last fold (``window``: the state's ``snapshot``,
        read under its ``judge_lock``).
        ``g``: the gauges just judged against this reference (its experts over ``hot_factor`` keep theirs; a layer
        over its imbalance or collapse bar keeps its learned CV and top share)."""
        if self.started is None or self.next_at is None:  # (both set together, at the first window with draws)
            if window.n_draws > 0:
                self.started, self.next_at = now, now + self.window_s
            return
        if now < self.next_at:
            return
        self.next_at = now + self.window_s
        n = len(window.layers)
        self._fit(n)
        ok = window.draws.draws >= sampling.MIN_DRAWS
        shares = sampling.draw_shares(window.draws)
        over = np.zeros_like(self.share, dtype=bool)
        cv, top = np.full(n, np.nan), np.full(n, np.nan)  # this window's, where judged
        changed = np.zeros(n, dtype=bool)  # over the bar its learned CV or top share sets
        if len(g.layers):
            rows = np.array([window.row[layer] for layer in g.layers])
            if g.hot is not None:
                with np.errstate(invalid="ignore"):
                    over[rows] = np.nan_to_num(g.hot, nan=0.0) > hot_factor
            cv[rows], top[rows] = g.excess_cv, g.top_share
            for r in rows[self.has[rows]].tolist():
                changed[r] = bool(cv[r] > t.imbalance_bar_of("learned", float(self.cv[r]))
                                  or top[r] > t.collapse_bar("learned", float(self.top[r])))
        ok &= np.isfinite(cv) & np.isfinite(top)
        first = ok & ~self.has
        later = ok & self.has
        self.share[first] = shares[first]
        self.cv[first], self.top[first] = cv[first], top[first]
        blend = (1.0 - self.alpha) * self.share + self.alpha * shares
        self.share[later] = np.where(over[later], self.share[later], blend[later])
        follow = later & ~changed
        self.cv[follow] = (1.0 - self.alpha) * self.cv[follow] + self.alpha * cv[follow]
        self.top[follow] = (1.0 - self.alpha) * self.top[follow] + self.alpha * top[follow]
        self.has |= ok
        self.updates += 1
