"""benchmarks/_suite_time.py reads a CI log as .ci/pytest writes it: each pass's time line and pytest's summary
just above it. The log below is written by hand in that format (the reference), not produced by the parser."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _suite_time  # noqa: E402

LOG = """\
ruff check .
All checks passed!
============ 744 passed, 10 skipped in 559.12s (0:09:19) ============
suite phase: parallel 560 s (exit 0)
============ 50 passed in 701.00s (0:11:41) ============
suite phase: serial 702 s (exit 0)
============ 14 passed in 6.20s ============
suite phase: hf457 7 s (exit 0)
============ 18 passed, 1 failed in 770.00s (0:12:50) ============
suite phase: vllm 771 s (exit 1)
"""


def test_each_pass_gets_its_time_and_its_own_summary():
    r = _suite_time.parse(LOG, 2198, 1)
    assert [(p["pass"], p["seconds"], p["exit"]) for p in r["passes"]] == [
        ("parallel", 560, 0), ("serial", 702, 0), ("hf457", 7, 0), ("vllm", 771, 1)]
    assert [p.get("passed") for p in r["passes"]] == [744, 50, 14, 18]
    assert r["passes"][0]["skipped"] == 10 and r["passes"][3]["failed"] == 1
    assert r["setup_and_rest_s"] == 2198 - (560 + 702 + 7 + 771)
    table = _suite_time.markdown(r)
    assert "| vllm | 771 s | 18 passed, 1 failed | 1 |" in table and "2198 s (36.6 min)" in table


LANE_LOG = """\
============ 700 passed, 10 skipped in 500.00s (0:08:20) ============
suite phase: parallel 501 s (exit 0)
============ 50 passed in 690.00s (0:11:30) ============
suite phase: serial 712 s (exit 0)
============ 20 passed in 700.00s (0:11:40) ============
suite lane: beside-serial 705 s (exit 1)
"""


def test_a_lane_beside_a_phase_is_kept_apart_and_not_added_to_the_total():
    r = _suite_time.parse(LANE_LOG, 1300, 1)
    assert [(p["pass"], p["seconds"], p["exit"], p.get("beside", False), p.get("passed")) for p in r["passes"]] == [
        ("parallel", 501, 0, False, 700), ("serial", 712, 0, False, 50), ("beside-serial", 705, 1, True, 20)]
    assert r["setup_and_rest_s"] == 1300 - (501 + 712)  # the lane ran inside the serial phase's 712 s
    assert "| beside-serial (beside the phase above, inside its time) | 705 s | 20 passed | 1 |" in \
        _suite_time.markdown(r)
