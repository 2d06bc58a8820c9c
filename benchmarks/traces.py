"""Trace store: writer throughput, query latency on a 1M-token store, bytes per token-layer.

Synthetic but real data path: routing decisions (3 MoE layers, 8 experts, top-2) for steps of 100-token
requests go through the trace writer's public hooks (its packing and SQLite code), into a real store on disk.
Then `moescope trace ID --json` and `moescope requests` run as subprocesses against the 1M-token store
(their wall time includes Python start-up), and the in-process query time is reported too.

    python benchmarks/traces.py [--tokens 1000000] [--quick] [--out benchmarks/results/traces.json]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _results

import torch

from moescope.capture.token_trace import StepTrace
from moescope.runtime.engine import RequestRecord, StepRecord
from moescope.runtime.router import route
from moescope.traces import store
from moescope.traces.writer import TraceWriter

LAYERS, EXPERTS, TOP_K, PER_REQUEST = (1, 2, 3), 8, 2, 100


def fill(path: Path, n_tokens: int) -> dict:
    """Drive the trace writer (the worker half of the pipeline) on this thread, timed: one StepTrace per
    request's prefill, then the request's record, through its public hooks; commits as its tick would."""
    writer = TraceWriter(path, max_bytes=2**40)
    gen = torch.Generator().manual_seed(0)
    n_requests = n_tokens // PER_REQUEST
    pool = [tuple((layer, route(torch.randn(PER_REQUEST, EXPERTS, generator=gen), TOP_K)) for layer in LAYERS)
            for _ in range(8)]
    times = {layer: (1e-4, 1e-3) for layer in LAYERS}
    t0 = time.perf_counter()
    for i in range(n_requests):
        rid = f"req-{i:07d}"
        step = StepRecord(i, "prefill", float(i), 0.01, PER_REQUEST, ((rid, 0, PER_REQUEST),))
        writer.on_step(StepTrace(step, pool[i % len(pool)], times, {}, {}, {}, time.time()))
        writer.on_request(RequestRecord(rid, "p" * (PER_REQUEST - 1), "o", tuple(range(PER_REQUEST)), (7,),
                                        float(i), 0.0, 0.01, 0.01, (0.01,), 0.01, "length"))
        if i % 500 == 0:
            writer.tick()
    writer.shutdown()
    seconds = time.perf_counter() - t0
    return {"requests": n_requests, "tokens": n_requests * PER_REQUEST, "write_s": seconds,
            "token_layer_records_per_s": n_requests * PER_REQUEST * len(LAYERS) / seconds}


def wall(cmd: list[str], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = _results.parser(__doc__, quick="a 20,000-token store (CI keeps the script working)")
    ap.add_argument("--tokens", type=int, default=1_000_000)
    args = _results.parse(ap, argv, "traces")
    if args.quick:
        args.tokens = 20_000
    with tempfile.TemporaryDirectory() as tmp, _results.progress("traces: write a store, then read it back "
                                                                 "(in process, 2 commands, start-up)", 4) as advance:
        path = Path(tmp) / "traces.sqlite"
        report = fill(path, args.tokens)
        advance()
        conn = store.open_store(path)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        size = path.stat().st_size
        report["store_bytes"] = size
        report["bytes_per_token_layer"] = size / (report["tokens"] * len(LAYERS))
        rid = f"req-{report['requests'] // 2:07d}"
        t = time.perf_counter()
        store.load_request(conn, rid)
        report["load_request_in_process_s"] = time.perf_counter() - t
        moescope = [sys.executable, "-m", "moescope"]
        report["trace_json_cli_s"] = wall([*moescope, "trace", rid, "--traces", str(path), "--json"])
        advance()
        report["requests_cli_s"] = wall([*moescope, "requests", "--traces", str(path)])
        advance()
        report["startup_cli_s"] = wall([*moescope, "--version"])
        advance()
    print(f"trace store: {report['tokens']:,} tokens x {len(LAYERS)} layers, top-{TOP_K}")
    print(f"  writer: {report['token_layer_records_per_s']:,.0f} token-layer records/s "
          f"({report['write_s']:.1f} s for the store)")
    print(f"  size: {report['store_bytes'] / 1e6:.1f} MB = {report['bytes_per_token_layer']:.1f} bytes per token-layer")
    print(f"  moescope trace ID --json: {report['trace_json_cli_s']:.2f} s wall "
          f"(in-process query {report['load_request_in_process_s'] * 1e3:.1f} ms; CLI start-up alone "
          f"{report['startup_cli_s']:.2f} s)")
    print(f"  moescope requests: {report['requests_cli_s']:.2f} s wall")
    _results.save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
