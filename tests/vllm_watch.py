"""Each fault checkpoint served once per test session under the whole alerting path, and shared by the tests that
read what it left: tests/test_vllm_alerts.py (the alerts delivered, `top --once` and `diagnose --prometheus`
while it served) and tests/test_vllm_diagnose.py (the trace store it wrote). A vLLM server start is most of a
vLLM test's time on two cores; before, the diagnose tests served the healthy and hot checkpoints a second time.

A watch: a real vLLM server of the checkpoint with the plugin, under broad traffic (``Traffic``) -> a real Prometheus
evaluating moescope's generated rules (every `for` 30-fold shorter) -> a real Alertmanager (the repo's routing) ->
a webhook; until ``until(firing names)`` or ``watch_s``. tests/conftest.py's session fixture ``vllm_watched`` runs
each at most once (``vllm_watched("hot")``); the tests that share one are in one pytest-xdist group (`make
test-vllm` runs ``--dist loadgroup``), so a watch is never run twice in one pass.

Qwen3-MoE with 16 experts at top-2 here: a hot expert can exceed 4x its fair share only where E/k > 4
(thresholds.hot_factor; at 8 experts top-2 an expert's share is capped at 4x and collapse is the alert for it).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from conftest import ROOT
from helpers import run_cli, stored_ids
from moescope.alerts import rules
from moescope.traces import store
from servers import Alertmanager, Prometheus, Webhook, free_port, wait_http
from test_vllm import PROMPTS, _checkpoint
from vllm_ep_views import ep_views
from vllm_server import serve

HOT = (2, 5, 4.0)  # (layer, expert, the gate-row scale of vllm_models.build)
COLLAPSE_LAYER = 2
# vllm_models.build's tilt: every layer's loads a ramp (held-out max/mean ~3.3 here against the calibrated
# checkpoint's 1.3-1.9: experts at 3-4x their fair share, as trained models show)
UNEVEN = 1.0
WINDOW_S = 20  # the exporter's routing window (MOESCOPE_WINDOW_S): tens of requests a window at this rate
WARMUP_S = WINDOW_S  # a first window full of traffic before Prometheus scrapes (as production's `for` would)
ROUTING_ALERTS = {"MoEExpertHot", "MoEExpertCollapse", "MoEExpertLoadImbalance", "MoEDeadExperts",
                  "MoERoutingDrift", "MoERoutingFlips", "MoERouterNonFiniteLogits", "MoETokensDropped",
                  "MoEActivationRatioLow"}
N_JUDGED = 64  # requests of diagnose traffic in the healthy store: a routing window's "tens of requests"
N_SAMPLED = 20  # requests at the default sample rate whose ids are checked

# Requests a second the traffic thread sends (one at a time, each started on its own schedule). Flat out, one client
# sent ~6.7 a second (measured beside another alert test) and kept the server busy for the whole watch, starving the
# test beside it in the pass. A window of WINDOW_S holds ~RATE x WINDOW_S = 80 requests (~2,000 output tokens) at
# this rate, the "tens of requests a window" the rules judge. Measured, the three tests at -n 2: 280 s flat out,
# 265 s paced; the hot expert paged 26 s into the watch (51 s flat out).
RATE = 4.0

# Each checkpoint: (architecture, build faults) for vllm_models.build.
BUILDS = {"healthy": ("qwen3_moe", {"experts": 16}), "hot": ("qwen3_moe", {"experts": 16, "hot": HOT}),
          "uneven": ("qwen3_moe", {"experts": 16, "uneven": UNEVEN}),
          "collapse": ("deepseek_v3", {"collapse_layer": COLLAPSE_LAYER})}


class Traffic:
    """Broad traffic in a background thread: every prompt, sampled, at up to ``RATE`` requests a second, until
    stopped."""

    def __init__(self, server) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60)
        self.model, self.done, self.sent = server.name, threading.Event(), 0
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i, start = 0, time.monotonic()
        while not self.done.is_set():
            if self.done.wait(max(0.0, start + i / RATE - time.monotonic())):
                break
            try:
                self.client.completions.create(model=self.model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=24,
                                               temperature=1.0, seed=i)
                self.sent += 1
            except Exception as e:  # noqa: BLE001 (kept and asserted on: the server must answer every one)
                self.errors.append(repr(e))
            i += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(timeout=60)


def keep_traffic(server, tag: str, n: int) -> list[str]:
    """``n`` completions with keep ids (``moescope-keep-``: kept at any sample rate), 4 at a time; their response
    ids."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=300, max_retries=0)

    def one(i: int) -> str:
        r = client.completions.create(model=server.name, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=24,
                                      temperature=1.0, seed=i,
                                      extra_headers={"X-Request-Id": f"{store.KEEP_PREFIX}{tag}-{i}"})
        return r.id

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(n)))


def sampled_traffic(server, n: int) -> list[str]:
    """``n`` requests without an id of the client's: completions and chats, streamed and not; their ids."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=300, max_retries=0)
    ids = []
    for i in range(n):
        prompt, kw = PROMPTS[i % len(PROMPTS)], {"max_tokens": 8, "temperature": 1.0, "seed": 100 + i}
        chat, stream = i % 2 == 1, i % 4 >= 2
        if chat:
            messages = [{"role": "user", "content": prompt}]
            if stream:
                ids.append([c.id for c in client.chat.completions.create(model=server.name, messages=messages,
                                                                          stream=True, **kw)][0])
            else:
                ids.append(client.chat.completions.create(model=server.name, messages=messages, **kw).id)
        elif stream:
            chunks = list(client.completions.create(model=server.name, prompt=prompt, stream=True, **kw))
            ids.append(chunks[0].id)
        else:
            ids.append(client.completions.create(model=server.name, prompt=prompt, **kw).id)
    return ids


table = stored_ids  # the request ids of one of a trace store's tables (tests/helpers.py)


def firing(hook) -> set[str]:
    return {a["labels"]["alertname"] for _, a in hook.alerts() if a["status"] == "firing"}


@dataclass
class Watched:
    """What one watch left: the alerts delivered while vLLM served ((path, alert) pairs), what ``during``
    returned, the trace store (None: none written), and the diagnose traffic's ids (keep ids, sampled ids)."""
    alerts: list
    during: Any = None
    store: Path | None = None
    keep: list[str] = field(default_factory=list)
    sampled: list[str] = field(default_factory=list)
    ep: Any = None  # [eplb] the step-level prediction's views while it served (tests/vllm_ep_views.py)


def _views(prom, port, path) -> tuple:
    """`top --once` on the exporter and `diagnose --prometheus` (with the store) while vLLM serves."""
    top = run_cli("top", f"127.0.0.1:{port}", "--once", timeout=60)
    diag = run_cli("diagnose", "--prometheus", prom.url, "--json", "--traces", str(path), timeout=120)
    return top, diag


def _diagnose_traffic(server, path) -> tuple[list[str], list[str]]:
    """The healthy store's diagnose traffic, beside the broad traffic: keep ids, then requests at the default
    sample rate; waits (bounded) until the writer stored or sampled out every one, read while vLLM serves as a user
    does (vLLM's default shutdown kills the worker before the writer's last interval: tests/test_vllm_diagnose.py)."""
    keep = keep_traffic(server, "healthy", N_JUDGED)
    sampled = sampled_traffic(server, N_SAMPLED)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not set(keep + sampled) <= (table(path, "requests")
                                                                     | table(path, "sampled_out")):
        time.sleep(1)
    return keep, sampled


def _never(firing_names: set[str]) -> bool:
    return False


# name -> (until(firing names), watch_s, trace sample (None: no store; "": the default 0.1), hot reference (None:
# the default), whether the diagnose traffic runs beside the broad traffic, whether the views run at the end)
SPECS: dict[str, tuple[Callable[[set[str]], bool], float, str | None, str | None, bool, bool]] = {
    # healthy: nothing but the Watchdog in 45 s; its store (default sample rate) for the diagnose tests
    "healthy": (_never, 45, "", None, True, False),
    # the hot expert is in the checkpoint from the first token: judged against the fair share (the default learns
    # its reference from the first window, and a page then means a change: tests/test_learned.py)
    "hot": (lambda f: "MoEExpertHot" in f, 90, "1", "fair", False, True),
    "uneven": (_never, 45, None, None, False, False),
    "collapse": (lambda f: "MoEExpertCollapse" in f, 90, None, None, False, False),
}


def watch(name: str, tmp_path_factory) -> Watched:
    """Serve ``name``'s checkpoint (``BUILDS``) under ``SPECS[name]`` and return what it left."""
    until, watch_s, sample, hot_reference, diagnose_traffic, views = SPECS[name]
    arch, build = BUILDS[name]
    model_dir = _checkpoint(tmp_path_factory, arch, **build)
    tmp = tmp_path_factory.mktemp(f"watch-{name}")
    rule_file = tmp / "rules.yml"
    rule_file.write_text(yaml.safe_dump(rules.rules_document(rules.Thresholds(for_scale=1 / 30)), sort_keys=False))
    hook = Webhook()
    am = Alertmanager(tmp, ROOT / "collectors" / "alertmanager" / "alertmanager.yml", hook.port)
    port = free_port()
    env = {"MOESCOPE_METRICS_PORT": str(port), "MOESCOPE_WINDOW_S": str(WINDOW_S)}
    path = tmp / "traces.sqlite" if sample is not None else None
    if path is not None:
        env["MOESCOPE_TRACES"] = str(path)
        if sample:
            env["MOESCOPE_TRACE_SAMPLE"] = sample
    if hot_reference is not None:
        env["MOESCOPE_HOT_REFERENCE"] = hot_reference
    out = Watched(alerts=[], store=path)
    prom = None
    server = serve(model_dir, env, ["--no-enable-prefix-caching"], eager=True)
    server.timeout = 900  # a start beside other servers on a shared 2-core machine took over 240 s
    try:
        with server, Traffic(server) as traffic:
            wait_http(f"http://127.0.0.1:{port}/metrics", timeout=120, proc=server.proc)
            with ThreadPoolExecutor(1) as side:  # the diagnose traffic, from the warm-up on, beside the broad one
                pending = side.submit(_diagnose_traffic, server, path) if diagnose_traffic else None
                time.sleep(WARMUP_S)
                prom = Prometheus(tmp, [f"127.0.0.1:{port}"], rule_files=[str(rule_file)], alertmanager=am.address,
                                  extra_args=["--rules.alert.resend-delay=2s"])
                deadline = time.monotonic() + watch_s
                while time.monotonic() < deadline and not until(firing(hook)):
                    time.sleep(1)
                out.during = _views(prom, port, path) if views else None
                out.ep = ep_views(prom, port, path) if views else None  # [eplb]: read by tests/test_vllm_ep.py
                if pending is not None:
                    out.keep, out.sampled = pending.result()
            # What was delivered while vLLM served, and Prometheus stopped before vLLM is: a server shutting
            # down is an exporter that stops answering, which MoEExporterDown (1m / 30 = 2 s) pages within
            # seconds (a CI run delivered it between the watch's end and the server's exit).
            out.alerts = hook.alerts()
            prom.stop()
            prom = None
            assert not traffic.errors, traffic.errors[:3]
            assert traffic.sent > 0
        return out
    finally:
        if prom is not None:
            prom.stop()
        am.stop()
        hook.stop()
