import torch

from moescope.runtime.config import MoEConfig
from moescope.runtime.experts import DenseFFN, Experts
from moescope.runtime.model import MoELayer
from reference import naive_moe


def _init(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def test_grouped_experts_equal_naive_loop():
    experts = Experts(n_experts=8, hidden_size=40, ffn_size=56)
    _init(experts, 1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(133, 40, generator=gen)
    ids = torch.randint(0, 8, (133, 3), generator=gen)
    ids[::7, 1] = 8  # dropped slots (sentinel E) contribute nothing
    weights = torch.rand(133, 3, generator=gen)
    with torch.no_grad():
        got = experts(x, ids, weights)
    want = naive_moe(x, ids, weights, experts.gate_up_proj.detach(), experts.down_proj.detach())
    assert (got - want).abs().max().item() <= 1e-5


def test_grouped_experts_with_unused_experts_and_empty_batch():
    experts = Experts(n_experts=4, hidden_size=8, ffn_size=8)
    _init(experts, 3)
    x = torch.randn(5, 8)
    ids = torch.full((5, 1), 2)
    w = torch.ones(5, 1)
    with torch.no_grad():
        got = experts(x, ids, w)
        assert torch.equal(experts(x, torch.full((5, 1), 4), w), torch.zeros(5, 8))  # all dropped
    want = naive_moe(x, ids, w, experts.gate_up_proj.detach(), experts.down_proj.detach())
    assert (got - want).abs().max().item() <= 1e-5


def test_one_expert_moe_equals_dense_ffn():
    cfg = MoEConfig(hidden_size=32, n_heads=4, n_experts=1, top_k=1, ffn_size=64)
    moe = MoELayer(cfg)
    dense = DenseFFN(32, 64)
    _init(moe, 4)
    with torch.no_grad():
        dense.gate_up_proj.copy_(moe.experts.gate_up_proj[0])
        dense.down_proj.copy_(moe.experts.down_proj[0])
        x = torch.randn(50, 32)
        y, decision, *_ = moe(x)
        assert torch.all(decision.weights == 1.0)
        torch.testing.assert_close(y, dense(x), atol=1e-6, rtol=0)
