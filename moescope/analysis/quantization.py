"""``moescope check quantization``: what int8 weights do to routing.

The model's weights are quantized with PyTorch's own int8 quantization (``torch.quantize_per_channel``:
symmetric, one scale per output channel, qint8) and dequantized for compute (weight-only int8, as most
serving stacks deploy it). Variants: ``experts`` (every expert's gate/up and down projections) and
``experts+router`` (the router's weight too). The same inputs go through the full-precision model and the
variant; reported per MoE layer: the share of tokens whose expert set changed (flip rate), non-finite router
logits, and for the output the share of positions whose greedy next token is unchanged and the mean KL
divergence of the next-token distributions. The seeds' lesson, in numbers: keep the router in higher
precision.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch

from moescope.capture.observer import NOOP
from moescope.runtime import tokenizer
from moescope.runtime.model import MoETransformer, Segment

VARIANTS = ("experts", "experts+router")


def int8_roundtrip(w: torch.Tensor, axis: int) -> torch.Tensor:
    """Quantize ``w`` to qint8 with a symmetric per-channel scale along ``axis``; return the dequantized
    float tensor (what an int8-weight kernel computes with)."""
    w32 = w.detach().float()
    reduce = [d for d in range(w32.dim()) if d != axis]
    scale = (w32.abs().amax(dim=reduce) / 127.0).clamp_min(1e-12).double()
    zero = torch.zeros_like(scale, dtype=torch.int64)
    try:
        with warnings.catch_warnings():  # torch 2.13 marks quantized tensor creation deprecated (torchao's turn)
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(w32, scale, zero, axis, torch.qint8)
        return q.dequantize().to(w.dtype)
    except (AttributeError, RuntimeError):  # a torch without it: the same arithmetic by hand
        shape = [1] * w32.dim()
        shape[axis] = -1
        s = scale.float().reshape(shape)
        return (torch.clamp(torch.round(w32 / s), -128, 127) * s).to(w.dtype)


@torch.no_grad()
def quantized_copy(model: MoETransformer, variant: str) -> MoETransformer:
    if variant not in VARIANTS:
        raise ValueError(variant)
    q = copy.deepcopy(model)
    for moe in q.moe_layers():
        ex = moe.experts
        e, two_f, h = ex.gate_up_proj.shape
        # one scale per (expert, output row): fold the expert axis into the channel axis
        ex.gate_up_proj.copy_(int8_roundtrip(ex.gate_up_proj.reshape(e * two_f, h), 0).reshape(e, two_f, h))
        e, h_out, f = ex.down_proj.shape
        ex.down_proj.copy_(int8_roundtrip(ex.down_proj.reshape(e * h_out, f), 0).reshape(e, h_out, f))
        if variant == "experts+router":
            moe.router.weight.copy_(int8_roundtrip(moe.router.weight, 0))  # one scale per expert row
    return q


@dataclass
class QuantReport:
    variant: str
    tokens: int
    flip_rate: dict[int, float]
    nonfinite_logits: dict[int, int]
    next_token_agreement: float
    mean_kl: float

    @property
    def worst(self) -> float:
        return max(self.flip_rate.values(), default=0.0)


@torch.inference_mode()
def _run(model: MoETransformer, tokens: torch.Tensor, segments: list[Segment]):
    observer, model.observer = model.observer, NOOP
    try:
        out = model(tokens, segments)
    finally:
        model.observer = observer
    return out


def compare(model: MoETransformer, prompts: list[str], variant: str) -> QuantReport:
    ids = [tokenizer.encode(p) for p in prompts]
    tokens = torch.tensor([t for seq in ids for t in seq], dtype=torch.long, device=model.device)
    segments = [Segment(len(s)) for s in ids]
    ref = _run(model, tokens, segments)
    got = _run(quantized_copy(model, variant), tokens, segments)
    flips, nonfinite = {}, {}
    for layer, d in ref.decisions.items():
        a, b = d.ids.sort(-1).values, got.decisions[layer].ids.sort(-1).values
        flips[layer] = float((a != b).any(-1).float().mean())
        nonfinite[layer] = int((~torch.isfinite(got.router_logits[layer])).sum())
    p_log = torch.log_softmax(ref.logits.float(), -1)
    q_log = torch.log_softmax(got.logits.float(), -1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    agree = float((ref.logits.argmax(-1) == got.logits.argmax(-1)).float().mean())
    return QuantReport(variant, len(tokens), flips, nonfinite, agree, float(kl.mean()))
