"""diagnose, baseline and trace sampling on real vLLM servers (the CPU build in .vllm/) with the plugin, and
docs/vllm.md's "Run it" block run as printed.

- A vLLM trace store holds no router scores (vLLM's capture function gives the chosen ids only: entropy, margin and
  gate weights NaN meaning "unknown"): `diagnose --traces` on the healthy checkpoint's store names nothing critical
  (never "NaN/Inf logits") and judges every layer; on the hot-gate checkpoint's store, with a baseline saved from
  the healthy one's (`baseline save --traces`), it names the hot layer and expert.
- Under the default sample rate (MOESCOPE_TRACE_SAMPLE unset: 0.1), every response id of 20 requests (completions
  and chats, streamed and not) either opens in `moescope trace` or is reported as served but not kept; a request
  sent with an ``X-Request-Id`` starting ``moescope-keep-`` is kept.

The stores are those the alert tests' watches wrote (tests/vllm_watch.py, served once per session and shared:
tests/conftest.py ``vllm_watched``): the healthy checkpoint (Qwen3-MoE, 16 experts top-2) served at the default
sample rate, with 64 requests of keep ids (so the default sample rate keeps all of them: the keep rule at work;
broad prompts, sampled, 24 tokens each) and 20 requests without one beside the alert test's broad traffic; the hot
one (one gate row of layer 2 scaled 4x: an expert can exceed the hot bar, 4x its fair share, only where E/k > 4)
with every request stored.
"""

from __future__ import annotations

import json
import time

import pytest

from conftest import ROOT
from helpers import run_cli
from moescope.traces import store
from test_vllm import _checkpoint, _needs_vllm  # noqa: F401 (the fixture applies here too)
from vllm_server import DEFAULT_ARGS, DEFAULT_ENV, VLLM_PYTHON
from vllm_watch import BUILDS, HOT, N_JUDGED, N_SAMPLED, table

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
SHARED = pytest.mark.xdist_group("vllm-watch-healthy-hot")  # the alert tests' watches (test_vllm_alerts.py)


def _diagnose(path, *extra) -> tuple[int, dict]:
    r = run_cli("diagnose", "--traces", str(path), "--json", *extra, timeout=300)
    assert r.returncode in (0, 1), r.stderr[-2000:]
    return r.returncode, json.loads(r.stdout)


@SHARED
def test_every_returned_id_opens_or_is_reported_not_kept(vllm_watched):
    healthy = vllm_watched("healthy")
    path, keep, sampled = healthy.store, healthy.keep, healthy.sampled
    kept, not_kept = table(path, "requests"), table(path, "sampled_out")
    assert set(keep) <= kept, sorted(set(keep) - kept)[:5]  # the keep ids: kept at the default rate
    assert all(rid.startswith("cmpl-" + store.KEEP_PREFIX) for rid in keep), keep[:3]
    assert len(set(sampled)) == N_SAMPLED
    assert set(sampled) <= kept | not_kept, sorted(set(sampled) - kept - not_kept)
    assert set(sampled) & not_kept  # at 10%, all 20 kept by chance: 1e-20
    for rid in sampled:
        r = run_cli("trace", rid, "--traces", str(path), "--plain", timeout=120)
        if rid in kept:
            assert r.returncode == 0 and f"request {rid}" in r.stdout, r.stderr
        else:
            err = r.stderr.strip()
            assert r.returncode == 2 and "no request" not in err and len(err.splitlines()) == 1, err
            assert "served" in err and "not kept" in err and "MOESCOPE_TRACE_SAMPLE=0.1" in err, err


@SHARED
def test_a_healthy_vllm_store_names_nothing_critical_and_judges_every_layer(vllm_watched):
    path = vllm_watched("healthy").store
    code, report = _diagnose(path)
    causes = {f["cause"]: f for f in report["findings"]}
    assert "nonfinite" not in causes, causes["nonfinite"]
    assert not [f for f in report["findings"] if f["severity"] == "critical"], report["findings"]
    judged = causes["judged"]["evidence"]
    assert judged["layers_judged"] == judged["layers"] == len(report["layers"]) > 0, judged
    assert report["requests"] >= N_JUDGED


@SHARED
def test_a_hot_gate_is_named_against_a_baseline_from_the_healthy_store(vllm_watched, tmp_path):
    layer, expert, _ = HOT
    base = tmp_path / "baseline.json"
    r = run_cli("baseline", "save", "--traces", str(vllm_watched("healthy").store), "--out", str(base), timeout=300)
    assert r.returncode == 0, r.stderr
    code, report = _diagnose(vllm_watched("hot").store, "--baseline", str(base))
    hot = [f for f in report["findings"] if f["cause"] == "hot-expert"]
    assert code == 1 and hot, report["findings"]
    assert hot[0]["evidence"]["reference"] == "baseline"
    assert (hot[0]["evidence"]["experts"][0]["layer"], hot[0]["evidence"]["experts"][0]["expert"]) == (layer, expert)
    assert {(e["layer"], e["expert"]) for e in hot[0]["evidence"]["experts"]} == {(layer, expert)}, hot[0]
    assert not [f for f in report["findings"] if f["cause"] == "nonfinite"]


def test_the_run_it_block_runs_as_written(tmp_path_factory, tmp_path):
    """docs/vllm.md's "Run it" block, every command of it as tests/doc_runs.yml runs it, against a real vLLM
    server of the healthy checkpoint started by the CPU build's launcher."""
    import doc_runner
    from servers import free_port

    arch, build = BUILDS["healthy"]
    model_dir = _checkpoint(tmp_path_factory, arch, **build)
    scratch = doc_runner.Scratch(tmp_path, free_port)
    scratch.env.update(DEFAULT_ENV)  # the CPU build's environment (tests/vllm_server.py): KV cache size, offline
    scratch.captured["vllm_launcher"] = (f"{VLLM_PYTHON} -m vllm.entrypoints.openai.api_server --model {model_dir} "
                                         + " ".join(DEFAULT_ARGS))
    ran = 0
    try:
        for c, e in doc_runner.pair(ROOT / "docs" / "vllm.md"):
            if e.skip or not e.vllm:
                continue
            for _attempt in range(e.retry + 1):
                run = scratch.run(c, e)
                problems = doc_runner.check(c, e, run, scratch)
                if not problems:
                    break
                time.sleep(0.5)
            assert not problems, "\n".join(problems)
            ran += 1
    finally:
        scratch.stop()
    assert ran == 4


def test_the_soak_benchmark_quick_runs(tmp_path):
    """benchmarks/vllm_soak.py --quick (CI keeps it working): both servers sampled all along, the same paced load
    served by each, the plugin on in one only, and every request the on server answered stored (sample 1): read
    back from the results file against its own raw samples."""
    import os
    import subprocess

    out = tmp_path / "soak.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOESCOPE_")}
    env["MOESCOPE_VLLM_PYTHON"] = str(VLLM_PYTHON)
    script = ROOT / "benchmarks" / "vllm_soak.py"
    r = subprocess.run([str(VLLM_PYTHON), str(script), "--quick", "--out", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    d = json.loads(out.read_text())
    assert "moescope: watching" in d["server"]["plugin_log_line"]
    samples = d["samples"]
    assert len(samples) >= 4 and all(s["off"]["rss"] and s["on"]["rss"] for s in samples)
    last = samples[-1]
    for name in ("off", "on"):
        assert last[name]["done"] > 0 and last[name]["errors"] == 0, last[name]
        assert last[name]["sent"] == last[name]["done"]  # the pool drained before the last sample
    assert d["traces"]["requests_stored"] == last["on"]["done"]
    total_end = sum(last["on"]["rss"].values()) / 2**20
    assert abs(d["summary"]["on"]["total"]["rss_end_mb"] - total_end) < 0.1
