"""``moescope diagnose``: ranked findings from the trace store (and a Prometheus server when given)."""

from __future__ import annotations

import json

import click

from moescope.cli.options import (echo, emit_json, json_option, model_option, read_store, reference_options,
                                  since_option, traces_option)
from moescope.errors import CheckFailed

MARK = {"critical": "CRIT", "warning": "WARN", "info": "ok  "}


def _brief(evidence: dict) -> str:
    parts = []
    for k, v in evidence.items():
        if k in ("note", "source"):
            continue
        text = json.dumps(v, separators=(",", ":")) if isinstance(v, (dict, list)) else str(v)
        parts.append(f"{k}={text}")
    return "; ".join(parts)


@click.command("diagnose")
@traces_option()
@since_option
@model_option
@click.option("--limit", type=click.IntRange(min=1), default=5000, show_default=True,
              help="Most recent requests read.")
@reference_options("Judge against this baseline profile (`moescope baseline save`): the imbalance bar from its "
                   "structural CV, hot and dead experts against its shares, drift against its load (else: the "
                   "no-baseline bar, the fair share, and the window's earlier half).")
@click.option("--prometheus", default=None, help="Prometheus URL: add its firing moescope alerts as evidence.")
@click.option("--run", "run", default=None, metavar="ID|all",
              help="Which writer run to judge (each process that wrote the store is one run; a store often holds "
              "a healthy run and a fault run, or an old one): a run id (or a unique prefix), or `all`. Default: "
              "the latest run (with any run written alongside it: a launch's ranks). Identical prefixes are "
              "compared within a run, never across.")
@json_option
def diagnose_cmd(traces_path, since, model, limit, baseline_path, hot_reference, learn_window_s, prometheus, run,
                 as_json) -> None:
    """Name what is wrong, with evidence and the playbook to follow. Exit 1 when something is."""
    # start-up: numpy (analysis.baseline, analysis.diagnose), only when the command runs, not for --help
    from moescope.analysis import baseline as bl
    from moescope.analysis.diagnose import diagnose

    baseline = bl.load(baseline_path) if baseline_path else None
    with read_store(traces_path) as (conn, corrupt):
        report = diagnose(conn, since=since, limit=limit, baseline=baseline, prometheus=prometheus, corrupt=corrupt,
                          run=run, model=model, hot_reference=hot_reference, learn_window_s=learn_window_s)
    report["corrupt_rows"] = corrupt.count
    if as_json:
        emit_json(report)
    else:
        echo(f"{report['model']}: {report['requests']} requests, {report['routed_tokens']} routed tokens, "
             f"layers {','.join(map(str, report['layers']))}")
        echo(report["runs"]["line"])
        if not report["alarming"]:
            echo("nothing alarming found")
        for i, f in enumerate(report["findings"], 1):
            echo(f"{i:2d}. [{MARK[f['severity']]}] {f['title']}")
            echo(f"      {_brief(f['evidence'])}")
            if f["examples"]:
                echo(f"      requests: {', '.join(f['examples'])}")
            if f["playbook"]:
                echo(f"      playbook: {f['playbook']}")
    if report["alarming"]:
        raise CheckFailed(f"diagnose: {report['alarming']} finding(s) need attention")
