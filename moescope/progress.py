"""Progress of long work on stderr: a bar with an estimate where stderr is a terminal (rich), else one line at
the start and one at the end (logs and CI keep a record without a redrawn bar). ``MOESCOPE_PROGRESS=0`` turns
both off.

    with progress("balancing routers", total=n) as advance:
        for ...:
            advance()
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator


def _off() -> bool:
    return os.environ.get("MOESCOPE_PROGRESS", "1") == "0"


def note(line: str) -> None:
    """One progress line on stderr (``moescope: line``), terminal or not, unless progress is off."""
    if not _off():
        print(f"moescope: {line}", file=sys.stderr, flush=True)


@contextmanager
def progress(description: str, total: int, lines: bool = True) -> Iterator[Callable[[int], None]]:
    """Yields ``advance(n=1)``; shows ``description`` with a bar of ``total`` steps and the time left.
    ``lines``: off a terminal, the start and done lines (False: nothing, for work whose output is the
    command's own, as `cache-sim --json`'s errors and results)."""
    if _off() or (not lines and not sys.stderr.isatty()):
        yield lambda n=1: None
        return
    started = time.monotonic()
    if not sys.stderr.isatty():
        note(f"{description} ...")
        yield lambda n=1: None
        note(f"{description}: done in {time.monotonic() - started:.0f} s")
        return
    try:
        # optional: rich, which comes with the tui extra (textual); without it, the plain lines
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    except ImportError:
        note(f"{description} ...")
        yield lambda n=1: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
               TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)
