"""The docs run as tests (tests/doc_runner.py): each page's commands, in order, in a fresh HOME and folder, with
the outcome its text promises (exit code, the line it says appears, the file it says is written)."""

from __future__ import annotations

import time

import pytest
import yaml

import doc_runner
from doc_runner import ROOT, SPEC, Scratch, check, pair
from servers import free_port

# The pages a new user follows first; every ```sh block in them is run (or says why it cannot be, here).
PAGES = ("README.md", "docs/quickstart.md", "docs/serve.md", "docs/traces.md", "docs/runtime.md", "docs/views.md",
         "docs/vllm.md")


def test_every_page_has_its_entries_and_every_skip_says_why():
    doc = yaml.safe_load(SPEC.read_text())
    assert set(doc) == set(PAGES), set(doc) ^ set(PAGES)
    for page in PAGES:
        entries = pair(ROOT / page)  # the page's commands, one entry each, the same text
        assert entries, page
        for _, e in entries:
            assert e.skip is None or len(e.skip.split()) >= 4, f"{page}: {e.cmd}: a skip needs its reason"
    # most of what the pages tell a user to run does run
    ran = sum(e.skip is None for page in PAGES for _, e in pair(ROOT / page))
    assert ran >= 0.7 * sum(1 for page in PAGES for _ in pair(ROOT / page)), ran


def test_the_runner_reads_commands_as_a_shell_would(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("text\n```sh\n# a comment line\nmoescope demo --requests 2   # trailing comment\n"
                    "curl -s x \\\n     -d '{\"a\": \"#1\"}' | grep -i id\n\nprometheus &\n```\n"
                    "```python\nx = 1\n```\n")
    got = [(c.text, c.line) for c in doc_runner.commands(page)]
    assert got == [("moescope demo --requests 2", 4), ("curl -s x -d '{\"a\": \"#1\"}' | grep -i id", 5),
                   ("prometheus &", 8)]
    # a background command keeps its leading assignments in its environment (exec VAR=x cmd: not found)
    assert doc_runner._exec("A=1 B=/x.sqlite cmd --port 2") == "A=1 B=/x.sqlite exec cmd --port 2"


def _runs_here(e) -> bool:
    return e.skip is None and e.ran_in is None and not e.vllm  # (vLLM entries: tests/test_vllm_diagnose.py)


def test_a_command_another_page_runs_is_run_there_with_every_promise():
    entries = {page: [e for _, e in pair(ROOT / page)] for page in PAGES}
    assert doc_runner.ran_in_problems(entries) == []
    moved = [e for own in entries.values() for e in own if e.ran_in]
    assert moved  # (README's tour)
    # the check fails on a promise the other page drops, an order it changes, a command it does not run
    page, other = "README.md", moved[0].ran_in
    first = next(i for i, e in enumerate(entries[other]) if " ".join(e.cmd.split()) == " ".join(moved[0].cmd.split()))
    dropped = dict(entries, **{other: [*entries[other][:first], doc_runner.Entry(
        **{**vars(entries[other][first]), "out": []}), *entries[other][first + 1:]]})
    assert any("does not check out" in p for p in doc_runner.ran_in_problems(dropped))
    reordered = dict(entries, **{page: [moved[1], moved[0]]})
    assert any("after the previous one" in p for p in doc_runner.ran_in_problems(reordered))
    unrun = dict(entries, **{other: [e for e in entries[other] if e.cmd != entries[other][first].cmd]})
    assert doc_runner.ran_in_problems(unrun)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if any(_runs_here(e) for e in doc_runner.spec(p))])
def test_the_page_runs_as_written(page, tmp_path):
    scratch = Scratch(tmp_path, free_port)
    try:
        for c, e in pair(ROOT / page):
            if not _runs_here(e):
                continue
            for _attempt in range(e.retry + 1):
                run = scratch.run(c, e)
                problems = check(c, e, run, scratch)
                if not problems:
                    break
                time.sleep(0.5)
            assert not problems, "\n".join(problems)
    finally:
        scratch.stop()


def test_a_missing_promise_fails_the_page(tmp_path):
    """The runner's check: a line the text promises and the command does not print, another exit code, a file
    not written, a background server that never answers: each is a failure naming the command."""
    scratch = Scratch(tmp_path, free_port)
    try:
        said = doc_runner.Command("echo served 4/4 requests", 3)
        run = scratch.run(said, doc_runner.Entry(cmd=said.text))
        assert check(said, doc_runner.Entry(cmd=said.text, out=["served 4/4"]), run, scratch) == []
        broken = doc_runner.Entry(cmd=said.text, out=["served 8/8"], exit=1, files=["report/summary.md"])
        problems = check(said, broken, run, scratch)
        assert len(problems) == 3 and all(p.startswith("line 3: echo served 4/4 requests") for p in problems)
        quiet = doc_runner.Command("sleep 30 &", 5)
        with pytest.raises(AssertionError, match="never held"):
            scratch.run(quiet, doc_runner.Entry(cmd=quiet.text, until="false", timeout=1))
    finally:
        scratch.stop()


def test_what_the_alert_walkthrough_writes_in_the_checkout_is_ignored():
    """README's alert walkthrough, run from the repository root, leaves Prometheus' and Alertmanager's storage in
    ./data (their default --storage paths): git ignores it, so it never shows as a change to commit."""
    import shutil
    import subprocess

    from conftest import in_ci

    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        (pytest.fail if in_ci() else pytest.skip)("not a git checkout (CI runs on a clone)")
    for path in ("data/wal/00000000", "data/nflog", "data/silences", "build/vllm-env.log"):
        assert subprocess.run([git, "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path
