"""moescope's EPLB placement (parallel/eplb_policy.py, a numpy port) equals vLLM's default policy's on the same load:
the physical-to-logical map ``DefaultEplbPolicy.rebalance_experts`` returns and the replica counts vLLM derives from it
(``eplb_state.compute_logical_maps``), over loads with ties, several layers, hierarchical cases (groups packed onto
nodes), the global fallback (groups not dividing the nodes), no redundant experts and an old map to preserve slots.
Run in the vLLM environment (vLLM's own classes, imported there), for each installed release."""

from __future__ import annotations

import json
import subprocess

import pytest

from vllm_server import VLLM_PYTHON

pytestmark = pytest.mark.vllm

SCRIPT = r"""
import json, sys
import numpy as np, torch
from vllm.distributed.eplb.policy.default import DefaultEplbPolicy
from vllm.distributed.eplb.eplb_state import compute_logical_maps
from moescope.parallel import eplb_policy

rng = np.random.default_rng(0)
cases = []
def add(name, weight, replicas, groups, nodes, ranks, old=None):
    cases.append((name, np.asarray(weight, dtype=np.float64), replicas, groups, nodes, ranks, old))

add("global skewed", rng.zipf(1.6, size=(3, 16)).clip(max=500), 20, 1, 1, 4)
add("global ties", np.full((2, 12), 7.0), 16, 1, 1, 4)
add("integer ties", rng.integers(0, 4, size=(4, 32)), 40, 1, 1, 8)
add("hierarchical 4 groups on 2 nodes", rng.integers(0, 1000, size=(3, 16)), 24, 4, 2, 4)
add("hierarchical 8 groups on 4 nodes", rng.integers(0, 1000, size=(2, 64)), 80, 8, 4, 8)
add("deepseek-like 8 groups, 1 node", rng.gamma(0.5, 100, size=(4, 256)).round(), 288, 8, 1, 32)
add("groups not dividing nodes: global", rng.integers(0, 50, size=(2, 24)), 30, 3, 2, 6)
add("no redundant experts", rng.integers(0, 100, size=(2, 16)), 16, 1, 1, 4)
old = eplb_policy.rebalance(rng.integers(0, 100, size=(3, 16)), 20, 1, 1, 4)
add("with the old map", rng.integers(0, 100, size=(3, 16)), 20, 1, 1, 4, old)

out = []
for name, w, replicas, groups, nodes, ranks, old in cases:
    theirs = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(w), replicas, groups, nodes, ranks,
                                                 None if old is None else torch.from_numpy(old))
    _, their_cnt = compute_logical_maps(theirs, w.shape[1])
    ours = eplb_policy.rebalance(w, replicas, groups, nodes, ranks, old=old)
    cnt = eplb_policy.replica_counts(ours, w.shape[1])
    out.append({"case": name, "map_equal": bool(np.array_equal(theirs.numpy(), ours)),
                "counts_equal": bool(np.array_equal(their_cnt.numpy(), cnt)),
                "replicated": int((cnt > 1).sum())})
print(json.dumps(out))
"""


def test_moescope_places_as_vllms_default_policy():
    if not VLLM_PYTHON.exists():
        pytest.skip("no vLLM environment here (make vllm-env)")
    proc = subprocess.run([str(VLLM_PYTHON), "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(cases) == 9
    for c in cases:
        assert c["map_equal"] and c["counts_equal"], c
    assert sum(c["replicated"] > 0 for c in cases) >= 7  # the loads replicate experts (not the trivial case)
