"""The demo summary stays compact at any shape: one line per MoE layer whatever the expert count, and the
JSON's per-layer summary equals a naive recomputation from the full counts it also carries."""

import numpy as np

from moescope import stats
from moescope.cli import summary


def _naive(counts, n=3):
    total = sum(counts)
    by_hot = sorted(range(len(counts)), key=lambda e: (-counts[e], e))
    by_cold = sorted(range(len(counts)), key=lambda e: (counts[e], e))
    return {"cv": round(stats.load_cv(counts), 4), "dead": sum(1 for c in counts if c == 0), "slots": total,
            "hottest": [{"expert": e, "share": round(counts[e] / total, 5)} for e in by_hot[:n]],
            "coldest": [{"expert": e, "share": round(counts[e] / total, 5)} for e in by_cold[:n]]}


def _deepseek_shaped_load(seed=0):
    rng = np.random.default_rng(seed)
    load = {layer: rng.multinomial(24000, np.full(256, 1 / 256)).tolist() for layer in range(3, 61)}
    load[7][5] = 0
    load[7][200] = 0
    load[30][17] = 9000  # a hot expert
    return load


def test_layer_summary_equals_a_naive_recomputation():
    for counts in [*_deepseek_shaped_load().values(), [5, 0, 5, 1, 0, 9, 9, 2]]:
        assert summary.layer_summary(counts) == _naive(counts)


def test_human_lines_are_one_per_layer_at_deepseek_shape():
    load = _deepseek_shaped_load()
    s = {"expert_load": {str(k): v for k, v in load.items()}}
    lines = summary.load_lines(s)
    assert len(lines) == 2 + 58  # the model, the legend, one line per layer: never 14,848 percentages
    assert all(len(line) <= 120 for line in lines)
    assert "2 dead in 1 layers" in lines[0]
    row7 = next(line for line in lines if line.startswith("  L7 "))
    assert "dead   2" in row7 and "cold 5:0.00% 200:0.00%" in row7
    row30 = next(line for line in lines if line.startswith("  L30 "))
    assert f"hot 17:{9000 / sum(load[30]):.2%}" in row30


def test_demo_json_carries_the_summary_of_its_own_counts(capsys):
    import json

    from moescope.cli import main

    assert main(["demo", "--requests", "2", "--rate", "0", "--metrics-port", "-1", "--traces", "none", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["expert_load_summary"] == {layer: _naive(c) for layer, c in s["expert_load"].items()}
