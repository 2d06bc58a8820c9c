"""`moescope report`: tables equal a recomputation from the store's per-request traces, the heatmaps are real
images whose pixels follow the load, and the summary attributes a drift to the domain that moved."""

import collections

import numpy as np
import pandas as pd
import pytest
import torch

from moescope.cli import main
from moescope.traces import store


@pytest.fixture(scope="module")
def drift_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "t.sqlite"
    assert main(["demo", "--no-tui", "--rate", "40", "--requests", "48", "--scenario", "drift",
                 "--metrics-port", "-1", "--traces", str(path)]) == 0
    return path


def _recompute(path):
    """Slots per (layer, expert), per (layer, domain, expert), per (layer, phase, expert) from load_request."""
    conn = store.open_store(path)
    by = {k: collections.Counter() for k in ("all", "domain", "phase")}
    for row in store.list_requests(conn, limit=10000):
        doc = store.load_request(conn, row.request_id)
        for tok in doc["tokens"]:
            for lay in tok["layers"]:
                for e in lay["experts"]:
                    if e == doc["n_experts"]:  # a dropped slot
                        continue
                    by["all"][(lay["layer"], e)] += 1
                    by["domain"][(lay["layer"], doc["domain"], e)] += 1
                    by["phase"][(lay["layer"], tok["phase"], e)] += 1
    conn.close()
    return by


def test_tables_equal_a_recomputation_from_the_store(drift_store, tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["report", "--traces", str(drift_store), "--out", str(out), "--layers", "all"]) == 0
    ref = _recompute(drift_store)
    load = pd.read_csv(out / "load.csv")
    assert {(r.layer, r.expert): r.slots for r in load.itertuples() if r.slots} == dict(ref["all"])
    for kind in ("domain", "phase"):
        t = pd.read_csv(out / f"load_by_{kind}.csv")
        assert {(r.layer, getattr(r, kind), r.expert): r.slots for r in t.itertuples()} == dict(ref[kind])
        assert np.allclose(t.groupby(["layer", kind]).share.sum(), 1.0)
    co = pd.read_csv(out / "coactivation.csv")
    assert (co.tokens > 0).all() and (co.expert_a < co.expert_b).all()
    summary = (out / "summary.md").read_text()
    assert "domain mix explains" in summary and "**numbers**" in summary  # the drift scenario's shift
    for png in out.glob("*.png"):
        assert png.stat().st_size > 5000


def _heatmap_pixels(tmp_path, counts, name):
    import matplotlib.image as mpimg

    dump = tmp_path / f"{name}.pt"
    torch.save({"logical_count": torch.tensor(counts)}, dump)
    assert main(["report", "--import", str(dump), "--out", str(tmp_path / name), "--layers", "0"]) == 0
    return mpimg.imread(tmp_path / name / "heatmap_layer0.png")


def test_heatmap_pixels_follow_the_load(tmp_path):
    uniform = np.full((6, 1, 8), 10)
    skewed = uniform.copy()
    skewed[:, 0, :] = 1
    skewed[:, 0, 3] = 80  # expert 3 takes most of every pass
    a = _heatmap_pixels(tmp_path, uniform, "u")
    b = _heatmap_pixels(tmp_path, skewed, "s")
    a2 = _heatmap_pixels(tmp_path, uniform, "u2")
    assert a.std() > 0 and np.array_equal(a, a2)  # a real image, and the same load draws the same pixels
    assert a.shape == b.shape and np.abs(a - b).mean() > 0.001  # another load, other pixels
