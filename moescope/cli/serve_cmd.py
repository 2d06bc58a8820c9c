"""``moescope serve``: an OpenAI-compatible HTTP API on the reference runtime (docs/serve.md).

The command only maps flags: ``assemble`` builds the observed engine (model, faults, mitigations, metrics,
trace store, OTLP, expert cache, canary) through the one assembly point, from the same option decorators as
``demo`` (``cli.config_options``), and ``moescope.serve`` does the serving.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from contextlib import ExitStack

import click

from moescope.cli.config_options import (InstrumentOptions, ModelOptions, build_config, build_model,
                                         instrument_options, instrumented, model_options)
from moescope.cli import demo_parallel, serve_parallel
from moescope.cli.demo_parallel import fleet_settings, rank_options, validate_launch
from moescope.config import Config
from moescope.errors import BadInput, MoescopeError
from moescope.parallel.spawn import ENV_SUMMARY, write_summary
from moescope.serve import server


class RankEngineDied(MoescopeError):
    """An expert-parallel rank's engine thread died: the rank leaves with this one line (its error file) and exit 1,
    so the agent ends the fleet and the launcher names this rank."""

    exit_code = 1

# Scenarios that need the demo's synthetic traffic: a server has none.
DEMO_ONLY_SETTINGS = {"traffic_shift": "drift"}
RANK_ONLY = ("placement_spec", "slow_rank", "delay_ms", "timeout")  # flags that mean nothing on one process


@dataclasses.dataclass(frozen=True)
class RankSetup:
    """One expert-parallel rank's place: ``rank`` of ``world``, its experts, the slow-rank fault, the peer timeout."""

    rank: int
    world: int
    placement_spec: str
    slow_rank: int | None
    delay_ms: float
    timeout: float


@dataclasses.dataclass(frozen=True)
class ServePlan:
    """``moescope serve``'s options, checked (``plan``): what ``run_server`` (or, for the launcher's front end,
    ``launch_ranks``) assembles. ``ranks``: this process is one expert-parallel rank under the launcher; ``world`` > 1
    without it: this process is the launcher."""

    model: ModelOptions
    config: Config  # this process's one Config (``build_config``)
    served: tuple[str, ...]  # --served-model-name, each once
    world: int  # the ranks: --world-size, or the scenarios' (slow-rank: 2)
    ranks: RankSetup | None
    placement_spec: str
    slow_rank: int | None
    timeout: float  # a peer's exchange timeout (expert-parallel ranks)
    max_queue: int
    request_timeout: float
    shutdown_timeout: float
    log_level: str
    access_log: bool
    debug: bool

    @property
    def launcher(self) -> bool:
        return self.ranks is None and self.world > 1


def served_model_names(served_names) -> tuple[str, ...]:
    """--served-model-name, each once; an empty one is one line, exit 2."""
    served = tuple(dict.fromkeys(n.strip() for n in served_names))
    if any(not n for n in served):
        raise BadInput("--served-model-name must not be empty")
    return served


def plan(ctx: click.Context, model: ModelOptions, instrument: InstrumentOptions, *, served: tuple[str, ...],
         rank_env: tuple[int, int] | None, world_size: int, placement_spec: str, slow_rank: int | None,
         delay_ms: float, timeout: float, **http) -> ServePlan:
    """Check the options (each bad one: one line, exit 2; nothing started yet) and return what to run.
    ``rank_env``: (rank, world) under the launcher (``parallel.launch.env_rank``); ``http``: ``ServePlan``'s
    serving fields as given."""
    rank, world = rank_env or (0, 1)
    config = build_config(instrument, model, rank=rank, world=world)
    world, slow_rank, delay_ms = fleet_settings(config, world_size, slow_rank, delay_ms)
    ranks = RankSetup(*rank_env, placement_spec, slow_rank, delay_ms, timeout) if rank_env is not None else None
    if ranks is None and world <= 1:
        given = [f"--{name.replace('_spec', '').replace('_', '-')}" for name in RANK_ONLY
                 if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
        if given:
            raise BadInput(f"{', '.join(given)}: for expert-parallel ranks; give --world-size N (N > 1) too")
    out = ServePlan(model, config, served, world, ranks, placement_spec, slow_rank, timeout, **http)
    if not out.launcher:  # (the launcher's ranks each check their own)
        asked = config.settings.asked()
        for key, name in DEMO_ONLY_SETTINGS.items():
            if key in asked:
                raise BadInput(f"--scenario {name} needs the demo's synthetic traffic; run it with "
                               "`moescope demo --scenario " + name + "`")
    return out


def assemble(stack: ExitStack, model: ModelOptions, config, ranks: RankSetup | None = None):
    """Model, instrumentation and engine from the parsed options' ``config`` (``build_config``), through the one
    assembly point (``moescope.instrument``); everything it opens is closed by ``stack``. ``ranks``: this process is
    one expert-parallel rank (it joins the group and holds its experts first). Returns (engine, instrumentation,
    recorder or None, the rank's ``ExpertParallel`` or None)."""
    ep = None
    if ranks is not None:
        model = demo_parallel.rank_model(model, ranks.rank)  # CUDA: this rank's own GPU
    net = build_model(model, config)
    if ranks is not None:
        a2a, monitor, ep = demo_parallel.setup_rank(stack, net, ranks.rank, ranks.world, ranks.placement_spec,
                                                    ranks.slow_rank, ranks.delay_ms, ranks.timeout)
        config = dataclasses.replace(config, observers=(a2a, monitor))
    inst = stack.enter_context(instrumented(net, config))
    for line in inst.notices:
        click.echo(line, err=True)
    return inst.engine(max_batch=model.max_batch, seed=model.seed, lockstep=ep), inst, inst.recorder, ep


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (loopback unless you say so).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0: any free port.")
@click.option("--max-queue", type=click.IntRange(min=0), default=128, show_default=True,
              help="Requests waiting for a batch slot; beyond it a request gets 429 with Retry-After. 0: unbounded.")
@click.option("--served-model-name", "served_names", multiple=True, metavar="NAME",
              help="The model name clients send and /v1/models lists (repeat for aliases) [the model's own name]; "
                   "the trace store keeps the model's own name.")
@click.option("--request-timeout", type=click.FloatRange(min=0), default=600.0, show_default=True,
              help="Seconds from arrival before a request ends as 'timeout' (408; stored); 0: none.")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM, seconds in-flight requests may take to finish before they are cancelled.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True, help="uvicorn's log level.")
@click.option("--access-log", is_flag=True, help="Log every HTTP request (off: the trace store has them).")
@click.option("--debug-endpoints", is_flag=True,
              help="Fault injection for tests and drills: POST /debug/kill-engine, POST /debug/poison. Never in "
                   "production.")
@rank_options
@model_options
@instrument_options
def serve(host, port, max_queue, served_names, request_timeout, shutdown_timeout, log_level, access_log,
          debug_endpoints, world_size, placement_spec, slow_rank, delay_ms, timeout, model: ModelOptions,
          instrument: InstrumentOptions) -> int:
    """Serve the OpenAI completions and chat completions API on the reference MoE runtime.

    Each response's id (and x-request-id header) opens in `moescope trace ID`. With --world-size N, one front
    end deals the requests to N expert-parallel ranks (data-parallel attention) under torchrun's agent.
    """
    try:  # a missing extra: one line that names it
        # optional: fastapi, uvicorn (the serve extra)
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise BadInput(f"moescope serve needs FastAPI and uvicorn ({exc.name} is missing): "
                       "pip install 'moescope[serve]'") from None
    served = served_model_names(served_names)
    # start-up: torch and numpy (parallel.launch), not for --help
    from moescope.parallel.launch import env_rank

    rank_env = env_rank()  # under the launcher: one rank, on a loopback port of its own the front end forwards to
    sock = server.bind("127.0.0.1", 0) if rank_env else server.bind(host, port)  # before torch and the model load
    ctx = click.get_current_context()
    try:
        p = plan(ctx, model, instrument, served=served, rank_env=rank_env, world_size=world_size,
                 placement_spec=placement_spec, slow_rank=slow_rank, delay_ms=delay_ms, timeout=timeout,
                 max_queue=max_queue, request_timeout=request_timeout, shutdown_timeout=shutdown_timeout,
                 log_level=log_level, access_log=access_log, debug=debug_endpoints)
    except BaseException:
        sock.close()
        raise
    if p.launcher:
        return launch_ranks(ctx, p, sock)
    return run_server(p, sock)


def launch_ranks(ctx: click.Context, p: ServePlan, sock) -> int:
    """The launcher: the front end on ``sock``, the ranks under torchrun's agent (``cli.serve_parallel``)."""
    with sock:
        net, _ = validate_launch(p.model, p.config, p.world, p.placement_spec, p.slow_rank)  # one line, before any rank
        return serve_parallel.launch(ctx, sock, p.world, model=net.cfg.name,
                                     # a rank's worst-case exit: its drain, then its peers' agreement to leave
                                     timeout=p.shutdown_timeout + server.BACKSTOP_S + p.timeout,
                                     log_level=p.log_level, access_log=p.access_log, debug=p.debug)


def run_server(p: ServePlan, sock) -> int:
    """One process serving on ``sock`` (alone, or one expert-parallel rank): assemble the engine, serve until
    SIGTERM, flush."""
    # optional: fastapi, pydantic, starlette (serve.app, serve.loop, serve.protocol; the serve extra)
    from moescope.serve import app as app_mod
    from moescope.serve.loop import EngineLoop
    from moescope.serve.protocol import ModelLimits

    ranks = p.ranks
    with ExitStack() as stack:
        stack.callback(sock.close)
        engine, inst, recorder, ep = assemble(stack, p.model, p.config, ranks)
        loop = EngineLoop(engine, max_queue=p.max_queue, request_timeout_s=p.request_timeout or None, ranks=ep)
        if ranks is not None:  # a rank whose engine died stops serving (its peers cannot step without it)
            loop.on_death = lambda exc: os.kill(os.getpid(), signal.SIGTERM)
        # first out: cancels what is left, before the recorder flushes (a rank: once every rank closes)
        stack.callback(loop.close, p.shutdown_timeout + server.BACKSTOP_S + (p.timeout if ep is not None else 0))
        cfg = engine.model.cfg
        service = app_mod.Service(loop, ModelLimits(cfg.name, cfg.max_seq_len, p.served, cfg.vocab_size),
                                  debug=p.debug)
        bound = sock.getsockname()
        where = f"http://{'[' + bound[0] + ']' if ':' in bound[0] else bound[0]}:{bound[1]}"
        click.echo(f"moescope serve: {where} (model {service.limits.name}"
                   + (f" served as {', '.join(p.served)}" if p.served else "")
                   + f", max batch {engine.max_batch}, queue {p.max_queue or 'unbounded'}); metrics "
                   f"{inst.exporter.url if inst.exporter else 'off'}; traces {recorder.path if recorder else 'off'}",
                   err=True)
        if ranks is not None:
            # optional: fastapi, httpx (serve.fleet; the serve extra)
            from moescope.serve.fleet import address_file

            addr = address_file(os.environ[ENV_SUMMARY], ranks.rank)  # the front end finds it here
            addr.with_suffix(".tmp").write_text(where)
            os.replace(addr.with_suffix(".tmp"), addr)  # whole or absent: never a half-written address
        server.run(app_mod.create_app(service), service, sock, shutdown_timeout_s=p.shutdown_timeout,
                   log_level=p.log_level, access_log=p.access_log)
        if ranks is not None and loop.died is not None:
            why = loop.died if isinstance(loop.died, MoescopeError) else repr(loop.died)
            raise RankEngineDied(f"rank {ranks.rank}: the engine thread died: {why}")
    if ranks is not None:
        write_summary({"rank": ranks.rank, "served": loop.served})
    click.echo(f"moescope serve: stopped after {loop.served} requests"
               + (f"; traces flushed to {recorder.path} ({recorder.written} stored)" if recorder else ""), err=True)
    return 0
