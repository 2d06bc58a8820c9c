"""Trace lake at fleet scale: many replicas' Parquet datasets read as one through DuckDB, against the SQLite store.

- bytes: a real deepseek-v3-shape store (58 MoE layers x 256 experts, top-8, gate weights; served by the real
  engine into the real TraceRecorder) as SQLite and as the lake (``traces convert``): bytes per token-layer;
- fleet: ``--replicas`` replicas' lakes (``fleet/replica-N/``) of tiny-demo requests and deepseek-v3-shape ones,
  cloned from really served requests with fresh ids and start times spread over the last two hours (clones
  repeat their routing, so the fleet's bytes are not a size figure: the real store's are); the same rows in one
  SQLite file, SQLite's best case (one file cannot hold a fleet in practice);
- queries, side by side in each round (store opened each time, as a command does), medians of ``--rounds``:
  ``trace ID`` (``load_request``, a tiny-demo and a deepseek-v3-shape request), ``requests --since 1h``
  (``list_requests``), a fleet-wide per-(layer, expert) count over the tiny-demo requests (``iter_routed`` +
  numpy, the readers' path), and ``moescope trace ID --json`` over the fleet glob as a subprocess (what a user
  waits for, interpreter start included).

    python benchmarks/lake.py            # -> benchmarks/results/lake.json (docs/traces.md quotes it)
    python benchmarks/lake.py --quick    # 2 replicas, few requests, one round (CI) -> lake-quick.json
    python benchmarks/lake.py --markdown benchmarks/results/lake.json   # the docs' table, from the file

Figures from a shared 2-core machine are noisy: compare medians and ratios.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import _results

import moescope
from moescope.runtime import loader, traffic
from moescope.runtime.engine import Engine
from moescope.traces import to_parquet, lake, store
from moescope.traces.recorder import TraceRecorder

COLUMNS = [name for name, _ in lake._COLUMNS]
INSERT = f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"


def serve(model_name: str, path: Path, n: int, out_tokens: int) -> list[dict]:
    """Serve ``n`` requests into a SQLite store at ``path``; its rows as dicts."""
    model = loader.build_model(model_name)
    cfg = traffic.TrafficConfig(seed=1, output_tokens_median=out_tokens,
                                output_tokens_range=(out_tokens * 3 // 4, out_tokens * 5 // 4))
    with moescope.instrument(model, observers=[TraceRecorder(path, model=model_name)]):
        Engine(model, max_batch=16).run(traffic.generate(cfg, n), realtime=False)
    conn = store.open_store(path)
    rows = [dict(zip(COLUMNS, r)) for r in conn.execute(f"SELECT {', '.join(COLUMNS)} FROM requests")]
    conn.close()
    return rows


def _bytes(path: Path, rows: list[dict]) -> float:
    size = sum(p.stat().st_size for p in path.rglob("*.parquet")) if path.is_dir() else path.stat().st_size
    return size / sum((r["n_prompt"] + r["n_output"]) * r["n_layers"] for r in rows)


def build_fleet(root: Path, db: Path, templates: dict[str, list[dict]], per_replica: dict[str, int],
                replicas: int, now: float) -> dict[str, list[str]]:
    """The fleet's lakes under ``root`` and the same rows in the SQLite file ``db``; ids per model."""
    rng = random.Random(0)
    conn = store.open_store(db, create=True)
    ids: dict[str, list[str]] = {m: [] for m in templates}
    for rep in range(replicas):
        for model, rows in templates.items():
            writer = lake.LakeWriter(root / f"replica-{rep}", model=model, rank=0, run_id=uuid.uuid4().hex[:12],
                                     roll_s=float("inf"), replica=f"node{rep}-r0")
            batch: list[dict] = []
            for i in range(per_replica[model]):
                row = dict(rows[i % len(rows)], request_id=uuid.uuid4().hex[:16], started=now - rng.uniform(0, 7200))
                batch.append(row)
                ids[model].append(row["request_id"])
                if len(batch) == 1000 or i == per_replica[model] - 1:
                    batch.sort(key=lambda r: r["started"])
                    writer.write(batch)
                    conn.executemany(INSERT, [tuple(r[c] for c in COLUMNS) for r in batch])
                    conn.commit()
                    batch = []
            writer.close()
    conn.close()
    return ids


def per_expert_count(conn) -> np.ndarray:
    """[layers, experts] routed slots over every request of the fleet's main shape (the readers' path)."""
    total = None
    for r in store.iter_routed(conn, corrupt=store.CorruptRows(warn=None)):
        codes = r.ids.astype(np.int64) + (np.arange(len(r.layers)) * (r.n_experts + 1))[None, :, None]
        counts = np.bincount(codes.ravel(), minlength=len(r.layers) * (r.n_experts + 1))
        total = counts if total is None else total + counts
    return total.reshape(-1, total.size // len(r.layers))[:, :-1]


def _timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def queries(stores: dict[str, str], ids: dict[str, list[str]], rounds: int, now: float) -> dict:
    """Each query on each store, side by side per round; medians and lake/SQLite ratios."""
    rng = random.Random(1)
    times: dict[str, dict[str, list[float]]] = {}
    check: dict[str, dict[str, object]] = {}

    def run(query: str, name: str, fn) -> None:
        def opened():
            conn = store.open_store(stores[name])
            try:
                return fn(conn)
            finally:
                conn.close()
        dt, out = _timed(opened)
        times.setdefault(query, {}).setdefault(name, []).append(dt)
        check.setdefault(query, {})[name] = out

    for r in _results.track(range(rounds), "lake: each query on SQLite and the lake, interleaved rounds"):
        picks = {m: rng.choice(v) for m, v in ids.items()}
        for name in (list(stores) if r % 2 == 0 else list(stores)[::-1]):  # alternate the order per round
            for model, rid in picks.items():
                run(f"trace_{model}", name, lambda c, rid=rid: len(store.load_request(c, rid)["tokens"]))
            run("requests_since_1h", name,
                lambda c: [r.request_id for r in store.list_requests(c, since=now - 3600, limit=50)])
            run("per_layer_expert_count", name, lambda c: per_expert_count(c).tolist())
        for query, outs in check.items():  # the lake answers what SQLite answers
            assert outs["lake"] == outs["sqlite"], query
    out = {}
    for query, by in times.items():
        med = {name: statistics.median(v) for name, v in by.items()}
        out[query] = {**{f"{name}_s": round(s, 4) for name, s in med.items()},
                      "lake_over_sqlite": round(med["lake"] / med["sqlite"], 2), "rounds": rounds}
    return out


def cli_trace(glob: str, rid: str, n: int) -> dict:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "moescope", "trace", rid, "--traces", glob, "--json"],
                             capture_output=True, text=True, timeout=300)
        times.append(time.perf_counter() - t)
        if run.returncode != 0:
            raise RuntimeError(run.stderr[-2000:])
    return {"median_s": round(statistics.median(times), 3), "best_s": round(min(times), 3), "runs": n}


def markdown(report: dict) -> str:
    """The docs' table (docs/traces.md#fleet-figures) from a results file."""
    q, fleet, b = report["queries"], report["fleet"], report["bytes_per_token_layer"]
    reqs = ", ".join(f"{n:,} {m}" for m, n in fleet["requests"].items())
    lines = [f"{report['replicas']} replicas' lakes ({reqs} requests; {fleet['files']} files) read as one "
             f"glob, against the same rows in one SQLite file; medians of {q['requests_since_1h']['rounds']} "
             "rounds, store opened each time:", "",
             "| query | SQLite | lake | lake / SQLite |", "|---|---|---|---|"]
    names = {"trace_tiny-demo": "`trace ID` document, tiny-demo request",
             "trace_deepseek-v3-shape": "`trace ID` document, deepseek-v3-shape request",
             "requests_since_1h": "`requests --since 1h`",
             "per_layer_expert_count": "fleet-wide per-(layer, expert) count (tiny-demo)"}
    for key, name in names.items():
        lines.append(f"| {name} | {q[key]['sqlite_s']:.3f} s | {q[key]['lake_s']:.3f} s | "
                     f"{q[key]['lake_over_sqlite']:.2f} |")
    cli = report["cli_trace_json_fleet"]
    lines += ["", f"`moescope trace ID --json --traces 'fleet/replica-*'` (deepseek-v3-shape request, a subprocess: "
              f"interpreter start included): {cli['median_s']:.2f} s median of {cli['runs']}. Bytes per "
              f"token-layer at {b['model']} ({b['requests']} served requests, {b['tokens']:,} tokens x "
              f"{b['moe_layers']} layers, top-{b['top_k']}): SQLite {b['sqlite']}, lake {b['lake']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = _results.parser(__doc__, quick="2 replicas, few requests, one round (CI)", rounds=7)
    ap.add_argument("--replicas", type=int, default=10)
    ap.add_argument("--markdown", metavar="RESULTS", type=Path, default=None,
                    help="print the docs' table from a results file and exit")
    args = _results.parse(ap, argv, "lake")
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())), end="")
        return 0
    rounds, replicas = args.rounds, 2 if args.quick else args.replicas
    tiny_n, ds_n, ds_tokens = (24, 2, 12) if args.quick else (2000, 20, 240)
    out = args.out
    report: dict = {"machine": "shared 2-core CPU machine (other jobs running): figures are noisy",
                    "quick": args.quick, "replicas": replicas}
    now = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ds_rows = serve("deepseek-v3-shape", tmp / "ds.sqlite", 2 if args.quick else 8, ds_tokens)
        to_parquet.sqlite_to_lake(tmp / "ds.sqlite", tmp / "ds-lake")
        report["bytes_per_token_layer"] = {
            "model": "deepseek-v3-shape", "requests": len(ds_rows),
            "tokens": sum(r["n_prompt"] + r["n_output"] for r in ds_rows), "moe_layers": ds_rows[0]["n_layers"],
            "top_k": ds_rows[0]["top_k"], "sqlite": round(_bytes(tmp / "ds.sqlite", ds_rows), 1),
            "lake": round(_bytes(tmp / "ds-lake", ds_rows), 1), "zstd_level": lake.ZSTD_LEVEL}
        templates = {"tiny-demo": serve("tiny-demo", tmp / "tiny.sqlite", 64, 24), "deepseek-v3-shape": ds_rows}
        per = {"tiny-demo": tiny_n, "deepseek-v3-shape": ds_n}
        t0 = time.perf_counter()
        ids = build_fleet(tmp / "fleet", tmp / "all.sqlite", templates, per, replicas, now)
        report["fleet"] = {"requests": {m: len(v) for m, v in ids.items()},
                           "files": len(list((tmp / "fleet").rglob("*.parquet"))),
                           "lake_bytes": sum(p.stat().st_size for p in (tmp / "fleet").rglob("*.parquet")),
                           "sqlite_bytes": (tmp / "all.sqlite").stat().st_size,
                           "build_s": round(time.perf_counter() - t0, 1)}
        glob = str(tmp / "fleet" / "replica-*")
        report["queries"] = queries({"sqlite": str(tmp / "all.sqlite"), "lake": glob}, ids, rounds, now)
        report["cli_trace_json_fleet"] = cli_trace(glob, ids["deepseek-v3-shape"][-1], 1 if args.quick else 5)
    _results.save(report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
