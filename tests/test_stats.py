"""moescope.stats: its percentile is numpy's (linear interpolation), checked against the textbook definition; each
load statistic (max/mean, top share, per-rank load) is defined there once, and every caller reports its value."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moescope import judge, stats
from moescope.capture.sources import Reading
from moescope.metrics.state import MetricsObserver, ModelInfo, modelled_rank_loads
from moescope.parallel import planner
from moescope.parallel.placement import Placement, _layout
from moescope.thresholds import DEFAULT
from moescope.tui.top_data import cache_judgement
from reference import naive_max_over_mean, naive_rank_loads, naive_top_share


def naive_percentile(values, q):
    """Linear interpolation between the closest ranks (numpy's default 'linear' method), by hand."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=200), st.floats(0, 100))
def test_percentile_equals_linear_interpolation(values, q):
    assert math.isclose(stats.percentile(values, q), naive_percentile(values, q), rel_tol=1e-9, abs_tol=1e-6)


def test_percentile_of_nothing_is_nan_and_of_a_tuple_works():
    assert math.isnan(stats.percentile([], 50))
    assert stats.percentile((3.0, 1.0, 2.0), 50) == 2.0
    assert stats.percentile([0.0, 10.0], 99) == 9.9


# -- each load statistic defined once (moescope.stats, row-wise), every caller getting its value ------------------
# The same counts go through every caller that reports a max/mean, a top share or a per-rank load: the judge (the
# exporter's window, diagnose, report and the summary call it), the planner's JSON, EPLB in the loop, the exporter's
# per-rank and EPLB gauges; each answer is compared with tests/reference.py's naive loops, the empty load included
# (max/mean and top share of an empty load: NaN, "not defined"; a caller that leaves such a layer out says so).

COUNTS = np.array([[40, 3, 0, 7, 12, 9, 1, 8],  # skewed
                   [0, 0, 0, 0, 0, 0, 0, 0],  # the empty load
                   [5, 5, 5, 5, 5, 5, 5, 5],  # balanced
                   [0, 0, 0, 0, 0, 0, 0, 9]], dtype=np.float64)  # one expert took everything
TOKENS = np.array([30.0, 0.0, 20.0, 9.0])
PLACED = ((0, 1, 2, 3), (4, 5, 6, 7, 0))  # two ranks, expert 0 replicated on both


def _same(a, b) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12)


def test_max_over_mean_top_share_and_rank_loads_equal_the_naive_loops_row_wise_and_on_an_empty_load():
    mom, top = stats.max_over_mean_rows(COUNTS), stats.top_share_rows(COUNTS, TOKENS)
    for i, row in enumerate(COUNTS.tolist()):
        assert _same(float(mom[i]), naive_max_over_mean(row)), i
        assert _same(float(top[i]), naive_top_share(row, TOKENS[i])), i
        assert np.allclose(stats.rank_loads(np.array(row), PLACED), naive_rank_loads(row, PLACED))
    assert math.isnan(mom[1]) and math.isnan(top[1])  # the one answer for an empty load
    # leading axes: [2, 2, E] in, [2, 2] / [2, 2, N] out, row by row the same
    assert np.array_equal(stats.max_over_mean_rows(COUNTS.reshape(2, 2, 8)), mom.reshape(2, 2), equal_nan=True)
    assert np.allclose(stats.rank_loads(COUNTS.reshape(2, 2, 8), PLACED),
                       [[naive_rank_loads(r, PLACED) for r in pair] for pair in COUNTS.reshape(2, 2, 8).tolist()])


def test_every_caller_reports_the_same_max_over_mean_and_top_share_for_the_same_counts():
    from moescope.parallel.expert_parallel import ExpertParallel

    layers = [1, 2, 3, 4]
    want_mom = [naive_max_over_mean(r) for r in COUNTS.tolist()]
    # the judge: what the exporter's window exports and diagnose, report and the summary show
    j = judge.judge_window(COUNTS, judge.worst_case_draws(COUNTS, 1), layers, top_k=2, tokens=TOKENS)
    for i, row in enumerate(COUNTS.tolist()):
        assert _same(float(j.max_over_mean[i]), want_mom[i])
        assert _same(float(j.top_share[i]), naive_top_share(row, TOKENS[i]))
    assert not j.verdict(1).collapsed and j.verdict(3).collapsed  # NaN is under every bar; 9 of 9 tokens is not
    # per-rank loads: EPLB's measured rows (its dict leaves an empty layer out), the exporter's EPLB and per-rank
    # gauges (NaN / left out), the planner's JSON (None)
    per_rank = {layer: naive_rank_loads(row, PLACED) for layer, row in zip(layers, COUNTS.tolist())}
    want_rank = {layer: naive_max_over_mean(r) for layer, r in per_rank.items()}
    assert ExpertParallel.max_over_mean(per_rank) == pytest.approx(
        {layer: v for layer, v in want_rank.items() if not math.isnan(v)})
    obs = MetricsObserver(ModelInfo("m", 8, 2, tuple(layers), 100, 10))
    obs.counts.eplb_predicted = {layer: 1.0 for layer in layers}
    obs.counts.eplb_rows = {layer: np.array(r) for layer, r in per_rank.items()}
    _, _, measured = obs.counts.eplb_gauges()
    assert all(_same(measured[layer], want_rank[layer]) for layer in layers)
    for layer, r in per_rank.items():
        obs.counts.rank_window.add(layer, np.array(r), obs.clock())
    got, _ = obs.flush().rank_loads
    assert got == pytest.approx({layer: v for layer, v in want_rank.items() if not math.isnan(v)})
    obs2 = MetricsObserver(ModelInfo("m", 8, 2, tuple(layers), 100, 10))
    placed = Placement(2, 8, {layer: PLACED for layer in layers}, replicated=True)
    obs2.sources.register(SimpleNamespace(read=lambda: Reading(placement=placed)))
    obs2.flush()  # the sources are read once per evaluation
    modelled, _ = modelled_rank_loads(obs2.placement(), SimpleNamespace(layers=tuple(layers), slots=COUNTS,
                                                                       noise_cv=np.zeros(4)))
    assert modelled == pytest.approx({layer: v for layer, v in want_rank.items() if not math.isnan(v)})
    profile = SimpleNamespace(n_experts=8, coactivation={},
                              load=lambda: {layer: row for layer, row in zip(layers, COUNTS)})
    plan = planner.plan(profile, 2)
    rr = [list(x) for x in _layout("round-robin", 8, 2)]
    for layer, row in zip(layers, COUNTS.tolist()):
        for key, per in (("planned_max_over_mean", plan.layers[layer]), ("round_robin_max_over_mean", rr)):
            want = naive_max_over_mean(naive_rank_loads(row, per))
            assert plan.predicted[layer][key] == (None if math.isnan(want) else round(want, 4)), (layer, key)


def test_cache_thrash_is_judged_once_for_top_and_diagnose():
    """``judge.cache_thrash`` (diagnose calls it on a store's miss bits, ``top`` through ``cache_judgement`` on the
    exporter's counters) against the bar written out: a hit rate under ``cache_floor_of_capacity`` x capacity;
    a layer without lookups or with an unknown capacity is not judged."""
    hits, lookups, cap = [10, 0, 30, 5, 1], [100, 0, 40, 50, 10], [0.5, 0.5, 0.5, float("nan"), 0.25]
    want = [lookups[i] > 0 and not math.isnan(cap[i]) and hits[i] / lookups[i] < DEFAULT.cache_floor_of_capacity
            * cap[i] for i in range(5)]
    rate, floor, low = judge.cache_thrash(hits, lookups, cap)
    assert low.tolist() == want == [True, False, False, False, True]
    assert _same(float(rate[0]), 0.1) and math.isnan(rate[1]) and floor[0] == DEFAULT.cache_floor_of_capacity * 0.5
    keys = [(str(i),) for i in range(5)]
    got = cache_judgement(dict(zip(keys, map(float, hits))), dict(zip(keys, map(float, lookups))),
                          dict(zip(keys, cap)))
    assert got == {i: (hits[i] / lookups[i], DEFAULT.cache_floor_of_capacity * cap[i]) for i in range(5) if want[i]}
