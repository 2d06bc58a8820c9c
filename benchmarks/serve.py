"""``moescope serve`` under load: 1, 8 and 32 concurrent async OpenAI clients (the official SDK, streaming), with
capture on (the default: metrics exporter + trace store) and off (``--metrics-port -1 --traces none``).

Both servers run side by side; each round runs every (concurrency, capture) load once, the capture order
alternating between rounds, and the report takes medians over rounds. A load is closed-loop: ``c`` clients
each send their share of the requests one after another. Per load: output tokens/s (usage counts over the
load's wall time), TTFT (request sent -> first streamed chunk) and inter-token gaps (between chunks) at p50
and p99, errors, and the server process's CPU time per output token (Linux /proc; all its threads). The
capture overhead is given two ways, per round then median over rounds: the throughput ratio off / on, and the
server CPU per token ratio on / off. The second is the robust one on a shared machine: the clients run on the
same CPUs (the SDK's per-chunk parsing takes more CPU than the server), so throughput mostly measures them and
whatever else runs, while CPU per token counts only the server's own work.

    python benchmarks/serve.py [--quick] [--rounds 7] [--concurrency 1 8 32] [--model tiny-demo]

Soak mode (``--soak SECONDS``): both servers side by side, each under ``--soak-clients`` (8) closed-loop streaming
clients; the servers' RSS is sampled every 2 s against the requests each answered, and the report gives the RSS
slope per 1,000 requests after ``--soak-warmup`` (least squares) and the growth after warm-up
(``results/serve-soak.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _results import save

HERE = Path(__file__).resolve().parent
VARIANTS = {"capture_on": [], "capture_off": ["--metrics-port", "-1", "--traces", "none"]}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, extra: list[str], tmp: Path, name: str, max_batch: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    args = [sys.executable, "-m", "moescope", "serve", "--model", model, "--port", str(port), "--max-batch",
            str(max_batch), "--log-level", "warning", *extra]
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


def summarise(runs: dict, concurrency: list[int]) -> list[dict]:
    rows = []
    for c in concurrency:
        row = {"concurrency": c}
        for v in VARIANTS:
            rs = runs[(v, c)]
            row[v] = {k: statistics.median(r[k] for r in rs) for k in
                      ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                       "server_cpu_ms_per_token") if
                      all(r[k] is not None for r in rs)}
            row[v]["errors"] = sum(r["errors"] for r in rs)
            row[v]["requests"] = sum(r["requests"] for r in rs)
        ratios = [off["tokens_per_s"] / on["tokens_per_s"]
                  for on, off in zip(runs[("capture_on", c)], runs[("capture_off", c)])]
        row["throughput_off_over_on"] = statistics.median(ratios)
        cpu = [on["server_cpu_ms_per_token"] / off["server_cpu_ms_per_token"]
               for on, off in zip(runs[("capture_on", c)], runs[("capture_off", c)])
               if on["server_cpu_ms_per_token"] and off["server_cpu_ms_per_token"]]
        row["server_cpu_per_token_on_over_off"] = statistics.median(cpu) if cpu else None
        rows.append(row)
    return rows


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
    samples: dict[str, list[tuple[float, int, float]]] = {v: [] for v in servers}

    async def client(v: str, url: str, k: int) -> None:
        sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        i = 0
        while time.monotonic() < stop:
            i += 1
            try:
                stream = await sdk.completions.create(model=model, prompt=f"soak {k}-{i}: the quick brown fox",
                                                      max_tokens=max_tokens, temperature=0, stream=True)
                async for _ in stream:
                    pass
                done[v] += 1
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
        out[v] = {"requests": done[v], "errors": errors[v], "requests_after_warmup": after[-1][1] - after[0][1]
                  if after else 0, "rss_mb_start": rows[0][2] if rows else None,
                  "rss_mb_after_warmup": after[0][2] if after else None, "rss_mb_end": rows[-1][2] if rows else None,
                  "growth_after_warmup_pct": (after[-1][2] / after[0][2] - 1) * 100 if after else None,
                  "rss_kb_per_1000_requests": None if slope is None else slope * 1024 * 1000,
                  "samples": [[round(t, 1), n, round(m, 2)] for t, n, m in rows]}
    return out


def soak(args) -> int:
    """``--soak SECONDS``: both servers (capture on and off) side by side, each under ``--soak-clients``
    streaming clients; reports the RSS slope per 1,000 requests after ``--soak-warmup`` seconds."""
    out = args.out or HERE / "results" / "serve-soak.json"
    max_tokens = args.max_tokens or 32
    with tempfile.TemporaryDirectory(prefix="moescope-bench-soak-") as tmp:
        servers = {v: start(args.model, extra, Path(tmp), v, args.max_batch) for v, extra in VARIANTS.items()}
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
    print(f"\nsoak: moescope serve, {args.model}, {args.soak_clients} streaming clients per server, {args.soak:.0f} s "
          f"(warm-up {args.soak_warmup:.0f} s), {max_tokens} tokens per request")
    for v, r in res.items():
        slope, growth = r["rss_kb_per_1000_requests"], r["growth_after_warmup_pct"]
        print(f"{v:<11} {r['requests']:>7} requests, {r['errors']} errors; RSS {r['rss_mb_start']:.1f} -> "
              f"{r['rss_mb_after_warmup']:.1f} (warm) -> {r['rss_mb_end']:.1f} MB: "
              + (f"{slope:+.1f} KB per 1,000 requests, {growth:+.2f}% after warm-up" if slope is not None else "n/a"))
    import torch

    save({"mode": "soak", "model": args.model, "max_batch": args.max_batch, "max_tokens": max_tokens,
          "clients_per_server": args.soak_clients, "seconds": args.soak, "warmup_s": args.soak_warmup,
          "cpus": os.cpu_count(), "torch": torch.__version__, "results": res}, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one small round at 1 and 8 clients (CI: the script runs)")
    ap.add_argument("--rounds", type=int, default=None, help="[7; --quick: 1]")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="[1 8 32; --quick: 1 8]")
    ap.add_argument("--max-tokens", type=int, default=None, help="per request [32; --quick: 4]")
    ap.add_argument("--model", default="tiny-demo")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None,
                    help="[benchmarks/results/serve.json; --quick: serve-quick.json]")
    ap.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                    help="soak mode: RSS slope per 1,000 requests under --soak-clients streaming clients "
                         "[results/serve-soak.json]")
    ap.add_argument("--soak-clients", type=int, default=8, help="[8]")
    ap.add_argument("--soak-warmup", type=float, default=60.0, help="seconds before the slope is fitted [60]")
    args = ap.parse_args(argv)
    if args.soak:
        return soak(args)
    rounds = args.rounds or (1 if args.quick else 7)
    concurrency = args.concurrency or ([1, 8] if args.quick else [1, 8, 32])
    max_tokens = args.max_tokens or (4 if args.quick else 32)
    out = args.out or HERE / "results" / ("serve-quick.json" if args.quick else "serve.json")
    per_load = {c: (max(4, c) if args.quick else max(8, 2 * c)) for c in concurrency}

    with tempfile.TemporaryDirectory(prefix="moescope-bench-serve-") as tmp:
        servers = {v: start(args.model, extra, Path(tmp), v, args.max_batch) for v, extra in VARIANTS.items()}
        try:
            for proc, url in servers.values():
                wait_ready(proc, url)
            for _, (_, url) in servers.items():  # warm-up: first forwards, connection pools
                asyncio.run(load(url, args.model, 2, 4, max_tokens, seed=-1))
            runs: dict = {(v, c): [] for v in VARIANTS for c in concurrency}
            for r in range(rounds):
                order = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
                for c in concurrency:
                    for v in order:
                        proc, url = servers[v]
                        res = asyncio.run(load(url, args.model, c, per_load[c], max_tokens, seed=r, pid=proc.pid))
                        runs[(v, c)].append(res)
                        print(f"round {r} c={c:<3} {v:<11} {res['tokens_per_s']:8.1f} tok/s  ttft p50 "
                              f"{(res['ttft_p50_s'] or 0) * 1e3:7.1f} ms  server cpu "
                              f"{res['server_cpu_ms_per_token'] or 0:.2f} ms/token  errors {res['errors']}", flush=True)
        finally:
            for proc, _ in servers.values():
                proc.send_signal(signal.SIGTERM)
            for proc, _ in servers.values():
                proc.wait(60)
    rows = summarise(runs, concurrency)
    print(f"\nmoescope serve, {args.model}, max batch {args.max_batch}, {max_tokens} tokens per request, streamed; "
          f"medians of {rounds} interleaved round(s); {os.cpu_count()} CPUs (shared machine)")
    print(f"{'clients':>7} {'capture':>8} {'tok/s':>8} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} "
          f"{'cpu ms/tok':>10} {'errors':>6}")
    for row in rows:
        for v in VARIANTS:
            s = row[v]
            print(f"{row['concurrency']:>7} {v.split('_')[1]:>8} {s['tokens_per_s']:>8.1f} "
                  f"{s['ttft_p50_s'] * 1e3:>7.1f}ms {s['ttft_p99_s'] * 1e3:>6.1f}ms "
                  f"{s.get('itl_p50_s', 0) * 1e3:>6.1f}ms {s.get('itl_p99_s', 0) * 1e3:>6.1f}ms "
                  f"{s.get('server_cpu_ms_per_token', 0):>10.3f} {s['errors']:>6}")
        cpu = row["server_cpu_per_token_on_over_off"]
        print(f"{'':>7} throughput off/on: {row['throughput_off_over_on']:.3f}; server CPU per token on/off: "
              + (f"{cpu:.3f}" if cpu else "n/a"))
    import torch

    save({"model": args.model, "max_batch": args.max_batch, "max_tokens": max_tokens, "rounds": rounds,
          "requests_per_load": per_load, "cpus": os.cpu_count(), "torch": torch.__version__,
          "note": "shared 2-core machine: clients and server share the CPUs; ratios matter more than absolutes",
          "rows": rows, "runs": {f"{v}/{c}": rs for (v, c), rs in runs.items()}}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
