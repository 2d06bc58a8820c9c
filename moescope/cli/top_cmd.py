"""``moescope top``: live terminal view of routing health from metrics endpoints or a Prometheus server."""

from __future__ import annotations

import shutil
import sys
import time

import click

from moescope.errors import BadInput


def once_width(given: int | None, stream=None) -> int | None:
    """The columns ``--once`` cuts its lines to: ``--width``, else the terminal's (``$COLUMNS`` first) when
    ``stream`` (stdout) is one, else None: piped, every line whole."""
    if given is not None:
        return given
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return shutil.get_terminal_size().columns if isatty is not None and isatty() else None


@click.command("top")
@click.argument("endpoints", nargs=-1)
@click.option("--prometheus", default=None, help="Read from this Prometheus server instead of endpoints.")
@click.option("--alertmanager", default=None, help="Show the alerts firing in this Alertmanager.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True, help="Seconds per poll.")
@click.option("--once", is_flag=True, help="Print one plain-text frame (two polls, --interval apart; every layer, "
              "worst first) and exit.")
@click.option("--width", type=click.IntRange(min=20), default=None, metavar="N",
              help="--once: cut lines to N columns [the terminal's width; piped: lines whole].")
def top_cmd(endpoints, prometheus, alertmanager, interval, once, width) -> int:
    """Watch ENDPOINTS (host:port of each rank's exporter; default 127.0.0.1:9400) live."""
    from moescope.tui.top_data import Poller  # start-up: numpy (tui.top_data), only when the command runs

    if endpoints and prometheus:
        raise BadInput("give metrics endpoints or --prometheus, not both")
    poller = Poller(list(endpoints) or ["127.0.0.1:9400"], prometheus=prometheus, alertmanager=alertmanager)
    if once:
        # optional: rich, textual (tui.heatmap, tui.top_app; the tui extra)
        from moescope.tui import heatmap
        from moescope.tui.top_app import details_text, status_text, tiles_text

        poller.poll()
        time.sleep(interval)
        f = poller.poll()
        if not any(v == "ok" for v in f.endpoints.values()):  # nothing to show: say why, on one line (exit 2)
            raise BadInput("no metrics source answered: " + "; ".join(f"{u}: {e}" for u, e in f.endpoints.items()))
        worst = heatmap.sort_layers(f.routing, True)[0] if f.routing else None
        cols = once_width(width)
        for text in (heatmap.fit(status_text(f, False), cols), tiles_text(f, cols),
                     heatmap.overview(f, cols, 0, worst_first=True), details_text(f, worst, cols)):
            click.echo(text.plain.rstrip("\n"))
        return 0
    from moescope.tui.top_app import TopApp  # optional: rich, textual (tui.top_app; the tui extra)

    TopApp(poller, interval).run()
    return 0
