"""Counting stored routing, vectorised: one ``np.bincount`` per table whatever the model's shape.

Every table is a count of slots over (group, layer, expert), where a group is whatever a routed row belongs
to (its request's domain or tenant, its phase, its half of the window, its engine step). Rows are the routed
positions of the stored requests ([n, L, k] expert ids each); the sentinel id E (a dropped slot) is counted
into a spare column and cut off, so dropped slots never count. Rows are taken in chunks, so memory stays
bounded by the chunk whatever the store holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Iterable, Iterator

import numpy as np

CHUNK_ROWS = 8192


@dataclass(frozen=True)
class Chunk:
    ids: np.ndarray  # [T, L, k] int64 expert ids (E = dropped)
    groups: dict[str, np.ndarray]  # name -> [T] int64 group index of each row


def chunks(routing: Iterable[np.ndarray], labels: dict[str, Iterable[np.ndarray]],
           rows: int = CHUNK_ROWS) -> Iterator[Chunk]:
    """Concatenate per-request arrays into chunks of about ``rows`` rows. ``labels``: name -> per request an
    [n] array of group indices (aligned with ``routing``)."""
    names = list(labels)
    buf_ids: list[np.ndarray] = []
    buf: dict[str, list[np.ndarray]] = {n: [] for n in names}
    n_buf = 0
    for ids, *groups in zip(routing, *(labels[n] for n in names)):
        buf_ids.append(ids)
        for n, g in zip(names, groups):
            buf[n].append(g)
        n_buf += len(ids)
        if n_buf >= rows:
            yield Chunk(np.concatenate(buf_ids).astype(np.int64), {n: np.concatenate(buf[n]) for n in names})
            buf_ids, buf, n_buf = [], {n: [] for n in names}, 0
    if buf_ids:
        yield Chunk(np.concatenate(buf_ids).astype(np.int64), {n: np.concatenate(buf[n]) for n in names})


def count(ids: np.ndarray, n_experts: int, group: np.ndarray | None = None, n_groups: int = 1) -> np.ndarray:
    """[G, L, E] slots per (group, layer, expert) of rows ``ids`` [T, L, k] (``group``: [T] indices)."""
    t, n_layers, _ = ids.shape
    width = n_experts + 1  # the sentinel's column, cut off below
    g = np.zeros(t, np.int64) if group is None else group.astype(np.int64)
    code = (g[:, None, None] * n_layers + np.arange(n_layers)[None, :, None]) * width + ids
    out = np.bincount(code.ravel(), minlength=n_groups * n_layers * width)
    return out.reshape(n_groups, n_layers, width)[..., :n_experts]


def pairs(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """[L, E, E] tokens whose top-k chose both experts (symmetric, zero diagonal; dropped slots excluded)."""
    t, n_layers, k = ids.shape
    out = np.zeros(n_layers * n_experts * n_experts, np.int64)
    layer = np.arange(n_layers)[None, :]
    for a, b in combinations(range(k), 2):
        ea, eb = ids[:, :, a], ids[:, :, b]
        ok = (ea < n_experts) & (eb < n_experts)
        lo, hi = np.minimum(ea, eb), np.maximum(ea, eb)
        code = (np.broadcast_to(layer, ea.shape) * n_experts + lo) * n_experts + hi
        out += np.bincount(code[ok], minlength=out.size)
    m = out.reshape(n_layers, n_experts, n_experts)
    return m + m.transpose(0, 2, 1)
