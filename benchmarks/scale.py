"""moescope at DeepSeek-V3's shape (deepseek-v3-shape: 58 MoE layers x 256 experts, top-8): what it costs and how
fast its views are, in one run.

- serving: ``Engine.run`` over the same workload with capture off and on in one process (the kill switch), metrics
  and metrics + the real trace writer, medians of per-round ratios (``overhead.run_workload``, the same harness as
  the overhead benchmark);
- scrape: milliseconds and bytes per scrape on 1 and 2 lock-step ranks, and the two exposition writers
  (``_scrape.measure``);
- store: a real trace store of long requests (~300 tokens each, every token's top-8 in every layer): bytes per
  token-layer;
- views: ``moescope requests``, ``moescope trace ID --json`` (the longest request) and ``moescope report`` on
  that store, as subprocesses (what a user waits for, interpreter start included), best and median.

    python benchmarks/scale.py            # -> benchmarks/results/scale.json (docs/metrics.md quotes it)
    python benchmarks/scale.py --quick    # small: one round, short requests (CI) -> scale-quick.json

Figures from a shared 2-core machine are noisy: compare medians and ratios, not single runs.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _scrape
from _ports import free_port
import _results
from overhead import run_workload

import moescope
from moescope.runtime import loader, traffic
from moescope.runtime.engine import Engine
from moescope.traces.recorder import TraceRecorder

MODEL = _scrape.MODEL


def build_store(model, path: Path, n_requests: int, output_tokens: int) -> dict:
    """Serve ``n_requests`` requests of ~``output_tokens`` generated tokens into a real trace store."""
    cfg = traffic.TrafficConfig(seed=1, output_tokens_median=output_tokens,
                                output_tokens_range=(output_tokens * 3 // 4, output_tokens * 5 // 4))
    reqs = traffic.generate(cfg, n_requests)
    recorder = TraceRecorder(path, model=model.cfg.name)
    with moescope.instrument(model, observers=[recorder]):
        records = Engine(model, max_batch=16).run(reqs, realtime=False)
    tokens = sum(len(r.prompt_tokens) + r.n_output for r in records)
    layers = len(model.cfg.moe_layers)
    size = path.stat().st_size
    return {"requests": n_requests, "stored": recorder.written, "dropped": recorder.dropped, "tokens": tokens,
            "moe_layers": layers, "top_k": model.cfg.top_k, "bytes": size,
            "bytes_per_token_layer": round(size / (tokens * layers), 1)}


def _timed(args: list[str], n: int) -> tuple[dict, subprocess.CompletedProcess]:
    times, run = [], None
    for _ in range(n):
        t = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "moescope", *args], capture_output=True, text=True, timeout=600)
        times.append(time.perf_counter() - t)
        if run.returncode != 0:
            raise RuntimeError(f"moescope {' '.join(args)} exited {run.returncode}: {run.stderr[-2000:]}")
    return {"best_s": round(min(times), 2), "median_s": round(statistics.median(times), 2), "runs": n}, run


def views(store: Path, out: Path, n: int) -> dict:
    """Seconds of ``requests``, ``trace ID --json`` (the longest request) and ``report`` on ``store``."""
    listed, run = _timed(["requests", "--traces", str(store), "--json", "--limit", "1000"], n)
    longest = max(json.loads(run.stdout), key=lambda r: r["prompt_tokens"] + r["output_tokens"])
    rid = longest["request_id"]
    trace, run = _timed(["trace", rid, "--traces", str(store), "--json"], n)
    trace.update(request_id=rid, json_bytes=len(run.stdout.encode()),
                 tokens=longest["prompt_tokens"] + longest["output_tokens"])
    report, _ = _timed(["report", "--traces", str(store), "--out", str(out)], n)
    report["files"] = sum(1 for p in out.rglob("*") if p.is_file())
    return {"requests": listed, "trace_json": trace, "report": report}


def main(argv: list[str] | None = None) -> int:
    ap = _results.parser(__doc__, quick="one round, short requests, few scrapes (CI)", rounds=7)
    args = _results.parse(ap, argv, "scale")
    rounds, out = args.rounds, args.out
    n_serve, n_store, out_tokens, n_view = (2, 1, 12, 1) if args.quick else (16, 8, 240, 3)
    model = loader.build_model(MODEL)  # --weights auto: the balanced init (built once, then cached)
    report = {"model": MODEL, "machine": "shared 2-core CPU machine (other jobs running): figures are noisy",
              "quick": args.quick}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        report["serving"] = run_workload(MODEL, model, 16, n_serve, rounds, tmp, 12 if args.quick else 96)
        report["store"] = build_store(model, tmp / "store.sqlite", n_store, out_tokens)
        report["views"] = views(tmp / "store.sqlite", tmp / "report", n_view)
    report["scrape"] = _scrape.measure(args.quick, free_port(2))  # rank r of the 2-rank demo: port + r
    _results.save(report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
