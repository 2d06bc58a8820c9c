"""The reference MoE transformer LM, top to bottom: norm, rotary embedding, attention with a KV cache,
the MoE FFN layer, the block, the model.

Shape legend: T = tokens in the forward (all sequences concatenated, vLLM's flat "varlen" layout),
H = hidden, V = vocab, E = experts, k = experts per token, nh = heads, hd = head size, P = positions.

Attention runs per sequence (each has its own KV cache); the MoE layers see every token of the step at
once, so the experts are batched across requests, which is what makes MoE serving efficient.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from moescope.capture.decision import RoutingDecision
from moescope.capture.observer import NOOP, Observer
from moescope.errors import BadInput
from moescope.runtime.model_config import MoEConfig
from moescope.runtime.experts import DenseFFN, Experts
from moescope.runtime.router import ROUTER_IMPLS, Router, RoutingRule
from moescope.runtime.timing import LayerTimer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [P, hd/2] for rotary position embedding."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [n, nh, hd] by the angles of its positions (cos/sin [n, hd/2]); half-split convention."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class KVCache:
    """Keys and values of one sequence for every layer, preallocated to ``max_seq_len``."""

    def __init__(self, cfg: MoEConfig, device: torch.device, dtype: torch.dtype) -> None:
        shape = (cfg.n_layers, cfg.max_seq_len, cfg.n_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # positions filled; advanced by the model after each forward
        self.capacity = cfg.max_seq_len


@dataclass
class Segment:
    """``n`` consecutive tokens of one sequence inside the flat batch; ``cache`` None means no history."""

    n: int
    cache: KVCache | None = None

    @property
    def start_pos(self) -> int:
        return self.cache.length if self.cache is not None else 0


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, segments: list[Segment], layer: int, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        n_tok = x.shape[0]
        q, k, v = self.qkv(x).view(n_tok, 3, self.n_heads, self.head_dim).unbind(1)  # [T, nh, hd] each
        if all(s.cache is None for s in segments) and len({s.n for s in segments}) == 1:
            # Training / no-history fast path: equal-length sequences as one batched causal attention.
            b, n = len(segments), segments[0].n
            q, k = apply_rope(q, cos[:n].repeat(b, 1), sin[:n].repeat(b, 1)), \
                apply_rope(k, cos[:n].repeat(b, 1), sin[:n].repeat(b, 1))
            qb, kb, vb = (t.view(b, n, self.n_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)  # [b, nh, n, hd]
            return self.out(y.transpose(1, 2).reshape(n_tok, -1))
        if all(s.n == 1 and s.cache is not None for s in segments):
            return self.out(self._decode(q, k, v, segments, layer, cos, sin))
        outs = []
        start = 0
        for seg in segments:
            p0, n = seg.start_pos, seg.n
            if p0 + n > cos.shape[0]:
                raise ValueError(f"sequence of {p0 + n} tokens exceeds max_seq_len {cos.shape[0]}")
            qs = apply_rope(q[start:start + n], cos[p0:p0 + n], sin[p0:p0 + n])  # [n, nh, hd]
            ks = apply_rope(k[start:start + n], cos[p0:p0 + n], sin[p0:p0 + n])
            vs = v[start:start + n]
            if seg.cache is not None:
                seg.cache.k[layer, p0:p0 + n] = ks
                seg.cache.v[layer, p0:p0 + n] = vs
                ks, vs = seg.cache.k[layer, :p0 + n], seg.cache.v[layer, :p0 + n]  # [p0+n, nh, hd]
            if n == 1:
                mask, causal = None, False  # one new token sees the whole history
            elif p0 == 0:
                mask, causal = None, True
            else:  # new token i (absolute p0+i) sees keys 0..p0+i
                mask = torch.ones(n, p0 + n, dtype=torch.bool, device=x.device).tril(diagonal=p0)
                causal = False
            y = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                               attn_mask=mask, is_causal=causal)  # [nh, n, hd]
            outs.append(y.transpose(0, 1).reshape(n, -1))
            start += n
        return self.out(torch.cat(outs))


    def _decode(self, q, k, v, segments: list[Segment], layer: int, cos, sin) -> torch.Tensor:
        """One new token per sequence: rotary, cache writes, then one attention over the sequences' histories
        padded to the longest (positions past a sequence's own length are masked). [B, nh*hd]."""
        b = len(segments)
        pos = [s.cache.length for s in segments]
        p_max = max(pos) + 1
        if p_max > cos.shape[0]:
            raise ValueError(f"sequence of {p_max} tokens exceeds max_seq_len {cos.shape[0]}")
        at = torch.tensor(pos, device=q.device)  # [B] host positions: no device round trip
        q, k = apply_rope(q, cos[at], sin[at]), apply_rope(k, cos[at], sin[at])  # [B, nh, hd]
        for i, seg in enumerate(segments):
            seg.cache.k[layer, pos[i]] = k[i]
            seg.cache.v[layer, pos[i]] = v[i]
        keys = torch.stack([s.cache.k[layer, :p_max] for s in segments]).transpose(1, 2)  # [B, nh, P, hd]
        values = torch.stack([s.cache.v[layer, :p_max] for s in segments]).transpose(1, 2)
        mask = (torch.arange(p_max, device=q.device)[None, :] <= at[:, None])[:, None, None, :]  # [B, 1, 1, P]
        y = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask)  # [B, nh, 1, hd]
        return y.reshape(b, -1)


class MoELayer(nn.Module):
    """Router + routed experts (+ the shared experts every token runs). Returns the mixed output and the
    routing decision (for observers and the loss)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.router = Router(cfg.hidden_size, cfg.n_experts, cfg.top_k, temperature=cfg.router_temperature,
                             capacity_factor=cfg.capacity_factor, rule=RoutingRule.from_config(cfg),
                             correction_bias=cfg.correction_bias)
        self.experts = Experts(cfg.n_experts, cfg.hidden_size, cfg.ffn_size)
        # Not routed, not an expert: its parameters count as dense (every token touches them).
        self.shared_experts = DenseFFN(cfg.hidden_size, cfg.shared_ffn) if cfg.shared_ffn else None
        self.layer_index = -1  # set by the Block
        # Expert parallelism (moescope.parallel): when set, the experts are computed across ranks.
        self.parallel = None
        self.timer: LayerTimer | None = None  # set by the model for each forward while someone observes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RoutingDecision, torch.Tensor]:
        """Returns output, decision and router logits; router and expert times go to ``self.timer``."""
        timer = self.timer
        t0 = timer.mark() if timer is not None else None
        decision, logits = self.router(x)
        t1 = timer.mark() if timer is not None else None
        if self.parallel is None:
            y = self.experts(x, decision.active_ids, decision.weights)
        else:
            y = self.parallel(self.layer_index, self.experts, x, decision.active_ids, decision.weights)
        if self.shared_experts is not None:  # replicated: every rank runs it on every token
            y = y + self.shared_experts(x)
        if timer is not None:
            timer.add(self.layer_index, t0, t1, timer.mark())
        return y, decision, logits


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.is_moe = index not in cfg.dense_layers
        self.ffn = MoELayer(cfg) if self.is_moe else DenseFFN(cfg.hidden_size, cfg.dense_ffn)
        if self.is_moe:
            self.ffn.layer_index = index

    def forward(self, x, segments, cos, sin):
        x = x + self.attn(self.attn_norm(x), segments, self.index, cos, sin)
        if not self.is_moe:
            return x + self.ffn(self.ffn_norm(x)), None
        y, *moe = self.ffn(self.ffn_norm(x))
        return x + y, moe


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [T, V] (or [n_segments, V] with last_only)
    decisions: dict[int, RoutingDecision] = field(default_factory=dict)  # block index -> decision
    router_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # block index -> [T, E]


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.observer: Observer = NOOP
        self._timer: LayerTimer | None = None  # host clock on CPU, CUDA events on CUDA (runtime.timing)
        self.reset_parameters(cfg.seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Deterministic init from ``seed`` (GPT-2 style: std 0.02, residual outputs scaled by depth)."""
        gen = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / (2 * self.cfg.n_layers) ** 0.5
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = resid_std if name.endswith(("out.weight", "down_proj")) else 0.02
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        for m in self.moe_layers():  # a trained checkpoint's bias is not zero: let it steer selection here too
            if m.router.e_score_correction_bias is not None:  # (about the spread of the sigmoid scores)
                m.router.e_score_correction_bias.copy_(torch.randn(self.cfg.n_experts, generator=gen) * 0.01)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.blocks if b.is_moe]

    def new_cache(self) -> KVCache:
        return KVCache(self.cfg, self.device, self.embed.weight.dtype)

    def set_router_impl(self, impl: str) -> str | None:
        """Choose every router's path (``auto``, ``torch`` or ``triton``). Returns a one-line notice when the
        fused Triton kernel would be asked for but does not implement this model's routing rule (sigmoid,
        groups, correction bias, scaling): the torch router runs then, never a silently different routing."""
        if impl not in ROUTER_IMPLS:
            raise ValueError(f"router impl must be one of {', '.join(ROUTER_IMPLS)}, got {impl!r}")
        supported = all(m.router.kernel_supported for m in self.moe_layers())
        if impl == "triton" and supported:  # asked for by name: where it cannot run, say so (auto falls back)
            from moescope.kernels import router_triton  # optional: triton (kernels.router_triton; the gpu extra)

            if not router_triton.available():
                raise BadInput("--router-impl triton: triton is not installed (pip install triton)")
            if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise BadInput(f"--router-impl triton runs the fused kernel on a CUDA device (the model is on "
                               f"{self.device.type}); on a CPU only under Triton's interpreter, TRITON_INTERPRET=1 "
                               "(slow: for checks)")
        for m in self.moe_layers():
            m.router.impl = impl
        wanted = impl == "triton" or (impl == "auto" and self.device.type == "cuda")
        if wanted and not supported:
            return (f"note: the Triton router implements softmax top-k only; {self.cfg.name} routes with "
                    f"{self.cfg.scoring} scores{', groups' if self.cfg.n_group > 1 else ''}"
                    f"{', a correction bias' if self.cfg.correction_bias else ''}: the torch router runs")
        return None

    @property
    def smoothing(self) -> bool:
        """Whether a router mitigation needs prefix keys (``route_keys``) with each forward."""
        return any(m.router.mitigation is not None and m.router.mitigation.smoothing_margin is not None
                   for m in self.moe_layers())

    def forward(self, tokens: torch.Tensor, segments: list[Segment], *, last_only: bool = False,
                route_keys: torch.Tensor | None = None) -> ForwardOutput:
        """Run the flat batch ``tokens`` [T] laid out as ``segments``; advances each segment's KV cache.

        Args:
            tokens: [T] token ids, the segments' new tokens concatenated in order.
            segments: how many tokens belong to which sequence (and its cache, if any).
            last_only: return only the logits of each segment's last token ([n_segments, V]).
            route_keys: [T] int64 prefix keys (``router.extend_prefix_key``) for router smoothing.
        """
        if sum(s.n for s in segments) != tokens.shape[0]:
            raise ValueError("segments do not cover the flat batch")
        if route_keys is not None:
            for moe in self.moe_layers():
                moe.router.keys = route_keys
        try:
            return self._forward(tokens, segments, last_only)
        finally:
            if route_keys is not None:
                for moe in self.moe_layers():
                    moe.router.keys = None

    def _forward(self, tokens: torch.Tensor, segments: list[Segment], last_only: bool) -> ForwardOutput:
        x = self.embed(tokens)  # [T, H]
        out = ForwardOutput(logits=x)
        observer = self.observer
        timer = None
        if observer is not NOOP:  # nobody watching: no clock readings, no events
            timer = self._timer
            if timer is None or timer.cuda != x.is_cuda:
                timer = self._timer = LayerTimer(x.device)
        for block in self.blocks:
            if block.is_moe:
                block.ffn.timer = timer
            x, moe = block(x, segments, self.rope_cos, self.rope_sin)
            if moe is not None:
                decision, router_logits = moe
                out.decisions[block.index] = decision
                out.router_logits[block.index] = router_logits
                observer.on_routing(block.index, decision)
        if timer is not None:  # this forward's layers on CPU; on CUDA those whose events completed
            for layer, router_s, experts_s in timer.poll():
                observer.on_layer_time(layer, router_s, experts_s)
        for seg in segments:
            if seg.cache is not None:
                seg.cache.length += seg.n
        if last_only:
            ends = torch.tensor([s.n for s in segments], device=x.device).cumsum(0) - 1
            x = x[ends]
        out.logits = self.lm_head(self.norm(x))  # [T or n_segments, V]
        return out

    def forward_batch(self, tokens: torch.Tensor) -> ForwardOutput:
        """Training/evaluation: [B, S] equal-length sequences from position 0; logits [B*S, V]."""
        b, s = tokens.shape
        return self.forward(tokens.reshape(-1), [Segment(s) for _ in range(b)])
