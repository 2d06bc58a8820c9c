"""Replacement policies for a cache of experts, shared by the runtime's ``ExpertCache`` and ``cache-sim``.

One lookup = one expert needed by one forward of one layer (not one per token). All policies start cold
and load on demand; the rules:

- ``lru``: on a miss with the cache full, evict the least recently used expert.
- ``lfu``: evict the expert with the fewest lookups so far (counted over all lookups, resident or not),
  ties broken by least recent use.
- ``static``: a pinned set (the most used experts of a profile) stays resident once loaded; any other
  expert is streamed through a scratch buffer on every use (a miss that evicts nothing).
- ``belady`` (offline only, needs the future): Belady's MIN with bypass: on a miss with the cache full,
  drop whichever of the residents *or the incoming expert* is used again farthest in the future. This is the
  optimal hit rate any policy can reach, including static/bypass ones.
- ``none``: everything resident (the all-resident model: every lookup hits).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Iterable, Sequence

POLICIES = ("lru", "lfu", "static", "none")
SIM_POLICIES = ("lru", "lfu", "static", "belady")


@dataclass(frozen=True)
class Access:
    """What one lookup did: ``hit``; on a miss whether the expert was ``inserted`` and whom it ``evicted``."""

    hit: bool
    inserted: bool
    evicted: int | None


class Policy:
    """Tracks which experts are resident; ``access`` decides what a lookup does."""

    name = "base"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.resident: set[int] = set()

    def access(self, expert: int) -> Access:
        raise NotImplementedError


class LRU(Policy):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: collections.OrderedDict[int, None] = collections.OrderedDict()

    def access(self, expert: int) -> Access:
        if expert in self._order:
            self._order.move_to_end(expert)
            return Access(True, False, None)
        evicted = None
        if len(self._order) >= self.capacity:
            evicted, _ = self._order.popitem(last=False)
            self.resident.discard(evicted)
        self._order[expert] = None
        self.resident.add(expert)
        return Access(False, True, evicted)


class LFU(Policy):
    name = "lfu"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._freq: collections.Counter[int] = collections.Counter()
        self._last: dict[int, int] = {}
        self._clock = 0

    def access(self, expert: int) -> Access:
        self._clock += 1
        self._freq[expert] += 1
        self._last[expert] = self._clock
        if expert in self.resident:
            return Access(True, False, None)
        evicted = None
        if len(self.resident) >= self.capacity:
            evicted = min(self.resident, key=lambda e: (self._freq[e], self._last[e]))
            self.resident.discard(evicted)
        self.resident.add(expert)
        return Access(False, True, evicted)


class Static(Policy):
    name = "static"

    def __init__(self, capacity: int, pinned: Iterable[int]) -> None:
        super().__init__(capacity)
        self.pinned = frozenset(list(pinned)[:capacity])

    def access(self, expert: int) -> Access:
        if expert in self.resident:
            return Access(True, False, None)
        if expert in self.pinned:
            self.resident.add(expert)
            return Access(False, True, None)
        return Access(False, False, None)  # streamed through scratch, not kept


class AllResident(Policy):
    name = "none"

    def access(self, expert: int) -> Access:
        return Access(True, False, None)


def make(name: str, capacity: int, *, pinned: Sequence[int] = ()) -> Policy:
    """An online policy for the runtime (``belady`` needs the future: see ``simulate``)."""
    if name == "lru":
        return LRU(capacity)
    if name == "lfu":
        return LFU(capacity)
    if name == "static":
        return Static(capacity, pinned)
    if name == "none":
        return AllResident(capacity)
    raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}")


def pinned_by_frequency(sequence: Iterable[int], capacity: int) -> list[int]:
    """The ``capacity`` most used experts of a profile (ties: lower id first)."""
    counts = collections.Counter(sequence)
    return sorted(counts, key=lambda e: (-counts[e], e))[:capacity]


@dataclass(frozen=True)
class SimResult:
    policy: str
    capacity: int
    lookups: int
    hits: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 1.0


def _belady(sequence: Sequence[int], capacity: int) -> tuple[int, int]:
    """(hits, evictions) of MIN with bypass."""
    never = len(sequence)
    next_use = [never] * len(sequence)
    last_seen: dict[int, int] = {}
    for i in range(len(sequence) - 1, -1, -1):
        next_use[i] = last_seen.get(sequence[i], never)
        last_seen[sequence[i]] = i
    resident: dict[int, int] = {}  # expert -> index of its next use
    hits = evictions = 0
    for i, e in enumerate(sequence):
        if e in resident:
            hits += 1
            resident[e] = next_use[i]
            continue
        if len(resident) < capacity:
            resident[e] = next_use[i]
            continue
        victim = max(resident, key=lambda r: resident[r])
        if resident[victim] > next_use[i]:  # else bypass: the incoming expert is needed last
            del resident[victim]
            resident[e] = next_use[i]
            evictions += 1
    return hits, evictions


def simulate(sequence: Sequence[int], policy: str, capacity: int, *, pinned: Sequence[int] | None = None
             ) -> SimResult:
    """Replay a lookup sequence of one layer. ``static`` pins the sequence's own most used experts unless
    ``pinned`` is given."""
    if policy == "belady":
        hits, evictions = _belady(sequence, capacity)
        return SimResult(policy, capacity, len(sequence), hits, evictions)
    if policy == "static" and pinned is None:
        pinned = pinned_by_frequency(sequence, capacity)
    pol = make(policy, capacity, pinned=pinned or ())
    hits = evictions = 0
    for e in sequence:
        a = pol.access(e)
        hits += a.hit
        evictions += a.evicted is not None
    return SimResult(policy, capacity, len(sequence), hits, evictions)
