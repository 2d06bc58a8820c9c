"""What observability costs serving, measured as users run it: the engine serving a workload with capture off and on,
in one process, with moescope's kill switch (``Instrumentation.capture``): metrics (``moescope.instrument()``), and
metrics + per-token traces into a real SQLite store (``Traces``).

Per variant, one instrumentation is set up once; then rounds alternate capture off (the engine reports to no
moescope observer: the bare engine) and on, their order alternating, the same workload (requests queued at once,
greedy, the same tokens) each time. The ratio of a round is on / off; the figures are the median and the quartiles
of the per-round ratios (``benchmarks/_verdict.py`` judges a goal met only where the upper quartile is within it).
One process, one model, one set of warm caches: nothing but capture differs between the two sides of a round.

Two more measures, because this project's machines (shared VMs) change speed by tens of percent over seconds, which
passes of a second or two see as noise of several percent either way:
- A/A: the same passes, capture off on both sides: the machine's own noise between two passes, beside the ratios it
  blurs;
- interleaved: one serving run per round with capture flipped every ``BLOCK`` engine steps (between steps, on the
  engine's thread: whole steps each side), pairs of blocks in random order; the round's ratio is the mean decode step
  with capture on over the mean with it off. Blocks tens of milliseconds apart see the same machine. What capture
  runs beside the engine (the evaluator once per interval, the trace writer's tick) lands in either kind of block,
  so this ratio holds only part of it: the background threads' CPU over the serving time (``background_cpu_share``)
  is measured apart, and the ratio plus that whole share is an upper bound of capture's cost (the threads run on
  another core; the engine waits on them at most for the interpreter's lock).

Also per variant: the CPU time ratio (every thread of the process: the evaluator and the trace writer included),
the share of serving time Python's cyclic GC ran (``gc.callbacks``), and, for traces, what the store kept. With
capture on, what moescope does runs on the engine's thread (the hooks: O(1) each, tests/test_step_work.py), on the
evaluator's (once per interval), and on the trace writer's; the ratio is all of it, as users pay it.

Workloads (issue [lean]): tiny-demo and deepseek-v3-shape (58 MoE layers x 256 experts), 16 requests x 96 output
tokens each at 16 concurrent requests (deepseek-v3-shape: 16 x 32, half the rounds: a pass there takes seconds);
tiny-demo also at 1 request at a time (half the rounds). Each side of a round serves its workload a few times back to
back at tiny-demo (a pass of under a second is at the mercy of a single scheduler hiccup), once at deepseek-v3-shape.

    python benchmarks/overhead.py [--rounds 21] [--quick] [--device cuda] [--out benchmarks/results/overhead.json]
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _results
from _verdict import judge, quartiles

import torch

import moescope
from moescope.config import Config, Metrics, Traces
from moescope.runtime import loader, traffic
from moescope.runtime.engine import Engine

VARIANTS = ("metrics", "metrics+traces")
BLOCK = 8  # engine steps per block of the interleaved rounds


def _requests(n: int, tokens: int):
    """``n`` requests of exactly ``tokens`` output tokens each (the issue's 16 x 96)."""
    cfg = traffic.TrafficConfig(seed=0, output_tokens_median=tokens, output_tokens_range=(tokens, tokens))
    return traffic.generate(cfg, n)


def _serve(model, reqs, max_batch: int) -> dict:
    """One serving run (``Engine.run``, all requests queued at once): wall and CPU seconds, GC time."""
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
        seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
        gc.callbacks.remove(on_gc)
    return {"seconds": seconds, "cpu_s": cpu, "tokens": sum(r.n_output for r in records), "gc_s": collected["s"],
            "gc_full": collected["full"]}



def _serve_n(model, reqs, max_batch: int, repeat: int) -> dict:
    """The workload served ``repeat`` times back to back, its figures summed (a longer pass per side of a round: the
    machine's noise averages over more of it)."""
    runs = [_serve(model, reqs, max_batch) for _ in range(repeat)]
    return {k: (sum(r[k] for r in runs) if k != "tokens" else runs[0][k]) for k in runs[0]}


def run_variant(model, reqs, variant: str, concurrency: int, rounds: int, store: Path, repeat: int = 1) -> dict:
    """Rounds of (capture off, capture on) in alternating order on one instrumentation; each side serves the
    workload ``repeat`` times."""
    config = Config(metrics=Metrics(), traces=Traces(str(store)) if variant == "metrics+traces" else None)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    a_a: list[float] = []  # capture off on both sides: the machine's own noise between two passes
    with moescope.instrument(model, config) as inst:
        tids = _background(inst)
        bg0 = _thread_cpu_s(tids)
        for r in range(rounds + 1):  # round 0 warms both sides up
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                inst.capture.set(on)
                res = _serve_n(model, reqs, concurrency, repeat)
                if r:
                    runs[on].append(res)
        bg = _thread_cpu_s(tids) - bg0
        inst.capture.set(False)
        for _ in range(rounds):
            a, b = (_serve_n(model, reqs, concurrency, repeat)["seconds"] for _ in range(2))
            a_a.append(b / a)
        interleaved = _interleaved(inst, model, reqs, concurrency, rounds)
        inst.capture.set(True)
        recorder = inst.recorder
    ratios = [a["seconds"] / b["seconds"] for a, b in zip(runs[True], runs[False])]
    cpu = [a["cpu_s"] / b["cpu_s"] for a, b in zip(runs[True], runs[False])]
    q1, med, q3 = quartiles(ratios)
    out = {"ratio": med, "ratios": ratios, "q1": q1, "q3": q3, "cpu_ratio": statistics.median(cpu),
           "off_s": statistics.median(x["seconds"] for x in runs[False]),
           "on_s": statistics.median(x["seconds"] for x in runs[True]),
           # over all rounds: full collections are rare events (one every few rounds), a median hides them
           "gc_share_off": sum(x["gc_s"] for x in runs[False]) / sum(x["seconds"] for x in runs[False]),
           "gc_share_on": sum(x["gc_s"] for x in runs[True]) / sum(x["seconds"] for x in runs[True]),
           "gc_full_collections_on": sum(x["gc_full"] for x in runs[True]),
           "tokens": runs[True][0]["tokens"],
           # the same passes with capture off on both sides: how far two passes differ on this machine alone
           "a_a_ratios": a_a, "a_a_quartiles": quartiles(a_a),
           "interleaved": interleaved,
           # the evaluator's and the trace writer's CPU over the capture-on passes' serving time (they also ran,
           # idle, during the off passes: an upper bound)
           "background_cpu_share": bg / sum(x["seconds"] for x in runs[True])}
    if recorder is not None:
        out.update(stored=recorder.written, dropped=recorder.dropped, errors=recorder.errors)
    return out


def _interleaved(inst, model, reqs, max_batch: int, rounds: int, block: int = BLOCK, seed: int = 0) -> dict:
    """Rounds of one serving run each, capture flipped every ``block`` engine steps between steps (on the engine's
    thread: whole steps on each side), each pair of blocks in a random order: per round, the mean decode step with
    capture on over the mean with it off. The machine's speed drifts by tens of percent over seconds on a shared VM
    (``a_a`` below); blocks a few tens of milliseconds apart see the same machine. What runs off the engine's thread
    because of capture (the evaluator once per interval, the trace writer's tick) lands in either kind of block:
    this ratio holds about half of it, and ``background_cpu_share`` says how much there is."""
    rng = random.Random(seed)
    ratios = []
    for r in range(rounds + 1):  # round 0 warms up
        engine = Engine(model, max_batch=max_batch)
        for q in reqs:
            engine.submit(q.prompt, max_new_tokens=q.max_new_tokens, domain=q.domain, tenant=q.tenant)
        times: dict[bool, list[float]] = {True: [], False: []}
        i, first = 0, True
        while engine.has_work:
            if i % (2 * block) == 0:
                first = rng.random() < 0.5
            on = first if i % (2 * block) < block else not first
            inst.capture.set(on)
            waiting = len(engine._waiting)
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            if len(engine._waiting) == waiting:  # a decode step (a prefill admits waiting requests)
                times[on].append(dt)
            i += 1
        engine.idle()
        if r and times[True] and times[False]:
            ratios.append(statistics.fmean(times[True]) / statistics.fmean(times[False]))
    inst.capture.set(True)
    q1, med, q3 = quartiles(ratios)
    return {"block_steps": block, "ratio": med, "ratios": ratios, "q1": q1, "q3": q3}


def _thread_cpu_s(tids) -> float:
    """CPU seconds (user + system) of this process's threads ``tids`` (native ids), from /proc/self/task."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for tid in tids:
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        except OSError:
            continue
    return total


def _background(inst) -> list[int]:
    """The native ids of the threads capture runs beside the engine: the evaluator's and the trace writer's."""
    threads = [inst.metrics.evaluator._thread]
    if inst.recorder is not None:
        threads.append(inst.recorder.queue._thread)
    return [t.native_id for t in threads if t is not None]


GOALS = {"metrics": 1.01, "metrics+traces": 1.03}  # issue [lean], at 16 concurrent requests


def run_workload(name: str, model, concurrency: int, n_requests: int, rounds: int, tmp: Path,
                 tokens: int = 96, repeat: int = 1) -> dict:
    """One workload's row: ``n_requests`` requests of ``tokens`` output tokens at ``concurrency``, each variant's
    rounds of capture off and on (benchmarks/scale.py serves deepseek-v3-shape through it too)."""
    reqs = _requests(n_requests, tokens)
    row = {"model": name, "concurrency": concurrency, "requests": n_requests, "output_tokens": tokens,
           "rounds": rounds, "repeat": repeat}
    for variant in VARIANTS:
        label = f"overhead: {name} at {concurrency}, {variant}, {rounds} rounds of off and on"
        with _results.progress(label, 1):
            row[variant] = run_variant(model, reqs, variant, concurrency, rounds,
                                       tmp / f"{name}-{concurrency}-{variant}.sqlite", repeat)
    row["bare_s"] = row["metrics"]["off_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = _results.parser(__doc__, quick="tiny-demo only, 4 requests x 16 tokens, 1 round (CI keeps the script working)",
                         rounds=21)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (benchmarks/device_checks.sh: cuda)")
    args = _results.parse(ap, argv, lambda a: "overhead" if a.device == "cpu" else f"overhead-{a.device}")
    # (model, concurrent requests, requests, output tokens each, passes of the workload per side of a round, rounds):
    # deepseek-v3-shape's pass takes seconds (58 MoE layers x 256 experts), so fewer tokens and rounds there
    half = max(5, args.rounds // 2)
    if args.quick:
        workloads = [("tiny-demo", 4, 4, 16, 1, args.rounds)]
    else:
        workloads = [("tiny-demo", 16, 16, 96, 4, args.rounds), ("deepseek-v3-shape", 16, 16, 32, 1, half),
                     ("tiny-demo", 1, 8, 96, 2, half)]
    models = {name: loader.build_model(name, device=args.device) for name in {w[0] for w in workloads}}
    report = {"torch": torch.__version__, "device": args.device, "threads": torch.get_num_threads(),
              "rounds": args.rounds, "goals": GOALS, "workloads": []}
    print(f"capture's cost, capture on / off in one process (Engine.run; {args.rounds} rounds; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads)")
    print(f"{'model':>18} {'conc':>4} {'reqs':>4} {'off s':>7} | {'variant':>15} {'median':>7} {'IQR':>13} "
          f"{'cpu':>6} {'gc on':>6} {'goal':>5}")
    with tempfile.TemporaryDirectory(prefix="moescope-overhead-") as tmp:
        for name, conc, n_req, tokens, repeat, rounds in workloads:
            row = run_workload(name, models[name], conc, n_req, rounds, Path(tmp), tokens, repeat)
            for variant in VARIANTS:
                v = row[variant]
                met = judge(v["ratios"], GOALS[variant]) if conc == 16 else None
                print(f"{name:>18} {conc:>4} {n_req:>4} {v['off_s']:>7.3f} | {variant:>15} {v['ratio']:>6.3f}x "
                      f"{v['q1']:>6.3f}-{v['q3']:<6.3f} {v['cpu_ratio']:>5.3f}x {v['gc_share_on']:>6.2%} "
                      f"{'-' if conc != 16 else {True: 'met', False: 'missed', None: 'n/r'}[met]:>5}")
                print("    per-round ratios: " + " ".join(f"{x:.3f}" for x in v["ratios"]))
            report["workloads"].append(row)
    _results.save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
