"""``moescope baseline save``: the routing baseline drift is measured against."""

from __future__ import annotations

import click

from moescope.cli.requests_cmd import TRACES_OPTION, parse_since


@click.group("baseline")
def baseline() -> None:
    """Routing baselines (expert load per layer) for drift detection."""


@baseline.command("save")
@TRACES_OPTION
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Baseline file to write (JSON).")
@click.option("--since", default=None, help="Only requests since: 30s, 5m, 2h, 1d or an ISO timestamp.")
def save(traces_path: str, out: str, since: str | None) -> int:
    """Save the expert load per layer of the stored requests as the baseline."""
    from moescope.analysis import baseline as bl
    from moescope.traces import store

    load, model = bl.from_store(store.open_store(traces_path), parse_since(since) if since else None)
    bl.save(out, load, model)
    click.echo(f"wrote {out}: {len(load)} layers, {int(sum(sum(v) for v in load.values()))} slots")
    return 0
