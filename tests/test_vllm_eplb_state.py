"""moescope reads vLLM's own EPLB placement (moescope/vllm/eplb_state.py) from vLLM's own classes, built on CPU in the
vLLM environment (the CPU build cannot run expert parallelism: a worker dies with SIGSEGV under
``--tensor-parallel-size 2 --enable-expert-parallel``, and ``ParallelConfig`` refuses ``enable_eplb`` off CUDA/ROCm/
XPU). What runs: vLLM's ``EplbState`` (its ``__init__``), an ``EplbModelState`` holding vLLM's initial map
(``build_initial_global_physical_to_logical_map``) and the maps ``compute_logical_maps`` derives; a rearrangement as
``EplbState.step`` makes it: the host counter reset to 0, then ``DefaultEplbPolicy.rebalance_experts`` on a skewed
window and vLLM's ``_commit_eplb_maps``. The reader sees the change from the host counter alone, reads the maps
once per change (again while the commit settles), and the step-level prediction (parallel/step_balance.py) reports
the balance per rank before and after, equal to a naive recomputation.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from vllm_server import VLLM_PYTHON

pytestmark = pytest.mark.vllm

SCRIPT = r"""
import dataclasses, json
import numpy as np, torch
from types import SimpleNamespace
from vllm.config.parallel import ParallelConfig
from vllm.distributed.eplb.eplb_state import (EplbModelState, EplbState, _commit_eplb_maps,
                                              compute_logical_maps)
from vllm.distributed.eplb.policy.default import DefaultEplbPolicy
from moescope.metrics.catalogue import STEP_BALANCE_BUCKETS
from moescope.parallel import eplb_policy, step_balance as sb
from moescope.vllm.eplb_state import SETTLE_READS, VllmEplbReader, replica_counts

E, R, RANKS, LAYERS = 16, 4, 4, (3, 5, 7)
state = EplbState(ParallelConfig(), torch.device("cpu"))
initial = torch.tensor(EplbState.build_initial_global_physical_to_logical_map(E, R)).repeat(len(LAYERS), 1)
l2p, cnt = compute_logical_maps(initial.clone(), E)
given = {"physical_to_logical_map": initial.clone(), "physical_to_logical_map_buffer": initial.clone(),
         "logical_to_physical_map": torch.nn.functional.pad(l2p, (0, R + 1 - l2p.shape[-1]), value=-1),
         "logical_replica_count": cnt, "rebalanced": False, "model_name": "t",
         "model": SimpleNamespace(num_local_physical_experts=(E + R) // RANKS, num_physical_experts=E + R,
                                  num_logical_experts=E, num_expert_groups=1)}
fields = {f.name: given.get(f.name) for f in dataclasses.fields(EplbModelState)
          if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
ms = EplbModelState(**fields)
state.model_states["hash"] = ms
state.expert_rearrangement_step = 10
runner = SimpleNamespace(eplb_state=state)
reader = VllmEplbReader(lambda: runner, LAYERS, E)
out = {}
lay = reader.layout()
out["initial_equal"] = bool(np.array_equal(lay.phy2log, initial.numpy()))
out["ranks"], out["redundant"] = lay.ep, lay.redundant
out["counts_equal"] = bool(np.array_equal(replica_counts(ms), eplb_policy.replica_counts(lay.phy2log, E)))
p = reader.placement()
out["placement_rank0"] = [list(x) for x in p.layers[3]][0]

b = sb.StepBalance(LAYERS, E, buckets=STEP_BALANCE_BUCKETS, ep_sizes=(RANKS,), placements=("linear",),
                   in_use_source=reader.layout)
rng = np.random.default_rng(0)
def step():
    c = rng.integers(0, 3, size=(len(LAYERS), E)).astype(np.float32)
    c[:, 0] += 40  # expert 0 hot: on rank 0 under the initial map
    return c
before = [step() for _ in range(6)]
for c in before:
    b.observe_counts(c[None], 1, c)
    state.expert_rearrangement_step += 1
reads_before = reader.reads
# vLLM's rearrangement: the counter reset (EplbState.step), then the policy and the commit (EplbState.rearrange)
state.expert_rearrangement_step = 0
stale = reader.layout()  # a read between the reset and the commit: still the old map
out["stale_read_is_old"] = bool(np.array_equal(stale.phy2log, initial.numpy()))
window = torch.from_numpy(np.sum(before, axis=0).astype(np.int64))
new = DefaultEplbPolicy.rebalance_experts(window, E + R, 1, 1, RANKS, ms.physical_to_logical_map.clone())
_commit_eplb_maps(ms, new)
after = [step() for _ in range(5)]
for c in after:
    b.observe_counts(c[None], 1, c)
    state.expert_rearrangement_step += 1
for _ in range(SETTLE_READS + 2):
    reader.layout()
out["new_equal"] = bool(np.array_equal(reader.layout().phy2log, new.numpy()))
out["reads"] = reader.reads - reads_before
out["changes"] = reader.changes
snap = b.snapshot()
ev = snap.rearrangements[0]
out["event"] = {"step": ev.step, "before": ev.before, "after": ev.after, "after_steps": ev.after_steps}
out["rank_slots"] = list(snap.in_use_rank_slots)
out["old_map"], out["new_map"] = initial.tolist(), new.tolist()
out["before_counts"] = [c.tolist() for c in before]
out["after_counts"] = [c.tolist() for c in after]
print(json.dumps(out))
"""


def rank_loads(row, phy2log, ranks):
    """Slot by slot: each physical slot computes its logical expert's slots / that expert's replicas."""
    per = len(phy2log) // ranks
    reps = {e: sum(1 for x in phy2log if x == e) for e in set(phy2log)}
    return [sum(row[e] / reps[e] for e in phy2log[r * per:(r + 1) * per] if e >= 0) for r in range(ranks)]


def straggler(steps, phy2log, ranks):
    busiest = mean = 0.0
    for c in steps:
        for i, row in enumerate(c):
            loads = rank_loads(row, phy2log[i], ranks)
            busiest, mean = busiest + max(loads), mean + sum(loads) / ranks
    return busiest / mean


def test_reads_vllms_maps_and_reports_balance_before_and_after_a_rearrangement():
    if not VLLM_PYTHON.exists():
        pytest.skip("no vLLM environment here (make vllm-env)")
    proc = subprocess.run([str(VLLM_PYTHON), "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["initial_equal"] and out["counts_equal"] and out["ranks"] == 4 and out["redundant"] == 4
    assert out["placement_rank0"] == [0, 1, 2, 3, 4]  # vLLM's initial map: 0-3, then 4; the spares 0-3 on rank 3
    assert out["stale_read_is_old"] and out["new_equal"]
    assert out["changes"] == 1 and out["reads"] <= 4  # the maps copied on the change only (and while it settles)
    ev = out["event"]
    assert ev["step"] == 6 and ev["after_steps"] == 5
    assert ev["before"] == pytest.approx(straggler(out["before_counts"], out["old_map"], 4))
    assert ev["after"] == pytest.approx(straggler(out["after_counts"], out["new_map"], 4))
    assert ev["after"] < ev["before"]  # vLLM's policy spread the hot expert
    want = [sum(rank_loads(row, out["old_map"][i], 4)[r] for c in out["before_counts"] for i, row in enumerate(c))
            + sum(rank_loads(row, out["new_map"][i], 4)[r] for c in out["after_counts"] for i, row in enumerate(c))
            for r in range(4)]
    assert out["rank_slots"] == pytest.approx(want)
