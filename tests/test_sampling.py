"""moescope.sampling against references: the running sums against a naive per-request loop, and the noise
bounds by simulation (healthy traffic whose requests each favour a few experts: the cluster bound holds where
the multinomial one does not; a 5x expert among 58 x 256 is found, a healthy model flags none)."""

import numpy as np
import pytest

from moescope import sampling, thresholds

T = thresholds.DEFAULT


def _naive(per_request):
    """Sums and the sandwich share variance with plain Python loops over requests, layers and experts."""
    R, L, E = per_request.shape
    out = {"draws": [0.0] * L, "slots": [0.0] * L, "var": [[0.0] * E for _ in range(L)]}
    for lay in range(L):
        rows = [[float(x) for x in per_request[r, lay]] for r in range(R)]
        rows = [row for row in rows if sum(row) > 0]  # a request without slots in a layer is no draw of it
        n = [sum(row) for row in rows]
        total = sum(n)
        out["draws"][lay], out["slots"][lay] = float(len(rows)), total
        for e in range(E):
            p = sum(row[e] for row in rows) / total
            resid = sum((row[e] - p * nr) ** 2 for row, nr in zip(rows, n))
            cluster = len(rows) / (len(rows) - 1) * resid / total ** 2
            out["var"][lay][e] = max(cluster, p * (1 - p) / total)
    return out


def test_draws_running_sums_equal_a_naive_loop_over_requests():
    rng = np.random.default_rng(0)
    c = rng.poisson(rng.uniform(0.2, 6, (9, 3, 7))).astype(float)
    c[4, 1] = 0  # request 4 routed nothing in layer 1
    d = sampling.Draws.of(c)
    ref = _naive(c)
    assert d.draws.tolist() == ref["draws"] and d.slots.tolist() == ref["slots"]
    np.testing.assert_allclose(d.share_var(), ref["var"], rtol=1e-10)
    for lay in range(3):  # the plain sums
        for e in range(7):
            assert d.counts[lay, e] == sum(c[r, lay, e] for r in range(9))
            assert d.counts_sq[lay, e] == sum(c[r, lay, e] ** 2 for r in range(9))
            assert d.cross[lay, e] == sum(c[r, lay].sum() * c[r, lay, e] for r in range(9))
    # a window adds finished requests and subtracts the ones that left: the sums of what remains
    acc = sampling.Draws.of(c[:4])
    acc.add(sampling.Draws.of(c[4:]))
    acc.add(sampling.Draws.of(c[:2]), -1.0)
    np.testing.assert_allclose(acc.share_var(), sampling.Draws.of(c[2:]).share_var(), rtol=1e-12)
    assert np.isnan(sampling.Draws.of(c[:1]).share_var()).all()  # one request: no variance, not judged


def _requests(rng, n_requests, n_windows, n_experts, slots_mean, favour=4, weight=0.5):
    """[R, W, E] slots of healthy requests: fair on average, but each request sends ``weight`` of its slots to
    ``favour`` experts of its own (a request's tokens route alike). Windows are independent (the layer axis)."""
    q = np.full((n_requests, n_windows, n_experts), (1 - weight) / n_experts)
    fav = rng.integers(0, n_experts, (n_requests, n_windows, favour))
    for k in range(favour):
        np.put_along_axis(q, fav[..., k:k + 1], np.take_along_axis(q, fav[..., k:k + 1], 2) + weight / favour, 2)
    q /= q.sum(2, keepdims=True)
    n = rng.poisson(slots_mean, (n_requests, n_windows)) + 1
    out = np.empty_like(q)
    for r in range(n_requests):
        for w in range(n_windows):
            out[r, w] = rng.multinomial(n[r, w], q[r, w])
    return out


@pytest.mark.parametrize("n_experts,n_windows,slots_mean", [(8, 1500, 80), (256, 300, 800)])
def test_healthy_correlated_requests_stay_under_the_cluster_noise_bound(n_experts, n_windows, slots_mean):
    rng = np.random.default_rng(n_experts)
    c = _requests(rng, 30, n_windows, n_experts, slots_mean)
    window = c.sum(0)  # [W, E]
    cv = window.std(1) / window.mean(1)
    n = window.sum(1)
    bound = sampling.noise_cv(n_experts, n, sampling.Draws.of(c), T.noise_z)
    multinomial = sampling.multinomial_noise_cv(n_experts, n, T.noise_z)
    assert np.mean(cv <= bound) >= 0.99
    assert np.mean(cv > multinomial) > 0.3  # slots as independent draws: healthy traffic reads as imbalance
    excess = sampling.excess_cv(cv, bound)
    assert np.mean(excess == 0) >= 0.99 and np.all(excess < T.imbalance_cv)


def _deepseek_requests(rng, hot=None, n_requests=40, n_layers=58, n_experts=256, slots_mean=500):
    """[R, L, E]: ~20k slots per layer of healthy clustered requests; ``hot`` (layer, expert, factor) sets
    that expert's share to factor / E in every request."""
    c = _requests(rng, n_requests, n_layers, n_experts, slots_mean, favour=8)
    if hot is None:
        return c
    layer, expert, factor = hot
    n = c[:, layer].sum(1)
    q = np.full(n_experts, (1 - factor / n_experts) / (n_experts - 1))
    q[expert] = factor / n_experts
    c[:, layer] = [rng.multinomial(x, q) for x in n.astype(int)]
    return c


def test_hot_factor_finds_a_5x_expert_among_58_x_256_and_flags_none_on_healthy_traffic():
    rng = np.random.default_rng(7)
    L, E = 58, 256
    z, fair = T.hot_z(L, E), np.full((L, E), 1 / E)
    for _ in range(4):
        c = _deepseek_requests(rng)
        h = sampling.hot_factor(c.sum(0), sampling.Draws.of(c), fair, z)
        assert not np.isfinite(h).any()
    for _ in range(4):
        c = _deepseek_requests(rng, hot=(17, 42, 5.0))
        window = c.sum(0)
        assert 19_000 < window[17].sum() < 21_000
        h = sampling.hot_factor(window, sampling.Draws.of(c), fair, z)
        assert h[17, 42] > T.hot_factor  # the alert's bar
        assert h[17, 42] == pytest.approx(window[17, 42] / window[17].sum() * E)
        assert np.isfinite(h).sum() == 1
