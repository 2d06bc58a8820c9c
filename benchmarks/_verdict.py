"""The one verdict rule of every benchmark that holds a figure against a goal (a ratio at most ``goal``).

A goal is judged only where the rounds resolve it: "met" when the upper quartile of the per-round ratios is within
the goal, "missed" when the lower quartile is above it; otherwise the rounds' spread is larger than the distance
to the goal and the verdict is "not resolved", never a "met" read off one point estimate (a median, an
order-balanced mean) of noisy rounds. Quartiles are ``statistics.quantiles(ratios, n=4)`` (the default,
exclusive method: rank (n + 1) p, so with 2 rounds they lie beyond the two values, a quarter of their gap out);
fewer than 2 rounds resolve nothing.

Two instances (``instances=True``: the ratio's two sides are separate server processes, the one with capture doing
strictly more work): a ratio the rounds put below 1 by more than the goal's margin (upper quartile < 2 - goal) can
only be the instances differing, by more than the goal; such rounds cannot resolve the goal either way, and the
verdict is "not resolved" (a difference the other way, the instance without capture the cheaper, cannot be told
from a cost: two instances resolve a goal only as far as they are alike).

    judge([1.00, 1.01, 1.00, 1.02], 1.02)   # True
    verdict([0.64, 1.38, 0.73, 1.41], 1.02)  # 'not resolved (rounds 0.64-1.41)'

benchmarks/serve.py, benchmarks/_tables.py and benchmarks/vllm.py print their verdicts through ``verdict``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def quartiles(xs: Sequence[float]) -> list[float]:
    """[q1, median, q3] of ``xs`` (``statistics.quantiles(xs, n=4)``; one value: itself three times)."""
    return statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3


def judge(ratios: Sequence[float], goal: float) -> bool | None:
    """True (met: upper quartile <= ``goal``), False (missed: lower quartile > ``goal``) or None (not resolved:
    the quartiles straddle the goal, or fewer than 2 rounds)."""
    if len(ratios) < 2:
        return None
    q1, _, q3 = quartiles(ratios)
    return True if q3 <= goal else (False if q1 > goal else None)


def verdict(ratios: Sequence[float] | None, goal: float, *, why: str | None = None, instances: bool = False) -> str:
    """The words every table prints for ``ratios`` (the per-round ratios) against ``goal``: "met", "missed" or
    "not resolved (rounds LO-HI)". ``ratios`` None: the results file holds no per-round ratios, and the verdict is
    "not resolved (WHY)" (``why`` says what is missing). ``instances``: the two sides are two processes (module
    docstring): rounds under 1 by more than the goal's margin are "not resolved (the instances differ ...)"."""
    if ratios is None:
        return f"not resolved ({why or 'no per-round ratios in the results file'})"
    if instances and len(ratios) >= 2 and quartiles(ratios)[2] < 2 - goal:
        return (f"not resolved (rounds {min(ratios):.2f}-{max(ratios):.2f}: the instances differ by more than the "
                "goal)")
    met = judge(ratios, goal)
    if met is None:
        if len(ratios) < 2:
            return f"not resolved ({len(ratios)} round{'' if len(ratios) == 1 else 's'})"
        return f"not resolved (rounds {min(ratios):.2f}-{max(ratios):.2f})"
    return "met" if met else "missed"


__all__ = ["judge", "verdict"]
