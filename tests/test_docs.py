"""Docs stay in step with the code: every catalogue metric is documented, the README stays a front page, the
site builds strict and every documented `moescope` command names real options (the pages themselves run in
tests/test_doc_runner.py)."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT
from moescope.metrics import catalogue

README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 150


def test_metrics_doc_names_every_catalogue_metric():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    missing = [m.name for m in catalogue.CATALOGUE if f"`{m.name}`" not in doc]
    assert not missing, missing


# --- the README as a front page, and the site ---------------------------------------------------------------

def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, len(text.splitlines())
    # The two set-up commands are Makefile targets, and every docs page is one link away.
    assert "make demo" in text and "make test" in text
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", text))
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages <= linked, sorted(pages - linked)
    for page in linked:
        assert (DOCS / page).is_file(), page


def test_every_docs_page_is_in_the_nav():
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(cfg["nav"])
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(nav) == pages, (nav, pages)


@pytest.mark.slow
def test_site_builds_strict(tmp_path):
    # Not --quiet: mkdocs 1.6 counts warnings for --strict only at the default log level, so `--quiet`
    # lets a broken link or anchor through.
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "WARNING" not in run.stderr, run.stderr[-3000:]
    assert (tmp_path / "site" / "quickstart" / "index.html").is_file()


# --- documented commands --------------------------------------------------------------------------------------

def _shell_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, re.S)


def _commands(block: str) -> list[list[str]]:
    """Each `moescope ...` command line of a shell block, as argv after `moescope` (comments, a trailing `&`
    and line continuations handled)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words and words[-1] == "&":
            words = words[:-1]
        if words and words[0] in (".venv/bin/moescope", "moescope"):
            out.append(words[1:])
    return out


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in [README, *sorted(DOCS.glob("*.md"))]:
        for block in _shell_blocks(path.read_text()):
            found += [(path.name, argv) for argv in _commands(block)]
    return found


def _resolve(argv: list[str]):
    """The click command argv names, and the rest of argv."""
    import click

    from moescope.cli import cli

    cmd, rest = cli, list(argv)
    while isinstance(cmd, click.Group) and rest and not rest[0].startswith("-"):
        sub = cmd.get_command(click.Context(cmd), rest[0])
        assert sub is not None, f"no command {rest[0]!r} under {cmd.name!r}"
        cmd, rest = sub, rest[1:]
    return cmd, rest


def test_docs_document_moescope_commands():
    found = documented_commands()
    assert len(found) >= 40, len(found)
    assert {argv[0] for _, argv in found} >= {"demo", "serve", "top", "requests", "trace", "diagnose", "report",
                                              "alerts", "dashboards", "cache-sim", "plan-placement", "check"}


@pytest.mark.parametrize("where,argv", documented_commands(), ids=lambda x: x if isinstance(x, str) else None)
def test_documented_command_uses_real_options(where, argv):
    """Every documented command names a real subcommand, only options that subcommand accepts, and values its
    choices and number ranges accept (paths and free text are the reader's)."""
    import click

    cmd, rest = _resolve(argv)
    shown = f"{where}: `moescope {' '.join(argv)}`"
    assert not isinstance(cmd, click.Group), f"{shown} names a group, not a command"
    options = {o: p for p in cmd.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}
    checked = (click.Choice, click.types._NumberParamTypeBase)
    i = 0
    while i < len(rest):
        word = rest[i]
        if word.startswith("--") or (word.startswith("-") and len(word) == 2 and not word[1].isdigit()):
            name, eq, value = word.partition("=")
            assert name in options, f"{shown}: {name} is not an option of `{cmd.name}`"
            opt = options[name]
            if not (opt.is_flag or opt.count):
                if not eq:
                    i += 1
                    assert i < len(rest), f"{shown}: {name} needs a value"
                    value = rest[i]
                if isinstance(opt.type, checked) and not value.startswith("$"):
                    try:
                        opt.type.convert(value, opt, None)
                    except click.BadParameter as exc:
                        raise AssertionError(f"{shown}: {name} {value}: {exc.format_message()}") from None
        i += 1


# --- the README's five-minute tour, run as written ---------------------------------------------------------------

def test_quickstart_python_block_runs_as_written(tmp_path):
    """The quickstart's "In Python" block, pasted into a fresh interpreter in an empty folder with a fresh HOME:
    it defines what it uses, serves its requests and leaves them in the trace store it names."""
    text = (DOCS / "quickstart.md").read_text()
    block = re.search(r"```python\n(.*?)```", text[text.index("### In Python"):], re.S).group(1)
    env = {**os.environ, "HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "data")}
    env.pop("MOESCOPE_TRACES", None)
    run = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    from moescope.traces import store

    ids = [line.split()[0] for line in run.stdout.splitlines() if not line.startswith("metrics on")]
    assert len(ids) == 8 and run.stdout.startswith("metrics on http://127.0.0.1:"), run.stdout
    stored = {r.request_id for r in store.list_requests(store.open_store(tmp_path / "traces.sqlite"), limit=100)}
    assert stored == set(ids)


def test_docs_tables_are_printed_from_their_results_files():
    """Every `<!-- table: benchmarks/X.py --markdown RESULTS -->` block holds exactly what that command prints and
    the provenance line of its results file; a `<!-- figures: -->` (hand-typed) table fails the check."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _doc_tables as doc_tables

    found = [m for p in doc_tables.pages() for m in doc_tables.blocks(p.read_text())]
    assert found, "no generated tables in the docs"
    # Each block ends with its results file's provenance line; no hand-typed figure table is left.
    unsourced = [m.group("cmd") for m in found if not m.group("body").rstrip("\n").splitlines()[-1].startswith(
        ("Provenance: commit", "Provenance (not recorded by the run; reconstructed from"))]
    assert not unsourced, unsourced
    assert not [p.name for p in doc_tables.pages() if doc_tables.HAND_TYPED in p.read_text()]
    # (the check's other parts, fresh results files and sourced figures: tests/test_doc_checks.py)
    run = subprocess.run([sys.executable, "benchmarks/_doc_tables.py", "--check", "--only", "tables"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_every_results_file_says_how_it_was_made():
    """Every benchmarks/results/*.json carries its provenance: the commit, the exact command, the date and the
    machine (benchmarks/_results.py save(); for a file from before runs recorded it, reconstructed from what its run
    did record, marked `reconstructed` with what it was reconstructed from and, for the commit, how sure). Where the
    report itself recorded the commit its run started at, the provenance names that commit (not one made while it
    ran)."""
    missing = {}
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        d = json.loads(path.read_text())
        p = d.get("provenance") or {}
        lacks = [k for k in ("commit", "command", "date", "machine") if not p.get(k)]
        if d.get("commit") and p.get("commit") != d["commit"]:  # the run's own record of HEAD at its start
            lacks.append(f"commit: the run started at {d['commit']}, the provenance names {p.get('commit')}")
        if p.get("reconstructed") and not p.get("commit_basis"):
            lacks.append("commit_basis")
        if lacks:
            missing[path.name] = lacks
    assert not missing, missing


def test_gpu_statements_quote_the_device_log():
    """What the docs say ran on a GPU is what benchmarks/results/device-checks.log shows: each call's pytest
    summary and each error the log holds are quoted in docs/runtime.md, and no page claims more ("every test
    passed") than the log does. The log is the reference: the docs are checked against it, never the reverse."""
    log = (ROOT / "benchmarks" / "results" / "device-checks.log").read_text()
    runtime = " ".join((DOCS / "runtime.md").read_text().split())  # wrapped lines read as one
    summaries = re.findall(r"^(\d+ (?:passed|failed)(?:, \d+ \w+)*) in [\d.]+s", log, re.M)
    errors = re.findall(r"^(?:E\s+)?(?:\w+: )?(\w*[Ee]rror: .+)$", log, re.M)
    errors = [e for e in errors if not e.startswith("AssertionError")]  # pytest's wrapper of the TypeError below
    assert summaries and errors, "the log no longer has the shape this test reads"
    unquoted = [s for s in summaries if f"`{s}" not in runtime]
    unquoted += [e for e in errors if " ".join(e.split()[:6]) not in runtime]
    assert not unquoted, f"device-checks.log lines the docs do not quote: {unquoted}"
    failed = sum(int(n) for n in re.findall(r"(\d+) failed", " ".join(summaries)))
    for page in [README, *DOCS.glob("*.md")]:
        text = " ".join(page.read_text().split())
        assert not (failed and re.search(r"every `-m gpu` test passed|gpu`-marked tests passed", text)), page


def test_the_docs_count_the_alert_rules_that_are_generated():
    """"N alerts" / "N rules" in the docs is the number of alerts in the generated rules file (design.md said 16
    while there were 18)."""
    generated = len(re.findall(r"^\s*- alert: ", (ROOT / "collectors" / "prometheus" / "moescope-rules.yml")
                               .read_text(), re.M))
    counted = re.compile(r"\b(\d+) (?:alerts|rules|alert rules),? (?:generated|from one source)")
    said = {(p.name, int(n)) for p in [README, *DOCS.glob("*.md")]
            for n in counted.findall(" ".join(p.read_text().split()))}
    assert said, "the docs no longer count the rules"
    assert {n for _, n in said} == {generated}, (said, generated)


def test_the_benchmarks_page_names_every_benchmark_and_results_file():
    """docs/benchmarks.md's table lists every benchmarks/*.py and names every results file it writes that the docs
    quote (a `*` in a name covers a family: `detection-shapes-*.json`)."""
    import fnmatch

    rows = [line for line in (DOCS / "benchmarks.md").read_text().splitlines() if line.startswith("| `benchmarks/")]
    listed = {re.match(r"\| `benchmarks/(\w+)\.py`", line).group(1) for line in rows}
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    assert scripts <= listed, sorted(scripts - listed)
    named = set(re.findall(r"`([\w*.-]+\.json)`", "\n".join(rows)))
    named |= set(re.findall(r"`[^`]*benchmarks/results/([\w.-]+\.json)[^`]*`", (DOCS / "benchmarks.md").read_text()))
    # (a --quick run's NAME-quick.json is scratch, git-ignored: the suite's own quick runs write them beside)
    files = [p.name for p in (ROOT / "benchmarks" / "results").glob("*.json") if not p.name.endswith("-quick.json")]
    unnamed = [f for f in files if not any(fnmatch.fnmatch(f, n) for n in named)]
    assert not unnamed, unnamed


def test_precise_prose_figures_come_from_a_results_file():
    """A figure written with three or more decimals in the docs' prose (outside the printed tables and code) is a
    value some benchmarks/results/*.json holds (or the demo model's asset), or a bar the generated alert rules'
    promtool cases hold (their bar series): a measured figure with no file behind it (the EPLB prose's 1.289 and
    1.176 were) fails here."""
    values: set[str] = set()

    def walk(x):
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            values.add(repr(float(x)))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, str):
            values.update(repr(float(m)) for m in re.findall(r"-?\d+\.\d+", x))

    for path in [*(ROOT / "benchmarks" / "results").glob("*.json"), ROOT / "moescope" / "assets" / "tiny-demo.json"]:
        walk(json.loads(path.read_text()))
    # the bars: the rules compare with bar series, which their promtool cases feed (Thresholds.bars' values)
    rules = set(re.findall(r"\d+\.\d+", "".join((ROOT / "collectors" / "prometheus" / name).read_text() for name in (
        "moescope-rules.yml", "tests/moescope-rules.test.yml"))))
    held = [float(v) for v in values]

    def found(tok: str) -> bool:
        d = len(tok.split(".")[1])
        return tok in rules or any(round(v, d) == float(tok) for v in held)

    unsourced = {}
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        text = re.sub(r"<!-- table:.*?<!-- /table -->", "", page.read_text(), flags=re.S)
        text = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))
        missing = sorted({t for t in re.findall(r"(?<![\w.])(\d+\.\d{3,})(?![\w.])", text) if not found(t)})
        if missing:
            unsourced[page.name] = missing
    assert not unsourced, unsourced
