"""diagnose and baseline on a trace store whose engine gives no router scores (vLLM's capture function hands over
the chosen expert ids only: entropy, margin and gate weights are stored NaN meaning "unknown", its steps
``"scored": false``).

Fast, on the reference runtime: the demo's own traffic, written by the real trace writer, with every routing
decision reduced at the observer seam to what the vLLM adapter gives (``_unscored``: the ids, NaN scores,
``scored=False``). The unknown scores must never read as non-finite logits, and routing must be judged as on a
scored store: the healthy store names nothing critical and judges every layer; the hot-expert store, against a
baseline saved from the healthy store, names the fault's layer and expert (the ones the demo was told). The same
on a real vLLM server: tests/test_vllm_diagnose.py."""

from __future__ import annotations

import dataclasses
import json
import sqlite3

import numpy as np
import pytest
import torch

from moescope.capture import token_trace
from moescope.cli import main

HOT_LAYER, HOT_EXPERT = 2, 5


def _unscored(decision):
    """What vLLM's capture gives for ``decision``: its ids (and the capacity's kept slots), every score NaN."""
    nan_t = torch.full_like(decision.entropy, float("nan"))
    return dataclasses.replace(decision, weights=torch.full_like(decision.weights, float("nan")), entropy=nan_t,
                               margin=nan_t.clone(), nonfinite=torch.zeros_like(decision.nonfinite), scored=False)


def _demo(path, extra) -> None:
    assert main(["demo", "--no-tui", "--rate", "0", "--requests", "48", "--metrics-port", "-1", "--traces",
                 str(path), *extra]) == 0


FAULTS = {"healthy": [], "hot": ["--scenario", f"hot={HOT_LAYER}:{HOT_EXPERT}:2.5x"]}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """{name: unscored store}, and {name + "-scored": the same demo's store with its scores (the reference)}."""
    base = tmp_path_factory.mktemp("unscored")
    out = {}
    for name, extra in FAULTS.items():
        out[name + "-scored"] = base / f"{name}-scored.sqlite"
        _demo(out[name + "-scored"], extra)
    original = token_trace.TokenTraceCapture.on_routing
    mp = pytest.MonkeyPatch()
    # the observer seam as the vLLM adapter feeds it: decisions without scores
    mp.setattr(token_trace.TokenTraceCapture, "on_routing", lambda self, layer, d: original(self, layer, _unscored(d)))
    try:
        for name, extra in FAULTS.items():
            out[name] = base / f"{name}.sqlite"
            _demo(out[name], extra)
    finally:
        mp.undo()
    return out


def named(report) -> set[tuple[int, int]]:
    """The (layer, expert) pairs the routing findings blame: a hot expert's, a collapsed layer's, the hottest of a
    drifted or imbalanced layer."""
    out = set()
    for f in report["findings"]:
        ev = f["evidence"]
        if f["cause"] == "hot-expert":
            out |= {(e["layer"], e["expert"]) for e in ev["experts"]}
        elif f["cause"] == "collapse":
            out |= {(int(layer), v["expert"]) for layer, v in ev["layers"].items()}
        elif f["cause"] == "imbalance":
            out |= {(int(layer), v["hot"][0]) for layer, v in ev["layers"].items()}
        elif f["cause"] == "drift":
            out |= {(int(layer), v["hot"][0]) for layer, v in (ev.get("imbalanced_too") or {}).items()}
    return out


def _diagnose(capsys, path, *extra) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["diagnose", "--traces", str(path), "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_the_store_holds_unscored_steps(stores):
    """The premise, read from the store directly: every stored entropy is NaN and every step says unscored."""
    con = sqlite3.connect(stores["healthy"])
    rows = con.execute("SELECT entropy, steps FROM requests").fetchall()
    con.close()
    assert len(rows) == 48
    for ent, steps in rows:
        assert np.isnan(np.frombuffer(ent, dtype=np.float16)).all()
        assert all(st.get("scored") is False for st in json.loads(steps))


def test_unknown_scores_are_not_nonfinite_and_routing_is_judged(stores, capsys):
    code, report = _diagnose(capsys, stores["healthy"])
    causes = {f["cause"]: f for f in report["findings"]}
    assert "nonfinite" not in causes, causes["nonfinite"]
    assert not [f for f in report["findings"] if f["severity"] == "critical"], report["findings"]
    judged = causes["judged"]["evidence"]
    assert judged["layers_judged"] == judged["layers"] == len(report["layers"]), judged
    assert judged["requests"] == 48
    # one request's trace: no token flagged nonfinite
    con = sqlite3.connect(stores["healthy"])
    rid = con.execute("SELECT request_id FROM requests LIMIT 1").fetchone()[0]
    con.close()
    capsys.readouterr()
    assert main(["trace", rid, "--traces", str(stores["healthy"]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert not any("nonfinite" in t["flags"] for t in doc["tokens"])


def test_hot_gate_is_named_against_a_baseline_from_the_healthy_store(stores, capsys, tmp_path):
    """tiny-demo has 8 experts at top-2: an expert's share is capped at 4x its fair share, the hot-expert bar
    (thresholds.hot_factor), so a hot gate there is drift (or collapse) naming its layer and expert, as the rules
    name it; the scored store of the same demo is the reference: the same causes, the same layer and expert."""
    found = {}
    for kind in ("", "-scored"):
        base = tmp_path / f"base{kind}.json"
        assert main(["baseline", "save", "--traces", str(stores["healthy" + kind]), "--out", str(base)]) == 0
        code, report = _diagnose(capsys, stores["hot" + kind], "--baseline", str(base))
        assert code == 1, report["findings"]
        alarming = {f["cause"] for f in report["findings"] if f["severity"] != "info"}
        found[kind] = (alarming, named(report))
    assert found[""][1] == {(HOT_LAYER, HOT_EXPERT)}, found
    assert "nonfinite" not in found[""][0]
    assert found[""] == found["-scored"]


def test_a_healthy_store_is_judged_alike_scored_or_not(stores, capsys):
    causes = {}
    for name in ("healthy", "healthy-scored"):
        code, report = _diagnose(capsys, stores[name])
        causes[name] = (code, {f["cause"] for f in report["findings"] if f["severity"] != "info"})
    assert causes["healthy"] == causes["healthy-scored"] == (0, set()), causes
