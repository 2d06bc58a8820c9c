"""The tests' toolkit: wait until a condition holds, run the CLI as a user does, record what the engine hands
its observers. One of each, so a deadline, an interpreter path or a recording rule is written once.

Every wait here is a property with a generous bound (it returns as soon as the condition holds), never a timing
assertion: a test must hold on a loaded 2-core machine.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from moescope.capture.observer import Observer
from moescope.prom_http import Unreachable

T = TypeVar("T")
_MISSING = object()


def wait_until(probe: Callable[[], T], *, timeout: float, what: str, until: Callable[[T], object] = bool,
               interval: float = 0.3, ignore: tuple[type[BaseException], ...] = (OSError, Unreachable),
               alive: Callable[[], bool] | None = None) -> T:
    """Call ``probe`` until ``until(value)`` holds (by default: the value is truthy) and return the value.
    ``ignore``: exceptions that mean "not yet" (a server still starting). ``alive``: returns False when waiting is
    pointless (the process under test exited). Gives up after ``timeout`` s with an AssertionError naming
    ``what`` and the last value seen (so a probe that returns its readings explains a failure). By default a
    socket error and moescope's own ``Unreachable`` (a server slow to answer a query, on a loaded machine) are
    "not yet"."""
    deadline, last = time.monotonic() + timeout, _MISSING
    while True:
        try:
            last = probe()
        except ignore as e:  # noqa: PERF203 - a retry loop
            last = e
        if not isinstance(last, BaseException) and until(last):
            return last
        if alive is not None and not alive():
            raise AssertionError(f"{what}: gave up, the process under test ended (last seen: {last!r})")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s (last seen: {last!r})")
        time.sleep(interval)


def cli_argv(*args: str) -> list[str]:
    """The CLI as a user runs it: ``python -m moescope ARGS`` in this interpreter."""
    return [sys.executable, "-m", "moescope", *map(str, args)]


def run_cli(*args, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Run ``moescope ARGS`` to its end; text output captured. ``kw`` goes to subprocess.run (env, cwd, input)."""
    return subprocess.run(cli_argv(*args), capture_output=True, text=True, timeout=timeout, **kw)


def run_cli_ok(*args, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """``moescope`` that must exit 0; the failure message is the command and its stderr."""
    run = run_cli(*args, timeout=timeout, **kw)
    assert run.returncode == 0, f"moescope {' '.join(map(str, args))} -> {run.returncode}\n{run.stderr[-4000:]}"
    return run


def popen_cli(*args, **kw) -> subprocess.Popen:
    """Start ``moescope ARGS`` in the background (output discarded unless ``kw`` says otherwise)."""
    kw.setdefault("stdout", subprocess.DEVNULL)
    kw.setdefault("stderr", subprocess.DEVNULL)
    return subprocess.Popen(cli_argv(*args), **kw)


class Recording(Observer):
    """An independent record of what the engine hands its observers, kept as plain data:

    - ``steps``: per step, ``(segments, decisions)``: the step's ``(request id, position, rows)`` segments and the
      routing decisions of its forwards, ``(layer, ids, n_experts)`` with ``ids`` the kept (active) expert ids of
      each row, a CPU tensor;
    - ``decisions``: every decision in order, the same tuples;
    - ``step_records`` and ``requests``: the StepRecord and RequestRecord objects as handed over.
    """

    def __init__(self):
        self.steps, self.decisions, self.step_records, self.requests = [], [], [], []
        self._pending = []

    def on_routing(self, layer, decision):
        d = (layer, decision.active_ids.detach().to("cpu", copy=True), decision.n_experts)
        self._pending.append(d)
        self.decisions.append(d)

    def on_step(self, step):
        self.steps.append((tuple(step.segments), self._pending))
        self.step_records.append(step)
        self._pending = []

    def on_request(self, record):
        self.requests.append(record)

    def rows_by_request(self) -> dict[str, list[list[list[int]]]]:
        """{request id: per token row, per routed layer in order, the row's expert ids}."""
        out: dict[str, list] = {}
        for segments, decisions in self.steps:
            offset = 0
            for rid, _, n in segments:
                rows = out.setdefault(rid, [])
                for t in range(offset, offset + n):
                    rows.append([ids[t].tolist() for _, ids, _ in decisions])
                offset += n
        return out


def stored_ids(path, table: str) -> set[str]:
    """The request ids of one of a SQLite trace store's tables (``requests``, ``sampled_out``)."""
    con = sqlite3.connect(path)
    try:
        return {r[0] for r in con.execute(f"SELECT request_id FROM {table}")}  # noqa: S608 (our own table names)
    finally:
        con.close()
