"""`moescope serve --world-size 2` under faults (issue 23): real rank processes under torchrun's agent, real HTTP,
tiny-demo. A request whose step fails inside a MoE layer's expert compute ends alone while its neighbour and the
peer rank's requests are answered as the single-process model answers them (the canary on, as by default); a rank
whose engine dies, or that is killed, ends the fleet with that rank named and every client answered; a client
that goes away cancels its request on the rank; a rank that refuses requests leaves the front end's rotation."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import wait_until
from moescope.runtime import loader
from moescope.runtime.engine import Engine
from moescope.serve import fleet as fleet_mod, server
from test_lockstep_end import _alive, _children
from test_serve import Serve

MODEL = "tiny-demo"
LONG = 400  # tokens: a request still running when the fault lands (tiny-demo's KV holds 512)


def _reference(requests: list[tuple[str, str]], n: int) -> dict[str, str]:
    """Greedy, EOS ignored, ``n`` tokens each: request id -> text, from the single-process model here."""
    engine = Engine(loader.build_model(MODEL), max_batch=4)
    for rid, prompt in requests:
        engine.submit(prompt, request_id=rid, max_new_tokens=n, ignore_eos=True)
    while engine.has_work:
        engine.step()
    return {r.request_id: r.output for r in engine.finished}


class Stream(threading.Thread):
    """One streamed completion through the front end, read to its end on a thread of its own."""

    def __init__(self, url: str, rid: str, prompt: str, max_tokens: int = LONG) -> None:
        super().__init__(daemon=True)
        self.url, self.rid = url, rid
        self.body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                     "ignore_eos": True}
        self.first = threading.Event()  # the first token came: the request is running on its rank
        self.events: list[str] = []
        self.rank: str | None = None
        self.status = 0
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body,
                              headers={"x-request-id": self.rid}, timeout=300) as r:
                self.status, self.rank = r.status_code, r.headers.get("x-moescope-rank")
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()
        finally:
            self.first.set()

    @property
    def text(self) -> str:
        return "".join(json.loads(e)["choices"][0]["text"] for e in self.events[:-1] if '"choices"' in e)

    @property
    def error(self) -> dict | None:
        return next((json.loads(e)["error"] for e in self.events if e.startswith('{"error"')), None)


def _started(streams: list[Stream]) -> None:
    for st in streams:
        assert st.first.wait(120), f"{st.rid}: no first token"
        assert st.status == 200, (st.rid, st.status, st.events)


@pytest.mark.integration
@pytest.mark.slow
def test_a_step_failing_inside_the_expert_compute_ends_its_request_alone_neighbour_and_peer_answered(tmp_path):
    """Four long streams, two per rank, the canary running (its default); then one is poisoned: its rank's next
    step raises inside the middle MoE layer's expert compute, after the first layer's exchanges. The failing rank
    finishes the step's exchanges, every rank's step fails alike (the rows it computed for its peer are wrong),
    the peer takes its step again, the failing rank reruns its requests one by one: exactly the poisoned request
    ends as an error; its neighbour and the peer's requests are the single-process model's answers."""
    s = Serve(tmp_path, "--world-size", "2", "--model", MODEL, "--max-batch", "8", "--debug-endpoints",
              "--canary-interval", "5", name="fleet-poison")  # (the default: a rank runs it every 32 steps)
    prompts = {f"s-{i}": p for i, p in enumerate(("The river", "Once upon a time", "def main():", "42 + 17 ="))}
    try:
        streams = [Stream(s.url, rid, p) for rid, p in prompts.items()]
        _started(streams)
        by_rank = {r: [st for st in streams if st.rank == r] for r in ("0", "1")}
        assert [len(v) for v in by_rank.values()] == [2, 2], [(st.rid, st.rank) for st in streams]
        poisoned, neighbour = by_rank["0"]
        httpx.post(s.url + "/debug/poison", json={"request_id": poisoned.rid}, timeout=30).raise_for_status()
        for st in streams:
            st.join(300)
        health = s.health()
        after = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "still here", "max_tokens": 4},
                           timeout=120)
    finally:
        code = s.stop()
    assert code == 0, s.log()[-3000:]
    assert poisoned.events[-1] == "[DONE]" and poisoned.error is not None, poisoned.events[-3:]
    assert len(poisoned.events) < LONG  # it ended early, at the poisoned step
    ref = _reference([(st.rid, prompts[st.rid]) for st in streams if st is not poisoned], LONG)
    got = {st.rid: st.text for st in streams if st is not poisoned}
    assert all(len(t) > 0 for t in got.values()) and got == ref
    assert all(st.error is None and st.events[-1] == "[DONE]" for st in streams if st is not poisoned)
    r0, r1 = health["ranks"]
    assert r0["failed_requests"] == 1 and r1["failed_requests"] == 0, health
    assert r0["step_errors"] >= 1 and r1["peer_failed_steps"] >= 1, health  # the peer took the step again
    assert health["status"] == "ok" and after.status_code == 200
    assert neighbour.rid in ref and "out of step" not in s.log()
    # the launcher's own lines (a rank logs its failed step's traceback, tee'd with its prefix)
    assert not [ln for ln in s.log().splitlines() if "Traceback" in ln and not ln.startswith("[default_role")]


def _launcher_ends(s: Serve, ranks: dict[int, int]) -> int:
    code = s.proc.wait(120)
    wait_until(lambda: [r for r, pid in ranks.items() if _alive(pid)], until=lambda alive: not alive, timeout=20,
               what="no rank outliving its launcher", interval=0.1)
    return code


@pytest.mark.integration
@pytest.mark.slow
def test_a_rank_whose_engine_dies_ends_the_fleet_and_its_own_error_is_shown(tmp_path):
    """Rank 1's engine thread dies mid-request (POST /debug/kill-engine to it alone): the rank leaves with its own
    one-line error, the agent ends the fleet, the launcher exits 1 naming rank 1; both clients get an answer
    that ends (an error event, then [DONE]); no rank is left."""
    s = Serve(tmp_path, "--world-size", "2", "--model", MODEL, "--debug-endpoints", name="fleet-engine-dies")
    try:
        ranks = _children(s.proc.pid)
        streams = [Stream(s.url, f"d-{i}", p) for i, p in enumerate(("The river", "Once upon a time"))]
        _started(streams)
        assert sorted(st.rank for st in streams) == ["0", "1"]
        httpx.post(s.url + "/debug/kill-engine?rank=1", json={}, timeout=30).raise_for_status()
        for st in streams:
            st.join(120)
        code = _launcher_ends(s, ranks)
    finally:
        s.stop()
    log = s.log()
    assert code == 1, log[-3000:]
    assert "rank 1: the engine thread died" in log and "kill-engine" in log, log[-3000:]
    assert all(st.events and st.events[-1] == "[DONE]" for st in streams), [st.events[-2:] for st in streams]
    dead = next(st for st in streams if st.rank == "1")
    assert dead.error is not None


@pytest.mark.integration
@pytest.mark.slow
def test_a_rank_killed_mid_stream_ends_its_client_with_an_error_event_and_the_launcher_names_it(tmp_path):
    """SIGKILL to rank 1 while it streams: the front end ends that client's stream with an error event and [DONE]
    (not a cut-off body), the launcher exits non-zero naming rank 1, no rank is left."""
    s = Serve(tmp_path, "--world-size", "2", "--model", MODEL, name="fleet-rank-killed")
    try:
        ranks = _children(s.proc.pid)
        streams = [Stream(s.url, f"k-{i}", p) for i, p in enumerate(("The river", "Once upon a time"))]
        _started(streams)
        victim = next(st for st in streams if st.rank == "1")
        os.kill(ranks[1], signal.SIGKILL)
        victim.join(120)
        code = _launcher_ends(s, ranks)
    finally:
        s.stop()
    log = s.log()
    assert code != 0 and "rank 1 killed by SIGKILL" in log, log[-3000:]
    assert victim.events[-1] == "[DONE]" and victim.error["code"] == "rank_unavailable", victim.events[-2:]


def _connect_and_leave(url: str, rid: str, stream: bool) -> socket.socket:
    """A raw HTTP client that sends a long completion and keeps the socket (the caller closes it: going away)."""
    body = json.dumps({"model": MODEL, "prompt": "The river", "max_tokens": LONG, "temperature": 0,
                       "ignore_eos": True, "stream": stream}).encode()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 + f"x-request-id: {rid}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
    return sock


@pytest.mark.integration
@pytest.mark.slow
def test_a_client_that_goes_away_cancels_its_request_on_the_rank(tmp_path):
    """A whole (non-streamed) and a streamed request whose clients close their sockets while the rank runs them:
    the rank stops them (stored "cancelled", short of their length) and the front end's in-flight count returns
    to 0. Each goes to rank 0, whose trace store this is (an idle fleet deals round-robin from rank 0: a short
    request to rank 1 in between)."""
    s = Serve(tmp_path, "--world-size", "2", "--model", MODEL, name="fleet-disconnect")
    try:
        for rid, stream in (("gone-whole", False), ("gone-stream", True)):
            sock = _connect_and_leave(s.url, rid, stream)
            s.wait_health(lambda h: h["ranks"][0]["running"] == 1, timeout=60)
            sock.close()
            doc = s.stored(rid, timeout=30)
            assert doc["finish_reason"] == "cancelled" and len(doc["tokens"]) < LONG, (rid, doc["finish_reason"])
            s.wait_health(lambda h: [r["outstanding"] for r in h["ranks"]] == [0, 0], timeout=30)
            short = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                               timeout=60)
            assert short.headers["x-moescope-rank"] == "1"
    finally:
        code = s.stop()
    assert code == 0, s.log()[-3000:]


def _stand_in(state: dict):
    """A stand-in rank for the front end's dealing: answers completions 200 while ``state["ok"]``, else 503
    engine_unhealthy before admitting (as serve's own refusal); /health alike. A prompt "slow" is held until
    ``state["release"]`` is set."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    unhealthy = {"error": {"message": "the engine is unhealthy", "type": "service_unavailable",
                           "code": "engine_unhealthy"}}

    async def complete(request):
        if json.loads(await request.body())["prompt"] == "slow":  # held until the test releases it
            await asyncio.to_thread(state["release"].wait, 60)
        state["seen"] += 1
        return JSONResponse({"ok": True}) if state["ok"] else JSONResponse(unhealthy, status_code=503)

    async def health(request):
        return JSONResponse({"status": "ok" if state["ok"] else "unhealthy"}, status_code=200 if state["ok"] else 503)

    async def metrics(request):  # a rank's serving series: its rank label, the requests it answered
        return PlainTextResponse("# HELP moescope_serve_request_success_total Requests that ended.\n"
                                 "# TYPE moescope_serve_request_success_total counter\n"
                                 f'moescope_serve_request_success_total{{model="{MODEL}",rank="{state["rank"]}",'
                                 f'finished_reason="length"}} {state["seen"] if state["ok"] else 0}\n')

    return Starlette(routes=[Route("/v1/completions", complete, methods=["POST"]),
                             Route("/health", health, methods=["GET"]), Route("/metrics", metrics, methods=["GET"])])


def _serve_app(app) -> tuple[str, object]:
    sock = server.bind("127.0.0.1", 0)
    _, userver = server.start_in_thread(app, sock, log_level="warning")
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    wait_until(lambda: httpx.get(url + "/health", timeout=2).status_code, timeout=20, what=url, interval=0.05,
               ignore=(httpx.HTTPError,))
    return url, userver


@pytest.mark.integration
def test_a_rank_that_refuses_leaves_rotation_until_its_health_passes(tmp_path):
    """Three real HTTP servers stand in for ranks behind the real front end: rank 0 answers 503 engine_unhealthy,
    rank 2's address refuses connections. Every request is answered by rank 1 (the refusals came before admission:
    retried there), rank 0 is asked once and rank 2 never twice; once rank 0's /health passes it is dealt again. A
    request id in flight is refused (409) whichever rank the second would go to."""
    states = [{"ok": False, "seen": 0, "rank": 0, "release": threading.Event()},
              {"ok": True, "seen": 0, "rank": 1, "release": threading.Event()}]
    stand_ins = [_serve_app(_stand_in(st)) for st in states]
    closed = socket.socket()  # bound, never listening: connections are refused (kept to the end: no one else
    closed.bind(("127.0.0.1", 0))  # takes the port meanwhile)
    dead_url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    for r, url in enumerate([stand_ins[0][0], stand_ins[1][0], dead_url]):
        fleet_mod.address_file(tmp_path, r).write_text(url)
    fleet = fleet_mod.Fleet(3, tmp_path, MODEL)
    front, front_server = _serve_app(fleet_mod.create_app(fleet))
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        got = [httpx.post(front + "/v1/completions", json=body, timeout=30) for _ in range(6)]
        assert [(r.status_code, r.headers["x-moescope-rank"]) for r in got] == [(200, "1")] * 6
        assert states[0]["seen"] == 1 and states[1]["seen"] == 6 and fleet.dealt[2] == 1, (states, fleet.dealt)
        health = httpx.get(front + "/health", timeout=30).json()
        assert [r["in_rotation"] for r in health["ranks"]] == [False, True, False]
        # the front end's /metrics: its own series per rank, and the ranks' serving series merged (rank 2's
        # could not be read: up 0, no series of its own)
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(front + "/metrics", timeout=30).text)}

        def per_rank(name):
            return {s.labels["rank"]: s.value for s in families[name].samples if s.name.endswith(("_total", name))}

        assert per_rank("moescope_fleet_requests_dealt") == {"0": 1, "1": 6, "2": 1}
        assert per_rank("moescope_fleet_rank_in_rotation") == {"0": 0, "1": 1, "2": 0}
        assert per_rank("moescope_fleet_rank_metrics_up") == {"0": 1, "1": 1, "2": 0}
        assert per_rank("moescope_fleet_requests_outstanding") == {"0": 0, "1": 0, "2": 0}
        assert per_rank("moescope_serve_request_success") == {"0": 0, "1": 6}
        states[0]["ok"] = True
        wait_until(lambda: httpx.get(front + "/health", timeout=30).json()["ranks"][0]["in_rotation"], timeout=20,
                   what="rank 0 back in rotation", interval=0.1)
        again = [httpx.post(front + "/v1/completions", json=body, timeout=30).headers["x-moescope-rank"]
                 for _ in range(4)]
        assert sorted(set(again)) == ["0", "1"]
        wait_until(lambda: fleet.outstanding, until=lambda o: o == [0, 0, 0], timeout=10, what="nothing in flight",
                   interval=0.02)  # (released as each relayed answer ends, just after its last byte)
        # an x-request-id in flight on one rank is refused on any: the front end sees them all
        slow = threading.Thread(target=httpx.post, args=(front + "/v1/completions",),
                                kwargs={"json": {**body, "prompt": "slow"}, "headers": {"x-request-id": "dup"},
                                        "timeout": 30})
        slow.start()
        wait_until(lambda: fleet.in_flight, timeout=10, what="the first 'dup' in flight", interval=0.02)
        dup = [httpx.post(front + "/v1/completions", json=body, headers={"x-request-id": "dup"}, timeout=30)
               for _ in range(2)]
        assert [r.status_code for r in dup] == [409, 409]
        assert {r.json()["error"]["code"] for r in dup} == {"duplicate_request_id"}
        for st in states:
            st["release"].set()
        slow.join(30)
        wait_until(lambda: fleet.in_flight, until=lambda ids: not ids, timeout=10, what="no id in flight",
                   interval=0.02)
    finally:
        for st in states:  # (a failed assertion must not leave a handler waiting)
            st["release"].set()
        for srv in (front_server, *(u for _, u in stand_ins)):
            srv.should_exit = True
        closed.close()


@pytest.mark.integration
@pytest.mark.slow
def test_sigterm_with_a_request_in_flight_on_one_rank_drains_it_while_the_peer_idles(tmp_path):
    """SIGTERM to the launcher while rank 0 streams a request and rank 1 has none: rank 0 finishes it (its
    peer keeps stepping with it, idle), the answer is whole and the single-process model's, new requests are
    refused meanwhile, the launcher exits 0 and no rank is left."""
    s = Serve(tmp_path, "--world-size", "2", "--model", MODEL, name="fleet-drain")
    n = 120
    try:
        ranks = _children(s.proc.pid)
        st = Stream(s.url, "drained", "The river", max_tokens=n)
        _started([st])
        assert st.rank == "0"
        s.proc.send_signal(signal.SIGTERM)
        st.join(120)
        code = _launcher_ends(s, ranks)
    finally:
        s.stop()
    assert code == 0, s.log()[-3000:]
    assert st.error is None and st.events[-1] == "[DONE]", st.events[-2:]
    assert st.text == _reference([("drained", "The river")], n)["drained"]
    assert "stopped after 1 requests (rank 0: 1, rank 1: 0)" in s.log()
    for r in (0, 1):  # the ranks' own logs reach the launcher's output while they serve, each line prefixed
        assert f"[default_role{r}]:moescope serve: http://127.0.0.1:" in s.log(), s.log()[-3000:]


@pytest.mark.parametrize("args, says", [
    (("--world-size", "2", "--scenario", "hot=2:5:6x"), "out of reach for tiny-demo"),
    (("--world-size", "2", "--placement", "nowhere.yaml"), "nowhere.yaml"),
    (("--world-size", "2", "--slow-rank", "2"), "--slow-rank 2 is not a rank of world size 2"),
    (("--slow-rank", "1", "--delay-ms", "5"), "--slow-rank, --delay-ms: for expert-parallel ranks"),
])
def test_bad_fleet_input_is_one_line_and_exit_2_before_any_rank_starts(args, says):
    """What would fail every rank alike is refused by the launcher itself: one line, exit 2, no front end."""
    from helpers import run_cli

    got = run_cli("serve", "--port", "0", "--model", MODEL, *args, timeout=120)
    lines = [ln for ln in got.stderr.splitlines() if ln.strip()]
    assert got.returncode == 2 and len(lines) == 1 and says in lines[0], got.stderr
