"""Expert cache: tokens/s and per-token latency at cache sizes {all, E/2, E/4} x tiers {memory, disk}.

A random-weight model with experts big enough for loads to matter (hidden 512, ffn 1408: 8.7 MB per
expert, fp32; 3 MoE layers of 8 experts, top-2) serves the same greedy workload under every variant,
in interleaved rounds in one run. The disk tier reads each miss from a safetensors file through mmap,
with the file's page cache dropped after every read (posix_fadvise DONTNEED), so a miss is a real read.
Outputs are checked identical to the all-resident run. Medians of tokens/s over rounds; per-token latency
percentiles over all decode tokens of all rounds.

    python benchmarks/cache.py [--rounds 3] [--requests 16] [--out benchmarks/results/cache.json]
    python benchmarks/cache.py --quick   # 1 round, 3 short requests, hidden 128 (CI: it still runs) -> cache-quick.json

cache-sim section (-> cache-sim.json, cache-sim-quick.json): the one-pass sweep over every size 1..E
(``cache_sim.simulate_all``) against the per-size simulation it replaced (``cache_policy.simulate``) at one
size, on deepseek-v3-shaped lookups (256 experts, top-8, 58 layers; synthetic: each step's sorted union of
the top-8 picks of 1-16 tokens from a skewed per-layer distribution). Medians of interleaved rounds; the
sweep's rows at that size are checked equal to the per-size simulation.

    python benchmarks/cache.py --only sim [--sim-rounds 7] [--sim-steps 120]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import _results

import numpy as np
import torch

from moescope import stats
from moescope.analysis import cache_sim
from moescope.runtime import cache_policy, traffic
from moescope.runtime.expert_cache import attach_cache
from moescope.runtime.model_config import MoEConfig
from moescope.runtime.engine import Engine
from moescope.runtime.model import MoETransformer

CFG = MoEConfig(name="cache-bench", hidden_size=512, n_layers=3, n_heads=8, n_experts=8, top_k=2,
                ffn_size=1408, max_seq_len=256)
# --quick: a 16x smaller expert and short outputs (a smoke run of the script, seconds even on a busy CI machine)
QUICK_CFG = MoEConfig(name="cache-bench-quick", hidden_size=128, n_layers=3, n_heads=2, n_experts=8, top_k=2,
                      ffn_size=352, max_seq_len=256)


def serve(model, requests, max_batch):
    engine = Engine(model, max_batch=max_batch)
    t0 = time.perf_counter()
    records = engine.run(requests, realtime=False)
    wall = time.perf_counter() - t0
    return records, wall


def sim_lookups(n_layers: int, n_steps: int, *, n_experts: int = 256, top_k: int = 8, seed: int = 0):
    """deepseek-v3-shaped lookup sequences: per layer and step, the sorted union of 1-16 tokens' top-k."""
    rng = np.random.default_rng(seed)
    seqs = {}
    for layer in range(n_layers):
        p = rng.dirichlet(np.full(n_experts, 0.5))
        steps = []
        for _ in range(n_steps):
            tokens = int(rng.integers(1, 17))
            picks = [rng.choice(n_experts, size=top_k, replace=False, p=p) for _ in range(tokens)]
            steps.extend(np.unique(np.concatenate(picks)).tolist())
        seqs[layer + 3] = steps
    return n_experts, seqs


def bench_sim(rounds: int, n_layers: int, n_steps: int, out: Path) -> None:
    n_experts, seqs = sim_lookups(n_layers, n_steps)
    size = n_experts // 4
    sweep_s, naive_s = [], []
    for r in _results.track(range(rounds), "cache-sim: the sweep and the per-size simulation, interleaved rounds"):
        for which in (("sweep", "naive") if r % 2 == 0 else ("naive", "sweep")):
            t0 = time.perf_counter()
            if which == "sweep":
                report = cache_sim.simulate_all(n_experts, seqs)
                sweep_s.append(time.perf_counter() - t0)
            else:
                naive = {p: [cache_policy.simulate(seq, p, size) for seq in seqs.values()]
                         for p in cache_policy.SIM_POLICIES}
                naive_s.append(time.perf_counter() - t0)
    for p, results in naive.items():
        row = next(x for x in report["results"] if x["policy"] == p and x["size"] == size)
        if (row["hits"], row["evictions"]) != (sum(x.hits for x in results), sum(x.evictions for x in results)):
            raise SystemExit(f"cache-sim sweep differs from the per-size simulation: {p} at size {size}")
    lookups = sum(len(s) for s in seqs.values())
    sweep, one = statistics.median(sweep_s), statistics.median(naive_s)
    print(f"cache-sim: {n_layers} layers x {n_experts} experts, top-8, {n_steps} steps ({lookups} lookups), "
          f"{rounds} interleaved rounds")
    print(f"  sweep, all {n_experts} sizes x 4 policies: {sweep:.2f} s; per-size simulation, one size (E/4) x 4 "
          f"policies: {one:.2f} s (x {n_experts} sizes ~ {one * n_experts:.0f} s); equal at size {size}")
    _results.save({"n_layers": n_layers, "n_experts": n_experts, "top_k": 8, "steps": n_steps, "lookups": lookups,
                   "rounds": rounds, "sweep_all_sizes_s": sweep, "per_size_one_size_s": one, "compared_size": size,
                   "per_size_all_sizes_estimate_s": one * n_experts,
                   "speedup_vs_per_size_all_sizes": one * n_experts / sweep, "sweep_s": sweep_s,
                   "per_size_s": naive_s}, out)


def main(argv: list[str] | None = None) -> int:
    ap = _results.parser(__doc__, quick="one round of 3 short requests on a smaller model (CI keeps the script "
                         "working)", rounds=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--only", choices=("serve", "sim"), default=None, help="run one section (default: both)")
    ap.add_argument("--sim-rounds", type=int, default=7)
    ap.add_argument("--sim-layers", type=int, default=58)
    ap.add_argument("--sim-steps", type=int, default=120)
    args = _results.parse(ap, argv, "cache")
    if args.quick:
        args.requests = 3
        args.sim_rounds, args.sim_layers, args.sim_steps = 1, 4, 20
    if args.only != "serve":
        bench_sim(args.sim_rounds, args.sim_layers, args.sim_steps, _results.path("cache-sim", args.quick))
    if args.only == "sim":
        return 0

    cfg = QUICK_CFG if args.quick else CFG
    model = MoETransformer(cfg).eval()
    reqs = traffic.generate(traffic.TrafficConfig(seed=3, output_tokens_median=6 if args.quick else 24,
                                                  prompt_bytes_median=48), args.requests)
    e = cfg.n_experts
    variants = [("all", e, "memory"), ("E/2", e // 2, "memory"), ("E/4", e // 4, "memory"),
                ("E/2", e // 2, "disk"), ("E/4", e // 4, "disk")]
    results = {v: {"tok_s": [], "lat": [], "hit_rate": [], "load_s": []} for v in variants}
    reference = None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "experts.safetensors"
        for r in _results.track(range(args.rounds), "cache: every cache size and tier, interleaved rounds"):
            for v in (variants if r % 2 == 0 else variants[::-1]):
                label, size, tier = v
                cache = None
                if label != "all":
                    cache = attach_cache(model, size=size, policy="lru", tier=tier,
                                         path=path if tier == "disk" else None)
                try:
                    records, wall = serve(model, reqs, args.max_batch)
                finally:
                    if cache is not None:
                        cache.close()
                outputs = [rec.output_tokens for rec in records]
                if reference is None and label == "all":
                    reference = outputs
                if reference is not None and outputs != reference:
                    raise SystemExit(f"outputs differ under cache {v}")
                res = results[v]
                res["tok_s"].append(sum(rec.n_output for rec in records) / wall)
                res["lat"].extend(x for rec in records for x in rec.token_latencies_s[1:])
                if cache is not None:
                    st = cache.stats().values()
                    res["hit_rate"].append(sum(s.hits for s in st) / sum(s.lookups for s in st))
                    res["load_s"].extend(x for s in st for x in s.load_seconds)
    base = statistics.median(results[variants[0]]["tok_s"])
    rows = []
    mb = 3 * cfg.hidden_size * cfg.ffn_size * 4 / 1e6
    print(f"expert cache, LRU; model hidden {cfg.hidden_size}, ffn {cfg.ffn_size} ({mb:.1f} MB/expert), "
          f"{len(cfg.moe_layers)} MoE layers x {e} experts, top-{cfg.top_k}; {args.requests} requests, "
          f"max batch {args.max_batch}, {args.rounds} interleaved rounds, {torch.get_num_threads()} threads")
    print(f"{'cache':>6} {'tier':>7} {'tok/s':>8} {'vs all':>7} {'p50 ms':>8} {'p99 ms':>8} {'hit rate':>9} "
          f"{'load p50 ms':>12} {'load p99 ms':>12}")
    for v in variants:
        label, size, tier = v
        res = results[v]
        tok_s = statistics.median(res["tok_s"])
        row = {"cache": label, "size": size, "tier": tier if label != "all" else "-", "tokens_per_s": tok_s,
               "vs_all": tok_s / base, "token_p50_s": stats.percentile(res["lat"], 50),
               "token_p99_s": stats.percentile(res["lat"], 99),
               "hit_rate": statistics.median(res["hit_rate"]) if res["hit_rate"] else 1.0,
               "load_p50_s": stats.percentile(res["load_s"], 50) if res["load_s"] else None,
               "load_p99_s": stats.percentile(res["load_s"], 99) if res["load_s"] else None}
        rows.append(row)
        lp50 = f"{row['load_p50_s'] * 1e3:12.2f}" if row["load_p50_s"] is not None else f"{'-':>12}"
        lp99 = f"{row['load_p99_s'] * 1e3:12.2f}" if row["load_p99_s"] is not None else f"{'-':>12}"
        print(f"{label:>6} {row['tier']:>7} {tok_s:8.1f} {row['vs_all']:6.2f}x {row['token_p50_s'] * 1e3:8.1f} "
              f"{row['token_p99_s'] * 1e3:8.1f} {row['hit_rate']:9.3f} {lp50} {lp99}")
    print("outputs identical to the all-resident run in every variant")
    _results.save({"config": cfg.to_dict(), "rounds": args.rounds, "requests": args.requests,
                   "max_batch": args.max_batch, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
