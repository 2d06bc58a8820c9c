"""One judgement in every view: the same window, judged by the generated alert rules in the real promtool and
by the views' own code, fires the same alerts, case by case.

Each case is per-request routing counts (the exporter's draws) and, where given, a baseline profile.
``diagnose.judge_counts`` turns them into the series the exporter exports (excess CV, baseline CV, hot factors,
unexpected dead experts, drift and its noise, top share) and its verdicts; the summary judges the same counts
(``summary.judgement``); ``moescope top``'s data layer reads the same series from a parsed exposition; and
``promtool test rules`` evaluates ``rules.rules_document()`` over the same series. The alert names expected from
promtool are the shared brief's (written here, not read from the rules). Cache and rank placement are series
only top and the rules read (diagnose judges the cache from the store's miss bits): those cases feed top and
promtool."""

from __future__ import annotations

import math
import subprocess

import numpy as np
import pytest
import yaml
from servers import require

from moescope import judge
from moescope.analysis import diagnose
from moescope.analysis.baseline import LayerProfile, Profile
from moescope.cli import summary
from moescope.sampling import Draws
from moescope.thresholds import DEFAULT
from moescope.tui.top_data import frame, parse_exposition

E, K, LAYERS = 32, 2, [1, 2, 3]
LAB = {"model": "acme-moe", "rank": "0"}
STEPS = 20  # one sample a minute for 20 minutes; alerts are read at 15m (every `for` of these rules <= 10m)
ALERTS = ("MoEExpertLoadImbalance", "MoEExpertHot", "MoEDeadExperts", "MoEExpertCollapse", "MoERoutingDrift",
          "MoERankLoadImbalance", "MoEExpertCacheHitRateLow")  # the shared brief's names


def _requests(rng, n_req: int, tokens: int, p: dict[int, np.ndarray], clustered: bool = True) -> np.ndarray:
    """[R, L, E] slots per request: each request draws its tokens' K slots from the layer's distribution, tilted
    per request (a request's tokens route alike) unless ``clustered`` is False."""
    out = np.zeros((n_req, len(LAYERS), E), np.int64)
    for r in range(n_req):
        for j, layer in enumerate(LAYERS):
            q = p.get(layer, np.full(E, 1 / E))
            if clustered:
                q = rng.dirichlet(q * 200 + 1e-9)
            out[r, j] = rng.multinomial(tokens * K, q / q.sum())
    return out


def _skew(alpha: float) -> np.ndarray:
    q = np.exp(-alpha * np.arange(E))
    return q / q.sum()


def _profile(per_request: np.ndarray, structural: dict[int, float]) -> Profile:
    """A baseline whose shares are the window's own (no drift) and whose structural CV is ``structural``."""
    load = per_request.sum(0).astype(np.float64)
    layers = {layer: LayerProfile(load[j], load[j] / load[j].sum(), None, structural[layer], None,
                                  len(per_request)) for j, layer in enumerate(LAYERS)}
    return Profile("acme-moe", E, layers, 60.0)


def _cases():
    rng = np.random.default_rng(7)
    uniform = {}
    cases = [("healthy, no baseline", _requests(rng, 40, 48, uniform), None)]
    cases.append(("imbalance over the no-baseline bar", _requests(rng, 40, 48, {2: _skew(0.35)}), None))
    moderate = _requests(rng, 60, 48, {1: _skew(0.06), 2: _skew(0.06)})
    j0 = diagnose.judge_requests(moderate, LAYERS, K)
    # layer 1 grew past 1.5 x its baseline structure + 0.1; layers 2 and 3 are at their baseline's
    structural = {1: 0.1, 2: float(j0.excess_cv[1]), 3: float(j0.excess_cv[2])}
    cases.append(("imbalance against a baseline (no drift)", moderate, _profile(moderate, structural)))
    cases.append(("one request: not judged", _requests(rng, 1, 400, {2: _skew(0.5)}), None))
    hot = np.full(E, 1.0)
    hot[9] = 6.0
    cases.append(("a hot expert against the fair share", _requests(rng, 80, 48, {3: hot / hot.sum()}, False), None))
    dead = np.full(E, 1.0)
    dead[[30, 31]] = 0.0
    cases.append(("dead experts where traffic predicts them",
                  _requests(rng, 400, 50, {3: dead / dead.sum()}, False), None))
    cases.append(("dead experts in a thin window are chance",
                  _requests(rng, 20, 50, {3: dead / dead.sum()}, False), None))
    base = _requests(rng, 60, 48, {})
    tilted = np.full(E, 1.0)
    tilted[:4] = 5.0
    drifted = _requests(rng, 60, 48, {1: tilted / tilted.sum()})
    cases.append(("drift from the baseline (and its imbalance held back)", drifted,
                  _profile(base, {1: 0.05, 2: 0.05, 3: 0.05})))
    collapse = _requests(rng, 40, 48, {})
    collapse[:, 0, 0] = 48  # every token of layer 1 chooses expert 0, its other slot elsewhere
    collapse[:, 0, 1:] = rng.multinomial(48, np.full(E - 1, 1 / (E - 1)), size=40)
    cases.append(("collapse", collapse, None))
    return cases


def _bars(bars, layers) -> dict[tuple[str, tuple], float]:
    """The bar and clear-bar series the exporter exports for ``bars`` (``Thresholds.bars``: what it calls), as
    ``_series`` keys them."""
    out = {}
    for name, clear in (("moescope_judgement_bar", False), ("moescope_judgement_clear_bar", True)):
        for labels, v in bars.rows(layers, clear):
            if len(labels) > 1:  # the layers' (the model's bars are no view's here)
                out[(name, tuple(zip(("judgement", "layer", "reference"), labels)))] = v
    return out


def _series(j) -> dict[tuple[str, tuple], float]:
    """What the exporter exports for the judgement ``j``: {(name, ((label, value), ...)): value}, its bars
    included."""
    out = _bars(j.bars, j.layers)
    for i, layer in enumerate(j.layers):
        lab = (("layer", str(layer)),)
        out[("moescope_expert_load_excess_cv_ratio", lab)] = float(j.excess_cv[i])
        out[("moescope_expert_load_top_share_ratio", lab)] = float(j.top_share[i])
        out[("moescope_dead_experts_unexpected", lab)] = float(j.dead[i])
        out[("moescope_dead_experts_holding", lab)] = float(j.dead_holding[i])
        kind = (("reference", j.hot_reference[i]),)
        for name, values in (("moescope_reference_load_cv_ratio", j.reference_cv),
                             ("moescope_reference_top_share_ratio", j.reference_top)):
            if math.isfinite(values[i]):  # absent while the layer's reference is being learned
                out[(name, lab + kind)] = float(values[i])
        if j.baseline_cv is not None and math.isfinite(j.baseline_cv[i]):
            out[("moescope_baseline_load_cv_ratio", lab)] = float(j.baseline_cv[i])
        if j.jsd is not None and math.isfinite(j.jsd[i]):
            out[("moescope_routing_drift_jsd_bits", lab)] = float(j.jsd[i])
            out[("moescope_routing_drift_noise_bits", lab)] = float(j.drift_noise[i])
        out[("moescope_window_slots_per_expert", lab)] = float(j.counts[i].sum() / E)
        for e in {*np.argsort(-j.counts[i], kind="stable")[:8].tolist(), *np.argsort(j.counts[i], kind="stable")[:8]}:
            out[("moescope_expert_window_slots", lab + (("expert", str(e)),))] = float(j.counts[i, e])
        for e in np.nonzero(np.isfinite(j.hot_factor[i]))[0]:
            out[("moescope_expert_hot_factor_ratio", lab + (("expert", str(e)), ("reference", j.hot_reference[i])))] \
                = float(j.hot_factor[i, e])
    return out


def _exposition(series: dict) -> str:
    lines = []
    for (name, lab), v in sorted(series.items()):
        labels = ",".join(f'{k}="{x}"' for k, x in (*LAB.items(), *lab))
        lines.append(f"{name}{{{labels}}} {'NaN' if math.isnan(v) else repr(v)}")
    return "\n".join(lines) + "\n"


def _top_frame(cur: str, prev: str | None = None, dt: float = 60.0):
    return frame(parse_exposition(cur), parse_exposition(prev) if prev else None, dt, {"exposition": "ok"})


def _top_fires(cur: str, prev: str | None = None, dt: float = 60.0) -> set:
    f = _top_frame(cur, prev, dt)
    out = set()
    for layer, r in f.routing.items():
        for name in r.fires:
            alert, _, expert = name.partition(":")
            out.add((alert, str(layer), expert))
    return out | {("MoEExpertCacheHitRateLow", str(layer), "") for layer in f.cache_low}


def _assert_top_says_what_judge_says(j, f, name: str) -> None:
    """Layer by layer, top's verdict (over the exported series and bars) is judge's verdict of the same window: the
    same Verdict, the same words and colour (``judge.layer_words`` / ``layer_level`` over the judgement's own
    arrays), the same bars; a view that judged by a formula of its own would differ somewhere in the cases."""
    for i, layer in enumerate(j.layers):
        r, v = f.routing[layer], j.verdict(i)
        hot = tuple((int(e), float(j.hot_factor[i, e]), j.hot_reference[i]) for e in v.over_hot)
        bars = j.bars.layer(i)
        assert r.fires == tuple(v.fires()) and r.reference == v.reference, (name, layer)
        assert r.hot_factors == hot, (name, layer)
        assert {k: x for k, x in r.bars.items() if math.isfinite(x)} == \
            {k: x for k, x in bars.items() if math.isfinite(x)}, (name, layer)
        busiest = int(np.lexsort((np.arange(E), -j.counts[i]))[0]) if j.counts[i].sum() else None
        words = judge.layer_words(v, layer=layer, excess_cv=float(j.excess_cv[i]), top_share=float(j.top_share[i]),
                                  bars=bars, drift_jsd=None if j.jsd is None else float(j.jsd[i]),
                                  dead_unexpected=float(j.dead[i]), hot=hot, busiest=busiest,
                                  uneven=j.uneven_words(i))
        assert r.verdict == words, (name, layer, r.verdict, words)
        assert r.level == judge.layer_level(v, excess_cv=float(j.excess_cv[i]), top_share=float(j.top_share[i]),
                                            bars=bars, dead_counted=False), (name, layer)


def _judge_fires(j) -> set:
    out = set()
    for i, layer in enumerate(j.layers):
        for alert, on in (("MoEExpertCollapse", j.collapsed[i]), ("MoEExpertLoadImbalance", j.imbalanced[i]),
                          ("MoEDeadExperts", j.dead[i] > 0), ("MoERoutingDrift", j.drifted[i])):
            if on:
                out.add((alert, str(layer), ""))
        out |= {("MoEExpertHot", str(layer), str(e)) for e in np.nonzero(j.hot[i])[0]}
    return out


def _summary_fires(per_request, baseline) -> set:
    load = {layer: per_request.sum(0)[j].tolist() for j, layer in enumerate(LAYERS)}
    judged, per = summary.judgement(load, len(per_request), K, Draws.of(per_request), baseline)
    out = set()
    for layer, v in judged["layers"].items():
        if v["imbalanced"]:
            out.add(("MoEExpertLoadImbalance", layer, ""))
        if v["collapsed"]:
            out.add(("MoEExpertCollapse", layer, ""))
        if per[layer]["dead"]:
            out.add(("MoEDeadExperts", layer, ""))
        out |= {("MoEExpertHot", layer, str(h["expert"])) for h in per[layer]["hot"]}
    return out


def _input_series(series: dict, values=None) -> list[dict]:
    out = []
    for (name, lab), v in sorted(series.items()):
        labels = ",".join(f'{k}="{x}"' for k, x in (*LAB.items(), *lab))
        vals = values.get((name, lab)) if values else None
        if vals is None:
            vals = " ".join(["NaN"] * (STEPS + 1)) if math.isnan(v) else f"{v!r}x{STEPS}"
        out.append({"series": f"{name}{{{labels}}}", "values": vals})
    return out


def _promtool_test(name: str, inputs: list[dict], fires: set) -> dict:
    exp = []
    for alert, layer, expert in sorted(fires):
        lab = f'alertname="{alert}", layer="{layer}"' + (f', expert="{expert}"' if expert else "")
        exp.append({"labels": f"{{{lab}}}", "value": 1})
    return {"name": name, "interval": "1m", "input_series": inputs,
            "promql_expr_test": [{"expr": 'count by (alertname, layer, expert) (ALERTS{alertstate="firing", '
                                          f'alertname=~"{"|".join(ALERTS)}"}})', "eval_time": "15m",
                                  "exp_samples": exp}]}


def _cache_case():
    """Counters over a minute for top (two polls) and over 20 minutes for promtool; capacity per layer."""
    rates = {1: (5, 100, 0.25), 2: (20, 100, 0.25), 3: (30, 100, 0.75)}  # hits, lookups per minute, capacity
    series = {k: v for k, v in _bars(DEFAULT.bars([""] * 3, capacity=[rates[la][2] for la in LAYERS]), LAYERS).items()
              if ("judgement", "cache") in k[1]}
    values = {}
    for layer, (h, n, cap) in rates.items():
        lab = (("layer", str(layer)),)
        series[("moescope_expert_cache_capacity_ratio", lab)] = cap
        for name, per_min in (("moescope_expert_cache_hits_total", h), ("moescope_expert_cache_lookups_total", n)):
            series[(name, lab)] = per_min * 11.0  # the poll at 11 minutes; the previous at 10
            values[(name, lab)] = f"0+{per_min}x{STEPS}"
    prev = {k: (v - rates[int(dict(k[1])["layer"])][0 if "hits" in k[0] else 1] if k[0].endswith("_total") else v)
            for k, v in series.items()}
    return series, prev, values


def _rank_case():
    bars = {k: v for k, v in _bars(DEFAULT.bars([""] * 3), LAYERS).items() if ("judgement", "rank_load") in k[1]}
    return {**bars, **{("moescope_rank_load_max_over_mean_ratio", (("layer", str(layer)),)): v
                       for layer, v in ((1, 1.2), (2, DEFAULT.rank_max_over_mean + 0.2),
                                        (3, DEFAULT.rank_max_over_mean))}}


def test_views_and_rules_fire_the_same_alerts(tmp_path):
    from moescope.alerts.rules import rules_document

    promtool = require("promtool", "prometheus")
    tests, seen = [], {}
    for name, per_request, baseline in _cases():
        j = diagnose.judge_requests(per_request, LAYERS, K, baseline)
        fires = _judge_fires(j)
        series = _series(j)
        assert _top_fires(_exposition(series)) == fires, name
        _assert_top_says_what_judge_says(j, _top_frame(_exposition(series)), name)
        # the summary says nothing of drift, and leaves out a collapsed layer's hot experts (as Alertmanager's
        # inhibition does: a collapse is the extreme of both)
        collapsed = {la for a, la, _ in fires if a == "MoEExpertCollapse"}
        assert _summary_fires(per_request, baseline) == {
            f for f in fires if f[0] != "MoERoutingDrift" and not (f[0] == "MoEExpertHot" and f[1] in collapsed)}, name
        seen[name] = fires
        tests.append(_promtool_test(name, _input_series(series), fires))
    series, prev, values = _cache_case()
    cache = _top_fires(_exposition(series), _exposition(prev))
    assert cache == {("MoEExpertCacheHitRateLow", "1", ""), ("MoEExpertCacheHitRateLow", "3", "")}
    tests.append(_promtool_test("cache under half its capacity's hit rate", _input_series(series, values), cache))
    rank = _top_fires(_exposition(_rank_case()))
    assert rank == {("MoERankLoadImbalance", "2", "")}
    tests.append(_promtool_test("rank max/mean", _input_series(_rank_case()), rank))
    # the cases cover every judgement both ways (a case that fires nothing would agree by accident otherwise)
    assert seen["healthy, no baseline"] == set() and seen["one request: not judged"] == set()
    skewed = seen["imbalance over the no-baseline bar"]  # its busiest experts are also hot against 1/E
    assert ("MoEExpertLoadImbalance", "2", "") in skewed
    assert {(a, la) for a, la, _ in skewed} <= {("MoEExpertLoadImbalance", "2"), ("MoEExpertHot", "2")}
    assert seen["imbalance against a baseline (no drift)"] == {("MoEExpertLoadImbalance", "1", "")}
    assert seen["a hot expert against the fair share"] == {("MoEExpertHot", "3", "9")}
    assert seen["dead experts where traffic predicts them"] == {("MoEDeadExperts", "3", "")}
    assert seen["dead experts in a thin window are chance"] == set()
    moved = seen["drift from the baseline (and its imbalance held back)"]
    assert ("MoERoutingDrift", "1", "") in moved and not any(a == "MoEExpertLoadImbalance" for a, _, _ in moved)
    assert ("MoEExpertCollapse", "1", "") in seen["collapse"]
    (tmp_path / "tests").mkdir()
    (tmp_path / "moescope-rules.yml").write_text(yaml.safe_dump(rules_document(), sort_keys=False))
    doc = {"rule_files": ["../moescope-rules.yml"], "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "tests" / "t.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    run = subprocess.run([promtool, "test", "rules", "tests/t.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


@pytest.mark.parametrize("excess,kind,ref,fires", [
    (1.05, "fair", 0.0, True), (0.95, "fair", 0.0, False), (0.5, "baseline", 0.2, True), (0.35, "baseline", 0.2, False),
    (0.5, "learned", 0.2, True), (0.35, "learned", 0.2, False), (float("nan"), "baseline", 0.2, False),
    (3.0, "learned", 2.5, False), (4.0, "learned", 2.5, True), (5.0, "learning", None, False)])
def test_top_reads_the_imbalance_bar_from_the_bar_series(excess, kind, ref, fires):
    """The imbalance bar top applies is the exported moescope_judgement_bar{judgement="imbalance"} (none exported
    while the layer learns its reference: nothing judged), and that bar is the documented one: 1.5 x the
    reference's structural CV + 0.1, 1 against the fair share (docs/alerts.md; written out here)."""
    t = DEFAULT
    bars = _bars(t.bars([kind], [math.nan if ref is None else ref]), [1])
    exported = {dict(k[1])["judgement"]: v for k, v in bars.items() if k[0] == "moescope_judgement_bar"}
    naive = {"fair": t.imbalance_cv, "learning": None}.get(
        kind, None if ref is None else t.imbalance_baseline_factor * ref + t.imbalance_baseline_margin)
    assert exported.get("imbalance") == (pytest.approx(naive) if naive is not None else None)
    series = {("moescope_expert_load_excess_cv_ratio", (("layer", "1"),)): excess, **bars}
    assert (("MoEExpertLoadImbalance", "1", "") in _top_fires(_exposition(series))) == fires
    assert (naive is not None and excess > naive) == fires


def test_an_empty_layer_has_no_relative_load_in_any_view():
    """A layer without load has no mean to be relative to: top's bands and named experts say NaN, as
    ``stats`` does (max/mean, top share), never 0.0 (a load at 0x its fair share reads as "dead")."""
    from moescope import stats
    from moescope.tui.routing_view import fold, named

    empty = np.zeros(8)
    assert math.isnan(stats.max_over_mean_rows(empty)) and math.isnan(stats.top_share_rows(empty, 0))
    assert all(math.isnan(b.rel_max) and math.isnan(b.rel_sum) for b in fold(empty, 4))
    hot, cold = named(empty)
    assert all(math.isnan(r) for _, r in (*hot, *cold))
    loaded = np.array([4.0, 0, 0, 0, 2, 2, 0, 0])  # the mean is 1: relative load is the count
    assert [b.rel_max for b in fold(loaded, 4)] == [4.0, 0.0, 2.0, 0.0]
    assert [b.rel_sum for b in fold(loaded, 4)] == [2.0, 0.0, 2.0, 0.0]


def _learned_cases():
    """(name, first window's requests, later requests): the reference is learned from the first (as the exporter
    learns it from its first full window, and diagnose from the run's), the later judged against it."""
    rng = np.random.default_rng(11)
    narrow = {layer: _skew(0.35) for layer in LAYERS}  # a few fixed prompts: excess CV over 1 from the start
    dead = np.full(E, 1.0)
    dead[[30, 31]] = 0.0
    collapse = _requests(rng, 40, 48, {})
    collapse[:, 0, 0] = 48
    collapse[:, 0, 1:] = rng.multinomial(48, np.full(E - 1, 1 / (E - 1)), size=40)
    return [
        ("uneven from the start (narrow traffic)", _requests(rng, 40, 48, narrow), _requests(rng, 40, 48, narrow)),
        ("imbalance that appears", _requests(rng, 40, 48, {}), _requests(rng, 40, 48, {2: _skew(0.35)})),
        ("experts idle from the start", _requests(rng, 400, 50, {3: dead / dead.sum()}, False),
         _requests(rng, 400, 50, {3: dead / dead.sum()}, False)),
        ("experts that die", _requests(rng, 400, 50, {}, False),
         _requests(rng, 400, 50, {3: dead / dead.sum()}, False)),
        ("collapse that appears", _requests(rng, 40, 48, {}), collapse),
    ]


def test_views_and_rules_agree_against_a_learned_reference(tmp_path):
    """Issue [learned]: without a baseline, imbalance, collapse and dead experts are judged against the reference
    learned from the first window; the judgement's verdicts, top's (over the exported series, the reference series
    and their ``reference`` label included) and the generated rules in the real promtool fire the same alerts. What
    was uneven from the start fires nothing (against the fair share it does: the case is not vacuous); what changed
    fires."""
    from moescope.alerts.rules import rules_document

    promtool = require("promtool", "prometheus")
    tests, seen = [], {}
    for name, first, later in _learned_cases():
        learned = diagnose.learned_reference(first, LAYERS, K)
        assert learned.has.all(), name
        j = diagnose.judge_requests(later, LAYERS, K, learned=learned)
        assert set(j.hot_reference) == {"learned"}, name
        fires = _judge_fires(j)
        series = _series(j)
        assert _top_fires(_exposition(series)) == fires, name
        _assert_top_says_what_judge_says(j, _top_frame(_exposition(series)), name)
        seen[name] = fires
        tests.append(_promtool_test(name, _input_series(series), fires))
    assert seen["uneven from the start (narrow traffic)"] == set()
    fair = _judge_fires(diagnose.judge_requests(_learned_cases()[0][2], LAYERS, K))
    assert {a for a, _, _ in fair} >= {"MoEExpertLoadImbalance"}, fair  # against 1/E it pages every layer
    assert ("MoEExpertLoadImbalance", "2", "") in seen["imbalance that appears"]
    assert seen["experts idle from the start"] == set()
    # two of 32 experts dead: the layer's load CV grew past its learned (uniform) structure's bar too
    assert ("MoEDeadExperts", "3", "") in seen["experts that die"] and {la for _, la, _ in seen["experts that die"]} \
        == {"3"}
    assert ("MoEExpertCollapse", "1", "") in seen["collapse that appears"]
    (tmp_path / "tests").mkdir()
    (tmp_path / "moescope-rules.yml").write_text(yaml.safe_dump(rules_document(), sort_keys=False))
    doc = {"rule_files": ["../moescope-rules.yml"], "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "tests" / "t.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    run = subprocess.run([promtool, "test", "rules", "tests/t.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


# -- recorded traffic: the exporter, top, diagnose and report on the same requests ------------------------------

# A shape no code names: 384 experts, top-8 sigmoid routing in 8 groups (top-4 groups), a shared expert, a dense
# first layer; one expert of one layer made hot (a real logit bias) so every view has something to name.
WIDE = {"name": "acme-wide-384", "hidden_size": 32, "n_layers": 3, "n_heads": 2, "n_experts": 384, "top_k": 8,
        "ffn_size": 16, "dense_layers": [0], "scoring": "sigmoid", "n_group": 8, "topk_group": 4,
        "correction_bias": True, "routed_scaling_factor": 2.5, "n_shared_experts": 1, "max_seq_len": 256,
        "seed": 11}
WIDE_HOT = (2, 5, 8)
WIDE_REQUESTS = 64
EXPORTED = 8  # metrics.state.EXTREMES_K: the hottest experts per layer the exporter exports (the docs' figure)


@pytest.mark.integration
def test_recorded_traffic_is_judged_alike_by_every_view_at_384_experts(tmp_path):
    """One demo at a 384-expert shape with a trace store and a window longer than the run: the exporter's judged
    series (scraped while the demo lingers), ``top``'s verdicts over them, ``report`` and ``diagnose`` from the
    store judge the same requests. The excess CV, the top share and every exported hot factor agree (to the views'
    rounding), and the four name the same hot experts. (At this shape, on random weights and narrow demo traffic,
    healthy layers have experts at 10x their fair share: the no-baseline hot bar pages them, issue [judge].)"""
    import json
    import time

    from helpers import popen_cli, run_cli, run_cli_ok, wait_until
    from servers import free_port

    from moescope import prom_http

    cfg = tmp_path / "acme-wide.yaml"
    cfg.write_text(yaml.safe_dump(WIDE))
    store, port = tmp_path / "t.sqlite", free_port()
    layer, expert, factor = WIDE_HOT
    proc = popen_cli("demo", "--model", str(cfg), "--weights", "random", "--scenario",
                     f"hot={layer}:{expert}:{factor}x", "--requests", str(WIDE_REQUESTS), "--rate", "0",
                     "--metrics-port", str(port), "--metrics-window", "3600", "--canary-interval", "0",
                     "--traces", str(store), "--linger", "60", "--no-tui", "--json")
    try:
        def finished():
            s = parse_exposition(prom_http.exposition(f"127.0.0.1:{port}"))
            return sum(v for (name, _), v in s.items() if name == "moescope_requests_total"), s

        _, samples = wait_until(finished, timeout=600, what="the demo's requests finished",
                                until=lambda x: x[0] >= WIDE_REQUESTS, alive=lambda: proc.poll() is None)
        time.sleep(2)  # the last request's draw is folded in on finish; one more scrape after it
        samples = parse_exposition(prom_http.exposition(f"127.0.0.1:{port}"))
    finally:
        proc.terminate()
        proc.wait(60)

    def series(name):
        return {dict(lab).get("layer"): v for (n, lab), v in samples.items() if n == name}

    excess, top_share = series("moescope_expert_load_excess_cv_ratio"), series("moescope_expert_load_top_share_ratio")
    hot_exported = {(dict(lab)["layer"], dict(lab)["expert"]): v for (n, lab), v in samples.items()
                    if n == "moescope_expert_hot_factor_ratio" and v > DEFAULT.hot_factor}
    assert set(excess) == {"1", "2"}, excess  # the MoE layers (block 0 is dense)

    report = json.loads(run_cli_ok("report", "--traces", str(store), "--out", str(tmp_path / "r"), "--json",
                                   timeout=300).stdout)
    # diagnose learns its reference as the exporter does, over the exporter's window (--metrics-window 3600): the
    # whole run is within it, so the hot experts are named against 1/E and page nothing (exit 0), as in top
    run = run_cli("diagnose", "--traces", str(store), "--json", "--learn-window", "3600", timeout=300)
    assert run.returncode == 0, run.stderr
    diag = json.loads(run.stdout)
    per = {str(k): v for k, v in report["per_layer"].items()}
    for la in ("1", "2"):
        assert per[la]["excess_cv"] == pytest.approx(excess[la], abs=1e-3), la
    # the exporter exports each layer's EXPORTED hottest factors (a bounded series count); report and diagnose
    # list every hot expert, hottest first: their first EXPORTED per layer are the exported ones
    reported_hot = {(la, str(h["expert"])): h["factor"] for la, v in per.items() for h in v["hot"][:EXPORTED]}
    assert reported_hot.keys() == hot_exported.keys(), (reported_hot, hot_exported)
    for key, f in hot_exported.items():
        assert reported_hot[key] == pytest.approx(f, abs=0.01), key
    hot_found = [f for f in diag["findings"] if f["cause"] == "hot-expert"]
    assert hot_found and hot_found[0]["severity"] == "info" and "not paged" in hot_found[0]["title"], hot_found
    named: dict[str, list] = {}
    for h in hot_found[0]["evidence"]["experts"] if hot_found else []:
        named.setdefault(str(h["layer"]), []).append((str(h["layer"]), str(h["expert"])))
    assert {x for v in named.values() for x in v[:EXPORTED]} == hot_exported.keys(), named
    top = frame(samples, None, 60.0, {"exposition": "ok"})
    top_hot = {(str(la), str(e)) for la, r in top.routing.items() for e, _, _ in r.hot_factors}
    assert top_hot == set(hot_exported)
    # the run is shorter than the exporter's window: every layer's reference is still being learned, so top names
    # the hot experts against 1/E and pages none of them (as the rule: reference="learning" does not page)
    assert {dict(lab)["reference"] for (n, lab) in samples if n == "moescope_expert_hot_factor_ratio"} == \
        {"learning"}
    assert not any(name.startswith("MoEExpertHot") for r in top.routing.values() for name in r.fires)
    for la in ("1", "2"):  # top share: slots of the busiest expert over the tokens the layer routed, in both
        assert top.routing[int(la)].top_share == pytest.approx(top_share[la])


@pytest.mark.integration
def test_diagnose_judges_against_the_reference_learned_from_the_runs_first_window(tmp_path):
    """Issue [learned], part 4: without a baseline diagnose learns its reference from the run's first window, as
    the exporter does (tests/test_detection_matrix.py's interleaved row: the same shape and traffic through the
    real alerting path). A top-1 interleaved shape under 7 fixed prompts: the healthy run names nothing (against
    the fair share it names hot experts: the case is not vacuous); an expert made hot after the first window is
    named, on its layer only, against its learned share."""
    import json

    from helpers import run_cli, run_cli_ok
    from test_detection_matrix import INTERLEAVED_HOT, INTERLEAVED_PROMPTS, INTERLEAVED_SHAPE

    cfg = tmp_path / "acme-interleaved.yaml"
    cfg.write_text(yaml.safe_dump(INTERLEAVED_SHAPE))
    layer, expert = INTERLEAVED_HOT
    learn = 8  # s: the exporter's window here (--metrics-window) and diagnose's --learn-window

    def run(name, *scenario):
        store = tmp_path / f"{name}.sqlite"
        run_cli_ok("demo", "--no-tui", "--json", "--model", str(cfg), "--prompts", str(INTERLEAVED_PROMPTS),
                   "--rate", "20", "--duration", "24", "--metrics-port", "-1", "--metrics-window", str(learn),
                   "--canary-interval", "0", "--traces", str(store), *scenario, timeout=600)
        return store

    def findings(store, *extra):
        got = run_cli("diagnose", "--traces", str(store), "--json", "--learn-window", str(learn), *extra,
                      timeout=300)
        assert got.returncode in (0, 1), got.stderr
        return got.returncode, json.loads(got.stdout)["findings"]

    healthy = run("healthy")
    code, found = findings(healthy)
    assert code == 0 and not [f for f in found if f["severity"] != "info"], found
    judged = next(f for f in found if f["cause"] == "judged")["evidence"]
    assert judged["imbalance"] == "no baseline: judged against the reference learned from the run's first window"
    code, fair = findings(healthy, "--hot-reference", "fair")
    assert code == 1 and "hot-expert" in {f["cause"] for f in fair}, fair
    hot = run("hot", "--scenario", f"hot={layer}:{expert}:8x", "--fault-after", str(2 * learn))
    code, found = findings(hot)
    alarming = [f for f in found if f["severity"] != "info"]
    assert code == 1 and {f["cause"] for f in alarming} <= {"hot-expert", "imbalance"}, alarming
    named = {(h["layer"], h["expert"]) for f in alarming if f["cause"] == "hot-expert"
             for h in f["evidence"]["experts"]}
    assert (layer, expert) in named and {la for la, _ in named} == {layer}, named
