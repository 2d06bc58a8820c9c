"""``moescope baseline save``: the routing baseline drift is measured against."""

from __future__ import annotations

import click

from moescope.cli.options import echo, read_store, since_option, traces_option


@click.group("baseline")
def baseline() -> None:
    """Routing baselines (expert load per layer) for drift detection."""


@baseline.command("save")
@traces_option()
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Baseline file to write (JSON).")
@since_option
def save(traces_path: str, out: str, since: float | None) -> None:
    """Save the expert load per layer of the stored requests as the baseline."""
    from moescope.analysis import baseline as bl

    with read_store(traces_path) as (conn, corrupt):
        load, model = bl.from_store(conn, since, corrupt=corrupt)
    bl.save(out, load, model)
    skipped = f"; skipped {corrupt.count} corrupt rows" if corrupt.count else ""
    echo(f"wrote {out}: {len(load)} layers, {int(sum(sum(v) for v in load.values()))} slots{skipped}")
