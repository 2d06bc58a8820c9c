"""Cache what-if: replay recorded expert lookups through each policy at every cache size.

Input: a routing log (``moescope demo --record-routing FILE``, format ``moescope-routing-v1``): for each
MoE layer, the experts each forward used. Each forward looks its experts up in ascending id order, as the
runtime's grouped expert loop does, so the replay reproduces the runtime cache's counts exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moescope.analysis import cache_stack
from moescope.analysis.files import read_format
from moescope.errors import BadInput
from moescope.progress import progress
from moescope.runtime import cache_policy
from moescope.capture.routing_log import FORMAT
from moescope.traces.store import CorruptRows, iter_routed, routed_where


def load_lookups(path: str | Path) -> tuple[int, dict[int, list[int]]]:
    """(n_experts, {layer: lookup sequence}) from a routing log file."""
    data = read_format(path, "routing log", FORMAT)
    n_experts = data.get("n_experts")
    layers = data.get("layers")
    if not isinstance(n_experts, int) or n_experts <= 0 or not isinstance(layers, dict) or not layers:
        raise BadInput(f"routing log {path} has no n_experts or no layers")
    seqs = {}
    for layer, forwards in layers.items():
        try:
            seq = [e for fwd in forwards for e in sorted(set(int(x) for x in fwd))]
        except (TypeError, ValueError):
            raise BadInput(f"routing log {path}: layer {layer} is not a list of expert id lists") from None
        if any(not 0 <= e < n_experts for e in seq):
            raise BadInput(f"routing log {path}: layer {layer} has expert ids outside 0..{n_experts - 1}")
        seqs[int(layer)] = seq
    return n_experts, seqs


def load_lookups_from_store(conn, corrupt=None, model: str | None = None) -> tuple[int, dict[int, list[int]]]:
    """The same lookup sequences from a trace store: each engine step's experts per layer (the union over
    the stored requests that took part in it), steps in order. With sampling below 1 only kept requests
    contribute, so the replay sees a subset of each step's experts. Corrupt rows are skipped into
    ``corrupt`` (``store.CorruptRows``). ``model``: only this model's requests (None: the shape most requests
    have)."""
    corrupt = CorruptRows() if corrupt is None else corrupt
    step_rank: dict[tuple[str, int], int] = {}  # (run, index) -> a number; sorted into step order below
    layer_no: dict[int, int] = {}
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (step number, layer numbers, ids) per request
    n_experts = None
    where, args = routed_where(None, model)
    total = conn.execute(f"SELECT count(*) FROM requests WHERE {where}", args).fetchone()[0]
    with progress("reading the stored routing", total, lines=False) as advance:
        for r in iter_routed(conn, corrupt=corrupt, model=model):
            advance()
            n_experts, steps = r.n_experts, r.steps
            used = np.unique(np.asarray(r.step_of[:r.n_routed], dtype=np.int64))
            if any("index" not in steps[int(i)] for i in used):
                raise BadInput("this trace store predates step ids; record a new one (or use --record-routing)")
            number = np.zeros(len(steps), np.int64)
            for i in used:
                number[i] = step_rank.setdefault((steps[i].get("run", ""), steps[i]["index"]), len(step_rank))
            layers = np.array([layer_no.setdefault(layer, len(layer_no)) for layer in r.layers], np.int64)
            parts.append((number[np.asarray(r.step_of[:r.n_routed], dtype=np.int64)], layers, r.ids))
    if n_experts is None:
        raise corrupt.nothing_left("the trace store holds no routed tokens")
    order = np.empty(len(step_rank), np.int64)
    order[[step_rank[k] for k in sorted(step_rank)]] = np.arange(len(step_rank))  # number -> place in step order
    n_layers = len(layer_no)
    codes = []
    for step, layers, ids in parts:  # one code per (step, layer, expert) slot: sorting them is replay order
        code = ((order[step][:, None, None] * n_layers + layers[None, :, None]) * n_experts
                + ids.astype(np.int64))
        codes.append(code[ids < n_experts])  # the sentinel n_experts marks a dropped slot
    code = np.sort(np.concatenate(codes))  # sort + drop repeats: ~6x np.unique's hashing on millions of slots
    first = np.ones(len(code), bool)
    first[1:] = code[1:] != code[:-1]
    code = code[first]
    layer_of, expert = (code // n_experts) % n_layers, code % n_experts
    seqs = {layer: expert[layer_of == j].tolist() for layer, j in layer_no.items()}
    return n_experts, seqs


def simulate_all(n_experts: int, seqs: dict[int, list[int]], *, target: float = 0.9,
                 policies=cache_policy.SIM_POLICIES) -> dict:
    """Hit rates summed over layers (each layer has its own cache of the given size), at every size 1..E.

    One pass per policy over each layer's lookups gives every size at once (``cache_stack``: LRU, LFU and
    MIN are stack algorithms; ``static`` is closed-form), with the hits and evictions that
    ``cache_policy.simulate`` counts size by size."""
    unknown = [p for p in policies if p not in cache_policy.SIM_POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; cache-sim replays {', '.join(cache_policy.SIM_POLICIES)}")
    sweep = cache_stack.sweep(n_experts, [np.asarray(seq, dtype=np.int64) for seq in seqs.values()])
    lookups = sum(len(seq) for seq in seqs.values())
    rows = []
    for size in range(1, n_experts + 1):
        per_policy = {}
        for policy in policies:
            hits, evictions = (int(sweep[policy][key][size - 1]) for key in ("hits", "evictions"))
            per_policy[policy] = {"policy": policy, "size": size, "lookups": lookups, "hits": hits,
                                  "evictions": evictions, "hit_rate": hits / lookups if lookups else 1.0}
        best = per_policy.get("belady", max(per_policy.values(), key=lambda r: r["hit_rate"]))
        for r in per_policy.values():
            r["gap_to_optimal"] = best["hit_rate"] - r["hit_rate"]
            rows.append(r)
    min_size = {p: next((r["size"] for r in rows if r["policy"] == p and r["hit_rate"] >= target), None)
                for p in policies}
    return {"n_experts": n_experts, "layers": sorted(seqs), "lookups_per_layer": {str(k): len(v) for k, v in
                                                                                  seqs.items()},
            "target_hit_rate": target, "results": rows, "min_size_for_target": min_size,
            "table_sizes": table_sizes(n_experts, min_size.values())}


def table_sizes(n_experts: int, marked=()) -> list[int]:
    """The sizes the text table shows: 1, 2, 4, ... up to E, E itself, and each given size with the one below
    it (where the target is crossed). A few rows at any E; --json has every size."""
    sizes = {n_experts} | {1 << i for i in range(n_experts.bit_length()) if 1 << i <= n_experts}
    for s in marked:
        if s is not None:
            sizes |= {s, max(1, s - 1)}
    return sorted(sizes)


def format_table(report: dict) -> str:
    policies = list(report["min_size_for_target"])
    mins = report["min_size_for_target"]
    lines = [f"cache what-if over {len(report['layers'])} MoE layers, {report['n_experts']} experts each; "
             f"hit rate per policy (gap to Belady's optimal in brackets); * = smallest size reaching "
             f"{report['target_hit_rate']:.2f}; every size 1..{report['n_experts']} in --json",
             f"{'size':>4}  " + "  ".join(f"{p:>17}" for p in policies)]
    by = {(r["policy"], r["size"]): r for r in report["results"]}
    for size in report.get("table_sizes") or table_sizes(report["n_experts"], mins.values()):
        cells = []
        for p in policies:
            r = by[(p, size)]
            mark = "*" if mins[p] == size else " "
            cells.append(f"{r['hit_rate']:>7.3f} ({r['gap_to_optimal']:+.3f}){mark}" if p != "belady"
                         else f"{r['hit_rate']:>16.3f}{mark}")
        lines.append(f"{size:>4}  " + "  ".join(cells))
    text = ", ".join(f"{p} {s if s is not None else 'never'}" for p, s in mins.items())
    lines.append(f"smallest cache size (experts per layer) reaching hit rate {report['target_hit_rate']:.2f}: {text}")
    return "\n".join(lines)


__all__ = ["load_lookups", "load_lookups_from_store", "simulate_all", "table_sizes", "format_table"]
