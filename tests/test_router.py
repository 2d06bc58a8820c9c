import math

import pytest
import torch

from moescope.runtime.router import Router, RoutingRule, capacity_keep_mask, expert_capacity, route
from reference import naive_capacity_keep, naive_route, naive_route_rule


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


RULES = [  # (scoring, n_experts, k, n_group, topk_group, bias, norm, scale)
    ("sigmoid", 256, 8, 8, 4, True, True, 2.5),  # DeepSeek-V3
    ("sigmoid", 64, 6, 1, 1, True, True, 2.5),  # Kimi K2's shape: one group
    ("sigmoid", 16, 4, 4, 2, False, False, 1.0),
    ("softmax", 128, 8, 1, 1, False, True, 1.0),  # Qwen3-MoE
    ("softmax", 32, 4, 1, 1, False, False, 1.0),  # OLMoE / Qwen2-MoE: not renormalised
    ("softmax", 32, 4, 4, 2, True, True, 1.5),  # every option at once on softmax scores
]


@pytest.mark.parametrize("scoring,n_experts,k,n_group,topk_group,with_bias,norm,scale", RULES)
def test_routing_rules_match_float64_reference(scoring, n_experts, k, n_group, topk_group, with_bias, norm, scale):
    gen = torch.Generator().manual_seed(n_experts + k)
    logits = torch.randn(200, n_experts, generator=gen) * 1.5
    rule = RoutingRule(scoring=scoring, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm, scale=scale)
    bias = (torch.rand(n_experts, generator=gen) - 0.5) * 0.4 if with_bias else None
    d = route(logits, k, rule=rule, bias=bias)
    ids, weights, entropy, margin = naive_route_rule(logits, k, scoring=scoring, n_group=n_group,
                                                     topk_group=topk_group, bias=bias, norm=norm, scale=scale)
    assert torch.equal(d.ids, ids)
    torch.testing.assert_close(d.weights.double(), weights, atol=2e-6, rtol=0)
    torch.testing.assert_close(d.entropy.double(), entropy, atol=1e-5, rtol=0)
    torch.testing.assert_close(d.margin.double(), margin, atol=2e-6, rtol=0)
    if n_group > 1:  # every chosen expert lies in one of the token's topk_group groups
        assert all(len({e // (n_experts // n_group) for e in row}) <= topk_group for row in d.ids.tolist())
    # the selection alone (what calibration's balancing rounds count): the same experts in the same order
    key = rule.scores(logits, 1.0) + (0 if bias is None else bias)
    assert torch.equal(rule.choose(key, k), ids)


def test_correction_bias_steers_selection_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    rule = RoutingRule(scoring="sigmoid", norm_topk_prob=False)
    plain = route(logits, 1, rule=rule)
    steered = route(logits, 1, rule=rule, bias=torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert plain.ids.tolist() == [[0]] and steered.ids.tolist() == [[3]]
    assert steered.weights.item() == pytest.approx(torch.sigmoid(torch.tensor(-1.0)).item())  # unbiased score
    assert steered.margin.item() == plain.margin.item()  # the router's own confidence ignores the bias


def test_sigmoid_router_module_uses_its_bias_and_config(deepseek_cfg):
    from moescope.runtime.model import MoELayer

    layer = MoELayer(deepseek_cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.router.weight.copy_(torch.randn(16, 32, generator=gen))
        layer.router.e_score_correction_bias.copy_(torch.rand(16, generator=gen) * 0.3)
    x = torch.randn(50, 32, generator=gen)
    with torch.no_grad():
        d, logits = layer.router(x)
    ids, weights, *_ = naive_route_rule(logits, 4, scoring="sigmoid", n_group=4, topk_group=2,
                                        bias=layer.router.e_score_correction_bias, scale=2.5)
    assert torch.equal(d.ids, ids)
    torch.testing.assert_close(d.weights.sum(-1), torch.full((50,), 2.5))
    layer = layer.to(torch.bfloat16)  # the bias keeps float32, as HF keeps it
    assert layer.router.e_score_correction_bias.dtype == torch.float32


def test_nonfinite_rows_and_capacity_under_sigmoid_groups():
    logits = torch.randn(40, 16, generator=torch.Generator().manual_seed(2))
    logits[3] = float("nan")
    rule = RoutingRule(scoring="sigmoid", n_group=4, topk_group=2)
    d = route(logits, 4, rule=rule, capacity_factor=0.5)
    assert int(d.nonfinite) == 16
    cap = expert_capacity(40, 4, 16, 0.5)
    assert torch.bincount(d.ids[d.kept], minlength=16).max() <= cap
    assert int(d.dropped) == int((~d.kept).sum()) > 0
    assert d.kept.tolist() == naive_capacity_keep(d.ids.tolist(), 16, cap)


def test_kernel_is_used_only_for_the_rule_it_implements(deepseek_cfg):
    from moescope.runtime.model import MoELayer

    sig = MoELayer(deepseek_cfg).router
    soft = MoELayer(deepseek_cfg.replace(scoring="softmax", n_group=1, topk_group=None, correction_bias=False,
                                         routed_scaling_factor=1.0)).router
    assert not sig.kernel_supported and soft.kernel_supported
    sig.impl = "triton"  # asked for explicitly: the torch router still runs (the CLI says so in one line)
    torch.nn.init.normal_(sig.weight)
    x = torch.randn(9, 32)
    d, logits = sig(x)
    ref = route(logits, 4, rule=sig.rule, bias=sig.e_score_correction_bias)
    assert torch.equal(d.ids, ref.ids) and torch.equal(d.weights, ref.weights)
