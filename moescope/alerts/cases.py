"""promtool cases beyond fires/healthy/boundary: what production shapes and thin windows must (not) page on.

The numbers are measured or derived, never tuned to pass: DeepSeek-V3's shape (256 experts, top-8) sends a
60 s window ~14,000 slots per layer at the demo's 4 requests/s; its healthy layers show a raw load CV of
0.33-0.40 and the imbalance fault 0.94-1.34 (docs/metrics.md, "Thresholds"); uniform routing of N slots over
E experts has a CV near sqrt((E - 1) / N) and leaves ~E exp(-N / E) experts empty by chance.
"""

from __future__ import annotations

import math

from moescope.alerts.rules import Case
from moescope.thresholds import Thresholds, noise_cv

DS = "deepseek-v3-shape"


def _lab(model: str) -> str:
    return f'model="{model}",rank="0",layer="1"'


def _load(model: str, cv: float, noise: float, per_expert: float | None = None) -> dict:
    lab = _lab(model)
    out = {f"moescope_expert_load_cv_ratio{{{lab}}}": f"{cv:.6g}x20",
           f"moescope_expert_load_cv_noise_ratio{{{lab}}}": f"{noise:.6g}x20"}
    if per_expert is not None:
        out[f"moescope_window_slots_per_expert{{{lab}}}"] = f"{per_expert:.6g}x20"
    return out


def imbalance(t: Thresholds) -> tuple[Case, ...]:
    low = noise_cv(256, 1000)
    ds_noise = noise_cv(256, 14000)
    skew = _load(DS, 1.1, noise_cv(256, 7900), 7900 / 256)
    ds_bar = t.for_model(DS).load_cv
    return (
        # 1,000 slots over 256 experts: uniform routing's CV is ~0.50 (the mean floor); a draw a little above it
        Case("uniform routing at low traffic", _load("m", 1.05 * math.sqrt(255 / 1000), low)),
        Case("a real skew at low traffic", _load("m", 0.9, low), {"model": "m", "rank": "0", "layer": "1"},
             "Layer 1 of m (rank 0) has a load CV of "
             f"{math.sqrt(0.81 - low * low):.2f} beyond sampling noise (this model's bar: {t.default.load_cv})."),
        Case("healthy deepseek-v3-shape (its worst layer)", _load(DS, 0.40, ds_noise, 14000 / 256)),
        # measured: a healthy layer's window holding two requests (raw CV 1.11 over 640 slots; excess 0.86)
        Case("healthy deepseek-v3-shape in a thin window (two requests)", _load(DS, 1.114, noise_cv(256, 640),
                                                                                 640 / 256)),
        # the same thin window, skewed far beyond the bar, is still not judged (too few slots per expert)
        Case("a skew on deepseek-v3-shape in a thin window is not judged", _load(DS, 2.0, noise_cv(256, 640),
                                                                                  640 / 256)),
        Case("a real skew on deepseek-v3-shape", skew, {"model": DS, "rank": "0", "layer": "1"},
             f"Layer 1 of {DS} (rank 0) has a load CV of {math.sqrt(1.21 - noise_cv(256, 7900) ** 2):.2f} beyond "
             f"sampling noise (this model's bar: {ds_bar})."),
        Case("tiny-demo keeps its own bar", _load("tiny-demo", 0.22, 0.03)),
    )


def dead(t: Thresholds) -> tuple[Case, ...]:
    def series(model, n_dead, per_expert):
        return {f"moescope_dead_experts{{{_lab(model)}}}": f"{n_dead}x20",
                f"moescope_window_slots_per_expert{{{_lab(model)}}}": f"{per_expert:.6g}x20"}

    return (
        # 1,000 slots over 256 experts: ~256 exp(-3.9) = 5 experts empty by chance
        Case("uniform routing at low traffic", series("m", 5, 1000 / 256)),
        # the demo's traffic: ~56 slots per expert a window, and a few structurally cold experts
        Case("healthy deepseek-v3-shape", series(DS, 2, 14000 / 256)),
    )


def activation(t: Thresholds) -> tuple[Case, ...]:
    def series(model, observed, expected):
        lab = f'model="{model}",rank="0"'
        return {f"moescope_activation_ratio{{{lab}}}": f"{observed}x20",
                f"moescope_activation_expected_ratio{{{lab}}}": f"{expected}x20"}

    lo, hi = t.for_model(DS).activation_band
    return (
        Case("healthy deepseek-v3-shape (7.7%)", series(DS, 0.0768, 0.0768)),
        Case("healthy DeepSeek-V3 (37B of 671B)", series("deepseek-v3", 0.0551, 0.0551)),
        Case("healthy Mixtral-shaped (13B of 47B)", series("mixtral-8x7b", 0.277, 0.277)),
        Case("a quarter of deepseek-v3-shape's slots dropped", series(DS, 0.06, 0.08),
             {"model": DS, "rank": "0"},
             f"{DS} (rank 0) touches 75% of the parameters its config says a token touches (band: {lo:.0%}-{hi:.0%})."),
    )


def _waits(per_rank: dict[tuple[int, int], str], dispatches: str = "0+60x20") -> dict:
    """rank, peer -> wait-seconds values; every rank dispatches once a second."""
    out = {f'moescope_all_to_all_peer_wait_seconds_total{{model="m",rank="{r}",peer="{p}"}}': v
           for (r, p), v in per_rank.items()}
    for r in sorted({r for r, _ in per_rank}):
        out[f'moescope_all_to_all_seconds_count{{model="m",rank="{r}",op="dispatch"}}'] = dispatches
    return out


def slow_rank_bad() -> dict:
    return _waits({(0, 2): "0+6x20", (0, 1): "0+0.1x20", (1, 2): "0+6x20"})


def slow_rank_healthy() -> dict:
    return _waits({(0, 2): "0+1x20", (0, 1): "0+1x20", (1, 2): "0+1x20", (1, 0): "0+1x20"})


def slow_rank_boundary(t: Thresholds) -> dict:
    # waits long per dispatch, but split evenly: exactly the share bar, not over it
    return _waits({(0, 2): "0+6x20", (0, 1): "0+6x20"})


def slow_rank(t: Thresholds) -> tuple[Case, ...]:
    return (
        # two healthy ranks: one peer always holds over half of a tiny total wait (1 ms a dispatch)
        Case("two healthy ranks", _waits({(0, 1): "0+0.06x20", (1, 0): "0+0.03x20"})),
        # rank 1 late by 20 ms at every dispatch (the demo's slow-rank fault)
        Case("two ranks, one 20 ms late", _waits({(0, 1): "0+1.2x20", (1, 0): "0+0.03x20"}),
             {"model": "m", "peer": "1"},
             "Rank 1 accounts for 97.56% of the time ranks of m wait on their peers (a slow peer: over "
             f"{t.default.slow_rank_share:.0%} of the wait and over {t.default.slow_rank_wait_s * 1e3:g} ms per "
             "dispatch)."),
    )
