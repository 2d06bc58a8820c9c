"""`moescope trace ID` of a request another rank served: a `demo --world-size 2` run prints every rank's request
ids, but only rank 0 writes a SQLite store, so a rank-1 id is not in it. The one-line error (exit 2) says so and
names the store that holds every rank's requests (`--traces DIR/`, a trace lake); on a store one rank wrote, an
unknown id's error says nothing about ranks."""

import json
import sqlite3

import pytest

from helpers import run_cli_ok
from moescope.cli import main


def _stored_ids(path) -> set[str]:
    conn = sqlite3.connect(path)
    try:
        return {rid for (rid,) in conn.execute("SELECT request_id FROM requests")}
    finally:
        conn.close()


def _trace_error(capsys, rid, path) -> str:
    capsys.readouterr()
    assert main(["trace", rid, "--traces", str(path), "--plain"]) == 2
    io = capsys.readouterr()
    lines = io.err.splitlines()
    assert len(lines) == 1 and io.out == "", io.err
    return lines[0]


@pytest.mark.integration
def test_a_rank_1_id_says_a_sqlite_store_holds_rank_0_only(tmp_path, capsys):
    path = tmp_path / "t.sqlite"
    demo = run_cli_ok("demo", "--no-tui", "--world-size", "2", "--requests", "8", "--rate", "0", "--metrics-port",
                      "-1", "--canary-interval", "0", "--traces", str(path), "--json")
    summary = json.loads(demo.stdout)
    stored = _stored_ids(path)
    # the reference: the launch's ids (every rank's) against the rows SQLite holds (rank 0's, as it says)
    assert stored < set(summary["request_ids"])
    assert len(stored) == summary["ranks"][0]["completed"]
    others = sorted(set(summary["request_ids"]) - stored)
    assert len(others) == summary["ranks"][1]["completed"] > 0
    line = _trace_error(capsys, others[0], path)
    assert line.startswith(f"moescope: error: no request {others[0]!r} in the trace store")
    assert "2-rank launch" in line and "rank 0's requests only" in line, line
    assert "--traces DIR/" in line and "every rank's" in line, line
    # a stored (rank 0) id still opens
    assert main(["trace", sorted(stored)[0], "--traces", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rank"] == 0


def test_an_unknown_id_in_a_one_rank_store_says_nothing_about_ranks(tmp_path, capsys):
    path = tmp_path / "one.sqlite"
    assert main(["demo", "--requests", "2", "--rate", "0", "--metrics-port", "-1", "--canary-interval", "0",
                 "--traces", str(path), "--json"]) == 0
    rid = sorted(_stored_ids(path))[0]
    line = _trace_error(capsys, rid + "x", path)
    assert line.startswith(f"moescope: error: no request {rid + 'x'!r} in the trace store; nearest stored ids: ")
    assert "rank" not in line, line
