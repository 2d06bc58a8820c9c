"""Scrape cost at DeepSeek-V3's shape (58 MoE layers x 256 experts, top-8): milliseconds and bytes per scrape.

- serving: the engine serves traffic in a thread (as the demo does) while this process scrapes its exporter over
  HTTP: the text format (what curl gets) and OpenMetrics + gzip (what Prometheus asks for). Best and median.
- idle: the same exporter once the engine stopped (its own cost, without the engine holding the GIL).
- writers: the full tier (14,848 counters) rendered by prometheus_client's CounterMetricFamily + generate_latest
  against moescope's fast writer, interleaved rounds, medians: why the exporter writes those families itself.
- two ranks: ``moescope demo --world-size 2`` (lock-step expert parallelism): rank 0 exports routing, rank 1
  does not (it routes the same tokens), so the pair costs about one rank.

``benchmarks/scale.py`` runs these (``measure``) and writes them with its other figures to
benchmarks/results/scale.json. Figures from a shared 2-core machine are noisy: compare medians and ratios.
"""

from __future__ import annotations

import gzip
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import _results

import moescope
from moescope.runtime import loader, traffic
from moescope.runtime.engine import Engine

MODEL = "deepseek-v3-shape"
OM = "application/openmetrics-text; version=1.0.0"


def scrape(url: str, openmetrics: bool) -> tuple[float, int, int]:
    """(seconds, bytes on the wire, samples) of one scrape."""
    headers = {"Accept": OM, "Accept-Encoding": "gzip"} if openmetrics else {}
    t = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
        body = r.read()
        zipped = r.headers.get("Content-Encoding") == "gzip"
    dt = time.perf_counter() - t
    text = gzip.decompress(body) if zipped else body
    samples = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    return dt, len(body), samples


def series(url: str, n: int, gap_s: float) -> dict:
    out = {}
    for fmt, om in (("text", False), ("openmetrics_gzip", True)):
        runs = []
        for _ in range(n):
            runs.append(scrape(url, om))
            time.sleep(gap_s)
        ms = [r[0] * 1e3 for r in runs]
        out[fmt] = {"best_ms": round(min(ms), 1), "median_ms": round(statistics.median(ms), 1),
                    "bytes": runs[-1][1], "samples": runs[-1][2]}
    return out


def serving(n: int, warm_s: float) -> dict:
    model = loader.build_model(MODEL)
    stop = threading.Event()
    with moescope.instrument(model, port=0) as inst:
        def serve():
            seed = 0
            while not stop.is_set():  # back-to-back batches, as a busy server
                Engine(model, max_batch=16).run(traffic.generate(traffic.TrafficConfig(seed=seed), 16),
                                                realtime=False)
                seed += 1

        worker = threading.Thread(target=serve, daemon=True)
        worker.start()
        deadline = time.monotonic() + warm_s
        while time.monotonic() < deadline or len(inst.metrics.expert_tokens) < len(model.cfg.moe_layers):
            time.sleep(0.5)
        url = inst.exporter.url
        busy = series(url, n, 0.5)
        stop.set()
        worker.join()
        idle = series(url, n, 0.1)
        layers = len(inst.metrics.expert_tokens)
    return {"layers_with_expert_series": layers, "serving": busy, "idle": idle}


def writers(rounds: int) -> dict:
    """prometheus_client vs the fast writer on the same 58 x 256 counters (interleaved rounds, medians)."""
    import numpy as np
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily

    from moescope.metrics import catalogue
    from moescope.metrics.exposition import FamilyWriter

    spec = catalogue.BY_NAME["moescope_expert_tokens_total"]
    counts = np.random.default_rng(0).integers(0, 10**6, (58, 256)).tolist()

    class Big:
        def collect(self):
            f = CounterMetricFamily(spec.family, spec.help, labels=list(spec.all_labels))
            for layer, row in enumerate(counts):
                for e, v in enumerate(row):
                    f.add_metric([MODEL, "0", str(layer + 3), str(e)], v)
            yield f

    reg = CollectorRegistry(auto_describe=False)
    reg.register(Big())
    w = FamilyWriter(MODEL, "0")
    times = {"prometheus_client": [], "fast": []}
    for _ in _results.track(range(rounds), "scrape: prometheus_client and the fast writer, interleaved rounds"):
        t = time.perf_counter()
        generate_latest(reg)
        times["prometheus_client"].append(time.perf_counter() - t)
        t = time.perf_counter()
        (w.header(spec, False) + "".join(w.expert_rows(spec, layer + 3, row) for layer, row in enumerate(counts))
         ).encode()
        times["fast"].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"series": 58 * 256, "rounds": rounds, "median_ms": {k: round(v, 1) for k, v in med.items()},
            "ratio": round(med["prometheus_client"] / med["fast"], 1)}


def two_ranks(n: int, port: int) -> dict:
    demo = subprocess.Popen([sys.executable, "-m", "moescope", "demo", "--model", MODEL, "--world-size", "2",
                             "--duration", "600", "--rate", "0", "--metrics-port", str(port), "--traces", "none",
                             "--no-tui"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # its own process group: the launcher and both ranks end together
    try:
        deadline = time.monotonic() + 300
        url0 = f"http://127.0.0.1:{port}/metrics"
        while True:  # until rank 0 exports routing for every MoE layer (a series every tier has: with W ranks the
            # per-expert tier's budget is the default / W, so at this shape each rank exports the per-layer tier)
            try:
                text = urllib.request.urlopen(url0, timeout=10).read().decode()
                layers = {ln.split('layer="')[1].split('"')[0] for ln in text.splitlines()
                          if ln.startswith("moescope_router_tokens_total")}
                if len(layers) == 58:
                    per_expert = next(float(ln.split()[-1]) for ln in text.splitlines()
                                      if ln.startswith("moescope_expert_series_per_expert"))
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the 2-rank demo never exported all 58 layers")
            time.sleep(1)
        return {"per_expert_tier": bool(per_expert), "rank0": series(url0, n, 0.5),
                "rank1": series(f"http://127.0.0.1:{port + 1}/metrics", n, 0.5)}
    finally:
        # (a SIGTERM to the launcher alone left its rank processes serving on: end the whole group)
        os.killpg(demo.pid, signal.SIGTERM)
        try:
            demo.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()


def measure(quick: bool, port: int) -> dict:
    """Every scrape figure: one rank serving and idle, the two writers, two lock-step ranks."""
    n, rounds, warm = (3, 3, 5.0) if quick else (9, 7, 20.0)
    out = {"scrapes_per_format": n, "one_rank": serving(n, warm), "writers": writers(rounds)}
    if not quick:  # (--quick leaves out the two-rank demo: a minute of CI for a path the parallel tests cover)
        out["two_ranks"] = two_ranks(n, port)
    return out
