"""The capture switch: moescope's kill switch, turning capture off and on in a running engine without a restart.

Off, the engine reports to no moescope observer (``EngineContract.pause``: the reference runtime's model reports to
the no-op observer again, a HF model's hooks are removed, the vLLM plugin's step wrapper calls vLLM's own
``execute_model`` straight through), so moescope does no work per step (``tests/test_step_work.py`` counts it). The
exporter keeps serving the last counts, with ``moescope_capture_enabled`` 0. Back on, the engine reports again; a
step that began while capture was off (it routed fewer MoE layers than a whole forward) is dropped whole, so
nothing is counted twice and no step is counted in part (``RoutingProbe.resync``, ``TokenTraceCapture.resync``).

Who may flip it: the operator, never a scraper. There is no HTTP write endpoint. The switch is a control file, one
word (``on`` or ``off``), that every moescope process polls once per evaluation interval (one ``stat`` a second):
``moescope capture off`` writes it; file permissions say who may. Its path: ``MOESCOPE_CAPTURE_CONTROL``, else
``capture`` in moescope's user directory (``moescope.user_cache.root()``): one switch for a user's processes. A
library caller can flip it directly too (``Instrumentation.capture.set(False)``). A missing or unreadable file, or
one holding anything else, changes nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Callable

from moescope import user_cache

log = logging.getLogger("moescope.capture")

CONTROL_ENV = "MOESCOPE_CAPTURE_CONTROL"
WORDS = {"on": True, "off": False}


def control_path(path: str | os.PathLike | None = None) -> Path:
    """The control file: ``path``, else ``$MOESCOPE_CAPTURE_CONTROL``, else ``<user directory>/capture``."""
    return Path(path or os.environ.get(CONTROL_ENV) or (user_cache.root() / "capture"))


def write_control(on: bool, path: str | os.PathLike | None = None) -> Path:
    """Write the control file (atomically: a poller never reads half of it); returns its path. Raises ``OSError``
    where it cannot be written."""
    target = control_path(path)
    if not user_cache.write_atomic(target, b"on\n" if on else b"off\n"):
        raise OSError(f"cannot write {target}")
    return target


def read_control(path: str | os.PathLike | None = None) -> bool | None:
    """What the control file says (True on, False off), or None (missing, unreadable, another word)."""
    try:
        word = control_path(path).read_text().strip().lower()
    except OSError:
        return None
    return WORDS.get(word)


class CaptureSwitch:
    """On or off, with the engine's ``pause``/``resume`` applied on each change (from any thread; changes are
    serialised). ``listeners`` are called with the new state after it took effect (the metrics' gauge)."""

    def __init__(self, pause: Callable[[], None], resume: Callable[[], None], *,
                 control: str | os.PathLike | None = None, poll_control: bool = True) -> None:
        self._pause, self._resume = pause, resume
        self.control = control_path(control) if poll_control else None
        self._on = True
        self._lock = threading.Lock()
        self._mtime: int | None = None
        self.switches = 0
        self.listeners: list[Callable[[bool], None]] = []

    @property
    def on(self) -> bool:
        return self._on

    def set(self, on: bool) -> bool:
        """Turn capture on or off; True where it changed."""
        with self._lock:
            if on == self._on:
                return False
            (self._resume if on else self._pause)()
            self._on = on
            self.switches += 1
        log.info("moescope: capture turned %s", "on" if on else "off")
        for fn in self.listeners:
            fn(on)
        return True

    def poll(self) -> None:
        """Follow the control file, if it changed since the last look (its modification time)."""
        if self.control is None:
            return
        try:
            mtime = self.control.stat().st_mtime_ns
        except OSError:
            return
        if mtime == self._mtime:
            return
        self._mtime = mtime
        want = read_control(self.control)
        if want is not None:
            self.set(want)


__all__ = ["CONTROL_ENV", "CaptureSwitch", "control_path", "read_control", "write_control"]
