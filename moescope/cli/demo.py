"""``moescope demo``: serve synthetic traffic on the reference runtime and summarise what the experts did.

The command maps flags: the model and its instrumentation come from ``cli/config_options.py`` (one
``moescope.Config``, shared with ``serve``), the workload from the flags here; with ``--world-size W`` the
launcher in ``demo_parallel`` runs W ranks of this same command (data-parallel attention: each rank serves
its share of the requests, the experts sharded over the ranks).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import click

from moescope import stats
from moescope.analysis.baseline import calibration_profile
from moescope.cli import demo_parallel
from moescope.cli.config_options import (InstrumentOptions, ModelOptions, build_config, build_model,
                                         instrument_options, instrumented, model_options)
from moescope.cli.demo_live import serve_with_live_view
from moescope.cli.demo_parallel import PEER_OPTIONS, RANK_OPTIONS
from moescope.cli.options import emit_json, json_option, option_group
from moescope.cli.summary import build as _summary, learned_rows, print_human as _print_human, save_baseline
from moescope.config import Config
from moescope.errors import BadInput
from moescope.parallel.spawn import write_summary
from moescope.runtime import traffic


@dataclass(frozen=True)
class DemoOptions:
    """The workload and the run: the flags ``demo`` has beside the model and the instrumentation."""

    n_requests: int | None
    duration: float | None
    rate: float
    temperature: float
    prompts: int | None
    drift_after: float | None
    linger: float
    save_baseline: str | None
    decode_mode: str
    world_size: int
    placement_spec: str
    rebalance_steps: int | None
    rebalance_slots: int | None
    rebalance_below: float | None
    measure_from_step: int | None
    slow_rank: int | None
    delay_ms: float
    timeout: float
    no_tui: bool
    as_json: bool


demo_options = option_group(
    DemoOptions, "run",
    click.option("--requests", "n_requests", type=click.IntRange(min=1), default=None,
                 help="Requests to serve (default 32, or unlimited with --duration)."),
    click.option("--duration", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="Stop after this many seconds."),
    click.option("--rate", type=click.FloatRange(min=0), default=20.0, show_default=True,
                 help="Arrival rate in requests/s (0: all at once)."),
    click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
                 help="Sampling temperature (0: greedy)."),
    click.option("--prompts", type=click.IntRange(min=1), default=None,
                 help="Narrow traffic: only this many distinct prompts, each request one of them (what a "
                      "product with a few fixed templates sends) [every request its own prompt]."),
    click.option("--drift-after", type=click.FloatRange(min=0), default=None,
                 help="Drift scenario: seconds of traffic before the domain mix shifts [half the run]."),
    click.option("--linger", type=click.FloatRange(min=0), default=0.0, show_default=True,
                 help="Keep serving metrics this many seconds after the workload (for scrapers)."),
    click.option("--save-baseline", type=click.Path(dir_okay=False), default=None,
                 help="Write this run's expert load per layer as a baseline file."),
    click.option("--decode", "decode_mode", type=click.Choice(["eager", "static", "graph"]), default="eager",
                 show_default=True,
                 help="Decode step: the model's own forward; a fixed-shape step with routing counted inside it "
                      "(static); or that step captured as a CUDA graph (graph, CUDA only). Needs every expert "
                      "resident: no --cache-size, --world-size, mitigations."),
    *RANK_OPTIONS,
    click.option("--rebalance-steps", type=click.IntRange(min=1), default=None,
                 help="EPLB in the loop (--world-size > 1): every N steps plan a placement from the fleet's live "
                      "counts and move the experts' weights between ranks while serving."),
    click.option("--rebalance-slots", type=click.IntRange(min=1), default=None,
                 help="Experts per rank the rebalancer places (spare slots replicate hot experts) [the starting "
                      "placement's most per rank]."),
    click.option("--rebalance-below", type=click.FloatRange(min=0, max=1, min_open=True), default=None,
                 help="Rearrange only when the measured balancedness (mean rank / busiest rank) since the last time "
                      "is below this [always]."),
    click.option("--measure-from-step", type=click.IntRange(min=1), default=None,
                 help="Also measure the per-rank load (busiest rank / mean rank, --world-size > 1) over steps N to "
                      "the end, whether or not the ranks rearrange: a static run and an EPLB run compare on the "
                      "same steps [--rebalance-steps: from the first rearrangement on]."),
    *PEER_OPTIONS,
    click.option("--no-tui", is_flag=True, help="Plain output only. Without it, a terminal shows the live view "
                 "(`moescope top` of this run's exporter) while the workload runs, then the summary."),
    json_option,
)


@dataclass(frozen=True)
class DemoPlan:
    """``demo``'s options, checked (``plan``): what ``run_demo`` assembles and serves on this process, or, for the
    launcher (``launcher``), the ranks ``demo_parallel.launch`` starts."""

    model: ModelOptions
    instrument: InstrumentOptions
    run: DemoOptions
    config: Config  # this process's one Config (its rank's; a launcher's is rank 0's, for validation)
    rank: int  # this process's rank and world (1 but under a launcher)
    world: int
    under_launcher: bool  # a rank started by a launcher (``parallel.launch.env_rank``)
    world_size: int  # the fleet's ranks, slow rank and its delay: the flags, the scenarios' settings over them
    slow_rank: int | None
    delay_ms: float
    launch_model: Any = None  # the launcher: the model and placement it validated
    placement: Any = None

    @property
    def launcher(self) -> bool:
        return self.world_size > 1 and not self.under_launcher


def plan(model: ModelOptions, instrument: InstrumentOptions, run: DemoOptions) -> DemoPlan:
    """Check the options (each bad one: one line, exit 2, before any rank or request) and return what to run."""
    # start-up: torch (parallel.launch), only when the command runs, not for --help
    from moescope.parallel.launch import env_rank

    rank_env = env_rank()
    rank, world = rank_env or (0, 1)
    # The scenarios' settings override the flags.
    config = build_config(instrument, model, rank=rank, world=world)
    world_size, slow_rank, delay_ms = demo_parallel.fleet_settings(config, run.world_size, run.slow_rank, run.delay_ms)
    if run.decode_mode != "eager" and instrument.record_routing:
        raise BadInput(f"--record-routing logs every forward's routing, which --decode {run.decode_mode} steps do "
                       "not hand to hooks: use --decode eager")
    if run.decode_mode != "eager" and world_size > 1:
        raise BadInput(f"--decode {run.decode_mode} serves on one process: it cannot hold expert parallelism "
                       f"(--world-size {world_size})")
    if world_size == 1 and rank_env is None and run.rebalance_steps:
        raise BadInput("--rebalance-steps rearranges experts between ranks: it needs --world-size > 1")
    if world_size == 1 and rank_env is None and run.measure_from_step:
        raise BadInput("--measure-from-step measures the per-rank load of expert parallelism: it needs "
                       "--world-size > 1")
    if not run.rebalance_steps and (run.rebalance_slots is not None or run.rebalance_below is not None):
        raise BadInput("--rebalance-slots and --rebalance-below shape the rearrangements --rebalance-steps N "
                       "makes: give it too")
    p = DemoPlan(model, instrument, run, config, rank, world, rank_env is not None, world_size, slow_rank, delay_ms)
    if not p.launcher:
        return p
    net, placement = demo_parallel.validate_launch(model, config, world_size, run.placement_spec, slow_rank)
    if run.rebalance_slots is not None and run.rebalance_slots * world_size < net.cfg.n_experts:
        raise BadInput(f"--rebalance-slots {run.rebalance_slots}: {world_size} ranks x "
                       f"{run.rebalance_slots} slots cannot hold {net.cfg.n_experts} experts (need "
                       f">= {-(-net.cfg.n_experts // world_size)})")
    return dataclasses.replace(p, launch_model=net, placement=placement)


@click.command()
@model_options
@instrument_options
@demo_options
def demo(model: ModelOptions, instrument: InstrumentOptions, run: DemoOptions) -> int | None:
    """Serve synthetic traffic (code, prose, numbers, unicode) on the reference MoE runtime."""
    p = plan(model, instrument, run)
    if p.launcher:
        return demo_parallel.launch(click.get_current_context(), p.world_size, p.placement, run.timeout,
                                    p.launch_model, run.as_json)
    run_demo(p)
    return None


def run_demo(p: DemoPlan) -> None:
    """Assemble the plan on this process (alone, or one expert-parallel rank), serve its share of the workload and
    print the summary (a rank under the launcher hands it on instead)."""
    model, instrument, run = p.model, p.instrument, p.run
    if p.world > 1:
        model = demo_parallel.rank_model(model, p.rank)  # CUDA: this rank's own GPU
    net = build_model(model, p.config)
    reqs, n_requests, rate = _workload(run, model.seed, p.config.settings.traffic_shift, p.world)
    reqs = reqs[p.rank::p.world]  # data-parallel attention: request i is served by rank i mod W
    config = p.config
    if config.settings.traffic_shift and not instrument.baseline_path:  # drift needs a known-good reference
        config = build_config(instrument, model, rank=p.rank, world=p.world,
                              baseline=calibration_profile(net, model.seed, 64))
        click.echo("drift baseline: a calibration pass over 64 held-out requests of the normal mix", err=True)
    run_started = time.time()
    summary = _serve_and_summarise(p, model, net, config, reqs, rate,
                                   n_requests if run.duration is None else None)
    if run.save_baseline and not p.under_launcher:  # (ranks: the launcher writes it from every rank's counts)
        save_baseline(run.save_baseline, summary, net.cfg.name, run_started)
    if p.world > 1 and write_summary(summary):
        return
    if "rank" in summary:  # a rank on its own (torchrun without moescope's launcher): no merge needs them
        summary["rank"].pop("raw_latency_s", None)
    if instrument.record_routing:
        summary["routing_log"] = str(instrument.record_routing)
    if run.as_json:
        emit_json(summary)
    else:
        _print_human(summary)


def _serve_and_summarise(p: DemoPlan, model: ModelOptions, net, config, reqs, rate: float,
                         n_asked: int | None) -> dict:
    """Instrument ``net`` as ``config`` says (a rank joins its group first), serve ``reqs`` and summarise them.
    ``n_asked``: the requests asked for (None: a --duration run, as many as were served)."""
    run, rank, world = p.run, p.rank, p.world
    with ExitStack() as stack:
        a2a = lockstep = stop = None
        if world > 1:  # join the group first: the rank's observers go into the instrumentation
            stop = demo_parallel.StopOnSignal()
            a2a, monitor, lockstep = demo_parallel.setup_rank(stack, net, rank, world, run.placement_spec,
                                                              p.slow_rank, p.delay_ms, run.timeout)
            lockstep.rebalancer = demo_parallel.rebalancer(run)
            lockstep.measure_from = run.measure_from_step or run.rebalance_steps
            config = dataclasses.replace(config, observers=(a2a, monitor))
        inst = stack.enter_context(instrumented(net, config))
        engine = inst.engine(max_batch=model.max_batch, seed=model.seed, decode=run.decode_mode, lockstep=lockstep)
        for line in inst.notices + ([f"metrics: {inst.exporter.url}"] if inst.exporter else []):
            click.echo(line, err=True)
        serving = dict(realtime=rate > 0, deadline_s=run.duration, temperature=run.temperature,
                       id_prefix=os.environ.get("MOESCOPE_RUN_ID", f"ep{model.seed}-") if world > 1 else None)
        start = time.perf_counter()
        if _wants_tui(run, world, inst):
            records = serve_with_live_view(engine, reqs, serving, inst.exporter.url)
        else:
            if stop is not None:
                stop.engine = engine
            records = _serve(engine, reqs, serving)
            if stop is not None:
                stop.engine = None
        summary = _summarise(inst, records, time.perf_counter() - start, net,
                             len(records) if n_asked is None else n_asked)
        if a2a is not None:
            summary["rank"] = demo_parallel.rank_summary(rank, a2a, summary, summary["wall_s"], lockstep, records)
        if run.linger:
            time.sleep(run.linger)
    return summary


def _workload(run: DemoOptions, seed: int, shift: dict | None, world: int):
    """(requests, how many, arrival rate): the arrivals of the whole run at ``--rate`` (expert-parallel ranks
    serve every W-th of them, so the fleet's rate is the one asked). ``shift``: the drift scenario's domain mix
    after the shift."""
    rate = run.rate
    n = run.n_requests
    if n is None:  # (from the asked rate: a --duration run must not run dry; each of W ranks serves 1/W of them)
        n = 32 if run.duration is None else max(64, int(run.rate * run.duration * 2) + 16) * world
    shift_after = None
    if shift:
        shift_after = n // 2 if run.drift_after is None or rate == 0 else int(rate * run.drift_after)
    reqs = traffic.generate(traffic.TrafficConfig(rate=rate, seed=seed, shift_after=shift_after,
                                                  shifted_domains=shift, distinct_prompts=run.prompts), n)
    return reqs, n, rate


def _wants_tui(run: DemoOptions, world: int, inst) -> bool:
    """The live view: a person at a terminal, one process, and an exporter to watch."""
    return not (run.no_tui or run.as_json) and world == 1 and inst.exporter is not None and sys.stdout.isatty()


def _serve(engine, reqs, serving: dict) -> list:
    try:
        return engine.run(reqs, **serving)
    except KeyboardInterrupt:  # keep what was served: summarise it
        return engine.finished


def _summarise(inst, records, wall: float, model, n_asked: int) -> dict:
    """The run's summary; the load comes from the instrumentation's own counters (no second probe)."""
    inst.metrics.flush()
    load = {layer: counts.tolist() for layer, counts in sorted(inst.metrics.expert_tokens.items())}
    dropped = {layer: int(n) for layer, n in
               sorted(inst.metrics.layer_counters.get("moescope_tokens_dropped_total", {}).items())}
    summary = _summary(records, load, dropped, wall, model, model.device, n_asked,
                       draws=inst.metrics.run_draws_of(list(load)), baseline=inst.metrics.baseline,
                       learned=learned_rows(inst.metrics, list(load)) if load else None)
    if inst.cache is not None:
        summary["expert_cache"] = _cache_summary(inst.cache)
    if inst.metrics.flips:
        summary["canary_flip_ratio"] = {str(layer): round(v, 4) for layer, v in sorted(inst.metrics.flips.items())}
    if inst.exporter is not None:
        summary["metrics_url"] = inst.exporter.url
    if inst.observer.errors:
        summary["observer_errors"] = dict(inst.observer.errors)
    if inst.recorder is not None:
        summary["traces"] = str(inst.recorder.path)
    return summary


def _cache_summary(cache) -> dict:
    layers = {}
    for layer, s in cache.stats().items():
        layers[str(layer)] = {
            "lookups": s.lookups, "hits": s.hits, "misses": s.misses, "evictions": s.evictions,
            "hit_rate": round(s.hit_rate, 4), "prefetch_issued": s.prefetch_issued,
            "prefetch_hits": s.prefetch_hits, "prefetch_wasted": s.prefetch_wasted, "bytes_loaded": s.bytes_loaded,
            "load_p50_s": round(stats.percentile(s.load_seconds, 50), 6) if s.load_seconds else None,
            "load_p99_s": round(stats.percentile(s.load_seconds, 99), 6) if s.load_seconds else None}
    return {"policy": cache.policy, "size": cache.size, "tier": cache.tier, "layers": layers}
