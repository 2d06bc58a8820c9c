"""Canary routing: at an interval the engine routes a fixed canary batch and compares each token's expert
set with the baseline routing of the same batch (its first). The flip ratio per layer (share of canary tokens
whose top-k set changed) is 0 for a deterministic router; noise or a precision fault make it rise.

Determinism is a property of one model state (issue [judge]): a router that changed once and routes
deterministically since (a new bias, a swapped adapter) flips the canary for one run: two runs in a
row that agree token for token in every layer become the new baseline, so the ratio returns to 0
(``changes`` counts them; the routing change itself is the drift and hot alerts' to judge). A nondeterministic
router never agrees with itself twice, so its flips stay. The canary forward is real engine work on the same
model, kept out of the serving metrics, traces and expert-cache state.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from moescope.capture.observer import NOOP
from moescope.runtime import tokenizer, traffic
from moescope.runtime.model import MoETransformer, Segment
from moescope.runtime.router import extend_prefix_key

# A changed routing becomes the new baseline when two canary runs in a row agree in every token of every layer. A
# router noisy enough to flip the bar's share of the batch against its baseline (5% of the canary tokens, in some
# layer) flips several of its tokens between any two runs too, so two that agree are one stable state. After a run
# that begins to flip, the next one runs at the next engine step (``due``), so a change is confirmed within a step
# (interval-timed canaries; lock-step ranks keep their steps) and its flips are exported for that long, never for
# MoERoutingFlips' `for`.


def default_prompts(n: int = 4, seed: int = 4242) -> list[str]:
    """A fixed batch: held-out prompts of every domain (deterministic)."""
    return [r.prompt for r in traffic.generate(traffic.TrafficConfig(seed=seed, domains={
        "code": 1, "prose": 1, "numbers": 1, "unicode": 1}), n)]


class Canary:
    def __init__(self, model: MoETransformer, *, prompts: list[str] | None = None, interval_s: float = 5.0,
                 every_steps: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """Due every ``interval_s`` seconds, or with ``every_steps`` every that many engine steps (the first step
        included): expert-parallel ranks make the same steps, and a canary forward is a collective, so they
        must all run it at the same step, which no per-rank clock can promise."""
        if every_steps is not None and every_steps <= 0:
            raise ValueError(f"every_steps must be positive, got {every_steps}")
        self.model, self.interval_s, self.clock = model, interval_s, clock
        self.every_steps, self._calls = every_steps, 0
        ids = self._ids = [tokenizer.encode(p) for p in (prompts or default_prompts())]
        self._tokens = torch.tensor([t for seq in ids for t in seq], dtype=torch.long)
        self._segments = [len(seq) for seq in ids]
        self.baseline: dict[int, torch.Tensor] | None = None
        self._previous: dict[int, torch.Tensor] | None = None  # the last run's expert sets
        self._confirm = False  # the last run began to flip: run again at the next step
        self._flipped = False  # the last run flipped
        self.changes = 0  # times a stable new routing became the baseline
        self._last = None

    @torch.inference_mode()
    def run(self) -> dict[int, float]:
        """Route the canary batch; returns the flip ratio per MoE layer against the baseline."""
        model = self.model
        observer, model.observer = model.observer, NOOP  # not serving traffic: no metrics, no traces
        # Nor the expert cache's state: the canary computes from the master weights (bit-identical), so its
        # lookups neither count nor reorder the serving cache.
        experts = [layer.experts for layer in model.moe_layers()]
        sources = [e.weight_source for e in experts]
        for e in experts:
            e.weight_source = None
        # Mitigations apply to the canary as to any traffic (its flip ratio measures routing as served, and
        # the smoothing table learns its prefixes like anyone's), but its batch is not serving load: load-aware
        # routing's estimate is left as it was.
        routers = [layer.router for layer in model.moe_layers()]
        for r in routers:
            r.update_load = False
        try:
            keys = None
            if model.smoothing:
                keys = torch.tensor([k for seq in self._ids for k in extend_prefix_key(0, seq)],
                                    dtype=torch.int64, device=model.device)
            out = model(self._tokens.to(model.device), [Segment(n) for n in self._segments], last_only=True,
                        route_keys=keys)
        finally:
            model.observer = observer
            for e, s in zip(experts, sources):
                e.weight_source = s
            for r in routers:
                r.update_load = True
        sets = {layer: d.ids.sort(-1).values for layer, d in out.decisions.items()}  # [T, k] expert sets
        if self.baseline is None:
            self.baseline = sets
        previous, self._previous = self._previous, sets
        # One host copy per canary run (every interval_s), not per step.
        flips = torch.stack([(sets[layer] != self.baseline[layer]).any(-1).float().mean() for layer in sets])
        same = previous is not None and previous.keys() == sets.keys() and all(
            torch.equal(previous[layer], sets[layer]) for layer in sets)
        if same and bool(flips.any()):
            self.baseline, self.changes = sets, self.changes + 1  # changed, then deterministic: a new state
            flips = torch.zeros_like(flips)
        flipped = bool(flips.any())
        # a new flip is confirmed at once (once: a noisy router keeps its interval, never a canary per step)
        self._confirm, self._flipped = flipped and not self._flipped, flipped
        return dict(zip(sets, flips.tolist()))

    def due(self) -> bool:
        """Called once per engine step."""
        if self.every_steps is not None:
            self._calls += 1
            return (self._calls - 1) % self.every_steps == 0
        now = self.clock()
        if self._confirm or self._last is None or now - self._last >= self.interval_s:
            self._last = now
            return True
        return False
