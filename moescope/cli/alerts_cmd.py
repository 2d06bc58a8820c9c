"""``moescope alerts build``: regenerate the alert rules and their promtool tests."""

from __future__ import annotations

from pathlib import Path

import click

from moescope.errors import BadInput


@click.group("alerts")
def alerts() -> None:
    """Alert rules (generated from moescope/alerts/rules.py)."""


@alerts.command("build")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=Path("."), show_default=True,
              help="Repository root to write collectors/prometheus/ under.")
def build(root: Path) -> int:
    """Write collectors/prometheus/moescope-rules.yml and tests/moescope-rules.test.yml."""
    # start-up: yaml, numpy and the rule tables (alerts.alert_files): for this command only, not for --help
    from moescope.alerts import alert_files as alerts_build

    try:
        paths = alerts_build.write(root)
    except OSError as e:
        raise BadInput(f"cannot write the rules under {root}: {e.strerror or e}") from None
    for path in paths:
        click.echo(f"wrote {path}")
    return 0
