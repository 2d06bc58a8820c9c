"""HuggingFace MoE blocks -> the reference runtime's ``MoELayer``: the routing rule from the HF config, the
weights copied across (transformers 4.5x and 5.x layouts). Used by the parity tests and the HF benchmark.

Supported families: Mixtral (softmax top-k, renormalised), Qwen2/3-MoE and OLMoE (softmax, ``norm_topk_prob``),
DeepSeek-V3 / Kimi K2 (sigmoid, correction bias, group-limited top-k, routed scaling, shared experts).
"""

from __future__ import annotations

import torch

from moescope.errors import BadInput
from moescope.runtime.model_config import MoEConfig


def _get(cfg, *names, default=None):
    for n in names:
        value = getattr(cfg, n, None)
        if value is not None:
            return value
    return default


def moe_config(hf_config, **overrides) -> MoEConfig:
    """The routing and shape of one MoE block of an HF model config, as a one-layer ``MoEConfig``."""
    kind = getattr(hf_config, "model_type", "")
    hidden = hf_config.hidden_size
    deepseek = kind in ("deepseek_v3", "kimi_k2") or hasattr(hf_config, "n_routed_experts")
    fields = dict(
        name=f"hf-{kind}", hidden_size=hidden, n_layers=1, n_heads=1 if hidden % 2 else 2,
        n_experts=_get(hf_config, "n_routed_experts", "num_local_experts", "num_experts"),
        top_k=hf_config.num_experts_per_tok,
        ffn_size=_get(hf_config, "moe_intermediate_size", "intermediate_size"),
        norm_topk_prob=bool(_get(hf_config, "norm_topk_prob", default=kind == "mixtral")),
    )
    if kind == "mixtral":
        fields["norm_topk_prob"] = True  # Mixtral always renormalises its top-k
    if deepseek:
        fields.update(scoring="sigmoid", n_group=_get(hf_config, "n_group", default=1),
                      topk_group=_get(hf_config, "topk_group", default=1), correction_bias=True,
                      routed_scaling_factor=float(_get(hf_config, "routed_scaling_factor", default=1.0)),
                      n_shared_experts=_get(hf_config, "n_shared_experts", default=0))
    if fields["n_experts"] is None or fields["ffn_size"] is None:
        raise BadInput(f"not an MoE config: {kind or type(hf_config).__name__}")
    fields.update(overrides)
    return MoEConfig(**fields)


def _mlp_weights(mlp) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [2F, H], down [H, F]) of one HF SwiGLU MLP (gate_proj/up_proj/down_proj, or w1/w3/w2)."""
    if hasattr(mlp, "gate_proj"):
        return torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight
    return torch.cat([mlp.w1.weight, mlp.w3.weight]), mlp.w2.weight


@torch.no_grad()
def copy_block(hf_block, layer) -> None:
    """Copy an HF sparse MoE block's router, experts and shared experts into ``layer`` (a ``MoELayer`` built
    from ``moe_config`` of the same HF config). Raises ``BadInput`` when a part has no counterpart."""
    gate = hf_block.gate
    layer.router.weight.copy_(gate.weight)
    bias = getattr(gate, "e_score_correction_bias", None)
    if (bias is None) != (layer.router.e_score_correction_bias is None):
        raise BadInput("the HF router and the runtime's router disagree on the correction bias")
    if bias is not None:
        layer.router.e_score_correction_bias.copy_(bias)
    experts = hf_block.experts
    if hasattr(experts, "gate_up_proj"):  # transformers 5.x: fused [E, 2F, H] / [E, H, F], our layout
        layer.experts.gate_up_proj.copy_(experts.gate_up_proj)
        layer.experts.down_proj.copy_(experts.down_proj)
    else:  # 4.x: a ModuleList of MLPs
        for e, mlp in enumerate(experts):
            gate_up, down = _mlp_weights(mlp)
            layer.experts.gate_up_proj[e].copy_(gate_up)
            layer.experts.down_proj[e].copy_(down)
    shared = getattr(hf_block, "shared_experts", None)
    if (shared is None) != (layer.shared_experts is None):
        raise BadInput("the HF block and the runtime's layer disagree on shared experts")
    if shared is not None:
        gate_up, down = _mlp_weights(shared)
        layer.shared_experts.gate_up_proj.copy_(gate_up)
        layer.shared_experts.down_proj.copy_(down)


def hf_routing(hf_block, x: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k], weights [T, k]) the HF block's own router chooses for ``x`` [T, H], each row sorted by
    expert id (HF's DeepSeek router returns them unsorted). 5.x routers return (logits, weights, ids); 4.x
    DeepSeek returns (ids, weights); 4.x linear gates return logits, of which softmax top-k is the choice
    (renormalised as ``cfg`` says)."""
    out = hf_block.gate(x)
    if isinstance(out, tuple):
        ints = [t for t in out if not t.is_floating_point()]
        floats = [t for t in out if t.is_floating_point() and t.shape == ints[0].shape]
        ids, weights = ints[0], floats[0]
    else:
        weights, ids = torch.topk(torch.softmax(out.float(), dim=-1), cfg.top_k, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.float().gather(1, order)
