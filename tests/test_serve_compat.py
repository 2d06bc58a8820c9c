"""What load generators and gateways expect of ``moescope serve`` (issue 22, item 2), against a real server
subprocess with the ``openai`` SDK, httpx and curl. Each answer is checked against a reference: the trace
store's record, the tokenizer, a greedy run of the same weights in this process.

The served weights are the demo model's with the EOS row of the output head set to 1.05 x the space's: the
demo model was never trained on EOS (greedy never ends on it), this copy ends wherever the demo model would
print a space with a positive logit. So ``ignore_eos`` must give exactly the demo model's greedy output and
``min_tokens`` its first ``min_tokens`` tokens: real changes of what the engine samples, checked against the
unmodified model.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
import time

import httpx
import pytest

from conftest import in_ci
from moescope.runtime import tokenizer
from test_serve import Serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ALIASES = ("alias-a", "alias-b")


def _greedy(model, prompt_ids: list[int], max_tokens: int):
    from moescope.runtime.engine import Engine

    engine = Engine(model, max_batch=1)
    engine.submit("", prompt_ids=prompt_ids, max_new_tokens=max_tokens)
    while engine.has_work:
        engine.step()
    return engine.finished[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the demo model, the demo model whose EOS logit copies the space's, the latter's weights file)."""
    import torch

    from moescope.runtime import loader, weights

    demo, eos = loader.build_model("tiny-demo"), loader.build_model("tiny-demo")
    with torch.no_grad():
        eos.lm_head.weight[tokenizer.EOS] = eos.lm_head.weight[ord(" ")] * 1.05
    path = weights.save(eos, tmp_path_factory.mktemp("w") / "eos-demo.safetensors", dtype=torch.float32)
    return demo, eos, path


@pytest.fixture(scope="module")
def server(tmp_path_factory, models):
    """One batch slot (so requests queue) and an unbounded admission queue (``--max-queue 0``)."""
    s = Serve(tmp_path_factory.mktemp("compat"), "--weights", str(models[2]), "--max-batch", "1",
              "--max-queue", "0", *(a for name in ALIASES for a in ("--served-model-name", name)))
    yield s
    assert s.stop() == 0
    assert "Traceback" not in s.log(), s.log()


def _post(server, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def _curl() -> str:
    curl = shutil.which("curl")
    if curl is None:
        (pytest.fail if in_ci() else pytest.skip)("curl not installed")
    return curl


def _decode_outputs(doc: dict) -> list[int]:
    return [t["token"] for t in doc["tokens"] if t["phase"] == "decode"]


def test_served_names_version_tokenize_detokenize(server):
    import moescope

    models = server.client().models.list()
    assert [m.id for m in models.data] == list(ALIASES)
    assert httpx.get(server.url + "/version", timeout=10).json() == {"version": moescope.__version__}
    curl = _curl()
    out = subprocess.run([curl, "-sf", server.url + "/tokenize", "-d", json.dumps({"prompt": "héllo"})],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {"count": 7, "max_model_len": 512, "tokens": tokenizer.encode("héllo")}
    r = _post(server, "/tokenize", {"model": ALIASES[1], "prompt": "ab", "add_special_tokens": False,
                                    "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode("ab", bos=False) and r["token_strs"] == ["a", "b"]
    from moescope.serve import chat

    msgs = [{"role": "user", "content": "hi"}]
    r = _post(server, "/tokenize", {"messages": msgs}).json()
    assert r["tokens"] == tokenizer.encode(chat.render([("user", "hi")]))
    ids = tokenizer.encode("round trip ✓")
    assert _post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    for path, body, param in (("/detokenize", {"tokens": [1, 260]}, "tokens"),
                              ("/tokenize", {"model": "tiny-demo", "prompt": "x"}, "model"),
                              ("/tokenize", {}, "prompt")):
        r = _post(server, path, body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
        assert r.headers["x-should-retry"] == "false"


def test_aliases_answer_under_their_name_and_the_store_keeps_the_model_name(server):
    client = server.client()
    comp = client.completions.create(model=ALIASES[1], prompt="The river", max_tokens=3, temperature=0)
    assert comp.model == ALIASES[1]
    assert server.stored(comp.id)["model"] == "tiny-demo"
    r = _post(server, "/v1/completions", {"model": "tiny-demo", "prompt": "x"})  # only the served names
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_token_id_prompts_equal_the_text_prompt(server, models):
    demo, eos, _ = models
    client = server.client()
    ids = _post(server, "/tokenize", {"prompt": "def add(a, b):"}).json()["tokens"]
    text = client.completions.create(model=ALIASES[0], prompt="def add(a, b):", max_tokens=6, temperature=0)
    for prompt in (ids, [ids]):  # a list of ids and a list of one such list
        comp = client.completions.create(model=ALIASES[0], prompt=prompt, max_tokens=6, temperature=0)
        assert comp.choices[0].text == text.choices[0].text and comp.usage.prompt_tokens == len(ids)
        doc = server.stored(comp.id)
        assert [t["token"] for t in doc["tokens"] if t["phase"] == "prefill"] == ids
    ref = _greedy(eos, ids, 6)
    assert text.choices[0].text == tokenizer.decode(list(ref.output_tokens))
    no_bos = [ord(c) for c in "xyz"]  # used as given: no BOS is added
    comp = client.completions.create(model=ALIASES[0], prompt=no_bos, max_tokens=4, temperature=0)
    assert _decode_outputs(server.stored(comp.id)) == list(_greedy(eos, no_bos, 4).output_tokens)
    for bad in ([256, 260], [-1], [], [[1], [2]]):
        r = _post(server, "/v1/completions", {"model": ALIASES[0], "prompt": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (bad, r.text)


def test_ignore_eos_and_min_tokens_change_what_the_engine_samples(server, models):
    demo, eos, _ = models
    client = server.client()
    prompt = "The river"
    ids = tokenizer.encode(prompt)
    plain = client.completions.create(model=ALIASES[0], prompt=prompt, max_tokens=24, temperature=0)
    ref_demo = _greedy(demo, ids, 24)  # the unmodified model: never EOS
    ref_eos = _greedy(eos, ids, 24)
    assert ref_demo.finish_reason == "length" and ref_eos.finish_reason == "eos"
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == ref_eos.n_output < 24

    fixed = client.completions.create(model=ALIASES[0], prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
    doc = server.stored(fixed.id)
    assert fixed.choices[0].finish_reason == "length" and fixed.usage.completion_tokens == 24
    assert _decode_outputs(doc) == list(ref_demo.output_tokens)  # EOS never sampled: the demo model's output

    m = 8
    early = ref_eos.n_output
    assert early < m
    at_least = client.completions.create(model=ALIASES[0], prompt=prompt, max_tokens=24, temperature=0,
                                         extra_body={"min_tokens": m})
    out = _decode_outputs(server.stored(at_least.id))
    assert out[:m] == list(ref_demo.output_tokens[:m]) and tokenizer.EOS not in out[:m]
    # from min_tokens on, EOS may be sampled: the rest is the EOS model's greedy continuation of what came before
    rest = _greedy(eos, ids + out[:m], 24 - m)
    assert out[m:] == list(rest.output_tokens) and at_least.choices[0].finish_reason == "stop"

    with_temp = client.completions.create(model=ALIASES[0], prompt=prompt, max_tokens=16, temperature=1.0, seed=3,
                                          extra_body={"ignore_eos": True})
    assert with_temp.usage.completion_tokens == 16 and tokenizer.EOS not in _decode_outputs(
        server.stored(with_temp.id))
    for body in ({"min_tokens": 30, "max_tokens": 24}, {"min_tokens": -1}, {"ignore_eos": "yes"}):
        r = _post(server, "/v1/completions", {"model": ALIASES[0], "prompt": "x", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] in body, r.text


def test_role_chunk_comes_with_the_first_token_not_before_admission(server, models):
    """One batch slot, taken by a long request: the streamed chat waits in the queue, and its first chunk (the
    role, with the first token's text) cannot reach the client before the engine made that token."""
    _, eos, _ = models

    async def run():
        client = server.async_client()
        blocker = asyncio.ensure_future(client.completions.create(
            model=ALIASES[0], prompt="hold the slot", max_tokens=400, temperature=0, extra_body={"ignore_eos": True}))
        await asyncio.to_thread(server.wait_health, lambda h: h["running"] == 1)
        t0 = time.perf_counter()
        stream = await client.chat.completions.create(
            model=ALIASES[0], messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
            stream=True)
        chunks, first_at = [], None
        async for c in stream:
            first_at = first_at or time.perf_counter()
            chunks.append(c)
        await blocker
        await client.close()
        return chunks, first_at - t0

    chunks, client_ttft = asyncio.run(run())
    doc = server.stored(chunks[0].id)
    assert doc["timings"]["queue_s"] > 0.05  # it did wait for the slot
    assert client_ttft >= doc["timings"]["ttft_s"]  # the first chunk left after the first token was made
    first = chunks[0].choices[0].delta
    out = _decode_outputs(doc)
    assert first.role == "assistant" and first.content == tokenizer.decode(out[:1])  # the token's text with it
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == doc["output"]
    assert chunks[0].model == ALIASES[0]


def test_unbounded_queue_answers_every_request(server):
    async def run():
        client = server.async_client()
        rs = await asyncio.gather(*(client.completions.create(model=ALIASES[0], prompt=f"q{i}", max_tokens=6,
                                                              temperature=0, extra_body={"ignore_eos": True})
                                     for i in range(24)))
        await client.close()
        return rs

    assert server.health()["max_queue"] == 0
    rs = asyncio.run(run())  # 24 at once into 1 slot: with a bound they would get 429s; unbounded, all wait
    assert len({r.id for r in rs}) == 24
    for r in rs:
        doc = server.stored(r.id)
        assert doc["output"] == r.choices[0].text and r.usage.completion_tokens == 6
    assert server.health()["rejected"] == 0


def test_any_request_id_is_accepted_with_a_distinct_store_key(server):
    async def two_at_once():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": ALIASES[0], "prompt": "same id", "max_tokens": 160, "temperature": 0,
                    "ignore_eos": True}
            return await asyncio.gather(*(c.post(server.url + "/v1/completions", json=body,
                                                 headers={"x-request-id": "dup-1"}) for _ in range(2)))

    rs = asyncio.run(two_at_once())  # the second arrives while the first is in flight
    keys = sorted(r.headers["x-request-id"] for r in rs)
    assert all(r.status_code == 200 and r.json()["id"] == r.headers["x-request-id"] for r in rs)
    assert keys[0] == "dup-1" and keys[1].startswith("dup-1-") and len(keys[1]) == len("dup-1-") + 8
    for r in rs:
        assert server.stored(r.headers["x-request-id"])["output"] == r.json()["choices"][0]["text"]
    curl = _curl()
    out = subprocess.run([curl, "-s", "-i", server.url + "/v1/completions", "-H", "x-request-id: trace me/é 1",
                          "-d", json.dumps({"model": ALIASES[0], "prompt": "x", "max_tokens": 2})],
                         capture_output=True, text=True, check=True).stdout
    head, _, payload = out.replace("\r\n", "\n").partition("\n\n")
    rid = dict(line.split(": ", 1) for line in head.splitlines()[1:])["x-request-id"]
    assert rid == json.loads(payload)["id"] and rid.startswith("traceme1-")
    assert server.stored(rid)["request_id"] == rid


def test_user_is_stored_as_a_bounded_label(server):
    client = server.client()
    for user, label in (("team-a@corp", "team-a@corp"),
                        ("Émile <emile@example.com>\n", "u-" + hashlib.sha256(
                            "Émile <emile@example.com>\n".encode()).hexdigest()[:16]),
                        ("x" * 500, "u-" + hashlib.sha256(b"x" * 500).hexdigest()[:16])):
        comp = client.completions.create(model=ALIASES[0], prompt="hi", max_tokens=2, user=user)
        assert server.stored(comp.id)["tenant"] == label


def test_should_retry_header_only_where_a_retry_cannot_help(server):
    curl = _curl()
    for body, status in (({"model": ALIASES[0], "prompt": "x", "max_tokens": 0}, 400),
                         ({"model": "nope", "prompt": "x"}, 404)):
        out = subprocess.run([curl, "-s", "-i", server.url + "/v1/completions", "-d", json.dumps(body)],
                             capture_output=True, text=True, check=True).stdout.lower()
        assert out.startswith(f"http/1.1 {status}") and "\nx-should-retry: false" in out.replace("\r", "")
    ok = subprocess.run([curl, "-s", "-i", server.url + "/v1/completions", "-d",
                         json.dumps({"model": ALIASES[0], "prompt": "x", "max_tokens": 1})],
                        capture_output=True, text=True, check=True).stdout.lower()
    assert ok.startswith("http/1.1 200") and "x-should-retry" not in ok
