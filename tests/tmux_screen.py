"""Reading a terminal view in tmux as a person would: the pane's text, polled until a line shows up."""

from __future__ import annotations

import subprocess
import time


def screen(tmux: str, session: str) -> str:
    """The pane's visible text, one line per terminal row."""
    return subprocess.run([tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def wait_screen(tmux: str, session: str, needle: str, timeout: float = 60.0) -> str:
    """The pane's text once ``needle`` is on it; fails with the last screen after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    text = screen(tmux, session)
    while needle not in text and time.monotonic() < deadline:
        time.sleep(0.3)
        text = screen(tmux, session)
    assert needle in text, text
    return text
