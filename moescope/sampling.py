"""Sampling noise of routing windows, with requests as the independent draws.

A window's expert load is a sample of the traffic. Its slots are not independent draws: the tokens of one
request route alike (same domain, same prompt), so a window of three requests says about as much as three
draws, whatever its slot count. The multinomial bound (slots as independent draws) is therefore only a floor;
the noise moescope judges by is the *cluster-robust* (sandwich) variance of each expert's share, with the
request as the cluster:

    p_e = sum_r c_re / sum_r n_r                       (c_re: request r's slots on expert e; n_r = sum_e c_re)
    Var(p_e) = R / (R - 1) * sum_r (c_re - p_e n_r)^2 / (sum_r n_r)^2

computed from six running sums per layer (``Draws``), so a window never keeps a request's vector. Where the
unit cannot be a request (an instrumented HF model without request ids), a forward pass is the draw: a batch
routes alike too.

From ``Var(p_e)``:
- ``noise_cv``: E[CV^2] = CV_structural^2 + E * sum_e Var(p_e), so the noise part of the load CV is
  ``sqrt(E * sum_e Var(p_e))``, raised to the chi-square's upper quantile at the normal tail of ``z``, with
  ``df = min(E, R) - 1`` degrees of freedom (Wilson-Hilferty: a factor ``(1 - a + z sqrt(a))^3``, a = 2/(9 df);
  ``1 + z sqrt(2 / df)`` at large df, but the chi-square's right skew at small df, where mean + z sd is only
  its ~99% quantile at df 7). With independent slots (df = E - 1) this is exactly the multinomial bound, which
  stays the floor.
- ``excess_cv``: ``sqrt(max(0, cv^2 - noise_cv^2))``, the structure beyond noise (NaN: not judged).
- ``hot``: an expert's window share over its reference share (the baseline's, else the fair share 1/E), kept
  only where the excess over the reference is significant at a Bonferroni ``z`` for all L x E experts.
- ``dead``: a zero-slot expert is evidence only where its reference share predicts at least
  ``min_expected`` slots after dividing by the design effect (the cluster variance over the multinomial one).
- ``drift_noise_bits``: the Jensen-Shannon divergence sampling alone gives a window against its reference,
  ``sum_e Var(p_e) / (8 m_e ln 2)`` (the second-order expansion of JSD), at the same chi-square bound.

All functions take arrays with a leading layer axis ([L, E] and [L]); docs/metrics.md has the formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

# Fewer draws than this: no variance to estimate (one request is one draw); the window is not judged.
MIN_DRAWS = 2


@dataclass
class Draws:
    """Running sums over the draws (requests) of a window, per layer: ``draws`` [L], ``slots`` [L] (sum n_r),
    ``slots_sq`` [L] (sum n_r^2), ``counts`` [L, E] (sum c_re), ``counts_sq`` [L, E] (sum c_re^2), ``cross``
    [L, E] (sum n_r c_re). Add and subtract whole draws; every array float64."""

    draws: np.ndarray
    slots: np.ndarray
    slots_sq: np.ndarray
    counts: np.ndarray
    counts_sq: np.ndarray
    cross: np.ndarray

    @classmethod
    def zeros(cls, n_layers: int, n_experts: int) -> "Draws":
        z = np.zeros
        return cls(z(n_layers), z(n_layers), z(n_layers), z((n_layers, n_experts)), z((n_layers, n_experts)),
                   z((n_layers, n_experts)))

    @classmethod
    def of(cls, per_draw: np.ndarray) -> "Draws":
        """From per-draw counts [R, L, E] (a draw with no slot in a layer is not a draw of that layer)."""
        c = np.asarray(per_draw, dtype=np.float64)
        n = c.sum(2)  # [R, L]
        return cls((n > 0).sum(0).astype(np.float64), n.sum(0), (n * n).sum(0), c.sum(0), (c * c).sum(0),
                   (n[:, :, None] * c).sum(0))

    def add(self, other: "Draws", sign: float = 1.0) -> None:
        for name in ("draws", "slots", "slots_sq", "counts", "counts_sq", "cross"):
            getattr(self, name).__iadd__(sign * getattr(other, name))

    def padded(self, n_layers: int) -> "Draws":
        """These sums with zero rows appended up to ``n_layers`` layers (a layer found after they began)."""
        extra = n_layers - len(self.draws)
        if extra <= 0:
            return self
        e = self.counts.shape[1]
        z = Draws.zeros(extra, e)
        return Draws(*(np.concatenate([getattr(self, f), getattr(z, f)]) for f in
                       ("draws", "slots", "slots_sq", "counts", "counts_sq", "cross")))

    def rows(self, idx) -> "Draws":
        return Draws(self.draws[idx], self.slots[idx], self.slots_sq[idx], self.counts[idx], self.counts_sq[idx],
                     self.cross[idx])

    def share_var(self) -> np.ndarray:
        """[L, E] variance of each expert's share, cluster-robust, floored by the multinomial p(1-p)/N; NaN
        where the layer has fewer than ``MIN_DRAWS`` draws."""
        r, n = self.draws[:, None], self.slots[:, None]
        ok = (r >= MIN_DRAWS) & (n > 0)
        safe_n = np.where(n > 0, n, 1.0)
        p = self.counts / safe_n
        resid = np.maximum(self.counts_sq - 2 * p * self.cross + p * p * self.slots_sq[:, None], 0.0)
        cluster = np.where(r > 1, r / np.maximum(r - 1, 1), 0.0) * resid / (safe_n * safe_n)
        var = np.maximum(cluster, p * (1 - p) / safe_n)
        return np.where(ok, var, np.nan)

    def design_effect(self) -> np.ndarray:
        """[L] the cluster variance of the shares over the multinomial one (1: slots as good as independent;
        NaN: not judged)."""
        r, n = self.draws[:, None], self.slots[:, None]
        safe_n = np.where(n > 0, n, 1.0)
        p = self.counts / safe_n
        multi = (p * (1 - p) / safe_n).sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            d = self.share_var().sum(1) / multi
        return np.where((r[:, 0] >= MIN_DRAWS) & (multi > 0), np.maximum(d, 1.0), np.nan)


def _df(n_experts: int, draws: np.ndarray) -> np.ndarray:
    return np.maximum(np.minimum(n_experts, draws) - 1, 1)


def chi2_bound(df, z: float):
    """The upper quantile of a chi-square with ``df`` degrees of freedom at the normal tail of ``z``, over its
    mean (Wilson-Hilferty; within 3% of the exact quantile at df >= 3, z = 3)."""
    a = 2 / (9 * np.asarray(df, dtype=np.float64))
    return np.maximum(1 - a + z * np.sqrt(a), 0.0) ** 3


def multinomial_noise_cv(n_experts: int, slots, z: float):
    """The load CV that noise alone stays under (the chi-square quantile of ``chi2_bound``) when ``slots`` slots
    are routed uniformly and independently over ``n_experts`` experts: ``sqrt((E - 1) chi2_bound(E - 1, z) /
    N)``; inf without slots."""
    slots = np.asarray(slots, dtype=np.float64)
    if n_experts < 2:
        return np.zeros_like(slots)
    e1 = n_experts - 1
    with np.errstate(divide="ignore"):
        return np.where(slots > 0, np.sqrt(e1 * float(chi2_bound(e1, z)) / np.where(slots > 0, slots, 1)), np.inf)


def scaled_var(draws: Draws, window_slots: np.ndarray) -> np.ndarray:
    """[L, E] share variance for a window of ``window_slots`` slots per layer: the draws' variance scaled by
    their slots over the window's (variance falls as 1/draws; in-flight requests are draws of the same kind)."""
    w = np.asarray(window_slots, dtype=np.float64)
    ratio = np.where(w > 0, draws.slots / np.where(w > 0, w, 1.0), np.nan)
    return draws.share_var() * ratio[:, None]


def noise_cv(n_experts: int, window_slots, draws: Draws | None, z: float) -> np.ndarray:
    """[L] the load CV sampling noise stays under: the cluster bound where the window has draws, never below
    the multinomial bound; NaN where fewer than ``MIN_DRAWS`` draws (not judged). Without ``draws`` at all
    (no request information), the multinomial bound."""
    w = np.asarray(window_slots, dtype=np.float64)
    multi = multinomial_noise_cv(n_experts, w, z)
    if draws is None:
        return multi
    var = scaled_var(draws, w).sum(1) * n_experts
    cluster = np.sqrt(var * chi2_bound(_df(n_experts, draws.draws), z))
    return np.where(np.isnan(cluster), np.nan, np.maximum(cluster, multi))


def excess_cv(cv, noise) -> np.ndarray:
    """The load CV beyond sampling noise, ``sqrt(max(0, cv^2 - noise^2))``; NaN where noise is (not judged)."""
    cv, noise = np.asarray(cv, dtype=np.float64), np.asarray(noise, dtype=np.float64)
    out = np.sqrt(np.maximum(0.0, cv * cv - np.where(np.isfinite(noise), noise, 0.0) ** 2))
    return np.where(np.isfinite(noise), out, np.nan)


def family_z(n_tests: int, alpha: float) -> float:
    """The one-sided z at which ``n_tests`` tests together false-alarm with probability ``alpha`` (Bonferroni)."""
    return NormalDist().inv_cdf(1 - alpha / max(1, n_tests))


def normalised(load) -> np.ndarray:
    """Each row of ``load`` [..., E] over its sum: shares (1/E for a row without load)."""
    load = np.asarray(load, dtype=np.float64)
    s = load.sum(-1, keepdims=True)
    return np.where(s > 0, load / np.where(s > 0, s, 1.0), 1.0 / load.shape[-1])


def reference_shares(n_experts: int, baseline: np.ndarray | None, n_layers: int) -> np.ndarray:
    """[L, E] each expert's reference share: the baseline's where given (rows normalised), else 1/E."""
    if baseline is None:
        return np.full((n_layers, n_experts), 1.0 / n_experts)
    return normalised(baseline)


def var_upper(draws, z: float):
    """The factor a variance estimated from ``draws`` draws (``draws - 1`` degrees of freedom) may understate
    the true one by, at ``z``: ``df / chi2_lower(df)`` (Wilson-Hilferty); inf where the lower quantile is 0 (too
    few draws to bound it). A per-expert variance from five requests can be near zero by chance (the few
    requests that used the expert happened to agree): judging against it paged on healthy traffic."""
    df = np.maximum(np.asarray(draws, dtype=np.float64) - 1, 0)
    a = 2 / (9 * np.where(df > 0, df, 1.0))
    lower = np.maximum(1 - a - z * np.sqrt(a), 0.0) ** 3
    with np.errstate(divide="ignore"):
        return np.where((df > 0) & (lower > 0), 1 / np.where(lower > 0, lower, 1.0), np.inf)


def hot_reference(n_experts: int, baseline_share: np.ndarray | None, n_layers: int) -> np.ndarray:
    """[L, E] the share a hot expert is measured against: its baseline share, never below the fair share 1/E
    (an expert the baseline left nearly idle is not hot at its fair share), or 1/E without a baseline."""
    fair = np.full((n_layers, n_experts), 1.0 / n_experts)
    return fair if baseline_share is None else np.maximum(np.asarray(baseline_share, dtype=np.float64), fair)


def draw_shares(draws: Draws) -> np.ndarray:
    """[L, E] each expert's share over the finished draws (the sample their variance describes)."""
    n = draws.slots[:, None]
    return draws.counts / np.where(n > 0, n, 1.0)


def hot_sd(draws: Draws, z: float) -> np.ndarray:
    """[L, E] the standard deviation a hot-expert test allows each share: the cluster-robust variance (never
    below the multinomial one) times its small-sample upper bound (``var_upper`` at ``z``, as a t-test's
    quantile grows with few draws); NaN where not judged, inf where too few draws."""
    # No pooled (layer design effect) floor: an expert every request uses alike (a biased router) has a small
    # variance of its own, and the layer's other, clustered experts would hide it (a 4x expert at tiny-demo went
    # unseen under a pooled design effect of 20). The small-sample bound covers a variance that is small by chance.
    with np.errstate(invalid="ignore"):
        return np.sqrt(draws.share_var() * var_upper(draws.draws, z)[:, None])


def hot_factor(window: np.ndarray, draws: Draws, ref: np.ndarray, z: float, z_var: float = 3.0) -> np.ndarray:
    """[L, E] share / reference share (``hot_reference``) of the experts whose share over the window's finished
    draws is significantly above the reference: by ``z`` (the family's) standard deviations of ``hot_sd`` (at
    ``z_var``); NaN elsewhere and where the layer is not judged. ``window`` is unused (kept for callers that
    judge a window of slots: the share comes from the draws, so that share and variance describe one sample)."""
    share = draw_shares(draws)
    sd = hot_sd(draws, z_var)
    with np.errstate(invalid="ignore", divide="ignore"):
        factor = share / ref
        significant = (share - ref) > z * sd
    return np.where(significant & (ref > 0), factor, np.nan)


def dead_mask(window: np.ndarray, draws: Draws, ref: np.ndarray, min_expected: float, z_var: float = 3.0):
    """[L, E] experts with no slot in the window whose reference share predicts at least ``min_expected``
    effective slots: expected slots / (design effect x its small-sample upper bound ``var_upper``); Poisson
    P(0) = exp(-min_expected). False where the layer is not judged."""
    window = np.asarray(window, dtype=np.float64)
    n = window.sum(1)
    deff = draws.design_effect() * var_upper(draws.draws, z_var)
    ok = np.isfinite(deff)
    expected = ref * n[:, None] / np.where(ok, deff, 1.0)[:, None]
    return (window == 0) & (expected >= min_expected) & ok[:, None]


def dead_unexpected(window: np.ndarray, draws: Draws, ref: np.ndarray, min_expected: float,
                    z_var: float = 3.0) -> np.ndarray:
    """[L] how many experts ``dead_mask`` holds; NaN where not judged."""
    ok = np.isfinite(draws.design_effect() * var_upper(draws.draws, z_var))
    return np.where(ok, dead_mask(window, draws, ref, min_expected, z_var).sum(1).astype(np.float64), np.nan)


def drift_noise_bits(window: np.ndarray, draws: Draws, ref: np.ndarray, z: float) -> np.ndarray:
    """[L] the JS divergence (bits) between a window and its reference that sampling noise stays under:
    ``sum_e Var(p_e) / (8 m_e ln 2)`` with m the midpoint of the two shares, at the chi-square bound; NaN where
    not judged."""
    window = np.asarray(window, dtype=np.float64)
    n = window.sum(1)
    share = window / np.where(n > 0, n, 1.0)[:, None]
    var = scaled_var(draws, n)
    m = np.maximum((share + ref) / 2, 1e-12)
    e = window.shape[1]
    return (var / m).sum(1) / (8 * math.log(2)) * chi2_bound(_df(e, draws.draws), z)
