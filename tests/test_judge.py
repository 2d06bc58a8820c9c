"""The one routing judgement (``moescope.judge``): its combining rules against the rules' documented semantics,
its quantities against naive recomputations, and every view reading it (the exporter's window, ``diagnose`` from
a store with dropped slots, ``top``'s verdicts over exported series) agreeing with them."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest

from moescope import judge, sampling
from moescope.analysis import diagnose
from moescope.metrics.window import RoutingWindow
from moescope.thresholds import DEFAULT
from moescope.tui.routing_view import layer_routing
from reference import naive_window_judgement

ROOT = Path(__file__).resolve().parents[1]


def _naive_cv(row) -> float:
    mean = sum(row) / len(row)
    return math.sqrt(sum((x - mean) ** 2 for x in row) / len(row)) / mean if mean else 0.0


# -- the combining rules (docs/alerts.md: a drifted layer's imbalance is the drift's; a collapse inhibits the hot
# alert it causes; every bar is the Thresholds field named) -------------------------------------------------

BAR = DEFAULT.imbalance_cv


@pytest.mark.parametrize("case, kw, fires, shown", [
    ("quiet", dict(excess_cv=BAR / 2, baseline_cv=None, top_share=0.2), [], ()),
    ("imbalanced", dict(excess_cv=BAR * 2, baseline_cv=None, top_share=0.2), ["MoEExpertLoadImbalance"], ()),
    ("not judged", dict(excess_cv=math.nan, baseline_cv=None, top_share=0.2), [], ()),
    ("drift mutes imbalance", dict(excess_cv=BAR * 2, baseline_cv=None, top_share=0.2, drift_jsd=0.5,
                                   drift_noise=0.01), ["MoERoutingDrift"], ()),
    ("drift within noise", dict(excess_cv=BAR * 2, baseline_cv=None, top_share=0.2, drift_jsd=0.05,
                                drift_noise=0.04), ["MoEExpertLoadImbalance"], ()),
    ("hot", dict(excess_cv=BAR / 2, baseline_cv=None, top_share=0.3,
                 hot_factors={3: DEFAULT.hot_factor * 1.5, 1: DEFAULT.hot_factor * 2, 2: DEFAULT.hot_factor / 2}),
     ["MoEExpertHot:1", "MoEExpertHot:3"], (1, 3)),
    ("collapse hides hot (but both fire: Alertmanager inhibits)",
     dict(excess_cv=BAR * 3, baseline_cv=None, top_share=DEFAULT.collapse_top_share + 0.1,
          hot_factors={0: DEFAULT.hot_factor * 2}),
     ["MoEExpertCollapse", "MoEExpertLoadImbalance", "MoEExpertHot:0"], ()),
    ("dead and rank", dict(excess_cv=0.0, baseline_cv=None, top_share=0.1, dead_unexpected=2.0,
                           rank_max_over_mean=DEFAULT.rank_max_over_mean + 0.5),
     ["MoEDeadExperts", "MoERankLoadImbalance"], ()),
    ("a baseline raises the bar", dict(excess_cv=BAR * 2, baseline_cv=BAR * 2, top_share=0.2), [], ()),
])
def test_verdict_combines_as_the_rules_do(case, kw, fires, shown):
    v = judge.verdict(**kw)
    assert v.fires() == fires, case
    assert v.hot_shown == shown, case


def test_top_reads_its_verdicts_from_the_same_function():
    """``top``'s layer line (over the series the exporter exports) fires what ``judge.verdict`` fires."""
    gauges = {"cv": 1.2, "excess_cv": BAR * 2, "top_share": 0.3, "max_over_mean": 4.0, "baseline_cv": math.nan,
              "drift_jsd": 0.5, "drift_noise": 0.01, "dead_unexpected": 1.0, "rank_max_over_mean": math.nan}
    hot = {5: (DEFAULT.hot_factor * 1.2, "fair")}
    r = layer_routing(2, gauges, 8, hot_factors=hot)
    v = judge.verdict(excess_cv=gauges["excess_cv"], baseline_cv=None, top_share=0.3, drift_jsd=0.5,
                      drift_noise=0.01, hot_factors={5: hot[5][0]}, dead_unexpected=1.0)
    assert list(r.fires) == v.fires() == ["MoEDeadExperts", "MoERoutingDrift", "MoEExpertHot:5"]
    assert r.hot_factors == ((5, hot[5][0], "fair"),)


# -- the quantities against naive recomputations, in every view -------------------------------------------

def _per_request(rng, n_req=40, n_layers=3, n_exp=8, per=24):
    p = rng.dirichlet(np.ones(n_exp) * 0.7, size=n_layers)
    out = np.zeros((n_req, n_layers, n_exp), np.int64)
    for r in range(n_req):
        for li in range(n_layers):
            out[r, li] = rng.multinomial(per, p[li])
    return out


def test_the_exporter_window_exports_the_judgement():
    """The window's gauges against naive formulas: the CV (population std / mean, zeros included), max/mean,
    and the top share as the busiest expert's slots over the tokens the layer routed (not slots / k: a layer
    that dropped slots routed more tokens than its slots say)."""
    rng = np.random.default_rng(1)
    per = _per_request(rng)
    counts = per.sum(0)
    tokens = counts.sum(1) // 2 + np.array([0, 7, 30])  # top-2, and some tokens' slots dropped
    w = RoutingWindow((1, 2, 3), 8, window_s=60)
    for li in range(3):
        w.add(10, li + 1, counts[li], int(tokens[li]), 0.0, 0.0)
    w.add_draws(10.0, per)
    g = w.gauges()
    for li in range(3):
        row = counts[li].tolist()
        assert g.cv[li] == pytest.approx(_naive_cv(row))
        assert g.max_over_mean[li] == pytest.approx(max(row) / (sum(row) / 8))
        assert g.top_share[li] == pytest.approx(max(row) / tokens[li])
    # The sampling noise, the excess beyond it and the hot factors against docs/metrics.md's formulas written out
    # per request (tests/reference.py), in the exporter's window and in diagnose's path over the same requests.
    z_hot = NormalDist().inv_cdf(1 - DEFAULT.family_alpha / (3 * 8))  # Bonferroni over the L x E experts
    ref = naive_window_judgement(per.tolist(), DEFAULT.noise_z, z_hot)
    assert np.isfinite(ref["hot_factor"]).any() and not np.isfinite(ref["hot_factor"]).all()  # some hot, not all
    j = diagnose.judge_requests(per, [1, 2, 3], 2, tokens=tokens)  # diagnose's path, the same window
    for view, hot in ((g, g.hot), (j, j.hot_factor)):
        for name in ("cv", "noise_cv", "excess_cv"):
            assert np.allclose(getattr(view, name), ref[name]), name
        assert np.allclose(hot, ref["hot_factor"], equal_nan=True)
    for li in range(3):
        row = counts[li].tolist()
        assert j.top_share[li] == pytest.approx(max(row) / tokens[li])
        assert j.max_over_mean[li] == pytest.approx(max(row) / (sum(row) / 8))


def test_diagnose_divides_the_top_share_by_routed_tokens_from_the_store():
    """A stored window with dropped slots (expert id == E): the top share is the busiest expert's slots over the
    positions routed, counted naively from the stored arrays, as the exporter divides by tokens."""
    rng = np.random.default_rng(2)
    e, k, n = 4, 2, 30
    routing, entropy = [], []
    for _ in range(6):
        ids = np.stack([rng.permutation(e)[:k] for _ in range(n)])[:, None, :].astype(np.int16)
        ids[: n // 3, 0, 1] = e  # a third of the positions dropped their second slot (capacity)
        ids[:, 0, 0] = np.where(rng.random(n) < 0.6, 0, ids[:, 0, 0])  # expert 0 busy
        routing.append(ids)
        entropy.append(np.zeros((n, 1), np.float32))
    w = diagnose.Window(ids=[f"r{i}" for i in range(6)], started=np.arange(6.0), domain=[None] * 6,
                        tenant=[None] * 6, model="m", n_experts=e, top_k=k, layers=[1],
                        tokens=[np.zeros(n, np.int64)] * 6, routing=routing, entropy=entropy,
                        miss=[np.zeros((n, 1), np.uint8)] * 6, step_of=[np.zeros(n, np.int64)] * 6, steps=[{}])
    allids = np.concatenate([r[:, 0, :].ravel() for r in routing])
    busiest = max(int((allids == x).sum()) for x in range(e))
    j = diagnose.window_judgement(w)
    assert j.top_share[0] == pytest.approx(busiest / (6 * n))
    assert j.top_share[0] < busiest / ((allids < e).sum() / k)  # what slots / k would have said


def test_drift_between_halves_is_noise_on_unchanged_routing_and_beyond_it_on_a_change():
    rng = np.random.default_rng(3)
    a, b = _per_request(rng, n_req=60), _per_request(np.random.default_rng(3), n_req=60)
    jsd, noise = judge.drift_between(a.sum(0), judge.draws_of(a), a.sum(0), judge.draws_of(a))
    assert np.allclose(jsd, 0) and (noise > 0).all()
    shifted = b.copy()
    shifted[:, :, 0] += 40  # every request now sends 40 more slots to expert 0
    jsd, noise = judge.drift_between(a.sum(0), judge.draws_of(a), shifted.sum(0), judge.draws_of(shifted))
    assert all(DEFAULT.drifted(x, y) for x, y in zip(jsd.tolist(), noise.tolist()))


# -- bars with their derivations --------------------------------------------------------------------------

def test_mix_shift_is_judged_against_its_sampling_noise():
    before, after = {"code": 0.6, "chat": 0.4}, {"code": 0.4, "chat": 0.6}  # a fifth of the traffic moved
    assert not DEFAULT.mix_shifted(before, before, 1000, 1000)
    assert not DEFAULT.mix_shifted(before, after, 10, 10)  # ten requests a side cannot tell
    assert DEFAULT.mix_shifted(before, after, 1000, 1000)


def test_determinism_needs_two_flips_over_the_bar():
    """At the fewest positions diagnose judges, one flipped position is within the bar; at one fewer it is not."""
    n = DEFAULT.flip_min_compared()
    assert 1 / n <= DEFAULT.flip_ratio < 1 / (n - 1)


def test_judged_quantities_are_computed_in_one_module():
    """No view computes a judged quantity itself: the sampling tests (noise CV, excess CV, hot factor, dead
    experts, drift noise) are called from ``moescope/judge.py`` alone (``analysis/baseline.py`` fits a
    baseline's structural CV, which judges nothing)."""
    judged = {"noise_cv", "excess_cv", "hot_factor", "hot_reference", "dead_unexpected", "dead_mask",
              "drift_noise_bits", "jensen_shannon_rows"}
    callers = {}
    for path in (ROOT / "moescope").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in judged:
                callers.setdefault(node.func.attr, set()).add(path.relative_to(ROOT).as_posix())
    allowed = {"moescope/judge.py", "moescope/sampling.py"}
    assert {k: v - allowed for k, v in callers.items() if v - allowed} == {"excess_cv": {
        "moescope/analysis/baseline.py"}}
    assert sampling.MIN_DRAWS >= 2
