"""Per-token traces: the store, `moescope requests` / `moescope trace`, OpenTelemetry, sanitising."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import moescope
from helpers import Recording, run_cli
from tmux_screen import wait_screen
from moescope.cli import main
from moescope.errors import BadInput
from moescope.runtime import traffic
from moescope.runtime.engine import Engine
from moescope.runtime.model import MoETransformer
from moescope.traces import store
from moescope.traces.recorder import TraceRecorder

EVIL = "\x1b]0;pwned\x07\x1b[2J\x1b[31mred\x9b"


def _serve(cfg, path, n=6, **kw):
    model = MoETransformer(cfg).eval()
    spy = Recording()
    rec = TraceRecorder(path, **kw)
    with moescope.instrument(model, observers=[rec, spy]):
        engine = Engine(model, max_batch=3)
        for i, r in enumerate(traffic.generate(traffic.TrafficConfig(seed=3, output_tokens_median=6), n)):
            engine.submit(EVIL + r.prompt if i == 0 else r.prompt, max_new_tokens=r.max_new_tokens,
                          domain=r.domain, tenant=r.tenant)
        while engine.has_work:
            engine.step()
    return engine.finished, spy, rec


def test_trace_json_expert_ids_equal_an_independent_observer(tiny_cfg, tmp_path, capsys):
    path = tmp_path / "t.sqlite"
    records, spy, rec = _serve(tiny_cfg.replace(capacity_factor=0.9), path)
    assert rec.written == len(records) and rec.dropped == 0
    for r in records:
        assert main(["trace", r.request_id, "--traces", str(path), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        routed = [t for t in doc["tokens"] if t["layers"]]
        assert [[la["experts"] for la in t["layers"]] for t in routed] == spy.rows_by_request()[r.request_id]
        assert len(doc["tokens"]) == len(r.prompt_tokens) + r.n_output
        assert [t["latency_s"] for t in doc["tokens"] if t["phase"] == "decode"] == \
            pytest.approx(list(r.token_latencies_s), rel=1e-6)
    flagged = [r for r in records if "dropped" in store.load_request(store.open_store(path), r.request_id)["flags"]]
    assert flagged  # capacity 0.9 drops slots; those requests carry the flag


def test_escape_sequences_are_shown_inert_in_every_output(tiny_cfg, tmp_path, capsys):
    path = tmp_path / "t.sqlite"
    records, _, _ = _serve(tiny_cfg, path, n=2)
    rid = records[0].request_id if records[0].prompt.startswith("\x1b") else records[1].request_id
    for mode in ("--json", "--plain"):
        assert main(["trace", rid, "--traces", str(path), mode]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out
        if mode == "--plain":  # a terminal sees the escapes spelled out
            assert "\\x1b]0;pwned\\x07" in out
        else:  # JSON escapes them itself (the CLI's one JSON rule): a parser gets the original text back
            assert "\\u001b]0;pwned\\u0007" in out and EVIL in json.loads(out)["prompt"]
    from moescope.tui.trace_app import header_text

    doc = store.load_request(store.open_store(path), rid)
    text = header_text(doc).plain
    assert "\x1b" not in text and "\\x1b]0;pwned\\x07" in text


def test_trace_shows_domain_and_tenant_only_when_set(tiny_cfg, tmp_path, capsys):
    """A served request has no domain or tenant: the header says nothing of them (no "domain None")."""
    path = tmp_path / "t.sqlite"
    model = MoETransformer(tiny_cfg).eval()
    with moescope.instrument(model, observers=[TraceRecorder(path, model="tiny-demo")]):
        engine = Engine(model, max_batch=2)
        bare = engine.submit("hello", max_new_tokens=2)
        half = engine.submit("hello", max_new_tokens=2, tenant="acme")
        while engine.has_work:
            engine.step()
    from moescope.tui.trace_app import header_text

    for rid, shown in ((bare, ""), (half, "  tenant acme")):
        assert main(["trace", rid, "--traces", str(path), "--plain"]) == 0
        head = capsys.readouterr().out.splitlines()[0]
        assert "None" not in head and "domain" not in head
        assert head.endswith(f"rank 0{shown}"), head
        tui = header_text(store.load_request(store.open_store(path), rid)).plain.splitlines()[0]
        assert "None" not in tui and "domain" not in tui and ("tenant acme" in tui) == bool(shown)


def test_tui_pilot_navigate_anomaly_search_quit(tiny_cfg, tmp_path):
    import asyncio

    from textual.widgets import DataTable

    from moescope.tui.trace_app import TraceApp

    path = tmp_path / "t.sqlite"
    records, spy, _ = _serve(tiny_cfg.replace(capacity_factor=0.9), path)
    conn = store.open_store(path)
    docs = [store.load_request(conn, r.request_id) for r in records]
    doc = next(d for d in docs if any(t["flags"] for t in d["tokens"]))
    first_anomaly = next(i for i, t in enumerate(doc["tokens"]) if t["flags"])

    async def drive():
        app = TraceApp(doc)
        async with app.run_test(size=(80, 24)) as pilot:
            layers = app.query_one("#layers", DataTable)
            grid = str(app.query_one("#grid").render()).splitlines()
            assert grid[1].startswith("   0 pre <bos") and len(grid[1]) == 14 + len(doc["layers"])  # a cell a layer
            await pilot.press("down", "down", "right")
            assert (app.current, app.col) == (2, 1)
            la = doc["tokens"][2]["layers"][1]
            cell = str(app.query_one("#cell").render())
            assert f"layer {la['layer']} (2/{len(doc['layers'])})" in cell
            assert " ".join(f"e{e}" for e in la["experts"]) in " ".join(w for w in cell.split() if w[0] == "e")
            await pilot.press("enter")  # the token's table: every layer, the selected one highlighted
            assert layers.row_count == len(doc["layers"]) and layers.cursor_row == 1
            assert layers.get_row_at(0)[1] == ",".join(map(str, doc["tokens"][2]["layers"][0]["experts"]))
            await pilot.press("up", "escape")  # back to the grid, on the layer picked in the table
            assert (app.current, app.col) == (2, 0)
            await pilot.press("home")
            await pilot.press("n")
            assert app.current == first_anomaly
            # search: the output's first 3 characters start at the first decode position
            out = doc["tokens"][len([t for t in doc["tokens"] if t["phase"] == "prefill"])]
            await pilot.press("home", "slash", *list(out["text"]), "enter")
            assert doc["tokens"][app.current]["text"] == out["text"]
            await pilot.press("c")
            await pilot.press("q")
        assert app.return_code in (0, None)

    asyncio.run(drive())


def test_tmux_screen_reads_as_a_person_would(tiny_cfg, tmp_path):
    from servers import require

    tmux = require("tmux", "tmux")
    path = tmp_path / "t.sqlite"
    records, _, _ = _serve(tiny_cfg, path, n=2)
    rid = records[-1].request_id
    session = f"moescope-{os.getpid()}"
    cmd = f"{sys.executable} -m moescope trace {rid} --traces {path}; echo EXITED; sleep 30"
    subprocess.run([tmux, "new-session", "-d", "-s", session, "-x", "80", "-y", "24", cmd], check=True)
    try:
        screen = wait_screen(tmux, session, lambda text: rid in text and "quit" in text)
        assert rid in screen and "prompt:" in screen and "next anomaly" in screen, screen
        assert all(len(line) <= 80 for line in screen.splitlines())
        subprocess.run([tmux, "send-keys", "-t", session, "q"], check=True)
        wait_screen(tmux, session, "EXITED", timeout=20)
    finally:
        subprocess.run([tmux, "kill-session", "-t", session], capture_output=True)


def test_requests_command_filters(tiny_cfg, tmp_path, capsys):
    path = tmp_path / "t.sqlite"
    records, _, _ = _serve(tiny_cfg.replace(capacity_factor=0.9), path)
    assert main(["requests", "--traces", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["request_id"] for r in rows} == {r.request_id for r in records}
    assert main(["requests", "--traces", str(path), "--slowest", "2", "--json"]) == 0
    slow = json.loads(capsys.readouterr().out)
    want = sorted(records, key=lambda r: -r.total_s)[:2]
    assert [r["request_id"] for r in slow] == [r.request_id for r in want]
    assert main(["requests", "--traces", str(path), "--flag", "dropped", "--json"]) == 0
    dropped = json.loads(capsys.readouterr().out)
    assert dropped and all("dropped" in r["flags"] for r in dropped)
    assert main(["requests", "--traces", str(path), "--since", "1h"]) == 0
    assert records[0].request_id[:8] in capsys.readouterr().out
    assert main(["requests", "--traces", str(path), "--since", "yesterday-ish"]) == 2


def test_bad_stores_are_clear_errors(tmp_path, capsys):
    assert main(["requests", "--traces", str(tmp_path / "missing.sqlite")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"this is not sqlite at all" * 100)
    assert main(["trace", "x", "--traces", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moescope: error: trace store") and err.count("\n") == 1
    old = tmp_path / "old.sqlite"
    conn = store.open_store(old, create=True)
    conn.execute("UPDATE meta SET value='0' WHERE key='schema_version'")
    conn.commit()
    with pytest.raises(BadInput, match="older moescope"):
        store.open_store(old)


def test_sampling_keeps_anomalies_and_otel_spans_link(tiny_cfg, tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    path = tmp_path / "t.sqlite"
    records, _, rec = _serve(tiny_cfg.replace(capacity_factor=0.9), path, n=8, sample=0.0,
                             tracer=provider.get_tracer("moescope"))
    conn = store.open_store(path)
    kept = {r.request_id: r for r in store.list_requests(conn, limit=100)}
    assert kept and all(r.flags for r in kept.values())  # sample=0: only anomalous requests
    assert rec.sampled_out == len(records) - len(kept)
    spans = exporter.get_finished_spans()
    roots = {s.attributes["moescope.request_id"]: s for s in spans if s.name == "moescope.request"}
    assert set(roots) == set(kept)
    for rid, span in roots.items():
        doc = store.load_request(conn, rid)
        assert doc["trace_id"] == format(span.context.trace_id, "032x")
        kids = sorted((s for s in spans if s.parent and s.parent.span_id == span.context.span_id),
                      key=lambda s: s.start_time)
        assert [k.name for k in kids] == ["moescope.queue", "moescope.prefill", "moescope.decode"]
        assert span.end_time - span.start_time == pytest.approx(doc["timings"]["total_s"] * 1e9, rel=1e-3)


def test_a_full_queue_drops_and_counts_without_blocking(tiny_cfg, tmp_path):
    path = tmp_path / "t.sqlite"
    rec = TraceRecorder(path, queue_size=1)
    rec.queue._queue.put(("on_request", (None,)))  # occupy the queue: the writer chokes on this item (counted)
    model = MoETransformer(tiny_cfg).eval()
    with moescope.instrument(model, port=0, observers=[rec]) as inst:
        Engine(model, max_batch=2).run(traffic.generate(traffic.TrafficConfig(seed=1), 3), realtime=False)
        text = inst.exporter.exposition().decode()
    assert rec.dropped > 0
    assert f'moescope_capture_dropped_total{{model="test-tiny",queue="traces",rank="0"}} {float(rec.dropped)}' in text


def test_a_request_the_writer_cannot_write_is_counted_and_loses_no_other(tiny_cfg, tmp_path):
    """The writer does a tick's work in one go: one bad item must cost only itself."""
    path = tmp_path / "t.sqlite"
    rec = TraceRecorder(path, flush_interval_s=60)  # one tick, at shutdown: every request in the same batch
    rec.queue.on_request(None)  # not a request: its row cannot be built
    model = MoETransformer(tiny_cfg).eval()
    with moescope.instrument(model, observers=[rec]):
        records = Engine(model, max_batch=3).run(traffic.generate(traffic.TrafficConfig(seed=2), 5), realtime=False)
    assert rec.errors == 1 and rec.written == len(records) == 5
    assert {r.request_id for r in store.list_requests(store.open_store(path))} == {r.request_id for r in records}


def test_retention_by_size(tiny_cfg, tmp_path):
    path = tmp_path / "t.sqlite"
    _serve(tiny_cfg, path, n=10, max_bytes=60_000, flush_interval_s=0.05)
    conn = store.open_store(path)
    n = conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0]
    assert 0 < n < 10


KILL_SCRIPT = r"""
import sys, time, moescope
from moescope.runtime import loader, traffic
from moescope.runtime.engine import Engine
from moescope.traces.recorder import TraceRecorder
from moescope.traces.writer import TraceWriter
tick = TraceWriter.tick
def say(line):  # one write per line: print() writes the text and its newline apart, and two threads print here
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
def told(self):  # a line per written tick, once its rows are committed (SQLite) or its file renamed (lake)
    ids = [r.request_id for r in self._finished]
    tick(self)
    say(" ".join(["W", *ids]))
TraceWriter.tick = told
model = loader.build_model("tiny-demo")
rec = TraceRecorder(sys.argv[1], flush_interval_s=0.5)
if rec.writer.lake is not None:
    rec.writer.lake.roll_s = 1.0  # a trace lake (tests/test_lake.py): roll often, so the kill may land mid-roll
inst = moescope.instrument(model, observers=[rec])
engine = Engine(model, max_batch=4)
for r in traffic.generate(traffic.TrafficConfig(seed=9), 100000):
    engine.submit(r.prompt, max_new_tokens=r.max_new_tokens)
while True:
    for record in engine.step():
        say(f"{time.time()} {record.request_id}")
"""


def serve_then_kill(traces: str, n: int = 40) -> set[str]:
    """Run KILL_SCRIPT into ``traces`` until ``n`` requests finished, SIGKILL it; the ids of the requests the
    writer had written before the kill (its ticks that returned). On an idle machine that is every request
    finished more than two flush intervals (1 s) before the kill; on a loaded one the writer thread lags, and
    what it had not written yet is what a kill may lose: the property is that nothing written is."""
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, traces], stdout=subprocess.PIPE, text=True)
    finished, written = 0, set()
    deadline = time.monotonic() + 120
    while finished < n and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("W"):
            written.update(line.split()[1:])
        elif line:
            finished += 1
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    written.update(rid for line in proc.stdout if line.startswith("W") for rid in line.split()[1:])
    assert written, "the writer wrote nothing before the kill"
    return written


def test_killing_the_process_loses_nothing_the_writer_had_written(tmp_path):
    path = tmp_path / "t.sqlite"
    old = serve_then_kill(str(path))
    conn = store.open_store(path)  # opens after the crash
    stored = {r[0] for r in conn.execute("SELECT request_id FROM requests")}
    # Everything the writer had written before the kill is there.
    assert old and old <= stored, (len(old), len(old - stored))


def test_a_demo_request_opens_by_id(tmp_path, capsys):
    path = tmp_path / "demo.sqlite"
    assert main(["demo", "--requests", "3", "--rate", "0", "--metrics-port", "-1", "--traces", str(path),
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["traces"] == str(path)
    for rid in summary["request_ids"]:
        assert main(["trace", rid, "--traces", str(path), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["request_id"] == rid and doc["model"] == "tiny-demo"
        assert all(len(t["layers"]) == 3 for t in doc["tokens"][:-1])


def test_baseline_from_the_store_equals_the_runs_own_load(tmp_path, capsys):
    path, a, b = tmp_path / "t.sqlite", tmp_path / "a.json", tmp_path / "b.json"
    assert main(["demo", "--requests", "5", "--rate", "0", "--metrics-port", "-1", "--traces", str(path),
                 "--save-baseline", str(a), "--canary-interval", "0.01"]) == 0
    assert main(["baseline", "save", "--traces", str(path), "--out", str(b)]) == 0
    capsys.readouterr()
    from moescope.analysis import baseline

    assert baseline.load(a).load_map() == baseline.load(b).load_map()  # the canary's routing is kept out of both
    (tmp_path / "bad.json").write_text("{}")
    assert main(["demo", "--baseline", str(tmp_path / "bad.json"), "--requests", "1"]) == 2


def test_requests_whose_forwards_were_not_all_seen_are_stored_without_routing(tiny_cfg, tmp_path, capsys):
    """A static/CUDA-graph decode step routes with no per-layer hook (as does a step whose event the full
    queue dropped): the request is stored whole, without a routing that would not line up with its tokens."""
    path = tmp_path / "t.sqlite"
    model = MoETransformer(tiny_cfg).eval()
    rec = TraceRecorder(path)
    with moescope.instrument(model, observers=[rec]):
        records = Engine(model, max_batch=3, decode="static").run(
            traffic.generate(traffic.TrafficConfig(seed=2, output_tokens_median=4), 5), realtime=False)
    conn = store.open_store(path)
    assert rec.unrouted == sum(r.n_output > 1 for r in records) > 0
    for r in records:
        doc = store.load_request(conn, r.request_id)
        assert len(doc["tokens"]) == len(r.prompt_tokens) + r.n_output
        assert (doc["layers"] == []) == (r.n_output > 1)  # one output token: its only forward was the prefill
    rid = records[0].request_id
    conn.execute("UPDATE requests SET ids = ?, layers = '[1, 2]', top_k = 2 WHERE request_id = ?", (b"\0" * 6, rid))
    conn.commit()
    assert main(["trace", rid, "--traces", str(path), "--json"]) == 2  # a row no writer of ours makes
    err = capsys.readouterr().err
    assert "corrupt row" in err and err.count("\n") == 1


def test_a_request_that_ended_on_nan_keeps_its_routing(tmp_path):
    """The `nan` scenario ends requests whose logits go non-finite ("error") after the forward that routed their
    last token: the store keeps that routing (prompt + every output token), and `diagnose` reads the NaN from it."""
    path = tmp_path / "nan.sqlite"
    # deepseek-v3-shape: its NaN reaches the logits after a few decode steps (tiny-demo's at the prefill, where
    # no output token is routed either way)
    run = run_cli("demo", "--no-tui", "--json", "--model", "deepseek-v3-shape", "--requests", "6", "--rate", "0",
                  "--scenario", "nan", "--metrics-port", "-1", "--traces", str(path), timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    conn = store.open_store(path)
    rows = conn.execute("SELECT request_id, n_prompt, n_output, finish_reason, ids IS NOT NULL FROM requests")\
        .fetchall()
    errored = [r for r in rows if r[3] == "error"]
    assert any(r[2] > 0 for r in errored) and all(r[4] for r in errored), rows
    routed = {r.request_id: r for r in store.iter_routed(conn, limit=1000)}
    for rid, n_prompt, n_output, _, _ in errored:
        assert routed[rid].ids.shape[0] == n_prompt + n_output
        assert not np.isfinite(routed[rid].entropy[-1]).all()  # the forward that gave the NaN is the last row
    doc = json.loads(run_cli("diagnose", "--json", "--traces", str(path), timeout=300).stdout)
    assert any(f["cause"] == "nonfinite" for f in doc["findings"])
