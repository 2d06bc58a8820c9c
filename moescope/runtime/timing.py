"""Router and expert time of each MoE layer per forward, without ever waiting on the device.

On CPU the work is synchronous, so host clock readings are the times. On CUDA the host runs ahead of the
device and a host clock measures only the launch; there the timer records CUDA events (three per MoE layer
per forward, from a pool) and ``poll()`` resolves those whose last event has completed (``Event.query()``,
never a synchronize): a layer's times arrive a forward or two later, in order. At most ``capacity`` layer
records wait; older ones are dropped (counted in ``LayerTimer.dropped``, not exported) rather than grow
without bound: only a device that stays over 1024 layer-forwards behind the host drops any.

Expert fetches and the all-to-all stay host-timed: a fetch is a host-blocking copy (the stall a token sees),
and the all-to-all runs on gloo over host tensors.
"""

from __future__ import annotations

import collections
import time

import torch


class LayerTimer:
    def __init__(self, device: torch.device | str = "cpu", capacity: int = 1024) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.capacity = capacity
        self.dropped = 0
        self._ready: list[tuple[int, float, float]] = []
        self._pending: collections.deque = collections.deque()  # (layer, e0, e1, e2) in record order
        self._pool: list = []

    def mark(self):
        """A point in the stream: a host clock reading (CPU) or a recorded event (CUDA)."""
        if not self.cuda:
            return time.perf_counter()
        ev = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def add(self, layer: int, start, routed, done) -> None:
        """One layer of one forward: router from ``start`` to ``routed``, experts from ``routed`` to ``done``."""
        if not self.cuda:
            self._ready.append((layer, routed - start, done - routed))
            return
        if len(self._pending) >= self.capacity:
            self._pool.extend(self._pending.popleft()[1:])
            self.dropped += 1
        self._pending.append((layer, start, routed, done))

    def poll(self) -> list[tuple[int, float, float]]:
        """(layer, router seconds, experts seconds) of every layer record complete by now, oldest first."""
        out, self._ready = self._ready, []
        pending = self._pending
        while pending and pending[0][3].query():
            layer, e0, e1, e2 = pending.popleft()
            out.append((layer, e0.elapsed_time(e1) / 1e3, e1.elapsed_time(e2) / 1e3))
            self._pool.extend((e0, e1, e2))
        return out
