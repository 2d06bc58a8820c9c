"""The flags that map onto ``moescope.Config`` (and the model it instruments), shared by every command that
serves: ``demo`` and ``serve`` take these option groups and call ``build_config``; nothing else builds the
pipeline. Each group reaches the command as one frozen object (``ModelOptions``, ``InstrumentOptions``), parsed
once by click; the field names are the option's parameter names."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import click

import moescope
from moescope.cli.options import option_group, traces_option
from moescope.config import Cache, Canary, Config, Metrics, Mitigations, Traces
from moescope.errors import BadInput
from moescope.runtime import routers_cache
from moescope.traces import lake

# The options that say which model, shared by every command that loads one (``check`` takes only these).
MODEL_SOURCE = (
    click.option("--model", "model_spec", default="tiny-demo", show_default=True,
                 help="Preset name, .json/.yaml config, or .safetensors weights file."),
    click.option("--weights", default="auto", show_default=True,
                 help="safetensors file, 'auto' (bundled demo weights for tiny-demo) or 'random'."),
    click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N."),
)


@dataclass(frozen=True)
class ModelSource:
    """``--model --weights --device``."""

    model_spec: str
    weights: str
    device: str

    def load(self, **overrides):
        """The model these options name (``weights random``: a seeded random init)."""
        # start-up: torch (runtime.loader), only when the command runs, not for --help
        from moescope.runtime import loader

        return loader.build_model(self.model_spec, weights=self.weights_arg, device=self.device, **overrides)

    @property
    def weights_arg(self) -> str | None:
        """``--weights`` as the loader takes it (``random``: None, a seeded random init)."""
        return None if self.weights == "random" else self.weights


@dataclass(frozen=True)
class ModelOptions(ModelSource):
    """The model and how the engine runs it: ``ModelSource`` and ``--dtype --capacity-factor --max-batch
    --seed``."""

    dtype: str
    capacity_factor: float | None
    max_batch: int
    seed: int


@dataclass(frozen=True)
class InstrumentOptions:
    """What observes the model (metrics, traces, OTLP, routing log), the expert cache, faults, canary, baseline
    and mitigations: the flags ``build_config`` maps onto a ``moescope.Config``."""

    metrics_port: int
    metrics_addr: str
    traces_path: str
    otlp_endpoint: str | None
    trace_sample: float
    record_routing: str | None
    cache_size: int | None
    cache_policy: str | None
    cache_tier: str | None
    cache_prefetch: int
    cache_file: str | None
    scenario: str
    fault_after: float | None
    canary_interval: float
    canary_steps: int | None
    baseline_path: str | None
    metrics_window: float
    hot_reference: str
    peak_bandwidth: float | None
    peak_flops: float | None
    load_bound: float | None
    smoothing_margin: float | None
    router_impl: str

    @property
    def scenarios(self) -> tuple[str, ...]:
        return tuple(s.strip() for s in self.scenario.split(",") if s.strip())


model_source_options = option_group(ModelSource, "source", *MODEL_SOURCE)

def _announcing(command):
    """The command, first saying on stderr how its model will be built where that takes a while (a production
    shape's balanced routers): before the command's body imports torch, so progress shows within a second."""
    @functools.wraps(command)
    def announced(*args, model: ModelOptions, **kw):
        routers_cache.announce(model.model_spec, model.weights_arg)
        return command(*args, model=model, **kw)
    return announced


_model_group = option_group(
    ModelOptions, "model", *MODEL_SOURCE,
    click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32",
                 show_default=True),
    click.option("--capacity-factor", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="Per-expert capacity factor (drops slots beyond it); default: no capacity limit."),
    click.option("--max-batch", type=click.IntRange(min=1), default=16, show_default=True),
    click.option("--seed", type=int, default=0, show_default=True, help="Seeds traffic and sampling."),
)


def model_options(command):
    """``ModelOptions`` as the keyword ``model``; the command announces a long model build before its body runs."""
    return _model_group(_announcing(command))


instrument_options = option_group(
    InstrumentOptions, "instrument",
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
    click.option("--fault-after", "fault_after", type=click.FloatRange(min=0), default=None,
                 help="Switch the scenario's router faults (collapse, imbalance, hot, jitter) on this many seconds "
                      "after start; the model routes as healthy until then (a fault that appears mid-run). "
                      "Default: from the start."),
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
    click.option("--hot-reference", "hot_reference", type=click.Choice(["learned", "fair"]), default="learned",
                 show_default=True,
                 help="Without --baseline, what a hot expert is judged against: learned (the share this run's "
                      "first full window gave it, followed slowly: a page means its share rose) or fair (1/E "
                      "from the first window: also pages experts that are popular by design)."),
    click.option("--peak-bandwidth", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="The device's peak memory bandwidth, bytes/s, for S-MBU [MOESCOPE_PEAK_BANDWIDTH, else the "
                      "GPU's datasheet figure by its name; on CPU: none]."),
    click.option("--peak-flops", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="The device's peak FLOP/s, for S-MFU [MOESCOPE_PEAK_FLOPS, else the GPU's datasheet dense "
                      "BF16 figure; on CPU: none]."),
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


def build_config(i: InstrumentOptions, model: ModelOptions, *, rank: int = 0, world: int = 1, observers=(),
                 baseline=None):
    """The ``moescope.Config`` the options describe, for ``rank`` of ``world`` expert-parallel ranks (each rank
    exports its own routing on metrics port + rank; into a trace lake every rank writes its own requests, in its
    own ``replica=`` partition; a SQLite store is rank 0's alone, one writer per file). ``baseline``: a drift
    reference computed by the caller, used when no ``--baseline`` file is given."""
    # start-up: numpy, torch (metrics.state), only when the command runs, not for --help
    from moescope.metrics.state import EXPERT_SERIES_BUDGET

    if i.otlp_endpoint and i.traces_path == "none":
        raise BadInput("--otlp-endpoint exports the trace recorder's spans: it needs --traces (not none)")
    port = i.metrics_port
    traces = None
    if i.traces_path != "none" and (rank == 0 or lake.is_lake(i.traces_path)):
        traces = Traces(i.traces_path, sample=i.trace_sample, seed=model.seed, otlp_endpoint=i.otlp_endpoint)
    cache = None
    if i.cache_size is not None or i.cache_policy or i.cache_tier or i.cache_prefetch:
        cache = Cache(size=i.cache_size, policy=i.cache_policy or "lru", tier=i.cache_tier or "memory",
                      prefetch=i.cache_prefetch, file=i.cache_file, calibration_seed=model.seed)
    canary = None
    if i.canary_interval > 0:
        steps = i.canary_steps or (LOCKSTEP_CANARY_STEPS if world > 1 else None)
        canary = Canary(interval_s=i.canary_interval, every_steps=steps)
    mitigations = None
    if i.load_bound is not None or i.smoothing_margin is not None:
        mitigations = Mitigations(load_bound=i.load_bound, smoothing_margin=i.smoothing_margin)
    return Config(
        metrics=Metrics(port=None if port < 0 else port + (rank if port > 0 else 0), addr=i.metrics_addr,
                        rank=rank, baseline=i.baseline_path or baseline,
                        # W ranks share one process's per-expert series budget: the fleet's stays within it
                        expert_series_budget=None if world == 1 else EXPERT_SERIES_BUDGET // world,
                        window_s=i.metrics_window, hot_reference=i.hot_reference,
                        peak_bandwidth=i.peak_bandwidth, peak_flops=i.peak_flops),
        traces=traces, routing_log=i.record_routing if rank == 0 else None, cache=cache, canary=canary,
        mitigations=mitigations, scenarios=i.scenarios, fault_after_s=i.fault_after, router_impl=i.router_impl,
        observers=tuple(observers))


def instrumented(net, config):
    """``moescope.instrument(net, config)`` for a command: a metrics port that cannot be bound is named by the flag
    that chose it (the library's error names no flag)."""
    # start-up: numpy, torch (metrics.exporter), only when the command runs, not for --help
    from moescope.metrics.exporter import BindError

    try:
        return moescope.instrument(net, config)
    except BindError as exc:
        rank = config.metrics.rank
        own = f" (rank {rank} serves on --metrics-port + {rank})" if rank else ""
        raise BadInput(f"{exc}; pick another --metrics-port{own} (0: any free port; -1: no exporter)") from None


def build_model(model: ModelOptions, config):
    """The model the options name, with the scenarios' model overrides (``drop``: a capacity limit)."""
    return model.load(dtype=model.dtype, **config.model_overrides(model.capacity_factor))
