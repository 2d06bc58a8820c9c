"""The routing judgement: computed once, here, for every view.

``judge_window`` takes a window of routing (slots per layer and expert, its draws as ``sampling.Draws``, the tokens each
layer routed) plus the model's shape, its noise (``sampling``) and an optional baseline, and returns one
``Judgement``: the quantities the exporter exports (load CV, the CV's sampling noise and the excess beyond it,
max/mean, top share, hot factors, unexpected dead experts, drift and its noise) and the alert rules' verdicts as
methods. The combining rules (a drifted layer's imbalance is the drift's; a collapse hides the hot experts it
makes; an overloaded rank is its own alert) are ``verdict``: the one function ``top`` applies to the exporter's
series read back from Prometheus, and ``Judgement`` applies to its own arrays.

Who calls it: the exporter's routing window (``metrics/window.py``: the gauges), ``diagnose`` and ``report`` (from
the trace store), the demo summary (``cli/summary.py``), ``top`` (``tui/routing_view.py``: ``verdict`` over the
exported series and bars). Every bar comes from ``Thresholds.bars``, with its derivation in ``thresholds.py``:
``judge_window`` keeps the window's (``Judgement.bars``), the exporter exports them (``moescope_judgement_bar``),
the rules compare with those series, and ``verdict`` compares each quantity with the same values; its words and
colours for the views are ``layer_words`` and ``layer_level``.

A foundation: imports ``sampling``, ``stats`` and ``thresholds`` only (a baseline is anything with
``rows(layers, n_experts)``: ``analysis.baseline.Profile``; callers coerce paths and dicts).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from moescope import sampling, stats
from moescope.thresholds import DEFAULT, WARN_FRACTION, Bars, Thresholds


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


@dataclass(frozen=True)
class Verdict:
    """One layer's alert verdicts, as the rules and Alertmanager's inhibitions combine them."""

    collapsed: bool  # MoEExpertCollapse: top share over its bar (from the layer's reference: Thresholds.collapse_bar)
    imbalanced: bool  # MoEExpertLoadImbalance: excess CV over its bar, unless the layer drifted
    over_bar: bool  # the excess CV over its bar (before the drift rule): shown, not paged, on a drifted layer
    drifted: bool  # MoERoutingDrift: JS divergence from the baseline beyond its noise
    hot: tuple[int, ...]  # MoEExpertHot: experts whose factor is over the hot bar, hottest first (none while the
    # layer's reference is still being learned: shown, not paged)
    hot_shown: tuple[int, ...]  # the hot experts a view names (none on a collapsed layer: the collapse inhibits)
    dead: bool  # MoEDeadExperts: zero-slot experts the reference says should have slots
    rank_overloaded: bool  # MoERankLoadImbalance
    over_hot: tuple[int, ...] = ()  # every expert over the hot bar, paged or not (hottest first)
    reference: str = "fair"  # what imbalance, collapse and dead are judged against: baseline, learned, fair, learning
    uneven: bool = False  # uneven by design or traffic: its reference's own structure is over the no-reference
    # bars (excess CV over imbalance_cv, or top share over collapse_top_share); shown as information, never paged

    def uneven_words(self, reference_cv: float | None, reference_top: float | None) -> str:
        """"uneven by design/traffic: ..." for a layer whose reference is itself uneven ('' otherwise)."""
        if not self.uneven:
            return ""
        parts = []
        if _finite(reference_cv) and reference_cv > 0:
            parts.append(f"excess CV {reference_cv:.2f}")
        if _finite(reference_top):
            parts.append(f"top share {reference_top:.0%}")
        return f"uneven by design/traffic: {', '.join(parts)} in its {self.reference} reference (not paged)"

    def fires(self) -> list[str]:
        """The alerts this layer fires (``MoEExpertHot:E`` per hot expert)."""
        out = [name for name, on in (
            ("MoEExpertCollapse", self.collapsed), ("MoEExpertLoadImbalance", self.imbalanced),
            ("MoEDeadExperts", self.dead), ("MoERoutingDrift", self.drifted),
            ("MoERankLoadImbalance", self.rank_overloaded)) if on]
        return out + [f"MoEExpertHot:{e}" for e in self.hot]


def verdict(*, excess_cv: float | None, baseline_cv: float | None, top_share: float | None,
            drift_jsd: float | None = None, drift_noise: float | None = None,
            hot_factors: dict[int, float] | None = None, dead_unexpected: float | None = None,
            rank_max_over_mean: float | None = None, hot_reference: str = "fair", reference: str | None = None,
            reference_cv: float | None = None, reference_top: float | None = None,
            bars: Mapping[str, float] | None = None, t: Thresholds = DEFAULT) -> Verdict:
    """One layer's verdicts from its judged quantities (None or NaN: not judged, never over a bar), each compared
    with its bar (``bars``: judgement -> the layer's bar, as ``Thresholds.bars`` gives it and the exporter exports
    it; a judgement without a bar is not judged; default: ``Thresholds.bars`` of this layer's reference).
    ``hot_reference``: what the hot factors are against ("learning": the exporter is still learning the layer's
    reference, so its hot experts are named but do not page). ``reference``: what imbalance, collapse and dead are
    judged against (default: "baseline" where ``baseline_cv`` is given, else ``hot_reference``);
    ``reference_cv`` / ``reference_top``: that reference's structural CV and top share (the exporter's
    ``moescope_reference_load_cv_ratio`` / ``moescope_reference_top_share_ratio``; default: ``baseline_cv``, none)."""
    base = baseline_cv if _finite(baseline_cv) else None
    kind = reference or ("baseline" if base is not None else hot_reference)
    ref_cv = reference_cv if _finite(reference_cv) else base if kind == "baseline" else \
        (0.0 if kind == "fair" else None)
    ref_top = reference_top if _finite(reference_top) else None
    if bars is None:
        bars = t.bars([kind], [_nan(ref_cv)], [_nan(ref_top)], [_nan(drift_noise)]).layer(0)

    def over(value, judgement: str) -> bool:  # NaN (no value, or no bar) compares false: not judged
        return _finite(value) and value > bars.get(judgement, math.nan)

    drifted = over(drift_jsd, "drift")
    imbalanced = over(excess_cv, "imbalance")
    collapsed = over(top_share, "collapse")
    uneven = kind in ("baseline", "learned") and (
        (ref_cv is not None and ref_cv > t.imbalance_cv) or (ref_top is not None and ref_top > t.collapse_top_share))
    hot = tuple(e for e, f in sorted((hot_factors or {}).items(), key=lambda x: (-x[1], x[0])) if over(f, "hot"))
    return Verdict(collapsed=collapsed, imbalanced=imbalanced and not drifted, over_bar=imbalanced,
                   drifted=drifted, hot=() if hot_reference == "learning" else hot,
                   hot_shown=() if collapsed else hot, over_hot=hot, dead=over(dead_unexpected, "dead"),
                   rank_overloaded=over(rank_max_over_mean, "rank_load"), reference=kind, uneven=bool(uneven))


def _nan(x: float | None) -> float:
    return math.nan if x is None else x


def level(value: float | None, bar: float | None, *, floor: bool = False) -> str:
    """ok | warn | bad | none for ``value`` against ``bar`` (the views' colours: ``bad`` past the bar, ``warn``
    from ``WARN_FRACTION`` of it; ``floor``: lower is worse; no value or NaN: none; no bar (None, NaN): ok)."""
    if not _finite(value):
        return "none"
    if bar is None or not math.isfinite(bar):
        return "ok"
    if floor:
        return "bad" if value < bar else "warn" if value < bar + (1 - bar) * (1 - WARN_FRACTION) else "ok"
    return "bad" if value > bar else "warn" if value > WARN_FRACTION * bar else "ok"


def worst(*levels: str) -> str:
    order = ("none", "ok", "warn", "bad")
    return max(levels, key=order.index, default="none")


def layer_level(v: Verdict, *, excess_cv: float | None, top_share: float | None, bars: Mapping[str, float],
                dead_counted: bool) -> str:
    """A layer's colour from its verdict: the imbalance bar passed is ``bad`` only where the rule fires (a
    drifted layer's imbalance is the drift's: ``warn``); the collapse bar; judged dead experts ``warn``; a paged
    hot expert ``bad``, one named while learning ``warn``; drift and rank load ``bad``. ``dead_counted``: the
    layer's zero-slot experts are known (else its dead level is none)."""
    cv_level = level(excess_cv, bars.get("imbalance"))
    if cv_level == "bad" and not v.imbalanced:
        cv_level = "warn"
    dead_level = "warn" if v.dead else "ok" if dead_counted else "none"
    return worst(cv_level, level(top_share, bars.get("collapse")), dead_level,
                 "bad" if v.hot else "warn" if v.over_hot else "none",
                 "bad" if v.drifted or v.rank_overloaded else "none")


AGAINST = {"baseline": "baseline", "learned": "learned", "fair": "fair share"}


def layer_words(v: Verdict, *, layer: int, excess_cv: float | None, top_share: float | None,
                bars: Mapping[str, float], drift_jsd: float | None = None, rank_max_over_mean: float | None = None,
                dead_unexpected: float | None = None, hot: Sequence[tuple[int, float, str]] = (),
                busiest: int | None = None, uneven: str = "") -> str:
    """What is wrong with a layer, in words ('' when nothing is), from its verdict and the bars it was judged by:
    ``hot``: (expert, factor, reference) of its experts over the hot bar, hottest first; ``busiest``: the expert
    a collapse is onto (None: unknown); ``uneven``: ``Verdict.uneven_words`` (said only when nothing else is)."""
    words = []
    if v.collapsed:
        words.append(f"collapsed{f' onto e{busiest}' if busiest is not None else ''} ({top_share:.0%} of tokens)")
    elif v.imbalanced:
        words.append(f"imbalanced (excess cv {excess_cv:.2f}>{bars['imbalance']:.2f} "
                     f"{AGAINST.get(v.reference, v.reference)})")
    if v.hot_shown:  # collapse inhibits the hot alert (Alertmanager), as it does here
        # "learning": against 1/E while the exporter learns the layer's reference (named here, not paged)
        words.append("hot " + " ".join(f"L{layer} E{e} {f:.1f}x {'fair' if ref == 'learning' else ref}"
                                       for e, f, ref in hot[:2]) + ("" if v.hot else " (learning: not paged)"))
    if v.drifted:
        words.append(f"drifted ({drift_jsd:.3f} bits > {bars['drift']:.3f})")
    if v.rank_overloaded:
        words.append(f"rank max/mean {rank_max_over_mean:.2f}")
    if v.dead:
        words.append(f"{int(dead_unexpected)} dead")
    if uneven and not words:
        words.append(uneven)
    return ", ".join(words)


@dataclass
class Judgement:
    """A window's judged quantities and verdicts. Arrays have a leading layer axis (``layers``). NaN: not judged
    (fewer than ``sampling.MIN_DRAWS`` draws, or no baseline for the layer)."""

    layers: list[int]
    n_experts: int
    reference: str  # "baseline" | "fair": what hot and dead are judged against
    counts: np.ndarray  # [L, E] slots per expert over the window
    draws: np.ndarray  # [L] requests (the independent draws)
    tokens: np.ndarray  # [L] tokens routed
    cv: np.ndarray  # [L] moescope_expert_load_cv_ratio
    noise_cv: np.ndarray  # [L] moescope_expert_load_cv_noise_ratio
    excess_cv: np.ndarray  # [L] moescope_expert_load_excess_cv_ratio
    max_over_mean: np.ndarray  # [L] moescope_expert_load_max_over_mean_ratio
    has_baseline: np.ndarray  # [L] bool: the reference is the baseline for this layer
    baseline_cv: np.ndarray | None  # [L] moescope_baseline_load_cv_ratio (None: no baseline at all)
    bars: Bars  # every layer's bars (Thresholds.bars: the exported moescope_judgement_bar series)
    hot_factor: np.ndarray  # [L, E] moescope_expert_hot_factor_ratio (NaN: not significantly above)
    hot_sd: np.ndarray  # [L, E] the share's noise sd (cluster-robust)
    ref_share: np.ndarray  # [L, E] the hot reference share
    hot_reference: list[str]  # [L] what each layer's hot factor is against: "baseline", "learned", "learning" or
    # "fair" (``judge``'s ``learned``); the exporter's ``reference`` label, and the alert pages all but "learning"
    dead: np.ndarray  # [L] moescope_dead_experts_unexpected
    dead_holding: np.ndarray  # [L] moescope_dead_experts_holding: zero-slot experts at the clear level
    dead_mask: np.ndarray  # [L, E] the experts counted in ``dead``
    jsd: np.ndarray | None  # [L] moescope_routing_drift_jsd_bits (None: no baseline at all)
    drift_noise: np.ndarray | None  # [L] moescope_routing_drift_noise_bits
    top_share: np.ndarray  # [L] moescope_expert_load_top_share_ratio: busiest expert's slots / routed tokens
    reference_cv: np.ndarray | None = None  # [L] moescope_reference_load_cv_ratio (NaN: no reference)
    reference_top: np.ndarray | None = None  # [L] moescope_reference_top_share_ratio (NaN: no reference)
    t: Thresholds = DEFAULT

    @property
    def bar(self) -> np.ndarray:
        """[L] the imbalance bar of each layer (inf: none, the reference is still being learned)."""
        b = self.bars.bar["imbalance"]
        return np.where(np.isnan(b), np.inf, b)

    @property
    def collapse_bar(self) -> np.ndarray:
        """[L] the collapse bar of each layer's reference."""
        return self.bars.bar["collapse"]

    def verdict(self, i: int) -> Verdict:
        """Layer ``i``'s (the row, not the layer id) verdicts."""
        row = self.hot_factor[i]
        return verdict(
            excess_cv=float(self.excess_cv[i]),
            baseline_cv=None if self.baseline_cv is None else float(self.baseline_cv[i]),
            top_share=float(self.top_share[i]),
            drift_jsd=None if self.jsd is None else float(self.jsd[i]),
            drift_noise=None if self.drift_noise is None else float(self.drift_noise[i]),
            hot_factors={int(e): float(row[e]) for e in np.nonzero(np.isfinite(row))[0]},
            dead_unexpected=float(self.dead[i]), hot_reference=self.hot_reference[i],
            reference=self.hot_reference[i], reference_cv=_at(self.reference_cv, i),
            reference_top=_at(self.reference_top, i), bars=self.bars.layer(i), t=self.t)

    def uneven_words(self, i: int) -> str:
        """Layer ``i``'s "uneven by design/traffic: ..." ('' where its reference is not uneven)."""
        return self.verdicts[i].uneven_words(_at(self.reference_cv, i), _at(self.reference_top, i))

    @functools.cached_property
    def verdicts(self) -> list[Verdict]:  # (once: the array properties below read it)
        return [self.verdict(i) for i in range(len(self.layers))]

    @property
    def judged(self) -> np.ndarray:
        return np.isfinite(self.excess_cv)

    @property
    def drifted(self) -> np.ndarray:
        return np.array([v.drifted for v in self.verdicts], dtype=bool)

    @property
    def collapsed(self) -> np.ndarray:
        return np.array([v.collapsed for v in self.verdicts], dtype=bool)

    @property
    def imbalanced(self) -> np.ndarray:
        """MoEExpertLoadImbalance: excess over the bar, unless the layer drifted."""
        return np.array([v.imbalanced for v in self.verdicts], dtype=bool)

    @property
    def hot(self) -> np.ndarray:
        """[L, E] MoEExpertHot: the exported factor above ``hot_factor``."""
        out = np.zeros(self.counts.shape, dtype=bool)
        for i, v in enumerate(self.verdicts):
            out[i, list(v.hot)] = True
        return out

    def hot_experts(self, k: int) -> list[list[tuple[int, float]]]:
        """Per layer, up to ``k`` (expert, hot factor) with a finite factor, highest first (ties: lower id)."""
        return top_factors(self.hot_factor, k)


@dataclass(frozen=True)
class Inhibit:
    """One of Alertmanager's inhibit rules: a firing alert matching ``source`` mutes the alerts matching
    ``target`` whose ``equal`` labels are the same (a cause mutes its symptoms). Matchers are label: value, a value
    with ``|`` is any of its parts (Alertmanager's ``=~``)."""

    source: tuple[tuple[str, str], ...]
    target: tuple[tuple[str, str], ...]
    equal: tuple[str, ...]
    why: str

    @staticmethod
    def _matches(matchers, labels: dict) -> bool:
        return all(labels.get(k, "") in v.split("|") for k, v in matchers)

    def matchers(self, which: str) -> list[str]:
        """``source_matchers`` / ``target_matchers`` as alertmanager.yml writes them."""
        return [f'{k}=~"{v}"' if "|" in v else f'{k}="{v}"' for k, v in getattr(self, which)]


# The combining rules Alertmanager applies to what the alert rules fire, written once: collectors/alertmanager/
# alertmanager.yml's inhibit_rules are these (tests/test_alerts.py checks the file and a real Alertmanager against
# ``delivered``).
INHIBITIONS = (
    Inhibit((("severity", "critical"),), (("severity", "warning"),), ("model", "layer"),
            "A critical page (collapse, non-finite logits) mutes the warnings of its layer."),
    Inhibit((("alertname", "MoESlowRank"),), (("alertname", "MoEAllToAllLatencyHigh"),), ("model",),
            "A slow rank makes every peer's all-to-all slow: page for the cause (which rank), not for each "
            "symptom."),
    Inhibit((("alertname", "MoEExpertCollapse"),), (("alertname", "MoEExpertLoadImbalance|MoEExpertHot"),),
            ("model",),
            "A collapse (a broken router bias, a bad fine-tune) skews every layer: it is the extreme of both "
            "imbalance and a hot expert, and the layers it leaves just short of the collapse bar (measured at "
            "deepseek-v3-shape: 1 of 58, its load split over two experts) are its symptoms."),
    Inhibit((("alertname", "MoEExpertHot"),), (("alertname", "MoEExpertLoadImbalance|MoERankLoadImbalance"),),
            ("model", "layer"),
            "One hot expert is what raises its layer's load CV and its rank's load: page for the expert (it names "
            "what to replicate or move), not for each of its symptoms in the same layer."),
    Inhibit((("alertname", "MoETokensDropped"),), (("alertname", "MoEActivationRatioLow"),), ("model", "rank"),
            "Dropped slots are experts a token did not run: they lower the activation ratio."),
)


def delivered(firing: list[dict]) -> list[dict]:
    """The firing alerts (label dicts) ``INHIBITIONS`` leave to page, as Alertmanager decides: an alert is muted
    by another firing alert (not itself) that matches a rule's source where it matches the rule's target and
    their ``equal`` labels agree."""
    def muted(a: dict) -> bool:
        return any(Inhibit._matches(r.target, a) and any(
            b is not a and Inhibit._matches(r.source, b) and all(a.get(k, "") == b.get(k, "") for k in r.equal)
            for b in firing) for r in INHIBITIONS)

    return [a for a in firing if not muted(a)]


def _at(a, i: int) -> float | None:
    return None if a is None else float(a[i])


def top_factors(factors: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    """Per row of ``factors`` [L, E], up to ``k`` (expert, factor) with a finite factor, highest first (ties: lower
    id)."""
    out = []
    for row in factors:
        finite = np.nonzero(np.isfinite(row))[0]
        order = finite[np.argsort(-row[finite], kind="stable")][:k]
        out.append([(int(e), float(row[e])) for e in order])
    return out


def judge_window(counts, draws: sampling.Draws, layers, top_k: int = 1, baseline=None, t: Thresholds = DEFAULT, *,
          tokens=None, family_layers: int | None = None, learned=None) -> Judgement:
    """The judged quantities of a window: ``counts`` [L, E] slots, ``draws`` its requests as ``sampling.Draws``,
    ``tokens`` [L] the tokens each layer routed (default: slots / ``top_k``, which undercounts where slots were
    dropped). ``baseline``: anything with ``rows(layers, n_experts)`` (``analysis.baseline.Profile``), the
    reference of hot, dead and drift where it has the layer; else the fair share and ``t.dead_reference``.
    ``family_layers``: the layers the hot test's family spans (default: ``len(layers)``; the exporter's window
    passes every layer of the model, judged in this window or not). ``learned``: where no baseline is saved, the
    exporter's own learned reference (``metrics.window.LearnedReference.rows``: ``share`` [L, E], ``has`` [L],
    ``cv`` [L] its excess CV, ``top`` [L] its top share): the reference of hot, dead, imbalance and collapse on
    the layers it has learned ("learned"); the others are "learning" (hot named against the fair share, not
    paged; dead and imbalance not judged; collapse only over ``Thresholds.collapse_ceiling``); None: the fair
    share ("fair": 1/E, the no-reference imbalance bar and dead floor, as the user asked with
    ``--hot-reference fair``). Each layer's reference kind is ``hot_reference``."""
    counts = np.asarray(counts, dtype=np.float64)
    n_layers, n_exp = counts.shape
    layers = list(layers)
    slots = counts.sum(1)
    tokens = slots / max(1, top_k) if tokens is None else np.asarray(tokens, dtype=np.float64)
    cv = stats.load_cv_rows(counts)
    with np.errstate(invalid="ignore", divide="ignore"):
        noise = sampling.noise_cv(n_exp, slots, draws, t.noise_z)
    noise = np.where(np.isinf(noise), np.nan, noise)
    excess = sampling.excess_cv(cv, noise)
    base = baseline.rows(layers, n_exp) if baseline is not None else None
    has = base.has if base is not None else np.zeros(n_layers, dtype=bool)
    has_base = bool(has.any())
    ref = base.share if base is not None else sampling.reference_shares(n_exp, None, n_layers)
    base_cv = base.structural_cv if base is not None else np.full(n_layers, np.nan)
    hot_ref = sampling.hot_reference(n_exp, ref if has_base else None, n_layers)
    kinds = np.where(has, "baseline", "fair").astype(object)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_token = np.where(tokens > 0, slots / np.where(tokens > 0, tokens, 1.0), float(top_k))  # k, less drops
    # The reference's structure: its structural CV and top share (the baseline's; the fair share's: 0 and k/E)
    ref_cv = np.where(has, base_cv, 0.0)
    ref_top = np.where(has, (base.share.max(1) if base is not None and n_exp else 0.0) * per_token,
                       per_token / max(1, n_exp))
    dead_ref = np.where(has[:, None], ref, t.dead_reference(n_exp) if n_exp else 0.0)
    dead_judged = np.ones(n_layers, dtype=bool)
    if learned is not None and not has_base:
        lhas = np.asarray(learned.has, dtype=bool)
        hot_ref = np.where(lhas[:, None], sampling.hot_reference(n_exp, learned.share, n_layers), hot_ref)
        kinds = np.where(lhas, "learned", "learning").astype(object)
        ref_cv = np.where(lhas, np.asarray(learned.cv, dtype=np.float64), np.nan)
        ref_top = np.where(lhas, np.asarray(learned.top, dtype=np.float64), np.nan)
        dead_ref = np.where(lhas[:, None], learned.share, 0.0)
        dead_judged = lhas
    hot_z = t.hot_z(family_layers or n_layers, n_exp)
    with np.errstate(invalid="ignore", divide="ignore"):
        factor = sampling.hot_factor(counts, draws, hot_ref, hot_z, t.noise_z)
        sd = sampling.hot_sd(draws, t.noise_z)
        dead = np.where(dead_judged, sampling.dead_unexpected(counts, draws, dead_ref, t.dead_min_expected_slots,
                                                              t.noise_z), np.nan)
        holding = np.where(dead_judged, sampling.dead_unexpected(counts, draws, dead_ref,
                                                                 t.dead_clear_expected_slots, t.noise_z), np.nan)
        dead_mask = sampling.dead_mask(counts, draws, dead_ref, t.dead_min_expected_slots, t.noise_z) & \
            dead_judged[:, None]
    jsd = noise_bits = None
    if has_base:
        jsd = np.full(n_layers, np.nan)
        jsd[has] = stats.jensen_shannon_rows(counts[has], base.load[has])
        with np.errstate(invalid="ignore", divide="ignore"):
            noise_bits = np.where(has, sampling.drift_noise_bits(counts, draws, ref, t.noise_z), np.nan)
    return Judgement(
        layers=layers, n_experts=n_exp, reference="baseline" if has_base else "fair", counts=counts,
        draws=draws.draws.copy(), tokens=tokens, cv=cv, noise_cv=noise, excess_cv=excess,
        max_over_mean=stats.max_over_mean_rows(counts), has_baseline=has,
        baseline_cv=base_cv if has_base else None,
        bars=t.bars([str(k) for k in kinds], ref_cv, ref_top, noise_bits),
        hot_factor=factor, hot_sd=sd, ref_share=hot_ref, hot_reference=[str(k) for k in kinds], dead=dead,
        dead_holding=holding, dead_mask=dead_mask, jsd=jsd, reference_cv=ref_cv, reference_top=ref_top,
        drift_noise=noise_bits, top_share=stats.top_share_rows(counts, tokens), t=t)


def drift_between(before, before_draws: sampling.Draws, after, after_draws: sampling.Draws,
                  t: Thresholds = DEFAULT) -> tuple[np.ndarray, np.ndarray]:
    """[L] JS divergence (bits) of ``after`` [L, E] from ``before``, and the noise it stays under when nothing
    changed: each side's sampling noise against the other's shares, added (no baseline: a window's later half
    against its earlier half)."""
    a, b = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    n_layers, e = a.shape
    ra, rb = sampling.reference_shares(e, b, n_layers), sampling.reference_shares(e, a, n_layers)
    with np.errstate(invalid="ignore", divide="ignore"):
        noise = sampling.drift_noise_bits(b, after_draws, rb, t.noise_z) + \
            sampling.drift_noise_bits(a, before_draws, ra, t.noise_z)
    return stats.jensen_shannon_rows(b, a), noise


def draws_of(per_request: np.ndarray, chunk: int = 256) -> sampling.Draws:
    """``sampling.Draws.of`` summed over chunks of requests (a float copy of 5000 requests at 58 x 256 would be
    600 MB at once)."""
    r, n_layers, n_exp = per_request.shape
    out = sampling.Draws.zeros(n_layers, n_exp)
    for lo in range(0, r, chunk):
        out.add(sampling.Draws.of(per_request[lo: lo + chunk]))
    return out


def worst_case_draws(counts: np.ndarray, requests) -> sampling.Draws:
    """The most clustered draws consistent with totals alone (``counts`` [L, E], ``requests`` draws [L] or a
    number): as if each request sent all its slots to one expert. Its share variance p(1-p)/(R-1) bounds any
    real traffic's, so a judgement on totals errs towards "not judged", never towards a false alarm."""
    c = np.asarray(counts, dtype=np.float64)
    n = c.sum(1)
    r = np.broadcast_to(np.asarray(requests, dtype=np.float64), n.shape).copy()
    per = np.where(r > 0, n / np.where(r > 0, r, 1.0), 0.0)  # slots per request
    return sampling.Draws(r, n, n * per, c, c * per[:, None], c * per[:, None])


def cache_thrash(hits, lookups, capacity_ratio, t: Thresholds = DEFAULT
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MoEExpertCacheHitRateLow, per layer: ``hits`` [L] and ``lookups`` [L] over the same interval, the layer's
    cache holding ``capacity_ratio`` [L] of its experts. Returns the hit rate [L], its floor [L]
    (its ``Thresholds.bars`` cache bar: under half a random resident set's hit rate) and whether the cache thrashes [L]
    (the rate under the floor). A layer without lookups or with an unknown (NaN) capacity is not judged: its rate
    or floor NaN, never thrashing. ``top`` calls it on the exporter's counters, ``diagnose`` on a store's miss bits."""
    hits, lookups, capacity = (np.asarray(x, dtype=np.float64) for x in (hits, lookups, capacity_ratio))
    rate = np.where(lookups > 0, hits / np.where(lookups > 0, lookups, 1.0), np.nan)
    floor = t.bars([""] * len(capacity), capacity=capacity).bar["cache"]  # (the exported cache bars)
    return rate, floor, np.isfinite(rate) & np.isfinite(floor) & (rate < floor)
