"""The engine's serving seams (``moescope serve`` builds on them): per-request sinks, cancel, timeout, stop strings
and per-request seeds, each checked against a plain engine run of the same requests as the reference."""

from __future__ import annotations

from helpers import Recording
from moescope.runtime import tokenizer
from moescope.runtime.engine import Engine
from moescope.runtime.model import MoETransformer

PROMPTS = ["def add(a, b):", "The river", "12 + 7 =", "¿Qué tal?", "import os", "Once upon"]


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        self.t += 0.01  # every reading advances: steps take time
        return self.t


def _engine(cfg, **kw):
    obs = Recording()
    return Engine(MoETransformer(cfg), seed=1, observer=obs, **kw), obs


def _drain(engine):
    while engine.has_work:
        engine.step()


def test_sink_gets_every_token_once_in_order_then_the_record(tiny_cfg):
    plain, _ = _engine(tiny_cfg, max_batch=3)
    ref = {}
    for i, p in enumerate(PROMPTS):
        ref[plain.submit(p, max_new_tokens=6 + i, request_id=f"r{i}")] = None
    _drain(plain)
    ref = {r.request_id: r.output_tokens for r in plain.finished}

    engine, _ = _engine(tiny_cfg, max_batch=3)
    got: dict[str, list] = {}
    for i, p in enumerate(PROMPTS):
        rid = f"r{i}"
        engine.submit(p, max_new_tokens=6 + i, request_id=rid,
                      sink=lambda tok, rec, rid=rid: got.setdefault(rid, []).append((tok, rec)))
    _drain(engine)
    for rid, calls in got.items():
        tokens = tuple(t for t, _ in calls)
        assert tokens == ref[rid]  # the same tokens as without sinks: a sink changes nothing the engine does
        assert all(rec is None for _, rec in calls[:-1])
        assert calls[-1][1].request_id == rid and calls[-1][1].output_tokens == tokens


def test_a_raising_sink_is_counted_and_never_stops_the_engine(tiny_cfg):
    engine, obs = _engine(tiny_cfg)

    def broken(tok, rec):
        raise RuntimeError("client went away badly")

    engine.submit("hello", max_new_tokens=4, sink=broken)
    engine.submit("world", max_new_tokens=4)
    _drain(engine)
    assert len(obs.requests) == 2 and engine.sink_errors == 4


def test_cancel_frees_the_slot_and_records_the_request_as_cancelled(tiny_cfg):
    engine, obs = _engine(tiny_cfg, max_batch=2)
    a = engine.submit(PROMPTS[0], max_new_tokens=40, request_id="a")
    engine.submit(PROMPTS[1], max_new_tokens=40, request_id="b")
    engine.submit(PROMPTS[2], max_new_tokens=3, request_id="c")
    queued = engine.submit(PROMPTS[3], max_new_tokens=3, request_id="q")
    engine.step()  # prefill a and b; c and q wait (max_batch 2)
    engine.step()
    endings = []
    engine._running[0].sink = lambda tok, rec: endings.append((tok, rec))
    rec_a = engine.cancel(a)
    assert rec_a.finish_reason == "cancelled" and rec_a.n_output == 2 and endings == [(None, rec_a)]
    assert engine.cancel(a) is None  # already gone
    rec_q = engine.cancel(queued)
    assert rec_q.finish_reason == "cancelled" and rec_q.n_output == 0 and rec_q.ttft_s == 0.0
    assert rec_q.queue_s == rec_q.total_s > 0
    engine.step()  # the freed slot takes c at once
    assert [r.request_id for r in engine._running] == ["b", "c"]
    _drain(engine)
    assert [r.request_id for r in obs.requests][:2] == ["a", "q"]
    assert {r.request_id: r.finish_reason for r in obs.requests}["c"] in ("length", "eos")
    # the cancelled request's tokens are a prefix of what it would have made
    ref, _ = _engine(tiny_cfg, max_batch=2)
    ref.submit(PROMPTS[0], max_new_tokens=40, request_id="a")
    ref.submit(PROMPTS[1], max_new_tokens=40, request_id="b")
    _drain(ref)
    assert ref.finished[[r.request_id for r in ref.finished].index("a")].output_tokens[:2] == rec_a.output_tokens


def test_timeout_ends_running_and_queued_requests(tiny_cfg):
    clock = FakeClock()
    engine, obs = _engine(tiny_cfg, max_batch=1, clock=clock)
    engine.submit(PROMPTS[0], max_new_tokens=50, request_id="slow", timeout_s=0.2)
    engine.submit(PROMPTS[1], max_new_tokens=50, request_id="queued", timeout_s=0.1)
    engine.submit(PROMPTS[2], max_new_tokens=2, request_id="fine")
    _drain(engine)
    by = {r.request_id: r for r in obs.requests}
    assert by["slow"].finish_reason == "timeout" and 0 < by["slow"].n_output < 50
    assert by["slow"].total_s >= 0.2
    assert by["queued"].finish_reason == "timeout" and by["queued"].n_output == 0
    assert by["fine"].finish_reason in ("length", "eos")


def test_stop_string_ends_the_request_where_the_reference_output_first_contains_it(tiny_cfg):
    ref, _ = _engine(tiny_cfg)
    ref.submit(PROMPTS[0], max_new_tokens=40, request_id="r")
    _drain(ref)
    out = [t for t in ref.finished[0].output_tokens if t < 256]
    stop = bytes(out[5:7]).decode("utf-8", errors="ignore") or "x"
    stop_ids = list(stop.encode())
    first_end = next(i + len(stop_ids) for i in range(len(out)) if out[i:i + len(stop_ids)] == stop_ids)

    engine, _ = _engine(tiny_cfg)
    engine.submit(PROMPTS[0], max_new_tokens=40, request_id="r", stop=[stop, "never-made-\x00"])
    _drain(engine)
    rec = engine.finished[0]
    assert rec.finish_reason == "stop"
    assert list(rec.output_tokens) == out[:first_end]
    assert tokenizer.decode(list(rec.output_tokens)).endswith(stop)


def test_request_seed_fixes_sampling_whatever_the_submission_order(tiny_cfg):
    outs = []
    for order in (PROMPTS[:3], PROMPTS[:3][::-1]):
        engine, _ = _engine(tiny_cfg, max_batch=1)
        for p in order:
            engine.submit(p, max_new_tokens=12, temperature=1.0, seed=PROMPTS.index(p), request_id=p)
        _drain(engine)
        outs.append({r.request_id: r.output_tokens for r in engine.finished})
    assert outs[0] == outs[1]
