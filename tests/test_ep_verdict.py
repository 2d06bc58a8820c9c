"""The verdict on EP and EPLB (moescope/ep_verdict.py, thresholds.Thresholds.eplb_*) and its offline inputs
(analysis/ep_advice.py): the bar from its definition (the sample's noise and one rearrangement's published cost), the
flags vLLM takes, per-step counts rebuilt from stored routing against a naive loop, and diagnose's finding."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from moescope import ep_verdict
from moescope.analysis import ep_advice
from moescope.thresholds import DEFAULT
from reference import naive_max_over_mean, naive_rank_loads


def test_worth_needs_a_gain_beyond_noise_and_over_one_rearrangements_cost():
    t = DEFAULT
    # vLLM #50647: 3.17x a step -> 2.17 step times more; #47206: 16 s, in step times where a step's time is known
    assert t.eplb_cost_steps(None) == pytest.approx(2.17)
    assert t.eplb_cost_steps(0.05) == pytest.approx(16 / 0.05)
    assert t.eplb_gain_steps(1.5, 1.2, 3000) == pytest.approx(3000 * (1 - 1.2 / 1.5))
    assert t.eplb_worth(1.5, 0.01, 1.2, 0.01, 3000)  # 600 step times saved, 4 standard errors of 0.014 apart
    assert not t.eplb_worth(1.5, 0.08, 1.2, 0.08, 3000)  # 0.3 apart within 3 x hypot(0.08, 0.08) = 0.34
    assert t.eplb_beyond_noise(1.5, 0.05, 1.2, 0.05) and not t.eplb_beyond_noise(1.5, 0.08, 1.2, 0.08)
    assert not t.eplb_worth(1.5, 0.01, 1.2, 0.01, 3000, step_s=0.005)  # 600 < 16 s / 5 ms = 3200 step times
    assert not t.eplb_worth(1.5, float("nan"), float("nan"), 0.0, 3000)


def F(placement, straggler, se=0.01, redundant=0, ep=8):
    return ep_verdict.Figures(placement, ep, redundant, 1.4, 2.1, straggler, se, 1.05, 500)


def test_the_verdict_compares_linear_with_the_best_eplb_and_prints_vllms_flags():
    figs = [F("linear", 1.6), F("round_robin", 1.5), F("eplb", 1.3, redundant=8), F("eplb", 1.1, redundant=16),
            F("linear", 1.9, ep=16)]
    v = ep_verdict.verdict(figs, 8, 1000, 3000)
    assert v.static.placement == "linear" and v.eplb.redundant == 16 and v.worth and v.beyond_noise
    text = "\n".join(v.lines())
    assert "EP 8 linear: step max/mean p50 1.40, p99 2.10" in text and "EPLB R=16 every 3000 steps" in text
    flag = v.flags
    assert flag.startswith("--enable-expert-parallel --enable-eplb --eplb-config '") and flag in text
    cfg = json.loads(flag.split("'")[1])
    assert cfg == {"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 16}
    flat = ep_verdict.verdict([F("linear", 1.10), F("eplb", 1.09, redundant=8)], 8, 1000, 3000)
    assert not flat.worth and "Not worth a rearrangement's cost" in flat.lines()[-1]
    assert ep_verdict.verdict(figs, 4, 1000, 3000) is None  # no linear figure at EP 4
    assert ep_verdict.default_ep((2, 4, 8, 16)) == 8 and ep_verdict.default_ep((3, 6, 12)) == 6


def naive_step_counts(routing, step_of, n_experts, n_layers):
    steps = sorted({int(s) for so in step_of for s in so})
    out = np.zeros((len(steps), n_layers, n_experts))
    for ids, so in zip(routing, step_of):
        for pos in range(len(so)):
            for layer in range(n_layers):
                for e in ids[pos, layer]:
                    if e < n_experts:
                        out[steps.index(int(so[pos])), layer, e] += 1
    return out


def test_step_counts_rebuild_each_steps_slots_from_stored_requests():
    rng = np.random.default_rng(4)
    routing = [rng.integers(0, 9, size=(n, 3, 2)) for n in (5, 8, 3)]  # 9 = the dropped sentinel of 8 experts
    step_of = [np.sort(rng.choice([2, 5, 7, 11], size=len(r))) for r in routing]
    got = ep_advice.step_counts(routing, step_of, 8, 3)
    assert np.array_equal(got, naive_step_counts(routing, step_of, 8, 3))


def test_diagnose_finding_judges_the_windows_steps_out_of_sample():
    """Steps that each load one half of 8 experts (alternating): at EP 8 linear every step loads 4 ranks of 8
    (max/mean 2); the finding's straggler is the naive one on the steps after the held-out half."""
    n = 40
    routing, step_of = [], []
    for s in range(n):
        half = np.arange(4) + (4 if s % 2 else 0)
        routing.append(np.array([[half[:2], half[:2]], [half[2:], half[2:]]]))  # [2 tokens, 2 layers, top-2]
        step_of.append(np.full(2, s))
    w = SimpleNamespace(routing=routing, step_of=step_of, n_experts=8, layers=[1, 2],
                        steps=[{"phase": "decode", "seconds": 0.01}] * n)
    f = ep_advice.diagnose_finding(w)
    assert f["cause"] == "ep-balance" and f["severity"] == "info"
    ev = f["evidence"]
    assert ev["ep"] == 8 and ev["steps_held_out"] == n // 2 and ev["steps_judged"] == n // 2
    counts = naive_step_counts(routing, step_of, 8, 2)[n // 2:]
    per_rank = [[e] for e in range(8)]
    b = sum(max(naive_rank_loads(c[i], per_rank)) for c in counts for i in range(2))
    m = sum(sum(naive_rank_loads(c[i], per_rank)) / 8 for c in counts for i in range(2))
    assert ev["static"]["straggler"] == pytest.approx(b / m)
    assert ev["static"]["p50"] == pytest.approx(np.median([max(naive_max_over_mean(
        naive_rank_loads(c[i], per_rank)) for i in range(2)) for c in counts]))
    assert math.isfinite(ev["eplb"]["straggler"]) and ev["step_s"] == pytest.approx(0.01)


def test_tops_line_is_the_verdict_of_the_exported_series():
    """`moescope top` reads the exposition (the histogram's buckets, the straggler gauges): its line is the
    verdict of the exporter's own snapshot (the same quantiles, the same bar)."""
    from moescope.metrics import catalogue, step_balance_families
    from moescope.metrics.exposition import FamilyWriter
    from moescope.parallel import step_balance as sb
    from moescope.tui import top_data
    from moescope.tui.ep_view import ep_line

    rng = np.random.default_rng(2)
    b = sb.StepBalance((1, 2), 16, buckets=catalogue.STEP_BALANCE_BUCKETS, ep_sizes=(4, 8),
                       schedule=sb.Schedule(window=20, every=40))
    for _ in range(30):
        c = rng.integers(0, 4, size=(8, 2, 16)).astype(np.float32)
        c[:, :, rng.integers(0, 16)] += 25  # a hot expert per summary
        b.observe_counts(c, 32, c.sum(0) * 4)
    snap = b.snapshot()
    text = step_balance_families.text(snap, FamilyWriter("m", "0"), False, full=True)
    line = ep_line(top_data.parse_exposition(text), top_data._quantile)
    figs = [ep_verdict.Figures(e.placement, e.ep, e.redundant, e.quantile(0.5), e.quantile(0.99), e.straggler,
                               e.stderr, e.average, int(e.count[0])) for e in snap.entries]
    want = ep_verdict.verdict(figs, 8, 20, 40)
    assert line == want.short() and line.startswith("EP 8 linear")
