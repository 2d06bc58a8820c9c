"""What observability costs serving, measured as users run it: the engine serving a workload bare, with
``moescope.instrument()`` (metrics), and with ``moescope.instrument(observers=[TraceRecorder(...)])`` (metrics +
per-token traces into a real SQLite store), side by side in interleaved rounds in one process.

Two measures, both printed:
- end to end: the serving wall time of ``Engine.run`` over the same workload (requests queued at once, greedy,
  the same tokens every round) per variant; ratio = the median over rounds of instrumented / bare in the same
  round (variants run back to back, their order alternating, so a machine that slows down for a while slows
  both sides of a pair). ``cpu`` is the same for the process's CPU time (all threads, the drain included):
  on a VM whose neighbours steal time it is the steadier figure. The trace writer's
  thread works while the engine serves, so its competition for the cores and the GIL is in this figure; its
  drain after the run is reported apart (``drain_s``), and so are the requests it stored and any it dropped.
- hook share: the engine thread's own time in the hooks of one step (every ``on_routing`` and
  ``on_layer_time`` of a forward, then ``on_step``), replayed in a tight loop, as a share of the bare step. It
  leaves out the routing probe's summary, which runs on the engine thread once per interval (0.25 s).
- GC share: the time Python's cyclic garbage collector ran while the engine served (``gc.callbacks``), as a
  share of the serving time. The routing probe holds each step's decisions (tensors: GC-tracked objects) until
  its summary; held across collections, they are promoted to the oldest generation, whose collections walk
  every object of the process (torch's included: tens of ms each). The bare engine frees its decisions at once.

Workloads: tiny-demo at 1 and 16 concurrent requests (16 = 16 tokens per decode step), and
deepseek-v3-shape at 16 (58 MoE layers x 256 experts; ``--quick`` skips it).

    python benchmarks/overhead.py [--rounds 9] [--quick] [--device cuda] [--out benchmarks/results/overhead.json]
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _results

import torch

import moescope
from moescope.capture.observer import NOOP, Observer
from moescope.runtime import loader, traffic
from moescope.runtime.engine import Engine, StepRecord
from moescope.runtime.model import Segment
from moescope.traces.recorder import TraceRecorder

VARIANTS = ("bare", "metrics", "metrics+traces")


class _Calls(Observer):
    """Keeps one forward's hook calls, to replay them against a variant's observer."""

    def __init__(self) -> None:
        self.calls = []

    def on_routing(self, layer, decision):
        self.calls.append(("on_routing", layer, decision))

    def on_layer_time(self, layer, router_s, experts_s):
        self.calls.append(("on_layer_time", layer, router_s, experts_s))


def _serve(model, reqs, variant: str, store: Path, max_batch: int) -> dict:
    """One serving run of ``reqs`` under ``variant``; the instrumentation is set up and closed around it, as a
    user's process would (set-up and close are not in the serving time)."""
    observers = []
    recorder = None
    if variant == "metrics+traces":
        recorder = TraceRecorder(store, model=model.cfg.name)
        observers.append(recorder)
    inst = moescope.instrument(model, observers=observers) if variant != "bare" else None
    engine = Engine(model, max_batch=max_batch)
    collected = {"s": 0.0, "full": 0, "start": 0.0}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collected["start"] = time.perf_counter()
        else:
            collected["s"] += time.perf_counter() - collected["start"]
            collected["full"] += info["generation"] == 2

    gc.callbacks.append(on_gc)
    t, cpu = time.perf_counter(), time.process_time()
    try:
        records = engine.run(reqs, realtime=False)
    finally:
        seconds = time.perf_counter() - t
        gc.callbacks.remove(on_gc)
    t = time.perf_counter()
    if inst is not None:
        inst.close()  # the writer drains its queue and commits here
    drain = time.perf_counter() - t
    cpu = time.process_time() - cpu  # every thread of the process, the drain included
    model.observer = NOOP
    out = {"seconds": seconds, "cpu_s": cpu, "tokens": sum(r.n_output for r in records), "drain_s": drain,
           "gc_s": collected["s"], "gc_full": collected["full"]}
    if recorder is not None:
        out.update(stored=recorder.written, dropped=recorder.dropped, errors=recorder.errors)
    return out


def _hook_cost(model, variant: str, store: Path, n_tokens: int, n: int = 300) -> float:
    """Seconds per step in the variant's hooks on the engine thread (no writer work counted: the queue is
    only filled, and its consumer stays behind the same lock the real one does)."""
    calls = _Calls()
    model.observer = calls
    with torch.inference_mode():
        model(torch.randint(0, 256, (n_tokens,), device=model.device), [Segment(1) for _ in range(n_tokens)])  # decode
    model.observer = NOOP
    recorder = TraceRecorder(store, model=model.cfg.name, queue_size=n + 8) if variant == "metrics+traces" else None
    inst = moescope.instrument(model, observers=[recorder] if recorder else [])
    obs = inst.observer
    bound = [(getattr(obs, c[0]), c[1:]) for c in calls.calls]
    step = StepRecord(0, "decode", 0.0, 0.001, n_tokens, tuple((f"r{i}", 0, 1) for i in range(n_tokens)))
    t = time.perf_counter()
    for _ in range(n):
        for fn, args in bound:
            fn(*args)
        obs.on_step(step)
    seconds = (time.perf_counter() - t) / n
    inst.close()
    model.observer = NOOP
    return seconds


def run_workload(name: str, model, concurrency: int, n_requests: int, rounds: int, tmp: Path) -> dict:
    reqs = traffic.generate(traffic.TrafficConfig(seed=0, output_tokens_median=24), n_requests)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    extra: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in _results.track(range(rounds + 1), f"overhead: {name} at {concurrency}, a warm-up and {rounds} rounds"):
        # round 0 warms up (and builds the store)
        for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            res = _serve(model, reqs, v, tmp / f"{name}-{concurrency}-{r}-{v}.sqlite", concurrency)
            if r:
                times[v].append(res["seconds"])
                extra[v].append(res)
    bare = statistics.median(times["bare"])
    bare_cpu = [e["cpu_s"] for e in extra["bare"]]
    tokens = extra["bare"][0]["tokens"]
    step_s = bare / max(1, tokens / concurrency)  # a decode step's time, roughly
    row = {"model": name, "concurrency": concurrency, "requests": n_requests, "output_tokens": tokens,
           "rounds": rounds, "bare_s": bare,
           "bare_gc_share": sum(e["gc_s"] for e in extra["bare"]) / sum(times["bare"])}
    for v in VARIANTS[1:]:
        med = statistics.median(times[v])
        hook = statistics.median(_hook_cost(model, v, tmp / f"hook-{name}-{v}.sqlite", concurrency) for _ in range(3))
        paired = [t / b for t, b in zip(times[v], times["bare"])]  # each round against its own bare run
        cpu = [e["cpu_s"] / b for e, b in zip(extra[v], bare_cpu)]
        row[v] = {"serving_s": med, "ratio": statistics.median(paired), "ratios": paired,
                  "ratio_of_medians": med / bare, "cpu_ratio": statistics.median(cpu),
                  "hook_s": hook, "hook_share_of_step": hook / step_s,
                  "drain_s": statistics.median(e["drain_s"] for e in extra[v]),
                  # over all rounds: full collections are rare events (one every few rounds), a median hides them
                  "gc_share": sum(e["gc_s"] for e in extra[v]) / sum(times[v]),
                  "gc_full_collections": sum(e["gc_full"] for e in extra[v])}
        if v == "metrics+traces":
            row[v].update(stored=extra[v][-1]["stored"], dropped=max(e["dropped"] for e in extra[v]),
                          errors=max(e["errors"] for e in extra[v]))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = _results.parser(__doc__, quick="tiny-demo only, 1 round (CI keeps the script working)", rounds=9)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (benchmarks/device_checks.sh: cuda)")
    args = _results.parse(ap, argv, lambda a: "overhead" if a.device == "cpu" else f"overhead-{a.device}")
    rounds, out = args.rounds, args.out
    workloads = [("tiny-demo", 1, 4 if args.quick else 8), ("tiny-demo", 16, 16 if args.quick else 48)]
    if not args.quick:
        workloads.append(("deepseek-v3-shape", 16, 16))
    models = {name: loader.build_model(name, device=args.device) for name in {w[0] for w in workloads}}
    report = {"torch": torch.__version__, "device": args.device, "threads": torch.get_num_threads(),
              "rounds": rounds, "workloads": []}
    print(f"observability cost, end to end (Engine.run; medians of {rounds} interleaved rounds; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads)")
    print(f"{'model':>18} {'conc':>4} {'bare s':>7} | {'metrics':>7} {'cpu':>6} {'hook':>6} | {'+traces':>7} "
          f"{'cpu':>6} {'hook':>6} {'drain s':>7} {'stored':>6} {'dropped':>7}")
    with tempfile.TemporaryDirectory(prefix="moescope-overhead-") as tmp:
        for name, conc, n_req in workloads:
            row = run_workload(name, models[name], conc, n_req, rounds, Path(tmp))
            report["workloads"].append(row)
            m, t = row["metrics"], row["metrics+traces"]
            print(f"{name:>18} {conc:>4} {row['bare_s']:>7.3f} | {m['ratio']:>6.3f}x {m['cpu_ratio']:>5.3f}x "
                  f"{m['hook_share_of_step']:>6.2%} | {t['ratio']:>6.3f}x {t['cpu_ratio']:>5.3f}x "
                  f"{t['hook_share_of_step']:>6.2%} {t['drain_s']:>7.3f} {t['stored']:>6} {t['dropped']:>7}")
    _results.save(report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
