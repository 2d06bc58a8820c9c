"""Sampling users can follow: a request the trace writer served but did not keep is reported as such by
`moescope trace` (with the sample rate and how to keep every request), never as "no request"; a client keeps one
request by an id that starts with ``moescope-keep-``; the record of ids not kept stays bounded.

On the reference runtime's ``moescope serve`` (its response id is the client's ``x-request-id``); the same on a
real vLLM server: tests/test_vllm_diagnose.py."""

from __future__ import annotations


import httpx
import pytest

from helpers import run_cli, stored_ids
from moescope.capture.records import RequestRecord
from moescope.cli import main
from moescope.traces import store
from moescope.traces.writer import TraceWriter
from test_serve import MODEL, Serve

SAMPLE = 0.1
N = 30
KEEP = [f"{store.KEEP_PREFIX}{i}" for i in range(3)]


_ids_in = stored_ids  # (tests/helpers.py)


def test_every_served_id_opens_or_is_reported_not_kept(tmp_path, capsys):
    s = Serve(tmp_path, "--trace-sample", str(SAMPLE))
    try:
        ids = []
        for i in range(N):
            headers = {"x-request-id": KEEP[i % len(KEEP)] + f"-{i}"} if i % 10 == 0 else {}
            body = {"model": MODEL, "prompt": f"The number {i} is", "max_tokens": 4}
            r = httpx.post(s.url + "/v1/completions", json=body, headers=headers, timeout=120)
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
    finally:
        assert s.stop() == 0
    # read back independently of the code under test: the two tables partition the ids served
    kept, not_kept = _ids_in(s.traces, "requests"), _ids_in(s.traces, "sampled_out")
    assert set(ids) == kept | not_kept and not kept & not_kept
    asked = [rid for rid in ids if rid.startswith(store.KEEP_PREFIX)]
    assert len(asked) == 3 and set(asked) <= kept  # kept whatever the sample
    assert not_kept  # at 10% of 27 requests, all kept by chance: 1e-27
    capsys.readouterr()
    for rid in ids:
        code = main(["trace", rid, "--traces", str(s.traces), "--plain"])
        out, err = capsys.readouterr()
        if rid in kept:
            assert code == 0 and f"request {rid}" in out, err
            continue
        err = err.strip()
        assert code == 2 and "no request" not in err, err
        assert len(err.splitlines()) == 1, err
        assert "served" in err and "not kept" in err and f"MOESCOPE_TRACE_SAMPLE={SAMPLE:g}" in err, err
        assert "MOESCOPE_TRACE_SAMPLE=1" in err and store.KEEP_PREFIX in err, err


def test_an_unknown_id_still_says_no_request_with_the_sampling_in_view(tmp_path):
    path = tmp_path / "t.sqlite"
    w = TraceWriter(path, sample=0.0)
    w.on_request(_record("r-1"))
    w.tick()
    w.shutdown()
    out = run_cli("trace", "never-served", "--traces", str(path), "--plain", timeout=60)
    assert out.returncode == 2 and "no request 'never-served'" in out.stderr
    assert "MOESCOPE_TRACE_SAMPLE=0" in out.stderr and "remembers the ids of the latest 1 " in out.stderr


def _record(rid: str, t: float = 100.0) -> RequestRecord:
    return RequestRecord(request_id=rid, prompt="p", output="o", prompt_tokens=(1, 2), output_tokens=(3,),
                         arrival=t, queue_s=0.0, prefill_s=0.1, ttft_s=0.1, token_latencies_s=(0.1,), total_s=0.2,
                         finish_reason="length")


@pytest.mark.parametrize("max_bytes", [64 * 2**10, 256 * 2**20])
def test_the_record_of_ids_not_kept_is_bounded_and_keeps_the_latest(tmp_path, max_bytes):
    path = tmp_path / "t.sqlite"
    bound = store.sampled_out_max(max_bytes)
    assert bound == min(100_000, max_bytes // 10 // 200)  # the rule as documented in store.py, written out
    n = min(bound + 500, bound * 2)  # past the bound (kept cheap at the large budget: 100,500 records)
    w = TraceWriter(path, sample=0.0, max_bytes=max_bytes)
    for lo in range(0, n, 5000):
        for i in range(lo, min(n, lo + 5000)):
            w.on_request(_record(f"req-{i}", t=float(i)))
        w.tick()
    w.shutdown()
    got = _ids_in(path, "sampled_out")
    assert got == {f"req-{i}" for i in range(n - bound, n)}
    assert not _ids_in(path, "requests")


def test_a_keep_id_is_kept_at_sample_zero(tmp_path):
    path = tmp_path / "t.sqlite"
    w = TraceWriter(path, sample=0.0)
    for rid in ("moescope-keep-a", "cmpl-moescope-keep-b", "chatcmpl-moescope-keep-c-0", "plain", "keep-moescope"):
        w.on_request(_record(rid))
    w.tick()
    w.shutdown()
    assert _ids_in(path, "requests") == {"moescope-keep-a", "cmpl-moescope-keep-b", "chatcmpl-moescope-keep-c-0"}
    assert _ids_in(path, "sampled_out") == {"plain", "keep-moescope"}

