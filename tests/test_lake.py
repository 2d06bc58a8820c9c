"""The Parquet trace lake (moescope.traces.lake): written by the trace writer, read through DuckDB by the same
readers as the SQLite store. The reference is the SQLite store fed the same steps (or converted)."""

import json
import os
import shutil
import time
from pathlib import Path

import duckdb
import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest

from helpers import run_cli
import moescope
from conftest import in_ci
from moescope.cli import main
from moescope.errors import BadInput
from moescope.runtime import traffic
from moescope.runtime.engine import Engine
from moescope.runtime.model import MoETransformer
from moescope.traces import lake, store
from moescope.traces.recorder import TraceRecorder
from test_traces import serve_then_kill

DATASET = "read_parquet('{}/**/*.parquet', hive_partitioning=true, union_by_name=true)"


def _serve_both(cfg, sqlite_path, lake_dir, n=10, seed=3):
    """Serve ``n`` requests once, recorded by two writers: into SQLite and into a lake."""
    model = MoETransformer(cfg).eval()
    offset = time.time() - time.perf_counter()  # one clock for both writers
    recs = [TraceRecorder(sqlite_path, model="tiny", clock_offset=offset),
            TraceRecorder(f"{lake_dir}/", model="tiny", clock_offset=offset)]
    with moescope.instrument(model, observers=recs):
        engine = Engine(model, max_batch=3)
        for r in traffic.generate(traffic.TrafficConfig(seed=seed, output_tokens_median=6), n):
            engine.submit(r.prompt, max_new_tokens=r.max_new_tokens, domain=r.domain, tenant=r.tenant)
        while engine.has_work:
            engine.step()
    return engine.finished


def _own(doc):
    """A trace document without what each writer judges or reads for itself: in its steps the run id, RSS and
    clock stamp; the request's ``slow`` flag (against the writer's recent median at its own flush ticks)."""
    for st in doc["steps"]:
        for key in ("run", "rss", "t"):
            st.pop(key, None)
    doc["flags"] = [f for f in doc["flags"] if f != "slow"]
    return doc


def _cli(capsys, *args, rc=0):
    got = main(list(args))
    out = capsys.readouterr()
    assert got == rc, out.err
    return out.out


def test_the_writer_fills_a_lake_with_what_it_writes_to_sqlite(tiny_cfg, tmp_path):
    db, dl = tmp_path / "t.sqlite", tmp_path / "lake"
    records = _serve_both(tiny_cfg.replace(capacity_factor=0.9), db, dl)
    files = list(dl.rglob("*.parquet"))
    assert files and all(pq.read_metadata(f).metadata[lake.SCHEMA_KEY] == lake.LAKE_SCHEMA.encode() for f in files)
    assert {p.name.split("=")[0] for f in files for p in f.relative_to(dl).parents if p.name} == \
        {"model", "date", "replica"}
    conn_s, conn_l = store.open_store(db), store.open_store(dl)
    assert isinstance(conn_l, lake.LakeConn)
    for r in records:
        assert _own(store.load_request(conn_l, r.request_id)) == _own(store.load_request(conn_s, r.request_id))
    got = {r.request_id: r.ids for r in store.iter_routed(conn_l)}
    want = {r.request_id: r.ids for r in store.iter_routed(conn_s)}
    assert got.keys() == want.keys() == {r.request_id for r in records}
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_every_reader_reads_a_lake_as_it_reads_the_sqlite_store_it_was_converted_from(tiny_cfg, tmp_path, capsys):
    db, dl = tmp_path / "t.sqlite", tmp_path / "lake"
    records = _serve_both(tiny_cfg.replace(capacity_factor=0.9), db, tmp_path / "unused")
    out = json.loads(_cli(capsys, "traces", "convert", str(db), str(dl), "--json"))
    assert out["requests"] == len(records) and out["files"] >= 1
    conn_s, conn_l = store.open_store(db), store.open_store(dl)
    assert store.list_requests(conn_l, limit=100) == store.list_requests(conn_s, limit=100)
    for r in records:
        assert store.load_request(conn_l, r.request_id) == store.load_request(conn_s, r.request_id)
    # the commands over the lake directory print what they print over the SQLite file
    for args in (["requests", "--json"], ["cache-sim", "--json"], ["requests", "--flag", "dropped", "--json"],
                 ["trace", records[0].request_id, "--plain"]):
        assert _cli(capsys, *args, "--traces", str(dl)) == _cli(capsys, *args, "--traces", str(db))
    rc = main(["diagnose", "--traces", str(db), "--json"])  # 1: a finding (capacity 0.9 drops slots)
    diag_s = json.loads(capsys.readouterr().out)
    diag_l = json.loads(_cli(capsys, "diagnose", "--traces", str(dl), "--json", rc=rc))
    assert diag_l["findings"] == diag_s["findings"]
    for src, path in ((dl, tmp_path / "bl.json"), (db, tmp_path / "bs.json")):
        _cli(capsys, "baseline", "save", "--traces", str(src), "--out", str(path))
    assert json.loads((tmp_path / "bl.json").read_text()) == json.loads((tmp_path / "bs.json").read_text())


def test_two_replicas_lakes_read_as_one(tiny_cfg, tmp_path, capsys):
    fleet = tmp_path / "fleet"
    a = _serve_both(tiny_cfg, tmp_path / "a.sqlite", fleet / "replica-a", n=4, seed=1)
    b = _serve_both(tiny_cfg, tmp_path / "b.sqlite", fleet / "replica-b", n=5, seed=2)
    listed = json.loads(_cli(capsys, "requests", "--traces", str(fleet / "replica-*"), "--json"))
    assert {r["request_id"] for r in listed} == {r.request_id for r in a + b}
    for rid in (a[0].request_id, b[-1].request_id):  # one from each replica
        doc = json.loads(_cli(capsys, "trace", rid, "--traces", str(fleet / "replica-*"), "--json"))
        assert doc["request_id"] == rid
    # the parent directory reads as one lake too
    assert len(json.loads(_cli(capsys, "requests", "--traces", str(fleet), "--json"))) == len(a) + len(b)


def test_a_corrupt_or_partial_file_is_skipped_with_one_warning_and_counted(tiny_cfg, tmp_path, capsys):
    dl = tmp_path / "lake"
    records = _serve_both(tiny_cfg, tmp_path / "t.sqlite", dl, n=4)
    good = sorted(dl.rglob("*.parquet"))
    part = good[0].parent
    (part / "t-garbage-000001.parquet").write_bytes(b"PAR1 not parquet at all")
    data = good[0].read_bytes()
    (part / "t-partial-000001.parquet").write_bytes(data[: len(data) // 2])  # a writer killed mid-file
    conn = store.open_store(dl)
    assert conn.files == len(good) and sorted(conn.skipped) == sorted(str(part / f"t-{n}-000001.parquet")
                                                                     for n in ("garbage", "partial"))
    assert json.loads(_cli(capsys, "requests", "--traces", str(dl), "--json")) == \
        json.loads(_cli(capsys, "requests", "--traces", str(tmp_path / "t.sqlite"), "--json"))
    rc = main(["trace", records[0].request_id, "--traces", str(dl), "--plain"])
    err = capsys.readouterr().err
    assert rc == 0 and err.count("warning") == 1 and "skipped 2 unreadable trace files" in err


def test_tick_files_a_rolled_file_covers_are_not_read_twice(tmp_path):
    rows = [{"request_id": f"r{i}", "started": 1.7e9 + i, "prompt": "", "output": "", "n_prompt": 1,
             "n_output": 1, "total_s": 0.1, "ttft_s": 0.1, "flags": "", "latencies": b"\0" * 4} for i in range(6)]
    w = lake.LakeWriter(tmp_path, model="m", rank=0, run_id="run1", roll_s=float("inf"))
    for i in range(3):
        w.write(rows[2 * i: 2 * i + 2])
    ticks = sorted(tmp_path.rglob("t-*.parquet"))
    saved = {t: t.read_bytes() for t in ticks}
    w.close()
    assert not list(tmp_path.rglob("t-*.parquet")) and len(list(tmp_path.rglob("p-*.parquet"))) == 1
    for t, data in saved.items():  # a writer killed between the rename of the rolled file and the deletes
        t.write_bytes(data)
    ids = [r.request_id for r in store.list_requests(store.open_store(tmp_path), limit=100)]
    assert sorted(ids) == sorted(r["request_id"] for r in rows)


def test_compaction_merges_small_files_and_a_crash_mid_way_reads_nothing_twice(tmp_path, capsys):
    rows = [{"request_id": f"r{i}", "started": 1.7e9 + i, "prompt": "", "output": "", "n_prompt": 1,
             "n_output": 1, "total_s": 0.1, "ttft_s": 0.1, "flags": "", "latencies": b"\0" * 4} for i in range(8)]
    for run in range(4):  # four short runs of one replica: four small rolled files
        w = lake.LakeWriter(tmp_path, model="m", rank=0, run_id=f"run{run}")
        w.write(rows[2 * run: 2 * run + 2])
        w.close()
    before = store.list_requests(store.open_store(tmp_path), limit=100)
    files = sorted(tmp_path.rglob("*.parquet"))
    assert len(files) == 4 and len(before) == 8
    saved = {f: f.read_bytes() for f in files}
    young = json.loads(_cli(capsys, "traces", "compact", str(tmp_path), "--json"))
    assert young == {"compacted": [], "too_young": 4}
    said = _cli(capsys, "traces", "compact", str(tmp_path)).strip()  # says why nothing merged, and the way out
    assert said.startswith(f"merged 0 files into 0 in {tmp_path}; skipped 4 files closed less than 10m ago"), said
    assert "--min-age" in said
    out = json.loads(_cli(capsys, "traces", "compact", str(tmp_path), "--min-age", "0s", "--json"))
    assert [c["merged"] for c in out["compacted"]] == [4] and len(list(tmp_path.rglob("*.parquet"))) == 1
    assert store.list_requests(store.open_store(tmp_path), limit=100) == before
    for f, data in saved.items():  # killed between the rename of the merged file and the deletes
        f.write_bytes(data)
    assert store.list_requests(store.open_store(tmp_path), limit=100) == before
    lake.compact(tmp_path, min_age_s=0)  # the leftovers go
    assert len(list(tmp_path.rglob("*.parquet"))) == 1


def test_the_writer_keeps_its_own_files_within_max_bytes(tmp_path):
    rows = [{"request_id": f"r{i}", "started": 1.7e9 + i, "prompt": "x" * 3000, "output": "", "n_prompt": 1,
             "n_output": 1, "total_s": 0.1, "ttft_s": 0.1, "flags": "", "latencies": np.random.default_rng(i)
             .bytes(4000)} for i in range(20)]
    other = tmp_path / "model=m" / "date=2023-11-14" / "replica=other" / "t-x-000001.parquet"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"another replica's file: never this writer's to delete")
    w = lake.LakeWriter(tmp_path, model="m", rank=0, run_id="run", roll_s=0, max_bytes=30_000, replica="me")
    for i in range(20):
        w.write(rows[i: i + 1])  # a rolled file per request, then retention
    mine = sorted((tmp_path / "model=m").rglob("replica=me/*.parquet"))
    assert 0 < len(mine) < 20 and sum(f.stat().st_size for f in mine) <= 30_000 and other.exists()
    kept = {r.request_id for r in store.list_requests(store.open_store(tmp_path / "model=m/date=2023-11-14/"
                                                                      "replica=me"), limit=100)}
    assert kept == {f"r{i}" for i in range(20 - len(kept), 20)}  # the newest


def test_retention_deletes_the_oldest_files_by_age_then_size(tmp_path, capsys):
    now = time.time()
    sizes = {}
    for i in range(5):
        f = tmp_path / "model=m" / "date=2026-01-01" / f"replica={'a' if i < 4 else 'b'}" / f"t-x-{i:06d}.parquet"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x" * 1000 * (i + 1))
        os.utime(f, (now - 86400 * (5 - i), now - 86400 * (5 - i)))  # file i closed 5 - i days ago
        sizes[i] = f
    deleted = lake.enforce_retention(tmp_path, "a", max_age_s=3.5 * 86400, max_bytes=5000, now=now)
    # age: files 0, 1 (5 and 4 days old); then size: a's rest is 3000 + 4000 > 5000 -> file 2 goes
    assert deleted == [sizes[0], sizes[1], sizes[2]] and sizes[3].exists() and sizes[4].exists()
    out = json.loads(_cli(capsys, "traces", "retain", str(tmp_path), "--max-size", "5k", "--json"))
    assert out["deleted"] == [str(sizes[3])] and sizes[4].exists()  # 4000 + 5000 > 5120: the older goes
    assert main(["traces", "retain", str(tmp_path), "--max-size", "lots"]) == 2


@pytest.mark.integration
def test_a_killed_writer_leaves_every_closed_file_readable(tmp_path):
    dl = tmp_path / "lake"
    old = serve_then_kill(f"{dl}/", n=60)  # (the script rolls every second: the kill may land mid-roll)
    files = list(dl.rglob("*.parquet"))
    assert any(f.name.startswith("p-") for f in files)  # it rolled while it ran
    for f in files:
        pq.read_table(f)  # every closed file reads whole
    conn = store.open_store(dl)
    assert not conn.skipped
    stored = {r[0] for r in conn.execute("SELECT request_id FROM requests")}
    assert old and old <= stored, (len(old), len(old - stored))


@pytest.mark.integration
def test_demo_into_a_lake_directory(tmp_path):
    dl = tmp_path / "lake"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = run_cli("demo", "--requests", "24", "--rate", "0", "--traces", f"{dl}/", "--metrics-port", "0", timeout=300,
                  env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert list(dl.rglob("*.parquet"))
    n = duckdb.sql(f"select count(distinct request_id) from {DATASET.format(dl)}").fetchall()[0][0]
    assert n == 24
    listed = run_cli("requests", "--json", env={**env, "MOESCOPE_TRACES": str(dl)})
    rows = json.loads(listed.stdout)
    assert len(rows) == 24
    rid = rows[0]["request_id"]
    doc = json.loads(run_cli("trace", rid, "--traces", str(dl), "--json", env=env).stdout)
    assert doc["request_id"] == rid and len(doc["tokens"]) == rows[0]["prompt_tokens"] + rows[0]["output_tokens"]


@pytest.mark.integration
def test_every_expert_parallel_rank_writes_its_own_requests_into_the_lake(tmp_path):
    """Data-parallel attention: each rank serves its own requests; into a lake each writes them in its own
    replica partition, so every request the fleet served is found (a SQLite store stays rank 0's alone)."""
    dl = tmp_path / "lake"
    run = run_cli("demo", "--no-tui", "--world-size", "2", "--requests", "6", "--rate", "0", "--json",
                  "--metrics-port", "-1", "--traces", f"{dl}/", timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    ranks = json.loads(run.stdout)["ranks"]
    served = sum(r["completed"] for r in ranks)
    assert all(r["completed"] for r in ranks)
    parts = {p.name for p in dl.glob("model=*/date=*/replica=*")}
    assert len(parts) == 2 and all(p.endswith(("-r0", "-r1")) for p in parts)
    conn = store.open_store(dl)
    by_rank = dict(conn.execute("SELECT rank, count(*) FROM requests GROUP BY rank").fetchall())
    assert by_rank == {0: ranks[0]["completed"], 1: ranks[1]["completed"]} and sum(by_rank.values()) == served
    rid = conn.execute("SELECT request_id FROM requests WHERE rank = 1 LIMIT 1").fetchone()[0]
    doc = json.loads(run_cli("trace", rid, "--traces", str(dl), "--json").stdout)
    assert doc["request_id"] == rid


@pytest.mark.integration
def test_serve_then_trace_reads_a_request_from_the_lake_while_serving(tmp_path):
    from test_serve import Serve

    (tmp_path / "lake").mkdir()
    s = Serve(tmp_path, traces=tmp_path / "lake")
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny-demo", "prompt": "route me", "max_tokens": 4},
                       timeout=60)
        rid = r.headers["x-request-id"]
        doc = s.stored(rid)  # polled while the server runs: a tick file, not the shutdown, made it readable
        assert s.proc.poll() is None and doc["request_id"] == rid
        run = run_cli("trace", rid, "--traces", str(tmp_path / "lake"), "--plain", timeout=120)
        assert run.returncode == 0 and rid in run.stdout
        assert sum(t["phase"] == "decode" for t in doc["tokens"]) == r.json()["usage"]["completion_tokens"]
    finally:
        s.stop()


def test_a_path_that_is_not_a_lake_is_one_clear_error(tmp_path):
    with pytest.raises(BadInput, match="does not exist"):
        store.open_store(f"{tmp_path}/missing/")
    with pytest.raises(BadInput, match="matches nothing"):
        store.open_store(f"{tmp_path}/replica-*")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert store.list_requests(store.open_store(empty)) == []
    shutil.rmtree(empty)


# ClickHouse's SQL over the lake: each routed slot's (layer, expert), the ids column decoded in SQL (int16 LE)
CLICKHOUSE_COUNT = """
SELECT intDiv(i, top_k) % n_layers AS layer_idx, reinterpretAsUInt16(substring(ids, 2 * i + 1, 2)) AS expert,
       count() AS n
FROM file('{}/**/*.parquet', Parquet) ARRAY JOIN range(intDiv(length(ids), 2)) AS i
WHERE ids IS NOT NULL AND expert < n_experts GROUP BY layer_idx, expert ORDER BY layer_idx, expert
SETTINGS use_hive_partitioning = 1
"""


def test_clickhouse_reads_the_same_files(tiny_cfg, tmp_path):
    if in_ci():  # CI installs it (the test extra): missing there is a failure, not a skip
        import chdb
    else:
        chdb = pytest.importorskip("chdb")
    dl = tmp_path / "lake"
    _serve_both(tiny_cfg.replace(capacity_factor=0.9), tmp_path / "t.sqlite", dl)
    n_moe = len([i for i in range(tiny_cfg.n_layers) if i not in tiny_cfg.dense_layers])
    want = np.zeros((n_moe, tiny_cfg.n_experts), dtype=np.int64)  # reference: the readers' arrays, numpy-counted
    for r in store.iter_routed(store.open_store(tmp_path / "t.sqlite")):
        for j in range(len(r.layers)):
            ids = r.ids[:, j].ravel()
            want[j] += np.bincount(ids[ids < r.n_experts], minlength=r.n_experts)
    got = np.zeros_like(want)
    for layer_idx, expert, n in json.loads(str(chdb.query(CLICKHOUSE_COUNT.format(dl), "JSONCompact")))["data"]:
        got[int(layer_idx), int(expert)] = int(n)
    assert got.sum() > 0 and np.array_equal(got, want)
    ids = json.loads(str(chdb.query(f"SELECT DISTINCT request_id, replica FROM file('{dl}/**/*.parquet', Parquet) "
                                    "SETTINGS use_hive_partitioning = 1", "JSONCompact")))["data"]
    assert sorted(r[0] for r in ids) == sorted(r.request_id for r in store.list_requests(store.open_store(dl)))
    assert {r[1] for r in ids} == {p.name.split("=")[1] for p in dl.rglob("replica=*")}
