"""Routing through ``moescope serve``'s API, against references: ``return_routed_experts`` (the ``openai`` SDK,
whole and streamed, and curl) against ``moescope trace ID --json`` for the same request; the SGLang
expert-distribution endpoints' dump against the exporter's ``moescope_expert_tokens_total`` read before and
after the window and against the trace store's routing of the requests served in it; the dump read by
``plan-placement --import`` and ``cache-sim --import``."""

from __future__ import annotations

import base64
import json
import subprocess
import time

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from helpers import wait_until
from test_serve import MODEL, Serve, _cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-routing")
    with pytest.MonkeyPatch.context() as mp:  # where the dumps go, as for SGLang (the subprocess inherits it)
        mp.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp / "dumps"))
        s = Serve(tmp, "--max-batch", "4", metrics=True)
    s.dump_dir = tmp / "dumps"
    yield s
    assert s.stop() == 0
    assert "Traceback" not in s.log(), s.log()


def routed(ext: dict) -> np.ndarray:
    ids = np.frombuffer(base64.b64decode(ext["routed_experts"]), dtype="<i4")
    return ids.reshape(ext["routed_experts_shape"])


def trace_ids(server: Serve, rid: str) -> tuple[np.ndarray, list[int]]:
    """[routed positions, layers, k] from `moescope trace ID --json` (the CLI, once the store has it)."""
    server.stored(rid)
    out = _cli("trace", rid, "--json", "--traces", str(server.traces))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    rows = [[entry["experts"] for entry in tok["layers"]] for tok in doc["tokens"] if tok["layers"]]
    return np.asarray(rows), [lay["layer"] if isinstance(lay, dict) else lay for lay in doc["layers"]]


def test_routed_experts_whole_and_streamed_equal_the_trace(server):
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=12, temperature=0.7,
                                      seed=3, extra_body={"return_routed_experts": True})
    ext = whole.choices[0].model_extra["sgl_ext"]
    ref, layers = trace_ids(server, whole.id)
    assert ext["routed_experts_layers"] == layers
    got = routed(ext)
    # SGLang's [seqlen - 1, layers, k]: the prompt, then every generated token but the last
    assert got.shape[0] == whole.usage.prompt_tokens + whole.usage.completion_tokens - 1
    assert np.array_equal(got, ref)

    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "route me"}],
                                                 max_tokens=9, stream=True,
                                                 extra_body={"return_routed_experts": True,
                                                             "routed_experts_start_len": 5}))
    with_ext = [c for c in chunks if c.choices and (c.choices[0].model_extra or {}).get("sgl_ext")]
    assert len(with_ext) == 1 and with_ext[0].choices[0].finish_reason is not None  # on the last chunk
    ext = with_ext[0].choices[0].model_extra["sgl_ext"]
    ref, _ = trace_ids(server, chunks[0].id)
    assert ext["routed_experts_start_len"] == 5 and np.array_equal(routed(ext), ref[5:])

    plain = client.completions.create(model=MODEL, prompt="no routing", max_tokens=3)
    assert "sgl_ext" not in plain.choices[0].model_extra


def test_routed_experts_curl_and_bad_values(server):
    out = subprocess.run(["curl", "-s", server.url + "/v1/completions", "-H", "content-type: application/json",
                          "-d", json.dumps({"model": MODEL, "prompt": "curl", "max_tokens": 4,
                                            "return_routed_experts": True})],
                         capture_output=True, text=True, timeout=60, check=True)
    doc = json.loads(out.stdout)
    ref, _ = trace_ids(server, doc["id"])
    assert np.array_equal(routed(doc["choices"][0]["sgl_ext"]), ref)
    for body, param in (({"return_routed_experts": "yes"}, "return_routed_experts"),
                        ({"return_routed_experts": True, "routed_experts_start_len": -1}, "routed_experts_start_len")):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def _scraped_counts(server: Serve) -> dict[tuple[int, int], float]:
    text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).text
    return {(int(s.labels["layer"]), int(s.labels["expert"])): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "moescope_expert_tokens_total"}


def exporter_counts(server: Serve) -> dict[tuple[int, int], float]:
    """The exporter's counts once settled: the engine flushes its last partial interval when it goes idle, just
    after the response is sent, so a scrape right after an answer may precede that flush. Two scrapes half a
    second apart that agree (the server idle between them) hold every step served."""
    def two_scrapes():
        first = _scraped_counts(server)
        time.sleep(0.5)
        return first, _scraped_counts(server)

    return wait_until(two_scrapes, until=lambda pair: pair[0] == pair[1], timeout=30, interval=0,
                      what="the exporter's counts settled")[1]


def dump(server: Serve) -> tuple[np.ndarray, dict]:
    r = httpx.post(server.url + "/dump_expert_distribution_record", timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["path"].startswith(str(server.dump_dir / "expert_distribution_recorder_"))
    return torch.load(r.json()["path"], weights_only=True)["logical_count"].numpy(), r.json()


def test_distribution_dump_equals_the_exporter_and_the_store_over_the_window(server, tmp_path):
    assert httpx.post(server.url + "/stop_expert_distribution_record", timeout=30).status_code == 400  # not on
    client = server.client()
    client.completions.create(model=MODEL, prompt="before the window", max_tokens=5)  # not in the window
    before = exporter_counts(server)  # the server idle: every step served is in the counts
    assert httpx.post(server.url + "/start_expert_distribution_record", timeout=30).status_code == 200
    ids = [client.completions.create(model=MODEL, prompt=f"window {i} " * (i + 1), max_tokens=4 + 3 * i,
                                     temperature=0.9, seed=i).id for i in range(5)]
    assert httpx.post(server.url + "/stop_expert_distribution_record", timeout=30).status_code == 200
    after = exporter_counts(server)
    client.completions.create(model=MODEL, prompt="after the window", max_tokens=5)  # not in it either
    counts, meta = dump(server)
    n_layers, n_exp = counts.shape
    exporter = np.zeros_like(counts)
    for (layer, e), v in after.items():
        exporter[layer, e] = v - before.get((layer, e), 0)
    assert np.array_equal(counts, exporter)
    # the trace store's routing of the requests served in the window (dropped slots hold n_experts)
    store = np.zeros_like(counts)
    for rid in ids:
        for tok in server.stored(rid)["tokens"]:
            for entry in tok["layers"]:
                for e in entry["experts"]:
                    if e < n_exp:
                        store[entry["layer"], e] += 1
    assert np.array_equal(counts, store)
    assert meta["slots"] == int(counts.sum()) > 0 and meta["layers"] == sorted(set(np.nonzero(counts)[0]))
    assert n_layers == 4 and not counts[0].any()  # SGLang's layout: a row per model layer, the dense one zero
    again, _ = dump(server)  # the window stays closed: a later request is not in it
    assert np.array_equal(again, counts)

    # what moescope's importers read from it
    out = _cli("plan-placement", "--import", meta["path"], "--ranks", "2", "--out", str(tmp_path / "pl"), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["source"].startswith("sglang:") and (tmp_path / "pl" / "eplb.json").exists()
    out = _cli("cache-sim", "--import", meta["path"], "--json")
    assert out.returncode == 0, out.stderr
    from moescope.analysis import profile

    loaded = profile.from_sglang(meta["path"]).load()
    assert {layer: v.tolist() for layer, v in loaded.items()} == \
        {layer: counts[layer].tolist() for layer in range(n_layers) if counts[layer].any()}
