"""EPLB in the loop: a skewed workload served with a static placement and with live rearrangement, side by side.

Each round runs `moescope demo --world-size 2 --scenario imbalance --rate 0 --canary-interval 0` twice, in
alternating order: once on the round-robin placement as it is (static), once with `--rebalance-steps K
--rebalance-slots S` (every K steps the ranks plan a placement from the fleet's live counts of the last windows,
spare slots replicating hot experts, and move the weights of the layers the plan improves while serving).

Per-rank load max/mean: the busiest rank's rows over the mean rank's (TensorRT-LLM's form), measured from the
exchanges' split sizes, worst MoE layer. Per configuration, the medians over the rounds of:
- static: the whole run, and steps K to the end (`--measure-from-step K`: the same steps as EPLB's "end of run");
- EPLB: the whole run; steps K to the end (from its first rearrangement to the end of the run: its end-of-run
  figure); for each rearrangement the max/mean measured before it (since the last one), predicted by the planner
  (on the counts it planned from) and measured after it (until the next one, or the end of the run: the run's
  drain, a few steps), with the steps and slots that measure rests on, experts moved, layers kept, seconds;
- throughput (output tokens/s, summed over the ranks) and its ratio to static.
Greedy decoding: both configurations route the same tokens in the same steps (the rows per layer add up alike),
so every max/mean is the same each round; the rounds are for the throughput. Two ranks share this machine's
cores: throughput says what the rearrangements cost here, not what balance buys on real accelerators.

The canary is off: its fixed batch runs on every rank every 32 steps through the same exchanges (at
deepseek-v3-shape up to half of a run's rows, one batch at a time), and the exported per-rank load
(`moescope_rank_load_max_over_mean_ratio`) leaves it out; here the figures are the served traffic's.

    python benchmarks/eplb.py [--rounds 7] [--requests 192] [--every 40] [--slots 5]   # tiny-demo (~5 min)
    python benchmarks/eplb.py --model deepseek-v3-shape       # 96 requests, every 20 steps, 144 slots, 3 rounds:
                                                             # ~9 min on 2 cores -> eplb-deepseek-v3-shape.json
    python benchmarks/eplb.py --quick     # 1 round, 12 requests, every 10 (CI: it still runs) -> eplb-quick.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import _results

# Per model: requests, rearrangement period (steps), slots per rank (experts / 2 ranks + spares), rounds.
# tiny-demo: one run of 192 requests takes ~20 s (about 250 steps, 6 rearrangements): 7 rounds in ~5 minutes.
# deepseek-v3-shape: one run of 96 requests takes ~1.5 min on 2 shared cores (141 steps, 7 rearrangements): 3
# rounds (6 runs) in ~9 minutes.
DEFAULTS = {"tiny-demo": {"requests": 192, "every": 40, "slots": 5, "rounds": 7},
            "deepseek-v3-shape": {"requests": 96, "every": 20, "slots": 144, "rounds": 3}}
QUICK = {"requests": 12, "every": 10}


def demo(model: str, requests: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "moescope", "demo", "--json", "--no-tui", "--rate", "0", "--metrics-port", "-1",
           "--traces", "none", "--canary-interval", "0", "--world-size", "2", "--scenario", "imbalance",
           "--model", model, "--requests", str(requests), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout)


def worst(per_layer: dict | None) -> float | None:
    return max(per_layer.values()) if per_layer else None


def slots_per_layer(rows: dict | None) -> float | None:
    return round(sum(map(sum, rows.values())) / len(rows), 1) if rows else None


def figures(s: dict) -> dict:
    r0 = s["ranks"][0]  # every rank measures the same per-rank loads (the exchanges' split sizes)
    out = {"tokens_per_s": s["tokens_per_s"], "steps": r0["steps"], "measure_from_step": r0["measure_from_step"],
           "max_over_mean_run": worst(r0["rank_max_over_mean_run"]),
           "max_over_mean_from": worst(r0["rank_max_over_mean_from"]),
           "slots_per_layer_run": slots_per_layer(r0["rank_rows_run"]),
           "slots_per_layer_from": slots_per_layer(r0["rank_rows_from"])}
    events = r0.get("rebalances")
    if events is not None:
        out["rearrangements"] = [{"step": e["step"], "before": worst(e["before"]), "predicted": worst(e["predicted"]),
                                  "measured": worst(e["measured"]), "measured_steps": e["measured_steps"],
                                  "measured_slots_per_layer": e["measured_slots_per_layer"],
                                  "moved_experts": e["moved_experts"], "kept_layers": e["kept_layers"],
                                  "layers": len(e["predicted"]), "seconds": e["seconds"]} for e in events]
        out.update(rebalances=len(events), moved_experts=sum(e["moved_experts"] for e in events),
                   rebalance_s=round(statistics.median(e["seconds"] for e in events), 4) if events else None)
        if events:
            first = out["rearrangements"][0]
            out.update(before=first["before"], predicted=first["predicted"], measured=first["measured"])
    return out


def med(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    if not vals:
        return None
    m = statistics.median(vals)
    return int(m) if all(isinstance(v, int) for v in vals) and m == int(m) else round(m, 4)


def medians(rows: list[dict]) -> dict:
    """Per figure, the median over the rounds; per rearrangement (by its place in the run), likewise."""
    out = {k: med(rows, k) for k in rows[0] if k != "rearrangements"}
    if "rearrangements" in rows[0]:
        n = min(len(r["rearrangements"]) for r in rows)
        out["rearrangements"] = [{k: med([r["rearrangements"][i] for r in rows], k)
                                  for k in rows[0]["rearrangements"][i]} for i in range(n)]
    return out


def num(v) -> str:
    return "-" if v is None else f"{v:g}"


def markdown(report: dict, results: str = "benchmarks/results/eplb.json") -> str:
    """The docs' table, every figure from the results file."""
    st, ep = report["static"], report["eplb"]
    k, end = report["rebalance_steps"], st["steps"]
    rows = [
        (f"per-rank max/mean, whole run (steps 1-{num(end)})", st["max_over_mean_run"], ep["max_over_mean_run"]),
        (f"per-rank max/mean, steps {k}-{num(end)} (EPLB: from its first rearrangement to the end of the run)",
         st["max_over_mean_from"], ep["max_over_mean_from"]),
        (f"slots per MoE layer in steps {k}-{num(end)} (whole run)",
         f"{num(st['slots_per_layer_from'])} ({num(st['slots_per_layer_run'])})",
         f"{num(ep['slots_per_layer_from'])} ({num(ep['slots_per_layer_run'])})"),
        (f"EPLB's end of run against static on steps {k}-{num(end)}", "-", report["eplb_end_vs_static"]),
        ("EPLB's end of run against the first rearrangement's prediction", "-",
         report["eplb_end_vs_first_prediction"]),
    ]
    for e in ep.get("rearrangements", []):
        rows.append((f"rearrangement at step {num(e['step'])}", "-",
                     f"{num(e['before'])} / {num(e['predicted'])} / {num(e['measured'])} "
                     f"({num(e['measured_steps'])} steps, {num(e['measured_slots_per_layer'])} slots); "
                     f"{num(e['moved_experts'])} moved, {num(e['kept_layers'])} of {num(e['layers'])} kept"))
    rows += [
        ("rearrangements per run, experts moved in all", "0, 0",
         f"{num(ep['rebalances'])}, {num(ep['moved_experts'])}"),
        ("rearrangement seconds, median (fleet counts, plan, weight moves)", "-", ep["rebalance_s"]),
        ("throughput, output tokens/s (both ranks)", st["tokens_per_s"], ep["tokens_per_s"]),
        ("throughput ratio, EPLB / static", 1, report["throughput_ratio_eplb_over_static"]),
    ]
    lines = [f"{report['model']}, {report['world_size']} gloo ranks, scenario {report['scenario']}, "
             f"{report['requests']} requests at once, canary off; EPLB every {k} steps, "
             f"{report['rebalance_slots']} slots per rank, planning on the last {report['rebalance_horizon']} "
             f"windows, a layer moving for a predicted gain over {report['rebalance_min_gain']:g}; max/mean: busiest "
             f"rank's rows / the mean rank's, worst MoE layer; each rearrangement: max/mean measured before it / "
             "predicted by the planner / measured after it (until the next one or the end of the run: the steps "
             "and slots per MoE layer that figure rests on), experts moved, layers that kept their placement; "
             f"medians of {report['rounds']} rounds ({results}).", "",
             "| figure | static round-robin | EPLB in the loop |", "|---|---|---|"]
    lines += [f"| {name} | {num(a) if not isinstance(a, str) else a} | {num(b) if not isinstance(b, str) else b} |"
              for name, a, b in rows]
    return "\n".join(lines) + "\n"


def relative(a: float | None, b: float | None) -> str | None:
    """a against b, as a signed percentage."""
    return None if a is None or not b else f"{100 * (a / b - 1):+.1f}%"


def main(argv: list[str] | None = None) -> int:
    from moescope.parallel.eplb import Rebalancer

    ap = _results.parser(__doc__, quick="1 round, 12 requests, every 10 steps (CI keeps the script working)",
                         rounds=DEFAULTS["tiny-demo"]["rounds"])  # (deepseek-v3-shape: 3)
    ap.add_argument("--model", choices=sorted(DEFAULTS), default="tiny-demo",
                    help="tiny-demo (8 experts; 7 rounds) or deepseek-v3-shape (256 experts, 58 MoE layers; 3 "
                         "rounds) -> results/eplb.json, results/eplb-deepseek-v3-shape.json")
    ap.add_argument("--requests", type=int, default=None, help="[tiny-demo 192, deepseek-v3-shape 96]")
    ap.add_argument("--every", type=int, default=None, help="--rebalance-steps [tiny-demo 40, deepseek-v3-shape 20]")
    ap.add_argument("--slots", type=int, default=None,
                    help="--rebalance-slots [tiny-demo 5 (8 experts, 4 per rank), deepseek-v3-shape 144 (128 + 16)]")
    ap.add_argument("--markdown", metavar="RESULTS", default=None,
                    help="print the docs' table from a results file and exit (no run)")
    model = ap.parse_known_args(argv)[0].model
    ap.set_defaults(full_rounds=DEFAULTS[model]["rounds"])  # (--rounds wins; --quick: 1)
    args = _results.parse(ap, argv, lambda a: "eplb" if a.model == "tiny-demo" else f"eplb-{a.model}")
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text()), args.markdown), end="")
        return 0
    given = {k: getattr(args, k) for k in ("requests", "every", "slots")}
    defaults = {**DEFAULTS[args.model], **(QUICK if args.quick else {})}
    requests, every, slots = (given[k] or defaults[k] for k in ("requests", "every", "slots"))
    configs = {"static": ["--measure-from-step", str(every)],
               "eplb": ["--rebalance-steps", str(every), "--rebalance-slots", str(slots)]}
    rows: dict[str, list[dict]] = {name: [] for name in configs}
    for i in _results.track(range(args.rounds), f"eplb {args.model}: static and EPLB runs, interleaved rounds"):
        order = list(configs) if i % 2 == 0 else list(reversed(configs))  # alternate: drift hits both alike
        for name in order:
            rows[name].append(figures(demo(args.model, requests, configs[name])))
        print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{n} {rows[n][-1]['tokens_per_s']} tok/s" for n in order))
    static, eplb = medians(rows["static"]), medians(rows["eplb"])
    defaults_rb = Rebalancer(every)
    report = {"model": args.model, "world_size": 2, "scenario": "imbalance", "requests": requests, "canary": "off",
              "rounds": args.rounds, "rebalance_steps": every, "rebalance_slots": slots,
              "rebalance_horizon": defaults_rb.horizon, "rebalance_min_gain": defaults_rb.min_gain,
              "static": static, "eplb": eplb,
              "eplb_end_vs_static": relative(eplb["max_over_mean_from"], static["max_over_mean_from"]),
              "eplb_end_vs_first_prediction": relative(eplb["max_over_mean_from"], eplb.get("predicted")),
              "throughput_ratio_eplb_over_static": round(eplb["tokens_per_s"] / static["tokens_per_s"], 4),
              "per_round": rows,
              "note": "max/mean: busiest rank's rows over the mean rank's, worst MoE layer. run: the whole run; "
                      "from: steps rebalance_steps to the end (EPLB: from its first rearrangement on, its end-of-run "
                      "figure; static: the same steps); per rearrangement: before (since the last one), predicted "
                      "(the planner's, on the counts it planned from), measured (until the next one or the end)"}
    lines = [f"per-rank max/mean (worst layer), {args.model}, medians of {args.rounds} rounds:",
             f"  static: whole run {static['max_over_mean_run']}, steps {every}-end {static['max_over_mean_from']}",
             f"  EPLB: whole run {eplb['max_over_mean_run']}, steps {every}-end (end of run) "
             f"{eplb['max_over_mean_from']} ({report['eplb_end_vs_static']} against static, "
             f"{report['eplb_end_vs_first_prediction']} against the first prediction)"]
    lines += [f"    step {e['step']}: before {e['before']}, predicted {e['predicted']}, measured after {e['measured']} "
              f"({e['measured_steps']} steps, {e['measured_slots_per_layer']} slots/layer); {e['moved_experts']} "
              f"moved, {e['kept_layers']}/{e['layers']} layers kept, {e['seconds']} s"
              for e in eplb.get("rearrangements", [])]
    lines.append(f"  throughput: static {static['tokens_per_s']} tok/s, EPLB {eplb['tokens_per_s']} tok/s "
                 f"(x{report['throughput_ratio_eplb_over_static']})")
    print("\n".join(lines))
    _results.save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
