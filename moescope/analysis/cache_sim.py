"""Cache what-if: replay recorded expert lookups through each policy at every cache size.

Input: a routing log (``moescope demo --record-routing FILE``, format ``moescope-routing-v1``): for each
MoE layer, the experts each forward used. Each forward looks its experts up in ascending id order, as the
runtime's grouped expert loop does, so the replay reproduces the runtime cache's counts exactly.
"""

from __future__ import annotations

from pathlib import Path

from moescope.analysis.files import read_format
from moescope.errors import BadInput
from moescope.runtime import cache_policy
from moescope.capture.routing_log import FORMAT


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


def load_lookups_from_store(conn, corrupt=None) -> tuple[int, dict[int, list[int]]]:
    """The same lookup sequences from a trace store: each engine step's experts per layer (the union over
    the stored requests that took part in it), steps in order. With sampling below 1 only kept requests
    contribute, so the replay sees a subset of each step's experts. Corrupt rows are skipped into
    ``corrupt`` (``store.CorruptRows``)."""
    from moescope.traces.store import CorruptRows, iter_routed

    corrupt = CorruptRows() if corrupt is None else corrupt
    used: dict[tuple[str, int], dict[int, set[int]]] = {}
    n_experts = None
    for r in iter_routed(conn, corrupt=corrupt):
        n_experts, steps, ids, step_of = r.n_experts, r.steps, r.ids, r.step_of
        for i in range(r.n_routed):
            st = steps[int(step_of[i])]
            if "index" not in st:
                raise BadInput("this trace store predates step ids; record a new one (or use --record-routing)")
            per_layer = used.setdefault((st.get("run", ""), st["index"]), {})
            for j, layer in enumerate(r.layers):
                per_layer.setdefault(layer, set()).update(int(e) for e in ids[i, j] if e < n_experts)
    if not used:
        raise corrupt.nothing_left("the trace store holds no routed tokens")
    seqs: dict[int, list[int]] = {}
    for key in sorted(used):
        for layer, experts in used[key].items():
            seqs.setdefault(layer, []).extend(sorted(experts))
    return n_experts, seqs


def simulate_all(n_experts: int, seqs: dict[int, list[int]], *, target: float = 0.9,
                 policies=cache_policy.SIM_POLICIES) -> dict:
    """Hit rates summed over layers (each layer has its own cache of the given size)."""
    rows = []
    for size in range(1, n_experts + 1):
        best = None
        per_policy = {}
        for policy in policies:
            results = [cache_policy.simulate(seq, policy, size) for seq in seqs.values()]
            hits, lookups = sum(r.hits for r in results), sum(r.lookups for r in results)
            per_policy[policy] = {"policy": policy, "size": size, "lookups": lookups, "hits": hits,
                                  "evictions": sum(r.evictions for r in results),
                                  "hit_rate": hits / lookups if lookups else 1.0}
        best = per_policy.get("belady", max(per_policy.values(), key=lambda r: r["hit_rate"]))
        for r in per_policy.values():
            r["gap_to_optimal"] = best["hit_rate"] - r["hit_rate"]
            rows.append(r)
    min_size = {p: next((r["size"] for r in rows if r["policy"] == p and r["hit_rate"] >= target), None)
                for p in policies}
    return {"n_experts": n_experts, "layers": sorted(seqs), "lookups_per_layer": {str(k): len(v) for k, v in
                                                                                  seqs.items()},
            "target_hit_rate": target, "results": rows, "min_size_for_target": min_size}


def format_table(report: dict) -> str:
    policies = list(report["min_size_for_target"])
    lines = [f"cache what-if over {len(report['layers'])} MoE layers, {report['n_experts']} experts each; "
             f"hit rate per policy (gap to Belady's optimal in brackets)",
             f"{'size':>4}  " + "  ".join(f"{p:>15}" for p in policies)]
    by = {(r["policy"], r["size"]): r for r in report["results"]}
    for size in range(1, report["n_experts"] + 1):
        cells = []
        for p in policies:
            r = by[(p, size)]
            cells.append(f"{r['hit_rate']:>7.3f} ({r['gap_to_optimal']:+.3f})" if p != "belady"
                         else f"{r['hit_rate']:>15.3f}")
        lines.append(f"{size:>4}  " + "  ".join(cells))
    mins = ", ".join(f"{p} {s if s is not None else 'never'}" for p, s in report["min_size_for_target"].items())
    lines.append(f"smallest cache size (experts per layer) reaching hit rate {report['target_hit_rate']:.2f}: {mins}")
    return "\n".join(lines)


__all__ = ["load_lookups", "simulate_all", "format_table"]
