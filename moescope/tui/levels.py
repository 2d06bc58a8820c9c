"""The one place `moescope top` reads thresholds: views hold no bar of their own.

Every bar and every judgement is the thresholds object's (``moescope.thresholds.DEFAULT``), the one the alert
rules, dashboards and ``diagnose`` read; top applies its methods to the series the exporter exports already
judged against sampling noise (excess CV, hot factor, unexpected dead experts, drift noise), never to a raw CV.

Colours: a value is ``ok`` under ``WARN_FRACTION`` of its bar, ``warn`` up to the bar, ``bad`` past it (for a
floor such as the cache hit rate, mirrored). ``none`` = no value (or not judged). The heatmaps' shading is a
legend (a scale, not a judgement): ``SHADES``/``RAMP`` below.
"""

from __future__ import annotations

import math

from moescope import judge
from moescope.thresholds import DEFAULT

# The heatmaps' legend: a cell's load relative to the fair share 1/E. Characters step per doubling (1/8x ...
# 32x); colours: idle blue, around fair green, 2x yellow, 4x+ red.
SHADES = ".:-=+*#%@"  # ASCII: readable over any SSH terminal and font; "=" is the fair share
FAIR_SHADE = 3
HOT = DEFAULT.hot_factor  # where the ramp turns red: a folded band shows its busiest expert from here on
RAMP = ((0.5, "blue"), (2.0, "green"), (HOT, "yellow"), (float("inf"), "red"))


def finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


level = judge.level  # the verdict's colours (``judge.level``: the same for every view)
worst = judge.worst
