"""The step-level prediction (parallel/step_balance.py, issue [eplb]) against naive recomputations: per-step rank
loads slot by slot, vLLM's static expert maps as its docstring states them, the straggler and average figures from
their definitions, EPLB's schedule step by step, and the workload whose whole-run counts are even while its steps are
skewed (the straggler factor reported above the average one)."""

from __future__ import annotations

import numpy as np
import pytest

from moescope.errors import BadInput
from moescope.metrics import catalogue
from moescope.metrics.exposition import FamilyWriter
from moescope.metrics import step_balance_families
from moescope.parallel import eplb_policy, planner
from moescope.parallel import step_balance as sb
from reference import naive_max_over_mean, naive_rank_loads

BUCKETS = catalogue.STEP_BALANCE_BUCKETS


def balance(layers, n_experts, **kw):
    return sb.StepBalance(layers, n_experts, buckets=BUCKETS, **kw)


def per_rank(layout: sb.Layout, layer: int) -> list[list[int]]:
    """The experts each rank holds, read slot by slot from the physical-to-logical map."""
    row = layout.phy2log[layer]
    per = len(row) // layout.ep
    return [[int(e) for e in row[r * per:(r + 1) * per] if e >= 0] for r in range(layout.ep)]


def test_vllm_static_maps_as_its_expert_map_manager_states_them():
    """linear: contiguous blocks, the remainder to the first ranks; round_robin: expert e on rank e mod N
    (vllm/model_executor/layers/fused_moe/expert_map_manager.py determine_expert_map)."""
    lin = sb.static_layout("linear", 10, 4, 1)
    assert per_rank(lin, 0) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    rr = sb.static_layout("round_robin", 10, 4, 1)
    assert per_rank(rr, 0) == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    assert lin.kind is None and sb.static_layout("linear", 12, 4, 2).kind == "linear"
    with pytest.raises(BadInput, match="unknown static placement"):
        sb.static_layout("random", 8, 2, 1)


@pytest.mark.parametrize("n_experts,ep,redundant", [(12, 4, 0), (12, 3, 3), (10, 4, 2), (16, 8, 8)])
def test_rank_loads_equal_a_slot_by_slot_recomputation(n_experts, ep, redundant):
    """Every kind of layout (static reshape, the fold from a finer size, a replicated map's matmul) gives each rank
    what a naive sum over the experts it holds gives, a replicated expert split over its replicas."""
    rng = np.random.default_rng(n_experts + ep)
    counts = rng.integers(0, 9, size=(5, 3, n_experts)).astype(np.float32)
    layouts = [sb.static_layout(p, n_experts, ep, 3) for p in ("linear", "round_robin")]
    if (n_experts + redundant) % ep == 0:
        phy = eplb_policy.rebalance(counts.sum(0), n_experts + redundant, 1, 1, ep)
        layouts.append(sb.Layout("eplb", ep, redundant, phy))
    for lay in layouts:
        got = sb.rank_loads(counts, lay)
        for s in range(5):
            for i in range(3):
                assert got[s, i] == pytest.approx(naive_rank_loads(counts[s, i].tolist(), per_rank(lay, i)))
    for kind in ("linear", "round_robin"):  # a coarser size folded from a finer one
        fine = sb.rank_loads(counts, sb.static_layout(kind, 16, 8, 3)) if n_experts == 16 else None
        if fine is not None:
            assert np.allclose(sb._fold(fine, kind, 2), sb.rank_loads(counts, sb.static_layout(kind, 16, 2, 3)))


def run(b, steps):
    """Feed ``steps`` ([S, L, E] per-step counts) one summary per step, every step sampled."""
    for c in steps:
        b.observe_counts(c[None], 1, c)
    return b.snapshot()


def skewed_steps(n_steps=40, n_layers=2, n_experts=8):
    """Each step routes all its slots to one half of the experts, alternating: every expert gets the same slots over
    the run (even whole-run counts), while every step loads one rank of a 2-rank linear placement only."""
    out = []
    for s in range(n_steps):
        c = np.zeros((n_layers, n_experts), np.float32)
        half = n_experts // 2
        c[:, :half] = 10 if s % 2 == 0 else 0
        c[:, half:] = 0 if s % 2 == 0 else 10
        out.append(c)
    return out


def test_even_whole_run_skewed_steps_the_step_factor_is_above_the_average_one():
    """The acceptance workload: whole-run counts even (each expert 200 slots), each step all on one rank of EP 2
    linear. The average-load figure sees 1.0; each step's busiest rank does all the work: 2.0."""
    steps = skewed_steps()
    total = np.sum(steps, axis=0)
    assert (total == total[0, 0]).all()  # even over the run
    snap = run(balance((1, 2), 8, ep_sizes=(2,), placements=("linear", "round_robin"), keep_values=True), steps)
    lin = snap.entry("linear", 2)
    assert lin.average == pytest.approx(naive_max_over_mean(naive_rank_loads(total[0], [[0, 1, 2, 3], [4, 5, 6, 7]])))
    assert lin.average == pytest.approx(1.0)
    assert lin.straggler == pytest.approx(2.0) and lin.straggler > lin.average
    assert lin.quantile(0.5) == pytest.approx(2.0) and lin.quantile(0.99, sb.MEAN) == pytest.approx(2.0)
    # round-robin splits each half over both ranks: balanced per step too
    assert snap.entry("round_robin", 2).straggler == pytest.approx(1.0)


def naive_straggler(steps, per_rank_of) -> tuple[float, float]:
    """(sum over steps and layers of the busiest rank / sum of the mean rank, and the same of the summed counts)."""
    busiest = mean = 0.0
    total = np.sum(steps, axis=0)
    for c in steps:
        for i, row in enumerate(c):
            loads = naive_rank_loads(row.tolist(), per_rank_of(i))
            busiest += max(loads)
            mean += sum(loads) / len(loads)
    avg_b = sum(max(naive_rank_loads(total[i].tolist(), per_rank_of(i))) for i in range(len(total)))
    avg_m = sum(sum(naive_rank_loads(total[i].tolist(), per_rank_of(i))) / len(per_rank_of(i))
                for i in range(len(total)))
    return busiest / mean, avg_b / avg_m


def test_straggler_average_quantiles_and_stderr_from_their_definitions():
    rng = np.random.default_rng(3)
    steps = [rng.integers(0, 6, size=(3, 12)).astype(np.float32) for _ in range(50)]
    snap = run(balance((1, 2, 3), 12, ep_sizes=(4,), placements=("linear",), keep_values=True), steps)
    e = snap.entry("linear", 4)
    lin = sb.static_layout("linear", 12, 4, 3)
    want_s, want_a = naive_straggler(steps, lambda i: per_rank(lin, i))
    assert e.straggler == pytest.approx(want_s) and e.average == pytest.approx(want_a)
    worst = [max(naive_max_over_mean(naive_rank_loads(c[i].tolist(), per_rank(lin, i))) for i in range(3))
             for c in steps]
    assert e.quantile(0.5) == pytest.approx(float(np.quantile(worst, 0.5)))
    # the histogram's interpolated quantile lies in the bucket holding the exact one
    hq = sb.histogram_quantile(0.9, e.hist[0], BUCKETS)
    exact = float(np.quantile(worst, 0.9))
    b = int(np.searchsorted(BUCKETS, exact))
    assert (BUCKETS[b - 1] if b else 1.0) <= hq <= BUCKETS[b]
    # the ratio estimator's standard error: sqrt(sum (b_i - R m_i)^2 / (n (n - 1))) / mean(m)
    bs = np.array([sum(max(naive_rank_loads(c[i].tolist(), per_rank(lin, i))) for i in range(3)) for c in steps])
    ms = np.array([sum(c[i].sum() / 4 for i in range(3)) for c in steps])
    r = bs.sum() / ms.sum()
    assert e.stderr == pytest.approx(np.sqrt(((bs - r * ms) ** 2).sum() / (50 * 49)) / ms.mean())


def test_eplb_rearranges_on_vllms_schedule_from_the_windows_load():
    """First rearrangement after every // 4 steps, then every ``every``; each from the last ``window`` steps' counts
    (vLLM's EplbState.step / rearrange), the policy's map with the old one's slots preserved."""
    rng = np.random.default_rng(7)
    steps = []
    for s in range(40):
        c = rng.integers(0, 3, size=(2, 8)).astype(np.float32)
        c[:, s // 10] += 30  # the hot expert moves every 10 steps
        steps.append(c)
    sched = sb.Schedule(window=6, every=12)  # rearrangements after steps 3, 15, 27, 39
    b = balance((1, 2), 8, ep_sizes=(2,), placements=("eplb",), redundant=2, schedule=sched)
    maps, old = [], np.tile(eplb_policy.initial(8, 2), (2, 1))
    for n, c in enumerate(steps, start=1):
        b.observe_counts(c[None], 1, c)
        if n in (3, 15, 27, 39):
            window = np.sum(steps[max(0, n - 6):n], axis=0)
            old = eplb_policy.rebalance(window, 10, 1, 1, 2, old=old)
            maps.append(old)
            assert np.array_equal(b._acc[("eplb", 2, 2)].layout.phy2log, old), n
    assert len({m.tobytes() for m in maps}) > 1  # the hot expert moved: the placement followed


def test_the_window_is_bounded_whatever_the_summaries():
    """One-step summaries over a 1000-step window are merged into chunks of >= window / 32 steps: at most ~64 kept,
    and the counts still add up to the last window's (to within one chunk)."""
    b = balance((1,), 4, ep_sizes=(2,), placements=("linear",), schedule=sb.Schedule(window=1000, every=5000))
    c = np.ones((1, 4), np.float32)
    for _ in range(3000):
        b.observe_counts(c[None], 1, c)
    assert len(b._window) <= 66
    assert 1000 <= b._window_steps <= 1000 + 2 * (1000 // 32)
    assert b._window_counts().sum() == 4 * b._window_steps


def test_the_placement_in_use_changes_are_rearrangements_with_before_and_after():
    """An engine's placement (here a runtime Placement) read per summary: a change is one rearrangement, its
    ``before`` the old placement's straggler on the steps since the last change, ``after`` the new one's since."""
    from moescope.parallel import placement

    state = {"p": placement.build("contiguous", n_experts=8, world_size=2, moe_layers=(1,))}
    b = balance((1,), 8, ep_sizes=(2,), placements=("linear",), in_use_source=sb.InUse(lambda: state["p"], 8))
    skew = np.array([[40, 1, 1, 1, 1, 1, 1, 1]], np.float32)
    for _ in range(5):
        b.observe_counts(skew[None], 1, skew)
    before = naive_max_over_mean(naive_rank_loads(skew[0].tolist(), [[0, 1, 2, 3], [4, 5, 6, 7]]))
    plan = planner.plan_layer(skew[0] * 5, 2, 5)
    state["p"] = placement.validate({1: plan}, 8, 2, True, (1,))
    for _ in range(3):
        b.observe_counts(skew[None], 1, skew)
    snap = b.snapshot()
    assert snap.rearranged == 1
    ev = snap.rearrangements[0]
    after = naive_max_over_mean(naive_rank_loads(skew[0].tolist(), plan))
    assert ev.step == 5 and ev.before == pytest.approx(before) and ev.after == pytest.approx(after)
    assert ev.after_steps == 3
    assert ev.predicted_new == pytest.approx(after) and ev.predicted_old == pytest.approx(before)
    # the in-use series is labelled by its redundant experts: a new label set (R 0 -> 2) starts with the change
    assert snap.entry("in_use", 2, 2).straggler == pytest.approx(after) and snap.entry("in_use", 2, 0) is None
    # the per-rank slots of every step under the placement in use (whole summaries, not only sampled steps)
    want = np.add(np.multiply(5, naive_rank_loads(skew[0].tolist(), [[0, 1, 2, 3], [4, 5, 6, 7]])),
                  np.multiply(3, naive_rank_loads(skew[0].tolist(), plan)))
    assert np.allclose(snap.in_use_rank_slots, want)


def test_the_work_budget_judges_every_placement_on_the_same_steps():
    """A budget too small for the whole sample judges an evenly spaced subset, the same for every placement
    (paired); the work per step is the count the budget divides by."""
    b = balance((1, 2), 8, ep_sizes=(2, 4), placements=("linear", "eplb"), redundant={2: 2, 4: 4})
    assert b.work_per_step() == 2 * 8 * (1 + 2 + 1 + 4)  # statics: L x E each; matmuls: L x E x N
    b.budget = 3 * b.work_per_step()
    counts = np.random.default_rng(1).integers(0, 5, size=(10, 2, 8)).astype(np.float32)
    b.observe_counts(counts, 40, counts.sum(0))
    snap = b.snapshot()
    assert snap.sampled == 3 and snap.steps == 40
    assert all(int(e.count[0]) == 3 for e in snap.entries)


def test_exposition_is_what_the_snapshot_holds_in_both_formats():
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
    from prometheus_client.parser import text_string_to_metric_families as parse

    snap = run(balance((1, 2), 8, ep_sizes=(2,), placements=("linear", "eplb")), skewed_steps(12))
    w = FamilyWriter("m", "0")
    for openmetrics, parser in ((False, parse), (True, om_parse)):
        body = step_balance_families.text(snap, w, openmetrics, full=True)
        fams = {f.name: f for f in parser(body + ("# EOF\n" if openmetrics else ""))}
        h = fams["moescope_ep_step_max_over_mean_ratio"]
        count = {tuple(sorted(s.labels.items())): s.value for s in h.samples if s.name.endswith("_count")}
        key = (("ep", "2"), ("layer", "worst"), ("model", "m"), ("placement", "linear"), ("rank", "0"),
               ("redundant", "0"))
        assert count[key] == 12
        strag = {s.labels["placement"]: s.value for s in fams["moescope_ep_straggler_ratio"].samples}
        assert strag["linear"] == pytest.approx(snap.entry("linear", 2).straggler)
        names = {s.name for f in fams.values() for s in f.samples}
        assert names <= catalogue.exposed_sample_names(), names - catalogue.exposed_sample_names()
