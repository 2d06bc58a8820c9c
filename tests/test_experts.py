import pytest
import torch

from moescope.runtime.model_config import MoEConfig
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


@pytest.mark.parametrize("n_experts,n_rows", [(8, 64), (64, 24), (256, 40), (256, 3000)])
def test_grouped_mm_path_is_bit_equal_to_the_per_expert_loop(n_experts, n_rows):
    """The grouped path (one grouped GEMM per projection, compacted to the experts in use when few are) and
    the per-expert loop it replaced run the same GEMM per expert: equal bit for bit, which keeps the expert
    cache (loop) and expert parallelism (grouped on a subset of experts) exactly equal to one process."""
    from moescope.runtime.experts import grouped_mm_native

    if not grouped_mm_native(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no grouped_mm")
    experts = Experts(n_experts=n_experts, hidden_size=32, ffn_size=16)
    _init(experts, n_experts)
    gen = torch.Generator().manual_seed(n_rows)
    ids = torch.randint(0, n_experts, (n_rows,), generator=gen).sort().values
    counts = torch.bincount(ids, minlength=n_experts).tolist()
    rows = torch.randn(n_rows, 32, generator=gen)
    with torch.no_grad():
        grouped = experts.compute_grouped(rows, counts)
        loop = experts.compute_loop(rows, counts)
    assert torch.equal(grouped, loop)
    want = naive_moe(rows, ids[:, None], torch.ones(n_rows, 1), experts.gate_up_proj.detach(),
                     experts.down_proj.detach())
    assert (grouped - want).abs().max().item() <= 1e-5


def test_shared_expert_is_added_for_every_token(deepseek_cfg):
    moe = MoELayer(deepseek_cfg)
    _init(moe, 6)
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y, decision, _ = moe(x)
        routed = naive_moe(x, decision.active_ids, decision.weights, moe.experts.gate_up_proj,
                           moe.experts.down_proj)
        shared = moe.shared_experts(x)
    torch.testing.assert_close(y, routed + shared, atol=1e-5, rtol=1e-5)
    assert moe.shared_experts.gate_up_proj.shape == (2 * deepseek_cfg.ffn_size, 32)
