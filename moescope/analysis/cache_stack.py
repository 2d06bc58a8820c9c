"""Every cache size in one pass: stack distances for the cache-sim policies.

LRU, LFU (global counts, least recent first among equals) and Belady's MIN with bypass, as
``runtime.cache_policy`` implements them, are stack algorithms (Mattson et al., 1970): after every lookup a
cache of size s holds a subset of what a cache of size s+1 holds, so all sizes share one ordered *stack*
whose top s experts are the size-s cache. A lookup whose expert sits at depth d (0 = top) hits in every
cache larger than d. Each policy ranks experts by a key ("badness": the one to drop first is the worst)
that changes only when the expert itself is looked up, and one update rule serves all three: a lookup
carries the worst expert seen so far down the stack from the top to the looked-up expert's old place
(the size-s cache drops the worst of its s experts plus, for MIN with bypass, the incoming one).

- LRU: badness = age (the expert looked up goes on top).
- LFU: badness = (fewest lookups, then least recent); the looked-up expert goes on top (it is always loaded).
- MIN with bypass: badness = when the expert is next needed (never: after the end, later lookups worse);
  the incoming expert takes part in the carry, so where it lands says at which sizes it was bypassed.

The pass walks the sequences step by step with all layers and policies as rows of one numpy array, so
Python runs once per lookup index, not once per lookup, size and policy. ``static`` is closed-form.
tests/test_cache_sim.py checks every size's hits and evictions against ``cache_policy.simulate``.
"""

from __future__ import annotations

import numpy as np

STACK_POLICIES = ("lru", "lfu", "belady")


def _next_use(seq: np.ndarray) -> np.ndarray:
    """Index of each lookup's next lookup of the same expert; ``n + i`` (after the end) for none."""
    n = len(seq)
    order = np.argsort(seq, kind="stable")
    nxt = n + np.arange(n)
    same = seq[order[1:]] == seq[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def _lookup_number(seq: np.ndarray) -> np.ndarray:
    """How many times each lookup's expert has been looked up, this lookup included."""
    n = len(seq)
    order = np.argsort(seq, kind="stable")
    starts = np.r_[0, np.flatnonzero(seq[order[1:]] != seq[order[:-1]]) + 1]
    occ = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
    out = np.empty(n, np.int64)
    out[order] = occ + 1
    return out


def _badness(policy: str, seq: np.ndarray) -> np.ndarray:
    """The looked-up expert's badness right after each lookup (higher = dropped first)."""
    n = len(seq)
    i = np.arange(n, dtype=np.int64)
    if policy == "lru":
        return n - i
    if policy == "lfu":
        return (n + 1 - _lookup_number(seq)) * (n + 1) + (n - i)
    return _next_use(seq)


def depths(n_experts: int, seqs: list[np.ndarray]) -> dict[str, list[tuple[np.ndarray, np.ndarray | None]]]:
    """Per policy, per sequence: (depth of each lookup's expert before it, -1 when first seen; for MIN, the
    depth it lands at after it: sizes up to that depth bypassed it)."""
    e, n_seq = n_experts, len(seqs)
    n_rows = len(STACK_POLICIES) * n_seq
    length = max((len(s) for s in seqs), default=0)
    dtype = np.int32 if (length + 1) * e < np.iinfo(np.int32).max else np.int64
    big = np.iinfo(dtype).max  # an empty slot, and the looked-up expert's old slot while it moves
    # rows: policy-major (MIN last); a shorter sequence is padded with lookups of expert 0 (not counted)
    ids = np.zeros((n_rows, length), np.int64)
    keys = np.empty((n_rows, length), np.int64)
    for p, policy in enumerate(STACK_POLICIES):
        for j, seq in enumerate(seqs):
            r = p * n_seq + j
            ids[r, :len(seq)] = seq
            bad = np.empty(length, np.int64)
            bad[:len(seq)] = _badness(policy, seq)
            bad[len(seq):] = bad[:len(seq)].max(initial=0) + 1 + np.arange(length - len(seq))
            keys[r, np.argsort(bad)] = np.arange(length)  # ranks: the order is all that counts
    keys = (keys * e + ids).astype(dtype)  # unique per expert (its id in the low digits): a key finds its slot
    n_top = (len(STACK_POLICIES) - 1) * n_seq  # lru and lfu rows: the looked-up expert goes on top
    keys_t = keys.T.copy()
    cur_idx = (np.arange(n_rows, dtype=np.int64)[:, None] * e + ids).T.astype(np.intp)
    del keys, ids
    stack = np.full((n_rows, e + 1), big, dtype)  # column 0: the carry's start; 1..e: the stack
    stack[:n_top, 0] = -1  # nothing starts the carry (on top); MIN rows: the incoming expert, set per lookup
    body, flat = stack[:, 1:], stack.reshape(-1)
    slot_base = np.arange(n_rows) * (e + 1) + 1
    cur = np.full(n_rows * e, big, dtype)  # each expert's key in the stack
    depth_t = np.empty((length, n_rows), np.int16 if e < 2 ** 15 else np.int64)
    land_t = np.empty((length, n_seq), depth_t.dtype)
    # the carry is a running maximum along each row: torch's cummax is ~4x numpy's maximum.accumulate here
    import torch  # start-up: torch, only when depths() runs

    carry = np.empty_like(stack)
    cummax_in = torch.from_numpy(stack)
    cummax_out = (torch.from_numpy(carry), torch.empty(stack.shape, dtype=torch.long))
    for t in range(length):
        k, ci = keys_t[t], cur_idx[t]
        d = (body == cur[ci][:, None]).argmax(axis=1)  # a new expert's big matches the first empty slot
        depth_t[t] = d
        flat[slot_base + d] = big
        stack[n_top:, 0] = k[n_top:]
        torch.cummax(cummax_in, 1, out=cummax_out)
        np.minimum(carry[:, :-1], body, out=body)  # slot j keeps the better of itself and the carry
        body[:n_top, 0] = k[:n_top]
        land_t[t] = (body[n_top:] == k[n_top:, None]).argmax(axis=1)
        cur[ci] = k
    out: dict[str, list[tuple[np.ndarray, np.ndarray | None]]] = {}
    for p, policy in enumerate(STACK_POLICIES):
        out[policy] = []
        for j, seq in enumerate(seqs):
            d = depth_t[:len(seq), p * n_seq + j].astype(np.int64)
            d[_first_seen(seq)] = -1
            out[policy].append((d, land_t[:len(seq), j].astype(np.int64) if policy == "belady" else None))
    return out


def _first_seen(seq: np.ndarray) -> np.ndarray:
    seen = np.zeros(len(seq), bool)
    seen[np.unique(seq, return_index=True)[1]] = True
    return seen


def sweep(n_experts: int, seqs: list[np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """Per policy (lru, lfu, belady, static): ``hits`` and ``evictions`` at sizes 1..E (index s-1), summed over
    the sequences (one cache per sequence), equal to ``cache_policy.simulate`` at each size."""
    e = n_experts
    sizes = np.arange(1, e + 1)
    lookups = sum(len(s) for s in seqs)
    filled = sum(np.minimum(sizes, len(np.unique(s))) for s in seqs) if seqs else np.zeros(e, np.int64)
    out = {}
    for policy, per_seq in depths(e, seqs).items():
        hist = np.zeros(e + 1, np.int64)
        bypass = np.zeros(e + 1, np.int64)
        for d, land in per_seq:
            hist += np.bincount(d[d >= 0], minlength=e + 1)[:e + 1]
            if land is not None:
                bypass += np.bincount(land, minlength=e + 1)[:e + 1]
        hits = np.cumsum(hist)[:e]  # hit at size s iff depth < s
        bypassed = (bypass.sum() - np.cumsum(bypass))[:e]  # bypassed at size s iff landing depth >= s
        if policy != "belady":
            bypassed = np.zeros(e, np.int64)
        out[policy] = {"hits": hits, "evictions": lookups - hits - bypassed - filled}
    out["static"] = _static(e, seqs)
    return out


def _static(n_experts: int, seqs: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Pinning the s most used experts (ties: lower id): each pinned expert misses once, then always hits."""
    hits = np.zeros(n_experts, np.int64)
    for seq in seqs:
        counts = np.bincount(seq, minlength=n_experts)
        order = np.lexsort((np.arange(n_experts), -counts))
        gain = np.maximum(counts[order] - 1, 0)  # an unused expert is never pinned: gains nothing
        hits += np.cumsum(gain)
    return {"hits": hits, "evictions": np.zeros(n_experts, np.int64)}
