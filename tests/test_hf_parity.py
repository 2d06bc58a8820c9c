"""Our MoE layer equals HuggingFace transformers' MoE blocks with the same weights: Mixtral (the benchmark's
pairing, at a small shape), DeepSeek-V3 (sigmoid, correction bias, groups, shared expert) and Qwen3-MoE, on
transformers 5.x and 4.57 (CI runs this file in both venvs)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import runtime as bench  # noqa: E402


def test_moe_layer_equals_hf_mixtral_block():
    hf, ours = bench.build_pair(hidden=64, ffn=96, n_experts=8, top_k=2, seed=3)
    with torch.no_grad():
        for n in (1, 7, 64):
            x = torch.randn(n, 64, generator=torch.Generator().manual_seed(n))
            ref = bench.hf_forward(hf, x)
            got, decision, logits, *_ = ours(x)
            torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(logits, hf.gate(x)[0] if isinstance(hf.gate(x), tuple) else hf.gate(x))


def test_benchmark_report_shape(tmp_path):
    report = bench.run([1, 4], rounds=2, hidden=64, ffn=96)
    assert [r["tokens"] for r in report["results"]] == [1, 4]
    for r in report["results"]:
        assert r["max_abs_diff"] < 1e-5 and r["ours_s"] > 0 and r["hf_s"] > 0
    assert report["ours_1_token_over_floor"] > 0


def _hf_block(family: str, seed: int):
    """One HF sparse MoE block of a tiny config (built offline), random weights with routers sharp enough to
    have clear winners, and a random correction bias where the family has one."""
    from transformers import AutoConfig

    from moescope.hf import to_runtime

    if family == "deepseek_v3":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mod

        cfg = AutoConfig.for_model("deepseek_v3", hidden_size=32, moe_intermediate_size=24, n_routed_experts=16,
                                   num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                                   routed_scaling_factor=2.5, norm_topk_prob=True, num_attention_heads=4,
                                   intermediate_size=64)
        block = mod.DeepseekV3MoE(cfg)
    else:
        from transformers.models.qwen3_moe import modeling_qwen3_moe as mod

        cfg = AutoConfig.for_model("qwen3_moe", hidden_size=32, moe_intermediate_size=24, num_experts=16,
                                   num_experts_per_tok=4, norm_topk_prob=True, num_attention_heads=4)
        block = mod.Qwen3MoeSparseMoeBlock(cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0, 0.5 if "gate.weight" in name else 0.1)
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.rand(bias.shape) * 0.2)  # large enough to change the choice
    block.eval()
    return block, to_runtime.moe_config(cfg)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_moe_layer_equals_hf_block_with_groups_bias_and_shared_experts(family):
    """The runtime's layer with an HF block's weights: the same experts chosen for every token (DeepSeek-V3:
    sigmoid + correction bias + group-limited top-k, recomputed independently of HF by the reference too),
    the same gate weights, and outputs within fp32 rounding (HF sums expert outputs with index_add in expert
    order; we sum each token's slots in slot order)."""
    from moescope.hf import to_runtime
    from moescope.runtime.model import MoELayer
    from reference import naive_route_rule

    hf, cfg = _hf_block(family, seed=4)
    ours = MoELayer(cfg).eval()
    to_runtime.copy_block(hf, ours)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = hf(x[None])
        ref = (ref[0] if isinstance(ref, tuple) else ref)[0]
        got, decision, logits = ours(x)
        hf_ids, hf_weights = to_runtime.hf_routing(hf, x, cfg)
    order = decision.ids.argsort(dim=-1)
    assert torch.equal(decision.ids.gather(1, order), hf_ids)
    torch.testing.assert_close(decision.weights.gather(1, order), hf_weights, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    if family == "deepseek_v3":
        assert cfg.scoring == "sigmoid" and cfg.n_shared_experts == 1 and cfg.routed_scaling_factor == 2.5
        ids, *_ = naive_route_rule(logits, 4, scoring="sigmoid", n_group=4, topk_group=2,
                                   bias=hf.gate.e_score_correction_bias, scale=2.5)
        assert torch.equal(ids.sort(-1).values, hf_ids)
        unbiased = naive_route_rule(logits, 4, scoring="sigmoid", n_group=4, topk_group=2, scale=2.5)[0]
        assert not torch.equal(unbiased.sort(-1).values, hf_ids)  # the bias really steered the choice
