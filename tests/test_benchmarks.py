"""Every benchmark keeps working: each benchmarks/*.py has a --quick mode, and CI runs it.

The list is the directory itself, so a new benchmark is covered the day it lands, and one without --quick
fails here. A quick run writes benchmarks/results/<name>-quick*.json (ignored by git), never the figures
the docs quote.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT

BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
QUICK_TIMEOUT_S = 900  # a quick run is a smoke run: minutes at most, even on a busy 2-core CI machine


def test_the_directory_holds_the_benchmarks():
    assert len(BENCHMARKS) >= 8, BENCHMARKS


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.stem)
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
