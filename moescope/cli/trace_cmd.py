"""``moescope trace REQUEST_ID``: one request's life, token by token (Textual, or --json / --plain)."""

from __future__ import annotations

import click

from moescope.cli.layer_select import ALL, layers_option
from moescope.cli.options import echo, emit_json, json_option, traces_option
from moescope.traces import store
from moescope.traces.sanitize import sanitize
from moescope.tui import trace_grid


def plain_lines(doc: dict) -> list[str]:
    """The plain-text rendering (also what the TUI shows, in widgets). Every string is sanitised."""
    t = doc["timings"]
    tags = trace_grid.labels(doc)
    lines = [f"request {sanitize(doc['request_id'])}  model {doc['model']}  rank {doc['rank']}"
             + (f"  {tags}" if tags else ""),
             f"timings: queue {t['queue_s'] * 1e3:.1f} ms, prefill {t['prefill_s'] * 1e3:.1f} ms, "
             f"ttft {t['ttft_s'] * 1e3:.1f} ms, total {t['total_s'] * 1e3:.1f} ms; finish {doc['finish_reason']}; "
             f"flags: {','.join(doc['flags']) or '-'}" + (f"; trace id {doc['trace_id']}" if doc["trace_id"] else ""),
             f"prompt: {sanitize(doc['prompt'], keep_newlines=False)}",
             f"output: {sanitize(doc['output'], keep_newlines=False)}",
             f"{'idx':>5} {'phase':<7} {'text':<6} {'lat ms':>7}  flags  layer: experts(weights) H margin cache"]
    for tok in doc["tokens"]:
        lat = f"{tok['latency_s'] * 1e3:7.1f}" if tok["latency_s"] is not None else f"{'':>7}"
        routing = "  ".join(
            f"L{la['layer']}:" + ",".join(f"{e}({w:.2f})" for e, w in zip(la["experts"], la["weights"]))
            + f" H{la['entropy']:.2f} m{la['margin']:.2f} "
            + "".join("M" if s in la["misses"] else "." for s in range(len(la["experts"])))
            for la in tok["layers"])
        lines.append(f"{tok['index']:>5} {tok['phase']:<7} {sanitize(tok['text'], keep_newlines=False):<6} {lat}  "
                     f"{','.join(tok['flags']) or '-':<6} {routing}")
    return lines


@click.command("trace")
@click.argument("request_id")
@traces_option()
@json_option
@click.option("--plain", is_flag=True, help="Plain text, one line per token (no TUI).")
@layers_option("Only these MoE layers' routing: 'all' (the default) or ids and ranges, e.g. 3,17,40-45.")
def trace_cmd(request_id, traces_path, as_json, plain, layers) -> int:
    """Show REQUEST_ID's prompt, output, timings, flags and each token's routing through every layer."""
    conn = store.open_store(traces_path)
    try:
        doc = store.load_request(conn, request_id, layers=None if layers in (None, ALL) else layers)
    finally:
        conn.close()
    if as_json:
        emit_json(doc, compact=True)  # megabytes at 58 layers: one line, json's C encoder
        return 0
    if plain:
        for line in plain_lines(doc):
            echo(line)
        return 0
    from moescope.tui.trace_app import TraceApp  # optional: textual (tui.trace_app; the tui extra)

    TraceApp(doc).run()
    return 0
