"""The expert-parallel side of `moescope demo`: the launcher (`--world-size W`) and one rank's set-up."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import click

from moescope.capture.observer import RuntimeObserver
from moescope.cli.config_options import build_model
from moescope.cli.options import emit_json
from moescope.errors import BadInput, MoescopeError
from moescope.parallel import placement as placement_mod
from moescope.parallel.eplb import Rebalancer
from moescope.parallel.spawn import run_ranks
from moescope.traces.sanitize import sanitize

# Expert-parallel options `demo` and `serve` share: how many ranks and which experts each holds; the slow-rank
# fault and how long a rank waits for its peers.
RANK_OPTIONS = (
    click.option("--world-size", type=click.IntRange(min=1), default=1, show_default=True,
                 help="Expert parallelism: spawn this many ranks (gloo on CPU; NCCL with a GPU per rank), each "
                      "serving its share of the requests (data-parallel attention), the experts sharded over them."),
    click.option("--placement", "placement_spec", default="round-robin", show_default=True,
                 help="Experts per rank: round-robin, contiguous, or a placement YAML (rank_to_experts)."),
)
PEER_OPTIONS = (
    click.option("--slow-rank", type=int, default=None, help="Fault: delay this rank's all-to-all participation."),
    click.option("--delay-ms", type=click.FloatRange(min=0), default=20.0, show_default=True,
                 help="The slow rank's delay before each dispatch exchange."),
    click.option("--timeout", type=click.FloatRange(min=1), default=60.0, show_default=True,
                 help="Seconds a rank waits for its peers before stopping with an error naming them."),
)


def rank_options(f):
    """Apply ``RANK_OPTIONS`` and ``PEER_OPTIONS`` (a command's expert-parallel flags) in their order."""
    for option in reversed((*RANK_OPTIONS, *PEER_OPTIONS)):
        f = option(f)
    return f


def fleet_settings(config, world_size: int, slow_rank: int | None, delay_ms: float) -> tuple[int, int | None, float]:
    """(world size, slow rank, its delay): the flags, overridden by the scenarios' (``slow-rank``: 2 ranks)."""
    settings = config.settings
    return (max(world_size, settings.world_size or 1),
            settings.slow_rank if settings.slow_rank is not None else slow_rank,
            settings.delay_ms if settings.delay_ms is not None else delay_ms)


def validate_launch(model_opts, config, world_size: int, placement_spec: str, slow_rank: int | None):
    """Before spawning ranks, what would fail every rank alike: the device, the slow rank, the model
    with its faults, the placement; one line and exit 2. Returns (the model, its placement)."""
    # start-up: torch (runtime.faults, runtime.loader), only when the command runs, not for --help
    from moescope.runtime import faults
    from moescope.runtime.loader import resolve_device

    resolve_device(model_opts.device)  # a device this machine lacks: one line here, not one per rank
    if slow_rank is not None and not 0 <= slow_rank < world_size:
        raise BadInput(f"--slow-rank {slow_rank} is not a rank of world size {world_size}")
    net = build_model(model_opts, config)
    faults.apply(net, list(config.scenarios))  # a fault out of the model's reach fails here, not on every rank
    placement = placement_mod.build(placement_spec, n_experts=net.cfg.n_experts, world_size=world_size,
                                    moe_layers=net.cfg.moe_layers)
    return net, placement


class AllToAllStats(RuntimeObserver):
    """Per-rank totals for the summary: all-to-all seconds per op, and the wait on each peer."""

    def __init__(self, world_size: int) -> None:
        self.seconds = {"dispatch": 0.0, "combine": 0.0}
        self.peer_wait_s = [0.0] * world_size
        self.exchanges = 0
        self.received_bytes = 0  # dispatch: the rows this rank's experts computed (its expert load)

    def on_all_to_all(self, record) -> None:
        self.seconds[record.op] += record.seconds
        self.exchanges += 1
        if record.op == "dispatch":
            self.received_bytes += sum(record.recv_bytes)
        for p, w in enumerate(record.peer_wait_s):
            self.peer_wait_s[p] += w


def argv_from_context(ctx: click.Context, drop: set[str]) -> list[str]:
    """Rebuild the command line of ``ctx`` (options differing from their defaults), minus ``drop``."""
    argv = [ctx.info_name]
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name in drop:
            continue
        value = ctx.params.get(param.name)
        if value is None or value == param.default or (param.is_flag and not value):
            continue
        if param.is_flag:
            argv.append(param.opts[0])
            continue
        for v in (value if param.multiple else (value,)):
            argv += [param.opts[0], str(v)]
    return argv


def launch(ctx: click.Context, world_size: int, placement, timeout: float, model, as_json: bool) -> None:
    """Run the ranks under torchrun's agent, merge their summaries and print them. A failed run: every failed
    rank's own error (and, when it died without one, the tail of its stderr), the first to fail first, then
    ``RanksFailed``."""
    # start-up: numpy (cli.summary), only when the command runs, not for --help
    from moescope.cli.summary import print_human, save_baseline

    run_started = time.time()
    summaries, failures = run_ranks(argv_from_context(ctx, {"world_size", "save_baseline"}), world_size, timeout)
    if failures or any(s is None for s in summaries):
        report_failures(failures, world_size, missing=[r for r, s in enumerate(summaries) if s is None])
    merged = merge_summaries(summaries, model.cfg.top_k, ctx.params.get("duration") is not None)
    merged["world_size"] = world_size
    start = {str(layer): [list(x) for x in v] for layer, v in placement.layers.items()}
    final = summaries[0]["rank"].get("placement") or start  # every rank ends with the same (one plan, all ranks)
    merged["placement"] = final
    if final != start:
        merged["placement_start"] = start  # EPLB rearranged it while serving
    merged["ranks"] = [s["rank"] for s in summaries]
    merged["peer_wait_matrix_s"] = [s["rank"]["peer_wait_s"] for s in summaries]
    if ctx.params.get("save_baseline"):  # every rank's counts (the ranks write none)
        save_baseline(ctx.params["save_baseline"], merged, model.cfg.name, run_started)
    if as_json:
        emit_json(merged)
        return
    print_human(merged)
    r0 = merged["ranks"][0]
    click.echo(f"expert parallel over {world_size} ranks ({ctx.params['placement_spec']}; {r0['backend']}, "
               f"{', '.join(sorted({str(r['device']) for r in merged['ranks']}))}); per rank:")
    for r in merged["ranks"]:
        click.echo(f"  rank {r['rank']}: {r['completed']} requests, {r['tokens_per_s']} tokens/s, "
                   f"all-to-all {r['all_to_all_s']:.3f}s "
                   f"({r['all_to_all_share']:.1%} of the run), waited on peers "
                   + ", ".join(f"{p}: {w:.3f}s" for p, w in enumerate(r["peer_wait_s"])))


def report_failures(failures, world_size: int, missing: list[int] = ()) -> None:
    """Each failed rank's own error (and, when it died without one, the tail of its stderr), the first to fail
    first; then raise ``RanksFailed`` (``missing``: the ranks that left no summary)."""
    for f in failures:
        if f.crashed:
            click.echo(f"moescope: {f.error}; its last stderr lines:", err=True)
            for line in f.tail:
                click.echo(f"  rank {f.rank} | {sanitize(line)}", err=True)
        else:
            click.echo(sanitize(f.error), err=True)
    first = failures[0] if failures else None
    raise RanksFailed(f"{len(failures)} of {world_size} ranks failed; first: "
                      f"{first.error.removeprefix('moescope: error: ') if first else _no_summary(missing)}",
                      first.code if first and first.code > 0 else 1)


def _no_summary(missing: list[int]) -> str:
    return (f"rank {', '.join(map(str, missing))} wrote no summary" if missing else "a rank wrote no summary")


def merge_summaries(summaries: list[dict], top_k: int, by_duration: bool) -> dict:
    """The run's summary from its ranks' (data-parallel attention: each served its own requests): requests,
    tokens, throughput and expert load added up, the load judged again from the sums (``expert_load_summary``,
    ``judged``: what the human summary prints); latency percentiles over every rank's requests (each rank's own in
    ``ranks``)."""
    # start-up: numpy (stats, cli.summary), only when the command runs, not for --help
    from moescope.cli.summary import latency

    merged = dict(summaries[0])
    for key in ("expert_load_summary", "judged", "canary_flip_ratio"):
        merged.pop(key, None)
    merged["top_k"] = top_k
    merged["completed"] = sum(s["completed"] for s in summaries)
    if by_duration:  # a --duration run asks for as many as it serves
        merged["requests"] = sum(s["requests"] for s in summaries)
    merged["tokens"] = {k: sum(s["tokens"][k] for s in summaries) for k in ("prompt", "output")}
    merged["tokens_per_s"] = round(sum(s["tokens_per_s"] or 0 for s in summaries), 1)
    merged["wall_s"] = max(s["wall_s"] for s in summaries)
    raw = [s["rank"].pop("raw_latency_s") for s in summaries if "rank" in s and "raw_latency_s" in s["rank"]]
    if len(raw) == len(summaries):
        merged["latency_s"] = latency([x for r in raw for x in r["ttft"]], [x for r in raw for x in r["per_token"]])
    merged["request_ids"] = sorted(i for s in summaries for i in s["request_ids"])
    merged["requests_detail"] = sorted((d for s in summaries for d in s["requests_detail"]),
                                       key=lambda d: d["request_id"])
    return _merge_load(merged, summaries, top_k)


def _merge_load(merged: dict, summaries: list[dict], top_k: int) -> dict:
    """``merged`` with the ranks' expert load and dropped slots summed, per layer, and judged again from the sums."""
    # start-up: numpy (stats, cli.summary), only when the command runs, not for --help
    from moescope import stats
    from moescope.cli.summary import judgement

    # summed over the ranks that routed each layer: a rank that served no request (fewer requests than ranks)
    # routed nothing and its summary has no layers
    load: dict[str, list[int]] = {}
    dropped: dict[str, int] = {}
    for s in summaries:
        for layer, counts in s["expert_load"].items():
            load[layer] = [a + b for a, b in zip(load.get(layer, [0] * len(counts)), counts)]
        for layer, n in s["tokens_dropped"].items():
            dropped[layer] = dropped.get(layer, 0) + n
    merged["expert_load"] = load = dict(sorted(load.items(), key=lambda kv: int(kv[0])))
    merged["expert_load_cv"] = {layer: round(stats.load_cv(c), 4) for layer, c in load.items()}
    merged["tokens_dropped"] = dict(sorted(dropped.items(), key=lambda kv: int(kv[0])))
    if load:  # judged again from the fleet's sums, as the human summary prints it (--json held no judgement)
        judged, per = judgement({int(k): v for k, v in load.items()}, merged["completed"], top_k)
        merged["expert_load_summary"] = {str(k): v for k, v in per.items()}
        merged["judged"] = judged
    return merged


class StopOnSignal:
    """A rank's SIGTERM, SIGINT and SIGHUP (the launcher's agent forwards the signal it got, or stops the survivors of a
    failed rank): while ``engine`` serves, ask it to stop (the ranks agree on the step, and a rank blocked in an
    exchange with a dead peer still names it first); otherwise end now, as the signal would."""

    def __init__(self) -> None:
        self.engine = None
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # (Ctrl-C reaches every rank too)
                signal.signal(sig, self)

    def __call__(self, signum, _frame) -> None:
        if self.engine is None:
            raise SystemExit(128 + signum)
        self.engine.request_stop()


class RanksFailed(MoescopeError):
    """Some rank of a ``--world-size`` run failed; the exit code is the first failed rank's."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def rank_model(model_opts, rank: int):
    """This rank's ``ModelOptions``: on CUDA without an index (``auto``, ``cuda``) each rank on its own GPU of its
    node (local rank modulo the GPUs: ranks share GPUs when there are fewer); an explicit ``cuda:N`` or ``cpu``
    as given. Call before building the model."""
    # start-up: torch (runtime.loader), only when the command runs, not for --help
    from moescope.runtime.loader import resolve_device

    device = resolve_device(model_opts.device)
    if device.type != "cuda" or device.index is not None:
        return model_opts
    import torch  # start-up: torch, only when the command runs, not for --help

    local = int(os.environ.get("LOCAL_RANK", rank))
    return dataclasses.replace(model_opts, device=f"cuda:{local % torch.cuda.device_count()}")


def comm_backend(device, world_size: int) -> str:
    """The process group's backend for ranks on ``device``: NCCL when every rank of the node has a GPU of its own
    (NCCL refuses two ranks on one GPU); otherwise gloo, CUDA tensors staged through host memory by
    ``ExpertParallel`` (one copy each way per exchange; the exchange is a synchronisation point anyway)."""
    if device.type != "cuda":
        return "gloo"

    import torch  # start-up: torch, only when the command runs, not for --help

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    own = device.index == int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
    return "nccl" if own and torch.cuda.device_count() >= local_world else "gloo"


def setup_rank(stack, model, rank: int, world_size: int, placement_spec: str, slow_rank: int | None,
               delay_ms: float, timeout: float):
    """Join the group and shard the experts; returns (AllToAllStats, RankMonitor, ExpertParallel: the
    engine's ``lockstep``, through whose exchanges the ranks make the same steps and agree when to stop)."""
    import torch.distributed as dist  # start-up: torch, only when the command runs, not for --help

    # start-up: numpy, torch (parallel.expert_parallel, parallel.launch), only when the command runs, not for --help
    from moescope.parallel.expert_parallel import ExpertParallel
    from moescope.parallel.launch import RankMonitor, init

    placement = placement_mod.build(placement_spec, n_experts=model.cfg.n_experts, world_size=world_size,
                                    moe_layers=model.cfg.moe_layers)
    device = model.device
    backend = comm_backend(device, world_size)
    if device.type == "cuda":
        import torch  # start-up: torch, only when the command runs, not for --help

        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
    store = init(rank, world_size, timeout, backend)
    stack.callback(dist.destroy_process_group)
    monitor = RankMonitor(store, rank, world_size, timeout)
    stack.callback(monitor.shutdown)
    ep = ExpertParallel(placement, rank, world_size, observer=lambda: model.observer, monitor=monitor,
                        slow_delay_s=delay_ms / 1000 if slow_rank == rank else 0.0,
                        comm_device=device if backend == "nccl" else "cpu")
    for layer in model.moe_layers():
        layer.parallel = ep
    return AllToAllStats(world_size), monitor, ep


def rebalancer(run):
    """The demo's ``parallel.eplb.Rebalancer`` from its options (``DemoOptions``), or None."""
    if not run.rebalance_steps:
        return None
    return Rebalancer(run.rebalance_steps, run.rebalance_slots, run.rebalance_below)


def rebalance_report(ep) -> list[dict]:
    """Each rearrangement: when, how long, what moved, busiest / mean rank measured before it, predicted for the
    new placement, and measured after it (until the next one, or the end of the run), with the steps and the
    slots per MoE layer that measure rests on (a run's last window can be a few steps of its drain)."""
    out = []
    events = list(ep.events)
    for i, ev in enumerate(events):
        last = i + 1 == len(events)
        after, rows = (ep.measured_since(), ep.rows_since()) if last else (events[i + 1].before,
                                                                          events[i + 1].before_rows)
        steps = ep.steps + 1 - ev.step if last else events[i + 1].step - ev.step
        out.append({"step": ev.step, "seconds": round(ev.seconds, 4), "moved_experts": ev.moved,
                    "moved_bytes": ev.moved_bytes, "kept_layers": ev.kept,
                    **{k: {str(layer): round(v, 4) for layer, v in d.items()}
                       for k, d in (("before", ev.before), ("predicted", ev.predicted), ("measured", after))},
                    "measured_steps": steps,
                    "measured_slots_per_layer": round(sum(map(sum, rows.values())) / len(rows), 1) if rows else 0})
    return out


def rank_load_report(ep) -> dict:
    """Per-rank load (rows each rank's experts computed, from the exchanges' split sizes; every rank sees the same)
    over the whole run and over steps ``ep.measure_from`` to the end: the same steps whether or not the ranks
    rearranged, so a static run and an EPLB run compare on them; each as busiest rank / mean rank per layer and
    as the rows themselves. ``ep`` None (one process): every key, None."""
    if ep is None:
        return dict.fromkeys(("rank_max_over_mean_run", "rank_rows_run", "measure_from_step",
                              "rank_max_over_mean_from", "rank_rows_from"))

    def ratios(rows):
        return {str(k): round(v, 4) for k, v in ep.max_over_mean(rows).items()}

    def raw(rows):
        return {str(k): list(v) for k, v in sorted(rows.items())}

    span = ep.measure_from is not None
    return {"rank_max_over_mean_run": ratios(ep.rows_run), "rank_rows_run": raw(ep.rows_run),
            "measure_from_step": ep.measure_from,
            "rank_max_over_mean_from": ratios(ep.rows_from) if span else None,
            "rank_rows_from": raw(ep.rows_from) if span else None}


def rank_summary(rank: int, stats: AllToAllStats, summary: dict, wall: float, ep=None, records=()) -> dict:
    """The rank's part of the run's summary; ``records``: its requests (their raw latencies go to the launcher,
    which takes the run's percentiles over every rank's and drops them)."""
    # start-up: numpy (cli.summary), only when the command runs, not for --help
    from moescope.cli.summary import latencies

    a2a = stats.seconds["dispatch"] + stats.seconds["combine"]
    ttft, tpot = latencies(records)
    return {"raw_latency_s": {"ttft": ttft, "per_token": tpot},
            # the placement the rank ends with (after EPLB's rearrangements: the one serving at the end)
            "placement": {str(layer): [list(x) for x in v] for layer, v in ep.placement.layers.items()} if ep else None,
            "rank": rank, "completed": summary["completed"], "tokens": summary["tokens"],
            "tokens_per_s": summary["tokens_per_s"],
            "latency_s": summary["latency_s"], "all_to_all_s": round(a2a, 4),
            "all_to_all_share": round(a2a / wall, 4) if wall > 0 else None,
            "dispatch_s": round(stats.seconds["dispatch"], 4), "combine_s": round(stats.seconds["combine"], 4),
            "exchanges": stats.exchanges, "dispatch_received_bytes": stats.received_bytes,
            "peer_wait_s": [round(w, 4) for w in stats.peer_wait_s],
            "metrics_url": summary.get("metrics_url"), "canary_flip_ratio": summary.get("canary_flip_ratio"),
            "steps": ep.steps if ep is not None else None,
            "device": summary.get("device"), "backend": ep.backend if ep is not None else None,
            # busiest rank's rows / the mean rank's per layer: the whole run, and steps measure_from_step.. to the end
            # (since the last rearrangement: each rearrangement's "measured", below)
            **rank_load_report(ep),
            "rebalances": rebalance_report(ep) if ep is not None and ep.rebalancer is not None else None}
