"""`--model NAME` on the commands that read the trace store (`report`, `diagnose`, `plan-placement`, `baseline
save`, `cache-sim`): on a store that holds two models of different shapes each reads only the named model's
requests, the note a read without `--model` writes names the model it left out and the option, and a name the
store does not hold is one error line (exit 2) naming the stored models, with nothing written.

The store is real: two `moescope demo` runs into one file, the bundled tiny-demo and a smaller model of another
shape (a config file, random weights). The references are the store's own rows, counted with `sqlite3`."""

import json
import sqlite3

import pandas as pd
import pytest

from moescope.cli import main

OTHER = "other-moe"  # 2 MoE layers x 6 experts (tiny-demo: 3 x 8)
COUNTS = {"tiny-demo": 8, OTHER: 12}  # requests per model: the other model is the one most requests have


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    path = root / "t.sqlite"
    config = root / "other.json"
    config.write_text(json.dumps({"preset": "tiny-demo", "name": OTHER, "n_layers": 3, "n_experts": 6,
                                  "hidden_size": 32, "ffn_size": 32, "dense_ffn_size": 64}))
    common = ["--rate", "0", "--metrics-port", "-1", "--traces", str(path), "--canary-interval", "0", "--json"]
    assert main(["demo", "--requests", str(COUNTS["tiny-demo"]), *common]) == 0
    assert main(["demo", "--model", str(config), "--weights", "random", "--requests", str(COUNTS[OTHER]),
                 *common]) == 0
    return path


def _stored(path, model):
    """(routed requests, MoE layers, experts) of ``model``'s rows, straight from SQLite."""
    conn = sqlite3.connect(path)
    try:
        (n,) = conn.execute("SELECT COUNT(*) FROM requests WHERE model = ? AND ids IS NOT NULL", (model,)).fetchone()
        shapes = conn.execute("SELECT DISTINCT layers, n_experts FROM requests WHERE model = ?", (model,)).fetchall()
    finally:
        conn.close()
    assert len(shapes) == 1
    return n, json.loads(shapes[0][0]), shapes[0][1]


def test_the_store_holds_two_models_of_different_shapes(two_models):
    """What the other tests rely on."""
    tiny, other = _stored(two_models, "tiny-demo"), _stored(two_models, OTHER)
    assert (tiny[0], other[0]) == (COUNTS["tiny-demo"], COUNTS[OTHER])
    assert (tiny[1], tiny[2]) != (other[1], other[2])


@pytest.mark.parametrize("model", ["tiny-demo", OTHER])
def test_each_reader_reads_only_the_named_model(model, two_models, tmp_path, capsys):
    n, layers, n_experts = _stored(two_models, model)
    traces = ["--traces", str(two_models), "--model", model]

    assert main(["report", *traces, "--json", "--out", str(tmp_path / "rep")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["model"], summary["requests"], summary["n_experts"], summary["layers"]) == (
        model, n, n_experts, layers)
    assert set(pd.read_csv(tmp_path / "rep" / "load.csv").layer) == set(layers)

    assert main(["diagnose", *traces, "--json", "--run", "all"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    assert (report["model"], report["requests"], report["layers"]) == (model, n, layers)

    assert main(["plan-placement", *traces, "--json", "--ranks", "2", "--out", str(tmp_path / "plan")]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["n_experts"], sorted(map(int, plan["layers"]))) == (n_experts, layers)

    assert main(["baseline", "save", *traces, "--out", str(tmp_path / "base.json")]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'base.json'}")
    base = json.loads((tmp_path / "base.json").read_text())
    assert (base["model"], base["n_experts"], sorted(map(int, base["layers"]))) == (model, n_experts, layers)
    assert {la["draws"] for la in base["layers"].values()} == {n}

    assert main(["cache-sim", *traces, "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert (sim["n_experts"], sim["layers"]) == (n_experts, layers)

    # the note on other shapes is for reads that chose no model
    assert "other shapes left out" not in capsys.readouterr().err


def test_a_read_without_model_notes_the_other_model_and_the_option(two_models, tmp_path, capsys):
    left_out, _, _ = _stored(two_models, "tiny-demo")  # the minority model: the most common shape is read
    for argv in (["diagnose", "--run", "all", "--json"], ["report", "--json", "--out", str(tmp_path / "rep")],
                 ["baseline", "save", "--out", str(tmp_path / "b.json")], ["cache-sim", "--json"],
                 ["plan-placement", "--ranks", "2", "--json", "--out", str(tmp_path / "plan")]):
        assert main([*argv, "--traces", str(two_models)]) in (0, 1)
        notes = [line for line in capsys.readouterr().err.splitlines() if "other shapes left out" in line]
        assert len(notes) == 1, argv
        assert f"{left_out} of other shapes left out" in notes[0]
        assert f"tiny-demo ({left_out} requests)" in notes[0] and "--model NAME" in notes[0], notes[0]


@pytest.mark.parametrize("reader", ["report", "diagnose", "plan-placement", "baseline", "cache-sim"])
def test_an_unknown_model_is_one_line_exit_2_naming_the_stored_ones(reader, two_models, tmp_path, capsys):
    out = tmp_path / "out"
    argv = {"report": ["report", "--out", str(out)], "diagnose": ["diagnose"],
            "plan-placement": ["plan-placement", "--ranks", "2", "--out", str(out)],
            "baseline": ["baseline", "save", "--out", str(out)], "cache-sim": ["cache-sim"]}[reader]
    capsys.readouterr()
    assert main([*argv, "--traces", str(two_models), "--model", "no-such-model"]) == 2
    io = capsys.readouterr()
    (line,) = [line for line in io.err.splitlines() if line.startswith("moescope: error:")]
    assert io.err.splitlines()[-1] == line and "Traceback" not in io.err  # (report's progress line comes first)
    assert line.startswith("moescope: error: --model no-such-model")
    assert f"{OTHER} ({COUNTS[OTHER]} requests)" in line and f"tiny-demo ({COUNTS['tiny-demo']} requests)" in line
    assert io.out == ""
    assert not out.exists()  # nothing written: no report or placement directory, no baseline file


def test_the_same_model_choice_reads_the_trace_lake(two_models, tmp_path, capsys):
    """The store's SQL with `--model` runs unchanged over the Parquet lake (DuckDB)."""
    pytest.importorskip("duckdb")
    lake = tmp_path / "lake"
    assert main(["traces", "convert", str(two_models), str(lake)]) == 0
    for model in COUNTS:
        capsys.readouterr()
        assert main(["diagnose", "--traces", f"{lake}/", "--model", model, "--run", "all", "--json"]) in (0, 1)
        report = json.loads(capsys.readouterr().out)
        assert (report["model"], report["requests"]) == (model, _stored(two_models, model)[0])
    assert main(["diagnose", "--traces", f"{lake}/", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("moescope: error: --model no-such-model"), err


def test_model_with_an_import_is_one_line_exit_2(tmp_path, capsys):
    dump = tmp_path / "load.jsonl"
    dump.write_text('{"iteration": 0, "layer": 1, "tokens_per_expert": [3, 1]}\n')
    assert main(["plan-placement", "--ranks", "2", "--import", str(dump), "--model", "x",
                 "--out", str(tmp_path / "plan")]) == 2
    assert capsys.readouterr().err.splitlines() == ["moescope: error: --model chooses a model of the trace store: "
                                                    "not with --import"]
    assert not (tmp_path / "plan").exists()


def test_layers_the_store_lacks_leave_no_report_directory(two_models, tmp_path, capsys):
    """docs/views.md's `report --out report/ --layers 3,17,40-45` on a store that lacks most of those layers: one
    error line, and no empty report directory left behind (nor its parents)."""
    out = tmp_path / "new" / "report2"
    assert main(["report", "--traces", str(two_models), "--out", f"{out}/", "--layers", "3,17,40-45"]) == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("moescope: error: no MoE layer 3, 17, 40"), line
    assert not (tmp_path / "new").exists()
