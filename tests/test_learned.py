"""The hot test's learned reference (``metrics.window.LearnedReference``, issue [judge]): without a saved baseline
the exporter judges a hot expert against the shares its own first full window showed, so narrow traffic's popular
experts (7x their fair share here, by design of the traffic) page nothing, while an expert whose share jumps does,
and keeps paging while the jump lasts (it is not absorbed into the reference it is judged against).

The traffic is drawn here from known shares; what each check expects comes from those shares, not from the code
under test. The end-to-end check (a real demo on a shape no preset has, narrow traffic, the hot fault switched on
mid-run, through Prometheus and Alertmanager) is tests/test_detection_matrix.py's narrow row."""

from __future__ import annotations


import numpy as np
import pytest

from moescope.metrics.window import LearnedReference, RoutingWindow
from moescope.thresholds import DEFAULT

E, K, LAYERS, WINDOW_S = 64, 4, (1, 2, 3), 10
POPULAR = np.arange(8)  # narrow traffic: 8 experts get 90% of the slots (7.2x their fair share each)


def narrow_shares() -> np.ndarray:
    p = np.full(E, 0.1 / (E - len(POPULAR)))
    p[POPULAR] = 0.9 / len(POPULAR)
    return p


def feed(w: RoutingWindow, second: int, shares: dict[int, np.ndarray], rng, requests: int = 6, tokens: int = 40):
    """One second of traffic: ``requests`` requests of ``tokens`` tokens, each slot drawn from the layer's shares."""
    per = np.stack([rng.multinomial(tokens * K, shares[layer], size=requests) for layer in LAYERS], axis=1)
    for i, layer in enumerate(LAYERS):
        w.add(second, layer, per[:, i].sum(0), requests * tokens, 0.0, 0.0)
    w.add_draws(second + 0.5, per)


def scrape(w: RoutingWindow, lr: LearnedReference, now: float):
    w.prune(int(now))
    g = w.gauges(None, learned=lr)
    lr.update(now, w, g, DEFAULT.hot_factor)
    return g


def over_bar(g) -> set[tuple[int, int, str]]:
    """(layer, expert, reference) of every exported hot factor over the bar."""
    return {(layer, int(e), g.hot_reference[i]) for i, layer in enumerate(g.layers)
            for e in np.nonzero(np.nan_to_num(g.hot[i]) > DEFAULT.hot_factor)[0]}


def test_narrow_traffic_pages_nothing_once_learned_and_a_jump_pages_until_it_goes():
    rng = np.random.default_rng(0)
    w = RoutingWindow(LAYERS, E, WINDOW_S)
    lr = LearnedReference(len(LAYERS), E, WINDOW_S, DEFAULT.learn_half_life_windows)
    base = {layer: narrow_shares() for layer in LAYERS}
    seen: dict[str, set] = {"learning": set(), "learned": set(), "jump": set(), "after": set()}
    jump = base[2].copy()
    jump[40] = 0.2  # an expert the narrow traffic left near idle: 12.8x its fair share, ~130x its learned share
    jump /= jump.sum()
    for second in range(0, 60 * WINDOW_S):
        phase = "learning" if second < 2 * WINDOW_S else "learned" if second < 30 * WINDOW_S else \
            "jump" if second < 50 * WINDOW_S else "after"
        shares = {**base, 2: jump} if phase == "jump" else base
        feed(w, second, shares, rng)
        seen[phase] |= over_bar(scrape(w, lr, second + 0.9))
    # while learning: the popular experts are over 4x their fair share, labelled "learning" (named, never paged)
    assert seen["learning"] and {ref for _, _, ref in seen["learning"]} == {"learning"}
    assert {e for _, e, _ in seen["learning"]} <= set(POPULAR.tolist())
    # learned: the same traffic pages nothing (its popular experts are its reference)
    assert lr.has.all() and lr.updates >= 25
    assert not {x for x in seen["learned"] if x[2] != "learning"}, seen["learned"]
    # the jump pages that layer and expert only, against the learned share, for all 20 windows it lasts: the
    # reference does not absorb an expert over the bar (the first window after the jump may not be over it yet)
    assert seen["jump"] == {(2, 40, "learned")}, seen["jump"]
    assert lr.share[1, 40] < 2 / E  # still the narrow traffic's share (~0.1/56), not the jump's 0.17
    # and when the traffic returns to what it was, the page clears (nothing over the bar a window later)
    late = over_bar(scrape(w, lr, 60 * WINDOW_S + 0.9))
    assert not late, late


def test_a_gradual_shift_is_followed_not_paged():
    """The popular set moves from experts 0-7 to 8-15 over 300 windows (ten half-lives): nothing pages."""
    rng = np.random.default_rng(1)
    w = RoutingWindow(LAYERS, E, WINDOW_S)
    lr = LearnedReference(len(LAYERS), E, WINDOW_S, DEFAULT.learn_half_life_windows)
    old, new = narrow_shares(), np.roll(narrow_shares(), len(POPULAR))
    paged = set()
    for second in range(0, 300 * WINDOW_S, 2):  # every other second: half the traffic, twice the windows
        mix = min(1.0, max(0.0, (second / WINDOW_S - 20) / 280))
        shares = (1 - mix) * old + mix * new
        feed(w, second, {layer: shares for layer in LAYERS}, rng, requests=12)
        g = scrape(w, lr, second + 1.9)
        paged |= {x for x in over_bar(g) if x[2] == "learned"}
    assert lr.has.all()
    assert not paged, paged


def _stats(shares: np.ndarray) -> tuple[float, float]:
    """(load CV, top share per token) of a layer routing by ``shares``: the structure, computed directly."""
    return float(shares.std() / shares.mean()), float(shares.max() * K)


def test_a_layer_uneven_from_the_start_is_its_reference_and_a_jump_in_it_pages():
    """Issue [learned]: imbalance and collapse without a baseline are judged against the excess CV and top share the
    layer showed in its first full window. Narrow traffic (excess CV ~2.5 by design of the traffic, over the old
    no-baseline bar of 1) pages neither, and its reference holds that structure (checked against the shares'
    own CV and top share); one layer whose load then collapses onto one expert pages collapse, that layer only,
    and its learned top share does not absorb the collapse while it lasts."""
    from moescope import judge

    rng = np.random.default_rng(2)
    w = RoutingWindow(LAYERS, E, WINDOW_S)
    lr = LearnedReference(len(LAYERS), E, WINDOW_S, DEFAULT.learn_half_life_windows)
    base = {layer: narrow_shares() for layer in LAYERS}
    collapsed = narrow_shares() * 0.2
    collapsed[50] += 0.8  # one expert in nearly every token (share 0.8 of slots x K = 3.2 > 1: in every token)
    collapsed /= collapsed.sum()
    verdicts: dict[str, set] = {"learned": set(), "jump": set()}
    for second in range(0, 40 * WINDOW_S):
        phase = "learning" if second < 2 * WINDOW_S else "learned" if second < 30 * WINDOW_S else "jump"
        feed(w, second, {**base, 3: collapsed} if phase == "jump" else base, rng)
        g = scrape(w, lr, second + 0.9)
        if phase == "learning":
            continue
        for i, layer in enumerate(g.layers):
            v = judge.verdict(excess_cv=float(g.excess_cv[i]), baseline_cv=None, top_share=float(g.top_share[i]),
                              dead_unexpected=float(g.dead_unexpected[i]), reference=g.hot_reference[i],
                              reference_cv=float(g.reference_cv[i]), reference_top=float(g.reference_top[i]))
            verdicts[phase] |= {(layer, name) for name in v.fires()}
    cv, top = _stats(narrow_shares())
    assert cv > DEFAULT.imbalance_cv  # over the old no-baseline bar by design of the traffic
    assert lr.has.all()
    assert lr.cv[:2] == pytest.approx(cv, rel=0.2) and lr.top[:2] == pytest.approx(top, rel=0.2)
    assert verdicts["learned"] == set(), verdicts["learned"]
    assert (3, "MoEExpertCollapse") in verdicts["jump"], verdicts["jump"]
    assert {layer for layer, _ in verdicts["jump"]} == {3}, verdicts["jump"]
    assert lr.top[2] == pytest.approx(top, rel=0.2)  # not absorbed: still the narrow traffic's top share
