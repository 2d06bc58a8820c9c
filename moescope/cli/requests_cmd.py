"""``moescope requests``: recent requests in the trace store."""

from __future__ import annotations

import datetime as dt
import json
import re
import time

import click

from moescope.errors import BadInput
from moescope.traces import store
from moescope.traces.sanitize import sanitize

TRACES_OPTION = click.option("--traces", "traces_path", type=click.Path(dir_okay=False),
                             default=str(store.DEFAULT_PATH), show_default=True, envvar="MOESCOPE_TRACES",
                             help="Trace store (SQLite).")


def parse_since(text: str) -> float:
    """``30s``, ``5m``, ``2h``, ``1d`` ago, or an ISO timestamp -> unix seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if m:
        return time.time() - float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise BadInput(f"--since {text!r}: use a duration (30s, 5m, 2h, 1d) or an ISO timestamp") from None
    if when.tzinfo is None:
        when = when.astimezone()
    return when.timestamp()


@click.command("requests")
@TRACES_OPTION
@click.option("--flag", "flags", multiple=True, help="Only requests with this flag (nonfinite, dropped, "
              "cache_miss, slow, truncated); repeatable.")
@click.option("--since", default=None, help="Only requests since: 30s, 5m, 2h, 1d or an ISO timestamp.")
@click.option("--slowest", type=click.IntRange(min=1), default=None, help="The N slowest requests.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def requests_cmd(traces_path, flags, since, slowest, limit, as_json) -> int:
    """List recent requests (id, start, tokens, latency, flags)."""
    conn = store.open_store(traces_path)
    rows = store.list_requests(conn, flag=list(flags), since=parse_since(since) if since else None,
                               slowest=slowest, limit=limit)
    if as_json:
        click.echo(json.dumps([{"request_id": sanitize(r.request_id), "started": r.started,
                                "prompt_tokens": r.n_prompt, "output_tokens": r.n_output, "total_s": r.total_s,
                                "ttft_s": r.ttft_s, "flags": list(r.flags), "domain": r.domain,
                                "tenant": r.tenant} for r in rows], indent=1))
        return 0
    click.echo(f"{'request id':<22} {'started':<19} {'prompt':>6} {'output':>6} {'ttft ms':>8} {'total ms':>9}  flags")
    for r in rows:
        started = dt.datetime.fromtimestamp(r.started).strftime("%Y-%m-%d %H:%M:%S")
        click.echo(f"{sanitize(r.request_id)[:22]:<22} {started:<19} {r.n_prompt:>6} {r.n_output:>6} "
                   f"{r.ttft_s * 1e3:>8.1f} {r.total_s * 1e3:>9.1f}  {','.join(r.flags)}")
    return 0
