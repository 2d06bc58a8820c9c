"""Naive reference implementations the tests compare the runtime against: plain loops, float64."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def naive_route(logits: torch.Tensor, k: int, temperature: float = 1.0):
    """float64 softmax and top-k per token in Python: (ids [T,k], weights [T,k], entropy [T], margin [T])."""
    ids, weights, entropy, margin = [], [], [], []
    for row in logits.double():
        p = torch.softmax(row / temperature, -1).tolist()
        order = sorted(range(len(p)), key=lambda e: -p[e])
        top = order[:k]
        s = sum(p[e] for e in top)
        ids.append(top)
        weights.append([p[e] / s for e in top])
        entropy.append(-sum(x * math.log(x) for x in p if x > 0) / math.log(len(p)))
        margin.append(p[order[0]] - p[order[1]])
    f64 = torch.float64
    return (torch.tensor(ids), torch.tensor(weights, dtype=f64), torch.tensor(entropy, dtype=f64),
            torch.tensor(margin, dtype=f64))


def naive_capacity_keep(ids: list[list[int]], n_experts: int, capacity: int) -> list[list[bool]]:
    """Rank-major, then token order: each expert accepts slots until it holds ``capacity``."""
    n_tokens, k = len(ids), len(ids[0])
    used = [0] * n_experts
    keep = [[False] * k for _ in range(n_tokens)]
    for rank in range(k):
        for t in range(n_tokens):
            e = ids[t][rank]
            if used[e] < capacity:
                used[e] += 1
                keep[t][rank] = True
    return keep


def naive_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """Per token, per slot: weight * SwiGLU_e(x_t); slots with id >= E (dropped) contribute nothing."""
    n_experts = gate_up.shape[0]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            if e >= n_experts:
                continue
            g, u = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, slot] * (down[e] @ (F.silu(g) * u))
    return out
