"""``moescope serve`` against real clients: the official ``openai`` SDK (sync and async, streamed and whole), curl
and httpx, on a real server subprocess on loopback. What the server answered is checked against references:
a greedy run of the same model in this process, the trace store (``moescope requests`` / ``moescope trace``),
the OTLP spans a real exporter posted."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import openai
import pytest

from conftest import in_ci
from moescope.traces import store
from helpers import popen_cli, run_cli, wait_until
from servers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "tiny-demo"


class Serve:
    """A ``moescope serve`` subprocess; its log and trace store in ``tmp``."""

    def __init__(self, tmp: Path, *args: str, name: str = "serve", metrics: bool = False,
                 traces: Path | None = None) -> None:
        self.port = free_port()
        self.metrics_port = free_port() if metrics else -1
        self.url = f"http://127.0.0.1:{self.port}"
        self.traces = traces or tmp / f"{name}.sqlite"  # (an existing directory: a trace lake)
        self.log_path = tmp / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = popen_cli("serve", "--port", str(self.port), "--metrics-port", str(self.metrics_port), "--traces",
                              str(self.traces), "--canary-interval", "0", *args, stdout=self._log,
                              stderr=subprocess.STDOUT)
        try:  # deepseek-v3-shape builds its balanced routers once (then cached)
            wait_until(lambda: urllib.request.urlopen(self.url + "/health", timeout=2).read(), timeout=240,
                       what="serve answering /health", interval=0.2, alive=lambda: self.proc.poll() is None)
        except AssertionError:
            self.stop()
            raise RuntimeError("serve did not start:\n" + self.log()) from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_health(self, pred, timeout: float = 20.0) -> dict:
        return wait_until(self.health, until=pred, timeout=timeout, what="a /health state", interval=0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def gather(self, one, n: int) -> list:
        """``one(client, i)`` for i in 0..n-1, all at once on one async SDK client; their results in order."""
        async def main():
            client = self.async_client()
            try:
                return await asyncio.gather(*(one(client, i) for i in range(n)))
            finally:
                await client.close()

        return asyncio.run(main())

    def stored(self, rid: str, timeout: float = 10.0) -> dict:
        """The request's trace document, once the recorder committed it (it commits every 0.5 s)."""
        def load():
            conn = store.open_store(self.traces)
            try:
                return store.load_request(conn, rid)
            finally:
                conn.close()

        return wait_until(load, timeout=timeout, what=f"{rid} in the trace store", interval=0.1, ignore=(Exception,))


def _n_output(doc: dict) -> int:
    return sum(t["phase"] == "decode" for t in doc["tokens"])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Serve(tmp_path_factory.mktemp("serve"))
    yield s
    assert s.stop() == 0
    assert "Traceback" not in s.log(), s.log()


@pytest.fixture(scope="module")
def greedy():
    """The reference: the same model run greedily by a plain engine in this process."""
    from moescope.runtime import loader
    from moescope.runtime.engine import Engine

    model = loader.build_model(MODEL)

    def run(prompt: str, max_tokens: int):
        engine = Engine(model, max_batch=1)
        engine.submit(prompt, max_new_tokens=max_tokens)
        while engine.has_work:
            engine.step()
        return engine.finished[0]

    return run


def test_curl_health_completion_and_trace(server, greedy):
    curl = shutil.which("curl")
    if curl is None:
        (pytest.fail if in_ci() else pytest.skip)("curl not installed")
    health = json.loads(subprocess.run([curl, "-sf", server.url + "/health"], capture_output=True, text=True,
                                       check=True).stdout)
    assert health["status"] == "ok" and health["model"] == MODEL
    out = subprocess.run([curl, "-s", "-i", server.url + "/v1/completions", "-H", "content-type: application/json",
                          "-d", json.dumps({"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 12,
                                            "temperature": 0})], capture_output=True, text=True, check=True).stdout
    head, _, payload = out.replace("\r\n", "\n").partition("\n\n")
    assert head.startswith("HTTP/1.1 200")
    headers = dict(line.split(": ", 1) for line in head.splitlines()[1:])
    body = json.loads(payload)
    rid = headers["x-request-id"]
    assert body["id"] == rid and body["object"] == "text_completion" and body["model"] == MODEL
    ref = greedy("def add(a, b):", 12)
    from moescope.runtime import tokenizer

    assert body["choices"][0]["text"] == tokenizer.decode(list(ref.output_tokens))
    assert body["usage"] == {"prompt_tokens": len(ref.prompt_tokens), "completion_tokens": ref.n_output,
                             "total_tokens": len(ref.prompt_tokens) + ref.n_output}
    server.stored(rid)
    shown = _cli("trace", rid, "--traces", str(server.traces), "--json")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["request_id"] == rid and doc["prompt"] == "def add(a, b):" and doc["finish_reason"] == "length"
    assert _n_output(doc) == ref.n_output and len(doc["tokens"][0]["layers"]) == len(doc["layers"]) > 0


def test_readme_serve_example_works(server):
    """The README's "serve, then trace" curl line, run as written (against this server's port)."""
    from conftest import ROOT

    sections = (ROOT / "README.md").read_text().split("\n## ")
    (section,) = [s for s in sections if "serve" in s.splitlines()[0].lower() and "curl " in s]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    curl = block[block.index("curl "):].split("\n#", 1)[0]
    out = subprocess.run(["bash", "-c", curl.replace("localhost:8000", server.url)], capture_output=True,
                         text=True, timeout=60)
    name, rid = out.stdout.strip().split(": ", 1)
    assert name.lower() == "x-request-id", out
    server.stored(rid)
    assert "moescope trace " in block
    shown = _cli("trace", rid, "--plain", "--traces", str(server.traces))
    assert shown.returncode == 0 and f"request {rid}" in shown.stdout and "def add(a, b):" in shown.stdout, shown


def test_sdk_sync_whole_and_streamed(server):
    client = server.client()
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="The river", max_tokens=8, temperature=0)
    comp = raw.parse()
    assert raw.headers["x-request-id"] == comp.id
    assert comp.usage.completion_tokens == 8 and comp.choices[0].finish_reason == "length"
    doc = server.stored(comp.id)
    assert comp.choices[0].text == doc["output"] and doc["finish_reason"] == "length"

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "be brief"},
                                                                 {"role": "user", "content": "hello"}],
                                          max_tokens=6, temperature=0, seed=1)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    doc = server.stored(chat.id)
    assert doc["prompt"] == "<|system|>\nbe brief\n<|user|>\nhello\n<|assistant|>\n"
    assert chat.choices[0].message.content == doc["output"]
    assert chat.usage.prompt_tokens == len(doc["prompt"].encode()) + 1  # bytes + BOS

    pieces, finish, usage, ids = [], None, None, set()
    for chunk in client.completions.create(model=MODEL, prompt="12 + 7 =", max_tokens=10, stream=True, temperature=0,
                                           stream_options={"include_usage": True}):
        ids.add(chunk.id)
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    (rid,) = ids
    doc = server.stored(rid)
    assert "".join(pieces) == doc["output"] and finish == "length" and usage.completion_tokens == 10

    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, stream=True, temperature=0)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == server.stored(chunks[0].id)["output"]


def test_every_token_is_its_own_chunk_with_32_streams_at_once(server):
    """32 openai-SDK streams at once (temperature 1: bytes that complete no character on their own too): each
    stream's chunks are its tokens, one each (the finish chunk may come alone: N or N + 1 chunks for N tokens,
    never fewer), however far behind the engine the handlers fall; joined, the text is what the trace store
    holds for the request (the reference: the engine's own output tokens, decoded)."""

    async def one(client, i):
        pieces, usage, ids = [], None, set()
        stream = await client.completions.create(model=MODEL, prompt=f"def f{i}(x):", max_tokens=24, stream=True,
                                                 temperature=1.0, stream_options={"include_usage": True})
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return ids.pop(), pieces, usage

    results = server.gather(one, 32)
    for rid, pieces, n_tokens in results:
        doc = server.stored(rid)
        assert n_tokens == _n_output(doc) > 0
        assert n_tokens <= len(pieces) <= n_tokens + 1, (rid, n_tokens, pieces)
        assert "".join(pieces) == doc["output"]


def test_stop_string_trims_the_answer_and_the_store_keeps_it(server, greedy):
    ref = greedy("import os", 30)
    from moescope.runtime import tokenizer

    text = tokenizer.decode(list(ref.output_tokens))
    stop = text[4:6]
    assert stop and len(stop.encode()) == 2
    client = server.client()
    comp = client.completions.create(model=MODEL, prompt="import os", max_tokens=30, temperature=0, stop=[stop])
    assert comp.choices[0].finish_reason == "stop"
    assert comp.choices[0].text == text[:text.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="import os", max_tokens=30, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == comp.choices[0].text  # held back while streaming: never a piece of the stop string
    doc = server.stored(comp.id)
    assert doc["finish_reason"] == "stop" and doc["output"] == text[:text.index(stop)] + stop


def test_sdk_async_whole_and_streamed(server):
    async def main():
        client = server.async_client()
        whole = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6)
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                      max_tokens=6, stream=True)
        chunks = [c async for c in stream]
        await client.close()
        return whole, chunks

    whole, chunks = asyncio.run(main())
    assert server.stored(whole.id)["output"] == whole.choices[0].text
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert server.stored(chunks[0].id)["output"] == text


def test_32_concurrent_clients_all_answered_and_traceable(server):
    prompts = [f"request {i}: " + "abc" * (i % 5) for i in range(32)]

    async def one(client, i):
        if i % 2:
            stream = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=4 + i % 7,
                                                     stream=True, stream_options={"include_usage": True})
            rid, usage = None, None
            async for c in stream:
                rid, usage = c.id, c.usage or usage
            return rid, usage.prompt_tokens, usage.completion_tokens
        r = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=4 + i % 7,
                                            user=f"tenant-{i % 3}")
        return r.id, r.usage.prompt_tokens, r.usage.completion_tokens

    answers = server.gather(one, 32)
    assert len({rid for rid, _, _ in answers}) == 32
    for i, (_, n_prompt, n_out) in enumerate(answers):  # sampled at temperature 1: an EOS may end one early
        assert n_prompt == len(prompts[i].encode()) + 1 and 1 <= n_out <= 4 + i % 7
    for rid, _, _ in answers:  # every row committed (the last answered is not the last finished)
        server.stored(rid)
    listed = _cli("requests", "--traces", str(server.traces), "--json", "--limit", "1000")
    assert listed.returncode == 0, listed.stderr
    rows = {r["request_id"]: r for r in json.loads(listed.stdout)}
    for rid, n_prompt, n_out in answers:
        assert (rows[rid]["prompt_tokens"], rows[rid]["output_tokens"]) == (n_prompt, n_out)
    tenants = {rows[rid]["tenant"] for rid, _, _ in answers[::2]}
    assert tenants == {"tenant-0", "tenant-1", "tenant-2"}
    from moescope.cli import main

    for rid, _, n_out in answers:  # `moescope trace --json` on every id, in this process (32 interpreters: slow)
        doc = store.load_request(store.open_store(server.traces), rid)
        assert doc["request_id"] == rid and _n_output(doc) == n_out
        assert main(["trace", rid, "--json", "--traces", str(server.traces)]) == 0
    assert server.health()["running"] == 0


BAD = [
    (b"{bad json", 400, "invalid_json", None),
    (b"[1, 2]", 400, "invalid_json", None),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "5"}).encode(), 400, "invalid_type", "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(), 400, "invalid_value", "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 100000}).encode(), 400, "context_length_exceeded",
     "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x" * 600}).encode(), 400, "context_length_exceeded", "prompt"),
    (json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), 404, "model_not_found", "model"),
    (json.dumps({"model": MODEL, "prompt": "x", "n": 2}).encode(), 400, "unsupported_value", "n"),
    (json.dumps({"model": MODEL, "prompt": "x", "logprobs": 2}).encode(), 400, "unsupported_parameter", "logprobs"),
    (json.dumps({"model": MODEL, "prompt": "x", "temperature": 3}).encode(), 400, "invalid_value", "temperature"),
    (json.dumps({"model": MODEL}).encode(), 400, "missing", "prompt"),
]


@pytest.mark.parametrize("payload,status,code,param", BAD)
def test_bad_input_is_a_4xx_with_an_openai_error_object(server, payload, status, code, param):
    r = httpx.post(server.url + "/v1/completions", content=payload, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["code"], err["param"]) == (code, param)


def test_chat_bad_input_and_request_ids(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "tool"}]},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                   headers={"x-request-id": "client-chosen.id:42"}, timeout=30)
    assert r.headers["x-request-id"] == r.json()["id"] == "client-chosen.id:42"
    assert _n_output(server.stored("client-chosen.id:42")) == 2
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                   headers={"x-request-id": "no spaces or \x7f; " + "x" * 80}, timeout=30)
    rid = r.headers["x-request-id"]  # not a safe key: its safe characters (at most 40) and a random suffix
    assert r.status_code == 200 and rid == r.json()["id"] and rid.startswith("nospacesor" + "x" * 30 + "-")
    assert httpx.get(server.url + "/nope", timeout=10).json()["error"]["code"] == "not_found"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """One batch slot, one queue place: deterministic queueing, 429 and cancellation. The switch-jitter scenario
    (an expert cache miss waits 20-60 ms on a slow tier: ~25 ms a token) makes a 400-token request take ~10 s and a
    200-token one ~5 s on any machine, so each surely outlives what the tests do meanwhile (unloaded, tiny-demo
    makes 400 tokens in 0.75 s, within the 1 s a client waits below: a fresh-clone run saw it answered whole)."""
    s = Serve(tmp_path_factory.mktemp("small"), "--max-batch", "1", "--max-queue", "1", "--scenario", "switch-jitter",
              name="small", metrics=True)
    yield s
    assert s.stop() == 0
    assert "Traceback" not in s.log(), s.log()


def test_full_queue_answers_429_with_retry_after(small):
    async def main():
        async with httpx.AsyncClient(base_url=small.url, timeout=120) as c:
            body = {"model": MODEL, "prompt": "long", "max_tokens": 200, "temperature": 0}  # ~5 s: outlives refusals
            running = asyncio.ensure_future(c.post("/v1/completions", json=body))
            await asyncio.to_thread(small.wait_health, lambda h: h["running"] == 1)
            queued = asyncio.ensure_future(c.post("/v1/completions", json={**body, "max_tokens": 2}))
            await asyncio.to_thread(small.wait_health, lambda h: h["queued"] == 1)
            refused = await c.post("/v1/completions", json={**body, "max_tokens": 2})
            sdk = openai.AsyncOpenAI(base_url=small.url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError) as sdk_refused:
                await sdk.completions.create(model=MODEL, prompt="y", max_tokens=2)
            await sdk.close()
            return await running, await queued, refused, sdk_refused.value

    running, queued, refused, sdk_err = asyncio.run(main())
    assert running.status_code == queued.status_code == 200
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert "x-should-retry" not in refused.headers  # a later retry can succeed
    assert refused.json()["error"]["type"] == "rate_limit_error" and refused.json()["error"]["code"] == "queue_full"
    assert sdk_err.status_code == 429
    assert small.health()["rejected"] == 2
    assert small.stored(queued.json()["id"])["timings"]["queue_s"] > 0.1  # it waited for the one slot


def test_dropped_stream_and_dropped_request_free_the_slot_and_are_stored_cancelled(small):
    body = {"model": MODEL, "prompt": "drop me", "max_tokens": 400, "temperature": 0}
    with httpx.Client(base_url=small.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            rid = r.headers["x-request-id"]
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
    small.wait_health(lambda h: h["running"] == 0)  # freed long before 400 tokens
    doc = small.stored(rid)
    assert doc["finish_reason"] == "cancelled" and 1 <= _n_output(doc) < 400

    with pytest.raises(httpx.ReadTimeout):  # a whole response the client stops waiting for
        httpx.post(small.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0),
                   headers={"x-request-id": "gave-up"})
    small.wait_health(lambda h: h["running"] == 0)
    doc = small.stored("gave-up")
    assert doc["finish_reason"] == "cancelled" and _n_output(doc) < 400
    ok = small.client().completions.create(model=MODEL, prompt="next", max_tokens=3)  # the one slot serves again
    assert ok.usage.completion_tokens == 3
    # the exporter counts what the store holds, by finish reason (the served path feeds the same observers)
    from prometheus_client.parser import text_string_to_metric_families

    small.stored(ok.id)  # committed (the exporter counts it at once, the store within a commit interval)

    def both():
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{small.metrics_port}/metrics", timeout=30).read().decode()
        counts = {s.labels["finish_reason"]: s.value for f in text_string_to_metric_families(scraped)
                  for s in f.samples if s.name == "moescope_requests_total"}
        conn = store.open_store(small.traces)
        try:
            stored = dict(conn.execute("SELECT finish_reason, COUNT(*) FROM requests GROUP BY finish_reason"))
        finally:
            conn.close()
        return counts, stored

    # every request this server finished, by finish reason, in both (each settles within a commit interval)
    counts, stored = wait_until(both, until=lambda got: got[0] == got[1], timeout=30,
                                what="the exporter's counts equal the store's")
    assert counts["cancelled"] == 2


DRAIN_S = 5  # --shutdown-timeout of the SIGTERM test: the short request (24 tokens) ends well within it


def test_sigterm_finishes_or_cancels_in_flight_and_flushes_the_store(tmp_path):
    """SIGTERM with two requests in flight: the short one finishes within --shutdown-timeout, the long one is
    cancelled at it; both are in the flushed store and have spans. The switch-jitter scenario (every expert
    cache miss waits 20-60 ms on a slow tier) makes the long one take far longer than the deadline on any
    machine (~10 s against DRAIN_S = 5 s), while the short one needs well under it."""
    from test_otlp import Receiver, _attrs

    receiver = Receiver()
    s = Serve(tmp_path, "--max-batch", "2", "--shutdown-timeout", str(DRAIN_S), "--scenario", "switch-jitter",
              "--otlp-endpoint", f"http://127.0.0.1:{receiver.port}", name="term")
    try:
        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
                body = {"model": MODEL, "prompt": "p", "temperature": 0}
                long = asyncio.ensure_future(c.post("/v1/completions", json={**body, "max_tokens": 480},
                                                    headers={"x-request-id": "long-one"}))
                await asyncio.to_thread(s.wait_health, lambda h: h["running"] == 1)
                short = asyncio.ensure_future(c.post("/v1/completions", json={**body, "max_tokens": 24},
                                                     headers={"x-request-id": "short-one"}))
                await asyncio.to_thread(s.wait_health, lambda h: h["running"] == 2)
                s.proc.send_signal(signal.SIGTERM)
                signalled = time.time()

                async def refused():  # the listener closes at the signal (a loaded server may take a moment)
                    try:  # a new connection each try (a pooled keep-alive one would never be refused)
                        async with httpx.AsyncClient(base_url=s.url, timeout=2) as fresh:
                            await fresh.post("/v1/completions", json={**body, "max_tokens": 2})
                    except httpx.ConnectError:
                        return True
                    except httpx.TransportError:  # accepted into the backlog just before the listener closed
                        return False
                    return False  # answered (503 while draining): the listener not closed yet

                deadline = time.monotonic() + DRAIN_S / 2
                while not await refused():
                    assert time.monotonic() < deadline, "the listener still accepts after the signal"
                    await asyncio.sleep(0.1)
                return await short, await long, signalled

        short, long, signalled = asyncio.run(main())
        assert s.proc.wait(60) == 0
    finally:
        s.stop()
        receiver.stop()
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 24
    assert long.status_code == 503 and long.json()["error"]["code"] == "cancelled"
    conn = store.open_store(s.traces)
    short_doc, long_doc = store.load_request(conn, "short-one"), store.load_request(conn, "long-one")
    assert short_doc["started"] + short_doc["timings"]["total_s"] > signalled  # it finished while draining
    assert long_doc["finish_reason"] == "cancelled" and 0 < _n_output(long_doc) < 480
    # cancelled at the deadline, counted from the server's receipt of the signal (after `signalled`): never
    # before it; after it by at most the step in progress (a jittered step) and the server's load
    ended = long_doc["started"] + long_doc["timings"]["total_s"]
    assert signalled + DRAIN_S - 0.25 <= ended <= signalled + DRAIN_S + 4, (ended - signalled)
    assert "traces flushed" in s.log() and "Traceback" not in s.log()
    spans = {_attrs(sp).get("moescope.request_id"): sp for _, sp in receiver.spans() if sp.name == "moescope.request"}
    assert set(spans) == {"short-one", "long-one"}  # the request id is on the span; the store links the trace id
    assert short_doc["trace_id"] == spans["short-one"].trace_id.hex()


def test_deepseek_v3_shape_answers_a_completion(tmp_path):
    s = Serve(tmp_path, "--model", "deepseek-v3-shape", "--max-batch", "4", name="dsv3")
    try:
        comp = s.client().completions.create(model="deepseek-v3-shape", prompt="hello", max_tokens=3)
        assert comp.usage.completion_tokens == 3 or comp.choices[0].finish_reason == "stop"
        doc = s.stored(comp.id)
        assert doc["model"] == "deepseek-v3-shape" and len(doc["layers"]) == 58 and doc["top_k"] == 8
    finally:
        assert s.stop() == 0
    assert "Traceback" not in s.log()


@pytest.mark.skipif(os.name != "posix", reason="signals")
def test_port_in_use_is_one_line_exit_2(server):
    r = _cli("serve", "--port", str(server.port), "--metrics-port", "-1", "--traces", "none")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot listen" in r.stderr


def test_load_benchmark_quick_runs(tmp_path):
    from conftest import ROOT

    out = tmp_path / "serve.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--quick", "--out", str(out)],
                   check=True, timeout=600, capture_output=True)
    report = json.loads(out.read_text())
    (bench,) = report["models"].values()
    assert bench["model"] == MODEL and [r["concurrency"] for r in bench["rows"]] == [1, 8]
    for row in bench["rows"]:
        for v in ("capture_on", "capture_off"):
            s = row[v]
            assert s["errors"] == 0 and s["requests"] == bench["requests_per_load"][str(row["concurrency"])]
            assert s["tokens_per_s"] > 0 and 0 < s["ttft_p50_s"] <= s["ttft_p99_s"]
            assert s["server_cpu_ms_per_token"] > 0  # the server process's own CPU (Linux /proc)
        assert row["throughput_off_over_on"] == pytest.approx(
            row["capture_off"]["tokens_per_s"] / row["capture_on"]["tokens_per_s"])  # one round: its own ratio
    (open_row,) = bench["open"]["rows"]  # Poisson arrivals at 2x saturation
    for v in ("capture_on", "capture_off"):
        s, (run,) = open_row[v], bench["open"]["runs"][f"{v}/2"]
        assert s["sent"] == s["answered"] + s["rejected_429"] + s["errors"] and s["errors"] == 0
        assert s["rate"] == pytest.approx(2 * bench["open"]["saturation_rps"])
        assert s["goodput_tokens_per_s"] == pytest.approx(run["tokens"] / run["wall_s"])
        assert run["tokens"] == s["answered"] * bench["max_tokens"]  # greedy, no EOS: every answer is full length
