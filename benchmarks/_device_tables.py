"""The docs' tables of the GPU figures (benchmarks/device_checks.sh's results files), printed from the files:

    python benchmarks/_device_tables.py --markdown benchmarks/results/router_kernel.json
    python benchmarks/_device_tables.py --markdown benchmarks/results/decode_step-cuda.json
    python benchmarks/_device_tables.py --markdown benchmarks/results/overhead-cuda.json

(benchmarks/_doc_tables.py keeps the docs' blocks equal to what these print.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def router_kernel(d: dict) -> list[str]:
    lines = [f"{d['device']}, torch {d['torch']}: the fused Triton router vs the torch router, per call (µs)", "",
             "| tokens | experts | k | torch µs | kernel µs | kernel / torch |", "|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        lines.append(f"| {r['tokens']} | {r['experts']} | {r['k']} | {r['torch_s'] * 1e6:.1f} | "
                     f"{r['kernel_s'] * 1e6:.1f} | {r['kernel_over_torch']:.2f} |")
    return lines


def decode_step(d: dict) -> list[str]:
    lines = [f"{d['device']}, torch {d['torch']}, {d['dtype'].removeprefix('torch.')}, medians of {d['rounds']} "
             f"rounds of {d['steps']} steps: one decode step, bare vs with routing capture", "",
             "| shape | batch | eager µs | eager + capture | graph µs | graph + counters | graph / eager |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        lines.append(f"| {r['shape']} | {r['batch']} | {r['eager_bare_s'] * 1e6:.0f} | {r['eager_ratio']:.3f}x | "
                     f"{r['graph_bare_s'] * 1e6:.0f} | {r['graph_ratio']:.3f}x | {1 / r['graph_speedup']:.2f} |")
    return lines


def overhead(d: dict) -> list[str]:
    lines = [f"{d['device']}, torch {d['torch']}, medians of {d['rounds']} interleaved rounds: serving time with "
             "moescope over bare (paired per round)", "",
             "| model | concurrency | bare s | metrics | metrics + traces | hook share of a step (traces) |",
             "|---|---:|---:|---:|---:|---:|"]
    for w in d["workloads"]:
        m, t = w["metrics"], w["metrics+traces"]
        lines.append(f"| {w['model']} | {w['concurrency']} | {w['bare_s']:.3f} | {m['ratio']:.3f}x | "
                     f"{t['ratio']:.3f}x | {t['hook_share_of_step']:.2%} |")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--markdown":
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[1])
    d = json.loads(path.read_text())
    render = (router_kernel if path.name.startswith("router_kernel") else
              decode_step if path.name.startswith("decode_step") else overhead)
    print("\n".join(render(d)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
