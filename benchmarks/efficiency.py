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

    python benchmarks/efficiency.py            # -> benchmarks/results/efficiency.json
    python benchmarks/efficiency.py --quick    # batches 1 and 4, a few tokens (CI) -> efficiency-quick.json
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


def measure(model, batch: int, tokens: int) -> dict:
    cfg = model.cfg
    seen = []
    probe = RoutingProbe(seen.append, interval_s=0.0)
    with moescope.instrument(model, observers=[probe]) as handle:
        st = handle.metrics
        flush, spent = st.probe.flush, [0.0]

        def timed(final: bool = False) -> None:  # the metrics' own probe: its summarising, timed
            t0 = time.perf_counter()
            flush(final)
            spent[0] += time.perf_counter() - t0

        st.probe.flush = timed
        engine = Engine(model, max_batch=batch)
        # the demo's traffic (four domains, varied prompts): a batch of one prompt repeated would share experts
        for r in traffic.generate(traffic.TrafficConfig(seed=batch), batch):
            engine.submit(r.prompt, max_new_tokens=tokens, ignore_eos=True)
        while engine.has_work:
            engine.step()
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
    c = st.counters
    dec_tokens = c.get(("moescope_tokens_total", ("decode",)), 0.0)
    w = c.get(("moescope_step_read_bytes_total", ("decode", "weights")), 0.0)
    kv = c.get(("moescope_step_read_bytes_total", ("decode", "kv")), 0.0)
    step_s = sum(h._sum.get() for (name, _), h in st._children.items() if name == "moescope_step_seconds")
    mean, _ = step_experts.uniform_distinct(cfg.n_experts, cfg.top_k, [batch])
    child = st._children.get(("moescope_step_seconds", ("decode",)))
    dec = None if child is None else type("Dec", (), {"sum": child._sum.get(), "count": sum(
        b.get() for b in child._buckets)})
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


def markdown(d: dict) -> list[str]:
    """The docs' worked example (docs/metrics.md, "Efficiency"), one table per shape."""
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
    ap = _results.parser(__doc__, quick="batches 1 and 4, 3 tokens each (CI keeps the script working)")
    ap.add_argument("--markdown", metavar="RESULTS", type=Path, default=None,
                    help="print the docs' table from a results file instead of measuring")
    args = _results.parse(ap, argv, "efficiency")
    if args.markdown is not None:
        print("\n".join(markdown(json.loads(args.markdown.read_text()))).rstrip("\n"))
        return 0
    batches, tokens = ((1, 4), 3) if args.quick else ((1, 8, 64, 256), 12)
    out = {"shapes": {}, "batches": list(batches), "decode_tokens": tokens}
    for name in SHAPES:
        model = loader.build_model(name, device="cpu")
        cfg = model.cfg
        rows = [measure(model, b, tokens) for b in _results.track(batches, f"efficiency: {name}")]
        out["shapes"][name] = {"n_experts": cfg.n_experts, "top_k": cfg.top_k, "moe_layers": len(cfg.moe_layers),
                               "dtype_bytes": next(model.parameters()).element_size(), "rows": rows}
    out["table_cost"] = table_cost("deepseek-v3-shape", 64, 8 if args.quick else 32, 3 if args.quick else 15)
    _results.save(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
