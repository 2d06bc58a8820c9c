"""The thresholds object: every bar moescope judges a deployment by. One object for every model.

One source for every bar: ``Thresholds.bars`` computes each judgement's bar and clear bar once, per layer and per
model; the exporter exports them (``moescope_judgement_bar``, ``moescope_judgement_clear_bar``), the alert rules
(``moescope/alerts/rules.py``) compare their quantities with those series and hold no number of their own, the
dashboards draw them, and ``moescope top``, ``moescope diagnose``, ``report`` and the demo's summary judge with the
same values. A bar written anywhere else would drift.

No bar here belongs to a model, and none was placed between a healthy and a faulty run. What depends on the
deployment comes from three places, never from a model's name:
- the model's config: experts E, top-k, layers L (the noise floor's degrees of freedom, the Bonferroni z for
  L x E experts, the expected activation ratio);
- the traffic's own sampling noise, with requests as the independent draws (``moescope.sampling``), exported
  as gauges (``moescope_expert_load_cv_noise_ratio``, ``moescope_routing_drift_noise_bits``, ...);
- the user's own healthy baseline (``moescope baseline save``), which the exporter exports as series
  (``moescope_baseline_load_cv_ratio``, ``moescope_baseline_expert_share_ratio``) and judges each layer against:
  its bars are the baseline's, one rule expression for every model.

What stays here is model-independent: z-scores, factors and SLO-like limits, each with its meaning beside it.
Every routing judgement is a change from a reference (issue [learned]): the baseline, else the reference the
exporter learns from its own first window (``learn_half_life_windows``), else (``--hot-reference fair``, asked
for) uniform routing; only the collapse ceiling pages without one (``collapse_top_share``); views say so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moescope import sampling

# Views colour a value "warn" from this fraction of the way to its bar (dashboards' yellow, top's warn).
WARN_FRACTION = 2 / 3

# -- the judgements whose bars are series (``Thresholds.bars``) -------------------------------------------------
# Per layer: moescope_judgement_bar{judgement, layer, reference} (the reference label on the judgements judged
# against the layer's reference), and moescope_judgement_clear_bar where a firing page holds until a clear bar.
LAYER_JUDGEMENTS = ("imbalance", "collapse", "hot", "dead", "drift", "rank_load", "flips", "drops", "cache")
CLEARED = ("imbalance", "collapse", "hot", "dead", "drift", "rank_load", "flips")
REFERENCED = ("imbalance", "collapse", "hot", "dead", "drift")
# Per model (no layer label): activation floor, all-to-all p99, expert fetch p99, a slow rank's share of the wait
# and its wait per dispatch, process memory capacity
MODEL_JUDGEMENTS = ("activation", "all_to_all", "fetch", "slow_rank_share", "slow_rank_wait", "memory")
JUDGED_KINDS = ("baseline", "learned", "fair")  # the references imbalance and dead experts are judged against
KINDS = (*JUDGED_KINDS, "learning")  # "learning": no reference yet (collapse only over its ceiling, hot not paged)


@dataclass(frozen=True)
class Bars:
    """Every bar of L layers and of the model (``Thresholds.bars``). NaN: the layer has no such bar (not
    judged)."""

    bar: dict[str, np.ndarray]  # judgement -> [L] the value over which the judgement fires (under: cache floor)
    clear: dict[str, np.ndarray]  # judgement -> [L] the value a firing page holds over (``CLEARED``)
    reference: tuple[str, ...]  # [L] each layer's reference kind (the ``reference`` label)
    model: dict[str, float]  # judgement -> the model's bar (``MODEL_JUDGEMENTS``; activation where known)

    def layer(self, i: int) -> dict[str, float]:
        """Row ``i``'s bars by judgement."""
        return {name: float(v[i]) for name, v in self.bar.items()}

    def rows(self, layers: Sequence, clear: bool = False) -> list[tuple[tuple[str, ...], float]]:
        """The exported series: ((judgement, layer, reference), value) for every finite bar (``clear``: the clear
        bars), the labels that do not apply left out: (judgement, layer) where no reference judges the bar,
        (judgement,) for the model's bars. ``layers``: [L] ids."""
        values = self.clear if clear else self.bar
        out = [((name, str(layer), kind) if name in REFERENCED else (name, str(layer)), x)
               for name, v in values.items() for layer, kind, x in zip(layers, self.reference, v.tolist())
               if math.isfinite(x)]
        return out if clear else out + [((name,), x) for name, x in self.model.items()]


@dataclass(frozen=True)
class Thresholds:
    """The bars. Rates and shares are per window (the exporter's, 60 s by default).

    ``for_scale`` shrinks every alert ``for`` (end-to-end tests: 10m -> 20s at 1/30, keeping production's order).
    """

    # -- noise -------------------------------------------------------------------------------------------
    # A window-level judgement (one gauge per layer) counts as noise up to NOISE_Z deviations of its noise:
    # healthy routing exceeds it about once in a thousand windows.
    noise_z: float = 3.0
    # Per-expert judgements (hot, dead) test L x E experts at once: the z is Bonferroni's for this
    # family-wide false-alarm probability per window (``hot_z``), from the model's L and E.
    family_alpha: float = 0.001

    # -- routing -----------------------------------------------------------------------------------------
    # Imbalance, the load CV beyond sampling noise (``excess_cv``):
    # - without a baseline: an excess CV of 1, the load's spread as wide as its mean (e.g. half the experts
    #   idle and the other half at twice their fair share: half the expert capacity doing nothing). A model's
    #   own healthy structure (untrained or specialised routers: ~0.3-0.4 on the bundled shapes) stays under it;
    # - with a baseline: the structure grew by half over the baseline's own structural CV, and by at least
    #   0.1 (so a near-uniform baseline is not judged on relative changes of nothing).
    imbalance_cv: float = 1.0
    imbalance_baseline_factor: float = 1.5
    imbalance_baseline_margin: float = 0.1
    # A hot expert: its window share at least 4x its reference share (the baseline's, else 1/E), and
    # significantly above the reference. 4x: one expert doing the work of four; on an expert-parallel rank
    # holding 8 experts it alone adds 3/8 to the rank's load, which every all-to-all then waits for.
    # An expert takes at most one slot per token, so its share is at most 1/k: against the fair share a factor
    # over E/k cannot happen, and where E/k <= 4 (8 experts, top-2) the collapse bar (3 of 4 tokens on one
    # expert, a factor of 0.75 E/k) is the hot-expert alert's role; against a baseline share it can fire anywhere.
    hot_factor: float = 4.0
    # Without a saved baseline the hot reference is learned from the deployment's own windows
    # (``metrics.window.LearnedReference``) and follows the traffic with this half-life, in windows: 30 windows
    # (30 min at 60 s) is six times the hot alert's 5 min ``for``, so a jump is paged long before it could be
    # absorbed (an expert over the bar is not absorbed at all), while a mix that shifts over hours is followed.
    learn_half_life_windows: float = 30.0
    # Ranks of an expert-parallel placement: the busiest rank's load over the mean (TensorRT-LLM's
    # straggler factor; EPLB's objective). 1.5: the other ranks idle a third of every dispatch.
    rank_max_over_mean: float = 1.5
    # Hysteresis of the ratio pages (hot factor, rank max/mean): a firing page holds until its value falls back
    # this share of the way from its bar to 1 (the reference): 3.25x for the hot bar of 4, 1.375 for the rank bar
    # of 1.5 (``clear_bar``). A hot factor exported at all passed its test at the family z (4-5 at L x E in the
    # hundreds to tens of thousands), so near the bar its sd is at most (bar - 1) / z, under this quarter of the
    # way: a value hovering at the bar by noise keeps one page instead of firing and resolving.
    clear_fraction: float = 0.25
    # Collapse: the busiest expert's share of the routed tokens (the top share; k/E when balanced) jumped. Against
    # a reference (the baseline's top share, else the one learned from the deployment's first full window, else
    # k/E with ``--hot-reference fair``) the bar is ``collapse_bar``: half of the way from the reference to every
    # token (``collapse_rise``), and never under 3 tokens in 4 (``collapse_top_share``). A layer whose healthy top
    # share is 0.67 (a vLLM checkpoint's, issue [learned]) pages over 0.835, not at 0.75; a balanced layer (k/E
    # under 0.5) keeps the bar of 0.75.
    collapse_top_share: float = 0.75
    collapse_rise: float = 0.5
    # Absolute limit (no reference, or one learned from a start that was already collapsed): a learned or missing
    # reference counts as at most ``collapse_top_share``, so ``collapse_ceiling`` = collapse_bar(0.75) = 0.875,
    # one expert in 7 of every 8 tokens, pages whatever the learned reference says. Why this is no traffic's shape:
    # with top-k > 1 that expert holds 7/(8k) of the slots, so every other expert shares the remaining
    # (k - 7/8)/k, and a router that still chose by its input would have had to pick the same expert for 7 in 8 of
    # even a few fixed prompts' distinct tokens; with top-1 the layer has become one dense FFN for 7 in 8 tokens. A
    # saved baseline (a reference the user vetted as healthy) is not capped: its own top share sets the bar.
    # Imbalance and dead experts have no absolute limit: under top-1 routing of a few fixed prompts an excess CV of
    # several and most experts idle are the traffic (issue [learned]: 11 of 12 healthy layers paged at the old
    # no-baseline bar, 12 layers at the fair dead floor); they page only as a change from a reference (hot and
    # collapse cover the extremes without one).
    # Dead: an expert with no slot where its reference share predicts at least this many effective slots
    # (Poisson P(0) = e^-5 < 1%). Without a baseline the reference is this fraction of the fair share: an
    # expert getting under 1% of its fair share is as good as dead, so zero is evidence only at 500 slots per
    # expert (models keep a few nearly idle experts by design).
    dead_min_expected_slots: float = 5.0
    dead_floor_share: float = 0.01
    # Activation: observed / expected activation ratio (the config's): below 0.9 a tenth of the configured
    # expert compute is skipped (dropped slots, experts not computed). It cannot exceed 1 (top-k caps it).
    activation_floor: float = 0.9
    # A deterministic router flips nothing; the canary's flip ratio above 5% is nondeterminism.
    flip_ratio: float = 0.05
    # diagnose compares identical prefixes; it judges determinism from at least (2 - 1) / flip_ratio compared
    # positions (``flip_min_compared``: 20), so a ratio over the bar is at least two flipped positions, never one
    # tie in the numerics.
    flip_min_flips: int = 2
    # Drift: JS divergence from the baseline beyond its sampling noise (``drift_noise_bits``). 0.02 bits is
    # about 4% of the load moving to experts the baseline leaves idle (5% -> 0.025 bits, 10% -> 0.052).
    drift_bits: float = 0.02
    drop_ratio: float = 0.01  # dropped slots per routed token: 1% of the configured compute thrown away

    # -- expert cache --------------------------------------------------------------------------------------
    # A cache hitting less than half as often as a random choice of resident experts would (capacity / E)
    # is thrashing: its eviction order works against the routing.
    cache_floor_of_capacity: float = 0.5
    fetch_p99_s: float = 0.05  # p99 time to make an expert resident: 50 ms stalls a decode step visibly
    fetch_quantile: float = 0.99  # the alert's quantile: fetches slower than the bar exceed 1 - 0.99 of all
    # diagnose reads the share of slow fetches from forwards with misses: at least this many (fewer: no finding)
    fetch_min_forwards: int = 5

    # -- expert parallelism ----------------------------------------------------------------------------------
    all_to_all_p99_s: float = 0.002  # a healthy NVLink/IB exchange is well under 1 ms; raise on CPU deployments
    slow_rank_share: float = 0.5  # one peer's share of all the time ranks wait on peers ...
    slow_rank_wait_s: float = 0.005  # ... and how long a rank waits on it per dispatch exchange

    # -- memory -------------------------------------------------------------------------------------------
    memory_capacity_bytes: int = 24 * 2**30
    memory_horizon_s: int = 4 * 3600
    # The trend's window; a process without samples a window ago is too young to judge (start-up growth).
    memory_window_s: int = 1800
    # diagnose judges a trend from a trace store's steps, which may span seconds, not the alert's 30 minutes:
    # at least this many steps (a slope's standard error from fewer is itself unreliable) over at least this long
    # (a process' first seconds grow and shrink as allocator and caches warm); then as the alert (horizon and
    # capacity above), with the slope noise_z standard errors above zero.
    memory_min_points: int = 30
    memory_min_span_s: float = 10.0
    # diagnose: judge a memory trend beside the working set (KV-cache tokens held) only where time varies on
    # its own: the part of time's spread the tokens held do not follow, at least this share (0.1: time and
    # working set correlate at r < 0.995; beyond that a fitted split between them is arbitrary)
    memory_time_apart: float = 0.1

    for_scale: float | None = None

    # -- expert parallelism: is EPLB worth its rearrangements? (issue [eplb], ``eplb_worth``) --------------------
    # What one rearrangement costs, from vLLM's published figures: the step that rearranged took 3.17x a step
    # (vLLM #50647, Kimi K2 on 16 ranks: 2.17 step times more), and 16-21 s on DeepSeek-class models (#47206: the
    # lower end). Where a step's seconds are known the larger of the two, in step times, is the cost.
    eplb_rearrange_extra_steps: float = 2.17
    eplb_rearrange_seconds: float = 16.0

    # -- judgements (the same methods for every view) ------------------------------------------------------
    def hot_z(self, n_layers: int, n_experts: int) -> float:
        """The z at which L x E per-expert tests false-alarm with ``family_alpha`` per window together."""
        return sampling.family_z(n_layers * n_experts, self.family_alpha)

    def imbalance_bar(self, baseline_cv: float | None) -> float:
        """The excess load CV above which a layer is imbalanced: from its baseline's structural CV, else the
        no-baseline bar."""
        if baseline_cv is None or not math.isfinite(baseline_cv):
            return self.imbalance_cv
        return self.imbalance_baseline_factor * baseline_cv + self.imbalance_baseline_margin

    def dead_reference(self, n_experts: int) -> float:
        """Without a baseline, the share a living expert gets at least: ``dead_floor_share`` of 1/E."""
        return self.dead_floor_share / n_experts

    def cache_floor(self, capacity_ratio: float) -> float:
        """The hit rate below which a cache holding ``capacity_ratio`` of the experts thrashes."""
        return self.cache_floor_of_capacity * capacity_ratio

    def drift_bar(self, noise_bits: float | None) -> float:
        """The JS divergence from the baseline over which a layer drifted: what sampling noise gives, plus
        ``drift_bits`` (NaN without a noise estimate: not judged)."""
        if noise_bits is None or not math.isfinite(noise_bits):
            return math.nan
        return noise_bits + self.drift_bits

    def drifted(self, jsd_bits: float | None, noise_bits: float | None) -> bool:
        """Whether a divergence is over its ``drift_bar`` (the rule's comparison, not its own subtraction)."""
        bar = self.drift_bar(noise_bits)
        return jsd_bits is not None and math.isfinite(jsd_bits) and math.isfinite(bar) and jsd_bits > bar

    def flip_min_compared(self) -> int:
        """The identical-prefix positions ``diagnose`` needs before it judges determinism."""
        return math.ceil((self.flip_min_flips - 1) / self.flip_ratio)

    def mix_shifted(self, before: dict[str, float], after: dict[str, float], n_before: int, n_after: int) -> bool:
        """Whether a traffic mix (label -> share of requests) moved beyond sampling noise between two sets of
        requests: its total variation distance over half the sum of each label's two-sample z bound
        (``noise_z`` standard deviations of the difference of two proportions)."""
        if n_before < 1 or n_after < 1:
            return False
        tvd, bound = 0.0, 0.0
        for k in set(before) | set(after):
            a, b = before.get(k, 0.0), after.get(k, 0.0)
            p = (a * n_before + b * n_after) / (n_before + n_after)
            tvd += abs(b - a) / 2
            bound += self.noise_z * math.sqrt(p * (1 - p) * (1 / n_before + 1 / n_after)) / 2
        return tvd > bound

    def clear_bar(self, bar: float, reference: float = 1.0) -> float:
        """Where a firing page clears: ``clear_fraction`` of the way back from its bar towards ``reference``, the
        value the quantity has when nothing changed (1 for a ratio to its reference; the reference's own CV, top
        share, or 0 for the divergence beyond noise and the flip ratio)."""
        return bar - self.clear_fraction * (bar - reference)

    # -- the reference of the change judgements (imbalance, collapse, dead) --------------------------------------
    # A layer's routing is judged against its reference: "baseline" (the saved one), "learned" (from the
    # deployment's own first full window, followed slowly: ``learn_half_life_windows``), "fair" (uniform routing,
    # where the user asked for it: ``--hot-reference fair``), or "learning" (no reference yet: only the absolute
    # limits page).
    def imbalance_bar_of(self, kind: str, reference_cv: float | None) -> float:
        """The excess-CV bar of a layer judged against ``kind``: 1.5 x the reference's structural CV + 0.1
        (baseline or learned), ``imbalance_cv`` against the fair share, none (inf) while learning."""
        if kind == "fair":
            return self.imbalance_cv
        if kind in ("baseline", "learned") and reference_cv is not None and math.isfinite(reference_cv):
            return self.imbalance_bar(reference_cv)
        return math.inf

    def imbalance_clear(self, bar: float, reference_cv: float | None) -> float:
        """Where a firing imbalance page clears: a quarter of the way back from its bar to the reference's CV (0
        against the fair share)."""
        ref = reference_cv if reference_cv is not None and math.isfinite(reference_cv) else 0.0
        return self.clear_bar(bar, ref)

    def collapse_bar(self, kind: str, reference_top: float | None) -> float:
        """The top-share bar of a layer judged against ``kind`` (see ``collapse_top_share``): half way from the
        reference's top share to 1, at least ``collapse_top_share``; a learned or missing reference counts as at
        most ``collapse_top_share`` (so the bar is at most ``collapse_ceiling``)."""
        ref = self._collapse_reference(kind, reference_top)
        return max(self.collapse_top_share, ref + self.collapse_rise * (1.0 - ref))

    def _collapse_reference(self, kind: str, reference_top: float | None) -> float:
        """The top share a collapse is measured from: while learning (no reference) ``collapse_top_share`` (the
        bar is then the ceiling); a learned or fair one capped at it; a baseline's as it is; unknown: 0."""
        if kind == "learning":
            return self.collapse_top_share
        ref = reference_top if reference_top is not None and math.isfinite(reference_top) else 0.0
        return ref if kind == "baseline" else min(ref, self.collapse_top_share)

    @property
    def collapse_ceiling(self) -> float:
        """The absolute collapse limit: the bar a learned or missing reference cannot raise."""
        return self.collapse_bar("learning", None)

    def collapse_clear(self, bar: float, kind: str, reference_top: float | None) -> float:
        """Where a firing collapse page clears: a quarter of the way back from its bar to the reference's top
        share (capped as in ``collapse_bar``)."""
        return self.clear_bar(bar, self._collapse_reference(kind, reference_top))

    @property
    def dead_clear_expected_slots(self) -> float:
        """A firing dead-experts page holds while a zero-slot expert's reference predicts at least this many
        effective slots (a quarter of the way from 5 to 0: 3.75, Poisson P(0) = 2.4%)."""
        return self.clear_bar(self.dead_min_expected_slots, 0.0)

    def eplb_cost_steps(self, step_s: float | None = None) -> float:
        """One EPLB rearrangement in step times: vLLM's published cost (``eplb_rearrange_extra_steps``), or
        ``eplb_rearrange_seconds`` over a step's seconds where that is more."""
        by_time = self.eplb_rearrange_seconds / step_s if step_s and step_s > 0 else 0.0
        return max(self.eplb_rearrange_extra_steps, by_time)

    def eplb_gain_steps(self, static: float, eplb: float, interval_steps: int) -> float:
        """Step times EPLB saves per rearrangement interval against the static placement: each step's MoE time
        scales with its straggler factor (every layer waits on its busiest rank), so a step takes ``eplb /
        static`` of its static time at most (all of a step taken as MoE time: an upper bound of the gain)."""
        return interval_steps * (1.0 - eplb / static) if static > 0 else 0.0

    def eplb_beyond_noise(self, static: float, static_se: float, eplb: float, eplb_se: float) -> bool:
        """EPLB's straggler factor is below the static placement's by more than ``noise_z`` standard errors of the
        two (the sample's noise, taken as independent: conservative, both are measured on the same steps)."""
        if not all(math.isfinite(v) for v in (static, eplb)):
            return False
        noise = self.noise_z * math.hypot(static_se if math.isfinite(static_se) else 0.0,
                                          eplb_se if math.isfinite(eplb_se) else 0.0)
        return static - eplb > noise

    def eplb_worth(self, static: float, static_se: float, eplb: float, eplb_se: float, interval_steps: int,
                   step_s: float | None = None) -> bool:
        """EPLB is worth turning on when its gain is beyond the sample's noise (``eplb_beyond_noise``) and the step
        times it saves per interval exceed one rearrangement's (``eplb_cost_steps``)."""
        return self.eplb_beyond_noise(static, static_se, eplb, eplb_se) and \
            self.eplb_gain_steps(static, eplb, interval_steps) > self.eplb_cost_steps(step_s)

    # -- every bar as a series (issue [one-bar]) -----------------------------------------------------------------
    def bars(self, kinds: Sequence[str], reference_cv=None, reference_top=None, drift_noise=None, capacity=None,
             expected_activation: float | None = None) -> Bars:
        """Every bar and clear bar of L layers and of the model, computed once: the exporter exports them
        (``moescope_judgement_bar`` / ``moescope_judgement_clear_bar``), the alert rules compare their quantities
        with those series, and every view (``top``, ``diagnose``, ``report``, the demo's summary) judges with the
        values this returns. Per layer, never per expert.

        Args:
            kinds: [L] each layer's reference kind: "baseline", "learned", "fair", "learning" (no reference yet),
                or "" (no routing judged in this window: only the bars that need no reference).
            reference_cv: [L] the reference's structural (excess) CV; reference_top: [L] its top share.
            drift_noise: [L] the JS divergence sampling noise alone gives against the baseline (bits).
            capacity: [L] experts the layer's expert cache holds / experts (NaN: no cache).
            expected_activation: the model config's activation ratio (None: no activation bar).
        Returns:
            ``Bars``: NaN where a layer has no bar (not judged: imbalance and dead while learning, drift without
            a noise estimate, the cache floor without a cache).
        """
        n = len(kinds)

        def col(x) -> list[float | None]:
            return [None] * n if x is None else [float(v) for v in np.asarray(x, dtype=np.float64).tolist()]

        ref_cv, ref_top, noise, cap = col(reference_cv), col(reference_top), col(drift_noise), col(capacity)
        rows = [self._layer_bars(k, c, tp, d, x) for k, c, tp, d, x in zip(kinds, ref_cv, ref_top, noise, cap)]
        bar = {name: np.array([r[0][name] for r in rows], dtype=np.float64).reshape(n) for name in LAYER_JUDGEMENTS}
        clear = {name: np.array([r[1][name] for r in rows], dtype=np.float64).reshape(n) for name in CLEARED}
        model = {"all_to_all": self.all_to_all_p99_s, "fetch": self.fetch_p99_s,
                 "slow_rank_share": self.slow_rank_share, "slow_rank_wait": self.slow_rank_wait_s,
                 "memory": float(self.memory_capacity_bytes)}
        if expected_activation is not None and math.isfinite(expected_activation):
            model["activation"] = self.activation_floor * expected_activation
        return Bars(bar, clear, tuple(kinds), model)

    def _layer_bars(self, kind: str, ref_cv, ref_top, noise, capacity) -> tuple[dict, dict]:
        """One layer's (bars, clear bars) by judgement (``bars``)."""
        nan = math.nan
        routed = kind in KINDS
        judged = kind in JUDGED_KINDS  # imbalance and dead wait for a reference
        imbalance = self.imbalance_bar_of(kind, ref_cv) if judged else math.inf
        collapse = self.collapse_bar(kind, ref_top) if routed else nan
        drift = self.drift_bar(noise)
        bar = {"imbalance": imbalance if math.isfinite(imbalance) else nan, "collapse": collapse,
               "hot": self.hot_factor if routed else nan,
               # the count of zero-slot experts whose reference predicts at least dead_min_expected_slots: any
               "dead": 0.0 if judged else nan, "drift": drift,
               "rank_load": self.rank_max_over_mean, "flips": self.flip_ratio, "drops": self.drop_ratio,
               "cache": self.cache_floor(capacity) if capacity is not None and math.isfinite(capacity) else nan}
        clear = {"imbalance": self.imbalance_clear(imbalance, ref_cv) if math.isfinite(imbalance) else nan,
                 "collapse": self.collapse_clear(collapse, kind, ref_top) if routed else nan,
                 "hot": self.clear_bar(self.hot_factor) if routed else nan,
                 # held while zero-slot experts predicted at least dead_clear_expected_slots (the holding count)
                 "dead": 0.0 if judged else nan,
                 "drift": noise + self.clear_bar(self.drift_bits, 0.0) if math.isfinite(drift) else nan,
                 "rank_load": self.clear_bar(self.rank_max_over_mean), "flips": self.clear_bar(self.flip_ratio, 0.0)}
        return bar, clear


def expected_activation(dense_params: int, expert_params: int, n_moe_layers: int, top_k: int,
                        total_params: int) -> float:
    """Parameters a token touches / total parameters when every layer computes its top-k: the model config's
    own activation ratio (DeepSeek-V3: 37B / 671B)."""
    return (dense_params + n_moe_layers * top_k * expert_params) / total_params


DEFAULT = Thresholds()
