"""``moescope cache-sim``: what cache size to buy, from a recorded routing log."""

from __future__ import annotations

import click

from moescope.cli.options import (echo, emit_json, import_option, json_option, model_option, no_model_with, read_store,
                                  traces_option)
from moescope.errors import BadInput


@click.command("cache-sim")
@click.argument("routing_log", type=click.Path(dir_okay=False), required=False)
@traces_option(help="Trace store (SQLite) to replay when neither a routing log nor --import is given.")
@import_option("Replay (each pass or iteration is one forward; SGLang's per-pass mode)")
@model_option
@click.option("--target", type=click.FloatRange(0, 1), default=0.9, show_default=True,
              help="Hit rate the recommended size must reach.")
@json_option
def cache_sim(routing_log: str | None, traces_path: str, import_path: str | None, model: str | None, target: float,
              as_json: bool) -> None:
    """Replay ROUTING_LOG (from `moescope demo --record-routing`), an --import dump, or else the trace store
    through LRU, LFU, static and Belady's optimal at every cache size 1..E (one pass per policy). The table
    shows sizes 1, 2, 4, ..., E and each policy's smallest size reaching --target; --json has every size."""
    # start-up: numpy, torch (analysis.cache_sim), only when the command runs, not for --help
    from moescope.analysis import cache_sim as sim

    corrupt = None
    if routing_log is not None and import_path is not None:
        raise BadInput("give a routing log or --import FILE, not both")
    no_model_with(model, import_path, "--import")
    no_model_with(model, routing_log, "a routing log")
    if import_path is not None:
        # start-up: numpy (analysis.profile), only when the command runs, not for --help
        from moescope.analysis import profile

        prof = profile.load(import_path=import_path)
        n_experts, seqs = prof.n_experts, prof.lookups()
    elif routing_log is not None:
        n_experts, seqs = sim.load_lookups(routing_log)
    else:
        with read_store(traces_path) as (conn, corrupt):
            n_experts, seqs = sim.load_lookups_from_store(conn, corrupt=corrupt, model=model)
    report = sim.simulate_all(n_experts, seqs, target=target)
    if corrupt is not None:
        report["corrupt_rows"] = corrupt.count
    if as_json:
        emit_json(report)
    else:
        echo(sim.format_table(report))
