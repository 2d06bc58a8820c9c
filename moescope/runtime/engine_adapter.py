"""The reference runtime as a ``moescope.capture.engine_contract.EngineContract``: a ``MoETransformer`` and the
runtime's ``Engine`` that serves it (``moescope.runtime.engine``).

The model reports routing and layer times from its forward (``model.observer``); a runtime ``Engine`` serving it
reports steps, finished requests and idleness to the same observer (it reads ``model.observer`` at every event), so
attaching is setting ``model.observer`` and detaching is restoring what was there. The runtime takes every feature:
fault scenarios, router mitigations and router path, the expert cache, the canary.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

from moescope.capture.engine_contract import FEATURES, EngineContract, ModelInfo, Parts
from moescope.capture.observer import Observer
from moescope.capture.sources import Reading, Sources
from moescope.runtime import faults
from moescope.runtime.calibration import calibration_load
from moescope.runtime.canary import Canary
from moescope.runtime.expert_cache import attach_cache
from moescope.runtime.router import Mitigation

if TYPE_CHECKING:
    from moescope.config import Cache, Config
    from moescope.runtime.model import MoETransformer


class RuntimeEngine(EngineContract):
    """A ``MoETransformer`` under the engine contract."""

    features = FEATURES
    flushes_when_idle = True  # a runtime Engine calls on_idle when it runs out of work

    def __init__(self, model: "MoETransformer") -> None:
        self.model = model
        self._observer: Observer | None = None
        self._previous: Observer | None = None

    def model_info(self, name: str | None = None) -> ModelInfo:
        model = self.model
        cfg = model.cfg
        total = sum(p.numel() for p in model.parameters())
        expert = cfg.expert_params
        dtype_bytes = next(iter(model.parameters())).element_size()
        width = cfg.n_heads * cfg.head_dim  # the runtime's attention: every head has its own K and V
        return ModelInfo(name=name or cfg.name, n_experts=cfg.n_experts, top_k=cfg.top_k, moe_layers=cfg.moe_layers,
                         dense_params=total - len(cfg.moe_layers) * cfg.n_experts * expert, expert_params=expert,
                         device=str(model.device), dtype_bytes=dtype_bytes,
                         kv_bytes_per_token=2 * cfg.n_layers * width * dtype_bytes,
                         # q.k and p.v: a multiply-add each, per head dimension, per layer
                         attn_flops_per_context=4 * cfg.n_layers * width)

    def attach(self, observer: Observer) -> None:
        self._previous, self._observer = self.model.observer, observer
        self.model.observer = observer

    def detach(self) -> None:
        if self._observer is not None and self.model.observer is self._observer:  # unless replaced since
            self.model.observer = self._previous
        self._observer = self._previous = None

    def setup(self, config: "Config", stack: ExitStack) -> Parts:
        """Faults, router path and mitigations (real changes to what the model computes; a part the config leaves
        unset leaves the model as its caller set it up), then the expert cache and the canary."""
        model, parts = self.model, Parts()
        if config.scenarios:
            faults.apply(model, list(config.scenarios))
            if config.fault_after_s:
                stack.callback(faults.defer(model, config.fault_after_s).cancel)
        if config.router_impl is not None:
            notice = model.set_router_impl(config.router_impl)
            if notice:
                parts.notices.append(notice)
        mit = config.mitigations
        if mit is not None and (mit.load_bound is not None or mit.smoothing_margin is not None):
            for layer in model.moe_layers():
                layer.router.mitigation = Mitigation(load_bound=mit.load_bound, smoothing_margin=mit.smoothing_margin)
        if config.cache is not None:
            parts.cache = stack.enter_context(_expert_cache(model, config.cache))
        if config.canary is not None:
            parts.canary = Canary(model, interval_s=config.canary.interval_s, every_steps=config.canary.every_steps)
        return parts

    def register_sources(self, sources: Sources) -> None:
        sources.register(self)

    def read(self) -> Reading:
        """What the runtime reports of itself (a ``capture.sources.Source``, read once per evaluation): the placement
        its MoE layers dispatch by and its expert cache's capacity, as they are now (a placement or cache set up
        after ``instrument`` counts too)."""
        return Reading(placement=self.placement(), cache_capacity=self.cache_capacity())

    def placement(self):
        """The expert-parallel placement the model's MoE layers dispatch by (``moescope.parallel``), or None."""
        for layer in self.model.moe_layers():
            ep = getattr(layer, "parallel", None)
            if ep is not None:
                return getattr(ep, "placement", None)
        return None

    def cache_capacity(self) -> dict[int, float]:
        """{MoE layer: experts its expert cache holds resident / experts} where a cache is attached."""
        out = {}
        for layer in self.model.moe_layers():
            lc = getattr(layer.experts, "weight_source", None)
            capacity = getattr(getattr(lc, "policy", None), "capacity", None)
            if capacity is not None:
                out[layer.layer_index] = min(1.0, capacity / layer.experts.n_experts)
        return out


def _expert_cache(model, c: "Cache"):
    """The expert cache as a context manager; ``static`` pins the most used experts of a calibration pass
    over held-out traffic; a disk tier without a file gets a temporary one, removed at close."""
    @contextmanager
    def cm():
        pinned = None
        if c.policy == "static":
            pinned = {layer: sorted(range(len(n)), key=lambda e: (-n[e], e))
                      for layer, n in calibration_load(model, c.calibration_seed, 8).items()}
        with tempfile.TemporaryDirectory(prefix="moescope-experts-") as tmp:
            path = c.file or os.path.join(tmp, "experts.safetensors")
            cache = attach_cache(model, size=c.size if c.size is not None else model.cfg.n_experts, policy=c.policy,
                                 tier=c.tier, path=path if c.tier == "disk" else None, prefetch=c.prefetch,
                                 pinned=pinned, disk_delay_s=c.disk_delay_s)
            try:
                yield cache
            finally:
                cache.close()

    return cm()


__all__ = ["RuntimeEngine"]
