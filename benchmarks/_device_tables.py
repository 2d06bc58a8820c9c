"""The docs' tables of the GPU figures (benchmarks/device_checks.sh's results files), printed from the files:

    python benchmarks/_device_tables.py --markdown benchmarks/results/router_kernel.json
    python benchmarks/_device_tables.py --markdown benchmarks/results/decode_step-cuda.json
    python benchmarks/_device_tables.py --markdown OUT/overhead-cuda.json

(benchmarks/_doc_tables.py keeps the docs' blocks equal to what these print, summary lines included: the docs'
prose quotes no device figure of its own.) benchmarks/results/ holds no overhead-cuda.json: device_checks.sh
writes one, but no logged run has produced it (docs/runtime.md), so no page prints that table.
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
    faster = [r["kernel_over_torch"] for r in d["rows"] if r["kernel_over_torch"] < 1]
    slower = [r for r in d["rows"] if r["kernel_over_torch"] >= 1]
    said = "; slower (kernel / torch >= 1) at " + ", ".join(
        f"T = {r['tokens']}, E = {r['experts']}, k = {r['k']} ({r['kernel_over_torch']:.2f})" for r in slower) \
        if slower else "; slower at no size"
    return lines + ["", f"The kernel is faster at {len(faster)} of {len(d['rows'])} sizes (kernel / torch "
                    f"{min(faster):.2f}-{max(faster):.2f}){said}." if faster else "The kernel is faster at no size."]


def decode_step(d: dict) -> list[str]:
    lines = [f"{d['device']}, torch {d['torch']}, {d['dtype'].removeprefix('torch.')}, medians of {d['rounds']} "
             f"rounds of {d['steps']} steps: one decode step, bare vs with routing capture", "",
             "| shape | batch | eager µs | eager + capture | graph µs | graph + counters | graph / eager |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        lines.append(f"| {r['shape']} | {r['batch']} | {r['eager_bare_s'] * 1e6:.0f} | {r['eager_ratio']:.3f}x | "
                     f"{r['graph_bare_s'] * 1e6:.0f} | {r['graph_ratio']:.3f}x | {1 / r['graph_speedup']:.2f} |")

    def span(xs: list[float]) -> str:
        return f"{(min(xs) - 1):+.1%} to {(max(xs) - 1):+.1%}"

    graph = [1 / r["graph_speedup"] for r in d["rows"]]
    return lines + ["", f"Capture's cost per decode step (one run of {d['rounds']} rounds per row): eager "
                    f"{span([r['eager_ratio'] for r in d['rows']])}, graph "
                    f"{span([r['graph_ratio'] for r in d['rows']])}; the CUDA graph takes a step to "
                    f"{min(graph):.2f}-{max(graph):.2f} of its eager time."]


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


RENDER = {"router_kernel": router_kernel, "decode_step": decode_step, "overhead": overhead}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--markdown":
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[1])
    render = next((fn for prefix, fn in RENDER.items() if path.name.startswith(prefix)), None)
    if render is None:
        print(f"no device table for {path.name} (router_kernel*, decode_step* or overhead*.json)", file=sys.stderr)
        return 2
    print("\n".join(render(json.loads(path.read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
