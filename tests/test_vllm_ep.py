"""[eplb] The step-level prediction on a real vLLM server (the CPU build, one process, the plugin): read from the
hot-expert watch the alert tests already serve (tests/vllm_watch.py, Qwen3-MoE 16 experts top-2, every request
stored, a real Prometheus scraping the exporter; no server of its own): the prediction's series are exported, every
query of the Grafana row that needs no expert-parallel placement returns data from that Prometheus (the placement-in-
use panels need one: a single vLLM process runs none, and the CPU build cannot run EP; tests/test_dashboards.py's
2-rank demo answers them), and `plan-placement` on the store prints the verdict at EP 4 with an ``--eplb-config``
vLLM's own ``EPLBConfig`` accepts (built in the vLLM environment)."""

from __future__ import annotations

import json
import subprocess

import pytest

from test_vllm import _checkpoint, _needs_vllm  # noqa: F401 (the fixture applies here too)
from vllm_server import VLLM_PYTHON

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
SHARED = pytest.mark.xdist_group("vllm-watch-healthy-hot")  # the alert tests' watches (test_vllm_alerts.py)
NEEDS_PLACEMENT = ("in_use", "moescope_ep_rearrangement_straggler_ratio", "moescope_ep_rank_slots_total")


@SHARED
def test_the_step_level_prediction_on_a_real_vllm_server(vllm_watched):
    ep = vllm_watched("hot").ep
    for name in ("moescope_ep_step_max_over_mean_ratio_bucket", "moescope_ep_straggler_ratio",
                 "moescope_ep_straggler_stderr_ratio", "moescope_ep_average_max_over_mean_ratio",
                 "moescope_ep_sampled_steps_total", "moescope_ep_steps_total", "moescope_ep_eplb_schedule_steps"):
        assert name in ep["families"], ep["families"]
    answered = {q: n for q, n in ep["queries"].items() if not any(s in q for s in NEEDS_PLACEMENT)}
    assert len(answered) == 4 and all(answered.values()), ep["queries"]
    code, out, err = ep["plan"]
    assert code == 0, err[-2000:]
    assert "EP 4 linear: step max/mean p50" in out and "EPLB R=4 every 3000 steps" in out, out
    assert "Enable it with `--enable-expert-parallel --enable-eplb --eplb-config" in out or \
        "Not worth a rearrangement's cost" in out, out
    code, out, err = ep["plan_json"]
    assert code == 0, err[-2000:]
    step = json.loads(out)["step_level"]
    config = json.loads(step["flags"].split("'")[1])
    assert config == step["eplb_config"] == {"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 4}
    build = ("import json, sys; from vllm.config.parallel import EPLBConfig; c = EPLBConfig(**json.loads(sys.argv[1]));"
             " print(c.window_size, c.step_interval, c.num_redundant_experts)")
    check = subprocess.run([str(VLLM_PYTHON), "-c", build, json.dumps(config)], capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0 and check.stdout.split()[-3:] == ["1000", "3000", "4"], check.stderr[-2000:]
