"""Real, switchable faults in the reference runtime: they change what the engine computes, and the metrics
then report it honestly (nothing here touches a metric).

Router faults act on the router's logits before the softmax (or sigmoid):
- ``collapse``: a large bias toward one expert in every MoE layer (a broken router bias / bad fine-tune);
- ``imbalance``: a milder graded bias across the experts (skewed routing);
- ``hot``: a bias toward ONE expert of ONE MoE layer (the rest of the model routes as before): the expert
  whose rank becomes the straggler of every all-to-all under expert parallelism;
- ``jitter``: Gaussian noise on the logits from an unseeded generator, so the same input routes differently
  from run to run (non-deterministic routing).
Model faults:
- ``nan``: the embedding rows of the UTF-8 lead bytes of 4-byte characters (emoji) overflow to inf (a
  precision fault on unusual inputs): those tokens' router logits become non-finite.
Faults of the other subsystems are settings of the demo (``DEMO_SETTINGS``): ``thrash`` (a cache far too
small), ``switch-jitter`` (a slow disk tier: every load waits 20-60 ms more), ``slow-rank`` (2 ranks, rank 1
late by 20 ms in every dispatch), ``drop`` (capacity factor 0.5), ``drift`` (the traffic switches to
70% numbers, 30% code halfway, measured against a baseline of the normal mix), ``leak`` (the engine retains 256 KiB
per step: at the demo's ~20 steps/s, 5 MB/s, a process that outgrows a 24 GiB host within the alert's 4 h).
Scenarios compose: ``--scenario collapse,jitter``.

Magnitudes: ``NAME=VALUE`` sets a fault's size (what ``benchmarks/detection.py`` sweeps):
- ``collapse=B``: the bias on expert 0 (default 8);
- ``imbalance=S``: the graded bias scaled by S (default 1: 0.8 on expert 0 down to 0 on the last);
- ``jitter=SD``: the logit noise's standard deviation (default 0.04);
- ``drop=CF``: the capacity factor (default 0.5; smaller drops more);
- ``leak=KIB``: the KiB the engine retains per step (default 256);
- ``hot=LAYER:EXPERT:BIAS`` or ``hot=LAYER:EXPERT:Fx``: a logit bias of BIAS on EXPERT of MoE layer LAYER (the
  layer label metrics use), or the bias that gives the expert F times its fair share (k/E of the slots) on
  calibration traffic (``hot_bias``: measured on held-out prompts, bisected). ``hot`` alone: the middle MoE
  layer's expert 0 at ``default_hot_factor``; ``hot=LAYER:EXPERT``: that expert at it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass

import torch

from moescope.capture.observer import NOOP
from moescope.errors import BadInput
from moescope.runtime.balance import calibration_batch


@dataclass(frozen=True)
class RouterFault:
    bias: tuple[float, ...] | None = None  # added to the logits, per expert
    noise_std: float = 0.0

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            logits = logits + torch.tensor(self.bias, dtype=logits.dtype, device=logits.device)
        if self.noise_std:
            logits = logits + torch.randn_like(logits) * self.noise_std  # unseeded on purpose
        return logits


@dataclass(frozen=True)
class Fault:
    """One parsed scenario item: ``name``, its ``value`` (None: the default magnitude) and, for ``hot``, the
    ``layer`` and ``expert`` with ``factor`` (a target share / fair share; then ``value`` is None)."""

    name: str
    value: float | None = None
    layer: int | None = None
    expert: int | None = None
    factor: float | None = None


ROUTER_SCENARIOS = ("collapse", "imbalance", "jitter")
LAYER_SCENARIOS = ("hot",)
# Demo settings each scenario changes (real engine behaviour, through the same flags a user has).
DEMO_SETTINGS = {
    "thrash": {"cache_size": 1, "cache_policy": "lru"},
    # 7 of 8 pinned: a healthy hit rate (~0.85), but every miss waits on the slow tier
    "switch-jitter": {"cache_size": 7, "cache_policy": "static", "cache_tier": "disk", "disk_delay_s": (0.02, 0.06)},
    "slow-rank": {"world_size": 2, "slow_rank": 1, "delay_ms": 20.0},
    "drop": {"capacity_factor": 0.5},
    "drift": {"traffic_shift": {"numbers": 0.7, "code": 0.3}},
    "leak": {"leak_bytes": 256 * 1024},
}
SCENARIOS = ("healthy", *ROUTER_SCENARIOS, *LAYER_SCENARIOS, "nan", *DEMO_SETTINGS)
# Scenarios that take a magnitude (NAME=VALUE) and the range a value must be in (low, high; open at low).
MAGNITUDES = {"collapse": (0.0, math.inf), "imbalance": (0.0, math.inf), "jitter": (0.0, math.inf),
              "drop": (0.0, math.inf), "leak": (0.0, math.inf)}
COLLAPSE_BIAS, IMBALANCE_SLOPE, JITTER_STD = 8.0, 0.8, 0.04
# ``hot`` without a factor: 5x the fair share, or where a model cannot give one expert that much (every token
# choosing it is E/k times the fair share), three quarters of the way there.
HOT_FACTOR = 5.0
HOT_CALIBRATION_PROMPTS = 32
HOT_MAX_BIAS = 64.0


def default_hot_factor(n_experts: int, top_k: int) -> float:
    return min(HOT_FACTOR, 0.75 * n_experts / top_k)


def spec(item: str) -> Fault:
    """One scenario item (``name`` or ``name=magnitude``) parsed; BadInput naming what is wrong."""
    item = item.strip()
    name, sep, raw = item.partition("=")
    name, raw = name.strip(), raw.strip()
    if name not in SCENARIOS:
        raise BadInput(f"unknown scenario(s) {name}; choose from {', '.join(SCENARIOS)}")
    if not sep:
        return Fault(name)
    if name == "hot":
        return _hot_spec(raw, item)
    if name not in MAGNITUDES:
        raise BadInput(f"scenario {name} takes no magnitude (got {item!r}); these do: "
                       f"{', '.join((*MAGNITUDES, 'hot'))}")
    value = _number(raw, item)
    low, high = MAGNITUDES[name]
    if not low < value <= high:
        raise BadInput(f"scenario {item!r}: the magnitude must be > {low:g}")
    return Fault(name, value)


def _number(raw: str, item: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise BadInput(f"scenario {item!r}: {raw!r} is not a number") from None
    if not math.isfinite(value):
        raise BadInput(f"scenario {item!r}: {raw!r} is not a finite number")
    return value


def _hot_spec(raw: str, item: str) -> Fault:
    parts = raw.split(":")
    if len(parts) not in (2, 3):
        raise BadInput(f"scenario {item!r}: write hot=LAYER:EXPERT, hot=LAYER:EXPERT:BIAS or hot=LAYER:EXPERT:Fx "
                       "(F times the fair share)")
    try:
        layer, expert = int(parts[0]), int(parts[1])
    except ValueError:
        raise BadInput(f"scenario {item!r}: LAYER and EXPERT are integers") from None
    if layer < 0 or expert < 0:
        raise BadInput(f"scenario {item!r}: LAYER and EXPERT are >= 0")
    if len(parts) == 2:
        return Fault("hot", layer=layer, expert=expert)
    size = parts[2].strip()
    if size.lower().endswith("x"):
        factor = _number(size[:-1], item)
        if factor <= 1:
            raise BadInput(f"scenario {item!r}: a hot factor is above 1 (the fair share)")
        return Fault("hot", layer=layer, expert=expert, factor=factor)
    return Fault("hot", _number(size, item), layer=layer, expert=expert)


def _router_fault(f: Fault, n_experts: int) -> RouterFault:
    if f.name == "collapse":
        return RouterFault(bias=(COLLAPSE_BIAS if f.value is None else f.value,) + (0.0,) * (n_experts - 1))
    if f.name == "imbalance":
        slope = IMBALANCE_SLOPE * (1.0 if f.value is None else f.value)
        return RouterFault(bias=tuple(slope * (n_experts - 1 - e) / max(1, n_experts - 1) for e in range(n_experts)))
    if f.name == "jitter":
        return RouterFault(noise_std=JITTER_STD if f.value is None else f.value)
    raise AssertionError(f.name)


def combine(faults: list[RouterFault | None]) -> RouterFault | None:
    faults = [f for f in faults if f is not None]
    if not faults:
        return None
    bias = None
    for f in faults:
        if f.bias is not None:
            bias = f.bias if bias is None else tuple(a + b for a, b in zip(bias, f.bias))
    return RouterFault(bias=bias, noise_std=sum(f.noise_std for f in faults))


def parse(spec_text: str) -> list[str]:
    """The scenario items of a comma-separated spec, each checked (``spec``); "healthy" items are kept."""
    items = [s.strip() for s in spec_text.split(",") if s.strip()]
    for item in items:
        spec(item)
    return items


def _one_hot(n_experts: int, expert: int, bias: float) -> RouterFault:
    return RouterFault(bias=tuple(bias if e == expert else 0.0 for e in range(n_experts)))


def resolve_hot(model, f: Fault) -> Fault:
    """``f`` (a ``hot`` item) with its layer, expert and bias filled in: the defaults, and for a factor the
    bias ``hot_bias`` measures. BadInput where the layer is not a MoE layer or the expert does not exist."""
    cfg = model.cfg
    layers = [m.layer_index for m in model.moe_layers()]
    layer = layers[len(layers) // 2] if f.layer is None else f.layer
    expert = 0 if f.expert is None else f.expert
    if layer not in layers:
        dense = f" except {', '.join(map(str, cfg.dense_layers))}" if cfg.dense_layers else ""
        raise BadInput(f"hot: layer {layer} is not a MoE layer of {cfg.name} (MoE layers: {layers[0]}..{layers[-1]}"
                       f"{dense})")
    if not 0 <= expert < cfg.n_experts:
        raise BadInput(f"hot: expert {expert} does not exist ({cfg.name} has experts 0..{cfg.n_experts - 1})")
    if f.value is not None:
        return Fault("hot", f.value, layer, expert)
    factor = f.factor if f.factor is not None else default_hot_factor(cfg.n_experts, cfg.top_k)
    return Fault("hot", hot_bias(model, layer, expert, factor), layer, expert, factor)


def router_input(model, layer: int, n_prompts: int = HOT_CALIBRATION_PROMPTS, seed: int = 0) -> torch.Tensor:
    """[T, H] the router input of MoE layer ``layer`` on held-out calibration prompts (the balanced init's
    calibration batch, another stream than any served traffic). The forward stops at that router: nothing
    after it runs, and no observer sees it."""
    tokens, segments = calibration_batch(seed, n_prompts, model.cfg.max_seq_len)
    router = next(m.router for m in model.moe_layers() if m.layer_index == layer)
    seen: list[torch.Tensor] = []

    class _Reached(Exception):
        pass

    def grab(mod, args):
        seen.append(args[0].detach().float())
        raise _Reached

    handle = router.register_forward_pre_hook(grab)
    observer, model.observer = model.observer, NOOP
    try:
        with torch.no_grad():
            model(tokens.to(model.device), segments, last_only=True)
    except _Reached:
        pass
    finally:
        model.observer = observer
        handle.remove()
    return seen[0]


def measured_factor(router, x: torch.Tensor, expert: int, bias: float) -> float:
    """Share of the slots ``router`` gives ``expert`` on inputs ``x`` with ``bias`` on its logit, over the fair
    share (k/E of the tokens' slots is 1/E of the slots): 1 = fair, E/k = every token chooses it."""
    saved = router.fault
    try:
        router.fault = combine([saved, _one_hot(router.weight.shape[0], expert, bias)])
        with torch.no_grad():
            ids = router(x)[0].ids
    finally:
        router.fault = saved
    return float((ids == expert).sum()) / ids.numel() * router.weight.shape[0]


def hot_bias(model, layer: int, expert: int, factor: float, n_prompts: int = HOT_CALIBRATION_PROMPTS,
             tolerance: float = 0.02) -> float:
    """The logit bias on ``expert`` of MoE layer ``layer`` that gives it ``factor`` times its fair share on
    calibration traffic (``router_input``): bisection, the share rising with the bias. BadInput where the
    factor is out of reach (E/k: every token chooses it)."""
    cfg = model.cfg
    most = cfg.n_experts / cfg.top_k
    if not 1 < factor < most:
        raise BadInput(f"hot: a factor of {factor:g}x is out of reach for {cfg.name}: between 1 (the fair share) "
                       f"and {most:g} (E/k: every token choosing the expert), exclusive")
    router = next(m.router for m in model.moe_layers() if m.layer_index == layer)
    x = router_input(model, layer, n_prompts)
    lo, hi = 0.0, 1.0
    if measured_factor(router, x, expert, 0.0) >= factor:
        return 0.0
    while measured_factor(router, x, expert, hi) < factor:
        lo, hi = hi, hi * 2
        if hi > HOT_MAX_BIAS:
            raise BadInput(f"hot: no bias up to {HOT_MAX_BIAS:g} gives expert {expert} of layer {layer} "
                           f"{factor:g}x its fair share on calibration traffic")
    for _ in range(40):
        mid = (lo + hi) / 2
        got = measured_factor(router, x, expert, mid)
        if abs(got - factor) <= tolerance * factor:
            return mid
        lo, hi = (mid, hi) if got < factor else (lo, mid)
    return (lo + hi) / 2


def apply(model, names: list[str]) -> list[Fault]:
    """Install the model faults of ``names`` (router faults on every MoE layer, ``hot`` on its layer only;
    ``nan`` in the embedding). Returns the parsed items, ``hot`` resolved (its layer, expert and bias)."""
    items = [spec(n) for n in names]
    n_experts = model.cfg.n_experts
    shared = combine([_router_fault(f, n_experts) for f in items if f.name in ROUTER_SCENARIOS])
    resolved = [resolve_hot(model, f) if f.name == "hot" else f for f in items]
    for layer in model.moe_layers():
        layer.router.fault = combine([shared] + [_one_hot(n_experts, f.expert, f.value) for f in resolved
                                                 if f.name == "hot" and f.layer == layer.layer_index])
    if any(f.name == "nan" for f in items):
        with torch.no_grad():  # 4-byte UTF-8 lead bytes: emoji and other astral-plane characters
            model.embed.weight[0xF0:0xF5] = float("inf")  # as if cast to fp16 and overflowed
    return resolved


def defer(model, after_s: float) -> threading.Timer:
    """Hold the router faults ``apply`` installed back for ``after_s`` seconds (the model routes as healthy until
    then), then switch them on: a fault that appears mid-run, as a bad deploy or a shift does, so the judgement
    against a reference learned from the run's own first windows (``--hot-reference learned``) sees a change.
    Model faults (``nan``) and the runtime's settings are not deferred. Returns the started timer (cancel it to
    keep the model healthy)."""
    routers = [layer.router for layer in model.moe_layers()]
    held = [r.fault for r in routers]
    for r in routers:
        r.fault = None

    def switch_on() -> None:
        for r, f in zip(routers, held):
            r.fault = f  # one attribute store each: the engine's next forward reads it

    timer = threading.Timer(after_s, switch_on)
    timer.daemon = True
    timer.start()
    return timer


@dataclass(frozen=True)
class ScenarioSettings:
    """What the scenarios ask of the runtime around the model (``DEMO_SETTINGS``, merged); None: not asked, the
    flag or default stands. ``Config.resolved`` folds the cache's into the config, ``Config.model_overrides`` the
    capacity factor, ``Config.engine_settings`` the leak; the demo reads the ranks and the traffic shift."""

    cache_size: int | None = None
    cache_policy: str | None = None
    cache_tier: str | None = None
    disk_delay_s: tuple[float, float] | None = None
    world_size: int | None = None
    slow_rank: int | None = None
    delay_ms: float | None = None
    capacity_factor: float | None = None
    traffic_shift: dict[str, float] | None = None
    leak_bytes: int | None = None

    def asked(self) -> dict:
        """The settings a scenario asked for, by name."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def demo_settings(names: list[str]) -> ScenarioSettings:
    """The settings the scenarios ask for, merged (later scenarios win on conflicts)."""
    out: dict = {}
    for n in names:
        f = spec(n)
        out.update(DEMO_SETTINGS.get(f.name, {}))
        if f.name == "drop" and f.value is not None:
            out["capacity_factor"] = f.value
        if f.name == "leak" and f.value is not None:
            out["leak_bytes"] = int(f.value * 1024)
    return ScenarioSettings(**out)
