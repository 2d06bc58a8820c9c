"""Expert parallelism: per-rank tokens/s and the all-to-all share of the run at world sizes 1 and 2.

Runs `moescope demo --world-size W` (gloo, loopback, the tiny demo model, the same greedy requests) for each
world size in one go and prints, per rank, tokens/s, all-to-all seconds and their share of the run time.
On one 2-core machine the ranks share the cores, so this measures the exchange's cost and the slow-rank
view, not a speed-up.

    python benchmarks/parallel.py [--requests 24] [--worlds 1 2] [--out benchmarks/results/parallel.json]
    python benchmarks/parallel.py --quick    # 4 requests (CI: the script still runs) -> parallel-quick.json
"""

from __future__ import annotations

import json
import subprocess
import sys

import _results



def run(world: int, requests: int) -> dict:
    cmd = [sys.executable, "-m", "moescope", "demo", "--json", "--rate", "0", "--metrics-port", "-1",
           "--requests", str(requests), "--world-size", str(world)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = _results.parser(__doc__, quick="4 requests (CI keeps the script working)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    args = _results.parse(ap, argv, "parallel")
    if args.quick:
        args.requests = 4
    rows = []
    print(f"expert parallel demo (tiny-demo, gloo on loopback, {args.requests} requests, greedy)")
    print(f"{'world':>5} {'rank':>4} {'tokens/s':>9} {'all-to-all s':>13} {'share of run':>13} {'wall s':>7}")
    for w in _results.track(args.worlds, "parallel: one demo per world size"):
        s = run(w, args.requests)
        ranks = s.get("ranks") or [{"rank": 0, "tokens_per_s": s["tokens_per_s"], "all_to_all_s": 0.0,
                                    "all_to_all_share": 0.0}]
        for r in ranks:
            rows.append({"world_size": w, **r, "wall_s": s["wall_s"]})
            print(f"{w:>5} {r['rank']:>4} {r['tokens_per_s']:>9.1f} {r['all_to_all_s']:>13.3f} "
                  f"{r['all_to_all_share']:>12.1%} {s['wall_s']:>7.2f}")
    _results.save({"benchmark": "parallel", "requests": args.requests, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
