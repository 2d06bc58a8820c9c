import math

import pytest
import torch

from moescope.runtime.router import Router, capacity_keep_mask, expert_capacity, route
from reference import naive_capacity_keep, naive_route


@pytest.mark.parametrize("n_experts,k,temperature", [(8, 2, 1.0), (16, 4, 0.7), (6, 1, 2.0), (64, 8, 1.0)])
def test_router_matches_float64_reference(n_experts, k, temperature):
    gen = torch.Generator().manual_seed(n_experts * 31 + k)
    x = torch.randn(300, 48, generator=gen)
    router = Router(48, n_experts, k, temperature=temperature)
    with torch.no_grad():
        router.weight.copy_(torch.randn(n_experts, 48, generator=gen) * 0.3)
        decision, logits = router(x)
    ref_logits = x.double() @ router.weight.double().t()
    ids, weights, entropy, margin = naive_route(ref_logits, k, temperature)
    assert torch.equal(decision.ids, ids)
    assert decision.ids.dtype == torch.int64 and decision.ids.shape == (300, k)
    torch.testing.assert_close(decision.weights.double(), weights, atol=1e-6, rtol=0)
    torch.testing.assert_close(decision.entropy.double(), entropy, atol=1e-5, rtol=0)
    torch.testing.assert_close(decision.margin.double(), margin, atol=5e-6, rtol=0)  # fp32 vs fp64
    assert int(decision.nonfinite) == 0 and int(decision.dropped) == 0
    assert bool(decision.kept.all())


def test_nonfinite_logits_are_counted():
    logits = torch.randn(10, 8)
    logits[2, 3] = float("nan")
    logits[5, 0] = float("inf")
    logits[5, 1] = float("-inf")
    d = route(logits, 2)
    assert int(d.nonfinite) == 3


def test_uniform_router_has_entropy_one_and_zero_margin():
    d = route(torch.zeros(4, 8), 2)
    torch.testing.assert_close(d.entropy, torch.ones(4))
    torch.testing.assert_close(d.margin, torch.zeros(4))


@pytest.mark.parametrize("cf", [0.5, 1.0, 1.25])
def test_capacity_drops_counted_exactly(cf):
    gen = torch.Generator().manual_seed(7)
    n_experts, k, n_tokens = 8, 2, 97
    # Skewed logits so some experts overflow.
    logits = torch.randn(n_tokens, n_experts, generator=gen) + torch.linspace(2, 0, n_experts)
    d = route(logits, k, capacity_factor=cf)
    cap = expert_capacity(n_tokens, k, n_experts, cf)
    assert cap == math.ceil(cf * n_tokens * k / n_experts)
    keep = naive_capacity_keep(d.ids.tolist(), n_experts, cap)
    assert d.kept.tolist() == keep
    n_dropped = sum(not x for row in keep for x in row)
    assert int(d.dropped) == n_dropped > 0
    assert torch.all(d.weights[~d.kept] == 0)
    # Each expert holds at most `cap` kept slots.
    kept_ids = d.ids[d.kept]
    assert torch.bincount(kept_ids, minlength=n_experts).max() <= cap
    # Dropped slots get the sentinel id E.
    assert torch.all(d.active_ids[~d.kept] == n_experts)


def test_capacity_keep_mask_prefers_first_choices():
    # Expert 0 is everyone's second choice but token 2's first: with capacity 1 the first choice wins.
    ids = torch.tensor([[1, 0], [2, 0], [0, 1]])
    keep = capacity_keep_mask(ids, 3, 1)
    assert keep.tolist() == [[True, False], [True, False], [True, False]]
