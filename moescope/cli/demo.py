"""``moescope demo``: serve synthetic traffic on the reference runtime and summarise what the experts did."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager

import click

from moescope import stats
from moescope.cli.summary import build as _summary, print_human as _print_human


@click.command()
@click.option("--model", "model_spec", default="tiny-demo", show_default=True,
              help="Preset name, .json/.yaml config, or .safetensors weights file.")
@click.option("--weights", default="auto", show_default=True,
              help="safetensors file, 'auto' (bundled demo weights for tiny-demo) or 'random'.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32",
              show_default=True)
@click.option("--requests", "n_requests", type=click.IntRange(min=1), default=None,
              help="Requests to serve (default 32, or unlimited with --duration).")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop after this many seconds.")
@click.option("--rate", type=click.FloatRange(min=0), default=20.0, show_default=True,
              help="Arrival rate in requests/s (0: all at once).")
@click.option("--max-batch", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Sampling temperature (0: greedy).")
@click.option("--capacity-factor", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Per-expert capacity factor (drops slots beyond it); default: no capacity limit.")
@click.option("--cache-size", type=int, default=None,
              help="Resident experts per MoE layer (1..E); the rest load on demand. Default: all resident.")
@click.option("--cache-policy", type=click.Choice(["lru", "lfu", "static", "none"]), default=None,
              help="Replacement policy [lru] (static pins the most used experts of a calibration pass).")
@click.option("--cache-tier", type=click.Choice(["memory", "disk"]), default=None,
              help="Where non-resident experts live [memory]: host memory, or a safetensors file read via mmap.")
@click.option("--cache-prefetch", type=click.IntRange(min=0), default=0, show_default=True,
              help="Experts per layer a loader thread stages ahead (0: off).")
@click.option("--cache-file", type=click.Path(dir_okay=False), default=None,
              help="Disk tier file (default: a temporary file, removed at exit).")
@click.option("--record-routing", type=click.Path(dir_okay=False), default=None,
              help="Write the experts each forward used per layer (input of `moescope cache-sim`).")
@click.option("--metrics-port", type=click.IntRange(min=-1, max=65535), default=9400, show_default=True,
              help="Serve Prometheus metrics on this port (0: any free port; -1: no exporter).")
@click.option("--metrics-addr", default="127.0.0.1", show_default=True, help="Exporter bind address.")
@click.option("--linger", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Keep serving metrics this many seconds after the workload (for scrapers).")
@click.option("--traces", "traces_path", default=None,
              help="Trace store (SQLite) for per-token traces [~/.local/share/moescope/traces.sqlite, or "
                   "$MOESCOPE_TRACES]; 'none' to disable.")
@click.option("--otlp-endpoint", default=None, metavar="URL",
              help="Also export each kept request's spans over OTLP/HTTP (e.g. http://127.0.0.1:4318, an "
                   "OpenTelemetry Collector). Needs --traces (the trace recorder makes the spans).")
@click.option("--trace-sample", type=click.FloatRange(0, 1), default=1.0, show_default=True,
              help="Share of ordinary requests traced (anomalous ones are always kept).")
@click.option("--scenario", default="healthy", show_default=True,
              help="Fault scenario(s), comma-separated: healthy, collapse, imbalance, jitter, nan, thrash, "
                   "switch-jitter, slow-rank, drop, drift, leak (real changes to the engine, never to metrics).")
@click.option("--canary-interval", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="Seconds between canary routing runs (flip ratio per layer); 0: off.")
@click.option("--canary-steps", type=click.IntRange(min=1), default=None,
              help="Run the canary every N engine steps instead (expert-parallel ranks always do: they must run "
                   "it at the same step) [with --world-size > 1: 32].")
@click.option("--baseline", "baseline_path", type=click.Path(dir_okay=False), default=None,
              help="Routing baseline to measure drift against (moescope_routing_drift_jsd_bits).")
@click.option("--drift-after", type=click.FloatRange(min=0), default=None,
              help="Drift scenario: seconds of traffic before the domain mix shifts [half the run].")
@click.option("--save-baseline", type=click.Path(dir_okay=False), default=None,
              help="Write this run's expert load per layer as a baseline file.")
@click.option("--load-aware", "load_bound", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Load-aware routing: demote experts whose estimated load exceeds this share of their "
                   "capacity (e.g. 0.85; capacity = 1.5 x the fair share). Default: off.")
@click.option("--smoothing", "smoothing_margin", type=click.FloatRange(min=0), default=None,
              help="Router smoothing: a position whose prefix was routed before keeps its experts unless the "
                   "new choice has this much more router probability (e.g. 0.02). Default: off.")
@click.option("--router-impl", type=click.Choice(["auto", "torch", "triton"]), default="auto", show_default=True,
              help="Router path: the fused Triton kernel (auto: on CUDA when triton is installed) or torch.")
@click.option("--decode", "decode_mode", type=click.Choice(["eager", "static", "graph"]), default="eager",
              show_default=True,
              help="Decode step: the model's own forward; a fixed-shape step with routing counted inside it "
                   "(static); or that step captured as a CUDA graph (graph, CUDA only). Needs every expert "
                   "resident: no --cache-size, --world-size, mitigations.")
@click.option("--world-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Expert parallelism: spawn this many ranks (gloo on CPU) serving the same requests in lock-step.")
@click.option("--placement", "placement_spec", default="round-robin", show_default=True,
              help="Experts per rank: round-robin, contiguous, or a placement YAML (rank_to_experts).")
@click.option("--slow-rank", type=int, default=None, help="Fault: delay this rank's all-to-all participation.")
@click.option("--delay-ms", type=click.FloatRange(min=0), default=20.0, show_default=True,
              help="The slow rank's delay before each dispatch exchange.")
@click.option("--timeout", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Seconds a rank waits for its peers before stopping with an error naming them.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds traffic and sampling.")
@click.option("--no-tui", is_flag=True, help="Plain output only (the live view is `moescope top`).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary (request ids, tokens, load).")
def demo(model_spec, weights, device, dtype, n_requests, duration, rate, max_batch, temperature,
         capacity_factor, cache_size, cache_policy, cache_tier, cache_prefetch, cache_file, record_routing,
         metrics_port, metrics_addr, linger, traces_path, otlp_endpoint, trace_sample, scenario, canary_interval, canary_steps, baseline_path,
         drift_after, save_baseline, load_bound, smoothing_margin, router_impl, decode_mode, world_size, placement_spec, slow_rank, delay_ms,
         timeout, seed, no_tui, as_json) -> int:
    """Serve synthetic traffic (code, prose, numbers, unicode) on the reference MoE runtime."""
    from moescope.capture.routing_log import RoutingLog
    from moescope.cli import demo_parallel
    from moescope.parallel.launch import env_rank
    from moescope.runtime import loader, traffic
    from moescope.runtime import faults
    from moescope.runtime.engine import Engine

    scenarios = faults.parse(scenario)
    settings = faults.demo_settings(scenarios)  # the scenarios' real settings override the flags
    capacity_factor = settings.get("capacity_factor", capacity_factor)
    cache_size = settings.get("cache_size", cache_size)
    cache_policy = settings.get("cache_policy", cache_policy)
    cache_tier = settings.get("cache_tier", cache_tier)
    world_size = max(world_size, settings.get("world_size", 1))
    slow_rank = settings.get("slow_rank", slow_rank)
    delay_ms = settings.get("delay_ms", delay_ms)
    overrides = {"capacity_factor": capacity_factor} if capacity_factor is not None else {}
    model = loader.build_model(model_spec, weights=None if weights == "random" else weights, device=device,
                               dtype=dtype, **overrides)
    faults.apply(model, scenarios)
    notice = model.set_router_impl(router_impl)
    if notice:
        click.echo(notice, err=True)
    if load_bound is not None or smoothing_margin is not None:
        from moescope.runtime.router import Mitigation

        for layer in model.moe_layers():
            layer.router.mitigation = Mitigation(load_bound=load_bound, smoothing_margin=smoothing_margin)
    if decode_mode != "eager" and record_routing:
        from moescope.errors import BadInput

        raise BadInput(f"--record-routing logs every forward's routing, which --decode {decode_mode} steps do not "
                       "hand to hooks: use --decode eager")
    if decode_mode != "eager" and world_size > 1:
        from moescope.errors import BadInput

        raise BadInput(f"--decode {decode_mode} serves on one process: it cannot hold expert parallelism "
                       f"(--world-size {world_size})")
    rank_env = env_rank()
    if world_size > 1 and rank_env is None:
        return demo_parallel.launch(click.get_current_context(), world_size, placement_spec, slow_rank, timeout,
                                    model, as_json)
    rank, world = rank_env or (0, 1)
    if n_requests is None:  # (before lock-step forces rate 0: a --duration run must not run dry)
        n_requests = 32 if duration is None else max(64, int(rate * duration * 2) + 16)
    if world > 1:
        rate = 0.0  # lock-step ranks schedule by step, never by wall clock (identical batches everywhere)
        if metrics_port > 0:
            metrics_port += rank
    shift = settings.get("traffic_shift")
    shift_after = None
    if shift:
        shift_after = n_requests // 2 if drift_after is None or rate == 0 else int(rate * drift_after)
    reqs = traffic.generate(traffic.TrafficConfig(rate=rate, seed=seed, shift_after=shift_after,
                                                  shifted_domains=shift), n_requests)
    auto_baseline = None
    if shift and not baseline_path:  # drift needs a reference: the load of a known-good pass of the normal mix
        auto_baseline = _calibration_load(model, seed, 64)
    observers = []
    routing_log = None
    if record_routing:
        routing_log = RoutingLog()
        observers.append(routing_log)
    with ExitStack() as stack:
        import moescope

        a2a = None
        if world > 1:  # join the group first: the rank's observers go into the instrumentation
            a2a, monitor = demo_parallel.setup_rank(stack, model, rank, world, placement_spec, slow_rank, delay_ms,
                                                    timeout)
            observers += [a2a, monitor]
        recorder = None
        traces_path = traces_path or os.environ.get("MOESCOPE_TRACES") or str(_default_traces())
        if otlp_endpoint and traces_path == "none":
            from moescope.errors import BadInput

            raise BadInput("--otlp-endpoint exports the trace recorder's spans: it needs --traces (not none)")
        if traces_path != "none" and (world == 1 or rank == 0):  # lock-step ranks trace identical routing
            from moescope.traces.recorder import TraceRecorder

            tracer = None
            if otlp_endpoint:
                from moescope.traces import otlp

                provider = otlp.tracer_provider(otlp_endpoint, attributes={"moescope.model": model.cfg.name})
                stack.callback(provider.shutdown)  # after the recorder's last spans (the stack unwinds LIFO)
                tracer = provider.get_tracer("moescope")
            recorder = TraceRecorder(traces_path, sample=trace_sample, model=model.cfg.name, rank=rank, seed=seed,
                                     tracer=tracer)
            if decode_mode != "eager":
                click.echo(f"note: --decode {decode_mode} runs no per-layer hook in decode steps: the trace store "
                           "keeps each request's timings and spans, not its per-token routing", err=True)
            observers.append(recorder)
        # Lock-step ranks route the same tokens: rank 0 alone exports routing (sums over ranks count it once).
        inst = stack.enter_context(moescope.instrument(
            model, port=None if metrics_port < 0 else metrics_port, addr=metrics_addr, observers=observers,
            rank=rank, export_routing=rank == 0))
        if inst.exporter is not None:
            click.echo(f"metrics: {inst.exporter.url}", err=True)
        if baseline_path:
            from moescope.analysis import baseline as bl

            inst.metrics.baseline = bl.load(baseline_path)
        elif auto_baseline is not None:
            inst.metrics.baseline = auto_baseline
            click.echo("drift baseline: a calibration pass over held-out traffic of the normal mix", err=True)
        cache = None
        if cache_size is not None or cache_policy or cache_tier or cache_prefetch:
            cache = stack.enter_context(_expert_cache(model, cache_size, cache_policy or "lru",
                                                      cache_tier or "memory", cache_prefetch, cache_file, seed,
                                                      settings.get("disk_delay_s")))
        canary = None
        if canary_interval > 0:
            from moescope.runtime.canary import Canary

            if world > 1 and canary_steps is None:
                canary_steps = 32  # lock-step ranks: the canary forward is a collective, run at the same step
            canary = Canary(model, interval_s=canary_interval, every_steps=canary_steps)
        engine = Engine(model, max_batch=max_batch, seed=seed, canary=canary,  # observed via the instrumentation
                        decode=decode_mode)
        if settings.get("leak_bytes"):
            engine.leak, engine.leak_bytes = [], settings["leak_bytes"]
        start = time.perf_counter()
        try:
            records = engine.run(reqs, realtime=rate > 0, deadline_s=duration, temperature=temperature,
                                 id_prefix=os.environ.get("MOESCOPE_RUN_ID", f"ep{seed}-") if world > 1 else None)
        except KeyboardInterrupt:  # keep what was served: summarise it
            records = engine.finished
        wall = time.perf_counter() - start
        # The load comes from the instrumentation's own counters: no second probe on the hot path.
        inst.metrics.flush()
        load = {layer: counts.tolist() for layer, counts in sorted(inst.metrics.expert_tokens.items())}
        dropped = {layer: int(n) for layer, n in
                   sorted(inst.metrics.layer_counters["moescope_tokens_dropped_total"].items())}
        summary = _summary(records, load, dropped, wall, model, model.device,
                           n_requests if duration is None else len(records))
        if cache is not None:
            summary["expert_cache"] = _cache_summary(cache)
        if inst.metrics.flips:
            summary["canary_flip_ratio"] = {str(layer): round(v, 4) for layer, v in sorted(inst.metrics.flips.items())}
        if inst.exporter is not None:
            summary["metrics_url"] = inst.exporter.url
        if inst.observer.errors:
            summary["observer_errors"] = dict(inst.observer.errors)
        if recorder is not None:
            summary["traces"] = str(recorder.path)
        if a2a is not None:
            summary["rank"] = demo_parallel.rank_summary(rank, a2a, summary, wall)
        if linger:
            time.sleep(linger)
    if save_baseline:
        from moescope.analysis import baseline as bl

        bl.save(save_baseline, {int(k): v for k, v in summary["expert_load"].items()}, model.cfg.name)
    if world > 1 and demo_parallel.write_summary(summary):
        return 0
    if routing_log is not None:
        routing_log.save(record_routing)
        summary["routing_log"] = str(record_routing)
    if as_json:
        json.dump(summary, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print_human(summary)
    return 0


def _default_traces():
    from moescope.traces.store import DEFAULT_PATH

    return DEFAULT_PATH


def _calibration_load(model, seed: int, n_requests: int = 16) -> dict[int, list[int]]:
    """Expert load per layer of a pass over held-out traffic (another seed than the served traffic), run
    outside the served run's instrumentation."""
    from moescope.capture.probes import ExpertLoadProbe
    from moescope.runtime import traffic
    from moescope.runtime.engine import Engine

    calib, previous = ExpertLoadProbe(), model.observer
    Engine(model, max_batch=8, observer=[calib]).run(
        traffic.generate(traffic.TrafficConfig(seed=seed + 7919, output_tokens_median=8), n_requests),
        realtime=False)
    model.observer = previous  # the calibration pass is not part of the served run's metrics
    return calib.snapshot()


@contextmanager
def _expert_cache(model, size, policy, tier, prefetch, cache_file, seed, disk_delay_s=None):
    """Attach an expert cache for the run; static pins the most used experts of a calibration pass over
    held-out traffic (a different seed from the served traffic)."""
    from moescope.runtime.cache import attach_cache

    pinned = None
    if policy == "static":
        pinned = {layer: sorted(range(len(c)), key=lambda e: (-c[e], e))
                  for layer, c in _calibration_load(model, seed, 8).items()}
    with tempfile.TemporaryDirectory(prefix="moescope-experts-") as tmp:
        path = cache_file or os.path.join(tmp, "experts.safetensors")
        cache = attach_cache(model, size=size if size is not None else model.cfg.n_experts, policy=policy,
                             tier=tier, path=path if tier == "disk" else None, prefetch=prefetch, pinned=pinned,
                             disk_delay_s=disk_delay_s)
        try:
            yield cache
        finally:
            cache.close()


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
