"""`diagnose`'s efficiency finding (issue 44): a batch that touches more experts per step than the model's own band,
while the bandwidth is the binding resource.

The band comes from the model's shape and the traffic's batches, never from a fitted number. A step of B routed
rows in a layer of E experts, top-k: under independent uniform routing (every token's k experts a uniform draw
without replacement, tokens independent) an expert is left untouched with probability q1 = (1 - k/E)^B and two
given experts with q2 = ((E - k)(E - k - 1) / (E (E - 1)))^B, so the distinct experts touched have

    mean  E (1 - q1)        variance  E q1 + E (E - 1) q2 - (E q1)^2.

Independent uniform routing is the widest a batch spreads by chance: a trained router's popular experts make
tokens share experts, so fewer are touched. A window whose steps touch more than that mean by over 3 standard
deviations of its own sampling noise (summed over its steps and layers, taken as independent) spreads its tokens
apart on purpose (a load-aware router, a balancing mitigation, a router whose tokens avoid each other): each step
reads more expert weights than the batch needs. It matters when the step is bound by memory bandwidth: the
roofline says so where S-MBU > S-MFU (bytes / peak bandwidth exceeds FLOPs / peak FLOPs: the step's arithmetic
intensity is below the device's ridge point), read from Prometheus when ``diagnose --prometheus`` gives one.
"""

from __future__ import annotations

import math

import numpy as np

from moescope import efficiency
from moescope.prom_http import query

Z = 3.0  # standard deviations of the window's own sampling noise: the other noise bars' (docs/metrics.md)


def uniform_distinct(n_experts: int, top_k: int, rows) -> tuple[np.ndarray, np.ndarray]:
    """(mean, variance) of the distinct experts ``rows`` independent uniformly routed tokens touch."""
    b = np.asarray(rows, dtype=np.float64)
    e, k = float(n_experts), float(top_k)
    q1 = (1.0 - k / e) ** b
    q2 = (((e - k) * (e - k - 1.0)) / (e * (e - 1.0))) ** b if e > 1 else np.zeros_like(b)
    return e * (1.0 - q1), np.maximum(0.0, e * q1 + e * (e - 1.0) * q2 - (e * q1) ** 2)


def step_distinct(routing: list[np.ndarray], step_of: list[np.ndarray], n_experts: int) -> tuple[np.ndarray,
                                                                                                 np.ndarray]:
    """([S] rows, [S, L] distinct experts) of every step the requests' rows were routed in (dropped slots, the
    sentinel ``n_experts``, excluded). ``routing``: per request [n, L, k]; ``step_of``: per request [n] step keys."""
    keys = np.concatenate(step_of) if step_of else np.zeros(0, np.int64)
    if not len(keys):
        return np.zeros(0), np.zeros((0, 0))
    ids = np.concatenate(routing).astype(np.int64)  # [N, L, k]
    steps, inv = np.unique(keys, return_inverse=True)
    n_layers, width = ids.shape[1], n_experts + 1
    flat = ((inv[:, None, None] * n_layers + np.arange(n_layers)[None, :, None]) * width + ids).ravel()
    hit = np.zeros(len(steps) * n_layers * width, dtype=bool)
    hit[flat] = True
    distinct = hit.reshape(len(steps), n_layers, width)[:, :, :n_experts].sum(-1)
    return np.bincount(inv, minlength=len(steps)), distinct


def spread(routing, step_of, n_experts: int, top_k: int) -> dict | None:
    """The window's distinct experts per step against the band (None without a step of 2 or more rows)."""
    rows, distinct = step_distinct(routing, step_of, n_experts)
    batched = rows >= 2  # one row touches exactly k experts per layer: nothing to judge
    if not batched.any():
        return None
    mean, var = uniform_distinct(n_experts, top_k, rows[batched])
    got = distinct[batched]  # [S', L]
    n_layers = got.shape[1]
    expected, noise = float(mean.sum() * n_layers), math.sqrt(float(var.sum() * n_layers))
    measured = float(got.sum())
    return {"steps": int(batched.sum()), "mean_rows": round(float(rows[batched].mean()), 2),
            "distinct_per_step_layer": round(measured / got.size, 3),
            "uniform_per_step_layer": round(expected / got.size, 3),
            "band_top_per_step_layer": round((expected + Z * noise) / got.size, 3),
            "above": measured > expected + Z * noise, "z": round((measured - expected) / noise, 2) if noise else 0.0}


def finding(routing, step_of, n_experts: int, top_k: int, utilisation: tuple | None = None) -> dict | None:
    """A ``diagnose`` Finding's fields when the steps spread above the band: a warning where the bandwidth is the
    binding resource (``utilisation`` = (S-MBU, S-MFU) with S-MBU > S-MFU), else info; None otherwise."""
    ev = spread(routing, step_of, n_experts, top_k)
    if ev is None or not ev["above"]:
        return None
    smbu, smfu = utilisation or (None, None)
    bound = smbu is not None and smfu is not None and smbu > smfu
    ev = {**ev, "s_mbu": smbu, "s_mfu": smfu, "memory_bound": bound}
    return dict(cause="expert-spread", severity="warning" if bound else "info",
                title=("Steps touch more experts than independent routing would, and bandwidth binds" if bound else
                       "Steps touch more experts than independent routing would (bandwidth not shown binding)"),
                score=ev["distinct_per_step_layer"] / ev["band_top_per_step_layer"], evidence=ev, examples=[],
                playbook=None)


def utilisation_from(url: str, model: str | None) -> tuple[float | None, float | None]:
    """(S-MBU, S-MFU) of the decode steps over the last 5 minutes from a Prometheus (None where unknown)."""
    sel = f'model="{model}", rank=~".*"' if model else 'rank=~".*"'
    out = []
    for expr in (efficiency.smbu(sel, window="5m"), efficiency.smfu(sel, window="5m")):
        r = query(url, f"max({expr})")
        v = float(r[0]["value"][1]) if r else float("nan")
        out.append(v if math.isfinite(v) else None)
    return out[0], out[1]
