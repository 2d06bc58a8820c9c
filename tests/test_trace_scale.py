"""Traces at deepseek-v3 shape (58 MoE layers x 256 experts, top-8): `trace --json` with and without a layer
selection, the Textual viewer's token x layer grid driven by Pilot and by tmux as a person would, and
`requests`, on a store the real engine and TraceRecorder wrote."""

import asyncio
import json
import os
import subprocess
import sys

import pytest
import scale_store
from tmux_screen import wait_screen

from moescope.cli import main
from moescope.traces import store
from moescope.tui import trace_grid

LAYERS = list(range(3, 61))


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv3") / "t.sqlite"
    records = scale_store.build(path, tokens=40, short=2)
    return path, records


def test_trace_json_at_shape_and_layer_selection(dsv3, capsys):
    path, records = dsv3
    rid = records[0].request_id
    assert main(["trace", rid, "--traces", str(path), "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["layers"] == LAYERS and full["n_experts"] == 256 and full["top_k"] == 8
    routed = [t for t in full["tokens"] if t["layers"]]
    assert len(full["tokens"]) == 40 and len(routed) == 39  # the last generated token is never routed
    assert all(len(t["layers"]) == 58 and all(len(la["experts"]) == 8 for la in t["layers"]) for t in routed)
    assert main(["trace", rid, "--traces", str(path), "--json", "--layers", "3,17,40-42"]) == 0
    part = json.loads(capsys.readouterr().out)
    assert part["layers"] == [3, 17, 40, 41, 42]
    for a, b in zip(full["tokens"], part["tokens"]):  # the selection is the full document's entries
        assert b["layers"] == [la for la in a["layers"] if la["layer"] in part["layers"]]
        assert b["flags"] == a["flags"]
    assert main(["trace", rid, "--traces", str(path), "--json", "--layers", "2,61"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no MoE layer 2, 61" in err and "(layers 3-60)" in err


def test_requests_lists_the_store(dsv3, capsys):
    path, records = dsv3
    assert main(["requests", "--traces", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["request_id"] for r in rows) == sorted(r.request_id for r in records)


def test_viewer_grid_pilot_58_layers_in_80x24(dsv3):
    from moescope.tui.trace_app import TraceApp

    path, records = dsv3
    doc = store.load_request(store.open_store(path), records[0].request_id)
    scale = trace_grid.entropy_scale(doc)

    async def drive():
        app = TraceApp(doc)
        async with app.run_test(size=(80, 24)) as pilot:
            grid = str(app.query_one("#grid").render()).splitlines()
            ruler, rows = grid[0], grid[1:]
            assert ruler.split() == [f"L{la}" for la in LAYERS[::5]]  # every fifth layer named over its column
            assert len(rows) >= 10 and all(len(r) == trace_grid.LABEL + 58 for r in rows)  # every layer fits
            for i, row in enumerate(rows):  # each cell is its token's routing at that layer
                want = [trace_grid.cell(doc, la, scale)[0] for la in doc["tokens"][i]["layers"]]
                assert list(row[trace_grid.LABEL:]) == want
            for _ in range(57):
                await pilot.press("right")
            await pilot.press("down", "down", "down")
            assert (app.current, app.col) == (3, 57)
            cell = str(app.query_one("#cell").render())
            la = doc["tokens"][3]["layers"][57]
            assert "layer 60 (58/58)" in cell and f"e{la['experts'][0]} " in cell
            await pilot.press("end")
            assert app.current == len(doc["tokens"]) - 1  # the grid scrolled to the last token
            assert str(app.query_one("#grid").render()).splitlines()[-1].startswith(f"{app.current:>4} ")
            await pilot.press("q")

    asyncio.run(drive())


def test_viewer_in_tmux_reads_as_a_person_would(dsv3):
    from servers import require

    tmux = require("tmux", "tmux")
    path, records = dsv3
    rid = records[0].request_id
    session = f"moescope-trace-dsv3-{os.getpid()}"
    cmd = f"{sys.executable} -m moescope trace {rid} --traces {path}; echo EXITED; sleep 30"
    subprocess.run([tmux, "new-session", "-d", "-s", session, "-x", "80", "-y", "24", cmd], check=True)

    try:
        text = wait_screen(tmux, session, "q quit")  # the footer comes last
        lines = text.splitlines()
        assert all(len(line) <= 80 for line in lines) and len(lines) <= 24
        assert rid in text and "L58" in text and "layer 3 (1/58)" in text
        subprocess.run([tmux, "send-keys", "-t", session, "End", "Up", "Right", "Right"], check=True)
        wait_screen(tmux, session, "layer 5 (3/58)")
        subprocess.run([tmux, "send-keys", "-t", session, "q"], check=True)
        wait_screen(tmux, session, "EXITED")
    finally:
        subprocess.run([tmux, "kill-session", "-t", session], capture_output=True)

