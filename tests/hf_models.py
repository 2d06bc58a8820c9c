"""Tiny random HF MoE models built offline from configs (no hub download), one per supported family."""

from __future__ import annotations

import torch

COMMON = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, vocab_size=100,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "mixtral": dict(num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2),
    "qwen2_moe": dict(num_key_value_heads=2, moe_intermediate_size=24, shared_expert_intermediate_size=24,
                      num_experts=6, num_experts_per_tok=2, mlp_only_layers=[0]),
    "qwen3_moe": dict(num_key_value_heads=2, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
                      head_dim=8, mlp_only_layers=[0]),
    "olmoe": dict(num_key_value_heads=4, num_experts=6, num_experts_per_tok=2),
    "deepseek_v3": dict(num_key_value_heads=4, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
                        n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1),
    "gpt_oss": dict(num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, head_dim=8),
}


def build(family: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(family, **COMMON, **FAMILIES[family])
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random init large enough that routing is not near-uniform
        for name, p in model.named_parameters():
            if "gate" in name or "router" in name:
                p.normal_(0, 0.5)
    return model


def deepseek_v3_reference_ids(gate, x: torch.Tensor, config) -> torch.Tensor:
    """DeepSeek-V3's group-limited top-k, written out from the paper's description: sigmoid scores plus the
    correction bias pick groups (sum of each group's two best), then the top-k experts inside the best
    ``topk_group`` groups. The ids cannot be recomputed from the logits alone (the bias). Tests use a positive
    bias, so masking out groups with 0 (older transformers) or -inf (newer) picks the same experts."""
    logits = x.reshape(-1, x.shape[-1]).double() @ gate.weight.double().t()
    scores = logits.sigmoid() + gate.e_score_correction_bias.double()
    n_group, e = config.n_group, logits.shape[-1]
    grouped = scores.view(-1, n_group, e // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    keep_groups = group_scores.topk(config.topk_group, dim=-1).indices
    mask = torch.zeros_like(group_scores).scatter_(1, keep_groups, 1.0)
    masked = scores.masked_fill(~mask.repeat_interleave(e // n_group, dim=1).bool(), float("-inf"))
    return masked.topk(config.num_experts_per_tok, dim=-1).indices
