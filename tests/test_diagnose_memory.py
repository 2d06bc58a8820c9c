"""diagnose's memory check tells a leak from a growing working set: the running requests' KV caches fill as they
decode and come back when they end, so an overloaded engine's memory climbs with the tokens it holds (seen on
young deepseek-v3-shape demos sharing two cores: ~1.9 MB/s for a minute, called a leak). The steps record the
KV-cache tokens held; the check fits memory on time, the tokens held and their running peak together (an allocator
keeps the memory of the largest working set so far: RSS steps up at each new peak and stays, as seen on a healthy
deepseek-v3-shape row that diagnose called a leak in CI) and judges what time alone explains.
Reference: the synthetic memory's own leak rate."""

import math

import numpy as np

from moescope.analysis.diagnose import Window, _check_memory
from moescope.thresholds import DEFAULT

BASE = 500 * 2**20
# The alert's bar as a rate: growth that reaches capacity from BASE within the horizon (24 GiB in 4 h: ~1.7 MB/s).
# diagnose judges as the alert does, so the synthetic rates are set against it.
BAR = (DEFAULT.memory_capacity_bytes - BASE) / DEFAULT.memory_horizon_s
# bytes per KV-cache token of a larger model than the presets (a working set that grows by a few tokens a second
# then crosses the bar: on time alone it would page)
PER_TOKEN = 256 * 2**10


def _window(rss, kv, t):
    steps = [{"t": 1.7e9 + ti, "rss": int(r), **({"kv": int(k)} if k is not None else {})}
             for ti, r, k in zip(t, rss, kv)]
    return Window(ids=[], started=np.array([]), domain=[], tenant=[], model=None, n_experts=8, top_k=2,
                  layers=[], tokens=[], routing=[], entropy=[], miss=[], step_of=[], steps=steps)


def _alarming(w):
    return [f for f in _check_memory(w, DEFAULT) if f.severity != "info"]


T = np.linspace(0, 100, 200)


def test_a_working_set_that_grows_with_time_is_not_a_leak():
    kv = 2 * BAR / PER_TOKEN * T  # requests pile up: the tokens held grow all along, twice as fast as the bar
    rss = BASE + PER_TOKEN * kv
    assert _alarming(_window(rss, [None] * len(T), T))  # without the tokens held it looks like a leak
    found = _check_memory(_window(rss, kv, T), DEFAULT)
    assert found and all(f.severity == "info" for f in found)


def test_memory_that_follows_the_tokens_held_is_not_a_leak():
    kv = 2000 + 1500 * np.sin(T / 15)
    assert not _alarming(_window(BASE + PER_TOKEN * kv, kv, T))


def test_a_leak_beside_the_working_set_is_named_with_its_own_rate():
    kv = 2000 + 1500 * np.sin(T / 15)
    leak = 2 * BAR  # bytes per second
    found = _alarming(_window(BASE + PER_TOKEN * kv + leak * T, kv, T))
    assert [f.cause for f in found] == ["leak"]
    ev = found[0].evidence
    assert math.isclose(ev["rss_bytes_per_s"], leak, rel_tol=0.02)
    assert math.isclose(ev["working_set_bytes_per_kv_token"], PER_TOKEN, rel_tol=0.02)


def _bursts():
    """Tokens held in bursts whose peaks grow as requests pile up (an engine falling behind its arrivals),
    falling back between them."""
    rng = np.random.default_rng(7)
    return 100 + rng.uniform(0, 1, len(T)) * (50 + 30 * T) * (rng.uniform(0, 1, len(T)) < 0.3)


def test_memory_kept_at_the_working_sets_peak_is_not_a_leak():
    kv = _bursts()
    rss = BASE + PER_TOKEN * np.fmax.accumulate(kv)  # the allocator keeps the high-water mark
    assert _alarming(_window(rss, [None] * len(T), T))  # on time alone it looks like a leak
    assert not _alarming(_window(rss, kv, T))


def test_a_leak_beside_a_kept_peak_is_named_with_its_own_rate():
    kv = _bursts()
    leak = 2 * BAR
    found = _alarming(_window(BASE + PER_TOKEN * np.fmax.accumulate(kv) + leak * T, kv, T))
    assert [f.cause for f in found] == ["leak"]
    assert math.isclose(found[0].evidence["rss_bytes_per_s"], leak, rel_tol=0.02)


def test_a_leak_under_the_alerts_bar_is_not_named_and_one_over_it_is():
    """diagnose judges a trend as MoEMemoryGrowth does: the fitted line extended by the horizon, against the
    capacity. Half the bar's rate, steady as it is, stays quiet (the alert would not fire); twice it pages."""
    for rate, named in ((BAR / 2, False), (2 * BAR, True)):
        found = _alarming(_window(BASE + rate * T, [None] * len(T), T))
        assert bool(found) == named, (rate, found)
    ev = _alarming(_window(BASE + 2 * BAR * T, [None] * len(T), T))[0].evidence
    assert ev["capacity_bytes"] == DEFAULT.memory_capacity_bytes and ev["horizon_s"] == DEFAULT.memory_horizon_s


def _would_page(t, rss) -> bool:
    """The alert's judgement of a line fitted to the whole settled span (after diagnose's first fifth), written
    out: its value at the end plus the horizon's growth over capacity."""
    start = len(t) // 5
    slope, intercept = np.polyfit(t[start:] - t[start], rss[start:], 1)
    return intercept + slope * (t[-1] - t[start] + DEFAULT.memory_horizon_s) > DEFAULT.memory_capacity_bytes


def test_a_warm_up_that_slows_is_not_a_leak_and_a_leak_after_it_is():
    """Memory that grows fast and then levels off (a young server's allocator pools, compiled graphs and caches,
    as vLLM's worker: +219 MB in its first two minutes, the growth slowing) crosses the bar on a line fitted to the
    whole span, but its latest half grows at a fraction of the bar: the alert, which extrapolates the latest
    window's rate, would not page. The same warm-up with a steady leak of twice the bar after it is named, at the
    leak's rate."""
    warm = BASE + 2 * 2**30 * (1 - np.exp(-T / 10))  # 2 GiB, time constant 10 s: levelled off by the last half
    late = T >= 60
    assert _would_page(T, warm)  # the premise: the whole span's line pages
    assert np.polyfit(T[late], warm[late], 1)[0] < BAR / 2
    found = _check_memory(_window(warm, [None] * len(T), T), DEFAULT)
    assert found and all(f.severity == "info" for f in found), found
    assert "warm-up" in found[0].title
    leak = 2 * BAR
    found = _alarming(_window(warm + leak * T, [None] * len(T), T))
    assert [f.cause for f in found] == ["leak"]
    assert math.isclose(found[0].evidence["latest_half_rss_bytes_per_s"], leak, rel_tol=0.15)
