"""[eplb] What the step-level prediction shows while a real vLLM server serves (a vLLM-pass helper, run inside a
watch of tests/vllm_watch.py: its Prometheus and trace store): the exposition's ``moescope_ep_*`` families, every
query of the Grafana row (grafana.expert_parallel, as dashboards/moescope-cache-a2a.json holds it) against that
Prometheus, and `plan-placement` on the store
(text and JSON). tests/test_vllm_ep.py asserts on it."""

from __future__ import annotations

import json
import urllib.request

from conftest import ROOT
from helpers import run_cli

ROW = ("Would EP", "Straggler factor", "Placement in use")  # the row's panel titles (grafana.expert_parallel)


def ep_views(prom, port: int, path, model: str = "tiny", ranks: int = 4) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    families = sorted({line.split("{")[0].split(" ")[0] for line in text.splitlines()
                       if line.startswith("moescope_ep_")})
    queries = {}
    # the row as a user imports it (dashboards/*.json; tests/test_dashboards.py keeps it what grafana.py builds)
    doc = json.loads((ROOT / "dashboards" / "moescope-cache-a2a.json").read_text())
    for panel in doc["panels"]:
        if panel["title"].startswith(ROW):
            for t in panel["targets"]:
                q = t["expr"].replace("$model", model).replace("$rank", ".*").replace("$__rate_interval", "20s")
                queries[q] = len(prom.query(q))
    out = path.parent / "placement"
    plan = run_cli("plan-placement", "--ranks", str(ranks), "--traces", str(path), "--out", str(out), timeout=300)
    plan_json = run_cli("plan-placement", "--ranks", str(ranks), "--traces", str(path), "--out", str(out), "--json",
                        timeout=300)
    return {"families": families, "queries": queries, "plan": (plan.returncode, plan.stdout, plan.stderr),
            "plan_json": (plan_json.returncode, plan_json.stdout, plan_json.stderr)}
