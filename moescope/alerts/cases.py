"""promtool cases of every alert: ``fires`` (with the labels and the rendered description expected),
``healthy``, ``boundary`` (exactly at the bar: silent) and what else each rule must (not) page on.

The rules compare with the bar series the exporter exports (``moescope_judgement_bar``,
``moescope_judgement_clear_bar``): every case feeds them as input series, computed by ``Thresholds.bars`` (the
exporter's function) of the case's reference, never typed here, and every quantity a case sits on is placed from
the thresholds object's own methods (``Thresholds.imbalance_bar``, ``cache_floor``, ...). A suite takes two
thresholds objects: ``t`` places the quantities, ``b`` writes the bar series (tests/test_alerts.py moves ``b``
alone: the boundary cases must then fail). The expected descriptions are worked out from the series in Python, so
the test checks the templates too. Series carry the labels the exporter gives them (model, rank, layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moescope.thresholds import DEFAULT, REFERENCED, Thresholds

DS = "deepseek-v3-shape"
LAYER = {"model": "m", "rank": "0", "layer": "1"}
L = 'model="m",rank="0",layer="1"'  # labels of most unit-test series
NAN = float("nan")


@dataclass(frozen=True)
class Case:
    """``series`` -> promtool values; the alerts expected at ``eval_time`` as (labels, rendered description)
    pairs (none: silent)."""

    name: str
    series: dict
    fires: tuple[tuple[dict, str], ...] = ()
    eval_time: str | None = None


@dataclass(frozen=True)
class Suite:
    """An alert's cases: ``fires``, ``healthy``, ``boundary`` and its ``extra`` cases."""

    fires: Case
    healthy: Case
    boundary: Case
    extra: tuple[Case, ...] = ()
    eval_time: str = "15m"
    interval: str = "1m"

    def all(self) -> tuple[Case, ...]:
        return (self.fires, self.healthy, self.boundary, *self.extra)


def v(x: float, n: int = 20) -> str:
    """A constant series of ``n + 1`` samples (NaN written out: promtool has no ``NaNxN``)."""
    if isinstance(x, float) and math.isnan(x):
        return " ".join(["NaN"] * (n + 1))
    return f"{x!r}x{n}"


def lab(layer: str = "1", model: str = "m", **more) -> str:
    return ",".join(f'{k}="{val}"' for k, val in {"model": model, "rank": "0", "layer": layer, **more}.items())


def model_lab(model: str = "m", rank: str = "0") -> str:
    return f'model="{model}",rank="{rank}"'


def layer_bar(b: Thresholds, judgement: str, kind: str = "", *, ref_cv: float = NAN, ref_top: float = NAN,
              noise: float = NAN, capacity: float = NAN) -> tuple[float, float]:
    """(bar, clear bar) of one layer's ``judgement`` (``Thresholds.bars``; NaN: none)."""
    bars = b.bars([kind], [ref_cv], [ref_top], [noise], [capacity])
    return float(bars.bar[judgement][0]), float(bars.clear[judgement][0]) if judgement in bars.clear else NAN


def bar_series(judgement: str, labels: str, bar: float, clear: float = NAN, n: int = 20, kind: str = "") -> dict:
    """The bar series (and clear bar) of ``judgement`` as the exporter exports them (none where NaN)."""
    ref = f',reference="{kind}"' if kind and judgement in REFERENCED else ""
    out = {}
    for name, x in (("moescope_judgement_bar", bar), ("moescope_judgement_clear_bar", clear)):
        if math.isfinite(x):
            out[f'{name}{{{labels},judgement="{judgement}"{ref}}}'] = v(x, n)
    return out


def layer_bars(b: Thresholds, judgement: str, kind: str = "", labels: str = L, n: int = 20, **ref) -> dict:
    """``bar_series`` of one layer's ``judgement`` from ``Thresholds.bars`` of its reference (``ref``: ``ref_cv``,
    ``ref_top``, ``noise``, ``capacity``)."""
    return bar_series(judgement, labels, *layer_bar(b, judgement, kind, **ref), n=n, kind=kind)


def model_bar(b: Thresholds, judgement: str, labels: str = 'model="m",rank="0"', expected: float | None = None,
              n: int = 20) -> dict:
    """The model-level bar series of ``judgement`` (no layer label)."""
    return bar_series(judgement, labels, b.bars([], expected_activation=expected).model[judgement], n=n)


def _pct(x: float) -> str:
    """As Prometheus' ``humanizePercentage`` writes a ratio."""
    return f"{100 * x:.4g}%"


def _duration(x: float) -> str:
    """As Prometheus' ``humanizeDuration`` writes a duration under a second."""
    prefix = ""
    for p in ("m", "u", "n"):
        if abs(x) >= 1:
            break
        prefix, x = p, x * 1000
    return f"{x:.4g}{prefix}s"


# -- MoEExpertLoadImbalance ----------------------------------------------------------------------------------
def _load(excess: float, ref: float | None = None, layer: str = "1", model: str = "m",
          jsd: float | None = None, noise: float | None = None, kind: str = "baseline", n: int = 20,
          steps: tuple[float, float] | None = None, b: Thresholds = DEFAULT, **more) -> dict:
    """An imbalance case's series: the excess CV (or ``steps``: 15 samples at the first, then 31 at the second),
    the reference's structural CV labelled ``kind`` (none: no reference yet, the layer is learning) and the layer's
    imbalance bars (``b``) from it; with ``jsd``, the drift series and bars."""
    labels = lab(layer, model, **more)
    m = n if steps is None else 45
    kind = kind if ref is not None else "learning"
    out = {f"moescope_expert_load_excess_cv_ratio{{{labels}}}":
           v(excess, n) if steps is None else f"{steps[0]!r}x14 {steps[1]!r}x30"}
    if ref is not None:
        out[f"moescope_reference_load_cv_ratio{{{labels},reference=\"{kind}\"}}"] = v(ref, m)
    out.update(layer_bars(b, "imbalance", kind, labels, m, ref_cv=NAN if ref is None else ref))
    if jsd is not None:
        out[f"moescope_routing_drift_jsd_bits{{{labels}}}"] = v(jsd, n)
        out[f"moescope_routing_drift_noise_bits{{{labels}}}"] = v(noise, n)
        out.update(layer_bars(b, "drift", "baseline", labels, n, noise=noise))
    return out


def imbalance_description(excess: float, ref: float | None, t: Thresholds = DEFAULT,
                          labels: dict = LAYER, kind: str = "baseline") -> str:
    bar, _ = layer_bar(t, "imbalance", kind, ref_cv=ref)
    against = "against the fair share, as asked" if kind == "fair" else f"from its {kind} reference"
    return (f"Layer {labels['layer']} of {labels['model']} (rank {labels['rank']}) has a load CV of {excess:.2f} "
            f"beyond sampling noise, over its bar {bar:.2f} ({against}).")


def imbalance(t: Thresholds, b: Thresholds | None = None) -> Suite:
    b = b or t
    ref = 0.3  # a reference's structural CV (the bundled shapes' healthy routers: ~0.3-0.4)
    bar = t.imbalance_bar(ref)
    over, under = bar + 0.05, bar - 0.05
    clear = t.imbalance_clear(bar, ref)
    mid = (bar + clear) / 2
    # two replicas of one model (two processes serving the same name, each rank 0), each judged against its own
    # reference (matched on (model, rank, layer) alone, the rule would not even evaluate)
    replicas = {**_load(over, ref, instance="a:9400", job="moescope", b=b),
                **_load(bar - 0.01, ref, instance="b:9400", job="moescope", b=b)}
    replica = {**LAYER, "instance": "a:9400", "job": "moescope"}
    learned = {**LAYER}
    uneven = 2.5  # a top-1 layer under a few fixed prompts: excess CV 2.5 from its first window (issue [learned])
    return Suite(
        Case("fires", _load(over, ref, kind="learned", b=b),
             ((learned, imbalance_description(over, ref, b, kind="learned")),)),
        Case("healthy", _load(0.4, ref, kind="learned", b=b)),
        Case("boundary", _load(bar, ref, kind="learned", b=b)),
        (
            Case("with a baseline: above its bar fires", _load(over, ref, b=b),
                 ((LAYER, imbalance_description(over, ref, b)),)),
            Case("with a baseline: below its bar is silent", _load(under, ref, b=b)),
            Case("with a baseline: exactly at its bar is silent", _load(t.imbalance_bar(ref), ref, b=b)),
            Case("against the fair share (asked for): over the no-reference bar fires",
                 _load(1.2 * t.imbalance_cv, 0.0, kind="fair", b=b),
                 ((LAYER, imbalance_description(1.2 * t.imbalance_cv, 0.0, b, kind="fair")),)),
            Case("against the fair share (asked for): exactly at the no-reference bar is silent",
                 _load(t.imbalance_cv, 0.0, kind="fair", b=b)),
            # the top-1 narrow traffic: no reference yet, an excess CV of several is not judged
            Case("while its reference is being learned nothing is judged", _load(5.0, b=b)),
            Case("uneven by design or traffic from the start is not paged",
                 _load(uneven + 0.1, uneven, kind="learned", b=b)),
            Case("another layer's reference does not set this layer's bar",
                 {**_load(over, b=b), **_load(0.1, 0.8, layer="2", b=b)}),
            Case("two replicas of one model are judged apart", replicas,
                 ((replica, imbalance_description(over, ref, b, replica)),)),
            Case("NaN excess (too few draws) is not judged", _load(NAN, ref, b=b)),
            Case("NaN excess with a baseline is not judged", _load(NAN, 0.0, b=b)),
            Case("a drifted layer is drift, not imbalance", _load(over, ref, jsd=0.3, noise=0.01, b=b)),
            Case("a divergence within its noise does not hold imbalance back",
                 _load(over, ref, jsd=0.3, noise=0.295, b=b), ((LAYER, imbalance_description(over, ref, b)),)),
            # hysteresis: 15 minutes over the bar (firing after its 10m), then between the bars: held; under the
            # clear bar: resolved once its keep_firing_for (10m) passed
            Case("firing, it holds between its bar and its clear bar", _load(0, ref, steps=(over, mid), b=b),
                 ((LAYER, imbalance_description(mid, ref, b)),), eval_time="30m"),
            Case("firing, it clears under its clear bar", _load(0, ref, steps=(over, clear - 0.02), b=b),
                 eval_time="30m"),
            Case("between the bars without having fired is silent", _load(mid, ref, b=b)),
        ))


# -- MoEExpertHot -----------------------------------------------------------------------------------------------
def _hot(factor: float, expert: str = "17", reference: str = "fair", b: Thresholds = DEFAULT,
         values: str | None = None) -> dict:
    """A hot factor (``values``: promtool's, else constant) and its layer's hot bars."""
    return {f"moescope_expert_hot_factor_ratio{{{lab(expert=expert, reference=reference)}}}": values or v(factor),
            **layer_bars(b, "hot", reference)}


def _hot_steps(first: float, then: float, b: Thresholds) -> dict:
    """10 samples (minutes) at ``first``, then 21 at ``then``."""
    return _hot(first, b=b, values=f"{first!r}x9 {then!r}x20")


def hot_description(factor: float, expert: str, reference: str, t: Thresholds = DEFAULT) -> str:
    ref = {"baseline": "its baseline share",
           "learned": "the share this deployment's traffic gave it (learned; no baseline loaded)"}.get(
        reference, "its fair share 1/E (no baseline loaded)")
    return (f"Expert {expert} of layer 1 in m (rank 0) gets {factor:.1f}x {ref}, beyond sampling noise "
            f"(bar: {layer_bar(t, 'hot', reference)[0]:.3g}x).")


def hot(t: Thresholds, b: Thresholds | None = None) -> Suite:
    b = b or t
    f = 5.1  # the hot expert at deepseek-v3-shape
    labels = {**LAYER, "expert": "17", "reference": "fair"}
    base = {**LAYER, "expert": "3", "reference": "baseline"}
    two = {**_hot(f, b=b), **_hot(2 * t.hot_factor, "200", b=b)}
    mid = (t.hot_factor + t.clear_bar(t.hot_factor)) / 2
    return Suite(
        Case("fires", _hot(f, b=b), ((labels, hot_description(f, "17", "fair", b)),)),
        Case("healthy", _hot(0.6 * t.hot_factor, b=b)),  # healthy layers show 2-3x their fair share
        Case("boundary", _hot(t.hot_factor, b=b)),
        (
            Case("against its baseline share", _hot(t.hot_factor + 0.5, "3", "baseline", b),
                 ((base, hot_description(t.hot_factor + 0.5, "3", "baseline", b)),)),
            Case("two hot experts of one layer page apart", two,
                 ((labels, hot_description(f, "17", "fair", b)),
                  ({**labels, "expert": "200"}, hot_description(2 * t.hot_factor, "200", "fair", b)))),
            Case("pending before its for", _hot(f, b=b), eval_time="4m"),
            Case("against its learned share", _hot(f, "17", "learned", b),
                 (({**labels, "reference": "learned"}, hot_description(f, "17", "learned", b)),)),
            Case("not while its reference is being learned", _hot(2 * t.hot_factor, "17", "learning", b)),
            # hysteresis: 10 minutes over the bar (firing after its 5m), then between the bars: held; under the
            # clear bar: resolved once its keep_firing_for (5m) passed
            Case("firing, it holds between its bar and its clear bar", _hot_steps(f, mid, b),
                 ((labels, hot_description(mid, "17", "fair", b)),), eval_time="18m"),
            Case("firing, it clears under its clear bar", _hot_steps(f, t.clear_bar(t.hot_factor) - 0.25, b),
                 eval_time="18m"),
            Case("between the bars without having fired is silent", _hot(mid, b=b)),
        ))


# -- MoERankLoadImbalance ---------------------------------------------------------------------------------------
def rank(t: Thresholds, b: Thresholds | None = None) -> Suite:
    b = b or t

    def s(x, then=None):  # constant, or 15 samples (minutes) at x, then 31 at then
        return {f"moescope_rank_load_max_over_mean_ratio{{{L}}}": v(x) if then is None else f"{x!r}x14 {then!r}x30",
                **layer_bars(b, "rank_load", n=45)}

    def desc(x):
        return (f"Layer 1 of m: the busiest expert-parallel rank computes {x:.2f}x the mean rank's slots (bar: "
                f"{layer_bar(b, 'rank_load')[0]:.3g}x); every all-to-all of the layer waits for it.")

    x = 1.56  # TensorRT-LLM's DeepSeek-R1 rank imbalance without EPLB: (max - mean) / mean 0.56
    mid = (t.rank_max_over_mean + t.clear_bar(t.rank_max_over_mean)) / 2
    return Suite(Case("fires", s(1 + x), ((LAYER, desc(1 + x)),)), Case("healthy", s(1.1)),
                 Case("boundary", s(t.rank_max_over_mean)),
                 (Case("NaN (an empty window) is not judged", s(NAN)),
                  # hysteresis: firing (after its 10m), then between the bars: held; under the clear bar: resolved
                  # once its keep_firing_for (10m) passed
                  Case("firing, it holds between its bar and its clear bar", s(1 + x, mid), ((LAYER, desc(mid)),),
                       eval_time="30m"),
                  Case("firing, it clears under its clear bar", s(1 + x, t.clear_bar(t.rank_max_over_mean) - 0.05),
                       eval_time="30m"),
                  Case("between the bars without having fired is silent", s(mid))))


# -- MoEExpertCollapse --------------------------------------------------------------------------------------------
def _steps(first: float, then: float, short: bool) -> str:
    """``short`` (a 2m or 5m ``for``): 10 samples at ``first``, then 21 at ``then``; else 15, then 31."""
    return f"{first!r}x9 {then!r}x20" if short else f"{first!r}x14 {then!r}x30"


def collapse(t: Thresholds, b: Thresholds | None = None) -> Suite:
    b = b or t

    def s(x, ref=None, kind="learned", then=None):
        kind = kind if ref is not None else "learning"
        out = {f"moescope_expert_load_top_share_ratio{{{L}}}": v(x) if then is None else _steps(x, then, True)}
        if ref is not None:
            out[f'moescope_reference_top_share_ratio{{{L},reference="{kind}"}}'] = v(ref, 30)
        return {**out, **layer_bars(b, "collapse", kind, n=30, ref_top=NAN if ref is None else ref)}

    def desc(x, ref=None, kind="learned"):
        bar, _ = layer_bar(b, "collapse", kind if ref is not None else "learning", ref_top=NAN if ref is None else ref)
        return f"{_pct(x)} of layer 1's tokens choose one expert in m (rank 0), over its bar {_pct(bar)}."

    fair = 2 / 32  # k/E of a 32-expert top-2 model: the fair share's top share
    vllm = 0.67  # a vLLM checkpoint's healthy layer (issue [learned]): the old fixed 0.75 paged it
    bar = t.collapse_bar("learned", vllm)
    clear = t.collapse_clear(bar, "learned", vllm)
    mid = (bar + clear) / 2
    base_bar = t.collapse_bar("baseline", 0.9)
    return Suite(Case("fires", s(0.9, 0.1), ((LAYER, desc(0.9, 0.1)),)),
                 Case("healthy", s(0.3, 0.1)),
                 Case("boundary", s(t.collapse_top_share, fair, "fair")),
                 (
                     Case("a healthy top share of 0.67 learned: 0.8 is not a collapse", s(0.8, vllm)),
                     Case("a healthy top share of 0.67 learned: over half way to 1 fires", s(bar + 0.02, vllm),
                          ((LAYER, desc(bar + 0.02, vllm)),)),
                     Case("exactly at its learned reference's bar is silent", s(bar, vllm)),
                     # the absolute limit: a learned reference cannot raise the bar over the ceiling (0.875)
                     Case("collapsed from the start: over the ceiling pages whatever was learned", s(0.95, 0.95),
                          ((LAYER, desc(0.95, 0.95)),)),
                     Case("a baseline's own top share sets its bar (not capped)", s((base_bar + 0.9) / 2, 0.9,
                                                                                   "baseline")),
                     Case("no reference yet: under the ceiling is silent", s(0.85)),
                     Case("no reference yet: over the ceiling fires", s(0.9), ((LAYER, desc(0.9)),)),
                     Case("firing, it holds between its bar and its clear bar", s(0.95, vllm, then=mid),
                          ((LAYER, desc(mid, vllm)),), eval_time="18m"),
                     Case("firing, it clears under its clear bar", s(0.95, vllm, then=clear - 0.02), eval_time="18m"),
                     Case("between the bars without having fired is silent", s(mid, vllm)),
                 ))


# -- MoEDeadExperts -------------------------------------------------------------------------------------------
def dead(t: Thresholds, b: Thresholds | None = None) -> Suite:
    b = b or t

    def s(unexpected, raw=None, holding=None, then=None, kind="learned"):
        out = {f"moescope_dead_experts_unexpected{{{L}}}": v(unexpected) if then is None else
               _steps(unexpected, then[0], False)}
        if raw is not None:
            out[f"moescope_dead_experts{{{L}}}"] = v(raw)
        if holding is not None or then is not None:
            out[f"moescope_dead_experts_holding{{{L}}}"] = v(holding) if then is None else \
                _steps(unexpected, then[1], False)
        return {**out, **layer_bars(b, "dead", kind, n=45)}

    def desc(n):
        return (f"{n} experts of layer 1 in m got no slot in the window where their reference share (the baseline's, "
                "else the one learned from this deployment's traffic; "
                f"{t.dead_floor_share:.0%} of the fair share with --hot-reference fair) predicts at least "
                f"{t.dead_min_expected_slots:g} effective slots (firing, it holds down to "
                f"{t.dead_clear_expected_slots:g}).")

    return Suite(
        Case("fires", s(2, 2, 2), ((LAYER, desc(2)),)), Case("healthy", s(0, 3, 0)), Case("boundary", s(0, 0, 0)),
        (
            # deepseek-v3-shape after 29 tokens: 1397 experts of 58 x 256 had no slot, all of them chance
            Case("empty experts that sampling explains are not dead", s(0, 1397 // 58)),
            Case("NaN (too few draws, or no reference yet) is not judged", s(NAN, 40, NAN, kind="learning")),
            # hysteresis: 15 minutes with 2 unexpected (firing after its 10m), then none over the firing level (5
            # expected effective slots) but one at the clear level (3.75): held; none at the clear level either:
            # resolved after its keep_firing_for; one at the clear level that never fired: silent
            Case("firing, it holds between its bar and its clear bar", s(2, then=(0, 1)),
                 ((LAYER, desc(1)),), eval_time="30m"),
            Case("firing, it clears under its clear bar", s(2, then=(0, 0)), eval_time="30m"),
            Case("between the bars without having fired is silent", s(0, 1, 1)),
        ))


# -- MoEActivationRatioLow ------------------------------------------------------------------------------------
def activation(t: Thresholds, b: Thresholds | None = None) -> Suite:
    b = b or t

    def s(model, observed, expected):
        lab_ = model_lab(model)
        return {f"moescope_activation_ratio{{{lab_}}}": v(observed),
                f"moescope_activation_expected_ratio{{{lab_}}}": v(expected),
                **model_bar(b, "activation", lab_, expected)}

    def desc(model, observed, expected):
        floor = b.bars([], expected_activation=expected).model["activation"]
        return (f"{model} (rank 0) touches {_pct(observed)} of its parameters per token, under its floor {_pct(floor)} "
                "(from the share its config says a token touches).")

    # expected 0.5: the observed ratio at the floor is exact in binary
    return Suite(
        Case("fires", s(DS, 0.06, 0.08), (({"model": DS, "rank": "0"}, desc(DS, 0.06, 0.08)),)),
        Case("healthy", s("tiny-demo", 0.45, 0.45)),
        Case("boundary", s("m", t.activation_floor * 0.5, 0.5)),
        (
            Case("healthy deepseek-v3-shape (7.7%)", s(DS, 0.0768, 0.0768)),
            Case("healthy DeepSeek-V3 (37B of 671B)", s("deepseek-v3", 0.0551, 0.0551)),
            Case("healthy Mixtral-shaped (13B of 47B)", s("mixtral-8x7b", 0.277, 0.277)),
        ))


# -- MoERoutingDrift ------------------------------------------------------------------------------------------
def _exact_boundary(bar: float) -> tuple[float, float]:
    """(jsd, noise) with jsd == noise + bar exactly in binary (PromQL and Python agree on the boundary)."""
    for noise in (0.03125, 0.0625, 0.015625, 0.125):
        if (noise + bar) - noise == bar:
            return noise + bar, noise
    return bar, 0.0


def drift(t: Thresholds, b: Thresholds | None = None) -> Suite:
    b = b or t

    def s(jsd, noise, then=None):
        return {f"moescope_routing_drift_jsd_bits{{{L}}}": v(jsd) if then is None else _steps(jsd, then, False),
                f"moescope_routing_drift_noise_bits{{{L}}}": v(noise, 45),
                **layer_bars(b, "drift", "baseline", n=45, noise=noise)}

    def say(jsd, noise):
        return (f"Layer 1 of m (rank 0) routes {jsd:.3f} bits (JS divergence) from its baseline, over its bar "
                f"{layer_bar(b, 'drift', 'baseline', noise=noise)[0]:.3f} bits (what sampling noise gives, plus the "
                "drift bar).")

    noise = 0.03125  # exact in binary: jsd - noise lands where it is put
    clear = t.clear_bar(t.drift_bits, 0.0)
    mid = (t.drift_bits + clear) / 2
    return Suite(
        Case("fires", s(0.3, 0.01), ((LAYER, say(0.3, 0.01)),)), Case("healthy", s(0.01, 0.005)),
        Case("boundary", s(*_exact_boundary(t.drift_bits))),
        (
            # a thin window: a large divergence that sampling alone gives
            Case("a divergence within its sampling noise is silent", s(0.3, 0.29)),
            Case("no noise estimate (too few draws) is not judged", s(0.3, NAN)),
            Case("firing, it holds between its bar and its clear bar", s(0.3, noise, noise + mid),
                 ((LAYER, say(noise + mid, noise)),), eval_time="30m"),
            Case("firing, it clears under its clear bar", s(0.3, noise, noise + clear - 0.002), eval_time="30m"),
            Case("between the bars without having fired is silent", s(noise + mid, noise)),
        ))


# -- MoEExpertCacheHitRateLow ---------------------------------------------------------------------------------
def cache_description(hit: float, capacity: float, t: Thresholds = DEFAULT) -> str:
    return (f"Layer 1 of m (rank 0) hits its expert cache {_pct(hit)} of the time, under its floor "
            f"{_pct(layer_bar(t, 'cache', capacity=capacity)[0])} (from the share of its experts it holds resident: "
            "what a random resident set would hit).")


def cache(t: Thresholds, b: Thresholds | None = None) -> Suite:
    b = b or t

    def s(hit, capacity, lookups=100, labels=L):
        return {f"moescope_expert_cache_hits_total{{{labels}}}": f"0+{hit * lookups:g}x20",
                f"moescope_expert_cache_lookups_total{{{labels}}}": f"0+{lookups:g}x20",
                f"moescope_expert_cache_capacity_ratio{{{labels}}}": v(capacity),
                **layer_bars(b, "cache", labels=labels, capacity=capacity)}

    half, small = 0.5, 1 / 8  # half the experts resident; tiny-demo with a cache of one expert of 8
    low = 0.5 * t.cache_floor(small)
    return Suite(
        Case("fires", s(0.1, half), ((LAYER, cache_description(0.1, half, b)),)),
        Case("healthy", s(0.8, half)),
        Case("boundary", s(t.cache_floor(half), half)),
        (
            # the old fixed floor (60-85%) paged on every small cache; its own capacity's floor does not
            Case("a small cache is judged against its own capacity", s(0.8 * small, small)),
            Case("a small cache under its floor fires", s(low, small), ((LAYER, cache_description(low, small, b)),)),
            # two replicas, each with its own cache: one thrashes, the other's hits do not hide it
            Case("two replicas are judged each by its own cache", {
                **s(0.1, half, labels=lab(instance="a:9400")), **s(0.9, half, labels=lab(instance="b:9400"))},
                 (({**LAYER, "instance": "a:9400"}, cache_description(0.1, half, b)),)),
            Case("without a capacity series nothing is judged", {
                f"moescope_expert_cache_hits_total{{{L}}}": "0+1x20",
                f"moescope_expert_cache_lookups_total{{{L}}}": "0+100x20"}),
        ))


# -- the rest -------------------------------------------------------------------------------------------------
def _waits(b: Thresholds, per_rank: dict[tuple[int, int], str], dispatches: str = "0+60x20") -> dict:
    """rank, peer -> wait-seconds values; every rank dispatches once a second and exports the slow-rank bars."""
    out = {f'moescope_all_to_all_peer_wait_seconds_total{{model="m",rank="{r}",peer="{p}"}}': val
           for (r, p), val in per_rank.items()}
    for r in sorted({r for r, _ in per_rank}):
        out[f'moescope_all_to_all_seconds_count{{model="m",rank="{r}",op="dispatch"}}'] = dispatches
        for judgement in ("slow_rank_share", "slow_rank_wait"):
            out.update(model_bar(b, judgement, model_lab(rank=str(r))))
    return out


def slow_rank(t: Thresholds, b: Thresholds | None = None) -> Suite:
    b = b or t

    def desc(peer, share):
        return (f"Rank {peer} accounts for {share} of the time ranks of m wait on their peers (a slow peer: over "
                f"{_pct(b.slow_rank_share)} of the wait and over {_duration(b.slow_rank_wait_s)} per dispatch).")

    return Suite(
        Case("fires", _waits(b, {(0, 2): "0+6x20", (0, 1): "0+0.1x20", (1, 2): "0+6x20"}),
             (({"model": "m", "peer": "2"}, desc(2, "99.17%")),)),  # 12 / 12.1
        Case("healthy", _waits(b, {(0, 2): "0+1x20", (0, 1): "0+1x20", (1, 2): "0+1x20", (1, 0): "0+1x20"})),
        # waits long per dispatch, but split evenly: exactly the share bar, not over it
        Case("boundary", _waits(b, {(0, 2): "0+6x20", (0, 1): "0+6x20"})),
        (
            # two healthy ranks: one peer always holds over half of a tiny total wait (1 ms a dispatch)
            Case("two healthy ranks", _waits(b, {(0, 1): "0+0.06x20", (1, 0): "0+0.03x20"})),
            # rank 1 late by 20 ms at every dispatch (the demo's slow-rank fault)
            Case("two ranks, one 20 ms late", _waits(b, {(0, 1): "0+1.2x20", (1, 0): "0+0.03x20"}),
                 (({"model": "m", "peer": "1"}, desc(1, "97.56%")),)),
        ))


def a2a(t: Thresholds, b: Thresholds | None = None) -> Suite:
    b = b or t

    def h(*buckets):
        return {**{f'moescope_all_to_all_seconds_bucket{{model="m",rank="0",op="dispatch",le="{le}"}}': val
                   for le, val in buckets}, **model_bar(b, "all_to_all")}

    # p99 of 60 obs/min all in (1 ms, 10 ms] = 1 + 9 * 0.99 = 9.91 ms
    return Suite(
        Case("fires", h(("0.001", "0x20"), ("0.01", "0+60x20"), ("+Inf", "0+60x20")),
             (({"model": "m", "rank": "0", "op": "dispatch"}, "p99 of the dispatch all-to-all on rank 0 of m is "
               f"9.91ms (bar: {_duration(b.all_to_all_p99_s)})."),)),
        Case("healthy", h(("0.001", "0+60x20"), ("0.01", "0+60x20"), ("+Inf", "0+60x20"))),
        Case("boundary", h((f"{t.all_to_all_p99_s!r}", "0+60x20"), ("+Inf", "0+60x20"))))


def switch_jitter(t: Thresholds, b: Thresholds | None = None) -> Suite:
    b = b or t

    def h(*buckets):
        return {**{f'moescope_expert_fetch_seconds_bucket{{{L},le="{le}"}}': val for le, val in buckets},
                **model_bar(b, "fetch")}

    return Suite(
        Case("fires", h(("0.01", "0x20"), ("0.25", "0+10x20"), ("+Inf", "0+10x20")),
             (({"model": "m", "rank": "0"}, "p99 time to make an expert resident on m rank 0 is 247.6ms (bar: "
               f"{_duration(b.fetch_p99_s)})."),)),
        Case("healthy", h(("0.01", "0+10x20"), ("+Inf", "0+10x20"))),
        Case("boundary", h((f"{t.fetch_p99_s!r}", "0+10x20"), ("+Inf", "0+10x20"))))


def nonfinite(t: Thresholds, b: Thresholds | None = None) -> Suite:
    s = f"moescope_router_nonfinite_logits_total{{{L}}}"
    return Suite(Case("fires", {s: "0 0 3 3 3 3"}, ((LAYER, "Layer 1 of m (rank 0) produced 3 non-finite router "
                                                             "logits in 5 minutes."),)),
                 Case("healthy", {s: "0x20"}), Case("boundary", {s: "5x20"}), eval_time="3m")


def flips(t: Thresholds, b: Thresholds | None = None) -> Suite:
    b = b or t
    clear = t.clear_bar(t.flip_ratio, 0.0)
    mid = (t.flip_ratio + clear) / 2

    def s(x, then=None):
        return {f"moescope_routing_flip_ratio{{{L}}}": v(x) if then is None else _steps(x, then, True),
                **layer_bars(b, "flips")}

    def desc(x):
        return (f"{_pct(x)} of the canary tokens changed experts in layer 1 of m (rank 0), over its bar "
                f"{_pct(layer_bar(b, 'flips')[0])}.")

    return Suite(Case("fires", s(0.12), ((LAYER, desc(0.12)),)),
                 Case("healthy", s(0.0)), Case("boundary", s(t.flip_ratio)),
                 (Case("firing, it holds between its bar and its clear bar", s(0.12, mid), ((LAYER, desc(mid)),),
                       eval_time="18m"),
                  Case("firing, it clears under its clear bar", s(0.12, clear - 0.005), eval_time="18m"),
                  Case("between the bars without having fired is silent", s(mid))))


def drops(t: Thresholds, b: Thresholds | None = None) -> Suite:
    b = b or t

    def s(dropped):
        return {f"moescope_tokens_dropped_total{{{L}}}": dropped, f"moescope_router_tokens_total{{{L}}}": "0+1000x20",
                **layer_bars(b, "drops")}

    return Suite(Case("fires", s("0+50x20"), ((LAYER, "Layer 1 of m drops 5% slots per routed token (bar: "
                                                      f"{_pct(layer_bar(b, 'drops')[0])})."),)),
                 Case("healthy", s("0x20")), Case("boundary", s(f"0+{t.drop_ratio * 1000:g}x20")))


def memory(t: Thresholds, b: Thresholds | None = None) -> Suite:
    b = b or t

    def s(values):
        return {'moescope_process_resident_memory_bytes{model="m",rank="0"}': values, **model_bar(b, "memory", n=60)}

    # 5.5e9 B at 45 min, +1e8 B/min: 5.5e9 + 1e8 / 60 * 14400 = 2.95e10 B = 27.47 GiB
    return Suite(Case("fires", s("1e9+1e8x60"), (({"model": "m", "rank": "0"}, "At its current rate m (rank 0) "
                                                  "reaches memory capacity within 4h (predicted 27.47GiB)."),)),
                 Case("healthy", s("1e9x60")), Case("boundary", s("1e9+1e6x60")), eval_time="45m")


def exporter_down(t: Thresholds, b: Thresholds | None = None) -> Suite:
    up = 'up{job="moescope",instance="127.0.0.1:9400"}'
    # fires: it served, then stopped; boundary: a listed target nothing ever served (a rank that does not run)
    return Suite(Case("fires", {up: "1x5 0x15"}, (({"job": "moescope", "instance": "127.0.0.1:9400"},
                                                   "Prometheus cannot scrape 127.0.0.1:9400 (job moescope)."),)),
                 Case("healthy", {up: "1x20"}), Case("boundary", {up: "0x20"}))


def exporter_absent(t: Thresholds, b: Thresholds | None = None) -> Suite:
    up = 'up{job="moescope",instance="127.0.0.1:9400"}'
    # absent() of a regex matcher carries no labels
    return Suite(Case("fires", {'up{job="other",instance="x"}': "1x20"},
                      (({}, "Prometheus has no moescope scrape target: check the scrape configuration."),)),
                 Case("healthy", {up: "1x20"}), Case("boundary", {up: "0x20"}))


SUITES = {
    "MoEExpertLoadImbalance": imbalance, "MoEExpertHot": hot, "MoERankLoadImbalance": rank,
    "MoEExpertCollapse": collapse, "MoEDeadExperts": dead, "MoEActivationRatioLow": activation,
    "MoEAllToAllLatencyHigh": a2a, "MoESlowRank": slow_rank, "MoEExpertCacheHitRateLow": cache,
    "MoEExpertSwitchJitter": switch_jitter, "MoERouterNonFiniteLogits": nonfinite, "MoERoutingFlips": flips,
    "MoERoutingDrift": drift, "MoETokensDropped": drops, "MoEMemoryGrowth": memory,
    "MoEExporterDown": exporter_down, "MoEExporterAbsent": exporter_absent,
}


def suites(t: Thresholds = DEFAULT, b: Thresholds | None = None) -> dict[str, Suite]:
    """Every alert's suite: quantities placed by ``t``, bar series written by ``b`` (default ``t``)."""
    return {name: make(t, b) for name, make in SUITES.items()}
