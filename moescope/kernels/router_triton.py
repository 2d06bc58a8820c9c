"""Fused router kernel (Triton): logits -> temperature softmax -> top-k -> renormalised weights, with the
per-expert slot histogram, entropy and margin sums and the non-finite logit count accumulated into device
counters in the same pass. One program handles ``BLOCK_T`` tokens; experts are padded to a power of two.

Semantics match ``router.route(..., canonical_ties=True)`` exactly: a row holding a NaN or +Inf logit, or only
-Inf, has an all-NaN softmax (as ``torch.softmax`` gives); NaN ranks above every probability; ties go to
the lower expert id. The counters are static device buffers (``RouterCounters``): a captured CUDA graph
replays the kernel and the counts keep accumulating, read by the collector between replays.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` (Triton's interpreter), which is how CI checks it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:  # triton is optional: the torch path is the reference and the fallback
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None


def available() -> bool:
    return triton is not None


@dataclass
class RouterCounters:
    """Static device accumulators updated by the kernel (and safe inside a CUDA graph)."""

    slots: torch.Tensor  # [E] int32 slots per expert
    sums: torch.Tensor  # [3] float32: entropy sum, margin sum, non-finite logit count

    @classmethod
    def zeros(cls, n_experts: int, device) -> "RouterCounters":
        return cls(torch.zeros(n_experts, dtype=torch.int32, device=device),
                   torch.zeros(3, dtype=torch.float32, device=device))


if triton is not None:

    @triton.jit
    def _router_kernel(logits_ptr, ids_ptr, w_ptr, ent_ptr, margin_ptr, slots_ptr, sums_ptr,
                       T, E, inv_temp, inv_log_e,
                       K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        rmask = rows < T
        cmask = cols < E
        m2 = rmask[:, None] & cmask[None, :]
        x = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        nan = x != x
        pinf = x == float("inf")
        ninf = x == float("-inf")
        bad = (nan | pinf | ninf) & m2
        n_bad = tl.sum(tl.sum(bad.to(tl.float32), axis=1), axis=0)
        # torch.softmax gives an all-NaN row for any NaN or +Inf logit, or when every logit is -Inf
        row_nan = (tl.sum((nan | pinf).to(tl.int32) * m2.to(tl.int32), axis=1) > 0) | \
            (tl.sum((ninf & m2).to(tl.int32), axis=1) == E)
        xs = tl.where(m2 & ~ninf & ~nan & ~pinf, x * inv_temp, float("-inf"))
        mx = tl.max(xs, axis=1)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        e = tl.where(m2 & ~ninf & ~nan & ~pinf, tl.exp(xs - mx[:, None]), 0.0)
        denom = tl.sum(e, axis=1)
        denom = tl.where(denom > 0, denom, 1.0)
        p = e / denom[:, None]
        p = tl.where(row_nan[:, None], float("nan"), p)
        # entropy normalised by log(E); 0 * log 0 = 0, NaN stays NaN
        plogp = tl.where(p == 0.0, 0.0, p * tl.log(tl.where(p > 0, p, 1.0)))
        plogp = tl.where(p != p, float("nan"), plogp)
        plogp = tl.where(m2, plogp, 0.0)
        ent = -tl.sum(plogp, axis=1) * inv_log_e
        key = tl.where(p != p, 2.0, p)  # NaN above every probability
        key = tl.where(m2, key, -1.0)  # padding never wins
        total = tl.zeros((BLOCK_T,), dtype=tl.float32)
        first = tl.zeros((BLOCK_T,), dtype=tl.float32)
        second = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for j in tl.static_range(K):
            best = tl.max(key, axis=1)
            cand = tl.where(key == best[:, None], cols[None, :], BLOCK_E)
            idx = tl.min(cand, axis=1)
            hit = cols[None, :] == idx[:, None]
            pj = tl.sum(tl.where(hit, p, 0.0), axis=1)
            pj = tl.where(row_nan, float("nan"), pj)
            tl.store(ids_ptr + rows * K + j, idx.to(tl.int64), mask=rmask)
            tl.store(w_ptr + rows * K + j, pj, mask=rmask)
            tl.atomic_add(slots_ptr + idx, tl.full((BLOCK_T,), 1, tl.int32), mask=rmask)
            total += pj
            if j == 0:
                first = pj
            if j == 1:
                second = pj
            key = tl.where(hit, -1.0, key)
        if K == 1:  # the margin still needs the runner-up
            best = tl.max(key, axis=1)
            second = tl.where(row_nan, float("nan"), tl.where(best == 2.0, float("nan"), tl.maximum(best, 0.0)))
        for j in tl.static_range(K):
            wj = tl.load(w_ptr + rows * K + j, mask=rmask, other=0.0)
            tl.store(w_ptr + rows * K + j, wj / total, mask=rmask)
        margin = first - second
        tl.store(ent_ptr + rows, ent, mask=rmask)
        tl.store(margin_ptr + rows, margin, mask=rmask)
        tl.atomic_add(sums_ptr + 0, tl.sum(tl.where(rmask, ent, 0.0), axis=0))
        tl.atomic_add(sums_ptr + 1, tl.sum(tl.where(rmask, margin, 0.0), axis=0))
        tl.atomic_add(sums_ptr + 2, n_bad)


def route_fused(logits: torch.Tensor, top_k: int, *, temperature: float = 1.0,
                counters: RouterCounters | None = None, block_t: int = 32):
    """(ids [T, k] int64, weights [T, k] float32, entropy [T], margin [T], non-finite count []) in one pass;
    ``counters`` (if given) accumulate slots per expert, entropy/margin sums and non-finite logits."""
    if triton is None:
        raise RuntimeError("triton is not installed (pip install triton)")
    logits = logits.float().contiguous()
    n_tokens, n_experts = logits.shape
    dev = logits.device
    ids = torch.empty((n_tokens, top_k), dtype=torch.int64, device=dev)
    w = torch.empty((n_tokens, top_k), dtype=torch.float32, device=dev)
    ent = torch.empty(n_tokens, dtype=torch.float32, device=dev)
    margin = torch.empty(n_tokens, dtype=torch.float32, device=dev)
    counters = counters or RouterCounters.zeros(n_experts, dev)
    before = counters.sums[2].clone()
    if n_tokens:
        grid = (triton.cdiv(n_tokens, block_t),)
        _router_kernel[grid](logits, ids, w, ent, margin, counters.slots, counters.sums, n_tokens, n_experts,
                             1.0 / temperature, 1.0 / math.log(n_experts) if n_experts > 1 else 0.0,
                             K=top_k, BLOCK_T=block_t, BLOCK_E=triton.next_power_of_2(n_experts))
    nonfinite = (counters.sums[2] - before).round().to(torch.int64)
    return ids, w, ent, margin, nonfinite
