"""diagnose, baseline and trace sampling on real vLLM servers (the CPU build in .vllm/) with the plugin, and
docs/vllm.md's "Run it" block run as printed.

- A vLLM trace store holds no router scores (vLLM's capture function gives the chosen ids only: entropy, margin and
  gate weights NaN meaning "unknown"): `diagnose --traces` on the healthy checkpoint's store names nothing critical
  (never "NaN/Inf logits") and judges every layer; on the hot-gate checkpoint's store, with a baseline saved from
  the healthy one's (`baseline save --traces`), it names the hot layer and expert.
- Under the default sample rate (MOESCOPE_TRACE_SAMPLE unset: 0.1), every response id of 20 requests (completions
  and chats, streamed and not) either opens in `moescope trace` or is reported as served but not kept; a request
  sent with an ``X-Request-Id`` starting ``moescope-keep-`` is kept.

The checkpoints are test_vllm_alerts.py's (Qwen3-MoE, 16 experts top-2, one gate row of layer 2 scaled 4x: an
expert can exceed the hot bar, 4x its fair share, only where E/k > 4). The diagnose traffic is sent with keep ids
(so the default sample rate keeps all of it: the keep rule at work), broad prompts, sampled, 24 tokens each.
"""

from __future__ import annotations

import json
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import ROOT
from helpers import run_cli
from moescope.traces import store
from test_vllm import PROMPTS, _checkpoint, _needs_vllm  # noqa: F401 (the fixture applies here too)
from test_vllm_alerts import BUILDS, HOT
from vllm_server import DEFAULT_ARGS, DEFAULT_ENV, VLLM_PYTHON, serve

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

N_JUDGED = 64  # requests of diagnose traffic per store: a routing window's "tens of requests" (test_vllm_alerts)
N_SAMPLED = 20  # requests at the default sample rate whose ids are checked


def _keep_traffic(server, tag: str, n: int) -> list[str]:
    """``n`` completions with keep ids, 4 at a time; their response ids."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=300, max_retries=0)

    def one(i: int) -> str:
        r = client.completions.create(model=server.name, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=24,
                                      temperature=1.0, seed=i,
                                      extra_headers={"X-Request-Id": f"{store.KEEP_PREFIX}{tag}-{i}"})
        return r.id

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(n)))


def _sampled_traffic(server, n: int) -> list[str]:
    """``n`` requests without an id of the client's: completions and chats, streamed and not; their ids."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=300, max_retries=0)
    ids = []
    for i in range(n):
        prompt, kw = PROMPTS[i % len(PROMPTS)], {"max_tokens": 8, "temperature": 1.0, "seed": 100 + i}
        chat, stream = i % 2 == 1, i % 4 >= 2
        if chat:
            messages = [{"role": "user", "content": prompt}]
            if stream:
                ids.append([c.id for c in client.chat.completions.create(model=server.name, messages=messages,
                                                                          stream=True, **kw)][0])
            else:
                ids.append(client.chat.completions.create(model=server.name, messages=messages, **kw).id)
        elif stream:
            chunks = list(client.completions.create(model=server.name, prompt=prompt, stream=True, **kw))
            ids.append(chunks[0].id)
        else:
            ids.append(client.completions.create(model=server.name, prompt=prompt, **kw).id)
    return ids


def _table(path, table: str) -> set[str]:
    con = sqlite3.connect(path)
    try:
        return {r[0] for r in con.execute(f"SELECT request_id FROM {table}")}  # noqa: S608 (our own table names)
    finally:
        con.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Each checkpoint served with the plugin's defaults but the store (metrics and traces, sample 0.1): the
    healthy one's keep traffic and sampled requests, the hot one's keep traffic. {name: (store, keep ids,
    sampled ids)}."""
    out = {}
    base = tmp_path_factory.mktemp("vllm-diagnose")
    for name in ("healthy", "hot"):
        arch, build = BUILDS[name]
        model_dir = _checkpoint(tmp_path_factory, arch, **build)
        path = base / f"{name}.sqlite"
        server = serve(model_dir, {"MOESCOPE_TRACES": str(path)}, ["--no-enable-prefix-caching"], eager=True)
        server.timeout = 900  # a start beside other servers on a shared 2-core machine took over 240 s
        with server:
            keep = _keep_traffic(server, name, N_JUDGED)
            sampled = _sampled_traffic(server, N_SAMPLED) if name == "healthy" else []
            # read while vLLM serves, as a user does: a stopping vLLM server kills its worker at once (its API
            # server's shutdown, timeout 0 s), so the writer's last interval (0.5 s) would be lost at the stop.
            # Each id is written within about a second of its end; waited for (bounded), never assumed.
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not set(keep + sampled) <= (
                    _table(path, "requests") | _table(path, "sampled_out")):
                time.sleep(1)
        out[name] = (path, keep, sampled)
    return out


def _diagnose(path, *extra) -> tuple[int, dict]:
    r = run_cli("diagnose", "--traces", str(path), "--json", *extra, timeout=300)
    assert r.returncode in (0, 1), r.stderr[-2000:]
    return r.returncode, json.loads(r.stdout)


def test_every_returned_id_opens_or_is_reported_not_kept(served):
    path, keep, sampled = served["healthy"]
    kept, not_kept = _table(path, "requests"), _table(path, "sampled_out")
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


def test_a_healthy_vllm_store_names_nothing_critical_and_judges_every_layer(served):
    path = served["healthy"][0]
    code, report = _diagnose(path)
    causes = {f["cause"]: f for f in report["findings"]}
    assert "nonfinite" not in causes, causes["nonfinite"]
    assert not [f for f in report["findings"] if f["severity"] == "critical"], report["findings"]
    judged = causes["judged"]["evidence"]
    assert judged["layers_judged"] == judged["layers"] == len(report["layers"]) > 0, judged
    assert report["requests"] >= N_JUDGED


def test_a_hot_gate_is_named_against_a_baseline_from_the_healthy_store(served, tmp_path):
    layer, expert, _ = HOT
    base = tmp_path / "baseline.json"
    r = run_cli("baseline", "save", "--traces", str(served["healthy"][0]), "--out", str(base), timeout=300)
    assert r.returncode == 0, r.stderr
    code, report = _diagnose(served["hot"][0], "--baseline", str(base))
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
