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


def naive_route_rule(logits: torch.Tensor, k: int, *, scoring: str, n_group: int = 1, topk_group: int = 1,
                     bias=None, norm: bool = True, scale: float = 1.0, temperature: float = 1.0):
    """Any routing rule written out per token in float64 from its description (DeepSeek-V3's paper / HF's
    router): scores (softmax or sigmoid); choice = scores + bias; group score = sum of the group's two best
    choices; only the topk_group best groups are eligible; top-k of the eligible choices; gate weights are
    the chosen experts' unbiased scores, normalised (sigmoid: + 1e-20) and scaled. Entropy of the scores
    normalised to sum 1, divided by log E; margin = best minus second-best score.
    Returns (ids [T,k], weights [T,k], entropy [T], margin [T])."""
    ids, weights, entropy, margin = [], [], [], []
    n_experts = logits.shape[1]
    per = n_experts // n_group
    b = [0.0] * n_experts if bias is None else [float(x) for x in bias]
    for row in logits.double():
        z = [float(x) / temperature for x in row]
        if scoring == "softmax":
            m = max(z)
            e = [math.exp(x - m) for x in z]
            s = [x / sum(e) for x in e]
        else:
            s = [1 / (1 + math.exp(-x)) for x in z]
        choice = [s[e] + b[e] for e in range(n_experts)]
        group_score = []
        for g in range(n_group):
            best = sorted(choice[g * per:(g + 1) * per], reverse=True)[:2]
            group_score.append(sum(best))
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        eligible = [e for e in range(n_experts) if e // per in groups]
        top = sorted(eligible, key=lambda e: -choice[e])[:k]
        w = [s[e] for e in top]
        if norm:
            total = sum(w) + (1e-20 if scoring == "sigmoid" else 0.0)
            w = [x / total for x in w]
        ids.append(top)
        weights.append([x * scale for x in w])
        p = [x / sum(s) for x in s]
        entropy.append(-sum(x * math.log(x) for x in p if x > 0) / math.log(n_experts))
        two = sorted(s, reverse=True)[:2]
        margin.append(two[0] - two[1])
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
