import torch
from helpers import Recording

from moescope.runtime import tokenizer, traffic
from moescope.runtime.engine import Engine
from moescope.runtime.model import MoETransformer, Segment


def _serve(cfg, temperature, n=12, max_batch=4):
    model = MoETransformer(cfg)
    rec = Recording()
    engine = Engine(model, max_batch=max_batch, seed=5, observer=rec)
    reqs = traffic.generate(traffic.TrafficConfig(seed=2, output_tokens_median=8), n)
    records = engine.run(reqs, realtime=False, temperature=temperature)
    return records, rec


def test_seeded_run_is_bit_identical_twice(tiny_cfg):
    for temperature in (0.0, 0.9):
        a, rec_a = _serve(tiny_cfg, temperature)
        b, rec_b = _serve(tiny_cfg, temperature)
        assert [r.output_tokens for r in a] == [r.output_tokens for r in b]
        assert len(rec_a.decisions) == len(rec_b.decisions) > 0
        assert all(la == lb and torch.equal(x, y) for (la, x, _), (lb, y, _) in zip(rec_a.decisions, rec_b.decisions))


def test_engine_output_equals_manual_greedy_decode(tiny_cfg):
    records, _ = _serve(tiny_cfg, 0.0, n=5, max_batch=3)
    model = MoETransformer(tiny_cfg).eval()
    for r in records:
        cache = model.new_cache()
        toks = list(r.prompt_tokens)
        out = []
        with torch.no_grad():
            logits = model(torch.tensor(toks), [Segment(len(toks), cache)], last_only=True).logits
            while True:
                logits[:, [tokenizer.PAD, tokenizer.BOS]] = float("-inf")
                nxt = int(logits.argmax(-1))
                out.append(nxt)
                if nxt == tokenizer.EOS or len(out) == r.n_output:
                    break
                logits = model(torch.tensor([nxt]), [Segment(1, cache)], last_only=True).logits
        assert tuple(out) == r.output_tokens


def test_request_timings_and_steps_are_consistent(tiny_cfg):
    records, rec = _serve(tiny_cfg, 0.0)
    assert {r.request_id for r in records} == {r.request_id for r in rec.requests}
    assert len({r.request_id for r in records}) == len(records)  # ids unique
    for r in records:
        assert r.n_output == len(r.token_latencies_s) > 0
        assert r.ttft_s >= r.queue_s + r.prefill_s - 1e-9
        assert abs(sum(r.token_latencies_s) - r.total_s) < 1e-9
        assert r.finish_reason in ("length", "eos")
    phases = {s.phase for s in rec.step_records}
    assert phases == {"prefill", "decode"}
    # Every token the engine ran is accounted to a request in the step records.
    total = sum(n for s in rec.step_records for _, _, n in s.segments)
    assert total == sum(len(r.prompt_tokens) + r.n_output - 1 for r in records)


def test_given_request_ids_are_kept_and_long_prompts_truncated(tiny_cfg):
    engine = Engine(MoETransformer(tiny_cfg), max_batch=2)
    rid = engine.submit("x" * 500, max_new_tokens=4, request_id="my-request")
    while engine.has_work:
        engine.step()
    (r,) = engine.finished
    assert r.request_id == rid == "my-request"
    assert r.truncated_prompt and len(r.prompt_tokens) == tiny_cfg.max_seq_len - 4
