"""``moescope serve`` under load: 1, 8 and 32 concurrent async OpenAI clients (the official SDK, streaming), with
capture on (the default: metrics exporter + trace store) and off (``--metrics-port -1 --traces none``), closed-loop
and open-loop, at tiny-demo and deepseek-v3-shape.

Both servers run side by side; each round runs every (concurrency, capture) load once, the capture order
alternating between rounds, and the report takes medians over rounds. A load is closed-loop: ``c`` clients
each send their share of the requests one after another. Per load: output tokens/s (usage counts over the
load's wall time), TTFT (request sent -> first streamed chunk) and inter-token gaps (between chunks) at p50
and p99, errors, and the server process's CPU time per output token (Linux /proc; all its threads). The
capture overhead is given two ways, per round then median over rounds: the throughput ratio off / on, and the
server CPU per token ratio on / off. The second is the robust one on a shared machine: the clients run on the
same CPUs (the SDK's per-chunk parsing takes more CPU than the server), so throughput mostly measures them and
whatever else runs, while CPU per token counts only the server's own work.

Open loop: requests arrive as a Poisson process at fixed multiples of the saturation rate (the best closed-loop
requests/s with capture off), whether or not earlier ones have finished, for ``--open-s`` seconds; past
saturation the admission queue (``--max-queue``) fills, so queueing shows in TTFT and the overflow as 429s.
Per rate and capture: requests answered, 429s, other errors, goodput (output tokens/s from the first arrival to
the last answer), TTFT p50/p99 of the answered ones and server CPU per token; medians over ``--open-rounds``.

    python benchmarks/serve.py [--quick] [--models tiny-demo deepseek-v3-shape] [--rounds 5]
    python benchmarks/serve.py --markdown benchmarks/results/serve.json   # the docs' tables, from the file

    python benchmarks/serve.py [--quick] [--rounds 7] [--concurrency 1 8 32] [--model tiny-demo]

Soak mode (``--soak SECONDS``): both servers side by side, each under ``--soak-clients`` (8) closed-loop streaming
clients; the servers' RSS is sampled every 2 s against the requests each answered, and the report gives the RSS
slope per 1,000 requests after ``--soak-warmup`` (least squares) and the growth after warm-up
(``results/serve-soak.json``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import _results
from _ports import free_port
from _verdict import verdict

VARIANTS = {"capture_on": [], "capture_off": ["--metrics-port", "-1", "--traces", "none"]}
GOAL = 1.02  # issue [vllm]: capture on / off at most this, CPU per token (the robust figure: module docstring)


def start(model: str, extra: list[str], tmp: Path, name: str, max_batch: int,
          max_queue: int | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [sys.executable, "-m", "moescope", "serve", "--model", model, "--port", str(port), "--max-batch",
            str(max_batch), "--log-level", "warning", *extra]
    if max_queue is not None:
        args += ["--max-queue", str(max_queue)]
    if "--traces" not in extra:
        args += ["--traces", str(tmp / f"{name}.sqlite"), "--metrics-port", "0"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{name}.log", "wb"))
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server at {url} did not start (exit {proc.poll()})") from None
            time.sleep(0.2)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all threads), or None off Linux."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(url: str, model: str, concurrency: int, n_requests: int, max_tokens: int, seed: int,
               pid: int | None = None) -> dict:
    """One closed-loop load: ``concurrency`` clients share ``n_requests`` streamed completions."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    ttft, gaps, tokens, errors = [], [], 0, 0
    queue = list(range(n_requests))

    async def worker() -> None:
        nonlocal tokens, errors
        while queue:
            i = queue.pop()
            t0 = time.perf_counter()
            last = None
            try:
                stream = await client.completions.create(
                    model=model, prompt=f"request {seed}-{i}: the quick brown fox", max_tokens=max_tokens,
                    temperature=0, stream=True, stream_options={"include_usage": True})
                async for chunk in stream:
                    now = time.perf_counter()
                    if chunk.choices:
                        if last is None:
                            ttft.append(now - t0)
                        else:
                            gaps.append(now - last)
                        last = now
                    if chunk.usage:
                        tokens += chunk.usage.completion_tokens
            except openai.OpenAIError:
                errors += 1

    cpu0 = cpu_s(pid) if pid else None
    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t
    cpu1 = cpu_s(pid) if pid else None
    await client.close()
    cpu_per_token = (cpu1 - cpu0) / tokens if cpu0 is not None and cpu1 is not None and tokens else None
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "requests": n_requests,
            "server_cpu_ms_per_token": None if cpu_per_token is None else cpu_per_token * 1e3,
            "errors": errors, "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "itl_p50_s": _pct(gaps, 50), "itl_p99_s": _pct(gaps, 99)}


def _medians(rs: list[dict], keys: tuple[str, ...]) -> dict:
    """Per key, the median over runs (keys some run lacks a figure for are left out)."""
    return {k: statistics.median(r[k] for r in rs) for k in keys if all(r[k] is not None for r in rs)}


def summarise(runs: dict, concurrency: list[int]) -> list[dict]:
    rows = []
    for c in concurrency:
        row = {"concurrency": c}
        for v in VARIANTS:
            rs = runs[(v, c)]
            row[v] = _medians(rs, ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                                   "server_cpu_ms_per_token"))
            row[v]["errors"] = sum(r["errors"] for r in rs)
            row[v]["requests"] = sum(r["requests"] for r in rs)
        pairs = list(enumerate(zip(runs[("capture_on", c)], runs[("capture_off", c)])))
        row["throughput_off_over_on"] = order_balanced(
            [(r, off["tokens_per_s"] / on["tokens_per_s"]) for r, (on, off) in pairs])
        row["server_cpu_per_token_on_over_off"] = order_balanced(
            [(r, on["server_cpu_ms_per_token"] / off["server_cpu_ms_per_token"]) for r, (on, off) in pairs
             if on["server_cpu_ms_per_token"] and off["server_cpu_ms_per_token"]])
        rows.append(row)
    return rows


def order_balanced(ratios: list[tuple[int, float]]) -> float | None:
    """The on/off ratio with the load order's effect cancelled: ``ratios`` are (round, ratio); even rounds ran capture
    on first, odd rounds off first (``_interleaved``). The geometric mean of the two orders' median ratios: a cost
    that comes with running first (or second) multiplies one order's ratios by f and the other's by 1/f, and cancels.
    A plain median over an odd number of rounds took the majority order's side: at deepseek-v3-shape, 8 clients, the
    per-round CPU ratios alternated 1.38 / 0.64 / 1.41 / 0.73 / 1.26 / 0.79 / 1.30 (median 1.26, balanced 0.99; the
    first load of a pair cost ~30% more CPU per token, whichever server ran it; serve.json at f288462). One order
    only (one round): its median."""
    groups = [[x for r, x in ratios if r % 2 == parity] for parity in (0, 1)]
    medians = [statistics.median(g) for g in groups if g]
    if not medians:
        return None
    return statistics.geometric_mean(medians)


def rss_mb(pid: int) -> float | None:
    """Resident set size of process ``pid`` in MB (Linux /proc), or None."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys on xs."""
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else None


async def soak_load(servers: dict, model: str, clients: int, seconds: float, warmup_s: float, max_tokens: int,
                    sample_s: float = 2.0) -> dict:
    """``clients`` closed-loop streaming clients per server for ``seconds``; the servers' RSS sampled every
    ``sample_s`` against the requests each has answered. Per server: RSS slope per 1,000 requests after
    ``warmup_s`` (least squares over the samples), growth from the first sample after warm-up to the last."""
    import openai

    stop = time.monotonic() + seconds
    done = {v: 0 for v in servers}
    errors = {v: 0 for v in servers}
    rejected = {v: 0 for v in servers}  # 429 queue_full: documented back-pressure, not an error
    answered: dict[str, list[str]] = {v: [] for v in servers}  # ids, to look up in the trace store after
    samples: dict[str, list[tuple[float, int, float]]] = {v: [] for v in servers}

    async def client(v: str, url: str, k: int) -> None:
        sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        i = 0
        while time.monotonic() < stop:
            i += 1
            try:
                stream = await sdk.completions.create(model=model, prompt=f"soak {k}-{i}: the quick brown fox",
                                                      max_tokens=max_tokens, temperature=0, stream=True)
                rid = None
                async for chunk in stream:
                    rid = chunk.id
                done[v] += 1
                answered[v].append(rid)
            except openai.RateLimitError:
                rejected[v] += 1
                await asyncio.sleep(0.05)
            except openai.OpenAIError:
                errors[v] += 1
        await sdk.close()

    async def sampler() -> None:
        t0 = time.monotonic()
        while time.monotonic() < stop:
            for v, (proc, _) in servers.items():
                rss = rss_mb(proc.pid)
                if rss is not None:
                    samples[v].append((time.monotonic() - t0, done[v], rss))
            await asyncio.sleep(sample_s)

    await asyncio.gather(sampler(), *(client(v, url, k) for v, (_, url) in servers.items() for k in range(clients)))
    out = {}
    for v, rows in samples.items():
        after = [r for r in rows if r[0] >= warmup_s]
        slope = _slope([r[1] for r in after], [r[2] for r in after])
        out[v] = {"requests": done[v], "errors": errors[v], "rejected_429": rejected[v], "answered_ids": answered[v],
                  "requests_after_warmup": after[-1][1] - after[0][1]
                  if after else 0, "rss_mb_start": rows[0][2] if rows else None,
                  "rss_mb_after_warmup": after[0][2] if after else None, "rss_mb_end": rows[-1][2] if rows else None,
                  "growth_after_warmup_pct": (after[-1][2] / after[0][2] - 1) * 100 if after else None,
                  "rss_kb_per_1000_requests": None if slope is None else slope * 1024 * 1000,
                  "samples": [[round(t, 1), n, round(m, 2)] for t, n, m in rows]}
    return out


def soak(args) -> int:
    """``--soak SECONDS``: both servers (capture on and off) side by side, each under ``--soak-clients``
    streaming clients; reports the RSS slope per 1,000 requests after ``--soak-warmup`` seconds."""
    out = args.out
    max_tokens = args.max_tokens or 32
    with tempfile.TemporaryDirectory(prefix="moescope-bench-soak-") as tmp:
        servers = {v: start(args.model, extra, Path(tmp), v, args.max_batch) for v, extra in VARIANTS.items()
                   if v in args.soak_variants}
        try:
            for proc, url in servers.values():
                wait_ready(proc, url)
            res = asyncio.run(soak_load(servers, args.model, args.soak_clients, args.soak, args.soak_warmup,
                                        max_tokens))
        finally:
            for proc, _ in servers.values():
                proc.send_signal(signal.SIGTERM)
            for proc, _ in servers.values():
                proc.wait(60)
        # every answered request is in its server's trace store (read after the graceful shutdown's flush)
        for v, r in res.items():
            ids = r.pop("answered_ids")
            path = Path(tmp) / f"{v}.sqlite"
            if "--traces" in VARIANTS[v] or not path.exists():
                r["stored_of_answered"] = None
                continue
            con = sqlite3.connect(path)
            stored = {row[0] for row in con.execute("select request_id from requests")}
            con.close()
            r["stored_of_answered"] = sum(i in stored for i in ids)
            # The store's retention (256 MB by default) trims the oldest requests: those answered before the first
            # one still stored are that; any missing after it would be a loss (up to the clients' concurrency
            # may differ by arrival vs answer order).
            first = next((k for k, i in enumerate(ids) if i in stored), len(ids))
            r["answered_before_oldest_stored"] = first
            r["missing_after_oldest_stored"] = sum(i not in stored for i in ids[first:])
    print(f"\nsoak: moescope serve, {args.model}, {args.soak_clients} streaming clients per server, {args.soak:.0f} s "
          f"(warm-up {args.soak_warmup:.0f} s), {max_tokens} tokens per request")
    for v, r in res.items():
        slope, growth = r["rss_kb_per_1000_requests"], r["growth_after_warmup_pct"]
        print(f"{v:<11} {r['requests']:>7} requests ({r['stored_of_answered']} of them in the store; "
              f"{r.get('answered_before_oldest_stored')} older ones trimmed by retention, "
              f"{r.get('missing_after_oldest_stored')} missing after), {r['errors']} "
              f"errors, {r['rejected_429']} 429s; RSS {r['rss_mb_start']:.1f} -> "
              f"{r['rss_mb_after_warmup']:.1f} (warm) -> {r['rss_mb_end']:.1f} MB: "
              + (f"{slope:+.1f} KB per 1,000 requests, {growth:+.2f}% after warm-up" if slope is not None else "n/a"))
    import torch

    _results.save({"mode": "soak", "model": args.model, "max_batch": args.max_batch, "max_tokens": max_tokens,
          "clients_per_server": args.soak_clients, "seconds": args.soak, "warmup_s": args.soak_warmup,
          "cpus": os.cpu_count(), "torch": torch.__version__, "results": res}, out)
    return 0


async def open_load(url: str, model: str, rate: float, duration_s: float, max_tokens: int, seed: int,
                    pid: int | None = None) -> dict:
    """One open-loop load: Poisson arrivals at ``rate`` requests/s for ``duration_s``, each a streamed
    completion sent at its arrival time whatever is still running; then waits for every answer."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    rng = random.Random(seed)
    ttft, tokens, answered, rejected, errors = [], 0, 0, 0, 0

    async def one(i: int) -> None:
        nonlocal tokens, answered, rejected, errors
        t0 = time.perf_counter()
        first = True
        try:
            stream = await client.completions.create(
                model=model, prompt=f"open {seed}-{i}: the quick brown fox", max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.choices and first:
                    ttft.append(time.perf_counter() - t0)
                    first = False
                if chunk.usage:
                    tokens += chunk.usage.completion_tokens
            answered += 1
        except openai.RateLimitError:
            rejected += 1
        except openai.OpenAIError:
            errors += 1

    cpu0 = cpu_s(pid) if pid else None
    start_t = time.perf_counter()
    tasks, at, i = [], 0.0, 0
    while True:
        at += rng.expovariate(rate)
        if at > duration_s:
            break
        await asyncio.sleep(max(0.0, start_t + at - time.perf_counter()))
        tasks.append(asyncio.ensure_future(one(i)))
        i += 1
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start_t
    cpu1 = cpu_s(pid) if pid else None
    await client.close()
    return {"rate": rate, "sent": len(tasks), "answered": answered, "rejected_429": rejected, "errors": errors,
            "wall_s": wall, "tokens": tokens, "goodput_tokens_per_s": tokens / wall,
            "server_cpu_ms_per_token": (cpu1 - cpu0) / tokens * 1e3 if cpu0 is not None and cpu1 is not None
            and tokens else None, "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99)}


def summarise_open(runs: dict, multiples: list[float]) -> list[dict]:
    rows = []
    for m in multiples:
        row = {"multiple": m}
        for v in VARIANTS:
            rs = runs[(v, m)]
            row[v] = _medians(rs, ("rate", "goodput_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
                                   "server_cpu_ms_per_token"))
            for k in ("sent", "answered", "rejected_429", "errors"):
                row[v][k] = sum(r[k] for r in rs)
        rows.append(row)
    return rows


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def markdown(report: dict) -> str:
    """The docs' tables, every figure from the results file."""
    lines = []
    for r in report["models"].values():
        lines += [f"**{r['model']}**, max batch {r['max_batch']}, {r['max_tokens']} tokens per request, streamed, "
                  f"greedy; {report['cpus']} CPUs shared by clients and servers; torch {report['torch']}.", "",
                  f"Closed loop (medians of {r['rounds']} interleaved rounds, the ratios order-balanced: the geometric "
                  "mean of the median ratio of the rounds that ran capture on first and of those that ran it second; "
                  f"requests per load "
                  f"{', '.join(f'{c}: {n}' for c, n in r['requests_per_load'].items())}):", "",
                  "| clients | capture | tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | server CPU ms/token "
                  "| errors | off/on throughput | on/off CPU per token |", "|---|---|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            cpu = row["server_cpu_per_token_on_over_off"]
            for i, v in enumerate(VARIANTS):
                s = row[v]
                ratios = (f"{row['throughput_off_over_on']:.2f} | {'-' if cpu is None else f'{cpu:.2f}'}" if i == 0
                          else " | ")
                lines.append(f"| {row['concurrency'] if i == 0 else ''} | {v.split('_')[1]} | "
                             f"{s['tokens_per_s']:.1f} | {_ms(s.get('ttft_p50_s'))} / {_ms(s.get('ttft_p99_s'))} | "
                             f"{_ms(s.get('itl_p50_s'))} / {_ms(s.get('itl_p99_s'))} | "
                             f"{s.get('server_cpu_ms_per_token', float('nan')):.2f} | {s['errors']} | {ratios} |")
        said = []
        for row in r["rows"]:
            c, x = row["concurrency"], row["server_cpu_per_token_on_over_off"]
            if x is None:
                continue
            per_round = _per_round_cpu(r, c)
            # capture adds work and saves none: a ratio under 1 says the two server processes differed by more than
            # capture's cost (their batching, the machine), never that capture made one cheaper
            note = " (under 1: the two servers differed by more than capture's cost, not a saving)" if x < 1 else ""
            said.append(f"{c} client{'' if str(c) == '1' else 's'} {x:.3f}x{note}: "
                        f"{verdict(per_round, GOAL, why='this file keeps no per-round runs', instances=True)}")
        lines += ["", f"Capture's cost against the goal of <= {GOAL}x server CPU per token, capture on / off (the "
                  "capture is metrics + every request's trace, serve's default; the order-balanced ratio, then the "
                  "verdict of benchmarks/_verdict.py on the per-round ratios: met only where their upper quartile "
                  "is within the goal, and never where the rounds put capture on under off by more than the goal: "
                  f"two servers that differ by that much cannot resolve it): {'; '.join(said)}."]
        o = r.get("open")
        if o:
            lines += ["", f"Open loop (Poisson arrivals for {o['duration_s']:g} s at multiples of the saturation rate "
                      f"{o['saturation_rps']:.2f} requests/s; --max-queue {o['max_queue']}; sums over "
                      f"{o['rounds']} round(s), medians of the rest):", "",
                      "| load | capture | offered req/s | sent | answered | 429 | other errors | goodput tokens/s "
                      "| TTFT p50 / p99 ms | server CPU ms/token |", "|---|---|---|---|---|---|---|---|---|---|"]
            for row in o["rows"]:
                for i, v in enumerate(VARIANTS):
                    s = row[v]
                    cpu, load_cell = s.get("server_cpu_ms_per_token"), f"{row['multiple']:g}x" if i == 0 else ""
                    lines.append(f"| {load_cell} | {v.split('_')[1]} | "
                                 f"{s['rate']:.2f} | {s['sent']} | {s['answered']} | {s['rejected_429']} | "
                                 f"{s['errors']} | {s['goodput_tokens_per_s']:.1f} | {_ms(s.get('ttft_p50_s'))} / "
                                 f"{_ms(s.get('ttft_p99_s'))} | {'-' if cpu is None else f'{cpu:.2f}'} |")
        lines.append("")
    return "\n".join(lines)


def _per_round_cpu(r: dict, c) -> list[float] | None:
    """The per-round server CPU per token ratios on / off at ``c`` clients, from the file's raw runs (None: none)."""
    on, off = (r.get("runs", {}).get(f"{v}/{c}") for v in VARIANTS)
    if not on or not off:
        return None
    return [a["server_cpu_ms_per_token"] / b["server_cpu_ms_per_token"] for a, b in zip(on, off)
            if a.get("server_cpu_ms_per_token") and b.get("server_cpu_ms_per_token")]


def _interleaved(servers: dict, rounds: int, points: list, run_one, what: str) -> dict:
    """``run_one(round, point, variant, proc, url)`` for every round, point and server, the servers' order
    alternating between rounds; {(variant, point): [results per round]}. ``what``: the progress line's words."""
    runs: dict = {(v, p): [] for v in VARIANTS for p in points}
    for r in _results.track(range(rounds), f"serve: {what}, capture on and off, interleaved rounds"):
        order = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
        for p in points:
            for v in order:
                runs[(v, p)].append(run_one(r, p, v, *servers[v]))
    return runs


def bench_model(model: str, args, tmp: Path) -> dict:
    """Closed loop at each concurrency, then open loop at multiples of the saturation rate, on one pair of servers
    (capture on, off) of ``model``."""
    quick = args.quick
    rounds = args.rounds or (1 if quick else 5 if model == "tiny-demo" else 3)
    concurrency = args.concurrency or ([1, 8] if quick else [1, 8, 32])
    max_tokens = args.max_tokens or (4 if quick else 32 if model == "tiny-demo" else 8)
    # at least 8 requests a load (at deepseek-v3-shape, 1 client: 64 tokens; 4 requests gave per-round CPU-per-token
    # ratios from 0.83 to 1.24 over 7 rounds, median 1.05: serve.json at 81fecfc)
    per_load = {c: (max(4, c) if quick else max(8, 2 * c) if model == "tiny-demo" else max(8, c)) for c in concurrency}
    servers = {v: start(model, extra, tmp, f"{model}-{v}", args.max_batch, args.max_queue)
               for v, extra in VARIANTS.items()}
    try:
        for proc, url in servers.values():
            wait_ready(proc, url)
        for _, (_, url) in servers.items():  # warm-up: first forwards, connection pools
            asyncio.run(load(url, model, 2, 4, max_tokens, seed=-1))
        def closed(r, c, v, proc, url):
            res = asyncio.run(load(url, model, c, per_load[c], max_tokens, seed=r, pid=proc.pid))
            print(f"{model} round {r} c={c:<3} {v:<11} {res['tokens_per_s']:8.1f} tok/s  ttft p50 "
                          f"{(res['ttft_p50_s'] or 0) * 1e3:7.1f} ms  server cpu "
                  f"{res['server_cpu_ms_per_token'] or 0:.2f} ms/token  errors {res['errors']}", flush=True)
            return res

        runs = _interleaved(servers, rounds, concurrency, closed, f"{model} closed loop")
        rows = summarise(runs, concurrency)
        saturation = max(row["capture_off"]["tokens_per_s"] for row in rows) / max_tokens  # requests/s
        multiples = args.open_load or ([2.0] if quick else [0.5, 1.0, 2.0])
        open_rounds = args.open_rounds or (1 if quick else 2)
        open_s = args.open_s or (3.0 if quick else 15.0 if model == "tiny-demo" else 20.0)
        def opened(r, m, v, proc, url):
            res = asyncio.run(open_load(url, model, m * saturation, open_s, max_tokens, seed=r, pid=proc.pid))
            print(f"{model} open round {r} {m:g}x ({res['rate']:.2f} req/s) {v:<11} sent {res['sent']} "
                  f"answered {res['answered']} 429 {res['rejected_429']} errors {res['errors']} goodput "
                  f"{res['goodput_tokens_per_s']:.1f} tok/s", flush=True)
            return res

        oruns = _interleaved(servers, open_rounds, multiples, opened, f"{model} open loop")
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            proc.wait(120)
    return {"model": model, "max_batch": args.max_batch, "max_tokens": max_tokens, "rounds": rounds,
            "requests_per_load": per_load, "rows": rows, "runs": {f"{v}/{c}": rs for (v, c), rs in runs.items()},
            "open": {"saturation_rps": saturation, "duration_s": open_s, "rounds": open_rounds,
                     "max_queue": args.max_queue, "rows": summarise_open(oruns, multiples),
                     "runs": {f"{v}/{m:g}": rs for (v, m), rs in oruns.items()}}}


def main(argv: list[str] | None = None) -> int:
    ap = _results.parser(__doc__, quick="tiny-demo, one small round at 1 and 8 clients and 3 s open loop at 2x (CI: "
                         "the script runs)")
    ap.add_argument("--models", nargs="+", default=None, help="[tiny-demo deepseek-v3-shape; --quick: tiny-demo]")
    ap.add_argument("--rounds", type=int, default=None, help="closed-loop rounds [tiny-demo 5, else 3; --quick: 1]")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="[1 8 32; --quick: 1 8]")
    ap.add_argument("--max-tokens", type=int, default=None, help="per request [tiny-demo 32, else 8; --quick: 4]")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-queue", type=int, default=64,
                    help="the servers' admission bound (429 beyond it; >= the most clients: no closed-loop 429s)")
    ap.add_argument("--open-load", type=float, nargs="+", default=None,
                    help="open-loop rates as multiples of saturation [0.5 1 2; --quick: 2]")
    ap.add_argument("--open-s", type=float, default=None, help="open-loop seconds [tiny-demo 15, else 20; --quick 3]")
    ap.add_argument("--open-rounds", type=int, default=None, help="[2; --quick: 1]")
    ap.add_argument("--markdown", metavar="RESULTS", type=Path, default=None,
                    help="print the docs' tables from a results file and exit")
    ap.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                    help="soak mode: RSS slope per 1,000 requests under --soak-clients streaming clients "
                         "[results/serve-soak.json]")
    ap.add_argument("--soak-clients", type=int, default=8, help="[8]")
    ap.add_argument("--soak-variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                    help="which servers the soak runs [both]")
    ap.add_argument("--soak-warmup", type=float, default=60.0, help="seconds before the slope is fitted [60]")
    args = _results.parse(ap, argv, lambda a: "serve-soak" if a.soak else "serve")
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())), end="")
        return 0
    if args.soak:
        args.model = (args.models or ["tiny-demo"])[0]
        return soak(args)
    models = args.models or (["tiny-demo"] if args.quick else ["tiny-demo", "deepseek-v3-shape"])
    out = args.out
    import torch

    report = {"cpus": os.cpu_count(), "torch": torch.__version__, "models": {},
              "note": "shared 2-core machine: clients and servers share the CPUs; ratios matter more than absolutes"}
    with tempfile.TemporaryDirectory(prefix="moescope-bench-serve-") as tmp:
        for model in models:
            report["models"][model] = bench_model(model, args, Path(tmp))
    print()
    print(markdown(report), end="")
    _results.save(report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
