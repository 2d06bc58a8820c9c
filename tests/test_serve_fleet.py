"""`moescope serve --world-size N` (issue 23): one HTTP front end, N expert-parallel ranks behind it under torchrun's
agent (data-parallel attention). Real processes, real HTTP, a real Prometheus: every answer equals the
single-process model's for the same request; the slow-rank and hot-expert faults are attributed to the right
rank and expert by the ranks' own metrics; SIGTERM ends every rank."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers import wait_until
from moescope.parallel import placement as placement_mod
from moescope.runtime import faults, loader
from moescope.runtime.engine import Engine
from servers import Prometheus, free_port
from test_lockstep_end import _alive, _children
from test_serve import Serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _complete(url: str, model: str, rid: str, prompt: str, max_tokens: int, stream: bool) -> tuple[int, str, str]:
    """(status, the answering rank, the text) of one completion through the front end."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"x-request-id": rid},
                      timeout=300) as r:
        raw = r.read().decode()
        rank = r.headers.get("x-moescope-rank")
    if r.status_code != 200 or not stream:
        return r.status_code, rank, json.loads(raw)["choices"][0]["text"] if r.status_code == 200 else raw
    events = [ln[6:] for ln in raw.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return r.status_code, rank, "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def _reference(model_name: str, requests: list[tuple[str, str, int]], scenarios: list[str] = ()) -> dict[str, str]:
    """The same requests on the single-process model in this process (with the model faults of ``scenarios``, as
    the server installs them), greedy: request id -> output text."""
    net = loader.build_model(model_name)
    faults.apply(net, list(scenarios))
    engine = Engine(net, max_batch=4)
    for rid, prompt, n in requests:
        engine.submit(prompt, request_id=rid, max_new_tokens=n)
    while engine.has_work:
        engine.step()
    return {r.request_id: r.output for r in engine.finished}


def test_serve_world_size_2_deepseek_answers_equal_the_single_process_model(tmp_path):
    """Four short requests at once, two whole and two streamed: both ranks answer, each answer is the
    single-process model's; SIGTERM to the launcher ends it (exit 0) and every rank with it."""
    model = "deepseek-v3-shape"
    requests = [(f"req-{i}", prompt, 4) for i, prompt in
                enumerate(("The river", "Once upon a time", "def main():", "42 + 17 ="))]
    s = Serve(tmp_path, "--world-size", "2", "--model", model, "--max-batch", "4", name="fleet-dsv3")
    try:
        ranks = _children(s.proc.pid)
        assert sorted(ranks) == [0, 1]
        with ThreadPoolExecutor(4) as pool:
            got = dict(zip([rid for rid, _, _ in requests], pool.map(
                lambda a: _complete(s.url, model, a[1][0], a[1][1], a[1][2], stream=a[0] % 2 == 1),
                enumerate(requests))))
        health = s.health()
    finally:
        code = s.stop()
    assert code == 0, s.log()[-3000:]
    wait_until(lambda: [r for r, pid in ranks.items() if _alive(pid)], until=lambda alive: not alive, timeout=10,
               what="no rank outliving its launcher", interval=0.1)
    assert all(status == 200 for status, _, _ in got.values()), got
    assert {rank for _, rank, _ in got.values()} == {"0", "1"}  # dealt to both ranks
    assert [r["dealt"] for r in health["ranks"]] == [2, 2] and health["dealing"] == "least-outstanding"
    ref = _reference(model, requests)
    assert {rid: text for rid, (_, _, text) in got.items()} == ref
    assert "stopped after 4 requests (rank 0: 2, rank 1: 2)" in s.log()
    assert "Traceback" not in s.log()


def test_serve_world_size_2_attributes_the_slow_rank_and_the_hot_expert(tmp_path):
    """tiny-demo under `--scenario slow-rank,hot=L:E:Fx` behind one front end, a real Prometheus scraping both
    ranks: the peer everyone waits on is rank 1; the hot factor names expert E of layer L on every rank, and
    its slots are computed by the rank the placement gives it. A poisoned request and a malformed one end alone."""
    model, layer, expert = "tiny-demo", 2, 5
    port = free_port(2)  # rank r exports on port + r
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"])
    s = Serve(tmp_path, "--world-size", "2", "--model", model, "--max-batch", "8", "--debug-endpoints",
              "--scenario", f"slow-rank,hot={layer}:{expert}:3x", "--metrics-port", str(port), name="fleet-faults")
    try:
        # one client's bad request never fails another's: a poisoned request ends alone (500) on whichever rank
        # it is dealt to, a malformed one is refused (400); the others' answers are the single-process model's
        httpx.post(s.url + "/debug/poison", json={"request_id": "poisoned"}, timeout=30).raise_for_status()
        iso = [("ok-a", "The river", 6), ("poisoned", "Once upon", 6), ("ok-b", "Numbers: 1 2 3", 6)]
        with ThreadPoolExecutor(4) as pool:
            futs = {rid: pool.submit(_complete, s.url, model, rid, p, n, rid == "ok-b") for rid, p, n in iso}
            bad = pool.submit(_complete, s.url, model, "bad", "x", -1, False)
            got = {rid: f.result() for rid, f in futs.items()}
        assert bad.result()[0] == 400
        assert got["poisoned"][0] == 500
        ref = _reference(model, [x for x in iso if x[0] != "poisoned"], [f"hot={layer}:{expert}:3x"])
        assert {rid: got[rid][2] for rid in ("ok-a", "ok-b")} == ref
        # traffic for the faults: 24 requests, 8 at a time
        prompts = [f"request {i}: the quick brown fox" for i in range(24)]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: _complete(s.url, model, f"load-{i}", prompts[i], 16, i % 3 == 0),
                                    range(24)))
        assert all(a[0] == 200 for a in answers) and {a[1] for a in answers} == {"0", "1"}
        health = s.health()
        assert all(r["status"] == "ok" and r["failed_requests"] <= 1 for r in health["ranks"])

        def final(q: str) -> dict[tuple[str, ...], float]:
            return {tuple(r["metric"].get(k, "") for k in ("rank", "peer", "expert")): float(r["value"][1])
                    for r in prom.query(q)}

        # the slow rank: what every rank waited on each peer, from both ranks' exporters
        wait = wait_until(lambda: final("sum by (peer) (moescope_all_to_all_peer_wait_seconds_total)"),
                          until=lambda w: len(w) == 2 and w[("", "1", "")] > 0.5, timeout=30,
                          what="both ranks' peer waits in Prometheus", interval=0.5)
        assert wait[("", "1", "")] > 10 * wait[("", "0", "")], wait
        # the hot expert: each rank's own routing names it ...
        hot = wait_until(lambda: final(f'moescope_expert_hot_factor_ratio{{layer="{layer}"}}'),
                         until=lambda h: {k[0] for k in h} == {"0", "1"}, timeout=30,
                         what="both ranks' hot factors", interval=0.5)
        for rank in ("0", "1"):
            mine = {k[2]: v for k, v in hot.items() if k[0] == rank}
            assert max(mine, key=mine.get) == str(expert) and mine[str(expert)] > 2.0, (rank, mine)
        # ... and its slots were computed by the rank that holds it (the placement's, read from the placement code)
        owner = placement_mod.build("round-robin", n_experts=8, world_size=2, moe_layers=[1, 2, 3]).ranks_of(
            layer, expert)
        slots = final(f'sum by (rank) (moescope_expert_physical_slots_total{{layer="{layer}",expert="{expert}"}})')
        assert {k[0] for k, v in slots.items() if v > 0} == {str(r) for r in owner}, slots
    finally:
        code = s.stop()
        prom.stop()
    assert code == 0, s.log()[-3000:]
    assert "Traceback" not in s.log()
