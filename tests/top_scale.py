"""A deepseek-v3-shaped exporter with known routing, for `moescope top`'s tests at scale: the real
``MetricsObserver`` and ``Exporter``, fed the routing statistics a 58-layer x 256-expert top-8 model hands it
(``on_stats``, the hook the CUDA-graph decode step uses), with three faults placed where the test knows them:
a collapsed layer, a layer with dead experts, an imbalanced layer."""

from __future__ import annotations

import numpy as np

from moescope.capture.routing_probe import LayerStats, StepStats
from moescope.metrics.exporter import Exporter
from moescope.metrics.state import MetricsObserver, ModelInfo

E, K = 256, 8
LAYERS = tuple(range(3, 61))
COLLAPSED, HOT_EXPERT = 17, 5
DEAD_LAYER, DEAD = 30, (100, 101, 102, 103)
SKEWED = 45  # experts 0-31 take 4x their share


def tokens_to_judge(model: str = "deepseek-v3-shape") -> int:
    """Tokens per layer after which the thresholds object judges a zero-slot expert dead (with a margin)."""
    from moescope.thresholds import for_model

    return int(1.25 * for_model(model).dead_min_expected_slots * E / K) + 1


def probabilities(layer: int) -> np.ndarray:
    p = np.ones(E)
    if layer == DEAD_LAYER:
        p[list(DEAD)] = 0.0
    if layer == SKEWED:
        p[:32] *= 4
    return p / p.sum()


class ScaleExporter:
    """``feed(tokens)`` routes that many tokens per layer (k slots each) into a live exporter on ``url``."""

    def __init__(self, *, seed: int = 0, budget: int = 64 * 256) -> None:
        info = ModelInfo("deepseek-v3-shape", E, K, LAYERS, dense_params=10**6, expert_params=10**4)
        self.state = MetricsObserver(info, expert_series_budget=budget)
        self.exporter = Exporter(self.state, port=0).start()
        self.url = f"127.0.0.1:{self.exporter.port}"
        self.rng = np.random.default_rng(seed)
        self.truth = {layer: np.zeros(E, dtype=np.int64) for layer in LAYERS}

    def feed(self, tokens: int) -> None:
        layers = []
        for layer in LAYERS:
            p = probabilities(layer)
            if layer == COLLAPSED:  # every token picks the hot expert (once: its K experts are distinct)
                rest = np.delete(p, HOT_EXPERT)
                slots = np.insert(self.rng.multinomial(tokens * (K - 1), rest / rest.sum()), HOT_EXPERT, tokens)
            else:
                slots = self.rng.multinomial(tokens * K, p)
            slots = slots.astype(np.int64)
            self.truth[layer] += slots
            layers.append(LayerStats(layer, tokens, slots, 0, 0, 0.9 * tokens, 0.1 * tokens))
        self.state.on_stats(StepStats(1, tuple(layers), E, K))

    def stop(self) -> None:
        self.exporter.stop()
