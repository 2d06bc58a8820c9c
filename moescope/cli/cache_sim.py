"""``moescope cache-sim``: what cache size to buy, from a recorded routing log."""

from __future__ import annotations

import json

import click


@click.command("cache-sim")
@click.argument("routing_log", type=click.Path(dir_okay=False), required=False)
@click.option("--traces", "traces_path", type=click.Path(dir_okay=False), default=None,
              help="Replay the routing recorded in this trace store instead of a routing log.")
@click.option("--import", "import_path", type=click.Path(dir_okay=False), default=None,
              help="Replay an SGLang expert-distribution dump (.pt, per-pass mode) or a Megatron-style "
                   "tokens-per-expert JSONL: each pass/iteration is one forward.")
@click.option("--target", type=click.FloatRange(0, 1), default=0.9, show_default=True,
              help="Hit rate the recommended size must reach.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def cache_sim(routing_log: str | None, traces_path: str | None, import_path: str | None, target: float,
              as_json: bool) -> int:
    """Replay ROUTING_LOG (from `moescope demo --record-routing`) or a trace store (--traces) through LRU,
    LFU, static and Belady's optimal at cache sizes 1..E."""
    from moescope.analysis import cache_sim as sim
    from moescope.errors import BadInput

    if sum(x is not None for x in (routing_log, traces_path, import_path)) != 1:
        raise BadInput("give one of: a routing log, --traces PATH, --import FILE")
    if import_path is not None:
        from moescope.analysis import profile

        prof = profile.load(import_path=import_path)
        n_experts, seqs = prof.n_experts, prof.lookups()
    elif traces_path is not None:
        from moescope.traces import store

        n_experts, seqs = sim.load_lookups_from_store(store.open_store(traces_path))
    else:
        n_experts, seqs = sim.load_lookups(routing_log)
    report = sim.simulate_all(n_experts, seqs, target=target)
    click.echo(json.dumps(report, indent=1) if as_json else sim.format_table(report))
    return 0
