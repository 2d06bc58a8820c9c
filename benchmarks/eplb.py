"""EPLB in the loop: a skewed workload served with a static placement and with live rearrangement, side by side.

Each round runs `moescope demo --world-size 2 --scenario imbalance` twice, in alternating order: once on the
round-robin placement as it is (static), once with `--rebalance-steps K --rebalance-slots S` (the ranks plan a
placement from the fleet's live counts every K steps, spare slots replicating hot experts, and move the weights
while serving). Per configuration, the medians over the rounds of: per-rank load max/mean (busiest rank's rows /
the mean rank's, TensorRT-LLM's form; measured from the exchanges' split sizes, worst MoE layer), for the
rebalanced run the first rearrangement's max/mean measured before it, predicted by the planner, and measured
after it (until the next one), its seconds, and throughput (output tokens/s, summed over the ranks) with its
ratio to static. Two ranks share this machine's cores: throughput says what the rearrangement costs here, not
what balance buys on real accelerators.

    python benchmarks/eplb.py [--rounds 7] [--requests 48] [--every 40] [--slots 5]
    python benchmarks/eplb.py --quick     # 1 round, 12 requests (CI: the script still runs) -> eplb-quick.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import _results


def demo(requests: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "moescope", "demo", "--json", "--no-tui", "--rate", "0", "--metrics-port", "-1",
           "--traces", "none", "--world-size", "2", "--scenario", "imbalance", "--requests", str(requests), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout)


def worst(per_layer: dict | None) -> float | None:
    return max(per_layer.values()) if per_layer else None


def figures(s: dict) -> dict:
    r0 = s["ranks"][0]  # every rank measures the same per-rank loads (the exchanges' split sizes)
    out = {"tokens_per_s": s["tokens_per_s"], "max_over_mean_end": worst(r0["rank_max_over_mean"])}
    events = r0.get("rebalances") or []
    if events:
        first = events[0]
        out.update(rebalances=len(events), rebalance_s=first["seconds"], moved_experts=first["moved_experts"],
                   before=worst(first["before"]), predicted=worst(first["predicted"]),
                   measured=worst(first["measured"]))
    return out


def med(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(vals), 4) if vals else None


def markdown(report: dict) -> str:
    """The docs' table, every figure from the results file."""
    st, ep = report["static"], report["eplb"]
    rows = [
        ("per-rank max/mean, measured (whole run / before the first rearrangement)", st["max_over_mean_end"],
         ep["before"]),
        ("per-rank max/mean predicted by the planner for the new placement", "-", ep["predicted"]),
        ("per-rank max/mean measured after it (until the next one)", "-", ep["measured"]),
        ("rearrangement seconds (fleet counts, plan, weight moves)", "-", ep["rebalance_s"]),
        ("experts moved in the first rearrangement", "-", ep["moved_experts"]),
        ("rearrangements per run", 0, ep["rebalances"]),
        ("throughput, output tokens/s (both ranks)", st["tokens_per_s"], ep["tokens_per_s"]),
        ("throughput ratio, EPLB / static", 1, report["throughput_ratio_eplb_over_static"]),
    ]
    lines = [f"{report['model']}, {report['world_size']} gloo ranks, scenario {report['scenario']}, "
             f"{report['requests']} requests per run; EPLB every {report['rebalance_steps']} steps, "
             f"{report['rebalance_slots']} slots per rank; medians of {report['rounds']} rounds "
             "(benchmarks/results/eplb.json).", "",
             "| figure | static round-robin | EPLB in the loop |", "|---|---|---|"]
    lines += [f"| {name} | {a} | {b} |" for name, a, b in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = _results.parser(__doc__, quick="1 round, 12 requests (CI keeps the script working)", rounds=7)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--every", type=int, default=40, help="--rebalance-steps")
    ap.add_argument("--slots", type=int, default=5, help="--rebalance-slots (tiny-demo: 8 experts, 4 per rank)")
    ap.add_argument("--markdown", metavar="RESULTS", default=None,
                    help="print the docs' table from a results file and exit (no run)")
    args = _results.parse(ap, argv, "eplb")
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())), end="")
        return 0
    if args.quick:
        args.requests, args.every = 12, 10
    configs = {"static": [], "eplb": ["--rebalance-steps", str(args.every), "--rebalance-slots", str(args.slots)]}
    rows: dict[str, list[dict]] = {name: [] for name in configs}
    for i in _results.track(range(args.rounds), "eplb: static and EPLB runs, interleaved rounds"):
        order = list(configs) if i % 2 == 0 else list(reversed(configs))  # alternate: drift hits both alike
        for name in order:
            rows[name].append(figures(demo(args.requests, configs[name])))
        print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{n} {rows[n][-1]['tokens_per_s']} tok/s" for n in order))
    static, eplb = ({k: med(rows[n], k) for k in rows[n][0]} for n in ("static", "eplb"))
    report = {"model": "tiny-demo", "world_size": 2, "scenario": "imbalance", "requests": args.requests,
              "rounds": args.rounds, "rebalance_steps": args.every, "rebalance_slots": args.slots,
              "static": static, "eplb": eplb,
              "throughput_ratio_eplb_over_static": round(eplb["tokens_per_s"] / static["tokens_per_s"], 4),
              "per_round": rows,
              "note": "max/mean: busiest rank's rows over the mean rank's, worst MoE layer; before, predicted and "
                      "measured refer to the first rearrangement (measured: until the next one)"}
    print("\n".join([
        f"per-rank max/mean (worst layer), medians of {args.rounds} rounds:",
        f"  static placement, whole run: {static['max_over_mean_end']}",
        f"  EPLB first rearrangement: measured before {eplb['before']}, predicted {eplb['predicted']}, measured "
        f"after {eplb['measured']}; {eplb['rebalance_s']} s, {eplb['moved_experts']} experts moved; "
        f"{eplb['rebalances']} rearrangements per run",
        f"  throughput: static {static['tokens_per_s']} tok/s, EPLB {eplb['tokens_per_s']} tok/s "
        f"(x{report['throughput_ratio_eplb_over_static']})"]))
    _results.save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
