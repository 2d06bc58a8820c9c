"""``moescope report --out DIR``: tables (CSV), heatmaps (PNG) and a summary (Markdown)."""

from __future__ import annotations

import json

import click

from moescope.cli.plan_cmd import IMPORT_OPTION
from moescope.cli.requests_cmd import TRACES_OPTION, parse_since


@click.command("report")
@TRACES_OPTION
@IMPORT_OPTION
@click.option("--since", default=None, help="Trace store: only requests since (30s, 5m, 2h, 1d, ISO).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="moescope-report", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def report_cmd(traces_path, import_path, since, out_dir, as_json) -> int:
    """Write load tables, expert heatmaps and summary.md (read it first) to OUT."""
    from moescope.analysis import report

    summary = report.build(out_dir, traces_path=None if import_path else traces_path, import_path=import_path,
                           since=parse_since(since) if since else None)
    if as_json:
        click.echo(json.dumps(summary, indent=1, default=str))
    else:
        click.echo(f"wrote {len(summary['files'])} files to {out_dir}; start with {out_dir}/summary.md")
    return 0
