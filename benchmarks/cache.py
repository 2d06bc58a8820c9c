"""Expert cache: tokens/s and per-token latency at cache sizes {all, E/2, E/4} x tiers {memory, disk}.

A random-weight model with experts big enough for loads to matter (hidden 512, ffn 1408: 8.7 MB per
expert, fp32; 3 MoE layers of 8 experts, top-2) serves the same greedy workload under every variant,
in interleaved rounds in one run. The disk tier reads each miss from a safetensors file through mmap,
with the file's page cache dropped after every read (posix_fadvise DONTNEED), so a miss is a real read.
Outputs are checked identical to the all-resident run. Medians of tokens/s over rounds; per-token latency
percentiles over all decode tokens of all rounds.

    python benchmarks/cache.py [--rounds 3] [--requests 16] [--out benchmarks/results/cache.json]
    python benchmarks/cache.py --quick   # 1 round, 3 short requests, hidden 128 (CI: it still runs) -> cache-quick.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _results import save

import torch

from moescope import stats
from moescope.runtime import traffic
from moescope.runtime.cache import attach_cache
from moescope.runtime.config import MoEConfig
from moescope.runtime.engine import Engine
from moescope.runtime.model import MoETransformer

HERE = Path(__file__).resolve().parent
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--quick", action="store_true",
                    help="one round of 3 short requests on a smaller model (CI keeps the script working)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.requests = 1, 3
    args.out = args.out or HERE / "results" / ("cache-quick.json" if args.quick else "cache.json")

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
        for r in range(args.rounds):
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
    save({"config": cfg.to_dict(), "rounds": args.rounds, "requests": args.requests,
                                    "max_batch": args.max_batch, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
