"""``moescope serve --world-size N``: the front end in this process, N expert-parallel ranks under torchrun's agent.

Each rank is this same command (``serve_cmd`` on a rank: its own engine, requests and metrics exporter on
metrics port + rank; the experts sharded over the ranks); the front end (``serve.fleet``) deals the requests to
them. The agent owns the main thread and the signals: a SIGTERM or SIGINT to this process reaches every rank,
each drains its own requests (``--shutdown-timeout``) while the front end still carries their answers, the
ranks leave together, then the front end stops. No rank outlives the launcher.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import click

from moescope.cli.demo_parallel import argv_from_context, report_failures
from moescope.parallel.spawn import run_ranks

# The launcher's own options (the ranks bind a loopback port of their own; the world is the launcher's).
LAUNCHER_ONLY = {"world_size", "host", "port"}


def launch(ctx: click.Context, sock, world_size: int, *, model: str, timeout: float,
           log_level: str, access_log: bool, debug: bool = False) -> int:
    # optional: fastapi, httpx, pydantic, starlette (serve.fleet; the serve extra)
    from moescope.serve import fleet as fleet_mod, server

    run_dir = Path(tempfile.mkdtemp(prefix="moescope-ranks-"))
    fleet = fleet_mod.Fleet(world_size, run_dir, model)  # (the model label of the front end's own series)
    thread, front = server.start_in_thread(fleet_mod.create_app(fleet, debug=debug), sock, log_level=log_level,
                                           access_log=access_log)
    bound = sock.getsockname()
    where = f"http://{'[' + bound[0] + ']' if ':' in bound[0] else bound[0]}:{bound[1]}"
    click.echo(f"moescope serve: {where}: front end over {world_size} expert-parallel ranks (requests dealt to the "
               "least outstanding rank; /health shows each)", err=True)
    try:
        summaries, failures = run_ranks(argv_from_context(ctx, LAUNCHER_ONLY), world_size, timeout, run_dir=run_dir,
                                        signal_stops=True, tee=True)  # the ranks' logs, prefixed, as they come
    finally:
        front.should_exit = True
        thread.join(30)
        shutil.rmtree(run_dir, ignore_errors=True)
    if failures or any(s is None for s in summaries):  # a rank that left no summary did not stop as asked
        report_failures(failures, world_size, missing=[r for r, s in enumerate(summaries) if s is None])
    served = [s["served"] if s else None for s in summaries]
    click.echo(f"moescope serve: stopped after {sum(s or 0 for s in served)} requests ("
               + ", ".join(f"rank {r}: {'?' if s is None else s}" for r, s in enumerate(served)) + ")", err=True)
    return 0
