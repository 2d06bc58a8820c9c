"""Alerts on vLLM, end to end: a real vLLM server with the plugin -> a real Prometheus evaluating moescope's generated
rules -> a real Alertmanager (the repo's routing) -> a webhook. The faults live in the checkpoint itself (one
expert of one layer made hot by scaling its gate row; a layer whose gate sends nearly every token to the same
experts); healthy traffic on the healthy checkpoint delivers only the Watchdog. `top --once` and `diagnose
--prometheus` name the same layer and expert.

Qwen3-MoE with 16 experts at top-2 here: a hot expert can exceed 4x its fair share only where E/k > 4
(thresholds.hot_factor; at 8 experts top-2 an expert's share is capped at 4x and collapse is the alert for it).
"""

from __future__ import annotations

import json

import pytest

from test_vllm import _needs_vllm  # noqa: F401 (the fixture applies here too)
from vllm_watch import COLLAPSE_LAYER, HOT, ROUTING_ALERTS

# The watches are served once per session (tests/vllm_watch.py, tests/conftest.py ``vllm_watched``); the healthy and
# hot ones are shared with tests/test_vllm_diagnose.py, so those tests run on one pytest-xdist worker.
pytestmark = [pytest.mark.vllm, pytest.mark.integration]
SHARED = pytest.mark.xdist_group("vllm-watch-healthy-hot")


@SHARED
def test_healthy_traffic_delivers_only_the_watchdog(vllm_watched):
    alerts = vllm_watched("healthy").alerts
    names = {a["labels"]["alertname"] for _, a in alerts}
    assert "Watchdog" in names  # the path works end to end
    assert names == {"Watchdog"}, [(a["labels"], a["annotations"].get("summary")) for _, a in alerts]


def test_an_uneven_but_healthy_checkpoint_delivers_only_the_watchdog(vllm_watched, tmp_path_factory):
    """Issue [learned]: a checkpoint whose layers route unevenly from the start (its gates tilted into a ramp of
    loads, as trained models route), with the default settings (no baseline, the learned reference): nothing pages
    but the Watchdog. The checkpoint is uneven by HF's own recount of held-out text (vllm_models' build report),
    beyond what the calibrated checkpoint shows."""
    from test_vllm import _checkpoint
    from vllm_watch import BUILDS

    def built(name):
        return _checkpoint(tmp_path_factory, BUILDS[name][0], **BUILDS[name][1])

    uneven = json.loads((built("uneven") / "moescope_build.json").read_text())["max_over_mean"]
    calibrated = json.loads((built("healthy") / "moescope_build.json").read_text())["max_over_mean"]
    assert min(uneven.values()) > 1.5 * max(calibrated.values()), (uneven, calibrated)  # every layer uneven
    alerts = vllm_watched("uneven").alerts
    names = {a["labels"]["alertname"] for _, a in alerts}
    assert "Watchdog" in names
    assert names == {"Watchdog"}, [(a["labels"], a["annotations"].get("summary")) for _, a in alerts]


@SHARED
def test_a_hot_expert_in_the_checkpoint_pages_naming_it(vllm_watched):
    layer, expert, _ = HOT
    watched = vllm_watched("hot")
    alerts, (top, diag) = watched.alerts, watched.during
    hot = [a for _, a in alerts if a["labels"]["alertname"] == "MoEExpertHot" and a["status"] == "firing"]
    assert hot, [a["labels"]["alertname"] for _, a in alerts]
    assert {(a["labels"]["layer"], a["labels"]["expert"]) for a in hot} == {(str(layer), str(expert))}
    assert hot[0]["labels"]["model"] == "tiny"
    assert hot[0]["annotations"]["runbook_url"].endswith("/playbooks/MoEExpertHot.md")
    others = {a["labels"]["alertname"] for _, a in alerts} & ROUTING_ALERTS - {"MoEExpertHot"}
    assert not others, others
    assert top.returncode == 0 and f"L{layer}" in top.stdout and f"hot e{expert}" in top.stdout, top.stdout
    report = json.loads(diag.stdout)
    assert any("MoEExpertHot" in f["cause"] for f in report["findings"]), report["findings"]


def test_a_collapsed_layer_pages_critical(vllm_watched):
    alerts = vllm_watched("collapse").alerts
    collapse = [(path, a) for path, a in alerts if a["labels"]["alertname"] == "MoEExpertCollapse"
                and a["status"] == "firing"]
    assert collapse, [a["labels"]["alertname"] for _, a in alerts]
    assert {a["labels"]["layer"] for _, a in collapse} == {str(COLLAPSE_LAYER)}
    assert all(path == "/critical" for path, _ in collapse)
