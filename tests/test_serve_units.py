"""``moescope.serve`` without HTTP: request validation, the chat template, request ids, text assembly (against
``tokenizer.decode`` and a naive stop search) and the engine loop (against a plain engine run)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import wait_until
from moescope.runtime import tokenizer
from moescope.runtime.engine import Engine
from moescope.runtime.model import MoETransformer
from moescope.serve import chat, ids
from moescope.serve.openai_errors import APIError
from moescope.serve.loop import EngineLoop, Job, asyncio_waker, now
from moescope.serve.protocol import ModelLimits, parse_chat, parse_completion
from moescope.serve.text import TextAssembler, whole_text

LIMITS = ModelLimits("m", 64)


def test_chat_template_and_chat_defaults():
    p = parse_chat({"model": "m", "messages": [{"role": "developer", "content": "rules"},
                                               {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                            {"type": "text", "text": "b"}]},
                                               {"role": "assistant", "content": None}], "logprobs": False}, LIMITS)
    assert p.prompt == "<|system|>\nrules\n<|user|>\nab\n<|assistant|>\n\n<|assistant|>\n"
    assert p.prompt == chat.render([("system", "rules"), ("user", "ab"), ("assistant", ""), ])
    assert p.prompt_tokens == len(p.prompt.encode()) + 1 and p.max_tokens == 64 - p.prompt_tokens  # rest of context
    assert p.temperature == 1.0 and not p.stream  # OpenAI's defaults


def test_completion_limits_and_neutral_values_of_unsupported_fields():
    p = parse_completion({"model": "m", "prompt": ["x" * 45], "top_p": 1, "echo": False, "stop": "\n"}, LIMITS)
    assert (p.prompt_tokens, p.max_tokens, p.stop) == (46, 16, ("\n",))
    assert parse_completion({"model": "m", "prompt": "x" * 61, "max_tokens": 2}, LIMITS).max_tokens == 2
    with pytest.raises(APIError) as e:  # 62 prompt tokens + 3 > 64
        parse_completion({"model": "m", "prompt": "x" * 61, "max_tokens": 3}, LIMITS)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    with pytest.raises(APIError) as e:  # no room for even one token
        parse_completion({"model": "m", "prompt": "x" * 63}, LIMITS)
    assert e.value.param == "prompt"
    for field, value in (("top_p", 0.5), ("echo", True), ("stop", ["a"] * 5), ("prompt", ["a", "b"]),
                         ("temperature", "1"), ("seed", 1.5), ("stream", 1)):
        with pytest.raises(APIError) as e:
            parse_completion({"model": "m", "prompt": "x", field: value}, LIMITS)
        assert e.value.status == 400 and e.value.param == field, (field, e.value.body())


def test_token_id_prompts_min_tokens_and_served_names():
    limits = ModelLimits("m", 64, ("a", "b"), 260)
    ids_ = tokenizer.encode("hello")
    for prompt in (ids_, [ids_]):
        p = parse_completion({"model": "b", "prompt": prompt, "min_tokens": 3, "ignore_eos": True}, limits)
        assert (p.prompt_ids, p.prompt, p.prompt_tokens, p.model) == (tuple(ids_), "hello", len(ids_), "b")
        assert (p.min_tokens, p.ignore_eos, p.max_tokens) == (3, True, 16)
    for body, param in (({"model": "m", "prompt": "x"}, "model"), ({"model": "a", "prompt": [0, 260]}, "prompt"),
                        ({"model": "a", "prompt": [[1], [2]]}, "prompt"), ({"model": "a", "prompt": [True]}, "prompt"),
                        ({"model": "a", "prompt": "x", "min_tokens": 17}, "min_tokens")):
        with pytest.raises(APIError) as e:
            parse_completion(body, limits)
        assert e.value.param == param and e.value.status in (400, 404), body


def test_request_ids_and_tenants():
    import hashlib
    import re

    assert ids.request_id("abc-1.2:3") == "abc-1.2:3"
    for bad in (None, "", "é", "-._:", "\x1b"):  # nothing safe in it: a fresh id
        new = ids.request_id(bad)
        assert new != bad and len(new) == 16 and int(new, 16) >= 0
    for bad, prefix in (("x y", "xy"), (" x", "x"), ("x" * 65, "x" * ids.PREFIX_CHARS), ("-lead", "lead"),
                        ("a\x1bb", "ab")):
        new = ids.request_id(bad)  # its safe characters, then 8 random hex digits: distinct each time
        assert re.fullmatch(re.escape(prefix) + "-[0-9a-f]{8}", new) and new != ids.request_id(bad), (bad, new)
    assert ids.tenant("team-a@corp") == "team-a@corp" and ids.tenant(None) is None
    for user in ("x" * 65, "a b", "émile", "\x1b[31m"):  # any other string: a bounded hashed label, stable
        assert ids.tenant(user) == "u-" + hashlib.sha256(user.encode()).hexdigest()[:16] == ids.tenant(user)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 255), max_size=40))
def test_streamed_text_equals_decode(tokens):
    asm = TextAssembler()
    streamed = "".join(asm.feed(t) for t in tokens) + asm.finish("length")
    assert streamed == tokenizer.decode(tokens) == whole_text(tuple(tokens + [tokenizer.EOS]), (), "eos")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([ord(c) for c in "ab\n"] + [0xC3, 0xA9]), max_size=30),
       st.lists(st.sampled_from(["a", "b\n", "ab", "\né", "bb"]), min_size=1, max_size=3))
def test_stop_strings_never_stream_and_are_trimmed(tokens, stops):
    # reference: the engine ends at the first token after which the output ends with a stop (bytes)
    end, hit = len(tokens), None
    for i in range(1, len(tokens) + 1):
        hit = next((s for s in stops if bytes(tokens[:i]).endswith(s.encode())), None)
        if hit:
            end = i
            break
    made = tokens[:end]
    reason = "stop" if hit else "length"
    asm = TextAssembler(tuple(stops))
    sent = ""
    for t in made:
        sent += asm.feed(t)
    answer = sent + asm.finish(reason)
    expect = tokenizer.decode(made)
    if hit:
        expect = expect[:len(expect) - len(hit)]
    assert answer == expect == whole_text(tuple(made), tuple(stops), reason)
    assert expect.startswith(sent)  # nothing sent while streaming was taken back


def _jobs(prompts, max_tokens=6, **kw):
    from moescope.serve.protocol import Params

    return [Job(f"j{i}", Params("completion", p, len(p) + 1, max_tokens, 0.0, None, (), None, False, False), now())
            for i, p in enumerate(prompts)]


PROMPTS = ["alpha", "beta gamma", "delta", "epsilon zeta eta", "theta", "iota"]


def test_engine_loop_serves_like_a_plain_engine_and_bounds_its_queue(tiny_cfg):
    model = MoETransformer(tiny_cfg)
    plain = Engine(model, max_batch=2)
    for i, p in enumerate(PROMPTS):
        plain.submit(p, max_new_tokens=6, request_id=f"j{i}")
    while plain.has_work:
        plain.step()
    ref = {r.request_id: r.output_tokens for r in plain.finished}

    async def main():
        loop = EngineLoop(Engine(model, max_batch=2), max_queue=3)
        jobs = _jobs(PROMPTS)
        # before the thread runs, the bound is exact: 3 waiting + the 2 free batch slots' worth, then full; a
        # repeated id is refused
        offers = [loop.offer(j) for j in jobs]
        assert offers == ["ok"] * 5 + ["full"] and loop.admission.rejected == 1
        assert loop.offer(_jobs(["again"])[0]) == "duplicate"
        loop.start(asyncio_waker(asyncio.get_running_loop()))
        streamed = {}
        for j in jobs[:5]:
            toks = []
            while True:
                got, rec = await j.stream.next()
                toks += got
                if rec is not None:
                    break
            streamed[j.request_id] = (tuple(toks), rec)
        for j in jobs[5:]:
            assert loop.offer(j) == "ok"
        records = [await j.stream.done() for j in jobs[5:]]
        loop.close()
        return streamed, records

    streamed, records = asyncio.run(main())
    for rid, (toks, rec) in streamed.items():
        assert toks == rec.output_tokens == ref[rid]
    assert all(r.output_tokens == ref[r.request_id] for r in records)


LONG_TOKENS = 2000  # a request the drain must cut: thousands of steps, cut within a few


def test_engine_loop_cancels_queued_and_running_and_drains(tiny_cfg):
    import dataclasses

    model = MoETransformer(dataclasses.replace(tiny_cfg, max_seq_len=LONG_TOKENS + 64))

    async def main():
        loop = EngineLoop(Engine(model, max_batch=1), max_queue=8)
        loop.start(asyncio_waker(asyncio.get_running_loop()))
        # (long enough that no loaded machine finishes one before the drain: cancelled is the only way it ends)
        long, queued, late = _jobs(["long one", "queued", "late"], max_tokens=LONG_TOKENS)
        for j in (long, queued):
            assert loop.offer(j) == "ok"
        await long.stream.next()  # running
        loop.cancel(queued)  # still waiting for the one slot: recorded all the same
        rq = await queued.stream.done()
        loop.drain(0.0)  # the deadline is now: everything left is cancelled at the loop's next turn
        assert loop.offer(late) == "ok"
        rl, rlate = await long.stream.done(), await late.stream.done()
        loop.close()
        return rq, rl, rlate, loop

    rq, rl, rlate, loop = asyncio.run(main())
    assert rq.finish_reason == "cancelled" and rq.n_output == 0
    assert rl.finish_reason == rlate.finish_reason == "cancelled" and 0 < rl.n_output < LONG_TOKENS
    assert loop.running == 0 and not loop._thread.is_alive()


def test_served_connections_have_tcp_nodelay():
    """The listening socket says IPPROTO_TCP, so asyncio sets TCP_NODELAY on every accepted connection (else a
    response written as headers + body waits ~40 ms for the client's delayed ACK: every keep-alive request)."""
    import socket

    from moescope.serve.server import bind

    sock = bind("127.0.0.1", 0)

    async def main():
        accepted = asyncio.get_running_loop().create_future()

        def on_connect(reader, writer):
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname())
        nodelay = await accepted
        writer.close()
        server.close()
        return nodelay

    assert asyncio.run(main()) != 0


def test_serving_metrics_count_every_token_when_the_event_loop_lags(tiny_cfg):
    """The engine makes all of a request's tokens while the event loop is blocked, so every step's wake-up waits
    in its queue: the metrics must still count each token once (per-step snapshots), against the records."""
    from moescope.serve.metrics import ServeMetrics

    model = MoETransformer(tiny_cfg)

    async def main():
        loop = EngineLoop(Engine(model, max_batch=2), max_queue=8)
        metrics = ServeMetrics("tiny", loop)
        jobs = _jobs(["lagging one", "lagging two"], max_tokens=12)
        for j in jobs:
            metrics.admitted(j)
            assert loop.offer(j) == "ok"
        loop.start(metrics.waker(asyncio.get_running_loop()))
        # time.sleep inside: blocks the event loop, so the wake-ups queue up behind it
        wait_until(lambda: loop.served, until=lambda n: n >= len(jobs), timeout=60, what="both jobs served",
                   interval=0.05)
        records = [await j.stream.done() for j in jobs]
        loop.close()
        return metrics, records

    metrics, records = asyncio.run(main())
    n_out = [r.n_output for r in records]
    assert all(n > 1 for n in n_out)
    samples = {s.name: s.value for m in metrics.registry.collect() for s in m.samples}
    assert samples["moescope_serve_generation_tokens_total"] == sum(n_out)
    assert samples["moescope_serve_time_to_first_token_seconds_count"] == len(records)
    assert samples["moescope_serve_inter_token_latency_seconds_count"] == sum(n - 1 for n in n_out)
