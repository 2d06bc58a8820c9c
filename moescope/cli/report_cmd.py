"""``moescope report --out DIR``: tables (CSV), heatmaps (PNG) and a summary (Markdown)."""

from __future__ import annotations

from pathlib import Path

import click

from moescope.cli.layer_select import layers_option
from moescope.cli.options import (echo, emit_json, import_option, json_option, model_option, no_model_with,
                                  reference_options, since_option, traces_option)


@click.command("report")
@traces_option()
@import_option("Report (instead of the trace store) on")
@since_option
@model_option
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="moescope-report", show_default=True)
@layers_option("Also draw per-layer figures (expert x step, expert x domain) for these layers: 'all' or ids and "
               "ranges, e.g. 3,17,40-45. The overview figure always has every layer.")
@reference_options("Judge the store's routing against this baseline profile (`moescope baseline save`), as "
                   "`moescope diagnose --baseline`.")
@click.option("--prometheus", default=None, help="Prometheus URL: its S-MBU and S-MFU say whether bandwidth binds "
              "(the expert-spread finding's severity, as `moescope diagnose --prometheus`).")
@json_option
def report_cmd(traces_path, import_path, since, model, out_dir, layers, baseline_path, hot_reference,
               learn_window_s, prometheus, as_json) -> None:
    """Write summary.md (read it first), a layers x experts overview figure and load tables to OUT."""
    # start-up: numpy (analysis.baseline, analysis.report, traces.store), only when the command runs, not for --help
    from moescope.analysis import baseline as bl
    from moescope.analysis import report
    from moescope.traces.store import CorruptRows

    no_model_with(model, import_path, "--import")
    corrupt = CorruptRows()
    summary = report.build(out_dir, traces_path=None if import_path else traces_path, import_path=import_path,
                           since=since, corrupt=corrupt, layers=layers, model=model,
                           baseline=bl.load(baseline_path) if baseline_path else None, hot_reference=hot_reference,
                           learn_window_s=learn_window_s, prometheus=prometheus)
    if import_path is None:
        summary["corrupt_rows"] = corrupt.count
    if as_json:
        emit_json(summary)
    else:
        out = Path(out_dir)  # "report/" names the same folder as "report": no "report//summary.md"
        echo(f"wrote {len(summary['files'])} files to {out}; start with {out / 'summary.md'}")
