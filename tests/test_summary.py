"""The demo summary stays compact at any shape (one line per MoE layer whatever the expert count), its JSON's
per-layer summary equals a naive recomputation from the full counts it also carries, and it calls an expert
dead or hot only as the rules would: from totals alone with the most clustered draws the totals allow (two
requests at 256 experts judge no expert dead, whatever has no slot)."""

import math

import numpy as np

from helpers import run_cli
from moescope.cli import summary
from moescope.thresholds import DEFAULT
from reference import naive_load_cv


def _naive(counts, n=3, dead=None, hot=None):
    total = sum(counts)
    by_hot = sorted(range(len(counts)), key=lambda e: (-counts[e], e))
    by_cold = sorted(range(len(counts)), key=lambda e: (counts[e], e))
    return {"cv": round(naive_load_cv(counts), 4), "no_slot": sum(1 for c in counts if c == 0), "dead": dead,
            "slots": total, "hottest": [{"expert": e, "share": round(counts[e] / total, 5)} for e in by_hot[:n]],
            "coldest": [{"expert": e, "share": round(counts[e] / total, 5)} for e in by_cold[:n]], "hot": hot or []}


def _naive_dead(counts, requests):
    """Zero-slot experts whose no-baseline reference (1% of the fair share) predicts the rule's effective slots,
    with the worst case design effect of totals: each request's slots on one expert (Var p(1-p)/(R-1))."""
    n, e = sum(counts), len(counts)
    if requests < 2:
        return None
    var = sum((c / n) * (1 - c / n) / (requests - 1) for c in counts)
    multi = sum((c / n) * (1 - c / n) / n for c in counts)
    # a design effect estimated from R draws may understate the true one by df / chi2_lower(df) (df = R - 1,
    # Wilson-Hilferty at noise_z): too few draws to bound it judge nothing
    df = requests - 1
    a = 2 / (9 * df)
    lower = max(1 - a - DEFAULT.noise_z * math.sqrt(a), 0.0) ** 3
    if lower == 0:
        return None
    deff = max(1.0, var / multi) / lower
    expected = DEFAULT.dead_floor_share / e * n / deff
    return sum(1 for c in counts if c == 0) if expected >= DEFAULT.dead_min_expected_slots else 0


def _deepseek_shaped_load(seed=0):
    rng = np.random.default_rng(seed)
    load = {layer: rng.multinomial(24000, np.full(256, 1 / 256)).tolist() for layer in range(3, 61)}
    load[7][5] = 0
    load[7][200] = 0
    load[30][17] = 9000  # a hot expert
    return load


def test_layer_summary_equals_a_naive_recomputation():
    for counts in [*_deepseek_shaped_load().values(), [5, 0, 5, 1, 0, 9, 9, 2]]:
        assert summary.layer_summary(counts) == _naive(counts)
        assert summary.layer_summary(counts, dead=1) == _naive(counts, dead=1)


def test_judgement_from_totals_equals_a_naive_recomputation():
    """Dead and hot from totals: few requests judge nothing (the demo once printed "1397 dead in 58 layers"
    after 29 tokens); many requests find the two empty experts and the hot one, at the naive factor."""
    load = _deepseek_shaped_load()
    for requests in (2, 1000, 200_000):
        judged, per = summary.judgement(load, requests, 1)  # top-1: 9000 slots of 33k are no collapse
        for layer, counts in load.items():
            assert per[str(layer)]["dead"] == _naive_dead(counts, requests), (requests, layer)
        hot = per["30"]["hot"]
        if requests == 2:
            assert hot == [] and all(v["dead"] in (0, None) for v in per.values())
        else:
            share = load[30][17] / sum(load[30])
            assert [h["expert"] for h in hot] == [17] and math.isclose(hot[0]["factor"], share * 256, rel_tol=1e-3)
            assert hot[0]["reference"] == "fair"
        assert judged["requests"] == requests and judged["draws"].startswith("from totals")
    assert per["7"]["dead"] == 0  # 24k slots: 1% of a fair share predicts under one slot, zero is no evidence
    load[7] = [c * 10 for c in load[7]]  # 240k slots over a million requests: now it is
    judged, per = summary.judgement(load, 10**6, 1)
    assert per["7"]["dead"] == _naive_dead(load[7], 10**6) == 2
    lines = summary.load_lines({"expert_load": {str(k): v for k, v in load.items()}, "judged": judged,
                                "expert_load_summary": per})
    assert "2 dead in 1 layers" in lines[0] and "hot L30 E17" in lines[1]


def test_human_lines_are_one_per_layer_at_deepseek_shape():
    load = _deepseek_shaped_load()
    judged, per = summary.judgement(load, 2, 1)
    s = {"expert_load": {str(k): v for k, v in load.items()}, "judged": judged, "expert_load_summary": per}
    lines = summary.load_lines(s)
    assert len(lines) == 4 + 58  # the model, what was judged, what would page, the legend, one line per layer
    assert all(len(line) <= 120 for line in lines)
    assert "dead: not judged (2 req)" in lines[0] and "hot none" in lines[1]  # 2 requests: nothing is evidence
    assert f"against the fair share: over excess CV {DEFAULT.imbalance_cv:g}" in lines[1]
    assert lines[2] == "would page: nothing"
    row7 = next(line for line in lines if line.startswith("  L7 "))
    assert "no slot   2 dead   -" in row7 and "cold 5:0.00% 200:0.00%" in row7
    row30 = next(line for line in lines if line.startswith("  L30 "))
    assert f"hot 17:{9000 / sum(load[30]):.2%}" in row30


def test_demo_json_carries_the_summary_of_its_own_counts(capsys):
    import json

    from moescope.cli import main

    assert main(["demo", "--requests", "2", "--rate", "0", "--metrics-port", "-1", "--traces", "none", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["judged"]["requests"] == 2
    for layer, c in s["expert_load"].items():
        got = s["expert_load_summary"][layer]
        assert got == _naive(c, dead=_naive_dead(c, 2), hot=got["hot"])
        assert got["hot"] == []  # two requests: nothing is significant


def test_the_text_summary_shows_the_capacity_drops_its_json_counts(capsys):
    """A capacity-factor demo drops slots: the text summary says how many and at what rate per routed token (what
    `top`'s dropped tile shows), from the counts --json carries; a run without drops says nothing of them."""
    import json

    from moescope.cli import main

    args = ["demo", "--requests", "4", "--rate", "0", "--metrics-port", "-1", "--traces", "none",
            "--capacity-factor", "0.5"]
    assert main([*args, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    dropped = sum(s["tokens_dropped"].values())
    routed = (s["tokens"]["prompt"] + s["tokens"]["output"] - s["completed"]) * len(s["expert_load"])
    assert dropped > 0
    summary.print_human(s)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("dropped by the capacity limit"))
    assert f": {dropped} slots, {dropped / routed:.1%} per routed token" in line, line
    assert main([*args, "--no-tui"]) == 0  # the command's own text output
    assert "dropped by the capacity limit: " in capsys.readouterr().out
    assert main([*args[:-2], "--no-tui"]) == 0
    assert "dropped" not in capsys.readouterr().out


def test_the_demo_summary_judges_the_run_per_request_as_diagnose_does_from_its_store(tmp_path):
    """The demo's summary judges the whole run from the metrics state's per-request draws; the same run's
    requests read back from its trace store, judged by diagnose's function, give the same excess CV per layer."""
    import json
    import sqlite3

    from moescope.analysis import baseline as bl
    from moescope.analysis.diagnose import judge_requests
    from moescope.traces.store import iter_routed

    store = tmp_path / "t.sqlite"
    run = run_cli("demo", "--requests", "16", "--rate", "0", "--json", "--metrics-port", "-1", "--traces", str(store),
                  timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    assert out["judged"]["draws"] == "per request" and out["judged"]["requests"] == 16
    conn = sqlite3.connect(store)
    routed = list(iter_routed(conn))
    assert len(routed) == 16
    layers = [int(k) for k in out["expert_load"]]
    per = np.stack([bl.request_counts(r) for r in routed])  # [R, L, E] in the store's layer order
    assert list(routed[0].layers) == layers
    np.testing.assert_array_equal(per.sum(0), np.array([out["expert_load"][str(k)] for k in layers]))
    j = judge_requests(per, layers, top_k=2)
    for i, layer in enumerate(layers):
        assert out["judged"]["layers"][str(layer)]["excess_cv"] == round(float(j.excess_cv[i]), 4)


# Issue [learned]: the summary judges against the exporter's reference (learned from the first window), not the
# fair share. A top-1 layer uneven by design (one expert takes 40% of the tokens: the shares' CV 1.5, over the
# no-reference bar 1) stays uneven: information, nothing pages; one expert whose share rose mid-run is hot.
DESIGN = np.array([0.40, 0.15, 0.10, 0.08, 0.05, 0.04, 0.03, 0.03, 0.02, 0.02, 0.02, 0.02, 0.01, 0.01, 0.01, 0.01])


def _requests(rng, n, shares_per_layer, tokens=20):
    """[n, L, E] per-request slots, top-1: each token one multinomial draw from its layer's shares."""
    return np.stack([np.stack([rng.multinomial(tokens, p) for p in shares_per_layer]) for _ in range(n)])


def _judge_run(first, later, learned):
    from moescope import sampling

    run = np.concatenate([first, later])
    load = {layer: run[:, i].sum(0).tolist() for i, layer in enumerate((1, 3))}
    return summary.judgement(load, len(run), 1, draws=sampling.Draws.of(run), learned=learned)


def test_the_summary_judges_against_the_learned_reference_uneven_by_design_is_no_problem_a_rise_is():
    from moescope import sampling
    from moescope.analysis.diagnose import learned_from

    rng = np.random.default_rng(0)
    first = _requests(rng, 200, [DESIGN, DESIGN])  # the exporter's first window
    learned = learned_from(sampling.Draws.of(first), [1, 3], 1)
    assert naive_load_cv(DESIGN.tolist()) > DEFAULT.imbalance_cv  # uneven by design, by the no-reference bar

    judged, per = _judge_run(first, _requests(rng, 600, [DESIGN, DESIGN]), learned)
    assert judged["reference"] == "learned"
    for layer in ("1", "3"):
        assert judged["layers"][layer]["pages"] == [], judged["layers"][layer]
        assert judged["layers"][layer]["uneven"].startswith("uneven by design/traffic"), judged["layers"][layer]
        assert per[layer]["hot"] == []
    lines = summary.load_lines({"expert_load": {k: [0] * 16 for k in per}, "judged": judged,
                                "expert_load_summary": per})
    assert "would page: nothing" in lines and any("uneven by design/traffic" in x for x in lines)
    # the same run against the fair share (what the summary judged before): the design pages as imbalance
    fair, _ = _judge_run(first, _requests(np.random.default_rng(0), 600, [DESIGN, DESIGN]), None)
    assert all("MoEExpertLoadImbalance" in fair["layers"][k]["pages"] for k in ("1", "3")), fair

    risen = DESIGN * (0.55 / (1 - DESIGN[8]))
    risen[8] = 0.45  # expert 8 of layer 3: 0.02 of the tokens in the first window, 0.45 after
    later = _requests(rng, 600, [DESIGN, risen])
    judged, per = _judge_run(first, later, learned)
    assert judged["layers"]["1"]["pages"] == []
    assert "MoEExpertHot:8" in judged["layers"]["3"]["pages"]
    assert [h["expert"] for h in per["3"]["hot"]] == [8] and per["3"]["hot"][0]["reference"] == "learned"
    run = np.concatenate([first, later])[:, 1]
    # naive: the run's share of expert 8 over its share in the first window (never below the fair share 1/E)
    naive = (run[:, 8].sum() / run.sum()) / max(first[:, 1, 8].sum() / first[:, 1].sum(), 1 / 16)
    assert math.isclose(per["3"]["hot"][0]["factor"], naive, rel_tol=0.01), (per["3"]["hot"], naive)
