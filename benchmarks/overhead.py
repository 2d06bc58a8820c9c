"""What observability costs the engine: a step (model forward + the step's capture work) bare, with metrics,
and with metrics + per-token trace capture, side by side in interleaved rounds in one run.

Two measures, both printed:
- hook cost per step, measured directly: one forward's hook calls (``on_routing``, ``on_layer_time`` per
  layer, then ``on_step``, including the routing probe's periodic flush, amortised) replayed 2000 times in a
  tight loop on the engine thread, as a share of the bare step time;
- the step-time ratio instrumented / bare (medians; the machine is shared, so this one is noisier).

The trace variant hands each step to a queued writer thread that packs the arrays (the trace store's
writer, minus the SQLite write): its work competes for the same 2 cores, which the step-time ratio shows.

Configs: tiny-demo (the bundled model: 3 MoE layers, 8 experts) and a Mixtral-shaped block (hidden 1024,
ffn 2816, 8 experts, top-2), at 1, 16, 256 and 2048 tokens per step, fp32.

    python benchmarks/overhead.py [--rounds 7] [--tokens 1 16 256 2048] [--out benchmarks/results/overhead.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from _results import save

import torch

from moescope.capture.observer import NOOP, FanOut, Observer
from moescope.capture.queued import QueuedObserver
from moescope.capture.token_trace import TokenTraceCapture
from moescope.metrics.state import MetricsObserver, ModelInfo
from moescope.runtime import loader
from moescope.runtime.engine import StepRecord
from moescope.runtime.model import MoETransformer, Segment

HERE = Path(__file__).resolve().parent


class Recorder(Observer):
    """Keeps one forward's hook calls, to replay them against each variant."""

    def __init__(self) -> None:
        self.calls = []

    def on_routing(self, layer, decision):
        self.calls.append(("on_routing", layer, decision))

    def on_layer_time(self, layer, router_s, experts_s):
        self.calls.append(("on_layer_time", layer, router_s, experts_s))


def hook_cost(observer: Observer, calls, step, n: int) -> float:
    """Seconds per step spent in the observer's hooks: the forward's calls plus ``on_step``, replayed ``n``
    times in a tight loop (includes the routing probe's periodic flush, amortised)."""
    bound = [(getattr(observer, c[0]), c[1:]) for c in calls]
    t = time.perf_counter()
    for _ in range(n):
        for fn, args in bound:
            fn(*args)
        observer.on_step(step)
    return (time.perf_counter() - t) / n


class PackingSink(Observer):
    """Stands in for the trace store's writer: packs each step's arrays on its own thread."""

    def __init__(self) -> None:
        self.records = 0

    def on_step(self, trace) -> None:
        trace.arrays()
        self.records += 1


def variants(model) -> dict[str, Observer | None]:
    info = ModelInfo.from_runtime(model)
    sink = QueuedObserver(PackingSink(), maxsize=4096, name="trace-writer")
    return {
        "none": None,
        "metrics": FanOut([MetricsObserver(info)]),
        "metrics+trace": FanOut([MetricsObserver(info), TokenTraceCapture(sink.on_step)]),
    }


def segments_for(n_tokens: int, max_len: int) -> list[Segment]:
    seg = min(n_tokens, max_len // 2)
    out = [Segment(seg) for _ in range(n_tokens // seg)]
    if n_tokens % seg:
        out.append(Segment(n_tokens % seg))
    return out


def run_config(model: MoETransformer, tokens: list[int], rounds: int) -> list[dict]:
    rows = []
    obs = variants(model)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n in tokens:
            toks = torch.randint(0, 256, (n,), generator=gen)
            segs = segments_for(n, model.cfg.max_seq_len)
            step = StepRecord(0, "prefill", 0.0, 0.001, n, (("bench", 0, n),))
            reps = max(1, min(30, 4096 // n))
            times = {name: [] for name in obs}
            for r in range(rounds + 1):  # round 0 warms up
                order = list(obs) if r % 2 == 0 else list(obs)[::-1]
                for name in order:
                    model.observer = obs[name] or NOOP
                    t = time.perf_counter()
                    for _ in range(reps):
                        model(toks, segs)
                        model.observer.on_step(step)
                    if r:
                        times[name].append((time.perf_counter() - t) / reps)
            rec = Recorder()
            model.observer = rec
            model(toks, segs)
            bare = statistics.median(times["none"])
            row = {"tokens": n, "bare_s": bare}
            for name in ("metrics", "metrics+trace"):
                med = statistics.median(times[name])
                h = statistics.median(hook_cost(obs[name], rec.calls, step, 2000) for _ in range(3))
                row[name] = {"step_s": med, "ratio": med / bare, "hook_s": h, "hook_share": h / bare}
            rows.append(row)
    model.observer = NOOP
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "overhead.json")
    args = ap.parse_args(argv)
    configs = {"tiny-demo": loader.build_model("tiny-demo", device=args.device),
               "mixtral-block": loader.build_model("mixtral-block", weights=None, device=args.device)}
    report = {"device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "rounds": args.rounds, "configs": {}}
    print(f"capture overhead per step, {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"medians of {args.rounds} interleaved rounds")
    print(f"{'config':>14} {'tokens':>6} {'bare ms':>9} | {'metrics: hook us':>16} {'share':>7} {'ratio':>6} | "
          f"{'+trace: hook us':>15} {'share':>7} {'ratio':>6}")
    for name, model in configs.items():
        rows = run_config(model, args.tokens, args.rounds)
        report["configs"][name] = rows
        for r in rows:
            m, t = r["metrics"], r["metrics+trace"]
            print(f"{name:>14} {r['tokens']:>6} {r['bare_s'] * 1e3:>9.3f} | {m['hook_s'] * 1e6:>16.1f} "
                  f"{m['hook_share']:>6.2%} {m['ratio']:>6.3f} | {t['hook_s'] * 1e6:>15.1f} {t['hook_share']:>6.2%} "
                  f"{t['ratio']:>6.3f}")
    save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
