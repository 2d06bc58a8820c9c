"""``moescope requests``: recent requests in the trace store."""

from __future__ import annotations

import datetime as dt

import click

from moescope.cli.options import echo, emit_json, json_option, read_store, since_option, traces_option
from moescope.traces import store


@click.command("requests")
@traces_option()
@click.option("--flag", "flags", multiple=True, help="Only requests with this flag (nonfinite, dropped, "
              "cache_miss, slow, truncated); repeatable.")
@since_option
@click.option("--slowest", type=click.IntRange(min=1), default=None, help="The N slowest requests.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@json_option
def requests_cmd(traces_path, flags, since, slowest, limit, as_json) -> None:
    """List recent requests (id, start, tokens, latency, flags)."""
    with read_store(traces_path) as (conn, corrupt):
        rows = store.list_requests(conn, flag=list(flags), since=since, slowest=slowest, limit=limit,
                                   corrupt=corrupt)
    if not rows and corrupt.count:
        raise corrupt.nothing_left("no readable requests in the trace store")
    if as_json:
        emit_json([{"request_id": r.request_id, "started": r.started, "prompt_tokens": r.n_prompt,
                    "output_tokens": r.n_output, "total_s": r.total_s, "ttft_s": r.ttft_s, "flags": list(r.flags),
                    "domain": r.domain, "tenant": r.tenant} for r in rows])
        return
    echo(f"{'request id':<22} {'started':<19} {'prompt':>6} {'output':>6} {'ttft ms':>8} {'total ms':>9}  flags")
    for r in rows:
        started = dt.datetime.fromtimestamp(r.started).strftime("%Y-%m-%d %H:%M:%S")
        echo(f"{r.request_id[:22]:<22} {started:<19} {r.n_prompt:>6} {r.n_output:>6} "
             f"{r.ttft_s * 1e3:>8.1f} {r.total_s * 1e3:>9.1f}  {','.join(r.flags)}")
