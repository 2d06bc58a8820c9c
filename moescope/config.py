"""The one typed configuration of an instrumented model: what ``moescope.instrument(model, config)`` wires.

Front ends map their flags onto a ``Config`` and nothing else (``moescope demo``, ``moescope serve``);
library users build one directly::

    cfg = moescope.Config(metrics=Metrics(port=9400), traces=Traces("traces.sqlite", sample=0.1),
                          cache=Cache(size=4), scenarios=("jitter",))
    with moescope.instrument(model, cfg) as inst:
        records = inst.engine(max_batch=16).run(requests)

Every sub-config is frozen and checked when built (``ConfigError``, exit 2 at the CLI). ``None`` for a
part means that part is off. Fault scenarios are real changes to what the model and engine do
(``runtime/faults.py``); ``resolved()`` folds the settings they ask for (a tiny cache, a slow disk tier,
a capacity limit) into the other parts, so a scenario and the flag a user would give are one thing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from moescope.errors import ConfigError
from moescope.traces import lake

# The routing window the exporter's ratio gauges cover, and so the first window a learned reference is taken from
# (diagnose learns over the same span by default).
DEFAULT_WINDOW_S = 60.0

if TYPE_CHECKING:
    from moescope.analysis.baseline import Profile
    from moescope.runtime.faults import ScenarioSettings

CACHE_POLICIES = ("lru", "lfu", "static", "none")
CACHE_TIERS = ("memory", "disk")
ROUTER_IMPLS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class Metrics:
    """Prometheus metrics. ``port``: serve them there (0: any free port; None: no exporter, counters only).
    ``export_routing``: False on a rank that routes the same tokens as an exporting rank (ranks given the
    same requests).
    ``expert_series_budget``: None for the metrics' default (docs/metrics.md, "Cardinality").
    ``hot_reference``: without a baseline, what the hot-expert test judges against ("learned": the deployment's
    own first full window, followed slowly; "fair": 1/E; ``metrics.state.MetricsObserver``).
    ``baseline``: the user's healthy baseline (``moescope baseline save``): a file, an
    ``analysis.baseline.Profile`` or {layer: load}; the reference of the hot, dead and drift judgements and
    the source of the ``moescope_baseline_*`` series.
    ``peak_bandwidth`` / ``peak_flops``: the device's peak bytes/s and FLOP/s S-MBU and S-MFU divide by (None:
    ``MOESCOPE_PEAK_BANDWIDTH`` / ``MOESCOPE_PEAK_FLOPS``, else ``moescope.efficiency``'s table by the GPU's
    name; on CPU unknown unless given).
    ``interval_s``: the evaluation interval; ``capture_control``: the capture switch's control file."""

    port: int | None = None
    addr: str = "127.0.0.1"
    model_name: str | None = None
    rank: int = 0
    export_routing: bool = True
    window_s: float = DEFAULT_WINDOW_S
    expert_series_budget: int | None = None
    hot_reference: str = "learned"
    baseline: str | Path | Profile | Mapping[int, Sequence[float]] | None = None
    peak_bandwidth: float | None = None
    peak_flops: float | None = None
    # How often the one evaluator folds, judges, learns and publishes the snapshot every reader serves
    # (``metrics.evaluator``): the exposition is at most this old.
    interval_s: float = 1.0
    # The capture switch's control file (``moescope.capture.switch``; None: $MOESCOPE_CAPTURE_CONTROL, else the
    # user's): ``moescope capture off`` turns capture off in every process that polls it.
    capture_control: str | Path | None = None

    def __post_init__(self) -> None:
        if not 0 < self.interval_s <= 60:
            raise ConfigError(f"metrics interval must be in (0, 60] s, got {self.interval_s}")
        for name in ("peak_bandwidth", "peak_flops"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and 0 < v < float("inf")):
                raise ConfigError(f"{name.replace('_', ' ')} must be a positive number, got {v!r}")
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ConfigError(f"metrics port must be 0..65535 (or None for no exporter), got {self.port}")
        if not self.window_s > 0:
            raise ConfigError(f"metrics window must be > 0 s, got {self.window_s}")
        if self.hot_reference not in ("learned", "fair"):
            raise ConfigError(f"hot reference must be learned or fair, got {self.hot_reference!r}")


@dataclass(frozen=True)
class Traces:
    """The per-token trace store (SQLite) and, with ``otlp_endpoint``, a span per kept request over OTLP/HTTP.
    ``sample``: share of ordinary requests kept (anomalous ones always are); ``seed`` seeds that choice."""

    path: str | Path
    sample: float = 1.0
    seed: int = 0
    otlp_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.sample <= 1:
            raise ConfigError(f"trace sample must be within 0..1, got {self.sample}")

    def for_rank(self, rank: int) -> "Traces":
        """Where rank ``rank`` of a multi-rank deployment writes: rank 0 where it was told; rank r > 0 of a SQLite
        store beside it, ``NAME.rankR.sqlite`` (a SQLite file has one writer); a trace lake (a directory, or a path
        ending in ``/``) takes every rank's files."""
        if rank == 0 or lake.is_lake(self.path):
            return self
        p = Path(self.path)
        return dataclasses.replace(self, path=str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}")))


@dataclass(frozen=True)
class Cache:
    """Expert cache: ``size`` experts resident per MoE layer (None: all), the rest loaded on demand from
    ``tier`` (host memory, or a safetensors ``file`` read via mmap; a temporary one when None). ``prefetch``:
    experts per layer a loader thread stages ahead. ``static`` pins the most used experts of a calibration
    pass over held-out traffic (seeded by ``calibration_seed``). ``disk_delay_s``: (low, high) seconds
    added to every disk load (the switch-jitter fault)."""

    size: int | None = None
    policy: str = "lru"
    tier: str = "memory"
    prefetch: int = 0
    file: str | Path | None = None
    disk_delay_s: tuple[float, float] | None = None
    calibration_seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in CACHE_POLICIES:
            raise ConfigError(f"cache policy must be one of {', '.join(CACHE_POLICIES)}, got {self.policy!r}")
        if self.tier not in CACHE_TIERS:
            raise ConfigError(f"cache tier must be one of {', '.join(CACHE_TIERS)}, got {self.tier!r}")
        if self.prefetch < 0:
            raise ConfigError(f"cache prefetch must be >= 0, got {self.prefetch}")


@dataclass(frozen=True)
class Canary:
    """A fixed batch routed between steps; its flip ratio per layer against the first run. Due every
    ``interval_s`` seconds, or every ``every_steps`` engine steps (expert-parallel ranks: steps, not a clock)."""

    interval_s: float = 5.0
    every_steps: int | None = None

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps <= 0:
            raise ConfigError(f"canary every_steps must be positive, got {self.every_steps}")


@dataclass(frozen=True)
class Mitigations:
    """Router mitigations (docs/design.md): load-aware demotion past ``load_bound`` of capacity; smoothing
    that keeps a seen prefix's experts unless the new choice wins by ``smoothing_margin``."""

    load_bound: float | None = None
    smoothing_margin: float | None = None


@dataclass(frozen=True)
class Config:
    """Everything ``moescope.instrument`` wires around a model. ``observers``: more observers to fan out to
    (a rank's all-to-all stats, your own). ``routing_log``: write every forward's experts per layer there
    at close (the input of ``moescope cache-sim``). ``scenarios``: fault scenario names, each optionally with
    its size (``"drop=0.8"``, ``"hot=3:17:4x"``: ``runtime/faults.py``); ``fault_after_s``: the router faults
    switch on this many seconds after instrumenting (``faults.defer``; None: from the start). A part left unset
    (None, no scenarios, ``router_impl`` None) leaves the model as the caller built it."""

    metrics: Metrics = field(default_factory=Metrics)
    traces: Traces | None = None
    routing_log: str | Path | None = None
    cache: Cache | None = None
    canary: Canary | None = None
    mitigations: Mitigations | None = None
    scenarios: tuple[str, ...] = ()
    fault_after_s: float | None = None
    router_impl: str | None = None
    observers: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        from moescope.runtime import faults  # start-up: torch (runtime.faults), only when __post_init__() runs

        object.__setattr__(self, "scenarios", tuple(faults.parse(",".join(self.scenarios))))
        if self.fault_after_s is not None and not self.fault_after_s >= 0:
            raise ConfigError(f"fault delay must be >= 0 s, got {self.fault_after_s}")
        if self.router_impl is not None and self.router_impl not in ROUTER_IMPLS:
            raise ConfigError(f"router impl must be one of {', '.join(ROUTER_IMPLS)}, got {self.router_impl!r}")

    @property
    def settings(self) -> ScenarioSettings:
        """What the scenarios ask of the runtime around the model (``runtime.faults.DEMO_SETTINGS``)."""
        from moescope.runtime import faults  # start-up: torch (runtime.faults), only when settings() runs

        return faults.demo_settings(list(self.scenarios))

    def resolved(self) -> "Config":
        """This config with the scenarios' cache settings folded in (a scenario wins over a flag)."""
        s = self.settings
        changes = {name: v for name, v in (("size", s.cache_size), ("policy", s.cache_policy),
                                            ("tier", s.cache_tier), ("disk_delay_s", s.disk_delay_s))
                   if v is not None}
        if not changes:
            return self
        return dataclasses.replace(self, cache=dataclasses.replace(self.cache or Cache(), **changes))

    def model_overrides(self, capacity_factor: float | None = None) -> dict:
        """Model-config overrides to build the model with: ``capacity_factor`` (a flag), unless a scenario
        sets one (``drop``)."""
        cf = self.settings.capacity_factor if self.settings.capacity_factor is not None else capacity_factor
        return {} if cf is None else {"capacity_factor": cf}

    def engine_settings(self) -> dict:
        """What the scenarios change in the engine itself (``leak_bytes``: memory retained per step)."""
        leak = self.settings.leak_bytes
        return {} if leak is None else {"leak_bytes": leak}
