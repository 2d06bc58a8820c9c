"""`python benchmarks/_doc_tables.py --check`'s two checks beside the tables: every results file as fresh as the code
it measures, with its machine (benchmarks/_freshness.py, benchmarks/_measures.py), and every figure in the docs'
prose naming a source that holds it (benchmarks/_doc_claims.py).

The failing cases run on a copy of the repository (a temporary `git clone` of the committed HEAD, with commits made
in it): the check is the script as committed, run as `make test` runs it; its verdicts are checked against what
the test itself did to the copy (which commit changed which path), never against the check's own bookkeeping.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import _doc_claims  # noqa: E402
import _freshness  # noqa: E402
import _measures  # noqa: E402

MEASURED = "moescope/capture/routing_probe.py"  # overhead.json measures it (the capture path on the engine thread)
UNMEASURED = "moescope/tui/heatmap.py"  # a view: no serving figure depends on it
MACHINE = {"cores": 2, "cpu": "AMD EPYC 7B13", "load_average": [0.5, 0.6, 0.7]}


def _git(repo, *args) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


def _commit(repo, message: str) -> str:
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-a", "--allow-empty", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def _check(repo, only: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/_doc_tables.py", "--check", "--only", only], cwd=repo,
                          capture_output=True, text=True, timeout=300)


CHECKER = ("_doc_tables.py", "_freshness.py", "_measures.py", "_doc_claims.py", "_results.py")


@pytest.fixture
def clone(tmp_path):
    """A clone of the committed HEAD, with the checker as this working tree has it (committed in the clone)."""
    out = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(out)], check=True, timeout=120)
    for name in CHECKER:
        (out / "benchmarks" / name).write_bytes((ROOT / "benchmarks" / name).read_bytes())
    _git(out, "add", *(f"benchmarks/{n}" for n in CHECKER))
    _commit(out, "the checker as in the working tree")
    return out


@pytest.fixture
def repo(clone):
    """The clone holding one results file, overhead.json, measured at its HEAD on a machine with its CPU model and
    load recorded (the others removed: they are judged on main, not here)."""
    results = clone / "benchmarks" / "results"
    for path in results.glob("*.json"):
        path.unlink()
    head = _git(clone, "rev-parse", "--short", "HEAD")
    (results / "overhead.json").write_text(json.dumps(
        {"workloads": [], "provenance": {"commit": head, "date": "2026-12-07T00:00:00+00:00",
                                         "command": "benchmarks/overhead.py --rounds 9", "machine": MACHINE}}))
    _git(clone, "add", "-A", "benchmarks/results")
    _commit(clone, "results: overhead.json only")
    return clone


def _append(repo, path: str, text: str) -> None:
    with open(repo / path, "a") as f:
        f.write(text)


def test_the_table_names_what_each_published_results_file_measures():
    """Every results file names code it measures, and every path the table names exists (a renamed module would
    otherwise silently stop staling anything)."""
    files = [p.name for p in (ROOT / "benchmarks" / "results").glob("*.json") if not p.name.endswith("-quick.json")]
    assert [f for f in files if _measures.of(f) is None] == []
    specs = {s for specs in _measures.MEASURES.values() for s in specs if not s.startswith(":(")}
    missing = [s for s in sorted(specs) if not (ROOT / s).exists()]
    assert missing == []
    assert _measures.of("overhead-quick.json") == _measures.of("overhead.json")

    def covers(specs, path):
        return any(path == s or (s.endswith("/") and path.startswith(s)) for s in specs)

    assert covers(_measures.of("overhead.json"), MEASURED) and not covers(_measures.of("overhead.json"), UNMEASURED)


def test_results_files_are_fresh_and_say_their_machine():
    """On main: each results file was measured at a commit after which nothing it measures changed (or each change
    is behaviour-free), on a machine whose CPU model and load it records. The message lists each stale file, the
    commits and paths that stale it, and the command that re-runs it."""
    found = _freshness.problems()
    assert found == [], "\n".join(found)


def test_a_measured_module_changed_after_its_file_stales_it_until_declared(repo):
    assert _check(repo, "fresh").returncode == 0  # measured at HEAD: fresh
    _append(repo, UNMEASURED, "\n_UNUSED = 1\n")
    _commit(repo, "a view changes")
    assert _check(repo, "fresh").returncode == 0, _check(repo, "fresh").stderr  # not what overhead.json measures
    _append(repo, MEASURED, "\n# a comment: the syntax tree is the same\n")
    _commit(repo, "a comment")
    assert _check(repo, "fresh").returncode == 0  # proved behaviour-free
    _append(repo, MEASURED, "\n_CHANGED = 2\n")
    changed = _commit(repo, "the probe changes")
    run = _check(repo, "fresh")
    assert run.returncode == 1
    assert "overhead.json" in run.stderr and f"{changed[:7]}" in run.stderr and MEASURED in run.stderr, run.stderr
    assert "python benchmarks/overhead.py --rounds 9" in run.stderr  # how to re-run it
    # a later commit declares that one behaviour-free, with its reason: fresh again; a declaration naming another
    # path of it declares nothing
    _append(repo, UNMEASURED, "\n_AGAIN = 3\n")
    _commit(repo, f"review\n\nBehaviour-free: {changed[:9]} {UNMEASURED}: not the probe")
    assert _check(repo, "fresh").returncode == 1
    _append(repo, UNMEASURED, "\n_MORE = 4\n")
    _commit(repo, f"review\n\nBehaviour-free: {changed[:9]} {MEASURED}: a module constant nothing reads")
    assert _check(repo, "fresh").returncode == 0, _check(repo, "fresh").stderr
    listed = subprocess.run([sys.executable, "benchmarks/_doc_tables.py", "--declarations"], cwd=repo,
                            capture_output=True, text=True, check=True).stdout
    assert f"git show {changed[:7]} -- {MEASURED}" in listed and "a module constant nothing reads" in listed
    # a commit declaring itself
    _append(repo, MEASURED, "\n_SELF = 5\n")
    _commit(repo, f"probe\n\nBehaviour-free: {MEASURED}: another constant nothing reads")
    assert _check(repo, "fresh").returncode == 0


@pytest.mark.parametrize("lacks", ["load_average", "cpu"])
def test_a_file_without_its_load_or_cpu_fails(repo, lacks):
    path = repo / "benchmarks" / "results" / "overhead.json"
    d = json.loads(path.read_text())
    del d["provenance"]["machine"][lacks]
    path.write_text(json.dumps(d))
    run = _check(repo, "fresh")
    assert run.returncode == 1
    said = {"load_average": "the load average", "cpu": "the CPU model"}[lacks]
    assert "overhead.json" in run.stderr and f"lacks {said}" in run.stderr, run.stderr


def test_a_results_file_naming_no_code_fails(repo):
    (repo / "benchmarks" / "results" / "new-benchmark.json").write_text(json.dumps(
        {"provenance": {"commit": _git(repo, "rev-parse", "--short", "HEAD"), "machine": MACHINE}}))
    run = _check(repo, "fresh")
    assert run.returncode == 1 and "new-benchmark.json" in run.stderr and "names no code" in run.stderr


# --- figures in the docs' prose --------------------------------------------------------------------------------

def test_every_figure_in_the_docs_names_a_source_that_holds_it():
    found = _doc_claims.problems()
    assert found == [], "\n".join(found)


def _lint(tmp_path, text: str) -> list[str]:
    page = tmp_path / "page.md"
    page.write_text(text)
    return _doc_claims.problems(ROOT, [page])


def test_an_invented_time_bound_fails(clone):
    """"within 2 s" added to a docs page of the copy: `--check --only claims` fails naming that line, which it did
    not name before (whatever else the copy's pages hold: tests/test_doc_checks.py's own test judges main)."""
    page = clone / "docs" / "traces.md"
    text = page.read_text() + "\nA request's row is written within 2 s of its end.\n"
    said = f"docs/traces.md:{len(text.splitlines())}: '2 s' names no source"
    assert said not in _check(clone, "claims").stderr
    page.write_text(text)
    run = _check(clone, "claims")
    assert run.returncode == 1 and said in run.stderr, run.stderr


def test_each_kind_of_source_is_checked_against_what_it_holds(tmp_path):
    vllm = json.loads((ROOT / "benchmarks" / "results" / "efficiency-vllm.json").read_text())["provenance"]
    cite = f"efficiency-vllm.json, commit {vllm['commit']}, {vllm['date'][:10]}"
    assert _lint(tmp_path, "No source: within a second, and 2 s.\n") and len(
        _lint(tmp_path, "No source: within a second, and 2 s.\n")) == 2
    # a test that exists and holds the figure; one that does not hold it; one that does not exist
    assert _lint(tmp_path, "Waits up to 120 s (test: tests/test_vllm_diagnose.py::test_every_returned_id_opens_or_is"
                           "_reported_not_kept).\n") == []
    assert _lint(tmp_path, "Waits 7.25 s (test: tests/test_vllm_diagnose.py::test_every_returned_id_opens_or_is"
                           "_reported_not_kept).\n")
    assert _lint(tmp_path, "Waits 120 s (test: tests/test_vllm_diagnose.py::test_no_such_test).\n")
    # a results file at its own commit and date, holding the figure (a share, to the decimals printed): passes;
    # a figure it does not hold, or a citation of another commit: fails
    share = json.loads((ROOT / "benchmarks" / "results" / "efficiency-vllm.json").read_text())["vllm"]
    assert _lint(tmp_path, f"The plugin took {round(100 * share['capture_share_of_step'], 2)}% ({cite}).\n") == []
    assert _lint(tmp_path, f"The plugin took 97.531% ({cite}).\n")
    assert _lint(tmp_path, f"The plugin took 1% (efficiency-vllm.json, commit 0000000, {vllm['date'][:10]}).\n")
    # a setting: the literal in the named code
    assert _lint(tmp_path, "Every 0.5 s (set: moescope/traces/recorder.py).\n") == []
    assert _lint(tmp_path, "Every 0.123 s (set: moescope/traces/recorder.py).\n")
    # exempt: code, generated tables, and a multiplication is not a ratio
    assert _lint(tmp_path, "Run `sleep 2s`; a 58 x 256 grid.\n\n<!-- table: x -->\n3 s\n<!-- /table -->\n") == []
