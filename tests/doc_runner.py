"""The docs as tests: every shell command a page tells a user to run, run as written, its promised outcome checked.

``tests/doc_runs.yml`` holds, per page, one entry per command in the page's ```sh blocks, in order, matched by
its exact text (continuation lines joined, the trailing ``# comment`` left out): a page whose commands change
fails until its entries follow. An entry either runs (``exit``, ``out``, ``files``: what the text promises) or is
skipped with the reason it cannot run here (``skip``). What the runner changes, and only that:

- every page runs in a scratch folder of its own with a fresh ``HOME`` (so the default trace store is new), the
  checkout's ``.venv`` and ``tests/`` linked in, ``.venv/bin`` first on ``PATH`` (pages write both
  ``.venv/bin/moescope`` and ``moescope``), and a copy of ``collectors/`` and ``dashboards/`` (the repository
  files commands name and write);
- ports: the well-known ones pages use (8000, 9090, 9093, 9400-9403) are replaced by free ones, in commands and
  in the copied collectors' configs (tests run side by side); ``{9400}`` etc. in an entry's ``append`` is the
  replacement;
- ``append``: arguments added at the end (click takes the last of a repeated option): documented flags that make
  a long run short (``--requests``, ``--duration``) or a terminal view print once (``--once``, ``--plain``);
- ``replace``: placeholders a user fills in (``<request-id>``), with a shell expression of what they would paste;
- ``ran_in``: a command another page runs in the same order with every promise of this one (README's tour is the
  quickstart's) is run there only;
- a command ending in ``&`` runs in the background (``until``: a shell test polled until it holds, e.g. the
  server answering) and is stopped when the page ends.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "tests" / "doc_runs.yml"
WELL_KNOWN = (8000, 9090, 9093, 9400, 9401, 9402, 9403)


@dataclass
class Command:
    text: str  # as the page writes it (joined, comment left out)
    line: int  # where it starts in the page


@dataclass
class Entry:
    cmd: str
    skip: str | None = None
    append: str = ""
    replace: dict = field(default_factory=dict)  # values may hold {name}: a value an earlier entry captured
    capture: dict = field(default_factory=dict)  # name -> regular expression: its first group in this output
    exit: int = 0
    out: list = field(default_factory=list)  # regular expressions, each must match stdout + stderr
    files: list = field(default_factory=list)  # paths (relative to the scratch folder) that must exist after
    until: str | None = None  # background: a shell test polled until it holds
    wait: bool = False  # first wait for the page's background demos (finite runs) to end
    background: bool = False  # a server the page runs in the foreground: here in the background, ``until`` its
    # promise holds (e.g. it answers), stopped at the page's end
    start: dict | None = None  # {cmd, until}: what the page presupposes running (a demo for `top` to watch),
    # started in the background first and stopped at the page's end
    stop: bool = False  # first stop the page's background processes (a server whose ports the next one takes)
    retry: int = 0  # run again (0.5 s apart) up to this many times until it keeps its promise (a store commits
    # every 0.5 s: a request just answered may not be readable yet)
    timeout: float = 300
    ran_in: str | None = None  # another page whose entry of the same text runs it, keeping every promise of this
    # one (tests/test_doc_runner.py checks both): a page that repeats another's commands does not run them twice
    vllm: bool = False  # needs the vLLM environment (.vllm/) and a local checkpoint: run only by the vLLM pass
    # (tests/test_vllm_diagnose.py), which captures {vllm_launcher}: the CPU build's server command for a checkpoint


def commands(page: Path) -> list[Command]:
    """The commands of a page's ```sh blocks: continuation lines joined, full-line comments and trailing
    ``# comments`` left out (a ``#`` inside quotes is kept)."""
    out: list[Command] = []
    in_block, pending, start = False, "", 0
    for n, raw in enumerate(page.read_text().splitlines(), 1):
        if raw.startswith("```"):
            in_block = raw.strip() == "```sh"
            continue
        if not in_block:
            continue
        line = _strip_comment(raw).rstrip()
        if not pending:
            start = n
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        text = (pending + line.strip()).strip()
        pending = ""
        if text:
            out.append(Command(" ".join(text.split()), start))
    return out


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _top_level_pipe(text: str) -> int | None:
    """Where a pipeline's first ``|`` is, outside quotes and ``$( )``; None for a single command."""
    quote, depth = None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif text.startswith("$(", i):
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
        elif ch == "|" and not depth and not text.startswith("||", i) and text[i - 1] != "|":
            return i
    return None


_ASSIGNMENTS = re.compile(r"((?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*)(.*)", re.S)


def _exec(text: str) -> str:
    """``text`` run by ``exec`` (the shell becomes the command: stopping it stops the command), its leading
    ``VAR=value`` assignments kept before ``exec`` (``exec VAR=value cmd`` is "command not found")."""
    assigns, rest = _ASSIGNMENTS.fullmatch(text.strip()).groups()
    return f"{assigns}exec {rest}"


def spec(page: str) -> list[Entry]:
    doc = yaml.safe_load(SPEC.read_text())
    return [Entry(**e) for e in doc[page]]


def pair(page: Path) -> list[tuple[Command, Entry]]:
    """The page's commands with their entries; a mismatch is an AssertionError naming the first difference."""
    cmds, entries = commands(page), spec(page.relative_to(ROOT).as_posix())
    for i, (c, e) in enumerate(zip(cmds, entries)):
        assert c.text == " ".join(e.cmd.split()), (
            f"{page.name}:{c.line}: the page's command #{i + 1} is\n  {c.text}\nbut tests/doc_runs.yml expects\n"
            f"  {e.cmd}\n(a changed page: update its entry, with what the text now promises)")
    assert len(cmds) == len(entries), (f"{page.name}: {len(cmds)} commands, {len(entries)} entries in "
                                      "tests/doc_runs.yml: " + "; ".join(c.text for c in cmds[len(entries):]
                                                                           or [e.cmd for e in entries[len(cmds):]]))
    return list(zip(cmds, entries))


# What an entry run on another page must keep exactly as its own page writes it (``out`` and ``files`` may grow)
_KEPT = ("append", "replace", "capture", "exit", "until", "wait", "background", "start", "stop", "retry", "timeout")


def ran_in_problems(entries: dict[str, list[Entry]]) -> list[str]:
    """For every entry with ``ran_in``: the page it names must run an entry of the same command text that keeps
    each of its promises (``_KEPT`` equal; every ``out`` line and file among the other's), and a page's
    ``ran_in`` entries must come in the same order there (a command reads what an earlier one wrote).
    ``entries``: page -> its entries (``spec``). Returns the problems, one line each."""
    problems = []
    for page, own in entries.items():
        at: dict[str, int] = {}  # per other page: where the last matched entry was
        for e in own:
            if not e.ran_in:
                continue
            theirs = entries.get(e.ran_in)
            if theirs is None:
                problems.append(f"{page}: {e.cmd}: ran_in names {e.ran_in}, which has no entries")
                continue
            text = " ".join(e.cmd.split())
            after = at.get(e.ran_in, -1)
            i = next((i for i, t in enumerate(theirs) if i > after and " ".join(t.cmd.split()) == text), None)
            if i is None:
                problems.append(f"{page}: {e.cmd}: not among {e.ran_in}'s commands after the previous one")
                continue
            at[e.ran_in] = i
            t = theirs[i]
            if t.skip or t.ran_in:
                problems.append(f"{page}: {e.cmd}: {e.ran_in} does not run it either")
            problems += [f"{page}: {e.cmd}: {k} is {getattr(e, k)!r} here, {getattr(t, k)!r} in {e.ran_in}"
                         for k in _KEPT if getattr(e, k) != getattr(t, k)]
            problems += [f"{page}: {e.cmd}: {e.ran_in} does not check {k} {x!r}"
                         for k in ("out", "files") for x in getattr(e, k) if x not in getattr(t, k)]
    return problems


class Scratch:
    """A page's folder, HOME, ports and background processes."""

    def __init__(self, base: Path, free_port) -> None:
        self.dir = base
        self.home = base / "home"
        self.home.mkdir(parents=True)
        (base / ".venv").symlink_to(ROOT / ".venv")
        (base / "tests").symlink_to(ROOT / "tests")  # scripts a page runs (read only: nothing writes there)
        block = free_port(4)
        self.ports = {8000: free_port(), 9090: free_port(), 9093: free_port(),
                      **{9400 + i: block + i for i in range(4)}}
        for name in ("collectors", "dashboards"):
            shutil.copytree(ROOT / name, base / name)
        for path in (base / "collectors").rglob("*.yml"):
            path.write_text(self.ports_in(path.read_text()))
        self.env = {**os.environ, "HOME": str(self.home), "PATH": f"{base / '.venv' / 'bin'}:{os.environ['PATH']}",
                    "MOESCOPE_PROGRESS": "0", "COLUMNS": "200"}
        for k in [k for k in self.env if k.startswith("MOESCOPE_") and k != "MOESCOPE_PROGRESS"]:
            del self.env[k]
        self.background: list[subprocess.Popen] = []
        self.started: list[str] = []  # each background process' command line
        self.n_started = 0
        self.captured: dict[str, str] = {}  # what entries' ``capture`` found, for later ``replace``
        self.logs: dict[int, Path] = {}  # page line -> its latest background log

    def ports_in(self, text: str) -> str:
        """The page's well-known ports (and an entry's ``{9400}`` placeholders) replaced by this page's own."""
        for old, new in self.ports.items():
            text = text.replace(f"{{{old}}}", str(new))
            text = re.sub(rf"(?<![\d.]){old}(?!\d)", str(new), text)
        return text

    def line(self, c: Command, e: Entry) -> str:
        text = c.text
        for old, new in e.replace.items():
            for name, value in self.captured.items():
                new = new.replace(f"{{{name}}}", value)
            text = text.replace(old, new)
        text = self.ports_in(text)
        background = text.endswith("&") or e.background
        text = text.rstrip("&").rstrip()
        if e.append:
            append = self.ports_in(e.append)
            cut = _top_level_pipe(text)
            if cut is not None:  # a pipeline: the arguments go to its first command
                text = f"{text[:cut].rstrip()} {append} | {text[cut + 1:].lstrip()}"
            else:
                text = f"{text} {append}"
        return text + (" &" if background else "")

    def run(self, c: Command, e: Entry) -> subprocess.CompletedProcess | None:
        if e.stop:
            self.stop()
        if e.start:
            self.run(Command(e.start["cmd"] + " &", c.line), Entry(cmd=e.start["cmd"], until=e.start.get("until"),
                                                                  timeout=e.timeout))
        text = self.line(c, e)
        if e.wait:
            for proc, what in zip(self.background, self.started):
                if "moescope demo" in what:
                    proc.wait(e.timeout)
        if text.endswith("&"):
            path = self.dir / f"background-{self.n_started}-line{c.line}.log"
            self.n_started += 1
            self.logs[c.line] = path
            log = open(path, "wb")
            proc = subprocess.Popen(["bash", "-c", _exec(text[:-1])], cwd=self.dir, env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            self.background.append(proc)
            self.started.append(text)
            if e.until:
                deadline = time.monotonic() + e.timeout
                while subprocess.run(["bash", "-c", self.ports_in(e.until)], cwd=self.dir, env=self.env,
                                     capture_output=True).returncode != 0:
                    assert proc.poll() is None, f"{c.text}: exited {proc.returncode}:\n{self.log_of(c)}"
                    assert time.monotonic() < deadline, f"{c.text}: `{e.until}` never held:\n{self.log_of(c)}"
                    time.sleep(0.5)
            return None
        return subprocess.run(["bash", "-c", text], cwd=self.dir, env=self.env, capture_output=True, text=True,
                              timeout=e.timeout, stdin=subprocess.DEVNULL)

    def log_of(self, c: Command) -> str:
        path = self.logs.get(c.line)
        return path.read_text(errors="replace")[-3000:] if path and path.exists() else ""

    def stop(self) -> None:
        procs, self.background, self.started = self.background, [], []
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(30)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()


def check(c: Command, e: Entry, run: subprocess.CompletedProcess | None, scratch: Scratch) -> list[str]:
    """What the text promised and did not happen."""
    where = f"line {c.line}: {scratch.line(c, e)}"
    if run is None:
        return []
    said = run.stdout + run.stderr
    problems = []
    if run.returncode != e.exit:
        problems.append(f"{where}\n  exit {run.returncode}, the page promises {e.exit}:\n{said[-2500:]}")
    problems += [f"{where}\n  no match for {pattern!r} in:\n{said[-2500:]}" for pattern in e.out
                 if not re.search(pattern, said, re.M)]
    problems += [f"{where}\n  {path} was not written" for path in e.files if not (scratch.dir / path).exists()]
    for name, pattern in e.capture.items():
        found = re.search(pattern, said, re.M)
        if found:
            scratch.captured[name] = found.group(1)
        else:
            problems.append(f"{where}\n  nothing to capture as {name} with {pattern!r} in:\n{said[-2500:]}")
    return problems
