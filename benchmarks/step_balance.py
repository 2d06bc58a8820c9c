"""Step-level rank load, predicted from routing against measured on real expert-parallel ranks (issue [eplb]).

Counts, not timings. For each shape (configs no preset names), W gloo ranks serve their own requests (data-parallel
attention) through the reference runtime's expert-parallel exchanges, twice:

- static: the contiguous placement (vLLM's ``linear``). Per rank step and MoE layer, **measured**: the rows each rank
  computed, from the dispatch exchange's split sizes (``AllToAllRecord.rank_rows``); **predicted**: every rank's
  routing in that step (each rank's probe ``StepSample``, summed over the ranks) through
  ``parallel.step_balance.rank_loads`` under the placement in use. They are equal, step by step.
- EPLB in the loop: the runtime rearranges every K steps (``Rebalancer(K, slots=S, min_gain=0)``: moescope's planner
  on the last two windows). ``parallel.step_balance``'s ``plan`` entry simulates the same schedule from the same
  per-step routing (``Schedule(window=2K, every=K, first=K-1)``): its placements equal the runtime's, and its
  per-step prediction differs from the measured rows by less than W slots per replicated expert a rank holds (the
  runtime deals a replicated expert's slots over its replicas in turn, within one slot per routing rank; the
  prediction splits them 1/R). The straggler factor (sum over steps and layers of the busiest rank / the mean rank)
  after the first rearrangement, predicted against measured.

    python benchmarks/step_balance.py               # both shapes (~1 min) -> results/step-balance.json
    python benchmarks/step_balance.py --quick       # shape A only -> results/step-balance-quick.json
    python benchmarks/step_balance.py --markdown benchmarks/results/step-balance.json   # the docs' table
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import numpy as np

import _results

# Shapes no preset names: (experts, top-k, MoE layers after one dense layer, ranks, slots per rank with EPLB, every K)
SHAPES = {"A": {"n_experts": 12, "top_k": 3, "moe_layers": 3, "world": 3, "slots": 5, "every": 6, "requests": 12},
          "B": {"n_experts": 20, "top_k": 4, "moe_layers": 2, "world": 4, "slots": 6, "every": 5, "requests": 16}}
HORIZON = 2  # windows the runtime plans from (the simulation's window: HORIZON x K steps)


def config(shape: dict) -> dict:
    from moescope.runtime.model_config import MoEConfig

    return MoEConfig(name=f"eplb-check-{shape['n_experts']}x{shape['top_k']}", hidden_size=32,
                     n_layers=shape["moe_layers"] + 1, n_heads=2, n_experts=shape["n_experts"], top_k=shape["top_k"],
                     ffn_size=16, dense_layers=(0,), dense_ffn_size=32, max_seq_len=256, seed=3).to_dict()


def rank_main(rank: int, world: int, port: int, cfg_dict: dict, every: int, slots: int, n_requests: int,
              out_dir: str) -> None:
    """One rank (torch.multiprocessing): serve this rank's requests, record each forward's rank step, its routing
    per step (the probe, one summary per step) and each dispatch exchange's rows per rank; write rank{r}.json."""
    import torch
    import torch.distributed as dist

    from moescope.capture.observer import Observer
    from moescope.capture.routing_probe import RoutingProbe
    from moescope.parallel import placement
    from moescope.parallel.eplb import Rebalancer
    from moescope.parallel.expert_parallel import ExpertParallel
    from moescope.runtime import traffic
    from moescope.runtime.engine import Engine
    from moescope.runtime.model import MoETransformer
    from moescope.runtime.model_config import from_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    cfg = from_dict(cfg_dict)
    model = MoETransformer(cfg).eval()
    start = placement.build("contiguous", n_experts=cfg.n_experts, world_size=world, moe_layers=cfg.moe_layers)
    out = {"forward_step": {}, "counts": {}, "measured": {}, "rearrangements": []}
    layers = list(cfg.moe_layers)

    def on_stats(st):
        if st.sample is None:
            return
        rows = {ls.layer: j for j, ls in enumerate(st.layers)}
        for s, index in enumerate(st.sample.index):
            c = np.zeros((len(layers), cfg.n_experts), dtype=np.int64)
            for i, layer in enumerate(layers):
                if layer in rows:
                    c[i] = st.sample.counts[s, rows[layer]]
            out["counts"][str(index)] = c.tolist()

    probe = RoutingProbe(on_stats, interval_s=0.0)  # a summary per step: every step sampled
    ep = ExpertParallel(start, rank, world)

    class Watch(Observer):
        def on_routing(self, layer, decision):
            probe.on_routing(layer, decision)

        def on_step(self, step):
            out["forward_step"][str(step.index)] = ep.steps
            probe.on_step(step)

        def on_request(self, record):
            probe.on_request(record.request_id)

        def on_all_to_all(self, r):
            if r.op == "dispatch":
                out["measured"][f"{r.step},{r.layer}"] = list(r.rank_rows)

        def on_rebalance(self, e):
            out["rearrangements"].append({"step": e.step, "layers": {str(k): [list(x) for x in v]
                                                                     for k, v in e.layers.items()}})

    watch = Watch()
    ep.observer = lambda: watch
    for m in model.moe_layers():
        m.parallel = ep
    if every:
        ep.rebalancer = Rebalancer(every, slots=slots, horizon=HORIZON, min_gain=0.0)
    reqs = traffic.generate(traffic.TrafficConfig(seed=5, output_tokens_median=8), n_requests)[rank::world]
    Engine(model, max_batch=3, lockstep=ep, observer=watch).run(reqs, realtime=False, id_prefix="s-")
    probe.flush(final=True)
    out["start"] = {str(k): [list(x) for x in v] for k, v in start.layers.items()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(shape: dict, every: int) -> list[dict]:
    """Every rank's record of one run (``every`` 0: the static placement)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(rank_main, args=(shape["world"], _free_port(), config(shape), every, shape["slots"],
                                  shape["requests"], d), nprocs=shape["world"])
        return [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(shape["world"])]


def fleet_steps(ranks: list[dict], n_layers: int, n_experts: int) -> tuple[np.ndarray, dict]:
    """([T, L, E] every rank's routed slots per rank step 1..T, summed over the ranks; measured {(step, layer
    row): [W] rows})."""
    measured = {}
    for key, rows in ranks[0]["measured"].items():  # every rank sees the same split sizes
        step, layer = map(int, key.split(","))
        measured[(step, layer)] = rows
    steps = max(s for s, _ in measured)
    fleet = np.zeros((steps, n_layers, n_experts), dtype=np.int64)
    for r in ranks:
        for index, step in r["forward_step"].items():
            fleet[step - 1] += np.asarray(r["counts"][index], dtype=np.int64)
    return fleet, measured


def compare(shape: dict, ranks: list[dict], every: int) -> dict:
    """Predicted against measured, per rank step and layer (``every``: the runtime's rearrangement period)."""
    from moescope.metrics.catalogue import STEP_BALANCE_BUCKETS
    from moescope.parallel import step_balance as sb

    e, w = shape["n_experts"], shape["world"]
    layers = sorted(int(k) for k in ranks[0]["start"])
    fleet, measured = fleet_steps(ranks, len(layers), e)
    in_use = {1: ranks[0]["start"]}
    for ev in ranks[0]["rearrangements"]:
        in_use[ev["step"]] = ev["layers"]
    sim = sb.StepBalance(layers, e, buckets=STEP_BALANCE_BUCKETS, ep_sizes=(w,), placements=("plan",),
                         redundant={w: w * shape["slots"] - e},
                         schedule=sb.Schedule(window=HORIZON * every, every=every, first=every - 1),
                         plan_min_gain=0.0) if every else None
    if sim is not None:  # from the runtime's own start, as its EPLB in the loop
        sim.start_from("plan", w, w * shape["slots"] - e,
                       sb.from_ranks("plan", [ranks[0]["start"][str(layer)] for layer in layers], e).phy2log)
    rows, placements_equal, bound_ok, worst_dev = [], [], True, 0.0
    current = None
    for t in range(1, len(fleet) + 1):
        current = in_use.get(t, current)
        lay = sb.from_ranks("in_use", [current[str(layer)] for layer in layers], e)
        predicted = sb.rank_loads(fleet[t - 1][None].astype(np.float32), lay)[0]  # [L, W]
        sim_lay = sim._acc[("plan", w, w * shape["slots"] - e)].layout if sim else None
        for i, layer in enumerate(layers):
            got = measured.get((t, layer))
            if got is None:
                continue
            dev = np.abs(np.asarray(got) - predicted[i])
            replicated = [sum(1 for x in current[str(layer)][r]
                              if sum(x in held for held in current[str(layer)]) > 1) for r in range(w)]
            bound_ok &= bool((dev < w * np.asarray(replicated) + 1e-9).all() | (dev < 1e-9).all())
            worst_dev = max(worst_dev, float(dev.max()))
            row = {"step": t, "layer": layer, "measured": got, "predicted": [round(float(v), 4) for v in predicted[i]]}
            if sim_lay is not None:
                row["simulated"] = [round(float(v), 4) for v in sb.rank_loads(
                    fleet[t - 1][None].astype(np.float32), sim_lay)[0][i]]
            rows.append(row)
        if sim is not None:
            if t in in_use and t > 1:  # the runtime rearranged before step t: the simulation did too
                placements_equal.append(_per_rank(sim_lay, len(layers)) == [
                    [sorted(x) for x in current[str(layer)]] for layer in layers])
            sim.observe_counts(fleet[t - 1][None].astype(np.float32), 1, fleet[t - 1].astype(np.float64))
    return {"steps": len(fleet), "rows": rows, "exact": all(r["measured"] == r["predicted"] for r in rows),
            "fleet": fleet.tolist(), "start": ranks[0]["start"], "rearranged": ranks[0]["rearrangements"],
            "max_abs_deviation": worst_dev, "within_dealing_bound": bound_ok,
            "rearrangements": [ev["step"] for ev in ranks[0]["rearrangements"]],
            "simulated_placements_equal": placements_equal, **_stragglers(rows, every)}


def _per_rank(layout, n_layers: int) -> list:
    per = layout.phy2log.shape[1] // layout.ep
    return [[sorted(int(x) for x in layout.phy2log[i, r * per:(r + 1) * per] if x >= 0) for r in range(layout.ep)]
            for i in range(n_layers)]


def _straggler(rows: list[dict], key: str) -> float | None:
    b = sum(max(r[key]) for r in rows)
    m = sum(sum(r[key]) / len(r[key]) for r in rows)
    return round(b / m, 4) if m else None


def _stragglers(rows: list[dict], every: int) -> dict:
    after = [r for r in rows if not every or r["step"] >= every]
    out = {"straggler_measured": _straggler(after, "measured"), "straggler_predicted": _straggler(after, "predicted"),
           "straggler_steps": len({r["step"] for r in after})}
    if every:
        out["straggler_simulated"] = _straggler(after, "simulated")
    return out


def markdown(report: dict) -> str:
    lines = ["| shape | ranks | run | rank steps (step-layers) | rows measured vs predicted | straggler measured / "
             "predicted / simulated (steps) | simulated placements = runtime's |", "|---|---|---|---|---|---|---|"]
    for name, s in report["shapes"].items():
        what = f"{s['n_experts']} experts top-{s['top_k']}, {s['moe_layers']} MoE layers"
        for run, r in s["runs"].items():
            sim = r.get("straggler_simulated")
            eq = r.get("simulated_placements_equal")
            rows = ("equal, every one" if r["exact"] else
                    f"within {s['world']} slots per replicated expert held: "
                    f"{'yes' if r['within_dealing_bound'] else 'NO'} (max {r['max_abs_deviation']:g})")
            lines.append(f"| {name}: {what} | {s['world']} | {run} | {r['steps']} ({len(r['rows'])}) | {rows} | "
                         f"{r['straggler_measured']} / {r['straggler_predicted']} / {sim if sim is not None else '-'} "
                         f"({r['straggler_steps']}) | {'-' if not eq else f'{sum(eq)} of {len(eq)}'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = _results.parser(__doc__, quick="shape A only (CI keeps the script working)")
    ap.add_argument("--markdown", metavar="RESULTS", default=None, help="print the docs' table and exit (no run)")
    args = _results.parse(ap, argv, "step-balance")
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())), end="")
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = {"benchmark": "step-balance", "horizon": HORIZON, "shapes": {}}
    for name in _results.track(["A"] if args.quick else list(SHAPES), "step-balance: static and EPLB runs per shape"):
        shape = SHAPES[name]
        runs = {"static": compare(shape, serve(shape, 0), 0),
                f"eplb every {shape['every']}": compare(shape, serve(shape, shape["every"]), shape["every"])}
        report["shapes"][name] = {**shape, "runs": runs}
        for run, r in runs.items():
            print(f"shape {name} {run}: {r['steps']} steps, equal {r['exact']}, max deviation {r['max_abs_deviation']}"
                  f", straggler measured {r['straggler_measured']} predicted {r['straggler_predicted']} simulated "
                  f"{r.get('straggler_simulated')}, placements equal {r.get('simulated_placements_equal')}")
    _results.save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
