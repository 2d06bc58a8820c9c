"""Naive reference implementations the tests compare the runtime against: plain loops, float64."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def naive_route(logits: torch.Tensor, k: int, temperature: float = 1.0):
    """float64 softmax and top-k per token in Python: (ids [T,k], weights [T,k], entropy [T], margin [T])."""
    ids, weights, entropy, margin = [], [], [], []
    for row in logits.double():
        p = torch.softmax(row / temperature, -1).tolist()
        order = sorted(range(len(p)), key=lambda e: -p[e])
        top = order[:k]
        s = sum(p[e] for e in top)
        ids.append(top)
        weights.append([p[e] / s for e in top])
        entropy.append(-sum(x * math.log(x) for x in p if x > 0) / math.log(len(p)))
        margin.append(p[order[0]] - p[order[1]])
    f64 = torch.float64
    return (torch.tensor(ids), torch.tensor(weights, dtype=f64), torch.tensor(entropy, dtype=f64),
            torch.tensor(margin, dtype=f64))


def naive_route_rule(logits: torch.Tensor, k: int, *, scoring: str, n_group: int = 1, topk_group: int = 1,
                     bias=None, norm: bool = True, scale: float = 1.0, temperature: float = 1.0):
    """Any routing rule written out per token in float64 from its description (DeepSeek-V3's paper / HF's
    router): scores (softmax or sigmoid); choice = scores + bias; group score = sum of the group's two best
    choices; only the topk_group best groups are eligible; top-k of the eligible choices; gate weights are
    the chosen experts' unbiased scores, normalised (sigmoid: + 1e-20) and scaled. Entropy of the scores
    normalised to sum 1, divided by log E; margin = best minus second-best score.
    Returns (ids [T,k], weights [T,k], entropy [T], margin [T])."""
    ids, weights, entropy, margin = [], [], [], []
    n_experts = logits.shape[1]
    per = n_experts // n_group
    b = [0.0] * n_experts if bias is None else [float(x) for x in bias]
    for row in logits.double():
        z = [float(x) / temperature for x in row]
        if scoring == "softmax":
            m = max(z)
            e = [math.exp(x - m) for x in z]
            s = [x / sum(e) for x in e]
        else:
            s = [1 / (1 + math.exp(-x)) for x in z]
        choice = [s[e] + b[e] for e in range(n_experts)]
        group_score = []
        for g in range(n_group):
            best = sorted(choice[g * per:(g + 1) * per], reverse=True)[:2]
            group_score.append(sum(best))
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        eligible = [e for e in range(n_experts) if e // per in groups]
        top = sorted(eligible, key=lambda e: -choice[e])[:k]
        w = [s[e] for e in top]
        if norm:
            total = sum(w) + (1e-20 if scoring == "sigmoid" else 0.0)
            w = [x / total for x in w]
        ids.append(top)
        weights.append([x * scale for x in w])
        p = [x / sum(s) for x in s]
        entropy.append(-sum(x * math.log(x) for x in p if x > 0) / math.log(n_experts))
        two = sorted(s, reverse=True)[:2]
        margin.append(two[0] - two[1])
    f64 = torch.float64
    return (torch.tensor(ids), torch.tensor(weights, dtype=f64), torch.tensor(entropy, dtype=f64),
            torch.tensor(margin, dtype=f64))


def naive_capacity_keep(ids: list[list[int]], n_experts: int, capacity: int) -> list[list[bool]]:
    """Rank-major, then token order: each expert accepts slots until it holds ``capacity``."""
    n_tokens, k = len(ids), len(ids[0])
    used = [0] * n_experts
    keep = [[False] * k for _ in range(n_tokens)]
    for rank in range(k):
        for t in range(n_tokens):
            e = ids[t][rank]
            if used[e] < capacity:
                used[e] += 1
                keep[t][rank] = True
    return keep


def naive_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """Per token, per slot: weight * SwiGLU_e(x_t); slots with id >= E (dropped) contribute nothing."""
    n_experts = gate_up.shape[0]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            if e >= n_experts:
                continue
            g, u = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, slot] * (down[e] @ (F.silu(g) * u))
    return out


def _wilson_hilferty(df: float, z: float, sign: float) -> float:
    """A chi-square's quantile at the normal tail ``sign * z``, over its mean (Wilson-Hilferty, as docs/metrics.md
    writes it: ``(1 - a + sign z sqrt(a))^3``, a = 2 / (9 df))."""
    a = 2 / (9 * df)
    return max(1 - a + sign * z * math.sqrt(a), 0.0) ** 3


def naive_window_judgement(per_request, z_noise: float, z_hot: float) -> dict:
    """docs/metrics.md's window judgement written out per layer and expert with plain loops over the requests
    (``per_request``: [R][L][E] slot counts; the window is exactly these requests' slots; no baseline: the
    reference share is 1/E). Per layer: ``cv`` (population), the cluster-robust share variance
    ``R/(R-1) sum_r (c_re - p_e n_r)^2 / N^2`` floored by ``p(1-p)/N``, ``noise_cv`` =
    ``sqrt(E sum_e Var(p_e) x chi2 bound at min(E, R) - 1 df)`` floored by the multinomial bound at E - 1 df,
    ``excess_cv`` = ``sqrt(max(0, cv^2 - noise^2))``, and per expert the hot factor p_e E where
    ``p_e - 1/E > z_hot sd`` (``sd^2`` = Var(p_e) x df / chi2 lower quantile at R - 1 df), else NaN."""
    n_layers, n_exp = len(per_request[0]), len(per_request[0][0])
    out = {"cv": [], "noise_cv": [], "excess_cv": [], "hot_factor": []}
    for li in range(n_layers):
        rows = [[float(x) for x in req[li]] for req in per_request if sum(req[li]) > 0]
        r = len(rows)
        load = [sum(row[e] for row in rows) for e in range(n_exp)]
        n = sum(load)
        mean = n / n_exp
        cv = math.sqrt(sum((x - mean) ** 2 for x in load) / n_exp) / mean
        var = []
        for e in range(n_exp):
            p = load[e] / n
            resid = sum((row[e] - p * sum(row)) ** 2 for row in rows)
            var.append(max(r / (r - 1) * resid / n ** 2, p * (1 - p) / n))
        cluster = math.sqrt(n_exp * sum(var) * _wilson_hilferty(max(min(n_exp, r) - 1, 1), z_noise, 1))
        multi = math.sqrt((n_exp - 1) * _wilson_hilferty(n_exp - 1, z_noise, 1) / n)
        noise = max(cluster, multi)
        lower = _wilson_hilferty(r - 1, z_noise, -1)
        upper = 1 / lower if lower > 0 else math.inf
        hot = []
        for e in range(n_exp):
            p, ref = load[e] / n, 1 / n_exp
            hot.append(p / ref if p - ref > z_hot * math.sqrt(var[e] * upper) else math.nan)
        out["cv"].append(cv)
        out["noise_cv"].append(noise)
        out["excess_cv"].append(math.sqrt(max(0.0, cv * cv - noise * noise)))
        out["hot_factor"].append(hot)
    return out


# -- load statistics, one load [E] at a time, as docs/metrics.md writes them (moescope.stats computes them
# row-wise; an empty load's max/mean and top share are NaN there: "not defined") -----------------------------
def naive_load_cv(load) -> float:
    """std/mean over all experts, zeros included (population std); 0 for no load."""
    n = len(load)
    mean = sum(load) / n if n else 0.0
    if mean == 0:
        return 0.0
    return math.sqrt(sum((x - mean) ** 2 for x in load) / n) / mean


def naive_max_over_mean(load) -> float:
    """The busiest's load over the mean load; NaN for no load."""
    total = sum(load)
    return max(load) / (total / len(load)) if total else math.nan


def naive_top_share(load, tokens) -> float:
    """The busiest expert's slots over the routed tokens (an expert takes at most one slot per token); NaN for no
    tokens."""
    return max(load) / tokens if tokens else math.nan


def naive_dead_experts(load) -> int:
    """Experts with no slot at all."""
    return sum(1 for x in load if x == 0)


def naive_rank_loads(load, per_rank) -> list[float]:
    """Slots each rank computes: an expert's slots split evenly over the ranks holding it."""
    out = [0.0] * len(per_rank)
    for e, w in enumerate(load):
        holders = [r for r, experts in enumerate(per_rank) if e in experts]
        for r in holders:
            out[r] += w / len(holders)
    return out


def naive_jensen_shannon(p, q) -> float:
    """Jensen-Shannon divergence in bits between two loads, each normalised to shares."""
    def shares(x):
        total = sum(x)
        return [v / total if total else 0.0 for v in x]

    ps, qs = shares(p), shares(q)
    m = [(a + b) / 2 for a, b in zip(ps, qs)]

    def kl(a, b):
        return sum(x * math.log2(x / y) for x, y in zip(a, b) if x > 0)

    return 0.5 * kl(ps, m) + 0.5 * kl(qs, m)


def naive_goal_verdict(ratios, goal: float, instances: bool = False) -> str:
    """docs/vllm.md's rule from its words: the quartiles of the per-round ratios, each at rank (n + 1) p of the
    sorted values (1-based; the "exclusive" definition), on the line through the two nearest ranks (between them,
    or beyond the end ones: with 2 rounds the quartiles lie outside them); "met" when the upper one is within
    ``goal``, "missed" when the lower one is above it, else "not resolved" (fewer than 2 rounds: not resolved).
    ``instances`` (two server processes, capture on doing strictly more): where the upper quartile says capture on
    was cheaper than off by more than the goal's margin (goal - 1), the two differ by more than the goal: not
    resolved."""
    xs = sorted(ratios)
    if len(xs) < 2:
        return "not resolved"

    def q(p: float) -> float:
        h = (len(xs) + 1) * p
        lo = min(max(int(math.floor(h)), 1), len(xs) - 1)  # the pair of ranks (lo, lo + 1) the line goes through
        return xs[lo - 1] + (h - lo) * (xs[lo] - xs[lo - 1])

    if instances and 1 - q(0.75) > goal - 1:
        return "not resolved"
    return "met" if q(0.75) <= goal else "missed" if q(0.25) > goal else "not resolved"


def naive_vllm_overhead(per_round: dict, name: str, goal: float) -> dict:
    """benchmarks/vllm.py's figures for server ``name`` recomputed from its results file's raw rounds
    (``per_round``: server -> one pair per round, capture ``off`` and ``on``, each with tokens, wall_s,
    server_cpu_s): per round, throughput off / on and server CPU per token on / off of the same server; their
    medians; each against ``goal`` by ``naive_goal_verdict``."""
    import statistics

    thr, cpu = [], []
    for pair in sorted(per_round[name], key=lambda p: p["round"]):
        o, c = pair["off"], pair["on"]
        thr.append((o["tokens"] / o["wall_s"]) / (c["tokens"] / c["wall_s"]))
        cpu.append((c["server_cpu_s"] / c["tokens"]) / (o["server_cpu_s"] / o["tokens"]))
    return {"per_round_throughput_off_over_on": thr, "per_round_cpu_per_token_on_over_off": cpu,
            "throughput_off_over_on": statistics.median(thr), "cpu_per_token_on_over_off": statistics.median(cpu),
            "throughput": naive_goal_verdict(thr, goal), "cpu_per_token": naive_goal_verdict(cpu, goal)}


def vllm_overhead_mismatches(report: dict, printed: str) -> list[str]:
    """Where a benchmarks/vllm.py report disagrees with its own rounds (``naive_vllm_overhead``): the per-round
    ratios and their medians (to the file's 4 decimals), the goal verdicts it records, and the verdict words its
    table (``printed``, ``vllm.py --markdown``) shows on each server's row. Empty: none."""
    said = {None: "not resolved", True: "met", False: "missed"}

    def off(a: float, b: float) -> bool:  # the file rounds ratios to 4 decimals and each pass's wall to 0.1 ms
        return abs(a - b) > 5e-5 + 5e-4 * abs(b)

    rows = [line for line in printed.splitlines() if line.startswith("| ") and "---" not in line][1:]
    out = [] if len(rows) == len(report["ratios"]) else [f"table rows {len(rows)}, servers {len(report['ratios'])}"]
    for (name, r), row in zip(report["ratios"].items(), rows):
        ref = naive_vllm_overhead(report["per_round"], name, r["goal"]["max_ratio"])
        for key in ("per_round_throughput_off_over_on", "per_round_cpu_per_token_on_over_off"):
            if len(r[key]) != len(ref[key]) or any(off(a, b) for a, b in zip(r[key], ref[key])):
                out.append(f"{name} {key}: file {r[key]}, rounds {[round(x, 4) for x in ref[key]]}")
        for key in ("throughput_off_over_on", "cpu_per_token_on_over_off"):
            if off(r[key], ref[key]):
                out.append(f"{name} {key}: file {r[key]}, rounds {ref[key]:.4f}")
        for key, field in (("throughput", "throughput_met"), ("cpu_per_token", "cpu_per_token_met")):
            if said[r["goal"][field]] != ref[key]:
                out.append(f"{name} goal {field}: file {r['goal'][field]}, rule {ref[key]}")
        cells = [c.strip().split(" (")[0].replace("not met", "missed") for c in row.strip("|").split("|")]
        # columns: server, tokens/s, CPU ms/token, the two ratios, goal, throughput and CPU/token verdicts, share
        if cells[6:8] != [ref["throughput"], ref["cpu_per_token"]]:
            out.append(f"{name} table verdicts {cells[6:8]}, rule {[ref['throughput'], ref['cpu_per_token']]}")
    return out
