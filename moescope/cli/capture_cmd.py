"""``moescope capture on|off|status``: the kill switch of every moescope process that polls the control file
(``moescope.capture.switch``): capture off means no moescope work per engine step, within one evaluation interval
(a second by default), without a restart. ``moescope_capture_enabled`` says which each process is in."""

from __future__ import annotations

import click

from moescope.capture import switch
from moescope.cli.options import echo, emit_json, json_option
from moescope.errors import BadInput

_CONTROL = click.option("--control", type=click.Path(dir_okay=False), default=None,
                        help=f"The control file [${switch.CONTROL_ENV}, else moescope's user directory]; the same "
                             "path the processes poll (their Metrics.capture_control).")


@click.group("capture")
def capture() -> None:
    """Turn capture off or on in running moescope processes (the kill switch), or say what it is."""


def _write(on: bool, control: str | None) -> None:
    try:
        path = switch.write_control(on, control)
    except OSError as e:
        raise BadInput(f"cannot write the capture control file: {e}") from None
    echo(f"capture {'on' if on else 'off'}: {path} (every process polling it follows within its evaluation interval)")


@capture.command("off")
@_CONTROL
def off(control: str | None) -> None:
    """Capture off: engines report to no moescope observer; exporters keep serving the last counts."""
    _write(False, control)


@capture.command("on")
@_CONTROL
def on(control: str | None) -> None:
    """Capture on again (a step that began while capture was off is dropped whole, never counted in part)."""
    _write(True, control)


@capture.command("status")
@_CONTROL
@json_option
def status(control: str | None, as_json: bool) -> None:
    """What the control file says (a process without it, or with another word in it, captures)."""
    path = switch.control_path(control)
    said = switch.read_control(path)
    state = "off" if said is False else "on"
    if as_json:
        emit_json({"control": str(path), "capture": state, "file": said is not None})
        return
    echo(f"capture {state} ({path}{'' if said is not None else ': no control file, capture is on'})")
