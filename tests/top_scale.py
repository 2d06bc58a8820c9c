"""A deepseek-v3-shaped exporter with known routing, for `moescope top`'s tests at scale: the real
``MetricsObserver`` and ``Exporter``, fed the routing statistics a 58-layer x 256-expert top-8 model hands it
(``on_stats``, the hook the CUDA-graph decode step uses) with its draws (forwards that are complete draws, as an
unmapped forward is), and four faults placed where the test knows them: a collapsed layer, a layer with dead
experts, an imbalanced layer (excess CV over the no-baseline bar) and a layer with one hot expert."""

from __future__ import annotations

import numpy as np

from moescope.capture.routing_probe import DrawCounts, LayerStats, StepStats
from moescope.metrics.exporter import Exporter
from moescope.metrics.state import MetricsObserver, ModelInfo

E, K = 256, 8
LAYERS = tuple(range(3, 61))
COLLAPSED, HOT_EXPERT = 17, 5
DEAD_LAYER, DEAD = 30, (100, 101, 102, 103)
SKEWED = 45  # experts 0-63 take 9x their share: a load CV of 1.15, over the no-baseline bar of 1
HOT_LAYER, HOT_ONE, HOT_BIAS = 52, 77, 6.0  # expert 77 takes 6x its share: 5.9x the fair share
DRAWS = 24  # draws (forwards) each feed is split into


def tokens_to_judge() -> int:
    """Tokens per layer after which the thresholds object judges a zero-slot expert dead without a baseline
    (its reference, ``dead_reference``, predicts ``dead_min_expected_slots`` after the small-sample bound of
    ``DRAWS`` draws' design effect, ``sampling.var_upper``; with a margin)."""
    from moescope import sampling
    from moescope.thresholds import DEFAULT

    bound = float(sampling.var_upper(DRAWS, DEFAULT.noise_z))
    return int(1.25 * bound * DEFAULT.dead_min_expected_slots / DEFAULT.dead_reference(E) / K) + 1


def probabilities(layer: int) -> np.ndarray:
    p = np.ones(E)
    if layer == DEAD_LAYER:
        p[list(DEAD)] = 0.0
    if layer == SKEWED:
        p[:64] *= 9
    if layer == HOT_LAYER:
        p[HOT_ONE] *= HOT_BIAS
    return p / p.sum()


class ScaleExporter:
    """``feed(tokens)`` routes that many tokens per layer (k slots each), as ``DRAWS`` complete draws, into a live
    exporter on ``url``."""

    def __init__(self, *, seed: int = 0, budget: int = 64 * 256) -> None:
        info = ModelInfo("deepseek-v3-shape", E, K, LAYERS, dense_params=10**6, expert_params=10**4)
        # a window longer than any test: what was fed stays judged however slowly a loaded machine runs the view
        # judged against the fair share (``--hot-reference fair``): every fault here is there from the first token,
        # which a reference learned from the first window would take as the model's own structure
        self.state = MetricsObserver(info, expert_series_budget=budget, window_s=3600.0, hot_reference="fair")
        self.exporter = Exporter(self.state, port=0).start()
        self.url = f"127.0.0.1:{self.exporter.port}"
        self.rng = np.random.default_rng(seed)
        self.truth = {layer: np.zeros(E, dtype=np.int64) for layer in LAYERS}

    def _draw(self, layer: int, tokens: int) -> np.ndarray:
        p = probabilities(layer)
        if layer == COLLAPSED:  # every token picks the hot expert (once: its K experts are distinct)
            rest = np.delete(p, HOT_EXPERT)
            return np.insert(self.rng.multinomial(tokens * (K - 1), rest / rest.sum()), HOT_EXPERT, tokens)
        return self.rng.multinomial(tokens * K, p)

    def feed(self, tokens: int, draws: int = DRAWS) -> None:
        per = [tokens // draws + (1 if i < tokens % draws else 0) for i in range(draws)]
        counts = np.stack([[self._draw(layer, n) for layer in LAYERS] for n in per]).astype(np.int64)  # [R, L, E]
        total = counts.sum(0)
        layers = []
        for j, layer in enumerate(LAYERS):
            self.truth[layer] += total[j]
            layers.append(LayerStats(layer, tokens, total[j], 0, 0, 0.9 * tokens, 0.1 * tokens))
        self.state.on_stats(StepStats(draws, tuple(layers), E, K, DrawCounts((None,) * draws, counts)))
        self.state.flush()  # no engine, no evaluator thread: evaluate now, as the evaluator would after a step

    def stop(self) -> None:
        self.exporter.stop()
