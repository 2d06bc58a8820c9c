"""Expert cache: a fixed number of resident experts per MoE layer; the rest live in a backing tier (CPU
memory, or a safetensors file on disk read through mmap) and are loaded on demand, timed.

How it plugs in: ``attach_cache`` sets each MoE layer's ``Experts.weight_source`` to a ``LayerCache``.
``Experts.forward`` tells it which experts the forward needs (``begin``), then asks for each one's
weights (``get``) right before computing its slice, so a miss makes the expert resident before its slot is
computed, and the stall shows up in that step's latency. Results never change: loaded weights are
bit-identical copies (the disk tier stores float32, or the model's dtype, never a down-cast).

Prefetch (optional): when layer L begins a forward, one loader thread stages the experts layer L+1 used in
its previous forward (temporal locality) that are not resident. A miss takes a staged copy if one is ready;
it never waits for one in flight. Staged copies not used within two steps of the layer count as wasted.

Counters live on the cache (``stats()``); the capture layer exports them.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from moescope.errors import BadInput
from moescope.runtime import cache_policy
from moescope.runtime.experts import ExpertWeights, Experts

TIERS = ("memory", "disk")


class ExpertLoadError(BadInput):
    """A backing tier could not produce an expert's weights (missing or corrupt file, wrong shape)."""


@dataclass
class CacheStats:
    """Counters of one layer's cache since it was attached."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    prefetch_issued: int = 0
    prefetch_hits: int = 0
    prefetch_wasted: int = 0
    prefetch_dropped: int = 0
    bytes_loaded: int = 0
    load_seconds: list[float] = field(default_factory=list)  # one entry per miss served by a load

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 1.0


@dataclass(frozen=True)
class CacheDelta:
    """What one layer's cache did during one forward (sent to observers as ``on_cache``)."""

    lookups: int
    hits: int
    misses: int
    evictions: int
    prefetch_hits: int
    prefetch_wasted: int
    prefetch_dropped: int  # prefetches not queued: the prefetcher's bounded queue was full
    bytes_loaded: int
    load_seconds: tuple[float, ...]
    missed: tuple[int, ...] = ()  # experts that were not resident when this forward needed them


_DELTA_FIELDS = ("lookups", "hits", "misses", "evictions", "prefetch_hits", "prefetch_wasted", "prefetch_dropped",
                 "bytes_loaded")


# -- backing tiers -------------------------------------------------------------------------------------
class MemoryTier:
    """Experts kept in host memory; a load is a copy to the compute device."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up, self.down = gate_up.detach().cpu(), down.detach().cpu()

    def load(self, expert: int) -> ExpertWeights:
        return self.gate_up[expert].clone(), self.down[expert].clone()


def _tensor_name(layer: int, expert: int, part: str) -> str:
    return f"layers.{layer}.experts.{expert}.{part}"


def write_disk_tier(model: torch.nn.Module, path: str | Path) -> Path:
    """Write every MoE layer's experts, one tensor per expert and projection, to a safetensors file."""
    from safetensors.torch import save_file  # start-up: safetensors, only when write_disk_tier() runs

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for block in model.blocks:
        if block.is_moe:
            ex = block.ffn.experts
            for e in range(ex.n_experts):
                tensors[_tensor_name(block.index, e, "gate_up")] = ex.gate_up_proj[e].detach().cpu().contiguous()
                tensors[_tensor_name(block.index, e, "down")] = ex.down_proj[e].detach().cpu().contiguous()
    save_file(tensors, str(path))
    return path


class DiskTier:
    """Experts in a safetensors file, read through mmap (``safe_open``) on each load.

    ``drop_page_cache`` asks the kernel to forget the file's pages after each read (posix_fadvise
    DONTNEED), so every miss is a real read from the device, as when the weights do not fit the page cache.
    """

    def __init__(self, path: str | Path, layer: int, shapes: tuple[torch.Size, torch.Size], dtype: torch.dtype,
                 *, drop_page_cache: bool = True, delay_s: tuple[float, float] | None = None) -> None:
        self.path, self.layer, self.shapes, self.dtype = Path(path), layer, shapes, dtype
        self.delay_s = delay_s  # the switch-jitter fault: a slow device, every read waits this much longer
        self.drop_page_cache = drop_page_cache and hasattr(os, "posix_fadvise")
        self._local = threading.local()  # one mmap handle per thread (the prefetcher has its own)
        if not self.path.exists():
            raise ExpertLoadError(f"expert tier file {self.path} does not exist")

    def _handle(self):
        handle = getattr(self._local, "handle", None)
        if handle is None:
            from safetensors import safe_open  # start-up: safetensors, only when _handle() runs

            try:
                handle = safe_open(str(self.path), framework="pt")
            except Exception as exc:
                raise ExpertLoadError(f"expert tier file {self.path} is not readable safetensors: {exc}") from None
            self._local.handle = handle
        return handle

    def load(self, expert: int) -> ExpertWeights:
        if self.delay_s is not None:
            time.sleep(random.uniform(*self.delay_s))
        out = []
        for part, shape in zip(("gate_up", "down"), self.shapes):
            name = _tensor_name(self.layer, expert, part)
            try:
                t = self._handle().get_tensor(name)
            except ExpertLoadError:
                raise
            except Exception as exc:  # missing key, truncated file, ...
                raise ExpertLoadError(f"cannot load layer {self.layer} expert {expert} ({name}) from "
                                      f"{self.path}: {exc}") from None
            if t.shape != shape or t.dtype != self.dtype:
                raise ExpertLoadError(f"{self.path}: layer {self.layer} expert {expert} {part} has "
                                      f"{tuple(t.shape)} {t.dtype}, expected {tuple(shape)} {self.dtype}")
            # Copy out of the mapping: an aligned, private buffer (kernels may pick a different, not
            # bit-identical path for unaligned inputs), and the read really happens here, not later.
            out.append(t.clone())
        if self.drop_page_cache:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return out[0], out[1]


# -- prefetch ------------------------------------------------------------------------------------------
class Prefetcher:
    """One loader thread staging (layer, expert) weights; callers never block on it."""

    def __init__(self, max_staged: int = 64) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=max_staged)
        self._staged: dict[tuple[int, int], tuple[ExpertWeights, int]] = {}
        self._inflight: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.errors = 0
        self._thread = threading.Thread(target=self._loop, name="moescope-prefetch", daemon=True)
        self._thread.start()

    def request(self, cache: "LayerCache", expert: int, generation: int) -> bool:
        key = (cache.layer, expert)
        with self._lock:
            if key in self._staged or key in self._inflight:
                return False
            self._inflight.add(key)
        try:
            self._queue.put_nowait((cache, expert, generation))
            return True
        except queue.Full:
            with self._lock:
                self._inflight.discard(key)
            cache.stats.prefetch_dropped += 1
            return False

    def take(self, layer: int, expert: int) -> ExpertWeights | None:
        with self._lock:
            item = self._staged.pop((layer, expert), None)
        return item[0] if item else None

    def expire(self, layer: int, generation: int) -> int:
        """Drop this layer's staged copies older than ``generation``; returns how many were wasted."""
        with self._lock:
            old = [k for k, (_, g) in self._staged.items() if k[0] == layer and g < generation]
            for k in old:
                del self._staged[k]
        return len(old)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                cache, expert, generation = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            key = (cache.layer, expert)
            try:
                weights = cache.load(expert)
                with self._lock:
                    self._staged[key] = (weights, generation)
            except Exception:  # a failed prefetch is only a lost optimisation; the demand load reports it
                self.errors += 1
            finally:
                with self._lock:
                    self._inflight.discard(key)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


# -- the cache -----------------------------------------------------------------------------------------
class LayerCache:
    """Resident experts of one MoE layer (the ``weight_source`` of its ``Experts``)."""

    def __init__(self, layer: int, tier, policy: cache_policy.Policy, device: torch.device,
                 dtype: torch.dtype, expert_bytes: int) -> None:
        self.layer, self.tier, self.policy = layer, tier, policy
        self.device, self.dtype, self.expert_bytes = device, dtype, expert_bytes
        self.stats = CacheStats()
        self._resident: dict[int, ExpertWeights] = {}
        self.next: LayerCache | None = None  # the following MoE layer (prefetch target)
        self.prefetcher: Prefetcher | None = None
        self.prefetch_width = 0
        self.last_used: list[int] = []
        self._generation = 0
        self.observer = None  # callable returning the model's current observer (set by attach_cache)
        self._mark = (0,) * len(_DELTA_FIELDS) + (0,)
        self._missed: list[int] = []

    def load(self, expert: int) -> ExpertWeights:
        gate_up, down = self.tier.load(expert)
        return gate_up.to(self.device, self.dtype), down.to(self.device, self.dtype)

    def begin(self, counts: Sequence[int]) -> None:
        """A forward will use the experts with nonzero ``counts``: remember them, prefetch for the next layer."""
        self._generation += 1
        self.last_used = [e for e, n in enumerate(counts) if n]
        if self.prefetcher is not None:
            self.stats.prefetch_wasted += self.prefetcher.expire(self.layer, self._generation - 2)
            nxt = self.next
            if nxt is not None:
                todo = [e for e in nxt.last_used if e not in nxt.policy.resident][: self.prefetch_width]
                for e in todo:
                    nxt.stats.prefetch_issued += self.prefetcher.request(nxt, e, nxt._generation + 1)

    def end(self) -> None:
        """Report this forward's counter changes to the model's observer (one call per layer per forward)."""
        st = self.stats
        now = tuple(getattr(st, f) for f in _DELTA_FIELDS) + (len(st.load_seconds),)
        if now == self._mark or self.observer is None:
            return
        diff = [a - b for a, b in zip(now, self._mark)]
        delta = CacheDelta(*diff[:-1], load_seconds=tuple(st.load_seconds[self._mark[-1]:]),
                           missed=tuple(self._missed))
        self._missed.clear()
        self._mark = now
        on_cache = getattr(self.observer(), "on_cache", None)  # a RuntimeObserver's event (capture.observer)
        if on_cache is not None:
            on_cache(self.layer, delta)

    def get(self, expert: int) -> ExpertWeights:
        st = self.stats
        st.lookups += 1
        access = self.policy.access(expert)
        if access.hit:
            st.hits += 1
            return self._resident[expert]
        st.misses += 1
        self._missed.append(expert)
        weights = self.prefetcher.take(self.layer, expert) if self.prefetcher is not None else None
        if weights is not None:
            st.prefetch_hits += 1
        else:
            t0 = time.perf_counter()
            weights = self.load(expert)
            st.load_seconds.append(time.perf_counter() - t0)
            st.bytes_loaded += self.expert_bytes
        if access.evicted is not None:
            self._resident.pop(access.evicted, None)
            st.evictions += 1
        if access.inserted:
            self._resident[expert] = weights
        return weights

    def preload(self, n_experts: int) -> None:
        """Policy ``none``: make every expert resident up front (the all-resident model)."""
        for e in range(n_experts):
            self._resident[e] = self.load(e)

class ExpertCache:
    """The per-layer caches of a model; ``close()`` detaches them and stops the prefetch thread."""

    def __init__(self, layers: dict[int, LayerCache], experts: dict[int, Experts],
                 prefetcher: Prefetcher | None, policy: str, size: int, tier: str) -> None:
        self.layers, self._experts, self.prefetcher = layers, experts, prefetcher
        self.policy, self.size, self.tier = policy, size, tier

    def stats(self) -> dict[int, CacheStats]:
        return {layer: c.stats for layer, c in self.layers.items()}

    def close(self) -> None:
        for ex in self._experts.values():
            ex.weight_source = None
        if self.prefetcher is not None:
            self.prefetcher.close()


def attach_cache(model: torch.nn.Module, *, size: int, policy: str = "lru", tier: str = "memory",
                 path: str | Path | None = None, prefetch: int = 0,
                 pinned: dict[int, Sequence[int]] | None = None, drop_page_cache: bool = True,
                 disk_delay_s: tuple[float, float] | None = None) -> ExpertCache:
    """Put an expert cache in front of every MoE layer of ``model``.

    Args:
        size: resident experts per layer (1..E); policy ``none`` keeps all E.
        policy: lru, lfu, static or none (see cache_policy).
        tier: ``memory`` (host RAM) or ``disk`` (safetensors file at ``path``, written from the model if
            it does not exist yet).
        prefetch: experts per layer the loader thread stages ahead (0: no prefetch thread).
        pinned: for ``static``: layer -> experts to pin, most used first.
    """
    cfg = model.cfg
    if policy not in cache_policy.POLICIES:
        raise BadInput(f"unknown cache policy {policy!r}; choose one of {', '.join(cache_policy.POLICIES)}")
    if tier not in TIERS:
        raise BadInput(f"unknown cache tier {tier!r}; choose one of {', '.join(TIERS)}")
    if policy == "none":
        size = cfg.n_experts
    if not 1 <= size <= cfg.n_experts:
        raise BadInput(f"cache size must be between 1 and the number of experts ({cfg.n_experts}), got {size}")
    if prefetch < 0:
        raise BadInput(f"prefetch must be >= 0, got {prefetch}")
    if policy == "static" and not pinned:
        raise BadInput("cache policy static needs a profile of the most used experts (pinned)")
    if tier == "disk":
        if path is None:
            raise BadInput("the disk tier needs a file path")
        path = Path(path)
        if not path.exists():
            write_disk_tier(model, path)
    dtype = model.embed.weight.dtype
    layers, experts = {}, {}
    prefetcher = Prefetcher() if prefetch > 0 else None
    prev: LayerCache | None = None
    for block in model.blocks:
        if not block.is_moe:
            continue
        ex: Experts = block.ffn.experts
        shapes = (ex.gate_up_proj.shape[1:], ex.down_proj.shape[1:])
        backing = (MemoryTier(ex.gate_up_proj, ex.down_proj) if tier == "memory" else
                   DiskTier(path, block.index, shapes, dtype, drop_page_cache=drop_page_cache, delay_s=disk_delay_s))
        pol = cache_policy.make(policy, size, pinned=(pinned or {}).get(block.index, ()))
        expert_bytes = (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()) * ex.gate_up_proj.element_size()
        lc = LayerCache(block.index, backing, pol, model.device, dtype, expert_bytes)
        lc.prefetcher, lc.prefetch_width = prefetcher, prefetch
        lc.observer = lambda: model.observer
        if policy == "none":
            lc.preload(cfg.n_experts)
        if prev is not None:
            prev.next = lc
        prev = lc
        ex.weight_source = lc
        layers[block.index], experts[block.index] = lc, ex
    return ExpertCache(layers, experts, prefetcher, policy, size, tier)
