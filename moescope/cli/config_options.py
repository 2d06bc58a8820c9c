"""The flags that map onto ``moescope.Config`` (and the model it instruments), shared by every command that
serves: ``demo`` and ``serve`` take these decorators and call ``config_from_options``; nothing else builds
the pipeline. Parameter names are the contract (``o["cache_size"]`` ...)."""

from __future__ import annotations

import functools

import click

from moescope.cli.options import traces_option
from moescope.errors import BadInput
from moescope.runtime import routers_cache


def _stack(*options):
    def deco(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn
    return deco


def _weights(o: dict) -> str | None:
    return None if o["weights"] == "random" else o["weights"]


def _announcing(command):
    """The command, first saying on stderr how its model will be built where that takes a while (a production
    shape's balanced routers): before the command's body imports torch, so progress shows within a second."""
    @functools.wraps(command)
    def announced(**o):
        routers_cache.announce(o["model_spec"], _weights(o))
        return command(**o)
    return announced


model_options = _stack(
    click.option("--model", "model_spec", default="tiny-demo", show_default=True,
                 help="Preset name, .json/.yaml config, or .safetensors weights file."),
    click.option("--weights", default="auto", show_default=True,
                 help="safetensors file, 'auto' (bundled demo weights for tiny-demo) or 'random'."),
    click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N."),
    click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32",
                 show_default=True),
    click.option("--capacity-factor", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="Per-expert capacity factor (drops slots beyond it); default: no capacity limit."),
    click.option("--max-batch", type=click.IntRange(min=1), default=16, show_default=True),
    click.option("--seed", type=int, default=0, show_default=True, help="Seeds traffic and sampling."),
    _announcing,  # innermost: wraps the command's body itself
)

instrument_options = _stack(
    click.option("--metrics-port", type=click.IntRange(min=-1, max=65535), default=9400, show_default=True,
                 help="Serve Prometheus metrics on this port (0: any free port; -1: no exporter)."),
    click.option("--metrics-addr", default="127.0.0.1", show_default=True, help="Exporter bind address."),
    traces_option(allow_none=True, help="Trace store (SQLite) for per-token traces.", writes=True),
    click.option("--otlp-endpoint", default=None, metavar="URL",
                 help="Also export each kept request's spans over OTLP/HTTP (e.g. http://127.0.0.1:4318, an "
                      "OpenTelemetry Collector). Needs --traces (the trace recorder makes the spans)."),
    click.option("--trace-sample", type=click.FloatRange(0, 1), default=1.0, show_default=True,
                 help="Share of ordinary requests traced (anomalous ones are always kept)."),
    click.option("--record-routing", type=click.Path(dir_okay=False), default=None,
                 help="Write the experts each forward used per layer (input of `moescope cache-sim`)."),
    click.option("--cache-size", type=int, default=None,
                 help="Resident experts per MoE layer (1..E); the rest load on demand. Default: all resident."),
    click.option("--cache-policy", type=click.Choice(["lru", "lfu", "static", "none"]), default=None,
                 help="Replacement policy [lru] (static pins the most used experts of a calibration pass)."),
    click.option("--cache-tier", type=click.Choice(["memory", "disk"]), default=None,
                 help="Where non-resident experts live [memory]: host memory, or a safetensors file read via "
                      "mmap."),
    click.option("--cache-prefetch", type=click.IntRange(min=0), default=0, show_default=True,
                 help="Experts per layer a loader thread stages ahead (0: off)."),
    click.option("--cache-file", type=click.Path(dir_okay=False), default=None,
                 help="Disk tier file (default: a temporary file, removed at exit)."),
    click.option("--scenario", default="healthy", show_default=True,
                 help="Fault scenario(s), comma-separated: healthy, collapse, imbalance, hot, jitter, nan, "
                      "thrash, switch-jitter, slow-rank, drop, drift, leak (real changes to the engine, never to "
                      "metrics). Sizes: collapse=BIAS, imbalance=SCALE, jitter=SD, drop=CAPACITY_FACTOR; "
                      "hot=LAYER:EXPERT:Fx (one expert of one MoE layer at F times its fair share on "
                      "calibration traffic) or hot=LAYER:EXPERT:BIAS (a logit bias)."),
    click.option("--canary-interval", type=click.FloatRange(min=0), default=5.0, show_default=True,
                 help="Seconds between canary routing runs (flip ratio per layer); 0: off."),
    click.option("--canary-steps", type=click.IntRange(min=1), default=None,
                 help="Run the canary every N engine steps instead (expert-parallel ranks always do: they must "
                      "run it at the same step) [with --world-size > 1: 32]."),
    click.option("--baseline", "baseline_path", type=click.Path(dir_okay=False), default=None,
                 help="The model's healthy baseline (`moescope baseline save`): imbalance, hot and dead experts "
                      "and drift are judged against it."),
    click.option("--metrics-window", "metrics_window", type=click.FloatRange(min=1), default=60.0,
                 show_default=True,
                 help="Seconds of routing the window gauges cover: a longer window holds more requests, so thin "
                      "traffic is judged (hot experts, imbalance), later."),
    click.option("--load-aware", "load_bound", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="Load-aware routing: demote experts whose estimated load exceeds this share of their "
                      "capacity (e.g. 0.85; capacity = 1.5 x the fair share). Default: off."),
    click.option("--smoothing", "smoothing_margin", type=click.FloatRange(min=0), default=None,
                 help="Router smoothing: a position whose prefix was routed before keeps its experts unless "
                      "the new choice has this much more router probability (e.g. 0.02). Default: off."),
    click.option("--router-impl", type=click.Choice(["auto", "torch", "triton"]), default="auto",
                 show_default=True,
                 help="Router path: the fused Triton kernel (auto: on CUDA when triton is installed) or torch."),
)

LOCKSTEP_CANARY_STEPS = 32  # expert-parallel ranks: the canary forward is a collective, run at the same step


def config_from_options(o: dict, *, rank: int = 0, world: int = 1, observers=(), baseline=None):
    """The ``moescope.Config`` the parsed options ``o`` describe, for ``rank`` of ``world`` expert-parallel
    ranks (each rank exports its own routing on metrics port + rank; into a trace lake every rank writes its own
    requests, in its own ``replica=`` partition; a SQLite store is rank 0's alone, one writer per file). ``baseline``:
    a drift reference computed by the caller, used when no ``--baseline`` file is given."""
    from moescope.config import Cache, Canary, Config, Metrics, Mitigations, Traces
    from moescope.metrics.state import EXPERT_SERIES_BUDGET

    traces_path = o.get("traces_path")
    if o.get("otlp_endpoint") and traces_path == "none":
        raise BadInput("--otlp-endpoint exports the trace recorder's spans: it needs --traces (not none)")
    port = o["metrics_port"]
    traces = None
    from moescope.traces import lake

    if traces_path != "none" and (rank == 0 or lake.is_lake(traces_path)):
        traces = Traces(traces_path, sample=o["trace_sample"], seed=o["seed"], otlp_endpoint=o.get("otlp_endpoint"))
    cache = None
    if o["cache_size"] is not None or o["cache_policy"] or o["cache_tier"] or o["cache_prefetch"]:
        cache = Cache(size=o["cache_size"], policy=o["cache_policy"] or "lru", tier=o["cache_tier"] or "memory",
                      prefetch=o["cache_prefetch"], file=o["cache_file"], calibration_seed=o["seed"])
    canary = None
    if o["canary_interval"] > 0:
        steps = o.get("canary_steps") or (LOCKSTEP_CANARY_STEPS if world > 1 else None)
        canary = Canary(interval_s=o["canary_interval"], every_steps=steps)
    mitigations = None
    if o["load_bound"] is not None or o["smoothing_margin"] is not None:
        mitigations = Mitigations(load_bound=o["load_bound"], smoothing_margin=o["smoothing_margin"])
    return Config(
        metrics=Metrics(port=None if port < 0 else port + (rank if port > 0 else 0), addr=o["metrics_addr"],
                        rank=rank, baseline=o["baseline_path"] or baseline,
                        # W ranks share one process's per-expert series budget: the fleet's stays within it
                        expert_series_budget=None if world == 1 else EXPERT_SERIES_BUDGET // world,
                        window_s=o.get("metrics_window") or 60.0),
        traces=traces, routing_log=o.get("record_routing") if rank == 0 else None, cache=cache, canary=canary,
        mitigations=mitigations, scenarios=tuple(s.strip() for s in o["scenario"].split(",") if s.strip()),
        router_impl=o["router_impl"], observers=tuple(observers))


def build_model(o: dict, config):
    """The model the options name, with the scenarios' model overrides (``drop``: a capacity limit)."""
    from moescope.runtime import loader

    return loader.build_model(o["model_spec"], weights=_weights(o), device=o["device"], dtype=o["dtype"],
                              **config.model_overrides(o["capacity_factor"]))
