"""Whether every results file is as fresh as the code it measures, and says on what machine it ran.

A results file (benchmarks/results/*.json) is measured at one commit: its provenance's ``commit``. It is stale when
a path it measures (benchmarks/_measures.py, and the ``measures`` its own provenance records) differs between that
commit and HEAD, unless every commit that changed that path since is behaviour-free for it, which is either

- proved: the path is Python whose syntax tree, docstrings left out, is the same before and after the commit (a
  comment, a docstring, a reflow), or YAML/JSON that parses to the same data; or
- declared, in a commit message, by a line a reviewer reads beside the diff it speaks for::

      Behaviour-free: moescope/capture/routing_probe.py: renamed a local; the summary's arithmetic is untouched
      Behaviour-free: 5380b7e moescope/vllm/plugin.py, moescope/vllm/capture.py: imports reordered, nothing else

  The first form declares the commit it is in; the second names an earlier commit (a declaration made in review,
  after the fact). Paths are exact file paths; the reason is required. ``python benchmarks/_doc_tables.py
  --declarations`` lists every declaration with the command that shows the diff it covers.

A file is also incomplete when its provenance lacks the CPU model or the load average (a figure from an unknown
machine under an unknown load cannot be compared): it must be re-run, never filled in by hand.

``problems()`` returns one line per stale or incomplete file, naming each change (commit, path) and the command
that re-runs it; benchmarks/_measures.py ``KNOWN_STALE`` lists the files that cannot be re-run here, which pass
only while their notice is printed beside their figures (``notice()``, used by benchmarks/_doc_tables.py), and
``SELF_MEASURED`` the suite's own time, which the run recording it cannot find fresh (not failed on).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import _measures

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "benchmarks/results"
TRAILER = re.compile(r"^Behaviour-free:\s*(?:(?P<sha>[0-9a-f]{7,40})\s+)?(?P<paths>[^\s:][^:]*?):\s*(?P<reason>\S.*)$",
                     re.M)


def _git(root: Path, *args: str, check: bool = True) -> str | None:
    run = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if run.returncode != 0:
        if check:
            raise RuntimeError(f"git {' '.join(args)}: {run.stderr.strip()}")
        return None
    return run.stdout


_CAT: dict[Path, subprocess.Popen] = {}  # one `git cat-file --batch` per repository: thousands of blobs, one process


@functools.lru_cache(maxsize=None)
def _show(root: Path, rev: str, path: str) -> bytes | None:
    """The bytes of ``path`` at ``rev`` (None where it does not exist there)."""
    cat = _CAT.get(root)
    if cat is None or cat.poll() is not None:
        cat = _CAT[root] = subprocess.Popen(["git", "cat-file", "--batch"], cwd=root, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE)
    cat.stdin.write(f"{rev}:{path}\n".encode())
    cat.stdin.flush()
    header = cat.stdout.readline().split()
    if len(header) != 3 or header[1] != b"blob":  # "<rev:path> missing" (or a tree): nothing there
        return None
    data = cat.stdout.read(int(header[2]))
    cat.stdout.read(1)  # the newline after the object
    return data


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


@functools.lru_cache(maxsize=None)
def _meaning_at(root: Path, rev: str, path: str):
    """``_meaning`` of ``path`` at ``rev``, computed once per (revision, path), and once per content: many files
    judge the same ones, and consecutive commits share most of their blobs (parsing is most of the check's time)."""
    data = _show(root, rev, path)
    return _meaning_of(path.rsplit(".", 1)[-1], hashlib.sha1(data).digest() if data is not None else None, data)


@functools.lru_cache(maxsize=None)
def _meaning_of(suffix: str, digest: bytes | None, data: bytes | None):
    """``_meaning`` keyed by the file's kind and content digest (``data`` rides along, equal for equal digests)."""
    return _meaning("x." + suffix, data)


def _meaning(path: str, data: bytes | None):
    """What of ``data`` can change behaviour: a Python module's syntax tree without docstrings, a YAML or JSON
    file's data; None where that cannot be told (other files, unparsable text)."""
    if data is None or not path.endswith((".py", ".yml", ".yaml", ".json")):
        return None
    try:
        text = data.decode()
        if path.endswith(".py"):
            return ast.dump(_strip_docstrings(ast.parse(text)), include_attributes=False)
        if path.endswith((".yml", ".yaml")):
            import yaml  # optional: the check's own dependency, the project's test extra

            return json.dumps(yaml.safe_load(text), sort_keys=True)
        if path.endswith(".json"):
            return json.dumps(json.loads(text), sort_keys=True)
    except (SyntaxError, ValueError, ImportError):  # (UnicodeDecodeError is a ValueError)
        return None
    except Exception:  # noqa: BLE001 (yaml's own errors: unparsable, so not proved)
        return None
    return None


@functools.lru_cache(maxsize=None)
def proved_same(root: Path, before: str, after: str, path: str) -> bool:
    """Whether ``path`` means the same at ``before`` and ``after`` (``_meaning``), so a change between cannot change
    a figure."""
    a, b = _show(root, before, path), _show(root, after, path)
    if a is not None and a == b:
        return True
    a = _meaning_at(root, before, path)
    return a is not None and a == _meaning_at(root, after, path)


@dataclass(frozen=True)
class Declaration:
    commit: str        # the commit declared behaviour-free (full sha)
    path: str
    reason: str
    declared_in: str   # the commit whose message holds the line (full sha)


def declarations(root: Path = ROOT) -> dict[tuple[str, str], Declaration]:
    """Every ``Behaviour-free:`` line in the history of HEAD, keyed by (declared commit, path)."""
    out: dict[tuple[str, str], Declaration] = {}
    log = _git(root, "log", "--format=%H%x1f%B%x1e", "-E", "--grep=^Behaviour-free:", "HEAD") or ""
    for entry in log.split("\x1e"):
        if "\x1f" not in entry:
            continue
        sha, body = entry.strip().split("\x1f", 1)
        for m in TRAILER.finditer(body):
            target = sha
            if m["sha"]:
                target = (_git(root, "rev-parse", "--verify", "--quiet", f"{m['sha']}^{{commit}}", check=False)
                          or "").strip()
                if not target:
                    continue  # names no commit of this history: declares nothing
            for path in (p.strip() for p in m["paths"].split(",")):
                out[(target, path)] = Declaration(target, path, m["reason"].strip(), sha)
    return out


@dataclass(frozen=True)
class Change:
    commit: str
    subject: str
    path: str


def stale_changes(root: Path, commit: str, specs: tuple[str, ...],
                  declared: dict[tuple[str, str], Declaration]) -> list[Change]:
    """The changes to ``specs`` between ``commit`` and HEAD that are neither proved nor declared behaviour-free."""
    differ = [p for p in (_git(root, "diff", "--name-only", commit, "HEAD", "--", *specs) or "").split()
              if not proved_same(root, commit, "HEAD", p)]  # (changed and back, or only comments, over the range)
    if not differ:
        return []
    log = _git(root, "log", "--full-history", "--no-merges", "--format=%x00%H%x1f%s", "--name-only",
               f"{commit}..HEAD", "--", *differ) or ""
    out = []
    for entry in log.split("\x00")[1:]:
        head, _, names = entry.partition("\n")
        sha, subject = head.split("\x1f", 1)
        for path in names.split():
            if path in differ and (sha, path) not in declared and not proved_same(root, f"{sha}^", sha, path):
                out.append(Change(sha, subject, path))
    return out


def machine_gaps(provenance: dict) -> list[str]:
    """What the provenance's machine lacks of what a figure needs beside it: the CPU model, the load average."""
    m = provenance.get("machine")
    m = m if isinstance(m, dict) else {}
    return [what for what, key in (("the CPU model", "cpu"), ("the load average", "load_average")) if not m.get(key)]


def measured(name: str, provenance: dict) -> tuple[str, ...] | None:
    """The pathspecs a results file measures: its provenance's own list and benchmarks/_measures.py's, both."""
    table = _measures.of(name)
    own = tuple(provenance.get("measures") or ())
    if table is None and not own:
        return None
    return tuple(dict.fromkeys((*own, *(table or ()))))


@dataclass(frozen=True)
class Verdict:
    name: str
    commit: str | None
    date: str | None
    command: str | None
    changes: tuple[Change, ...] = ()
    gaps: tuple[str, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return not (self.changes or self.gaps or self.error)


def judge(root: Path, path: Path, declared: dict[tuple[str, str], Declaration]) -> Verdict:
    d = json.loads(path.read_text())
    p = (d.get("provenance") if isinstance(d, dict) else None) or {}
    base = {"name": path.name, "commit": p.get("commit"), "date": p.get("date"), "command": p.get("command")}
    specs = measured(path.name, p)
    if specs is None:
        return Verdict(**base, error="names no code it measures (add it to benchmarks/_measures.py MEASURES)")
    if not p.get("commit") or _git(root, "cat-file", "-e", f"{p['commit']}^{{commit}}", check=False) is None:
        return Verdict(**base, error=f"its commit {p.get('commit')!r} is not in this repository's history")
    return Verdict(**base, changes=tuple(stale_changes(root, p["commit"], specs, declared)),
                   gaps=tuple(machine_gaps(p)))


def verdicts(root: Path = ROOT) -> list[Verdict]:
    declared = declarations(root)
    files = sorted(p for p in (root / RESULTS).glob("*.json") if not p.name.endswith("-quick.json"))
    return [judge(root, p, declared) for p in files]


def _rerun(v: Verdict) -> str:
    cmd = v.command or "?"
    return f"python {cmd}" if cmd.split()[0].endswith(".py") else cmd


def describe(v: Verdict) -> str:
    """One line: what is wrong with the file and how to make it right."""
    why = []
    if v.error:
        why.append(v.error)
    if v.changes:
        by_commit: dict[str, list[str]] = {}
        subjects = {}
        for c in v.changes:
            by_commit.setdefault(c.commit, []).append(c.path)
            subjects[c.commit] = c.subject
        why.append("measured code changed since: " + "; ".join(
            f"{sha[:7]} ({subjects[sha][:60]}): {', '.join(paths)}" for sha, paths in by_commit.items()))
    if v.gaps:
        why.append(f"its provenance lacks {' and '.join(v.gaps)}")
    return (f"{v.name} (measured at {v.commit}, {(v.date or '?')[:10]}): {' / '.join(why)}. Re-run: `{_rerun(v)}`"
            + (", or declare the changes behaviour-free (benchmarks/_freshness.py)" if v.changes and not v.gaps
               else ""))


def notice(v: Verdict) -> str | None:
    """What the docs print beside a KNOWN_STALE file's figures (None for any other file, or a fresh one). It names
    no commit, so that a later change does not make every page printing it out of date: ``--check --only fresh``
    lists the changes."""
    if v.name not in _measures.KNOWN_STALE or v.ok:
        return None
    said = ["the code it measures changed since it ran"] if v.changes else []
    if v.gaps:
        said.append(f"it lacks {' and '.join(v.gaps)}")
    return f"Stale, not re-run: {'; '.join(said)}; it {_measures.KNOWN_STALE[v.name]}."


def problems(root: Path = ROOT) -> list[str]:
    """One line per results file that fails: stale, without its machine, naming no code, or listed as known stale
    while it is not."""
    out = []
    for v in verdicts(root):
        if v.name in _measures.SELF_MEASURED and not v.error:  # (listed by --check's notes, never failed)
            continue
        if v.name in _measures.KNOWN_STALE:
            if v.ok:
                out.append(f"{v.name} is fresh and complete: remove it from benchmarks/_measures.py KNOWN_STALE")
            elif v.error:
                out.append(describe(v))
            continue
        if not v.ok:
            out.append(describe(v))
    return out


def declaration_lines(root: Path = ROOT) -> list[str]:
    """Each declaration, with the command that shows the diff it speaks for (for a reviewer), and whether that
    commit changed the path at all."""
    lines = []
    for (sha, path), d in sorted(declarations(root).items(), key=lambda kv: kv[0]):
        touched = path in (_git(root, "show", "--format=", "--name-only", sha) or "").split()
        where = "" if d.declared_in == sha else f" (declared in {d.declared_in[:7]})"
        lines.append(f"{sha[:7]} {path}: {d.reason}{where} -- `git show {sha[:7]} -- {path}`"
                     + ("" if touched else "  [that commit did not change this path: the line declares nothing]"))
    return lines
