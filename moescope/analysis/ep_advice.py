"""Would expert parallelism and EPLB help this traffic? The offline side of issue [eplb]: per-step routing read from
the trace store, judged by the same component the exporter runs live (``parallel.step_balance``) and the same
verdict (``moescope.ep_verdict``), for `plan-placement` and `diagnose`.

Steps are rebuilt from the stored requests: every routed position carries its step (``Routed.step_of``), so a step's
per-expert slots are the sum over the stored requests' positions in it. With a trace sample below 1 (vLLM's default
stores 10% of requests) each step holds the sampled requests only: a thinner batch than the engine ran, whose per-step
imbalance is larger; the figures then overstate the straggler (the output says how many rows a step held).

EPLB is judged out of sample: its first placement is planned from the first ``window`` steps (half the steps when
the trace holds fewer than twice that), and every placement is judged on the steps after them, EPLB re-planning on
its schedule from there (a trace of a few hundred steps would otherwise never reach vLLM's first rearrangement, and
judge vLLM's initial map instead of EPLB).
"""

from __future__ import annotations

import numpy as np

from moescope import ep_verdict
from moescope.metrics.catalogue import STEP_BALANCE_BUCKETS
from moescope.parallel import step_balance as sb

QUANTILES = (0.5, 0.99)


def step_counts(routing, step_of, n_experts: int, n_layers: int) -> np.ndarray:
    """[S, L, E] slots per step (steps in key order), from per-request routing [n, L, k] and each position's step key
    (dropped slots, the sentinel ``n_experts``, left out)."""
    keys = np.concatenate(step_of) if step_of else np.zeros(0, np.int64)
    if not len(keys):
        return np.zeros((0, n_layers, n_experts), np.float32)
    ids = np.concatenate(routing).astype(np.int64)  # [N, L, k]
    steps, inv = np.unique(keys, return_inverse=True)
    width = n_experts + 1
    flat = ((inv[:, None, None] * n_layers + np.arange(n_layers)[None, :, None]) * width + ids).ravel()
    counts = np.bincount(flat, minlength=len(steps) * n_layers * width)
    return counts.reshape(len(steps), n_layers, width)[:, :, :n_experts].astype(np.float32)


def profile_counts(prof) -> np.ndarray:
    """[S, L, E] from a ``analysis.profile.LoadProfile`` (its passes are the engine's steps, in order)."""
    return np.stack([prof.passes[layer] for layer in prof.layers], axis=1).astype(np.float32)


def figures(snap) -> list[ep_verdict.Figures]:
    """The verdict's figures of every placement in a ``step_balance.Snapshot``."""
    return [ep_verdict.Figures(e.placement, e.ep, e.redundant, e.quantile(QUANTILES[0]), e.quantile(QUANTILES[1]),
                               e.straggler, e.stderr, e.average, int(e.count[0])) for e in snap.entries]


def judge(counts: np.ndarray, n_experts: int, ep_sizes, *, redundant=None, window: int = 1000, interval: int = 3000,
          placements=sb.PLACEMENTS, groups: int = 1, nodes: int = 1):
    """(the ``step_balance.Snapshot`` of ``counts`` [S, L, E] judged out of sample, the steps held out to plan EPLB's
    first placement). Every step judged (no sample), exact quantiles."""
    held = min(window, len(counts) // 2)
    warm = counts[:held].sum(0) if held else None
    b = sb.StepBalance(range(counts.shape[1]), n_experts, buckets=STEP_BALANCE_BUCKETS, ep_sizes=ep_sizes,
                       placements=placements, redundant=redundant, schedule=sb.Schedule(window, interval, interval),
                       groups=groups, nodes=nodes, keep_values=True, budget=2**62, warm=warm)
    judged = counts[held:]
    for lo in range(0, len(judged), 256):  # summaries of 256 steps (every one judged), EPLB on its schedule
        part = judged[lo:lo + 256]
        b.observe_counts(part, len(part), part.sum(0))
    return b.snapshot(), held


def advise(counts: np.ndarray, n_experts: int, ep: int, *, redundant: int | None = None, window: int = 1000,
           interval: int = 3000, step_s: float | None = None, groups: int = 1, nodes: int = 1) -> dict | None:
    """The verdict for EP size ``ep`` on ``counts`` [S, L, E] (None when too few steps or an EP size the experts
    do not divide): its dict (``Verdict.as_dict``) with the steps it rests on."""
    if len(counts) < 2 or not 1 < ep <= n_experts or n_experts % ep:
        return None
    r = ep if redundant is None else redundant
    snap, held = judge(counts, n_experts, (ep,), redundant={ep: r}, window=window, interval=interval,
                       placements=("linear", "round_robin", "eplb"), groups=groups, nodes=nodes)
    v = ep_verdict.verdict(figures(snap), ep, window, interval, step_s)
    if v is None:
        return None
    return {**v.as_dict(), "steps_held_out": held, "steps_judged": len(counts) - held,
            "slots_per_step_layer": round(float(counts[held:].sum(-1).mean()), 2)}


def median_step_s(steps) -> float | None:
    """The median decode step's seconds of the stored steps' JSON (every step's without decode steps)."""
    rows = [(st.get("phase"), st.get("seconds")) for st in steps if st.get("seconds") is not None]
    decode = [s for phase, s in rows if phase == "decode"] or [s for _, s in rows]
    return float(np.median(decode)) if decode else None


def diagnose_finding(w) -> dict | None:
    """``diagnose``'s finding (info): the verdict at the default EP size (``ep_verdict.default_ep``) for the
    window's steps (``analysis.diagnose.Window``)."""
    counts = step_counts(w.routing, w.step_of, w.n_experts, len(w.layers))
    ep = ep_verdict.default_ep(sb.default_ep_sizes(w.n_experts))
    adv = advise(counts, w.n_experts, ep, step_s=median_step_s(w.steps)) if ep else None
    if adv is None:
        return None
    title = (f"EP {ep}: EPLB would pay for its rearrangements" if adv["worth"] else
             f"EP {ep}: a static placement is enough (EPLB not worth a rearrangement's cost)")
    return dict(cause="ep-balance", severity="info", title=title, score=adv["static"]["straggler"],
                evidence=adv, examples=[], playbook=None)
