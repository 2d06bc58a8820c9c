"""Every trace-store reader skips a corrupt row (one request's columns holding garbage) with a one-line
warning and counts it; what it prints from the rest equals what it prints from the same store with that row
deleted (the reference); with nothing readable left it exits 2 with one line."""

from __future__ import annotations

import json
import shutil
import sqlite3

import pytest

from moescope.cli import main

# kind -> (SQL SET clause, whether it touches a column `requests` lists)
CORRUPTIONS = {
    "ids-out-of-range": (None, False),  # the right size, every id 0x7f7f
    "ids-wrong-size": ("ids = x'000001000200'", False),
    "layers-not-json": ("layers = 'garbage'", False),
    "steps-not-records": ("steps = '[1, \"x\", null]'", False),
    "step-index-past-steps": (None, False),  # the right size, every index 0xffff
    "started-text": ("started = 'yesterday'", True),
    "negative-counts": ("n_prompt = -3", True),
    "every-column-random": (None, True),
}
READERS = ("requests", "diagnose", "report", "cache-sim", "baseline", "plan-placement")


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("corrupt") / "t.sqlite"
    assert main(["demo", "--requests", "8", "--rate", "0", "--metrics-port", "-1", "--traces", str(path),
                 "--canary-interval", "0", "--json"]) == 0
    conn = sqlite3.connect(path)
    rows = conn.execute("SELECT request_id FROM requests WHERE ids IS NOT NULL ORDER BY started").fetchall()
    conn.close()
    assert len(rows) >= 6
    return path, rows[2][0]


def _copy(src, dst):
    shutil.copy(src, dst)
    return dst


def _corrupt(path, rid, kind):
    conn = sqlite3.connect(path)
    if kind == "every-column-random":
        cols = [r[1] for r in conn.execute("PRAGMA table_info(requests)") if r[1] != "request_id"]
        conn.execute(f"UPDATE requests SET {', '.join(f'{c} = randomblob(13)' for c in cols)} WHERE request_id = ?",
                     (rid,))
    elif kind == "ids-out-of-range":
        n = conn.execute("SELECT length(ids) FROM requests WHERE request_id = ?", (rid,)).fetchone()[0]
        conn.execute("UPDATE requests SET ids = ? WHERE request_id = ?", (b"\x7f" * n, rid))
    elif kind == "step-index-past-steps":
        n = conn.execute("SELECT length(step) FROM requests WHERE request_id = ?", (rid,)).fetchone()[0]
        conn.execute("UPDATE requests SET step = ? WHERE request_id = ?", (b"\xff" * n, rid))
    else:
        conn.execute(f"UPDATE requests SET {CORRUPTIONS[kind][0]} WHERE request_id = ?", (rid,))
    conn.commit()
    conn.close()


def _delete(path, rid):
    conn = sqlite3.connect(path)
    conn.execute("DELETE FROM requests WHERE request_id = ?", (rid,))
    conn.commit()
    conn.close()


def _run(reader, path, out, capsys) -> tuple[int, object, str]:
    """(exit code, what the reader produced, stderr)."""
    argv = {"requests": ["requests", "--json"], "diagnose": ["diagnose", "--json"],
            "report": ["report", "--json", "--out", str(out)], "cache-sim": ["cache-sim", "--json"],
            "baseline": ["baseline", "save", "--out", str(out)],
            "plan-placement": ["plan-placement", "--ranks", "2", "--json", "--out", str(out)]}[reader]
    code = main([*argv, "--traces", str(path)])
    io = capsys.readouterr()
    if code == 2:
        return code, None, io.err
    if reader == "baseline":
        produced = json.loads(out.read_text())
    else:
        produced = json.loads(io.out)
        if isinstance(produced, dict):
            produced.pop("corrupt_rows", None)
            produced.pop("files", None)
            if reader == "report":
                produced["load.csv"] = (out / "load.csv").read_text()
    return code, produced, io.err


@pytest.fixture(scope="module")
def references():
    """Each reader's output from the store without the row, and from the intact store (filled on first use)."""
    return {}


# report and plan-placement read through the same profile as cache-sim: two kinds each suffice (they are slow)
CASES = [(reader, kind) for reader in READERS for kind in CORRUPTIONS
         if reader not in ("report", "plan-placement") or kind in ("ids-out-of-range", "every-column-random")]


@pytest.mark.parametrize("reader,kind", CASES)
def test_a_corrupt_row_is_skipped_with_one_warning(reader, kind, demo_store, references, tmp_path, capsys):
    src, rid = demo_store
    touches_listing = CORRUPTIONS[kind][1]
    if (reader, "deleted") not in references:
        deleted = _copy(src, tmp_path / "deleted.sqlite")
        _delete(deleted, rid)
        references[(reader, "deleted")] = _run(reader, deleted, tmp_path / "ref", capsys)
        references[(reader, "intact")] = _run(reader, src, tmp_path / "intact", capsys)
    path = _copy(src, tmp_path / "corrupt.sqlite")
    _corrupt(path, rid, kind)
    code, produced, err = _run(reader, path, tmp_path / "out", capsys)
    skips = reader != "requests" or touches_listing
    ref_code, ref, _ = references[(reader, "deleted" if skips else "intact")]
    assert "Traceback" not in err
    assert code == ref_code and code in (0, 1)  # diagnose: 1 when the rest is alarming, as without the row
    assert produced == ref
    warnings = [line for line in err.splitlines() if "corrupt row" in line]
    if skips:
        assert len(warnings) == 1 and warnings[0].startswith("moescope: warning: skipped corrupt row 1 (")
        assert kind == "every-column-random" or rid in warnings[0]
    else:
        assert warnings == []


def test_corrupt_rows_are_counted_in_json(demo_store, tmp_path, capsys):
    src, rid = demo_store
    path = _copy(src, tmp_path / "c.sqlite")
    conn = sqlite3.connect(path)
    ids = [r[0] for r in conn.execute("SELECT request_id FROM requests ORDER BY started LIMIT 3")]
    conn.executemany("UPDATE requests SET layers = 'x' WHERE request_id = ?", [(i,) for i in ids])
    conn.commit()
    conn.close()
    for argv in (["diagnose", "--json"], ["cache-sim", "--json"], ["report", "--json", "--out", str(tmp_path / "r")]):
        assert main([*argv, "--traces", str(path)]) in (0, 1)
        io = capsys.readouterr()
        assert json.loads(io.out)["corrupt_rows"] == 3
        assert [line.split(" (")[0] for line in io.err.splitlines() if "corrupt row" in line] == \
            [f"moescope: warning: skipped corrupt row {i}" for i in (1, 2, 3)]


@pytest.mark.parametrize("reader", READERS)
def test_nothing_readable_left_is_exit_2_with_one_error_line(reader, demo_store, tmp_path, capsys):
    src, _ = demo_store
    path = _copy(src, tmp_path / "all.sqlite")
    conn = sqlite3.connect(path)
    conn.execute("UPDATE requests SET started = 'garbage', layers = 'garbage'")
    conn.commit()
    conn.close()
    code, _, err = _run(reader, path, tmp_path / "out", capsys)
    assert code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("moescope: error:")]
    assert len(errors) == 1 and "nothing readable left" in errors[0]
    assert err.splitlines()[-1] == errors[0]


def test_trace_of_a_corrupt_row_is_one_line_and_the_others_still_read(demo_store, tmp_path, capsys):
    src, rid = demo_store
    for kind in CORRUPTIONS:
        path = _copy(src, tmp_path / f"{kind}.sqlite")
        _corrupt(path, rid, kind)
        assert main(["trace", rid, "--traces", str(path), "--json"]) == 2
        err = capsys.readouterr().err
        assert "corrupt row" in err and err.count("\n") == 1 and "Traceback" not in err
    conn = sqlite3.connect(src)
    other = conn.execute("SELECT request_id FROM requests WHERE request_id != ? LIMIT 1", (rid,)).fetchone()[0]
    conn.close()
    assert main(["trace", other, "--traces", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["request_id"] == other


def test_requests_of_another_model_shape_are_left_out_with_a_note(demo_store, tmp_path, capsys):
    """Not corrupt: another model's requests in the same store. Readers read the most common shape."""
    src, rid = demo_store
    path = _copy(src, tmp_path / "mixed.sqlite")
    conn = sqlite3.connect(path)
    n_experts = conn.execute("SELECT n_experts FROM requests WHERE request_id = ?", (rid,)).fetchone()[0]
    conn.execute("UPDATE requests SET n_experts = ? WHERE request_id = ?", (n_experts * 4, rid))
    conn.commit()
    conn.close()
    deleted = _copy(src, tmp_path / "deleted.sqlite")
    _delete(deleted, rid)
    for reader in ("cache-sim", "baseline", "diagnose"):
        code, produced, err = _run(reader, path, tmp_path / "o1", capsys)
        ref_code, ref, _ = _run(reader, deleted, tmp_path / "o2", capsys)
        assert (code, produced) == (ref_code, ref)
        assert [line for line in err.splitlines() if "other shapes left out" in line] != []
