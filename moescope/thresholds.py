"""The thresholds object: every bar moescope judges a model by, resolved per model.

One source for the alert rules (``moescope/alerts/rules.py`` generates their expressions, per-model selectors
and descriptions from it), the dashboards' colour steps (``moescope/dashboards/build.py``), ``moescope top``'s
tiles (``moescope/tui/levels.py``) and ``moescope diagnose``. A bar written anywhere else would drift.

Where a bar depends on the model it is derived, not guessed:

- activation: the expected ratio comes from the model's config (``expected_activation``, exported as
  ``moescope_activation_expected_ratio``); the band is on observed / expected, so Mixtral (~27%), DeepSeek-V3
  (~5.5%) and the demo (~45%) are judged by the same band;
- imbalance: judged on the *excess* load CV, what is left of the window's CV once the multinomial sampling noise
  of its slots is taken out (``noise_cv``, ``excess_cv``): a 256-expert layer with a thin window does not page;
- dead experts: judged only where uniform routing would have sent every expert ``dead_min_expected_slots``
  slots over the window (with fewer, an empty expert is chance).

What stays per model is the structural part of a model's healthy routing (``BY_MODEL``: each number has its
measurement beside it). Every other model gets the defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Mapping

# The noise bound: N * CV^2 of N slots routed uniformly over E experts is Pearson's chi-square statistic,
# chi2(E - 1): mean E - 1, standard deviation sqrt(2 (E - 1)). The bound is its mean plus NOISE_Z deviations
# (uniform routing exceeds it about once in a thousand windows).
NOISE_Z = 3.0
# Views colour a value "warn" from this fraction of the way to its bar (dashboards' yellow, top's warn).
WARN_FRACTION = 2 / 3


def noise_cv(n_experts: int, slots: float, z: float = NOISE_Z) -> float:
    """The load CV that sampling noise alone stays under (``z`` deviations) when ``slots`` slots are routed
    uniformly over ``n_experts`` experts: ``sqrt((E - 1 + z * sqrt(2 (E - 1))) / N)``. ``inf`` without slots."""
    if n_experts < 2:
        return 0.0
    if slots <= 0:
        return math.inf
    e1 = n_experts - 1
    return math.sqrt((e1 + z * math.sqrt(2 * e1)) / slots)


def excess_cv(cv: float, n_experts: int, slots: float, z: float = NOISE_Z) -> float:
    """The load CV beyond sampling noise, ``sqrt(max(0, cv^2 - noise_cv^2))``: 0 when noise explains it all.
    (E[CV^2] = CV_structural^2 + (E - 1 - CV_structural^2) / N, so this slightly under-states the structure.)"""
    noise = noise_cv(n_experts, slots, z)
    if math.isinf(noise):
        return 0.0
    return math.sqrt(max(0.0, cv * cv - noise * noise))


def expected_activation(dense_params: int, expert_params: int, n_moe_layers: int, top_k: int,
                        total_params: int) -> float:
    """Parameters a token touches / total parameters when every layer computes its top-k: the model config's
    own activation ratio (DeepSeek-V3: 37B / 671B)."""
    return (dense_params + n_moe_layers * top_k * expert_params) / total_params


@dataclass(frozen=True)
class ModelThresholds:
    """The bars one model is judged by. Rates and shares are per window (the exporter's, 60 s by default)."""

    model: str | None = None  # None: the defaults, for every model without its own entry
    # routing
    load_cv: float = 0.15  # excess load CV (beyond sampling noise); seeds: healthy trained routers < 0.10
    collapse_top_share: float = 0.75  # share of the routed tokens choosing the busiest expert (k/E balanced)
    dead_min_expected_slots: float = 20.0  # a zero-slot expert is dead only where uniform routing sends this many
    # Imbalance is judged only where the window holds this many slots per expert (0: always). The noise bound
    # takes slots as independent draws; a request's tokens route alike, so a window of one or two requests
    # is a sample of requests, not of slots (see BY_MODEL).
    imbalance_min_slots_per_expert: float = 0.0
    activation_band: tuple[float, float] = (0.9, 1.1)  # observed / expected activation ratio
    flip_ratio: float = 0.05  # a deterministic router flips nothing; the seeds' jitter fault flips ~12%
    drift_jsd_bits: float = 0.1
    drop_ratio: float = 0.01  # dropped slots per routed token
    # expert cache
    cache_hit_rate: float = 0.85  # a floor
    fetch_p99_s: float = 0.05  # p99 time to make an expert resident
    # expert parallelism
    all_to_all_p99_s: float = 0.002  # seeds: healthy < 1 ms; raise on CPU deployments
    slow_rank_share: float = 0.5  # one peer's share of all the time ranks wait on peers ...
    slow_rank_wait_s: float = 0.005  # ... and how long a rank waits on it per dispatch exchange
    # memory
    memory_capacity_bytes: int = 24 * 2**30
    memory_horizon_s: int = 4 * 3600
    # The trend's window; a process without samples a window ago is too young to judge (start-up growth).
    memory_window_s: int = 1800

    def noise_cv(self, n_experts: int, slots: float) -> float:
        return noise_cv(n_experts, slots)

    def excess_cv(self, cv: float, n_experts: int, slots: float) -> float:
        return excess_cv(cv, n_experts, slots)

    def load_cv_bar(self, n_experts: int, slots: float) -> float:
        """The raw load CV that means imbalance for a window of ``slots`` slots: ``sqrt(load_cv^2 + noise^2)``
        (a raw CV above it has an excess CV above ``load_cv``). ``inf`` without slots."""
        return math.hypot(self.load_cv, noise_cv(n_experts, slots))

    def judges_imbalance(self, n_experts: int, slots: float) -> bool:
        """Whether a window of ``slots`` slots holds enough per expert to judge imbalance at all."""
        return slots > 0 and slots / max(1, n_experts) >= self.imbalance_min_slots_per_expert

    def imbalanced(self, cv: float, n_experts: int, slots: float) -> bool:
        return self.judges_imbalance(n_experts, slots) and excess_cv(cv, n_experts, slots) > self.load_cv

    def judges_dead(self, n_experts: int, slots: float) -> bool:
        """Whether ``slots`` slots over the window are enough to call a zero-slot expert dead."""
        return slots > 0 and slots / max(1, n_experts) >= self.dead_min_expected_slots

    def activation_in_band(self, observed: float, expected: float) -> bool:
        lo, hi = self.activation_band
        return lo <= observed / expected <= hi


# Per-model bars: only what a model's healthy routing needs beyond the defaults, measured.
BY_MODEL: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    # 8 experts serving 4 domains in a skewed mix: healthy CV over a minute 0.07-0.15 (noise ~0.03 at ~7k
    # slots); nearly every expert is needed every forward, so even 7 of 8 resident hits ~0.87; healthy
    # traffic sits ~0.002 bits from its baseline, a 70/30 numbers/code mix 0.033-0.055.
    "tiny-demo": MappingProxyType({"load_cv": 0.25, "cache_hit_rate": 0.6, "drift_jsd_bits": 0.02}),
    # Seeded init balanced on calibration traffic (`--weights auto`): the untrained network routes mostly by
    # byte. Measured on the served mix (24 requests, 20.6k slots a layer): raw load CV 0.33-0.40 per layer
    # (sampling noise 0.11: a structural CV of ~0.31-0.38), the imbalance fault 0.94-1.34. And ~5 of its 14,848
    # (layer, expert) pairs get under 1% of the fair share: a zero there is evidence of death only where even 1%
    # would have brought ~5 slots (P(0) < 1%), i.e. 500 slots per expert in the window.
    # Thin traffic (the detection matrix's ~0.15 requests/s, alone on 2 cores; max over the 58 layers of the
    # excess CV): healthy 0.84-0.86 at 2.5-7.5 slots per expert (one to three requests in the window: a request's
    # tokens route alike), 0.57 at 17, 0.50 at 21; the imbalance fault 0.94-1.31 at 17-21 (every layer over
    # 0.9). Hence the bar 0.7 (healthy at 20k slots: structural 0.31-0.38; the fault 0.93-1.33), judged from 16
    # slots per expert (4,096 slots, ~500 tokens in the window).
    "deepseek-v3-shape": MappingProxyType({"load_cv": 0.7, "dead_min_expected_slots": 500.0,
                                           "imbalance_min_slots_per_expert": 16.0}),
})


@dataclass(frozen=True)
class Thresholds:
    """Defaults plus per-model overrides; ``for_model(name)`` resolves one model's bars.

    ``for_scale`` shrinks every alert ``for`` (end-to-end tests: 10m -> 20s at 1/30, keeping production's order).
    """

    default: ModelThresholds = ModelThresholds()
    by_model: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: BY_MODEL)
    for_scale: float | None = None

    def __post_init__(self) -> None:
        known = {f.name for f in fields(ModelThresholds)} - {"model"}
        for model, bars in self.by_model.items():
            unknown = set(bars) - known
            if unknown:
                raise ValueError(f"thresholds for {model}: unknown bar(s) {', '.join(sorted(unknown))}")

    def for_model(self, model: str | None) -> ModelThresholds:
        return replace(self.default, model=model, **dict(self.by_model.get(model or "", {})))

    def overrides(self, name: str) -> dict[str, Any]:
        """{model: value} for the models whose bar ``name`` differs from the default (rules and dashboards
        write these as per-model selectors; every other model gets the default)."""
        base = getattr(self.default, name)
        return {m: v[name] for m, v in sorted(self.by_model.items()) if name in v and v[name] != base}


DEFAULT = Thresholds()


def for_model(model: str | None) -> ModelThresholds:
    """The default thresholds object's bars for ``model``."""
    return DEFAULT.for_model(model)
