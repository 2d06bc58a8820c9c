"""Where each microsecond of moescope's capture goes: what it does per layer, per step, per request, per token and per
interval, on which thread, on each engine, as counted work (load-independent) and as time (medians of repeated
tight loops; noisy on a loaded machine, so the load average is recorded).

Per engine and shape, the hooks of one real decode step are captured and replayed against an instrumented observer
(metrics; metrics + traces):
- per layer: ``on_routing`` + ``on_layer_time`` of one MoE layer (the engine's thread);
- per step: ``on_step`` (the engine's thread), with no interval summary in it (that is counted per interval);
- per request: ``on_request`` of a request with 1 and with 96 output tokens (the engine's thread): the difference
  is the per-token work;
- per interval: the summary of the steps since the last (routing, counters, histograms), the judgement of the
  window and the learned reference (``moescope.metrics``' evaluation), per summarised step and per interval,
  on the thread that does it;
- GC: the GC-tracked objects moescope holds per step until its summary (what promotes objects to the oldest
  generation) and what one full collection costs with the model loaded.
HF: a tiny Mixtral's forward (3 layers, 512 tokens) bare and instrumented, alternating; the hooks' work per forward.
vLLM: the adapter's ``begin_step``/``end_step`` (the plugin's engine-thread work) with a scheduler output of B
requests, and its relay's delivery per step (the relay thread).

    python benchmarks/cost_model.py [--quick] [--out benchmarks/results/cost_model.json]
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _results
from _work import WorkCount

import torch

import moescope
from moescope.capture.observer import NOOP, Observer
from moescope.capture.records import RequestRecord, StepRecord
from moescope.config import Config, Metrics, Traces
from moescope.runtime import loader, traffic
from moescope.runtime.engine import Engine
from moescope.runtime.model import Segment

VARIANTS = ("metrics", "metrics+traces")


class _Calls(Observer):
    """Keeps one forward's per-layer hook calls, to replay against a variant's observer."""

    def __init__(self) -> None:
        self.calls: list = []

    def on_routing(self, layer, decision):
        self.calls.append(("on_routing", layer, decision))

    def on_layer_time(self, layer, router_s, experts_s):
        self.calls.append(("on_layer_time", layer, router_s, experts_s))


def _median_us(fn, n: int, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean time of ``n`` calls, in microseconds."""
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out)


def _counted(fn) -> dict:
    with WorkCount() as w:
        fn()
    return {"python_calls": w.python, "moescope_calls": w.of("moescope."), "c_calls": w.c, "torch_ops": w.torch_ops,
            "metadata_reads": w.metadata_reads}


def _instrument(model, variant: str, store: Path):
    """An instrumentation whose evaluator waits a minute: the per-interval work runs only where measured."""
    return moescope.instrument(model, Config(metrics=Metrics(interval_s=60),
                                             traces=Traces(str(store)) if variant == "metrics+traces" else None))


def _hold_summary(inst) -> None:
    """No interval summary during the per-hook loops (it is measured per interval): the evaluator's interval is a
    minute (``_instrument``); before the evaluator existed, the probe summarised on the engine's thread."""
    m = inst.metrics
    if not hasattr(m, "evaluate"):
        m.probe.interval_s, m.probe.max_pending = float("inf"), 10**12


def _evaluate(inst) -> None:
    m = inst.metrics
    if hasattr(m, "evaluate"):
        m.evaluate()
    else:  # before the evaluator: the engine's flush, then a scrape's judgement (learned reference included)
        m.flush()
        m.layer_gauges()


def _record(rid: str, n: int) -> RequestRecord:
    return RequestRecord(request_id=rid, prompt="p", output="o", prompt_tokens=(1, 2, 3), output_tokens=(4,) * n,
                         arrival=0.0, queue_s=0.001, prefill_s=0.002, ttft_s=0.003,
                         token_latencies_s=tuple(0.003 + 0.0001 * i for i in range(n)), total_s=0.05,
                         finish_reason="length")


def runtime_rows(name: str, batch: int, tmp: Path, quick: bool) -> list[dict]:
    model = loader.build_model(name)
    calls = _Calls()
    model.observer = calls
    with torch.inference_mode():
        model(torch.randint(0, 256, (batch,), device=model.device), [Segment(1) for _ in range(batch)])
    model.observer = NOOP
    layer_calls = [c for c in calls.calls if c[1] == calls.calls[0][1]]  # one layer's hooks
    n_layers = len({c[1] for c in calls.calls})
    step = StepRecord(0, "decode", 0.0, 0.001, batch, tuple((f"r{i}", 5, 1) for i in range(batch)))
    rows = []
    for variant in VARIANTS:
        inst = _instrument(model, variant, tmp / f"{name}-{batch}-{variant}.sqlite")
        obs = inst.observer
        _hold_summary(inst)
        layer = [(getattr(obs, c[0]), c[1:]) for c in layer_calls]

        def one_layer():
            for fn, args in layer:
                fn(*args)

        def one_step():
            for fn, args in ((getattr(obs, c[0]), c[1:]) for c in calls.calls):
                fn(*args)
            obs.on_step(step)

        n = 200 if quick else 2000
        per_layer = _median_us(one_layer, n)
        per_step = _median_us(lambda: obs.on_step(step), n)
        req1 = _median_us(lambda: obs.on_request(_record("r0", 1)), n // 10)
        req96 = _median_us(lambda: obs.on_request(_record("r0", 96)), n // 10)
        work = {"layer": _counted(one_layer), "step": _counted(lambda: obs.on_step(step)),
                "request_1_token": _counted(lambda: obs.on_request(_record("r1", 1))),
                "request_96_tokens": _counted(lambda: obs.on_request(_record("r2", 96)))}
        _evaluate(inst)
        # per interval: S steps' hooks, then one interval's work (summary, judgement), timed on its own
        steps = 25 if quick else 100
        intervals = []
        for _ in range(3 if quick else 7):
            for _ in range(steps):
                one_step()
            t = time.perf_counter()
            _evaluate(inst)
            intervals.append((time.perf_counter() - t) * 1e6)
        inst.close()
        model.observer = NOOP
        rows.append({"engine": "runtime", "model": name, "batch": batch, "variant": variant, "layers": n_layers,
                     "per_layer_us": per_layer, "per_step_us": per_step, "per_request_us": req1,
                     "per_token_us": (req96 - req1) / 95, "interval_steps": steps,
                     "per_interval_us": statistics.median(intervals), "work": work})
    return rows


def gc_row(name: str, batch: int, n_requests: int) -> dict:
    """GC-tracked objects moescope holds per step until the interval's summary, and one full collection's time."""
    model = loader.build_model(name)
    reqs = traffic.generate(traffic.TrafficConfig(seed=0, output_tokens_median=24), n_requests)
    inst = _instrument(model, "metrics", Path("unused"))
    _hold_summary(inst)
    engine = Engine(model, max_batch=batch)
    for r in reqs:
        engine.submit(r.prompt, max_new_tokens=r.max_new_tokens)
    gc.collect()
    before = len(gc.get_objects())
    steps = 0
    while engine.has_work:  # stepped by hand: no idle signal (which summarises) until the count is taken
        engine.step()
        steps += 1
    gc.collect()
    held = len(gc.get_objects()) - before
    _evaluate(inst)
    gc.collect()
    after = len(gc.get_objects()) - before
    inst.close()
    model.observer = NOOP
    full = []
    for _ in range(3):
        t = time.perf_counter()
        gc.collect()
        full.append((time.perf_counter() - t) * 1e3)
    return {"model": name, "batch": batch, "steps": steps, "held_objects_per_step": (held - after) / max(1, steps),
            "full_collection_ms": statistics.median(full), "tracked_objects": len(gc.get_objects())}


def hf_row(rounds: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM  # optional: the hf extra (the benchmark needs it)

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("mixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                               num_attention_heads=4, vocab_size=100, num_key_value_heads=2, num_local_experts=6,
                               num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    x = torch.randint(0, 100, (1, 512))

    def forward():
        with torch.inference_mode():
            model(x)

    for _ in range(3):
        forward()
    bare, inst_t = [], []
    with moescope.instrument(model) as inst:  # as users run it: the evaluator at its default interval
        for r in range(rounds):  # capture off and on in alternating order (the kill switch: hooks removed)
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                inst.capture.set(on)
                (inst_t if on else bare).append(_median_us(forward, 20, 3))
    inst = _instrument(model, "metrics", Path("unused"))
    _hold_summary(inst)
    on = _counted(forward)
    inst.capture.set(False)
    off = _counted(forward)  # the model's own work: what capture adds is the difference
    inst.close()
    work = {k: on[k] - off[k] for k in on}
    ratios = [i / b for i, b in zip(inst_t, bare)]
    return {"engine": "hf", "model": "tiny mixtral (3 layers, 6 experts, 512 tokens)",
            "bare_us": statistics.median(bare), "metrics_us": statistics.median(inst_t),
            "ratio": statistics.median(ratios), "ratios": ratios, "work_per_forward": work}


def main(argv: list[str] | None = None) -> int:
    ap = _results.parser(__doc__, quick="tiny-demo only, fewer repeats (CI keeps the script working)")
    args = _results.parse(ap, argv, "cost_model")
    report: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "runtime": [], "gc": []}
    shapes = [("tiny-demo", 1), ("tiny-demo", 16)] + ([] if args.quick else [("deepseek-v3-shape", 16)])
    with tempfile.TemporaryDirectory(prefix="moescope-cost-") as tmp:
        for name, batch in _results.track(shapes, "cost model: runtime hooks"):
            report["runtime"] += runtime_rows(name, batch, Path(tmp), args.quick)
    for name, batch, n in [("tiny-demo", 16, 48)] + ([] if args.quick else [("deepseek-v3-shape", 16, 16)]):
        report["gc"].append(gc_row(name, batch, n))
    report["hf"] = hf_row(3 if args.quick else 21)
    print(f"{'model':>18} {'B':>3} {'variant':>15} {'layer us':>9} {'step us':>8} {'req us':>7} {'token us':>8} "
          f"{'interval us':>11} {'py/step':>7}")
    for r in report["runtime"]:
        print(f"{r['model']:>18} {r['batch']:>3} {r['variant']:>15} {r['per_layer_us']:>9.2f} {r['per_step_us']:>8.2f} "
              f"{r['per_request_us']:>7.1f} {r['per_token_us']:>8.2f} {r['per_interval_us']:>11.0f} "
              f"{r['work']['step']['python_calls']:>7}")
    for g in report["gc"]:
        print(f"gc {g['model']} B={g['batch']}: {g['held_objects_per_step']:.1f} objects held per step, full "
              f"collection {g['full_collection_ms']:.1f} ms ({g['tracked_objects']} tracked)")
    h = report["hf"]
    print(f"hf: {h['ratio']:.3f}x ({h['bare_us']:.0f} -> {h['metrics_us']:.0f} us per forward), "
          f"{h['work_per_forward']['moescope_calls']} moescope calls, {h['work_per_forward']['torch_ops']} torch ops "
          f"(+ {h['work_per_forward']['metadata_reads']} tensor metadata reads)")
    _results.save(report, args.out, packages=("torch", "transformers"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
