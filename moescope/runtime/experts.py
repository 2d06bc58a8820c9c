"""SwiGLU feed-forward networks: the routed experts (computed grouped) and the dense FFN.

Shape legend: T = tokens, H = hidden, F = ffn size, E = experts, k = experts per token, S = active slots.
Weight layout matches HuggingFace transformers 5.x fused experts (``gate_up_proj`` [E, 2F, H] with the
gate half first, ``down_proj`` [E, H, F]) so weights copy across without transposes.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

# (gate_up [2F, H], down [H, F]) of one expert, wherever it currently lives.
ExpertWeights = tuple[torch.Tensor, torch.Tensor]
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)  # public from torch 2.9


def grouped_mm_native(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``grouped_mm`` runs here without a per-expert Python loop: torch's CPU build (any float dtype;
    bit-equal to one matmul per expert, tests/test_experts.py), or CUDA's kernel (bf16 on sm80+, which also
    takes the group offsets on the device, so a CUDA graph can hold it)."""
    if _grouped_mm is None:
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 8


class WeightSource(Protocol):
    """Where experts' weights come from when they are not all resident (the expert cache)."""

    def begin(self, counts: Sequence[int]) -> None:
        """A forward is about to compute the experts with nonzero ``counts`` (slots per expert)."""

    def get(self, expert: int) -> ExpertWeights:
        """The expert's weights on the compute device, loaded first if need be."""

    def end(self) -> None:
        """The forward's experts are all computed."""


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for x [n, H]; one matmul for gate and up together."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # [n, F] each
    return F.linear(F.silu(gate) * up, down)  # [n, H]


class DenseFFN(nn.Module):
    """The FFN of a dense block (and the reference a 1-expert MoE must equal)."""

    def __init__(self, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(2 * ffn_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(hidden_size, ffn_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_up_proj, self.down_proj)


# What one empty group costs CPU grouped_mm (~1 us), in bytes of weights copied in that time (~10-16 GB/s here).
EMPTY_GROUP_BYTES = 12_000


class Experts(nn.Module):
    """E SwiGLU experts stored as stacked tensors, computed grouped: slots sorted by expert, each expert over
    its contiguous slice, each token's slots then combined in slot order.

    Resident experts run as two ``grouped_mm`` calls per layer (every expert in one call, no Python loop per
    expert) where the torch build has a native grouped GEMM for the device and dtype; otherwise, and when a
    ``weight_source`` (the expert cache) decides where each expert's weights come from, one pair of matmuls
    per expert (``compute_loop``, also the reference the grouped path is tested against).
    """

    def __init__(self, n_experts: int, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * ffn_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden_size, ffn_size))
        self.weight_source: WeightSource | None = None
        self.use_grouped_mm = True  # False: always the per-expert loop (the reference; benchmarks compare)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                counts: list[int] | None = None) -> torch.Tensor:
        """Mix the chosen experts' outputs.

        Args:
            x: [T, H] tokens.
            ids: [T, k] expert per slot; the sentinel value E marks a dropped slot (computed by nobody).
            weights: [T, k] gate weight per slot.
            counts: slots per expert (length E) if the caller already has them on the host.
        Returns:
            [T, H] sum over each token's slots, in slot order, of weight * expert(x).
        """
        n_tokens, top_k = ids.shape
        flat_ids = ids.reshape(-1)  # [T*k]
        order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert; sentinel E sorts last
        if counts is None:
            # The one host sync of an MoE layer: per-expert slice bounds for the matmuls (HF's eager block
            # and megablocks without a grouped-GEMM kernel pay the same). Once per layer, never per token.
            counts = torch.bincount(flat_ids, minlength=self.n_experts + 1)[: self.n_experts].tolist()
        order = order[: sum(counts)]  # [S] active slots, grouped by expert
        slot_out = torch.zeros(n_tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)  # [T*k, H]
        slot_out[order] = self.compute_grouped(x[order // top_k], counts)
        return combine(slot_out, weights)

    def compute_grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Run each expert over its contiguous slice of ``rows`` [S, H] (grouped by expert, ``counts[e]``
        rows for expert e). Returns [S, H]. Also the expert-parallel path's local computation."""
        if (self.use_grouped_mm and self.weight_source is None and rows.shape[0]
                and grouped_mm_native(rows.device, rows.dtype)):
            gate_up, down = self.gate_up_proj, self.down_proj  # [E, 2F, H], [E, H, F]
            used = [e for e, n in enumerate(counts) if n]
            expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
            if len(used) * expert_bytes < (len(counts) - len(used)) * EMPTY_GROUP_BYTES:
                # CPU grouped_mm pays ~1 us per group, empty or not: when copying the used experts' weights
                # costs less than the empty groups (a decode step at 256 small experts), pass only those. Same
                # layout, same kernel: bit-equal to the full call. Never for large experts (Mixtral-sized: a
                # 1-token step would copy 69 MB of weights, 5x the whole step).
                idx = torch.tensor(used, device=rows.device)
                gate_up, down = gate_up.index_select(0, idx), down.index_select(0, idx)
                counts = [counts[e] for e in used]
            offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(rows.device)  # [E] ends
            gate, up = _grouped_mm(rows, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)  # [S, F] each
            return _grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)  # [S, H]
        return self.compute_loop(rows, counts)

    def compute_loop(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``compute_grouped`` with one pair of matmuls per expert: the reference, and the path for experts
        whose weights come from a ``weight_source`` (fetched right before use)."""
        out = torch.empty_like(rows)
        source = self.weight_source
        if source is not None:
            source.begin(counts)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                if source is None:
                    gate_up, down = self.gate_up_proj[expert], self.down_proj[expert]
                else:  # fetched right before use: a miss stalls this step, as on a real server
                    gate_up, down = source.get(expert)
                out[start:start + n] = swiglu(rows[start:start + n], gate_up, down)
                start += n
        if source is not None:
            source.end()
        return out


def combine(slot_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T*k, H] per-slot expert outputs -> [T, H]: each token's slots weighted and summed in slot order.

    A fixed summation order per token (not scatter-add order) makes the result independent of how the slots
    were computed: grouped on one process, or spread over ranks by the expert-parallel path, bit for bit.
    """
    n_tokens, top_k = weights.shape
    y = slot_out.view(n_tokens, top_k, slot_out.shape[-1]) * weights.to(slot_out.dtype).unsqueeze(-1)  # [T, k, H]
    return y.sum(1)
