"""Tables in the docs printed from results files, never typed by hand.

A docs page holds a block

    <!-- table: benchmarks/X.py --markdown benchmarks/results/Y.json [--section S] -->
    ...
    <!-- /table -->

whose body is what that command prints (run from the repository root with this Python), then one line of the
results file's provenance (`provenance_line`): the commit, date, machine and command its `provenance` object
records (benchmarks/_results.py `save()`); for a file from before runs recorded it, the provenance reconstructed
from what the run did record, marked as such with how sure its commit is.
``python benchmarks/_doc_tables.py`` rewrites every block; ``--check`` exits 1 naming

- ``tables``: the blocks that differ from what their command prints, and any page still holding a hand-typed figure
  table (a ``<!-- figures: ... -->`` marker);
- ``fresh``: the results files measured before a change to the code they measure, or without the CPU model or the
  load average (benchmarks/_freshness.py; what each file measures: benchmarks/_measures.py);
- ``claims``: the figures in the docs' prose that name no source holding them (benchmarks/_doc_claims.py);

``--only tables|fresh|claims`` (repeatable) checks those alone; tests/test_docs.py runs each. ``--declarations``
lists the commits declared behaviour-free, each with the command that shows its diff (for a reviewer).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import _doc_claims
import _freshness
import _measures

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- table: (?P<cmd>[^>]+?) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)
HAND_TYPED = "<!-- figures:"


def _machine(m) -> str:
    if isinstance(m, str):
        return m
    parts = [f"{m['cores']} cores" if m.get("cores") else f"{m['cpus']} CPUs" if m.get("cpus") else None,
             f"{m['cpu_threads']} intra-op thread(s)" if m.get("cpu_threads") else None,
             m.get("cpu"), f"GPU {m['gpu']}" if m.get("gpu") else None,
             "load average " + " / ".join(f"{x:g}" for x in m["load_average"]) if m.get("load_average") else None,
             m.get("note")]
    return ", ".join(p for p in parts if p)


def _command(cmd: str) -> str:
    first = cmd.split()[0] if cmd.split() else ""
    return f"python {cmd}" if first.endswith(".py") else cmd


def provenance_line(results: Path) -> str:
    """One line saying how ``results`` was made, from what the file records."""
    d = json.loads(results.read_text())
    p = d.get("provenance") if isinstance(d, dict) else None
    if p:
        m = p.get("machine") or {}
        pkgs = ", ".join(f"{k} {v}" for k, v in (p.get("packages") or {}).items() if v)
        dirty = " with uncommitted changes" if p.get("uncommitted_changes") else ""
        if p.get("commit_at_save"):  # HEAD moved while it ran: the commit measured is the one it started at
            dirty += f" (saved at {p['commit_at_save']})"
        head = "Provenance"
        if p.get("reconstructed"):  # a file from before runs recorded it: what the records say, and how sure
            head = f"Provenance (not recorded by the run; reconstructed from {p['reconstructed']})"
            dirty += f" ({p['commit_basis']})" if p.get("commit_basis") else ""
        # a summary recomputed later from the file's own raw rounds (an estimator fixed, nothing re-run): said so
        again = f" Summary {p['summarised']}." if p.get("summarised") else ""
        if p.get("corrected"):  # a provenance field set right after the run, with what and why
            again += f" Provenance corrected: {p['corrected']}."
        if results.name in _measures.KNOWN_STALE:  # cannot be re-run here: the docs say so beside its figures
            said = _freshness.notice(_freshness.judge(ROOT, results, _freshness.declarations(ROOT)))
            again += f" {said}" if said else ""
        return (f"{head}: commit {p.get('commit')}{dirty}, {p.get('date')}; {_machine(m)}"
                f"{'; ' + pkgs if pkgs else ''}; `{_command(p.get('command', '?'))}`.{again}")
    # (tests/test_docs.py fails on this line: every results file carries its provenance)
    return f"(provenance not recorded: re-run the benchmark that writes {results.name})"


def render(cmd: str) -> str:
    argv = cmd.split()
    if not argv or not argv[0].startswith("benchmarks/") or "--markdown" not in argv:
        raise SystemExit(f"doc table command must be `benchmarks/X.py --markdown RESULTS`: {cmd!r}")
    out = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    out = out.rstrip("\n") + "\n"
    results = ROOT / argv[argv.index("--markdown") + 1]
    return out + "\n" + provenance_line(results) + "\n"


def blocks(text: str):
    return list(BLOCK.finditer(text))


def pages() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def _tables(check: bool) -> list[str]:
    """Rewrites (or, under ``check``, names) the blocks out of date; names the hand-typed figure tables."""
    stale, hand = [], []
    for page in pages():
        text = page.read_text()
        if HAND_TYPED in text:
            hand.append(str(page.relative_to(ROOT)))
        new = BLOCK.sub(lambda m: m.group(1) + render(m.group("cmd")) + m.group(4), text)
        if new != text:
            stale.append(str(page.relative_to(ROOT)))
            if not check:
                page.write_text(new)
    out = []
    if hand:
        out.append(f"hand-typed figure tables ({HAND_TYPED} ...) in: {', '.join(hand)} (print them from their "
                   "results file in a `<!-- table: ... -->` block, or remove them)")
    if check and stale:
        out.append(f"tables out of date with their results files in: {', '.join(stale)} "
                   "(python benchmarks/_doc_tables.py rewrites them)")
    if not check:
        print(f"rewrote {len(stale)} page(s)" + (f": {', '.join(stale)}" if stale else ""))
    return out


CHECKS = {"tables": lambda: _tables(check=True), "fresh": _freshness.problems, "claims": _doc_claims.problems}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--declarations" in argv:
        print("\n".join(_freshness.declaration_lines()) or "no Behaviour-free declarations")
        return 0
    only = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--only"]
    if bad := [o for o in only if o not in CHECKS]:
        print(f"--only takes {', '.join(CHECKS)}, not {', '.join(bad)}", file=sys.stderr)
        return 2
    if "--check" not in argv:
        problems = _tables(check=False)
    else:
        problems = []
        for name in only or CHECKS:
            found = CHECKS[name]()
            if found:
                problems.append(f"{name}: {len(found)} problem(s)")
                problems += [f"  {line}" for line in found]
    if problems:
        print("\n".join(problems), file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
