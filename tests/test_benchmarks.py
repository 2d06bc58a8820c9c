"""Every benchmark keeps working: each benchmarks/*.py has a --quick mode, and CI runs it.

The list is the directory itself, so a new benchmark is covered the day it lands, and one without --quick
fails here. A quick run writes benchmarks/results/<name>-quick*.json (ignored by git), never the figures
the docs quote.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from reference import naive_goal_verdict, vllm_overhead_mismatches

BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
QUICK_TIMEOUT_S = 900  # a quick run is a smoke run: minutes at most, even on a busy 2-core CI machine
# Benchmarks whose --quick run a test of their own makes and checks in detail (not run twice): name -> that test.
# (vllm.py and vllm_soak.py need the .vllm/ environment: their quick runs are in the vLLM pass, `make test-vllm`)
QUICK_TESTED_ELSEWHERE = {"serve": ("test_serve.py", "test_load_benchmark_quick_runs"),
                          "vllm": ("test_vllm.py", "test_the_overhead_benchmark_quick_runs"),
                          "vllm_soak": ("test_vllm_diagnose.py", "test_the_soak_benchmark_quick_runs"),
                          "step_balance": ("test_step_balance_ranks.py", "report")}


def test_the_directory_holds_the_benchmarks():
    assert len(BENCHMARKS) >= 8, BENCHMARKS


@pytest.mark.parametrize("name", sorted(QUICK_TESTED_ELSEWHERE))
def test_a_benchmark_left_out_here_has_its_quick_run_tested_elsewhere(name):
    module, test = QUICK_TESTED_ELSEWHERE[name]
    source = (ROOT / "tests" / module).read_text()
    body = source[source.index(f"def {test}("):]
    body = body[:body.find("\ndef ", 1)]
    assert f'"{name}.py"' in body and '"--quick"' in body, f"{module}::{test} no longer runs {name}.py --quick"


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("path", [p for p in BENCHMARKS if p.stem not in QUICK_TESTED_ELSEWHERE], ids=lambda p: p.stem)
def test_benchmark_runs_in_quick_mode(path, tmp_path):
    # Without a --quick in its source a benchmark would run its full length here (or ignore the flag): fail first.
    # (No separate `--help` run: each costs a torch import; argparse rejects an unknown --quick below anyway.)
    assert "--quick" in path.read_text(), f"{path.name} has no --quick mode: CI cannot keep it from rotting"
    env = {**os.environ, "MOESCOPE_TRACES": str(tmp_path / "traces.sqlite")}
    started = time.time()
    run = subprocess.run([sys.executable, str(path), "--quick"], capture_output=True, text=True,
                         timeout=QUICK_TIMEOUT_S, cwd=ROOT, env=env)
    assert "unrecognized arguments: --quick" not in run.stderr, f"{path.name} has no --quick mode"
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    written = [p for p in (ROOT / "benchmarks" / "results").glob(f"{path.stem}*-quick*.json")
               if p.stat().st_mtime >= started - 1]
    assert written, f"{path.name} --quick wrote no results/{path.stem}*-quick*.json"
    assert all(p.stat().st_size > 2 for p in written)


def test_the_results_helper_resolves_quick_out_and_rounds(capfd, monkeypatch):
    """benchmarks/_results.py, the one place the benchmarks' --quick / --out / --rounds logic lives: a quick run
    never writes the file the docs quote; --rounds wins over both defaults; progress lines off a terminal."""
    monkeypatch.delenv("MOESCOPE_PROGRESS", raising=False)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _results
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def parse(*argv, **kw):
        return _results.parse(_results.parser("x", quick="q", rounds=7), list(argv), "bench", **kw)

    full, quick, chosen = parse(), parse("--quick"), parse("--quick", "--rounds", "3", "--out", "o.json")
    assert (full.out, full.rounds) == (ROOT / "benchmarks" / "results" / "bench.json", 7)
    assert (quick.out, quick.rounds) == (ROOT / "benchmarks" / "results" / "bench-quick.json", 1)
    assert (str(chosen.out), chosen.rounds) == ("o.json", 3)
    by_args = parse("--quick", quick_rounds=lambda a: 2 if a.quick else 9)
    assert by_args.rounds == 2
    assert list(_results.track(range(3), "three steps")) == [0, 1, 2]
    err = capfd.readouterr().err
    assert "moescope: three steps ..." in err and "moescope: three steps: done in" in err
    # every benchmark takes its command line from the helper (no argparse of its own)
    assert [p.name for p in BENCHMARKS if "_results.parser(" not in p.read_text()] == []


def test_serves_on_off_ratio_cancels_the_cost_of_running_first():
    """benchmarks/serve.py's ratio: rounds alternate which server runs first; a cost that comes with the position
    multiplies one order's ratios by f and the other's by 1/f. The order-balanced ratio gives back the true ratio
    (a plain median over 7 rounds, 4 of one order, would give r x f), and a noise-free run gives its own ratio."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import serve
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    true, f = 1.01, 1.3
    rounds = [(r, true * (f if r % 2 == 0 else 1 / f) * (1 + 0.01 * ((r * 7) % 3 - 1))) for r in range(7)]
    assert statistics.median(x for _, x in rounds) > 1.25  # the majority order's side
    assert math.isclose(serve.order_balanced(rounds), true, rel_tol=0.011)  # within the injected 1% jitter
    assert serve.order_balanced([(0, 1.07)]) == 1.07  # one round (--quick): its own ratio
    assert serve.order_balanced([]) is None


def _benchmarks_module(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.parametrize("ratios, goal", [
    ([1.0, 1.01, 1.0, 1.02, 1.0], 1.02), ([1.3, 1.2, 1.25, 1.4], 1.02), ([0.64, 1.38, 0.73, 1.41, 1.26], 1.02),
    ([0.98, 1.03], 1.02), ([1.0, 1.018], 1.02), ([1.03, 1.06], 1.02), ([1.05], 1.02), ([], 1.02),
    ([0.5, 0.6, 0.7, 1.5, 1.6, 1.7, 1.8], 1.03),
    ([1.1, 1.1, 1.1, 1.0, 0.9, 0.9, 0.9], 1.0),
    # serve.json's deepseek-v3-shape at 32 clients: every round under 1, by more than the goal's margin
    ([0.74, 0.81, 0.85, 0.87, 0.9, 0.95, 1.01], 1.02), ([0.97, 0.99, 1.0, 1.01], 1.02)])
def test_the_one_verdict_rule_against_its_words(ratios, goal):
    """benchmarks/_verdict.py (every benchmark's verdict) against docs/vllm.md's rule written out naively
    (tests/reference.py): quartiles of the per-round ratios, met / missed / not resolved."""
    verdict = _benchmarks_module("_verdict").verdict
    assert verdict(ratios, goal).split(" (")[0] == naive_goal_verdict(ratios, goal)
    assert verdict(ratios, goal, instances=True).split(" (")[0] == naive_goal_verdict(ratios, goal, instances=True)
    assert verdict(None, goal, why="no rounds kept") == "not resolved (no rounds kept)"


def test_published_verdicts_follow_the_rule_from_the_files_rounds():
    """The verdicts the docs print for serve.json and overhead.json are the rule's over the per-round ratios
    recomputed here from each file's raw figures (serve: each round's server CPU per token, on / off), and a
    "met" printed anywhere in those tables stands only where the rule says met."""
    serve, tables = _benchmarks_module("serve"), _benchmarks_module("_tables")
    results = ROOT / "benchmarks" / "results"
    d = json.loads((results / "serve.json").read_text())
    printed = serve.markdown(d)
    said = re.findall(r"(\d+) clients? ([\d.]+)x(?: \([^)]*\))?: (met|missed|not resolved)", printed)
    expected = []
    for r in d["models"].values():
        for c in r["requests_per_load"]:
            on, off = r["runs"][f"capture_on/{c}"], r["runs"][f"capture_off/{c}"]
            ratios = [a["server_cpu_ms_per_token"] / b["server_cpu_ms_per_token"] for a, b in zip(on, off)]
            expected.append((c, naive_goal_verdict(ratios, serve.GOAL, instances=True)))
    assert [(c, v) for c, _, v in said] == expected
    o = json.loads((results / "overhead.json").read_text())
    rows = [line for line in tables.overhead(o, None) if line.startswith("| ") and "---" not in line][1:]
    expected_rows = [(w, k) for w in o["workloads"] for k in ("metrics", "metrics+traces")]
    for (w, k), line in zip(expected_rows, rows, strict=True):
        cells = [c.strip().split(" (")[0] for c in line.strip("|").split("|")][-2:]
        if w["concurrency"] != tables.OVERHEAD_GOAL_CONCURRENCY:  # issue [lean]'s goal is at 16 tokens a step
            assert cells == ["-", "-"]
            continue
        # the passes' ratios, and the upper bound: each interleaved round plus the background threads' CPU share
        bound = [x + w[k]["background_cpu_share"] for x in w[k]["interleaved"]["ratios"]]
        assert cells == [naive_goal_verdict(w[k]["ratios"], tables.OVERHEAD_GOALS[k]),
                         naive_goal_verdict(bound, tables.OVERHEAD_GOALS[k])]


def test_the_published_vllm_overhead_is_its_rounds():
    """benchmarks/results/vllm.json (docs/vllm.md's table): every ratio, median and goal verdict recomputed from the
    file's raw rounds (tokens, wall and server CPU seconds per round), and the table's verdict words the rule's."""
    import subprocess

    results = ROOT / "benchmarks" / "results" / "vllm.json"
    printed = subprocess.run([sys.executable, "benchmarks/vllm.py", "--markdown", str(results)], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    assert vllm_overhead_mismatches(json.loads(results.read_text()), printed) == []
