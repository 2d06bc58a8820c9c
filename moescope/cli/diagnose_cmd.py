"""``moescope diagnose``: ranked findings from the trace store (and a Prometheus server when given)."""

from __future__ import annotations

import json

import click

from moescope.cli.requests_cmd import TRACES_OPTION, parse_since
from moescope.traces import store
from moescope.traces.sanitize import sanitize

MARK = {"critical": "CRIT", "warning": "WARN", "info": "ok  "}


def _brief(evidence: dict) -> str:
    parts = []
    for k, v in evidence.items():
        if k in ("note", "source"):
            continue
        text = json.dumps(v, separators=(",", ":")) if isinstance(v, (dict, list)) else str(v)
        parts.append(f"{k}={text}")
    return sanitize("; ".join(parts))


@click.command("diagnose")
@TRACES_OPTION
@click.option("--since", default=None, help="Only requests since: 30s, 5m, 2h, 1d or an ISO timestamp.")
@click.option("--limit", type=click.IntRange(min=1), default=5000, show_default=True,
              help="Most recent requests read.")
@click.option("--baseline", "baseline_path", type=click.Path(dir_okay=False), default=None,
              help="Measure drift against this baseline (else: the window's earlier half).")
@click.option("--prometheus", default=None, help="Prometheus URL: add its firing moescope alerts as evidence.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable findings.")
def diagnose_cmd(traces_path, since, limit, baseline_path, prometheus, as_json) -> int:
    """Name what is wrong, with evidence and the playbook to follow. Exit 1 when something is."""
    from moescope.analysis import baseline as bl
    from moescope.analysis.diagnose import diagnose

    conn = store.open_store(traces_path)
    try:
        report = diagnose(conn, since=parse_since(since) if since else None, limit=limit,
                          baseline=bl.load(baseline_path) if baseline_path else None, prometheus=prometheus)
    finally:
        conn.close()
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        click.echo(f"{report['model']}: {report['requests']} requests, {report['routed_tokens']} routed tokens, "
                   f"layers {','.join(map(str, report['layers']))}")
        if not report["alarming"]:
            click.echo("nothing alarming found")
        for i, f in enumerate(report["findings"], 1):
            click.echo(f"{i:2d}. [{MARK[f['severity']]}] {f['title']}")
            click.echo(f"      {_brief(f['evidence'])}")
            if f["examples"]:
                click.echo(f"      requests: {', '.join(sanitize(x) for x in f['examples'])}")
            if f["playbook"]:
                click.echo(f"      playbook: {f['playbook']}")
    return 1 if report["alarming"] else 0
