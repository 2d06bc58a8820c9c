"""Real servers for integration tests: Prometheus (Debian package), started on loopback in a temp dir.

In CI (CI=true) a missing binary fails the test; elsewhere it skips with the install command.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import in_ci
from helpers import wait_until
from moescope import prom_http


def require(binary: str, package: str) -> str:
    path = shutil.which(binary)
    if path is None:
        msg = f"{binary} not installed (apt-get install {package}; `make system-deps`)"
        if in_ci():
            pytest.fail(msg)
        pytest.skip(msg)
    return path


# Ports handed to servers that bind them later (a demo binds seconds after, once torch is imported). They come
# from below the kernel's ephemeral range (32768-60999 by default): a port there, even one free now, can meanwhile
# become the source port of some outgoing connection (a scrape, a poll) or a gloo pair's listener, and the
# server then fails with "Address already in use" (seen in CI, 4 scenarios at a time). Never the same port twice
# in one test run.
# Under pytest-xdist each worker draws from its own block of the range, so two workers never hand out the same port.
# MOESCOPE_TEST_PORTS=LOW:HIGH: the range of a pytest run beside another (.ci/pytest's lane beside the serial phase).
_LOW, _HIGH = (int(x) for x in os.environ.get("MOESCOPE_TEST_PORTS", "20000:32000").split(":"))
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_SPAN = (_HIGH - _LOW) // _WORKERS
_BLOCK = _LOW + int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0) * _SPAN
_PORTS = itertools.count(_BLOCK + (os.getpid() * 97) % (_SPAN // 2))
_PORTS_LOCK = threading.Lock()


def free_port(count: int = 1) -> int:
    """A port ``p`` such that ``p .. p + count - 1`` are free now and handed out to no one else in this run."""
    with _PORTS_LOCK:
        while True:
            base = next(_PORTS)
            if base + count > _BLOCK + _SPAN:
                raise RuntimeError("tests ran out of ports below the ephemeral range")
            if all(_bindable(p) for p in range(base, base + count)):
                for _ in range(count - 1):
                    next(_PORTS)
                return base


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_http(url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Until ``url`` answers. With ``proc`` (the server's process): gives up at once when it has exited, so the
    timeout can be generous (a server starting beside two vLLM servers on two cores took 18 s to be ready and
    then left 2 s requests unanswered for 12 s more)."""
    wait_until(lambda: prom_http.get(url, "a server", timeout=5) is not None, timeout=timeout, what=f"GET {url}",
               interval=0.2, ignore=(prom_http.Unreachable, OSError),
               alive=None if proc is None else (lambda: proc.poll() is None))


class _Server:
    """A server process started by a test: ``proc`` and its ``log`` file."""

    proc: subprocess.Popen
    log: object

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Prometheus(_Server):
    """A Prometheus scraping ``targets`` every second (and evaluating ``rule_files`` every second)."""

    def __init__(self, tmp: Path, targets: list[str], *, rule_files: list[str] = (),
                 alertmanager: str | None = None, extra_args: list[str] = (), scrape_interval: str = "1s",
                 metric_relabel: list[dict] = ()) -> None:
        self.binary = require("prometheus", "prometheus")
        self.tmp, self.port = tmp, free_port()
        # (the scrape timeout defaults to the interval: a longer interval is a longer timeout)
        cfg = {"global": {"scrape_interval": scrape_interval, "evaluation_interval": "1s"},
               "scrape_configs": [{"job_name": "moescope", "static_configs": [{"targets": targets}],
                                   "metric_relabel_configs": list(metric_relabel)}],
               "rule_files": [str(Path(r).resolve()) for r in rule_files]}
        if alertmanager:
            cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
        (tmp / "prometheus.yml").write_text(json.dumps(cfg))  # JSON is YAML
        self.log = open(tmp / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", f"--web.external-url=http://127.0.0.1:{self.port}/",
             "--enable-feature=exemplar-storage", *extra_args],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait_http(self.url + "/-/ready", timeout=180, proc=self.proc)
        except AssertionError:  # wait_http gave up (it fails with the last error seen)
            self.stop()
            raise RuntimeError("prometheus did not become ready: "
                               + (tmp / "prometheus.log").read_text()[-3000:]) from None

    def wait_scraping(self, n_targets: int, timeout: float = 30) -> None:
        """Until every target has been scraped once (``up`` written, 0 or 1). Prometheus syncs a new scrape
        target some seconds after it is ready (its scrape manager reloads at most every 5 s): an exporter that
        lives only a few seconds after Prometheus starts can end before its first scrape (seen on a fast machine:
        a 4 s linger, nothing scraped)."""
        wait_until(lambda: self.scalar("count(up)"), until=lambda n: n is not None and n >= n_targets,
                   timeout=timeout, what=f"Prometheus scraping its {n_targets} target(s)", interval=0.5)

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        """The result vector (moescope's one Prometheus client: a refused query raises, naming it)."""
        return prom_http.query(self.url, promql, timeout=10, at=at)

    def scalar(self, promql: str, at: float | None = None) -> float | None:
        result = self.query(promql, at)
        return float(result[0]["value"][1]) if result else None



class Webhook:
    """An Alertmanager webhook receiver on loopback: keeps every (path, payload) it gets."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.received: list[tuple[str, dict]] = []
        self.arrived: list[float] = []  # time.monotonic() of each delivery
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.arrived.append(time.monotonic())
                outer.received.append((self.path, json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self) -> list[tuple[str, dict]]:
        """(receiver path, alert) for every alert delivered so far."""
        return [(path, a) for path, payload in self.received for a in payload.get("alerts", [])]

    def timeline(self) -> list[tuple[float, dict]]:
        """(time.monotonic() of its delivery, alert) for every alert delivered so far."""
        return [(t, a) for (_, payload), t in zip(list(self.received), list(self.arrived))
                for a in payload.get("alerts", [])]

    def first_arrival(self, alertname: str) -> float | None:
        """time.monotonic() when ``alertname`` first arrived firing, or None."""
        for (_, payload), t in zip(list(self.received), list(self.arrived)):
            if any(a["labels"]["alertname"] == alertname and a["status"] == "firing" for a in payload["alerts"]):
                return t
        return None

    def stop(self) -> None:
        self.server.shutdown()


class Alertmanager(_Server):
    """Alertmanager (Debian package) with the repo's routing, its webhooks pointed at ``webhook``."""

    def __init__(self, tmp: Path, config: Path, webhook_port: int) -> None:
        import yaml

        self.binary = require("prometheus-alertmanager", "prometheus-alertmanager")  # Debian names it so
        cfg = yaml.safe_load(config.read_text())
        for r in cfg["receivers"]:
            for w in r.get("webhook_configs", []):
                w["url"] = w["url"].replace("127.0.0.1:9099", f"127.0.0.1:{webhook_port}")
        cfg["route"].update(group_wait="1s", group_interval="2s")  # test timings; the routing tree is the repo's
        for sub in cfg["route"].get("routes", []):
            sub.pop("group_wait", None)
        (tmp / "alertmanager.yml").write_text(yaml.safe_dump(cfg))
        self.port = free_port()
        self.log = open(tmp / "alertmanager.log", "wb")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={tmp / 'alertmanager.yml'}", f"--storage.path={tmp / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address="],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.address = f"127.0.0.1:{self.port}"
        try:
            wait_http(f"http://{self.address}/-/ready", timeout=180, proc=self.proc)
        except AssertionError:  # wait_http gave up (it fails with the last error seen)
            self.stop()
            raise RuntimeError("alertmanager did not start: "
                               + (tmp / "alertmanager.log").read_text()[-3000:]) from None

