"""Runtime throughput, three comparisons side by side in one run (medians of interleaved rounds, ratios):

1. ``hf``: moescope's MoE layer vs HuggingFace transformers' Mixtral sparse MoE block. Same weights (copied
   from the HF block), fp32, Mixtral-shaped at a quarter width (hidden 1024, ffn 2816, 8 experts, top-2);
   outputs compared numerically; the single-token time set against the memory-bandwidth floor (the bytes of
   the two chosen experts' weights / the copy bandwidth measured in the same run).
2. ``grouped``: the experts of one layer computed grouped (two ``grouped_mm`` calls) vs one matmul pair per
   expert in a Python loop (the path it replaced, kept as the reference), at E = 8, 64, 256, for a decode
   step's and a prefill's worth of slots (top-k of 16 and 512 tokens).
3. ``serving``: end-to-end serving through the public entry points (``loader.build_model`` with
   ``--weights auto``, ``Engine.run``) at tiny-demo, qwen3-moe-shape and deepseek-v3-shape: output tokens/s,
   each shape's ratio to tiny-demo's, and at the two production shapes the same run with the per-expert loop.

    python benchmarks/runtime.py [--sections hf grouped serving] [--rounds 15] [--quick]
                                 [--out benchmarks/results/runtime.json]
"""

from __future__ import annotations

import platform
import statistics
import sys
import time

import _results

import torch



def build_pair(hidden: int, ffn: int, n_experts: int, top_k: int, seed: int = 0):
    """(hf_block, our_layer) with identical weights; works on transformers 4.5x (ModuleList experts with
    w1/w2/w3) and 5.x (fused gate_up_proj/down_proj)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from moescope.runtime.model_config import MoEConfig
    from moescope.runtime.model import MoELayer

    hf_cfg = MixtralConfig(hidden_size=hidden, intermediate_size=ffn, num_local_experts=n_experts,
                           num_experts_per_tok=top_k, router_jitter_noise=0.0)
    torch.manual_seed(seed)
    hf = MixtralSparseMoeBlock(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.02)
    ours = MoELayer(MoEConfig(hidden_size=hidden, n_heads=8, n_experts=n_experts, top_k=top_k,
                              ffn_size=ffn)).eval()
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        if hasattr(hf.experts, "gate_up_proj"):  # transformers 5.x
            ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
            ours.experts.down_proj.copy_(hf.experts.down_proj)
        else:  # 4.x: w1 = gate, w3 = up, w2 = down
            for e, mlp in enumerate(hf.experts):
                ours.experts.gate_up_proj[e].copy_(torch.cat([mlp.w1.weight, mlp.w3.weight]))
                ours.experts.down_proj[e].copy_(mlp.w2.weight)
    return hf, ours


def hf_forward(hf, x):
    out = hf(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]  # 4.x returns (hidden, router_logits)


def copy_bandwidth(n_bytes: int = 256 * 2**20, repeats: int = 7) -> float:
    """Bytes/s of a large tensor copy (bytes counted once), median of ``repeats``."""
    src = torch.ones(n_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return n_bytes / statistics.median(times)


def _time(fn, x) -> float:
    t = time.perf_counter()
    fn(x)
    return time.perf_counter() - t


def run(tokens: list[int], rounds: int, hidden=1024, ffn=2816, n_experts=8, top_k=2) -> dict:
    hf, ours = build_pair(hidden, ffn, n_experts, top_k)
    results = []
    with torch.inference_mode():
        bw = copy_bandwidth()
        for n in _results.track(tokens, "runtime: ours and HF's MoE block at each token count, interleaved rounds"):
            x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(n))
            ref, got = hf_forward(hf, x), ours(x)[0]
            max_diff = (ref - got).abs().max().item()
            reps = max(1, min(20, 2048 // max(n, 1)))  # several calls per sample at small n
            ours_fn = lambda x: [ours(x) for _ in range(reps)]  # noqa: E731
            hf_fn = lambda x: [hf_forward(hf, x) for _ in range(reps)]  # noqa: E731
            ours_fn(x), hf_fn(x)  # warm-up
            t_ours, t_hf = [], []
            for r in range(rounds):  # interleaved, alternating who goes first
                pair = [(t_ours, ours_fn), (t_hf, hf_fn)]
                for acc, fn in (pair if r % 2 == 0 else pair[::-1]):
                    acc.append(_time(fn, x) / reps)
            mo, mh = statistics.median(t_ours), statistics.median(t_hf)
            results.append({"tokens": n, "ours_s": mo, "hf_s": mh, "ours_tokens_per_s": n / mo,
                            "hf_tokens_per_s": n / mh, "speedup_vs_hf": mh / mo, "max_abs_diff": max_diff})
    expert_bytes = 3 * hidden * ffn * 4
    floor_s = top_k * expert_bytes / bw
    one = next((r for r in results if r["tokens"] == 1), None)
    return {
        "shape": {"hidden": hidden, "ffn": ffn, "experts": n_experts, "top_k": top_k, "dtype": "float32"},
        "machine": {"cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "transformers": __import__("transformers").__version__,
        "rounds": rounds,
        "copy_bandwidth_gb_s": bw / 1e9,
        "expert_bytes": expert_bytes,
        "bandwidth_floor_1_token_s": floor_s,
        "ours_1_token_over_floor": one["ours_s"] / floor_s if one else None,
        "results": results,
    }


GROUPED_SHAPES = ((8, 128, 128, 2), (64, 64, 16, 8), (256, 64, 16, 8))  # (E, hidden, ffn, k)


def grouped_vs_loop(rounds: int, tokens=(16, 512), shapes=GROUPED_SHAPES) -> list[dict]:
    """One layer's experts: grouped_mm path vs the per-expert loop, same rows, outputs compared bit for bit."""
    from moescope.runtime.experts import Experts

    out = []
    for n_exp, hidden, ffn, k in _results.track(shapes, "runtime: grouped_mm and the loop at each shape"):
        experts = Experts(n_exp, hidden, ffn)
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0, 0.05)
        for n in tokens:
            gen = torch.Generator().manual_seed(n_exp + n)
            ids = torch.stack([torch.randperm(n_exp, generator=gen)[:k] for _ in range(n)]).reshape(-1).sort().values
            counts = torch.bincount(ids, minlength=n_exp).tolist()
            rows = torch.randn(len(ids), hidden, generator=gen)
            with torch.inference_mode():
                same = torch.equal(experts.compute_grouped(rows, counts), experts.compute_loop(rows, counts))
                reps = max(1, 256 // n)
                t = {"grouped": [], "loop": []}
                fns = {"grouped": lambda: experts.compute_grouped(rows, counts),
                       "loop": lambda: experts.compute_loop(rows, counts)}
                for f in fns.values():
                    f()  # warm-up
                for r in range(rounds):
                    for name in (("grouped", "loop") if r % 2 == 0 else ("loop", "grouped")):
                        t[name].append(_time(lambda _: [fns[name]() for _ in range(reps)], None) / reps)
            g, lo = statistics.median(t["grouped"]), statistics.median(t["loop"])
            out.append({"experts": n_exp, "hidden": hidden, "ffn": ffn, "top_k": k, "tokens": n, "slots": len(ids),
                        "grouped_s": g, "loop_s": lo, "loop_over_grouped": lo / g, "bit_equal": same})
    return out


SERVING_MODELS = ("tiny-demo", "qwen3-moe-shape", "deepseek-v3-shape")


def serving(rounds: int, n_requests: int = 8, quick: bool = False) -> list[dict]:
    """End-to-end serving tokens/s per model (bare engine, requests all queued at once, greedy), interleaved
    rounds; at the production shapes also with the per-expert loop instead of grouped_mm (not in quick mode)."""
    from moescope.runtime import loader, traffic
    from moescope.runtime.engine import Engine

    names = (SERVING_MODELS[0], SERVING_MODELS[-1]) if quick else SERVING_MODELS
    reqs = traffic.generate(traffic.TrafficConfig(seed=0, output_tokens_median=4 if quick else 24), n_requests)
    models = {name: loader.build_model(name) for name in names}
    variants = [(name, True) for name in names] + ([] if quick else [(name, False) for name in names[1:]])
    times: dict = {v: [] for v in variants}
    tokens: dict = {}

    def serve(name, grouped):
        model = models[name]
        for m in model.moe_layers():
            m.experts.use_grouped_mm = grouped
        t = time.perf_counter()
        records = Engine(model, max_batch=16).run(reqs, realtime=False)
        return time.perf_counter() - t, sum(r.n_output for r in records)

    for v in variants:
        serve(*v)  # warm-up (and the same tokens every round: greedy, seeded)
    for r in _results.track(range(rounds), "runtime: serving each model, interleaved rounds"):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            seconds, tokens[v] = serve(*v)
            times[v].append(seconds)
    base = tokens[("tiny-demo", True)] / statistics.median(times[("tiny-demo", True)])
    out = []
    for (name, grouped), ts in times.items():
        tps = tokens[(name, grouped)] / statistics.median(ts)
        cfg = models[name].cfg
        out.append({"model": name, "experts_path": "grouped_mm" if grouped else "per-expert loop",
                    "moe_layers": len(cfg.moe_layers), "experts": cfg.n_experts, "top_k": cfg.top_k,
                    "requests": n_requests, "output_tokens": tokens[(name, grouped)], "seconds": statistics.median(ts),
                    "tokens_per_s": tps, "ratio_to_tiny_demo": tps / base})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = _results.parser(__doc__, quick="one small round of each (CI: the benchmark still runs)", rounds=15)
    ap.add_argument("--sections", nargs="+", choices=["hf", "grouped", "serving"], default=["hf", "grouped", "serving"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048])
    args = _results.parse(ap, argv, "runtime")
    if args.quick:
        args.tokens = [1, 16]
    report = {}
    if "hf" in args.sections:
        report = run(args.tokens, args.rounds, **({"hidden": 128, "ffn": 256} if args.quick else {}))
        _print_hf(report, args.rounds)
    if "grouped" in args.sections:
        report["grouped"] = grouped_vs_loop(args.rounds, tokens=(16,) if args.quick else (16, 512),
                                            shapes=GROUPED_SHAPES[-1:] if args.quick else GROUPED_SHAPES)
        print(f"\nexperts of one layer: grouped_mm vs per-expert loop (medians of {args.rounds} interleaved rounds)")
        print(f"{'E':>4} {'tokens':>6} {'slots':>6} {'grouped ms':>11} {'loop ms':>8} {'loop/grouped':>13} "
              f"{'bit-equal':>9}")
        for g in report["grouped"]:
            print(f"{g['experts']:>4} {g['tokens']:>6} {g['slots']:>6} {g['grouped_s'] * 1e3:>11.3f} "
                  f"{g['loop_s'] * 1e3:>8.3f} {g['loop_over_grouped']:>12.2f}x {str(g['bit_equal']):>9}")
    if "serving" in args.sections:
        report["serving"] = serving(max(1, min(args.rounds, 7)), n_requests=2 if args.quick else 8, quick=args.quick)
        print("\nserving (Engine.run, requests queued at once, medians of interleaved rounds)")
        print(f"{'model':>18} {'experts path':>16} {'layers x E':>10} {'tok/s':>8} {'/ tiny-demo':>11}")
        for s in report["serving"]:
            print(f"{s['model']:>18} {s['experts_path']:>16} {s['moe_layers']:>4} x {s['experts']:<3} "
                  f"{s['tokens_per_s']:>8.1f} {s['ratio_to_tiny_demo']:>10.3f}x")
    # the HF section's machine (its thread count: the serving section sets its own afterwards), else now's
    report.setdefault("machine", {"cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
                                  "python": platform.python_version()})
    _results.save(report, args.out)
    return 0


def _print_hf(report: dict, rounds: int) -> None:
    print(f"MoE block hidden {report['shape']['hidden']}, ffn {report['shape']['ffn']}, 8 experts, top-2, fp32; "
          f"torch {report['machine']['torch']}, transformers {report['transformers']}, "
          f"{report['machine']['cpu_threads']} threads, medians of {rounds} interleaved rounds")
    print(f"{'tokens':>7} {'ours tok/s':>11} {'HF tok/s':>10} {'ours/HF':>8} {'max|diff|':>10}")
    for r in report["results"]:
        print(f"{r['tokens']:>7} {r['ours_tokens_per_s']:>11.1f} {r['hf_tokens_per_s']:>10.1f} "
              f"{r['speedup_vs_hf']:>7.2f}x {r['max_abs_diff']:>10.2e}")
    if report["ours_1_token_over_floor"] is not None:
        print(f"copy bandwidth {report['copy_bandwidth_gb_s']:.1f} GB/s; 1-token floor "
              f"{report['bandwidth_floor_1_token_s'] * 1e3:.2f} ms (2 experts x {report['expert_bytes'] / 1e6:.1f} MB);"
              f" ours at 1 token = {report['ours_1_token_over_floor']:.2f}x the floor")


if __name__ == "__main__":
    sys.exit(main())
