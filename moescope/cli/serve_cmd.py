"""``moescope serve``: an OpenAI-compatible HTTP API on the reference runtime (docs/serve.md).

The command only maps flags: ``assemble`` builds the observed engine (model, faults, mitigations, metrics,
trace store, OTLP, expert cache, canary) through the one assembly point, from the same option decorators as
``demo`` (``cli.config_options``), and ``moescope.serve`` does the serving.
"""

from __future__ import annotations

from contextlib import ExitStack

import click

from moescope.cli.config_options import (InstrumentOptions, ModelOptions, build_config, build_model,
                                         instrument_options, model_options)
from moescope.errors import BadInput

# Scenarios that need the demo's synthetic traffic or several ranks: a server has neither.
DEMO_ONLY_SETTINGS = {"traffic_shift": "drift", "world_size": "slow-rank"}


def assemble(stack: ExitStack, model: ModelOptions, instrument: InstrumentOptions):
    """Model, instrumentation and engine from the parsed options, through the one assembly point (``build_config``
    -> ``moescope.instrument``); everything it opens is closed by ``stack``. Returns (engine, instrumentation,
    recorder or None)."""
    import moescope

    config = build_config(instrument, model)
    asked = config.settings.asked()
    for key, name in DEMO_ONLY_SETTINGS.items():
        if key in asked:
            raise BadInput(f"--scenario {name} needs the demo's synthetic traffic or several ranks; run it with "
                           "`moescope demo --scenario " + name + "`")
    net = build_model(model, config)
    inst = stack.enter_context(moescope.instrument(net, config))
    for line in inst.notices:
        click.echo(line, err=True)
    return inst.engine(max_batch=model.max_batch, seed=model.seed), inst, inst.recorder


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
@model_options
@instrument_options
def serve(host, port, max_queue, served_names, request_timeout, shutdown_timeout, log_level, access_log,
          debug_endpoints, model: ModelOptions, instrument: InstrumentOptions) -> int:
    """Serve the OpenAI completions and chat completions API on the reference MoE runtime.

    Each response's id (and x-request-id header) opens in `moescope trace ID`.
    """
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise BadInput(f"moescope serve needs FastAPI and uvicorn ({exc.name} is missing): "
                       "pip install 'moescope[serve]'") from None
    served = tuple(dict.fromkeys(n.strip() for n in served_names))
    if any(not n for n in served):
        raise BadInput("--served-model-name must not be empty")
    from moescope.serve import server

    sock = server.bind(host, port)  # before torch and the model load: a taken port is a one-line error at once
    from moescope.serve import app as app_mod
    from moescope.serve.loop import EngineLoop
    from moescope.serve.protocol import ModelLimits

    with ExitStack() as stack:
        stack.callback(sock.close)
        engine, inst, recorder = assemble(stack, model, instrument)
        loop = EngineLoop(engine, max_queue=max_queue, request_timeout_s=request_timeout or None)
        stack.callback(loop.close)  # first out: cancels what is left, before the recorder flushes
        cfg = engine.model.cfg
        service = app_mod.Service(loop, ModelLimits(cfg.name, cfg.max_seq_len, served, cfg.vocab_size),
                                  debug=debug_endpoints)
        bound = sock.getsockname()
        where = f"http://{'[' + bound[0] + ']' if ':' in bound[0] else bound[0]}:{bound[1]}"
        click.echo(f"moescope serve: {where} (model {service.limits.name}"
                   + (f" served as {', '.join(served)}" if served else "")
                   + f", max batch {engine.max_batch}, queue {max_queue or 'unbounded'}); metrics "
                   f"{inst.exporter.url if inst.exporter else 'off'}; traces {recorder.path if recorder else 'off'}",
                   err=True)
        server.run(app_mod.create_app(service), service, sock, shutdown_timeout_s=shutdown_timeout,
                   log_level=log_level, access_log=access_log)
    click.echo(f"moescope serve: stopped after {loop.served} requests"
               + (f"; traces flushed to {recorder.path} ({recorder.written} stored)" if recorder else ""), err=True)
    return 0
