"""The verdict on expert parallelism and EPLB (issue [eplb]): one EP size's static placement against EPLB, from the
step-level figures (``parallel.step_balance``, live or offline), judged by ``thresholds.Thresholds.eplb_worth``.
Every view says the same: `plan-placement`, `diagnose`, `moescope top` (from the exported series) and the docs.

A foundation module (numbers in, words out): imported by the CLI, the analysis and the terminal views alike, it
imports nothing above ``thresholds``.

The printed flags are vLLM's (``vllm/config/parallel.py`` ``EPLBConfig``, the same fields in 0.31, 0.32 and 0.33:
``window_size``, ``step_interval``, ``num_redundant_experts``; tests/test_vllm.py builds vLLM's own ``EPLBConfig``
from the printed JSON).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from moescope.thresholds import DEFAULT, Thresholds

# Where the cost figures come from (``Thresholds.eplb_rearrange_*``), said beside them
COST_SOURCES = "vLLM #50647: a rearranging step took 3.17x a step; #47206: 16-21 s"


@dataclass(frozen=True)
class Figures:
    """One placement's step-level figures: the worst layer's busiest / mean rank per step (its median and 99th
    percentile), the straggler factor (sum of busiest / sum of mean rank over steps and layers) with its standard
    error, the average-load figure (the same steps' counts added up), and the steps they rest on."""

    placement: str
    ep: int
    redundant: int
    p50: float
    p99: float
    straggler: float
    stderr: float
    average: float
    steps: int


@dataclass(frozen=True)
class Verdict:
    ep: int
    static: Figures
    eplb: Figures | None
    round_robin: Figures | None
    worth: bool
    beyond_noise: bool  # EPLB's straggler below the static one's by more than the sample's noise
    gain_steps: float  # step times EPLB saves per interval (an upper bound: every step's time taken as MoE time)
    cost_steps: float  # one rearrangement, in step times
    window: int
    interval: int
    step_s: float | None
    eplb_config: dict
    flags: str

    def lines(self) -> list[str]:
        s = self.static
        out = [f"EP {self.ep} {s.placement}: step max/mean p50 {s.p50:.2f}, p99 {s.p99:.2f}; straggler "
               f"{_pm(s.straggler, s.stderr)} (the same steps' counts added up: {s.average:.2f}); {s.steps} steps"]
        rr = self.round_robin
        if rr is not None:
            out.append(f"EP {self.ep} round_robin: p50 {rr.p50:.2f}, p99 {rr.p99:.2f}; straggler "
                       f"{_pm(rr.straggler, rr.stderr)} (vLLM places round-robin only for models with expert groups "
                       "and no redundant experts, on the DeepEP low-latency or NIXL EP backend)")
        e = self.eplb
        if e is None:
            out.append(f"EPLB: no figure for EP {self.ep} (the redundant experts do not divide over the ranks)")
            return out
        out.append(f"EPLB R={e.redundant} every {self.interval} steps (window {self.window}): p50 {e.p50:.2f}, "
                   f"p99 {e.p99:.2f}; straggler {_pm(e.straggler, e.stderr)}")
        saves = (f"saves up to {self.gain_steps:.0f} step times per {self.interval}-step interval against "
                 f"{self.cost_steps:.2f} for one rearrangement ({COST_SOURCES}"
                 f"{f'; a step here takes {self.step_s * 1e3:.1f} ms' if self.step_s else ''})")
        if self.worth:
            out.append(f"Enable it with `{self.flags}`: {saves}")
        else:
            why = "too little under" if self.beyond_noise else "within the sample's noise of"
            out.append(f"Not worth a rearrangement's cost: EPLB's straggler is {why} {s.placement}'s; it {saves}")
        return out

    def short(self) -> str:
        """One line (``moescope top``): the static placement's per-step p50 / p99 and straggler, EPLB's, the verdict."""
        s, e = self.static, self.eplb
        head = (f"EP {self.ep} {s.placement}: step max/mean p50/p99 {s.p50:.2f}/{s.p99:.2f}, straggler "
                f"{_pm(s.straggler, s.stderr)} (average {s.average:.2f})")
        if e is None:
            return head
        word = "enable EPLB" if self.worth else "EPLB not worth a rearrangement"
        return (f"{head}; EPLB R={e.redundant}/{self.interval} steps: {e.p50:.2f}/{e.p99:.2f}, straggler "
                f"{_pm(e.straggler, e.stderr)}: {word}")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["lines"] = self.lines()
        return d


def _pm(v: float, se: float) -> str:
    return f"{v:.3f}" + (f" ± {se:.3f}" if math.isfinite(se) else "")


def eplb_config(window: int, interval: int, redundant: int) -> dict:
    """vLLM's ``--eplb-config`` fields for this schedule (``EPLBConfig``: window_size, step_interval,
    num_redundant_experts)."""
    return {"window_size": int(window), "step_interval": int(interval), "num_redundant_experts": int(redundant)}


def flags(config: dict) -> str:
    """The vLLM serve flags that turn EPLB on with ``config``."""
    return f"--enable-expert-parallel --enable-eplb --eplb-config '{json.dumps(config, separators=(',', ':'))}'"


def default_ep(sizes) -> int | None:
    """The EP size a view judges by default: 8 where predicted (a node's GPUs), else the nearest below, else the
    smallest."""
    sizes = sorted(set(sizes))
    if not sizes:
        return None
    below = [n for n in sizes if n <= 8]
    return below[-1] if below else sizes[0]


def verdict(figures, ep: int, window: int, interval: int, step_s: float | None = None,
            t: Thresholds = DEFAULT) -> Verdict | None:
    """The verdict for EP size ``ep`` from ``figures`` (``Figures`` of any placements and sizes; the static one is
    vLLM's default, linear), or None without linear's figures at that size. With several EPLB figures at the size,
    the one with the lowest straggler factor."""
    at = [f for f in figures if f.ep == ep and f.steps > 0 and math.isfinite(f.straggler)]
    static = next((f for f in at if f.placement == "linear"), None)
    if static is None:
        return None
    rr = next((f for f in at if f.placement == "round_robin"), None)
    eplbs = sorted((f for f in at if f.placement == "eplb"), key=lambda f: f.straggler)
    e = eplbs[0] if eplbs else None
    gain = t.eplb_gain_steps(static.straggler, e.straggler, interval) if e else 0.0
    worth = e is not None and t.eplb_worth(static.straggler, static.stderr, e.straggler, e.stderr, interval, step_s)
    beyond = e is not None and t.eplb_beyond_noise(static.straggler, static.stderr, e.straggler, e.stderr)
    cfg = eplb_config(window, interval, e.redundant if e else 0)
    return Verdict(ep, static, e, rr, worth, beyond, gain, t.eplb_cost_steps(step_s), window, interval, step_s, cfg,
                   flags(cfg))
