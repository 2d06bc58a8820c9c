"""The suite's time on a fresh clone, as CI runs it: ``make test`` (``.ci/run``) on a new clone with ``CI=true``.

    python benchmarks/_suite_time.py [--out benchmarks/results/suite-time.json]

runs ``../shared/tools/fresh-clone-check`` (the workplace's copy of CI: a fresh clone of the committed ``main``,
every environment built from nothing but the package caches) and records, from its log, the total and each pass's
own time line (``.ci/pytest`` prints ``suite phase: NAME S s (exit RC)`` for the parallel and serial phases,
transformers 4.57 and the two vLLM passes) with pytest's summary of each (passed / skipped / failed). Set-up (the
environments, lint, docs) is the total less the passes. ``--log CI_LOG --total S`` reads a run already made.
``--markdown RESULTS`` prints the table docs/design.md holds (benchmarks/_doc_tables.py).

Not a benchmark of moescope: the figure is CI's cost, which the project keeps under 35 minutes (CI's limit is 90).
The machine matters (the same suite's time differed by a third between the AVX2 EPYC and AVX-512 Xeon machines of
earlier sessions), so the file records it, and the load average before the run (another process beside it is not a
result).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import _results  # noqa: E402

# A phase's time line; a lane's (tests run beside a phase, inside its time: .ci/pytest's lane beside the serial
# phase) is read the same way and kept apart, never added to the total's parts.
PHASE = re.compile(r"^suite (?P<kind>phase|lane): (?P<name>\S+) (?P<s>\d+) s \(exit (?P<rc>\d+)\)$", re.M)
SUMMARY = re.compile(r"^=+ (?P<body>(?:\d+ (?:passed|failed|skipped|deselected|error|errors|xfailed|xpassed)"
                     r"(?:, )?)+)(?: in [\d.]+s.*)? =+$", re.M)
TOTAL = re.compile(r"fresh-clone CI: exit (?P<rc>\d+) in (?P<s>\d+) s \(log: (?P<log>\S+)\)")


def parse(log: str, total_s: int, rc: int) -> dict:
    """The passes in the order they ran, each with pytest's summary line just above its time line."""
    passes = []
    last = 0
    for m in PHASE.finditer(log):
        summaries = SUMMARY.findall(log[last:m.start()])
        counts = {}
        for part in (summaries[-1].split(", ") if summaries else []):
            n, what = part.split(" ", 1)
            counts[what] = int(n)
        passes.append({"pass": m["name"], "seconds": int(m["s"]), "exit": int(m["rc"]), **counts,
                       **({"beside": True} if m["kind"] == "lane" else {})})
        last = m.end()
    return {"total_s": total_s, "exit": rc,
            "setup_and_rest_s": total_s - sum(p["seconds"] for p in passes if not p.get("beside")), "passes": passes}


def markdown(report: dict) -> str:
    rows = [f"| {p['pass']}{' (beside the phase above, inside its time)' if p.get('beside') else ''} | "
            f"{p['seconds']} s | {p.get('passed', 0)} passed"
            + "".join(f", {p[k]} {k}" for k in ("skipped", "failed", "errors") if p.get(k)) + f" | {p['exit']} |"
            for p in report["passes"]]
    return "\n".join(["| pass | time | tests | exit |", "|---|---|---|---|", *rows,
                      f"| set-up (environments, lint, docs) and the rest | {report['setup_and_rest_s']} s | | |",
                      f"| **total** (`.ci/run` on a fresh clone) | **{report['total_s']} s "
                      f"({report['total_s'] / 60:.1f} min)** | | {report['exit']} |"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=_results.RESULTS / "suite-time.json")
    ap.add_argument("--log", type=Path, help="a fresh-clone check's ci.log, already run")
    ap.add_argument("--total", type=int, help="with --log: the check's total seconds")
    ap.add_argument("--markdown", type=Path, metavar="RESULTS")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0
    _results.started()
    load_before = [round(x, 2) for x in os.getloadavg()]
    if args.log:
        if args.total is None:
            ap.error("--log needs --total")
        log, total, rc = args.log.read_text(errors="replace"), args.total, 0
    else:
        t0 = time.monotonic()
        run = subprocess.run([str(ROOT.parent / "shared" / "tools" / "fresh-clone-check")], cwd=ROOT,
                             capture_output=True, text=True)
        m = TOTAL.search(run.stdout)
        if not m:
            print(f"fresh-clone-check printed no result: {run.stdout[-500:]}", file=sys.stderr)
            return 2
        log, total, rc = Path(m["log"]).read_text(errors="replace"), int(m["s"]), int(m["rc"])
        print(f"fresh-clone check: exit {rc} in {total} s ({time.monotonic() - t0:.0f} s here)")
    report = parse(log, total, rc)
    if not report["passes"]:
        print("no `suite phase:` lines in the log: not a run of this .ci/pytest", file=sys.stderr)
        return 2
    report["load_average_before"] = load_before
    _results.save(report, args.out)
    print(markdown(report))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
