"""The hot test's learned reference (``metrics.window.LearnedReference``, issue [judge]): without a saved baseline
the exporter judges a hot expert against the shares its own first full window showed, so narrow traffic's popular
experts (7x their fair share here, by design of the traffic) page nothing, while an expert whose share jumps does,
and keeps paging while the jump lasts (it is not absorbed into the reference it is judged against).

The traffic is drawn here from known shares; what each check expects comes from those shares, not from the code
under test. The end-to-end check (a real demo on a shape no preset has, narrow traffic, the hot fault switched on
mid-run, through Prometheus and Alertmanager) is tests/test_detection_matrix.py's narrow row."""

from __future__ import annotations


import numpy as np

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
