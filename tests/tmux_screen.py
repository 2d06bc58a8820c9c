"""Reading a terminal view in tmux as a person would: the pane's text, polled until a line shows up."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from helpers import wait_until


def screen(tmux: str, session: str) -> str:
    """The pane's visible text, one line per terminal row."""
    return subprocess.run([tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def wait_screen(tmux: str, session: str, needle: str | Callable[[str], bool], timeout: float = 60.0) -> str:
    """The pane's text once ``needle`` is on it (or once ``needle(text)`` holds); fails with the last screen
    after ``timeout`` seconds."""
    until = needle if callable(needle) else (lambda text: needle in text)
    return wait_until(lambda: screen(tmux, session), until=until, timeout=timeout, what=f"{needle!r} on the screen")
