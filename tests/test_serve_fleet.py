"""`moescope serve --world-size N` (issue 23): one HTTP front end, N expert-parallel ranks behind it under torchrun's
agent (data-parallel attention). Real processes, real HTTP, a real Prometheus: every answer equals the
single-process model's for the same request; the slow-rank and hot-expert faults are attributed to the right
rank and expert by the ranks' own metrics; SIGTERM ends every rank."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import torch
import yaml

from helpers import Recording, wait_until
from moescope.alerts import rules
from moescope.parallel import placement as placement_mod
from moescope.runtime import faults, loader
from moescope.runtime.engine import Engine
from moescope.serve.text import FINISH_REASONS
from moescope.thresholds import Thresholds
from servers import Prometheus, free_port
from test_lockstep_end import _alive, _children
from test_serve import Serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _complete(url: str, model: str, rid: str, prompt: str, max_tokens: int, stream: bool) -> tuple[int, str, str]:
    """(status, the answering rank, the text) of one completion through the front end."""
    status, rank, doc = _answer(url, model, rid, prompt, max_tokens, stream)
    return status, rank, doc["text"] if status == 200 else doc


def _answer(url: str, model: str, rid: str, prompt: str, max_tokens: int, stream: bool) -> tuple[int, str, dict]:
    """(status, the answering rank, {text, finish_reason, completion_tokens}) of one completion through the front
    end (streamed: the chunks' text joined, the last chunk's finish reason, the usage chunk's count); not 200:
    the body."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"x-request-id": rid},
                      timeout=300) as r:
        raw = r.read().decode()
        rank = r.headers.get("x-moescope-rank")
    if r.status_code != 200:
        return r.status_code, rank, raw
    if not stream:
        doc = json.loads(raw)
        return 200, rank, {"text": doc["choices"][0]["text"], "finish_reason": doc["choices"][0]["finish_reason"],
                           "completion_tokens": doc["usage"]["completion_tokens"]}
    events = [ln[6:] for ln in raw.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    return 200, rank, {"text": "".join(c["text"] for c in choices), "finish_reason": choices[-1]["finish_reason"],
                       "completion_tokens": chunks[-1]["usage"]["completion_tokens"]}


def _reference(model_name: str, requests: list[tuple[str, str, int]], scenarios: list[str] = ()) -> dict[str, str]:
    """The same requests on the single-process model in this process (with the model faults of ``scenarios``, as
    the server installs them), greedy: request id -> output text."""
    return {rid: r.output for rid, r in _reference_records(model_name, requests, scenarios).items()}


def _reference_records(model_name: str, requests: list[tuple[str, str, int]], scenarios: list[str] = ()) -> dict:
    """As ``_reference``: request id -> the engine's record (its text, tokens and finish reason)."""
    net = loader.build_model(model_name)
    faults.apply(net, list(scenarios))
    engine = Engine(net, max_batch=4)
    for rid, prompt, n in requests:
        engine.submit(prompt, request_id=rid, max_new_tokens=n)
    while engine.has_work:
        engine.step()
    return {r.request_id: r for r in engine.finished}


def _metric(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """One metric family from a Prometheus exposition: its labels -> value."""
    out = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            out[tuple(sorted(tuple(kv.split("=", 1)) for kv in labels.split(",")))] = float(value)
    return out


def test_serve_world_size_2_deepseek_answers_equal_the_single_process_model(tmp_path):
    """Four short requests at once, two whole and two streamed: both ranks answer, each answer (text, tokens,
    finish reason) is the single-process model's, and the experts really were shared (each rank's exporter counts
    all-to-all bytes sent to its peer); SIGTERM to the launcher ends it (exit 0) and every rank with it."""
    model = "deepseek-v3-shape"
    requests = [(f"req-{i}", prompt, 4) for i, prompt in
                enumerate(("The river", "Once upon a time", "def main():", "42 + 17 ="))]
    port = free_port(2)  # rank r exports on port + r
    s = Serve(tmp_path, "--world-size", "2", "--model", model, "--max-batch", "4", "--metrics-port", str(port),
              name="fleet-dsv3")
    try:
        ranks = _children(s.proc.pid)
        assert sorted(ranks) == [0, 1]
        with ThreadPoolExecutor(4) as pool:
            got = dict(zip([rid for rid, _, _ in requests], pool.map(
                lambda a: _answer(s.url, model, a[1][0], a[1][1], a[1][2], stream=a[0] % 2 == 1),
                enumerate(requests))))
        health = s.health()
        sent = [_metric(f"http://127.0.0.1:{port + r}/metrics", "moescope_all_to_all_bytes_total") for r in (0, 1)]
        front = {f.name: f for f in text_string_to_metric_families(httpx.get(s.url + "/metrics", timeout=30).text)}
    finally:
        code = s.stop()
    assert code == 0, s.log()[-3000:]
    wait_until(lambda: [r for r, pid in ranks.items() if _alive(pid)], until=lambda alive: not alive, timeout=10,
               what="no rank outliving its launcher", interval=0.1)
    assert all(status == 200 for status, _, _ in got.values()), got
    assert {rank for _, rank, _ in got.values()} == {"0", "1"}  # dealt to both ranks
    assert [r["dealt"] for r in health["ranks"]] == [2, 2] and health["dealing"] == "least-outstanding"
    ref = _reference_records(model, requests)
    for rid, (_, _, doc) in got.items():
        rec = ref[rid]
        assert doc["text"] and doc["text"] == rec.output, (rid, doc, rec.output)
        assert doc["completion_tokens"] == len(rec.output_tokens) > 0
        assert doc["finish_reason"] == FINISH_REASONS[rec.finish_reason]
    for r in (0, 1):
        peer = str(1 - r)
        to_peer = [v for k, v in sent[r].items() if ("direction", '"sent"') in k and ("peer", f'"{peer}"') in k]
        assert to_peer and sum(to_peer) > 0, sent[r]
    assert "stopped after 4 requests (rank 0: 2, rank 1: 2)" in s.log()
    assert "Traceback" not in s.log()
    # the front end's /metrics: each rank's serving series under its own rank label, equal to what it answered

    def by_rank(name: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for sample in front[name].samples:
            if sample.name == name + "_total":
                out[sample.labels["rank"]] = out.get(sample.labels["rank"], 0) + sample.value
        return out

    answered = {r: [doc for _, rank, doc in got.values() if rank == r] for r in ("0", "1")}
    assert by_rank("moescope_serve_request_success") == {r: len(a) for r, a in answered.items()} == {"0": 2, "1": 2}
    assert by_rank("moescope_serve_generation_tokens") == {r: sum(d["completion_tokens"] for d in a)
                                                           for r, a in answered.items()}
    assert by_rank("moescope_fleet_requests_dealt") == {"0": 2, "1": 2}


# tiny-demo's 8 experts, top-2, cannot make an expert 4x its share (E/k = 4): MoEExpertHot's bar is out of its reach.
# The same small shape with 16 experts (E/k = 8) can.
WIDE_DEMO = {"name": "wide-demo", "hidden_size": 64, "n_layers": 4, "n_heads": 4, "n_experts": 16, "top_k": 2,
             "ffn_size": 64, "dense_layers": [0], "dense_ffn_size": 128, "max_seq_len": 512}


def test_serve_world_size_2_attributes_the_slow_rank_and_the_hot_expert(tmp_path):
    """A small model (16 experts) under `--scenario slow-rank,hot=L:E:6x` behind one front end, a real Prometheus
    scraping both ranks
    and evaluating the generated alert rules (every `for` shrunk 30-fold): MoESlowRank names the scenario's slow
    rank as the peer, MoEExpertHot names expert E of layer L (6x: above its 4x bar); each rank's physical slots of
    layer L are the single-process model's routing of the same requests mapped through the placement. A malformed
    request is refused (400) without touching the others."""
    model, layer, expert = str(tmp_path / "wide-demo.yaml"), 2, 5
    (tmp_path / "wide-demo.yaml").write_text(yaml.safe_dump(WIDE_DEMO))
    hot = f"hot={layer}:{expert}:6x"
    slow = faults.demo_settings(["slow-rank"]).slow_rank  # the scenario's slow rank, as the server reads it
    rule_file = tmp_path / "rules.yml"
    rule_file.write_text(yaml.safe_dump(rules.rules_document(Thresholds(for_scale=1 / 30)), sort_keys=False))
    port = free_port(2)  # rank r exports on port + r
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"], rule_files=[str(rule_file)])
    s = Serve(tmp_path, "--world-size", "2", "--model", model, "--max-batch", "8",
              "--scenario", f"slow-rank,{hot}", "--metrics-port", str(port),
              # the fault is there from the first request: against the fair share (the default learns the
              # reference from the first window, fault included: a page means a change)
              "--hot-reference", "fair", name="fleet-faults")
    prompts = [(f"load-{i}", f"request {i}: the quick brown fox", 16) for i in range(24)]
    try:
        assert _complete(s.url, WIDE_DEMO["name"], "bad", "x", -1, False)[0] == 400
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: _complete(s.url, WIDE_DEMO["name"], *prompts[i], i % 3 == 0), range(24)))
        assert all(a[0] == 200 for a in answers) and {a[1] for a in answers} == {"0", "1"}
        health = s.health()
        assert all(r["status"] == "ok" and r["failed_requests"] == 0 for r in health["ranks"])

        def firing(name: str) -> list[dict]:
            return [r["metric"] for r in prom.query(f'ALERTS{{alertname="{name}",alertstate="firing"}}')]

        slow_alerts = wait_until(lambda: firing("MoESlowRank"), timeout=90, what="MoESlowRank firing", interval=1)
        assert {a["peer"] for a in slow_alerts} == {str(slow)}, slow_alerts
        hot_alerts = wait_until(lambda: firing("MoEExpertHot"), timeout=90, what="MoEExpertHot firing", interval=1)
        assert {(a["layer"], a["expert"]) for a in hot_alerts} == {(str(layer), str(expert))}, hot_alerts
        # each rank's physical slots: the reference routing of the same requests, mapped through the placement
        place = placement_mod.build("round-robin", n_experts=WIDE_DEMO["n_experts"], world_size=2,
                                    moe_layers=[1, 2, 3])
        counts = _reference_counts(model, prompts, [hot], layer)
        want = {str(r): 0.0 for r in range(2)}
        for e, n in enumerate(counts):
            (owner,) = place.ranks_of(layer, e)
            want[str(owner)] += n

        def slots() -> dict[str, float]:
            q = f'sum by (rank) (moescope_expert_physical_slots_total{{layer="{layer}"}})'
            return {r["metric"]["rank"]: float(r["value"][1]) for r in prom.query(q)}

        got = wait_until(slots, until=lambda g: g == want, timeout=30, what="physical slots per rank", interval=0.5)
        assert sum(got.values()) > 0 and got[str(place.ranks_of(layer, expert)[0])] > sum(got.values()) / 2
    finally:
        code = s.stop()
        prom.stop()
    assert code == 0, s.log()[-3000:]
    assert "Traceback" not in s.log()


def _reference_counts(model_name: str, requests: list[tuple[str, str, int]], scenarios: list[str],
                      layer: int) -> list[int]:
    """Slots per expert of ``layer`` the single-process model routes for ``requests`` (greedy, ``scenarios``'
    model faults installed)."""
    net = loader.build_model(model_name)
    faults.apply(net, list(scenarios))
    seen = Recording()
    engine = Engine(net, max_batch=8, observer=seen)
    for rid, prompt, n in requests:
        engine.submit(prompt, request_id=rid, max_new_tokens=n)
    while engine.has_work:
        engine.step()
    counts = [0] * net.cfg.n_experts
    for lay, ids, n_exp in seen.decisions:
        if lay == layer:
            for e, c in enumerate(torch.bincount(ids.reshape(-1), minlength=n_exp + 1)[:n_exp].tolist()):
                counts[e] += c
    return counts
