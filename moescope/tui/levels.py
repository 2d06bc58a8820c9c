"""The one place `moescope top` reads thresholds: views hold no bar of their own.

Every bar comes from the thresholds object (``moescope.thresholds``) the alert rules, dashboards and
``diagnose`` read, resolved per model; sample-size-aware judgements (the load CV beyond sampling noise, dead
experts only where uniform routing sends enough slots) are the object's own methods.

Colours: a value is ``ok`` under ``WARN_FRACTION`` of its bar, ``warn`` up to the bar, ``bad`` past it (for a
floor such as the cache hit rate, mirrored). ``none`` = no value. The heatmaps' shading is a legend (a scale,
not a judgement): ``SHADES``/``RAMP`` below.
"""

from __future__ import annotations

from moescope.thresholds import DEFAULT, WARN_FRACTION, ModelThresholds, Thresholds

Bars = ModelThresholds

# The heatmaps' legend: a cell's load relative to the fair share 1/E. Characters step per doubling (1/8x ...
# 32x); colours: idle blue, around fair green, 2x yellow, 4x+ red.
SHADES = ".:-=+*#%@"  # ASCII: readable over any SSH terminal and font; "=" is the fair share
FAIR_SHADE = 3
RAMP = ((0.5, "blue"), (2.0, "green"), (4.0, "yellow"), (float("inf"), "red"))
HOT = 4.0  # where the ramp turns red: a folded band shows its busiest expert from here on
# A per-expert window says something once uniform routing would give every expert this many slots; thinner
# recent windows are sampling noise, and top shows the run so far instead.
MIN_SLOTS_PER_EXPERT = 8


def bars(model: str | None, t: Thresholds = DEFAULT) -> Bars:
    return t.for_model(model)


def level(value: float | None, bar: float | None, *, floor: bool = False) -> str:
    """ok | warn | bad | none for ``value`` against ``bar`` (``floor``: lower is worse)."""
    if value is None:
        return "none"
    if bar is None:
        return "ok"
    if floor:
        return "bad" if value < bar else "warn" if value < bar + (1 - bar) * (1 - WARN_FRACTION) else "ok"
    return "bad" if value > bar else "warn" if value > WARN_FRACTION * bar else "ok"


def enough_slots(b: Bars, n_experts: int | None, slots: float) -> bool:
    """Whether a window holding ``slots`` per layer says something per expert (``MIN_SLOTS_PER_EXPERT``),
    else it is sampling noise."""
    return bool(n_experts) and slots >= n_experts * MIN_SLOTS_PER_EXPERT


def worst(*levels: str) -> str:
    order = ("none", "ok", "warn", "bad")
    return max(levels, key=order.index, default="none")
