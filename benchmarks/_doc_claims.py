"""Every figure the docs state names where it comes from, and that source holds it.

A figure is a number with a unit in a docs page's prose (docs/*.md, README.md): a time (``2 s``, ``250 ms``,
``5 minutes``, ``4h``, "within a second"), a share (``3.6%``), a ratio (``1.02x``, ``4.5 x``) or a size
(``16 MB``, ``256 KiB``). Exempt: the tables benchmarks/_doc_tables.py prints from results files (``<!-- table:
... -->`` blocks), a table printed from code that a test checks (under ``<!-- generated: ... -->``), code (fenced
blocks and `inline code`: commands, formulas) and HTML comments.

Every other figure sits in a block (a paragraph, a list item or a table, with the heading above it) that names its
source, in one of these forms, each checked here (a list item shares the sources of the items it is nested in
and of the paragraph that introduces the list, ending in a colon):

- ``(test: tests/test_x.py::test_name)``: the test that asserts it. The test must exist and its module hold the
  figure as a literal (``10 s`` -> ``10``, ``93%`` -> ``0.93`` or ``93``, ``250 ms`` -> ``0.25`` or ``250``).
- ``(X.json, commit abc1234, 2026-12-07)``: a results file in benchmarks/results/, or a path from the root for
  another file with a provenance (``moescope/assets/tiny-demo.json``); several: ``(X.json, commit .., date; Y.json,
  commit .., date)``. The commit and date must be the file's provenance's (a re-run changes them, so
  the prose is read again), and the file must hold the figure at the precision printed (``1.88%`` is 0.0188 or 1.88
  to two decimals; each end of a range ``3.6-4.4%``).
- ``(log: benchmarks/results/X.log)``: a run's own log kept with the results (device-checks.log), holding the
  figure as written.
- ``(set: moescope/x.py)``: a value the code sets, not a measurement: a default, a bar, an interval, a goal (several
  paths: comma-separated). Each path must exist and one of them hold the figure as a literal.

A block's sources cover every figure in it, and each figure must be held by one of them. What this cannot see is
whether the source holds the figure for the reason the prose gives (a small integer is held by many files): the
marker says where to look, and a reviewer looks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

_NUM = r"\d{1,3}(?:,\d{3})+(?!\d)|\d+(?:\.\d+)?"
_UNIT = (r"ms|us|µs|ns|seconds?|secs?|s|minutes?|mins?|hours?|h|%|x(?!\s*\d)|×|[KMGT]i?B|B|"
         r"(?:tokens|requests|req)/s")
FIGURE = re.compile(rf"(?<![\w.\-/+])(?P<num>{_NUM})(?:\s?(?:-|–|\.\.|to)\s?(?P<num2>{_NUM}))?"
                    rf"(?:\s|-)?(?P<unit>{_UNIT})(?![\w/])")
WORDS = re.compile(r"\b(?:within|under|about|after|every|over|than|in)\s+(?:about\s+)?(?P<n>a|one|half a|two|a few)\s+"
                   r"(?P<unit>second|minute|millisecond|hour)s?\b", re.I)
TEST = re.compile(r"\(test:\s+(?P<body>[^)]+)\)")
RESULT = re.compile(r"(?P<file>[\w./-]+\.json),\s+commit\s+(?P<commit>[0-9a-f]{7,40}),\s+(?P<date>\d{4}-\d{2}-\d{2})")
RESULTS_MARK = re.compile(r"\((?P<body>[\w./-]+\.json,\s+commit\s[^)]+)\)")
SET = re.compile(r"\(set:\s+(?P<body>[^)]+)\)")
GENERATED = re.compile(r"<!-- generated: (?P<func>[\w.()]+) \((?P<test>tests/[\w/]+\.py) checks it\) -->")
LOG = re.compile(r"\(log:\s+(?P<body>benchmarks/results/[\w./-]+\.log)\)")
_LITERAL = re.compile(r"(?<![\w.])(\d[\d_]*(?:\.\d+)?(?:[eE]-?\d+)?)(?![\w])")


@dataclass(frozen=True)
class Figure:
    page: str
    line: int
    text: str                 # as written
    values: tuple[float, ...]  # each end of a range
    decimals: tuple[int, ...]
    unit: str


def _prose(text: str) -> str:
    """``text`` with what is exempt blanked (line numbers kept): generated tables, fenced code, HTML comments,
    inline code and link targets."""
    keep_lines = lambda m: "\n" * m.group(0).count("\n")  # noqa: E731
    text = re.sub(r"<!-- table:.*?<!-- /table -->", keep_lines, text, flags=re.S)
    text = re.sub(r"^```.*?^```", keep_lines, text, flags=re.S | re.M)
    # a table printed from code that a test compares with it (`<!-- generated: FUNCTION (TEST checks it) -->`)
    text = re.sub(r"<!-- generated: [^>]* checks it\) -->\n(?:\|.*\n)+", keep_lines, text)
    text = re.sub(r"<!--.*?-->", keep_lines, text, flags=re.S)
    return text


def _strip_inline(text: str) -> str:
    """Code spans, link targets and source markers blanked (newlines kept: a marker may span lines)."""
    blank = lambda m: re.sub(r"[^\n]", " ", m.group(0))  # noqa: E731
    text = re.sub(r"`[^`]*`", blank, text)  # (inline code may wrap: the block's text is whole here)
    text = re.sub(r"\]\([^)]*\)", blank, text)  # a link's target (a path, an anchor)
    for marker in (TEST, RESULTS_MARK, SET, LOG):
        text = marker.sub(blank, text)
    return text


def blocks(text: str) -> list[list[tuple[int, str]]]:
    """The page's prose in blocks of (line number, line): a paragraph, a list item (with its continuation lines)
    or a table; a heading belongs to the block under it."""
    out: list[list[tuple[int, str]]] = []
    cur: list[tuple[int, str]] = []
    heading: list[tuple[int, str]] = []

    def close():
        nonlocal cur, heading
        if cur:
            out.append(heading + cur)
            heading = []
        cur = []

    for i, line in enumerate(_prose(text).splitlines(), 1):
        s = line.strip()
        if not s:
            close()
            continue
        if s.startswith("#"):
            close()
            heading = [(i, line)]
            continue
        item = re.match(r"\s*(?:[-*+]|\d+\.)\s", line) is not None
        table = s.startswith("|")
        if cur and (item or (table != cur[-1][1].strip().startswith("|"))):
            close()
        cur.append((i, line))
    close()
    return out


def _number(tok: str) -> tuple[float, int]:
    tok = tok.replace(",", "")
    return float(tok), len(tok.split(".")[1]) if "." in tok else 0


def figures(page: Path, block: list[tuple[int, str]]) -> list[Figure]:
    out = []
    stripped = _strip_inline("\n".join(line for _, line in block)).split("\n")
    for (number, _), prose in zip(block, stripped):
        for m in FIGURE.finditer(prose):
            vals = [_number(m["num"])] + ([_number(m["num2"])] if m["num2"] else [])
            out.append(Figure(page.name, number, m.group(0), tuple(v for v, _ in vals), tuple(d for _, d in vals),
                              m["unit"]))
        for m in WORDS.finditer(prose):
            n = {"a": 1.0, "one": 1.0, "half a": 0.5, "two": 2.0, "a few": 3.0}[m["n"].lower()]
            out.append(Figure(page.name, number, m.group(0), (n,), (1,), m["unit"].lower()))
    return out


def _scales(unit: str) -> tuple[float, ...]:
    """The factors a source may hold a figure in, for its unit: a share as a fraction, a time in the next unit."""
    u = unit.lower()
    if u == "%":
        return (1.0, 0.01)
    if u in ("ms",):
        return (1.0, 0.001)
    if u in ("s", "sec", "secs", "second", "seconds"):
        return (1.0, 1000.0)
    if u in ("minute", "minutes", "min", "mins"):
        return (1.0, 60.0)
    if u in ("hour", "hours", "h"):
        return (1.0, 3600.0, 60.0)
    if u in ("millisecond",):
        return (1.0, 0.001)
    if u in ("us", "µs"):
        return (1.0, 1e-6)
    return (1.0,)


def _held(values: list[float], fig: Figure, *, rounded: bool) -> bool:
    """Whether every end of ``fig`` is among ``values``: at the precision printed (``rounded``, a measured value)
    or as written (a literal in code)."""
    for v, d in zip(fig.values, fig.decimals):
        targets = [v * k for k in _scales(fig.unit)]
        if rounded:
            ok = any(round(x / k, d) == v for x in values for k in _scales(fig.unit) if x == x)
        else:
            if fig.unit == "%":  # a relative change, as code writes it: 1% up or down is 1.01 or 0.99
                targets += [1 + v / 100, 1 - v / 100]
            ok = any(abs(x - t) <= 1e-9 * max(1.0, abs(t)) for x in values for t in targets)
        if not ok:
            return False
    return True


def _json_numbers(x, out: list[float]) -> None:
    if isinstance(x, bool):
        return
    if isinstance(x, (int, float)):
        out.append(float(x))
    elif isinstance(x, dict):
        for k, v in x.items():
            if k == "provenance":  # of the provenance, the load (a figure the prose may cite); not dates, cores
                _json_numbers(((v.get("machine") or {}) if isinstance(v, dict) else {}).get("load_average"), out)
            else:
                _json_numbers(v, out)
    elif isinstance(x, list):
        for v in x:
            _json_numbers(v, out)
    elif isinstance(x, str):
        out.extend(float(t) for t in re.findall(r"-?\d+(?:\.\d+)?", x))


_DURATION = re.compile(r"(?<![\w.])(\d+)(ms|s|m|h)(?![\w])")  # Prometheus' "2m", "10m", "4h", "30s"


def _literals(text: str) -> list[float]:
    """The numbers ``text`` (code, a config) holds as literals, and its duration strings in seconds."""
    out = []
    for tok in _LITERAL.findall(text):
        try:
            out.append(float(tok.replace("_", "")))
        except ValueError:
            pass
    per = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    out += [int(n) * per[u] for n, u in _DURATION.findall(text)]
    return out


@dataclass
class Source:
    label: str
    values: list[float]
    rounded: bool


def _sources(raw: str, root: Path) -> tuple[list[Source], list[str]]:
    """The sources a block names and what is wrong with any of them."""
    sources, errors = [], []
    for m in TEST.finditer(raw):
        for ref in (r.strip() for r in m["body"].split(",")):
            file, _, name = ref.partition("::")
            path = root / file
            if not file.startswith("tests/") or not path.is_file():
                errors.append(f"(test: {ref}): no such test file")
                continue
            text = path.read_text()
            base = name.split("[")[0].split("::")[-1]
            if base and not re.search(rf"^\s*(?:async\s+)?def {re.escape(base)}\(", text, re.M):
                errors.append(f"(test: {ref}): no test {base} in {file}")
                continue
            sources.append(Source(f"test {ref}", _literals(text), rounded=False))
    for m in RESULTS_MARK.finditer(raw):
        for part in m["body"].split(";"):
            r = RESULT.fullmatch(part.strip())
            if not r:
                errors.append(f"({part.strip()}): not `X.json, commit SHA, YYYY-MM-DD`")
                continue
            # a bare name is a results file; a path (moescope/assets/tiny-demo.json) is from the root
            path = root / r["file"] if "/" in r["file"] else root / "benchmarks" / "results" / r["file"]
            if not path.is_file():
                errors.append(f"{r['file']}: no such results file")
                continue
            d = json.loads(path.read_text())
            p = d.get("provenance") or {}
            if (p.get("commit"), str(p.get("date", ""))[:10]) != (r["commit"], r["date"]):
                errors.append(f"{r['file']} is cited at {r['commit']}, {r['date']}; the file was measured at "
                              f"{p.get('commit')}, {str(p.get('date', ''))[:10]} (read the claim again against it)")
                continue
            values: list[float] = []
            _json_numbers(d, values)
            sources.append(Source(r["file"], values, rounded=True))
    for m in LOG.finditer(raw):  # a run's log kept beside the results files (device-checks.log): its text
        path = root / m["body"]
        if not path.is_file():
            errors.append(f"(log: {m['body']}): no such file")
        else:
            sources.append(Source(m["body"], _literals(path.read_text()), rounded=False))
    for m in SET.finditer(raw):
        for ref in (r.strip() for r in m["body"].split(",")):
            path = root / ref
            if not path.is_file():
                errors.append(f"(set: {ref}): no such file")
                continue
            sources.append(Source(ref, _literals(path.read_text()), rounded=False))
    return sources, errors


def problems(root: Path = ROOT, pages: list[Path] | None = None) -> list[str]:
    """One line per figure without a source that holds it, and per marker naming what does not exist."""
    pages = pages if pages is not None else sorted((root / "docs").glob("*.md")) + [root / "README.md"]
    out = []
    for page in pages:
        rel = page.relative_to(root) if page.is_relative_to(root) else page
        text = page.read_text()
        for m in GENERATED.finditer(text):  # an exempt table names the code printing it and the test checking it
            test = root / m["test"]
            if not test.is_file() or m["func"].split(".")[-1].rstrip("()") not in test.read_text():
                out.append(f"{rel}: <!-- generated: {m['func']} ({m['test']} checks it) -->: that test does not "
                           "name that function")
        intro: list[Source] = []  # the sources of the paragraph introducing a list (ending in ":")
        parents: list[tuple[int, list[Source]]] = []  # (indent, sources) of the list items enclosing the next
        for block in blocks(text):
            figs = figures(page, block)
            # (a marker in `code` is an example of one, not a source)
            own, errors = _sources(re.sub(r"`[^`]*`", " ", "\n".join(line for _, line in block)), root)
            sources = own
            first = next((line for _, line in block if not line.lstrip().startswith("#")), "")
            if re.match(r"\s*(?:[-*+]|\d+\.)\s", first):  # a list item: its own, its parents' and the intro's
                indent = len(first) - len(first.lstrip())
                parents = [(i, s) for i, s in parents if i < indent]
                sources = own + [s for _, ss in parents for s in ss] + intro
                parents.append((indent, own))
            else:
                intro = own if block[-1][1].rstrip().endswith(":") else []
                parents = []
            out += [f"{rel}:{block[0][0]}: {e}" for e in errors]
            for f in figs:
                if not sources:
                    out.append(f"{rel}:{f.line}: {f.text!r} names no source (a test, a results file or the code "
                               "that sets it: benchmarks/_doc_claims.py)")
                elif not any(_held(s.values, f, rounded=s.rounded) for s in sources):
                    out.append(f"{rel}:{f.line}: {f.text!r} is not held by "
                               + ", ".join(s.label for s in sources))
    return out
