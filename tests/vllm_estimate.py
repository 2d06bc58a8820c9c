"""vLLM's own estimate of what a step reads (``--enable-mfu-metrics``: vllm.v1.metrics.perf), for putting beside
moescope's measured experts touched (tests/test_vllm.py, benchmarks/efficiency.py's vLLM section).

vLLM estimates a MoE layer's routed-expert weight reads as ``min(tokens x k, E)`` experts ("FIXME: Assume perfect
load balancing for now", ``FfnMetrics.get_read_bytes_breakdown``), summed into
``vllm:estimated_read_bytes_per_gpu_total`` with attention, activations and the unembedding. Only the total is
exported, so the routed-weights part is computed here by vLLM's own code, in the vLLM environment, with the fields
the server's engine parsed from the model's config (its log line "Instantiated ComponentMetrics [ffn] with (...)").
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
from pathlib import Path

from moescope.traces import store

# The routed-weights part of vLLM's estimate, by vLLM's code (vllm.v1.metrics.perf.FfnMetrics,
# what `--enable-mfu-metrics` sums into vllm:estimated_read_bytes_per_gpu_total) for each step's token count, in the
# vLLM environment, with the very fields the server's engine parsed from the model's config (its log line
# "Instantiated ComponentMetrics [ffn] with (...)").
_VLLM_FFN = """
import json, sys
from vllm.v1.metrics.perf import ExecutionContext, FfnMetrics
fields, tokens = json.load(sys.stdin)
m = FfnMetrics(**fields)
out = []
for t in tokens:
    ctx = ExecutionContext()
    ctx.add(t, t, True)
    b = m.get_read_bytes_breakdown(ctx)
    out.append(b["routed_up_gate_weights"] + b["routed_down_weights"])
print(json.dumps(out))
"""


def vllm_ffn_fields(log: str) -> dict:
    """The FFN fields vLLM's MFU metrics parsed, from the server's log (``key=value`` pairs of its ffn line)."""
    line = next(x for x in log.splitlines() if "Instantiated ComponentMetrics [ffn] with (" in x)
    body = line.split("Instantiated ComponentMetrics [ffn] with (", 1)[1].rsplit(")", 1)[0]
    return {k: (float(v) if "." in v else int(v)) for k, v in re.findall(r"(\w+)=([0-9.]+)", body)}


def vllm_routed_bytes(fields: dict, tokens: list[int], python=None) -> list[int]:
    """vLLM's estimate of the routed experts' weight bytes of steps of ``tokens`` rows each (the code of the vLLM
    environment of ``python``; default: .vllm/)."""
    from vllm_server import VLLM_PYTHON

    run = subprocess.run([str(python or VLLM_PYTHON), "-c", _VLLM_FFN], input=json.dumps([fields, tokens]),
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(run.stdout.splitlines()[-1])


def touched_from_store(store_path: Path, only: set | None = None) -> tuple[dict, dict, set, set]:
    """The reference both read from a trace store (not the exporter's code): every stored token's experts grouped
    by the engine step that routed it (the step index the store keeps per row). Returns ({(step, layer): experts},
    {step: [phase, rows]}, the MoE layers, the request ids read); ``only``: those requests alone."""
    touched: dict[tuple[int, int], set] = collections.defaultdict(set)
    steps: dict[int, list] = {}
    layers: set[int] = set()
    seen: set[str] = set()
    conn = store.open_store(store_path)
    try:
        for r in store.iter_routed(conn):
            if only is not None and r.request_id not in only:
                continue
            seen.add(r.request_id)
            layers.update(r.layers)
            for row in range(r.n_routed):
                st = r.steps[r.step_of[row]]
                steps.setdefault(st["index"], [st["phase"], 0])[1] += 1
                for j, layer in enumerate(r.layers):
                    touched[(st["index"], layer)] |= {int(x) for x in r.ids[row, j] if x != r.n_experts}
    finally:
        conn.close()
    return touched, steps, layers, seen
