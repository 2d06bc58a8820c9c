"""``moescope serve``: an OpenAI-compatible HTTP API on the reference runtime (docs/serve.md).

The command only maps flags: ``assemble`` builds the observed engine (model, faults, mitigations, metrics,
trace store, OTLP, expert cache, canary) exactly as ``demo`` does, from the demo's own option definitions,
and ``moescope.serve`` does the serving. When the shared assembly point lands, ``assemble`` is what switches.
"""

from __future__ import annotations

import os
from contextlib import ExitStack

import click

from moescope.errors import BadInput

# The demo's options that apply to a server, reused as they are defined there (one definition, one help text).
DEMO_OPTIONS = ("model_spec", "weights", "device", "dtype", "max_batch", "capacity_factor", "cache_size",
                "cache_policy", "cache_tier", "cache_prefetch", "cache_file", "metrics_port", "metrics_addr",
                "traces_path", "otlp_endpoint", "trace_sample", "scenario", "canary_interval", "baseline_path",
                "load_bound", "smoothing_margin", "router_impl", "seed")
# Scenarios that need the demo's synthetic traffic or several ranks: a server has neither.
DEMO_ONLY_SETTINGS = {"traffic_shift": "drift", "world_size": "slow-rank"}


def _demo_options(fn):
    from moescope.cli.demo import demo

    by_name = {p.name: p for p in demo.params}
    missing = [n for n in DEMO_OPTIONS if n not in by_name]
    if missing:  # the demo renamed an option: fail loudly at import, not at a user's first serve
        raise RuntimeError(f"serve reuses demo options that no longer exist: {missing}")
    fn.__click_params__ = getattr(fn, "__click_params__", []) + [by_name[n] for n in reversed(DEMO_OPTIONS)]
    return fn


def assemble(stack: ExitStack, o: dict):
    """Model, instrumentation, trace recorder and engine from the parsed options ``o``; everything it opens is
    closed by ``stack``. Returns (engine, instrumentation, recorder or None)."""
    import moescope
    from moescope.cli.demo import _default_traces, _expert_cache
    from moescope.runtime import faults, loader
    from moescope.runtime.engine import Engine

    scenarios = faults.parse(o["scenario"])
    settings = faults.demo_settings(scenarios)
    for key, name in DEMO_ONLY_SETTINGS.items():
        if key in settings:
            raise BadInput(f"--scenario {name} needs the demo's synthetic traffic or several ranks; run it with "
                           "`moescope demo --scenario " + name + "`")
    cache_size = settings.get("cache_size", o["cache_size"])
    cache_policy = settings.get("cache_policy", o["cache_policy"])
    cache_tier = settings.get("cache_tier", o["cache_tier"])
    capacity = settings.get("capacity_factor", o["capacity_factor"])
    model = loader.build_model(o["model_spec"], weights=None if o["weights"] == "random" else o["weights"],
                               device=o["device"], dtype=o["dtype"],
                               **({"capacity_factor": capacity} if capacity is not None else {}))
    faults.apply(model, scenarios)
    for layer in model.moe_layers():
        layer.router.impl = o["router_impl"]
    if o["load_bound"] is not None or o["smoothing_margin"] is not None:
        from moescope.runtime.router import Mitigation

        for layer in model.moe_layers():
            layer.router.mitigation = Mitigation(load_bound=o["load_bound"], smoothing_margin=o["smoothing_margin"])
    traces_path = o["traces_path"] or os.environ.get("MOESCOPE_TRACES") or str(_default_traces())
    if o["otlp_endpoint"] and traces_path == "none":
        raise BadInput("--otlp-endpoint exports the trace recorder's spans: it needs --traces (not none)")
    recorder, observers = None, []
    if traces_path != "none":
        from moescope.traces.recorder import TraceRecorder

        tracer = None
        if o["otlp_endpoint"]:
            from moescope.traces import otlp

            provider = otlp.tracer_provider(o["otlp_endpoint"], attributes={"moescope.model": model.cfg.name})
            stack.callback(provider.shutdown)  # after the recorder's last spans (the stack unwinds LIFO)
            tracer = provider.get_tracer("moescope")
        recorder = TraceRecorder(traces_path, sample=o["trace_sample"], model=model.cfg.name, seed=o["seed"],
                                 tracer=tracer)
        observers.append(recorder)
    port = o["metrics_port"]
    inst = stack.enter_context(moescope.instrument(model, port=None if port < 0 else port, addr=o["metrics_addr"],
                                                   observers=observers))
    if o["baseline_path"]:
        from moescope.analysis import baseline as bl

        inst.metrics.baseline = bl.load(o["baseline_path"])
    if cache_size is not None or cache_policy or cache_tier or o["cache_prefetch"]:
        stack.enter_context(_expert_cache(model, cache_size, cache_policy or "lru", cache_tier or "memory",
                                          o["cache_prefetch"], o["cache_file"], o["seed"],
                                          settings.get("disk_delay_s")))
    canary = None
    if o["canary_interval"] > 0:
        from moescope.runtime.canary import Canary

        canary = Canary(model, interval_s=o["canary_interval"])
    engine = Engine(model, max_batch=o["max_batch"], seed=o["seed"], canary=canary)
    if settings.get("leak_bytes"):
        engine.leak, engine.leak_bytes = [], settings["leak_bytes"]
    return engine, inst, recorder


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (loopback unless you say so).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0: any free port.")
@click.option("--max-queue", type=click.IntRange(min=1), default=128, show_default=True,
              help="Requests waiting for a batch slot; beyond it a request gets 429 with Retry-After.")
@click.option("--request-timeout", type=click.FloatRange(min=0), default=600.0, show_default=True,
              help="Seconds from arrival before a request ends as 'timeout' (408; stored); 0: none.")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM, seconds in-flight requests may take to finish before they are cancelled.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True, help="uvicorn's log level.")
@click.option("--access-log", is_flag=True, help="Log every HTTP request (off: the trace store has them).")
@_demo_options
def serve(host, port, max_queue, request_timeout, shutdown_timeout, log_level, access_log, **o) -> int:
    """Serve the OpenAI completions and chat completions API on the reference MoE runtime.

    Each response's id (and x-request-id header) opens in `moescope trace ID`.
    """
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise BadInput(f"moescope serve needs FastAPI and uvicorn ({exc.name} is missing): "
                       "pip install 'moescope[serve]'") from None
    from moescope.serve import server

    sock = server.bind(host, port)  # before torch and the model load: a taken port is a one-line error at once
    from moescope.serve import app as app_mod
    from moescope.serve.loop import EngineLoop
    from moescope.serve.protocol import ModelLimits

    with ExitStack() as stack:
        stack.callback(sock.close)
        engine, inst, recorder = assemble(stack, o)
        loop = EngineLoop(engine, max_queue=max_queue, request_timeout_s=request_timeout or None)
        stack.callback(loop.close)  # first out: cancels what is left, before the recorder flushes
        service = app_mod.Service(loop, ModelLimits(engine.model.cfg.name, engine.model.cfg.max_seq_len))
        bound = sock.getsockname()
        where = f"http://{'[' + bound[0] + ']' if ':' in bound[0] else bound[0]}:{bound[1]}"
        click.echo(f"moescope serve: {where} (model {service.limits.name}, max batch {engine.max_batch}, queue "
                   f"{max_queue}); metrics {inst.exporter.url if inst.exporter else 'off'}; traces "
                   f"{recorder.path if recorder else 'off'}", err=True)
        server.run(app_mod.create_app(service), service, sock, shutdown_timeout_s=shutdown_timeout,
                   log_level=log_level, access_log=access_log)
    click.echo(f"moescope serve: stopped after {loop.served} requests"
               + (f"; traces flushed to {recorder.path} ({recorder.written} stored)" if recorder else ""), err=True)
    return 0
